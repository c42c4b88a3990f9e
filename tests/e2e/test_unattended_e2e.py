"""The orchestrator left to run on its own: server crashes, a second copy, Ctrl-C at start-up.

Each test drives `python run_orchestrator_loop.py` against a private cao-server
(fixture ``restartable_cao``, a server of this module alone) whose terminals
run the scripted ``mock_cli`` agent, and disturbs the run the way an unattended
machine would: cao-server killed with SIGKILL and started again on the same
port while an agent works or while a prompt is being delivered, the same
command started a second time, or Ctrl-C while the terminals are being
created.

The yardstick is always the agents' own record: ``received.jsonl`` (every
message an agent got) and ``counters.json`` (turns per role). A prompt that
reached an agent twice shows there as an extra turn or an extra message, so
"the run recovered" can never hide "and repeated work".
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from .test_orchestrator_e2e import (
    FAIL_REPLY,
    PASS_REPLY,
    PROGRAMMER_REPLY,
    QUICK_ROUND,
    REPO_ROOT,
    SCRIPT,
    SHORT_ROUND,
    Run,
    numbered,
)

pytestmark = pytest.mark.e2e

# Status reads ride out the outage; a still screen counts as idle after 1 s
# (the default 5 s would only slow the tests); a prompt that never arrived is
# sent again after 3 s of an idle agent.
UNATTENDED = dict(API_RETRY_SECONDS="120", QUIET_SCREEN_SECONDS="1", IDLE_GRACE_SECONDS="3")

FAIL_THEN_PASS = QUICK_ROUND + SHORT_ROUND
FAIL_THEN_PASS_TURNS = {"analyst": 1, "peer_analyst": 1, "programmer": 2, "peer_programmer": 2, "tester": 2}
ONE_ROUND_TURNS = {role: 1 for role in QUICK_ROUND}

UNKNOWN_STATUS_LINE = "CAO cannot tell the status"
BROKE_OFF_LINE = "broke off"
RESENT_LINE = "sending the whole prompt again"
WRITE_MARKER = "Write your complete answer to this file:"


class LiveRun:
    """A started orchestrator whose stdout and stderr are read as they come.

    Tests wait for a log line and act within a few hundred milliseconds of
    it, so the output is collected line by line by reader threads instead of
    at the end.
    """

    def __init__(self, run: Run):
        self.run = run
        self.process = subprocess.Popen([sys.executable, str(SCRIPT)], cwd=REPO_ROOT, env=run.env,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        self.out: list[str] = []
        self.err: list[str] = []
        self._new_line = threading.Condition()
        self._readers = [threading.Thread(target=self._read, args=(stream, lines), daemon=True)
                         for stream, lines in ((self.process.stdout, self.out), (self.process.stderr, self.err))]
        for reader in self._readers:
            reader.start()

    def _read(self, stream, lines: list[str]) -> None:
        for line in stream:
            with self._new_line:
                lines.append(line)
                self._new_line.notify_all()
        with self._new_line:
            self._new_line.notify_all()

    @property
    def stdout(self) -> str:
        return "".join(self.out)

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    def wait_for_line(self, pattern: str, timeout: float = 60) -> str:
        """Block until a stdout line matches ``pattern`` (a regular expression); return it."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        with self._new_line:
            while True:
                for line in self.out[seen:]:
                    if regex.search(line):
                        return line
                seen = len(self.out)
                if self.process.poll() is not None and not any(r.is_alive() for r in self._readers):
                    raise AssertionError(f"the run ended before a line matched {pattern!r}\n{self.explain()}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"no line matched {pattern!r} within {timeout}s\n{self.explain()}")
                self._new_line.wait(min(remaining, 0.2))

    def wait_until(self, predicate, what: str, timeout: float = 60, interval: float = 0.05) -> None:
        """Poll ``predicate`` until true; fail naming ``what`` if the run ends or the time runs out."""
        deadline = time.monotonic() + timeout
        while not predicate():
            assert self.process.poll() is None, f"the run ended before {what}\n{self.explain()}"
            assert time.monotonic() < deadline, f"not within {timeout}s: {what}\n{self.explain()}"
            time.sleep(interval)

    def finish(self, timeout: float = 150) -> int:
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"the run did not finish within {timeout}s\n{self.explain()}") from None
        for reader in self._readers:
            reader.join(timeout=10)
        return code

    def explain(self) -> str:
        code = self.process.poll()
        state = self.run.state_file.read_text() if self.run.state_file.exists() else "(no state file)"
        return (f"exit {code}\n--- stdout\n{self.stdout[-6000:]}\n--- stderr\n{self.stderr[-3000:]}"
                f"\n--- state file\n{state[-3000:]}")


