"""The loop killed while it takes a reply, on a real cao-server with scripted agents: the rerun neither sends
that turn again nor loses its reply.

One FAIL -> PASS run (8 turns) is stopped again and again, each time at another step between a reply's file
settling and the state saved after it (the loop's crash points, ORCHESTRATOR_CRASH_AT), by SIGKILL or by
SIGINT, at an author turn, a review and the tester's FAIL; each stop is followed by the same command again.
The run ends in PASS with exactly the turns of an uninterrupted run: each prompt sent once, each reply kept
once, the FAIL acted on.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .test_orchestrator_e2e import FAIL_REPLY, PASS_REPLY, QUICK_ROUND, SHORT_ROUND, Run, explain, numbered

pytestmark = pytest.mark.e2e

WHOLE_RUN = QUICK_ROUND + SHORT_ROUND
# (step, which time in that process the step is reached, signal). A rerun first finishes the turn it was
# stopped in (its reply taken again, or retaken from where it was kept: no crash point on that path), so:
STOPS = [
    ("reply-settled", 2, "KILL"),       # turn 2, the peer analyst's review: its wait over, nothing written yet
    ("reply-file-named", 1, "KILL"),    # turn 2 again: the state names the reply's place, the file not moved
    ("reply-archived", 1, "INT"),       # turn 2 again: moved into the run's folder; Ctrl-C saves the state
    ("reply-archived", 1, "KILL"),      # turn 3, the programmer (an author), kept and not yet acted on
    ("turn-recorded", 1, "KILL"),       # turn 4, the peer programmer's review, recorded
    ("report-written", 1, "INT"),       # turn 5, the tester's FAIL, recorded and reported; Ctrl-C saves
]


def test_a_run_killed_at_every_step_of_taking_a_reply_ends_with_each_turn_sent_once(cao):
    run = Run(cao)
    cao.set_script({"tester": [FAIL_REPLY, PASS_REPLY]})
    codes = []
    for step, count, how in STOPS:
        run.env["ORCHESTRATOR_CRASH_AT"] = f"{step}:{count}" + (":INT" if how == "INT" else "")
        stopped = run.run(timeout=300)
        codes.append(stopped.returncode)
        assert stopped.returncode == (-9 if how == "KILL" else 130), explain(stopped)
        assert run.state()["final_status"] == "RUNNING"
    run.env.pop("ORCHESTRATOR_CRASH_AT")
    result = run.run(timeout=300)
    assert result.returncode == 0, explain(result)

    assert run.roles_prompted() == WHOLE_RUN, explain(result)               # each prompt sent once
    assert cao.counters()["turns"] == {role: WHOLE_RUN.count(role) for role in set(WHOLE_RUN)}
    state = run.state()
    assert state["final_status"] == "PASS" and state["current_round"] == 2 and state["in_flight"] is None
    assert run.archived() == numbered(WHOLE_RUN)                            # each reply kept once
    assert run.archived_text("005-tester.md") == FAIL_REPLY                 # the FAIL was seen ...
    assert "missing comma" in run.prompts_for("programmer")[1]              # ... and acted on
    summary = json.loads((Path(state["run_dir"]) / "summary.json").read_text(encoding="utf-8"))
    assert [turn["role"] for turn in summary["turn_list"]] == WHOLE_RUN    # each turn recorded once
