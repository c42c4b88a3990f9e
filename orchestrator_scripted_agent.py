"""A scripted agent for trying the orchestrator loop without any AI CLI.

Installed with the project as the command ``mock_cli``: the program CAO's own
``mock_cli`` provider starts in each terminal. Start cao-server where this
command is on PATH, run the loop with ``PROVIDER=mock_cli``, and five scripted
agents answer every prompt with a reply that passes the loop's checks (the
reviewers approve with evidence, the tester reports PASS). It reads each
prompt, finds the response file the prompt names, and writes its answer there,
just as a real agent is asked to. It writes no code: its answers are canned
text (an analysis, a review, "RESULT: PASS"), so the task's files (a greet.py,
say) never appear unless a script step names them under ``files``; it shows
the loop's mechanics, not an agent's work. It needs no settings; ``MOCK_AGENT_THINK_MS``
sets its think time per turn (default 300) and ``MOCK_AGENT_HOME`` a directory
holding a per-role script, script.json (described below). The test suite
drives it the same way.

CAO starts this program (installed on PATH as ``mock_cli``) in a tmux pane and
decides the terminal status purely from what the pane prints:

* a line ending in the prompt ``❯ `` and no reply yet   -> idle
* no line ending in ``❯ `` since the last input         -> processing
* a line starting ``> MOCK:`` followed by a prompt      -> completed
* the text ``ERROR: mock failure injected``             -> error

CAO clears its status buffer whenever it sends input, so only output printed
after a message counts. Messages arrive as a bracketed paste
(``ESC[200~ ... ESC[201~``) followed by Enter keys; CAO sends two Enters, the
second one after a pause, and plain keystrokes for short control input.

With ``MOCK_AGENT_HOME`` set, what the agent does for each message is read
from ``$MOCK_AGENT_HOME/script.json`` (re-read every time) so a test can steer
five concurrent agents; everything they receive is appended to
``$MOCK_AGENT_HOME/received.jsonl``. Without it, every prompt gets the default
answer of its role and turns are counted per process.

Messages:

* ``Read and follow the instructions in this file: <path>`` -> the file's
  content is handled as the message.
* A prompt has a line ``Write your complete answer to this file: <path>``; the
  file name gives the role (analyst_summary.md -> analyst, analyst_review.md ->
  peer_analyst, programmer_summary.md -> programmer, programmer_review.md ->
  peer_programmer, test_result.md -> tester). Each prompt is one turn of that
  role and uses the next script step.
* Any other message naming one of those files is a reminder for that role: it
  uses no step and only releases an answer held back by ``write_on_reminder``.
* ``/exit`` (what CAO's exit endpoint types) or Ctrl-D ends the program.
* Anything else is answered ``> MOCK: #N ok``.

Like a real agent CLI, it shows each message it gets in its transcript: the
first line and the response-file line, each after ``›``.

script.json: ``{"<role>": [step, ...]}``. Turn N uses step N, the last step
repeats. A step is a string (the answer text) or
``{"text": str, "think_ms": int, "silent": bool, "action": "write" | "no_file" |
"error" | "write_on_reminder", "files": {path: content or null}, "hold_ms": int,
"say": str}``; ``say`` is a line it prints as its turn ends (e.g. an agent CLI's
usage-limit words: "You've hit your usage limit. Try again later.");
while it thinks the agent repaints a timer every second, as a working CLI does,
unless ``silent`` (a hung CLI); ``hold_ms`` keeps it at work that long after it
wrote its answer (a CLI still busy with its turn once the file is there, which a
test can kill right then); ``files`` are
written (null: deleted) in the project before the answer, as an agent
changes the code (a relative path is taken from the agent's working
directory). A missing role or text gets a default answer that
passes the orchestrator's checks; think time defaults to
``$MOCK_AGENT_THINK_MS`` (300). Per-role turn counts and held-back answers are
kept in ``counters.json`` (shared, locked) so they survive across processes.
With ``"count": "answered"`` in script.json a prompt counts as a turn only once
its think time is over: an agent ended while it thinks (a stopped run) leaves
the step to the prompt sent again (the demo's script says so).

Every reply line is ``> MOCK: #<n> ...`` where n counts the messages this
process has handled, so pollers can match a reply to its message.
"""

