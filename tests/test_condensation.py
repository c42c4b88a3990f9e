"""Condensation: what passes between agents.

Spec 1 "Feedback condensation" and "Explore summary condensation", with
spec 3's split of MAX_TEST_EVIDENCE_LINES (120) from MAX_FEEDBACK_LINES (30),
and the cross-phase condensers used by spec 1 prompts and spec 2 retry context.
"""

from __future__ import annotations

BACK_REFERENCE = "(Same as initial turn -- refer to your conversation history.)"


def numbered(prefix: str, count: int) -> list[str]:
    return [f"- {prefix} {n}" for n in range(1, count + 1)]


# -- defaults ---------------------------------------------------------------

def test_condensation_defaults(orch):
    """Spec 1 Configuration + spec 3 decision 3: MAX_FEEDBACK_LINES 30, MAX_TEST_EVIDENCE_LINES 120, cross-phase 40."""
    assert orch.MAX_FEEDBACK_LINES == 30
    assert orch.MAX_TEST_EVIDENCE_LINES == 120
    assert orch.MAX_CROSS_PHASE_LINES == 40
    assert orch.CONDENSE_CROSS_PHASE is True
    assert orch.CONDENSE_REVIEW_FEEDBACK is True
    assert orch.CONDENSE_EXPLORE_ON_REPEAT is True


# -- extract_review_notes ---------------------------------------------------

def test_review_notes_condensation(orch):
    """Spec 1 Feedback condensation / Review notes condensation: only the REVIEW_NOTES section onward."""
    text = ("I looked at everything carefully.\nREVIEW_RESULT: REVISE\n"
            "REVIEW_NOTES:\n- P1 requirement 2 is not traced\n- tasks.md misses the CLI task\n")
    assert orch.extract_review_notes(text) == (
        "REVIEW_NOTES:\n- P1 requirement 2 is not traced\n- tasks.md misses the CLI task")


def test_review_notes_capped_at_max_feedback_lines(orch):
    """Spec 1 Feedback condensation: review notes are capped at MAX_FEEDBACK_LINES (30) lines."""
    text = "REVIEW_RESULT: REVISE\nREVIEW_NOTES:\n" + "\n".join(numbered("note", 50))
    lines = orch.extract_review_notes(text).splitlines()
    assert len(lines) == 30
    assert lines[0] == "REVIEW_NOTES:"
    assert lines[-1] == "- note 29"


def test_review_notes_cap_follows_max_feedback_lines(orch):
    """Spec 1 Feedback condensation: the cap follows MAX_FEEDBACK_LINES when it is changed."""
    orch.MAX_FEEDBACK_LINES = 4
    text = "REVIEW_NOTES:\n" + "\n".join(numbered("note", 10))
    assert orch.extract_review_notes(text) == "REVIEW_NOTES:\n- note 1\n- note 2\n- note 3"


def test_review_notes_cap_from_env(load_orch):
    """Spec 1 Configuration: MAX_FEEDBACK_LINES=3 from the environment caps review notes."""
    m = load_orch(MAX_FEEDBACK_LINES="3")
    text = "REVIEW_NOTES:\n" + "\n".join(numbered("note", 10))
    assert m.extract_review_notes(text).splitlines() == ["REVIEW_NOTES:", "- note 1", "- note 2"]


def test_review_notes_fallback_head_truncated_raw_text(orch):
    """Spec 1 Feedback condensation: without REVIEW_NOTES, the head of the raw text, capped at MAX_FEEDBACK_LINES."""
    raw = [f"line {n}" for n in range(1, 51)]
    result = orch.extract_review_notes("\n".join(raw))
    assert result.splitlines() == raw[:30]


def test_review_notes_fallback_short_text_unchanged(orch):
    """Spec 1 Feedback condensation: a short review without REVIEW_NOTES is passed on whole."""
    assert orch.extract_review_notes("REVIEW_RESULT: REVISE\nPlease add tests.\n") == (
        "REVIEW_RESULT: REVISE\nPlease add tests.")


def test_review_notes_of_nothing_is_empty(orch):
    """Spec 1 Feedback condensation: an empty review condenses to ''."""
    assert orch.extract_review_notes("") == ""
    assert orch.extract_review_notes(None) == ""


# -- extract_test_evidence --------------------------------------------------

def test_test_evidence_condensation(orch):
    """Spec 1 Feedback condensation / Test evidence condensation: the RESULT line plus the EVIDENCE section."""
    text = ("I ran the scenario.\nRESULT: FAIL\nSome chatter between the sections.\n"
            "EVIDENCE:\n- greet World printed Hello World\n- Recommended next fix: greet.py\n")
    assert orch.extract_test_evidence(text) == (
        "RESULT: FAIL\nEVIDENCE:\n- greet World printed Hello World\n- Recommended next fix: greet.py")