@pytest.fixture
def start_run():
    """Start a ``LiveRun``; one a failed test leaves running is killed, so it cannot outlive its server."""
    started: list[LiveRun] = []

    def start(run: Run) -> LiveRun:
        live = LiveRun(run)
        started.append(live)
        return live

    yield start
    for live in started:
        if live.process.poll() is None:
            live.process.kill()
            live.process.wait(timeout=10)


def programmer_prompt_delivered(live, run, cao) -> str:
    """Wait until the programmer got its prompt and CAO answered that send; the programmer's terminal."""
    live.wait_until(lambda: "programmer" in run.roles_prompted(), "the programmer got its prompt")
    programmer = run.state()["terminals"]["programmer"]
    live.wait_until(lambda: f'"POST /terminals/{programmer}/input?' in cao.server_log(),
                    "CAO answered the programmer's prompt", timeout=10)
    return programmer


def unattended_run(cao, **settings: str) -> Run:
    return Run(cao, **{**UNATTENDED, **settings})


def assert_turns_exactly(run: Run, roles: list[str], turns: dict, live: LiveRun) -> None:
    """Every agent got exactly the prompts of an undisturbed run, each once, and nothing else."""
    received = run.cao.received()
    assert run.roles_prompted() == roles, live.explain()
    assert run.cao.counters().get("turns") == turns, live.explain()
    extra = [(r.get("role"), r.get("kind"), r.get("message", "")[:120]) for r in received if r.get("kind") != "prompt"]
    assert extra == [], f"messages besides the prompts (reminders, stray input): {extra}\n{live.explain()}"


def assert_finished_pass(run: Run, roles: list[str], live: LiveRun) -> None:
    state = run.state()
    assert state["final_status"] == "PASS" and state["current_phase"] == "done", live.explain()
    assert state["in_flight"] in (None, {}), live.explain()
    assert run.archived() == numbered(roles), live.explain()


# ---------------------------------------------------------------------------
# 1. The server dies while an agent works
# ---------------------------------------------------------------------------


def test_server_killed_while_agent_works_run_finishes_without_repeating_a_turn(restartable_cao, start_run):
    """SIGKILL cao-server while the programmer thinks, down ~5 s, restarted: same turns, exit 0.

    The kill comes once CAO has answered the programmer's prompt (its access
    log says so), so only the watching of the turn is disturbed, not the
    delivery. The programmer is still thinking when the server is back (it
    thinks 30 s: a loaded machine may take ten seconds or more to start the
    server again); from then on CAO answers ``unknown`` for every terminal of
    the run, so the rest of the turn and a whole FAIL -> PASS round are judged
    by reply files and screens alone. The thinking mock repaints its timer
    every second, so its screen is never still and it is never reminded.
    """
    cao = restartable_cao
    run = unattended_run(cao, IDLE_GRACE_SECONDS="10")
    cao.set_script({"tester": [FAIL_REPLY, PASS_REPLY],
                    "programmer": [{"text": PROGRAMMER_REPLY, "think_ms": 30000}, PROGRAMMER_REPLY]})
    live = start_run(run)
    programmer_prompt_delivered(live, run, cao)
    cao.stop_server()
    reply_file = Path(next(r for r in run.prompts() if r["role"] == "programmer")["response_file"])
    assert not reply_file.exists(), "the programmer was done before the kill: nothing was tested"
    time.sleep(5)
    cao.start_server_again()
    assert not reply_file.exists(), "the programmer was done before the restart: its turn was not watched"

    code = live.finish()
    assert code == 0, live.explain()
    assert_turns_exactly(run, FAIL_THEN_PASS, FAIL_THEN_PASS_TURNS, live)
    assert_finished_pass(run, FAIL_THEN_PASS, live)
    assert run.archived_text("003-programmer.md") == PROGRAMMER_REPLY
    assert "unreachable" in live.stdout, live.explain()          # it did see the outage
    assert BROKE_OFF_LINE not in live.stdout, live.explain()     # and the delivery was not caught in it
    assert UNKNOWN_STATUS_LINE in live.stdout, live.explain()
    assert RESENT_LINE not in live.stdout, live.explain()


