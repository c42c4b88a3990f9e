"""Runs that nothing knocks over: one process per run, a server that lost track, agents not left behind,
and a finished run that cron does not silently start again.

Driven through main() against the respx fake CAO, except the lock, which is
tried with real processes (a lock that only works inside one process proves
nothing).
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import FAST, ROOT, TASK_PROMPT, run_main
from fake_cao import FAIL_REPLY, MainThreadSignals, pool_tasks_elsewhere

TESTER_ONLY = {**FAST, "MIN_REVIEW_CYCLES_BEFORE_APPROVAL": "1", "START_AGENT": "tester"}


def state_of(module) -> dict:
    return json.loads(Path(module.STATE_FILE).read_text(encoding="utf-8"))


def write_state(module, **fields) -> Path:
    """A state file as an earlier run left it, with the given fields."""
    data = {"version": 1, "updated_at": "2026-11-20T03:00:00Z", "api": "http://cao.test", "provider": "codex",
            "wd": module.WD, "prompt": TASK_PROMPT, "current_round": 2, "current_phase": "done",
            "final_status": "PASS", "session_name": "cao-old",
            "terminals": {}, "feedback": "", "analyst_feedback": "", "programmer_feedback": "",
            "outputs": {"analyst": "", "analyst_review": "", "programmer": "", "programmer_review": "",
                        "tester": ""}}
    data.update(fields)
    path = Path(module.STATE_FILE)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


# -- one process per run: the lock ------------------------------------------------

HOLDER = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {root!r})
    import run_orchestrator_loop as loop
    loop.STATE_FILE = sys.argv[1]
    start_at = float(sys.argv[2])
    while time.time() < start_at:          # several holders can start in the same instant
        pass
    try:
        loop.RunLock.take()
    except loop.RunLocked as exc:
        print("LOCKED", exc.message, flush=True)
        sys.exit(exc.code)
    print("HOLDING", flush=True)
    time.sleep(float(sys.argv[3]))
""")


def start_holders(tmp_path: Path, count: int, hold_seconds: float) -> list[subprocess.Popen]:
    script = tmp_path / "holder.py"
    script.write_text(HOLDER.format(root=str(ROOT)), encoding="utf-8")
    state = tmp_path / "project" / ".tmp" / "state.json"
    start_at = time.time() + 1.0
    return [subprocess.Popen([sys.executable, str(script), str(state), str(start_at), str(hold_seconds)],
                             stdout=subprocess.PIPE, text=True) for _ in range(count)]


def test_second_invocation_exits_75_naming_the_holder_and_touching_nothing(load_orch, fake_cao, prompt_file,
                                                                            tmp_path, capsys):
    """While a process drives the run, the same command exits 75 at once with one line (pid, since when)."""
    m = load_orch(PROMPT_FILE=str(prompt_file), **TESTER_ONLY)
    state = write_state(m, final_status="RUNNING", current_phase="tester",
                        terminals=fake_cao.add_terminals())
    before = state.read_bytes()
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        import run_orchestrator_loop as loop
        loop.STATE_FILE = {m.STATE_FILE!r}
        loop.RunLock.take()
        print("HOLDING", flush=True)
        time.sleep(30)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "HOLDING"
        assert run_main(m) == 75
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"pid {holder.pid} since " in err[0] and m.STATE_FILE in err[0]
        assert fake_cao.requests == []
        assert state.read_bytes() == before
    finally:
        holder.kill()
        holder.wait()


def test_lock_is_released_when_the_holder_is_killed(tmp_path):
    """kill -9 the holder: the operating system drops the lock, and the next process gets it."""
    (first,) = start_holders(tmp_path, 1, hold_seconds=60)
    assert first.stdout.readline().strip() == "HOLDING"
    first.send_signal(signal.SIGKILL)
    first.wait()
    (second,) = start_holders(tmp_path, 1, hold_seconds=0)
    assert second.stdout.readline().strip() == "HOLDING"
    assert second.wait(timeout=30) == 0


def test_lock_is_released_when_a_run_ends(load_orch, fake_cao, prompt_file):
    """Two runs in a row from one process: the first run's lock does not block the second."""
    m = load_orch(PROMPT_FILE=str(prompt_file), **TESTER_ONLY)
    assert run_main(m) == 0
    assert run_main(m) == 0
    assert m.RunLock.handle is None


