"""The run's own CAO server (section 2): when the loop starts one, what its agents' environment holds, how a
killed run's helpers are found and ended, and how a run on it is resumed and reported. (Started and ended for
real, with every kind of stop: tests/e2e/test_own_server_e2e.py.)"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import FAST, run_main
from fake_cao import MainThreadSignals


@pytest.mark.parametrize("raw, value", [("auto", "auto"), ("1", True), ("0", False)])
def test_own_server_is_auto_1_or_0(load_orch, raw, value):
    assert load_orch(OWN_SERVER=raw).OWN_SERVER == value


def test_a_bad_own_server_setting_is_refused_in_one_line(load_orch, capsys):
    m = load_orch(OWN_SERVER="yes", OWN_SERVER_PORT="70000")
    assert run_main(m) == 2
    assert capsys.readouterr().err.strip() == "error: OWN_SERVER='yes' is not valid: expected auto, 1 or 0"


def test_caos_own_port_variable_names_the_server_where_api_is_unset(load_orch, monkeypatch):
    m = load_orch(API=None)
    monkeypatch.setenv("CAO_API_PORT", "9890")
    m.configure([])
    assert m.API == "http://127.0.0.1:9890" and "API" in m.explicit_settings
    monkeypatch.setenv("API", "http://cao.test")                  # API says where, whatever CAO's variable says
    m.configure([])
    assert m.API == "http://cao.test"
    monkeypatch.delenv("API")
    monkeypatch.setenv("CAO_API_PORT", "ninety")
    with pytest.raises(m.ConfigError, match="CAO_API_PORT='ninety' is not a port number"):
        m.configure([])


def never_asked() -> bool:
    raise AssertionError("the server at API was looked at where the settings decide")


@pytest.mark.parametrize("setting, named_by, saved_on_own, answers, own, says", [
    (True, "", None, never_asked, True, "the run's own CAO server, started for it and ended with it (OWN_SERVER=1); "
                                        "OWN_SERVER=auto uses a CAO server you run at API"),
    (True, "API", False, never_asked, True, "(OWN_SERVER=1)"),
    (False, "", None, never_asked, False, "the CAO server at http://localhost:9889 (OWN_SERVER=0: a server you run); "
                                          "OWN_SERVER=1 runs it on a CAO server of its own instead"),
    ("auto", "API", None, never_asked, False, "the CAO server at http://localhost:9889: API names it; OWN_SERVER=1 "),
    ("auto", "CAO_API_PORT", True, never_asked, False, ": CAO_API_PORT names it"),
    ("auto", "", True, never_asked, True, "the run's own CAO server, started for it and ended with it: the run "
                                          "resumed was on one; RESUME=0 starts a new run on the server you choose"),
    ("auto", "", False, never_asked, False, "the CAO server at http://localhost:9889: the run resumed has its "
                                            "agents there"),
    ("auto", "", None, lambda: True, False, "the CAO server at http://localhost:9889, a server you run: one answers "
                                            "there, the default address (OWN_SERVER=auto); OWN_SERVER=1 runs it on "
                                            "a CAO server of its own instead"),
    ("auto", "", None, lambda: False, True, "the run's own CAO server, started for it and ended with it: none "
                                            "answers at http://localhost:9889 and neither API nor CAO_API_PORT names "
                                            "one (OWN_SERVER=auto); to use a CAO server you run, set API to its "
                                            "address"),
])
def test_which_server_a_run_uses_and_the_line_that_says_why(orch, setting, named_by, saved_on_own, answers, own,
                                                            says):
    """The decision alone, as a table: nothing of the machine is looked at (what answers on 9889 is an input)."""
    choice = orch.choose_server(setting, "http://localhost:9889", named_by, saved_on_own, answers)
    assert choice.own is own and choice.line.startswith("using ") and says in choice.line


def test_the_run_names_what_names_its_server_and_looks_at_api_only_where_nothing_does(load_orch, monkeypatch,
                                                                                     tmp_path):
    m = load_orch(API=None)
    m.configure([])
    looked = []
    monkeypatch.setattr(m, "server_answers", lambda url: looked.append(url) or False)
    assert m.server_choice(m.StartPlan(False)).own and looked == ["http://localhost:9889"]
    monkeypatch.setattr(m, "read_state_file", lambda: m.SavedState(on_own_server=False))
    assert not m.server_choice(m.StartPlan(True)).own and len(looked) == 1     # the resumed run's kind
    monkeypatch.setenv("CAO_API_PORT", "9890")
    m.configure([])
    assert ": CAO_API_PORT names it" in m.server_choice(m.StartPlan(False)).line
    config = tmp_path / "config.json"
    config.write_text('{"api": "http://cao.test"}', encoding="utf-8")
    monkeypatch.delenv("CAO_API_PORT")
    m.configure([str(config)])
    assert f": `api` in {config} names it" in m.server_choice(m.StartPlan(False)).line
    monkeypatch.setenv("API", "http://cao.test")
    m.configure([])
    assert ": API names it" in m.server_choice(m.StartPlan(False)).line and len(looked) == 1


def test_a_refused_connection_is_no_server_and_any_answer_is_one(orch):
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    assert not orch.server_answers(f"http://127.0.0.1:{port}")
    import respx
    with respx.mock() as router:
        router.get("http://cao.test/health").mock(return_value=httpx.Response(401))
        assert orch.server_answers("http://cao.test")


def test_the_agents_environment_is_the_loops_with_a_private_tmux_and_what_each_cli_needs(load_orch, monkeypatch):
    monkeypatch.setenv("TMUX", "/tmp/tmux-0/default,123,0")      # run from inside the user's own tmux
    monkeypatch.setenv("TMUX_TMPDIR", "/home/you/.tmux")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "key")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    for name in ("IS_SANDBOX", "PROMPT_TOOLKIT_NO_CPR"):
        monkeypatch.delenv(name, raising=False)
    m = load_orch(PROVIDER="claude_code", TESTER_PROVIDER="hermes")
    own = m.OwnServer(4321, "/tmp/cao-loop-x", "")
    monkeypatch.setattr(m.os, "geteuid", lambda: 0)
    env = own.env()
    assert "TMUX" not in env and env["TMUX_TMPDIR"] == "/tmp/cao-loop-x"
    assert (env["CAO_API_HOST"], env["CAO_API_PORT"]) == ("127.0.0.1", "4321")
    assert env["PATH"].split(os.pathsep) == ["/usr/bin", "/bin", str(Path(sys.executable).parent)]  # mock_cli, cao
    assert env["ANTHROPIC_API_KEY"] == "key" and env[m.OWN_SERVER_MARK] == "/tmp/cao-loop-x"
    assert env["IS_SANDBOX"] == "1" and env["PROMPT_TOOLKIT_NO_CPR"] == "1"
    monkeypatch.setattr(m.os, "geteuid", lambda: 1000)
    assert "IS_SANDBOX" not in own.env()             # only root needs it
    assert own.tmux_socket == f"/tmp/cao-loop-x/tmux-{os.getuid()}/default"


def test_a_long_temporary_folder_gives_way_to_tmp_for_the_socket(orch, monkeypatch, tmp_path):
    deep = tmp_path / ("x" * 90)
    deep.mkdir()
    monkeypatch.setattr(orch.tempfile, "gettempdir", lambda: str(deep))
    folder = orch.own_tmux_folder()
    try:
        assert Path(folder).parent == Path("/tmp")
    finally:
        os.rmdir(folder)


def test_the_port_asked_for_held_by_another_process_is_refused_naming_it(load_orch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        m = load_orch(OWN_SERVER_PORT=str(port))
        with pytest.raises(m.ConfigError) as refused:
            m.free_port()
    assert refused.value.message.startswith(f"OWN_SERVER_PORT={port}: that port of 127.0.0.1 is taken by pid "
                                            f"{os.getpid()} (")
    assert load_orch(OWN_SERVER_PORT="0").free_port() > 0


def marked_sleeper(mark: str) -> subprocess.Popen:
    return subprocess.Popen(["sleep", "600"], env={**os.environ, "CAO_LOOP_OWN_SERVER": mark},
                            start_new_session=True)


def test_what_a_killed_run_left_running_is_ended_by_the_next_invocation(orch, tmp_path, capsys):
    """The note beside the state file names the own server's processes (pid and start time) and its tmux
    folder: they and whatever carries the folder's mark are ended, the folder and the note removed."""
    folder = tmp_path / "cao-loop-left"
    folder.mkdir()
    server, agent = marked_sleeper(str(folder)), marked_sleeper(str(folder))
    reused = subprocess.Popen(["sleep", "600"])                   # a pid noted with another start time: not ours
    try:
        note = orch.own_stage.note
        note.parent.mkdir(parents=True, exist_ok=True)
        note.write_text(json.dumps({"port": 1, "tmux_dir": str(folder), "log_file": "", "processes": {
            "cao-server": [server.pid, orch.process_started_at(server.pid)],
            "tmux": [reused.pid, orch.process_started_at(reused.pid) + 1]}}), encoding="utf-8")
        orch.own_stage.end_left()
        assert server.wait(timeout=10) is not None and agent.wait(timeout=10) is not None
        assert reused.poll() is None
        assert not note.exists() and not folder.exists()
        assert f"(cao-server pid {server.pid}, its tmux server {folder}" in capsys.readouterr().out
    finally:
        for process in (server, agent, reused):
            process.kill()
            process.wait()


