"""Long runs: a compacted conversation gets its full text again, a usage limit is waited out.

The wait's new rules are tested one at a time on a fake clock (as in
test_wait_rules.py); what the screens of Claude Code and Codex say is read by
pure functions; the loop's behaviour is driven through main() against the
respx fake CAO, whose agents show those words on their screens.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from conftest import FAST, TASK_PROMPT, run_main
from fake_cao import FAIL_REPLY, PASS_REPLY

QUICK = {**FAST, "MIN_REVIEW_CYCLES_BEFORE_APPROVAL": "1"}
TESTER_ONLY = {**QUICK, "START_AGENT": "tester"}
PROGRAMMER_ON = {**QUICK, "START_AGENT": "programmer"}
GRACE, TIMEOUT, STALL = 30.0, 1800.0, 300.0
PROMPT = "You are the tester (round 2 of 8).\n\nWrite your complete answer to this file: /wd/.tmp/test_result.md"
EXPLORE_TEXT = "Build a greeting CLI: `greet NAME` prints `Hello, NAME!`."
SCENARIO_TEXT = "Run `greet World` and expect `Hello, World!` on stdout."


@pytest.fixture
def m(orch, monkeypatch):
    for name, value in (("IDLE_GRACE_SECONDS", GRACE), ("RESPONSE_TIMEOUT", TIMEOUT), ("AGENT_STALL_SECONDS", STALL),
                        ("QUIET_SCREEN_SECONDS", 5.0), ("FILE_SETTLE_SECONDS", 0.25)):
        monkeypatch.setattr(orch, name, value)
    return orch


def idle_since_two(m, limit=None):
    """A turn sent at t=0 whose agent worked, then went idle at t=2 without its file."""
    facts = m.TurnFacts(started=0.0, guard_since=0.0, markers=m.prompt_markers(PROMPT), prompt_seen=True)
    facts.note_status("processing", 1.0)
    facts.note_status("completed", 2.0)
    if limit is not None:
        facts.note_usage_limit(limit)
    return facts


def decide(m, facts, now):
    state, rule = m.decide(facts, now)
    return state.name, rule.verdict.name


LIMIT = None


def a_limit(m, resets_in: float | None = 600.0):
    return m.UsageLimit("You've hit your usage limit. Try again at 3:05 PM.",
                        None if resets_in is None else time.time() + resets_in)


# -- the wait's rules ----------------------------------------------------------------------

def test_an_agent_idle_at_its_usage_limit_is_waited_out_not_reminded(m):
    facts = idle_since_two(m, a_limit(m))
    assert decide(m, facts, 3.0) == ("IDLE_WITHOUT_FILE", "WAIT_OUT_LIMIT")
    assert decide(m, facts, 2.0 + GRACE + 1) == ("IDLE_WITHOUT_FILE", "WAIT_OUT_LIMIT")


def test_without_a_limit_on_its_screen_the_same_agent_is_reminded(m):
    facts = idle_since_two(m)
    assert decide(m, facts, 2.0 + GRACE + 1) == ("IDLE_WITHOUT_FILE", "REMIND")


def test_a_usage_limit_wait_outlasts_response_timeout_and_a_still_screen(m):
    facts = idle_since_two(m, a_limit(m))
    facts.limit_wait_until = TIMEOUT + 3600.0
    facts.note_screen("You've hit your usage limit.", 2.0)
    assert decide(m, facts, TIMEOUT + 10.0) == ("IDLE_WITHOUT_FILE", "WAIT")
    facts.note_status("processing", TIMEOUT + 20.0)      # CAO reading it busy: still no stall, no timeout
    assert decide(m, facts, TIMEOUT + STALL + 30.0)[1] == "WAIT"


def test_an_idle_agent_is_told_to_continue_once_the_wait_is_over(m):
    facts = idle_since_two(m, a_limit(m))
    facts.limit_wait_until = 100.0
    assert decide(m, facts, 99.0)[1] == "WAIT"
    assert decide(m, facts, 100.0) == ("IDLE_WITHOUT_FILE", "CONTINUE_AFTER_LIMIT")


@pytest.mark.parametrize("provider, while_busy", [("codex", ("WAIT_OUT_LIMIT", "CONTINUE_AFTER_LIMIT")),
                                                  ("claude_code", ("WAIT", "WAIT"))])
def test_a_cli_read_busy_at_its_limit_is_waited_out_once_its_screen_is_still_where_its_row_says_so(
        m, provider, while_busy):
    """CAO reads Codex `processing` through a usage limit and the wait (its row does not trust CAO's ready word): a
    still screen tells instead. Claude Code's row trusts CAO's `processing` there: busy, it is working."""
    facts = idle_since_two(m)
    facts.cli = m.agent_cli(provider)
    facts.note_status("processing", 3.0)
    facts.note_screen("■ You’ve hit your usage limit. Try again at 8:20 AM.", 3.0)
    facts.note_usage_limit(a_limit(m))
    assert decide(m, facts, 4.0) == ("WORKING", "WAIT")                # the screen may still move
    assert decide(m, facts, 3.0 + 5.0) == ("WORKING", while_busy[0])
    facts.limit_wait_until = 100.0
    assert decide(m, facts, 100.0) == ("WORKING", while_busy[1])
    facts.note_status("idle", 101.0)
    assert decide(m, facts, 101.0) == ("IDLE_WITHOUT_FILE", "CONTINUE_AFTER_LIMIT")


def test_an_agent_that_works_again_after_the_wait_is_not_told_to_continue(m):
    facts = idle_since_two(m)
    facts.limit_wait_until = 100.0
    facts.note_status("processing", 101.0)
    assert decide(m, facts, 102.0) == ("WORKING", "WAIT")


def test_a_carried_over_turn_waits_out_its_limit_before_idle_grace_applies(m):
    facts = m.TurnFacts(started=0.0, guard_since=0.0)      # carried over: no prompt to look for
    facts.note_status("idle", 1.0)
    facts.limit_wait_until = 0.5
    assert decide(m, facts, 1.0) == ("SILENT", "CONTINUE_AFTER_LIMIT")


def test_a_reply_file_outranks_a_usage_limit_on_the_screen(m):
    facts = idle_since_two(m)
    facts.note_file((1, 2), 3.0)
    facts.note_usage_limit(a_limit(m))
    assert facts.usage_limit is None
    facts.note_status("completed", 4.0)
    assert decide(m, facts, 4.0) == ("FILE_SETTLED", "TAKE_REPLY")
    assert m.decide(facts, 4.0)[1].ended_by == m.TURN_ENDED_BY_STATUS


def test_a_message_sent_ends_the_limit_and_its_wait(m):
    facts = idle_since_two(m, a_limit(m))
    facts.limit_wait_until = 50.0
    facts.note_sent(60.0)
    assert facts.usage_limit is None and facts.limit_wait_until is None


def test_the_screen_is_read_while_the_agent_asks_a_question(m):
    facts = idle_since_two(m)
    facts.note_status("waiting_user_answer", 3.0)
    assert m.ReadSchedule.screen_due(facts, 3.0)


def test_progress_names_the_usage_limit_wait(m):
    facts = idle_since_two(m)
    facts.limit_wait_until = 1000.0
    assert "waiting out its usage limit for 16m 40s more" in m.progress_text(facts, 0.0, 0.0)


# -- what the screens say --------------------------------------------------------------------

@pytest.fixture
def berlin(monkeypatch):
    """This machine's clock in Europe/Berlin: the CLIs print their machine's local time."""
    monkeypatch.setenv("TZ", "Europe/Berlin")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def at(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M").timestamp()


@pytest.mark.parametrize("screen, reset", [
    ("■ You've hit your usage limit. Try again at 3:05 PM.", "2026-11-25 15:05"),
    ("You’ve hit your usage limit. Upgrade to Pro (https://chatgpt.com/pricing), or try again at 11:42 PM.",
     "2026-11-25 23:42"),
    ("■ You've hit your usage limit. Try again at Jan 5th, 2027 3:05 PM.", "2027-01-05 15:05"),
    ("⎿ You've hit your session limit · resets 3pm (Europe/Berlin)", "2026-11-25 15:00"),
    ("You've hit your weekly limit · resets Dec 5, 3:30pm (Europe/Berlin)", "2026-12-05 15:30"),
    ("You've hit your 5-hour limit · resets 9am", "2026-11-26 09:00"),          # passed today: tomorrow's
])
def test_a_usage_limit_and_its_reset_are_read_off_the_screen(m, berlin, screen, reset):
    now = at("2026-11-25 14:00")
    limit = m.usage_limit_on(f"some earlier output\n{screen}\n\n› Ask Codex to do anything\n", now)
    assert limit is not None and limit.line.startswith(("You've hit", "You’ve hit"))
    assert limit.resets_at == at(reset)


def test_a_reset_given_in_another_zone_is_read_in_that_zone(m, berlin):
    limit = m.usage_limit_on("You've hit your session limit · resets 3pm (UTC)", at("2026-11-25 14:00"))
    assert limit.resets_at == at("2026-11-25 16:00")          # 15:00 UTC is 16:00 in Berlin


@pytest.mark.parametrize("screen", ["■ You've hit your usage limit. Try again later.",
                                    "You've hit your monthly spend limit. /model to switch models."])
def test_a_usage_limit_without_a_reset_time_has_none(m, screen):
    limit = m.usage_limit_on(screen, time.time())
    assert limit is not None and limit.resets_at is None


def test_a_limit_above_the_last_thirty_lines_of_the_screen_is_an_old_one(m):
    screen = "You've hit your usage limit. Try again at 3:05 PM.\n" + "".join(f"line {n}\n" for n in range(40))
    assert m.usage_limit_on(screen, time.time()) is None


@pytest.mark.parametrize("screen, change", [
    ("\x1b[2K✻ Conversation compacted (ctrl+o for history)\n", "compacted"),
    ("✻ Conversation\x1b[1Ccompacted", "compacted"),                  # the cursor moved between the words
    ("· Compacting conversation… (esc to interrupt)", "compacted"),
    ("• Context compacted\n", "compacted"),
    ("◦ Compacting context (3s • esc to interrupt)", "compacted"),
    ("Context low (8% remaining) · Run /compact to compact & continue", "context low"),
    ("  ⎿  Context limit reached · /compact or /clear to continue", "context low"),
    ("\x1b[38;5;246m \x1b[3G⎿\x1b[6G\x1b[39m\x1b[2mCompacted\x1b[16G(ctrl+o\x1b[24Gto\x1b[27Gsee\x1b[31Gfull"
     "\x1b[36Gsummary)\x1b[22m", "compacted"),                         # /compact typed into Claude Code
    ("\x1b[38;5;246m✻\x1b[3GConversation\x1b[16Gcompacted\x1b[26G(ctrl+o", "compacted"),
    ("\x1b[38;5;147m✽\x1b[3GCompacting conve\x1b[38;5;153mrsa\x1b[38;5;147mtion… ", "compacted"),
    ("❯ /clear\n\n❯ ", "cleared"),
    ("╭──────╮\n│ >_ OpenAI Codex (v0.169.0) │\n› Ask Codex to do anything", ""),   # Codex's header: its start-up
    #                                                      and any redraw show it too, not only /new or /clear
    ("> You are the tester\n42% until auto-compact", ""),
    ("", ""),
])
def test_what_the_screen_says_of_the_conversation(m, screen, change):
    assert m.conversation_change(screen)[0] == change


def test_context_low_names_what_is_left(m):
    assert m.conversation_change("\x1b[31mContext low (8% remaining)\x1b[0m") == ("context low", "8% left")
    assert m.conversation_change("Context limit reached · /compact or /clear") == ("context low", "none left")


def test_a_compaction_drawn_before_the_prompts_echo_counts(m):
    """Claude Code compacting as a prompt is submitted draws "Conversation compacted", then the prompt again."""
    screen = ("[Pasted text #1 +20 lines]\n✽ Compacting conversation…\n✻ Conversation compacted (ctrl+o for "
              "history)\n❯ " + PROMPT + "\n● Bash(cat > /wd/.tmp/test_result.md)\n")
    assert m.conversation_change(screen)[0] == "compacted"


# -- the loop: compaction ------------------------------------------------------------------------

def compacted_then(text: str):
    """A fake agent step: it writes `text` as its answer; its screen shows that its CLI compacted first."""
    def act(fake, terminal):
        Path(terminal.response_path).write_text(text, encoding="utf-8")
        terminal.last_output = text
        terminal.printed = "✻ Conversation compacted (ctrl+o for history)\n" + text
        terminal.status = "completed"
    return {"action": "call", "call": act, "text": text}


def prompts_of_tester(fake_cao) -> list[str]:
    return fake_cao.prompts_for("tester")


def test_a_compacted_conversation_gets_the_full_task_in_its_next_prompt(load_orch, fake_cao, prompt_file, capsys):
    """The tester's CLI compacts during its round-1 turn: its round-2 prompt carries the explore summary and
    the scenario test in full again, and the run record says why."""
    fake_cao.script["tester"] = [compacted_then(FAIL_REPLY), PASS_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), PROVIDER="claude_code", **PROGRAMMER_ON)
    assert run_main(m) == 0
    first, second = prompts_of_tester(fake_cao)
    for prompt in (first, second):
        assert EXPLORE_TEXT in prompt and SCENARIO_TEXT in prompt
        assert m.EXPLORE_BACK_REFERENCE not in prompt
    out = capsys.readouterr().out
    assert "tester: its conversation was compacted; the next prompt carries the full task again" in out
    state = json.loads(Path(m.STATE_FILE).read_text())
    assert [(e["role"], e["what"]) for e in state["agent_events"]] == [("tester", "compacted")]
    summary = json.loads(Path(m.run_dir, "summary.json").read_text())
    assert summary["agent_events"][0]["what"] == "compacted"
    assert 'data-what="compacted"' in Path(m.run_dir, "report.html").read_text()


def test_without_compaction_the_next_prompt_keeps_the_back_reference(load_orch, fake_cao, prompt_file):
    fake_cao.script["tester"] = [FAIL_REPLY, PASS_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), PROVIDER="claude_code", **PROGRAMMER_ON)
    assert run_main(m) == 0
    first, second = prompts_of_tester(fake_cao)
    assert EXPLORE_TEXT in first and EXPLORE_TEXT not in second and m.EXPLORE_BACK_REFERENCE in second
    assert json.loads(Path(m.STATE_FILE).read_text())["agent_events"] == []


def test_a_compaction_typed_by_hand_between_turns_is_noticed_before_the_next_prompt(load_orch, fake_cao,
                                                                                       prompt_file):
    """Someone types /compact into the programmer's terminal after its turn: the screen, read before the
    next prompt is built, says so."""
    def compacted_by_hand(fake, terminal):
        fake.terminal_for("programmer").printed += "\n> /compact\n✻ Conversation compacted\n"
        Path(terminal.response_path).write_text(FAIL_REPLY if fake.turns["tester"] == 1 else PASS_REPLY)
        terminal.status = "completed"
    fake_cao.script["tester"] = [{"action": "call", "call": compacted_by_hand}]
    m = load_orch(PROMPT_FILE=str(prompt_file), PROVIDER="claude_code", **PROGRAMMER_ON)
    assert run_main(m) == 0
    programmer = fake_cao.prompts_for("programmer")
    assert len(programmer) == 2 and EXPLORE_TEXT in programmer[1] and SCENARIO_TEXT in programmer[1]


def test_context_low_starts_a_new_agent_for_the_next_turn(load_orch, fake_cao, prompt_file, capsys):
    """Claude Code with auto-compact off says its context is nearly full: the tester's next turn goes to a
    new agent (a new terminal, the old one ended), with the full task."""
    def low(fake, terminal):
        Path(terminal.response_path).write_text(FAIL_REPLY)
        terminal.last_output = FAIL_REPLY
        terminal.printed = FAIL_REPLY + "\nContext low (7% remaining) · Run /compact to compact & continue\n"
        terminal.status = "completed"
    fake_cao.script["tester"] = [{"action": "call", "call": low}, PASS_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), PROVIDER="claude_code", **PROGRAMMER_ON)
    old = None
    assert run_main(m) == 0
    testers = [t for t in fake_cao.terminals.values() if t.role == "tester"]
    assert len(testers) == 2
    old, new = testers
    assert old.exited and old.deleted and not new.exited
    first, second = prompts_of_tester(fake_cao)
    assert EXPLORE_TEXT in second and m.EXPLORE_BACK_REFERENCE not in second
    out = capsys.readouterr().out
    assert "its context is nearly full (7% left)" in out
    state = json.loads(Path(m.STATE_FILE).read_text())
    assert state["terminals"]["tester"] == new.id and state["fresh_agents_due"] == {}
    assert [e["what"] for e in state["agent_events"]] == ["context low", "new conversation"]


def test_fresh_context_round_starts_each_later_round_with_new_agents(load_orch, fake_cao, prompt_file):
    """FRESH_CONTEXT=round: round 2's programmer, peer programmer and tester are new agents whose prompts
    carry the full task; within round 1 the agents keep their conversations."""
    fake_cao.script["tester"] = [FAIL_REPLY, PASS_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), FRESH_CONTEXT="round", **PROGRAMMER_ON)
    assert run_main(m) == 0
    for role in ("programmer", "peer_programmer", "tester"):
        terminals = [t for t in fake_cao.terminals.values() if t.role == role]
        assert len(terminals) == 2, role
        prompts = fake_cao.prompts_for(role)
        assert EXPLORE_TEXT in prompts[-1], role
    assert [t for t in fake_cao.terminals.values() if t.role == "analyst"][0].exited is False
    state = json.loads(Path(m.STATE_FILE).read_text())
    assert [e["role"] for e in state["agent_events"] if e["what"] == "new conversation"] == \
        ["programmer", "peer_programmer", "tester"]


def test_fresh_context_refuses_an_unknown_value(load_orch, fake_cao, prompt_file, capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), FRESH_CONTEXT="turn", **TESTER_ONLY)
    assert run_main(m) == 2
    err = capsys.readouterr().err
    assert "FRESH_CONTEXT" in err and "off, round" in err


# -- the loop: usage limits -------------------------------------------------------------------------

def codex_limit_line(when: datetime) -> str:
    return f"■ You've hit your usage limit. Try again at {when.strftime('%I:%M %p').lstrip('0')}."


def limited(line: str, then_text: str = PASS_REPLY) -> dict:
    """A fake agent step: it stops at its usage limit without its file; told to continue, it writes `then_text`."""
    return {"action": "write_on_reminder", "text": then_text, "output": line}


def test_a_usage_limit_is_waited_out_and_the_agent_continues(load_orch, fake_cao, prompt_file, capsys):
    """The tester stops at its usage limit (reset this minute): the loop waits the margin, tells it to
    continue -- one message, no reminder, the prompt not sent again -- and the run passes."""
    fake_cao.script["tester"] = [limited(codex_limit_line(datetime.now()))]
    m = load_orch(PROMPT_FILE=str(prompt_file), USAGE_LIMIT_MARGIN_SECONDS="0.5", **TESTER_ONLY)
    assert run_main(m) == 0
    assert len(prompts_of_tester(fake_cao)) == 1
    assert [message.split(".")[0] for _, message in fake_cao.reminders] == ["Your usage limit has reset"]
    out = capsys.readouterr().out
    assert "tester: usage limit reached; waiting until" in out and "then it continues" in out
    assert "reminder" not in out
    state = json.loads(Path(m.STATE_FILE).read_text())
    assert state["in_flight"] is None and [e["what"] for e in state["agent_events"]] == ["usage limit"]


def test_a_usage_limit_beyond_the_longest_wait_stops_and_the_rerun_continues_the_turn(load_orch, fake_cao,
                                                                                        prompt_file, capsys):
    reset = datetime.now() + timedelta(hours=2)
    fake_cao.script["tester"] = [limited(codex_limit_line(reset))]
    m = load_orch(PROMPT_FILE=str(prompt_file), USAGE_LIMIT_MAX_WAIT="3600", **TESTER_ONLY)
    assert run_main(m) == 3
    err = capsys.readouterr().err
    assert "stopped at its account's usage limit (You've hit your usage limit." in err
    told = reset.replace(second=0, microsecond=0) + timedelta(seconds=60)     # the reset and the default margin
    # '01:05', or 'Nov 27 00:05' when the reset falls on the next day (a run after 22:00)
    shown = told.strftime("%H:%M") if told.date() == datetime.now().date() else told.strftime("%b %d %H:%M")
    assert f"rerun the command after {shown}" in err and "USAGE_LIMIT_MAX_WAIT" in err
    state = json.loads(Path(m.STATE_FILE).read_text())
    assert state["in_flight"]["limit_line"].startswith("You've hit your usage limit")
    assert state["in_flight"]["limit_until"] > time.time() + 3600

    # --status while it waits knows it
    m = load_orch(PROMPT_FILE=str(prompt_file), **TESTER_ONLY)
    assert run_main(m, "--status") == 0
    assert "stopped at its usage limit" in capsys.readouterr().out

    # A rerun before the reset stops again, sending nothing.
    m = load_orch(PROMPT_FILE=str(prompt_file), USAGE_LIMIT_MAX_WAIT="3600", **TESTER_ONLY)
    assert run_main(m) == 3
    assert len(prompts_of_tester(fake_cao)) == 1 and fake_cao.reminders == []

    # After the reset, the rerun tells the agent to continue; the prompt is not sent again.
    state["in_flight"]["limit_until"] = time.time() + 0.3
    Path(m.STATE_FILE).write_text(json.dumps(state))
    m = load_orch(PROMPT_FILE=str(prompt_file), **TESTER_ONLY)
    assert run_main(m) == 0
    assert len(prompts_of_tester(fake_cao)) == 1
    assert [message.split(".")[0] for _, message in fake_cao.reminders] == ["Your usage limit has reset"]
    assert json.loads(Path(m.STATE_FILE).read_text())["final_status"] == "PASS"


def test_a_reply_written_before_a_usage_limit_stop_is_taken_by_the_rerun(load_orch, fake_cao, prompt_file, capsys):
    """The agent's complete answer is in its file when the rerun looks (written before its limit showed, or by
    a person): the rerun takes it -- no wait for the reset, no stop, nothing sent, the turn not paid again."""
    fake_cao.script["tester"] = [limited(codex_limit_line(datetime.now() + timedelta(hours=2)))]
    m = load_orch(PROMPT_FILE=str(prompt_file), USAGE_LIMIT_MAX_WAIT="3600", **TESTER_ONLY)
    assert run_main(m) == 3
    capsys.readouterr()
    m.response_path("tester").write_text(PASS_REPLY, encoding="utf-8")
    m = load_orch(PROMPT_FILE=str(prompt_file), USAGE_LIMIT_MAX_WAIT="3600", **TESTER_ONLY)
    assert run_main(m) == 0
    assert len(prompts_of_tester(fake_cao)) == 1 and fake_cao.reminders == []
    state = json.loads(Path(m.STATE_FILE).read_text())
    assert state["final_status"] == "PASS" and state["in_flight"] is None


def test_a_usage_limit_without_a_reset_time_stops_and_the_rerun_continues(load_orch, fake_cao, prompt_file, capsys):
    fake_cao.script["tester"] = [limited("■ You've hit your usage limit. Try again later.")]
    m = load_orch(PROMPT_FILE=str(prompt_file), **TESTER_ONLY)
    assert run_main(m) == 3
    assert "its CLI names no reset time: rerun the command once the limit has reset" in capsys.readouterr().err
    m = load_orch(PROMPT_FILE=str(prompt_file), **TESTER_ONLY)
    assert run_main(m) == 0
    assert len(prompts_of_tester(fake_cao)) == 1 and len(fake_cao.reminders) == 1


def test_claude_codes_usage_limit_menu_is_answered_with_the_choice_that_waits(load_orch, fake_cao, prompt_file):
    """Claude Code asks "What do you want to do?" at its limit: the loop presses the key of "Stop and wait for
    limit to reset", then waits out the limit it shows."""
    line = f"You've hit your session limit · resets {datetime.now().strftime('%I:%M%p').lstrip('0').lower()}"
    def menu(fake, terminal):
        terminal.last_output = terminal.printed = (f"{line}\nWhat do you want to do?\n❯ 1. Stop and wait for limit to reset\n"
                                "  2. Upgrade your plan\n")
        terminal.status = "waiting_user_answer"
        terminal.held_text = PASS_REPLY

    fake_cao.script["tester"] = [{"action": "call", "call": menu}]
    m = load_orch(PROMPT_FILE=str(prompt_file), PROVIDER="claude_code", USAGE_LIMIT_MARGIN_SECONDS="0.2", **TESTER_ONLY)

    def stop_and_wait(fake, terminal, key):
        if key == "Enter":                 # the highlighted choice, "Stop and wait for limit to reset"
            terminal.printed, terminal.status = line, "idle"

    fake_cao.key_hook = stop_and_wait
    assert run_main(m) == 0
    assert fake_cao.keys == [("tester", "Enter")]
    assert [message.split(".")[0] for _, message in fake_cao.reminders] == ["Your usage limit has reset"]


