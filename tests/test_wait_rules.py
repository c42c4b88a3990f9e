"""The wait's decision table, one rule at a time, on a fake clock.

decide() is pure: it reads what has been observed of a turn (TurnFacts) and
the time, and names the turn's state and the verdict of the first rule that
applies. Each test puts the facts of one situation together by hand and asks.
The wait loop that feeds real observations in is tested in
test_turn_completion.py and test_robust_handoff.py.
"""

from __future__ import annotations

import pytest

POLL, GRACE, QUIET, SETTLE, TIMEOUT = 2.0, 30.0, 5.0, 0.25, 1800.0   # exact in binary: no rounding at the edges
STALL, PAUSE = 300.0, 60.0
FILE = (1_700_000_000_000_000_000, 42)
PROMPT = "You are the tester (round 2 of 8).\n\nWrite your complete answer to this file: /wd/.tmp/test_result.md"


@pytest.fixture
def m(orch, monkeypatch):
    for name, value in (("POLL_SECONDS", POLL), ("IDLE_GRACE_SECONDS", GRACE), ("QUIET_SCREEN_SECONDS", QUIET),
                        ("FILE_SETTLE_SECONDS", SETTLE), ("RESPONSE_TIMEOUT", TIMEOUT),
                        ("AGENT_STALL_SECONDS", STALL), ("PROVIDER_ERROR_PAUSE_SECONDS", PAUSE)):
        monkeypatch.setattr(orch, name, value)
    return orch


def sent_at_zero(m, prompt_known: bool = True, shown: bool = True, cli=None):
    """A turn whose prompt went out at t=0 (and, by default, showed on the agent's screen at once)."""
    markers = m.prompt_markers(PROMPT) if prompt_known else ()
    facts = m.TurnFacts(started=0.0, guard_since=0.0, markers=markers, prompt_seen=shown and prompt_known)
    facts.cli = cli or facts.cli
    return facts


def codex(m):
    return m.agent_cli("codex")


def marking(m):
    """A CLI whose ready status CAO reads right, and which marks its turns as Codex does."""
    return m.AgentCli("a CLI that marks its turns", turn_marks=m.agent_cli("codex").turn_marks)


def decide(m, facts, now):
    """The state and verdict by name; a reply taken is named by what ended its turn (a TURN_ENDED_BY_* row)."""
    state, rule = m.decide(facts, now)
    if rule.verdict is m.Verdict.TAKE_REPLY:
        return state.name, rule.ended_by
    return state.name, rule.verdict.name


def test_nothing_seen_yet_is_awaiting_a_sign_of_life(m):
    facts = sent_at_zero(m, shown=False)
    assert decide(m, facts, 1.0) == ("AWAITING_SIGN_OF_LIFE", "WAIT")
    facts = sent_at_zero(m, prompt_known=False)      # a carried-over turn: no prompt to look for
    assert decide(m, facts, 1.0) == ("AWAITING_SIGN_OF_LIFE", "WAIT")


def test_a_busy_status_is_working(m):
    facts = sent_at_zero(m)
    facts.note_status("processing", 2.0)
    assert decide(m, facts, 2.0) == ("WORKING", "WAIT")


def test_status_error_fails_the_turn_whatever_else_is_seen(m):
    facts = sent_at_zero(m)
    facts.note_file(FILE, 1.0)
    facts.note_status("error", 5.0)
    assert decide(m, facts, 5.0) == ("FAILED", "ERROR")


def test_a_file_is_settling_until_it_has_been_unchanged_for_file_settle_seconds(m):
    facts = sent_at_zero(m)
    facts.note_status("completed", 2.0)
    facts.note_file(FILE, 3.0)
    assert decide(m, facts, 3.0 + SETTLE / 2) == ("FILE_SETTLING", "WAIT")


def test_a_settled_file_waits_for_a_ready_status_read_after_it_appeared(m):
    facts = sent_at_zero(m)
    facts.note_status("completed", 2.0)             # ready, but before the file: an earlier turn's end
    facts.note_file(FILE, 3.0)
    assert decide(m, facts, 4.0) == ("FILE_SETTLED", "WAIT")
    facts.note_status("completed", 4.0)
    assert decide(m, facts, 4.0) == ("FILE_SETTLED", m.TURN_ENDED_BY_STATUS)


def test_a_settled_file_is_taken_once_the_screen_has_been_still_for_quiet_screen_seconds(m):
    facts = sent_at_zero(m)
    facts.note_status("processing", 2.0)            # CAO stuck at processing
    facts.note_screen("spinner 1", 2.0)
    facts.note_file(FILE, 3.0)
    assert decide(m, facts, 3.0 + QUIET - 0.1) == ("FILE_SETTLED", "WAIT")
    assert decide(m, facts, 3.0 + QUIET) == ("FILE_SETTLED", m.TURN_ENDED_BY_STILL_SCREEN)


def test_a_changing_screen_never_ends_a_turn(m):
    facts = sent_at_zero(m)
    facts.note_status("processing", 2.0)
    facts.note_file(FILE, 3.0)
    for second in range(4, 60):
        facts.note_screen(f"spinner {second}", float(second))
        assert decide(m, facts, second + 0.5) == ("FILE_SETTLED", "WAIT")


def test_a_rewritten_file_starts_its_clocks_again(m):
    facts = sent_at_zero(m)
    facts.note_file(FILE, 3.0)
    facts.note_status("completed", 4.0)
    facts.note_file((FILE[0] + 1, 50), 4.5)           # rewritten after the ready read
    assert decide(m, facts, 4.5 + SETTLE) == ("FILE_SETTLED", "WAIT")


def test_a_prompt_not_on_a_quiet_screen_waits_within_idle_grace(m):
    facts = sent_at_zero(m, shown=False)
    facts.note_status("idle", 2.0)
    facts.note_screen("Trust this folder?\n> 1. Trust and continue", 2.0)
    assert decide(m, facts, GRACE - 0.1) == ("PROMPT_NOT_SHOWN", "WAIT")


