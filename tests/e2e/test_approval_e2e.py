"""A person in the loop on the real cao-server with scripted agents: APPROVE's gates decided from another shell,
a note carried once, a run waiting in place, and one killed while it waits (docs/approval.md)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .test_orchestrator_e2e import PASS_REPLY, PROGRAMMER_REPLY, QUICK_ROUND, REPO_ROOT, SCRIPT, Run, explain

pytestmark = pytest.mark.e2e

ANALYSIS = ["analyst", "peer_analyst"]
REASON = "Keep the old --name flag working."
NOTE = "Use only the standard library."


def person(run: Run, *args: str) -> subprocess.CompletedProcess:
    """The loop's command as a person types it in another shell, with the run's settings."""
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO_ROOT, env={**run.env, "USER": "pat"},
                          capture_output=True, text=True, timeout=60)


def wait_for_gate(run: Run, process: subprocess.Popen, waits: int = 1, timeout: float = 120) -> None:
    """Until the run's log says it waits at a gate for the `waits`-th time (the gate is in its state by then)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            log = (Path(run.state()["run_dir"]) / "run.log").read_text(encoding="utf-8")
        except (OSError, ValueError, KeyError):
            log = ""
        if log.count("waiting for your approval of the plan (round 1") >= waits:
            return
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the run never reached the plan gate"
        time.sleep(0.05)


def test_the_plan_is_rejected_then_approved_from_another_shell_and_a_note_reaches_the_programmer_once(cao):
    run = Run(cao, APPROVE="plan", APPROVAL_MAX_WAIT="0")
    result = run.run()
    assert result.returncode == 6, explain(result)
    assert run.roles_prompted() == ANALYSIS                          # no programmer prompt
    assert result.stderr.strip().splitlines()[-1].startswith("stopped at the plan gate: waiting for your approval")

    rejected = person(run, "--reject", REASON)
    assert rejected.returncode == 0 and rejected.stdout.startswith("the plan rejected"), explain(rejected)
    result = run.run()
    assert result.returncode == 6, explain(result)                  # the new plan, reviewed, at the gate again
    assert run.roles_prompted() == ANALYSIS + ANALYSIS
    assert REASON in run.prompts_for("analyst")[1] and "Note from a person (pat, " in run.prompts_for("analyst")[1]

    noted = person(run, "--note", "programmer", NOTE)
    assert noted.returncode == 0, explain(noted)
    assert person(run, "--approve").returncode == 0
    again = person(run, "--approve")
    assert again.returncode == 2 and "already decided: approved by pat" in again.stderr
    result = run.run()
    assert result.returncode == 0, explain(result)
    assert run.roles_prompted() == ANALYSIS + QUICK_ROUND
    assert [NOTE in prompt for prompt in run.prompts_for("programmer")] == [True]
    gates = run.state()["gates"]
    assert [(g["gate"], g["verdict"], g["by"]) for g in gates] == [("plan", "reject", "pat"), ("plan", "approve", "pat")]
    events = [json.loads(line)["event"] for line in
              (Path(run.state()["run_dir"]) / "events.jsonl").read_text().splitlines()]
    assert events.count("gate_reached") == 2 and events.count("gate_decided") == 2 and "note_taken" in events


def test_a_run_waiting_in_place_goes_on_at_an_approve_and_one_killed_there_waits_again_having_sent_nothing(cao):
    run = Run(cao, APPROVE="plan", APPROVAL_MAX_WAIT="300")
    process = run.start()
    try:
        wait_for_gate(run, process)
        process.send_signal(signal.SIGKILL)
        process.wait(30)
        process = run.start()                                      # the same command after the kill
        wait_for_gate(run, process, waits=2)
        assert run.roles_prompted() == ANALYSIS                    # nothing sent again, nothing sent on
        status = person(run, "--status")
        assert "next: waiting for your approval of the plan since" in status.stdout, explain(status)
        approved = person(run, "--approve")
        assert approved.returncode == 0 and "the run waiting in place goes on" in approved.stdout, explain(approved)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, out + err
    assert run.roles_prompted() == QUICK_ROUND


def test_the_commit_gate_holds_the_commit_until_approved(cao, tmp_path):
    run = Run(cao, APPROVE="commit", APPROVAL_MAX_WAIT="0", COMMIT_ON_PASS="1",
              GIT_CONFIG_GLOBAL=str(tmp_path / "gitconfig"), GIT_CONFIG_NOSYSTEM="1")
    (tmp_path / "gitconfig").write_text("[user]\n\tname = Pat\n\temail = pat@example.test\n")

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=run.wd, env=run.env, check=True, capture_output=True,
                              text=True).stdout
    (run.wd / "greet.py").write_text("print('hi')\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "start")
    cao.set_script({"programmer": [{"text": PROGRAMMER_REPLY, "files": {
        str(run.wd / "greet.py"): "import sys\nprint(f'Hello, {sys.argv[1]}!')\n"}}], "tester": [PASS_REPLY]})
    result = run.run()
    assert result.returncode == 6, explain(result)
    assert run.roles_prompted() == QUICK_ROUND
    assert git("rev-list", "--count", "HEAD").strip() == "1"            # nothing committed before the approval
    assert run.state()["final_status"] == "RUNNING"
    assert person(run, "--approve").returncode == 0
    result = run.run()
    assert result.returncode == 0, explain(result)
    assert run.roles_prompted() == QUICK_ROUND                          # no agent asked again
    assert git("rev-list", "--count", "HEAD").strip() == "2"
    assert "greet.py" in git("show", "--name-only", "--format=", "HEAD")