def test_a_menu_still_on_the_screen_after_its_choice_is_answered_again_and_the_turn_goes_on(
        load_orch, fake_cao, prompt_file):
    """The first Enter is lost (the menu stays on the screen): the loop does not stop the turn; it answers
    again after PERMISSION_ANSWER_INTERVAL, and then waits out the limit as before."""
    line = f"You've hit your session limit · resets {datetime.now().strftime('%I:%M%p').lstrip('0').lower()}"
    def menu(fake, terminal):
        terminal.last_output = terminal.printed = (f"{line}\nWhat do you want to do?\n❯ 1. Stop and wait for limit to reset\n"
                                "  2. Upgrade your plan\n")
        terminal.status, terminal.permission_polls = "waiting_user_answer", 1000     # until a choice counts
        terminal.held_text = PASS_REPLY

    fake_cao.script["tester"] = [{"action": "call", "call": menu}]
    m = load_orch(PROMPT_FILE=str(prompt_file), PROVIDER="claude_code", USAGE_LIMIT_MARGIN_SECONDS="0.2", **TESTER_ONLY)
    m.PERMISSION_ANSWER_INTERVAL = 0.5

    def second_enter_counts(fake, terminal, key):
        if key == "Enter" and len(fake.keys) == 2:
            terminal.printed, terminal.status, terminal.permission_polls = line, "idle", 0

    fake_cao.key_hook = second_enter_counts
    assert run_main(m) == 0
    assert fake_cao.keys == [("tester", "Enter"), ("tester", "Enter")]
    assert [message.split(".")[0] for _, message in fake_cao.reminders] == ["Your usage limit has reset"]


