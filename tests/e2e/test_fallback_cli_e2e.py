"""A fallback CLI on a real cao-server with scripted agents: the programmer's agent stops at a usage limit of no
reset time, the role goes over to its fallback, and the loop is killed (SIGKILL) right after the switch is saved.

CAO runs the scripted agent under one provider only (mock_cli), so the fallback is mock_cli started with another
model (FALLBACK_MODEL): a new agent, a new conversation, as with another CLI. The same command then goes on with
the fallback's agent for the programmer, ends the limited agent, sends no answered turn again, and passes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .test_orchestrator_e2e import QUICK_ROUND, Run, explain, numbered

pytestmark = pytest.mark.e2e

LIMIT = "You've hit your usage limit. Try again later."


def test_a_run_killed_right_after_the_switch_goes_on_with_the_fallback_and_repeats_no_turn(cao):
    run = Run(cao, FALLBACK_PROVIDER="mock_cli", FALLBACK_MODEL="fallback-model",
              ORCHESTRATOR_CRASH_AT="fallback-switched:1")
    cao.set_script({"programmer": [{"action": "write_on_reminder", "say": LIMIT}, {}]})
    killed = run.run(timeout=300)
    assert killed.returncode == -9, explain(killed)
    state = run.state()
    [switch] = state["cli_switches"]
    old, new = switch["old_terminal"], switch["new_terminal"]
    assert new and state["terminals"]["programmer"] == new and not switch["old_ended"], explain(killed)
    assert state["in_flight"]["role"] == "programmer" and state["in_flight"]["sent_at"] is None
    assert "going over from mock_cli (its CLI default) to its fallback mock_cli (fallback-model)" in killed.stdout

    run.env.pop("ORCHESTRATOR_CRASH_AT")
    result = run.run(timeout=300)
    assert result.returncode == 0, explain(result)

    programmer = [r for r in run.prompts() if r["role"] == "programmer"]
    assert [r["terminal_id"] for r in programmer] == [old, new]             # once to each agent
    assert run.roles_prompted() == QUICK_ROUND[:3] + QUICK_ROUND[2:], explain(result)
    state = run.state()
    assert state["final_status"] == "PASS" and state["models"]["programmer"] == "fallback-model"
    assert state["cli_switches"][0]["old_ended"] is True and len(state["cli_switches"]) == 1
    assert run.archived() == numbered(QUICK_ROUND)                          # each turn answered and kept once
    summary = json.loads((Path(state["run_dir"]) / "summary.json").read_text(encoding="utf-8"))
    assert [turn["role"] for turn in summary["turn_list"]] == QUICK_ROUND
    assert summary["turn_list"][2]["terminal"] == new
    with cao.http() as client:                                             # the limited agent was ended
        listed = client.get(f"/sessions/{state['session_name']}/terminals")
        assert old not in {t["id"] for t in listed.json()}, listed.text
