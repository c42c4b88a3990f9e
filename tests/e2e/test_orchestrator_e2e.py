"""The orchestrator as a user runs it: a real process against a real cao-server.

Each test starts `python run_orchestrator_loop.py` with environment settings,
against the private cao-server of the `cao` fixture whose five terminals run
the scripted `mock_cli` agent. Assertions cover the exit code, the exact
sequence of agents prompted (as the agents themselves recorded it), the final
state file and the archived replies.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "run_orchestrator_loop.py"

TASK = """*** ORIGINAL EXPLORE SUMMARY ***
Build a greeting CLI: `greet NAME` prints `Hello, NAME!`.
*** SCENARIO TEST ***
Run `greet World` and expect `Hello, World!` on stdout.
"""

FAIL_REPLY = ("RESULT: FAIL\nEVIDENCE:\n- greet World printed 'Hello World' (missing comma)\n"
              "- Recommended next fix: the format string in greet.py\n")
PASS_REPLY = "RESULT: PASS\nEVIDENCE:\n- greet World printed 'Hello, World!'\n"
PROGRAMMER_REPLY = ("PROGRAMMER_SUMMARY:\n- Files changed: greet.py, tests/test_greet.py\n"
                    "- Behavior implemented: greet NAME prints a greeting\n- Tests run: pytest (2 passed)\n")
REVISE_ANALYSIS = ("REVIEW_RESULT: REVISE\nREVIEW_NOTES:\n"
                   "- P1 traceability: the empty-NAME case is not traced to the scenario\n")

QUICK_ROUND = ["analyst", "peer_analyst", "programmer", "peer_programmer", "tester"]
SHORT_ROUND = ["programmer", "peer_programmer", "tester"]


class Run:
    """One orchestrator working directory and the command that drives it."""

    def __init__(self, cao, **settings: str):
        self.cao = cao
        self.wd = cao.new_workdir("project")
        self.task = self.wd.parent / f"{self.wd.name}-task.md"
        self.task.write_text(TASK, encoding="utf-8")
        self.state_file = self.wd / ".tmp" / "orchestrator-loop-state.json"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("CAO_", "MOCK_AGENT_", "NTFY_"))}
        self.env.update(cao.env)
        self.env.update(WD=str(self.wd), PROMPT_FILE=str(self.task), POLL_SECONDS="0.2",
                        IDLE_GRACE_SECONDS="10", RESPONSE_TIMEOUT="60", MIN_REVIEW_CYCLES_BEFORE_APPROVAL="1")
        self.env.update(settings)

    def start(self) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(SCRIPT)], cwd=REPO_ROOT, env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def run(self, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(SCRIPT)], cwd=REPO_ROOT, env=self.env,
                              capture_output=True, text=True, timeout=timeout)

    def state(self) -> dict:
        return json.loads(self.state_file.read_text(encoding="utf-8"))

    def archived(self) -> list[str]:
        """The archived replies (NNN-<role>.md), without the run summary."""
        return sorted(p.name for p in Path(self.state()["run_dir"]).glob("[0-9][0-9][0-9]-*")
                      if not p.name.endswith(".prompt.md"))

    def archived_text(self, name: str) -> str:
        return (Path(self.state()["run_dir"]) / name).read_text(encoding="utf-8")

    def prompts(self) -> list[dict]:
        return [r for r in self.cao.received() if r.get("kind") == "prompt"]

    def roles_prompted(self) -> list[str]:
        return [r["role"] for r in self.prompts()]

    def prompts_for(self, role: str) -> list[str]:
        return [r["message"] for r in self.prompts() if r["role"] == role]


def wait_until_sent(run: Run, process: subprocess.Popen, role: str, timeout: float = 120) -> None:
    """Until `role`'s agent has its prompt and the loop has said it sent it (its run.log): from then on the loop
    waits on the agent, which works on it -- a stop now is a stop mid-turn, however slow the machine."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            log = (Path(run.state()["run_dir"]) / "run.log").read_text(encoding="utf-8")
        except (OSError, ValueError, KeyError):           # not written yet
            log = ""
        if f"{role}: prompt sent to terminal" in log and role in run.roles_prompted():
            return
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"the {role}'s prompt never went out"
        time.sleep(0.05)


def numbered(roles: list[str]) -> list[str]:
    return [f"{n:03d}-{role}.md" for n, role in enumerate(roles, 1)]


def explain(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-2000:]}"


