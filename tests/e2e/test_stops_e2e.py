"""Every stop's exit code, from a real case on a real cao-server: a provider the server does not know (2), the
agents shut down with the stop hint's own command and no replacement allowed (2, not 3: the same command meets
it again), a fault injected into the loop (70, its traceback in the run folder, the state saved, the same
command going on once the fault is gone); and --check refusing what the run would refuse."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .harness import private_cao
from .test_orchestrator_e2e import PASS_REPLY, REPO_ROOT, SCRIPT, Run, explain

pytestmark = pytest.mark.e2e

# A wrapper that injects a fault into the loop's own code (how the tester's verdict is read) and runs it as the
# command would: the fault is the loop's, not the agents' nor the server's.
FAULTY_LOOP = f"""
import sys
sys.path.insert(0, {str(REPO_ROOT)!r})
import run_orchestrator_loop as loop

def faulty(kind, text):
    return {{}}["verdict"]

loop.reply_verdict = faulty
loop.main()
"""


def check(run: Run, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--check"], cwd=REPO_ROOT, env={**run.env, **env},
                          capture_output=True, text=True, timeout=120)


def test_a_provider_the_server_does_not_know_exits_2_and_check_says_so(cao):
    """CAO 2.5.4 no longer knows q_cli (its older name for Kiro CLI): the run stops with exit 2 naming the
    providers it knows, before anything is written; --check says the same, not 'a run can start'."""
    run = Run(cao, START_AGENT="tester", PROVIDER="q_cli")
    result = run.run(timeout=60)
    assert result.returncode == 2, explain(result)
    err = result.stderr.strip()
    assert "\n" not in err and "does not know provider q_cli (it knows: " in err and "kiro_cli" in err, err
    assert not run.state_file.exists()
    checked = check(run)
    assert checked.returncode == 1, explain(checked)
    assert "✗ cao-server at" in checked.stdout and "does not know provider q_cli" in checked.stdout
    assert "a run can start" not in checked.stdout


def test_agents_shut_down_without_replacement_exit_2_twice_then_a_replacement_passes(cao):
    """The run stops (an agent error, exit 3) and leaves its agents running; the stop hint's own `cao shutdown`
    ends them. The same command then exits 2 (not 3), naming the tester -- the agent whose turn is next -- and
    REPLACE_LOST_AGENTS=1; again the same; with REPLACE_LOST_AGENTS=1 the run passes."""
    run = Run(cao, START_AGENT="tester")
    cao.set_script({"tester": [{"action": "error", "think_ms": 100}, PASS_REPLY]})
    result = run.run(timeout=60)
    assert result.returncode == 3, explain(result)
    session = run.state()["session_name"]
    hint = re.search(r"stop: `([^`]+)`", result.stdout).group(1)
    assert hint == f"CAO_API_PORT={cao.port} cao shutdown --session {session}", hint
    shut = subprocess.run(["bash", "-c", hint], env=cao.server_env, capture_output=True, text=True, timeout=60)
    assert shut.returncode == 0, shut.stderr
    for _ in range(2):
        again = run.run(timeout=60)
        assert again.returncode == 2, explain(again)
        err = again.stderr.strip()
        assert err.startswith("error: cannot resume: the tester agent") and "REPLACE_LOST_AGENTS=1" in err, err
        assert run.state()["final_status"] == "RUNNING"
    run.env["REPLACE_LOST_AGENTS"] = "1"
    passed = run.run(timeout=90)
    assert passed.returncode == 0, explain(passed)


def test_a_fault_of_the_loop_exits_70_with_its_traceback_and_the_same_command_goes_on(cao, tmp_path):
    run = Run(cao, START_AGENT="tester")
    cao.set_script({"tester": [PASS_REPLY]})
    wrapper = tmp_path / "faulty_loop.py"
    wrapper.write_text(FAULTY_LOOP, encoding="utf-8")
    result = subprocess.run([sys.executable, str(wrapper)], cwd=REPO_ROOT, env=run.env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 70, explain(result)
    state = run.state()
    kept = f"{state['run_dir']}/traceback.txt"
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: a fault of the loop itself (KeyError: 'verdict'); its traceback is in "
                           f"{kept}; state saved"), last
    with open(kept, encoding="utf-8") as handle:
        text = handle.read()
    assert "Traceback (most recent call last)" in text and "in faulty" in text
    assert state["final_status"] == "RUNNING" and run.roles_prompted() == ["tester"]
    status = subprocess.run([sys.executable, str(SCRIPT), "--status"], cwd=REPO_ROOT, env=run.env,
                            capture_output=True, text=True, timeout=60)
    assert "last stop: exit 70 (a fault of the loop itself" in status.stdout and f"traceback: {kept}" in status.stdout
    again = run.run(timeout=60)                        # the fault gone: the same command goes on
    assert again.returncode == 0, explain(again)
    assert run.roles_prompted() == ["tester"]          # from the reply already taken: the tester not asked again


def test_check_refuses_a_server_that_wants_a_token_and_a_wd_inside_this_checkout(cao_with_token, cao):
    """Without the server's token --check says so with the fix (no 'cannot say' lines, no 'a run can start');
    a working directory inside this program's own checkout is refused as the checkout itself is."""
    from .conftest import E2E_TOKEN

    run = Run(cao_with_token, START_AGENT="tester")
    checked = check(run)
    assert checked.returncode == 1, explain(checked)
    assert "✗ CAO server at" in checked.stdout and "requires a token: set CAO_AUTH_LOCAL_TOKEN" in checked.stdout
    assert "cannot say" not in checked.stdout and "a run can start" not in checked.stdout
    assert "requires a token" not in check(run, CAO_AUTH_LOCAL_TOKEN=E2E_TOKEN).stdout
    inside = check(Run(cao), WD=str(REPO_ROOT / "docs"))
    assert inside.returncode == 2, explain(inside)
    assert f"✗ WD={REPO_ROOT / 'docs'} is inside {REPO_ROOT}, this program's own directory" in inside.stdout


