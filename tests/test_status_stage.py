"""--status reads the stage, not its hopes: the run's own server's processes (the note beside the state file,
checked in /proc with their start times), an invocation killed holding the lock, and a run that is starting
(the start-up note). /proc is faked here; tests/e2e/test_own_server_e2e.py shows it with real processes."""

from __future__ import annotations

import json
import signal
from pathlib import Path

from conftest import FAST, lock_holder_process, run_main
from fake_cao import MainThreadSignals
from test_own_server import own_server_stand_in

CAO, TMUX = 4242, 4343               # pids of the noted cao-server and tmux server, with their start times
CAO_START, TMUX_START = 1000, 1001
PANES = [5001, 5002, 5003, 5004, 5005]


def stopped_own_server_run(m, fake_cao, monkeypatch) -> None:
    """A run on its own server (stood in for) stopped by SIGTERM with the programmer's turn in flight."""
    own_server_stand_in(m, monkeypatch, [])
    with MainThreadSignals() as signals:
        fake_cao.script["programmer"] = [{"action": "call", "call": lambda fake, terminal: signals.send(
            signal.SIGTERM)}]
        assert run_main(m) == 143


def note_killed_own_server(m, port: int = 45678) -> None:
    """The own server's note as a killed invocation left it, and its lock file, which no process holds."""
    Path(m.own_stage.note).write_text(json.dumps({
        "port": port, "tmux_dir": "/tmp/cao-loop-test", "log_file": "cao-server.log",
        "processes": {"tmux": [TMUX, TMUX_START], "cao-server": [CAO, CAO_START]}}), encoding="utf-8")
    Path(m.STATE_FILE + ".lock").write_text("pid 999999 since 2026-11-28 06:00:00\n", encoding="utf-8")


def fake_proc(m, monkeypatch, started: dict[int, int], marked: list[int]) -> None:
    """What /proc says: each pid's start time, the processes the own server marked, the tmux server's panes."""
    monkeypatch.setattr(m, "process_started_at", lambda pid: started.get(pid))
    monkeypatch.setattr(m, "marked_processes", lambda mark: list(marked))
    monkeypatch.setattr(m.OwnServer, "panes", lambda own: len(PANES))


def test_status_after_a_sigkill_names_what_of_the_own_server_still_runs_and_ends_only_when_it_is_gone(
        load_orch, fake_cao, prompt_file, monkeypatch, capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), OWN_SERVER="1", MIN_REVIEW_CYCLES_BEFORE_APPROVAL="1", **FAST)
    stopped_own_server_run(m, fake_cao, monkeypatch)
    note_killed_own_server(m)
    everything = [CAO, TMUX, *PANES, *range(6001, 6016)]                 # 22 processes in all
    fake_proc(m, monkeypatch, {CAO: CAO_START, TMUX: TMUX_START}, everything)
    capsys.readouterr()
    assert run_main(m, "--status") == 0
    out = capsys.readouterr().out
    assert ("CAO server: the run's own (http://127.0.0.1:45678), still running: cao-server pid 4242, tmux pid 4343, "
            "5 agents (22 processes in all) -- the same command ends them, or `kill -- -4242 4343`") in out
    assert "agents: still running on the run's own CAO server (5 agent terminals), driven by no process" in out
    assert "working now: programmer (terminal " in out and "no process drives it: the rerun ends its agent" in out
    assert "last stop: killed, no exit code (pid 999999 since 2026-11-28 06:00:00; SIGKILL" in out
    assert "ended" not in out.replace("CAO server: the run's own (", "") and "exit 143" not in out
    assert "start it with" not in out                          # never a server to start at the run's own address
    assert run_main(m, "--status", "--json") == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["own_server_running"] == {"url": "http://127.0.0.1:45678", "cao_server_pid": CAO,
                                           "tmux_pid": TMUX, "agents": 5, "pids": sorted(everything),
                                           "driven": False, "end_command": "kill -- -4242 4343"}
    assert facts["killed"] == {"pid": 999999, "since": "2026-11-28 06:00:00"} and facts["last_exit_code"] is None
    assert facts["starting"] is None and facts["killed_start_up"] is None

    # The pids given out again to other processes (another start time), nothing marked: all of it ended.
    fake_proc(m, monkeypatch, {CAO: 7, TMUX: 8}, [])
    assert run_main(m, "--status") == 0
    out = capsys.readouterr().out
    assert "CAO server: the run's own, ended (it was at http://127.0.0.1:45678); a rerun starts another" in out
    assert "agents: ended with the run's own CAO server" in out and "still running" not in out
    assert run_main(m, "--status", "--json") == 0
    assert json.loads(capsys.readouterr().out)["own_server_running"] is None