def assert_created_together(cao, state: dict) -> None:
    """The run's five terminals are in the one session CAO named, and were created at the same time:
    CAO had begun starting every agent CLI before any of them was ready (CAO's own log says when)."""
    session = state["session_name"]
    assert re.fullmatch(r"cao-loop-[0-9a-f]{8}", session)
    ids = set(state["terminals"].values())
    with cao.http() as client:
        assert {client.get(f"/terminals/{tid}").json()["session_name"] for tid in ids} == {session}
    log = "".join(path.read_text(errors="replace")
                  for path in sorted((cao.home / ".aws" / "cli-agent-orchestrator" / "logs").glob("cao_*.log")))
    events = [(kind, tid) for kind, tid in re.findall(
        r"(Waiting for shell to be ready for terminal|wait_until_status) \[?([0-9a-f]{8})\]?(?:\.\.\.|: reached)", log)
        if tid in ids]
    started = [tid for kind, tid in events if kind.startswith("Waiting")]
    first_ready = next(i for i, (kind, _) in enumerate(events) if kind == "wait_until_status")
    assert sorted(started) == sorted(ids)
    assert all(kind.startswith("Waiting") for kind, _ in events[:first_ready]) and first_ready == 5, events


def test_one_round_all_approved_pass_exits_0(cao):
    """Scenario 1: default review minimum (2 cycles), everything approved, tester PASS -> exit 0."""
    run = Run(cao, MIN_REVIEW_CYCLES_BEFORE_APPROVAL="2")
    cao.set_script({"tester": [PASS_REPLY]})
    result = run.run()
    assert result.returncode == 0, explain(result)
    sequence = ["analyst", "peer_analyst", "analyst", "peer_analyst",
                "programmer", "peer_programmer", "programmer", "peer_programmer", "tester"]
    assert run.roles_prompted() == sequence
    state = run.state()
    assert state["final_status"] == "PASS" and state["current_phase"] == "done" and state["current_round"] == 1
    assert set(state["terminals"]) == set(QUICK_ROUND)
    assert all(len(tid) == 8 for tid in state["terminals"].values())
    assert_created_together(cao, state)
    assert f"all at once in CAO session {state['session_name']}" in result.stdout
    assert run.archived() == numbered(sequence)
    assert run.archived_text("009-tester.md") == PASS_REPLY
    assert "RESULT: PASS" in result.stdout


def test_fail_then_pass_retries_programmer_peer_tester_only(cao):
    """Scenario 2: the round-2 prompts go to programmer -> peer_programmer -> tester, with the evidence."""
    run = Run(cao)
    cao.set_script({"tester": [FAIL_REPLY, PASS_REPLY], "programmer": [PROGRAMMER_REPLY]})
    result = run.run()
    assert result.returncode == 0, explain(result)
    assert run.roles_prompted() == QUICK_ROUND + SHORT_ROUND
    retry = run.prompts_for("programmer")[1]
    assert ("Test failure feedback:\nRESULT: FAIL\nEVIDENCE:\n- greet World printed 'Hello World' "
            "(missing comma)") in retry
    assert "Your previous changes (context):\n- Files changed: greet.py, tests/test_greet.py" in retry
    assert "System analyst handoff:" not in retry
    state = run.state()
    assert state["final_status"] == "PASS" and state["current_round"] == 2
    assert state["outputs"]["analyst"].startswith("ANALYST_SUMMARY:")
    assert run.archived() == numbered(QUICK_ROUND + SHORT_ROUND)
    assert run.archived_text("005-tester.md") == FAIL_REPLY


def test_tester_always_fails_max_rounds_2_exits_1(cao):
    """Scenario 3: no PASS within MAX_ROUNDS=2 -> exit 1, final_status FAIL."""
    run = Run(cao, MAX_ROUNDS="2")
    cao.set_script({"tester": [FAIL_REPLY]})
    result = run.run()
    assert result.returncode == 1, explain(result)
    assert run.roles_prompted() == QUICK_ROUND + SHORT_ROUND
    state = run.state()
    assert state["final_status"] == "FAIL" and state["current_phase"] == "done"
    assert run.archived() == numbered(QUICK_ROUND + SHORT_ROUND)
    assert "FAIL: no PASS within MAX_ROUNDS=2" in result.stdout


def test_sigint_while_agent_works_then_same_command_resumes_to_pass(cao):
    """Scenario 4: SIGINT mid-turn -> exit 130 with state saved; rerunning the same command resumes."""
    run = Run(cao)
    cao.set_script({"programmer": [{"text": PROGRAMMER_REPLY, "think_ms": 3000}, PROGRAMMER_REPLY]})
    process = run.start()
    wait_until_sent(run, process, "programmer")      # the programmer is thinking now (3 s)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=30)
    assert process.returncode == 130, out + err
    assert "interrupted (SIGINT); state saved" in err
    state = run.state()
    assert state["final_status"] == "RUNNING" and state["current_phase"] == "programmer"
    assert state["phase_step"] == "author" and state["in_flight"]["role"] == "programmer"

    # Rerun at once: the interrupted programmer is still thinking. Its prompt is not sent
    # again; the resumed loop waits for (or finds) the answer to the prompt in flight.
    result = run.run()                               # the same command, no RESUME
    assert result.returncode == 0, explain(result)
    assert "resuming run from" in result.stdout
    assert ("still working on the prompt sent before the interruption" in result.stdout
            or "taking the reply written while the loop was down" in result.stdout)
    assert run.roles_prompted() == QUICK_ROUND
    assert cao.counters()["turns"]["programmer"] == 1
    state = run.state()
    assert state["final_status"] == "PASS" and state["in_flight"] is None
    assert run.archived() == numbered(QUICK_ROUND)
    assert run.archived_text("003-programmer.md") == PROGRAMMER_REPLY


