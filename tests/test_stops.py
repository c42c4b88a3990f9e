"""Every stop tells the truth: exit 3 only where the same command gets past it, 2 where a person or a setting
must change something (the line says what), 70 for a fault of the loop itself with its traceback kept; and what
--status (text and JSON) and the hints say matches what happened."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest

from conftest import FAST, ROOT, run_main
from fake_cao import FAIL_REPLY, MainThreadSignals

TESTER_ONLY = {**FAST, "MIN_REVIEW_CYCLES_BEFORE_APPROVAL": "1", "START_AGENT": "tester"}


def test_a_fault_of_the_loop_exits_70_keeps_its_traceback_and_a_rerun_goes_on(load_orch, fake_cao, prompt_file,
                                                                               capsys, monkeypatch):
    """A KeyError in the loop's own code: exit 70 (not 3: a retry would meet it again), its whole traceback in
    the run folder, named by the last line and by --status; the state is saved, and once the fault is gone the
    same command goes on from the reply already taken."""
    m = load_orch(PROMPT_FILE=str(prompt_file), **TESTER_ONLY)

    def faulty(kind, text):
        return {}["verdict"]
    monkeypatch.setattr(m, "reply_verdict", faulty)
    assert run_main(m) == 70
    err = capsys.readouterr().err.strip().splitlines()[-1]
    kept = Path(m.run_dir) / "traceback.txt"
    assert err.startswith("error: a fault of the loop itself (KeyError: 'verdict'); its traceback is in "
                          f"{kept}; state saved")
    text = kept.read_text()
    assert "Traceback (most recent call last)" in text and "in faulty" in text and "KeyError: 'verdict'" in text
    state = json.loads(Path(m.STATE_FILE).read_text())
    assert state["final_status"] == "RUNNING"
    assert json.loads(Path(m.run_dir, "summary.json").read_text())["exit_code"] == 70
    m = load_orch(PROMPT_FILE=str(prompt_file), **TESTER_ONLY)
    assert run_main(m, "--status") == 0
    out = capsys.readouterr().out
    assert "last stop: exit 70 (a fault of the loop itself" in out and f"traceback: {kept}" in out
    assert run_main(m, "--status", "--json") == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["last_exit_code"] == 70 and facts["traceback"] == str(kept)
    assert facts["scheduler_action"].startswith("stop and alert: a bug")
    assert run_main(m) == 0                                  # the fault gone: the same command goes on
    assert [role for role, _ in fake_cao.prompts] == ["tester"]     # the tester is not asked again


def test_a_provider_the_server_does_not_know_stops_with_exit_2_and_what_to_set(load_orch, fake_cao, prompt_file,
                                                                              capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), PROVIDER="q_cli", **TESTER_ONLY)
    for role in m.ROLES:
        fake_cao.fail_create[m.profile_for(role)] = (400, "Unknown provider type: q_cli")
    assert run_main(m) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cao-server at http://cao.test does not know provider q_cli (it knows: claude_code, "
                          "codex, kiro_cli): set PROVIDER")
    assert not Path(m.STATE_FILE).exists()


def test_check_names_a_provider_the_server_does_not_list(load_orch, fake_cao, prompt_file, capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), PROVIDER="q_cli")
    assert run_main(m, "--check") == 1
    out = capsys.readouterr().out
    assert "✗ cao-server at http://cao.test does not know provider q_cli (it knows: claude_code, codex, " \
           "kiro_cli)" in out
    assert "a run can start" not in out


def test_an_older_cao_is_told_the_release_that_knows_the_scripted_agent(orch):
    """CAO leaves mock_cli out of its providers list: the row's first release, against the running version."""
    line = orch.provider_unknown_line("mock_cli", {"codex": ("codex", True)}, "2.4.0")
    assert line.startswith("this CAO does not know mock_cli: CAO >= 2.5.4 (cao-server at http://cao.test "
                           "(cli-agent-orchestrator 2.4.0))")
    assert orch.version_tuple("2.4.0") < orch.version_tuple("2.5.4") <= orch.version_tuple("2.10.0")


def test_an_event_that_cannot_be_written_is_said_once_and_the_run_goes_on(load_orch, fake_cao, prompt_file,
                                                                          capsys, monkeypatch):
    m = load_orch(PROMPT_FILE=str(prompt_file), **TESTER_ONLY)
    real_open = m.os.open

    def refusing(path, *args, **kwargs):
        if str(path).endswith(m.EVENTS_FILE):
            raise OSError(28, "No space left on device")
        return real_open(path, *args, **kwargs)
    monkeypatch.setattr(m.os, "open", refusing)
    assert run_main(m) == 0
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if "could not write the run's events" in line]
    assert len(said) == 1 and "No space left on device" in said[0] and "the run goes on" in said[0]
    assert not Path(m.run_dir, m.EVENTS_FILE).exists()


