#!/usr/bin/env bash
# One run of the orchestrator loop on a machine of its own: a Kubernetes Job's pod, a CI job.
#
# It starts what the loop needs beside it -- the agents' tmux server, the agent profiles, a cao-server on
# this machine -- then runs the loop in the foreground and exits with the loop's exit code, which tells
# the scheduler what to do (README: exit codes). The working directory (WD, with the state file under it)
# is the only thing that must outlive the machine: on a new machine the same command resumes the run, with
# new agents for the ones that are gone (REPLACE_LOST_AGENTS=1 is this script's default).
#
#   deploy/entrypoint.sh [config.json]
#
# Environment (besides the loop's own settings: WD, PROMPT_FILE, PROVIDER, ...):
#   CAO_PORT             the port cao-server listens on, on 127.0.0.1 (default 9889); API is set from it
#   PROFILES_DIR         the agent profiles installed where CAO has none yet (default: profiles/ beside this
#                        folder)
#   CAO_SERVER_LOG       where cao-server's output goes (default: /tmp/cao-server-$CAO_PORT.log)
#   CAO_START_SECONDS    how long cao-server may take to answer /health (default 60)
#   PYTHON               the Python that runs the loop in a checkout (default python3)
# SIGTERM (a pod deleted, a job cancelled) or SIGINT reaches the loop as SIGTERM: it saves its state, exits 143.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CAO_PORT="${CAO_PORT:-9889}"
export API="${API:-http://127.0.0.1:${CAO_PORT}}"
export REPLACE_LOST_AGENTS="${REPLACE_LOST_AGENTS:-1}"
PROFILES_DIR="${PROFILES_DIR:-${here}/../profiles}"
CAO_SERVER_LOG="${CAO_SERVER_LOG:-/tmp/cao-server-${CAO_PORT}.log}"
CAO_START_SECONDS="${CAO_START_SECONDS:-60}"
PYTHON="${PYTHON:-python3}"
EXIT_USAGE=2
EXIT_ERROR=3

say() { echo "entrypoint: $*" >&2; }

for tool in tmux cao cao-server "$PYTHON"; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    say "error: $tool is not on PATH: install it in the image (tmux; pip install cli-agent-orchestrator)"
    exit "$EXIT_USAGE"
  fi
done
if [ -f "${here}/../run_orchestrator_loop.py" ]; then
  loop=("$PYTHON" "${here}/../run_orchestrator_loop.py")        # a checkout: the loop beside this script
elif command -v cao-orchestrator-loop >/dev/null 2>&1; then
  loop=(cao-orchestrator-loop)
else
  say "error: cao-orchestrator-loop is not on PATH: pip install the project in the image"
  exit "$EXIT_USAGE"
fi

cao_server_pid=""
stop_helpers() {
  # The machine is the run's alone: its agents, its tmux server and its cao-server end with the run.
  [ -n "$cao_server_pid" ] && kill "$cao_server_pid" 2>/dev/null && wait "$cao_server_pid" 2>/dev/null
  tmux kill-server 2>/dev/null
  return 0
}

# 1. The agents' tmux server, started before cao-server: the agents' shells then get this environment as
#    it is (no login profile that resets PATH), and it stays up while it has no session.
if ! tmux start-server \; set-option -g exit-empty off \
     \; set-option -g default-command "exec bash --noprofile --norc" \
     \; set-environment -g PATH "$PATH"; then
  say "error: could not start a tmux server (TMUX_TMPDIR=${TMUX_TMPDIR:-/tmp})"
  exit "$EXIT_ERROR"
fi

# 2. The agent profiles, on a machine whose CAO has none yet (a new HOME).
store="${HOME}/.aws/cli-agent-orchestrator/agent-store"
for profile in "$PROFILES_DIR"/*.md; do
  if [ ! -f "$profile" ]; then
    say "error: no agent profiles in PROFILES_DIR=${PROFILES_DIR}"
    stop_helpers
    exit "$EXIT_USAGE"
  fi
  name="$(basename "$profile" .md)"
  if [ ! -f "${store}/${name}.md" ]; then
    out="$(cao install "$profile" --provider "${PROVIDER:-codex}" 2>&1)"
    if [ ! -f "${store}/${name}.md" ]; then
      say "error: cao install ${profile} failed: ${out}"
      stop_helpers
      exit "$EXIT_USAGE"
    fi
  fi
done

# 3. cao-server on this machine, answering before the loop starts.
cao-server --host 127.0.0.1 --port "$CAO_PORT" >>"$CAO_SERVER_LOG" 2>&1 &
cao_server_pid=$!
if ! "$PYTHON" - "$API" "$CAO_START_SECONDS" "$cao_server_pid" <<'WAIT'
import os, sys, time, urllib.request
url, seconds, pid = sys.argv[1] + "/health", float(sys.argv[2]), int(sys.argv[3])
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            if answer.status == 200:
                sys.exit(0)
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit(1)
    time.sleep(0.2)
sys.exit(1)
WAIT
then
  say "error: cao-server did not answer on ${API} within ${CAO_START_SECONDS}s; its log: ${CAO_SERVER_LOG}"
  stop_helpers
  exit "$EXIT_ERROR"
fi

# 4. The loop, waited for; a SIGTERM or SIGINT to this script reaches it as SIGTERM (a job in the background
#    of a script ignores SIGINT), and it stops with its state saved (exit 143).
"${loop[@]}" "$@" &
loop_pid=$!
trap 'kill -TERM "$loop_pid" 2>/dev/null' TERM INT
code=0
while true; do
  wait "$loop_pid"
  code=$?
  kill -0 "$loop_pid" 2>/dev/null || break        # a trapped signal ended the wait, not the loop
done
trap - TERM INT
stop_helpers
exit "$code"