def test_processes_starting_in_the_same_instant_get_one_lock(tmp_path):
    """Four processes try at the same moment: exactly one holds the run, three exit 75."""
    holders = start_holders(tmp_path, 4, hold_seconds=3)
    outputs = [h.communicate(timeout=60)[0] for h in holders]
    codes = sorted(h.returncode for h in holders)
    assert codes == [0, 75, 75, 75], outputs
    assert sum("HOLDING" in out for out in outputs) == 1


# -- a server that cannot tell ------------------------------------------------------

def test_run_whose_terminals_all_read_unknown_finishes(load_orch, fake_cao, prompt_file, capsys):
    """After a cao-server restart every status reads `unknown`: the files and still screens finish the run."""
    fake_cao.reported_status = "unknown"
    fake_cao.script["tester"] = [FAIL_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), QUIET_SCREEN_SECONDS="0.05",
                  **{**TESTER_ONLY, "START_AGENT": "programmer", "MAX_ROUNDS": "2"})
    assert run_main(m) == 1                            # FAIL twice: the run went through both rounds
    assert fake_cao.roles_prompted() == ["programmer", "peer_programmer", "tester"] * 2
    out = capsys.readouterr().out
    assert "CAO cannot tell the status" in out and "reminder" not in out


# -- agents not left behind ------------------------------------------------------------

def test_ctrl_c_while_the_session_is_being_created_exits_its_first_terminal(load_orch, fake_cao, prompt_file):
    """Ctrl-C in the first seconds: the creation under way finishes, and its terminal is exited."""
    def interrupt_while_creating(profile: str) -> None:
        if profile == "system_analyst":              # this creation goes on once the hook returns
            signals.send(signal.SIGINT)              # Ctrl-C reaches the main thread ...
            fake_cao.wait_until("the main thread to handle SIGINT", signals.handled.is_set)
            fake_cao.wait_until("the adds to give up", lambda: pool_tasks_elsewhere() == 0)

    fake_cao.create_hook = interrupt_while_creating
    m = load_orch(PROMPT_FILE=str(prompt_file), **FAST)
    with MainThreadSignals() as signals:             # ... and is handled while this creation is under way
        assert run_main(m) == 130
    assert fake_cao.gave_up == []
    assert len(fake_cao.terminals) == 1
    assert fake_cao.exited_ids() == list(fake_cao.terminals)
    assert not Path(m.STATE_FILE).exists()


def test_a_new_run_exits_the_agents_of_the_unfinished_run_it_replaces(load_orch, fake_cao, prompt_file, capsys):
    """RESUME=0 over an unfinished run: its state is kept aside, its five agents are exited and their
    CAO session removed (no session of idle shells is left behind)."""
    m = load_orch(PROMPT_FILE=str(prompt_file), RESUME="0", **TESTER_ONLY)
    old_ids = fake_cao.add_terminals(session="cao-old")
    write_state(m, final_status="RUNNING", current_phase="tester", terminals=old_ids, session_name="cao-old")
    assert run_main(m) == 0
    assert sorted(fake_cao.exited_ids()) == sorted(old_ids.values())
    assert fake_cao.deleted_sessions == ["cao-old"]
    out = capsys.readouterr().out
    assert "ended the replaced run's agents and removed their CAO session cao-old" in out
    assert out.index("new run: CAO session") < out.index("ended the replaced run's agents")
    backups = list(Path(m.STATE_FILE).parent.glob("*.bak"))
    assert len(backups) == 1 and json.loads(backups[0].read_text())["session_name"] == "cao-old"


def test_a_run_that_ends_says_how_to_stop_its_agents(load_orch, fake_cao, prompt_file, capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), **TESTER_ONLY)
    assert run_main(m) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert f"CAO session {m.session_name} are still running" in last
    assert f"cao shutdown --session {m.session_name}" in last and "CLEANUP_ON_EXIT=1" in last


# -- a finished run and cron ----------------------------------------------------------