def test_agents_that_outlived_their_servers_are_still_running_with_their_pids(load_orch, fake_cao, prompt_file,
                                                                                monkeypatch, capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), OWN_SERVER="1", MIN_REVIEW_CYCLES_BEFORE_APPROVAL="1", **FAST)
    stopped_own_server_run(m, fake_cao, monkeypatch)
    note_killed_own_server(m)
    fake_proc(m, monkeypatch, {}, [6001, 6002])
    capsys.readouterr()
    assert run_main(m, "--status") == 0
    out = capsys.readouterr().out
    assert "still running: 2 processes it started -- the same command ends them, or `kill 6001 6002`" in out
    assert "agents: still running on the run's own CAO server (0 agent terminals: its tmux server is gone" in out


def test_a_stop_the_invocation_said_is_not_a_kill(load_orch, fake_cao, prompt_file, monkeypatch, capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), OWN_SERVER="1", MIN_REVIEW_CYCLES_BEFORE_APPROVAL="1", **FAST)
    stopped_own_server_run(m, fake_cao, monkeypatch)
    assert not Path(m.STATE_FILE + ".lock").exists()               # every way out but a kill removes it
    capsys.readouterr()
    assert run_main(m, "--status") == 0
    out = capsys.readouterr().out
    assert "last stop: exit 143 (terminated by SIGTERM" in out and "killed" not in out
    assert run_main(m, "--status", "--json") == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["killed"] is None and facts["last_exit_code"] == 143