def came_up_after_all(marks, timeout: float = 120) -> list:
    """The agents of a stopped start that came up (their `up.<pid>` mark), once every start script that began
    (`started.<pid>`) has either ended or come up."""
    deadline = time.monotonic() + timeout
    while True:
        up = list(marks.glob("up.*"))
        starting = [mark for mark in marks.glob("started.*") if Path(f"/proc/{mark.suffix[1:]}").exists()
                    and not (marks / f"up{mark.suffix}").exists() and not zombie(int(mark.suffix[1:]))]
        if not starting or time.monotonic() > deadline:
            return up
        time.sleep(0.1)


def zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_sigterm_while_the_agents_start_on_a_users_server_removes_them_at_once():
    """A cao-server of the user's whose agent CLI is slow to come up (CAO answers a creation only once it is
    up): SIGTERM while the five start ends the loop before any of them has come up, and its session is
    removed by name -- the agents still starting end with it, and none comes up later on that server."""
    with private_cao() as server:
        marks = server.root / "marks"
        marks.mkdir()
        agent = server.bin_dir / "mock_cli"
        starts_it = agent.read_text().split("\n", 1)[1]
        agent.write_text(f"#!/bin/sh\ntouch {marks}/started.$$\nsleep 12\ntouch {marks}/up.$$\n{starts_it}")
        run = Run(server)
        loop = run.start()
        deadline = time.monotonic() + 120
        while not list(marks.glob("started.*")):
            assert loop.poll() is None and time.monotonic() < deadline, loop.communicate()
            time.sleep(0.1)
        loop.send_signal(signal.SIGTERM)
        out, err = loop.communicate(timeout=60)
        assert loop.returncode == 143, out[-3000:] + err[-2000:]
        assert list(marks.glob("up.*")) == [], "the loop waited for an agent CLI to come up before it stopped"
        assert "Traceback" not in out + err and not run.state_file.exists()
        session = re.search(r"in CAO session (cao-loop-[0-9a-f]+)", out)[1]
        # Each start's script is gone (ended with its session) or, had it survived, comes up 12 s after it began.
        assert not came_up_after_all(marks), "an agent of the stopped start came up after all"
        with server.http() as client:
            assert session not in [listed["name"] for listed in client.get("/sessions").json()]
        assert session not in server.tmux_sessions()