from __future__ import annotations

import codecs
import contextlib
import fcntl
import importlib.metadata
import json
import os
import re
import signal
import sys
import tempfile
import termios
import time
import traceback
from pathlib import Path

PROMPT = "❯ "
REPLY_PREFIX = "> MOCK: "
ERROR_TEXT = "ERROR: mock failure injected"

PASTE_START = "\x1b[200~"
PASTE_END = "\x1b[201~"
# CSI, SS3 or a two-byte escape; anchored, so it stays linear on long input.
ESCAPE_SEQUENCE_RE = re.compile(r"\x1b(\[[0-9;?]*[ -/]*[@-~]|O.|.)", re.S)

RESPONSE_FILE_ROLES = {
    "analyst_summary.md": "analyst",
    "analyst_review.md": "peer_analyst",
    "programmer_summary.md": "programmer",
    "programmer_review.md": "peer_programmer",
    "test_result.md": "tester",
}

WRITE_MARKER = "Write your complete answer to this file:"
INDIRECTION_MARKER = "Read and follow the instructions in this file:"
# Characters that end a path mentioned in free text (quotes, brackets, spaces).
PATH_DELIMITERS = frozenset(" \t\r\n'\"`<>()[]{},;")

DEFAULT_TEXTS = {
    "analyst": (
        "ANALYST_SUMMARY:\n"
        "1. Scope: implement the requested change in the target module.\n"
        "2. Artifacts: proposal.md, design.md and tasks.md are up to date.\n"
        "3. Acceptance criteria: every scenario in the spec passes.\n"
        "4. Risks: none beyond the edge cases listed in the spec.\n"
        "5. Handoff: the programmer should start with tasks.md item 1.\n"
    ),
    "peer_analyst": (
        "REVIEW_RESULT: APPROVED\n"
        "REVIEW_NOTES:\n"
        "- The artifact set (proposal, design) is complete; no P1 gaps, traceability is clear.\n"
        "- Downstream contract for the programmer handoff is actionable.\n"
    ),
    "programmer": (
        "PROGRAMMER_SUMMARY:\n"
        "- Files changed: src/app.py, tests/test_app.py\n"
        "- Behavior implemented: the requested feature, covered by new tests.\n"
        "- Verification: unit tests pass.\n"
    ),
    "peer_programmer": (
        "REVIEW_RESULT: APPROVED\n"
        "REVIEW_NOTES:\n"
        "- Tests cover the changed files and each scenario, including the edge case.\n"
        "- Error handling is present; the artifact and proposal match the code.\n"
        "- P1 traceability holds; downstream contract and handoff are actionable.\n"
    ),
    "tester": (
        "RESULT: PASS\n"
        "EVIDENCE:\n"
        "- Ran the project test command: all tests passed.\n"
        "- Scenario checks: every scenario behaves as specified.\n"
    ),
}

VALID_ACTIONS = {"write", "no_file", "error", "write_on_reminder"}


# The demo (`cao-orchestrator-loop --demo`): a small task, and a script under which the programmer writes a
# greet.py that misses a comma, the tester fails it with that evidence, and the retry round fixes it.
DEMO_TASK = """\
The orchestrator loop's demo: five scripted agents, no AI CLI and nothing paid.
*** ORIGINAL EXPLORE SUMMARY ***
Build a tiny greeting CLI in an empty Python project: `python greet.py NAME` prints
`Hello, NAME!` and exits 0; without NAME it prints `usage: greet.py NAME` on stderr
and exits 2. Add tests for both cases.
*** SCENARIO TEST ***
1. `python greet.py World` prints exactly `Hello, World!` and exits 0.
2. `python greet.py` prints `usage: greet.py NAME` on stderr and exits 2.
3. The project's tests pass.
"""

_DEMO_GREET = """\
import sys


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: greet.py NAME", file=sys.stderr)
        return 2
    print(f"Hello{separator} {{argv[1]}}!")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
"""

_DEMO_TEST = """\
import subprocess
import sys
from pathlib import Path

GREET = Path(__file__).resolve().parents[1] / "greet.py"


def test_greets_by_name():
    done = subprocess.run([sys.executable, str(GREET), "World"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout{check}


def test_usage_without_a_name():
    done = subprocess.run([sys.executable, str(GREET)], capture_output=True, text=True)
    assert done.returncode == 2 and "usage: greet.py NAME" in done.stderr
"""


