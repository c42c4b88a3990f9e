"""Prompt builders for the five agents.

Spec 1 "Prompt builders for all five agents", spec 2 "Analyst prompt includes
programmer context on retry rounds" / "Other agent prompts never include
programmer retry context", and spec 4 "Programmer retry prompt with test
failure context".
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

EXPLORE = "EXPLORE-MARKER: build a greeting CLI `greet NAME`."
SCENARIO = "SCENARIO-MARKER: run `greet World`, expect `Hello, World!`."
ANALYST_OUT = ("Narration before the summary.\nANALYST_SUMMARY:\n- Change: openspec/changes/analyst-marker-change\n"
               "- Handoff: implement greet.py\n")
PROGRAMMER_OUT = ("PROGRAMMER_SUMMARY:\n- Files changed: handoff_marker.py\n"
                  "- Behavior implemented: greet prints the greeting\n"
                  "- Tests run: pytest -q\n- Known gaps: gap-marker\n")
RETRY_CONTEXT = "- Files changed: retry_context_marker.py"
BACK_REFERENCE = "(Same as initial turn -- refer to your conversation history.)"

RESPONSE_FILES = {
    "analyst": "analyst_summary.md",
    "peer_analyst": "analyst_review.md",
    "programmer": "programmer_summary.md",
    "peer_programmer": "programmer_review.md",
    "tester": "test_result.md",
}

BUILDERS = {
    "analyst": lambda m: m.build_analyst_prompt(1, 1),
    "peer_analyst": lambda m: m.build_analyst_review_prompt(ANALYST_OUT),
    "programmer": lambda m: m.build_programmer_prompt(1, 1, ANALYST_OUT),
    "peer_programmer": lambda m: m.build_programmer_review_prompt(PROGRAMMER_OUT),
    "tester": lambda m: m.build_tester_prompt(PROGRAMMER_OUT),
}


@pytest.fixture
def m(orch):
    """The module with a task and five terminals, as after init_new_run()."""
    orch.EXPLORE_SUMMARY = EXPLORE
    orch.SCENARIO_TEST = SCENARIO
    orch.update_run(terminal_ids={role: f"term-{role}" for role in orch.ROLES})
    return orch


# -- spec 1: analyst prompt structure ------------------------------------------

def test_analyst_prompt_structure(m):
    """Spec 1 Prompt builders / Analyst prompt structure: explore summary, round/cycle, feedback, guards, task, file."""
    m.update_run(feedback="RESULT: FAIL\nEVIDENCE:\n- tester-feedback-marker")
    m.update_run(analyst_feedback="REVIEW_NOTES:\n- peer-analyst-feedback-marker")
    prompt = m.build_analyst_prompt(3, 2)
    assert EXPLORE in prompt
    assert re.search(r"\bround 3\b", prompt)
    assert re.search(r"\bcycle 2\b", prompt)
    assert "Latest tester feedback:\nRESULT: FAIL\nEVIDENCE:\n- tester-feedback-marker" in prompt
    assert "Latest peer analyst feedback:\nREVIEW_NOTES:\n- peer-analyst-feedback-marker" in prompt
    assert str(m.response_path("analyst")) in prompt


def test_analyst_prompt_round_and_cycle_numbers_follow_arguments(m):
    """Spec 1 Prompt builders / Analyst prompt structure: the round and cycle numbers are the ones passed in."""
    prompt = m.build_analyst_prompt(5, 3)
    assert re.search(r"\bround 5\b", prompt) and re.search(r"\bcycle 3\b", prompt)
    assert not re.search(r"\bround 1\b", prompt)


def test_analyst_prompt_guard_lines(m):
    """Spec 1 Prompt builders / Analyst prompt structure: guard lines (no code, stay in WD, no questions)."""
    prompt = m.build_analyst_prompt(1, 1)
    assert "Do not write or change application code" in prompt
    assert f"Work only inside {m.WD}" in prompt
    assert "Do not ask questions" in prompt


def test_analyst_prompt_five_mandatory_summary_sections(m):
    """Spec 1 Prompt builders / Analyst prompt structure: task with 5 mandatory ANALYST_SUMMARY sections."""
    prompt = m.build_analyst_prompt(1, 1)
    assert "all five sections are mandatory" in prompt
    summary = prompt[prompt.index("ANALYST_SUMMARY:"):]
    positions = [summary.index(f"- {name}:") for name in
                 ("Change", "Artifacts", "P1 requirements", "Contracts", "Handoff")]
    assert positions == sorted(positions)


def test_analyst_prompt_asks_for_openspec_change(m):
    """Spec 1 Prompt builders / Analyst prompt structure: the task is to explore and write the OpenSpec change."""
    prompt = m.build_analyst_prompt(1, 1)
    assert "/opsx:explore" in prompt and "/opsx:ff" in prompt


def test_analyst_prompt_without_feedback_says_none(m):
    """Spec 1 Prompt builders / Analyst prompt structure: empty feedback is shown as '(none)'."""
    prompt = m.build_analyst_prompt(1, 1)
    assert "Latest tester feedback:\n(none)" in prompt
    assert "Latest peer analyst feedback:\n(none)" in prompt


def delivered(m, prompt):
    """A prompt as ask_agent() handles it once it reached its terminal: what it carried in full is recorded."""
    m.record_sent(prompt.carries_in_full)
    return prompt


def test_analyst_prompt_explore_summary_full_then_back_reference(m):
    """Spec 1 Explore summary condensation in prompts: the analyst's second prompt refers back to the first."""
    first = delivered(m, m.build_analyst_prompt(1, 1))
    second = m.build_analyst_prompt(1, 2)
    assert EXPLORE in first
    assert EXPLORE not in second
    assert BACK_REFERENCE in second


