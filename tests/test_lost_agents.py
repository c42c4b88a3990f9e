"""Agents that die, vanish or never get their prompt, on the fake CAO.

An agent CLI that dies leaves a shell prompt in its pane while CAO keeps
reporting its last status; a tmux server that ends takes every agent's
session with it while CAO still answers for the terminals from its database.
The loop notices both within seconds. With the default REPLACE_LOST_AGENTS=0
it stops with one line naming the agent and both ways on; with 1 it replaces
the agent and sends the lost turn again, once, in full. It never types into a
pane whose CLI is gone. The same faults against a real cao-server and tmux are
in e2e/test_lost_agents_e2e.py.
"""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import pytest

from conftest import FAST, TASK_PROMPT, run_main
from fake_cao import FAIL_REPLY, PASS_REPLY, MainThreadSignals

TESTER_ONLY = {**FAST, "MIN_REVIEW_CYCLES_BEFORE_APPROVAL": "1", "START_AGENT": "tester"}
QUICK = {**FAST, "MIN_REVIEW_CYCLES_BEFORE_APPROVAL": "1"}
EXPLORE_LINE = "Build a greeting CLI"


def kill_cli(fake, terminal) -> None:
    fake.kill_cli(terminal.role)


def end_session(fake, terminal) -> None:
    fake.end_session(terminal.session)


@pytest.fixture
def run(load_orch, prompt_file):
    """Load the module with these settings; the liveness check runs often so tests take no seconds."""
    def load(**env):
        module = load_orch(PROMPT_FILE=str(prompt_file), **env)
        module.LIVENESS_CHECK_SECONDS = 0.05
        return module
    return load


def state_of(module) -> dict:
    return json.loads(Path(module.STATE_FILE).read_text())


def one_line(capsys) -> tuple[str, str]:
    out, err = capsys.readouterr()
    err = err.strip()
    assert "\n" not in err, err
    return out, err


# -- the default: stop at once, naming the agent ----------------------------------------

def test_a_cli_that_dies_mid_turn_stops_the_run_naming_it_and_both_ways_on(run, fake_cao, capsys):
    fake_cao.script["tester"] = [{"action": "call", "call": kill_cli}]
    m = run(**TESTER_ONLY)
    assert run_main(m) == 2                        # the same command would find it lost again
    out, err = one_line(capsys)
    tester = fake_cao.terminal_for("tester").id
    assert f"the tester agent (terminal {tester}) is lost: its agent CLI exited" in err
    assert "last screen line: 'bash-5.2#'" in err
    assert "REPLACE_LOST_AGENTS=1" in err and "RESUME=0" in err
    assert "tester: terminal" in out and "Killed | bash-5.2#" in out         # its last lines, logged
    assert fake_cao.shell_inputs == []                                      # no reminder typed into bash
    state = state_of(m)
    assert state["final_status"] == "RUNNING" and state["in_flight"]["role"] == "tester"


def test_a_vanished_session_stops_the_run_and_the_last_line_does_not_call_the_agents_running(
        run, fake_cao, capsys):
    fake_cao.script["tester"] = [{"action": "call", "call": end_session}]
    m = run(**TESTER_ONLY)
    assert run_main(m) == 2                        # the same command would find it lost again
    out, err = one_line(capsys)
    assert f"its CAO session {m.session_name} is gone" in err
    last = out.strip().splitlines()[-1]
    assert "still running" not in last and f"CAO session {m.session_name} are gone" in last


def test_an_agent_whose_cli_died_between_turns_is_never_typed_into(run, fake_cao, capsys):
    """The tester answered in round 1; the programmer's round-2 turn kills the tester's CLI: the tester's
    prompt never goes into its shell, and the run stops naming it (its conversation is gone)."""
    def kill_tester(fake, programmer):
        if fake.turns["programmer"] == 2:
            fake.kill_cli("tester")
        _write_reply(programmer)
    fake_cao.script["programmer"] = [{"action": "call", "call": kill_tester}]
    fake_cao.script["tester"] = [FAIL_REPLY, PASS_REPLY]
    m = run(**{**QUICK, "START_AGENT": "programmer"})
    assert run_main(m) == 2                        # the same command would find it lost again
    _out, err = one_line(capsys)
    assert "the tester agent" in err and "its agent CLI exited" in err
    assert fake_cao.shell_inputs == [] and len(fake_cao.prompts_for("tester")) == 1


