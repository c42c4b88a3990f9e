#!/usr/bin/env bash
# One run of the orchestrator loop on a machine of its own: a Kubernetes Job's pod, a CI job.
#
# The loop stands up what it needs beside it -- a tmux server and a cao-server of its own, the agent
# profiles, what each CLI needs in their environment -- and ends them with the run (OWN_SERVER=1; see
# docs/agent-clis.md, "The run's own CAO server"). Its exit code tells the scheduler what to do (README:
# exit codes). The working directory (WD, with the state file under it) is the only thing that must outlive
# the machine: on a new machine the same command resumes the run with new agents.
#
#   deploy/entrypoint.sh [config.json]
#
# Environment: the loop's own settings (WD, PROMPT_FILE, PROVIDER, OWN_SERVER_PORT, ...), REPLACE_LOST_AGENTS
# 1 unless set (nobody watches a pod), and PYTHON: the Python that runs the loop from a checkout (python3).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export OWN_SERVER=1
export REPLACE_LOST_AGENTS="${REPLACE_LOST_AGENTS:-1}"
PYTHON="${PYTHON:-python3}"

if [ -f "${here}/../run_orchestrator_loop.py" ]; then
  exec "$PYTHON" "${here}/../run_orchestrator_loop.py" "$@"     # a checkout: the loop beside this script
fi
if ! command -v cao-orchestrator-loop >/dev/null 2>&1; then
  echo "entrypoint: error: cao-orchestrator-loop is not on PATH: pip install the project in the image" >&2
  exit 2
fi
exec cao-orchestrator-loop "$@"