def _demo_programmer(summary: str, separator: str, check: str) -> dict:
    return {"text": summary, "files": {"greet.py": _DEMO_GREET.format(separator=separator),
                                       "tests/test_greet.py": _DEMO_TEST.format(check=check)}}


_DEMO_FIRST_CODE = _demo_programmer("""\
PROGRAMMER_SUMMARY:
- Files changed: greet.py (new), tests/test_greet.py (new: R1, R2)
- Behavior implemented: R1 `python greet.py NAME` prints the greeting; R2 no NAME prints the usage line on stderr, exit 2
- Tests run: python -m pytest -q (2 passed)
""", "", '.startswith("Hello")')
_DEMO_FIXED_CODE = _demo_programmer("""\
PROGRAMMER_SUMMARY:
- Files changed: greet.py (format string fixed to `Hello, NAME!`), tests/test_greet.py (asserts the exact output)
- Behavior implemented: R1 `python greet.py World` now prints `Hello, World!`; R2 unchanged
- Tests run: python -m pytest -q (2 passed)
""", ",", ' == "Hello, World!\\n"')

DEMO_SCRIPT = {
    "count": "answered",       # a demo stopped while an agent thinks goes on with that agent's same step
    "analyst": ["""\
ANALYST_SUMMARY:
- Change: add-greeting-cli: greet.py and its tests
- P1 requirements: R1 `greet.py NAME` prints `Hello, NAME!` (scenario step 1); R2 no NAME: usage on stderr, exit 2 (step 2)
- Contracts: command `python greet.py NAME`; stdout `Hello, NAME!`; exit codes 0 and 2
- Handoff: write greet.py, then tests/test_greet.py for R1 and R2; no open risks
"""],
    "peer_analyst": ["""\
REVIEW_RESULT: APPROVED
REVIEW_NOTES:
- Artifacts: the analysis matches the task; the proposal is small and complete
- P1 traceability: R1 and R2 each trace to a scenario step
- Downstream contract: command line, output and exit codes are fixed for programmer and tester
- Handoff: actionable; two concrete first steps
"""],
    "programmer": [_DEMO_FIRST_CODE, _DEMO_FIRST_CODE, _DEMO_FIXED_CODE],     # round 1 has two turns
    "peer_programmer": ["""\
REVIEW_RESULT: APPROVED
REVIEW_NOTES:
- Tests: ran python -m pytest -q; all tests passed (2 passed)
- Files: read greet.py and tests/test_greet.py
- Requirements: R1 and R2 implemented; each scenario step has a test
- Edge cases: a missing NAME is handled (error handling: usage on stderr, exit 2)
"""],
    "tester": ["""\
RESULT: FAIL
EVIDENCE:
- Step 1: `python greet.py World` printed `Hello World!` (exit 0); expected `Hello, World!`: the comma is missing
- Step 2: `python greet.py` printed `usage: greet.py NAME` on stderr, exit 2, as expected
- Step 3: python -m pytest -q: 2 passed (the test only checks that the output starts with `Hello`)
- Recommended next fix: the format string in greet.py, and a test for the exact output
""", """\
RESULT: PASS
EVIDENCE:
- Step 1: `python greet.py World` printed `Hello, World!` (exit 0)
- Step 2: `python greet.py` printed `usage: greet.py NAME` on stderr, exit 2
- Step 3: python -m pytest -q: 2 passed
"""],
}


def log(msg: str) -> None:
    """Diagnostics go to stderr, which is the same pane.

    Kept to one line without the prompt glyph or error marker, so a log line
    can never change the status CAO reads from the screen.
    """
    text = msg.replace(PROMPT.strip(), "?").replace(ERROR_TEXT, "<error-marker>")
    text = " ".join(text.split())[:300]
    try:
        sys.stderr.write(f"[mock_cli] {text}\n")
        sys.stderr.flush()
    except OSError:
        pass


_at_line_start = True


def say(text: str) -> None:
    global _at_line_start
    if text:
        _at_line_start = text.endswith("\n")
    sys.stdout.write(text)
    sys.stdout.flush()


