"""State file and the tester FAIL handler.

Spec 1 "State file compatibility with shell script", spec 2 "Programmer retry
context persisted in state" and "Condensed programmer summary carried on FAIL
retry", spec 4 "Shortened retry pipeline on tester FAIL" and "Selective output
clearing on FAIL".
"""

from __future__ import annotations

import ast
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
    m.update_run(session_name="cao-session-7", terminal_ids={role: f"tid-{role}" for role in ROLES})
    m.update_run(current_round=3, current_phase=m.PHASE_TESTER, final_status="RUNNING")
    m.update_run(feedback="RESULT: FAIL\nEVIDENCE:\n- boom", analyst_feedback="REVIEW_NOTES:\n- analyst notes")
    m.update_run(programmer_feedback="REVIEW_NOTES:\n- programmer notes")
    m.update_run(programmer_context_for_retry="- Files changed: foo.py")
    m.update_run(outputs={key: f"output of {key}" for key in OUTPUT_KEYS})


def reset(m) -> None:
    """Put the run globals back to a blank run."""
    m.set_task("")
    m.PROVIDER = "codex"
    m.update_run(session_name="", terminal_ids={role: "" for role in ROLES}, current_round=1)
    m.update_run(current_phase=m.PHASE_ANALYST, final_status="RUNNING")
    m.update_run(feedback="", analyst_feedback="", programmer_feedback="", programmer_context_for_retry="")
    m.update_run(outputs={key: "" for key in OUTPUT_KEYS})


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
    orch.update_run(programmer_context_for_retry="- Files changed: foo.py\n- Behavior implemented: bar")
    orch.save_state()
    assert saved(orch)["programmer_context_for_retry"] == "- Files changed: foo.py\n- Behavior implemented: bar"


def test_save_state_missing_terminal_saved_as_empty_string(orch):
    """Spec 1 State file compatibility: a role without a terminal is saved as '' (still a plain string)."""
    orch.update_run(terminal_ids={"analyst": "t1"})
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
    orch.update_run(programmer_context_for_retry="- Files changed: foo.py\n- Behavior implemented: bar")
    orch.save_state()
    orch.update_run(programmer_context_for_retry="")
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
        orch.update_run(current_round=5)
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
        orch.update_run(current_phase="tester")
        assert orch.load_state() is True
        assert orch.current_phase == "analyst", f"current_phase={value!r}"


def test_valid_phase_in_state_file_is_kept(orch):
    """Spec 1 State file compatibility: each valid phase name is restored as is."""
    for value in ["analyst", "programmer", "tester", "done"]:
        write_state(orch, shell_state(orch, current_phase=value))
        orch.update_run(current_phase="analyst" if value != "analyst" else "tester")
        assert orch.load_state() is True
        assert orch.current_phase == value


# -- old state files ----------------------------------------------------------------------

def test_loading_old_state_file_without_retry_context_field(orch):
    """Spec 2 Programmer retry context persisted / old state file without the key -> ''."""
    data = shell_state(orch)
    assert "programmer_context_for_retry" not in data
    write_state(orch, data)
    orch.update_run(programmer_context_for_retry="stale context from before")
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


# -- run state changes through its doors -------------------------------------------
# update_run() and the doors its docstring lists are the only functions that change run state: they assign
# a run-state global, or change its value in place. The check reads the module's source, so a change made
# anywhere else fails it. It follows a local name that holds run state or a part of it (`progress =
# story_progress`, `for record in turn_records`), not one passed on to another function.

MUTATING_METHODS = frozenset({
    "append", "extend", "insert", "add", "update", "setdefault", "pop", "popitem", "clear", "remove", "discard",
    "sort", "reverse", "difference_update", "intersection_update", "symmetric_difference_update",
    "__setitem__", "__delitem__", "__setattr__", "__delattr__"})
FUNCTION_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _own_nodes(scope: ast.AST):
    """The nodes of a function's body, not those of the functions (or classes) defined in it."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (*FUNCTION_SCOPES, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(node))


def _bound_names(scope: ast.AST) -> tuple[set[str], set[str]]:
    """The names a function binds itself (so not the module's globals), and those it declares global."""
    args = scope.args
    bound = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg) if a}
    declared: set[str] = set()
    for node in _own_nodes(scope):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.Global):
            declared.update(node.names)
    return bound - declared, declared