def test_test_evidence_capped_at_max_test_evidence_lines_120(orch):
    """Spec 3 decision 3: extract_test_evidence is capped at MAX_TEST_EVIDENCE_LINES (120) lines."""
    text = "RESULT: FAIL\nEVIDENCE:\n" + "\n".join(numbered("trace", 200))
    lines = orch.extract_test_evidence(text).splitlines()
    assert len(lines) == 120
    assert lines[:2] == ["RESULT: FAIL", "EVIDENCE:"]
    assert lines[-1] == "- trace 118"


def test_test_evidence_not_capped_at_max_feedback_lines(orch):
    """Spec 3 decision 3: test evidence is not cut at MAX_FEEDBACK_LINES (30) -- 100 lines pass whole."""
    evidence = numbered("trace", 100)
    text = "RESULT: FAIL\nEVIDENCE:\n" + "\n".join(evidence)
    lines = orch.extract_test_evidence(text).splitlines()
    assert len(lines) == 102 > orch.MAX_FEEDBACK_LINES
    assert lines[-1] == "- trace 100"


def test_test_evidence_independent_of_changed_max_feedback_lines(orch):
    """Spec 3 decision 3: lowering MAX_FEEDBACK_LINES does not shorten test evidence."""
    orch.MAX_FEEDBACK_LINES = 5
    text = "RESULT: FAIL\nEVIDENCE:\n" + "\n".join(numbered("trace", 20))
    assert len(orch.extract_test_evidence(text).splitlines()) == 22


def test_test_evidence_cap_follows_max_test_evidence_lines(orch):
    """Spec 3 decision 3: the cap follows MAX_TEST_EVIDENCE_LINES when it is changed."""
    orch.MAX_TEST_EVIDENCE_LINES = 4
    text = "RESULT: FAIL\nEVIDENCE:\n" + "\n".join(numbered("trace", 20))
    assert orch.extract_test_evidence(text) == "RESULT: FAIL\nEVIDENCE:\n- trace 1\n- trace 2"


def test_test_evidence_cap_from_env(load_orch):
    """Spec 3 decision 3: MAX_TEST_EVIDENCE_LINES=5 from the environment caps test evidence."""
    m = load_orch(MAX_TEST_EVIDENCE_LINES="5")
    assert m.MAX_TEST_EVIDENCE_LINES == 5
    text = "RESULT: FAIL\nEVIDENCE:\n" + "\n".join(numbered("trace", 20))
    assert len(m.extract_test_evidence(text).splitlines()) == 5


def test_test_evidence_fallback_head_truncated_raw_text(orch):
    """Spec 1/3 Feedback condensation: without EVIDENCE, the head of the raw text, capped at MAX_TEST_EVIDENCE_LINES."""
    raw = [f"output line {n}" for n in range(1, 201)]
    result = orch.extract_test_evidence("\n".join(raw))
    assert result.splitlines() == raw[:120]


def test_test_evidence_fallback_with_result_but_no_evidence(orch):
    """Spec 1 Feedback condensation: RESULT without an EVIDENCE section falls back to the raw text."""
    text = "RESULT: FAIL\nThe CLI crashed with a traceback.\n"
    assert orch.extract_test_evidence(text) == "RESULT: FAIL\nThe CLI crashed with a traceback."


def test_test_evidence_without_result_line_keeps_evidence_section(orch):
    """Spec 1 Feedback condensation: an EVIDENCE section without a RESULT line is still extracted."""
    text = "Preamble that is dropped.\nEVIDENCE:\n- step 2 failed\n"
    assert orch.extract_test_evidence(text) == "EVIDENCE:\n- step 2 failed"


# -- cross-phase condensers --------------------------------------------------

ANALYST_OUT = """Thinking out loud before the summary.
I explored the repository.
ANALYST_SUMMARY:
- Change: openspec/changes/add-greeting
- Artifacts: proposal.md, tasks.md
- P1 requirements: greet NAME
- Contracts: CLI greet NAME
- Handoff: implement greet.py
"""

PROGRAMMER_OUT = """Some narration from the programmer.
PROGRAMMER_SUMMARY:
- Files changed: greet.py, tests/test_greet.py
  - greet.py: new main()
- Behavior implemented: greet NAME prints Hello, NAME!
- Tests run: pytest -q (3 passed)
- Known gaps: unicode names untested
"""


