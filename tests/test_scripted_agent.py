"""The scripted agent shipped as `mock_cli`: it works with no settings at all."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest

import orchestrator_scripted_agent as agent_module


@pytest.fixture
def bare_agent(monkeypatch, capsys):
    """An agent as a user's cao-server starts it: no MOCK_AGENT_HOME, no think time set."""
    monkeypatch.delenv("MOCK_AGENT_HOME", raising=False)
    return agent_module.Agent(agent_module.Home(None), default_think_ms=0)


def prompt_for(path: Path) -> str:
    return f"Do the work.\n{agent_module.WRITE_MARKER} {path}\n"


def test_answers_every_role_without_a_home_directory(bare_agent, tmp_path):
    for name, role in agent_module.RESPONSE_FILE_ROLES.items():
        path = tmp_path / name
        bare_agent.handle(prompt_for(path))
        assert path.read_text(encoding="utf-8") == agent_module.DEFAULT_TEXTS[role]


def test_default_replies_pass_the_loops_checks(bare_agent, orch):
    """What a first run needs: approvals that count (from cycle 2, with the default settings) and a PASS."""
    texts = agent_module.DEFAULT_TEXTS
    assert orch.is_review_approved(texts["peer_analyst"], 2, "peer_analyst")
    assert orch.is_review_approved(texts["peer_programmer"], 2, "peer_programmer")
    assert orch.reply_verdict("tester", texts["tester"]) == "PASS"


def test_turns_are_counted_in_the_process_without_a_home(bare_agent, tmp_path):
    path = tmp_path / "test_result.md"
    bare_agent.handle(prompt_for(path))
    bare_agent.handle(prompt_for(path))
    with bare_agent.home._state() as counters:
        assert counters["turns"] == {"tester": 2}


def test_with_count_answered_a_prompt_cut_while_the_agent_thinks_gets_its_step_again(tmp_path, monkeypatch):
    """The demo's script: an agent ended while it thinks (the demo stopped) leaves its turn uncounted, so the
    prompt sent again after the resume gets the same step -- the tester's FAIL, not the PASS after it."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "script.json").write_text(json.dumps(agent_module.DEMO_SCRIPT), encoding="utf-8")
    path = tmp_path / "test_result.md"

    def ended(milliseconds, silent=False):
        raise SystemExit(129)                       # the agent's terminal closed while it thought
    cut = agent_module.Agent(agent_module.Home(str(home)), default_think_ms=0)
    monkeypatch.setattr(cut, "think", ended)
    with pytest.raises(SystemExit):
        cut.handle(prompt_for(path))
    assert not path.exists()
    again = agent_module.Agent(agent_module.Home(str(home)), default_think_ms=0)
    again.handle(prompt_for(path))
    assert path.read_text(encoding="utf-8").startswith("RESULT: FAIL")
    again.handle(prompt_for(path))
    assert path.read_text(encoding="utf-8").startswith("RESULT: PASS")


def test_a_step_held_after_its_answer_works_on_with_the_file_written(tmp_path, monkeypatch, capsys):
    """`hold_ms`: the answer is on disk while the agent still shows itself at work (no prompt yet)."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "script.json").write_text('{"tester": [{"text": "RESULT: PASS\\n", "hold_ms": 300}]}')
    agent = agent_module.Agent(agent_module.Home(str(home)), default_think_ms=0)
    path = tmp_path / "test_result.md"
    seen = []
    monkeypatch.setattr(agent_module.time, "sleep", lambda seconds: seen.append(path.exists()))
    agent.handle(prompt_for(path))
    assert path.read_text(encoding="utf-8") == "RESULT: PASS\n"
    assert seen and all(seen)                        # every pause of the hold came after the file
    out = capsys.readouterr().out
    assert out.rindex("thinking") < out.rindex(agent_module.PROMPT)


def test_a_reminder_with_nothing_pending_is_answered(bare_agent, tmp_path, capsys):
    bare_agent.handle(f"Please write {tmp_path / 'analyst_summary.md'} now.")
    assert "reminder: nothing pending" in capsys.readouterr().out
    assert not (tmp_path / "analyst_summary.md").exists()


def test_help_says_what_it_is():
    proc = subprocess.run([sys.executable, agent_module.__file__, "--help"], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0
    assert "PROVIDER=mock_cli" in proc.stdout and "MOCK_AGENT_HOME" in proc.stdout
    assert "It writes no code" in proc.stdout
    assert "script.json: ``{\"<role>\": [step, ...]}``" in proc.stdout      # the description it promises


def test_version_is_answered_without_starting_the_agent():
    proc = subprocess.run([sys.executable, agent_module.__file__, "--version"], capture_output=True, text=True,
                          timeout=30, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0
    assert proc.stdout == f"mock_cli (cao-orchestrator-loop) {agent_module.package_version()}\n"
    assert "ready" not in proc.stdout


def test_installed_as_the_command_cao_starts():
    scripts = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="console_scripts")}
    assert scripts.get("mock_cli") == "orchestrator_scripted_agent:main"


def test_a_step_can_end_with_a_cli_s_words_such_as_a_usage_limit(tmp_path, orch, capsys):
    """`say`: the line a step prints as its turn ends, read by the loop as the CLI's screen would be."""
    home = tmp_path / "home"
    home.mkdir()
    limit = "You've hit your usage limit. Try again later."
    (home / "script.json").write_text('{"tester": [{"action": "write_on_reminder", "say": "%s"}]}' % limit)
    agent = agent_module.Agent(agent_module.Home(str(home)), default_think_ms=0)
    agent.handle(prompt_for(tmp_path / "test_result.md"))
    screen = capsys.readouterr().out
    assert f"\n{limit}\n" in screen and not (tmp_path / "test_result.md").exists()
    found = orch.usage_limit_on(screen, 0.0, orch.agent_cli("mock_cli"))
    assert found.line == "You've hit your usage limit." and found.resets_at is None
