"""One judge of a turn's end: decide() names the rule that decided, and a turn's end is that rule's.

Every combination (34,560) of a table of observations (the CLI, whether a reply is awaited, CAO's status
before and after the reply file, the screen's marks, the CLI's record, the agent gone, how long since) is put
to decide(); the wait takes a reply, and names what ended it, by decide()'s rule itself (wait_for_reply returns
`rule.ended_by`). The other questions the loop's callers ask -- the settle check before a prompt, whether a
carried-over turn's agent is at work -- are put the same facts. They never disagree, no turn ends without an
observation that ends it, and each turn-ending row is needed: some facts only it ends.
"""

from __future__ import annotations

import itertools
import time

import pytest

WORKING, DONE, IDLE = (f"\x1b]7501;state={word}:app=codex\x07" for word in ("working", "done", "idle"))
SCREENS = (None, "> plain prompt", f"{WORKING} Working", f"{WORKING}{DONE}{IDLE}", f"{IDLE} > Ask",
           f"{WORKING}{IDLE} > Ask")
FILE = (1_700_000_000, 7)


@pytest.fixture
def m(orch, monkeypatch):
    for name, value in (("QUIET_SCREEN_SECONDS", 5.0), ("FILE_SETTLE_SECONDS", 0.25), ("IDLE_GRACE_SECONDS", 30.0),
                        ("RESPONSE_TIMEOUT", 1800.0), ("AGENT_STALL_SECONDS", 300.0)):
        monkeypatch.setattr(orch, name, value)
    return orch


