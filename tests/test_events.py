"""The run's events for programs: events.jsonl in the run's folder, numbered across invocations, torn lines
never written over, and `--status --follow` streaming it until the invocation that drives the run ends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import FAST, run_main
from fake_cao import FAIL_REPLY, PASS_REPLY

QUICK = {**FAST, "MIN_REVIEW_CYCLES_BEFORE_APPROVAL": "1"}


def events_of(module) -> list[dict]:
    path = Path(module.run_dir) / module.EVENTS_FILE
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_a_fail_then_pass_run_tells_each_turn_verdict_and_its_end(load_orch, fake_cao, prompt_file):
    fake_cao.script["tester"] = [FAIL_REPLY, PASS_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 0
    events = events_of(m)
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert events[0]["event"] == "run_started" and set(events[0]["terminals"]) == set(m.ROLES)
    sent = [e for e in events if e["event"] == "turn_sent"]
    taken = [e for e in events if e["event"] == "reply_taken"]
    assert [e["role"] for e in sent] == [e["role"] for e in taken] == fake_cao.roles_prompted()
    assert [e["number"] for e in sent] == list(range(1, len(sent) + 1))
    assert [e["reply_file"] for e in taken] == [f"{n:03d}-{e['role']}.md" for n, e in enumerate(taken, 1)]
    for event in sent + taken:
        assert event["terminal"] == m.terminal_ids[event["role"]]
    order = [(e["event"], e["role"]) for e in events if e["event"] in ("turn_sent", "reply_taken")]
    assert order == [(kind, role) for role in fake_cao.roles_prompted() for kind in ("turn_sent", "reply_taken")]
    tester = [(e["round"], e["outcome"]) for e in events if e["event"] == "verdict" and e["role"] == "tester"]
    assert tester == [(1, "FAIL"), (2, "PASS")]
    assert events[-1] == {**events[-1], "event": "run_stopped", "result": "PASS", "exit_code": 0,
                          "scheduler_action": m.SCHEDULER_ACTIONS[0], "turns": len(taken)}
    assert sum(e["event"] == "run_stopped" for e in events) == 1


def server_down_after_the_answer(fake, terminal) -> None:
    """The programmer answers, then the server stays down (until the test brings it back)."""
    fake.outage = 10**9
    Path(terminal.response_path).write_text("PROGRAMMER_SUMMARY:\n- Files changed: greet.py\n")
    terminal.status = "completed"


def test_a_resumed_run_numbers_its_events_on(load_orch, fake_cao, prompt_file):
    fake_cao.script["programmer"] = [{"action": "call", "call": server_down_after_the_answer}]
    m = load_orch(PROMPT_FILE=str(prompt_file), API_RETRY_SECONDS="0.3", **QUICK)
    assert run_main(m) == 3                                  # the server stayed away
    first = events_of(m)
    assert first[-1]["event"] == "run_stopped" and first[-1]["exit_code"] == 3
    assert first[-1]["result"] == "RUNNING" and first[-1]["scheduler_action"] == m.SCHEDULER_ACTIONS[3]

    fake_cao.outage = 0                                      # the server is back
    m = load_orch(PROMPT_FILE=str(prompt_file), RESUME="1", **QUICK)
    assert run_main(m) == 0
    events = events_of(m)
    assert events[:len(first)] == first                      # appended to, never rewritten
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    resumed = events[len(first)]
    assert resumed["event"] == "run_resumed" and resumed["phase"] == "programmer"
    assert [e["event"] for e in events].count("run_stopped") == 2 and events[-1]["result"] == "PASS"


def test_a_torn_last_line_is_left_and_the_next_event_follows_the_last_whole_one(orch, tmp_path, monkeypatch):
    monkeypatch.setattr(orch, "run_dir", str(tmp_path))
    path = tmp_path / orch.EVENTS_FILE
    path.write_text('{"seq": 1, "at": "x", "event": "run_started"}\n{"seq": 2, "at": "x", "eve', encoding="utf-8")
    orch.record_event("turn_sent", role="tester")
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines[1] == '{"seq": 2, "at": "x", "eve'                 # kept as it was
    assert json.loads(lines[2])["seq"] == 2 and json.loads(lines[2])["event"] == "turn_sent"
    assert [e["seq"] for e in orch.read_events(path)] == [1, 2]
    assert [e["event"] for e in orch.read_events(path, after=1)] == ["turn_sent"]


def test_an_event_kind_not_in_the_table_is_a_fault_of_the_script(orch, tmp_path, monkeypatch):
    monkeypatch.setattr(orch, "run_dir", str(tmp_path))
    with pytest.raises(ValueError, match="not an event kind: turn_went"):
        orch.record_event("turn_went")


def test_a_folder_that_cannot_be_written_costs_the_event_not_the_run(orch, tmp_path, monkeypatch):
    monkeypatch.setattr(orch, "run_dir", str(tmp_path / "gone"))
    orch.record_event("run_resumed", round=1)
    assert not (tmp_path / "gone").exists()


def test_status_follow_of_a_run_no_process_drives_prints_its_events_and_ends(load_orch, fake_cao, prompt_file,
                                                                            capsys):
    fake_cao.script["tester"] = [FAIL_REPLY, PASS_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 0
    events = events_of(m)
    capsys.readouterr()
    assert m.status_command([], as_json=True, follow=True) == 0
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == events
    assert m.status_command([], follow=True) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(events)
    assert lines[0].startswith("#1 ") and " run_started " in lines[0]
    assert lines[-1].startswith(f"#{len(events)} ") and "run_stopped result=PASS exit_code=0" in lines[-1]


def driven_in_steps(orch, monkeypatch, steps: list) -> None:
    """Each look --follow takes at the run's lock is a step of the process driving the run: it does the
    step (appends an event, ...) and holds the lock; once the steps are done it has let go of the run."""
    monkeypatch.setattr(orch, "FOLLOW_POLL_SECONDS", 0)

    def lock_holder() -> str:
        if steps:
            steps.pop(0)()
            return "pid 4242 since 2026-11-27 10:00:00"
        return ""

    monkeypatch.setattr(orch.RunLock, "holder", lock_holder)


def test_status_follow_streams_events_until_the_driving_invocation_ends(orch, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(orch, "STATE_FILE", str(tmp_path / "state.json"))
    monkeypatch.setattr(orch, "run_dir", str(tmp_path / "run"))
    Path(orch.run_dir).mkdir()
    orch.save_state()
    steps = [lambda: orch.record_event("run_resumed", round=2),
             lambda: orch.record_event("turn_sent", role="tester"),
             lambda: None,
             lambda: orch.record_event("reply_taken", role="tester"),
             lambda: orch.record_event("run_stopped", result="PASS", exit_code=0)]
    driven_in_steps(orch, monkeypatch, steps)
    assert orch.follow_events(as_json=True) == 0
    printed = [json.loads(line)["event"] for line in capsys.readouterr().out.splitlines()]
    assert printed == ["run_resumed", "turn_sent", "reply_taken", "run_stopped"]
    assert not steps


def test_status_follow_without_a_run_says_so(load_orch, tmp_path, capsys):
    m = load_orch(WD=str(tmp_path))
    assert m.status_command([], follow=True) == 1
    assert "no state file at" in capsys.readouterr().err


def test_the_docs_name_every_event_kind(orch):
    docs = (Path(orch.__file__).parent / "docs" / "following-a-run.md").read_text(encoding="utf-8")
    for kind in orch.EVENT_KINDS:
        assert f"| `{kind}` |" in docs, kind


def test_status_follow_goes_on_with_a_new_run_started_in_the_same_state_file(orch, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(orch, "STATE_FILE", str(tmp_path / "state.json"))
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
    monkeypatch.setattr(orch, "run_dir", str(tmp_path / "first"))
    orch.save_state()

    def new_run() -> None:
        orch.update_run(run_dir=str(tmp_path / "second"))
        orch.save_state()
        orch.record_event("run_started", session="cao-loop-2")

    steps = [lambda: orch.record_event("run_started", session="cao-loop-1"),
             lambda: orch.record_event("turn_sent", role="analyst"),
             new_run,
             lambda: orch.record_event("run_stopped", result="RUNNING", exit_code=3)]
    driven_in_steps(orch, monkeypatch, steps)
    assert orch.follow_events(as_json=True) == 0
    printed = [(e["seq"], e["event"], e.get("session")) for e in map(json.loads, capsys.readouterr().out.splitlines())]
    assert printed == [(1, "run_started", "cao-loop-1"), (2, "turn_sent", None), (1, "run_started", "cao-loop-2"),
                       (2, "run_stopped", None)]
