"""State file and the tester FAIL handler.

Spec 1 "State file compatibility with shell script", spec 2 "Programmer retry
context persisted in state" and "Condensed programmer summary carried on FAIL
retry", spec 4 "Shortened retry pipeline on tester FAIL" and "Selective output
clearing on FAIL".
"""

from __future__ import annotations

import json
import os
import re
from datetime import datetime
from pathlib import Path

import pytest

from conftest import TASK_PROMPT

SHELL_FIELDS = {"version", "updated_at", "api", "provider", "wd", "prompt", "current_round", "current_phase",
                "final_status", "session_name", "terminals", "feedback", "analyst_feedback",
                "programmer_feedback", "outputs"}
ROLES = ["analyst", "peer_analyst", "programmer", "peer_programmer", "tester"]
OUTPUT_KEYS = ["analyst", "analyst_review", "programmer", "programmer_review", "tester"]

PROGRAMMER_OUT = ("PROGRAMMER_SUMMARY:\n- Files changed: greet.py\n- Behavior implemented: greet NAME\n"
                  "- Tests run: pytest -q\n- Known gaps: none\n")
TESTER_FAIL = ("I ran it.\nRESULT: FAIL\nchatter\nEVIDENCE:\n- greet World printed Hello World\n"
               "- Recommended next fix: greet.py\n")


def populate(m) -> None:
    """Give every saved global a distinctive value."""
    m.set_task(TASK_PROMPT)
    m.PROVIDER = "claude_code"
    m.session_name = "cao-session-7"
    m.terminal_ids = {role: f"tid-{role}" for role in ROLES}
    m.current_round = 3
    m.current_phase = m.PHASE_TESTER
    m.final_status = "RUNNING"
    m.feedback = "RESULT: FAIL\nEVIDENCE:\n- boom"
    m.analyst_feedback = "REVIEW_NOTES:\n- analyst notes"
    m.programmer_feedback = "REVIEW_NOTES:\n- programmer notes"
    m.programmer_context_for_retry = "- Files changed: foo.py"
    m.outputs = {key: f"output of {key}" for key in OUTPUT_KEYS}


def reset(m) -> None:
    """Put the run globals back to a blank run."""
    m.set_task("")
    m.PROVIDER = "codex"
    m.session_name = ""
    m.terminal_ids = {role: "" for role in ROLES}
    m.current_round = 1
    m.current_phase = m.PHASE_ANALYST
    m.final_status = "RUNNING"
    m.feedback = m.analyst_feedback = m.programmer_feedback = m.programmer_context_for_retry = ""
    m.outputs = {key: "" for key in OUTPUT_KEYS}


def snapshot(m) -> dict:
    return {
        "API": m.API, "PROVIDER": m.PROVIDER, "WD": m.WD, "PROMPT": m.PROMPT,
        "EXPLORE_SUMMARY": m.EXPLORE_SUMMARY, "SCENARIO_TEST": m.SCENARIO_TEST,
        "session_name": m.session_name, "terminal_ids": dict(m.terminal_ids),
        "current_round": m.current_round, "current_phase": m.current_phase, "final_status": m.final_status,
        "feedback": m.feedback, "analyst_feedback": m.analyst_feedback,
        "programmer_feedback": m.programmer_feedback,
        "programmer_context_for_retry": m.programmer_context_for_retry, "outputs": dict(m.outputs),
    }


def saved(m) -> dict:
    return json.loads(Path(m.STATE_FILE).read_text(encoding="utf-8"))


def shell_state(m, **changes) -> dict:
    """A state file as the shell script writes it: only its fields."""
    data = {
        "version": 1,
        "updated_at": "2024-05-01T10:00:00Z",
        "api": "http://cao.test",
        "provider": "codex",
        "wd": m.WD,
        "prompt": TASK_PROMPT,
        "current_round": 2,
        "current_phase": "programmer",
        "final_status": "RUNNING",
        "session_name": "cao-shell",
        "terminals": {role: f"sh-{role}" for role in ROLES},
        "feedback": "RESULT: FAIL\nEVIDENCE:\n- shell evidence",
        "analyst_feedback": "",
        "programmer_feedback": "REVIEW_NOTES:\n- shell notes",
        "outputs": {key: (f"shell {key}" if key.startswith("analyst") else "") for key in OUTPUT_KEYS},
    }
    data.update(changes)
    return data