# ---------------------------------------------------------------------------
# 2. The server dies while a prompt is being delivered
# ---------------------------------------------------------------------------

# How long after "prompt sent" the server is killed. CAO's POST input takes
# about 0.85 s: tmux paste, ~0.3 s pause, Enter (the mock submits here),
# 0.5 s, a second Enter. So the early kill mostly lands before the Enter (the
# prompt never arrives, or sits unsubmitted in the input line), the late one
# after it (the prompt arrived; only the answer to the POST is lost).
KILL_DELAYS = {"early": 0.1, "late": 0.6}


@pytest.mark.parametrize("when", sorted(KILL_DELAYS))
def test_server_killed_while_a_prompt_is_delivered_no_turn_is_repeated(restartable_cao, start_run, when):
    """SIGKILL cao-server during the programmer's POST input; restarted after 3 s.

    Either outcome is right -- the prompt arrived (watched, not re-sent) or it
    did not (sent again once) -- as long as every role's turns are exactly an
    undisturbed run's. A kill that missed the POST (it had already returned)
    exercises nothing, so it is tried again on a new run with less delay.
    """
    cao = restartable_cao
    delay = KILL_DELAYS[when]
    for attempt in range(3):
        run = unattended_run(cao)
        cao.set_script({"tester": [FAIL_REPLY, PASS_REPLY], "programmer": [PROGRAMMER_REPLY]})
        live = start_run(run)
        live.wait_for_line(r"\| programmer: prompt sent to terminal")
        time.sleep(delay)
        cao.restart_server(down_seconds=3)
        code = live.finish()
        assert code == 0, live.explain()
        if BROKE_OFF_LINE in live.stdout:
            break
        assert_turns_exactly(run, FAIL_THEN_PASS, FAIL_THEN_PASS_TURNS, live)
        cao.kill_all_sessions()
        delay /= 2
    else:
        pytest.fail(f"the kill never caught the delivery in flight in 3 tries\n{live.explain()}")

    resent = RESENT_LINE in live.stdout
    first_programmer_prompt = next(r for r in cao.received() if r.get("role") == "programmer")
    pasted_twice = first_programmer_prompt["raw"].count(WRITE_MARKER) > 1
    outcome = ("never arrived; sent again" if resent and not pasted_twice
               else "pasted but not submitted; sent again, both pastes submitted as one message" if resent
               else "arrived; not sent again")
    print(f"kill {when} ({delay:.2f}s after 'prompt sent', attempt {attempt + 1}): delivery {outcome}")

    assert_turns_exactly(run, FAIL_THEN_PASS, FAIL_THEN_PASS_TURNS, live)
    assert_finished_pass(run, FAIL_THEN_PASS, live)
    assert UNKNOWN_STATUS_LINE in live.stdout, live.explain()
    assert live.stdout.count(RESENT_LINE) <= 1, live.explain()


# ---------------------------------------------------------------------------
# 3. The same command started twice
# ---------------------------------------------------------------------------


