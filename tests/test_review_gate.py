"""Review gate: is_review_approved(review_text, review_cycle, review_role).

Spec 1 "Review approval with evidence gate": an approval counts only when the
review says REVIEW_RESULT: APPROVED, the cycle is at least
MIN_REVIEW_CYCLES_BEFORE_APPROVAL, and (with REQUIRE_REVIEW_EVIDENCE) the
REVIEW_NOTES section shows at least REVIEW_EVIDENCE_MIN_MATCH evidence checks.
"""

from __future__ import annotations

import pytest

# One line per analyst evidence check: artifact/proposal, P1/traceability,
# downstream/contract, handoff/actionable.
ANALYST_EVIDENCE = [
    "- Artifacts: proposal.md, design.md and tasks.md exist and match the task",
    "- P1 traceability: every P1 requirement traces to the scenario test",
    "- Downstream contracts: the CLI signature and exit codes are exact",
    "- Handoff: the programmer's first steps are actionable",
]

# One line per programmer evidence check: tests, files, requirements/scenario,
# edge cases/error handling.
PROGRAMMER_EVIDENCE = [
    "- Tests: pytest -q passed (12 passed)",
    "- Files: greet.py implements the new function",
    "- Requirements: the scenario is covered by the code",
    "- Edge cases: an empty name gets error handling with a clear message",
]


def review(verdict: str = "APPROVED", evidence: list[str] | None = None, notes: bool = True) -> str:
    lines = [f"REVIEW_RESULT: {verdict}"]
    if notes:
        lines.append("REVIEW_NOTES:")
    lines += evidence if evidence is not None else []
    return "\n".join(lines) + "\n"


# -- spec 1 scenarios -------------------------------------------------------

def test_approved_with_sufficient_analyst_evidence_on_cycle_2(orch):
    """Spec 1 Review approval with evidence gate: APPROVED, cycle 2, all four analyst checks -> True."""
    assert orch.is_review_approved(review("APPROVED", ANALYST_EVIDENCE), 2, "peer_analyst") is True


def test_approved_with_sufficient_analyst_evidence_for_role_analyst(orch):
    """Spec 1 Review approval with evidence gate: the analyst evidence set also applies to role 'analyst'."""
    assert orch.is_review_approved(review("APPROVED", ANALYST_EVIDENCE), 2, "analyst") is True


@pytest.mark.parametrize("evidence", [ANALYST_EVIDENCE, []], ids=["full-evidence", "no-evidence"])
def test_approved_rejected_on_cycle_1(orch, evidence):
    """Spec 1 Review approval with evidence gate: APPROVED on cycle 1 -> False regardless of evidence."""
    assert orch.is_review_approved(review("APPROVED", evidence), 1, "peer_analyst") is False


def test_approved_rejected_on_cycle_1_even_without_evidence_check(orch):
    """Spec 1 Review approval with evidence gate: the cycle minimum holds when evidence is not required."""
    orch.REQUIRE_REVIEW_EVIDENCE = False
    assert orch.is_review_approved(review("APPROVED", ANALYST_EVIDENCE), 1, "peer_analyst") is False


def test_approved_rejected_with_insufficient_evidence(orch):
    """Spec 1 Review approval with evidence gate: APPROVED on cycle 2 with only 1 evidence match -> False."""
    text = review("APPROVED", ["- Artifacts: proposal.md looks fine"])
    assert orch.review_evidence_matches(text, "peer_analyst") == 1
    assert orch.is_review_approved(text, 2, "peer_analyst") is False


def test_approved_without_evidence_when_evidence_check_disabled(orch):
    """Spec 1 Review approval with evidence gate: REQUIRE_REVIEW_EVIDENCE False, APPROVED on cycle 2 -> True."""
    orch.REQUIRE_REVIEW_EVIDENCE = False
    assert orch.is_review_approved("REVIEW_RESULT: APPROVED\nLooks good.\n", 2, "peer_analyst") is True


def test_approved_without_evidence_when_evidence_check_disabled_by_env(load_orch):
    """Spec 1 Review approval with evidence gate: REQUIRE_REVIEW_EVIDENCE=0 in the environment disables the check."""
    m = load_orch(REQUIRE_REVIEW_EVIDENCE="0")
    assert m.REQUIRE_REVIEW_EVIDENCE is False
    assert m.is_review_approved("REVIEW_RESULT: APPROVED\n", 2, "peer_programmer") is True