def test_an_unreadable_note_is_said_and_what_the_runs_marks_find_is_ended_and_seen(orch, tmp_path, capsys):
    """The note cannot be read (a disk that filled as it was written): what carries the run's marks -- its state
    file, its tmux folder -- still runs, is seen by --status's view and ended by the next invocation; then the
    note goes. No note and nothing marked: nothing to do, nothing said."""
    folder = tmp_path / "cao-loop-left"
    folder.mkdir()
    marks = {"CAO_LOOP_OWN_SERVER": str(folder), "CAO_LOOP_STATE_FILE": str(Path(orch.STATE_FILE).resolve()),
             "CAO_API_PORT": "45678"}
    left = [subprocess.Popen(["sleep", "600"], env={**os.environ, **marks}, start_new_session=True) for _ in range(2)]
    other = marked_sleeper(str(tmp_path / "another-runs"))                # another run's: never touched
    try:
        note = orch.own_stage.note
        note.parent.mkdir(parents=True, exist_ok=True)
        note.write_text("{not json", encoding="utf-8")
        own, alive = orch.own_stage.seen()
        assert own.url == "http://127.0.0.1:45678" and sorted(alive.processes) == sorted(p.pid for p in left)
        orch.own_stage.end_left()
        assert all(process.wait(timeout=10) is not None for process in left) and other.poll() is None
        assert not note.exists() and not folder.exists()
        out = capsys.readouterr().out
        assert "cannot be read" in out and f"ending what the run's marks find of its own server ({folder})" in out
        orch.own_stage.end_left()                                 # no note: nothing to do, nothing said
        assert capsys.readouterr().out == ""
    finally:
        for process in (*left, other):
            process.kill()
            process.wait()


