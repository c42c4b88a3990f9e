#!/usr/bin/env python3
"""How long after its reply file a real agent CLI's turn ends, and when the loop takes the reply.

    python bench/bench_turn_end.py [--providers claude_code,codex] [--closing-ms 0,2000] [--runs 1]
                                   [--loop PATH]

For each provider, a private cao-server 2.5.4 runs the pinned real CLI
(tests/e2e/harness.py, agent_clis.py) against the scripted model endpoint
(tests/e2e/scripted_model.py), which thinks 0.2 s per request. Each run is one
round of the loop (analyst .. tester, PASS at once: 5 turns) with the loop's
default handoff settings. Every turn writes its reply file with one shell
command; the model then takes --closing-ms before its closing words, as a real
model's last message takes a few seconds after the answer is written.

Figures per provider and closing time (medians over every turn of every run):
  closing_s        from the model sending the command that writes the reply to
                   its closing words (what the CLI still does after the file)
  file_to_taken_s  from the reply file's last write to the loop taking the reply
                   (the loop's own log line): what the next agent waits
  turn_s           the whole turn, prompt sent to reply taken
  end_to_taken_s   from the model's last answer of the turn (the agent's turn over) to the
                   loop taking the reply (the run's summary.json, to the millisecond)

The loop is given the agents' home (AGENT_HOME), as a user running it beside cao-server has it,
so it reads the CLIs' own records; --no-records leaves them out of its reach.

--loop runs another copy of run_orchestrator_loop.py (an older release, to
compare): `git show v:run_orchestrator_loop.py > /tmp/old/run_orchestrator_loop.py`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests" / "e2e")]

from harness import private_cao  # noqa: E402
from scripted_model import ScriptedModel  # noqa: E402

ROLES = ("analyst", "peer_analyst", "programmer", "peer_programmer", "tester")
TURN_LINE = re.compile(r"\| (\w+): reply received after ([\d.]+)s \(file written ([\d.]+)s before\)"
                       r" \(\d+ chars, turn end seen by ([^,]+),")
TASK = "*** ORIGINAL EXPLORE SUMMARY ***\nBuild `greet NAME`.\n*** SCENARIO TEST ***\nRun `greet World`.\n"


def one_run(cao, model: ScriptedModel, closing_ms: int, loop: Path, records: bool) -> dict:
    """One round with every turn's closing words taking closing_ms; the turns' figures."""
    wd = cao.new_workdir("bench")
    task = wd.parent / f"{wd.name}-task.md"
    task.write_text(TASK, encoding="utf-8")
    model.set_script({role: [{"closing_ms": closing_ms}] for role in ROLES})
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CAO_", "MOCK_AGENT_"))}
    env.update(cao.env, WD=str(wd), PROMPT_FILE=str(task), MIN_REVIEW_CYCLES_BEFORE_APPROVAL="1",
               RESPONSE_TIMEOUT="300", CLEANUP_ON_EXIT="1")
    if records:                         # the agents' home, where their CLIs keep their records, as a user has it
        env["AGENT_HOME"] = str(cao.home)
    result = subprocess.run([sys.executable, str(loop)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise SystemExit(f"the run failed (exit {result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-2000:]}")
    found = TURN_LINE.findall(result.stdout)
    turns = [(role, float(took), float(lag)) for role, took, lag, _ in found]
    events = model.events()
    state = json.loads((wd / ".tmp" / "orchestrator-loop-state.json").read_text(encoding="utf-8"))
    summary = json.loads((Path(state["run_dir"]) / "summary.json").read_text(encoding="utf-8"))
    taken = {turn["role"]: datetime.fromisoformat(turn["taken_at"].replace("Z", "+00:00")).timestamp()
             for turn in summary["turn_list"]}
    closing, end_to_taken = [], []
    for role, _, lag in turns:
        writes = [e["time"] for e in events if e["role"] == role and e["action"] == "write" and e["kind"] != "repeat"]
        ends = [e["time"] for e in events if e["role"] == role and e["kind"] == "tool_result" and e["action"] == "text"]
        if writes and ends:
            closing.append(ends[0] - writes[0])
            end_to_taken.append(taken[role] - ends[0])   # from the model's last answer of the turn to the reply taken
    return {"turn_s": [t for _, t, _ in turns], "file_to_taken_s": [g for _, _, g in turns], "closing_s": closing,
            "end_to_taken_s": end_to_taken, "ended_by": [ended_by for *_, ended_by in found]}


def median(values: list[float]) -> float:
    return round(statistics.median(values), 2) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--providers", default="claude_code,codex,opencode_cli")
    parser.add_argument("--closing-ms", default="0,2000")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--no-records", action="store_true",
                        help="the CLIs' records out of the loop's reach (no AGENT_HOME): the screen rules alone")
    parser.add_argument("--loop", type=Path, default=REPO / "run_orchestrator_loop.py")
    args = parser.parse_args()
    figures = {}
    for provider in args.providers.split(","):
        with contextlib.ExitStack() as stack:
            model = stack.enter_context(ScriptedModel(think_seconds=0.2))
            cao = stack.enter_context(private_cao(provider=provider, model_url=model.url))
            for closing_ms in (int(v) for v in args.closing_ms.split(",")):
                runs = [one_run(cao, model, closing_ms, args.loop.resolve(), not args.no_records)
                        for _ in range(args.runs)]
                pooled = {key: [v for run in runs for v in run[key]] for key in runs[0]}
                ended_by = pooled.pop("ended_by")
                figures[f"{provider} closing {closing_ms}ms"] = {
                    "turns": len(pooled["turn_s"]),
                    **{f"{key} median": median(values) for key, values in pooled.items()},
                    "turn end seen by": {what: ended_by.count(what) for what in sorted(set(ended_by))},
                    "file_to_taken_s max": round(max(pooled["file_to_taken_s"]), 2),
                }
                print(json.dumps({f"{provider} closing {closing_ms}ms": figures[f"{provider} closing {closing_ms}ms"]}),
                      file=sys.stderr, flush=True)
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    started = time.monotonic()
    main()
    print(f"took {time.monotonic() - started:.0f}s", file=sys.stderr)