def test_an_agent_whose_cli_died_before_its_first_prompt_is_started_again_without_replace_lost_agents(
        run, fake_cao, capsys):
    """A CLI that crashed as it started (the programmer's turn kills the tester's CLI before the tester has
    had a prompt): nothing of the run goes with it, so the tester is started again even with
    REPLACE_LOST_AGENTS=0, never typed into while dead, and the run passes."""
    def kill_tester(fake, programmer):
        fake.kill_cli("tester")
        _write_reply(programmer)
    fake_cao.script["programmer"] = [{"action": "call", "call": kill_tester}]
    m = run(**{**QUICK, "START_AGENT": "programmer"})
    assert run_main(m) == 0
    out, _err = capsys.readouterr()
    assert "the tester agent's CLI is gone before its first prompt (its agent CLI exited" in out
    assert "starting it again, as nothing of the run goes with it" in out
    assert fake_cao.shell_inputs == [] and len(fake_cao.prompts_for("tester")) == 1
    state = state_of(m)
    assert state["final_status"] == "PASS" and [r["role"] for r in state["replacements"]] == ["tester"]
    assert state["terminals"]["tester"] != state["replacements"][0]["old_terminal"]


def _write_reply(terminal) -> None:
    """What a step's default action does: the reply file, then the agent shows completed."""
    path = Path(terminal.response_path)
    path.write_text("PROGRAMMER_SUMMARY:\n- Files changed: greet.py\n", encoding="utf-8")
    terminal.status = "completed"


# -- REPLACE_LOST_AGENTS=1 ---------------------------------------------------------------

def test_a_cli_that_dies_mid_turn_is_replaced_and_its_turn_sent_once_more_in_full(run, fake_cao, capsys):
    fake_cao.script["tester"] = [{"action": "call", "call": kill_cli}, PASS_REPLY]
    m = run(**TESTER_ONLY, REPLACE_LOST_AGENTS="1")
    assert run_main(m) == 0
    old, new = [t for t in fake_cao.terminals.values() if t.role == "tester"]
    assert old.deleted and not new.deleted and m.terminal_ids["tester"] == new.id
    first, again = fake_cao.prompts_for("tester")
    assert EXPLORE_LINE in again and " in a five-agent development loop" in again   # every block in full
    assert again == first                                   # the same whole prompt, once more
    assert fake_cao.shell_inputs == []
    [record] = state_of(m)["replacements"]
    assert (record["role"], record["old_terminal"], record["new_terminal"]) == ("tester", old.id, new.id)
    assert "its agent CLI exited" in record["why"] and record["at"].endswith("Z") and record["event"] == 1
    out = capsys.readouterr().out
    assert f"replacement 1/3: tester {old.id} -> {new.id}" in out
    assert "summary: lost agents replaced: 1 (tester" in out
    summary = json.loads((Path(m.run_dir) / "summary.json").read_text())
    assert summary["replacements"][0]["new_terminal"] == new.id


def test_a_replaced_agent_is_sent_the_lost_turn_whatever_its_first_status_reads(run, fake_cao, capsys):
    """The new agent never had the prompt: it is sent the turn, also where a ready status counts for nothing
    (OpenCode), instead of being waited on as if it worked on it."""
    fake_cao.script["tester"] = [{"action": "call", "call": kill_cli}, PASS_REPLY]
    m = run(**TESTER_ONLY, REPLACE_LOST_AGENTS="1", PROVIDER="opencode_cli")
    assert run_main(m) == 0
    assert len(fake_cao.prompts_for("tester")) == 2
    out = capsys.readouterr().out
    assert "still working on the prompt sent before" not in out and "reminder" not in out