def write_state(m, data: dict) -> None:
    path = Path(m.STATE_FILE)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data), encoding="utf-8")


# -- save_state fields -------------------------------------------------------------

def test_state_file_default_location(orch):
    """Spec 1 Configuration STATE_FILE: a state file under $WD/.tmp/."""
    assert Path(orch.STATE_FILE) == Path(orch.WD) / ".tmp" / "orchestrator-loop-state.json"


def test_a_state_file_under_the_old_name_is_still_the_one_used(load_orch, workdir):
    """A run saved under the shell orchestrator's name (codex-3agents-loop-state.json) is found and resumed;
    once a state file of the new name exists, that one counts."""
    old = workdir / ".tmp" / "codex-3agents-loop-state.json"
    old.parent.mkdir()
    old.write_text("{}")
    assert Path(load_orch().STATE_FILE) == old
    (workdir / ".tmp" / "orchestrator-loop-state.json").write_text("{}")
    assert Path(load_orch().STATE_FILE) == workdir / ".tmp" / "orchestrator-loop-state.json"


def test_save_state_has_shell_script_fields(orch):
    """Spec 1 State file compatibility: version 1 and every field of the shell script's state."""
    populate(orch)
    orch.save_state()
    data = saved(orch)
    assert SHELL_FIELDS <= set(data)
    assert data["version"] == 1
    assert data["api"] == orch.API
    assert data["provider"] == "claude_code"
    assert data["wd"] == orch.WD
    assert data["prompt"] == TASK_PROMPT
    assert data["current_round"] == 3
    assert data["current_phase"] == "tester"
    assert data["final_status"] == "RUNNING"
    assert data["session_name"] == "cao-session-7"
    assert data["feedback"] == "RESULT: FAIL\nEVIDENCE:\n- boom"
    assert data["analyst_feedback"] == "REVIEW_NOTES:\n- analyst notes"
    assert data["programmer_feedback"] == "REVIEW_NOTES:\n- programmer notes"


def test_save_state_terminals_are_five_plain_strings(orch):
    """Spec 1 State file compatibility: 'terminals' maps exactly the five roles to plain id strings."""
    populate(orch)
    orch.save_state()
    terminals = saved(orch)["terminals"]
    assert sorted(terminals) == sorted(ROLES)
    assert terminals == {role: f"tid-{role}" for role in ROLES}
    assert all(type(value) is str for value in terminals.values())


def test_save_state_outputs_have_five_keys(orch):
    """Spec 1 State file compatibility: 'outputs' holds exactly the five output keys."""
    populate(orch)
    orch.save_state()
    outputs = saved(orch)["outputs"]
    assert sorted(outputs) == sorted(OUTPUT_KEYS)
    assert outputs == {key: f"output of {key}" for key in OUTPUT_KEYS}


def test_save_state_field_types(orch):
    """Spec 1 State file compatibility: round is an integer, the text fields are strings."""
    populate(orch)
    orch.save_state()
    data = saved(orch)
    assert type(data["current_round"]) is int
    for key in SHELL_FIELDS - {"version", "current_round", "terminals", "outputs"}:
        assert isinstance(data[key], str), key


