"""Each reply format, both ways: the prompt is built, a reply is written the way the prompt asks (its own lines,
placeholders filled), and the code that reads that role's replies takes it as meant. Rewording a prompt so
that its readers no longer understand the answers it asks for fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from test_prompts import ANALYST_OUT, PROGRAMMER_OUT, m  # noqa: F401  (the fixture)

ROOT = Path(__file__).resolve().parent.parent


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
    assert m.reply_verdict("review", revise) == "REVISE" and not m.is_review_approved(revise, 1, reviewer)


def test_a_tester_reply_in_the_prompts_format_is_read_as_its_result(m):
    prompt = m.build_tester_prompt(PROGRAMMER_OUT)
    answer = format_lines(prompt, "RESULT:")
    assert m.reply_verdict("tester", written_as_asked(answer)) == "PASS"
    failed = written_as_asked(answer, alternative=True)
    assert m.reply_verdict("tester", failed) == "FAIL"
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


# Which verdict row each profile in profiles/ and each of the scripted agent's replies answers in.
PROFILE_FORMATS = {"tester.md": "tester", "peer_system_analyst.md": "review", "peer_programmer.md": "review"}
SCRIPTED_FORMATS = {"tester": "tester", "peer_analyst": "review", "peer_programmer": "review"}


def contract_lines(profile: str) -> list[str]:
    """The lines of a profile's output contract (its fenced block under '## Output contract')."""
    text = (ROOT / "profiles" / profile).read_text(encoding="utf-8")
    block = text.split("## Output contract", 1)[1].split("```")[1]
    return [line for line in block.splitlines() if line.strip()]


@pytest.mark.parametrize("profile, row", sorted(PROFILE_FORMATS.items()))
def test_each_profiles_output_contract_is_its_verdict_row(m, profile, row):
    """A profile asks for the verdict line and the section its row names, in that order, both words offered:
    a reply written as the profile asks is read by the row's reader as meant."""
    form = m.VERDICT_FORMATS[row]
    lines = contract_lines(profile)
    assert lines[0].split()[:2] == form.line(passed=True).split()
    assert form.line(passed=False) in lines[0]
    assert lines[1] == f"{form.section}:"
    for passed in (True, False):
        reply = "\n".join([form.line(passed)] + lines[1:])
        assert m.verdict_line(form, reply) == (0, form.good if passed else form.other)


@pytest.mark.parametrize("role, row", sorted(SCRIPTED_FORMATS.items()))
def test_the_scripted_agents_replies_are_in_their_verdict_row(m, role, row):
    """The scripted agent (mock_cli) answers with its row's passing verdict line, then the row's section."""
    import orchestrator_scripted_agent as agent

    form = m.VERDICT_FORMATS[row]
    lines = agent.DEFAULT_TEXTS[role].strip().splitlines()
    at, word = m.verdict_line(form, agent.DEFAULT_TEXTS[role])
    assert (lines[at], word) == (form.line(passed=True), form.good)
    assert lines[at + 1] == f"{form.section}:"


def test_the_loops_own_fail_is_written_in_the_testers_row(m, tmp_path, monkeypatch):
    """VERIFY_PASS's FAIL (the project's tests disagreed with the tester) is written with the row's words, so
    the one reader takes its verdict and evidence as from a tester."""
    m.WD, m.PROJECT_TEST_CMD, m.VERIFY_TIMEOUT = str(tmp_path), "echo broken; exit 3", 30.0
    monkeypatch.setattr(m, "save_state", lambda: None)
    assert m.verify_pass() == "FAIL"
    written = m.outputs["tester"]
    assert m.reply_verdict("tester", written) == "FAIL"
    assert m.extract_test_evidence(written).startswith(
        f"{m.TESTER_FORMAT.line(passed=False)}\n{m.TESTER_FORMAT.section}:")


def test_verdict_and_evidence_come_from_the_same_result_line(m):
    """A tester that changed its mind: the verdict is its last RESULT line, and the evidence passed on is the
    section under that line, not the first one."""
    reply = ("RESULT: FAIL\nEVIDENCE:\n- first try failed\n\nRan it again after the fix.\n"
             "RESULT: PASS\nEVIDENCE:\n- all green\n")
    assert m.reply_verdict("tester", reply) == "PASS"
    assert m.extract_test_evidence(reply) == "RESULT: PASS\nEVIDENCE:\n- all green"