def test_a_prompt_not_on_a_quiet_screen_is_sent_again_once_then_the_agent_counts_as_lost(m):
    facts = sent_at_zero(m, shown=False)
    facts.note_status("idle", 2.0)
    facts.note_screen("Trust this folder?", 2.0)
    assert decide(m, facts, GRACE) == ("PROMPT_NOT_SHOWN", "RESEND")
    facts.resend_used = True
    facts.note_sent(GRACE, whole_prompt=True)
    assert decide(m, facts, 2 * GRACE - 0.1) == ("PROMPT_NOT_SHOWN", "WAIT")
    assert decide(m, facts, 2 * GRACE) == ("PROMPT_NOT_SHOWN", "LOST")     # never a reminder first


def test_a_busy_status_and_a_changing_screen_are_no_sign_that_the_prompt_arrived(m):
    """A dialog that takes the prompt's Enter changes the screen, and CAO may read `processing`."""
    facts = sent_at_zero(m, shown=False)
    facts.note_status("processing", 2.0)
    facts.note_screen("Trust this folder?", 2.0)
    facts.note_screen("> Ask Codex to do anything", 3.0)
    assert decide(m, facts, 3.0 + QUIET - 0.1) == ("AWAITING_SIGN_OF_LIFE", "WAIT")
    assert decide(m, facts, GRACE) == ("PROMPT_NOT_SHOWN", "RESEND")


def test_the_prompt_on_screen_is_the_sign_that_it_arrived(m):
    facts = sent_at_zero(m, shown=False)
    facts.note_status("processing", 2.0)
    facts.note_screen("\x1b[1m> You are the tester (round 2 of 8).\x1b[0m\n  Write your complete answer to\n"
                      "  this file: /wd/.tmp/test_result.md\n\u273b Working", 2.0)
    assert facts.prompt_seen
    assert decide(m, facts, GRACE + 10) == ("WORKING", "WAIT")


def test_an_earlier_prompt_on_screen_does_not_count_for_this_one(m):
    assert not m.shows_prompt("> You are the tester (round 1 of 8).", m.prompt_markers("You are the tester "
                                                                                       "(round 2 of 8)."))


def test_a_carried_over_turn_is_reminded_where_a_resend_would_be(m):
    """The prompt of a turn carried over from an earlier process is not at hand: a reminder stands in."""
    facts = sent_at_zero(m, prompt_known=False)
    facts.note_status("idle", 2.0)
    assert decide(m, facts, GRACE) == ("SILENT", "REMIND")


def test_idle_after_working_is_reminded_after_idle_grace(m):
    facts = sent_at_zero(m)
    facts.note_status("processing", 2.0)
    facts.note_status("completed", 10.0)
    assert decide(m, facts, 10.0 + GRACE - 0.1) == ("IDLE_WITHOUT_FILE", "WAIT")
    assert decide(m, facts, 10.0 + GRACE) == ("IDLE_WITHOUT_FILE", "REMIND")


def test_idle_counts_from_the_last_reminder(m):
    facts = sent_at_zero(m)
    facts.note_status("processing", 2.0)
    facts.note_status("completed", 10.0)
    facts.note_sent(40.0)
    facts.seen_working = True                         # e.g. its reply changed
    assert decide(m, facts, 40.0 + GRACE - 0.1) == ("IDLE_WITHOUT_FILE", "WAIT")
    assert decide(m, facts, 40.0 + GRACE) == ("IDLE_WITHOUT_FILE", "REMIND")


def test_unknown_status_is_idle_once_the_screen_is_still(m):
    """After a server restart every status reads `unknown`: the screen tells idle from working."""
    facts = sent_at_zero(m)
    facts.note_status("unknown", 2.0)
    facts.note_screen("working 1", 2.0)
    facts.note_screen("working 2", 3.0)               # a change: it works
    assert decide(m, facts, 3.0 + QUIET - 0.1) == ("WORKING", "WAIT")
    assert decide(m, facts, 3.0 + QUIET) == ("IDLE_WITHOUT_FILE", "WAIT")
    assert decide(m, facts, 3.0 + QUIET + GRACE) == ("IDLE_WITHOUT_FILE", "REMIND")


def test_an_agent_whose_session_or_cli_is_gone_is_lost_at_once(m):
    facts = sent_at_zero(m)
    facts.note_status("processing", 2.0)
    facts.note_file(FILE, 2.5)                     # even with a reply file on the way
    facts.note_lost("its CAO session cao-x is gone")
    assert decide(m, facts, 3.0) == ("LOST", "LOST")


def test_a_gone_agent_that_left_its_reply_complete_has_it_taken(m):
    """A reply written is a reply taken: its agent gone (CAO's status `unknown`, the turn's end never seen),
    the settled, complete reply ends the turn, and the log says so."""
    facts = sent_at_zero(m)
    facts.note_status("unknown", 2.0)
    facts.note_file(FILE, 2.5)
    assert decide(m, facts, 3.0) == ("FILE_SETTLED", "WAIT")
    facts.note_lost("its CAO session cao-x is gone", left_reply=True)
    assert decide(m, facts, 3.0) == ("LOST", m.TURN_ENDED_BY_AGENT_GONE)


def test_a_gone_agent_without_a_complete_reply_is_lost(m):
    """Its reply cut off mid-write (or none): the agent is lost, and the turn goes to a new one."""
    facts = sent_at_zero(m)
    facts.note_file(FILE, 2.5)
    facts.note_lost("its CAO session cao-x is gone", left_reply=False)
    assert decide(m, facts, 3.0) == ("LOST", "LOST")
    facts.note_lost("", left_reply=True)                      # not gone: nothing it left counts
    assert not facts.left_reply


def test_a_working_agent_whose_screen_stays_unchanged_for_agent_stall_seconds_is_lost(m):
    facts = sent_at_zero(m)
    facts.note_status("processing", 2.0)
    facts.note_screen("\u273b Working (3s)", 3.0)
    assert decide(m, facts, 3.0 + STALL - 0.1) == ("WORKING", "WAIT")
    assert decide(m, facts, 3.0 + STALL) == ("WORKING", "LOST")
    facts.note_screen("\u273b Working (304s)", 3.0 + STALL)     # a repaint is a sign of life
    assert decide(m, facts, 3.0 + STALL + 1) == ("WORKING", "WAIT")


def test_an_agent_asking_for_permission_is_not_stalled(m):
    facts = sent_at_zero(m)
    facts.note_screen("Allow this command? (y/n)", 3.0)
    facts.note_status("waiting_user_answer", 3.0)
    assert decide(m, facts, 3.0 + 2 * STALL) == ("WORKING", "WAIT")