def test_save_state_updated_at_is_utc_timestamp(orch):
    """Spec 1 State file compatibility: updated_at is an ISO-8601 UTC timestamp."""
    orch.save_state()
    stamp = saved(orch)["updated_at"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", stamp)
    datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ")


def test_save_state_includes_programmer_context_for_retry(orch):
    """Spec 2 Programmer retry context persisted: saved under the key 'programmer_context_for_retry'."""
    orch.programmer_context_for_retry = "- Files changed: foo.py\n- Behavior implemented: bar"
    orch.save_state()
    assert saved(orch)["programmer_context_for_retry"] == "- Files changed: foo.py\n- Behavior implemented: bar"


def test_save_state_missing_terminal_saved_as_empty_string(orch):
    """Spec 1 State file compatibility: a role without a terminal is saved as '' (still a plain string)."""
    orch.terminal_ids = {"analyst": "t1"}
    orch.save_state()
    assert saved(orch)["terminals"] == {"analyst": "t1", "peer_analyst": "", "programmer": "",
                                        "peer_programmer": "", "tester": ""}


# -- roundtrip ------------------------------------------------------------------------

def test_state_roundtrip(orch):
    """Spec 1 State file compatibility / State roundtrip: all fields match after save, reset, load."""
    populate(orch)
    before = snapshot(orch)
    orch.save_state()
    reset(orch)
    assert snapshot(orch) != before
    assert orch.load_state() is True
    assert snapshot(orch) == before


def test_state_roundtrip_preserves_retry_context(orch):
    """Spec 2 Programmer retry context persisted / State round-trip preserves retry context (exact string)."""
    orch.programmer_context_for_retry = "- Files changed: foo.py\n- Behavior implemented: bar"
    orch.save_state()
    orch.programmer_context_for_retry = ""
    assert orch.load_state() is True
    assert orch.programmer_context_for_retry == "- Files changed: foo.py\n- Behavior implemented: bar"


def test_state_roundtrip_in_new_process_restores_api_wd_provider(load_orch, tmp_path):
    """Spec 1 State roundtrip: a new process without API/WD/PROVIDER set takes them from the state file."""
    first = load_orch()
    populate(first)
    first.save_state()
    before = snapshot(first)
    state_file = first.STATE_FILE
    second = load_orch(API=None, WD=None, STATE_FILE=state_file)
    assert second.API != before["API"]
    assert second.load_state() is True
    assert snapshot(second) == before


def test_load_state_without_state_file_returns_false(orch):
    """Spec 1 Init and resume: load_state() is False when there is no state file."""
    assert not Path(orch.STATE_FILE).exists()
    assert orch.load_state() is False


# -- invalid values --------------------------------------------------------------------

INVALID_ROUNDS = ["abc", "", "2x", -3, "-3", 2.5, True, False, None, [2], 0]
INVALID_PHASES = ["reviewer", "", "ANALYST", "Programmer", 3, None, ["tester"]]


def test_invalid_round_in_state_file_defaults_to_1(orch):
    """Spec 1 State file compatibility / Invalid round in state file defaults to 1 (string, negative, float, bool...)."""
    for value in INVALID_ROUNDS:
        write_state(orch, shell_state(orch, current_round=value))
        orch.current_round = 5
        assert orch.load_state() is True
        assert orch.current_round == 1, f"current_round={value!r}"


def test_valid_round_in_state_file_is_kept(orch):
    """Spec 1 State file compatibility: a valid round (also as the shell's digit string) is kept."""
    for value, expected in [(4, 4), ("4", 4), (" 6 ", 6)]:
        write_state(orch, shell_state(orch, current_round=value))
        assert orch.load_state() is True
        assert orch.current_round == expected, f"current_round={value!r}"


def test_invalid_phase_in_state_file_defaults_to_analyst(orch):
    """Spec 1 State file compatibility / Invalid phase in state file defaults to 'analyst'."""
    for value in INVALID_PHASES:
        write_state(orch, shell_state(orch, current_phase=value))
        orch.current_phase = "tester"
        assert orch.load_state() is True
        assert orch.current_phase == "analyst", f"current_phase={value!r}"


def test_valid_phase_in_state_file_is_kept(orch):
    """Spec 1 State file compatibility: each valid phase name is restored as is."""
    for value in ["analyst", "programmer", "tester", "done"]:
        write_state(orch, shell_state(orch, current_phase=value))
        orch.current_phase = "analyst" if value != "analyst" else "tester"
        assert orch.load_state() is True
        assert orch.current_phase == value


# -- old state files ----------------------------------------------------------------------

def test_loading_old_state_file_without_retry_context_field(orch):
    """Spec 2 Programmer retry context persisted / old state file without the key -> ''."""
    data = shell_state(orch)
    assert "programmer_context_for_retry" not in data
    write_state(orch, data)
    orch.programmer_context_for_retry = "stale context from before"
    assert orch.load_state() is True
    assert orch.programmer_context_for_retry == ""


def test_old_shell_format_state_file_loads(orch):
    """Spec 1 State file compatibility: a state file with only the shell script's fields loads."""
    write_state(orch, shell_state(orch))
    assert orch.load_state() is True
    assert orch.session_name == "cao-shell"
    assert orch.terminal_ids == {role: f"sh-{role}" for role in ROLES}
    assert orch.current_round == 2
    assert orch.current_phase == "programmer"
    assert orch.final_status == "RUNNING"
    assert orch.feedback == "RESULT: FAIL\nEVIDENCE:\n- shell evidence"
    assert orch.programmer_feedback == "REVIEW_NOTES:\n- shell notes"
    assert orch.outputs == {"analyst": "shell analyst", "analyst_review": "shell analyst_review",
                            "programmer": "", "programmer_review": "", "tester": ""}
    assert orch.PROMPT == TASK_PROMPT
    assert "greet NAME" in orch.EXPLORE_SUMMARY
    assert orch.programmer_context_for_retry == ""


# -- the state table ---------------------------------------------------------------

def test_state_file_holds_exactly_the_table_keys(orch):
    """STATE_FIELDS is the state file's format: save_state() writes its keys (shell fields first) and no other."""
    orch.save_state()
    saved = json.loads(Path(orch.STATE_FILE).read_text())
    keys = [f.key for f in orch.STATE_FIELDS]
    assert list(saved) == ["version", "updated_at", *keys]
    assert {f.key for f in orch.STATE_FIELDS if f.shell} | {"version", "updated_at"} == \
        SHELL_FIELDS | {"programmer_context_for_retry"}
    assert [f.shell for f in orch.STATE_FIELDS] == sorted((f.shell for f in orch.STATE_FIELDS), reverse=True)


def test_every_run_field_is_a_declared_global_starting_at_its_default(orch):
    """Each run row of the table has its module global, declared with its type, holding the row's default."""
    for name in orch.RUN_FIELDS:
        assert name in orch.__annotations__, name
        assert getattr(orch, name) == orch.STATE_FIELDS_BY_NAME[name].new(), name


def test_a_new_run_resets_every_run_field(orch):
    """reset_run_state(): a loaded run's values are all gone, settings and task untouched."""
    write_state(orch, {**shell_state(orch), "phase_cycle": 3, "run_dir": "/x", "context_sent": ["explore:t"],
                       "in_flight": {"role": "tester", "round": 2, "phase": "tester", "cycle": 1, "sent_at": 1.0},
                       "after_run": {"due": ["notify"], "notified": "FAIL"}})
    assert orch.load_state()
    orch.reset_run_state()
    for name in orch.RUN_FIELDS:
        assert getattr(orch, name) == orch.STATE_FIELDS_BY_NAME[name].new(), name
    assert orch.PROMPT == TASK_PROMPT


def test_update_run_refuses_a_name_that_is_not_run_state(orch):
    with pytest.raises(AttributeError, match="not a run-state field: MAX_ROUNDS"):
        orch.update_run(MAX_ROUNDS=3)


@pytest.mark.parametrize("key, bad, default", [
    ("current_round", "x", 1), ("phase_cycle", 0, 1), ("phase_step", "later", "author"),
    ("final_status", 7, "RUNNING"), ("context_sent", "explore:t", set()), ("terminals_exited", "yes", False),
    ("in_flight", ["tester"], None), ("story_progress", "1", None), ("turn_records", {"role": "x"}, []),
    ("worktree_at_start", {"a.py": 3}, None),
])
def test_a_malformed_field_reads_as_its_default(orch, key, bad, default):
    """A field of the wrong type (a hand-edited or foreign file) is read as its default, the rest as saved."""
    write_state(orch, {**shell_state(orch), key: bad})
    assert orch.load_state()
    name = next(f.name for f in orch.STATE_FIELDS if f.key == key)
    assert getattr(orch, name) == default
    assert orch.session_name == "cao-shell"


def test_nested_records_are_read_into_their_types(orch):
    """in_flight, story_progress, turn_records and after_run come back as their record types, checked once."""
    write_state(orch, {**shell_state(orch),
                       "in_flight": {"role": "programmer", "round": "2", "phase": "programmer", "cycle": 1,
                                     "story": "3", "attempt": 2, "sent_at": 5, "sent_in_full": ["a", 3]},
                       "story_progress": {"change": "c", "queue": ["3", 4], "current": "3", "results": [
                           {"id": "2", "title": "Two", "status": "COMPLETE", "attempts": 1}, "junk"]},
                       "turn_records": [{"role": "tester", "round": 1, "seconds": 2.5, "prompt_bytes": 10}, 7],
                       "after_run": {"due": ["commit"], "commit": {"result": "committed"}, "notified": 1}})
    assert orch.load_state()
    assert orch.in_flight == orch.InFlight("programmer", 2, "programmer", 1, "3", 2, 5, ("a",))
    assert orch.story_progress == orch.StoryProgress("c", ["3"], "3", 1, "", [orch.StoryResult("2", "Two",
                                                                                               "COMPLETE", 1)])
    assert orch.turn_records == [orch.TurnRecord("tester", 1, 2.5, 10)]
    assert orch.after_run == orch.AfterRun(["commit"], None, {"result": "committed"}, None)


def test_state_doc_names_every_state_key(orch):
    """docs/state-and-resume.md's "The state file" section names each key the state file holds."""
    doc = (Path(__file__).resolve().parent.parent / "docs" / "state-and-resume.md").read_text(encoding="utf-8")
    section = doc[doc.index("\n## The state file\n"):]
    section = section[:section.index("\n## ", 1)]
    missing = [f.key for f in orch.STATE_FIELDS if f"`{f.key}`" not in section]
    assert missing == []


def test_old_shell_format_state_survives_a_save(orch):
    """Spec 1 State file compatibility: loading a shell state and saving it keeps every shell field's value."""
    original = shell_state(orch)
    write_state(orch, original)
    orch.load_state()
    orch.save_state()
    data = saved(orch)
    for key in SHELL_FIELDS - {"updated_at"}:
        assert data[key] == original[key], key


def test_state_file_missing_output_key_loads_as_empty(orch):
    """Spec 1 State file compatibility: an outputs object lacking a key loads with '' for it."""
    write_state(orch, shell_state(orch, outputs={"analyst": "only analyst"}))
    assert orch.load_state() is True
    assert orch.outputs == {"analyst": "only analyst", "analyst_review": "", "programmer": "",
                            "programmer_review": "", "tester": ""}


# -- atomic write ----------------------------------------------------------------------------

def test_save_state_leaves_no_temporary_file(orch):
    """Spec 1 State file compatibility: save_state writes the state file and leaves nothing else behind."""
    populate(orch)
    orch.save_state()
    orch.current_round = 4
    orch.save_state()
    directory = Path(orch.STATE_FILE).parent
    assert sorted(p.name for p in directory.iterdir()) == [Path(orch.STATE_FILE).name]
    assert saved(orch)["current_round"] == 4


def test_failed_save_keeps_old_state_file_intact(orch, monkeypatch):
    """Spec 1 State file compatibility: a write that fails midway (os.replace raises) leaves the old file intact."""
    populate(orch)
    orch.save_state()
    old_text = Path(orch.STATE_FILE).read_text(encoding="utf-8")

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    orch.current_round = 7
    orch.outputs["tester"] = "new tester output that must not land half-written"
    with pytest.raises(OSError):
        orch.save_state()
    monkeypatch.undo()
    assert Path(orch.STATE_FILE).read_text(encoding="utf-8") == old_text
    assert json.loads(old_text)["current_round"] == 3


def test_failed_first_save_creates_no_state_file(orch, monkeypatch):
    """Spec 1 State file compatibility: a failed first write leaves no (partial) state file at STATE_FILE."""
    def broken_replace(src, dst):
        raise OSError(5, "I/O error")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError):
        orch.save_state()
    monkeypatch.undo()
    assert not Path(orch.STATE_FILE).exists()