def test_start_agent_programmer(cao):
    """Scenario 5: START_AGENT=programmer skips the analysis; the placeholder stands in for it."""
    run = Run(cao, START_AGENT="programmer")
    cao.set_script({"tester": [FAIL_REPLY, PASS_REPLY]})
    result = run.run()
    assert result.returncode == 0, explain(result)
    assert run.roles_prompted() == SHORT_ROUND + SHORT_ROUND
    first, second = run.prompts_for("programmer")
    assert "System analyst handoff:\n(No upstream output" in first
    assert "Test failure feedback:" in second and "System analyst handoff:" not in second
    state = run.state()
    assert state["outputs"]["analyst"].startswith("(No upstream output")
    assert state["final_status"] == "PASS"
    assert run.archived() == numbered(SHORT_ROUND + SHORT_ROUND)


def test_reviewer_revise_then_approved_notes_reach_next_analyst_prompt(cao):
    """Scenario 6: REVISE notes go to the analyst's next cycle; then APPROVED moves on."""
    run = Run(cao)
    cao.set_script({"peer_analyst": [REVISE_ANALYSIS, {}]})  # {}: the default approving review
    result = run.run()
    assert result.returncode == 0, explain(result)
    assert run.roles_prompted() == ["analyst", "peer_analyst"] + QUICK_ROUND
    second = run.prompts_for("analyst")[1]
    assert ("Latest peer analyst feedback:\nREVIEW_NOTES:\n- P1 traceability: the empty-NAME case is not "
            "traced to the scenario") in second
    assert run.archived_text("002-peer_analyst.md") == REVISE_ANALYSIS
    assert run.state()["analyst_feedback"] == ""


def test_cleanup_on_exit_leaves_no_agent_running(cao):
    """Scenario 7: CLEANUP_ON_EXIT=1 exits all five agents and removes their CAO session (no tmux
    session of idle shells is left behind); the state records it."""
    run = Run(cao, CLEANUP_ON_EXIT="1", START_AGENT="tester")
    result = run.run()
    assert result.returncode == 0, explain(result)
    state = run.state()
    assert state["terminals_exited"] is True
    session = state["session_name"]
    assert session not in cao.tmux_sessions()
    with cao.http(timeout=10) as client:
        assert client.get(f"/sessions/{session}").status_code == 404
    assert "a rerun starts a new run" in result.stdout


def test_agent_that_never_writes_its_file_is_reminded_then_run_stops(cao):
    """Robust handoff: the agent idles without its file -> one reminder -> strict stop, resumable."""
    run = Run(cao, START_AGENT="tester", IDLE_GRACE_SECONDS="1")
    cao.set_script({"tester": [{"action": "no_file", "text": "I ran the tests (not writing any file)"}]})
    result = run.run()
    assert result.returncode == 3, explain(result)
    reminders = [r for r in cao.received() if r.get("kind") == "reminder"]
    assert [r["role"] for r in reminders] == ["tester"]
    assert "test_result.md" in reminders[0]["message"]
    assert "reminder 1/1 sent" in result.stdout
    err = result.stderr.strip()
    assert "\n" not in err and "tester agent" in err and "went idle without writing" in err
    assert run.state()["final_status"] == "RUNNING" and run.state()["current_phase"] == "tester"


def test_agent_that_writes_only_after_the_reminder(cao):
    run = Run(cao, START_AGENT="tester", IDLE_GRACE_SECONDS="1")
    cao.set_script({"tester": [{"action": "write_on_reminder", "text": PASS_REPLY}]})
    result = run.run()
    assert result.returncode == 0, explain(result)
    assert [r["role"] for r in cao.received() if r.get("kind") == "reminder"] == ["tester"]
    assert run.archived_text("001-tester.md") == PASS_REPLY