def test_a_provider_error_pause_waits_then_tells_the_agent_to_continue(m):
    facts = sent_at_zero(m)
    facts.note_status("processing", 2.0)
    facts.note_status("idle", 10.0)
    facts.provider_errors, facts.provider_pause_until = 1, 10.0 + GRACE + PAUSE
    assert decide(m, facts, 10.0 + GRACE + PAUSE - 0.1) == ("IDLE_WITHOUT_FILE", "WAIT")
    assert decide(m, facts, 10.0 + GRACE + PAUSE) == ("IDLE_WITHOUT_FILE", "CONTINUE")
    facts.note_sent(10.0 + GRACE + PAUSE)
    assert facts.provider_pause_until is None and facts.prompt_seen      # a continue is not a new prompt


def test_response_timeout_stops_a_turn_that_never_ends(m, monkeypatch):
    monkeypatch.setattr(m, "AGENT_STALL_SECONDS", 2 * TIMEOUT)
    facts = sent_at_zero(m)
    facts.note_status("processing", 2.0)
    assert decide(m, facts, TIMEOUT - 0.1) == ("WORKING", "WAIT")
    assert decide(m, facts, TIMEOUT) == ("WORKING", "TIMEOUT")


def test_decide_changes_nothing(m):
    facts = sent_at_zero(m)
    facts.note_status("idle", 2.0)
    before = vars(facts).copy()
    for now in (1.0, GRACE, 2 * GRACE, TIMEOUT):
        m.decide(facts, now)
    assert vars(facts) == before


def test_every_rule_names_states_and_a_verdict(m):
    """The table reads on its own: each row has states, a condition in words and a verdict."""
    for rule in m.WAIT_RULES:
        assert rule.states and rule.condition and isinstance(rule.verdict, m.Verdict)
    assert {rule.verdict for rule in m.WAIT_RULES} == set(m.Verdict)          # every verdict has its rule


# -- what to read, and when ---------------------------------------------------------

def test_status_is_read_once_per_poll(m):
    facts, reads = sent_at_zero(m), m.ReadSchedule(next_status_at=POLL)
    assert not reads.status_due(facts, POLL - 0.01)
    assert reads.status_due(facts, POLL)
    reads.status_read(POLL)
    assert not reads.status_due(facts, 2 * POLL - 0.01)


def read(facts, reads, now, status="processing", screen=None):
    """One status read (and screen read, when given) at `now`, as observe_terminal does."""
    reads.status_read(now)
    facts.note_status(status, now)
    if screen is not None:
        facts.note_screen(screen, now)


def test_a_settled_file_is_asked_about_at_once_then_every_confirm_read_seconds(m):
    """The next agent waits on this turn's end: once its file has settled the agent is asked at once
    whether it has finished, then every CONFIRM_READ_SECONDS, not once per POLL_SECONDS."""
    facts, reads = sent_at_zero(m), m.ReadSchedule(next_status_at=POLL)
    facts.note_file(FILE, 0.5)
    assert not reads.status_due(facts, 0.5 + SETTLE / 2)
    assert reads.next_look_at(facts, 0.5) == pytest.approx(0.5 + SETTLE)
    assert reads.status_due(facts, 0.5 + SETTLE)
    read(facts, reads, 0.5 + SETTLE)
    confirm = m.CONFIRM_READ_SECONDS
    assert not reads.status_due(facts, 0.5 + SETTLE + confirm - 0.01)
    assert reads.next_look_at(facts, 0.5 + SETTLE) == pytest.approx(0.5 + SETTLE + confirm)
    assert reads.status_due(facts, 0.5 + SETTLE + confirm)
    read(facts, reads, 0.5 + SETTLE + confirm, status="completed")
    assert decide(m, facts, 0.5 + SETTLE + confirm) == ("FILE_SETTLED", m.TURN_ENDED_BY_STATUS)
    assert reads.confirm_read_at(facts, 0.5 + SETTLE + confirm) is None          # nothing left to ask


def test_quick_reads_last_quiet_screen_seconds_then_the_usual_pace_returns(m):
    """An agent that goes on working after writing its file is not asked twice a second for long."""
    facts, reads = sent_at_zero(m), m.ReadSchedule(next_status_at=POLL)
    facts.note_file(FILE, 0.5)
    now, quick = 0.5 + SETTLE, 0
    while now < 60.0:
        if reads.status_due(facts, now):
            quick += now < reads.next_status_at
            read(facts, reads, now, screen=f"spinner {now}")
        now += 0.05
    assert quick <= QUIET / m.CONFIRM_READ_SECONDS + 1
    assert reads.confirm_read_at(facts, 60.0) is None


def test_a_settled_file_s_turn_reads_its_cli_s_record_between_status_reads_where_it_is_read_here(m):
    """The CLI's own record tells the turn's end: read every RECORD_READ_SECONDS (a local file read) while a
    settled file waits, a status read only every CONFIRM_READ_SECONDS; never without records here."""
    facts, reads = sent_at_zero(m), m.ReadSchedule(next_status_at=POLL, records=True)
    facts.note_file(FILE, 0.5)
    settled = 0.5 + SETTLE
    assert not reads.record_due(facts, settled - 0.01)
    read(facts, reads, settled)                                     # the status read at once ...
    reads.record_read(settled)                                      # ... reads the record too
    step = m.RECORD_READ_SECONDS
    assert reads.next_look_at(facts, settled) == pytest.approx(settled + step)
    assert not reads.record_due(facts, settled + step - 0.01) and reads.record_due(facts, settled + step)
    assert not reads.status_due(facts, settled + step)              # no call to the server for it
    reads.record_read(settled + step)
    facts.note_record(True)                                         # the record shows the turn over
    assert decide(m, facts, settled + step) == ("FILE_SETTLED", m.TURN_ENDED_BY_RECORD)
    without = m.ReadSchedule(next_status_at=POLL)
    facts = sent_at_zero(m)
    facts.note_file(FILE, 0.5)
    read(facts, without, settled)
    assert without.record_read_at(facts, settled) is None
    assert without.next_look_at(facts, settled) == pytest.approx(settled + m.CONFIRM_READ_SECONDS)


