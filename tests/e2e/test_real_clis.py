"""The loop with the real agent CLIs users run: Claude Code, Codex, OpenCode, GitHub Copilot CLI and Hermes
Agent, each under CAO's own provider.

Each CLI is the pinned npm release (``agent_clis.py``), started by a private
cao-server with a private HOME, and talks to a scripted model endpoint on
127.0.0.1 (``scripted_model.py``) that drives it the way a real model would: a
shell tool call that writes the reply file the prompt names, then a short
final message. What is asserted is what a paying user cares about: the run
reaches PASS, every agent turn is taken exactly once (no prompt repeated, no
reminder to an agent that had answered), and no turn waits longer than the
settle and screen bounds after its reply file was written.
"""

from __future__ import annotations

import json
from datetime import datetime
import re
import subprocess
import time
from pathlib import Path

import pytest

import run_orchestrator_loop
from orchestrator_scripted_agent import DEFAULT_TEXTS

from .conftest import REAL_CLI_START_UPS, REAL_CLI_TURN_TIMES
from .test_orchestrator_e2e import FAIL_REPLY, PASS_REPLY, PROGRAMMER_REPLY, QUICK_ROUND, SHORT_ROUND, \
    Run, explain, numbered, write_two_story_change

pytestmark = [pytest.mark.e2e, pytest.mark.real_cli]

# A reply's log line: the turn's time, how long after its file was written the loop took it, and what showed
# the loop that the agent's turn was over. Times are measured (the suite's summary), never asserted: on a
# loaded machine they stretch; which rule ended a turn does not.
TURN_LINE = re.compile(r"\| (\w+): reply received after ([\d.]+)s \(file written ([\d.]+)s before\) "
                       r"\(\d+ chars, turn end seen by ([^,]+), kept as")
ENDED_BY_MARK = run_orchestrator_loop.TURN_ENDED_BY_MARK
ENDED_BY_RECORD = run_orchestrator_loop.TURN_ENDED_BY_RECORD


def real_cli_run(cao, **settings: str) -> Run:
    """A run with the loop's default handoff settings (unless a test names one), as a user has them, and room
    for real CLIs. The default poll, too: a status read costs cao-server a tmux call, and the suite's CPU is
    its time; a reply is taken when its file settles, not at the next poll."""
    run = Run(cao, RESPONSE_TIMEOUT="300", **settings)
    for name in ("POLL_SECONDS", "IDLE_GRACE_SECONDS", "QUIET_SCREEN_SECONDS"):   # the defaults
        if name not in settings:
            run.env.pop(name, None)
    return run


def turn_times(stdout: str) -> list[tuple[str, float, float, str]]:
    """Each turn's role, time, seconds from its file to its reply taken, and what showed the turn was over."""
    return [(role, float(took), float(lag), ended_by) for role, took, lag, ended_by in TURN_LINE.findall(stdout)]


