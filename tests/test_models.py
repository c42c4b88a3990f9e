"""A model per role: MODEL and <ROLE>_MODEL go to CAO when the agents are created, and are recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import FAST, run_main

QUICK = {**FAST, "MIN_REVIEW_CYCLES_BEFORE_APPROVAL": "1", "START_AGENT": "tester"}
ROLE_PROFILES = {"system_analyst": "analyst", "peer_system_analyst": "peer_analyst", "programmer": "programmer",
                 "peer_programmer": "peer_programmer", "tester": "tester"}


def creations(fake) -> dict[str, dict]:
    """role -> the query parameters of its creation request."""
    found = {}
    for request in fake.requests:
        if request.method == "POST" and request.url.path.startswith("/sessions"):
            params = dict(request.url.params)
            found[ROLE_PROFILES[params["agent_profile"]]] = params
    return found


def test_each_role_asks_for_its_model_and_the_run_records_it(load_orch, fake_cao, prompt_file, capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), PROVIDER="claude_code", MODEL="claude-sonnet-4-5",
                  PEER_ANALYST_MODEL="claude-haiku-4-5", TESTER_MODEL="claude-haiku-4-5", **QUICK)
    assert run_main(m) == 0
    asked = {role: params.get("model") for role, params in creations(fake_cao).items()}
    expected = {"analyst": "claude-sonnet-4-5", "peer_analyst": "claude-haiku-4-5", "programmer": "claude-sonnet-4-5",
                "peer_programmer": "claude-sonnet-4-5", "tester": "claude-haiku-4-5"}
    assert asked == expected
    assert "warning" not in capsys.readouterr().out            # claude_code passes the model on
    state = json.loads(Path(m.STATE_FILE).read_text())
    assert state["models"] == expected
    assert json.loads((Path(m.run_dir) / "summary.json").read_text())["models"] == expected
    assert run_main(m, "--status") == 0
    assert ("models asked for: analyst claude-sonnet-4-5, peer_analyst claude-haiku-4-5, programmer "
            "claude-sonnet-4-5, peer_programmer claude-sonnet-4-5, tester claude-haiku-4-5") in capsys.readouterr().out


def test_without_a_model_nothing_is_sent_and_each_cli_keeps_its_default(load_orch, fake_cao, prompt_file, capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 0
    assert all("model" not in params for params in creations(fake_cao).values())
    assert json.loads((Path(m.run_dir) / "summary.json").read_text())["models"] == {role: "" for role in m.ROLES}
    capsys.readouterr()
    assert run_main(m, "--status") == 0
    assert "models asked for" not in capsys.readouterr().out


def test_a_provider_that_cannot_pass_the_model_on_gets_one_warning_per_role(load_orch, fake_cao, prompt_file,
                                                                            capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), PROVIDER="mock_cli", TESTER_MODEL="small", **QUICK)
    assert run_main(m) == 0
    warnings = [line for line in capsys.readouterr().out.splitlines()    # but the one that the agents are scripted
                if "warning:" in line and "scripted agents:" not in line]
    assert len(warnings) == 1
    assert warnings[0].endswith("warning: CAO's mock_cli provider does not start its CLI with a chosen model: the "
                                "tester runs on its CLI's default model, not small")


@pytest.mark.parametrize("variable, value", [("MODEL", "claude sonnet"), ("TESTER_MODEL", "x;rm -rf /"),
                                             ("MODEL", "m" * 129)])
def test_a_model_id_cao_would_refuse_stops_before_anything_starts(load_orch, fake_cao, prompt_file, capsys,
                                                                  variable, value):
    m = load_orch(PROMPT_FILE=str(prompt_file), **{variable: value}, **QUICK)
    assert run_main(m) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {variable}=") and "is not valid: expected empty or a model id" in err
    assert "\n" not in err and fake_cao.requests == []


def test_a_model_the_server_refuses_stops_the_start_up_with_exit_2(load_orch, fake_cao, prompt_file, capsys):
    fake_cao.fail_create["system_analyst"] = (400, "model 'opus-9' is invalid (must match '^[a-z-]+$')")
    m = load_orch(PROMPT_FILE=str(prompt_file), MODEL="opus-9", **QUICK)
    assert run_main(m) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert err.startswith("error: CAO refuses the model: analyst: CAO create session failed: HTTP 400")
    assert "set MODEL (or <ROLE>_MODEL) to a model id it accepts" in err
    assert not Path(m.STATE_FILE).exists()


def test_model_settings_in_the_config_file(load_orch, fake_cao, prompt_file, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model": "big", "agents": {"peer_programmer": {"model": "small"}}}))
    m = load_orch(PROMPT_FILE=str(prompt_file), PROVIDER="codex", **QUICK)
    assert run_main(m, str(config)) == 0
    asked = {role: params.get("model") for role, params in creations(fake_cao).items()}
    assert asked == {"analyst": "big", "peer_analyst": "big", "programmer": "big", "peer_programmer": "small",
                     "tester": "big"}


# --------------------------------------------------------------------------
# A model is the one asked for by its CLI's rule (its row's model_names): a sibling is a change
# --------------------------------------------------------------------------

@pytest.mark.parametrize("cli, recorded, asked, same", [
    ("codex", "gpt-5.1-codex", "gpt-5.1-codex", True),
    ("codex", "gpt-5.1-codex-mini", "gpt-5.1-codex", False),          # its "-mini" sibling
    ("codex", "gpt-5.1-codex", "gpt-5.1-codex-mini", False),
    ("codex", "gpt-5.2-codex", "gpt-5.1-codex", False),                # a newer minor
    ("codex", "gpt-5.1-codex-20250929", "gpt-5.1-codex", False),       # a dated id is Claude Code's rule only
    ("codex", "anything", "", False),
    ("claude_code", "claude-sonnet-4-5-20250929", "claude-sonnet-4-5", True),   # the asked id, dated
    ("claude_code", "claude-sonnet-4-5-20250929", "claude-sonnet-4", False),    # a newer minor of the one asked
    ("claude_code", "claude-sonnet-4-20250514", "claude-sonnet-4", True),
    ("claude_code", "claude-sonnet-4-5-20250929", "sonnet", True),              # an alias: its family
    ("claude_code", "claude-sonnet-4-5", "sonnet", True),
    ("claude_code", "claude-opus-4-1-20250805", "opus", True),
    ("claude_code", "claude-haiku-4-5-20251001", "sonnet", False),             # another family
    ("claude_code", "claude-sonnet-4-5-mini", "sonnet", False),
    ("claude_code", "claude-sonnet-4-5-20250929-v2", "claude-sonnet-4-5", False),  # another suffix
    ("opencode_cli", "claude-sonnet-4-5", "anthropic/claude-sonnet-4-5", True),    # provider/model
    ("opencode_cli", "anthropic/claude-sonnet-4-5", "anthropic/claude-sonnet-4-5", True),
    ("opencode_cli", "claude-sonnet-4-5-20250929", "anthropic/claude-sonnet-4-5", False),
    ("opencode_cli", "gpt-5.1-codex-mini", "openai/gpt-5.1-codex", False),
    ("opencode_cli", "scripted", "scripted/scripted", True),
])
def test_a_recorded_model_is_the_one_asked_for_by_its_cli_s_rule_and_a_name_inside_it_is_not(orch, cli, recorded,
                                                                                               asked, same):
    assert orch.model_is(recorded, asked, orch.agent_cli(cli)) is same


def claude_like(m, home: Path):
    """A fake agent's step that records its turn as Claude Code does (a transcript naming its response file, the
    model its response came from, the turn's end), then writes its reply."""
    def step(text: str, model: str) -> dict:
        def act(fake, terminal):
            folder = home / ".claude" / "projects" / m.claude_project_folder(m.WD)
            folder.mkdir(parents=True, exist_ok=True)
            stamp = m.utc_iso(m.time.time(), precise=True)
            lines = ['{"type":"user","timestamp":"%s","message":{"role":"user","content":"Write your complete '
                     'answer to this file: %s"}}' % (stamp, terminal.response_path),
                     '{"type":"assistant","timestamp":"%s","message":{"id":"msg_%s","model":"%s","role":"assistant",'
                     '"content":[{"type":"text","text":"done"}],"usage":{"input_tokens":1000,'
                     '"cache_creation_input_tokens":0,"cache_read_input_tokens":0,"output_tokens":20}}}'
                     % (stamp, len(fake.prompts), model),
                     '{"type":"system","subtype":"turn_duration","timestamp":"%s"}' % stamp]
            with (folder / f"{terminal.id}.jsonl").open("a", encoding="utf-8") as file:
                file.write("\n".join(lines) + "\n")
            Path(terminal.response_path).write_text(text, encoding="utf-8")
            terminal.last_output, terminal.status = text, "completed"
        return {"action": "call", "call": act, "text": text}
    return step