def test_record_reads_stop_with_the_quick_reads(m):
    facts, reads = sent_at_zero(m), m.ReadSchedule(next_status_at=POLL, records=True)
    facts.note_file(FILE, 0.5)
    now, record_reads = 0.5 + SETTLE, 0
    while now < 60.0:
        if reads.status_due(facts, now):
            read(facts, reads, now, screen=f"spinner {now}")
            reads.record_read(now)
        elif reads.record_due(facts, now):
            record_reads += 1
            reads.record_read(now)
        now += 0.01
    assert record_reads <= QUIET / m.RECORD_READ_SECONDS + 1
    assert reads.record_read_at(facts, 60.0) is None


def test_a_rewritten_file_is_asked_about_at_once_when_it_settles_again(m):
    facts, reads = sent_at_zero(m), m.ReadSchedule(next_status_at=POLL)
    facts.note_file(FILE, 0.5)
    read(facts, reads, 0.5 + SETTLE)
    facts.note_file((FILE[0] + 1, 43), 0.8)
    assert not reads.status_due(facts, 0.8 + SETTLE / 2)
    assert reads.status_due(facts, 0.8 + SETTLE)


# -- an agent CLI that marks the end of its turn on its screen (Codex) ---------------

WORKING_MARK, DONE_MARK, IDLE_MARK = ("\x1b]7501;state=working:app=codex\x07", "\x1b]7501;state=done:app=codex\x07",
                                      "\x1b]7501;state=idle:app=codex\x07")


def test_the_newest_turn_state_mark_on_a_screen_decides(m):
    assert m.turn_mark(None, codex(m)) is None and m.turn_mark("plain text, no marks", codex(m)) is None
    assert m.turn_mark("\x1b]0;state=done\x07", codex(m)) is None                       # another escape's text
    assert m.turn_mark(f"> prompt{WORKING_MARK} Working (2s - esc to interrupt)", codex(m)) == "working"
    assert m.turn_mark(f"{WORKING_MARK} Working{DONE_MARK} Worked for 3s{IDLE_MARK}", codex(m)) == "ended"
    assert m.turn_mark(f"{WORKING_MARK}{DONE_MARK}", codex(m)) == "ended"
    assert m.turn_mark(f"{IDLE_MARK}{WORKING_MARK} again", codex(m)) == "working"


def test_a_cli_marked_working_outranks_a_stale_ready_status(m):
    """CAO answers `completed` left over from before, while Codex's screen says it works on a draft:
    the draft is not taken, and the agent does not count as idle."""
    facts = sent_at_zero(m, cli=marking(m))
    facts.note_file(FILE, 3.0)
    facts.note_status("completed", 3.0 + SETTLE)
    assert m.ReadSchedule.screen_due(facts, 3.0 + SETTLE)                 # the screen may say otherwise
    facts.note_screen(f"{WORKING_MARK} Working (1s)", 3.0 + SETTLE)
    assert decide(m, facts, 3.0 + SETTLE) == ("FILE_SETTLED", "WAIT")
    facts = sent_at_zero(m, cli=marking(m))
    facts.note_status("completed", 2.0)
    facts.note_screen(f"{WORKING_MARK} Working (2s)", 2.0)
    facts.note_screen(f"{WORKING_MARK} Working (40s)", 40.0)
    assert decide(m, facts, 2.0 + GRACE + 10) == ("WORKING", "WAIT")         # never reminded while it works


def test_a_working_mark_pushed_off_the_screen_still_stands(m):
    """CAO's screen is the tail of what Codex printed: its spinner, redrawn many times a second, can push the
    working mark out of it while the CLI works on past a draft. With CAO's stale `completed`, the draft is
    still not taken, nor is the agent idle; the end mark, when it shows, ends the turn."""
    facts = sent_at_zero(m, cli=marking(m))
    facts.note_screen(f"{WORKING_MARK} Working (1s)", 1.0)
    facts.note_file(FILE, 3.0)
    facts.note_status("completed", 3.0 + SETTLE)
    facts.note_screen(" Working (3s)" * 50, 3.0 + SETTLE)                       # no mark left on the screen
    assert decide(m, facts, 3.0 + SETTLE) == ("FILE_SETTLED", "WAIT")
    assert not facts.is_idle(3.0 + SETTLE)
    facts.note_file((FILE[0] + 1, 50), 5.0)                                      # the final answer
    facts.note_screen(f" Working (5s){DONE_MARK}{IDLE_MARK} > Ask Codex", 5.0 + SETTLE)
    assert decide(m, facts, 5.0 + SETTLE) == ("FILE_SETTLED", m.TURN_ENDED_BY_MARK)


def test_a_settled_file_is_taken_once_the_cli_marks_its_turn_ended_though_cao_says_processing(m):
    facts = sent_at_zero(m, cli=marking(m))
    facts.note_status("processing", 2.0)
    facts.note_screen(f"{WORKING_MARK} Working", 2.0)
    facts.note_file(FILE, 3.0)
    facts.note_screen(f"{WORKING_MARK} Working (3s){DONE_MARK}{IDLE_MARK} > Ask Codex", 3.0 + SETTLE)
    facts.note_status("processing", 3.0 + SETTLE)
    assert decide(m, facts, 3.0 + SETTLE) == ("FILE_SETTLED", m.TURN_ENDED_BY_MARK)               # not QUIET seconds later


def test_a_settled_file_is_taken_once_the_cli_s_own_record_says_its_turn_ended(m):
    """The CLI's record (its transcript, rollout or database) says the turn is over: no still screen waited for,
    whatever CAO's status says."""
    facts = sent_at_zero(m, cli=marking(m))
    facts.cli = m.AGENT_CLIS["opencode_cli"]                  # CAO's ready word not trusted, 2 s of still screen
    facts.note_status("processing", 2.0)
    facts.note_file(FILE, 3.0)
    facts.note_record(False)                                  # a draft: the CLI works on
    assert decide(m, facts, 3.0 + SETTLE) == ("FILE_SETTLED", "WAIT")
    facts.note_record(True)
    assert decide(m, facts, 3.5) == ("FILE_SETTLED", m.TURN_ENDED_BY_RECORD)


def test_a_record_read_before_the_file_changed_counts_only_when_read_again(m):
    facts = sent_at_zero(m, cli=marking(m))
    facts.note_file(FILE, 3.0)
    facts.note_record(True)
    facts.note_file((FILE[0] + 1, 50), 4.0)                   # rewritten after that read: the agent was at work
    assert decide(m, facts, 4.0 + SETTLE) == ("FILE_SETTLED", "WAIT")
    facts.note_record(True)
    assert decide(m, facts, 4.5) == ("FILE_SETTLED", m.TURN_ENDED_BY_RECORD)