def test_what_the_own_server_needs_is_said_before_anything_starts(load_orch, monkeypatch, prompt_file, capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), OWN_SERVER="1", PROVIDER="mock_cli")
    monkeypatch.setattr(m, "loop_program", lambda name: "")
    assert run_main(m) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("error: cao-server is not installed here: pip install 'cao-orchestrator-loop[cao]' (CAO "
                       "2.5.4), or point API at a CAO server you run")
    assert not Path(m.STATE_FILE).exists() and not m.own_stage.note.exists()


def own_server_stand_in(m, monkeypatch, started: list) -> None:
    """The own stage's start and end without processes: the fake CAO at API plays the new server."""
    def start() -> None:
        started.append("start")
        m.own_stage.server = m.OwnServer(1, "/nonexistent", "")

    def end() -> None:
        if m.own_stage.server is not None:
            started.append("end")
        m.own_stage.server = None

    monkeypatch.setattr(m.own_stage, "start", start)
    monkeypatch.setattr(m.own_stage, "end", end)


def test_a_run_resumed_on_a_new_own_server_gets_five_new_agents_and_keeps_its_answered_turns(
        load_orch, fake_cao, prompt_file, monkeypatch, capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), OWN_SERVER="1", MIN_REVIEW_CYCLES_BEFORE_APPROVAL="1", **FAST)
    started: list = []
    own_server_stand_in(m, monkeypatch, started)
    with MainThreadSignals() as signals:
        fake_cao.script["programmer"] = [{"action": "call", "call": lambda fake, terminal: signals.send(
            signal.SIGINT)}]
        assert run_main(m) == 130
    assert started == ["start", "end"]
    first = json.loads(Path(m.STATE_FILE).read_text())
    assert first["own_server"] is True and first["in_flight"]["role"] == "programmer"
    fake_cao.script.pop("programmer")                             # its usual answer, this time
    assert run_main(m) == 0
    out = capsys.readouterr().out
    assert "five new agents on the run's own CAO server" in out
    state = json.loads(Path(m.STATE_FILE).read_text())
    assert set(state["terminals"].values()).isdisjoint(first["terminals"].values())
    assert state["replacements"] == []                            # not a replacement: nothing was lost
    assert len(fake_cao.prompts_for("analyst")) == len(fake_cao.prompts_for("peer_analyst")) == 1         # answered before the stop: never sent again
    assert len(fake_cao.prompts_for("programmer")) == 2           # in flight at the stop: sent to its new agent
    assert m.EXPLORE_SUMMARY.strip().splitlines()[0] in fake_cao.prompts_for("programmer")[1]   # its whole prompt


