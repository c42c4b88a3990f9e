"""A run whose machine dies goes on on another one, from its working directory alone.

Machine A: a private cao-server, its tmux server and scripted agents, and the loop driving a FAIL -> PASS run.
After three turns everything there is killed with SIGKILL -- the loop, cao-server, the tmux server and the
agents in it -- as a node lost under a Kubernetes Job. Machine B has nothing of A but the working directory
(the volume): a new HOME without CAO's profiles or database, a new tmux server, a cao-server on another port.
There `deploy/entrypoint.sh`, the recipe's entrypoint, runs the loop with a server of its own: it starts its
tmux server and cao-server, installs the profiles, starts five new agents and finishes the run: every turn
answered on A is kept and never sent again, the exit code is the loop's, and nothing of B is left running.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from .harness import _pids_with_env, _server_env, _write_mock_cli, private_cao
from .cao_env import ensure_cao
from .test_orchestrator_e2e import FAIL_REPLY, PASS_REPLY, PROGRAMMER_REPLY, QUICK_ROUND, REPO_ROOT, SCRIPT, \
    SHORT_ROUND, Run, explain, numbered

pytestmark = pytest.mark.e2e

ENTRYPOINT = REPO_ROOT / "deploy" / "entrypoint.sh"
FAIL_THEN_PASS = QUICK_ROUND + SHORT_ROUND
TURNS_ON_A = 3


def events_in(run: Run) -> list[dict]:
    try:
        path = Path(run.state()["run_dir"]) / "events.jsonl"
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    except (OSError, ValueError, KeyError):
        return []


def kill_machine(node, loop: subprocess.Popen) -> None:
    """SIGKILL the loop, cao-server, the tmux server and whatever ran in it: nothing of A goes on."""
    loop.kill()
    loop.wait(timeout=10)
    node.stop_server()
    if node.tmux_pid:
        os.kill(node.tmux_pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while True:
        survivors = _pids_with_env(f"TMUX_TMPDIR={node.tmux_socket_dir}".encode())
        if not survivors or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for pid in survivors:                 # a pane's process the hang-up did not end: gone with its machine
        os.kill(pid, signal.SIGKILL)


def fresh_machine(root: Path) -> tuple[dict, Path]:
    """Machine B's environment: a new HOME, tmux folder and scripted agents' folder; no server started."""
    dirs = {name: root / name for name in ("home", "bin", "mock", "tmux")}
    for folder in dirs.values():
        folder.mkdir()
    _write_mock_cli(dirs["bin"])
    return _server_env(dirs, ensure_cao().parent, think_ms=None), dirs["mock"]


def server_log(run: Run) -> str:
    """The own cao-server's log, beside the run's state file."""
    path = run.state_file.with_name("cao-server.log")
    return path.read_text(errors="replace")[-3000:] if path.exists() else ""


def still_running(needle: str, seconds: float) -> list[str]:
    """The command lines of the processes with `needle` in their environment still there after `seconds`."""
    deadline = time.monotonic() + seconds
    while (pids := _pids_with_env(needle.encode())) and time.monotonic() < deadline:
        time.sleep(0.2)
    commands = []
    for pid in pids:
        try:
            commands.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return commands


def received_prompts(mock_home: Path) -> list[str]:
    path = mock_home / "received.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    return [record["role"] for record in map(json.loads, lines) if record.get("kind") == "prompt"]


def test_a_run_whose_machine_is_killed_goes_on_on_a_fresh_machine_from_its_working_directory():
    with private_cao() as node_a:
        run = Run(node_a)
        node_a.set_script({"tester": [FAIL_REPLY, PASS_REPLY], "programmer": [PROGRAMMER_REPLY],
                           "peer_programmer": [{"think_ms": 4000}]})      # its usual approval, slowly
        loop = run.start()
        deadline = time.monotonic() + 90
        while sum(e["event"] == "reply_taken" for e in events_in(run)) < TURNS_ON_A:
            assert loop.poll() is None and time.monotonic() < deadline, loop.communicate()
            time.sleep(0.1)
        kill_machine(node_a, loop)
        taken_on_a = [e["role"] for e in events_in(run) if e["event"] == "reply_taken"]
        assert taken_on_a == FAIL_THEN_PASS[:TURNS_ON_A]
        script = json.loads((node_a.mock_home / "script.json").read_text(encoding="utf-8"))

        root = Path(tempfile.mkdtemp(prefix="cao-node-b-", dir=tempfile.gettempdir()))
        try:
            env, mock_home = fresh_machine(root)
            (mock_home / "script.json").write_text(json.dumps(script), encoding="utf-8")
            settings = {k: v for k, v in run.env.items() if k not in env and k != "API"}   # the loop's own
            env.update(settings, PROVIDER="mock_cli", PYTHON=sys.executable)
            result = subprocess.run(["bash", str(ENTRYPOINT)], cwd=root, env=env, capture_output=True, text=True,
                                    timeout=300)
            assert result.returncode == 0, explain(result) + server_log(run)
            assert "five new agents on the run's own CAO server" in result.stdout, explain(result)

            state = run.state()
            assert state["final_status"] == "PASS" and state["current_round"] == 2
            on_b = received_prompts(mock_home)
            assert on_b == FAIL_THEN_PASS[TURNS_ON_A:], explain(result)   # none of A's answered turns again
            assert run.archived() == numbered(FAIL_THEN_PASS)
            events = events_in(run)
            assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
            assert [e["role"] for e in events if e["event"] == "reply_taken"] == FAIL_THEN_PASS
            replaced = [e for e in events if e["event"] == "agent_replaced"]
            assert len(replaced) == 1 and sorted(replaced[0]["roles"]) == sorted(QUICK_ROUND)
            assert events[-1]["event"] == "run_stopped" and events[-1]["exit_code"] == 0
            assert not still_running(f"HOME={root / 'home'}", seconds=10), "the entrypoint left them"
        finally:
            for pid in _pids_with_env(f"HOME={root / 'home'}".encode()):
                os.kill(pid, signal.SIGKILL)
            shutil.rmtree(root, ignore_errors=True)


# The tester writes its reply after 1 s, then works on for a minute: the loop waits for its turn's end, and the
# machine dies in that window. CUT_OFF is a reply its agent was cut off in writing.
CUT_OFF = PASS_REPLY[:PASS_REPLY.index("EVIDENCE")]
TRIES = 2                          # the window is a race: it holds on every try, not once


@pytest.mark.parametrize("written, sent_again", [(PASS_REPLY, False), (CUT_OFF, True)], ids=["complete", "cut off"])
def test_a_machine_killed_right_after_a_reply_was_written_goes_on_on_a_fresh_machine(written, sent_again):
    """Machine A dies (the loop, cao-server, tmux and the agents killed) right after the tester wrote its reply,
    before the loop took it; the working directory goes on on machine B (a new HOME and cao-server,
    REPLACE_LOST_AGENTS=1). A complete reply is taken there and the tester's turn is not sent again; a reply
    cut off mid-write is set aside and the turn goes to B's new tester."""
    with private_cao() as node_a, private_cao() as node_b:
        for attempt in range(1, TRIES + 1):
            node_a.set_script({"tester": [{"text": written, "think_ms": 1000, "hold_ms": 60000}]})
            node_b.set_script({})
            run = Run(node_a, START_AGENT="tester")
            loop = run.start()
            deadline = time.monotonic() + 60
            while not ((files := [Path(r["response_file"]) for r in run.prompts()]) and files[0].exists()):
                assert loop.poll() is None and time.monotonic() < deadline, loop.communicate()
                time.sleep(0.01)
            loop.kill()                                   # the machine dies: the loop, its agents, cao-server
            loop.wait(timeout=10)
            node_a.kill_tmux_server()
            node_a.stop_server()
            state = run.state()
            assert state["in_flight"]["role"] == "tester" and not state["turn_records"], "taken on A"

            env = {**run.env, **node_b.env, "REPLACE_LOST_AGENTS": "1"}
            result = subprocess.run([sys.executable, str(SCRIPT)], cwd=REPO_ROOT, env=env, capture_output=True,
                                    text=True, timeout=90)
            assert result.returncode == 0, explain(result)
            on_b = received_prompts(node_b.mock_home)
            print(f"machine killed after the reply ({'cut off' if sent_again else 'complete'}), try {attempt}: "
                  f"prompts on B: {on_b}")
            assert on_b == ["tester"] * sent_again, explain(result)          # sent again only when cut off
            kept = run.archived_text("001-tester.md")
            assert (kept != written) if sent_again else (kept == written), explain(result)
            assert run.state()["final_status"] == "PASS" and len(run.state()["replacements"]) == 5
            node_a.start_server_again()
            node_b.kill_all_sessions()


