#!/usr/bin/env bash
# The suite with CPU-bound processes beside it, as on a busy machine: a test that passes only when the machine
# is quiet (a bound too tight, a sleep standing in for an event) fails here. Run it before pushing a change to
# the tests or to what they time.
#
#   tests/e2e/stress.sh                       # the whole suite (python -m pytest --full) beside one busy loop
#   HOGS=2 tests/e2e/stress.sh tests/e2e/test_lost_agents_e2e.py -n 0     # pytest's arguments: what to run
#   STRESS_CI=1 tests/e2e/stress.sh           # .ci/run itself (install, decoy, suite) beside the busy loop
#
# HOGS: how many busy loops (default 1; each takes a core). They are ended when the suite ends, however it ends.
set -euo pipefail
cd "$(dirname "$0")/../.."

hogs=()
end_hogs() {
  for pid in "${hogs[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${hogs[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap end_hogs EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

for _ in $(seq "${HOGS:-1}"); do
  python3 -c 'while True: pass' &
  hogs+=("$!")
done
echo "stress: ${#hogs[@]} busy loop(s) beside the suite (pids ${hogs[*]})"

started=$SECONDS
code=0
if [ -n "${STRESS_CI:-}" ]; then
  bash .ci/run || code=$?
elif [ $# -gt 0 ]; then
  python3 -m pytest "$@" || code=$?
else
  python3 -m pytest --full || code=$?
fi
echo "stress: exit $code after $((SECONDS - started)) s beside ${#hogs[@]} busy loop(s)"
exit "$code"