def test_status_of_a_run_on_its_own_server_says_it_ended_with_it(load_orch, fake_cao, prompt_file, monkeypatch,
                                                                  capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), OWN_SERVER="1", MIN_REVIEW_CYCLES_BEFORE_APPROVAL="1", **FAST)
    own_server_stand_in(m, monkeypatch, [])
    with MainThreadSignals() as signals:
        fake_cao.script["programmer"] = [{"action": "call", "call": lambda fake, terminal: signals.send(
            signal.SIGTERM)}]
        assert run_main(m) == 143
    capsys.readouterr()
    assert run_main(m, "--status") == 0
    out = capsys.readouterr().out
    assert "agents: ended with the run's own CAO server" in out
    assert "working now: no agent: they ended with the run's own CAO server; programmer's turn goes on" in out
    assert "CAO server: the run's own, ended (it was at " in out and "start it with" not in out
    assert run_main(m, "--status", "--json") == 0
    assert json.loads(capsys.readouterr().out)["own_server"] is True


def test_the_demo_refuses_a_folder_that_holds_files_of_its_own(orch, tmp_path, capsys):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine", encoding="utf-8")
    assert run_main(orch, "--demo", str(folder)) == 2
    assert "it holds files of its own (notes.txt); give a new or empty folder" in capsys.readouterr().err
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
    assert run_main(orch, "--demo", str(folder), "--check") == 2


def test_check_in_own_server_mode_looks_at_what_the_own_server_needs(load_orch, monkeypatch, prompt_file, capsys,
                                                                       tmp_path):
    tools = tmp_path / "tools"
    tools.mkdir()
    for name in ("cao-server", "cao"):
        (tools / name).write_text("#!/bin/sh\n", encoding="utf-8")
        (tools / name).chmod(0o755)
    m = load_orch(PROMPT_FILE=str(prompt_file), OWN_SERVER="1", PROVIDER="mock_cli", API=None)
    monkeypatch.setattr(m, "loop_program", lambda name: str(tools / name))
    assert run_main(m, "--check") == 0
    out = capsys.readouterr().out
    assert f"✓ CAO server: the run's own, started for it on a free port of 127.0.0.1 (e.g. " in out
    assert f"and ended with it: {tools / 'cao-server'}\n" in out
    assert "✓ mock_cli found by the agents' shells: " in out and out.rstrip().endswith("a run can start")
    which = m.shutil.which
    monkeypatch.setattr(m.shutil, "which", lambda name, **kw: None if name == "tmux" else which(name, **kw))
    assert run_main(m, "--check") == 1
    assert "✗ tmux is not installed: CAO runs the agents in tmux (Debian/Ubuntu: apt-get install tmux)\n" in capsys.readouterr().out