def test_each_terminal_gets_the_full_explore_summary_once(m):
    """Spec 1 Explore summary condensation: each of the five agents gets the summary in full on its first prompt."""
    for role, build in BUILDERS.items():
        assert EXPLORE in delivered(m, build(m)), role
    for role, build in BUILDERS.items():
        prompt = build(m)
        assert EXPLORE not in prompt, role
        assert BACK_REFERENCE in prompt, role


def test_explore_summary_every_time_when_condense_explore_off(m):
    """Spec 1 Explore summary condensation: with CONDENSE_EXPLORE_ON_REPEAT off every prompt has the full summary."""
    m.CONDENSE_EXPLORE_ON_REPEAT = False
    delivered(m, m.build_analyst_prompt(1, 1))
    prompt = m.build_analyst_prompt(1, 2)
    assert EXPLORE in prompt
    assert BACK_REFERENCE not in prompt


# -- spec 2: programmer context block in the analyst prompt ---------------------

def test_round_2_analyst_prompt_includes_programmer_context(m):
    """Spec 2 Analyst prompt includes programmer context / Round 2 includes the labelled block."""
    m.update_run(programmer_context_for_retry="- Files changed: foo.py")
    prompt = m.build_analyst_prompt(2, 1)
    assert "Previous round programmer changes (context only):\n- Files changed: foo.py" in prompt


def test_programmer_context_block_between_tester_and_peer_feedback(m):
    """Spec 2 Analyst prompt includes programmer context: after 'Latest tester feedback:', before peer analyst feedback."""
    m.update_run(programmer_context_for_retry="- Files changed: foo.py", feedback="RESULT: FAIL\nEVIDENCE:\n- boom")
    prompt = m.build_analyst_prompt(2, 1)
    tester = prompt.index("Latest tester feedback:")
    block = prompt.index("Previous round programmer changes (context only):")
    peer = prompt.index("Latest peer analyst feedback:")
    assert tester < block < peer
    assert prompt.index("- boom") < block


def test_round_1_analyst_prompt_excludes_programmer_context(m):
    """Spec 2 Analyst prompt includes programmer context / Round 1 excludes it even when set."""
    m.update_run(programmer_context_for_retry="- Files changed: foo.py")
    prompt = m.build_analyst_prompt(1, 1)
    assert "Previous round programmer changes" not in prompt
    assert "foo.py" not in prompt


def test_round_2_with_empty_programmer_context_excludes_block(m):
    """Spec 2 Analyst prompt includes programmer context / Round 2 with empty context has no block."""
    m.update_run(programmer_context_for_retry="")
    assert "Previous round programmer changes" not in m.build_analyst_prompt(2, 1)


# -- spec 2: other prompts never include programmer retry context ---------------

@pytest.mark.parametrize("round_num", [1, 2])
def test_programmer_prompt_has_no_retry_context_block(m, round_num):
    """Spec 2 Other agent prompts never include programmer retry context / Programmer prompt."""
    m.update_run(programmer_context_for_retry=RETRY_CONTEXT)
    prompt = m.build_programmer_prompt(round_num, 1, ANALYST_OUT)
    assert "Previous round programmer changes" not in prompt


def test_tester_prompt_has_no_retry_context(m):
    """Spec 2 Other agent prompts never include programmer retry context / Tester prompt."""
    m.update_run(programmer_context_for_retry=RETRY_CONTEXT, current_round=2)
    prompt = m.build_tester_prompt(PROGRAMMER_OUT)
    assert "Previous round programmer changes" not in prompt
    assert "retry_context_marker" not in prompt


def test_programmer_review_prompt_has_no_retry_context(m):
    """Spec 2 Other agent prompts never include programmer retry context: build_programmer_review_prompt."""
    m.update_run(programmer_context_for_retry=RETRY_CONTEXT, current_round=2)
    prompt = m.build_programmer_review_prompt(PROGRAMMER_OUT)
    assert "Previous round programmer changes" not in prompt
    assert "retry_context_marker" not in prompt


def test_analyst_review_prompt_has_no_retry_context(m):
    """Spec 2 Other agent prompts never include programmer retry context: build_analyst_review_prompt."""
    m.update_run(programmer_context_for_retry=RETRY_CONTEXT, current_round=2)
    prompt = m.build_analyst_review_prompt(ANALYST_OUT)
    assert "Previous round programmer changes" not in prompt
    assert "retry_context_marker" not in prompt


