#!/usr/bin/env python3
"""How long the README's run command takes to a PASS: `cao-orchestrator-loop --demo DIR`, with nothing running.

    python bench/bench_first_pass.py [--runs 3] [--fresh-home] [--command "cao-orchestrator-loop"]

Each run starts the command in a new folder and times, from its start: the log line that says the run's own
CAO server is up, the line "PASS in round 2", and the command's exit (its server, tmux server and agents
ended). `--fresh-home` gives every run a new HOME, as a first run has (CAO's store then gets the profiles
installed). The cao-server of the project's environment is used, else the suite's pinned one
(tests/e2e/cao_env.py). Prints each run's figures and their medians; nothing may be left running after a run
(checked: processes with the run's HOME).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests" / "e2e")]

from cao_env import ensure_cao  # noqa: E402
from harness import _pids_with_env  # noqa: E402

MARKS = {"server up": "CAO server: the run's own", "PASS": "PASS in round 2"}


def one_run(command: list[str], env: dict[str, str]) -> dict[str, float]:
    """One demo run: seconds from its start to each mark, and to its exit."""
    folder = Path(tempfile.mkdtemp(prefix="bench-first-pass-"))
    started = time.monotonic()
    seen: dict[str, float] = {}
    try:
        process = subprocess.Popen([*command, "--demo", str(folder / "demo")], env=env, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for line in process.stdout:
            for name, mark in MARKS.items():
                if name not in seen and mark in line:
                    seen[name] = time.monotonic() - started
        if process.wait() != 0 or set(seen) != set(MARKS):
            raise SystemExit(f"the demo failed (exit {process.returncode}); seen: {seen}")
        seen["exit"] = time.monotonic() - started
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    left = _pids_with_env(f"HOME={env['HOME']}".encode())
    if left:
        raise SystemExit(f"the run left processes running: {left}")
    return seen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--fresh-home", action="store_true", help="a new HOME each run (a first run)")
    parser.add_argument("--command", default=f"{shlex.quote(sys.executable)} {REPO / 'run_orchestrator_loop.py'}")
    options = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CAO_", "MOCK_AGENT_", "TMUX"))}
    if not shutil.which("cao-server", path=env.get("PATH")) and not (Path(sys.executable).parent / "cao-server").exists():
        env["PATH"] = f"{env.get('PATH', '')}{os.pathsep}{ensure_cao().parent}"
    home = Path(tempfile.mkdtemp(prefix="bench-first-pass-home-"))
    results = []
    try:
        for number in range(1, options.runs + 1):
            if options.fresh_home:
                shutil.rmtree(home, ignore_errors=True)
                home.mkdir()
            figures = one_run(shlex.split(options.command), {**env, "HOME": str(home)})
            results.append(figures)
            print(f"run {number}: " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in figures.items()),
                  flush=True)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    print("median: " + ", ".join(f"{name} {statistics.median(r[name] for r in results):.1f} s"
                                 for name in results[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
