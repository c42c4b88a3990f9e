"""Agents that die or vanish, for real: a killed agent CLI, a killed tmux server, a reboot.

Each test drives `python run_orchestrator_loop.py` against a private cao-server
whose agents are the scripted ``mock_cli`` and causes the fault as it happens
to users: the agent's process is killed with SIGKILL (its pane drops back to a
shell), the agents' tmux server is killed, or -- a reboot -- the loop, the tmux
server and cao-server are all killed and cao-server is started again before
the same command runs again. CAO 2.5.4 notices none of this by itself.

With the default the run stops with one line naming the agent, within
seconds of the fault; with REPLACE_LOST_AGENTS=1 it reaches PASS. Either way
the agents' own record (received.jsonl, counters.json) shows that no completed
turn was sent again and that the lost turn was sent once more, to a new agent.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from .test_orchestrator_e2e import PROGRAMMER_REPLY, QUICK_ROUND
from .test_unattended_e2e import LiveRun, programmer_prompt_delivered, start_run, unattended_run  # noqa: F401  (start_run: a fixture)

pytestmark = pytest.mark.e2e

# The programmer works 20 s on its first turn (repainting a timer): the fault comes while it works.
SLOW_PROGRAMMER = {"programmer": [{"text": PROGRAMMER_REPLY, "think_ms": 20000}, PROGRAMMER_REPLY]}
# A completed turn is never sent again; the lost programmer turn goes out once more, to a new agent.
AFTER_ONE_LOST_TURN = {"analyst": 1, "peer_analyst": 1, "programmer": 2, "peer_programmer": 1, "tester": 1}
# Seconds from the fault to the one-line stop: a gone session is asked after every 5 s, a dead CLI (a shell
# prompt on its screen) is seen at the next look -- a few seconds on a quiet machine. The bound holds on one four
# times slower and stays well inside what a loop that missed the fault would meet first: RESPONSE_TIMEOUT (60 s),
# the stall rule (AGENT_STALL_SECONDS, 300 s).
STOP_WITHIN = 40.0
LOST_LINE = r"is lost: "


def start(cao, start_run, **settings) -> tuple[LiveRun, str]:
    """A run whose programmer is at work on its first turn; returns it and the programmer's terminal."""
    cao.set_script(SLOW_PROGRAMMER)
    run = unattended_run(cao, **settings)
    live = start_run(run)
    live.wait_until(lambda: "programmer" in run.roles_prompted(), "the programmer got its prompt")
    programmer = run.state()["terminals"]["programmer"]
    live.wait_until(lambda: cao.agent_cli_pids(programmer), "the programmer's CLI runs", timeout=10)
    time.sleep(1.0)                                   # well into its turn
    return live, programmer


def assert_one_line_stop(live: LiveRun, fault_at: float, *expected: str, within: float = STOP_WITHIN) -> float:
    """Exit 2 (not 3: the same command would find the agent lost again; a setting must change) with one line
    naming the agent and both ways on; returns seconds from the fault to the exit."""
    code = live.finish(timeout=60)
    took = time.monotonic() - fault_at
    assert code == 2, live.explain()
    err = live.stderr.strip()
    assert "\n" not in err and LOST_LINE in err, live.explain()
    assert "REPLACE_LOST_AGENTS=1" in err and "RESUME=0" in err, live.explain()
    for text in expected:
        assert text in err, live.explain()
    assert took <= within, f"stopped {took:.1f}s after the fault\n{live.explain()}"
    return took


def assert_replaced_and_passed(live: LiveRun, roles_replaced: set[str]) -> None:
    code = live.finish(timeout=150)
    run = live.run
    assert code == 0, live.explain()
    state = run.state()
    assert state["final_status"] == "PASS", live.explain()
    assert {r["role"] for r in state["replacements"]} == roles_replaced, live.explain()
    assert run.cao.counters().get("turns") == AFTER_ONE_LOST_TURN, live.explain()
    first, again = [r for r in run.prompts() if r["role"] == "programmer"]
    assert again["terminal_id"] != first["terminal_id"], live.explain()
    assert again["message"] == first["message"], live.explain()       # the whole prompt, once more
    stray = [(r.get("role"), r.get("kind")) for r in run.cao.received() if r.get("kind") != "prompt"]
    assert stray == [], live.explain()
    assert "summary: lost agents replaced" in live.stdout, live.explain()


