"""The command line as a newcomer meets it: --help, --version, warnings and the errors of a first hour."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import respx

from conftest import FAST, ROOT, run_main

SCRIPT = ROOT / "run_orchestrator_loop.py"


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_help_lists_every_setting_with_its_env_name_json_key_and_default(orch):
    result = run_cli("--help")
    assert result.returncode == 0 and result.stderr == ""
    lines = result.stdout.splitlines()
    for setting in orch.SETTINGS:
        row = next((line for line in lines if line.split()[:2] == [setting.env, setting.key]), None)
        assert row is not None, f"{setting.env} missing from --help"
        assert row.split()[-1] == orch._shown_default(setting).split()[-1]
    for code, _ in orch.EXIT_CODES:
        assert any(line.strip().startswith(f"{code} ") for line in lines), code
    assert "README.md" in lines[-1]


def test_version(orch):
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip().endswith(orch.__version__)


def test_misspelt_environment_variable_gets_a_warning_and_the_run_goes_on(load_orch, fake_cao, prompt_file, capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", MAX_ROUND="3", **FAST)
    assert run_main(m) == 0
    err = capsys.readouterr().err
    assert "warning: MAX_ROUND is not a setting (ignored); did you mean MAX_ROUNDS?" in err


def test_ordinary_environment_variables_get_no_warning(orch):
    assert orch.misspelt_settings({"PATH": "/bin", "PWD": "/", "HOME": "/root", "TERM": "xterm",
                                   "SHELL": "/bin/bash", "LANG": "C", "USER": "me"}) == []


def test_env_name_as_json_key_gets_its_json_key(load_orch, fake_cao, prompt_file, tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"MAX_ROUNDS": 3}))
    m = load_orch(PROMPT_FILE=str(prompt_file))
    assert run_main(m, str(config)) == 2
    err = capsys.readouterr().err.strip()
    assert "'MAX_ROUNDS' is the environment variable; in a config file it is 'limits.max_rounds'" in err
    assert "\n" not in err


def test_a_server_that_answers_html_gets_one_line_naming_it(load_orch, prompt_file, capsys):
    page = "<!doctype html><html><head><title>Welcome to nginx!</title></head><body>" + "x" * 5000 + "</body></html>"
    with respx.mock(assert_all_called=False) as router:
        router.route(host="cao.test").mock(return_value=httpx.Response(
            200, text=page, headers={"content-type": "text/html"}))
        m = load_orch(PROMPT_FILE=str(prompt_file), **FAST)
        assert run_main(m) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and len(err) < 400
    assert "is not a CAO server" in err and "'Welcome to nginx!'" in err and "set API" in err


def test_the_unedited_template_is_refused_naming_its_placeholder(load_orch, fake_cao, capsys):
    m = load_orch(PROMPT_FILE=str(ROOT / "prompt_template.md"))
    assert run_main(m) == 2
    err = capsys.readouterr().err.strip()
    assert "is the unedited template" in err and m.TEMPLATE_PLACEHOLDERS[0] in err
    assert fake_cao.requests == []


def test_every_template_placeholder_is_in_the_template(orch):
    template = (ROOT / "prompt_template.md").read_text(encoding="utf-8").splitlines()
    for placeholder in orch.TEMPLATE_PLACEHOLDERS:
        assert placeholder in (line.strip() for line in template)


def test_wd_that_is_this_programs_own_directory_is_refused(load_orch, fake_cao, prompt_file, capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), WD=str(ROOT))
    assert run_main(m) == 2
    err = capsys.readouterr().err
    assert "is this program's own directory" in err and "set WD" in err
    assert fake_cao.requests == []


def test_start_up_says_what_it_creates_with_which_provider(load_orch, fake_cao, prompt_file, capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", PROVIDER="claude_code", **FAST)
    assert run_main(m) == 0
    out = capsys.readouterr().out
    assert "creating the five agent terminals on http://cao.test with provider claude_code" in out