def _moment(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


RECORDED_END = re.compile(r": reply received after .*; its CLI recorded the turn's end ([\d.]+)s before\)$")


def timed_turns(cao, run: Run, stdout: str) -> list[tuple[str, float, float, str, float | None, bool, float | None]]:
    """turn_times(), each with the seconds from the agent's turn ended -- the model's last answer of the
    turn, its closing words after the write -- to the reply taken (None where the model gave none), whether
    the loop could read the CLI's records (AGENT_HOME given), and the seconds from the CLI's record of the
    turn's end to the reply taken, as the loop's line says (None for a turn not ended by the record)."""
    recorded = [(float(found.group(1)) if found else None) for found in
                (RECORDED_END.search(line) for line in stdout.splitlines() if TURN_LINE.search(line))]
    summary = json.loads((Path(run.state()["run_dir"]) / "summary.json").read_text(encoding="utf-8"))
    records = summary["turn_list"]
    closings = [(event["role"], event["time"]) for event in cao.model.events()
                if event["kind"] == "tool_result" and event["action"] == "text" and event["role"]]
    timed = []
    for index, (turn, record) in enumerate(zip(turn_times(stdout), records)):
        later = [_moment(r["sent_at"]) for r in records[index + 1:] if r["role"] == record["role"] and r["sent_at"]]
        sent, taken = _moment(record["sent_at"]), _moment(record["taken_at"])
        ends = [at for role, at in closings if role == record["role"] and sent <= at < min(later, default=taken + 60)]
        timed.append((*turn, round(taken - max(ends), 3) if ends else None, "AGENT_HOME" in run.env,
                      recorded[index] if index < len(recorded) else None))
    return timed


def turn_ends(stdout: str) -> list[str]:
    """What showed the loop each turn was over, in turn order."""
    return [ended_by for *_, ended_by in TURN_LINE.findall(stdout)]


def check_every_turn_taken_once(cao, run: Run, result, sequence: list[str], killed: str | None = None) -> None:
    """Exactly the expected turns, each prompt answered once, nothing repeated or reminded. ``killed``: the
    role whose CLI was killed in one turn; the model took that turn's prompt once more, from its new agent."""
    assert result.returncode == 0, explain(result)
    assert run.archived() == numbered(sequence), explain(result)
    expected = {role: sequence.count(role) for role in set(sequence)}
    if killed:
        expected[killed] += 1
    assert cao.model.turns() == expected, cao.model.events()
    kinds = [event["kind"] for event in cao.model.events()]
    assert "reminder" not in kinds, cao.model.events()
    assert "reminder" not in result.stdout and "sending the whole prompt again" not in result.stdout, explain(result)
    times = timed_turns(cao, run, result.stdout)
    assert [role for role, *_ in times] == sequence, explain(result)
    REAL_CLI_TURN_TIMES.setdefault(cao.env["PROVIDER"], []).extend(times)


ANALYST_FINAL = DEFAULT_TEXTS["analyst"]
# The analyst writes a draft first and its final answer 2 s later, in a second command of the same turn:
# the draft settles, but the CLI is still at work, so only the final answer may be read.
ANALYST_IN_TWO_WRITES = {"action": "write_twice", "draft": "DRAFT: not the answer yet\n", "text": ANALYST_FINAL,
                         "rewrite_after_ms": 2000}


# The CLIs whose records of tokens used the loop reads (their rows name a format in RECORD_FORMATS).
TOKENS_READ = ("claude_code", "codex", "opencode_cli", "copilot_cli", "hermes")


def figures(tokens: dict | None) -> tuple[int, int, int] | None:
    return None if tokens is None else (tokens["input"], tokens["cached_input"], tokens["output"])


def check_tokens_are_the_models(cao, run: Run, unanswered: set[tuple[str, int]] = frozenset(),
                                scripted: tuple[str, ...] = ()) -> None:
    """The tokens the loop reports for each turn, role and the run are exactly what the scripted model
    reported for the responses of that turn (the CLIs' side requests, which they do not record, left out).
    ``unanswered``: the (role, prompt count) the model took but whose CLI died before it answered.
    ``scripted``: roles played by the scripted agent, which records no tokens (theirs are unknown)."""
    reported = {key: use for key, use in cao.model.usage_by_turn().items() if key not in unanswered}
    state = run.state()
    summary = json.loads((Path(state["run_dir"]) / "summary.json").read_text(encoding="utf-8"))
    count: dict[str, int] = {}
    expected_turns = []
    turns = [turn for turn in summary["turn_list"] if turn["role"] not in scripted]
    for turn in turns:
        count[turn["role"]] = count.get(turn["role"], 0) + 1
        while (turn["role"], count[turn["role"]]) in unanswered:
            count[turn["role"]] += 1
        expected_turns.append(reported[(turn["role"], count[turn["role"]])])
    assert [figures(turn["tokens"]) for turn in turns] == expected_turns, reported
    for role in count:
        mine = [use for (who, _), use in reported.items() if who == role]
        assert figures(summary["roles"][role]["tokens"]) == tuple(map(sum, zip(*mine))), role
    assert figures(summary["tokens"]) == tuple(map(sum, zip(*reported.values())))
    assert summary["tokens_unknown_turns"] == len(summary["turn_list"]) - len(turns)


def fail_then_pass(cao, kill_in_round_2: bool = False, **settings: str) -> str:
    """Round 1 (analyst .. tester) ends in FAIL, round 2 (programmer, peer, tester) in PASS; the analyst's
    reply file is written twice in its turn, and the loop reads only the second. Where the loop reads the
    CLI's records (in the agents' HOME), the tokens it reports are the model's, exactly.
    ``kill_in_round_2``: the programmer's CLI is killed -9 while it works on its round-2 turn (REPLACE_LOST_AGENTS=1):
    a new agent, on the same model, gets the whole prompt; no completed turn is sent again. One run for both
    keeps the suite to one start-up of five agents where a second would prove nothing more."""
    if cao.env["PROVIDER"] in TOKENS_READ:
        settings = {"AGENT_HOME": str(cao.home), **settings}
    programmer = [PROGRAMMER_REPLY]
    if kill_in_round_2:
        settings = {"REPLACE_LOST_AGENTS": "1", **settings}
        programmer = [PROGRAMMER_REPLY, {"text": PROGRAMMER_REPLY, "think_ms": 20000}, PROGRAMMER_REPLY]
    run = real_cli_run(cao, **settings)
    cao.model.set_script({"tester": [FAIL_REPLY, PASS_REPLY], "programmer": programmer,
                          "analyst": [ANALYST_IN_TWO_WRITES]})
    if kill_in_round_2:
        result, killed_at = kill_programmer_while_it_works(cao, run, prompt=2)
        check_programmer_replaced(cao.env["PROVIDER"], run, result, killed_at)
    else:
        result = run.run(timeout=900)
    check_every_turn_taken_once(cao, run, result, QUICK_ROUND + SHORT_ROUND,
                                killed="programmer" if kill_in_round_2 else None)
    state = run.state()
    assert state["final_status"] == "PASS" and state["current_round"] == 2
    analyst_writes = [w["draft"] for w in cao.model.writes() if w["role"] == "analyst"]
    assert analyst_writes[0] and not analyst_writes[-1], cao.model.events()      # a draft, then the answer
    assert run.archived_text("001-analyst.md").strip() == ANALYST_FINAL.strip(), explain(result)
    assert run.archived_text("005-tester.md").strip() == FAIL_REPLY.strip()
    assert run.archived_text("008-tester.md").strip() == PASS_REPLY.strip()
    if cao.env["PROVIDER"] in TOKENS_READ:
        check_tokens_are_the_models(cao, run, unanswered={("programmer", 2)} if kill_in_round_2 else frozenset())
    return result.stdout


def cheaper_reviewers(big: str, small: str) -> tuple[dict[str, str], dict[str, set[str]]]:
    """Settings for a model per role (the reviewers and the tester on the cheaper one), and the models the
    scripted endpoint must then see named in each role's requests."""
    settings = {"MODEL": big, "PEER_ANALYST_MODEL": small, "PEER_PROGRAMMER_MODEL": small, "TESTER_MODEL": small}
    expected = {role: {small if role.startswith("peer_") or role == "tester" else big} for role in QUICK_ROUND}
    return settings, expected


def test_claude_code_fail_then_pass_with_a_model_per_role_and_its_programmer_killed(claude_cao):
    """Claude Code under CAO's claude_code provider: FAIL in round 1, PASS in round 2; the reviewers and
    the tester run on another model than the analyst and the programmer. The programmer's Claude Code is
    killed -9 while it works in round 2: a new one, on the programmer's model, gets the whole prompt."""
    settings, expected = cheaper_reviewers("claude-sonnet-4-5", "claude-haiku-4-5")
    stdout = fail_then_pass(claude_cao, kill_in_round_2=True, **settings)
    assert claude_cao.model.models_by_role() == expected
    assert "warning" not in stdout


def test_codex_fail_then_pass_with_a_model_per_role(codex_cao):
    """Codex under CAO's codex provider, whose status sticks at `processing` after each turn; a model per
    role as for Claude Code (slugs Codex does not know, so it keeps its standard tools)."""
    settings, expected = cheaper_reviewers("scripted-large", "scripted-small")
    stdout = fail_then_pass(codex_cao, **settings)
    assert codex_cao.model.models_by_role() == expected
    assert "warning" not in stdout
    # Codex marks the end of its turn on its screen (CAO's status for it cannot be trusted): its replies are
    # taken once that mark shows, not after QUIET_SCREEN_SECONDS of still screen. A mark a spinner pushed out
    # of CAO's screen tail before the loop looked may leave a turn to the still screen, never most of them.
    ends = turn_ends(stdout)
    assert ends.count(ENDED_BY_MARK) + ends.count(ENDED_BY_RECORD) > len(ends) / 2, ends


def test_codex_run_stops_at_its_token_budget_and_goes_on_with_a_higher_one(codex_cao):
    """MAX_RUN_TOKENS reached mid-run: the loop stops before the next turn is sent (exit 4, one line naming
    the budget, the state saved); the rerun with a higher budget reaches PASS with no turn sent twice."""
    cao = codex_cao
    step = {"usage_tokens": 1000}         # each response: 1,000 prompt tokens (a quarter cached) and 20 out
    cao.model.set_script({"programmer": [{**step, "text": PROGRAMMER_REPLY}], "peer_programmer": [step],
                          "tester": [{**step, "text": FAIL_REPLY}, {**step, "text": PASS_REPLY}]})
    run = real_cli_run(cao, START_AGENT="programmer", AGENT_HOME=str(cao.home), MAX_RUN_TOKENS="5000")
    stopped = run.run(timeout=600)
    assert stopped.returncode == 4, explain(stopped)
    lines = [line for line in stopped.stderr.splitlines() if "MAX_RUN_TOKENS" in line]
    assert len(lines) == 1 and "its budget is MAX_RUN_TOKENS=5000; state saved: rerun with a higher " \
        "MAX_RUN_TOKENS to go on with the" in lines[0], explain(stopped)
    state = run.state()
    used = [sum(figures(turn["tokens"])) for turn in state["turn_records"]]
    assert sum(used) >= 5000 > sum(used[:-1]), used           # stopped at the first send after reaching it
    assert state["in_flight"] is None and state["final_status"] == "RUNNING"
    sent_before = dict(cao.model.turns())
    assert sum(sent_before.values()) == len(used)            # the next turn's prompt never went out
    run.env["MAX_RUN_TOKENS"] = "100000"
    result = run.run(timeout=600)
    assert result.returncode == 0, explain(result)
    assert cao.model.turns() == {"programmer": 2, "peer_programmer": 2, "tester": 2}, cao.model.events()
    assert run.archived() == numbered(["programmer", "peer_programmer", "tester"] * 2)
    check_tokens_are_the_models(cao, run)


def story_mode(cao) -> None:
    """Story mode: two stories, each its own programmer turn, then review and test."""
    run = real_cli_run(cao, STORY_MODE="1", START_AGENT="programmer")
    assert "AGENT_HOME" not in run.env and run.env.get("HOME") != str(cao.home)   # the agents' records out of reach
    write_two_story_change(run.wd)
    summary = "PROGRAMMER_SUMMARY:\n- Files changed: greet.py\n- Behavior implemented: one story\n"
    cao.model.set_script({"programmer": [summary + "<promise>COMPLETE</promise>\n"]})
    result = run.run(timeout=600)
    sequence = ["programmer", "programmer", "peer_programmer", "tester"]
    check_every_turn_taken_once(cao, run, result, sequence)
    # With its records out of reach each turn ends by a screen rule (or CAO's word), named in the log.
    screen_rules = {run_orchestrator_loop.TURN_ENDED_BY_STATUS, ENDED_BY_MARK,
                    run_orchestrator_loop.TURN_ENDED_BY_STILL_SCREEN}
    assert len(turn_ends(result.stdout)) == len(sequence) and set(turn_ends(result.stdout)) <= screen_rules, \
        explain(result)
    state = run.state()
    assert state["final_status"] == "PASS"
    assert "story 1 attempt 1/3: COMPLETE" in result.stdout and "story 2 attempt 1/3: COMPLETE" in result.stdout
    assert '- Story 1 "Parse the name": COMPLETE (attempt 1)' in state["outputs"]["programmer"]
    assert '- Story 2 "Print the greeting": COMPLETE (attempt 1)' in state["outputs"]["programmer"]


def test_claude_code_story_mode(claude_cao):
    """Story mode with Claude Code."""
    story_mode(claude_cao)


# ---------------------------------------------------------------------------
# The agents' bad days, with the real CLIs
# ---------------------------------------------------------------------------

def test_codex_in_a_project_it_does_not_trust_has_its_dialog_answered_and_passes(codex_cao):
    """Codex asks "Trust this folder?" in a project not in its config. Where the loop reads the dialog as a
    menu it picks "Trust and continue" before the prompt; where Codex drew it in a way that reads as no menu,
    the first prompt's Enter answers it, the screen never shows the prompt, and the agent gets its whole
    prompt once more (never a reminder first). Either way, once per agent, and the FAIL -> PASS run
    completes with every agent given its task."""
    run = real_cli_run(codex_cao, IDLE_GRACE_SECONDS="5")
    untrusted = codex_cao.root / "untrusted" / run.wd.name      # new_workdir() would pre-trust it
    untrusted.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(untrusted)], check=True)        # a project, as users have them
    run.wd, run.state_file = untrusted, untrusted / ".tmp" / "orchestrator-loop-state.json"
    run.env["WD"] = str(untrusted)
    codex_cao.model.set_script({"tester": [FAIL_REPLY, PASS_REPLY], "programmer": [PROGRAMMER_REPLY]})
    result = run.run(timeout=900)
    assert result.returncode == 0, explain(result)
    sequence = QUICK_ROUND + SHORT_ROUND
    assert run.archived() == numbered(sequence), explain(result)
    assert codex_cao.model.turns() == {role: sequence.count(role) for role in set(sequence)}, \
        codex_cao.model.events()
    resent = re.findall(r"\| (\w+): terminal \w+ does not show the prompt", result.stdout)
    trusted = re.findall(r"\| (\w+): Codex's question whether to trust the project on terminal \w+ .*: "
                         r"choosing 1\. \"Trust and continue\"", result.stdout)
    assert sorted(resent + trusted) == sorted(QUICK_ROUND), explain(result)     # each agent's first prompt, once
    print(f"trust dialog: answered as a menu for {len(trusted)} agents, by a resent prompt for {len(resent)}")
    assert "reminder" not in result.stdout and "reminder" not in [e["kind"] for e in codex_cao.model.events()]