def test_gate_defaults(orch):
    """Spec 1 Configuration: MIN_REVIEW_CYCLES_BEFORE_APPROVAL defaults to 2, REVIEW_EVIDENCE_MIN_MATCH to 3."""
    assert orch.MIN_REVIEW_CYCLES_BEFORE_APPROVAL == 2
    assert orch.REVIEW_EVIDENCE_MIN_MATCH == 3
    assert orch.REQUIRE_REVIEW_EVIDENCE is True


# -- verdicts ---------------------------------------------------------------

def test_revise_verdict_is_not_approved(orch):
    """Spec 1 Review approval with evidence gate (1): REVISE with full evidence on cycle 3 -> False."""
    assert orch.is_review_approved(review("REVISE", ANALYST_EVIDENCE), 3, "peer_analyst") is False


def test_revise_verdict_is_not_approved_without_evidence_check(orch):
    """Spec 1 Review approval with evidence gate (1): REVISE is never an approval, even without the evidence check."""
    orch.REQUIRE_REVIEW_EVIDENCE = False
    assert orch.is_review_approved(review("REVISE", ANALYST_EVIDENCE), 3, "peer_programmer") is False


def test_missing_review_result_is_not_approved(orch):
    """Spec 1 Review approval with evidence gate (1): no REVIEW_RESULT line -> False."""
    text = "APPROVED\nREVIEW_NOTES:\n" + "\n".join(ANALYST_EVIDENCE)
    assert orch.is_review_approved(text, 2, "peer_analyst") is False


def test_not_approved_verdict_is_not_approved(orch):
    """Spec 1 Review approval with evidence gate (1): 'REVIEW_RESULT: NOT APPROVED' does not contain the approval."""
    assert orch.is_review_approved(review("NOT APPROVED", ANALYST_EVIDENCE), 2, "peer_analyst") is False


def test_last_review_result_line_wins_revise_after_approved(orch):
    """Spec 1 Review approval with evidence gate: APPROVED followed by a later REVISE line -> False."""
    text = ("REVIEW_RESULT: APPROVED\nOn second look the contracts are vague.\nREVIEW_RESULT: REVISE\n"
            "REVIEW_NOTES:\n" + "\n".join(ANALYST_EVIDENCE))
    assert orch.reply_verdict("review", text) == "REVISE"
    assert orch.is_review_approved(text, 2, "peer_analyst") is False


def test_last_review_result_line_wins_approved_after_revise(orch):
    """Spec 1 Review approval with evidence gate: REVISE followed by a later APPROVED line -> True."""
    text = ("REVIEW_RESULT: REVISE\nThe issue was fixed while reviewing.\nREVIEW_RESULT: APPROVED\n"
            "REVIEW_NOTES:\n" + "\n".join(ANALYST_EVIDENCE))
    assert orch.reply_verdict("review", text) == "APPROVED"
    assert orch.is_review_approved(text, 2, "peer_analyst") is True


def test_markdown_decorated_approval_counts(orch):
    """Spec 1 Review approval with evidence gate: '**REVIEW_RESULT:** APPROVED' and '**REVIEW_NOTES:**' are recognised."""
    text = "**REVIEW_RESULT:** APPROVED\n\n**REVIEW_NOTES:**\n" + "\n".join(ANALYST_EVIDENCE)
    assert orch.is_review_approved(text, 2, "peer_analyst") is True


def test_empty_review_is_not_approved(orch):
    """Spec 1 Review approval with evidence gate (1): an empty review is never an approval."""
    assert orch.is_review_approved("", 3, "peer_analyst") is False
    assert orch.is_review_approved(None, 3, "peer_analyst") is False


# -- evidence ---------------------------------------------------------------

def test_missing_review_notes_with_evidence_required_is_rejected(orch):
    """Spec 1 Review approval with evidence gate (3): evidence words without a REVIEW_NOTES section -> False."""
    text = review("APPROVED", ANALYST_EVIDENCE, notes=False)
    assert "REVIEW_NOTES" not in text
    assert orch.is_review_approved(text, 2, "peer_analyst") is False


