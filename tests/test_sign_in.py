"""--check: each CLI signed in where its agents run, by the forms of credential its row declares, without a
token spent; and an environment trap that checks the value a CLI needs, which the run's own server sets.

Each form is planted alone in a fresh agents' home (or environment): found, it is named (never its secret);
none found, the line names the CLI's own login and the variable that also works; a form the loop cannot judge
gives a "cannot say" line (!), never ✓. End to end with the real CLIs: tests/e2e/test_check_e2e.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_main

SECRET = "sk-ant-secret-0123456789abcdefghijklmnop"


def _side(orch, tmp_path: Path, uid: int = 1000, **env: str):
    home = tmp_path / "agents-home"
    home.mkdir(exist_ok=True)
    return orch.AgentsSide({"HOME": str(home), **env}, uid, {})


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def signed_in(orch, provider: str, side):
    [line] = orch.sign_in_lines(orch.AGENT_CLIS[provider], side)
    assert SECRET not in line.text and SECRET[-20:] not in line.text       # never the secret's value
    return line


# -- Claude Code --------------------------------------------------------------------


def test_claude_code_with_no_credential_names_its_login_and_the_variable(orch, tmp_path):
    line = signed_in(orch, "claude_code", _side(orch, tmp_path))
    assert line.ok is False and line.text.startswith("Claude Code: not signed in where its agents run")
    assert "run `claude`, then /login (or `claude setup-token`)" in line.text
    assert "or set ANTHROPIC_API_KEY for the agents" in line.text


def test_claude_code_uses_an_api_key_only_once_approved(orch, tmp_path):
    side = _side(orch, tmp_path, ANTHROPIC_API_KEY=SECRET)
    asked = signed_in(orch, "claude_code", side)
    assert asked.ok is False and "asks at each start whether to use it" in asked.text
    assert "customApiKeyResponses.approved" in asked.text
    config = Path(side.env["HOME"]) / ".claude.json"
    _write(config, json.dumps({"customApiKeyResponses": {"approved": [SECRET[-20:]], "rejected": []}}))
    line = signed_in(orch, "claude_code", side)
    assert line.ok is True and line.text == f"Claude Code: signed in (ANTHROPIC_API_KEY, approved in {config})"
    _write(config, json.dumps({"customApiKeyResponses": {"approved": [], "rejected": [SECRET[-20:]]}}))
    assert "was told not to use that key" in signed_in(orch, "claude_code", side).text


def test_an_unapproved_api_key_is_a_failure_even_beside_a_login(orch, tmp_path):
    """Claude Code asks about a new key at each start whatever else signs it in: CAO would wait on that question."""
    side = _side(orch, tmp_path, ANTHROPIC_API_KEY=SECRET)
    _write(Path(side.env["HOME"]) / ".claude" / ".credentials.json", json.dumps({"claudeAiOauth": {"accessToken": "t"}}))
    assert signed_in(orch, "claude_code", side).ok is False


@pytest.mark.parametrize("where, content, named", [
    (".claude/.credentials.json", {"claudeAiOauth": {"accessToken": "t", "scopes": ["user:inference"]}}, "its login"),
    (".claude.json", {"primaryApiKey": SECRET}, "the API key of its login"),
    (".claude/settings.json", {"apiKeyHelper": "~/bin/key.sh"}, "apiKeyHelper in"),
    (".claude/settings.json", {"env": {"ANTHROPIC_AUTH_TOKEN": SECRET}}, "ANTHROPIC_AUTH_TOKEN"),
    (".claude/settings.json", {"env": {"CLAUDE_CODE_OAUTH_TOKEN": SECRET}}, "CLAUDE_CODE_OAUTH_TOKEN in its settings"),
])
def test_claude_code_s_files_and_settings_sign_it_in(orch, tmp_path, where, content, named):
    side = _side(orch, tmp_path)
    path = _write(Path(side.env["HOME"]) / where, json.dumps(content))
    line = signed_in(orch, "claude_code", side)
    assert line.ok is True and named in line.text, line.text
    assert str(path) in line.text or "TOKEN" in named


def test_claude_code_s_project_settings_and_its_auth_token_variable(orch, tmp_path, workdir):
    _write(workdir / ".claude" / "settings.local.json", json.dumps({"apiKeyHelper": "./key.sh"}))
    line = signed_in(orch, "claude_code", _side(orch, tmp_path))
    assert line.ok is True and str(workdir.resolve() / ".claude" / "settings.local.json") in line.text
    line = signed_in(orch, "claude_code", _side(orch, tmp_path.parent, ANTHROPIC_AUTH_TOKEN=SECRET))
    assert line.text == "Claude Code: signed in (ANTHROPIC_AUTH_TOKEN)"


def test_claude_code_s_oauth_variable_in_the_agents_environment_is_cleared_by_cao(orch, tmp_path):
    line = signed_in(orch, "claude_code", _side(orch, tmp_path, CLAUDE_CODE_OAUTH_TOKEN=SECRET))
    assert line.ok is False and "CAO clears CLAUDE_CODE_OAUTH_TOKEN before it starts Claude Code" in line.text


def test_claude_code_on_a_cloud_cannot_be_said_signed_in_or_not(orch, tmp_path):
    line = signed_in(orch, "claude_code", _side(orch, tmp_path, CLAUDE_CODE_USE_BEDROCK="1"))
    assert line.ok is None and "cannot say" in line.text and "Amazon Bedrock" in line.text


# -- Codex --------------------------------------------------------------------------


def test_codex_with_no_login_names_codex_login_and_its_api_key_variable(orch, tmp_path):
    line = signed_in(orch, "codex", _side(orch, tmp_path))
    assert line.ok is False and "run `codex login` as the user the agents run as" in line.text
    assert "`printenv OPENAI_API_KEY | codex login --with-api-key`" in line.text


def test_codex_is_not_signed_in_by_openai_api_key_alone(orch, tmp_path):
    line = signed_in(orch, "codex", _side(orch, tmp_path, OPENAI_API_KEY=SECRET))
    assert line.ok is False and "OPENAI_API_KEY is set, but Codex does not sign in with OPENAI_API_KEY alone" in line.text


@pytest.mark.parametrize("auth", [{"auth_mode": "apikey", "OPENAI_API_KEY": SECRET},
                                  {"OPENAI_API_KEY": None, "tokens": {"id_token": "x", "access_token": "y"}}])
def test_codex_s_login_signs_it_in_where_codex_home_puts_it(orch, tmp_path, auth):
    side = _side(orch, tmp_path)
    path = _write(Path(side.env["HOME"]) / ".codex" / "auth.json", json.dumps(auth, indent=2))
    assert signed_in(orch, "codex", side).text == f"Codex: signed in (its login, {path})"
    moved = _write(tmp_path / "codex-home" / "auth.json", json.dumps(auth))
    assert str(moved) in signed_in(orch, "codex", _side(orch, tmp_path, CODEX_HOME=str(moved.parent))).text
    assert signed_in(orch, "codex", _side(orch, tmp_path, CODEX_HOME=str(tmp_path / "elsewhere"))).ok is False
    _write(path, json.dumps({"OPENAI_API_KEY": None, "tokens": None}))
    assert signed_in(orch, "codex", side).ok is False


CODEX_PROVIDER = 'model = "m"\nmodel_provider = "scripted"\n\n[model_providers.scripted]\nbase_url = "http://x/v1"\n'


def test_codex_s_model_provider_is_signed_in_by_its_env_key(orch, tmp_path):
    side = _side(orch, tmp_path)
    config = _write(Path(side.env["HOME"]) / ".codex" / "config.toml", CODEX_PROVIDER + 'env_key = "MY_KEY"\n')
    line = signed_in(orch, "codex", side)
    assert line.ok is False and f"its model provider scripted ({config}) reads its key from MY_KEY" in line.text
    side.env["MY_KEY"] = SECRET
    assert signed_in(orch, "codex", side).text == "Codex: signed in (its model provider scripted, its key in MY_KEY)"


def test_codex_s_model_provider_without_a_key_or_asking_for_its_login(orch, tmp_path):
    side = _side(orch, tmp_path)
    config = Path(side.env["HOME"]) / ".codex" / "config.toml"
    _write(config, CODEX_PROVIDER)
    assert signed_in(orch, "codex", side).ok is None                    # a local endpoint, or a key it names not
    _write(config, CODEX_PROVIDER + "requires_openai_auth = true\n")
    assert signed_in(orch, "codex", side).ok is False                  # its login decides: none
    _write(config, 'model_provider = "ollama"\n')
    assert signed_in(orch, "codex", side).ok is True
    _write(config, 'model_provider = "elsewhere"\n')
    assert signed_in(orch, "codex", side).ok is None
    _write(config, 'model_provider = "openai"\n[[broken\n')
    assert signed_in(orch, "codex", side).ok is None


# -- OpenCode, Copilot CLI, Hermes --------------------------------------------------


def test_opencode_s_provider_key_in_its_config_or_its_login(orch, tmp_path):
    side = _side(orch, tmp_path)
    config = Path(side.env["HOME"]) / ".aws" / "opencode" / "opencode.json"
    assert signed_in(orch, "opencode_cli", side).ok is None             # no model: cannot say
    _write(config, json.dumps({"model": "anthropic/claude"}))
    line = signed_in(orch, "opencode_cli", side)
    assert line.ok is None and "provider anthropic" in line.text and "`opencode auth login`" in line.text
    data = tmp_path / "data"
    _write(data / "opencode" / "auth.json", json.dumps({"anthropic": {"type": "api", "key": SECRET}}))
    assert signed_in(orch, "opencode_cli", _side(orch, tmp_path, XDG_DATA_HOME=str(data))).ok is True
    _write(config, json.dumps({"model": "local/m", "provider": {"local": {"options": {"apiKey": SECRET}}}}))
    assert signed_in(orch, "opencode_cli", side).text == \
        f"OpenCode: signed in (the apiKey of provider local in {config})"


def test_copilot_cli_s_forms_of_sign_in(orch, tmp_path):
    side = _side(orch, tmp_path)
    line = signed_in(orch, "copilot_cli", side)
    assert line.ok is False and "run `copilot`, then /login" in line.text and "COPILOT_GITHUB_TOKEN" in line.text
    assert signed_in(orch, "copilot_cli", _side(orch, tmp_path, GH_TOKEN=SECRET)).text == \
        "GitHub Copilot CLI: signed in (GH_TOKEN)"
    assert "COPILOT_PROVIDER_BASE_URL" in signed_in(
        orch, "copilot_cli", _side(orch, tmp_path, COPILOT_PROVIDER_BASE_URL="http://127.0.0.1:1/v1")).text
    hosts = _write(Path(side.env["HOME"]) / ".config" / "gh" / "hosts.yml", "github.com:\n    user: you\n")
    line = signed_in(orch, "copilot_cli", side)
    assert line.ok is None and str(hosts) in line.text
    config = _write(Path(side.env["HOME"]) / ".copilot" / "config.json",   # as Copilot writes it: comments first
                    '// User settings belong in settings.json.\n{\n  "logged_in_users": [{"host": "https://github.com",'
                    ' "login": "you"}],\n  "trustedFolders": []\n}\n')
    assert signed_in(orch, "copilot_cli", side).text == f"GitHub Copilot CLI: signed in (its /login, {config})"


def test_hermes_s_forms_of_sign_in(orch, tmp_path):
    side = _side(orch, tmp_path)
    line = signed_in(orch, "hermes", side)
    assert line.ok is False and "run `hermes setup`" in line.text and "OPENROUTER_API_KEY" in line.text
    assert signed_in(orch, "hermes", _side(orch, tmp_path, DEEPSEEK_API_KEY=SECRET)).text == \
        "Hermes Agent: signed in (DEEPSEEK_API_KEY)"
    folder = Path(side.env["HOME"]) / ".hermes"
    env_file = _write(folder / ".env", "# keys\nOPENROUTER_API_KEY=\nexport ANTHROPIC_API_KEY='x'\n")
    assert signed_in(orch, "hermes", side).text == f"Hermes Agent: signed in (a provider's key in {env_file})"
    env_file.unlink()
    for config in ("model:\n  default: m\n  provider: custom\n  base_url: http://x/v1\n",
                   json.dumps({"model": {"provider": "custom", "base_url": "http://x/v1", "default": "m"}})):
        _write(folder / "config.yaml", config)
        assert "its model provider in" in signed_in(orch, "hermes", side).text, config
    _write(folder / "config.yaml", "model: anthropic/claude-opus\n")     # a fresh install's: not set up
    assert signed_in(orch, "hermes", side).ok is False
    moved = _write(tmp_path / "hermes-home" / "auth.json", json.dumps({"active_provider": "nous", "providers": {}}))
    assert "its login" in signed_in(orch, "hermes", _side(orch, tmp_path, HERMES_HOME=str(moved.parent))).text


def test_every_sign_in_a_row_declares_is_readable(orch):
    rows = {name: cli for name, cli in orch.AGENT_CLIS.items() if cli.sign_in}
    assert set(rows) == {"claude_code", "codex", "opencode_cli", "copilot_cli", "hermes"}
    for cli in rows.values():
        assert cli.sign_in.login and cli.sign_in.instead.startswith("or ")
        for form in cli.sign_in.forms:
            assert form.name and (bool(form.env) + bool(form.file) + bool(form.reader) >= 1), form
            assert not form.reader or form.reader in orch.SIGN_IN_READERS, form
            assert not form.file or form.reader or bool(form.json_key) != bool(form.pattern), form
    assert orch.sign_in_lines(orch.AGENT_CLIS["mock_cli"], orch.AgentsSide({}, 0, {})) == []


# -- an environment trap checks the value the CLI needs -------------------------------


def test_is_sandbox_must_be_exactly_1_for_claude_code_as_root(orch, tmp_path):
    cli = orch.AGENT_CLIS["claude_code"]
    line = orch.check_trap(cli, cli.traps[0], _side(orch, tmp_path, uid=0, IS_SANDBOX="yes"))
    assert line.ok is False and "has IS_SANDBOX=yes, and Claude Code takes only IS_SANDBOX=1" in line.text
    assert "`IS_SANDBOX=1 cao-server`" in line.text
    assert "has no IS_SANDBOX" in orch.check_trap(cli, cli.traps[0], _side(orch, tmp_path, uid=0)).text
    assert orch.check_trap(cli, cli.traps[0], _side(orch, tmp_path, uid=0, IS_SANDBOX="1")).ok is True
    hermes = orch.AGENT_CLIS["hermes"]
    assert orch.check_trap(hermes, hermes.traps[0], _side(orch, tmp_path, PROMPT_TOOLKIT_NO_CPR="true")).ok is False


def test_the_own_server_sets_the_rows_value_over_the_users_and_says_so(load_orch, monkeypatch):
    monkeypatch.setenv("IS_SANDBOX", "yes")
    monkeypatch.setenv("PROMPT_TOOLKIT_NO_CPR", "1")
    m = load_orch(PROVIDER="claude_code", TESTER_PROVIDER="hermes")
    monkeypatch.setattr(m.os, "geteuid", lambda: 0)
    env = m.OwnServer(4321, "/tmp/cao-loop-x", "").env()
    assert env["IS_SANDBOX"] == "1" and env["PROMPT_TOOLKIT_NO_CPR"] == "1"
    assert m.own_server_overrides() == ("the agents get IS_SANDBOX=1 in place of IS_SANDBOX=yes from this "
                                        "environment: the CLIs take only those values")
    monkeypatch.setenv("IS_SANDBOX", "1")
    assert m.own_server_overrides() == ""


def test_check_on_the_own_server_as_root_names_the_value_it_sets_and_the_sign_in(load_orch, monkeypatch, prompt_file,
                                                                                  capsys, tmp_path):
    tools = tmp_path / "tools"
    tools.mkdir()
    for name in ("cao-server", "cao", "claude"):
        (tools / name).write_text("#!/bin/sh\necho 2.1.197\n", encoding="utf-8")
        (tools / name).chmod(0o755)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("PATH", f"{tools}:/usr/bin:/bin")
    monkeypatch.setenv("IS_SANDBOX", "yes")
    for name in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "CLAUDE_CODE_USE_BEDROCK", "CLAUDE_CODE_USE_VERTEX"):
        monkeypatch.delenv(name, raising=False)
    m = load_orch(PROMPT_FILE=str(prompt_file), OWN_SERVER="1", PROVIDER="claude_code", API=None)
    monkeypatch.setattr(m, "loop_program", lambda name: str(tools / name))
    monkeypatch.setattr(m.os, "getuid", lambda: 0)
    monkeypatch.setattr(m.os, "geteuid", lambda: 0)
    assert run_main(m, "--check") == 1
    out = capsys.readouterr().out
    assert "✓ Claude Code: IS_SANDBOX=1 set for root" in out
    assert "! the run's own server: the agents get IS_SANDBOX=1 in place of IS_SANDBOX=yes" in out   # it gives them 1
    assert "✗ Claude Code: not signed in where its agents run" in out and "ANTHROPIC_API_KEY" in out
    # the same signed-out CLI as the programmer's fallback only: a warning naming whose, and a run can start
    (tools / "mock_cli").write_text("#!/bin/sh\necho 1.0\n", encoding="utf-8")
    (tools / "mock_cli").chmod(0o755)
    m = load_orch(PROMPT_FILE=str(prompt_file), OWN_SERVER="1", PROVIDER="mock_cli", API=None,
                  PROGRAMMER_FALLBACK_PROVIDER="claude_code")
    monkeypatch.setattr(m, "loop_program", lambda name: str(tools / name))
    assert run_main(m, "--check") == 0
    out = capsys.readouterr().out
    assert "! the programmer's fallback: Claude Code: not signed in where its agents run" in out
    assert "! the run's own server: the agents get IS_SANDBOX=1 in place of IS_SANDBOX=yes" in out
    assert "✗" not in out and out.rstrip().endswith("a run can start")
    m = load_orch(PROMPT_FILE=str(prompt_file), OWN_SERVER="1", PROVIDER="claude_code", API=None)
    monkeypatch.setattr(m, "loop_program", lambda name: str(tools / name))
    monkeypatch.setenv("ANTHROPIC_API_KEY", SECRET)
    monkeypatch.setenv("IS_SANDBOX", "1")
    _write(home / ".claude.json", json.dumps({"customApiKeyResponses": {"approved": [SECRET[-20:]]},
                                              "hasCompletedOnboarding": True}))
    assert run_main(m, "--check") == 0
    out = capsys.readouterr().out
    assert "✓ Claude Code: signed in (ANTHROPIC_API_KEY, approved in" in out and out.rstrip().endswith("a run can start")
    assert SECRET[-20:] not in out