# -- spec 4 / spec 2: handle_tester_fail -------------------------------------------------------

def fail_setup(m, programmer: str = PROGRAMMER_OUT) -> None:
    m.current_round = 1
    m.current_phase = m.PHASE_TESTER
    m.outputs = {
        "analyst": "analyst summary text",
        "analyst_review": "review text",
        "programmer": programmer,
        "programmer_review": "REVIEW_RESULT: APPROVED\nREVIEW_NOTES:\n- fine",
        "tester": TESTER_FAIL,
    }


def test_fail_sets_phase_to_programmer_for_next_round(orch):
    """Spec 4 Shortened retry pipeline / FAIL sets phase to PROGRAMMER and increments the round."""
    fail_setup(orch)
    orch.handle_tester_fail()
    assert orch.current_phase == orch.PHASE_PROGRAMMER == "programmer"
    assert orch.current_round == 2


def test_fail_clears_programmer_and_tester_outputs(orch):
    """Spec 4 Selective output clearing / FAIL clears programmer, programmer_review and tester outputs."""
    fail_setup(orch)
    orch.handle_tester_fail()
    assert orch.outputs["programmer"] == ""
    assert orch.outputs["programmer_review"] == ""
    assert orch.outputs["tester"] == ""


def test_fail_preserves_analyst_outputs(orch):
    """Spec 4 Selective output clearing / FAIL preserves analyst output."""
    fail_setup(orch)
    orch.handle_tester_fail()
    assert orch.outputs["analyst"] == "analyst summary text"