def test_second_invocation_on_the_same_state_file_exits_75_and_touches_nothing(restartable_cao, start_run):
    """A second copy (same env, same state file) stops at once with 75; the first finishes undisturbed."""
    cao = restartable_cao
    run = unattended_run(cao)
    cao.set_script({"programmer": [{"text": PROGRAMMER_REPLY, "think_ms": 6000}]})
    live = start_run(run)
    live.wait_until(lambda: "programmer" in run.roles_prompted(), "the programmer got its prompt")
    sessions_before = cao.tmux_sessions()
    state_before = run.state_file.read_text()

    second = run.run(timeout=30)
    assert second.returncode == 75, f"exit {second.returncode}\n{second.stdout}\n{second.stderr}"
    err_lines = second.stderr.splitlines()
    assert len(err_lines) == 1, second.stderr
    assert f"pid {live.process.pid} since" in err_lines[0], second.stderr
    assert second.stdout == "", second.stdout
    assert cao.tmux_sessions() == sessions_before          # no terminals of its own
    assert live.process.poll() is None, live.explain()
    # The programmer is still thinking, so the first run has not written since.
    assert run.state_file.read_text() == state_before

    code = live.finish()
    assert code == 0, live.explain()
    assert_turns_exactly(run, QUICK_ROUND, ONE_ROUND_TURNS, live)
    assert_finished_pass(run, QUICK_ROUND, live)


# ---------------------------------------------------------------------------
# 4. Ctrl-C while the terminals are being created
# ---------------------------------------------------------------------------


def _session_terminals(cao, session: str) -> list[str]:
    with cao.http(timeout=10) as client:
        answer = client.get(f"/sessions/{session}/terminals")
    if answer.status_code == 404:
        return []
    answer.raise_for_status()
    return sorted(t["id"] for t in answer.json())


def _pane_commands(cao, session: str) -> list[str]:
    proc = cao.tmux("list-panes", "-s", "-t", f"={session}", "-F", "#{pane_current_command}")
    return proc.stdout.split() if proc.returncode == 0 else []


@pytest.mark.parametrize("moment", ["first terminal starting", "other four starting"])
def test_ctrl_c_during_start_up_exits_every_terminal_it_created(restartable_cao, start_run, moment):
    """SIGINT while CAO creates the run's terminals: exit 130, and no agent of the run is left running.

    The interrupt is sent once the run's tmux session exists (CAO is starting
    the analyst; the other four are added to it a moment later) or once it has
    a second window (the other four are being created). Every terminal CAO made
    for the run is exited and their CAO session removed, and no terminal may
    appear after that.
    """
    cao = restartable_cao
    run = unattended_run(cao)
    before = set(cao.tmux_sessions())
    live = start_run(run)

    def new_sessions() -> list[str]:          # the run's: not the window its look at the agents' shells opens
        return [s for s in cao.tmux_sessions() if s not in before and not s.startswith("cao-loop-check-")]

    def windows() -> list[str]:
        return cao.tmux("list-windows", "-t", f"={session}", "-F", "#{window_id}").stdout.split()

    live.wait_until(lambda: bool(new_sessions()), "the run's tmux session appeared", timeout=30)
    (session,) = new_sessions()
    if moment == "other four starting":
        live.wait_until(lambda: len(windows()) >= 2, "a second terminal was being created", timeout=30)
    live.process.send_signal(signal.SIGINT)

    code = live.finish(timeout=60)
    assert code == 130, live.explain()
    assert "interrupted (SIGINT)" in live.stderr and "state saved" not in live.stderr, live.explain()
    assert "ending the terminals being created first" in live.stdout, live.explain()
    assert not run.state_file.exists(), live.explain()
    assert run.roles_prompted() == [], live.explain()

    # Every terminal it made is exited and their CAO session removed: no session of idle shells is left.
    deadline = time.monotonic() + 15
    while session in cao.tmux_sessions() or _session_terminals(cao, session):
        assert time.monotonic() < deadline, (
            f"session {session} still there: panes {_pane_commands(cao, session)}\n{live.explain()}")
        time.sleep(0.2)
    # A creation nobody waited for would start its agent only now: look again a little later.
    time.sleep(5)
    assert new_sessions() == [] and _session_terminals(cao, session) == [], live.explain()
