"""A run that stops paying when it stops making progress, as a user runs it: a real process against a real
cao-server whose five terminals run the scripted `mock_cli` agent (see test_orchestrator_e2e.py).

The same failure every round (only its times differ) and a programmer that changes nothing stop the run after
MAX_ROUNDS_WITHOUT_PROGRESS rounds, far below MAX_ROUNDS, with exit 5; RESUME=1 goes on. A failing step that
changes every round while the programmer edits files stops nothing: the run reaches PASS as without the setting.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .test_orchestrator_e2e import PASS_REPLY, QUICK_ROUND, SHORT_ROUND, Run, explain

pytestmark = pytest.mark.e2e

SAME_FAILURE = ("RESULT: FAIL\nEVIDENCE:\n- Step 1: `greet World` printed 'Hello World', expected 'Hello, World!' "
                "(checked at 2026-11-27T10:0{n}:1{n}Z, took 0.{n}2s)\n- Recommended next fix: greet.py\n")
PROGRAMMER_REPLY = ("PROGRAMMER_SUMMARY:\n- Files changed: {files}\n- Behavior implemented: greet NAME\n"
                    "- Tests run: pytest\n")


def test_the_same_failure_every_round_stops_the_run_early_and_resume_goes_on(cao):
    run = Run(cao, MAX_ROUNDS="8", MAX_ROUNDS_WITHOUT_PROGRESS="2")
    cao.set_script({"tester": [SAME_FAILURE.format(n=n) for n in range(4)] + [PASS_REPLY],
                    "programmer": [PROGRAMMER_REPLY.format(files="none")]})
    stopped = run.run()
    assert stopped.returncode == 5, explain(stopped)
    assert run.roles_prompted() == QUICK_ROUND + SHORT_ROUND * 2            # rounds 1-3 of 8
    last = stopped.stderr.strip().splitlines()[-1]
    assert last.startswith("stopped without progress: the test failed at the same step in rounds 1 to 3 "
                           "(2 rounds in a row without progress, MAX_ROUNDS_WITHOUT_PROGRESS=2): Step 1: "), last
    assert "in those rounds no file changed" in last and last.endswith("to go on: RESUME=1 run_orchestrator_loop.py")

    state = run.state()
    assert (state["final_status"], state["current_round"]) == ("FAIL", 3)
    assert state["no_progress_stop"]["turns_saved"] == 5 * len(SHORT_ROUND)
    folder = Path(state["run_dir"])
    events = [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines()]
    assert [e["progress"] for e in events if e["event"] == "round_compared"] == [True, False, False]
    assert events[-1]["event"] == "run_stopped" and events[-1]["exit_code"] == 5
    assert events[-1]["no_progress"]["files_changed"] == []
    report = (folder / "report.html").read_text(encoding="utf-8")
    assert '<section id="no-progress">' in report and '<pre data-round="3">' in report
    told = run.prompts_for("programmer")[2]                                  # round 3's programmer
    assert "The same failure again:" in told and "you changed no file in the project" in told

    run.env.update(RESUME="1")
    resumed = run.run()
    assert resumed.returncode == 0, explain(resumed)
    assert "the run ended without progress after round 3; going on with round 4" in resumed.stdout
    assert run.roles_prompted() == QUICK_ROUND + SHORT_ROUND * 4            # round 4 fails alike, round 5 passes
    assert (run.state()["final_status"], run.state()["current_round"]) == ("PASS", 5)


def test_a_failing_step_that_changes_every_round_runs_on_to_pass(cao):
    run = Run(cao, MAX_ROUNDS="4", MAX_ROUNDS_WITHOUT_PROGRESS="1")
    cao.set_script({
        "tester": [f"RESULT: FAIL\nEVIDENCE:\n- Step {n}: `greet World` failed (at 10:0{n}:00, took 0.{n}s)\n"
                   for n in (1, 2, 3)] + [PASS_REPLY],
        "programmer": [{"text": PROGRAMMER_REPLY.format(files=f"greet.py (version {n})"),
                        "files": {"greet.py": f"print('Hello, World!')  # version {n}\n"}} for n in (1, 2, 3, 4)],
    })
    result = run.run()
    assert result.returncode == 0, explain(result)
    assert run.roles_prompted() == QUICK_ROUND + SHORT_ROUND * 3
    state = run.state()
    assert (state["final_status"], state["current_round"], state["no_progress_stop"]) == ("PASS", 4, None)
    assert [(r["repeats"], r["files"]) for r in state["failed_rounds"]] == [(0, None), (0, ["greet.py"]),
                                                                             (0, ["greet.py"])]
    assert all("The same failure again" not in prompt for prompt in run.prompts_for("programmer"))
