"""Each reply format, both ways: the prompt is built, a reply is written the way the prompt asks (its own lines,
placeholders filled), and the code that reads that role's replies takes it as meant. Rewording a prompt so
that its readers no longer understand the answers it asks for fails here."""

from __future__ import annotations

import re

import pytest

from test_prompts import ANALYST_OUT, PROGRAMMER_OUT, m  # noqa: F401  (the fixture)


def format_lines(prompt: str, first: str) -> list[str]:
    """The lines of the prompt's answer format, from the line that starts with `first` to the next blank line."""
    lines = prompt.splitlines()
    start = next(index for index, line in enumerate(lines) if line.startswith(first))
    block = []
    for line in lines[start:]:
        if not line.strip():
            break
        block.append(line)
    return block


def written_as_asked(lines: list[str], alternative: bool = False) -> str:
    """A reply following the format: each `<...>` filled in, `A  (or B)` answered with A (B if `alternative`)."""
    reply = []
    for line in lines:
        choice = re.fullmatch(r"(.*?)\s+\(or (.*)\)", line)
        if choice:
            line = choice.group(2) if alternative else choice.group(1)
        reply.append(re.sub(r"<[^<>]*\s[^<>]*>", "filled in as asked", line))    # placeholders, not tags
    return "\n".join(reply) + "\n"


@pytest.mark.parametrize("reviewer, build", [
    ("peer_analyst", lambda m: m.build_analyst_review_prompt(ANALYST_OUT)),
    ("peer_programmer", lambda m: m.build_programmer_review_prompt(PROGRAMMER_OUT)),
])
def test_a_review_that_makes_each_check_the_prompt_lists_is_approved(m, reviewer, build):
    """The checklist the prompt lists, each check cited by its name in REVIEW_NOTES, counts as evidence for
    every check; the format's REVIEW_RESULT line is the verdict read, and its alternative asks for changes."""
    m.MIN_REVIEW_CYCLES_BEFORE_APPROVAL, m.REQUIRE_REVIEW_EVIDENCE = 1, True
    m.REVIEW_EVIDENCE_MIN_MATCH = 4
    prompt = build(m)
    checks = re.findall(r"^\d+\. ([^:]+):", prompt, re.MULTILINE)
    assert len(checks) == 4
    answer = format_lines(prompt, "REVIEW_RESULT:")
    review = written_as_asked(answer[:1]) + "REVIEW_NOTES:\n" + "".join(f"- {name}: looked at it\n" for name in checks)
    assert m.review_evidence_matches(review, reviewer) == len(checks)
    assert m.is_review_approved(review, 1, reviewer)
    revise = written_as_asked(answer, alternative=True)
    assert m.review_verdict(revise) == "REVISE" and not m.is_review_approved(revise, 1, reviewer)


def test_a_tester_reply_in_the_prompts_format_is_read_as_its_result(m):
    prompt = m.build_tester_prompt(PROGRAMMER_OUT)
    answer = format_lines(prompt, "RESULT:")
    assert m.tester_result(written_as_asked(answer)) == "PASS"
    failed = written_as_asked(answer, alternative=True)
    assert m.tester_result(failed) == "FAIL"
    evidence = m.extract_test_evidence(failed)
    assert evidence.startswith("RESULT: FAIL\nEVIDENCE:") and "Recommended next fix" in evidence


def test_an_analyst_summary_in_the_prompts_format_reaches_the_programmer_whole(m):
    prompt = m.build_analyst_prompt(1, 1)
    answer = format_lines(prompt, "ANALYST_SUMMARY:")
    labels = [re.match(r"- ([^:]+):", line).group(1) for line in answer[1:]]
    assert labels == ["Change", "Artifacts", "P1 requirements", "Contracts", "Handoff"]
    passed_on = m.condense_analyst_for_programmer("Narration first.\n" + written_as_asked(answer))
    assert passed_on.startswith("ANALYST_SUMMARY:") and all(f"- {label}:" in passed_on for label in labels)


def test_a_programmer_summary_in_the_prompts_format_gives_the_tester_what_changed(m):
    prompt = m.build_programmer_prompt(1, 1, ANALYST_OUT)
    answer = format_lines(prompt, "PROGRAMMER_SUMMARY:")
    passed_on = m.condense_programmer_for_tester(written_as_asked(answer))
    assert "Files changed:" in passed_on and "Behavior implemented:" in passed_on
    assert "Tests run" not in passed_on and "Known gaps" not in passed_on


def test_a_story_reply_in_the_prompts_format_gives_its_completion_signal(m):
    full_format, _ = m.STORY_ANSWER_FORMAT
    answer = format_lines(full_format, "PROGRAMMER_SUMMARY:")
    assert m.promise_signal(written_as_asked(answer))[0] == "COMPLETE"
    assert m.promise_signal(written_as_asked(answer, alternative=True))[0] == "FAILED"


@pytest.mark.parametrize("role, build, first, last", [
    ("analyst", lambda m: m.build_analyst_prompt(1, 1), "ANALYST_SUMMARY:", "- Handoff:"),
    ("peer_analyst", lambda m: m.build_analyst_review_prompt(ANALYST_OUT), "REVIEW_RESULT:", "REVIEW_NOTES:"),
    ("programmer", lambda m: m.build_programmer_prompt(1, 1, ANALYST_OUT), "PROGRAMMER_SUMMARY:",
     "- Behavior implemented:"),
    ("peer_programmer", lambda m: m.build_programmer_review_prompt(PROGRAMMER_OUT), "REVIEW_RESULT:",
     "REVIEW_NOTES:"),
    ("tester", lambda m: m.build_tester_prompt(PROGRAMMER_OUT), "RESULT:", "EVIDENCE:"),
])
def test_a_reply_in_the_prompts_format_is_complete_and_one_cut_off_before_its_last_part_is_not(
        m, role, build, first, last):
    """What a gone agent left is taken only when complete: every part its format's reader reads is there."""
    reply = written_as_asked(format_lines(build(m), first))
    assert m.reply_complete(role, reply)
    assert m.reply_complete(role, "Narration first.\n" + reply.replace("- ", "**", 1))
    assert not m.reply_complete(role, reply[:reply.index(last)])               # cut off before its last part
    assert not m.reply_complete(role, reply[:len(first) - 3])                   # ... or in its first line


def test_a_story_reply_is_complete_only_with_its_completion_signal(m):
    m.STORY_MODE = True
    reply = written_as_asked(format_lines(m.STORY_ANSWER_FORMAT[0], "PROGRAMMER_SUMMARY:"))
    assert m.reply_complete("programmer", reply)
    assert not m.reply_complete("programmer", reply[:reply.index("<promise>")])