def kill_programmer_while_it_works(cao, run: Run, prompt: int = 1) -> tuple[subprocess.CompletedProcess, float]:
    """Start the run; once the model has taken the programmer's ``prompt``-th prompt (scripted to "think" 20 s,
    the CLI waiting on it, working), kill -9 its agent CLI and let the run end. Returns the result and when."""
    process = run.start()
    try:
        deadline = time.monotonic() + 600
        while cao.model.turns().get("programmer", 0) < prompt:
            assert process.poll() is None and time.monotonic() < deadline, "the programmer never got its prompt"
            time.sleep(0.2)
        time.sleep(2)
        cao.kill_agent_cli(run.state()["terminals"]["programmer"])
        killed_at = time.time()
        out, err = process.communicate(timeout=900)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    return subprocess.CompletedProcess(process.args, process.returncode, out, err), killed_at


def check_programmer_replaced(cli: str, run: Run, result, killed_at: float) -> None:
    """The run passed with one replacement, the programmer's, for the reason a dead CLI gives."""
    assert result.returncode == 0, explain(result)
    assert "replacement 1/3: programmer" in result.stdout and "its agent CLI exited" in result.stdout, explain(result)
    noticed = re.search(r"^\[([\d: -]+)\] replacing the programmer agent", result.stdout, re.MULTILINE)
    print(f"fault-reaction: {cli} killed, replacing after "
          f"{time.mktime(time.strptime(noticed.group(1), '%Y-%m-%d %H:%M:%S')) - killed_at:.0f}s (1 s resolution)")
    assert [r["role"] for r in run.state()["replacements"]] == ["programmer"]


