"""Story mode (spec 5): the programmer works one OpenSpec story of tasks.md at a time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import FAST, run_main
from fake_cao import FAIL_REPLY, PASS_REPLY

QUICK = {**FAST, "MIN_REVIEW_CYCLES_BEFORE_APPROVAL": "1"}

TASKS_MD = """# Tasks

## 1. Parse the name
- [ ] 1.1 Read NAME from argv
- [ ] 1.2 Reject an empty NAME

## 2. Print the greeting
- [ ] 2.1 Print `Hello, NAME!`

## 3. Package the CLI
- [ ] 3.1 Add a console entry point
"""

SPEC_MD = """# greeting

## ADDED Requirements

### Requirement: Greeting
The CLI SHALL greet.

#### Scenario: Greets by name
- **GIVEN** the CLI is installed
- **WHEN** `greet World` runs
- **THEN** it prints `Hello, World!`
- **AND** exits 0

#### Scenario: Empty name
- **WHEN** `greet ""` runs
- **THEN** it exits 2
"""


def make_change(wd: Path, name: str = "add-greeting", tasks: str = TASKS_MD) -> Path:
    change = wd / "openspec" / "changes" / name
    (change / "specs" / "greeting").mkdir(parents=True, exist_ok=True)
    (change / "tasks.md").write_text(tasks)
    (change / "proposal.md").write_text("# Proposal\n")
    (change / "design.md").write_text("# Design\n")
    (change / "specs" / "greeting" / "spec.md").write_text(SPEC_MD)
    return change


def story_reply(signal: str) -> str:
    return ("PROGRAMMER_SUMMARY:\n- Files changed: greet.py\n- Behavior implemented: part of the greeting\n"
            f"- Tests run: pytest\n{signal}\n")


COMPLETE = story_reply("<promise>COMPLETE</promise>")


def state_of(module) -> dict:
    return json.loads(Path(module.STATE_FILE).read_text(encoding="utf-8"))


def story_of(prompt: str) -> str:
    """Which story a programmer prompt is about ('1', '2', ...), or '' for a normal prompt."""
    marker = "This turn: story "
    return prompt.split(marker, 1)[1].split(" ", 1)[0] if marker in prompt else ""


# -- reading tasks.md --------------------------------------------------------------

def test_parse_stories_reads_headings_and_checkbox_tasks(orch):
    stories = orch.parse_stories(TASKS_MD.replace("- [ ] 1.1", "- [x] 1.1"))
    assert [(s.id, s.title) for s in stories] == [("1", "Parse the name"), ("2", "Print the greeting"),
                                                  ("3", "Package the CLI")]
    assert stories[0].tasks == [(True, "1.1 Read NAME from argv"), (False, "1.2 Reject an empty NAME")]
    assert not stories[0].finished


def test_parse_stories_copes_with_messy_input(orch):
    messy = ("- [ ] 0.1 a task before any story is ignored\n"
             "##   1.   Spaced   title  \n"
             "    - [X] 1.1 indented, upper-case X\n"
             "* [ ] 1.2 star bullet\n"
             "- [] 1.3 broken checkbox is ignored\n"
             "random prose\n"
             "## 2 Title without a dot\n"
             "## 3. Story without tasks\n"
             "### 3.1 a sub-heading is not a story\n")
    stories = orch.parse_stories(messy)
    assert [(s.id, s.title) for s in stories] == [("1", "Spaced   title"), ("2", "Title without a dot"),
                                                  ("3", "Story without tasks")]
    assert stories[0].tasks == [(True, "1.1 indented, upper-case X"), (False, "1.2 star bullet")]
    assert stories[2].tasks == [] and not stories[2].finished


def test_parse_stories_of_empty_or_unrelated_text(orch):
    assert orch.parse_stories("") == []
    assert orch.parse_stories("# Tasks\nnothing here\n") == []


def test_story_is_finished_when_every_task_is_ticked(orch):
    story = orch.parse_stories("## 1. A\n- [x] 1.1 a\n- [X] 1.2 b\n")[0]
    assert story.finished


# -- reading spec.md -----------------------------------------------------------------

def test_parse_scenarios_with_capability_and_steps(orch, workdir):
    change = make_change(workdir)
    (change / "specs" / "cli").mkdir()
    (change / "specs" / "cli" / "spec.md").write_text(
        "#### Scenario: Help\nGIVEN nothing\n- WHEN `greet --help` runs\nsome prose line\n- THEN usage is shown\n"
        "#### Scenario:\n## Next section\n- **WHEN** outside any scenario\n")
    scenarios = orch.parse_scenarios(change / "specs")
    assert scenarios == [
        ("cli", "Help", ["GIVEN nothing", "- WHEN `greet --help` runs", "- THEN usage is shown"]),
        ("cli", "(unnamed)", []),
        ("greeting", "Greets by name", ["- **GIVEN** the CLI is installed", "- **WHEN** `greet World` runs",
                                        "- **THEN** it prints `Hello, World!`", "- **AND** exits 0"]),
        ("greeting", "Empty name", ["- **WHEN** `greet \"\"` runs", "- **THEN** it exits 2"]),
    ]


def test_parse_scenarios_without_specs(orch, tmp_path):
    assert orch.parse_scenarios(tmp_path / "missing") == []
    (tmp_path / "specs" / "x").mkdir(parents=True)
    (tmp_path / "specs" / "x" / "spec.md").write_bytes(b"\xff\xfe not utf-8 \n")
    assert orch.parse_scenarios(tmp_path / "specs") == []


# -- completion signals --------------------------------------------------------------

@pytest.mark.parametrize("reply, expected", [
    ("done <promise>COMPLETE</promise>", ("COMPLETE", "")),
    ("<promise>FAILED: tests for 2.1 fail on Windows paths</promise>",
     ("FAILED", "tests for 2.1 fail on Windows paths")),
    ("<promise>FAILED: first</promise> then fixed it <promise>COMPLETE</promise>", ("COMPLETE", "")),
    ("<promise>COMPLETE</promise> but then <promise>FAILED: regression in 1.2</promise>",
     ("FAILED", "regression in 1.2")),
    ("<promise>FAILED</promise>", ("FAILED", "(no reason given)")),
    ("<promise> complete </promise>", ("COMPLETE", "")),
    ("no tag at all", ("", "")),
    ("<promise>MAYBE</promise>", ("", "")),
    ("", ("", "")),
])
def test_promise_signal(orch, reply, expected):
    assert orch.promise_signal(reply) == expected


# -- finding the change ----------------------------------------------------------------

def test_find_story_change_takes_the_only_change_and_ignores_archive(orch, workdir):
    change = make_change(workdir)
    (workdir / "openspec" / "changes" / "archive").mkdir()
    assert orch.find_story_change() == change


def test_find_story_change_uses_story_change(load_orch, workdir):
    make_change(workdir)
    other = make_change(workdir, "other-change")
    m = load_orch(STORY_CHANGE="other-change")
    assert m.find_story_change() == other


@pytest.mark.parametrize("names, expected", [((), "found no change directory"),
                                             (("a-change", "b-change"), "found a-change, b-change")])
def test_find_story_change_needs_exactly_one(orch, workdir, names, expected):
    for name in names:
        make_change(workdir, name)
    with pytest.raises(SystemExit) as stopped:
        orch.find_story_change()
    assert expected in str(stopped.value) and "STORY_CHANGE" in str(stopped.value)


def test_find_story_change_with_missing_story_change(load_orch, workdir):
    make_change(workdir)
    m = load_orch(STORY_CHANGE="nope")
    with pytest.raises(SystemExit) as stopped:
        m.find_story_change()
    assert "STORY_CHANGE=nope" in str(stopped.value)


# -- the story prompt (spec 5 scenarios) ------------------------------------------------

@pytest.fixture
def story_prompt(load_orch, workdir):
    def build(attempt=1, reason="", tasks=TASKS_MD, specs=True, **env):
        m = load_orch(**env)
        change = make_change(workdir, tasks=tasks)
        if not specs:
            (change / "specs" / "greeting" / "spec.md").unlink()
        story = m.parse_stories(tasks)[0] if m.parse_stories(tasks) else m.Story("1", "Empty", [])
        return m, m.build_story_prompt(story, change, m.parse_scenarios(change / "specs"), attempt, reason), change
    return build


def test_prompt_contains_story_context(story_prompt):
    """Spec 5 / Prompt contains story context: ID, title, its tasks, only this story."""
    m, prompt, _ = story_prompt()
    assert 'story 1 "Parse the name"' in prompt
    assert "- [ ] 1.1 Read NAME from argv\n- [ ] 1.2 Reject an empty NAME" in prompt
    assert "2.1 Print" not in prompt
    assert "Complete only the tasks of this story" in prompt
    assert "the orchestrator hands you the next story" in prompt


def test_prompt_contains_change_context(story_prompt):
    """Spec 5 / Prompt contains change context: the change directory, proposal.md and design.md."""
    m, prompt, change = story_prompt()
    assert str(change) in prompt
    assert str(change / "proposal.md") in prompt and str(change / "design.md") in prompt


def test_prompt_contains_scenarios(story_prompt):
    """Spec 5 / Prompt contains scenarios: all of them, with the instruction to focus."""
    m, prompt, _ = story_prompt()
    assert "[greeting] Scenario: Greets by name\n  - **GIVEN** the CLI is installed" in prompt
    assert "[greeting] Scenario: Empty name" in prompt
    assert "focus on those relevant to this story's tasks" in prompt


def test_prompt_says_no_scenarios_or_tasks_explicitly(story_prompt):
    m, prompt, _ = story_prompt(tasks="## 1. Empty\n", specs=False)
    assert "(no scenarios defined)" in prompt
    assert "(no tasks defined)" in prompt


def test_prompt_contains_verification_instructions(story_prompt):
    """Spec 5 / Prompt contains verification instructions."""
    m, prompt, _ = story_prompt(PROJECT_TEST_CMD="python -m pytest -q")
    assert "Test command: python -m pytest -q" in prompt
    assert "after completing the tasks, run the verification" in prompt
    m, prompt, _ = story_prompt()
    assert "find and run the project's own test suite" in prompt


def test_prompt_contains_completion_and_failure_signal_instructions(story_prompt):
    """Spec 5 / completion and failure signals: COMPLETE, FAILED with a reason, one is a must."""
    m, prompt, _ = story_prompt()
    assert "verification passes: <promise>COMPLETE</promise>" in prompt
    assert "<promise>FAILED: {reason}</promise>" in prompt
    assert "says briefly what went wrong" in prompt
    assert "retry the story with that context" in prompt
    assert "You MUST end with one of these two signals" in prompt


def test_prompt_contains_tool_usage_instructions(story_prompt):
    """Spec 5 / tool usage: how to mark a task done in tasks.md."""
    m, prompt, _ = story_prompt()
    assert "from `- [ ]` to `- [x]`" in prompt and "tasks.md" in prompt


def test_prompt_has_explore_block_guard_lines_and_response_file(story_prompt):
    m, prompt, _ = story_prompt()
    assert "Explore summary (the task):" in prompt
    assert "Never weaken, skip or delete a test" in prompt
    assert "Write your complete answer to this file: " in prompt and "programmer_summary.md" in prompt


def test_retry_prompt_includes_failure_reason(story_prompt):
    """Spec 5 / Retry context: header, the failure reason, a different approach."""
    m, prompt, _ = story_prompt(attempt=2, reason="pytest fails: argv[1] missing")
    assert "Retry of story 1 -- the previous attempt failed:\npytest fails: argv[1] missing" in prompt
    assert "Try a different approach" in prompt
    assert "attempt 2 of 3" in prompt


def test_no_retry_section_without_failure_reason(story_prompt):
    """Spec 5 / No extra context for abnormal termination."""
    m, prompt, _ = story_prompt(attempt=2, reason="")
    assert "Retry of story" not in prompt and "different approach" not in prompt


# -- the story loop, driven through main() ---------------------------------------------

def run_story_mode(load_orch, fake_cao, prompt_file, workdir, programmer, **env):
    make_change(workdir)
    fake_cao.script["programmer"] = programmer
    m = load_orch(PROMPT_FILE=str(prompt_file), STORY_MODE="1", START_AGENT="programmer", **{**QUICK, **env})
    return m, run_main(m)


def test_three_stories_second_failed_once_then_complete(load_orch, fake_cao, prompt_file, workdir):
    m, code = run_story_mode(load_orch, fake_cao, prompt_file, workdir, [
        COMPLETE, story_reply("<promise>FAILED: greeting misses the comma</promise>"), COMPLETE, COMPLETE])
    assert code == 0
    prompts = fake_cao.prompts_for("programmer")
    assert [story_of(p) for p in prompts] == ["1", "2", "2", "3"]
    assert "Retry of story" not in prompts[1]
    assert "Retry of story 2 -- the previous attempt failed:\ngreeting misses the comma" in prompts[2]
    assert fake_cao.roles_prompted() == ["programmer"] * 4 + ["peer_programmer", "tester"]
    review = fake_cao.prompts_for("peer_programmer")[0]
    assert '- Story 1 "Parse the name": COMPLETE (attempt 1)' in review
    assert '- Story 2 "Print the greeting": COMPLETE (attempt 2)' in review
    assert state_of(m)["story_progress"] is None


def test_reply_without_signal_is_retried_without_retry_section(load_orch, fake_cao, prompt_file, workdir):
    m, code = run_story_mode(load_orch, fake_cao, prompt_file, workdir, [
        story_reply("(forgot the signal)"), COMPLETE, COMPLETE, COMPLETE])
    assert code == 0
    prompts = fake_cao.prompts_for("programmer")
    assert [story_of(p) for p in prompts] == ["1", "1", "2", "3"]
    assert "attempt 2 of 3" in prompts[1] and "Retry of story" not in prompts[1]


def test_timeout_counts_as_abnormal_termination(load_orch, fake_cao, prompt_file, workdir):
    m, code = run_story_mode(load_orch, fake_cao, prompt_file, workdir, [
        {"action": "no_file", "text": "stuck"}, COMPLETE, COMPLETE, COMPLETE], MAX_FILE_REMINDERS="0")
    assert code == 0
    prompts = fake_cao.prompts_for("programmer")
    assert [story_of(p) for p in prompts] == ["1", "1", "2", "3"]
    assert "Retry of story" not in prompts[1]


def test_story_failing_every_attempt_is_named_in_the_review(load_orch, fake_cao, prompt_file, workdir):
    failed = story_reply("<promise>FAILED: cannot import greet</promise>")
    m, code = run_story_mode(load_orch, fake_cao, prompt_file, workdir,
                             [COMPLETE, failed, failed, COMPLETE], MAX_STORY_ATTEMPTS="2")
    assert code == 0
    assert [story_of(p) for p in fake_cao.prompts_for("programmer")] == ["1", "2", "2", "3"]
    review = fake_cao.prompts_for("peer_programmer")[0]
    assert '- Story 2 "Print the greeting": FAILED after 2 attempts -- cannot import greet' in review


def test_story_mode_off_uses_the_normal_programmer_turn(load_orch, fake_cao, prompt_file, workdir):
    make_change(workdir)
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="programmer", **QUICK)
    assert run_main(m) == 0
    assert [story_of(p) for p in fake_cao.prompts_for("programmer")] == [""]


def test_finished_change_uses_the_normal_programmer_turn(load_orch, fake_cao, prompt_file, workdir):
    make_change(workdir, tasks=TASKS_MD.replace("- [ ]", "- [x]"))
    m = load_orch(PROMPT_FILE=str(prompt_file), STORY_MODE="1", START_AGENT="programmer", **QUICK)
    assert run_main(m) == 0
    assert [story_of(p) for p in fake_cao.prompts_for("programmer")] == [""]


def test_story_mode_without_a_change_stops_with_a_clear_error(load_orch, fake_cao, prompt_file, capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), STORY_MODE="1", START_AGENT="programmer", **QUICK)
    assert run_main(m) == 2                # a change to make, not a retry
    err = capsys.readouterr().err
    assert "story mode needs exactly one OpenSpec change" in err and "found no change directory" in err
    assert state_of(m)["final_status"] == "RUNNING"


def test_later_round_runs_stories_again_only_if_unfinished(load_orch, fake_cao, prompt_file, workdir):
    """Round 2 after a FAIL: stories only if tasks.md still has unticked tasks."""
    def tick_all_and_fail(fake, terminal):
        tasks = workdir / "openspec" / "changes" / "add-greeting" / "tasks.md"
        tasks.write_text(TASKS_MD.replace("- [ ]", "- [x]"))
        Path(terminal.response_path).write_text(FAIL_REPLY)
        terminal.status = "completed"
    fake_cao.script["tester"] = [{"action": "call", "call": tick_all_and_fail}, PASS_REPLY]
    m, code = run_story_mode(load_orch, fake_cao, prompt_file, workdir, [COMPLETE])
    assert code == 0
    prompts = fake_cao.prompts_for("programmer")
    assert [story_of(p) for p in prompts] == ["1", "2", "3", ""]
    assert "Test failure feedback:" in prompts[3]


def test_retry_round_story_prompt_carries_test_failure_feedback(load_orch, fake_cao, prompt_file, workdir):
    fake_cao.script["tester"] = [FAIL_REPLY, PASS_REPLY]
    m, code = run_story_mode(load_orch, fake_cao, prompt_file, workdir, [COMPLETE])
    assert code == 0
    prompts = fake_cao.prompts_for("programmer")
    assert [story_of(p) for p in prompts] == ["1", "2", "3", "1", "2", "3"]
    assert "Test failure feedback:\nRESULT: FAIL" in prompts[3]
    assert "Test failure feedback:" not in prompts[0]


def test_resume_continues_at_the_interrupted_story_and_attempt(load_orch, fake_cao, prompt_file, workdir):
    def interrupt(fake, terminal):
        terminal.status = "idle"
        raise KeyboardInterrupt
    failed = story_reply("<promise>FAILED: flaky test</promise>")
    m, code = run_story_mode(load_orch, fake_cao, prompt_file, workdir,
                             [COMPLETE, failed, {"action": "call", "call": interrupt}, COMPLETE, COMPLETE])
    assert code == 130
    progress = state_of(m)["story_progress"]
    assert (progress["current"], progress["attempt"], progress["last_failure"]) == ("2", 2, "flaky test")
    m = load_orch(PROMPT_FILE=str(prompt_file), STORY_MODE="1", **QUICK)
    assert run_main(m) == 0
    prompts = fake_cao.prompts_for("programmer")
    assert [story_of(p) for p in prompts] == ["1", "2", "2", "2", "3"]
    assert "Retry of story 2 -- the previous attempt failed:\nflaky test" in prompts[3]
    review = fake_cao.prompts_for("peer_programmer")[0]
    assert '- Story 1 "Parse the name": COMPLETE (attempt 1)' in review


def test_tasks_md_without_stories_says_so_and_runs_a_normal_turn(load_orch, fake_cao, prompt_file, workdir,
                                                                 capsys):
    make_change(workdir, tasks="# Tasks\n- [ ] 1.1 a task without a story heading\n")
    m = load_orch(PROMPT_FILE=str(prompt_file), STORY_MODE="1", START_AGENT="programmer", **QUICK)
    assert run_main(m) == 0
    assert [story_of(p) for p in fake_cao.prompts_for("programmer")] == [""]
    assert "story mode: no '## N. Title' stories in" in capsys.readouterr().out
