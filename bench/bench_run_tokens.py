#!/usr/bin/env python3
"""What a run costs in model tokens with each proven agent CLI, counted as the model sees each request.

    python bench/bench_run_tokens.py [--providers claude_code,codex,opencode_cli,copilot_cli,hermes]

For each provider, one run with the loop's default settings (two review cycles): round 1 is
analyst, peer analyst, programmer, peer programmer (two cycles each) and the tester, 9 turns,
ending in FAIL; round 2 is the programmer's two cycles and the tester, PASS after 14 turns. The
pinned CLI (tests/e2e/agent_clis.py) runs under a private cao-server 2.5.4 against the scripted
model endpoint (tests/e2e/scripted_model.py), which counts each request as it receives it: the
CLI's own system prompt, its tool definitions, the conversation so far and the loop's prompt, at
one token per four bytes of the request. The CLIs' side requests (a title, a summary) count too.

The scripted model answers each turn with two responses (the command that writes the reply
file, then a short last message), so these are the least a run sends: a real model reads files,
runs tests and thinks aloud, and each of its requests carries at least as much. Output is the
model's own writing and is not measured here.

Figures per provider: requests and input tokens up to the end of turn 9 (a run that passes in
round 1) and of turn 14 (a FAIL, then PASS in round 2), and the input tokens per request.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests" / "e2e")]

from agent_clis import warm_opencode_home  # noqa: E402
from harness import private_cao  # noqa: E402
from scripted_model import ScriptedModel  # noqa: E402

PROVIDERS = ("claude_code", "codex", "opencode_cli", "copilot_cli", "hermes")
TASK = """*** ORIGINAL EXPLORE SUMMARY ***
Build greet.py: `python greet.py NAME` prints `Hello, NAME!`.
*** SCENARIO TEST ***
1. `python greet.py World` prints `Hello, World!` and exits 0.
"""
FAIL_REPLY = "RESULT: FAIL\nEVIDENCE:\n- greet World printed 'Hello World' (missing comma)\n"
PASS_REPLY = "RESULT: PASS\nEVIDENCE:\n- greet World printed 'Hello, World!'\n"
PROGRAMMER_REPLY = ("PROGRAMMER_SUMMARY:\n- Files changed: greet.py\n- Behavior implemented: greet NAME\n"
                    "- Tests run: python greet.py World\n- Known gaps: none\n")


def _epoch(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def one_run(provider: str, loop: Path) -> dict:
    """A 14-turn FAIL -> PASS run with the provider's CLI; what the model received up to turns 9 and 14."""
    with contextlib.ExitStack() as stack:
        model = stack.enter_context(ScriptedModel(think_seconds=0.2))
        cao = stack.enter_context(private_cao(provider=provider, model_url=model.url))
        if provider == "opencode_cli":
            warm_opencode_home(cao)
        wd = cao.new_workdir("bench")
        task = wd.parent / f"{wd.name}-task.md"
        task.write_text(TASK, encoding="utf-8")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CAO_", "MOCK_AGENT_", "NTFY_"))}
        env.update(cao.env, WD=str(wd), PROMPT_FILE=str(task), RESPONSE_TIMEOUT="300")
        model.set_script({"tester": [FAIL_REPLY, PASS_REPLY], "programmer": [PROGRAMMER_REPLY]})
        result = subprocess.run([sys.executable, str(loop)], cwd=REPO, env=env, capture_output=True, text=True,
                                timeout=1800)
        if result.returncode != 0:
            raise SystemExit(f"{provider}: the run failed (exit {result.returncode}):\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-2000:]}")
        state = json.loads((wd / ".tmp" / "orchestrator-loop-state.json").read_text(encoding="utf-8"))
        summary = json.loads((Path(state["run_dir"]) / "summary.json").read_text(encoding="utf-8"))
        entries = model.usage_entries()
    turns = summary["turn_list"]
    if len(turns) != 14:
        raise SystemExit(f"{provider}: expected 14 turns, the run took {len(turns)}")
    figures = {}
    for last in (9, 14):
        until = _epoch(turns[last - 1]["taken_at"])
        seen = [e for e in entries if e["time"] <= until]
        tokens = sum(e["input"] + e["cached_input"] for e in seen)
        figures[f"{last} turns"] = {"requests": len(seen), "input tokens": tokens,
                                    "side requests": sum(1 for e in seen if e["role"] is None)}
    whole = figures["14 turns"]
    figures["input tokens per request"] = round(whole["input tokens"] / max(1, whole["requests"]))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--providers", default=",".join(PROVIDERS))
    parser.add_argument("--loop", type=Path, default=REPO / "run_orchestrator_loop.py")
    args = parser.parse_args()
    figures = {"measured": time.strftime("%Y-%m-%d")}
    for provider in args.providers.split(","):
        started = time.monotonic()
        figures[provider] = one_run(provider, args.loop.resolve())
        print(json.dumps({provider: figures[provider], "seconds": round(time.monotonic() - started)}),
              file=sys.stderr, flush=True)
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