def test_a_server_of_another_process_answering_on_the_port_is_never_taken_for_the_runs_own(orch, monkeypatch,
                                                                                          tmp_path):
    """The port was free when looked at, then another server took it: the run's cao-server cannot bind and
    has not ended yet when that server answers /health -- the listener is not the run's child, so it is
    not used, and the run's cao-server is ended."""
    import http.server
    import threading

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"status": "ok"}')

        def log_message(self, *args):
            pass

    other = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    slow = tmp_path / "cao-server"
    slow.write_text("#!/bin/sh\nsleep 30\n", encoding="utf-8")        # it never binds; it ends late
    slow.chmod(0o755)
    monkeypatch.setattr(orch, "loop_program", lambda name: str(slow))
    own = orch.OwnServer(other.server_address[1], str(tmp_path), str(tmp_path / "cao-server.log"))
    Path(orch.STATE_FILE).parent.mkdir(parents=True, exist_ok=True)
    try:
        assert own.launch(lambda: None) is False
        pid = own.processes["cao-server"][0]
        assert orch.process_started_at(pid) is None                   # the run's own was ended
    finally:
        other.shutdown()


def test_the_demo_is_the_same_whatever_the_callers_settings(load_orch, monkeypatch, tmp_path, capsys):
    """--demo runs the scripted agents on a server of its own in its folder, whatever the caller's
    environment sets (a provider, a round limit, a server)."""
    for name in ("WD", "PROMPT_FILE", "PROVIDER", "OWN_SERVER", "RESUME", "MOCK_AGENT_HOME", "MOCK_AGENT_THINK_MS"):
        monkeypatch.delenv(name, raising=False)            # what the demo sets, put back after the test
    m = load_orch(PROVIDER="codex", MAX_ROUNDS="1", API="http://cao.test", OWN_SERVER="0")
    seen = {}

    def run(args):
        seen.update({name: getattr(m, name) for name in ("PROVIDER", "MAX_ROUNDS", "OWN_SERVER")},
                    env={name: os.environ.get(name) for name in ("PROVIDER", "MAX_ROUNDS", "API", "OWN_SERVER",
                                                                 "WD", "MOCK_AGENT_HOME")})
        return 0
    monkeypatch.setattr(m, "run_command_line", run)
    folder = tmp_path / "demo"
    assert run_main(m, "--demo", str(folder)) == 0
    assert (seen["PROVIDER"], seen["MAX_ROUNDS"], seen["OWN_SERVER"]) == ("codex", 8, "auto")  # defaults again
    assert seen["env"] == {"PROVIDER": m.SCRIPTED_PROVIDER, "MAX_ROUNDS": None, "API": None, "OWN_SERVER": "1",
                           "WD": str(folder), "MOCK_AGENT_HOME": str(folder / ".tmp" / "demo-agents")}
    assert json.loads((folder / ".tmp" / "demo-agents" / "script.json").read_text())["tester"][0].startswith(
        "RESULT: FAIL")
    assert "demo: PASS." in capsys.readouterr().out


def test_a_session_asked_of_the_own_server_is_noted_before_it_is_asked_for(orch):
    """Whatever ends the run (a SIGKILL while CAO makes the session), the note names the session to remove."""
    orch.own_stage.server = orch.OwnServer(1, "/nonexistent", "")
    Path(orch.STATE_FILE).parent.mkdir(parents=True, exist_ok=True)
    seen = {}

    def create_session(*args, **kwargs):
        seen["noted"] = json.loads(orch.own_stage.note.read_text(encoding="utf-8"))["sessions"]
        return {"id": "t1", "session_name": "cao-loop-1"}
    orch.api.create_session = create_session
    orch.request_agent("analyst", "cao-loop-1", first=True)
    orch.request_agent("analyst", "cao-loop-1", first=True)          # asked again: noted once
    assert seen["noted"] == ["cao-loop-1"] and orch.own_stage.server.sessions == ["cao-loop-1"]


def test_the_own_servers_sessions_are_removed_through_cao_and_those_it_could_not_are_said(orch, capsys):
    import respx
    with respx.mock() as router:
        gone = router.delete("http://127.0.0.1:4321/sessions/cao-loop-1").mock(return_value=httpx.Response(200))
        router.delete("http://127.0.0.1:4321/sessions/cao-loop-2").mock(return_value=httpx.Response(404))
        router.delete("http://127.0.0.1:4321/sessions/cao-loop-3").mock(return_value=httpx.Response(500))
        left = orch.remove_own_sessions("http://127.0.0.1:4321", ["cao-loop-1", "cao-loop-2", "cao-loop-3"])
    assert gone.called and left == ["cao-loop-3"]                  # a session CAO no longer has is gone too
    orch.own_stage.sessions_left.extend(left)
    orch.own_stage.end()                                          # no server of its own now: said, once
    out = capsys.readouterr().out
    assert "CAO sessions cao-loop-3 of the killed run are still in CAO's store" in out
    assert "`cao shutdown --session <name>` removes them" in out and orch.own_stage.sessions_left == []