def test_a_cli_still_marked_working_keeps_a_settled_file_waiting(m):
    """The CLI wrote a draft and works on: its newest mark says working, so the file is not final yet."""
    facts = sent_at_zero(m, cli=marking(m))
    facts.note_status("processing", 2.0)
    facts.note_file(FILE, 3.0)
    for second in range(4, 4 + int(QUIET)):
        facts.note_screen(f"{WORKING_MARK} Working ({second}s)", float(second))
        assert decide(m, facts, float(second)) == ("FILE_SETTLED", "WAIT")


def test_an_end_mark_seen_before_the_file_changed_counts_only_when_seen_again(m):
    facts = sent_at_zero(m, cli=marking(m))
    facts.note_file(FILE, 3.0)
    facts.note_screen(f"{WORKING_MARK}{DONE_MARK}", 3.5)
    facts.note_file((FILE[0] + 1, 50), 4.0)                          # rewritten after that read
    assert decide(m, facts, 4.0 + SETTLE) == ("FILE_SETTLED", "WAIT")
    facts.note_screen(f"{WORKING_MARK}{DONE_MARK}", 4.0 + SETTLE)
    assert decide(m, facts, 4.0 + SETTLE) == ("FILE_SETTLED", m.TURN_ENDED_BY_MARK)


def test_an_end_mark_without_a_file_is_idle_and_reminded_after_idle_grace(m):
    """CAO says processing for good, but Codex marked its turn ended with no file written: reminded after
    IDLE_GRACE_SECONDS from the mark, not left until AGENT_STALL_SECONDS counts it lost."""
    facts = sent_at_zero(m, cli=marking(m))
    facts.note_status("processing", 2.0)
    facts.note_screen(f"> {PROMPT}{WORKING_MARK} Working", 2.0)
    facts.note_screen(f"> {PROMPT}{WORKING_MARK} Working{DONE_MARK}{IDLE_MARK}", 10.0)
    facts.note_status("processing", 12.0)
    assert decide(m, facts, 10.0 + GRACE - 0.1) == ("IDLE_WITHOUT_FILE", "WAIT")
    assert decide(m, facts, 10.0 + GRACE) == ("IDLE_WITHOUT_FILE", "REMIND")
    facts.note_sent(10.0 + GRACE)                          # the reminder clears the mark
    assert facts.marked_idle_at is None
    assert decide(m, facts, 10.0 + GRACE + 1) == ("WORKING", "WAIT")


def test_a_cli_whose_row_names_no_turn_marks_has_none_read(m):
    """Codex's marks on the screen of a CLI without `turn_marks` say nothing: its settled file waits for its
    own confirmations (here CAO's ready status), not for a `done` it never prints."""
    facts = sent_at_zero(m)
    facts.note_status("processing", 2.0)
    facts.note_file(FILE, 3.0)
    facts.note_screen(f"{WORKING_MARK} Working{DONE_MARK}{IDLE_MARK}", 3.0 + SETTLE)
    assert facts.mark is None and m.turn_marks_on(f"{WORKING_MARK}{DONE_MARK}", facts.cli) == []
    assert decide(m, facts, 3.0 + SETTLE) == ("FILE_SETTLED", "WAIT")
    facts.note_status("completed", 3.5)
    assert decide(m, facts, 3.5) == ("FILE_SETTLED", m.TURN_ENDED_BY_STATUS)


def test_every_way_a_turn_ends_is_a_row_of_its_own(m):
    """The table says which confirmation ends a turn: each TURN_ENDED_BY_* is one row taking the reply (each
    row's own test above fails without it), and no row takes a reply without naming what ended the turn."""
    taking = [rule for rule in m.WAIT_RULES if rule.verdict is m.Verdict.TAKE_REPLY]
    assert all(rule.ended_by for rule in taking)
    assert sorted(rule.ended_by for rule in taking) == sorted(
        getattr(m, name) for name in dir(m) if name.startswith("TURN_ENDED_BY_"))


def test_a_terminal_at_rest_after_a_turn_is_over_by_its_marks_without_a_file(m):
    """What the settle check asks of a terminal about to be prompted: idle after a `done`, or after a turn this
    run saw it answer, is at rest; its start-up's idle is not, nor a mark that it works."""
    after_own_task = f"{WORKING_MARK}{DONE_MARK}{IDLE_MARK}{WORKING_MARK}{IDLE_MARK}"
    for screen, answered_before, over in ((after_own_task, False, m.TURN_ENDED_BY_MARK),
                                          (f"{WORKING_MARK}{IDLE_MARK}", True, m.TURN_ENDED_BY_MARK),
                                          (f"{WORKING_MARK}{IDLE_MARK}", False, ""),
                                          (f"{DONE_MARK}{WORKING_MARK} Working", True, "")):
        facts = m.TurnFacts(started=0.0, guard_since=0.0, cli=codex(m), answered_before=answered_before,
                            awaiting=False)
        facts.note_status("processing", 1.0)
        facts.note_screen(screen, 1.0)
        assert m.decide(facts, 1.0)[1].ended_by == over, screen


def test_only_a_done_after_the_newest_working_mark_ends_a_turn(m):
    """Codex marks its start-up too: `idle` once loaded, `working` then `idle` around a task of its own.
    Those say it is idle, not that a turn has ended; `done` does, even with the `working` scrolled out."""
    assert m.turn_mark(IDLE_MARK, codex(m)) == "idle"
    assert m.turn_mark(f"{IDLE_MARK}{WORKING_MARK}{IDLE_MARK} tab to queue message", codex(m)) == "idle"
    assert m.turn_mark(f"{IDLE_MARK}{WORKING_MARK}{IDLE_MARK}{WORKING_MARK} Working", codex(m)) == "working"
    assert m.turn_mark(f"{IDLE_MARK}{WORKING_MARK} Working{DONE_MARK}{IDLE_MARK}", codex(m)) == "ended"
    assert m.turn_mark(f" Working (9s){DONE_MARK}{IDLE_MARK} > Ask Codex", codex(m)) == "ended"


