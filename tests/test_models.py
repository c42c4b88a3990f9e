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
    warnings = [line for line in capsys.readouterr().out.splitlines() if "warning:" in line]
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