# -- the loop: a compaction foreseen, a compaction during a turn -----------------------------------

def recorded_context(m, monkeypatch, by_role: dict[str, int]):
    """The agents' CLIs record each turn's last response as filling this many tokens of context."""
    def reading(role, since, until, before=None, provider=""):
        context = by_role.get(role, 2_000)
        return m.TokenReading({"gpt-5-codex": m.TokenUse(context - 20, 0, 20)}, True, context)
    monkeypatch.setattr(m, "turn_tokens", reading)


def test_a_context_near_its_compaction_point_gets_the_full_task_before_the_cli_compacts(
        load_orch, fake_cao, prompt_file, monkeypatch, capsys):
    """The tester's first turn left 90,000 tokens of a context its CLI compacts at 100,000: the tester's next
    prompt carries the full task (the compaction that prompt sets off cannot summarise it away); the
    programmer, far from its point, keeps its back-references."""
    fake_cao.script["tester"] = [FAIL_REPLY, PASS_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), COMPACT_AT_TOKENS="100000", **PROGRAMMER_ON)
    recorded_context(m, monkeypatch, {"tester": 90_000})
    assert run_main(m) == 0
    first, second = prompts_of_tester(fake_cao)
    assert EXPLORE_TEXT in second and SCENARIO_TEXT in second and m.EXPLORE_BACK_REFERENCE not in second
    programmer = fake_cao.prompts_for("programmer")
    assert EXPLORE_TEXT not in programmer[1] and m.EXPLORE_BACK_REFERENCE in programmer[1]
    out = capsys.readouterr().out
    assert ("tester: its context held 90,000 tokens after its last turn, near the 100,000 at which its CLI "
            "compacts it: the next prompt carries the full task, not back-references") in out
    state = json.loads(Path(m.STATE_FILE).read_text())
    assert [(e["role"], e["what"]) for e in state["agent_events"]] == [("tester", "compaction foreseen")]
    assert [t["context_tokens"] for t in state["turn_records"] if t["role"] == "tester"] == [90_000, 90_000]


