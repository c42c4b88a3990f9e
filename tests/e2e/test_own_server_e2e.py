"""The run's own CAO server, as a user meets it: no server named, none running -- the loop starts cao-server
and a tmux server of its own, and ends them with the run, whatever ends it.

Each test gives the loop a new HOME (so CAO's store, database and logs are the test's), a working directory
and the scripted agents, and puts the pinned cao-server on PATH as `pip install '.[cao]'` would put it beside
the loop. What the run started carries that HOME in its environment: a process with it still running after
the run is a process left behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

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
                        MIN_REVIEW_CYCLES_BEFORE_APPROVAL="1", RESPONSE_TIMEOUT="120")
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


def test_a_run_killed_with_sigkill_has_its_helpers_ended_by_the_same_command_again(own_run):
    """SIGKILL mid-turn leaves the own server running (nothing can end it); the same command again ends
    them first, starts new ones, and goes on to PASS without sending an answered turn again."""
    run = own_run(OWN_SERVER="1")
    # The programmer's first turn outlasts the looks at --status below: it is still at work when the rerun comes.
    run.set_script({"tester": [FAIL_REPLY, PASS_REPLY], "programmer": [{"text": PROGRAMMER_REPLY,
                                                                        "think_ms": 60000}, PROGRAMMER_REPLY]})
    loop = run.start()
    run.wait_for_prompt(loop, "programmer")
    os.killpg(loop.pid, signal.SIGKILL)
    first = loop.stdout.read()
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
    status = run.status()
    assert "agents: ended with the run's own CAO server" in status, status
    assert "CAO server: the run's own, ended (it was at " in status and "killed" not in status, status
    assert json.loads(run.status("--json"))["own_server_running"] is None


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