# ---------------------------------------------------------------------------
# An agent CLI killed mid-turn
# ---------------------------------------------------------------------------

def test_agent_cli_killed_mid_turn_stops_the_run_in_seconds_naming_it(restartable_cao, start_run):
    cao = restartable_cao
    live, programmer = start(cao, start_run)
    cao.kill_agent_cli(programmer)
    fault_at = time.monotonic()
    took = assert_one_line_stop(live, fault_at, f"the programmer agent (terminal {programmer})",
                                "its agent CLI exited", "bash-5.2#")
    print(f"fault-reaction: cli killed, stop: {took:.1f}s")
    assert "peer_programmer" not in live.run.roles_prompted()
    with cao.http(timeout=10) as client:
        window = client.get(f"/terminals/{programmer}").json()["name"]
    pane = cao.capture_pane(live.run.state()["session_name"], window)
    assert "bash-5.2#" in pane and "command not found" not in pane and "Reminder" not in pane, pane


def test_agent_cli_killed_mid_turn_is_replaced_and_the_run_passes(restartable_cao, start_run):
    cao = restartable_cao
    live, programmer = start(cao, start_run, REPLACE_LOST_AGENTS="1")
    cao.kill_agent_cli(programmer)
    fault_at = time.monotonic()
    line = live.wait_for_line(r"replacement 1/3: programmer", timeout=30)
    print(f"fault-reaction: cli killed, replaced: {time.monotonic() - fault_at:.1f}s")
    assert programmer in line
    assert_replaced_and_passed(live, {"programmer"})


def test_an_agent_cli_killed_before_its_first_prompt_is_started_again_and_the_run_passes(restartable_cao,
                                                                                         start_run):
    """The tester's CLI dies while the programmer works (as a CLI that crashes as it starts): with the default
    REPLACE_LOST_AGENTS=0 the tester is started again when its turn comes -- it had no prompt, so nothing
    of the run goes with it -- never typed into while dead, and the run passes with each turn sent once."""
    cao = restartable_cao
    live, _programmer = start(cao, start_run)
    tester = live.run.state()["terminals"]["tester"]
    cao.kill_agent_cli(tester)
    live.wait_for_line(r"the tester agent's CLI is gone before its first prompt", timeout=90)
    code = live.finish(timeout=150)
    assert code == 0, live.explain()
    state = live.run.state()
    assert state["final_status"] == "PASS" and [r["role"] for r in state["replacements"]] == ["tester"]
    assert state["terminals"]["tester"] != tester, live.explain()
    assert cao.counters().get("turns") == {role: 1 for role in QUICK_ROUND}, live.explain()
    stray = [(r.get("role"), r.get("kind")) for r in cao.received() if r.get("kind") != "prompt"]
    assert stray == [], live.explain()


def test_a_hung_agent_cli_counts_as_lost_after_agent_stall_seconds(restartable_cao, start_run):
    """A CLI that hangs (alive, but its screen never changes again) is lost after AGENT_STALL_SECONDS."""
    cao = restartable_cao
    cao.set_script({"programmer": [{"text": PROGRAMMER_REPLY, "think_ms": 120000, "silent": True}]})
    run = unattended_run(cao, AGENT_STALL_SECONDS="8")
    live = start_run(run)
    live.wait_for_line(r"programmer: prompt sent to terminal", timeout=60)
    fault_at = time.monotonic()                       # it hangs from the moment it has its prompt
    took = assert_one_line_stop(live, fault_at, "the programmer agent", "no sign of life for 8s", within=8 + 30)
    print(f"fault-reaction: hung cli, stop: {took:.1f}s")


# ---------------------------------------------------------------------------
# The agents' tmux server killed mid-run
# ---------------------------------------------------------------------------