HERMES_TIMEOUT = "Failed to create terminal: Hermes initialization timed out after 120 seconds"


def kill_cli_and_fail_its_next_starts(times: int):
    """The CLI dies; the next `times` starts of the role's new agent time out in CAO."""
    def call(fake, terminal) -> None:
        tries = []
        fake.fail_create[terminal.profile] = (500, HERMES_TIMEOUT)

        def on_create(created: str) -> None:
            if created == terminal.profile:
                tries.append(created)
                if len(tries) > times:                # this try starts
                    fake.fail_create.pop(created, None)
        fake.create_hook = on_create
        fake.kill_cli(terminal.role)
    return call


def test_a_replacement_whose_cli_did_not_start_in_time_is_started_once_more(run, fake_cao, capsys):
    """CAO can fail a start-up whose CLI came up (a Hermes at its idle prompt): the new agent gets the second try
    its row gives it."""
    fake_cao.script["tester"] = [{"action": "call", "call": kill_cli_and_fail_its_next_starts(1)}, PASS_REPLY]
    m = run(**TESTER_ONLY, REPLACE_LOST_AGENTS="1", TESTER_PROVIDER="hermes")
    assert m.AGENT_CLIS["hermes"].start_tries == 2
    assert run_main(m) == 0
    assert [status for profile, status in fake_cao.create_answers if profile == "tester"] == [201, 500, 201]
    out = capsys.readouterr().out
    assert "tester: the new agent's CLI did not start within CAO's time limit" in out and "starting it again" in out
    [record] = state_of(m)["replacements"]
    assert record["new_terminal"] == m.terminal_ids["tester"]
    assert len(fake_cao.prompts_for("tester")) == 2


def test_a_replacement_whose_cli_did_not_start_in_time_twice_stops_the_run(run, fake_cao, capsys):
    fake_cao.script["tester"] = [{"action": "call", "call": kill_cli_and_fail_its_next_starts(2)}, PASS_REPLY]
    m = run(**TESTER_ONLY, REPLACE_LOST_AGENTS="1", TESTER_PROVIDER="hermes")
    assert run_main(m) == 3
    assert [status for profile, status in fake_cao.create_answers if profile == "tester"] == [201, 500, 500]
    assert "Hermes initialization timed out" in capsys.readouterr().err


def test_a_replacement_of_a_cli_whose_row_gives_one_try_is_not_started_again(run, fake_cao, capsys):
    fake_cao.script["tester"] = [{"action": "call", "call": kill_cli_and_fail_its_next_starts(1)}, PASS_REPLY]
    m = run(**TESTER_ONLY, REPLACE_LOST_AGENTS="1")
    assert m.agent_cli(m.provider_for("tester")).start_tries == 1
    assert run_main(m) == 3
    assert [status for profile, status in fake_cao.create_answers if profile == "tester"] == [201, 500]
    assert "starting it again" not in capsys.readouterr().out


def test_a_vanished_session_gets_five_new_agents_as_one_replacement(run, fake_cao, capsys):
    """The agents' tmux server ended: all five are made again in a new session; the turn goes on there."""
    fake_cao.script["peer_analyst"] = [{"action": "call", "call": end_session}, "REVIEW_RESULT: APPROVED\n"
                                       "REVIEW_NOTES:\n- Artifacts: ok\n- P1 traceability: ok\n"
                                       "- Downstream contract: ok\n- Handoff: ok\n"]
    m = run(**QUICK, REPLACE_LOST_AGENTS="1")
    assert run_main(m) == 0
    records = state_of(m)["replacements"]
    assert sorted(r["role"] for r in records) == sorted(m.ROLES) and {r["event"] for r in records} == {1}
    first_session = next(t.session for t in fake_cao.terminals.values() if t.id == records[0]["old_terminal"])
    assert first_session in fake_cao.deleted_sessions and m.session_name != first_session
    assert [role for role, _ in fake_cao.prompts].count("analyst") == 1          # a completed turn: not again
    assert [role for role, _ in fake_cao.prompts].count("peer_analyst") == 2     # the lost one: once more
    assert "replacing all five agents" in capsys.readouterr().out