def test_a_killed_runs_sessions_whose_server_died_are_removed_through_the_next_own_server(orch, tmp_path, capsys):
    note = orch.own_stage.note
    note.parent.mkdir(parents=True, exist_ok=True)
    note.write_text(json.dumps({"port": 1, "tmux_dir": str(tmp_path / "gone"), "log_file": "", "processes": {},
                                "sessions": ["cao-loop-old"]}), encoding="utf-8")
    orch.own_stage.end_left()                                     # its cao-server is dead: nothing to ask
    assert orch.own_stage.sessions_left == ["cao-loop-old"] and not note.exists()
    import respx
    with respx.mock() as router:
        removed = router.delete("http://127.0.0.1:5555/sessions/cao-loop-old").mock(
            return_value=httpx.Response(200, json={"success": True}))
        orch.own_stage.remove_sessions_left("http://127.0.0.1:5555")
    assert removed.called and orch.own_stage.sessions_left == []
    assert "removed from CAO's store what the killed run's sessions left there: cao-loop-old" in capsys.readouterr().out


def test_a_new_run_stops_before_a_terminal_where_check_marks_the_server_s_profiles_missing(
        load_orch, fake_cao, prompt_file, capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), PROVIDER="mock_cli")           # API names the fake CAO
    fake_cao.missing_profiles = {"tester"}
    assert run_main(m) == 2
    out, err = capsys.readouterr()
    assert out.splitlines()[0].endswith("using the CAO server at http://cao.test: API names it; OWN_SERVER=1 runs it "
                                        "on a CAO server of its own instead")
    tester = Path(m.__file__).resolve().parent / "profiles" / "tester.md"
    assert err.strip().splitlines()[-1] == (
        "error: agent profiles not installed for their provider: tester (mock_cli); install them where the CAO server "
        f"at http://cao.test runs, as its user: `{m.loop_program('cao') or 'cao'} install {tester} --provider mock_cli`; or "
        "OWN_SERVER=1 runs it on a CAO server of its own instead, which installs them itself (the CAO server at "
        "http://cao.test, as --check says; nothing was started)")
    assert fake_cao.terminals == {} and not Path(m.STATE_FILE).exists()


def test_a_new_run_stops_before_a_terminal_where_the_agents_shells_do_not_find_its_cli(
        load_orch, fake_cao, prompt_file, monkeypatch, capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), PROVIDER="mock_cli", **FAST)
    probed = []
    monkeypatch.setattr(m, "local_server", lambda: m.LocalServer(1, os.getuid(), {}))
    monkeypatch.setattr(m, "probe_agents_side", lambda server, programs, versions=True: probed.append(versions) or
                        m.AgentsSide({"HOME": "/nonexistent"}, os.getuid(), {"mock_cli": ("", "")}))
    assert run_main(m) == 2
    assert "error: mock_cli (" in capsys.readouterr().err and fake_cao.terminals == {}
    assert probed == [False]                                      # found or not: no CLI's --version in a run
    m = load_orch(PROMPT_FILE=str(prompt_file), PROVIDER="mock_cli", IGNORE_MISSING_CLI="1", RESUME="0", **FAST)
    monkeypatch.setattr(m, "local_server", lambda: m.LocalServer(1, os.getuid(), {}))
    monkeypatch.setattr(m, "probe_agents_side", lambda server, programs, versions=True:
                        m.AgentsSide({"HOME": "/nonexistent"}, os.getuid(), {"mock_cli": ("", "")}))
    assert run_main(m) == 0 and len(fake_cao.terminals) == 5    # the user says its agents' shells have it