def test_fail_preserves_analyst_review_output(orch):
    """Spec 4 Selective output clearing / FAIL preserves analyst review output."""
    fail_setup(orch)
    orch.handle_tester_fail()
    assert orch.outputs["analyst_review"] == "review text"


def test_fail_keeps_exactly_the_five_output_keys(orch):
    """Spec 4 Selective output clearing: after FAIL the outputs still hold the five keys, two of them kept."""
    fail_setup(orch)
    orch.handle_tester_fail()
    assert orch.outputs == {"analyst": "analyst summary text", "analyst_review": "review text",
                            "programmer": "", "programmer_review": "", "tester": ""}


def test_fail_sets_feedback_to_test_evidence(orch):
    """Spec 1/3 FAIL feedback: feedback = extract_test_evidence(tester output), taken before it is cleared."""
    fail_setup(orch)
    expected = orch.extract_test_evidence(TESTER_FAIL)
    orch.handle_tester_fail()
    assert orch.feedback == expected
    assert orch.feedback == ("RESULT: FAIL\nEVIDENCE:\n- greet World printed Hello World\n"
                             "- Recommended next fix: greet.py")


def test_fail_sets_programmer_retry_context(orch):
    """Spec 2 FAIL sets programmer retry context = condense_programmer_for_tester(programmer output)."""
    fail_setup(orch)
    expected = orch.condense_programmer_for_tester(PROGRAMMER_OUT)
    orch.handle_tester_fail()
    assert orch.programmer_context_for_retry == expected
    assert orch.programmer_context_for_retry == "- Files changed: greet.py\n- Behavior implemented: greet NAME"