def _roots(node: ast.AST) -> set[str]:
    """The names an expression's value may be part of: `turn_records` for `turn_records[-1].outcome`."""
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, (ast.Attribute, ast.Subscript, ast.Starred, ast.NamedExpr)):
        return _roots(node.value)
    if isinstance(node, ast.IfExp):
        return _roots(node.body) | _roots(node.orelse)
    if isinstance(node, ast.BoolOp):
        return set().union(*map(_roots, node.values))
    return set()


def _aliases(scope: ast.AST, state: set[str]) -> set[str]:
    """Local names that hold run state or a part of it."""
    aliases: set[str] = set()
    for node in _own_nodes(scope):
        if isinstance(node, ast.Assign) and _roots(node.value) & state:
            targets = [t for t in node.targets if isinstance(t, (ast.Name, ast.Tuple))]
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)) and _roots(node.iter) & state:
            targets = [node.target]
        else:
            continue
        aliases |= {name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name)}
    return aliases


def _changes(scope: ast.AST, state: set[str], declared: set[str]) -> list[tuple[int, str]]:
    """What a function's own code does to run state: `state` names it (or a local part of it), `declared` the
    run-state globals the function declares global."""
    found = []
    for node in _own_nodes(scope):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load) and node.id in declared:
            found.append((node.lineno, f"assigns the global {node.id}"))
        elif isinstance(node, (ast.Attribute, ast.Subscript)) and not isinstance(node.ctx, ast.Load) \
                and _roots(node) & state:
            verb = "deletes" if isinstance(node.ctx, ast.Del) else "assigns"
            found.append((node.lineno, f"{verb} {ast.unparse(node)}"))
        elif isinstance(node, ast.Call) and (
                isinstance(node.func, ast.Attribute) and node.func.attr in MUTATING_METHODS
                and _roots(node.func.value) & state
                or isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") and node.args
                and _roots(node.args[0]) & state):
            found.append((node.lineno, f"calls {ast.unparse(node.func)}()"))
    return found