def test_a_prompt_copy_that_cannot_be_written_is_said_once(load_orch, fake_cao, prompt_file, capsys, monkeypatch):
    m = load_orch(PROMPT_FILE=str(prompt_file), **TESTER_ONLY)
    monkeypatch.setattr(m, "prompt_file_path", lambda role, number: Path("/proc/no-such-folder") / f"{number}.md")
    assert run_main(m) == 0
    out = capsys.readouterr().out
    assert out.count("could not write the copies of the prompts sent") == 1


def test_status_json_says_what_the_text_says_after_a_fail_and_while_an_agent_works(load_orch, fake_cao,
                                                                                   prompt_file, capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), MAX_ROUNDS="1", **TESTER_ONLY)
    fake_cao.script["tester"] = [FAIL_REPLY]
    assert run_main(m) == 1
    capsys.readouterr()
    assert run_main(m, "--status") == 0
    text_next = re.search(r"^next: (.*)$", capsys.readouterr().out, re.M).group(1)
    assert run_main(m, "--status", "--json") == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["next"] == text_next and "RESUME=1 MAX_ROUNDS=2" in facts["next"]
    assert facts["working_now"] is None
    state = json.loads(Path(m.STATE_FILE).read_text())
    state.update(final_status="RUNNING", current_phase="tester", in_flight={
        "role": "tester", "round": 1, "phase": "tester", "cycle": 1, "sent_at": 1795000000.0,
        "first_sent_at": 1795000000.0})
    Path(m.STATE_FILE).write_text(json.dumps(state))
    assert run_main(m, "--status", "--json") == 0
    working = json.loads(capsys.readouterr().out)["working_now"]
    assert working["role"] == "tester" and working["terminal"] == state["terminals"]["tester"]
    assert working["since"] == m.utc_iso(1795000000.0) and working["text"].startswith("tester (terminal ")


def test_the_stop_hint_names_the_server_when_it_is_not_cao_s_default(load_orch):
    """CAO's `cao` reads its server's address from CAO_API_HOST and CAO_API_PORT (127.0.0.1:9889 by default)."""
    assert load_orch(API="http://localhost:9889").cao_hint("shutdown --session s") == "cao shutdown --session s"
    assert load_orch(API="http://127.0.0.1:9890").cao_hint("shutdown --session s") == \
        "CAO_API_PORT=9890 cao shutdown --session s"
    assert load_orch(API="http://cao.test").cao_hint("shutdown --all") == "CAO_API_HOST=cao.test CAO_API_PORT=80 " \
                                                                          "cao shutdown --all"


def test_a_working_directory_inside_this_checkout_is_refused(load_orch, fake_cao, prompt_file, capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), WD=str(ROOT / "docs"))
    assert run_main(m, "--check") == 2
    out = capsys.readouterr().out
    assert f"✗ WD={ROOT / 'docs'} is inside {ROOT}, this program's own directory" in out
    assert fake_cao.requests == []


def test_the_docstring_and_the_code_map_name_every_exit_code_and_section(orch):
    """The module docstring lists each exit code of EXIT_CODES and every numbered section by its heading; the
    code map's section table names the same sections."""
    source = Path(orch.__file__).read_text(encoding="utf-8")
    headings = dict(re.findall(r"^# (\d+)\. (.+)$", source, re.M))
    doc = orch.__doc__
    codes = doc.split("Exit codes:", 1)[1].split("\n\n", 1)[0]
    assert [int(code) for code in re.findall(r"(?:^|,)\s+(\d+) ", codes)] == [code for code, _, _ in orch.EXIT_CODES]
    listed = dict(re.findall(r"(\d+)\. (.+?)(?=\s{2,}\d+\.|\s*$)", doc.split("Sections,", 1)[1], re.M))
    assert sorted(listed, key=int) == sorted(headings, key=int) == [str(n) for n in range(1, len(headings) + 1)]
    for number, name in listed.items():
        assert headings[number].startswith(name.strip()), (number, name, headings[number])
    code_map = (ROOT / "docs" / "code-map.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| (\d+)\. ([^|]+?) \|", code_map, re.M))
    assert sorted(rows, key=int) == sorted(headings, key=int)
    for number, name in rows.items():
        assert headings[number].startswith(name.replace("`", "")), (number, name, headings[number])


def test_check_holds_an_older_cao_to_the_release_that_knows_the_scripted_agent(load_orch, fake_cao, prompt_file,
                                                                              capsys, monkeypatch):
    """CAO leaves mock_cli out of its providers list even where it knows it: --check goes by the version of the
    cao-server running here, and an older one is told the release to install, not 'a run can start'."""
    m = load_orch(PROMPT_FILE=str(prompt_file), PROVIDER="mock_cli")
    older = type("Server", (), {"cao_version": lambda self: "2.4.0", "env": {}, "tmux_socket": ""})()
    monkeypatch.setattr(m, "local_server", lambda: older)
    assert run_main(m, "--check") == 1
    out = capsys.readouterr().out
    assert "✗ this CAO does not know mock_cli: CAO >= 2.5.4 (cao-server at http://cao.test " \
           "(cli-agent-orchestrator 2.4.0)); install it where cao-server runs" in out
    assert "a run can start" not in out