def test_new_run_after_a_finished_one_says_what_the_old_state_held_first(load_orch, fake_cao, prompt_file, capsys):
    """The default (the spec's): a new run starts; its first line after the server's names the old result, when,
    and where it goes."""
    m = load_orch(PROMPT_FILE=str(prompt_file), **TESTER_ONLY)
    write_state(m, final_status="PASS", current_round=3)
    assert run_main(m) == 0
    server, first = capsys.readouterr().out.strip().splitlines()[:2]
    assert "using the CAO server at http://cao.test" in server
    assert "finished with PASS in round 3, last saved 2026-11-20T03:00:00Z" in first
    assert "starting a new run" in first and ".bak" in first
    assert len(list(Path(m.STATE_FILE).parent.glob("*.bak"))) == 1


@pytest.mark.parametrize("result, code", [("PASS", 0), ("FAIL", 1)])
def test_report_finished_run_exits_with_its_code_and_starts_nothing(load_orch, fake_cao, prompt_file, capsys,
                                                                   result, code):
    """REPORT_FINISHED_RUN=1: cron can rerun the same command until the work is done."""
    m = load_orch(PROMPT_FILE=str(prompt_file), REPORT_FINISHED_RUN="1", **TESTER_ONLY)
    state = write_state(m, final_status=result)
    before = state.read_bytes()
    assert run_main(m) == code
    out, err = capsys.readouterr()
    assert f"finished with {result} in round 2" in out and "nothing was started" in out and err == ""
    assert fake_cao.requests == []
    assert state.read_bytes() == before
    assert not list(state.parent.glob("*.bak"))


def test_a_stop_signal_while_a_run_found_finished_under_the_lock_is_said_ends_it_with_the_runs_code(
        load_orch, fake_cao, prompt_file, monkeypatch, capsys):
    """Another invocation finished the run between this one's first look and its lock: the finished run is
    reported. A SIGTERM (sent to this process) while that is said is this end: exit with the run's code, one
    line, no traceback, the lock released."""
    m = load_orch(PROMPT_FILE=str(prompt_file), REPORT_FINISHED_RUN="1", **TESTER_ONLY)
    monkeypatch.setattr(m, "finish_stopped_run", lambda: write_state(m, final_status="PASS"))
    real_log = m.log
    with MainThreadSignals() as signals:
        def log(message: str) -> None:
            if "REPORT_FINISHED_RUN=1, so nothing was started" in message:
                signals.send(signal.SIGTERM)
                assert signals.handled.wait(10)
            real_log(message)

        monkeypatch.setattr(m, "log", log)
        assert run_main(m) == 0
    out, err = capsys.readouterr()
    assert "finished with PASS in round 2" in out and "Traceback" not in out + err
    assert m.RunLock.holder() == "" and not Path(m.STATE_FILE + ".lock").exists()


def test_a_state_file_that_cannot_be_read_is_named_first_before_any_server_is_asked(load_orch, prompt_file,
                                                                                    capsys):
    """Automatic resume with a state file that cannot be read: the first line names it (and where it will be
    kept), before any server is looked at -- here none answers, and the stop's line names the server."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    m = load_orch(PROMPT_FILE=str(prompt_file), API=f"http://127.0.0.1:{port}", OWN_SERVER="0", **TESTER_ONLY)
    state = Path(m.STATE_FILE)
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text("{not json", encoding="utf-8")
    assert run_main(m) == 3
    out, err = capsys.readouterr()
    first = out.splitlines()[0]
    assert f"state file {m.STATE_FILE} cannot be parsed" in first and "starting a new run" in first, out
    assert out.count("cannot be parsed") == 1 and "not reachable" in err
    assert state.read_text(encoding="utf-8") == "{not json"


def test_report_finished_run_still_continues_an_unfinished_run(load_orch, fake_cao, prompt_file):
    m = load_orch(PROMPT_FILE=str(prompt_file), REPORT_FINISHED_RUN="1", **TESTER_ONLY)
    write_state(m, final_status="RUNNING", current_phase="tester", current_round=1,
                terminals=fake_cao.add_terminals(session="cao-old"),
                outputs={"analyst": "x", "analyst_review": "", "programmer": "y", "programmer_review": "",
                         "tester": ""})
    assert run_main(m) == 0
    assert fake_cao.roles_prompted() == ["tester"]
    assert state_of(m)["final_status"] == "PASS"