def test_condense_analyst_for_programmer_keeps_summary_section(orch):
    """Spec 1 Prompt builders (cross-phase condensation): the analyst handoff is the ANALYST_SUMMARY section."""
    result = orch.condense_analyst_for_programmer(ANALYST_OUT)
    assert result.startswith("ANALYST_SUMMARY:")
    assert "- Handoff: implement greet.py" in result
    assert "Thinking out loud" not in result


def test_condense_analyst_for_programmer_capped_at_max_cross_phase_lines(orch):
    """Spec 1 Configuration MAX_CROSS_PHASE_LINES: the analyst handoff is capped at 40 lines."""
    text = "ANALYST_SUMMARY:\n" + "\n".join(numbered("item", 80))
    lines = orch.condense_analyst_for_programmer(text).splitlines()
    assert len(lines) == 40
    assert lines[-1] == "- item 39"


def test_condense_analyst_for_programmer_fallback_head(orch):
    """Spec 1 cross-phase condensation: without ANALYST_SUMMARY, the head of the text (MAX_CROSS_PHASE_LINES)."""
    raw = [f"line {n}" for n in range(1, 61)]
    assert orch.condense_analyst_for_programmer("\n".join(raw)).splitlines() == raw[:40]


def test_condense_programmer_for_tester_keeps_files_and_behavior_only(orch):
    """Spec 2 Condensed programmer summary: only the 'Files changed' and 'Behavior implemented' sections."""
    assert orch.condense_programmer_for_tester(PROGRAMMER_OUT) == (
        "- Files changed: greet.py, tests/test_greet.py\n"
        "  - greet.py: new main()\n"
        "- Behavior implemented: greet NAME prints Hello, NAME!")


def test_condense_programmer_for_tester_drops_other_sections(orch):
    """Spec 2 Condensed programmer summary: Tests run, Known gaps and narration are left out."""
    result = orch.condense_programmer_for_tester(PROGRAMMER_OUT)
    assert "Tests run" not in result
    assert "Known gaps" not in result
    assert "narration" not in result
    assert "PROGRAMMER_SUMMARY" not in result


def test_condense_programmer_for_tester_markdown_headings(orch):
    """Spec 2 Condensed programmer summary: sections written as markdown headings are recognised."""
    text = ("## Files changed\n- greet.py\n\n## Tests run\n- pytest\n\n"
            "## Behavior implemented\n- greeting\n\n## Known gaps\n- none\n")
    result = orch.condense_programmer_for_tester(text)
    assert "## Files changed\n- greet.py" in result
    assert "## Behavior implemented\n- greeting" in result
    assert "pytest" not in result
    assert "Known gaps" not in result


def test_condense_programmer_for_tester_capped_at_max_cross_phase_lines(orch):
    """Spec 2 Condensed programmer summary: capped at MAX_CROSS_PHASE_LINES (40)."""
    text = "- Files changed:\n" + "\n".join(f"  - file{n}.py" for n in range(1, 81)) + "\n- Tests run: ok\n"
    lines = orch.condense_programmer_for_tester(text).splitlines()
    assert len(lines) == 40
    assert lines[0] == "- Files changed:"
    assert lines[-1] == "  - file39.py"


def test_condense_programmer_for_tester_cap_follows_setting(orch):
    """Spec 2 Condensed programmer summary: the cap follows MAX_CROSS_PHASE_LINES when it is changed."""
    orch.MAX_CROSS_PHASE_LINES = 2
    assert orch.condense_programmer_for_tester(PROGRAMMER_OUT).splitlines() == [
        "- Files changed: greet.py, tests/test_greet.py", "  - greet.py: new main()"]


def test_condense_programmer_for_tester_empty_gives_empty(orch):
    """Spec 2 Empty programmer output produces empty context: '' (or blank, or None) in, '' out."""
    for text in ["", "   \n\n", None]:
        assert orch.condense_programmer_for_tester(text) == "", repr(text)


def test_condense_programmer_for_tester_fallback_head(orch):
    """Spec 2 Condensed programmer summary: without the two sections, the head of the text (MAX_CROSS_PHASE_LINES)."""
    raw = [f"line {n}" for n in range(1, 61)]
    assert orch.condense_programmer_for_tester("\n".join(raw)).splitlines() == raw[:40]


# -- CONDENSE_CROSS_PHASE=0 --------------------------------------------------

def test_condense_cross_phase_off_passes_programmer_output_whole(load_orch):
    """Spec 1 Configuration CONDENSE_CROSS_PHASE=0: the programmer output is passed on whole."""
    m = load_orch(CONDENSE_CROSS_PHASE="0")
    assert m.CONDENSE_CROSS_PHASE is False
    assert m.condense_programmer_for_tester(PROGRAMMER_OUT) == PROGRAMMER_OUT.strip()