def test_an_alias_its_cli_resolves_to_a_dated_id_is_no_change(load_orch, fake_cao, prompt_file, tmp_path, capsys):
    """MODEL=sonnet; Claude Code records claude-sonnet-4-5-20250929 for each turn: the same model, nothing said."""
    from fake_cao import DEFAULT_REPLIES, FAIL_REPLY, PASS_REPLY
    home = tmp_path / "agent-home"
    m = load_orch(PROMPT_FILE=str(prompt_file), AGENT_HOME=str(home), MODEL="sonnet", PROVIDER="claude_code",
                  **{**QUICK, "START_AGENT": "programmer"})
    step = claude_like(m, home)
    for role in ("programmer", "peer_programmer"):
        fake_cao.script[role] = [step(DEFAULT_REPLIES[role], "claude-sonnet-4-5-20250929")] * 2
    fake_cao.script["tester"] = [step(FAIL_REPLY, "claude-sonnet-4-5-20250929"),
                                 step(PASS_REPLY, "claude-sonnet-4-5-20250929")]
    assert run_main(m) == 0
    out = capsys.readouterr().out
    assert out.count("; model: claude-sonnet-4-5-20250929") == 6 and "its model changed" not in out
    state = json.loads(Path(m.STATE_FILE).read_text())
    assert not [e for e in state["agent_events"] if e["what"] == "model changed"]