def new_line() -> None:
    """Start a fresh line: CAO only recognises replies and errors at line start."""
    if not _at_line_start:
        say("\n")


class Home:
    """Files under $MOCK_AGENT_HOME shared by all agent processes of a test.

    Without a home directory there is no script and nothing is recorded; the
    turn counters live in this process only.
    """

    def __init__(self, path: str | None):
        self.path = Path(path) if path else None
        self._counters_in_memory: dict = {"turns": {}, "pending": {}}

    def _file(self, name: str) -> Path | None:
        return self.path / name if self.path else None

    def script(self) -> dict:
        f = self._file("script.json")
        if f is None or not f.exists():
            return {}
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            log(f"cannot read {f}: {exc}; using defaults")
            return {}
        return data if isinstance(data, dict) else {}

    @contextlib.contextmanager
    def _state(self):
        """Yield the shared counters dict under an exclusive lock, then save it."""
        f = self._file("counters.json")
        if f is None:
            yield self._counters_in_memory
            return
        f.parent.mkdir(parents=True, exist_ok=True)
        # A separate lock file: counters.json itself is replaced atomically by
        # the test fixture's reset, which would orphan a lock held on its inode.
        with open(self.path / ".counters.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                try:
                    state = json.loads(f.read_text(encoding="utf-8"))
                    if not isinstance(state, dict):
                        state = {}
                except (OSError, ValueError):
                    state = {}
                state.setdefault("turns", {})
                state.setdefault("pending", {})
                yield state
                _atomic_write(f, json.dumps(state, indent=1, sort_keys=True))
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def next_turn(self, role: str, take: bool = True) -> int:
        with self._state() as state:
            n = int(state["turns"].get(role, 0)) + 1
            if take:
                state["turns"][role] = n
            return n

    def set_pending(self, role: str, pending: dict | None) -> None:
        with self._state() as state:
            if pending is None:
                state["pending"].pop(role, None)
            else:
                state["pending"][role] = pending

    def take_pending(self, role: str) -> dict | None:
        with self._state() as state:
            return state["pending"].pop(role, None)

    def record(self, entry: dict) -> None:
        f = self._file("received.jsonl")
        if f is None:
            return
        line = (json.dumps(entry, ensure_ascii=False) + "\n").encode("utf-8")
        # One O_APPEND write per record under a lock keeps lines from five
        # concurrent agents whole even for 40 KB messages.
        fd = os.open(f, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            view = memoryview(line)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would make answers unreadable to others
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def normalise_step(step, role: str, default_think_ms: int) -> dict:
    if isinstance(step, str):
        step = {"text": step}
    if not isinstance(step, dict):
        log(f"bad step for {role}: {step!r}; using default")
        step = {}
    action = step.get("action", "write")
    if action not in VALID_ACTIONS:
        log(f"unknown action {action!r} for {role}; using 'write'")
        action = "write"
    text = step.get("text")
    if not isinstance(text, str):
        text = DEFAULT_TEXTS.get(role, "MOCK ANSWER\n")
    try:
        think_ms = int(step.get("think_ms", default_think_ms))
    except (TypeError, ValueError):
        think_ms = default_think_ms
    files = step.get("files")
    if not isinstance(files, dict):
        files = {}
    try:
        hold_ms = int(step.get("hold_ms", 0))
    except (TypeError, ValueError):
        hold_ms = 0
    say_line = step.get("say")
    return {"text": text, "action": action, "think_ms": max(0, think_ms), "files": files,
            "silent": step.get("silent") is True, "hold_ms": max(0, hold_ms),
            "say": say_line if isinstance(say_line, str) else ""}


def pick_step(script: dict, role: str, turn: int, default_think_ms: int) -> dict:
    steps = script.get(role)
    if isinstance(steps, (str, dict)):
        steps = [steps]
    if not isinstance(steps, list) or not steps:
        return normalise_step({}, role, default_think_ms)
    return normalise_step(steps[min(turn, len(steps)) - 1], role, default_think_ms)


def _clean_path(raw: str) -> str:
    return raw.strip().strip("'\"`")


# Plain string scanning rather than regular expressions: messages can hold
# 60 KB single-line runs, on which a backtracking pattern goes quadratic and
# freezes the agent.


def find_marker_path(message: str, marker: str) -> str | None:
    """Return the path after the last line containing ``marker`` (to end of line)."""
    idx = message.rfind(marker)
    if idx < 0:
        return None
    rest = message[idx + len(marker):]
    path = _clean_path(rest.split("\n", 1)[0])
    return path or None


def mentioned_response_files(message: str) -> list[tuple[int, str]]:
    """Return (position, path) of every token that ends in a known response-file name."""
    found = []
    for name in RESPONSE_FILE_ROLES:
        start = 0
        while True:
            idx = message.find(name, start)
            if idx < 0:
                break
            start = idx + len(name)
            end = start
            if end < len(message) and message[end] not in PATH_DELIMITERS and message[end] not in ".:!?":
                continue  # e.g. "analyst_summary.md5": a different name
            begin = idx
            while begin > 0 and message[begin - 1] not in PATH_DELIMITERS:
                begin -= 1
            path = _clean_path(message[begin:end])
            if os.path.basename(path) == name:
                found.append((begin, path))
    found.sort()
    return found


def classify_message(message: str, last_role: str | None) -> tuple[str, str | None, str | None]:
    """(kind, role, response path) of a message: "prompt" (names the file to write), "reminder"
    (names a response file only; the role last prompted wins when several are named) or "other"."""
    path = find_marker_path(message, WRITE_MARKER)
    if path:
        return "prompt", RESPONSE_FILE_ROLES.get(os.path.basename(path)), path
    mentioned = [p for _pos, p in mentioned_response_files(message)]
    if mentioned:
        by_role = {RESPONSE_FILE_ROLES[os.path.basename(p)]: p for p in reversed(mentioned)}
        role = last_role if last_role in by_role else RESPONSE_FILE_ROLES[os.path.basename(mentioned[0])]
        return "reminder", role, by_role[role]
    return "other", None, None


class Agent:
    def __init__(self, home: Home, default_think_ms: int):
        self.home = home
        self.default_think_ms = default_think_ms
        # The role this process last served: a reminder that names several
        # response files is most likely about this one.
        self.last_role: str | None = None
        # Messages handled by this process. Every reply carries it ("#3 ..."),
        # so a poller can tell this turn's reply from the previous one.
        self.seq = 0

    def record(self, **entry) -> None:
        self.home.record(
            {
                "time": time.time(),
                "pid": os.getpid(),
                "terminal_id": os.environ.get("CAO_TERMINAL_ID"),
                "seq": self.seq,
                **entry,
            }
        )

    def handle(self, raw: str) -> None:
        self.seq += 1
        self.echo(raw)
        message = raw
        source_file = find_marker_path(raw, INDIRECTION_MARKER)
        if source_file:
            try:
                message = Path(source_file).read_text(encoding="utf-8")
            except OSError as exc:
                log(f"cannot read instructions file {source_file}: {exc}")

        kind, role, path = self.classify(message)
        self.record(
            role=role,
            message=message,
            raw=raw,
            kind=kind,
            response_file=path,
            instructions_file=source_file,
        )

        if kind == "prompt":
            if role is not None:
                self.last_role = role
            self.answer_prompt(role, path)
        elif kind == "reminder":
            self.answer_reminder(role, path)
        else:
            self.finish("ok")

    def classify(self, message: str) -> tuple[str, str | None, str | None]:
        return classify_message(message, self.last_role)

    def answer_prompt(self, role: str | None, path: str) -> None:
        if role is None:
            # A response file this suite has no role for: answer generically.
            self.think(self.default_think_ms)
            self.write_answer(path, "MOCK ANSWER\n")
            self.finish(f"wrote {path}")
            return
        script = self.home.script()
        on_answer = script.get("count") == "answered"
        turn = self.home.next_turn(role, take=not on_answer)
        step = pick_step(script, role, turn, self.default_think_ms)
        # A new prompt supersedes an answer still held back for a reminder.
        self.home.set_pending(role, None)
        self.think(step["think_ms"], step["silent"])
        if on_answer:
            self.home.next_turn(role)
        self.change_files(step["files"])
        if step["say"]:
            new_line()
            say(step["say"] + "\n")
        action = step["action"]
        if action == "error":
            new_line()
            say(f"{ERROR_TEXT}\n{PROMPT}")
        elif action == "no_file":
            self.finish(f"{role} turn {turn}: finished without writing {os.path.basename(path)}")
        elif action == "write_on_reminder":
            self.home.set_pending(role, {"text": step["text"], "path": path, "turn": turn})
            self.finish(f"{role} turn {turn}: answer held back until a reminder")
        else:
            self.write_answer(path, step["text"])
            if step["hold_ms"]:
                self.think(step["hold_ms"])      # still at work on its turn, its answer written
            self.finish(f"{role} turn {turn}: wrote {os.path.basename(path)}")

    def answer_reminder(self, role: str, path: str) -> None:
        """Reminders never consume a script step; they only release a held answer."""
        pending = self.home.take_pending(role)
        self.think(self.default_think_ms)
        if pending is None:
            self.finish(f"{role} reminder: nothing pending")
            return
        target = path if os.path.isabs(path) else pending.get("path") or path
        self.write_answer(target, pending.get("text", ""))
        self.finish(f"{role} reminder: wrote {os.path.basename(target)}")

    def change_files(self, files: dict) -> None:
        """The project edits a step asks for: write each file (making its folders), or delete it on null."""
        for name, content in files.items():
            path = Path(name)
            try:
                if content is None:
                    path.unlink(missing_ok=True)
                else:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(str(content), encoding="utf-8")
            except OSError as exc:
                log(f"cannot change {path}: {exc}")

    def write_answer(self, path: str, text: str) -> None:
        try:
            _atomic_write(Path(path), text)
        except OSError as exc:
            log(f"cannot write {path}: {exc}")

    @staticmethod
    def echo(raw: str) -> None:
        """Show the message in the transcript, as real agent CLIs do: its first line and the line
        naming the response file (the orchestrator looks for them to know the prompt arrived)."""
        lines = [line.strip() for line in raw.splitlines() if line.strip()]
        shown = lines[:1] + [line for line in lines[1:] if line.startswith(WRITE_MARKER)]
        new_line()
        say("".join(f"\u203a {line[:300]}\n" for line in shown))

    def think(self, ms: int, silent: bool = False) -> None:
        """Work for `ms` milliseconds, repainting a timer every second as a working CLI does
        (`silent`: a hung CLI, which shows nothing)."""
        # Something must be printed at once: CAO only leaves the previous
        # turn's idle/completed state when new output without a prompt arrives.
        new_line()
        say("· thinking")
        started = time.monotonic()
        while True:
            left = ms / 1000.0 - (time.monotonic() - started)
            if left <= 0:
                break
            time.sleep(min(1.0, left))
            if not silent and time.monotonic() - started < ms / 1000.0:
                say(f"\r· thinking ({int(time.monotonic() - started)}s)")
        say("\n")

    def finish(self, summary: str) -> None:
        new_line()
        say(f"{REPLY_PREFIX}#{self.seq} {summary}\n{PROMPT}")


class InputReader:
    """Turn raw terminal bytes into submitted messages.

    Raw (non-canonical) mode is required: a canonical tty line is capped at
    4095 bytes, which would silently truncate long pasted lines.
    """

    def __init__(self):
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.pending = ""  # undecided bytes: possibly a split escape sequence
        self.line: list[str] = []
        self.paste: list[str] | None = None

    def feed(self, data: bytes) -> list[str | None]:
        """Return submitted messages; None stands for end of input (Ctrl-D)."""
        self.pending += self.decoder.decode(data)
        out: list[str | None] = []
        text, self.pending = self.pending, ""
        i, n = 0, len(text)
        while i < n:
            if self.paste is not None:
                end = text.find(PASTE_END, i)
                if end < 0:
                    # Keep a possible partial end marker for the next read.
                    keep = len(PASTE_END) - 1
                    cut = max(i, n - keep)
                    self.paste.append(text[i:cut])
                    self.pending = text[cut:]
                    return out
                self.paste.append(text[i:end])
                pasted = "".join(self.paste)
                # tmux turns LF into CR unless it pastes with -r; undo either way.
                self.line.append(pasted.replace("\r\n", "\n").replace("\r", "\n"))
                self.paste = None
                i = end + len(PASTE_END)
                continue
            ch = text[i]
            if ch == "\x1b":
                if text.startswith(PASTE_START, i):
                    self.paste = []
                    i += len(PASTE_START)
                    continue
                m = ESCAPE_SEQUENCE_RE.match(text, i)
                if m is None:
                    self.pending = text[i:]  # incomplete escape sequence
                    return out
                i = m.end()  # arrow keys and the like: ignored
                continue
            if ch in "\r\n":
                msg = "".join(self.line)
                self.line = []
                # Empty submissions (CAO's second Enter) are not messages.
                if msg.strip():
                    out.append(msg)
            elif ch in "\x7f\x08":
                if self.line and self.line[-1]:
                    self.line[-1] = self.line[-1][:-1]
                    if not self.line[-1]:
                        self.line.pop()
            elif ch == "\x04":
                if not self.line:
                    out.append(None)
            elif ch == "\x15":  # Ctrl-U clears the line
                self.line = []
            elif ch >= " " or ch == "\t":
                self.line.append(ch)
            i += 1
        return out


@contextlib.contextmanager
def raw_terminal(fd: int):
    if not os.isatty(fd):
        yield
        return
    old = termios.tcgetattr(fd)
    new = termios.tcgetattr(fd)
    new[0] &= ~(termios.ICRNL | termios.INLCR | termios.IGNCR | termios.IXON)
    new[3] &= ~(termios.ICANON | termios.ECHO | termios.IEXTEN)
    new[6][termios.VMIN] = 1
    new[6][termios.VTIME] = 0
    termios.tcsetattr(fd, termios.TCSANOW, new)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, old)


def package_version() -> str:
    """The installed project's version ("unknown" when run from a copy that is not installed)."""
    try:
        return importlib.metadata.version("cao-orchestrator-loop")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    """Serve one terminal until /exit or end of input.

    Arguments other than --help and --version are ignored: CAO always passes
    "--delay-ms 50", and the pace comes from MOCK_AGENT_THINK_MS and script.json.
    """
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(__doc__.strip())
        return 0
    if "--version" in argv or "-V" in argv:
        print(f"mock_cli (cao-orchestrator-loop) {package_version()}")
        return 0
    try:
        think_ms = int(os.environ.get("MOCK_AGENT_THINK_MS", "300"))
    except ValueError:
        think_ms = 300

    home = Home(os.environ.get("MOCK_AGENT_HOME"))
    agent = Agent(home, think_ms)
    reader = InputReader()
    # Ctrl-C should not kill the agent mid-file-write; CAO never sends it in
    # these tests, and a person poking at the pane can use Ctrl-D or /exit.
    signal.signal(signal.SIGINT, lambda *_: log("interrupt ignored"))

    fd = sys.stdin.fileno()
    with raw_terminal(fd):
        # Ask the terminal for bracketed paste: newer tmux only frames pastes
        # for panes that requested it.
        say("\x1b[?2004h")
        say(f"mock_cli ready (pid {os.getpid()}, terminal {os.environ.get('CAO_TERMINAL_ID')})\n{PROMPT}")
        try:
            while True:
                try:
                    data = os.read(fd, 65536)
                except InterruptedError:
                    continue
                if not data:
                    return 0
                try:
                    messages = reader.feed(data)
                except Exception as exc:  # never let odd bytes kill the agent
                    log(f"cannot parse input: {exc!r}; input discarded")
                    reader = InputReader()
                    continue
                for msg in messages:
                    if msg is None or msg.strip() == "/exit":
                        # CAO's POST /terminals/{id}/exit types "/exit".
                        if msg is not None:
                            agent.seq += 1
                            agent.record(role=None, message=msg, raw=msg, kind="other")
                        new_line()
                        say("bye\n")
                        return 0
                    try:
                        agent.handle(msg)
                    except Exception as exc:  # keep the agent alive on any odd input
                        log(f"failed to handle message: {exc!r}")
                        for line in traceback.format_exc().splitlines()[-5:]:
                            log(line)
                        agent.finish("internal error, see log above")
        finally:
            with contextlib.suppress(OSError):
                say("\x1b[?2004l")


if __name__ == "__main__":
    sys.exit(main())
