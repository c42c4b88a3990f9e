"""Watch the orchestrator drive five scripted agents on a private cao-server.

    python tests/e2e/demo.py [--keep]

Run from the repository root after ``pip install -e '.[test]'``; needs tmux.
The first run installs cli-agent-orchestrator 2.5.4 into a virtualenv of its
own (see cao_env.py); later runs reuse it.

The demo starts a private cao-server whose agents are the scripted
``mock_cli`` program (1.5 s think time per turn), writes a small sample task
(a greeting CLI), and runs ``python run_orchestrator_loop.py`` against it,
streaming the orchestrator's log. The script: the reviewers approve with
evidence, the tester reports FAIL in round 1 (a missing comma) and PASS in
round 2. Lines the demo prints itself start with ``demo:``; everything else
is the orchestrator's own output.

Afterwards the server, its tmux server and all temporary files are removed,
also after Ctrl-C; ``--keep`` keeps the sample project (with the state file
and the archived replies) and prints where it is. The exit code is the
orchestrator's: 0 PASS, 1 FAIL or error, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

E2E_DIR = Path(__file__).resolve().parent
REPO_ROOT = E2E_DIR.parents[1]
ORCHESTRATOR = REPO_ROOT / "run_orchestrator_loop.py"

# The scripted agents' think time per turn; MOCK_AGENT_THINK_MS overrides it (the test suite runs it faster).
THINK_MS = int(os.environ.get("MOCK_AGENT_THINK_MS") or 1500)
LOOP_SETTINGS = {
    "POLL_SECONDS": "0.5",
    "IDLE_GRACE_SECONDS": "5",
    "MIN_REVIEW_CYCLES_BEFORE_APPROVAL": "1",
    "CLEANUP_ON_EXIT": "1",          # the demo removes its server afterwards: the loop ends its agents itself
}

TASK = """\
Sample task of the orchestrator demo (text above the first header is ignored).
*** ORIGINAL EXPLORE SUMMARY ***
Build a tiny greeting CLI in an empty Python project: `python greet.py NAME` prints
`Hello, NAME!` and exits 0; without NAME it prints `usage: greet.py NAME` on stderr
and exits 2. Add tests for both cases.
*** SCENARIO TEST ***
1. `python greet.py World` prints exactly `Hello, World!` and exits 0.
2. `python greet.py` prints `usage: greet.py NAME` on stderr and exits 2.
3. The project's tests pass.
"""

ANALYST = """\
ANALYST_SUMMARY:
- Change: add-greeting-cli (openspec/changes/add-greeting-cli/)
- Artifacts: proposal.md, design.md, tasks.md, specs/greeting/spec.md
- P1 requirements: R1 `greet.py NAME` prints `Hello, NAME!` (scenario step 1); R2 no NAME: usage on stderr, exit 2 (step 2)
- Contracts: command `python greet.py NAME`; stdout `Hello, NAME!`; exit codes 0 and 2
- Handoff: implement greet.py (tasks.md 1), then tests/test_greet.py for R1 and R2 (tasks.md 2); no open risks
"""

ANALYSIS_REVIEW = """\
REVIEW_RESULT: APPROVED
REVIEW_NOTES:
- Artifacts: proposal.md, design.md, tasks.md and the spec exist; the proposal matches the task
- P1 traceability: R1 and R2 each trace to a scenario step
- Downstream contract: command line, output and exit codes are fixed for programmer and tester
- Handoff: actionable; tasks.md gives the programmer two concrete first steps
"""

PROGRAMMER_FIRST = """\
PROGRAMMER_SUMMARY:
- Files changed: greet.py (new: argument check, greeting), tests/test_greet.py (new: R1, R2)
- Behavior implemented: R1 `python greet.py NAME` prints the greeting; R2 no NAME prints the usage line on stderr, exit 2
- Tests run: python -m pytest -q (2 passed)
- Known gaps: none
"""

PROGRAMMER_FIX = """\
PROGRAMMER_SUMMARY:
- Files changed: greet.py (format string fixed to `Hello, {name}!`), tests/test_greet.py (asserts the exact output)
- Behavior implemented: R1 `python greet.py World` now prints `Hello, World!`; R2 unchanged
- Tests run: python -m pytest -q (3 passed)
- Known gaps: none
"""

CODE_REVIEW_FIRST = """\
REVIEW_RESULT: APPROVED
REVIEW_NOTES:
- Tests: ran python -m pytest -q; all tests passed (2 passed)
- Files: read greet.py and tests/test_greet.py
- Requirements: R1 and R2 implemented; each scenario step has a test
- Edge cases: missing NAME is handled (error handling: usage on stderr, exit 2)
"""

CODE_REVIEW_FIX = """\
REVIEW_RESULT: APPROVED
REVIEW_NOTES:
- Tests: ran python -m pytest -q; all tests passed (3 passed), the new one checks the exact output
- Files: read the greet.py diff and tests/test_greet.py
- Requirements: scenario step 1 now matches `Hello, World!` exactly
- Edge cases: no regression for a missing NAME; error handling unchanged
"""

TEST_FAIL = """\
RESULT: FAIL
EVIDENCE:
- Step 1: `python greet.py World` printed `Hello World!` (exit 0); expected `Hello, World!`: the comma is missing
- Step 2: `python greet.py` printed `usage: greet.py NAME` on stderr, exit 2, as expected
- Step 3: python -m pytest -q: 2 passed (the test only checks that the output starts with `Hello`)
- Recommended next fix: the format string in greet.py, and a test for the exact output
"""

TEST_PASS = """\
RESULT: PASS
EVIDENCE:
- Step 1: `python greet.py World` printed `Hello, World!` (exit 0)
- Step 2: `python greet.py` printed `usage: greet.py NAME` on stderr, exit 2
- Step 3: python -m pytest -q: 3 passed
"""

SCRIPT = {
    "analyst": [ANALYST],
    "peer_analyst": [ANALYSIS_REVIEW],
    "programmer": [PROGRAMMER_FIRST, PROGRAMMER_FIX],
    "peer_programmer": [CODE_REVIEW_FIRST, CODE_REVIEW_FIX],
    "tester": [TEST_FAIL, TEST_PASS],
}

EXIT_MEANING = {0: "PASS", 1: "FAIL or error", 2: "bad configuration", 130: "interrupted", 143: "terminated"}


def say(message: str) -> None:
    print(f"demo: {message}", flush=True)


class Signals:
    """SIGINT/SIGTERM: the first one interrupts the demo, later ones cannot stop the cleanup."""

    received: int | None = None

    @classmethod
    def install(cls) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, cls._handle)

    @classmethod
    def _handle(cls, signum, frame) -> None:
        if cls.received is None:
            cls.received = signum
            raise KeyboardInterrupt
        os.write(2, b"demo: still cleaning up, one moment\n")


def orchestrator_env(cao, wd: Path, task: Path) -> dict[str, str]:
    """The caller's environment without any orchestrator setting, plus the demo's settings."""
    try:
        sys.path.insert(0, str(REPO_ROOT))
        import run_orchestrator_loop

        names = {s.env for s in run_orchestrator_loop.SETTINGS}
    except Exception:  # the subprocess will report a broken script itself
        names = set()
    finally:
        sys.path.remove(str(REPO_ROOT))
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in names and not k.startswith(("CAO_", "MOCK_AGENT_"))
    }
    env.update(cao.env)
    env.update(WD=str(wd), PROMPT_FILE=str(task), **LOOP_SETTINGS)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_orchestrator(env: dict[str, str]) -> int:
    """Run the orchestrator, echoing its output (stdout and stderr) line by line as it comes."""
    proc = subprocess.Popen(
        [sys.executable, str(ORCHESTRATOR)],
        cwd=REPO_ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        encoding="utf-8",
        errors="replace",
    )

    def pump() -> None:
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        proc.wait()
    except KeyboardInterrupt:
        say("interrupted; the orchestrator saves its state and stops")
        # Ctrl-C in a terminal reaches the orchestrator too; a signal sent to
        # the demo alone is passed on.
        forward = Signals.received or signal.SIGINT
        for sig, wait in ((None, 3), (forward, 20), (signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            if sig is not None and proc.poll() is None:
                proc.send_signal(sig)
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
    reader.join(timeout=5)
    return proc.returncode


def report(wd: Path) -> None:
    state_file = wd / ".tmp" / "orchestrator-loop-state.json"
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        say(f"no state file at {state_file}")
        return
    say(f"state file: {state_file}")
    say(f"  final_status {state.get('final_status')}, round {state.get('current_round')}, "
        f"phase {state.get('current_phase')}")
    run_dir = Path(state.get("run_dir") or wd / ".tmp")
    replies = sorted(p.name for p in run_dir.glob("[0-9][0-9][0-9]-*.md")
                     if not p.name.endswith(".prompt.md")) if run_dir.is_dir() else []
    say(f"archived replies: {run_dir}/")
    if replies:
        say(f"  {', '.join(replies)}")


def demo(keep: bool) -> int:
    import cao_env
    from harness import private_cao

    started = time.monotonic()
    if cao_env.installed_here() is not None:
        say(f"using {cao_env.CAO_REQUIREMENT}, installed here ({cao_env.installed_here().parent})")
    elif not cao_env._is_ready(cao_env.default_venv_dir()):
        say(f"first run: installing {cao_env.CAO_REQUIREMENT} into {cao_env.default_venv_dir()} "
            "(a minute or two)")
    say(f"starting a private cao-server with scripted mock_cli agents ({THINK_MS} ms think time per turn)")
    with private_cao(think_ms=THINK_MS) as cao:
        parent = os.environ.get("CAO_E2E_TMPDIR") or tempfile.gettempdir()
        demo_dir = Path(tempfile.mkdtemp(prefix="cao-demo-", dir=parent)).resolve()
        code = 1
        try:
            wd = demo_dir / "greeting-cli"
            wd.mkdir()
            (wd / "README.md").write_text(
                "# greeting-cli\n\nSample project of the orchestrator demo. Its agents are scripted:\n"
                "they answer, but write nothing here except under .tmp/.\n",
                encoding="utf-8",
            )
            task = demo_dir / "task.md"
            task.write_text(TASK, encoding="utf-8")
            cao.set_script(SCRIPT)

            say(f"cao-server {cao_env.CAO_VERSION} is up at {cao.base_url} "
                f"(private HOME and tmux under {cao.root})")
            say(f"sample project: {wd}")
            say(f"task: {task} (a greeting CLI)")
            say("script: the reviewers approve with evidence; the tester reports FAIL in round 1 "
                "(a missing comma) and PASS in round 2")
            say("MIN_REVIEW_CYCLES_BEFORE_APPROVAL=1 keeps it short (the default, 2, runs every review "
                "phase twice)")
            settings = " ".join(f"{k}={v}" for k, v in LOOP_SETTINGS.items())
            say(f"running: API={cao.base_url} PROVIDER=mock_cli WD={wd} PROMPT_FILE={task} {settings} "
                "python run_orchestrator_loop.py")
            say("----- orchestrator output -----")
            code = run_orchestrator(orchestrator_env(cao, wd, task))
            say(f"----- orchestrator exited with {code} ({EXIT_MEANING.get(code, 'unexpected')}) -----")
            report(wd)
            if keep:
                say(f"kept (--keep): {demo_dir} (remove it with: rm -rf {demo_dir})")
            else:
                say(f"these files are in {demo_dir}, removed now; run with --keep to keep them")
        finally:
            if not keep:
                shutil.rmtree(demo_dir, ignore_errors=True)
            say("stopping cao-server and tmux, removing temporary files"
                + (" (not the kept project)" if keep else ""))
    say(f"done in {time.monotonic() - started:.0f} s; exit code {code}")
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tests/e2e/demo.py",
        description="Run the orchestrator against a private cao-server with scripted agents.",
    )
    parser.add_argument("--keep", action="store_true",
                        help="keep the sample project (state file, archived replies) and print its path")
    args = parser.parse_args(argv)

    missing = [tool for tool in ("tmux", "bash") if shutil.which(tool) is None]
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        print(f"demo: {' and '.join(missing)} {verb} not installed; install {'it' if len(missing) == 1 else 'them'} "
              f"first, e.g. `apt-get install {' '.join(missing)}` (Debian/Ubuntu)", file=sys.stderr)
        return 2
    if str(E2E_DIR) not in sys.path:
        sys.path.insert(0, str(E2E_DIR))
    try:
        import httpx  # noqa: F401  (the harness and the orchestrator need it)
    except ImportError:
        print("demo: httpx is missing; run `pip install -e '.[test]'` in the repository root first",
              file=sys.stderr)
        return 2

    Signals.install()
    try:
        return demo(args.keep)
    except KeyboardInterrupt:
        signum = Signals.received or signal.SIGINT
        say("interrupted; everything was stopped and removed")
        return 128 + signum
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:  # the harness's errors, readably
        say(f"error: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
