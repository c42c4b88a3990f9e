"""The command line as a newcomer meets it: --help, --version, warnings and the errors of a first hour."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import respx

from conftest import FAST, ROOT, lock_holder_process, run_main

SCRIPT = ROOT / "run_orchestrator_loop.py"


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_help_is_one_screen_with_usage_example_providers_and_where_the_rest_is(orch):
    result = run_cli("--help")
    assert result.returncode == 0 and result.stderr == ""
    lines = result.stdout.splitlines()
    assert len(lines) <= 40 and max(map(len, lines)) <= 80
    assert lines[0] == "usage: run_orchestrator_loop.py [config.json]"
    for env in orch.COMMON_SETTINGS:
        assert any(line.split()[:1] == [env] for line in lines), env
    assert any(line.split() == ["RESUME", "unset", "(automatic)"] for line in lines)
    assert any(line.split() == ["RESPONSE_TIMEOUT", "1800", "s"] for line in lines)
    text = " ".join(result.stdout.split())
    assert all(provider in text for provider in orch.AGENT_CLIS)
    assert "Example: PROVIDER=claude_code PROMPT_FILE=task.md run_orchestrator_loop.py" in text
    assert "--help-settings" in text and lines[-1] == "Documentation: run_orchestrator_loop.py --readme (README.md; the rest in docs/)"


def test_help_settings_lists_every_setting_with_its_env_name_json_key_and_default(orch):
    result = run_cli("--help-settings")
    assert result.returncode == 0 and result.stderr == ""
    lines = result.stdout.splitlines()
    assert max(map(len, lines)) <= 80
    text = result.stdout
    for setting in orch.SETTINGS:
        assert f"{setting.env} ({setting.key}; default {orch._shown_default(setting)})" in " ".join(text.split()), \
            setting.env
    for env, _ in orch.SECRET_HELP:
        assert f"{env}  (environment only; default -)" in lines
    for code, _, action in orch.EXIT_CODES:       # each with what a scheduler does on it
        assert any(line.strip().startswith(f"{code} ") for line in lines), code
        assert f"a scheduler: {action}" in " ".join(text.split()), code


def test_the_installed_command_calls_itself_by_its_name(orch, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/cao-orchestrator-loop", "--help"])
    with pytest.raises(SystemExit):
        orch.main()
    out = capsys.readouterr().out
    assert out.startswith("usage: cao-orchestrator-loop [config.json]\n")
    assert "Documentation: cao-orchestrator-loop --readme" in out


def test_readme_prints_the_documentation(orch):
    result = run_cli("--readme")
    assert result.returncode == 0 and result.stdout == (ROOT / "README.md").read_text(encoding="utf-8")


def test_an_installed_copy_reads_its_readme_from_the_package_metadata(orch, monkeypatch, tmp_path):
    monkeypatch.setattr(orch, "__file__", str(tmp_path / "site-packages" / "run_orchestrator_loop.py"))
    payload = "# Orchestrator loop\n\nfrom the metadata\n"

    class Metadata:
        def get_payload(self):
            return payload
    monkeypatch.setattr(orch.metadata, "metadata", lambda name: Metadata() if name == orch.PACKAGE_NAME else None)
    assert orch.readme_text() == payload


@pytest.mark.parametrize("args, expected", [
    (["--stats"], "error: unknown option --stats (see run_orchestrator_loop.py --help)"),
    (["config.json", "--verbose"], "error: unknown option --verbose (see run_orchestrator_loop.py --help)"),
    (["--stat"], "error: unknown option --stat (see run_orchestrator_loop.py --help)"),
    (["a.json", "b.json"], "error: one config file at most, got also b.json (see run_orchestrator_loop.py --help)"),
])
def test_unknown_options_and_extra_arguments_are_refused_in_one_line(args, expected):
    result = run_cli(*args)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == expected + "\n"


def test_a_reader_that_closes_the_pipe_ends_help_quietly():
    for _ in range(5):
        result = subprocess.run(f"{shlex.quote(sys.executable)} {shlex.quote(str(SCRIPT))} --help-settings | head -1",
                                shell=True, capture_output=True, text=True, timeout=60)
        assert result.stdout.startswith("Settings:") and result.stderr == ""


def test_version(orch):
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"run_orchestrator_loop.py (cao-orchestrator-loop) {orch.__version__}"


def test_misspelt_environment_variable_is_warned_of_first_and_last_and_the_run_goes_on(load_orch, fake_cao, prompt_file, capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", MAX_ROUND="3", **FAST)
    assert run_main(m) == 0
    err = capsys.readouterr().err.splitlines()
    warning = "warning: MAX_ROUND is not a setting (ignored); did you mean MAX_ROUNDS?"
    assert err[0] == warning and err[-1] == warning          # the run's first line, and again its last
    assert (Path(m.run_dir) / "run.log").read_text().splitlines()[-1] == warning


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
        assert run_main(m) == 3
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


def test_wd_that_is_a_checkout_of_this_program_is_refused(load_orch, fake_cao, prompt_file, tmp_path, capsys):
    """An installed command runs from site-packages: a checkout it is started in is still its own source."""
    checkout = tmp_path / "orchestrator-loop"
    checkout.mkdir()
    for name in ("run_orchestrator_loop.py", "pyproject.toml"):
        (checkout / name).write_text((ROOT / name).read_text())
    m = load_orch(PROMPT_FILE=str(prompt_file), WD=str(checkout))
    assert run_main(m) == 2
    assert "is this program's own directory (a checkout" in capsys.readouterr().err
    assert fake_cao.requests == []


def test_start_up_says_what_it_creates_with_which_provider(load_orch, fake_cao, prompt_file, capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", PROVIDER="claude_code", **FAST)
    assert run_main(m) == 0
    out = capsys.readouterr().out
    assert "creating the five agent terminals on http://cao.test with provider claude_code" in out


def test_run_summary_in_the_log_and_as_json_in_the_archive(load_orch, fake_cao, prompt_file, capsys):
    """The end of a run: rounds, turns and time per role, verdicts, prompt bytes -- logged and in summary.json."""
    from fake_cao import FAIL_REPLY, PASS_REPLY
    fake_cao.script["tester"] = [FAIL_REPLY, PASS_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), MIN_REVIEW_CYCLES_BEFORE_APPROVAL="1", **FAST)
    assert run_main(m) == 0
    summary = json.loads((Path(m.run_dir) / "summary.json").read_text())
    assert summary["result"] == "PASS" and summary["exit_code"] == 0 and summary["rounds"] == 2
    assert summary["turns"] == 8
    assert {role: r["turns"] for role, r in summary["roles"].items()} == {
        "analyst": 1, "peer_analyst": 1, "programmer": 2, "peer_programmer": 2, "tester": 2}
    assert summary["roles"]["tester"]["outcomes"] == ["FAIL", "PASS"]
    assert summary["roles"]["peer_analyst"]["outcomes"] == ["APPROVED"]
    assert summary["prompt_bytes"] == sum(len(message.encode()) for _, message in fake_cao.prompts)
    assert all(r["seconds"] >= 0 for r in summary["roles"].values())
    out = capsys.readouterr().out
    assert "summary: PASS after round 2/8; 8 turns" in out and "tester: FAIL -> PASS" in out


def test_status_of_a_running_run_names_the_process_that_drives_it(load_orch, fake_cao, prompt_file, capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", **FAST)
    assert run_main(m) == 0
    state = json.loads(Path(m.STATE_FILE).read_text())
    state.update(final_status="RUNNING", current_phase="tester", current_round=2)
    Path(m.STATE_FILE).write_text(json.dumps(state))
    holder = lock_holder_process(m.STATE_FILE)
    try:
        before = Path(m.STATE_FILE).read_bytes()
        capsys.readouterr()
        assert run_main(m, "--status") == 0
        out = capsys.readouterr().out
        assert "run: an unfinished run (round 2, tester phase" in out
        assert f"driven by: pid {holder.pid} since" in out
        assert f"tmux attach -t {state['session_name']}" in out
        assert Path(m.STATE_FILE).read_bytes() == before
    finally:
        holder.kill()
        holder.wait()
    capsys.readouterr()
    assert run_main(m, "--status") == 0
    assert "driven by: no process -- rerun the command to resume it" in capsys.readouterr().out


def test_status_of_a_finished_run(load_orch, fake_cao, prompt_file, capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", **FAST)
    assert run_main(m) == 0
    capsys.readouterr()
    assert run_main(m, "--status") == 0
    out = capsys.readouterr().out
    assert "run: finished with PASS in round 1" in out and "driven by: no process\n" in out


def test_status_of_a_run_that_ended_in_fail_counts_its_rounds_and_says_how_to_go_on(load_orch, fake_cao, prompt_file,
                                                                                     capsys, tmp_path):
    from fake_cao import FAIL_REPLY
    fake_cao.script["tester"] = [FAIL_REPLY]
    config = tmp_path / "loop.json"
    config.write_text("{}")
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", MAX_ROUNDS="2", **FAST)
    assert run_main(m, str(config)) == 1
    capsys.readouterr()
    assert run_main(m, "--status", str(config)) == 0
    out = capsys.readouterr().out
    assert "run: finished with FAIL in round 2," in out
    assert f"next: to go on with more rounds, RESUME=1 MAX_ROUNDS=3 cao-orchestrator-loop {config}" in out


def test_status_says_how_the_last_invocation_stopped_and_what_a_scheduler_does_next(load_orch, fake_cao, prompt_file,
                                                                                     capsys):
    """A runtime error (exit 3) is retried, a FAIL verdict (exit 1) is not: --status says which, from the run's
    own record, while no process drives the run."""
    from fake_cao import FAIL_REPLY
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", MAX_ROUNDS="1", **FAST)
    for reply, code, said in (
            ({"action": "error"}, 3, "last stop: exit 3 (a runtime error the same command can get past (server "
                                     "unreachable, timeout, usage limit, ...); "
                                     "the state is saved); a scheduler: retry: the same command resumes the run"),
            (FAIL_REPLY, 1, "last stop: exit 1 (no PASS within MAX_ROUNDS: the tester's verdict; the state is "
                            "saved); a scheduler: stop, do not retry")):
        fake_cao.script["tester"] = [reply]
        assert run_main(m) == code
        capsys.readouterr()
        assert run_main(m, "--status") == 0
        out = capsys.readouterr().out
        assert said in out, out


def test_status_json_is_one_object_a_program_reads_and_acts_on(load_orch, fake_cao, prompt_file, capsys):
    """--status --json: the run's standing, its last exit and what a scheduler does, as one JSON object, read
    without asking the server; --json alone is a usage error."""
    fake_cao.script["tester"] = [{"action": "error"}]
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", MAX_ROUNDS="1", **FAST)
    assert run_main(m) == 3
    capsys.readouterr()
    asked = len(fake_cao.requests)
    assert run_main(m, "--status", "--json") == 0
    out = capsys.readouterr().out
    facts = json.loads(out)
    assert out.count("\n") == 1 and len(fake_cao.requests) == asked
    state = json.loads(Path(m.STATE_FILE).read_text())
    assert facts["result"] == "RUNNING" and facts["round"] == 1 and facts["phase"] == "tester"
    assert facts["next"] == "the test, round 1" and facts["driven_by"] is None
    assert facts["last_exit_code"] == 3 and facts["scheduler_action"] == "retry: the same command resumes the run"
    assert facts["session"] == state["session_name"] and facts["terminals"] == state["terminals"]
    assert facts["state_file"] == m.STATE_FILE and facts["turns"] == 0 and facts["tokens"] is None
    assert run_main(m, "--json") == 2
    assert "--json goes with --status" in capsys.readouterr().err
    assert run_main(m, "--follow") == 2
    assert "--follow goes with --status" in capsys.readouterr().err


def test_each_way_of_stopping_has_its_own_exit_code_and_scheduler_action_as_the_readme_lists_them(orch):
    codes = [code for code, _, _ in orch.EXIT_CODES]
    assert len(set(codes)) == len(codes) and all(0 <= code < 256 for code in codes)
    assert all(meaning and action for _, meaning, action in orch.EXIT_CODES)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme.split("\n## Exit codes", 1)[1].split("\n## ", 1)[0]
    rows = {int(line.split("|")[1]): line for line in table.splitlines() if re.match(r"\| \d+ \|", line)}
    assert sorted(rows) == sorted(codes)
    for code, _, action in orch.EXIT_CODES:       # the action's first words ("retry", "stop and alert", ...)
        assert f"| {action.split(':')[0]}" in rows[code], (code, action, rows[code])


def test_status_asks_the_server_the_run_is_on_not_the_default_one(load_orch, fake_cao, prompt_file, capsys):
    """The run's server is not on the default port: --status without API asks the server the state file names."""
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", CLEANUP_ON_EXIT="0", **FAST)
    assert run_main(m) == 0
    capsys.readouterr()
    m = load_orch(API=None)
    assert m.API == "http://localhost:9889"
    assert run_main(m, "--status") == 0
    out = capsys.readouterr().out
    assert "CAO server: http://cao.test" in out
    assert "agents: the five agents of CAO session" in out and "are still running" in out