# -- spec 4: retry programmer prompt ----------------------------------------------

def test_retry_programmer_prompt_includes_test_failure_feedback(m):
    """Spec 4 Programmer retry prompt / includes 'Test failure feedback:' followed by the feedback."""
    m.update_run(feedback="RESULT: FAIL\nEVIDENCE:\n- test_foo failed")
    prompt = m.build_programmer_prompt(2, 1, ANALYST_OUT)
    assert "Test failure feedback:\nRESULT: FAIL\nEVIDENCE:\n- test_foo failed" in prompt


def test_retry_programmer_prompt_excludes_analyst_output(m):
    """Spec 4 Programmer retry prompt / excludes 'System analyst handoff:'."""
    m.update_run(feedback="RESULT: FAIL\nEVIDENCE:\n- test_foo failed")
    assert "System analyst handoff:" not in m.build_programmer_prompt(2, 1, ANALYST_OUT)


def test_retry_programmer_prompt_does_not_contain_analyst_output_text(m):
    """Spec 4 Programmer retry prompt: SHALL NOT include outputs['analyst'] (nor its condensed summary)."""
    m.update_run(feedback="RESULT: FAIL\nEVIDENCE:\n- test_foo failed")
    m.outputs["analyst"] = ANALYST_OUT
    prompt = m.build_programmer_prompt(2, 1, m.outputs["analyst"])
    assert "analyst-marker-change" not in prompt
    assert "ANALYST_SUMMARY" not in prompt
    assert "Narration before the summary" not in prompt


def test_retry_programmer_prompt_includes_previous_changes_context(m):
    """Spec 4 Programmer retry prompt / 'Your previous changes (context):' followed by the context."""
    m.update_run(feedback="RESULT: FAIL", programmer_context_for_retry="- Files changed: foo.py")
    prompt = m.build_programmer_prompt(2, 1, ANALYST_OUT)
    assert "Your previous changes (context):\n- Files changed: foo.py" in prompt


def test_retry_programmer_prompt_with_empty_previous_changes_omits_block(m):
    """Spec 4 Programmer retry prompt / empty programmer_context_for_retry -> no 'Your previous changes' block."""
    m.update_run(feedback="RESULT: FAIL", programmer_context_for_retry="")
    assert "Your previous changes (context):" not in m.build_programmer_prompt(2, 1, ANALYST_OUT)


def test_retry_programmer_prompt_instructs_artifact_update_capability(m):
    """Spec 4 Programmer retry prompt / instructs to investigate (/opsx:explore) and update artifacts (/opsx:ff)."""
    m.update_run(feedback="RESULT: FAIL")
    prompt = m.build_programmer_prompt(2, 1, ANALYST_OUT)
    assert "/opsx:explore" in prompt
    assert "/opsx:ff" in prompt
    assert re.search(r"investigate the failure", prompt)
    assert re.search(r"may update the OpenSpec artifacts", prompt)
    assert re.search(r"spec or design", prompt)


def test_round_1_programmer_prompt_unchanged(m):
    """Spec 4 Programmer retry prompt / Round 1: 'System analyst handoff:' present, 'Test failure feedback:' absent."""
    m.update_run(feedback="RESULT: FAIL\nEVIDENCE:\n- stale feedback", programmer_context_for_retry=RETRY_CONTEXT)
    prompt = m.build_programmer_prompt(1, 1, ANALYST_OUT)
    assert "System analyst handoff:" in prompt
    assert "Test failure feedback:" not in prompt
    assert "Your previous changes (context):" not in prompt
    assert "/opsx:apply" in prompt


def test_round_1_programmer_prompt_carries_condensed_analyst_handoff(m):
    """Spec 1 Prompt builders: the round-1 programmer prompt carries the analyst's ANALYST_SUMMARY."""
    prompt = m.build_programmer_prompt(1, 1, ANALYST_OUT)
    assert ("System analyst handoff:\nANALYST_SUMMARY:\n- Change: openspec/changes/analyst-marker-change\n"
            "- Handoff: implement greet.py") in prompt
    assert "Narration before the summary" not in prompt


def test_retry_programmer_prompt_with_upstream_placeholder(m):
    """Spec 4 Shortcut retry with non-analyst START_AGENT: the placeholder analyst output still gives a retry prompt."""
    m.update_run(feedback="RESULT: FAIL\nEVIDENCE:\n- x")
    prompt = m.build_programmer_prompt(2, 1, m._UPSTREAM_PLACEHOLDER)
    assert "Test failure feedback:" in prompt
    assert "System analyst handoff:" not in prompt


# -- spec 1: programmer prompt condenses upstream on repeat -------------------------

def test_programmer_prompt_condenses_upstream_on_repeat(m):
    """Spec 1 Prompt builders / Programmer prompt condenses upstream on repeat: cycle 2 -> back-reference."""
    assert m.CONDENSE_UPSTREAM_ON_REPEAT is True
    delivered(m, m.build_programmer_prompt(1, 1, ANALYST_OUT))
    prompt = m.build_programmer_prompt(1, 2, ANALYST_OUT)
    assert "analyst-marker-change" not in prompt
    assert f"System analyst handoff:\n{m.UPSTREAM_BACK_REFERENCE}" in prompt
    assert "conversation history" in m.UPSTREAM_BACK_REFERENCE