def test_a_context_below_the_foresight_share_keeps_its_back_references(load_orch, fake_cao, prompt_file,
                                                                       monkeypatch):
    fake_cao.script["tester"] = [FAIL_REPLY, PASS_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), COMPACT_AT_TOKENS="100000", **PROGRAMMER_ON)
    recorded_context(m, monkeypatch, {"tester": 84_000})
    assert run_main(m) == 0
    assert m.EXPLORE_BACK_REFERENCE in prompts_of_tester(fake_cao)[1]
    assert json.loads(Path(m.STATE_FILE).read_text())["agent_events"] == []


def compacted_without_file(fake, terminal):
    """The CLI compacts as the back-referencing prompt is submitted; its summary lacks the task, so the agent
    stops without writing its file."""
    terminal.printed = "✻ Conversation compacted (ctrl+o for history)\n> You are the tester ...\nWhich task?"
    terminal.last_output = "Which task do you mean?"
    terminal.status = "completed"


def test_a_compaction_during_a_back_referencing_turn_sends_the_prompt_again_in_full_at_once(
        load_orch, fake_cao, prompt_file, capsys):
    """Unforeseen (no token records): the tester's CLI compacts during its round-2 turn, whose prompt referred
    back to the task. The prompt goes again at once with the task in full, before any reminder, and that
    turn's reply is the one taken."""
    fake_cao.script["tester"] = [FAIL_REPLY, {"action": "call", "call": compacted_without_file}, PASS_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), PROVIDER="claude_code", **PROGRAMMER_ON)
    assert run_main(m) == 0
    first, referring, again = prompts_of_tester(fake_cao)
    assert m.EXPLORE_BACK_REFERENCE in referring and EXPLORE_TEXT not in referring
    assert EXPLORE_TEXT in again and SCENARIO_TEXT in again and m.EXPLORE_BACK_REFERENCE not in again
    out = capsys.readouterr().out
    assert ("tester: its conversation was compacted during the turn, and the prompt referred back to what the "
            "summary may have dropped; sending the prompt again in full") in out
    assert "remind" not in out.lower()
    state = json.loads(Path(m.STATE_FILE).read_text())
    assert state["final_status"] == "PASS" and len(state["turn_records"]) == 6
    assert [(e["role"], e["what"]) for e in state["agent_events"]] == [("tester", "compacted")]