def test_a_pod_deleted_while_an_agent_works_stops_with_its_state_saved_and_the_next_pod_finishes(cao):
    """Kubernetes deletes a pod with SIGTERM to its entrypoint: the loop gets it, saves its state and exits
    143 (retry); the entrypoint ends the machine's agents and cao-server. The next pod's entrypoint, on a
    fresh machine, finishes the run without sending an answered turn again."""
    run = Run(cao)                                    # its working directory only: the entrypoint runs the rest
    script = {"tester": [FAIL_REPLY, PASS_REPLY], "programmer": [{"text": PROGRAMMER_REPLY, "think_ms": 5000}]}
    roots = [Path(tempfile.mkdtemp(prefix="cao-pod-", dir=tempfile.gettempdir())) for _ in range(2)]
    try:
        machines = [fresh_machine(root) for root in roots]
        for (env, mock_home), root in zip(machines, roots):
            (mock_home / "script.json").write_text(json.dumps(script), encoding="utf-8")
            env.update({k: v for k, v in run.env.items() if k not in env and k != "API"}, PROVIDER="mock_cli",
                       PYTHON=sys.executable)
        first = subprocess.Popen(["bash", str(ENTRYPOINT)], cwd=roots[0], env=machines[0][0], text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 90
        while "programmer" not in received_prompts(machines[0][1]):
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.1)
        first.send_signal(signal.SIGTERM)                # the programmer is thinking
        out, err = first.communicate(timeout=60)
        assert first.returncode == 143, out + err
        assert "terminated (SIGTERM); state saved" in err
        state = run.state()
        assert state["final_status"] == "RUNNING" and state["in_flight"]["role"] == "programmer"
        assert not still_running(f"HOME={roots[0] / 'home'}", seconds=10), "the entrypoint left them"

        second = subprocess.run(["bash", str(ENTRYPOINT)], cwd=roots[1], env=machines[1][0], capture_output=True,
                                text=True, timeout=300)
        assert second.returncode == 0, explain(second)
        answered_first = FAIL_THEN_PASS[:2]             # the analysts; the programmer's turn was in flight
        assert received_prompts(machines[0][1]) == answered_first + ["programmer"]
        assert received_prompts(machines[1][1]) == FAIL_THEN_PASS[2:]
        assert run.state()["final_status"] == "PASS" and run.archived() == numbered(FAIL_THEN_PASS)
        assert not still_running(f"HOME={roots[1] / 'home'}", seconds=10), "the entrypoint left them"
    finally:
        for root in roots:
            for pid in _pids_with_env(f"HOME={root / 'home'}".encode()):
                os.kill(pid, signal.SIGKILL)
            shutil.rmtree(root, ignore_errors=True)