def test_programmer_prompt_condenses_upstream_on_repeat_when_called_alone(load_orch):
    """Spec 1, as the spec states it: build_programmer_prompt() called with cycle 2 and
    CONDENSE_UPSTREAM_ON_REPEAT, nothing else done before -> the analyst output is a back-reference."""
    mod = load_orch()
    prompt = mod.build_programmer_prompt(1, 2, ANALYST_OUT)
    assert "analyst-marker-change" not in prompt
    assert f"System analyst handoff:\n{mod.UPSTREAM_BACK_REFERENCE}" in prompt


def test_a_compacted_conversation_at_a_later_cycle_gets_the_upstream_in_full(m):
    """The programmer's conversation was compacted after its cycle-1 turn: cycle 2 carries the upstream again."""
    delivered(m, m.build_programmer_prompt(1, 1, ANALYST_OUT))
    m.forget_conversation("programmer", m.terminal_ids["programmer"], "compacted")
    prompt = m.build_programmer_prompt(1, 2, ANALYST_OUT)
    assert "analyst-marker-change" in prompt and m.UPSTREAM_BACK_REFERENCE not in prompt


def test_programmer_prompt_cycle_1_has_analyst_output(m):
    """Spec 1 Prompt builders / Programmer prompt condenses upstream on repeat: cycle 1 has the analyst output."""
    prompt = m.build_programmer_prompt(1, 1, ANALYST_OUT)
    assert "analyst-marker-change" in prompt
    assert m.UPSTREAM_BACK_REFERENCE not in prompt


def test_programmer_prompt_upstream_not_condensed_when_off(m):
    """Spec 1 Prompt builders: CONDENSE_UPSTREAM_ON_REPEAT off -> cycle 2 still carries the analyst output."""
    m.CONDENSE_UPSTREAM_ON_REPEAT = False
    prompt = m.build_programmer_prompt(1, 2, ANALYST_OUT)
    assert "analyst-marker-change" in prompt
    assert m.UPSTREAM_BACK_REFERENCE not in prompt


def test_programmer_prompt_upstream_not_condensed_when_off_by_env(load_orch):
    """Spec 1 Configuration CONDENSE_UPSTREAM_ON_REPEAT=0: cycle 3 still carries the analyst output."""
    mod = load_orch(CONDENSE_UPSTREAM_ON_REPEAT="0")
    assert mod.CONDENSE_UPSTREAM_ON_REPEAT is False
    assert "analyst-marker-change" in mod.build_programmer_prompt(1, 3, ANALYST_OUT)


def test_retry_programmer_prompt_cycle_2_refers_back_to_failure_feedback(m):
    """Spec 1 upstream condensation on repeat applied to spec 4's retry block: cycle 2 refers back to the feedback."""
    m.update_run(feedback="RESULT: FAIL\nEVIDENCE:\n- failure-marker")
    delivered(m, m.build_programmer_prompt(2, 1, ANALYST_OUT))
    prompt = m.build_programmer_prompt(2, 2, ANALYST_OUT)
    assert f"Test failure feedback:\n{m.UPSTREAM_BACK_REFERENCE}" in prompt
    assert "failure-marker" not in prompt
    m.CONDENSE_UPSTREAM_ON_REPEAT = False
    assert "Test failure feedback:\nRESULT: FAIL\nEVIDENCE:\n- failure-marker" in m.build_programmer_prompt(2, 2, "")


def test_programmer_cycle_2_refers_back_to_open_peer_analyst_notes(m):
    """Upstream condensation on repeat: the unapproved analysis notes are shown in cycle 1, referred to after."""
    m.update_run(analyst_feedback="REVIEW_NOTES:\n- open-analyst-note-marker")
    label = "Open peer analyst notes (the analysis was not approved; keep them in mind):\n"
    assert f"{label}REVIEW_NOTES:\n- open-analyst-note-marker" in delivered(m, m.build_programmer_prompt(1, 1, ANALYST_OUT))
    assert f"{label}{m.UPSTREAM_BACK_REFERENCE}" in m.build_programmer_prompt(1, 2, ANALYST_OUT)
    m.CONDENSE_UPSTREAM_ON_REPEAT = False
    assert "open-analyst-note-marker" in m.build_programmer_prompt(1, 2, ANALYST_OUT)


def test_retry_programmer_cycle_2_refers_back_to_previous_changes(m):
    """Upstream condensation on repeat applied to spec 4's previous changes: full in cycle 1, referred to after."""
    m.update_run(feedback="RESULT: FAIL", programmer_context_for_retry=RETRY_CONTEXT)
    assert f"Your previous changes (context):\n{RETRY_CONTEXT}" in delivered(m, m.build_programmer_prompt(2, 1, ""))
    assert f"Your previous changes (context):\n{m.UPSTREAM_BACK_REFERENCE}" in m.build_programmer_prompt(2, 2, "")
    m.CONDENSE_UPSTREAM_ON_REPEAT = False
    assert f"Your previous changes (context):\n{RETRY_CONTEXT}" in m.build_programmer_prompt(2, 2, "")


