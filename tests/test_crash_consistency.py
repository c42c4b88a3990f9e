"""Taking a reply is crash-consistent: the loop dies at any step between a reply file settling and the
state saved after it, and the rerun neither sends that turn again nor loses its reply.

The steps are the loop's own crash points (`crash_point()`, ORCHESTRATOR_CRASH_AT in a real process):
reply-settled (the wait is over), reply-file-named (the state names where the reply goes), reply-archived
(the file moved into the run's folder), turn-recorded, report-written (then the caller saves what the reply
led to). Here a "kill" leaves the state file as the last save left it (nothing runs on the way out, as after
SIGKILL); a Ctrl-C goes out the usual way, which saves the state.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_main
from fake_cao import FAIL_REPLY, PASS_REPLY
from test_loop import QUICK, QUICK_ROUND, archived, state_of

STEPS = ("reply-settled", "reply-file-named", "reply-archived", "turn-recorded", "report-written")
RETRY_ROUND = ["programmer", "peer_programmer", "tester"]
WHOLE_RUN = QUICK_ROUND + RETRY_ROUND            # FAIL in round 1, PASS in round 2: 8 turns
# The turns the tests stop at (1-based, in WHOLE_RUN): an author turn, a review, and the tester's FAIL.
TURNS = {"author": 3, "review": 4, "tester FAIL": 5}


class Killed(BaseException):
    """The process died: nothing else of it runs."""


def crashing_at(module, monkeypatch, step: str, turn: int, how: str) -> None:
    """Make the module stop at `step` the `turn`-th time it gets there: killed, or Ctrl-C."""
    seen = {"count": 0}
    real_crash_point = module.crash_point

    def crash_point(name: str) -> None:
        real_crash_point(name)
        if name != step:
            return
        seen["count"] += 1
        if seen["count"] == turn:
            raise Killed() if how == "kill" else KeyboardInterrupt()

    monkeypatch.setattr(module, "crash_point", crash_point)
    if how == "kill":       # SIGKILL: no state saved on the way out, no summary, nothing
        monkeypatch.setattr(module, "wind_down", lambda code: code)


def killed_at(load_orch, fake_cao, prompt_file, monkeypatch, step: str, turn: int):
    """A FAIL -> PASS run killed at `step` of its `turn`-th reply: the module as the kill left it."""
    fake_cao.script["tester"] = [FAIL_REPLY, PASS_REPLY]
    module = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    crashing_at(module, monkeypatch, step, turn, "kill")
    with pytest.raises(Killed):
        module.main([])
    module.RunLock.give_back()             # the kernel frees a killed process's lock
    return module


def stop_once_then_finish(load_orch, fake_cao, prompt_file, monkeypatch, step: str, turn: int, how: str):
    if how == "kill":
        killed_at(load_orch, fake_cao, prompt_file, monkeypatch, step, turn)
    else:
        fake_cao.script["tester"] = [FAIL_REPLY, PASS_REPLY]
        first = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
        crashing_at(first, monkeypatch, step, turn, how)
        assert run_main(first) == 130
    monkeypatch.undo()
    second = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    return run_main(second), second


@pytest.mark.parametrize("how", ["kill", "ctrl-c"])
@pytest.mark.parametrize("which", list(TURNS))
@pytest.mark.parametrize("step", STEPS)
def test_a_stop_while_a_reply_is_taken_never_repeats_or_loses_the_turn(load_orch, fake_cao, prompt_file,
                                                                       monkeypatch, step, which, how):
    code, m = stop_once_then_finish(load_orch, fake_cao, prompt_file, monkeypatch, step, TURNS[which], how)
    assert code == 0
    assert fake_cao.roles_prompted() == WHOLE_RUN            # each prompt sent once: no turn repeated
    state = state_of(m)
    assert state["final_status"] == "PASS" and state["current_round"] == 2
    assert state["in_flight"] is None
    assert archived(m) == [f"{n:03d}-{role}.md" for n, role in enumerate(WHOLE_RUN, 1)]
    assert Path(m.run_dir, "005-tester.md").read_text() == FAIL_REPLY          # the FAIL was seen ...
    assert "greet World printed Hello World" in fake_cao.prompts_for("programmer")[1]   # ... and acted on
    summary = json.loads(Path(m.run_dir, "summary.json").read_text(encoding="utf-8"))
    assert [turn["role"] for turn in summary["turn_list"]] == WHOLE_RUN      # each turn recorded once


def test_the_state_names_the_reply_before_it_is_moved(load_orch, fake_cao, prompt_file, monkeypatch):
    """Killed between the save that names the reply's place and the move: the reply is still where the
    agent wrote it, and the rerun takes it from there."""
    m = killed_at(load_orch, fake_cao, prompt_file, monkeypatch, "reply-file-named", 2)
    in_flight = state_of(m)["in_flight"]
    assert in_flight["role"] == "peer_analyst" and in_flight["reply_file"] == "002-peer_analyst.md"
    assert not Path(m.run_dir, "002-peer_analyst.md").exists()
    assert m.read_reply_file(m.response_path("peer_analyst"))


def test_a_kept_reply_named_outside_the_run_folder_is_not_taken(load_orch, fake_cao, prompt_file, monkeypatch,
                                                                 tmp_path):
    """A state file edited by hand cannot make the loop read a file outside the run's folder as a reply."""
    m = killed_at(load_orch, fake_cao, prompt_file, monkeypatch, "reply-archived", 3)
    state = state_of(m)
    Path(m.run_dir, "003-programmer.md").unlink()              # the kept reply is gone ...
    outside = tmp_path / "elsewhere-programmer.md"
    outside.write_text("not a reply of this run")
    state["in_flight"]["reply_file"] = f"../../{outside.name}"   # ... and the state points elsewhere
    Path(m.STATE_FILE).write_text(json.dumps(state))
    monkeypatch.undo()
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    m.load_state()
    assert m.taken_reply("programmer") is None