def test_claude_code_whose_model_is_overloaded_three_times_recovers_and_passes(claude_cao):
    """The model answers 529 "overloaded" until Claude Code gives up, three times over: each time the
    loop pauses, tells the agent to continue, and the fourth try goes through."""
    settings = claude_cao.home / ".claude" / "settings.json"
    original = settings.read_text(encoding="utf-8")
    data = json.loads(original)
    data["env"]["CLAUDE_CODE_MAX_RETRIES"] = "0"          # it gives up at once instead of after ~3 minutes
    settings.write_text(json.dumps(data, indent=2), encoding="utf-8")
    try:
        run = real_cli_run(claude_cao, START_AGENT="tester", IDLE_GRACE_SECONDS="5",
                           PROVIDER_ERROR_PAUSE_SECONDS="2")
        claude_cao.model.set_script({"tester": [PASS_REPLY]})
        claude_cao.model.fail_next(3, status=529)
        result = run.run(timeout=600)
    finally:
        settings.write_text(original, encoding="utf-8")
    assert result.returncode == 0, explain(result)
    assert "retry 3/3" in result.stdout and "API Error: 529" in result.stdout, explain(result)
    errors = [e for e in claude_cao.model.events() if e["action"] == "error"]
    assert len(errors) == 3 and claude_cao.model.turns() == {"tester": 1}, claude_cao.model.events()
    assert run.state()["final_status"] == "PASS"