def test_replacements_stop_at_max_agent_replacements(run, fake_cao, capsys):
    fake_cao.script["tester"] = [{"action": "call", "call": kill_cli}] * 2 + [PASS_REPLY]
    m = run(**TESTER_ONLY, REPLACE_LOST_AGENTS="1", MAX_AGENT_REPLACEMENTS="1")
    assert run_main(m) == 2                        # the same command would find it lost again
    _out, err = one_line(capsys)
    assert "the tester agent" in err and "MAX_AGENT_REPLACEMENTS=1" in err and "RESUME=0" in err
    assert len(state_of(m)["replacements"]) == 1


# -- a written reply outlives its writer -----------------------------------------------------

CUT_OFF_PASS = PASS_REPLY[:PASS_REPLY.index("EVIDENCE")]          # its agent gone as it wrote it


def write_then_vanish(text: str, screens_too: bool = False):
    """A step: the agent writes `text` as its reply, then its session ends before its turn's end is seen."""
    def call(fake, terminal) -> None:
        Path(terminal.response_path).write_text(text, encoding="utf-8")
        fake.end_session(terminal.session, screens_too)
    return call


@pytest.mark.parametrize("screens_too", [False, True], ids=["old screen", "no screen"])
def test_a_session_gone_after_the_reply_was_written_is_noticed_and_the_reply_taken(run, fake_cao, capsys,
                                                                                   screens_too):
    """After a cao-server restart (status `unknown`) the turn's end is judged by a still screen; the tester's
    session ends right after it wrote its reply: the loop notices (the session's record, or a screen CAO can
    no longer read), and takes the complete reply -- not a still screen, not RESPONSE_TIMEOUT."""
    fake_cao.reported_status = "unknown"
    fake_cao.script["tester"] = [{"action": "call", "call": write_then_vanish(PASS_REPLY, screens_too)}]
    m = run(**{**TESTER_ONLY, "RESPONSE_TIMEOUT": "60", "QUIET_SCREEN_SECONDS": "30"})
    assert run_main(m) == 0
    out = capsys.readouterr().out
    assert f"turn end seen by {m.TURN_ENDED_BY_AGENT_GONE}" in out
    assert "the reply it wrote is complete: taking it" in out
    assert len(fake_cao.prompts_for("tester")) == 1 and state_of(m)["final_status"] == "PASS"


def test_a_window_gone_while_cao_cannot_tell_its_status_is_lost_though_its_session_is_listed(run, fake_cao,
                                                                                                capsys):
    """CAO lists the session, but can neither tell the terminal's status nor read its screen: the agent is
    gone, with or without a reply file -- noticed, not waited on."""
    def window_gone(fake, terminal) -> None:
        terminal.window_gone = True
    fake_cao.reported_status = "unknown"
    fake_cao.script["tester"] = [{"action": "call", "call": window_gone}]
    m = run(**{**TESTER_ONLY, "RESPONSE_TIMEOUT": "60"})
    assert run_main(m) == 2
    _out, err = one_line(capsys)
    assert "the tester agent" in err and "CAO can neither read its screen nor tell its status" in err


def test_a_reply_cut_off_as_its_session_ended_stops_the_run_naming_the_agent(run, fake_cao, capsys):
    fake_cao.script["tester"] = [{"action": "call", "call": write_then_vanish(CUT_OFF_PASS)}]
    m = run(**{**TESTER_ONLY, "RESPONSE_TIMEOUT": "60", "QUIET_SCREEN_SECONDS": "30"})
    assert run_main(m) == 2
    _out, err = one_line(capsys)
    assert f"its CAO session {m.session_name} is gone" in err
    assert state_of(m)["in_flight"]["role"] == "tester"