def test_a_compaction_during_a_turn_whose_prompt_was_in_full_sends_nothing_again(load_orch, fake_cao,
                                                                                 prompt_file, capsys):
    """The first prompt carried everything: a compaction during its turn costs no resend (only the next
    prompt carries the full task again)."""
    fake_cao.script["tester"] = [compacted_then(FAIL_REPLY), PASS_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), PROVIDER="claude_code", **PROGRAMMER_ON)
    assert run_main(m) == 0
    assert len(prompts_of_tester(fake_cao)) == 2
    assert "sending the prompt again in full" not in capsys.readouterr().out


def test_the_full_prompt_is_due_at_once_after_a_compaction_and_never_once_a_file_is_there(m):
    """The wait's rule alone, on the fake clock: due while working or idle, gone after the send, and not due
    for a compaction seen once the reply file is there."""
    facts = idle_since_two(m)
    facts.note_status("processing", 3.0)
    facts.note_compacted(True)
    assert decide(m, facts, 3.5) == ("WORKING", "RESEND_IN_FULL")
    facts.note_status("completed", 4.0)
    assert decide(m, facts, 4.5) == ("IDLE_WITHOUT_FILE", "RESEND_IN_FULL")
    facts.note_sent(5.0, whole_prompt=True, markers=m.prompt_markers(PROMPT))
    assert decide(m, facts, 5.5)[1] == "WAIT"
    written = idle_since_two(m)
    written.note_file((1, 10), 3.0)
    written.note_compacted(True)
    assert not written.full_prompt_due
    not_referring = idle_since_two(m)
    not_referring.note_compacted(False)
    assert decide(m, not_referring, 3.0)[1] == "WAIT"