# ---------------------------------------------------------------------------
# OpenCode, under CAO's opencode_cli provider
# ---------------------------------------------------------------------------

def start_up_seconds(stdout: str) -> float:
    """From the log line that starts creating the five terminals to the one that reports them made."""
    stamps = [re.search(rf"^\[([\d: -]+)\] {what}", stdout, re.MULTILINE) for what in ("creating the five", "new run:")]
    begin, end = (time.mktime(time.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S")) for stamp in stamps)
    return end - begin


def test_opencode_fail_then_pass_with_its_programmer_killed_in_round_2(opencode_cao):
    """OpenCode, from the programmer on: FAIL in round 1 (the programmer's reply written twice, only the second
    read), every reply taken once, no reminder (CAO answers `completed` throughout a later turn, so only the
    reply file and the still screen can tell that it ended). In round 2 the programmer's OpenCode is killed -9
    while it works: its full-screen drawing stays in the pane with a shell prompt somewhere in it; a new agent
    gets the whole prompt and the run PASSes. The tokens reported are the model's, exactly. One run for both,
    and no analysis phase (the same handoff as the programmer's): each OpenCode start costs ~15 s of CPU, each
    OpenCode running keeps a part of a core busy, and each turn on a loaded machine costs more. So the two
    analysts, which a run from the programmer on never asks, and the peer programmer (its turns prove nothing
    the programmer's and the tester's do not) are the scripted agent (a provider per role).
    OpenCode has run once in this HOME, as for a user who has used it before: a fresh HOME's first start-up
    is bench/bench_start_up.py's."""
    cao = opencode_cao
    assert (cao.home / ".local" / "share" / "opencode").exists()      # OpenCode ran here once
    run = real_cli_run(cao, REPLACE_LOST_AGENTS="1", START_AGENT="programmer", AGENT_HOME=str(cao.home),
                       ANALYST_PROVIDER="mock_cli", PEER_ANALYST_PROVIDER="mock_cli",
                       PEER_PROGRAMMER_PROVIDER="mock_cli")
    draft_then_answer = {**ANALYST_IN_TWO_WRITES, "text": PROGRAMMER_REPLY}
    cao.model.set_script({"tester": [FAIL_REPLY, PASS_REPLY],
                          "programmer": [draft_then_answer, {"text": PROGRAMMER_REPLY, "think_ms": 20000},
                                         PROGRAMMER_REPLY]})
    result, killed_at = kill_programmer_while_it_works(cao, run, prompt=2)
    check_programmer_replaced("opencode", run, result, killed_at)
    sequence = SHORT_ROUND + SHORT_ROUND
    assert run.archived() == numbered(sequence), explain(result)
    expected = {role: sequence.count(role) for role in set(sequence) - {"peer_programmer"}}
    expected["programmer"] += 1                                   # the killed turn, then its replacement's
    assert cao.model.turns() == expected, cao.model.events()
    assert "reminder" not in [event["kind"] for event in cao.model.events()], cao.model.events()
    assert "reminder" not in result.stdout, explain(result)
    assert run.state()["final_status"] == "PASS" and run.state()["current_round"] == 2
    programmer_writes = [w["draft"] for w in cao.model.writes() if w["role"] == "programmer"]
    assert programmer_writes[0] and not programmer_writes[1], cao.model.events()      # a draft, then the answer
    assert run.archived_text("001-programmer.md").strip() == PROGRAMMER_REPLY.strip(), explain(result)
    assert run.archived_text("003-tester.md").strip() == FAIL_REPLY.strip()
    assert run.archived_text("006-tester.md").strip() == PASS_REPLY.strip()
    check_tokens_are_the_models(cao, run, unanswered={("programmer", 2)}, scripted=("peer_programmer",))
    REAL_CLI_TURN_TIMES.setdefault(cao.env["PROVIDER"], []).extend(
        turn for turn in timed_turns(cao, run, result.stdout) if turn[0] != "peer_programmer")  # OpenCode's only


def first_fail_then_pass_with_a_model_per_role(cao, provider: str) -> None:
    """The FAIL -> PASS run with the reviewers and the tester on another model, as the first run of its
    module's server: its five agents' start-up in a fresh HOME counts for the summary. The programmer's CLI
    is killed -9 while it works in round 2: a new agent, on the programmer's model, gets the whole prompt."""
    settings, expected = cheaper_reviewers("scripted-large", "scripted-small")
    stdout = fail_then_pass(cao, kill_in_round_2=True, **settings)
    assert cao.model.models_by_role() == expected
    assert "warning" not in stdout
    REAL_CLI_START_UPS.setdefault(provider, []).append((start_up_seconds(stdout), "again, one at a time" in stdout))


# ---------------------------------------------------------------------------
# GitHub Copilot CLI, under CAO's copilot_cli provider (started with --autopilot)
# ---------------------------------------------------------------------------

def test_copilot_fail_then_pass_with_a_model_per_role_and_its_programmer_killed(copilot_cao):
    """Copilot: FAIL in round 1, PASS in round 2, every reply taken once, no reminder, no resend (CAO's
    ready status is not trusted: its turn's end is read from its session log, else the screen, whose spinner
    turns while Copilot works, still for 2 s); the reviewers and the tester on another model (CAO passes
    --model); its programmer killed -9 mid-turn in round 2 and replaced."""
    first_fail_then_pass_with_a_model_per_role(copilot_cao, "copilot_cli")


def test_copilot_story_mode(copilot_cao):
    """Story mode with Copilot."""
    story_mode(copilot_cao)


# ---------------------------------------------------------------------------
# Hermes Agent, under CAO's hermes provider
# ---------------------------------------------------------------------------

def test_hermes_fail_then_pass_with_a_model_per_role_and_its_programmer_killed(hermes_cao):
    """Hermes: FAIL in round 1, PASS in round 2, every reply taken once, no reminder, no resend; the
    reviewers and the tester on another model (CAO passes --model); its programmer killed -9 mid-turn in
    round 2 and replaced."""
    first_fail_then_pass_with_a_model_per_role(hermes_cao, "hermes")


def test_hermes_story_mode(hermes_cao):
    """Story mode with Hermes."""
    story_mode(hermes_cao)