def codex_turn(m, shown: bool = True):
    """A turn of Codex, whose ready status CAO misreads: only its own marks, or a still screen, end it."""
    facts = sent_at_zero(m, shown=shown)
    facts.cli = m.agent_cli("codex")
    return facts


def test_a_draft_of_a_codex_that_got_its_prompt_while_loading_is_not_taken(m):
    """On a loaded machine CAO took Codex for ready while it still loaded, and the analyst's first prompt
    went out: after CAO cleared the screen for it, Codex printed its start-up marks (`idle`, then `working`
    and `idle` around a task of its own) and CAO answered `idle`, left over from the start-up, through
    the turn. When the draft had settled, CAO's copy of the screen did not show the turn's own `working`
    yet: the draft was taken. Neither that status nor those marks end the turn; Codex's `done` does."""
    facts = codex_turn(m, shown=False)
    pasted = "\u203a [Pasted Content 1701 chars]"
    facts.note_status("idle", POLL)
    facts.note_screen(f"{IDLE_MARK}{pasted}", POLL)
    assert decide(m, facts, POLL) == ("PROMPT_NOT_SHOWN", "WAIT")
    facts.note_file(FILE, 2.5)                                                   # the draft
    facts.note_status("idle", 2.5 + SETTLE)
    facts.note_screen(f"{IDLE_MARK}{WORKING_MARK}{IDLE_MARK}{pasted} tab to queue message", 2.5 + SETTLE)
    assert decide(m, facts, 2.5 + SETTLE) == ("FILE_SETTLED", "WAIT")
    turn = f"{IDLE_MARK}{WORKING_MARK}{IDLE_MARK}{WORKING_MARK}\u203a {PROMPT}\n\u2022 Working (1s)"
    facts.note_status("idle", 3.0 + SETTLE)
    facts.note_screen(turn, 3.0 + SETTLE)
    assert decide(m, facts, 3.0 + SETTLE) == ("FILE_SETTLED", "WAIT")
    facts.note_file((FILE[0] + 1, 50), 4.5)                                      # the final answer
    facts.note_status("idle", 4.5 + SETTLE)
    facts.note_screen(f"{turn}\n\u2022 Ran cat > summary.md{DONE_MARK}{IDLE_MARK}\u203a Ask Codex", 4.5 + SETTLE)
    assert decide(m, facts, 4.5 + SETTLE) == ("FILE_SETTLED", m.TURN_ENDED_BY_MARK)


def test_a_codex_draft_under_a_stale_idle_status_waits_for_a_still_screen_when_no_mark_shows(m):
    """CAO's screen without any of Codex's marks (its copy of the pane lagging) and its `idle` left over:
    the draft waits; a screen still for QUIET_SCREEN_SECONDS ends the turn."""
    facts = codex_turn(m)
    facts.note_file(FILE, 1.0)
    for tick in range(8):
        now = 1.0 + SETTLE + tick / 2
        facts.note_status("idle", now)
        facts.note_screen(f"\u203a {PROMPT}\n\u2022 Working ({tick}s \u2022 esc to interrupt)", now)
        assert decide(m, facts, now) == ("FILE_SETTLED", "WAIT")
    last_change = 1.0 + SETTLE + 7 / 2
    assert decide(m, facts, last_change + QUIET - 0.5) == ("FILE_SETTLED", "WAIT")
    assert decide(m, facts, last_change + QUIET) == ("FILE_SETTLED", m.TURN_ENDED_BY_STILL_SCREEN)


# -- an agent CLI whose ready status CAO misreads (OpenCode) -----------------------

def opencode_turn(m):
    """A turn of a CLI that CAO reports ready while it works: its ready status counts for nothing."""
    facts = sent_at_zero(m)
    facts.cli = m.agent_cli("opencode_cli")
    return facts


def test_opencode_is_the_cli_whose_ready_status_is_not_trusted(m):
    assert not m.agent_cli("opencode_cli").ready_status_trusted
    assert not m.agent_cli("copilot_cli").ready_status_trusted         # the same for Copilot CLI
    assert not m.agent_cli("hermes").ready_status_trusted              # and Hermes Agent
    assert not m.agent_cli("codex").ready_status_trusted               # and Codex (its own marks count)
    assert m.agent_cli("claude_code").ready_status_trusted and m.agent_cli("mock_cli").ready_status_trusted


def test_a_settled_file_of_a_cli_reported_ready_while_it_works_waits_for_a_still_screen(m):
    """CAO says `completed` while OpenCode, having written a draft, repaints its busy bar: the draft is not
    taken; once the screen has been still for the CLI's window, the file is."""
    window = m.agent_cli("opencode_cli").still_screen_ends_turn
    facts = opencode_turn(m)
    facts.note_file(FILE, 3.0)
    for tick in range(0, 20):                                   # a frame every 0.25 s for 5 s
        now = 3.0 + SETTLE + tick / 4
        facts.note_status("completed", now)
        facts.note_screen(f"busy bar frame {tick}", now)
        assert decide(m, facts, now) == ("FILE_SETTLED", "WAIT")
    last_frame = 3.0 + SETTLE + 19 / 4
    assert decide(m, facts, last_frame + window - 0.01) == ("FILE_SETTLED", "WAIT")
    assert decide(m, facts, last_frame + window) == ("FILE_SETTLED", m.TURN_ENDED_BY_STILL_SCREEN)
    assert window < QUIET                                       # sooner than a CLI judged by QUIET_SCREEN_SECONDS


def test_the_same_facts_with_a_trusted_ready_status_take_the_file_at_once(m):
    facts = sent_at_zero(m)
    facts.note_file(FILE, 3.0)
    facts.note_status("completed", 3.0 + SETTLE)
    facts.note_screen("busy bar frame 0", 3.0 + SETTLE)
    assert decide(m, facts, 3.0 + SETTLE) == ("FILE_SETTLED", m.TURN_ENDED_BY_STATUS)