def test_fail_computes_retry_context_before_clearing_outputs(orch):
    """Spec 2 FAIL sets programmer retry context: computed before outputs are cleared (not from '')."""
    fail_setup(orch)
    orch.handle_tester_fail()
    assert orch.outputs["programmer"] == ""
    assert "greet.py" in orch.programmer_context_for_retry


def test_empty_programmer_output_produces_empty_context(orch):
    """Spec 2 Empty programmer output produces empty context."""
    fail_setup(orch, programmer="")
    orch.programmer_context_for_retry = "- Files changed: from an older round"
    orch.handle_tester_fail()
    assert orch.programmer_context_for_retry == ""


def test_upstream_placeholder_programmer_output_gives_empty_context(orch):
    """Spec 4 Shortcut retry with non-analyst START_AGENT: _UPSTREAM_PLACEHOLDER as programmer output -> ''."""
    fail_setup(orch, programmer=orch._UPSTREAM_PLACEHOLDER)
    orch.outputs["analyst"] = orch._UPSTREAM_PLACEHOLDER
    orch.handle_tester_fail()
    assert orch.programmer_context_for_retry == ""
    assert orch.current_phase == orch.PHASE_PROGRAMMER
    assert orch.outputs["analyst"] == orch._UPSTREAM_PLACEHOLDER