@pytest.mark.real_cli
def test_a_claude_code_run_whose_machine_is_killed_goes_on_on_a_fresh_machine_with_its_tokens_kept():
    """The same with the real Claude Code, whose records stay behind on machine A: on B new Claude Code agents
    get their whole prompts, no turn answered on A is sent again, and the tokens of A's turns are those its
    state kept; the run's tokens, turn by turn, equal what the model reported (the turn killed on A, whose
    prompt the model took and never finished, left out)."""
    from . import agent_clis
    from .scripted_model import ScriptedModel
    from .test_real_clis import check_tokens_are_the_models

    with ScriptedModel(think_seconds=0.2) as model, private_cao(provider="claude_code", model_url=model.url) as node_a:
        node_a.model = model
        run = Run(node_a, RESPONSE_TIMEOUT="300", AGENT_HOME=str(node_a.home))
        for name in ("POLL_SECONDS", "IDLE_GRACE_SECONDS"):        # the defaults, as a user has them
            run.env.pop(name, None)
        model.set_script({"tester": [FAIL_REPLY, PASS_REPLY], "programmer": [PROGRAMMER_REPLY],
                          "peer_programmer": [{"think_ms": 30000}, {}]})   # A dies while it thinks
        loop = run.start()
        deadline = time.monotonic() + 300
        while model.turns().get("peer_programmer", 0) < 1:
            assert loop.poll() is None and time.monotonic() < deadline, loop.communicate()
            time.sleep(0.2)
        time.sleep(1)
        kill_machine(node_a, loop)
        assert [e["role"] for e in events_in(run) if e["event"] == "reply_taken"] == FAIL_THEN_PASS[:TURNS_ON_A]
        tokens_on_a = [turn["tokens"] for turn in run.state()["turn_records"]]
        assert all(tokens_on_a), "A's turns' tokens were read there"

        root = Path(tempfile.mkdtemp(prefix="cao-node-b-", dir=tempfile.gettempdir()))
        try:
            dirs = {name: root / name for name in ("home", "bin", "tmux")}
            for folder in dirs.values():
                folder.mkdir()
            agent_clis.write_claude_home(dirs["home"], workdirs=[run.wd])     # the image's settings, the secret's key
            # What the image and the Secret give, with IS_SANDBOX=yes as some images export it: Claude Code as root
            # takes only IS_SANDBOX=1, and the loop's own server sets that for its agents over the image's value
            # (the README's "two commands" promise, with a real CLI).
            needs = {**agent_clis.claude_tmux_env(model.url), "IS_SANDBOX": "yes"}
            env = _server_env({**dirs, "mock": root}, ensure_cao().parent, think_ms=None,
                              cli_bin=agent_clis.cli_bin_for("claude_code"), extra=needs)
            env["IS_SANDBOX"] = "yes"
            settings = {k: v for k, v in run.env.items() if k not in env and k not in ("API", "AGENT_HOME", "IS_SANDBOX")}
            env.update(settings, PROVIDER="claude_code", PYTHON=sys.executable, AGENT_HOME=str(dirs["home"]))
            result = subprocess.run(["bash", str(ENTRYPOINT)], cwd=root, env=env, capture_output=True, text=True,
                                    timeout=600)
            assert result.returncode == 0, explain(result) + server_log(run)
            assert "five new agents on the run's own CAO server" in result.stdout, explain(result)
            assert re.search(r"CAO server: the run's own, http://127\.0\.0\.1:\d+", result.stdout), explain(result)
            if os.geteuid() == 0:                             # said once; the agents got 1, or none would have started
                assert result.stdout.count("the agents get IS_SANDBOX=1 in place of IS_SANDBOX=yes from this "
                                           "environment") == 1, explain(result)
            state = run.state()
            assert state["final_status"] == "PASS" and run.archived() == numbered(FAIL_THEN_PASS)
            expected = {role: FAIL_THEN_PASS.count(role) for role in set(FAIL_THEN_PASS)}
            expected["peer_programmer"] += 1                  # its prompt on A, never answered there
            assert model.turns() == expected, model.events()
            assert [turn["tokens"] for turn in state["turn_records"][:TURNS_ON_A]] == tokens_on_a
            check_tokens_are_the_models(node_a, run, unanswered={("peer_programmer", 1)})
            assert not still_running(f"HOME={root / 'home'}", seconds=10), "the entrypoint left them"
        finally:
            for pid in _pids_with_env(f"HOME={root / 'home'}".encode()):
                os.kill(pid, signal.SIGKILL)
            shutil.rmtree(root, ignore_errors=True)
