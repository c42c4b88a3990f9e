"""VERIFY_PASS on a real cao-server with scripted agents: the loop checks a tester's PASS itself."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from .test_orchestrator_e2e import PASS_REPLY, PROGRAMMER_REPLY, SHORT_ROUND, Run, explain

pytestmark = pytest.mark.e2e


def test_a_pass_the_test_command_contradicts_once_ends_in_pass_in_round_2(cao):
    command = "test -f fixed || { echo 'FAILED test_greet: expected Hello, World!'; exit 3; }"
    run = Run(cao, VERIFY_PASS="1", PROJECT_TEST_CMD=command, START_AGENT="programmer")
    cao.set_script({"programmer": [PROGRAMMER_REPLY, {"text": PROGRAMMER_REPLY, "files": {"fixed": "yes\n"}}],
                    "tester": [PASS_REPLY]})
    result = run.run()
    assert result.returncode == 0, explain(result)
    assert run.roles_prompted() == SHORT_ROUND + SHORT_ROUND
    retry = run.prompts_for("programmer")[1]
    assert "Test failure feedback:" in retry
    assert f"The tester reported PASS, but the project's test command disagreed: `{command}` exited 3" in retry
    assert "FAILED test_greet: expected Hello, World!" in retry
    summary = json.loads((Path(run.state()["run_dir"]) / "summary.json").read_text())
    assert [(v["round"], v["result"]) for v in summary["verifications"]] == [(1, "failed"), (2, "passed")]
    assert "PASS verified: PROJECT_TEST_CMD exited 0" in result.stdout


def test_a_hanging_test_command_is_stopped_at_verify_timeout_with_all_it_started(cao):
    marker = f"sleep 61.{time.time_ns() % 1000}"
    run = Run(cao, VERIFY_PASS="1", VERIFY_TIMEOUT="2", MAX_ROUNDS="1", START_AGENT="tester",
              PROJECT_TEST_CMD=f"{marker} & {marker}; wait")
    result = run.run()
    assert result.returncode == 1, explain(result)
    assert "PASS not verified: PROJECT_TEST_CMD was stopped after VERIFY_TIMEOUT=2s" in result.stdout
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    assert left == [], f"still running: {left}"


def test_a_stop_during_the_check_resumes_with_the_check_not_a_new_tester_turn(cao):
    run = Run(cao, VERIFY_PASS="1", START_AGENT="tester",
              PROJECT_TEST_CMD="test -f checked || { touch checked; sleep 30; }")
    process = run.start()
    deadline = time.monotonic() + 120
    while not (run.wd / "checked").exists():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=30)
    assert process.returncode == 143, out + err
    assert run.state()["phase_step"] == "verify"
    result = run.run()
    assert result.returncode == 0, explain(result)
    assert "resuming the check of the tester's PASS (the tester is not asked again)" in result.stdout
    assert run.roles_prompted() == ["tester"]                      # the tester was asked once
    assert cao.counters()["turns"]["tester"] == 1