@pytest.mark.parametrize("replace", ["0", "1"])
def test_a_sibling_of_the_asked_model_is_a_change_said_in_one_line_and_handled(load_orch, fake_cao, prompt_file,
                                                                              tmp_path, capsys, replace):
    """MODEL=gpt-5.1-codex, and Codex records the programmer's first turn on gpt-5.1-codex-mini (the name holds
    the one asked): one line says the change; the programmer's next turn is not sent to that agent -- the run
    stops with exit 2, or (REPLACE_LOST_AGENTS=1) a new agent takes it."""
    from fake_cao import DEFAULT_REPLIES, FAIL_REPLY, PASS_REPLY
    from test_token_usage import TESTER_FAIL_THEN_PASS, codex_like
    home = tmp_path / "agent-home"
    step, _ = codex_like(home)
    fake_cao.script["programmer"] = [step(DEFAULT_REPLIES["programmer"], model)
                                     for model in ("gpt-5.1-codex-mini", "gpt-5.1-codex")]
    fake_cao.script["peer_programmer"] = [step(DEFAULT_REPLIES["peer_programmer"], "gpt-5.1-codex")]
    fake_cao.script["tester"] = [step(FAIL_REPLY, "gpt-5.1-codex"), step(PASS_REPLY, "gpt-5.1-codex")]
    m = load_orch(PROMPT_FILE=str(prompt_file), AGENT_HOME=str(home), MODEL="gpt-5.1-codex",
                  REPLACE_LOST_AGENTS=replace, **TESTER_FAIL_THEN_PASS)
    assert run_main(m) == (2 if replace == "0" else 0)
    said = [line for line in capsys.readouterr().out.splitlines() if "and not by the run's settings" in line]
    assert len(said) == 1 and "programmer: its model changed from gpt-5.1-codex to gpt-5.1-codex-mini in turn 1" \
        in said[0]
    state = json.loads(Path(m.STATE_FILE).read_text())
    if replace == "0":
        assert [role for role, _ in fake_cao.prompts] == ["programmer", "peer_programmer", "tester"]
    else:
        fresh = [e for e in state["agent_events"] if e["what"] == "new conversation"]
        assert len(fresh) == 1 and fresh[0]["role"] == "programmer" and \
            "its model changed from gpt-5.1-codex to gpt-5.1-codex-mini" in fresh[0]["detail"]
        assert state["turn_records"][3]["model"] == "gpt-5.1-codex"