def test_ending_an_own_server_whose_tmux_folder_is_gone_never_reaches_the_users_tmux_server(orch, tmp_path,
                                                                                           monkeypatch):
    """tmux falls back to the default socket where TMUX_TMPDIR names a folder that is gone (after a reboot
    cleared /tmp): the own tmux server is ended by its socket's path, and only where that socket exists."""
    calls = []
    monkeypatch.setattr(orch.subprocess, "run", lambda args, **kwargs: calls.append(args))
    orch.OwnServer(1, str(tmp_path / "gone"), "").end()
    assert calls == []
    own = orch.OwnServer(1, str(tmp_path), "")
    Path(own.tmux_socket).parent.mkdir()
    Path(own.tmux_socket).touch()
    own.end()
    assert calls == [["tmux", "-S", own.tmux_socket, "kill-server"]]


@pytest.mark.parametrize("where", ["report_run_summary", "end"])
def test_stops_during_the_wind_down_are_held_till_the_own_server_is_ended_and_the_lock_released(
        load_orch, fake_cao, prompt_file, monkeypatch, capsys, where):
    """Ctrl-C, then SIGHUP, while a run that passed ends (its summary written, its own server ended): both are
    held, the first said once; the own server is ended, the lock released, and the run exits with its PASS."""
    m = load_orch(PROMPT_FILE=str(prompt_file), OWN_SERVER="1", MIN_REVIEW_CYCLES_BEFORE_APPROVAL="1", **FAST)
    started: list = []
    own_server_stand_in(m, monkeypatch, started)
    owner = m.own_stage if where == "end" else m
    step = getattr(owner, where)
    lock_during_the_end: list[str] = []

    def stopped_twice(*args):
        signals.send(signal.SIGINT)
        signals.send(signal.SIGHUP)
        lock_during_the_end.append(m.RunLock.holder())
        return step(*args)

    monkeypatch.setattr(owner, where, stopped_twice)
    with MainThreadSignals() as signals:
        assert run_main(m) == 0
    assert started == ["start", "end"] and lock_during_the_end[0].startswith("pid ")
    assert m.RunLock.holder() == "" and m.own_stage.server is None
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert out.count("first, so that nothing is left behind") == 1
    assert "interrupted (SIGINT): ending the run (its state saved, what it started ended) first" in out
    assert json.loads(Path(m.STATE_FILE).read_text())["final_status"] == "PASS"


def test_a_stop_held_while_the_own_servers_sessions_are_removed_ends_the_removals(orch):
    """A stop signal that arrives while the run ends (its sessions removed through CAO, up to 30 s each) is held,
    and no further removal is asked for: those left are said as left in CAO's store."""
    import respx
    with respx.mock(assert_all_called=False) as router, MainThreadSignals() as signals, \
            orch.signals_held("ending", raise_after=False):
        def stopped(request):
            signals.send(signal.SIGTERM)
            assert signals.handled.wait(10)
            return httpx.Response(200)
        first = router.delete("http://127.0.0.1:4321/sessions/cao-loop-1").mock(side_effect=stopped)
        later = router.delete(url__regex=r"http://127\.0\.0\.1:4321/sessions/cao-loop-[23]").mock(
            return_value=httpx.Response(200))
        left = orch.remove_own_sessions("http://127.0.0.1:4321", ["cao-loop-1", "cao-loop-2", "cao-loop-3"])
    assert first.called and not later.called and left == ["cao-loop-2", "cao-loop-3"]


def test_every_tmux_command_to_the_own_server_names_its_socket(orch, tmp_path, monkeypatch):
    """Starting the own tmux server, asking its pid, moving it to another port: each names the socket (-S), so
    none can reach the user's own tmux server where TMUX_TMPDIR's folder is gone."""
    calls = []

    def run(args, **kwargs):
        calls.append(args)
        return subprocess.CompletedProcess(args, 0, stdout="4242\n", stderr="")
    monkeypatch.setattr(orch.subprocess, "run", run)
    own = orch.OwnServer(1, str(tmp_path), "")
    own.start_tmux()
    own.tmux("set-environment", "-g", "CAO_API_PORT", "2")
    assert len(calls) == 3 and all(call[:3] == ["tmux", "-S", own.tmux_socket] for call in calls), calls
    assert Path(own.tmux_socket).parent.is_dir()