def test_a_cli_reported_ready_while_it_works_is_not_reminded_while_its_screen_moves(m):
    """No file yet, CAO says `completed` for the whole turn: the agent counts as working while its screen
    changes, and is reminded only IDLE_GRACE_SECONDS after its screen went still."""
    facts = opencode_turn(m)
    for second in range(1, 61):
        facts.note_status("completed", float(second))
        facts.note_screen(f"busy bar frame {second}", float(second))
        assert decide(m, facts, float(second)) == ("WORKING", "WAIT")
    facts.note_status("completed", 61.0)
    assert decide(m, facts, 60.0 + QUIET + GRACE - 0.1) == ("IDLE_WITHOUT_FILE", "WAIT")
    assert decide(m, facts, 60.0 + QUIET + GRACE) == ("IDLE_WITHOUT_FILE", "REMIND")
    assert facts.cao_status == "completed"                      # what CAO said is kept for the progress line


def test_whether_the_agent_is_there_is_asked_every_liveness_check_with_or_without_a_file(m):
    """A gone agent is never waited on: its session is asked after in every state of the wait, also once a
    reply file is there and the turn's end is awaited."""
    reads = m.ReadSchedule(next_status_at=POLL, next_liveness_at=5.0)
    assert not reads.liveness_due(4.9)
    assert reads.liveness_due(5.0)
    assert not reads.liveness_due(5.0 + m.LIVENESS_CHECK_SECONDS - 0.1)
    assert reads.liveness_due(5.0 + m.LIVENESS_CHECK_SECONDS)     # whatever the facts: the file is not asked


def test_the_screen_is_read_with_each_status_until_the_prompt_shows(m):
    facts = sent_at_zero(m, shown=False)
    facts.note_status("processing", 2.0)
    assert m.ReadSchedule.screen_due(facts, 2.0)
    facts.note_screen("> " + PROMPT, 2.0)
    assert not m.ReadSchedule.screen_due(facts, 4.0)


def test_the_screen_is_read_only_while_the_status_cannot_end_the_turn(m):
    facts = sent_at_zero(m)
    facts.note_status("processing", 2.0)
    assert not m.ReadSchedule.screen_due(facts, 2.0)
    facts.note_status("unknown", 4.0)
    assert m.ReadSchedule.screen_due(facts, 4.0)
    facts.note_status("processing", 6.0)
    assert not m.ReadSchedule.screen_due(facts, 6.0)
    facts.note_file(FILE, 6.0)
    assert m.ReadSchedule.screen_due(facts, 6.0 + SETTLE)


def test_an_agent_idle_without_its_file_has_its_screen_read_with_each_status(m):
    """Before a reminder: the screen may say why it stopped (its conversation compacted, a usage limit)."""
    facts = sent_at_zero(m)
    facts.note_status("completed", 2.0)
    assert m.ReadSchedule.screen_due(facts, 2.0)
    facts.note_status("processing", 4.0)
    assert not m.ReadSchedule.screen_due(facts, 4.0)


# -- permission prompts -------------------------------------------------------------

def test_permission_prompt_is_reported_once_without_auto_accept(m):
    m.AUTO_ACCEPT_PERMISSIONS = False
    answers = m.PermissionAnswers()
    assert answers.next_step(0.0) == "tell"
    answers.told_blocked = True
    assert answers.next_step(100.0) == ""


def test_permission_answers_are_spaced_and_capped(m):
    m.AUTO_ACCEPT_PERMISSIONS = True
    answers = m.PermissionAnswers()
    assert answers.next_step(0.0) == "answer"
    answers.answered, answers.last_answer_at = 1, 0.0
    assert answers.next_step(m.PERMISSION_ANSWER_INTERVAL - 0.1) == ""
    assert answers.next_step(m.PERMISSION_ANSWER_INTERVAL) == "answer"
    answers.answered = m.MAX_PERMISSION_ANSWERS
    assert answers.next_step(1000.0) == "tell"


# -- is the agent still there? --------------------------------------------------------

@pytest.mark.parametrize("last_line", ["bash-5.2# ", "bash-5.2$", "sh-5.2# ", "root@build-7:/srv/project# ",
                                       "dev@laptop:~/work$ ", "(venv) dev@laptop:~/work$", "user@host ~/p> "])
def test_a_shell_prompt_on_the_last_line_means_the_cli_exited(m, last_line):
    screen = f"\x1b[1m\u273b Working\x1b[0m\r\nKilled\r\n\x1b[?2004h{last_line}"
    assert m.shows_shell_prompt(screen)
    assert m.last_screen_line(screen) == last_line.strip()


@pytest.mark.parametrize("last_line", ["\u276f ", "\u203a Ask Codex to do anything", "# Summary", "RESULT: PASS",
                                       "  \u23f5\u23f5 bypass permissions on (shift+tab to cycle)", "$5.00 spent",
                                       "> MOCK: #3 tester turn 1: wrote test_result.md"])
def test_an_agent_cli_screen_is_not_a_shell_prompt(m, last_line):
    assert not m.shows_shell_prompt(f"some output\n{last_line}")


def test_the_prompt_is_found_on_screen_however_the_cli_wraps_and_colours_it(m):
    prompt = "You are the tester (round 2 of 8).\n\nRules: ...\nWrite your complete answer to this file: /wd/.tmp/t.md"
    wrapped = "\x1b[2m> \x1b[0mYou are the tester\x1b[1C(round\r\n  2 of 8).\r\n"
    assert m.shows_prompt(wrapped, m.prompt_markers(prompt))
    assert m.shows_prompt("  Write your complete answer to this file:\n    /wd/.tmp/t.md", m.prompt_markers(prompt))


# -- the progress line (PROGRESS_SECONDS): what the loop sees of a turn under way ----------------------

def test_progress_names_the_time_the_screen_the_status_and_the_missing_file(m):
    facts = sent_at_zero(m)
    facts.note_status("processing", 58.0)
    facts.note_screen("· thinking (58s)", 58.0)
    assert m.progress_text(facts, 0.0, 60.0) == \
        "working for 1m 0s; screen changing; CAO status processing; no response file yet"


def test_progress_says_how_long_the_screen_has_been_still_and_that_a_file_is_settling(m):
    facts = sent_at_zero(m)
    facts.note_screen("done", 10.0)
    facts.note_status("completed", 60.0)
    facts.note_file(FILE, 115.0)
    assert m.progress_text(facts, 0.0, 120.0) == \
        "working for 2m 0s; screen still for 1m 50s; CAO status completed; response file written 5s ago, settling"


def test_progress_says_when_the_prompt_has_not_shown_on_the_screen(m):
    facts = sent_at_zero(m, shown=False)
    facts.note_screen("Trust this folder?", 1.0)
    assert m.progress_text(facts, 0.0, 3700.0).startswith(
        "working for 1h 1m; its screen does not show the prompt yet; screen still for 1h 1m")