@pytest.mark.parametrize("step", ["reply-archived", "turn-recorded", "report-written"])
def test_a_reply_taken_before_a_kill_is_not_sent_again_to_the_new_agents_of_a_machine_gone(
        load_orch, fake_cao, prompt_file, monkeypatch, step):
    """Killed after the programmer's reply was taken and kept, with its machine: the rerun finds every agent
    gone, starts five new ones (REPLACE_LOST_AGENTS=1), and takes the kept reply -- the programmer is not
    asked again."""
    killed_at(load_orch, fake_cao, prompt_file, monkeypatch, step, TURNS["author"])
    for session in list(fake_cao.sessions):
        fake_cao.end_session(session)
    monkeypatch.undo()
    m = load_orch(PROMPT_FILE=str(prompt_file), REPLACE_LOST_AGENTS="1", **QUICK)
    assert run_main(m) == 0
    assert fake_cao.roles_prompted() == WHOLE_RUN            # the programmer's first turn once, on the old agent
    assert archived(m) == [f"{n:03d}-{role}.md" for n, role in enumerate(WHOLE_RUN, 1)]
    assert [r["role"] for r in state_of(m)["replacements"]] == list(m.ROLES)
    events = Path(state_of(m)["run_dir"], "events.jsonl").read_text(encoding="utf-8").splitlines()
    taken = [json.loads(line)["role"] for line in events if json.loads(line)["event"] == "reply_taken"]
    assert taken == WHOLE_RUN                                # each turn's reply_taken said once, the kill or not


def test_the_kept_reply_is_the_text_acted_on_though_the_agent_rewrote_its_file_after_it_was_read(
        load_orch, fake_cao, prompt_file, monkeypatch):
    """The tester's FAIL is read; before it is kept, its agent writes a PASS over the file: the run acts on the
    FAIL, and the run's folder keeps the FAIL, byte for byte."""
    fake_cao.script["tester"] = [FAIL_REPLY, PASS_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    real_crash_point, seen = m.crash_point, []

    def rewritten_after_read(name: str) -> None:
        real_crash_point(name)
        if name == "reply-settled":
            seen.append(name)
            if len(seen) == TURNS["tester FAIL"]:
                m.response_path("tester").write_text("RESULT: PASS\nEVIDENCE: written after the FAIL was read\n")
    monkeypatch.setattr(m, "crash_point", rewritten_after_read)
    assert run_main(m) == 0
    assert Path(m.run_dir, "005-tester.md").read_bytes() == FAIL_REPLY.encode("utf-8")
    assert fake_cao.roles_prompted() == WHOLE_RUN                        # the FAIL acted on: a second round
