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


@pytest.fixture
def codex_with_claude_cao():
    """A private server whose agents run the pinned Codex, with Claude Code set up beside it as the fallback,
    both against one ScriptedModel."""
    from .conftest import _real_cli_server
    yield from _real_cli_server("codex", also=("claude_code",))


@pytest.mark.real_cli
def test_codex_programmer_at_a_far_usage_limit_goes_over_to_claude_code_and_the_run_passes(codex_with_claude_cao):
    """The programmer's Codex meets its plan's limit, resetting six hours later (HTTP 429 usage_limit_reached):
    a Claude Code agent gets the programmer's prompt as a new conversation's task and answers it, the run
    passes, the report and summary.json say which CLI did each turn, and each CLI's tokens are its model's."""
    from .test_orchestrator_e2e import PASS_REPLY, PROGRAMMER_REPLY, SHORT_ROUND
    from .test_real_clis import real_cli_run

    cao = codex_with_claude_cao
    run = real_cli_run(cao, START_AGENT="programmer", FALLBACK_PROVIDER="claude_code", AGENT_HOME=str(cao.home))
    cao.model.set_script({"tester": [PASS_REPLY], "programmer": [PROGRAMMER_REPLY]})
    cao.model.usage_limit_next(1, resets_in=6 * 3600, role="programmer")
    result = run.run(timeout=900)
    assert result.returncode == 0, explain(result)
    assert "going over from codex (its CLI default) to its fallback claude_code (its CLI default)" in result.stdout

    state = run.state()
    [switch] = state["cli_switches"]
    assert (switch["from_provider"], switch["to_provider"], switch["old_ended"]) == ("codex", "claude_code", True)
    assert switch["resets_at"], switch
    assert run.archived() == numbered(SHORT_ROUND), explain(result)          # each turn answered and kept once
    summary = json.loads((Path(state["run_dir"]) / "summary.json").read_text(encoding="utf-8"))
    assert [(t["role"], t["provider"]) for t in summary["turn_list"]] == [
        ("programmer", "claude_code"), ("peer_programmer", "codex"), ("tester", "codex")]
    prompts = [e for e in cao.model.events() if e["kind"] == "prompt" and e["role"] == "programmer"]
    assert len(prompts) == 2, cao.model.events()          # once to Codex (answered 429), once to Claude Code

    usage = cao.model.usage_entries()
    def reported(roles):
        mine = [(u["input"], u["cached_input"], u["output"]) for u in usage if u["role"] in roles]
        return tuple(map(sum, zip(*mine)))
    tokens = {cli: summary["clis"][cli]["tokens"] for cli in ("codex", "claude_code")}
    assert (tokens["claude_code"]["input"], tokens["claude_code"]["cached_input"],
            tokens["claude_code"]["output"]) == reported({"programmer"}), usage
    assert (tokens["codex"]["input"], tokens["codex"]["cached_input"],
            tokens["codex"]["output"]) == reported({"peer_programmer", "tester"}), usage
    page = (Path(state["run_dir"]) / "report.html").read_text(encoding="utf-8")
    assert "; claude_code" in page and 'data-key="cli-claude_code"' in page and 'data-key="cli-codex"' in page