def test_a_reply_cut_off_as_its_session_ended_is_not_taken_and_the_turn_goes_to_a_new_agent(run, fake_cao,
                                                                                                capsys):
    fake_cao.script["tester"] = [{"action": "call", "call": write_then_vanish(CUT_OFF_PASS)}, PASS_REPLY]
    m = run(**{**TESTER_ONLY, "RESPONSE_TIMEOUT": "60", "QUIET_SCREEN_SECONDS": "30"}, REPLACE_LOST_AGENTS="1")
    assert run_main(m) == 0
    first, again = fake_cao.prompts_for("tester")
    assert again == first and m.terminal_ids["tester"] != fake_cao.terminal_for("tester").id
    assert len(state_of(m)["replacements"]) == 5
    assert Path(m.run_dir, "001-tester.md").read_text() == PASS_REPLY        # the new agent's, whole


class MachineGone(BaseException):
    """The loop's machine died: nothing of the process runs on."""


def machine_killed_after_the_reply(load_orch, prompt_file, fake_cao, monkeypatch, text: str):
    """A run whose machine dies right after the tester wrote `text` as its reply, before the loop took it; the
    agents are gone with it. Returns the module to run again on a fresh machine."""
    def write_then_die(fake, terminal) -> None:
        Path(terminal.response_path).write_text(text, encoding="utf-8")
        raise MachineGone()
    fake_cao.script["tester"] = [{"action": "call", "call": write_then_die}, PASS_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), **TESTER_ONLY)
    monkeypatch.setattr(m, "wind_down", lambda code: code)     # SIGKILL: nothing saved on the way out
    with pytest.raises(MachineGone):
        m.main([])
    m.RunLock.give_back()
    for session in list(fake_cao.sessions):
        fake_cao.end_session(session)
    monkeypatch.undo()
    return load_orch(PROMPT_FILE=str(prompt_file), REPLACE_LOST_AGENTS="1", **TESTER_ONLY)


def test_a_complete_reply_left_by_agents_gone_with_their_machine_is_taken_not_sent_again(
        load_orch, prompt_file, fake_cao, monkeypatch, capsys):
    m = machine_killed_after_the_reply(load_orch, prompt_file, fake_cao, monkeypatch, PASS_REPLY)
    assert run_main(m) == 0
    assert len(fake_cao.prompts_for("tester")) == 1             # not sent again to the new agent
    assert state_of(m)["final_status"] == "PASS" and len(state_of(m)["replacements"]) == 5
    assert Path(m.run_dir, "001-tester.md").read_text() == PASS_REPLY
    out = capsys.readouterr().out
    assert "tester: its reply, written before its agent was gone, is complete" in out
    assert f"turn end seen by {m.TURN_ENDED_BY_AGENT_GONE}" in out


def test_a_cut_off_reply_left_by_agents_gone_with_their_machine_is_not_taken_the_turn_goes_again(
        load_orch, prompt_file, fake_cao, monkeypatch):
    m = machine_killed_after_the_reply(load_orch, prompt_file, fake_cao, monkeypatch, CUT_OFF_PASS)
    assert run_main(m) == 0
    first, again = fake_cao.prompts_for("tester")
    assert again == first
    assert Path(m.run_dir, "001-tester.md").read_text() == PASS_REPLY        # the new agent's, whole
    assert any(p.name.endswith("-stale-test_result.md") and p.read_text() == CUT_OFF_PASS
               for p in Path(m.run_dir).iterdir())             # set aside, never read as the answer


# -- at resume: a reboot ---------------------------------------------------------------

