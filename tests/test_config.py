"""Configuration: environment variables, the optional JSON config file, validation.

Spec 1 "Configuration via environment variables" (names and defaults of the
shell script), spec 3 decision 3 (MAX_TEST_EVIDENCE_LINES and the JSON key
condensation.max_test_evidence_lines), and the configuration contract in docs/settings.md:
precedence env > JSON > default, and every bad value refused with one line on
stderr and exit 2 before anything is written or contacted.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import run_orchestrator_loop
from conftest import FAST, ROOT, TASK_PROMPT, run_main

STATE_NAME = "orchestrator-loop-state.json"

# Every provider CAO 2.5.4 knows, plus the older q_cli.
CAO_PROVIDERS = [
    "kiro_cli", "claude_code", "codex", "kimi_cli", "copilot_cli", "opencode_cli", "hermes",
    "cursor_cli", "antigravity_cli", "omp", "grok_cli", "mcode", "mock_cli", "q_cli",
]

# The variables spec 1 names, with the shell script's names.
SPEC1_VARIABLES = [
    "API", "PROVIDER", "WD", "PROMPT", "PROMPT_FILE", "MAX_ROUNDS", "POLL_SECONDS", "MAX_REVIEW_CYCLES",
    "PROJECT_TEST_CMD", "MIN_REVIEW_CYCLES_BEFORE_APPROVAL", "REQUIRE_REVIEW_EVIDENCE",
    "REVIEW_EVIDENCE_MIN_MATCH", "RESUME", "CONDENSE_EXPLORE_ON_REPEAT", "CONDENSE_REVIEW_FEEDBACK",
    "MAX_FEEDBACK_LINES", "CONDENSE_UPSTREAM_ON_REPEAT", "STATE_FILE", "CLEANUP_ON_EXIT",
    "RESPONSE_TIMEOUT", "STRICT_FILE_HANDOFF", "CONDENSE_CROSS_PHASE", "MAX_CROSS_PHASE_LINES",
    "MAX_TEST_EVIDENCE_LINES", "START_AGENT",
]


def _env_for(key: str) -> str:
    """The environment variable of the setting with this dotted JSON key."""
    return next(s.env for s in run_orchestrator_loop.SETTINGS if s.key == key)


TESTER_PROVIDER_ENV = _env_for("agents.tester.provider")


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------

def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every file (with its bytes) and directory under root."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def write_config(tmp_path: Path, data: object, name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def assert_rejected(m, capsys, fake_cao, root: Path, *args: str, names: tuple[str, ...]) -> str:
    """main() refuses: exit 2, one stderr line naming `names`, no traceback, no request, nothing written."""
    before = snapshot(root)
    capsys.readouterr()
    code = run_main(m, *args)
    out, err = capsys.readouterr()
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got: {err!r}"
    for name in names:
        assert name in lines[0], f"{name!r} not named in: {lines[0]!r}"
    assert "Traceback" not in out + err
    assert fake_cao.requests == []
    assert snapshot(root) == before, "something was written although the configuration was refused"
    return lines[0]


def check_each(cases, check) -> None:
    """Run check(case) for every (name, case); fail once, listing every case that failed."""
    failures = []
    for name, case in cases:
        try:
            check(case)
        except AssertionError as exc:
            failures.append(f"[{name}] {exc}")
    assert not failures, "\n".join(failures)


def flatten_keys(node: dict, prefix: str = "") -> set[str]:
    """Dotted keys of the leaves of a nested JSON object."""
    keys = set()
    for name, value in node.items():
        key = f"{prefix}.{name}" if prefix else name
        if isinstance(value, dict):
            keys |= flatten_keys(value, key)
        else:
            keys.add(key)
    return keys


# --------------------------------------------------------------------------
# defaults and the environment
# --------------------------------------------------------------------------

def test_default_configuration_matches_shell_script(load_orch, workdir):
    """Spec 1 'Default configuration matches shell script' (plus spec 3's MAX_TEST_EVIDENCE_LINES)."""
    m = load_orch()
    assert m.MAX_ROUNDS == 8
    assert m.MAX_REVIEW_CYCLES == 3
    assert m.POLL_SECONDS == 2
    assert m.MIN_REVIEW_CYCLES_BEFORE_APPROVAL == 2
    assert m.REVIEW_EVIDENCE_MIN_MATCH == 3
    assert m.RESPONSE_TIMEOUT == 1800
    assert m.STRICT_FILE_HANDOFF == 1
    assert m.CONDENSE_CROSS_PHASE == 1
    assert m.MAX_CROSS_PHASE_LINES == 40
    assert m.MAX_FEEDBACK_LINES == 30
    assert m.MAX_TEST_EVIDENCE_LINES == 120
    assert m.START_AGENT == "analyst"


def test_default_state_file_is_under_wd_tmp(load_orch, workdir):
    """STATE_FILE defaults to $WD/.tmp/orchestrator-loop-state.json."""
    m = load_orch()
    assert Path(m.STATE_FILE) == workdir / ".tmp" / STATE_NAME


def test_default_api_is_local_cao_server(load_orch):
    """Spec 1: API defaults to the local CAO server at http://localhost:9889."""
    m = load_orch(API=None)
    assert m.API.rstrip("/") == "http://localhost:9889"


def test_every_spec_variable_is_a_setting_and_module_global(load_orch):
    """Spec 1/3 and README 'Names the specs fix': each variable is a setting and a module global of that name."""
    m = load_orch()
    settings = {s.env for s in m.SETTINGS}
    assert [name for name in SPEC1_VARIABLES if name not in settings] == []
    assert [name for name in SPEC1_VARIABLES if not hasattr(m, name)] == []


ENV_VALUES = {
    # name: (raw value in the environment, expected global)
    "MAX_ROUNDS": ("5", 5),
    "MAX_REVIEW_CYCLES": ("4", 4),
    "MIN_REVIEW_CYCLES_BEFORE_APPROVAL": ("1", 1),
    "REVIEW_EVIDENCE_MIN_MATCH": ("2", 2),
    "POLL_SECONDS": ("0.5", 0.5),
    "RESPONSE_TIMEOUT": ("60", 60),
    "STRICT_FILE_HANDOFF": ("0", False),
    "CONDENSE_CROSS_PHASE": ("0", False),
    "CONDENSE_EXPLORE_ON_REPEAT": ("0", False),
    "CONDENSE_REVIEW_FEEDBACK": ("0", False),
    "CONDENSE_UPSTREAM_ON_REPEAT": ("0", False),
    "REQUIRE_REVIEW_EVIDENCE": ("0", False),
    "RESUME": ("1", True),
    "CLEANUP_ON_EXIT": ("1", True),
    "MAX_CROSS_PHASE_LINES": ("12", 12),
    "MAX_FEEDBACK_LINES": ("9", 9),
    "MAX_TEST_EVIDENCE_LINES": ("77", 77),
    "START_AGENT": ("programmer", "programmer"),
    "PROVIDER": ("claude_code", "claude_code"),
    "PROJECT_TEST_CMD": ("make test", "make test"),
    "PROMPT": ("some task", "some task"),
    "PROMPT_FILE": ("task.md", "task.md"),
    "API": ("http://example.test:1234", "http://example.test:1234"),
}


def test_environment_is_read_at_import(load_orch):
    """Spec README: importing the module leaves each global holding its value from the environment."""
    m = load_orch(**{name: raw for name, (raw, _) in ENV_VALUES.items()})
    got = {name: getattr(m, name) for name in ENV_VALUES}
    assert got == {name: expected for name, (_, expected) in ENV_VALUES.items()}
    for name, (_, expected) in ENV_VALUES.items():
        if isinstance(expected, bool):
            assert bool(got[name]) is expected, name


def test_state_file_from_environment_is_used(load_orch, tmp_path):
    """Spec 1: STATE_FILE from the environment replaces the default location."""
    custom = tmp_path / "states" / "run.json"
    m = load_orch(STATE_FILE=str(custom))
    assert Path(m.STATE_FILE) == custom


def test_empty_environment_variable_counts_as_unset(load_orch, prompt_file, fake_cao, workdir):
    """Configuration: an empty variable is unset -- defaults apply and main() runs without complaint."""
    m = load_orch(MAX_ROUNDS="", PROVIDER="", START_AGENT="", STRICT_FILE_HANDOFF="", STATE_FILE="",
                  MAX_TEST_EVIDENCE_LINES="", PROMPT_FILE=str(prompt_file), **FAST)
    assert (m.MAX_ROUNDS, m.PROVIDER, m.START_AGENT, m.MAX_TEST_EVIDENCE_LINES) == (8, "codex", "analyst", 120)
    assert bool(m.STRICT_FILE_HANDOFF) is True
    assert Path(m.STATE_FILE) == workdir / ".tmp" / STATE_NAME
    assert run_main(m) == 0
    assert (workdir / ".tmp" / STATE_NAME).is_file()
    assert {t.provider for t in fake_cao.terminals.values()} == {"codex"}


def test_bad_environment_value_does_not_break_import(load_orch):
    """Spec README: a bad environment value must not make the import fail; the globals keep defaults."""
    m = load_orch(MAX_ROUNDS="eight", POLL_SECONDS="fast", STRICT_FILE_HANDOFF="yes", PROVIDER="gpt",
                  START_AGENT="boss", MAX_TEST_EVIDENCE_LINES="0")
    assert m.MAX_ROUNDS == 8
    assert m.POLL_SECONDS == 2
    assert bool(m.STRICT_FILE_HANDOFF) is True
    assert m.PROVIDER == "codex"
    assert m.START_AGENT == "analyst"
    assert m.MAX_TEST_EVIDENCE_LINES == 120


def test_bad_environment_value_at_import_is_reported_by_main(load_orch, prompt_file, fake_cao, capsys, tmp_path):
    """Spec README: main() reports the bad environment value the import tolerated, with exit 2."""
    m = load_orch(MAX_ROUNDS="eight", PROMPT_FILE=str(prompt_file))
    assert_rejected(m, capsys, fake_cao, tmp_path, names=("MAX_ROUNDS",))


def test_several_bad_environment_values_give_one_line(load_orch, prompt_file, fake_cao, capsys, tmp_path):
    """Configuration: a refused configuration is one line on stderr, naming a culprit, even with several bad values."""
    m = load_orch(MAX_ROUNDS="eight", POLL_SECONDS="fast", PROMPT_FILE=str(prompt_file))
    line = assert_rejected(m, capsys, fake_cao, tmp_path, names=())
    assert "MAX_ROUNDS" in line or "POLL_SECONDS" in line


# --------------------------------------------------------------------------
# bad environment values
# --------------------------------------------------------------------------

BAD_ENV = [
    # non-numeric and non-positive numbers
    ("MAX_ROUNDS", "abc"), ("MAX_ROUNDS", "0"), ("MAX_ROUNDS", "-3"), ("MAX_ROUNDS", "2.5"),
    ("MAX_REVIEW_CYCLES", "0"), ("MIN_REVIEW_CYCLES_BEFORE_APPROVAL", "many"), ("REVIEW_EVIDENCE_MIN_MATCH", "0"),
    ("POLL_SECONDS", "fast"), ("POLL_SECONDS", "0"), ("POLL_SECONDS", "-1"), ("RESPONSE_TIMEOUT", "soon"),
    ("MAX_FEEDBACK_LINES", "0"), ("MAX_TEST_EVIDENCE_LINES", "lots"), ("MAX_CROSS_PHASE_LINES", "-40"),
    # booleans other than 1/0
    ("STRICT_FILE_HANDOFF", "yes"), ("STRICT_FILE_HANDOFF", "true"), ("CONDENSE_CROSS_PHASE", "2"),
    ("REQUIRE_REVIEW_EVIDENCE", "TRUE"), ("RESUME", "true"), ("CLEANUP_ON_EXIT", "no"),
    # unknown roles and providers
    ("START_AGENT", "boss"), ("PROVIDER", "gpt4"), (TESTER_PROVIDER_ENV, "nope"),
]


@pytest.mark.parametrize("name, raw", BAD_ENV, ids=[f"{n}={v}" for n, v in BAD_ENV])
def test_bad_environment_value_exits_2_naming_the_variable(load_orch, prompt_file, fake_cao, capsys, tmp_path,
                                                           name, raw):
    """Configuration: a bad env value is one stderr line naming the variable, exit 2, no request, no state file."""
    m = load_orch(PROMPT_FILE=str(prompt_file), **{name: raw})
    assert_rejected(m, capsys, fake_cao, tmp_path, names=(name,))
    assert not (tmp_path / "project" / ".tmp" / STATE_NAME).exists()


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_wd_not_a_directory_exits_2(load_orch, prompt_file, fake_cao, capsys, tmp_path, kind):
    """Configuration: WD that is not a directory is refused naming WD, exit 2, nothing written or contacted."""
    wd = tmp_path / "no-such-project"
    if kind == "file":
        wd.write_text("not a directory\n", encoding="utf-8")
    m = load_orch(WD=str(wd), PROMPT_FILE=str(prompt_file))
    assert_rejected(m, capsys, fake_cao, tmp_path, names=("WD",))


# --------------------------------------------------------------------------
# the task prompt
# --------------------------------------------------------------------------

BAD_PROMPTS = {
    "no_explore_header": "Intro\n*** SCENARIO TEST ***\nRun greet World.\n",
    "no_scenario_header": "*** ORIGINAL EXPLORE SUMMARY ***\nBuild a greeting CLI.\n",
    "no_headers": "Build a greeting CLI and test it.\n",
    "empty_explore_section": "*** ORIGINAL EXPLORE SUMMARY ***\n   \n*** SCENARIO TEST ***\nRun greet World.\n",
    "empty_scenario_section": "*** ORIGINAL EXPLORE SUMMARY ***\nBuild a greeting CLI.\n*** SCENARIO TEST ***\n\n  \n",
}


def test_malformed_prompt_file_exits_2(load_orch, fake_cao, capsys, tmp_path):
    """Configuration: a prompt file lacking a header line or with an empty section is refused naming PROMPT_FILE."""
    path = tmp_path / "task.md"
    m = load_orch(PROMPT_FILE=str(path))

    def check(text: str) -> None:
        path.write_text(text, encoding="utf-8")
        assert_rejected(m, capsys, fake_cao, tmp_path, names=("PROMPT_FILE",))

    check_each(sorted(BAD_PROMPTS.items()), check)


@pytest.mark.parametrize("case", ["no_headers", "empty_scenario_section"])
def test_malformed_prompt_text_exits_2(load_orch, fake_cao, capsys, tmp_path, case):
    """Configuration: a PROMPT lacking a header line or with an empty section is refused naming PROMPT."""
    m = load_orch(PROMPT=BAD_PROMPTS[case])
    assert_rejected(m, capsys, fake_cao, tmp_path, names=("PROMPT",))


def test_missing_prompt_file_exits_2(load_orch, fake_cao, capsys, tmp_path):
    """Configuration: a prompt file that does not exist is refused naming PROMPT_FILE."""
    m = load_orch(PROMPT_FILE=str(tmp_path / "absent.md"))
    assert_rejected(m, capsys, fake_cao, tmp_path, names=("PROMPT_FILE",))


def test_prompt_file_not_utf8_exits_2(load_orch, fake_cao, capsys, tmp_path):
    """Configuration: a prompt file that is not UTF-8 is refused naming PROMPT_FILE, without a traceback."""
    path = tmp_path / "task.md"
    path.write_bytes(TASK_PROMPT.replace("greeting", "caf\u00e9 greeting").encode("latin-1") + b"\xff\xfe\n")
    m = load_orch(PROMPT_FILE=str(path))
    line = assert_rejected(m, capsys, fake_cao, tmp_path, names=("PROMPT_FILE",))
    assert "UTF-8" in line or "utf-8" in line


@pytest.mark.parametrize("flaw, said", [
    ("absent", "does not exist"), ("folder", "is a directory, expected {what}"), ("latin-1", "is not UTF-8 text{fix}")])
@pytest.mark.parametrize("which", ["config", "prompt"])
def test_a_file_the_user_names_that_cannot_be_read_is_refused_saying_why(load_orch, prompt_file, fake_cao, capsys,
                                                                         tmp_path, flaw, said, which):
    """Configuration: the config file and PROMPT_FILE are read alike; each flaw is one line in the file's words."""
    path = tmp_path / ("my-config.json" if which == "config" else "my-task.md")
    if flaw == "folder":
        path.mkdir()
    elif flaw == "latin-1":
        path.write_bytes(b"caf\xe9\n")
    if which == "config":
        m = load_orch(PROMPT_FILE=str(prompt_file))
        code, named, what, fix = run_main(m, str(path)), f"config file {path}", "a JSON file", ""
    else:
        m = load_orch(PROMPT_FILE=str(path))
        code, named, what, fix = run_main(m), f"PROMPT_FILE={path}", "a text file", ": save it as UTF-8"
    assert code == 2
    assert capsys.readouterr().err.strip() == f"error: {named} " + said.format(what=what, fix=fix)


def test_no_task_at_all_exits_2(load_orch, fake_cao, capsys, tmp_path):
    """Configuration: neither PROMPT nor PROMPT_FILE (and nothing to resume) is refused naming how to give a task."""
    m = load_orch()
    assert_rejected(m, capsys, fake_cao, tmp_path, names=("PROMPT",))


def test_prompt_from_config_file_is_the_task(load_orch, fake_cao, tmp_path, workdir):
    """Configuration: JSON 'prompt' carries the task text when no prompt file is given."""
    cfg = write_config(tmp_path, {"prompt": TASK_PROMPT, "start_agent": "tester"})
    m = load_orch(**FAST)
    assert run_main(m, str(cfg)) == 0
    assert "greet NAME" in m.EXPLORE_SUMMARY
    assert "Hello, World!" in m.SCENARIO_TEST


# --------------------------------------------------------------------------
# arguments and the config file itself
# --------------------------------------------------------------------------

def test_more_than_one_argument_exits_2(load_orch, prompt_file, fake_cao, capsys, tmp_path):
    """Configuration: more than one command-line argument is refused with exit 2 and one line."""
    first = write_config(tmp_path, {}, "a.json")
    second = write_config(tmp_path, {}, "b.json")
    m = load_orch(PROMPT_FILE=str(prompt_file))
    line = assert_rejected(m, capsys, fake_cao, tmp_path, str(first), str(second), names=())
    assert "argument" in line


def test_missing_config_file_exits_2(load_orch, prompt_file, fake_cao, capsys, tmp_path):
    """Configuration: a config file that does not exist is refused naming the file."""
    path = tmp_path / "absent.json"
    m = load_orch(PROMPT_FILE=str(prompt_file))
    assert_rejected(m, capsys, fake_cao, tmp_path, str(path), names=(str(path),))


def test_config_file_not_json_exits_2(load_orch, prompt_file, fake_cao, capsys, tmp_path):
    """Configuration: a config file that is not JSON is refused naming the file."""
    path = tmp_path / "config.json"
    m = load_orch(PROMPT_FILE=str(prompt_file))

    def check(text: str) -> None:
        path.write_text(text, encoding="utf-8")
        assert_rejected(m, capsys, fake_cao, tmp_path, str(path), names=(str(path),))

    texts = ['{"limits": {"max_rounds": 8}', "max_rounds = 8\n", "", "{'api': 'x'}", '{"api": "x",}']
    check_each([(t, t) for t in texts], check)


def test_config_file_not_an_object_exits_2(load_orch, prompt_file, fake_cao, capsys, tmp_path):
    """Configuration: a config file whose top level is not a JSON object is refused naming the file."""
    m = load_orch(PROMPT_FILE=str(prompt_file))

    def check(data: object) -> None:
        path = write_config(tmp_path, data)
        assert_rejected(m, capsys, fake_cao, tmp_path, str(path), names=(str(path),))

    check_each([(json.dumps(d), d) for d in ([1, 2], "text", 8, None, True)], check)


BAD_JSON = [
    # unknown keys at any depth
    ({"max_round": 8}, "max_round"),
    ({"limits": {"max_round": 8}}, "max_round"),
    ({"handoff": {"poll_second": 2}}, "poll_second"),
    ({"condensation": {"max_evidence_lines": 50}}, "max_evidence_lines"),
    ({"agents": {"boss": {"provider": "codex"}}}, "boss"),
    ({"agents": {"tester": {"temperature": 0.2}}}, "temperature"),
    ({"limits": {"max_rounds": 8, "extra": {"deep": 1}}}, "extra"),
    # sections of the wrong type
    ({"limits": 8}, "limits"),
    ({"agents": {"tester": "codex"}}, "tester"),
    # wrong JSON types
    ({"limits": {"max_rounds": "8"}}, "max_rounds"),
    ({"limits": {"max_review_cycles": 2.5}}, "max_review_cycles"),
    ({"limits": {"max_rounds": True}}, "max_rounds"),
    ({"handoff": {"poll_seconds": "2"}}, "poll_seconds"),
    ({"condensation": {"max_test_evidence_lines": "120"}}, "max_test_evidence_lines"),
    ({"handoff": {"strict_file_handoff": 1}}, "strict_file_handoff"),
    ({"handoff": {"strict_file_handoff": "true"}}, "strict_file_handoff"),
    ({"condensation": {"condense_cross_phase": 0}}, "condense_cross_phase"),
    ({"limits": {"require_review_evidence": "yes"}}, "require_review_evidence"),
    ({"resume": 1}, "resume"),
    ({"cleanup_on_exit": "false"}, "cleanup_on_exit"),
    ({"api": 9889}, "api"),
    ({"project_test_cmd": ["pytest"]}, "project_test_cmd"),
    # non-positive numbers
    ({"limits": {"max_rounds": 0}}, "max_rounds"),
    ({"limits": {"min_review_cycles_before_approval": -1}}, "min_review_cycles_before_approval"),
    ({"limits": {"review_evidence_min_match": 0}}, "review_evidence_min_match"),
    ({"handoff": {"poll_seconds": 0}}, "poll_seconds"),
    ({"handoff": {"response_timeout": -10}}, "response_timeout"),
    ({"condensation": {"max_feedback_lines": 0}}, "max_feedback_lines"),
    ({"condensation": {"max_test_evidence_lines": 0}}, "max_test_evidence_lines"),
    ({"condensation": {"max_cross_phase_lines": -1}}, "max_cross_phase_lines"),
    # unknown roles and providers
    ({"start_agent": "boss"}, "start_agent"),
    ({"provider": "gpt4"}, "provider"),
    ({"provider": ["claude_code"]}, "provider"),       # not text: refused, not a crash
    ({"provider": {"name": "codex"}}, "provider"),
    ({"agents": {"tester": {"provider": "gpt4"}}}, "provider"),
]


def test_bad_config_file_value_exits_2_naming_the_key(load_orch, prompt_file, fake_cao, capsys, tmp_path):
    """Configuration: unknown keys, wrong types, bad numbers, roles and providers in JSON: one line naming the key, exit 2."""
    m = load_orch(PROMPT_FILE=str(prompt_file))

    def check(case: tuple[dict, str]) -> None:
        data, key = case
        path = write_config(tmp_path, data)
        assert_rejected(m, capsys, fake_cao, tmp_path, str(path), names=(key,))

    check_each([(json.dumps(case[0]), case) for case in BAD_JSON], check)


def test_config_file_wd_not_a_directory_exits_2(load_orch, prompt_file, fake_cao, capsys, tmp_path):
    """Configuration: JSON 'wd' that is not a directory is refused naming it, nothing written or contacted."""
    wd = tmp_path / "no-such-project"
    path = write_config(tmp_path, {"wd": str(wd)})
    m = load_orch(WD=None, PROMPT_FILE=str(prompt_file))
    assert_rejected(m, capsys, fake_cao, tmp_path, str(path), names=(str(wd),))


def test_config_file_prompt_file_missing_exits_2(load_orch, fake_cao, capsys, tmp_path):
    """Configuration: JSON 'prompt_file' naming a missing file is refused, naming that file."""
    missing = tmp_path / "nowhere.md"
    path = write_config(tmp_path, {"prompt_file": str(missing)})
    m = load_orch()
    assert_rejected(m, capsys, fake_cao, tmp_path, str(path), names=(str(missing),))


# --------------------------------------------------------------------------
# a refused configuration leaves an existing state file alone
# --------------------------------------------------------------------------

RUNNING_STATE = {
    "version": 1, "updated_at": "2025-01-01T00:00:00Z", "api": "http://cao.test", "provider": "codex",
    "wd": "", "prompt": TASK_PROMPT, "current_round": 2, "current_phase": "programmer",
    "final_status": "RUNNING", "session_name": "cao-old",
    "terminals": {"analyst": "aaaaaaa1", "peer_analyst": "aaaaaaa2", "programmer": "aaaaaaa3",
                  "peer_programmer": "aaaaaaa4", "tester": "aaaaaaa5"},
    "feedback": "RESULT: FAIL", "analyst_feedback": "", "programmer_feedback": "",
    "outputs": {"analyst": "ANALYST_SUMMARY: x", "analyst_review": "", "programmer": "",
                "programmer_review": "", "tester": ""},
}

STATE_CONTENTS = {
    "running": (json.dumps(RUNNING_STATE, indent=2) + "\n").encode(),
    "passed": (json.dumps({**RUNNING_STATE, "final_status": "PASS"}) + "\n").encode(),
    "corrupt": b'{"version": 1, "final_status": "RUNN',
}

BAD_INPUTS = ["env", "config", "config_key", "prompt", "args", "no_task", "wd"]


@pytest.mark.parametrize("bad", BAD_INPUTS)
def test_bad_value_leaves_existing_state_file_unchanged(load_orch, prompt_file, fake_cao, capsys, tmp_path,
                                                        workdir, bad):
    """Configuration: a refused configuration does not touch an existing state file (bytes unchanged, not moved)."""
    state_path = workdir / ".tmp" / STATE_NAME
    state_path.parent.mkdir()
    env = {"PROMPT_FILE": str(prompt_file)}
    args: tuple[str, ...] = ()
    if bad == "env":
        env["MAX_ROUNDS"] = "zero"
    elif bad == "config":
        path = tmp_path / "config.json"
        path.write_text("{not json", encoding="utf-8")
        args = (str(path),)
    elif bad == "config_key":
        args = (str(write_config(tmp_path, {"limits": {"max_rounds": "8"}})),)
    elif bad == "prompt":
        broken = tmp_path / "broken.md"
        broken.write_text("*** ORIGINAL EXPLORE SUMMARY ***\nBuild it.\n", encoding="utf-8")
        env["PROMPT_FILE"] = str(broken)
    elif bad == "args":
        args = ("one.json", "two.json")
    elif bad == "no_task":
        env["PROMPT_FILE"] = None
        env["RESUME"] = "0"        # a new run is asked for, so the saved task cannot stand in
    elif bad == "wd":
        env["STATE_FILE"] = str(state_path)
        env["WD"] = str(tmp_path / "no-such-project")
    m = load_orch(**env)

    def check(content: bytes) -> None:
        state_path.write_bytes(content)
        assert_rejected(m, capsys, fake_cao, tmp_path, *args, names=())
        assert state_path.read_bytes() == content
        assert sorted(p.name for p in state_path.parent.iterdir()) == [STATE_NAME]

    check_each(sorted(STATE_CONTENTS.items()), check)


# --------------------------------------------------------------------------
# precedence and the JSON mapping
# --------------------------------------------------------------------------

def test_precedence_env_over_json_over_default(load_orch, prompt_file, fake_cao, tmp_path):
    """Configuration: env beats JSON, JSON beats the default, and an empty env variable leaves the JSON value."""
    cfg = write_config(tmp_path, {
        "provider": "claude_code",
        "start_agent": "tester",
        "limits": {"max_rounds": 5, "max_review_cycles": 4},
        "condensation": {"max_feedback_lines": 11, "max_test_evidence_lines": 77},
        "agents": {"programmer": {"provider": "kiro_cli"}, "analyst": {"profile": "lead_analyst"}},
    })
    m = load_orch(PROMPT_FILE=str(prompt_file), PROVIDER="mock_cli", MAX_ROUNDS="6", MAX_FEEDBACK_LINES="",
                  **FAST)
    assert run_main(m, str(cfg)) == 0
    assert m.MAX_ROUNDS == 6                  # env over JSON
    assert m.PROVIDER == "mock_cli"           # env over JSON
    assert m.MAX_REVIEW_CYCLES == 4           # JSON over default
    assert m.MAX_FEEDBACK_LINES == 11         # empty env: JSON
    assert m.MAX_TEST_EVIDENCE_LINES == 77    # JSON over default
    assert m.MAX_CROSS_PHASE_LINES == 40      # neither: default
    assert m.START_AGENT == "tester"
    by_role = {t.role: t for t in fake_cao.terminals.values()}
    assert by_role["programmer"].provider == "kiro_cli"
    assert by_role["tester"].provider == "mock_cli"
    assert by_role["peer_analyst"].provider == "mock_cli"
    assert "lead_analyst" in {t.profile for t in fake_cao.terminals.values()}


def test_config_file_keys_map_to_settings(load_orch, prompt_file, fake_cao, tmp_path):
    """Configuration: nested JSON keys (top level, limits.*, handoff.*, condensation.*, agents.*) set their variables."""
    other_wd = tmp_path / "elsewhere"
    other_wd.mkdir()
    state = tmp_path / "states" / "mine.json"
    cfg = write_config(tmp_path, {
        "api": "http://cao.test",
        "provider": "mock_cli",
        "wd": str(other_wd),
        "prompt_file": str(prompt_file),
        "project_test_cmd": "make check",
        "state_file": str(state),
        "resume": False,
        "cleanup_on_exit": True,
        "start_agent": "tester",
        "limits": {"max_rounds": 3, "max_review_cycles": 4, "min_review_cycles_before_approval": 1,
                   "require_review_evidence": False, "review_evidence_min_match": 2},
        "handoff": {"poll_seconds": 0.01, "response_timeout": 5, "strict_file_handoff": False},
        "condensation": {"condense_explore_on_repeat": False, "condense_review_feedback": False,
                         "max_feedback_lines": 12, "max_test_evidence_lines": 34,
                         "condense_upstream_on_repeat": False, "condense_cross_phase": False,
                         "max_cross_phase_lines": 56},
        "agents": {"tester": {"provider": "codex", "profile": "tester"}},
    })
    m = load_orch(API=None, WD=None, IDLE_GRACE_SECONDS="0.05")
    assert run_main(m, str(cfg)) == 0
    assert m.API.rstrip("/") == "http://cao.test"
    assert m.PROVIDER == "mock_cli"
    assert Path(m.WD) == other_wd
    assert m.PROJECT_TEST_CMD == "make check"
    assert Path(m.STATE_FILE) == state and state.is_file()
    assert bool(m.RESUME) is False and bool(m.CLEANUP_ON_EXIT) is True
    assert (m.MAX_ROUNDS, m.MAX_REVIEW_CYCLES, m.MIN_REVIEW_CYCLES_BEFORE_APPROVAL,
            m.REVIEW_EVIDENCE_MIN_MATCH) == (3, 4, 1, 2)
    assert bool(m.REQUIRE_REVIEW_EVIDENCE) is False
    assert (m.POLL_SECONDS, m.RESPONSE_TIMEOUT) == (0.01, 5)
    assert bool(m.STRICT_FILE_HANDOFF) is False
    assert not any(bool(v) for v in (m.CONDENSE_EXPLORE_ON_REPEAT, m.CONDENSE_REVIEW_FEEDBACK,
                                      m.CONDENSE_UPSTREAM_ON_REPEAT, m.CONDENSE_CROSS_PHASE))
    assert (m.MAX_FEEDBACK_LINES, m.MAX_TEST_EVIDENCE_LINES, m.MAX_CROSS_PHASE_LINES) == (12, 34, 56)
    by_role = {t.role: t for t in fake_cao.terminals.values()}
    assert by_role["tester"].provider == "codex" and by_role["analyst"].provider == "mock_cli"
    assert {t.working_directory for t in fake_cao.terminals.values()} == {str(other_wd)}
    assert "make check" in fake_cao.prompts_for("tester")[0]
    assert len(fake_cao.exited_ids()) == 5          # cleanup_on_exit: true


def test_config_file_wd_moves_default_state_file(load_orch, prompt_file, fake_cao, tmp_path):
    """Spec 1 default STATE_FILE follows a WD given in the config file: $WD/.tmp/orchestrator-loop-state.json."""
    other_wd = tmp_path / "elsewhere"
    other_wd.mkdir()
    cfg = write_config(tmp_path, {"wd": str(other_wd), "start_agent": "tester"})
    m = load_orch(WD=None, PROMPT_FILE=str(prompt_file), **FAST)
    assert run_main(m, str(cfg)) == 0
    assert Path(m.STATE_FILE) == other_wd / ".tmp" / STATE_NAME
    assert json.loads((other_wd / ".tmp" / STATE_NAME).read_text(encoding="utf-8"))["final_status"] == "PASS"


def test_max_test_evidence_lines_from_config_caps_test_evidence(load_orch, prompt_file, fake_cao, tmp_path):
    """Spec 3: condensation.max_test_evidence_lines sets MAX_TEST_EVIDENCE_LINES; review notes keep their cap."""
    cfg = write_config(tmp_path, {"start_agent": "tester", "condensation": {"max_test_evidence_lines": 5}})
    m = load_orch(PROMPT_FILE=str(prompt_file), **FAST)
    assert run_main(m, str(cfg)) == 0
    assert m.MAX_TEST_EVIDENCE_LINES == 5
    assert m.MAX_FEEDBACK_LINES == 30
    long_evidence = "RESULT: FAIL\nEVIDENCE:\n" + "\n".join(f"- line {i}" for i in range(50))
    assert len(m.extract_test_evidence(long_evidence).splitlines()) == 5
    long_notes = "REVIEW_NOTES:\n" + "\n".join(f"- note {i}" for i in range(50))
    assert len(m.extract_review_notes(long_notes).splitlines()) == 30


ROLE_PROVIDER_ENVS = [_env_for(f"agents.{role}.provider") for role in
                      ("analyst", "peer_analyst", "programmer", "peer_programmer")]
# PROVIDER (used by the tester) plus four per-role providers: five providers per run.
PROVIDER_GROUPS = [CAO_PROVIDERS[i:i + 5] for i in range(0, len(CAO_PROVIDERS), 5)]


@pytest.mark.parametrize("group", PROVIDER_GROUPS, ids=["+".join(g) for g in PROVIDER_GROUPS])
def test_every_cao_provider_is_accepted_from_environment(load_orch, prompt_file, fake_cao, group):
    """Configuration: every CAO 2.5.4 provider is valid in the environment and reaches CAO in the create calls."""
    names = ["PROVIDER"] + ROLE_PROVIDER_ENVS
    env = dict(zip(names, group))
    m = load_orch(START_AGENT="tester", PROMPT_FILE=str(prompt_file), **env, **FAST)
    assert m.PROVIDER == group[0]
    assert run_main(m) == 0
    used = {t.role: t.provider for t in fake_cao.terminals.values()}
    assert used["tester"] == group[0]
    assert set(group) == set(used.values())


def test_every_cao_provider_is_accepted_in_config_file(load_orch, tmp_path):
    """Configuration: every CAO 2.5.4 provider is valid as JSON 'provider' and 'agents.<role>.provider'."""
    m = load_orch()

    def check(provider: str) -> None:
        cfg = write_config(tmp_path, {"provider": provider,
                                      "agents": {role: {"provider": provider} for role in m.ROLES}})
        try:
            m.read_config_file(str(cfg))
        except SystemExit as exc:
            raise AssertionError(f"refused: {exc}") from None

    check_each([(p, p) for p in CAO_PROVIDERS], check)


# --------------------------------------------------------------------------
# the starter configs
# --------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["config-fresh.json", "config-incremental.json"])
def test_starter_config_is_accepted(load_orch, name):
    """Configuration: each starter config file is a valid config file."""
    m = load_orch()
    path = ROOT / name
    assert path.is_file(), f"{name} is missing"
    m.read_config_file(str(path))       # raises ConfigError if refused


@pytest.mark.parametrize("name", ["config-fresh.json", "config-incremental.json"])
def test_starter_config_lists_every_setting(load_orch, name):
    """Configuration: each starter config file carries every key in SETTINGS, so it documents them all."""
    m = load_orch()
    path = ROOT / name
    assert path.is_file(), f"{name} is missing"
    keys = flatten_keys(json.loads(path.read_text(encoding="utf-8")))
    missing = sorted(s.key for s in m.SETTINGS if s.key not in keys)
    assert missing == []


def test_deleted_current_directory_is_reported_not_a_traceback(load_orch, fake_cao, monkeypatch, capsys):
    """Started from a directory deleted underneath it: the import survives and WD is reported."""
    def gone():
        raise FileNotFoundError(2, "No such file or directory")
    monkeypatch.setenv("PWD", "/nonexistent/deleted-project")
    monkeypatch.setattr(os, "getcwd", gone)
    m = load_orch(WD=None, PROMPT_FILE=None)
    monkeypatch.undo()
    assert m.WD == "/nonexistent/deleted-project"
    assert run_main(m) == 2
    assert capsys.readouterr().err.strip() == (
        "error: WD=/nonexistent/deleted-project does not exist: set WD (or 'wd' in the config file) "
        "to the project directory")


@pytest.mark.parametrize("variable, value, suggestion", [
    ("PROVIDER", "claude", "claude_code"),
    ("PROVIDER", "Claude_Code", "claude_code"),
    ("PROVIDER", "opencode", "opencode_cli"),
    ("PROVIDER", "kiro-cli", "kiro_cli"),
    ("START_AGENT", "Tester", "tester"),
])
def test_a_value_close_to_an_allowed_one_gets_a_did_you_mean(load_orch, prompt_file, fake_cao, capsys,
                                                              variable, value, suggestion):
    m = load_orch(PROMPT_FILE=str(prompt_file), **{variable: value})
    assert run_main(m) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {variable}={value!r} is not valid (did you mean {suggestion}?): expected one of")
    assert "\n" not in err


def test_a_json_value_close_to_an_allowed_one_gets_a_did_you_mean(load_orch, prompt_file, fake_cao, capsys,
                                                                   tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"provider": "claude"}))
    m = load_orch(PROMPT_FILE=str(prompt_file))
    assert run_main(m, str(config)) == 2
    assert "key 'provider' is \"claude\" (did you mean claude_code?); expected one of" in capsys.readouterr().err