def test_a_copilot_draft_is_not_taken_while_its_spinner_turns(m):
    """Copilot CLI's status bar spinner turns four times a second while it works; CAO may say `idle` or
    `completed` meanwhile. A settled draft is not taken while the screen moves, and is once it has been
    still for Copilot's window."""
    window = m.agent_cli("copilot_cli").still_screen_ends_turn
    facts = sent_at_zero(m)
    facts.cli = m.agent_cli("copilot_cli")
    facts.note_file(FILE, 1.0)
    for tick in range(12):                                      # ◎ / ◉ Working, every 0.25 s for 3 s
        now = 1.0 + SETTLE + tick / 4
        facts.note_status("idle" if tick < 6 else "processing", now)
        facts.note_screen(f"Autopilot · Allow All · {'◎◉'[tick % 2]} Working esc esc interrupt", now)
        assert decide(m, facts, now) == ("FILE_SETTLED", "WAIT")
    last_frame = 1.0 + SETTLE + 11 / 4
    facts.note_status("completed", last_frame + 0.5)
    assert decide(m, facts, last_frame + window - 0.01) == ("FILE_SETTLED", "WAIT")
    assert decide(m, facts, last_frame + window) == ("FILE_SETTLED", m.TURN_ENDED_BY_STILL_SCREEN)


def test_a_resumed_codex_at_rest_after_a_task_of_its_own_is_settled_whatever_cao_says(m, monkeypatch):
    """After its turn (`done`) Codex may run a task of its own (a title), marked `working`, then `idle`: a
    resumed run's first prompt to it goes out, though CAO reads `processing` for good."""
    screen = f"{WORKING_MARK} Working{DONE_MARK}{IDLE_MARK} > {WORKING_MARK}{IDLE_MARK} > Ask Codex"
    monkeypatch.setattr(m.api, "get_status", lambda terminal_id: "processing")
    monkeypatch.setattr(m, "_screen", lambda terminal_id: screen)
    monkeypatch.setattr(m, "RESPONSE_TIMEOUT", 0.5)
    m.wait_until_settled("peer_programmer", "t-peer")
    assert "t-peer" in m.settled_terminals
    for not_at_rest in (f"{WORKING_MARK} Working (3s)",                    # at work
                        f"{IDLE_MARK}{WORKING_MARK}{IDLE_MARK} > Ask Codex"):  # its start-up: no turn ended yet
        monkeypatch.setattr(m, "_screen", lambda terminal_id, text=not_at_rest: text)
        with pytest.raises(m.RunError, match="did not become ready within RESPONSE_TIMEOUT"):
            m.wait_until_settled("tester", "t-tester")


def test_a_resumed_codex_whose_marks_left_the_screen_is_settled_once_its_screen_is_still(m, monkeypatch):
    """CAO's screen is the tail of what the pane printed: Codex's marks may have left it (or a task of its own
    left a `working` behind) while Codex waits for input. A screen still for QUIET_SCREEN_SECONDS then says it
    is at rest; a screen that changes (Codex at work counts its seconds) or its start-up's marks do not, nor a
    still screen of a CLI whose ready status CAO reads right (CAO's word stands)."""
    monkeypatch.setattr(m.api, "get_status", lambda terminal_id: "processing")
    for name, value in (("QUIET_SCREEN_SECONDS", 0.2), ("POLL_SECONDS", 0.05), ("RESPONSE_TIMEOUT", 1.0)):
        monkeypatch.setattr(m, name, value)
    for still in ("> Ask Codex to do anything", f"{DONE_MARK}{IDLE_MARK}{WORKING_MARK} > Ask Codex"):
        monkeypatch.setattr(m, "_screen", lambda terminal_id, text=still: text)
        m.settled_terminals.clear()
        m.wait_until_settled("tester", "t-tester")
        assert "t-tester" in m.settled_terminals, still
    reads = iter(range(10**6))
    at_work = lambda terminal_id: f"{WORKING_MARK} Working ({next(reads)}s)"    # noqa: E731
    starting = lambda terminal_id: f"{IDLE_MARK} > Ask Codex"                    # noqa: E731
    for screen in (at_work, starting):
        monkeypatch.setattr(m, "_screen", screen)
        m.settled_terminals.clear()
        with pytest.raises(m.RunError, match=r"did not become ready within RESPONSE_TIMEOUT=1s \(status "
                                             r"'processing'; its marks: (working|idle)\)"):
            m.wait_until_settled("tester", "t-tester")
    monkeypatch.setattr(m, "PROVIDER", "claude_code")
    monkeypatch.setattr(m, "_screen", lambda terminal_id: "> Try \"fix lint errors\"")
    m.settled_terminals.clear()
    with pytest.raises(m.RunError, match=r"did not become ready within RESPONSE_TIMEOUT=1s \(status 'processing'\)"):
        m.wait_until_settled("tester", "t-tester")


def test_a_resumed_codex_that_answered_before_is_settled_though_its_done_left_the_screen(m, monkeypatch):
    """A task of its own after its turn (`working`, then `idle`) can push the turn's `done` out of CAO's screen,
    which is the tail of what the pane printed: seen in CI, the resumed run waited RESPONSE_TIMEOUT ('its marks:
    working, idle'). An agent that has answered a turn of this run is past its start-up: idle is at rest. One
    that has not is still waited for (idle then may be its start-up)."""
    screen = f"{WORKING_MARK}{IDLE_MARK} > Ask Codex to do anything"
    monkeypatch.setattr(m.api, "get_status", lambda terminal_id: "processing")
    monkeypatch.setattr(m, "_screen", lambda terminal_id: screen)
    monkeypatch.setattr(m, "RESPONSE_TIMEOUT", 0.5)
    m.update_run(turn_records=[m.TurnRecord("programmer", 1, 3.0, 100, terminal="t-programmer")])
    m.wait_until_settled("programmer", "t-programmer")
    assert "t-programmer" in m.settled_terminals
    with pytest.raises(m.RunError, match=r"did not become ready within RESPONSE_TIMEOUT=0.5s \(status 'processing'; "
                                         r"its marks: working, idle\)"):
        m.wait_until_settled("tester", "t-tester")
