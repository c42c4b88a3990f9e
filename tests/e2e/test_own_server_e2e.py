"""The run's own CAO server, as a user meets it: the loop starts cao-server and a tmux server of its own, and
ends them with the run, whatever ends it.

Each test gives the loop a new HOME (so CAO's store, database and logs are the test's), a working directory
and the scripted agents, and puts the pinned cao-server on PATH as `pip install '.[cao]'` would put it beside
the loop. Each says OWN_SERVER=1: with `auto`, a cao-server that answers on 9889 (one of the machine's user)
would be used instead. What the run started carries that HOME in its environment: a process with it still
running after the run is a process left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from .cao_env import ensure_cao
from .harness import _pids_with_env, private_cao
from .test_orchestrator_e2e import FAIL_REPLY, PASS_REPLY, PROGRAMMER_REPLY, QUICK_ROUND, SCRIPT, SHORT_ROUND, \
    TASK, explain, numbered

pytestmark = pytest.mark.e2e

FAIL_THEN_PASS = QUICK_ROUND + SHORT_ROUND
LOOP_SETTINGS = ("API", "PROVIDER", "WD", "PROMPT_FILE", "OWN_SERVER", "OWN_SERVER_PORT", "RESUME", "STATE_FILE")


class OwnRun:
    """One working directory, a HOME of its own and the command that drives the loop on its own server."""

    def __init__(self, root: Path, **settings: str):
        self.home, self.wd, self.agents = root / "home", root / "project", root / "agents"
        for folder in (self.home, self.wd, self.agents):
            folder.mkdir()
        (root / "task.md").write_text(TASK, encoding="utf-8")
        self.state_file = self.wd / ".tmp" / "orchestrator-loop-state.json"
        self.env = {k: v for k, v in os.environ.items()
                    if k not in LOOP_SETTINGS and not k.startswith(("CAO_", "MOCK_AGENT_", "TMUX", "NTFY_"))}
        self.env.update(HOME=str(self.home), PATH=f"{os.environ['PATH']}{os.pathsep}{ensure_cao().parent}",
                        WD=str(self.wd), PROMPT_FILE=str(root / "task.md"), PROVIDER="mock_cli",
                        MOCK_AGENT_HOME=str(self.agents), MOCK_AGENT_THINK_MS="200", POLL_SECONDS="0.2",
                        MIN_REVIEW_CYCLES_BEFORE_APPROVAL="1", RESPONSE_TIMEOUT="120", OWN_SERVER="1")
        self.env.update(settings)
        self.set_script({"tester": [FAIL_REPLY, PASS_REPLY], "programmer": [PROGRAMMER_REPLY]})

    def set_script(self, script: dict) -> None:
        (self.agents / "script.json").write_text(json.dumps(script), encoding="utf-8")

    def start(self) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(SCRIPT)], cwd=self.wd, env=self.env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)

    def run(self) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(SCRIPT)], cwd=self.wd, env=self.env, capture_output=True,
                              text=True, timeout=300)

    def state(self) -> dict:
        return json.loads(self.state_file.read_text(encoding="utf-8"))

    def prompts(self) -> list[str]:
        """The roles whose agents got a prompt, in order, as the scripted agents recorded it."""
        path = self.agents / "received.jsonl"
        lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
        return [record["role"] for record in map(json.loads, lines) if record.get("kind") == "prompt"]

    def left_running(self, seconds: float = 10) -> list[str]:
        """What still runs with this run's HOME after `seconds` (zombies count as gone)."""
        deadline = time.monotonic() + seconds
        while (pids := _pids_with_env(f"HOME={self.home}".encode())) and time.monotonic() < deadline:
            time.sleep(0.2)
        commands = []
        for pid in pids:
            try:
                commands.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
            except OSError:
                continue
        return commands

    def store(self) -> dict[str, list[str] | int]:
        """What CAO's store in this HOME holds: the files of its folders, and the rows of each table that has any."""
        store = self.home / ".aws" / "cli-agent-orchestrator"
        held: dict[str, list[str] | int] = {}
        for folder in ("fifos", "locks", "logs", "logs/terminal", "agent-store", "agent-context"):
            held[folder] = sorted(p.name for p in (store / folder).glob("*") if not p.is_dir())   # FIFOs too
        with contextlib.closing(sqlite3.connect(store / "db" / "cli-agent-orchestrator.db")) as db:
            for (table,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall():
                rows = db.execute(f'SELECT count(*) FROM "{table}"').fetchone()[0]
                if rows:
                    held[f"rows of {table}"] = rows
        return held

    def kill_leftovers(self) -> None:
        for pid in _pids_with_env(f"HOME={self.home}".encode()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def status(self, *options: str) -> str:
        """What `--status` says of the run (stdout and stderr)."""
        said = subprocess.run([sys.executable, str(SCRIPT), "--status", *options], cwd=self.wd, env=self.env,
                              capture_output=True, text=True, timeout=60)
        return said.stdout + said.stderr

    def wait_for_prompt(self, loop: subprocess.Popen, role: str, count: int = 1) -> None:
        deadline = time.monotonic() + 120
        while self.prompts().count(role) < count:
            assert loop.poll() is None and time.monotonic() < deadline, loop.communicate()
            time.sleep(0.1)


@pytest.fixture
def own_run(tmp_path_factory):
    # A short root: the agents' working directory is shown in tmux, and CAO refuses paths under /root.
    runs = []

    def make(**settings: str) -> OwnRun:
        root = Path(tmp_path_factory.mktemp("own"))
        runs.append(OwnRun(root, **settings))
        return runs[-1]

    yield make
    for run in runs:
        run.kill_leftovers()


def own_server_line(output: str) -> re.Match:
    line = re.search(r"CAO server: the run's own, (http://127\.0\.0\.1:(\d+)) \(cao-server's log: (\S+)\); its "
                     r"agents run in a tmux server of their own \((\S+)/tmux-\d+/default\)", output)
    assert line, output[-3000:]
    return line


def test_the_port_asked_for_held_by_another_cao_server_gets_nothing(own_run):
    """OWN_SERVER_PORT names a port another cao-server listens on: the run stops with one line before it
    starts anything, and that server gets no agent and no prompt."""
    with private_cao() as other:
        run = own_run(OWN_SERVER_PORT=str(other.port))
        result = run.run()
        assert result.returncode == 2, explain(result)
        assert result.stderr.strip().splitlines()[-1].startswith(
            f"error: OWN_SERVER_PORT={other.port}: that port of 127.0.0.1 is taken by pid "), explain(result)
        with other.http() as client:
            assert client.get("/sessions").json() == []
        assert other.received() == [] and other.tmux_sessions() == []
        assert not run.left_running()
        assert not run.state_file.exists()


def killed_in_the_programmers_turn(own_run):
    """A run on its own server killed with SIGKILL while the programmer's first turn (a minute long, so it
    outlasts the looks at --status that follow) is at work: the run, its killed process and what it printed."""
    run = own_run(OWN_SERVER="1")
    run.set_script({"tester": [FAIL_REPLY, PASS_REPLY], "programmer": [{"text": PROGRAMMER_REPLY,
                                                                        "think_ms": 60000}, PROGRAMMER_REPLY]})
    loop = run.start()
    run.wait_for_prompt(loop, "programmer")
    os.killpg(loop.pid, signal.SIGKILL)
    return run, loop, loop.stdout.read()


def test_a_run_killed_with_sigkill_has_its_helpers_ended_by_the_same_command_again(own_run):
    """SIGKILL mid-turn leaves the own server running (nothing can end it); the same command again ends
    them first, starts new ones, and goes on to PASS without sending an answered turn again."""
    run, loop, first = killed_in_the_programmers_turn(own_run)
    assert "agent profiles installed in CAO's store: system_analyst (mock_cli)" in first   # a new HOME
    loop.wait(timeout=30)
    note = json.loads(run.state_file.with_name("orchestrator-loop-state.own-server.json").read_text())
    assert run.left_running(seconds=0), "SIGKILL ends the loop alone"
    # --status says what still runs, by its pids, and that the invocation was killed (no exit code of its own).
    (cao, _), (tmux, _) = note["processes"]["cao-server"], note["processes"]["tmux"]
    status = run.status()
    assert (f"still running: cao-server pid {cao}, tmux pid {tmux}, 5 agents (" in status and
            f"the same command ends them, or `kill -- -{cao} {tmux}`" in status), status
    assert f"last stop: killed, no exit code (pid {loop.pid} since " in status and "ended" not in status, status
    assert "agents: still running on the run's own CAO server (5 agent terminals)" in status, status
    facts = json.loads(run.status("--json"))
    assert facts["own_server_running"]["cao_server_pid"] == cao and facts["killed"]["pid"] == loop.pid
    result = run.run()
    assert result.returncode == 0, explain(result)
    line = own_server_line(result.stdout)
    assert run.state()["own_server"] is True and run.state()["api"] == line[1]
    assert Path(line[3]) == run.state_file.with_name("cao-server.log") and Path(line[3]).stat().st_size > 0
    assert "ending the run's own CAO server" in result.stdout and "still running" not in result.stdout
    pids = ", ".join(f"{name} pid {pid}" for name, (pid, _) in note["processes"].items())
    assert f"ending what the last invocation's own CAO server left running ({pids}" in result.stdout, explain(result)
    assert "five new agents on the run's own CAO server" in result.stdout
    # The analysts' answered turns were not sent again; the programmer's, in flight, went to its new agent.
    assert run.prompts() == QUICK_ROUND[:3] + FAIL_THEN_PASS[2:]
    assert run.state()["final_status"] == "PASS"
    assert sorted(p.name for p in Path(run.state()["run_dir"]).glob("[0-9][0-9][0-9]-*.md")
                  if not p.name.endswith(".prompt.md")) == numbered(FAIL_THEN_PASS)
    assert not run.left_running()
    assert not Path(note["tmux_dir"]).exists() and not Path(line[4]).exists()
    assert not run.state_file.with_name("orchestrator-loop-state.own-server.json").exists()
    store = run.store()                       # the killed run's session too was removed through its server
    assert store["fifos"] == [] and "rows of terminals" not in store, store
    status = run.status()
    assert "agents: ended with the run's own CAO server" in status, status
    assert "CAO server: the run's own, ended (it was at " in status and "killed" not in status, status
    assert json.loads(run.status("--json"))["own_server_running"] is None


def test_a_run_killed_with_sigkill_whose_note_cannot_be_read_is_found_by_its_marks_and_ended(own_run):
    """SIGKILL mid-turn, then the own server's note damaged (a disk that filled as it was written): --status
    still finds what runs by the run's marks (never "ended"), and the same command ends it all and passes."""
    run, loop, _ = killed_in_the_programmers_turn(own_run)
    loop.wait(timeout=30)
    note = run.state_file.with_name("orchestrator-loop-state.own-server.json")
    tmux_dir = json.loads(note.read_text())["tmux_dir"]
    note.write_text('{"port": 4', encoding="utf-8")
    assert run.left_running(seconds=0), "SIGKILL ends the loop alone"
    status = run.status()
    assert "CAO server: the run's own (http://127.0.0.1:" in status and "), still running: cao-server pid " in status
    assert "ended" not in status and "agents: still running on the run's own CAO server" in status, status
    result = run.run()
    assert result.returncode == 0, explain(result)
    assert "cannot be read" in result.stdout and f"ending what the run's marks find of its own server ({tmux_dir})" \
        in result.stdout, explain(result)
    assert not run.left_running() and not Path(tmux_dir).exists() and not note.exists()
    assert "CAO server: the run's own, ended" in run.status()


def test_status_says_a_run_is_starting_and_one_killed_in_start_up_is_killed_not_its_last_runs_pass(own_run):
    """A new run starts where the last one passed: --status tells the new run's start-up (its pid, since when,
    each agent), not the PASS before it; killed right then, the invocation shows as killed with what still
    runs, and only the rerun that ends them leaves "ended"."""
    run = own_run(OWN_SERVER="1", START_AGENT="tester")
    run.set_script({"tester": [PASS_REPLY]})
    assert run.run().returncode == 0
    loop = run.start()
    note = run.state_file.with_name("orchestrator-loop-state.start-up.json")
    deadline = time.monotonic() + 120
    while not (note.exists() and '"step": "creating the five agents' in note.read_text()):
        assert loop.poll() is None and time.monotonic() < deadline, loop.communicate()
        time.sleep(0.02)
    loop.send_signal(signal.SIGSTOP)                # held in its start-up, its lock held
    status = run.status()
    assert "run: a new run is starting, since " in status and " ago: creating the five agents on " in status, status
    assert f"driven by: pid {loop.pid} since " in status and "before it: finished with PASS" in status, status
    assert re.search(r"CAO server: the run's own, http://127\.0\.0\.1:\d+ \(cao-server pid \d+, tmux pid", status)
    assert "last stop" not in status and "start it with" not in status and "no run has started" not in status
    starting = json.loads(run.status("--json"))["starting"]
    assert starting["pid"] == loop.pid and starting["resuming"] is False
    os.killpg(loop.pid, signal.SIGKILL)
    loop.communicate(timeout=30)
    status = run.status()
    assert f"last stop: killed, no exit code (pid {loop.pid} since " in status and "exit 0" not in status, status
    assert f"last start-up: pid {loop.pid}, starting a new run since " in status, status
    assert "CAO server: the run's own (http://127.0.0.1:" in status and "), still running: cao-server pid " in status
    result = run.run()
    assert result.returncode == 0, explain(result)
    assert "ending what the last invocation's own CAO server left running (" in result.stdout
    assert not run.left_running()
    status = run.status()
    assert "CAO server: the run's own, ended" in status and "killed" not in status and "starting" not in status


@pytest.mark.parametrize("signum, code, rerun", [(signal.SIGINT, 130, False), (signal.SIGTERM, 143, True)])
def test_ctrl_c_and_sigterm_end_the_own_server_with_the_run_and_the_rerun_passes(own_run, signum, code, rerun):
    run = own_run()
    run.set_script({"tester": [FAIL_REPLY, PASS_REPLY], "programmer": [{"text": PROGRAMMER_REPLY,
                                                                        "think_ms": 4000}, PROGRAMMER_REPLY]})
    loop = run.start()
    run.wait_for_prompt(loop, "programmer")
    loop.send_signal(signum)
    out, err = loop.communicate(timeout=60)
    assert loop.returncode == code, out[-3000:] + err[-2000:]
    assert not run.left_running(), "the stopped run left its helpers running"
    assert run.state()["final_status"] == "RUNNING" and run.state()["in_flight"]["role"] == "programmer"
    if not rerun:                                   # the rerun after a stop: SIGTERM's case, and SIGKILL's above
        return
    result = run.run()
    assert result.returncode == 0, explain(result)
    assert "ending what the last invocation" not in result.stdout      # nothing was left to end
    assert run.prompts() == QUICK_ROUND[:3] + FAIL_THEN_PASS[2:]
    assert not run.left_running()



def test_three_runs_on_their_own_server_leave_in_caos_store_only_what_the_readme_names(own_run):
    """Each run removes its CAO session through CAO before it ends its server: CAO takes the agents' FIFOs and
    database rows with it. What stays in CAO's store (~/.aws/cli-agent-orchestrator/) is what the README's
    quick start names: what CAO sets up once (its database and skills, the profiles with their context files
    and locks), and per run the logs of the server and of each agent (its log, last screen and snapshot) and a
    row per session and per agent that records their creation."""
    run = own_run()
    run.set_script({"tester": [PASS_REPLY]})         # one round each: what a run leaves does not depend on its turns
    stores, terminals = [], []
    for _ in range(3):
        result = run.run()
        assert result.returncode == 0, explain(result)
        stores.append(run.store())
        terminals += list(run.state()["terminals"].values())
    first, last = stores[0], stores[-1]
    assert last["fifos"] == [] and "rows of terminals" not in last, last
    for once in ("locks", "agent-store", "agent-context"):          # set up with the profiles, not per run
        assert last[once] == first[once] and len(first[once]) == 5, (once, stores)
    assert len(last["logs"]) == 3                                   # cao-server's log, one each start
    assert last["logs/terminal"] == sorted(f"{terminal}{kind}" for terminal in terminals
                                           for kind in (".log", ".scrollback", ".snapshot.json"))
    assert {key: value for key, value in last.items() if key.startswith("rows of ")} == {
        "rows of session_incarnations": 3, "rows of idempotency_keys": 15}, last
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    assert ("nothing is written outside `~/try-loop` but CAO's store (`~/.aws/cli-agent-orchestrator/`: profiles, "
            "logs, a row per agent and session)") in " ".join(readme.split())
    assert not run.left_running()


def test_a_killed_run_whose_server_died_with_it_has_its_session_removed_through_the_next_server(own_run):
    """The whole machine's processes killed (the loop, its cao-server and tmux server, as a reboot does): the old
    server cannot remove the run's session, so the next invocation's new server on the same HOME does, and the
    agents' FIFOs and rows leave CAO's store."""
    run = own_run()
    run.set_script({"tester": [FAIL_REPLY, PASS_REPLY], "programmer": [{"text": PROGRAMMER_REPLY,
                                                                        "think_ms": 4000}, PROGRAMMER_REPLY]})
    loop = run.start()
    run.wait_for_prompt(loop, "programmer")
    os.killpg(loop.pid, signal.SIGKILL)
    loop.wait(timeout=30)
    note = json.loads(run.state_file.with_name("orchestrator-loop-state.own-server.json").read_text())
    run.kill_leftovers()
    assert not run.left_running(), "all of the run is gone"
    assert len(run.store()["fifos"]) == 5 and note["sessions"] == [run.state()["session_name"]]
    result = run.run()
    assert result.returncode == 0, explain(result)
    assert (f"removed from CAO's store what the killed run's sessions left there: {note['sessions'][0]}"
            in result.stdout), explain(result)
    store = run.store()
    assert store["fifos"] == [] and "rows of terminals" not in store, store
    assert not run.left_running()


def test_a_run_on_a_server_of_the_users_that_cannot_work_there_stops_before_a_terminal_as_check_says(tmp_path):
    """A cao-server of another HOME, named by API: first without the agent profiles, then with them but without
    mock_cli where its agents' login shells look. Each time the run says which server it uses and why, stops
    before it creates a terminal with --check's line and exit 2, and the server gets no POST /sessions. The fixes
    as the lines print them (the profiles' one command copied, from another folder and HOME): the run PASSes."""
    from .test_check_e2e import NewcomersMachine

    root = Path(tempfile.mkdtemp(prefix="usr-", dir="/tmp"))      # short: the tmux socket path has a limit
    machine = NewcomersMachine(root)
    server_log = root / "cao-server.log"
    try:
        with open(server_log, "wb") as output:
            machine.server = subprocess.Popen([str(machine.cao_bin / "cao-server"), "--host", "127.0.0.1", "--port",
                                               str(machine.port)], env=machine.env(), cwd=root, stdout=output,
                                              stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while b"Uvicorn running" not in server_log.read_bytes():
            assert machine.server.poll() is None and time.monotonic() < deadline, server_log.read_text()
            time.sleep(0.3)
        env = {k: v for k, v in os.environ.items() if k not in LOOP_SETTINGS and not k.startswith(("CAO_", "TMUX"))}
        env.update(API=machine.api, PROVIDER="mock_cli", PROMPT_FILE="task.md", WD=str(machine.work),
                   HOME=str(machine.home))
        said = []
        for fix in (f"so install them there: `HOME={machine.home} ", "is not on the PATH of the agents' shells"):
            result = subprocess.run([sys.executable, str(SCRIPT)], cwd=machine.work, env=env, capture_output=True,
                                    text=True, timeout=180)
            check = subprocess.run([sys.executable, str(SCRIPT), "--check"], cwd=machine.work, env=env,
                                   capture_output=True, text=True, timeout=180)
            assert result.returncode == 2 and check.returncode == 1, explain(result) + check.stdout
            assert result.stdout.splitlines()[0].endswith(
                f"using the CAO server at {machine.api}: API names it; OWN_SERVER=1 runs it on a CAO server of its "
                "own instead"), explain(result)
            last = result.stderr.strip().splitlines()[-1]
            assert fix in last and last.endswith(f"(the CAO server at {machine.api}, as --check says; nothing was "
                                                 "started)"), explain(result)
            refused = last[len("error: "):last.index(" (the CAO server at")]
            assert f"✗ {refused}" in check.stdout, check.stdout             # --check and the run agree
            said.append(last)
            if len(said) == 1:          # the first fix: the one command it prints, as printed, from another folder
                subprocess.run(["sh", "-c", last.split("`")[1]], cwd="/", env=machine.env(HOME=str(root)),
                               check=True, capture_output=True, timeout=300)           # and another HOME
        assert "mock_cli" in said[1] and not (machine.work / ".tmp" / "orchestrator-loop-state.json").exists()
        logged = server_log.read_text(encoding="utf-8", errors="replace")
        assert "GET /agents/profiles/" in logged and "POST /sessions" not in logged       # its requests are logged
        assert httpx.get(f"{machine.api}/sessions", timeout=10).json() == []
        machine.login_path(machine.bin)             # the second fix: mock_cli where the agents' login shells look
        result = subprocess.run([sys.executable, str(SCRIPT)], cwd=machine.work, env=env, capture_output=True,
                                text=True, timeout=600)
        assert result.returncode == 0 and "PASS" in result.stdout, explain(result)
        assert machine.server.poll() is None                                 # the user's server is still theirs
    finally:
        machine.stop_server()
        shutil.rmtree(root, ignore_errors=True)



def test_sighup_mid_turn_ends_the_own_server_and_the_same_command_goes_on_to_pass(own_run):
    """The terminal closes (SIGHUP to the loop's process group, as a dropped ssh session sends it) while the
    programmer works, on the run's own server (OWN_SERVER=1) in a new HOME: exit 129 with one line, nothing
    of the run running 15 s later, and the same command goes on to PASS without sending an answered turn
    again."""
    run = own_run(OWN_SERVER="1")
    run.set_script({"tester": [FAIL_REPLY, PASS_REPLY], "programmer": [{"text": PROGRAMMER_REPLY,
                                                                        "think_ms": 4000}, PROGRAMMER_REPLY]})
    loop = run.start()
    run.wait_for_prompt(loop, "programmer")
    os.killpg(loop.pid, signal.SIGHUP)
    out, err = loop.communicate(timeout=60)
    assert loop.returncode == 129, out[-3000:] + err[-2000:]
    assert err.strip().splitlines()[-1] == "stopped by SIGHUP (its terminal closed); state saved, rerun to resume"
    assert "Traceback" not in out + err
    assert "ending the run's own CAO server" in out
    assert not run.left_running(seconds=15), "the run left its helpers running after SIGHUP"
    assert not run.state_file.with_name("orchestrator-loop-state.own-server.json").exists()
    assert run.state()["final_status"] == "RUNNING" and run.state()["in_flight"]["role"] == "programmer"
    stopped = [json.loads(line) for line in (Path(run.state()["run_dir"]) / "events.jsonl").read_text().splitlines()
               if '"run_stopped"' in line]
    assert [(e["exit_code"], e["result"]) for e in stopped] == [(129, "RUNNING")]
    result = run.run()
    assert result.returncode == 0, explain(result)
    assert "ending what the last invocation" not in result.stdout      # nothing was left to end
    assert run.prompts() == QUICK_ROUND[:3] + FAIL_THEN_PASS[2:]
    assert not run.left_running()


def test_stops_during_the_wind_down_after_pass_are_held_till_the_own_server_is_ended(own_run):
    """SIGHUP as the run that passed writes its summary, Ctrl-C as it ends its own server: both are held,
    the first said once; the run exits with its PASS, no traceback, nothing of it left running, its note
    and lock gone (a --status finds no process driving it)."""
    run = own_run(OWN_SERVER="1")
    run.set_script({"tester": [PASS_REPLY], "programmer": [PROGRAMMER_REPLY]})
    loop = run.start()
    out = []
    for line in loop.stdout:
        out.append(line)
        if "summary: PASS after round 1/" in line:          # said inside the wind-down
            os.killpg(loop.pid, signal.SIGHUP)
        elif "ending the run's own CAO server" in line:
            os.killpg(loop.pid, signal.SIGINT)
    err = loop.stderr.read()
    loop.wait(timeout=60)
    output = "".join(out) + err
    assert loop.returncode == 0, output[-4000:]
    assert "Traceback" not in output
    assert output.count("first, so that nothing is left behind") == 1, output[-3000:]
    assert "stopped by SIGHUP (its terminal closed): ending the run (its state saved, what it started ended) " \
           "first" in output
    assert not run.left_running(seconds=15), "a stop in the wind-down left the run's helpers running"
    assert not run.state_file.with_name("orchestrator-loop-state.own-server.json").exists()
    assert run.state()["final_status"] == "PASS"
    status = subprocess.run([sys.executable, str(SCRIPT), "--status"], cwd=run.wd, env=run.env,
                            capture_output=True, text=True, timeout=60)
    assert "driven by: no process" in status.stdout, status.stdout + status.stderr


def test_sigterm_while_the_agents_start_ends_the_start_at_once_and_leaves_nothing(own_run, tmp_path):
    """SIGTERM while CAO starts the five agents (their CLI slow to come up: CAO answers a creation only once
    it is up), on the run's own server: the loop does not wait for those answers -- it exits 143 before any
    agent CLI has come up -- writes no state, and leaves nothing of the run running."""
    slow = tmp_path / "slow-bin"
    slow.mkdir()
    marks = tmp_path / "marks"
    marks.mkdir()
    agent = slow / "mock_cli"
    agent.write_text(f"#!/bin/sh\ntouch {marks}/started.$$\nsleep 12\ntouch {marks}/up.$$\n"
                     f"exec {shutil.which('mock_cli')} \"$@\"\n", encoding="utf-8")
    agent.chmod(0o755)
    run = own_run(OWN_SERVER="1")
    run.env["PATH"] = f"{slow}{os.pathsep}{run.env['PATH']}"
    loop = run.start()
    deadline = time.monotonic() + 120
    while not list(marks.glob("started.*")):
        assert loop.poll() is None and time.monotonic() < deadline, loop.communicate()
        time.sleep(0.1)
    loop.send_signal(signal.SIGTERM)
    out, err = loop.communicate(timeout=60)
    came_up = list(marks.glob("up.*"))
    assert loop.returncode == 143, out[-3000:] + err[-2000:]
    assert came_up == [], "the loop waited for an agent CLI to come up before it stopped"
    assert err.strip().splitlines()[-1] == "terminated (SIGTERM)", err[-2000:]
    assert "terminated (SIGTERM): ending the terminals being created first" in out
    assert "Traceback" not in out + err
    assert not run.left_running(seconds=15), "the stopped start left processes running"
    assert not run.state_file.exists()
    assert not run.state_file.with_name("orchestrator-loop-state.own-server.json").exists()