def _saved_run_whose_session_is_gone(m, fake_cao) -> dict:
    ids = fake_cao.add_terminals(session="cao-old")
    fake_cao.end_session("cao-old")
    data = {"version": 1, "api": "http://cao.test", "provider": "codex", "wd": m.WD, "prompt": TASK_PROMPT,
            "current_round": 1, "current_phase": "tester", "final_status": "RUNNING", "session_name": "cao-old",
            "terminals": ids, "feedback": "", "analyst_feedback": "", "programmer_feedback": "",
            "outputs": {"analyst": "x", "analyst_review": "", "programmer": "y", "programmer_review": "",
                        "tester": ""}, "context_sent": [f"intro:{ids['tester']}", f"explore:{ids['tester']}"]}
    Path(m.STATE_FILE).parent.mkdir(parents=True, exist_ok=True)
    Path(m.STATE_FILE).write_text(json.dumps(data))
    return ids


def test_after_a_reboot_the_resume_stops_naming_the_lost_agent(run, fake_cao, capsys):
    """CAO still answers for the old terminals, but their session is gone: no wait, one line."""
    m = run(**TESTER_ONLY)
    _saved_run_whose_session_is_gone(m, fake_cao)
    before = Path(m.STATE_FILE).read_bytes()
    assert run_main(m) == 2                        # the same command would find it lost again
    _out, err = one_line(capsys)
    assert err.startswith("error: cannot resume: the tester agent")     # the one whose turn is next
    assert "its CAO session cao-old is gone" in err and "REPLACE_LOST_AGENTS=1" in err
    assert Path(m.STATE_FILE).read_bytes() == before and fake_cao.prompts == []


def test_after_a_reboot_every_lost_agent_is_replaced_before_the_run_goes_on_at_its_turn(run, fake_cao, capsys):
    m = run(**TESTER_ONLY, REPLACE_LOST_AGENTS="1")
    old_ids = _saved_run_whose_session_is_gone(m, fake_cao)
    assert run_main(m) == 0
    assert fake_cao.roles_prompted() == ["tester"]
    [prompt] = fake_cao.prompts_for("tester")
    assert EXPLORE_LINE in prompt                                # the new agent never had the task
    assert set(m.terminal_ids.values()).isdisjoint(old_ids.values())
    assert len(state_of(m)["replacements"]) == 5 and state_of(m)["final_status"] == "PASS"
    assert "cao-old" in fake_cao.deleted_sessions


# -- leave nothing behind -----------------------------------------------------------------

def test_cleanup_on_exit_removes_the_session_and_says_a_rerun_starts_a_new_run(run, fake_cao, capsys):
    fake_cao.script["tester"] = [{"action": "error", "text": "boom"}]
    m = run(**TESTER_ONLY, CLEANUP_ON_EXIT="1")
    assert run_main(m) == 3
    out, err = capsys.readouterr()
    assert fake_cao.deleted_sessions == [m.session_name]
    assert "rerun to resume" not in err and "rerun to start a new run (CLEANUP_ON_EXIT=1" in err
    assert "a rerun starts a new run" in out


def test_a_ctrl_c_while_the_old_run_is_ended_leaves_the_new_run_resumable(run, fake_cao, capsys):
    """The new run's state is written before the old agents are ended: a rerun resumes it."""
    m = run(**TESTER_ONLY, RESUME="0")
    old_ids = fake_cao.add_terminals(session="cao-old")
    Path(m.STATE_FILE).parent.mkdir(parents=True, exist_ok=True)
    Path(m.STATE_FILE).write_text(json.dumps({
        "version": 1, "api": "http://cao.test", "prompt": TASK_PROMPT, "final_status": "RUNNING",
        "current_phase": "tester", "session_name": "cao-old", "terminals": old_ids}))
    real_exit = m.api.exit_terminal

    def interrupted(terminal_id):
        if terminal_id in old_ids.values():
            raise KeyboardInterrupt
        return real_exit(terminal_id)
    m.api.exit_terminal = interrupted
    assert run_main(m) == 130
    assert "interrupted (SIGINT); state saved, rerun to resume" in capsys.readouterr().err
    state = state_of(m)
    assert state["final_status"] == "RUNNING" and state["session_name"] != "cao-old"
    assert set(state["terminals"].values()).isdisjoint(old_ids.values())
    m = run(**TESTER_ONLY)
    assert run_main(m) == 0 and state_of(m)["final_status"] == "PASS"
    assert "resuming run" in capsys.readouterr().out


