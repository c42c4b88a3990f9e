"""VERIFY_PASS: the loop runs PROJECT_TEST_CMD itself after a tester's PASS, and only exit 0 lets it stand."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_main
from fake_cao import PASS_REPLY, PROGRAMMER_REPLY
from test_loop import QUICK, QUICK_ROUND

RETRY = ["programmer", "peer_programmer", "tester"]


def test_verify_pass_needs_the_test_command(load_orch, fake_cao, prompt_file, capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), VERIFY_PASS="1", **QUICK)
    assert run_main(m) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: VERIFY_PASS=1 needs PROJECT_TEST_CMD: set it to the command that runs the project's "
                   "tests (exit 0 when they pass), or unset VERIFY_PASS")
    assert fake_cao.requests == []


def test_a_pass_the_command_confirms_stands_and_is_recorded(load_orch, fake_cao, prompt_file, capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), VERIFY_PASS="1", PROJECT_TEST_CMD="test -d .", **QUICK)
    assert run_main(m) == 0
    assert fake_cao.roles_prompted() == QUICK_ROUND
    out = capsys.readouterr().out
    assert "PASS verified: PROJECT_TEST_CMD exited 0" in out
    summary = json.loads((Path(m.run_dir) / "summary.json").read_text())
    assert summary["result"] == "PASS" and summary["verified"] is True
    assert [(v["round"], v["result"], v["exit_code"]) for v in summary["verifications"]] == [(1, "passed", 0)]
    assert "<dt>verified</dt><dd>yes: PROJECT_TEST_CMD exited 0 in round 1" in \
        (Path(m.run_dir) / "report.html").read_text()


def test_a_pass_the_command_contradicts_is_a_fail_whose_evidence_the_programmer_gets(
        load_orch, fake_cao, prompt_file, workdir, capsys):
    # The command fails until the marker exists: the programmer's second turn "fixes" it.
    command = "test -f fixed || { echo 'FAILED test_greet - AssertionError: Hello World!'; exit 3; }"

    def fix(fake, terminal):
        (workdir / "fixed").write_text("yes\n")
        Path(terminal.response_path).write_text(PROGRAMMER_REPLY, encoding="utf-8")
        terminal.status = "completed"
    fake_cao.script["programmer"] = [PROGRAMMER_REPLY, {"action": "call", "call": fix}]
    fake_cao.script["tester"] = [PASS_REPLY, PASS_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), VERIFY_PASS="1", PROJECT_TEST_CMD=command, **QUICK)
    assert run_main(m) == 0
    assert fake_cao.roles_prompted() == QUICK_ROUND + RETRY
    retry_prompt = fake_cao.prompts_for("programmer")[1]
    assert "Test failure feedback:" in retry_prompt
    assert f"The tester reported PASS, but the project's test command disagreed: `{command}` exited 3" in retry_prompt
    assert "FAILED test_greet - AssertionError: Hello World!" in retry_prompt
    summary = json.loads((Path(m.run_dir) / "summary.json").read_text())
    assert [(v["round"], v["result"]) for v in summary["verifications"]] == [(1, "failed"), (2, "passed")]
    assert summary["rounds"] == 2 and summary["verified"] is True
    assert "PASS not verified: PROJECT_TEST_CMD exited 3" in capsys.readouterr().out


def test_a_command_that_hangs_is_stopped_at_verify_timeout_and_the_round_fails(
        load_orch, fake_cao, prompt_file, capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), VERIFY_PASS="1", VERIFY_TIMEOUT="0.5", MAX_ROUNDS="1",
                  PROJECT_TEST_CMD="sleep 300 & wait", **QUICK)
    assert run_main(m) == 1
    out = capsys.readouterr().out
    assert "PASS not verified: PROJECT_TEST_CMD was stopped after VERIFY_TIMEOUT=0.5s" in out
    summary = json.loads((Path(m.run_dir) / "summary.json").read_text())
    assert summary["result"] == "FAIL" and summary["verifications"][0]["exit_code"] is None
    assert summary["verifications"][0]["seconds"] < 100      # stopped, not waited for (300 s)


def test_a_stop_during_the_check_is_resumed_by_checking_again_not_by_asking_the_tester(
        load_orch, fake_cao, prompt_file, workdir):
    m = load_orch(PROMPT_FILE=str(prompt_file), VERIFY_PASS="1", PROJECT_TEST_CMD="kill -INT $PPID; sleep 5",
                  **QUICK)
    assert run_main(m) == 130
    state = json.loads(Path(m.STATE_FILE).read_text())
    assert (state["current_phase"], state["phase_step"], state["final_status"]) == ("tester", "verify", "RUNNING")
    m = load_orch(PROMPT_FILE=str(prompt_file), VERIFY_PASS="1", PROJECT_TEST_CMD="true", **QUICK)
    assert run_main(m) == 0
    assert fake_cao.roles_prompted() == QUICK_ROUND            # no second tester turn
    assert json.loads(Path(m.STATE_FILE).read_text())["final_status"] == "PASS"