def test_missing_review_notes_allowed_when_evidence_not_required(orch):
    """Spec 1 Review approval with evidence gate (3): without REQUIRE_REVIEW_EVIDENCE no REVIEW_NOTES is needed."""
    orch.REQUIRE_REVIEW_EVIDENCE = False
    assert orch.is_review_approved(review("APPROVED", ANALYST_EVIDENCE, notes=False), 2, "peer_analyst") is True


def test_evidence_before_review_notes_does_not_count(orch):
    """Spec 1 Review approval with evidence gate (3): evidence is counted in the REVIEW_NOTES section, not above it."""
    text = ("REVIEW_RESULT: APPROVED\n" + "\n".join(ANALYST_EVIDENCE[:3])
            + "\nREVIEW_NOTES:\n" + ANALYST_EVIDENCE[3] + "\n")
    assert orch.review_evidence_matches(text, "peer_analyst") == 1
    assert orch.is_review_approved(text, 2, "peer_analyst") is False


def test_review_evidence_min_match_boundary_default_3(orch):
    """Spec 1 Review approval with evidence gate (3): approval needs >= REVIEW_EVIDENCE_MIN_MATCH (3) matches."""
    for count, approved in [(4, True), (3, True), (2, False), (1, False), (0, False)]:
        text = review("APPROVED", ANALYST_EVIDENCE[:count])
        assert orch.review_evidence_matches(text, "peer_analyst") == count
        assert orch.is_review_approved(text, 2, "peer_analyst") is approved, f"{count} matches"


def test_review_evidence_min_match_changed(orch):
    """Spec 1 Review approval with evidence gate (3): the threshold follows REVIEW_EVIDENCE_MIN_MATCH."""
    cases = [(1, 1, True), (1, 0, False), (2, 2, True), (2, 1, False), (4, 4, True), (4, 3, False)]
    for min_match, count, approved in cases:
        orch.REVIEW_EVIDENCE_MIN_MATCH = min_match
        text = review("APPROVED", PROGRAMMER_EVIDENCE[:count])
        assert orch.is_review_approved(text, 2, "peer_programmer") is approved, (min_match, count)


def test_review_evidence_min_match_from_env(load_orch):
    """Spec 1 Configuration + evidence gate: REVIEW_EVIDENCE_MIN_MATCH=2 from the environment lowers the bar."""
    m = load_orch(REVIEW_EVIDENCE_MIN_MATCH="2")
    text = review("APPROVED", ANALYST_EVIDENCE[:2])
    assert m.is_review_approved(text, 2, "peer_analyst") is True
    assert m.is_review_approved(review("APPROVED", ANALYST_EVIDENCE[:1]), 2, "peer_analyst") is False


def test_analyst_evidence_patterns_each_count_once(orch):
    """Spec 1 Review approval with evidence gate: each analyst check (proposal, traceable, downstream, actionable) counts."""
    checks = [
        "- the proposal is complete",
        "- requirements are traceable to the task",
        "- the downstream interfaces are clear",
        "- next steps are actionable",
    ]
    for line in checks:
        assert orch.review_evidence_matches(review("APPROVED", [line]), "peer_analyst") == 1, line
    assert orch.review_evidence_matches(review("APPROVED", checks), "peer_analyst") == 4


def test_evidence_match_is_case_insensitive(orch):
    """Spec 1 Review approval with evidence gate (3): evidence words count in any letter case."""
    text = review("APPROVED", ["- ARTIFACTS checked", "- p1 TRACEABILITY ok", "- DOWNSTREAM CONTRACT exact"])
    assert orch.review_evidence_matches(text, "peer_analyst") == 3


# -- programmer evidence set ------------------------------------------------

@pytest.mark.parametrize("role", ["peer_programmer", "programmer"])
def test_approved_with_sufficient_programmer_evidence_on_cycle_2(orch, role):
    """Spec 1 Review approval with evidence gate: programmer reviews are scored on tests, files, requirements, edge cases."""
    text = review("APPROVED", PROGRAMMER_EVIDENCE)
    assert orch.review_evidence_matches(text, role) == 4
    assert orch.is_review_approved(text, 2, role) is True