def test_server_that_requires_a_token(cao_with_token):
    """With CAO_AUTH_LOCAL_TOKEN the run goes through; without it, a clear 401 message and no state."""
    from .conftest import E2E_TOKEN

    cao_with_token.set_script({})
    run = Run(cao_with_token, START_AGENT="tester")
    result = run.run()
    assert result.returncode == 2, explain(result)
    assert "requires a token" in result.stderr and "CAO_AUTH_LOCAL_TOKEN" in result.stderr
    assert not run.state_file.exists()

    run.env["CAO_AUTH_LOCAL_TOKEN"] = E2E_TOKEN
    result = run.run()
    assert result.returncode == 0, explain(result)
    assert run.roles_prompted() == ["tester"]
    written = [p for p in run.wd.rglob("*") if p.is_file()]
    assert all(E2E_TOKEN not in p.read_text(errors="replace") for p in written)
    assert E2E_TOKEN not in result.stdout + result.stderr


def write_two_story_change(wd: Path) -> None:
    """An OpenSpec change with two stories (tasks.md sections) and one scenario."""
    change = wd / "openspec" / "changes" / "add-greeting"
    (change / "specs" / "greeting").mkdir(parents=True)
    (change / "tasks.md").write_text("## 1. Parse the name\n- [ ] 1.1 Read NAME\n\n"
                                     "## 2. Print the greeting\n- [ ] 2.1 Print Hello, NAME!\n")
    (change / "specs" / "greeting" / "spec.md").write_text(
        "#### Scenario: Greets\n- **WHEN** `greet World` runs\n- **THEN** it prints `Hello, World!`\n")


def test_story_mode_failed_then_complete(cao):
    """Story mode on the real server: story 1 FAILED then COMPLETE (retry carries the reason), then story 2."""
    run = Run(cao, STORY_MODE="1", START_AGENT="programmer")
    write_two_story_change(run.wd)
    summary = "PROGRAMMER_SUMMARY:\n- Files changed: greet.py\n- Behavior implemented: a story\n"
    cao.set_script({"programmer": [summary + "<promise>FAILED: argv parsing crashes on empty NAME</promise>\n",
                                   summary + "<promise>COMPLETE</promise>\n"]})
    result = run.run()
    assert result.returncode == 0, explain(result)
    assert run.roles_prompted() == ["programmer"] * 3 + ["peer_programmer", "tester"]
    first, retry, second_story = run.prompts_for("programmer")
    assert 'story 1 "Parse the name" (attempt 1 of 3)' in first and "[greeting] Scenario: Greets" in first
    assert 'story 1 "Parse the name" (attempt 2 of 3)' in retry
    assert "the previous attempt failed:\nargv parsing crashes on empty NAME" in retry
    assert 'story 2 "Print the greeting" (attempt 1 of 3)' in second_story
    review = run.prompts_for("peer_programmer")[0]
    assert '- Story 1 "Parse the name": COMPLETE (attempt 2)' in review
    assert run.state()["final_status"] == "PASS"


def test_a_run_that_ended_in_fail_goes_on_with_more_rounds_then_a_plain_rerun_starts_anew(cao):
    """FAIL at MAX_ROUNDS=1 (its last line names the command that goes on); RESUME=1 MAX_ROUNDS=2 continues the
    same run in round 2 -- no analyst turn again, the tester's evidence in the programmer's prompt, the same
    agents -- to PASS, one report for both; a plain rerun after that PASS starts a new run."""
    run = Run(cao, MAX_ROUNDS="1")
    cao.set_script({"tester": [FAIL_REPLY, PASS_REPLY]})
    failed = run.run()
    assert failed.returncode == 1, explain(failed)
    assert "to go on with more rounds: RESUME=1 MAX_ROUNDS=2" in failed.stdout
    first = run.state()
    assert (first["final_status"], first["current_round"]) == ("FAIL", 1)

    run.env.update(RESUME="1", MAX_ROUNDS="2")
    result = run.run()
    assert result.returncode == 0, explain(result)
    assert run.roles_prompted() == QUICK_ROUND + SHORT_ROUND                 # round 2 only: no analyst again
    assert "missing comma" in run.prompts_for("programmer")[1]              # the tester's evidence
    state = run.state()
    assert (state["final_status"], state["current_round"]) == ("PASS", 2)
    assert state["terminals"] == first["terminals"] and state["run_dir"] == first["run_dir"]
    assert run.archived() == numbered(QUICK_ROUND + SHORT_ROUND)
    report = (Path(state["run_dir"]) / "report.html").read_text(encoding="utf-8")
    assert report.count('<a class="turn"') == len(QUICK_ROUND + SHORT_ROUND)   # one report: both invocations

    run.env.pop("RESUME")
    again = run.run()
    assert again.returncode == 0, explain(again)
    assert "finished with PASS in round 2" in again.stdout and "starting a new run" in again.stdout
    assert run.state()["run_dir"] != first["run_dir"]