def test_multiple_consecutive_fails_stay_on_short_pipeline(orch):
    """Spec 4 Shortened retry pipeline / consecutive FAILs on rounds 2 and 3 start rounds 3 and 4 at PROGRAMMER."""
    fail_setup(orch)
    orch.handle_tester_fail()
    for expected_round in (3, 4):
        orch.current_phase = orch.PHASE_TESTER
        orch.outputs["programmer"] = f"- Files changed: round{expected_round - 1}.py\n"
        orch.outputs["tester"] = TESTER_FAIL
        orch.handle_tester_fail()
        assert orch.current_round == expected_round
        assert orch.current_phase == orch.PHASE_PROGRAMMER
        assert orch.programmer_context_for_retry == f"- Files changed: round{expected_round - 1}.py"
        assert orch.outputs["analyst"] == "analyst summary text"


def test_fail_resets_review_feedback_for_new_round(orch):
    """Spec 3 context: peer review feedback is reset on a new round."""
    fail_setup(orch)
    orch.analyst_feedback = "REVIEW_NOTES:\n- old analyst notes"
    orch.programmer_feedback = "REVIEW_NOTES:\n- old programmer notes"
    orch.handle_tester_fail()
    assert orch.analyst_feedback == ""
    assert orch.programmer_feedback == ""


def test_fail_state_roundtrip_keeps_retry_position(orch):
    """Spec 2/4: after FAIL, the saved state resumes at round 2, programmer phase, with the retry context."""
    fail_setup(orch)
    orch.handle_tester_fail()
    orch.save_state()
    data = saved(orch)
    assert data["current_round"] == 2
    assert data["current_phase"] == "programmer"
    assert data["programmer_context_for_retry"] == "- Files changed: greet.py\n- Behavior implemented: greet NAME"
    assert data["outputs"]["analyst"] == "analyst summary text"
    assert data["outputs"]["programmer"] == ""


def test_tester_phase_fail_goes_through_fail_handler(orch, monkeypatch):
    """Spec 2/4: a RESULT: FAIL reply in the tester phase starts the short retry round with context and evidence."""
    fail_setup(orch)
    orch.outputs["tester"] = ""
    monkeypatch.setattr(orch, "ask_agent", lambda role, prompt: TESTER_FAIL)
    assert orch.run_tester_phase() == "FAIL"
    assert (orch.current_round, orch.current_phase) == (2, orch.PHASE_PROGRAMMER)
    assert orch.programmer_context_for_retry == "- Files changed: greet.py\n- Behavior implemented: greet NAME"
    assert orch.feedback.startswith("RESULT: FAIL\nEVIDENCE:")
    assert saved(orch)["current_phase"] == "programmer"


def test_pass_does_not_set_programmer_retry_context(orch, monkeypatch):
    """Spec 2 PASS does not set programmer retry context: it stays unchanged."""
    fail_setup(orch)
    orch.outputs["tester"] = ""
    orch.programmer_context_for_retry = "- Files changed: earlier.py"
    orch.feedback = "earlier feedback"
    monkeypatch.setattr(orch, "ask_agent", lambda role, prompt: "RESULT: PASS\nEVIDENCE:\n- ok\n")
    assert orch.run_tester_phase() == "PASS"
    assert orch.programmer_context_for_retry == "- Files changed: earlier.py"
    assert orch.feedback == "earlier feedback"
    assert orch.final_status == "PASS"
    assert orch.current_round == 1
    assert orch.outputs["programmer"] == PROGRAMMER_OUT


def test_failed_save_leaves_no_temporary_file(orch, monkeypatch):
    """A save that fails half-way leaves the old state file and nothing else behind."""
    import pytest
    orch.save_state()
    state_dir = Path(orch.STATE_FILE).parent
    before = sorted(p.name for p in state_dir.iterdir())

    def refuse(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr(orch.os, "replace", refuse)
    with pytest.raises(OSError):
        orch.save_state()
    assert sorted(p.name for p in state_dir.iterdir()) == before