def test_status_without_a_state_file(load_orch, fake_cao, capsys):
    m = load_orch()
    assert run_main(m, "--status") == 1
    assert "no state file at" in capsys.readouterr().err
    assert fake_cao.requests == []


def test_status_names_the_agent_working_now_the_turns_used_and_the_most_left(load_orch, fake_cao, prompt_file,
                                                                             capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", **FAST)
    assert run_main(m) == 0
    state = json.loads(Path(m.STATE_FILE).read_text())
    sent = time.time() - 125
    state.update(final_status="RUNNING", current_phase="programmer", current_round=2, phase_cycle=1,
                 phase_step="review", in_flight={"role": "peer_programmer", "round": 2, "phase": "programmer",
                                                 "cycle": 1, "sent_at": sent, "first_sent_at": sent})
    Path(m.STATE_FILE).write_text(json.dumps(state))
    capsys.readouterr()
    m = load_orch(MAX_ROUNDS="3", MAX_REVIEW_CYCLES="3")
    assert run_main(m, "--status") == 0
    out = capsys.readouterr().out
    terminal = state["terminals"]["peer_programmer"]
    assert re.search(rf"working now: peer_programmer \(terminal {terminal}\), prompt sent [\d -:]+ UTC, 2m 5s ago",
                     out), out
    # round 2: this review and two more cycles (5 turns) and the test; round 3: 3 cycles and the test
    assert "turns: 1 answered, at most 13 left (MAX_ROUNDS=3, MAX_REVIEW_CYCLES=3)" in out
    assert "are still running" in out            # the agents' session is there
    assert "\nCAO server: http://cao.test\n" in out
    assert "\nnext: the peer programmer's review, cycle 1 of 3 of round 2's programmer phase\n" in out


@pytest.mark.parametrize("phase, step, said", [
    ("analyst", "author", "the analyst's turn, cycle 2 of 3 of round 1's analyst phase"),
    ("analyst", "review", "the peer analyst's review, cycle 2 of 3 of round 1's analyst phase"),
    ("tester", "author", "the test, round 1"),
    ("tester", "verify", "the check of the tester's PASS (PROJECT_TEST_CMD), round 1")])
def test_status_says_the_next_step_in_words(orch, phase, step, said):
    saved = orch.SavedState(current_phase=phase, phase_cycle=2, phase_step=step, current_round=1)
    assert orch.next_step(saved) == said


def test_the_most_turns_left_follow_the_documented_worst_case(orch):
    """A new run with the defaults can take at most the 62 turns of docs/following-a-run.md's worst case."""
    saved = orch.SavedState(final_status="RUNNING", current_phase="analyst", phase_cycle=1, phase_step="author",
                            current_round=1)
    assert orch.turns_left_at_most(saved) == 62
    saved.current_phase = "tester"
    assert orch.turns_left_at_most(saved) == 1 + 7 * 7


def written_to_a_closed_pipe(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The command, its output going to a pipe nobody reads any more (as `| head -6` leaves it)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([sys.executable, str(SCRIPT), *args], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, timeout=60, env=env)
    finally:
        os.close(write_end)


def test_every_output_command_ends_quietly_when_its_reader_has_gone(load_orch, fake_cao, prompt_file, capsys):
    """`--status | head -6` and the like: the reader gone, the command ends without a word on stderr (no
    BrokenPipeError traceback) and with the exit code it would have had."""
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", **FAST)
    assert run_main(m) == 0
    env = {**os.environ, "WD": m.WD, "API": "http://127.0.0.1:9"}
    for args in (["--status"], ["--status", "--json"], ["--status", "--follow"], ["--help"], ["--help-settings"],
                 ["--readme"], ["--version"]):
        result = written_to_a_closed_pipe(*args, env=env)
        assert (result.returncode, result.stderr) == (0, ""), (args, result.stderr[-2000:])
    check = written_to_a_closed_pipe("--check", env={**env, "PROMPT_FILE": str(prompt_file)})
    assert check.returncode == 1 and "Traceback" not in check.stderr, check.stderr[-2000:]   # no server at API