def test_condense_cross_phase_off_passes_analyst_output_whole(load_orch):
    """Spec 1 Configuration CONDENSE_CROSS_PHASE=0: the analyst output is passed on whole."""
    m = load_orch(CONDENSE_CROSS_PHASE="0")
    assert m.condense_analyst_for_programmer(ANALYST_OUT) == ANALYST_OUT.strip()


def test_condense_cross_phase_off_is_not_capped(orch):
    """Spec 1 Configuration CONDENSE_CROSS_PHASE=0: no MAX_CROSS_PHASE_LINES cap either."""
    orch.CONDENSE_CROSS_PHASE = False
    text = "- Files changed:\n" + "\n".join(f"  - file{n}.py" for n in range(1, 81))
    assert len(orch.condense_programmer_for_tester(text).splitlines()) == 81


def test_condense_cross_phase_off_empty_still_empty(orch):
    """Spec 2 Empty programmer output produces empty context, also with CONDENSE_CROSS_PHASE off."""
    orch.CONDENSE_CROSS_PHASE = False
    assert orch.condense_programmer_for_tester("") == ""


# -- CONDENSE_REVIEW_FEEDBACK ------------------------------------------------

REVIEW = "Long preamble about what I read.\nREVIEW_RESULT: REVISE\nREVIEW_NOTES:\n- add a test for empty names\n"


def test_review_feedback_condensed_by_default(orch):
    """Spec 1 Feedback condensation: with CONDENSE_REVIEW_FEEDBACK the author gets only the REVIEW_NOTES."""
    assert orch.review_feedback_from(REVIEW) == "REVIEW_NOTES:\n- add a test for empty names"


def test_condense_review_feedback_off_passes_review_whole(load_orch):
    """Spec 1 Configuration CONDENSE_REVIEW_FEEDBACK=0: the author gets the whole review."""
    m = load_orch(CONDENSE_REVIEW_FEEDBACK="0")
    assert m.CONDENSE_REVIEW_FEEDBACK is False
    assert m.review_feedback_from(REVIEW) == REVIEW.strip()


def test_condense_review_feedback_off_is_not_capped(orch):
    """Spec 1 Configuration CONDENSE_REVIEW_FEEDBACK=0: no MAX_FEEDBACK_LINES cap on the review."""
    orch.CONDENSE_REVIEW_FEEDBACK = False
    text = "REVIEW_NOTES:\n" + "\n".join(numbered("note", 60))
    assert len(orch.review_feedback_from(text).splitlines()) == 61


# -- explore_block_for --------------------------------------------------------

def test_first_send_includes_full_summary(orch):
    """Spec 1 Explore summary condensation / First send includes full summary."""
    orch.EXPLORE_SUMMARY = "Build a greeting CLI."
    assert orch.explore_block_for("term-a") == "Build a greeting CLI."


def test_repeat_send_returns_condensed(orch):
    """Spec 1 Explore summary condensation / Repeat send returns the exact back-reference text."""
    orch.EXPLORE_SUMMARY = "Build a greeting CLI."
    orch.explore_block_for("term-a")
    assert orch.explore_block_for("term-a") == BACK_REFERENCE
    assert orch.explore_block_for("term-a") == BACK_REFERENCE


def test_repeat_send_is_per_terminal(orch):
    """Spec 1 Explore summary condensation: another terminal's first send still gets the full summary."""
    orch.EXPLORE_SUMMARY = "Build a greeting CLI."
    orch.explore_block_for("term-a")
    assert orch.explore_block_for("term-b") == "Build a greeting CLI."
    assert orch.explore_block_for("term-b") == BACK_REFERENCE


def test_condense_explore_on_repeat_off_always_full(load_orch):
    """Spec 1 Explore summary condensation: CONDENSE_EXPLORE_ON_REPEAT=0 sends the full summary every time."""
    m = load_orch(CONDENSE_EXPLORE_ON_REPEAT="0")
    assert m.CONDENSE_EXPLORE_ON_REPEAT is False
    m.EXPLORE_SUMMARY = "Build a greeting CLI."
    assert m.explore_block_for("term-a") == "Build a greeting CLI."
    assert m.explore_block_for("term-a") == "Build a greeting CLI."


def test_condense_explore_on_repeat_off_by_global(orch):
    """Spec 1 Explore summary condensation: the CONDENSE_EXPLORE_ON_REPEAT global switches the back-reference off."""
    orch.EXPLORE_SUMMARY = "Build a greeting CLI."
    orch.CONDENSE_EXPLORE_ON_REPEAT = False
    orch.explore_block_for("term-a")
    assert orch.explore_block_for("term-a") == "Build a greeting CLI."