def test_programmer_prompt_carries_peer_programmer_feedback(m):
    """Spec 1 Prompt builders: the programmer prompt carries the latest peer programmer feedback."""
    m.update_run(programmer_feedback="REVIEW_NOTES:\n- peer-programmer-marker")
    prompt = m.build_programmer_prompt(1, 2, ANALYST_OUT)
    assert "Latest peer programmer feedback:\nREVIEW_NOTES:\n- peer-programmer-marker" in prompt


def test_programmer_prompt_guard_lines(m):
    """Spec 1 Prompt builders: the programmer prompt has its guard lines (stay in WD, never weaken tests)."""
    prompt = m.build_programmer_prompt(1, 1, ANALYST_OUT)
    assert f"Work only inside {m.WD}" in prompt
    assert "Never weaken, skip or delete a test" in prompt


# -- review prompts ----------------------------------------------------------------

def test_analyst_review_prompt_structure(m):
    """Spec 1 Prompt builders: the peer analyst gets the analyst output, the four checks and the verdict format."""
    prompt = m.build_analyst_review_prompt(ANALYST_OUT)
    assert "analyst-marker-change" in prompt
    assert "REVIEW_RESULT: APPROVED" in prompt and "REVIEW_RESULT: REVISE" in prompt
    assert "REVIEW_NOTES:" in prompt
    for check in ("Artifacts", "P1 traceability", "Downstream contracts", "Handoff"):
        assert check in prompt


def test_programmer_review_prompt_structure(m):
    """Spec 1 Prompt builders: the peer programmer gets the programmer output, the four checks and the verdict format."""
    prompt = m.build_programmer_review_prompt(PROGRAMMER_OUT)
    assert "handoff_marker.py" in prompt
    assert "REVIEW_RESULT: APPROVED" in prompt and "REVIEW_NOTES:" in prompt
    for check in ("Tests", "Files", "Requirements", "Edge cases"):
        assert check in prompt


# -- tester prompt ------------------------------------------------------------------

def test_tester_prompt_carries_condensed_programmer_handoff(m):
    """Spec 1 Prompt builders: the tester gets only Files changed + Behavior implemented from the programmer."""
    prompt = m.build_tester_prompt(PROGRAMMER_OUT)
    assert ("Programmer handoff:\n- Files changed: handoff_marker.py\n"
            "- Behavior implemented: greet prints the greeting") in prompt
    assert "gap-marker" not in prompt
    assert "Tests run: pytest -q" not in prompt


def test_tester_prompt_with_cross_phase_condensation_off_carries_whole_output(m):
    """Spec 1 Configuration CONDENSE_CROSS_PHASE=0: the tester gets the whole programmer output."""
    m.CONDENSE_CROSS_PHASE = False
    assert "gap-marker" in m.build_tester_prompt(PROGRAMMER_OUT)


def test_tester_prompt_carries_project_test_cmd(m):
    """Spec 1 Configuration PROJECT_TEST_CMD: when set, the tester prompt names the command."""
    m.PROJECT_TEST_CMD = "pytest -q tests/test_cmd_marker.py"
    assert "pytest -q tests/test_cmd_marker.py" in m.build_tester_prompt(PROGRAMMER_OUT)


def test_tester_prompt_project_test_cmd_from_env(load_orch):
    """Spec 1 Configuration PROJECT_TEST_CMD from the environment reaches the tester prompt."""
    mod = load_orch(PROJECT_TEST_CMD="make check-marker")
    assert "make check-marker" in mod.build_tester_prompt(PROGRAMMER_OUT)


def test_tester_prompt_without_project_test_cmd(m):
    """Spec 1 Configuration PROJECT_TEST_CMD unset: the tester is told no command is configured."""
    m.PROJECT_TEST_CMD = ""
    prompt = m.build_tester_prompt(PROGRAMMER_OUT)
    assert "Test command: none configured" in prompt


def test_tester_prompt_structure(m):
    """Spec 1 Prompt builders: the tester prompt has the scenario test and the RESULT/EVIDENCE answer format."""
    prompt = m.build_tester_prompt(PROGRAMMER_OUT)
    assert SCENARIO in prompt
    assert "RESULT: PASS" in prompt and "RESULT: FAIL" in prompt
    assert "EVIDENCE:" in prompt


# -- response-file instruction ----------------------------------------------------------

def test_response_file_instruction_names_role_file(m):
    """Spec 1 Prompt builders: each prompt names its role's file under $WD/.tmp/agent-responses/."""
    for role, build in BUILDERS.items():
        prompt = build(m)
        expected = Path(m.WD) / ".tmp" / "agent-responses" / RESPONSE_FILES[role]
        assert f"Write your complete answer to this file: {expected}" in prompt, role
        for other, name in RESPONSE_FILES.items():
            if other != role:
                assert name not in prompt, (role, other)