class FakeClock:
    """The time module with a monotonic clock that moves only when slept on."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds

    def __getattr__(self, name):
        return getattr(time, name)


def observed(m, cli, awaiting, status_before, file, status_after, screen, record, lost):
    """Facts put together the way the wait (or the settle check, `awaiting` False) notes them."""
    facts = m.TurnFacts(started=0.0, guard_since=0.0, cli=m.agent_cli(cli), awaiting=awaiting)
    if status_before:
        facts.note_status(status_before, 1.0)
    facts.note_screen(screen, 1.5)
    if file and awaiting:
        facts.note_file(FILE, 2.0)
    facts.note_screen(screen, 2.5)
    if status_after:
        facts.note_status(status_after, 3.0)
    facts.note_record(record)
    if lost and awaiting:
        facts.note_lost("its CLI exited", left_reply=lost == "left its reply")
    return facts


def every_case(m):
    dimensions = (("claude_code", "codex", "opencode_cli"), (True, False), (None, "idle", "processing", "unknown"),
                  (False, True), (None, "idle", "completed", "processing", "error"), SCREENS, (False, True),
                  ("", "gone", "left its reply"), (3.1, 3.3, 4.0, 8.5))
    for *observations, now in itertools.product(*dimensions):
        yield observations, observed(m, *observations), now


def evidence(case, facts, now):
    """What was observed that can end a turn, by the names of the rows (independent of the table's order)."""
    _, awaiting, status_before, file, status_after, *_ = case
    seen = set()
    if facts.lost and facts.left_reply:
        seen.add("gone")
    if status_after in ("idle", "completed") or (status_before in ("idle", "completed") and not (file and awaiting)):
        seen.add("status")
    if facts.mark in ("ended", "rest"):
        seen.add("mark")
    if facts.screen is not None and now - facts.screen_changed_at >= 2.0:
        seen.add("still")
    if case[6]:
        seen.add("record")
    return seen


def evidence_names(m) -> dict[str, str]:
    """The turn-ending rows' `ended_by`, by the names evidence() gives what was observed."""
    return {m.TURN_ENDED_BY_AGENT_GONE: "gone", m.TURN_ENDED_BY_STATUS: "status", m.TURN_ENDED_BY_MARK: "mark",
            m.TURN_ENDED_BY_STILL_SCREEN: "still", m.TURN_ENDED_BY_RECORD: "record"}


def test_the_judge_and_the_decision_never_disagree(m):
    names = evidence_names(m)
    ended_by_seen, cases = set(), 0
    for case, facts, now in every_case(m):
        cases += 1
        state, rule = m.decide(facts, now)
        assert state is m.turn_state(facts, now) and state in rule.states and rule.applies(facts, now), case
        earlier = m.WAIT_RULES[:m.WAIT_RULES.index(rule)] if rule in m.WAIT_RULES else m.WAIT_RULES
        assert not any(state in other.states and other.applies(facts, now) for other in earlier), case
        assert bool(rule.ended_by) == (rule.verdict is m.Verdict.TAKE_REPLY), case   # a taken reply names its end
        if rule.ended_by:
            ended_by_seen.add(rule.ended_by)
            assert names[rule.ended_by] in evidence(case, facts, now), case                # ... which was observed
            assert facts.mark != "working" or rule.ended_by in (m.TURN_ENDED_BY_AGENT_GONE,   # marks at work outrank
                                                                m.TURN_ENDED_BY_STILL_SCREEN), case  # all but these
        if facts.awaiting and not facts.lost:
            assert not rule.ended_by or facts.file_settled(now), case    # without a whole reply file, never over
        if rule.ended_by == m.TURN_ENDED_BY_STATUS and not facts.cli.ready_status_trusted:
            assert not facts.awaiting and facts.mark == "idle", case     # a ready word its row does not trust
        if not facts.awaiting:
            assert rule.verdict in (m.Verdict.TAKE_REPLY, m.Verdict.WAIT, m.Verdict.ERROR), case
    assert cases == 3 * 2 * 4 * 2 * 5 * len(SCREENS) * 2 * 3 * 4
    assert ended_by_seen == {getattr(m, name) for name in dir(m) if name.startswith("TURN_ENDED_BY_")}


@pytest.mark.parametrize("row", ["TURN_ENDED_BY_AGENT_GONE", "TURN_ENDED_BY_STATUS", "TURN_ENDED_BY_MARK",
                                 "TURN_ENDED_BY_STILL_SCREEN", "TURN_ENDED_BY_RECORD"])
def test_each_turn_ending_row_is_needed_some_facts_end_by_it_alone(m, monkeypatch, row):
    """Each turn-ending row ends some of the table's facts where only its own evidence was observed; without
    the row no other row ends them (a row another one always covers would fail here)."""
    ended_by = getattr(m, row)
    alone = [(case, facts, now) for case, facts, now in every_case(m)
             if m.decide(facts, now)[1].ended_by == ended_by
             and evidence(case, facts, now) == {evidence_names(m)[ended_by]}]
    assert alone, f"no facts end by {row} alone"
    monkeypatch.setattr(m, "WAIT_RULES", tuple(rule for rule in m.WAIT_RULES if rule.ended_by != ended_by))
    for case, facts, now in alone:
        assert not m.decide(facts, now)[1].ended_by, case


def test_claude_code_idle_without_a_reply_file_is_not_a_turn_s_end(m):
    """Idle, no reply file: the wait waits (its grace, then a reminder); no caller calls the turn over."""
    facts = observed(m, "claude_code", True, None, False, "idle", "> plain prompt", False, "")
    state, rule = m.decide(facts, 3.1)
    assert (state, rule.verdict, rule.ended_by) == (m.TurnState.SILENT, m.Verdict.WAIT, "")


def test_the_callers_ask_the_judge_with_the_same_facts(m, monkeypatch):
    """The settle check is at rest, and a carried-over turn's agent not at work, exactly where decide() says so
    of the facts each reads: a status and a screen (error aside: the settle check stops on it)."""
    monkeypatch.setattr(m, "terminal_ids", {"tester": "t1"})
    monkeypatch.setattr(m, "RESPONSE_TIMEOUT", 1.0)             # on a clock that moves only as the loop sleeps,
    monkeypatch.setattr(m, "time", FakeClock())                  # less than any still-screen window
    for cli, status, screen in itertools.product(("claude_code", "codex", "opencode_cli"),
                                                 ("idle", "completed", "processing", "unknown"), SCREENS):
        monkeypatch.setattr(m, "PROVIDER", cli)
        monkeypatch.setattr(m.api, "get_status", lambda terminal_id, status=status: status)
        monkeypatch.setattr(m, "_screen", lambda terminal_id, screen=screen: screen)
        probe = m.TurnFacts(started=0.0, guard_since=0.0, cli=m.agent_cli(cli), awaiting=False)
        probe.note_screen(screen, 0.0)
        probe.note_status(status, 0.0)
        m.settled_terminals.clear()
        try:
            m.wait_until_settled("tester", "t1")
            settled = True
        except m.RunError:
            settled = False
        assert settled == bool(m.decide(probe, 0.0)[1].ended_by), (cli, status, screen)
        carried = m.TurnFacts(started=0.0, guard_since=0.0, cli=m.agent_cli(cli))
        carried.note_status(status, 0.0)
        carried.note_screen(screen, 0.0)
        assert m.at_work("tester") == (m.decide(carried, 0.0)[0] in m.BUSY_STATES), (cli, status, screen)


def test_the_settle_check_takes_cao_s_ready_word_only_where_the_cli_s_row_trusts_it(m, monkeypatch):
    """CAO reads `idle` while Codex works (its row does not trust that word): a resumed Codex whose marks say it
    works is not prompted; Claude Code's `idle` is its turn's end. Codex's own idle mark bears `idle` out."""
    monkeypatch.setattr(m, "RESPONSE_TIMEOUT", 1.0)
    monkeypatch.setattr(m, "time", FakeClock())
    monkeypatch.setattr(m.api, "get_status", lambda terminal_id: "idle")
    for cli, screen, settles in (("codex", f"{WORKING} Working (3s)", False), ("claude_code", "> ", True),
                                 ("codex", f"{IDLE} > Ask Codex", True)):
        monkeypatch.setattr(m, "PROVIDER", cli)
        monkeypatch.setattr(m, "_screen", lambda terminal_id, screen=screen: screen)
        m.settled_terminals.clear()
        if settles:
            m.wait_until_settled("tester", "t1")
        else:
            with pytest.raises(m.RunError, match=r"did not become ready within RESPONSE_TIMEOUT=1s \(status 'idle'; "
                                                 r"its marks: working\)"):
                m.wait_until_settled("tester", "t1")


def test_a_resumed_agent_cao_reads_unknown_after_a_restart_is_prompted_once_its_screen_is_at_rest(m, monkeypatch,
                                                                                                  capsys):
    """After a cao-server restart CAO reads `unknown` for good for a terminal made before it, while the screen
    shows its CLI's idle prompt: the settle check goes by the screen (a still screen, or its idle mark held
    still), within seconds -- never RESPONSE_TIMEOUT (30 min) of silence. One that does wait on (the CLI at work)
    says in the log what it waits for, every PROGRESS_SECONDS (a minute by default)."""
    clock = FakeClock()
    monkeypatch.setattr(m, "time", clock)
    monkeypatch.setattr(m, "PROGRESS_SECONDS", 60.0)
    monkeypatch.setattr(m, "terminal_ids", {"tester": "t1"})
    monkeypatch.setattr(m.api, "get_status", lambda terminal_id: "unknown")
    monkeypatch.setattr(m, "session_name", "s1")
    monkeypatch.setattr(m.api, "session_terminals", lambda session: ["t1"])     # there all along
    for cli, screen in (("claude_code", "> plain prompt"), ("codex", f"{IDLE} > Ask"), ("opencode_cli", "> plain")):
        monkeypatch.setattr(m, "PROVIDER", cli)
        monkeypatch.setattr(m, "_screen", lambda terminal_id, screen=screen: screen)
        m.settled_terminals.clear()
        clock.now = 0.0
        m.wait_until_settled("tester", "t1")
        assert "t1" in m.settled_terminals and clock.now <= 2 * m.QUIET_SCREEN_SECONDS, (cli, clock.now)
    assert "waiting" not in capsys.readouterr().out
    reads = iter(range(10**6))
    monkeypatch.setattr(m, "_screen", lambda terminal_id: f"{WORKING} Working ({next(reads)}s)")
    monkeypatch.setattr(m, "PROVIDER", "codex")
    monkeypatch.setattr(m, "RESPONSE_TIMEOUT", 150.0)
    m.settled_terminals.clear()
    clock.now = 0.0
    with pytest.raises(m.RunError, match=r"RESPONSE_TIMEOUT=150s \(status 'unknown'; its marks: working\)"):
        m.wait_until_settled("tester", "t1")
    notes = [line for line in capsys.readouterr().out.splitlines() if "to be at rest before its prompt" in line]
    assert [note.split("| tester: ")[1] for note in notes] == [
        f"waiting {s}s for terminal t1 to be at rest before its prompt (status 'unknown'; its marks: working)"
        for s in (60, 120)]