def test_tmux_server_killed_mid_run_stops_the_run_in_seconds(restartable_cao, start_run):
    cao = restartable_cao
    live, _programmer = start(cao, start_run)
    session = live.run.state()["session_name"]
    cao.kill_tmux_server()
    fault_at = time.monotonic()
    took = assert_one_line_stop(live, fault_at, "the programmer agent", f"its CAO session {session} is gone")
    print(f"fault-reaction: tmux killed, stop: {took:.1f}s")
    last = live.stdout.strip().splitlines()[-1]
    assert "still running" not in last and "are gone" in last, live.explain()


def test_tmux_server_killed_mid_run_gets_five_new_agents_and_passes(restartable_cao, start_run):
    cao = restartable_cao
    live, _programmer = start(cao, start_run, REPLACE_LOST_AGENTS="1")
    old_session = live.run.state()["session_name"]
    cao.kill_tmux_server()
    fault_at = time.monotonic()
    live.wait_for_line(r"replacement 1/3: ", timeout=60)
    print(f"fault-reaction: tmux killed, replaced: {time.monotonic() - fault_at:.1f}s")
    assert_replaced_and_passed(live, set(QUICK_ROUND))
    assert live.run.state()["session_name"] != old_session


# ---------------------------------------------------------------------------
# A reboot: the loop, the agents and cao-server killed; cao-server started again; the same command again
# ---------------------------------------------------------------------------

def reboot(cao, live: LiveRun) -> None:
    live.process.send_signal(signal.SIGKILL)
    live.process.wait(timeout=10)
    cao.kill_tmux_server()
    cao.stop_server()
    cao.start_server_again()


def test_after_a_reboot_the_same_command_stops_in_seconds_naming_the_lost_agent(restartable_cao, start_run):
    cao = restartable_cao
    live, _programmer = start(cao, start_run)
    reboot(cao, live)
    session = live.run.state()["session_name"]
    again = start_run(live.run)
    fault_at = time.monotonic()
    took = assert_one_line_stop(again, fault_at, "cannot resume: the programmer agent",     # whose turn is next
                                f"its CAO session {session} is gone")
    print(f"fault-reaction: reboot, stop: {took:.1f}s")
    assert live.run.state()["final_status"] == "RUNNING"


def test_after_a_reboot_the_same_command_replaces_the_agents_and_passes(restartable_cao, start_run):
    cao = restartable_cao
    live, _programmer = start(cao, start_run, REPLACE_LOST_AGENTS="1")
    reboot(cao, live)
    again = start_run(live.run)
    fault_at = time.monotonic()
    again.wait_for_line(r"replacement 1/3: ", timeout=60)
    print(f"fault-reaction: reboot, replaced: {time.monotonic() - fault_at:.1f}s")
    assert_replaced_and_passed(again, set(QUICK_ROUND))


# ---------------------------------------------------------------------------
# The agents' session killed in the last second of a turn: the reply written, its end not yet seen
# ---------------------------------------------------------------------------

# The programmer thinks 4 s, writes its reply, then works on (repainting its timer) for a minute: its turn's
# end is not seen while CAO reads `unknown` (a server restarted), so the loop waits for a still screen.
HELD_AFTER_ITS_REPLY = {"programmer": [{"text": PROGRAMMER_REPLY, "think_ms": 4000, "hold_ms": 60000}]}
TRIES = 2                          # the window is a race: it holds on every try, not once
# a gone session is asked after every 5 s, an unreadable screen at once: a few seconds on a quiet machine, the
# bound one four times slower keeps, and short of the minute the programmer works on after its reply
NOTICED_WITHIN = 30.0