def test_status_says_still_running_only_of_agents_the_server_still_has(run, fake_cao, capsys):
    m = run(**TESTER_ONLY)
    assert run_main(m) == 0
    capsys.readouterr()
    assert run_main(m, "--status") == 0
    assert f"agents: the five agents of CAO session {m.session_name} are still running" in capsys.readouterr().out
    fake_cao.kill_cli("tester")
    fake_cao.terminal_for("tester").deleted = True
    assert run_main(m, "--status") == 0
    assert f"agents: 4 of the five agents of CAO session {m.session_name} are still running" in \
        capsys.readouterr().out
    fake_cao.end_session(m.session_name)
    assert run_main(m, "--status") == 0
    out = capsys.readouterr().out
    assert "still running" not in out and f"agents: the agents of CAO session {m.session_name} are gone" in out


def test_a_server_without_the_session_route_is_not_taken_for_a_lost_session(run, fake_cao, capsys):
    """An older CAO answers 404 "Not Found" for GET /sessions/{name}: the loop cannot ask, so it goes on."""
    import httpx
    fake_cao.router.route(method="GET", url__regex=r"^http://cao\.test/sessions/[^/?]+$").mock(
        return_value=httpx.Response(404, json={"detail": "Not Found"}))
    m = run(**TESTER_ONLY)
    assert run_main(m) == 0


def test_a_replaced_agent_asks_for_the_roles_model_again(run, fake_cao):
    fake_cao.script["tester"] = [{"action": "call", "call": kill_cli}, PASS_REPLY]
    m = run(**TESTER_ONLY, REPLACE_LOST_AGENTS="1", MODEL="big-model", TESTER_MODEL="small-model")
    assert run_main(m) == 0
    tester_creations = [dict(r.url.params) for r in fake_cao.requests
                        if r.method == "POST" and r.url.path.startswith("/sessions")
                        and dict(r.url.params).get("agent_profile") == "tester"]
    assert [c.get("model") for c in tester_creations] == ["small-model", "small-model"]


def test_a_stop_while_a_replacement_starts_ends_at_once_and_the_rerun_gets_that_same_agent(run, fake_cao):
    """SIGTERM while the replacement of a lost tester is still starting (CAO answers once its CLI is up): the
    run exits 143 without waiting for that answer, its state still naming the lost terminal; the same
    command asks again under the same key and gets the agent that start made, never a second one."""
    let_go = threading.Event()
    answered_before_the_exit: list[bool] = []

    def hold_the_replacement(profile: str) -> None:
        if profile == "tester" and len(fake_cao.terminals) == 5:      # the five are up: this is the replacement
            signals.send(signal.SIGTERM)
            let_go.wait(60)

    fake_cao.script["tester"] = [{"action": "call", "call": kill_cli}, PASS_REPLY]
    m = run(**TESTER_ONLY, REPLACE_LOST_AGENTS="1")
    fake_cao.create_hook = hold_the_replacement
    with MainThreadSignals() as signals:
        assert run_main(m) == 143
    answered_before_the_exit.append(fake_cao.create_answers[-1][0] == "tester" and len(fake_cao.terminals) == 6)
    lost = state_of(m)["terminals"]["tester"]
    let_go.set()
    fake_cao.wait_until("the replacement to be made", lambda: len(fake_cao.terminals) == 6)
    assert answered_before_the_exit == [False]
    assert state_of(m)["replacements"] == [] and fake_cao.terminals[lost].role == "tester"
    fake_cao.create_hook = None
    m = run(**TESTER_ONLY, REPLACE_LOST_AGENTS="1")
    assert run_main(m) == 0
    assert len(fake_cao.terminals) == 6 and fake_cao.idempotent_answers == 1        # that same agent, asked again
    assert state_of(m)["terminals"]["tester"] == [t.id for t in fake_cao.terminals.values()][-1]