def test_status_while_a_new_run_starts_says_so_with_each_agent_not_the_run_before_it(
        load_orch, fake_cao, prompt_file, monkeypatch, capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", **FAST)
    assert run_main(m) == 0                                      # the run before: PASS
    fake_cao.fail_create["tester"] = (500, "the tester's CLI would not start")
    seen = {}
    failure = m.start_up_failure

    def look_then_fail(failures, *screens):
        seen["text"], seen["json"] = m.status_report(), m.status_json_report()
        return failure(failures, *screens)

    monkeypatch.setattr(m, "start_up_failure", look_then_fail)
    assert run_main(m) == 3
    code, text = seen["text"]
    assert code == 0 and text.splitlines()[1].startswith("run: a new run is starting, since ")
    assert text.splitlines()[1].endswith(" ago: creating the five agents on http://cao.test")
    assert "agents: analyst up (terminal " in text and "peer_programmer up (terminal " in text
    assert "tester failed: " in text and "the tester's CLI would not start" in text
    assert f"driven by: pid {m.os.getpid()} since " in text
    assert "before it: finished with PASS in round 1" in text
    assert "last stop" not in text and "run: finished" not in text and "CAO server" not in text
    code, line = seen["json"]
    facts = json.loads(line)
    assert code == 0 and facts["starting"]["pid"] == m.os.getpid() and facts["starting"]["resuming"] is False
    assert facts["starting"]["step"] == "creating the five agents on http://cao.test"
    assert facts["starting"]["agents"]["analyst"]["state"] == "up"
    assert facts["starting"]["agents"]["tester"]["state"] == "failed"
    # Once the start-up has stopped, its note is gone and the state file's run is told again.
    assert not m.start_up.path().exists()
    capsys.readouterr()
    assert run_main(m, "--status") == 0
    out = capsys.readouterr().out
    assert "run: finished with PASS in round 1" in out and "starting" not in out


def status_seen_in_the_run(m, monkeypatch) -> tuple[int, str]:
    """`--status` as another shell sees it during the run: the look taken at its last check of an agent's model."""
    seen = {}
    answers = m.note_model_answers

    def look(found):
        seen["text"] = m.status_report()
        return answers(found)

    monkeypatch.setattr(m, "note_model_answers", look)
    assert run_main(m) == 0
    return seen["text"]


def test_status_while_the_first_run_starts_is_not_no_run(load_orch, fake_cao, prompt_file, monkeypatch):
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", **FAST)
    code, text = status_seen_in_the_run(m, monkeypatch)
    assert code == 0 and "no run has started here" not in text and "a new run is starting" in text
    assert all(f"{role} up (terminal " in text for role in m.ROLES) and "before it" not in text
    assert not m.start_up.path().exists()                         # the state file has the run


def test_a_start_up_killed_is_told_with_how_far_it_got(load_orch, monkeypatch, capsys):
    m = load_orch()
    Path(m.STATE_FILE).parent.mkdir(parents=True)
    m.start_up.begin(resuming=False)
    m.start_up.step("creating the five agents")
    m.start_up.agent("analyst", "up", terminal="1a2b3c4d")
    m.start_up.agent("tester", "starting")
    m.start_up.facts.clear()                                      # the invocation was killed: its note stays
    note = json.loads(m.start_up.path().read_text())
    note["pid"] = 999999
    m.start_up.path().write_text(json.dumps(note))
    Path(m.STATE_FILE + ".lock").write_text("pid 999999 since 2026-11-28 06:00:00\n", encoding="utf-8")
    assert run_main(m, "--status") == 1
    err = capsys.readouterr().err
    assert err.splitlines()[0].startswith("a start-up was killed here (pid 999999, since ")    # what it found, first
    assert err.splitlines()[0].endswith(f"before it saved a run in {m.STATE_FILE}; nothing of it still runs")
    assert "no run has started here" not in err
    alive = m.StageAlive(4242, 4343, 5, list(range(4242, 4264)))            # its own server's 22 processes live on
    monkeypatch.setattr(m.own_stage, "seen", lambda: (None, alive))
    assert run_main(m, "--status") == 1
    assert capsys.readouterr().err.splitlines()[0].endswith(
        "; still running: cao-server pid 4242, tmux pid 4343, 5 agents (22 processes in all)")
    assert ('last start-up: pid 999999, starting a new run since ' in err and 'was killed at "creating the five '
            'agents" (agents: analyst up (terminal 1a2b3c4d), tester starting)') in err
    assert run_main(m, "--status", "--json") == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["result"] is None and facts["starting"] is None
    assert facts["killed_start_up"]["agents"]["analyst"] == {"state": "up", "reason": "", "terminal": "1a2b3c4d"}
    assert facts["killed"] == {"pid": 999999, "since": "2026-11-28 06:00:00"}


def test_the_start_up_note_is_only_written_while_a_run_starts(orch):
    orch.start_up.agent("analyst", "up", terminal="1a2b3c4d")   # a replacement mid-run: no note
    orch.start_up.step("anything")
    assert not orch.start_up.path().exists()


def test_a_driven_run_whose_own_cao_server_is_gone_is_never_told_to_start_one(load_orch, fake_cao, prompt_file,
                                                                               monkeypatch, capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), OWN_SERVER="1", MIN_REVIEW_CYCLES_BEFORE_APPROVAL="1", **FAST)
    stopped_own_server_run(m, fake_cao, monkeypatch)
    note_killed_own_server(m)
    Path(m.STATE_FILE + ".lock").unlink()
    holder = lock_holder_process(m.STATE_FILE)
    try:
        fake_proc(m, monkeypatch, {TMUX: TMUX_START}, [TMUX, *PANES])
        capsys.readouterr()
        assert run_main(m, "--status") == 0
        out = capsys.readouterr().out
    finally:
        holder.kill()
        holder.wait()
    assert ("CAO server: the run's own, http://127.0.0.1:45678 (tmux pid 4343, 5 agents (6 processes in all)); it "
            "ends with the run") in out
    assert "agents: the run's own cao-server is not running, so none can be asked" in out
    assert "start it with" not in out and f"driven by: pid {holder.pid} since " in out and "last stop" not in out


def test_status_while_a_run_on_its_own_server_is_resumed_says_so_with_its_new_agents(
        load_orch, fake_cao, prompt_file, monkeypatch):
    m = load_orch(PROMPT_FILE=str(prompt_file), OWN_SERVER="1", MIN_REVIEW_CYCLES_BEFORE_APPROVAL="1", **FAST)
    stopped_own_server_run(m, fake_cao, monkeypatch)
    fake_cao.script.pop("programmer")
    code, text = status_seen_in_the_run(m, monkeypatch)
    assert code == 0 and "run: an unfinished run (round 1, programmer phase)" in text
    assert "starting: the run is being resumed, since " in text and " ago: creating the five agents on " in text
    assert "agents: five new ones on the run's own CAO server: analyst up (terminal " in text
    assert "last stop" not in text and "start it with" not in text
    assert not m.start_up.path().exists()