def test_agents_killed_right_after_a_reply_was_written_the_reply_is_taken_in_seconds_never_waited_out(
        restartable_cao, start_run):
    """CAO restarted while the programmer works (its status reads `unknown` from then on); its reply file
    written, the agents' tmux session is killed before the turn's end is seen: the loop notices within
    seconds, takes the complete reply (the programmer is not asked again), replaces the five agents and
    passes -- RESPONSE_TIMEOUT (600 s) is never waited out."""
    cao = restartable_cao
    for attempt in range(1, TRIES + 1):
        cao.kill_all_sessions()
        cao.set_script(HELD_AFTER_ITS_REPLY)
        run = unattended_run(cao, START_AGENT="programmer", REPLACE_LOST_AGENTS="1", RESPONSE_TIMEOUT="600")
        live = start_run(run)
        programmer_prompt_delivered(live, run, cao)
        cao.stop_server()
        cao.start_server_again()
        reply_file = Path(run.prompts()[0]["response_file"])
        live.wait_until(reply_file.exists, "the programmer wrote its reply", timeout=30, interval=0.01)
        cao.tmux("kill-session", "-t", f"={run.state()['session_name']}")
        killed_at = time.monotonic()
        line = live.wait_for_line(r"programmer: reply received", timeout=60)
        noticed = time.monotonic() - killed_at
        print(f"fault-reaction: session killed after the reply, try {attempt}: reply taken {noticed:.1f}s after")
        assert "turn end seen by its agent gone, the reply complete" in line, live.explain()
        assert noticed <= NOTICED_WITHIN, live.explain()
        assert live.finish(timeout=60) == 0, live.explain()
        state = run.state()
        assert state["final_status"] == "PASS" and len(state["replacements"]) == 5, live.explain()
        assert run.roles_prompted() == ["programmer", "peer_programmer", "tester"], live.explain()
        assert run.archived_text("001-programmer.md") == PROGRAMMER_REPLY
        assert "CAO cannot tell the status" in live.stdout, live.explain()     # it was judged with `unknown`


# ---------------------------------------------------------------------------
# The loop killed mid-run, then cao-server restarted (a crash, an upgrade): the agents live on in tmux
# ---------------------------------------------------------------------------

# The programmer thinks 6 s: the loop is killed, and cao-server restarted, while it works.
THINKING_PROGRAMMER = {"programmer": [{"text": PROGRAMMER_REPLY, "think_ms": 6000}]}
RESUMED_WITHIN = 120.0             # RESPONSE_TIMEOUT is 600 s: a wait that never ends is seen as one


def test_killed_mid_run_then_cao_restarted_the_same_command_prompts_the_next_agent_and_passes(restartable_cao,
                                                                                               start_run):
    """SIGKILL to the loop while the programmer works, then cao-server restarted for real: it reads `unknown`
    for good for every terminal made before, while their screens show the CLIs' idle prompts. The same command
    takes the programmer's reply, prompts the next agents within seconds (the screen tells that they are at
    rest) and passes; no answered turn is sent again, and no agent is replaced."""
    cao = restartable_cao
    cao.set_script(THINKING_PROGRAMMER)
    run = unattended_run(cao, START_AGENT="programmer", RESPONSE_TIMEOUT="600")
    live = start_run(run)
    programmer_prompt_delivered(live, run, cao)
    live.process.send_signal(signal.SIGKILL)
    live.process.wait(timeout=10)
    cao.stop_server()
    cao.start_server_again()
    reply_file = Path(run.prompts()[0]["response_file"])
    deadline = time.monotonic() + 60                  # the loop is gone: its agent works on alone
    while not reply_file.exists():
        assert time.monotonic() < deadline, "the programmer never wrote its reply"
        time.sleep(0.05)
    peer = run.state()["terminals"]["peer_programmer"]
    with cao.http() as client:
        assert client.get(f"/terminals/{peer}").json()["status"] == "unknown"       # as CAO 2.5.4 says it
    again = start_run(run)
    resumed_at = time.monotonic()
    assert again.finish(timeout=RESUMED_WITHIN + 60) == 0, again.explain()
    took = time.monotonic() - resumed_at
    print(f"fault-reaction: killed, cao-server restarted, resumed to PASS: {took:.1f}s")
    assert took <= RESUMED_WITHIN, again.explain()
    state = run.state()
    assert state["final_status"] == "PASS" and not state.get("replacements"), again.explain()
    assert run.roles_prompted() == ["programmer", "peer_programmer", "tester"], again.explain()
    assert cao.counters().get("turns") == {"programmer": 1, "peer_programmer": 1, "tester": 1}, again.explain()
    assert run.archived_text("001-programmer.md") == PROGRAMMER_REPLY