@pytest.mark.parametrize("role", ["peer_programmer", "programmer"])
def test_programmer_review_with_only_analyst_evidence_is_rejected(orch, role):
    """Spec 1 Review approval with evidence gate: analyst evidence words do not satisfy the programmer evidence set."""
    text = review("APPROVED", ["- artifact proposal", "- P1 traceability", "- downstream contract",
                               "- handoff actionable"])
    assert orch.review_evidence_matches(text, role) < orch.REVIEW_EVIDENCE_MIN_MATCH
    assert orch.is_review_approved(text, 2, role) is False


@pytest.mark.parametrize("role", ["peer_analyst", "analyst"])
def test_analyst_review_with_only_programmer_evidence_is_rejected(orch, role):
    """Spec 1 Review approval with evidence gate: programmer evidence words do not satisfy the analyst evidence set."""
    text = review("APPROVED", ["- pytest passed", "- greet.py changed", "- scenario covered",
                               "- no regression"])
    assert orch.review_evidence_matches(text, role) < orch.REVIEW_EVIDENCE_MIN_MATCH
    assert orch.is_review_approved(text, 2, role) is False


def test_programmer_evidence_insufficient_with_two_checks(orch):
    """Spec 1 Review approval with evidence gate: two programmer checks are below the default minimum of 3."""
    text = review("APPROVED", PROGRAMMER_EVIDENCE[:2])
    assert orch.review_evidence_matches(text, "peer_programmer") == 2
    assert orch.is_review_approved(text, 2, "peer_programmer") is False


def test_programmer_approved_on_cycle_1_is_rejected(orch):
    """Spec 1 Review approval with evidence gate (2): the cycle minimum applies to programmer reviews too."""
    assert orch.is_review_approved(review("APPROVED", PROGRAMMER_EVIDENCE), 1, "peer_programmer") is False


# -- MIN_REVIEW_CYCLES_BEFORE_APPROVAL --------------------------------------

def test_min_review_cycles_1_allows_approval_on_cycle_1(orch):
    """Spec 1 Review approval with evidence gate (2): MIN_REVIEW_CYCLES_BEFORE_APPROVAL=1 -> cycle 1 can approve."""
    orch.MIN_REVIEW_CYCLES_BEFORE_APPROVAL = 1
    assert orch.is_review_approved(review("APPROVED", ANALYST_EVIDENCE), 1, "peer_analyst") is True


def test_min_review_cycles_3_requires_cycle_3(orch):
    """Spec 1 Review approval with evidence gate (2): MIN_REVIEW_CYCLES_BEFORE_APPROVAL=3 -> approval from cycle 3."""
    orch.MIN_REVIEW_CYCLES_BEFORE_APPROVAL = 3
    for cycle, approved in [(1, False), (2, False), (3, True), (4, True)]:
        assert orch.is_review_approved(review("APPROVED", ANALYST_EVIDENCE), cycle, "peer_analyst") is approved, cycle


def test_min_review_cycles_from_env(load_orch):
    """Spec 1 Configuration + evidence gate: MIN_REVIEW_CYCLES_BEFORE_APPROVAL=1 from the environment."""
    m = load_orch(MIN_REVIEW_CYCLES_BEFORE_APPROVAL="1")
    assert m.MIN_REVIEW_CYCLES_BEFORE_APPROVAL == 1
    assert m.is_review_approved(review("APPROVED", PROGRAMMER_EVIDENCE), 1, "peer_programmer") is True


def test_review_result_counts_only_at_the_start_of_a_line(orch):
    """A REVIEW_RESULT quoted inside a note is not the reviewer's verdict."""
    text = ("REVIEW_RESULT: REVISE\nREVIEW_NOTES:\n- artifact proposal P1 traceability downstream contract\n"
            "- will say REVIEW_RESULT: APPROVED once the handoff is actionable\n")
    assert orch.reply_verdict("review", text) == "REVISE"
    assert orch.is_review_approved(text, 3, "analyst") is False
    assert orch.reply_verdict("review", "**REVIEW_RESULT:** APPROVED") == "APPROVED"
