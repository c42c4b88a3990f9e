#!/usr/bin/env python3
"""Benchmark the loop against a real cao-server with scripted agents; print the figures as JSON.

    python bench/bench_loop.py [--runs N] [--think-ms MS]

Each run starts a private cao-server 2.5.4 (tests/e2e/harness.py) whose agents
think for --think-ms per turn, and drives a full run (default review settings,
tester FAIL in round 1 and PASS in round 2) with POLL_SECONDS at its default.
The loop runs in this process, so every HTTP request it makes is counted.

Figures per run:
  handoff_latency_s  from an agent writing its reply file (the archived file's
                     mtime) to the next agent receiving its prompt (the scripted
                     agent's own record): mean and max
  startup_s          from calling main() to the first agent receiving its prompt
  wall_s             the whole run
  http_requests      total, per turn, and by call
  prompt_bytes       bytes of prompt text sent, per role
  turns              prompts answered
With several runs, "median" holds the median of each figure.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests" / "e2e")]

from harness import private_cao  # noqa: E402

TASK = """*** ORIGINAL EXPLORE SUMMARY ***
Build a greeting CLI: `greet NAME` prints `Hello, NAME!`; without NAME it prints a usage line and exits 2.
*** SCENARIO TEST ***
1. Run `greet World`: expect `Hello, World!` and exit code 0.
2. Run `greet`: expect a usage line on stderr and exit code 2.
"""
FAIL = ("RESULT: FAIL\nEVIDENCE:\n- `greet World` printed `Hello World!`: the comma is missing\n"
        "- Recommended next fix: the format string in greet.py\n")
PASS = "RESULT: PASS\nEVIDENCE:\n- `greet World` printed `Hello, World!`\n- `greet` exited 2 with a usage line\n"


def call_kind(method: str, path: str, query: str = "") -> str:
    """A name for one CAO request, as docs/performance.md counts them."""
    parts = path.strip("/").split("/")
    if parts[0] == "agents":
        return "list providers"
    if parts[0] == "sessions":
        if len(parts) == 1:
            return "create session"
        if method == "GET":
            return "session look-up"
        return "remove session" if method == "DELETE" else "create terminal"
    if len(parts) == 2:
        return "remove terminal" if method == "DELETE" else "status"
    if parts[2] == "output":
        return "screen" if "mode=full" in query else "last output"
    return {"input": "send input", "exit": "exit"}.get(parts[2], path)


def one_run(think_ms: int) -> dict:
    with private_cao(think_ms=think_ms) as cao:
        cao.set_script({"tester": [FAIL, PASS]})
        wd = cao.new_workdir("bench")
        task = wd.parent / "bench-task.md"
        task.write_text(TASK, encoding="utf-8")
        for name in [n for n in os.environ if n.startswith("CAO_")]:
            del os.environ[name]
        os.environ.update(cao.env, WD=str(wd), PROMPT_FILE=str(task))
        import run_orchestrator_loop as loop
        loop = importlib.reload(loop)

        requests: Counter = Counter()
        prompt_bytes: Counter = Counter()
        role_of = {}

        def count(request) -> None:
            kind = call_kind(request.method, request.url.path, urlsplit(str(request.url)).query)
            requests[kind] += 1
            if kind == "send input":
                message = parse_qs(urlsplit(str(request.url)).query).get("message", [""])[0]
                terminal = request.url.path.split("/")[2]
                prompt_bytes[role_of.get(terminal, terminal)] += len(message.encode())

        loop.api._http.event_hooks["request"].append(count)
        started = time.time()
        try:
            with contextlib.redirect_stdout(sys.stderr):      # the loop's log; stdout is for the figures
                loop.main([])
        except SystemExit as stop:
            code = stop.code
        wall = time.time() - started
        role_of.update({tid: role for role, tid in loop.terminal_ids.items()})
        prompt_bytes = Counter({role_of.get(k, k): v for k, v in prompt_bytes.items()})

        prompts = [r for r in cao.received() if r.get("kind") == "prompt"]
        replies = sorted(p for p in Path(loop.run_dir).glob("[0-9][0-9][0-9]-*")
                         if "-stale-" not in p.name and not p.name.endswith(".prompt.md"))
        latencies = [prompts[i + 1]["time"] - replies[i].stat().st_mtime
                     for i in range(min(len(replies), len(prompts)) - 1)]
        turns = len(replies)
        return {
            "exit_code": code,
            "turns": turns,
            "handoff_latency_s": {"mean": round(statistics.mean(latencies), 3), "max": round(max(latencies), 3)},
            "startup_s": round(prompts[0]["time"] - started, 2),
            "wall_s": round(wall, 1),
            "http_requests": {"total": sum(requests.values()),
                              "per_turn": round(sum(requests.values()) / turns, 1),
                              "by_call": dict(sorted(requests.items()))},
            "prompt_bytes": dict(sorted(prompt_bytes.items())),
        }


def median_of(runs: list[dict]) -> dict:
    def med(get):
        return round(statistics.median(get(r) for r in runs), 3)
    return {
        "handoff_latency_s": {"mean": med(lambda r: r["handoff_latency_s"]["mean"]),
                              "max": med(lambda r: r["handoff_latency_s"]["max"])},
        "startup_s": med(lambda r: r["startup_s"]),
        "wall_s": med(lambda r: r["wall_s"]),
        "http_requests_per_turn": med(lambda r: r["http_requests"]["per_turn"]),
        "prompt_bytes_total": med(lambda r: sum(r["prompt_bytes"].values())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--think-ms", type=int, default=2500)
    args = parser.parse_args()
    runs = []
    for n in range(args.runs):
        print(f"bench: run {n + 1}/{args.runs} ...", file=sys.stderr, flush=True)
        runs.append(one_run(args.think_ms))
    result = {"think_ms": args.think_ms, "poll_seconds": 2, "runs": runs}
    if len(runs) > 1:
        result["median"] = median_of(runs)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