# -- where each CLI compacts ---------------------------------------------------------------------

@pytest.mark.parametrize("settings, point", [
    (None, 167_000),                                                     # no settings file: its defaults
    ({"autoCompactWindow": 100_000}, 67_000),
    ({"env": {"CLAUDE_CODE_AUTO_COMPACT_WINDOW": "150000"}}, 117_000),
    ({"autoCompactEnabled": False}, None),
    ({"env": {"DISABLE_AUTO_COMPACT": "1"}}, None),
])
def test_claude_codes_compaction_point_is_read_from_its_settings(load_orch, tmp_path, settings, point):
    home = tmp_path / "agent-home"
    (home / ".claude").mkdir(parents=True)
    if settings is not None:
        (home / ".claude" / "settings.json").write_text(json.dumps(settings))
    m = load_orch(PROVIDER="claude_code", AGENT_HOME=str(home))
    assert m.compaction_point("tester") == point


@pytest.mark.parametrize("config, point", [
    ("", 244_800),                                                       # 90% of its default window
    ("model_auto_compact_token_limit = 50000\nmodel = \"x\"\n", 50_000),
    ("model_context_window = 100_000\n", 90_000),
    ("model = \"x\"\n[profiles.a]\nmodel_auto_compact_token_limit = 1000\n", 244_800),   # not top level
])
def test_codexs_compaction_point_is_read_from_the_top_of_its_config(load_orch, tmp_path, config, point):
    home = tmp_path / "agent-home"
    (home / ".codex").mkdir(parents=True)
    (home / ".codex" / "config.toml").write_text(config)
    m = load_orch(PROVIDER="codex", AGENT_HOME=str(home))
    assert m.compaction_point("tester") == point


def test_compact_at_tokens_outranks_the_clis_settings_and_an_unknown_cli_has_no_point(load_orch, tmp_path):
    assert load_orch(PROVIDER="codex", AGENT_HOME=str(tmp_path), COMPACT_AT_TOKENS="120000").compaction_point(
        "tester") == 120_000
    assert load_orch(PROVIDER="kiro_cli", AGENT_HOME=str(tmp_path)).compaction_point("tester") is None
