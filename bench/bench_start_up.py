#!/usr/bin/env python3
"""How long the loop's start-up (five agents at once) takes with a real agent CLI in a fresh HOME.

    python bench/bench_start_up.py [--providers opencode_cli] [--runs 2] [--loop PATH]

For each provider and run, a new private cao-server 2.5.4 with a new HOME runs the
pinned real CLI (tests/e2e/harness.py, agent_clis.py) against the scripted model
endpoint (tests/e2e/scripted_model.py); the loop creates its five terminals at
once, as a run does, and the time until all five report ready is measured. A
fresh HOME is a user's first run: OpenCode then sets up its database and the
provider package of its config, which is what makes its first start-up slow
(and, on a loaded machine, past CAO's 120 s limit: the loop then starts that
agent once more, alone -- "second try" below).

Figures per provider: each run's seconds, whether a second try was needed, and
the median. The test suite's FAIL -> PASS run of each CLI is the first start-up
in its server's HOME and prints the same figure in the suite's summary.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests" / "e2e")]

from harness import private_cao  # noqa: E402
from scripted_model import ScriptedModel  # noqa: E402

ROLES = ("analyst", "peer_analyst", "programmer", "peer_programmer", "tester")
# The loop's own start-up, alone: configure, connect, create the five terminals, report, end them.
START_UP_ONLY = """
import json, sys
sys.path.insert(0, {folder!r})
import run_orchestrator_loop as loop
loop.configure([])
loop.connect_api()
started = loop.time.monotonic()
session, terminals = loop.create_terminals()
statuses = {{role: loop.api.get_status(terminal) for role, terminal in terminals.items()}}
print(json.dumps({{"seconds": loop.time.monotonic() - started, "statuses": statuses}}))
loop.end_agents(list(terminals.values()), session)
"""


def one_start_up(provider: str, loop: Path) -> dict:
    """Five agents started at once on a new server in a new HOME: seconds, statuses, second try or not."""
    with contextlib.ExitStack() as stack:
        model = stack.enter_context(ScriptedModel(think_seconds=0.2))
        cao = stack.enter_context(private_cao(provider=provider, model_url=model.url))
        wd = cao.new_workdir("bench")
        task = wd.parent / f"{wd.name}-task.md"
        task.write_text("*** ORIGINAL EXPLORE SUMMARY ***\nx\n*** SCENARIO TEST ***\ny\n", encoding="utf-8")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CAO_", "MOCK_AGENT_"))}
        env.update(cao.env, WD=str(wd), PROMPT_FILE=str(task))
        result = subprocess.run([sys.executable, "-c", START_UP_ONLY.format(folder=str(loop.parent))], cwd=REPO,
                                env=env, capture_output=True, text=True, timeout=900)
        if result.returncode != 0:
            raise SystemExit(f"the start-up failed (exit {result.returncode}):\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-2000:]}")
        report = json.loads(result.stdout.strip().splitlines()[-1])
        if sorted(report["statuses"]) != sorted(ROLES):
            raise SystemExit(f"not all five agents reported: {report}")
        return {"seconds": round(report["seconds"], 1), "second_try": "again, one at a time" in result.stdout,
                "statuses": report["statuses"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--providers", default="opencode_cli")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--loop", type=Path, default=REPO / "run_orchestrator_loop.py")
    args = parser.parse_args()
    figures = {}
    for provider in args.providers.split(","):
        runs = []
        for _ in range(args.runs):
            runs.append(one_start_up(provider, args.loop.resolve()))
            print(json.dumps({provider: runs[-1]}), file=sys.stderr, flush=True)
        figures[provider] = {"runs": runs, "seconds median": statistics.median(r["seconds"] for r in runs)}
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    started = time.monotonic()
    main()
    print(f"took {time.monotonic() - started:.0f}s", file=sys.stderr)