@pytest.mark.parametrize("section, key, value, expected", [
    ("limits", "max_rounds", "3", "a whole number of at least 1 (not a string)"),
    ("handoff", "poll_seconds", "2", "a number greater than 0 (not a string)"),
    ("handoff", "progress_seconds", -1, "a number of at least 0 (not a string)"),
    ("tokens", "max_run_cost", "5", "a number of at least 0 (not a string)"),
    ("on_pass", "commit", "1", "true or false"),
])
def test_a_json_value_of_the_wrong_type_is_told_in_the_files_words(load_orch, prompt_file, fake_cao, capsys,
                                                                   tmp_path, section, key, value, expected):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({section: {key: value}}))
    m = load_orch(PROMPT_FILE=str(prompt_file))
    assert run_main(m, str(config)) == 2
    assert f"key '{section}.{key}' is {json.dumps(value)}; expected {expected}" in capsys.readouterr().err


def test_a_setting_key_at_the_wrong_level_is_told_where_it_belongs(load_orch, prompt_file, fake_cao, capsys,
                                                                    tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"max_rounds": 2}))
    m = load_orch(PROMPT_FILE=str(prompt_file))
    assert run_main(m, str(config)) == 2
    err = capsys.readouterr().err
    assert "unknown key 'max_rounds' ('max_rounds' belongs inside 'limits': {\"limits\": {\"max_rounds\": ...}}." in err
    assert "environment variable" not in err
    config.write_text(json.dumps({"limits": {"provider": "codex"}}))
    assert run_main(m, str(config)) == 2
    assert "('provider' belongs at the top level." in capsys.readouterr().err
    config.write_text(json.dumps({"MAX_ROUNDS": 2}))
    assert run_main(m, str(config)) == 2
    assert "'MAX_ROUNDS' is the environment variable; in a config file it is 'limits.max_rounds'" in \
        capsys.readouterr().err


def test_the_public_names_are_the_specs_names_main_and_one_per_setting():
    """`__all__` names what users and the specs' tests address: each exists, every setting's global is in it,
    and nothing the script keeps to itself (the wait's rules, the report's parts) is."""
    public = set(run_orchestrator_loop.__all__)
    assert all(hasattr(run_orchestrator_loop, name) for name in public)
    assert {"main", "ApiClient", "api", "save_state", "load_state", "extract_test_evidence"} <= public
    assert set(SPEC1_VARIABLES) <= public
    assert {setting.env for setting in run_orchestrator_loop.SETTINGS} <= public
    assert not public & {"decide", "TurnFacts", "wait_for_reply", "write_report", "CLI_TRAITS"}