def heredoc_command(prompt: str, answer: str) -> str:
    """The example shell command of a prompt with the placeholder replaced by an answer."""
    lines = prompt.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("mkdir -p "))
    end = next(i for i in range(start, len(lines)) if lines[i] == "END_OF_RESPONSE")
    body = lines[start:end + 1]
    assert "<your complete answer>" in body
    return "\n".join(answer if line == "<your complete answer>" else line for line in body) + "\n"


def test_response_file_heredoc_writes_file_with_awkward_wd(m, tmp_path):
    """Spec 1 Prompt builders: each heredoc command, run by bash, writes its role's file even if WD has ' and space."""
    wd = tmp_path / "my project's dir"
    wd.mkdir()
    m.WD = str(wd)
    for role, build in BUILDERS.items():
        answer = f"{role} answer\nEVIDENCE:\n- kept literally: $HOME `echo no` \"quoted\" 'single'"
        done = subprocess.run(["bash", "-c", heredoc_command(build(m), answer)], cwd=tmp_path,
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, (role, done.stderr)
        written = wd / ".tmp" / "agent-responses" / RESPONSE_FILES[role]
        assert written.read_text(encoding="utf-8") == answer + "\n", role
    assert not (tmp_path / "my").exists()


# -- what every prompt kind carries, the first time and when repeated -----------------------
#
# A repeated prompt (the terminal has had one before) refers back to the text it
# already has -- the task, the checks, the answer format, the example command --
# but still carries everything the specs require of that prompt: guard lines,
# task instructions, round and cycle, the feedback and handoff blocks under
# their fixed labels, and the response-file instruction.

STORY_CHANGE = "/project/openspec/changes/add-greeting"
FAILURE = "RESULT: FAIL\nEVIDENCE:\n- failure-marker: comma missing"
PEER_ANALYST_NOTES = "REVIEW_NOTES:\n- peer-analyst-notes-marker"
PEER_PROGRAMMER_NOTES = "REVIEW_NOTES:\n- peer-programmer-notes-marker"
TITLES = {"analyst": "system analyst", "peer_analyst": "peer analyst", "programmer": "programmer",
          "peer_programmer": "peer programmer", "tester": "tester"}


def response_line(m, role: str) -> str:
    return f"Write your complete answer to this file: {m.response_path(role)}"


def _analyst_retry(m):
    m.feedback, m.programmer_context_for_retry, m.analyst_feedback = FAILURE, RETRY_CONTEXT, PEER_ANALYST_NOTES
    return m.build_analyst_prompt(2, 1)


def _programmer_after_review(m):
    m.update_run(programmer_feedback=PEER_PROGRAMMER_NOTES)
    return m.build_programmer_prompt(1, 2, ANALYST_OUT)


def _programmer_after_failure(m):
    m.feedback, m.programmer_context_for_retry = FAILURE, RETRY_CONTEXT
    return m.build_programmer_prompt(2, 1, ANALYST_OUT)


def _story(m, attempt: int = 2, reason: str = "story-failure-marker"):
    story = m.Story("2", "Print the greeting", [(False, "2.1 Print Hello, NAME!")])
    scenarios = [("greeting", "Greets by name", ["- **WHEN** greet World runs", "- **THEN** it prints Hello"])]
    return m.build_story_prompt(story, Path(STORY_CHANGE), scenarios, attempt, reason)


def _reviewer_required(author: str, checks: tuple[str, ...]) -> list[str]:
    return ["Rules:\n- Review only: change no file except your response file.", f"Review the {author}'s work",
            "REVIEW_RESULT: APPROVED", "REVISE", "REVIEW_NOTES:", *checks]


ANALYST_GUARDS = ["Do not write or change application code", "Work only inside {WD}", "Do not ask questions",
                  "Address every point of the feedback above"]
ANALYST_TASK = ["/opsx:explore", "/opsx:ff", "ANALYST_SUMMARY", "all five sections are mandatory",
                "Change", "Artifacts", "P1 requirements", "Contracts", "Handoff"]
PROGRAMMER_GUARDS = ["Work only inside {WD}", "Never weaken, skip or delete a test", "Do not ask questions",
                     "Test command: none configured"]
PROGRAMMER_FORMAT = ["PROGRAMMER_SUMMARY:", "Files changed", "Behavior implemented", "Tests run", "Known gaps"]
RETRY_TASK = ["/opsx:explore to investigate the failure", "may update the OpenSpec artifacts with /opsx:ff",
              "spec or design"]

# kind: (role, build, text every form must carry,
#        [(text only the complete form has, what a repeated form says instead)])
PROMPT_KINDS = {
    "analyst first": ("analyst", lambda m: m.build_analyst_prompt(1, 1), [
        "round 1 of 8", "analyst cycle 1 of 3", "Latest tester feedback:\n(none)",
        "Latest peer analyst feedback:\n(none)", *ANALYST_GUARDS, *ANALYST_TASK]),
    "analyst retry": ("analyst", _analyst_retry, [
        "round 2 of 8", "analyst cycle 1 of 3", f"Latest tester feedback:\n{FAILURE}",
        f"Previous round programmer changes (context only):\n{RETRY_CONTEXT}",
        f"Latest peer analyst feedback:\n{PEER_ANALYST_NOTES}", *ANALYST_GUARDS, *ANALYST_TASK]),
    "analyst review": ("peer_analyst", lambda m: m.build_analyst_review_prompt(ANALYST_OUT), [
        "round 1 of 8", "review cycle 1 of 3", "System analyst output to review:\nNarration before the summary.",
        "analyst-marker-change", "Judge the OpenSpec artifacts on disk",
        *_reviewer_required("system analyst", ("Artifacts", "P1 traceability", "Downstream contracts",
                                               "Handoff"))]),
    "programmer first": ("programmer", lambda m: m.build_programmer_prompt(1, 1, ANALYST_OUT), [
        "round 1 of 8", "programmer cycle 1 of 3",
        "System analyst handoff:\nANALYST_SUMMARY:\n- Change: openspec/changes/analyst-marker-change",
        "Latest peer programmer feedback:\n(none)", "/opsx:apply", "Run the tests and fix what fails",
        *PROGRAMMER_GUARDS, *PROGRAMMER_FORMAT]),
    "programmer after review feedback": ("programmer", _programmer_after_review, [
        # in full to a terminal with no earlier prompt (a replaced agent), else a back-reference (tested below)
        "round 1 of 8", "programmer cycle 2 of 3", "System analyst handoff:\n",
        f"Latest peer programmer feedback:\n{PEER_PROGRAMMER_NOTES}", "/opsx:apply",
        *PROGRAMMER_GUARDS, *PROGRAMMER_FORMAT]),
    "programmer after test failure": ("programmer", _programmer_after_failure, [
        "round 2 of 8", "a retry after a failed test", "programmer cycle 1 of 3", f"Test failure feedback:\n{FAILURE}",
        f"Your previous changes (context):\n{RETRY_CONTEXT}", *RETRY_TASK, *PROGRAMMER_GUARDS, *PROGRAMMER_FORMAT]),
    "programmer review": ("peer_programmer", lambda m: m.build_programmer_review_prompt(PROGRAMMER_OUT), [
        "round 1 of 8", "review cycle 1 of 3", "Programmer output to review:\nPROGRAMMER_SUMMARY:",
        "gap-marker", "Read the changed code and run the tests yourself", "Test command: none configured",
        *_reviewer_required("programmer", ("Tests", "Files", "Requirements", "Edge cases"))]),
    "tester": ("tester", lambda m: m.build_tester_prompt(PROGRAMMER_OUT), [
        "round 1 of 8", "Programmer handoff:\n- Files changed: handoff_marker.py",
        "Test only: do not change application code", "Test command: none configured",
        "run the test command and carry out the scenario test step by step",
        "RESULT: PASS", "RESULT: FAIL", "EVIDENCE:"]),
    "story": ("programmer", _story, [
        "round 1 of 8", 'story 2 "Print the greeting"', "attempt 2 of 3",
        "Retry of story 2 -- the previous attempt failed:\nstory-failure-marker", "Try a different approach",
        "Tasks of this story:\n- [ ] 2.1 Print Hello, NAME!", "Complete only the tasks of this story",
        STORY_CHANGE, f"{STORY_CHANGE}/proposal.md", f"{STORY_CHANGE}/design.md",
        "[greeting] Scenario: Greets by name\n  - **WHEN** greet World runs", "focus on those relevant",
        "after completing the tasks, run the verification", "Test command: none configured",
        "verification passes: <promise>COMPLETE</promise>", "<promise>FAILED: {reason}</promise>",
        "says briefly what went wrong", "retry the story with that context",
        "You MUST end with one of these two signals", "from `- [ ]` to `- [x]`",
        "Never weaken, skip or delete a test", "Work only inside {WD}", "PROGRAMMER_SUMMARY:"]),
}
# What only a terminal's first prompt has in full, and what later ones say in its place.
STANDING = {
    "analyst": [("- P1 requirements: <must-have", "Answer with the ANALYST_SUMMARY as in your first turn")],
    "peer_analyst": [("Check, citing what you looked at:\n1. Artifacts:",
                      "Checks and answer format: as in your first review"),
                     ("- <for REVISE: each change the analyst must make>", "what the analyst must change")],
    "programmer": [("Answer format:\nPROGRAMMER_SUMMARY:\n- Files changed: <",
                    "Answer format: as in your first turn -- PROGRAMMER_SUMMARY:")],
    "peer_programmer": [("Check, citing what you looked at:\n1. Tests:",
                         "Checks and answer format: as in your first review"),
                        ("- <for REVISE: each change the programmer must make>", "what the programmer must change")],
    "tester": [("Answer format:\nRESULT: PASS  (or RESULT: FAIL)\nEVIDENCE:\n- <",
                "Answer format: as in your first turn -- RESULT: PASS or RESULT: FAIL, then EVIDENCE:")],
}
STORY_STANDING = [("Answer format:\nPROGRAMMER_SUMMARY:\n- Files changed: <",
                   "Answer format: as in your first story -- PROGRAMMER_SUMMARY:")]


def standing_text(m, kind: str) -> list[tuple[str, str]]:
    """The once-per-terminal blocks of a prompt kind: (complete form, back-reference)."""
    role = PROMPT_KINDS[kind][0]
    return [(EXPLORE, BACK_REFERENCE), (SCENARIO, BACK_REFERENCE),
            ("For example:\nmkdir -p ", "Response file (required; as in your first turn):"),
            (" in a five-agent development loop", f"You are the {TITLES[role]} ("),
            *(STORY_STANDING if kind == "story" else STANDING[role])]


def first_and_repeated(m, kind: str) -> tuple[str, str]:
    """The prompt to a terminal that has had none yet, and the same prompt once it has had one."""
    build = PROMPT_KINDS[kind][1]
    return delivered(m, build(m)), build(m)


@pytest.mark.parametrize("kind", list(PROMPT_KINDS))
def test_first_and_repeated_prompts_carry_what_the_specs_require(m, kind):
    """Spec 1 prompt builders, spec 2 and 4 retry blocks, spec 5 story prompt: in the first and in a repeated form."""
    role, _build, required = PROMPT_KINDS[kind]
    first, repeated = first_and_repeated(m, kind)
    for form, prompt in (("first", first), ("repeated", repeated)):
        for text in [*required, response_line(m, role), "Response file (required"]:
            assert text.replace("{WD}", m.WD) in prompt, (kind, form, text)
        assert "Only this file is read" in prompt and "when your work is done" in prompt, (kind, form)
    for complete, back_reference in standing_text(m, kind):
        assert complete in first and back_reference not in first, (kind, complete)
        assert complete not in repeated and back_reference in repeated, (kind, back_reference)
    assert len(repeated) < len(first)


@pytest.mark.parametrize("kind", list(PROMPT_KINDS))
def test_new_terminal_gets_the_complete_prompt_again(m, kind):
    """A new terminal (a new run, a replaced agent) has no history to refer to: its first prompt is complete."""
    role = PROMPT_KINDS[kind][0]
    first, repeated = first_and_repeated(m, kind)
    assert repeated != first
    m.terminal_ids[role] = f"new-{role}"
    again = PROMPT_KINDS[kind][1](m)
    assert again == first


@pytest.mark.parametrize("kind", list(PROMPT_KINDS))
def test_building_a_prompt_records_nothing(m, kind):
    """A prompt that never reached its terminal leaves no record: the next one to it is complete again."""
    build = PROMPT_KINDS[kind][1]
    first = build(m)
    assert first.carries_in_full and m.context_sent == set()
    assert build(m) == first


def test_fresh_context_record_gives_complete_prompts(m):
    """A new run starts with an empty record (init_new_run): every prompt kind is complete again."""
    for kind, (_role, build, _required) in PROMPT_KINDS.items():
        m.update_run(context_sent=set())
        first, repeated = delivered(m, build(m)), build(m)
        m.update_run(context_sent=set())
        assert build(m) == first != repeated, kind


def test_resumed_run_keeps_referring_back(m):
    """context_sent is saved in the state: after a resume the terminals that have the text get back-references."""
    for _role, build, _required in PROMPT_KINDS.values():
        delivered(m, build(m))
    m.save_state()
    m.update_run(context_sent=set())
    assert m.load_state()
    for kind, (_role, build, _required) in PROMPT_KINDS.items():
        prompt = build(m)
        for complete, back_reference in standing_text(m, kind):
            assert complete not in prompt and back_reference in prompt, (kind, complete)


def test_repeated_prompts_complete_when_condense_explore_off(m):
    """CONDENSE_EXPLORE_ON_REPEAT=0: nothing is sent once only, every prompt is complete."""
    m.CONDENSE_EXPLORE_ON_REPEAT = False
    for kind, (_role, build, _required) in PROMPT_KINDS.items():
        first, repeated = delivered(m, build(m)), build(m)
        assert repeated == first, kind


def test_a_new_agent_at_a_later_cycle_gets_the_upstream_in_full(m):
    """A replaced agent has no conversation to refer back to: the upstream comes in full, as in cycle 1."""
    delivered(m, m.build_programmer_prompt(1, 1, ANALYST_OUT))
    assert m.UPSTREAM_BACK_REFERENCE in m.build_programmer_prompt(1, 2, ANALYST_OUT)
    m.update_run(terminal_ids={**m.terminal_ids, "programmer": "term-programmer-new"},
                 replacements=[m.Replacement("programmer", "term-programmer", "term-programmer-new",
                                             "2026-11-25T10:00:00Z", "its agent CLI exited")])
    prompt = m.build_programmer_prompt(1, 2, ANALYST_OUT)
    assert "analyst-marker-change" in prompt and m.UPSTREAM_BACK_REFERENCE not in prompt
    assert EXPLORE in prompt and m.EXPLORE_BACK_REFERENCE not in prompt
    assert set(prompt.carries_in_full) >= {"intro:term-programmer-new", "answer-format:term-programmer-new",
                                           "response-file:term-programmer-new"}