def run_state_changes(source: str, run_fields: set[str]) -> dict[str, list[str]]:
    """Function (top-level, or Class.method) -> each change to run state its code makes, with its line; a
    function or lambda defined inside another counts as its owner's."""
    found: dict[str, list[str]] = {}

    def visit(node: ast.AST, owner: str, prefix: str, outer_bound: set[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, FUNCTION_SCOPES):
                name = owner or prefix + getattr(child, "name", "<lambda>")
                bound, declared = _bound_names(child)
                state = (run_fields - bound - outer_bound) | (declared & run_fields)
                state |= _aliases(child, state)
                found.setdefault(name, []).extend(
                    f"line {line}: {what}" for line, what in sorted(_changes(child, state, declared & run_fields)))
                visit(child, name, "", outer_bound | bound)
            elif isinstance(child, ast.ClassDef):
                visit(child, owner, f"{prefix}{child.name}.", outer_bound)
            else:
                visit(child, owner, prefix, outer_bound)
    visit(ast.parse(source), "", "", set())
    return {name: changes for name, changes in found.items() if changes}


def run_state_doors(m) -> set[str]:
    """update_run() and the doors its docstring lists ("The doors: set_output(), ...")."""
    listed = re.search(r"The doors: (.*?)\.\s", m.update_run.__doc__, re.DOTALL)
    assert listed, "update_run's docstring lists the doors after 'The doors:'"
    return {"update_run", *re.findall(r"(\w+)\(\)", listed.group(1))}


def test_run_state_changes_only_through_its_doors(orch):
    """No function but update_run() and its doors assigns a run-state global (RUN_FIELDS) or changes one in
    place: item or attribute assignment, `del`, a mutating method, setattr."""
    doors = run_state_doors(orch)
    assert all(callable(getattr(orch, door, None)) for door in doors), doors
    changes = run_state_changes(Path(orch.__file__).read_text(encoding="utf-8"), set(orch.RUN_FIELDS))
    elsewhere = {name: found for name, found in changes.items() if name not in doors}
    assert not elsewhere, f"run state changed outside update_run() and its doors: {elsewhere}"
    assert set(changes) == doors - {"update_run"}, "each door listed changes run state (update_run by globals())"


@pytest.mark.parametrize("code, changed", [
    ('def f():\n    outputs["x"] = 1\n', True),
    ("def f():\n    turn_records[-1].outcome = 'PASS'\n", True),
    ("def f():\n    del fresh_agents_due['tester']\n", True),
    ("def f():\n    context_sent.add('explore:t')\n", True),
    ("def f():\n    setattr(after_run, 'due', [])\n", True),
    ("def f():\n    global feedback\n    feedback = ''\n", True),
    ("def f():\n    progress = story_progress\n    progress.results.append(1)\n", True),
    ("def f():\n    for record in turn_records:\n        record.outcome = None\n", True),
    ("def f():\n    return lambda: verifications.append({})\n", True),
    ("class C:\n    def f(self):\n        replacements.clear()\n", True),
    ("def f():\n    feedback = ''\n    return feedback\n", False),
    ("def f(outputs):\n    outputs['x'] = 1\n", False),
    ("def f():\n    outputs = dict(OLD)\n    outputs['x'] = 1\n", False),
    ("def f():\n    return [key for key in outputs if outputs[key]]\n", False),
    ("def f():\n    update_run(outputs={**outputs, 'x': ''})\n", False),
])
def test_the_door_check_sees_each_kind_of_change(code, changed):
    """The check above on small pieces of code: what changes run state, and what only looks like it."""
    assert bool(run_state_changes(code, {"outputs", "turn_records", "fresh_agents_due", "context_sent",
                                         "after_run", "feedback", "story_progress", "verifications",
                                         "replacements"})) == changed


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


def test_records_leave_out_what_they_do_not_hold(orch):
    """A record writes its optional keys only when they hold something: the prompt in flight its story, usage
    limit, reply and terminal; an answered turn its outcome, and its CLI's running totals until its tokens stand."""
    base = {"role": "tester", "round": 1, "phase": "tester", "cycle": 1, "sent_at": None, "sent_in_full": [],
            "number": None, "first_sent_at": None, "prompt_bytes": 0, "reminders": 0, "resends": 0}
    assert orch.InFlight("tester", 1, "tester", 1, limit_until=5.0).to_json() == base
    totals = {"s": {"m": orch.TokenUse(1, 2, 3)}}
    full = orch.InFlight("tester", 1, "tester", 1, "3", None, limit_line="limit", reply_file="r.md",
                         tokens_before=totals, terminal="t1")
    assert full.to_json() == {**base, "story": "3", "attempt": None, "limit_line": "limit", "limit_until": None,
                              "reply_file": "r.md", "tokens_before": orch.tokens_before_json(totals), "terminal": "t1"}
    assert orch.InFlight.from_json(json.loads(json.dumps(full.to_json()))) == full
    turn = orch.TurnRecord("tester", 1, 2.0, 10, tokens_before=totals)
    assert "outcome" not in turn.to_json() and "tokens_before" in turn.to_json()
    turn.outcome, turn.tokens_final = "PASS", True
    assert turn.to_json()["outcome"] == "PASS" and "tokens_before" not in turn.to_json()
    assert orch.Replacement.from_json({"event": "x"}) == orch.Replacement("", "", "", "", "", 1)


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
    orch.update_run(current_round=4)
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
    orch.update_run(current_round=7)
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
    m.update_run(current_round=1, current_phase=m.PHASE_TESTER)
    m.update_run(outputs={
        "analyst": "analyst summary text",
        "analyst_review": "review text",
        "programmer": programmer,
        "programmer_review": "REVIEW_RESULT: APPROVED\nREVIEW_NOTES:\n- fine",
        "tester": TESTER_FAIL,
    })


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
    orch.update_run(programmer_context_for_retry="- Files changed: from an older round")
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
        orch.update_run(current_phase=orch.PHASE_TESTER)
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
    orch.update_run(analyst_feedback="REVIEW_NOTES:\n- old analyst notes")
    orch.update_run(programmer_feedback="REVIEW_NOTES:\n- old programmer notes")
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
    orch.update_run(programmer_context_for_retry="- Files changed: earlier.py", feedback="earlier feedback")
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