@pytest.mark.parametrize("signum, code, said", [
    (signal.SIGHUP, 129, "stopped by SIGHUP (its terminal closed)"),
    (signal.SIGQUIT, 131, "stopped by SIGQUIT (Ctrl-\\)"),
    (signal.SIGTERM, 143, "terminated (SIGTERM)")])
def test_every_stop_signal_saves_the_state_and_exits_with_its_documented_code(load_orch, fake_cao, prompt_file,
                                                                              capsys, signum, code, said):
    """SIGHUP (a closed terminal) and SIGQUIT (Ctrl-\\) stop a run as SIGTERM does: the turn in flight kept,
    one line, the code the exit table, --help-settings, --status --json and the run_stopped event name; the
    handlers that were there before are there again."""
    before = {s: signal.getsignal(s) for s in (signal.SIGHUP, signal.SIGQUIT, signal.SIGTERM, signal.SIGINT)}
    m = load_orch(PROMPT_FILE=str(prompt_file), **TESTER_ONLY)
    with MainThreadSignals() as signals:
        fake_cao.script["tester"] = [{"action": "call", "call": lambda fake, terminal: signals.send(signum)}]
        assert run_main(m) == code
    assert {s: signal.getsignal(s) for s in before} == before
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"{said}; state saved, rerun to resume"
    state = json.loads(Path(m.STATE_FILE).read_text())
    assert state["final_status"] == "RUNNING" and state["in_flight"]["role"] == "tester"
    stopped = [e for e in m.read_events(Path(m.run_dir) / m.EVENTS_FILE) if e["event"] == "run_stopped"]
    assert [(e["exit_code"], e["meaning"]) for e in stopped] == [(code, m.EXIT_MEANINGS[code])]
    assert m.SCHEDULER_ACTIONS[code] == "retry: the same command resumes the run"
    assert run_main(m, "--status", "--json") == 0
    facts = json.loads(capsys.readouterr().out)
    assert (facts["last_exit_code"], facts["last_exit"]) == (code, m.EXIT_MEANINGS[code])
    assert run_main(m, "--help-settings") == 0
    assert re.search(rf"^  {code}  {re.escape(m.EXIT_MEANINGS[code][:40])}", capsys.readouterr().out, re.M)
    fake_cao.script.pop("tester")
    assert run_main(m) == 0                                   # the same command goes on


def test_a_fault_of_the_loop_while_the_agents_are_created_exits_70_and_leaves_none_running(load_orch, fake_cao,
                                                                                           prompt_file, capsys,
                                                                                           monkeypatch):
    """A TypeError of the loop's own in one of the five creations is no "could not create the agent terminals":
    exit 70 with its traceback kept, once every creation is over and the agents that came up are exited."""
    m = load_orch(PROMPT_FILE=str(prompt_file), **TESTER_ONLY)
    original = m.request_agent

    def faulty(role, session, first=False, replacing=""):
        if role == "tester":
            return len(None)
        return original(role, session, first, replacing)
    monkeypatch.setattr(m, "request_agent", faulty)
    assert run_main(m) == 70
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: a fault of the loop itself (TypeError: ") and "could not create" not in err
    kept = re.search(r"its traceback is in (\S+);", err)
    assert kept and "in faulty" in Path(kept[1]).read_text()
    assert len(fake_cao.terminals) == 4 and sorted(fake_cao.exited_ids()) == sorted(fake_cao.terminals)


def test_a_lost_agent_exits_2_with_replacements_on_too_and_the_readme_says_so(load_orch):
    """A lost agent that stops the run with REPLACE_LOST_AGENTS=1 (its replacements used up) meets the same
    command again: exit 2, never 3, as EXIT_CODES and the README's table say. The README's attach command names
    the agents' tmux socket: without it, tmux reaches the user's own server, never the run's own."""
    m = load_orch(REPLACE_LOST_AGENTS="1")
    assert m.AgentLost("tester", "t1", "its CLI exited").code == m.EXIT_USAGE == 2
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = {row.split("|")[1].strip(): row for row in readme.splitlines() if re.match(r"\| \d+ \|", row)}
    assert "REPLACE_LOST_AGENTS" not in rows["3"] and "lost" not in m.EXIT_MEANINGS[m.EXIT_ERROR]
    assert "REPLACE_LOST_AGENTS" in rows["2"]
    assert "`tmux attach -r" not in readme and "`tmux -S <socket> attach -r -t <CAO session>`" in readme
