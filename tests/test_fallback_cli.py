"""A fallback CLI per role: a usage limit that outlasts USAGE_LIMIT_MAX_WAIT hands the role to another CLI.

The settings and the choice are pure functions; the switch itself is driven
through main() against the respx fake CAO (tests/fake_cao.py), whose agents
show a usage limit on their screens as Codex does (as in test_long_runs.py).
A stop at each instant around the switch is a KeyboardInterrupt raised at the
loop's own crash points; the rerun is a new module loaded on the same fake.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from conftest import FAST, run_main
from fake_cao import FAIL_REPLY, PASS_REPLY

QUICK = {**FAST, "MIN_REVIEW_CYCLES_BEFORE_APPROVAL": "1"}
TESTER_ONLY = {**QUICK, "START_AGENT": "tester"}
PROGRAMMER_ON = {**QUICK, "START_AGENT": "programmer"}
FALLBACK = {"FALLBACK_PROVIDER": "claude_code", "FALLBACK_MODEL": "claude-sonnet-4-5"}
EXPLORE_TEXT = "Build a greeting CLI: `greet NAME` prints `Hello, NAME!`."


def codex_limit_line(when: datetime) -> str:
    return f"■ You've hit your usage limit. Try again at {when.strftime('%I:%M %p').lstrip('0')}."


def limited(line: str, then_text: str = PASS_REPLY) -> dict:
    """A fake agent step: it stops at its usage limit without its file; told to continue, it writes `then_text`."""
    return {"action": "write_on_reminder", "text": then_text, "output": line}


def claude_limit_line(when: datetime) -> str:
    return f"You've hit your session limit · resets {when.strftime('%I:%M%p').lstrip('0').lower()}"


FAR_LIMIT = codex_limit_line(datetime.now() + timedelta(hours=2))
CLAUDE_FAR_LIMIT = claude_limit_line(datetime.now() + timedelta(hours=2))   # the fallback's own, in its words
NO_RESET = "■ You've hit your usage limit. Try again later."


def terminals_of_tester(fake_cao) -> list:
    return [t for t in fake_cao.terminals.values() if t.role == "tester"]


def state_of(m) -> dict:
    return json.loads(Path(m.STATE_FILE).read_text())


def events_of(m) -> list[dict]:
    return [json.loads(line) for line in Path(m.run_dir, "events.jsonl").read_text().splitlines()]


# -- the settings and the choice ---------------------------------------------------------------------------

def test_the_fallback_settings_are_declared_like_the_role_settings(orch):
    for env, key in (("FALLBACK_PROVIDER", "recovery.fallback_provider"),
                     ("FALLBACK_MODEL", "recovery.fallback_model"),
                     ("TESTER_FALLBACK_PROVIDER", "agents.tester.fallback_provider"),
                     ("PEER_ANALYST_FALLBACK_MODEL", "agents.peer_analyst.fallback_model")):
        assert orch.SETTINGS_BY_ENV[env].key == key and orch.SETTINGS_BY_ENV[env].default == ""


def test_a_roles_fallback_is_its_own_else_the_common_one_and_never_its_own_cli(load_orch):
    m = load_orch(PROVIDER="codex", FALLBACK_PROVIDER="claude_code", TESTER_FALLBACK_PROVIDER="opencode_cli",
                  TESTER_FALLBACK_MODEL="x/y", PROGRAMMER_PROVIDER="claude_code")
    assert m.fallback_for("analyst") == ("claude_code", "")
    assert m.fallback_for("tester") == ("opencode_cli", "x/y")
    assert m.fallback_for("programmer") is None              # its own CLI and model: no fallback
    assert m.providers_in_use() == ["claude_code", "codex", "opencode_cli"]
    assert ("tester", "opencode_cli") in m.profiles_in_use() and ("tester", "codex") in m.profiles_in_use()
    unset = load_orch(PROVIDER="codex")
    assert unset.fallback_for("tester") is None and unset.providers_in_use() == ["codex"]


def test_a_fallback_provider_cao_does_not_know_is_refused(load_orch, prompt_file, capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), FALLBACK_PROVIDER="no_such_cli")
    assert run_main(m) == 2
    assert "FALLBACK_PROVIDER" in capsys.readouterr().err


def test_check_looks_for_the_fallback_cli_on_the_agents_path(load_orch, tmp_path):
    m = load_orch(PROVIDER="codex", FALLBACK_PROVIDER="claude_code")
    side = m.AgentsSide({"HOME": str(tmp_path)}, 1000, {"codex": ("/usr/bin/codex", "")})
    missing = [line for line in m.check_clis(side, None) if line.ok is not True]     # a warning: it may never be needed
    assert [line.ok for line in missing] == [None] and missing[0].text.startswith("every role's fallback: claude ")
    assert "provider claude_code" in missing[0].text
    assert {trap.env for trap in m.AGENT_CLIS["claude_code"].traps if trap.env} <= {
        trap.env for provider in m.providers_in_use() for trap in m.agent_cli(provider).traps if trap.env}


@pytest.mark.parametrize("settings, named", [({"FALLBACK_PROVIDER": "claude_code"}, "(FALLBACK_PROVIDER=claude_code)"),
                                              ({"TESTER_FALLBACK_PROVIDER": "claude_code"},
                                               "(TESTER_FALLBACK_PROVIDER=claude_code)")])
def test_a_fallback_cli_the_server_reports_missing_is_a_warning_naming_its_setting(load_orch, fake_cao, prompt_file,
                                                                                   capsys, settings, named):
    fake_cao.missing_clis = {"claude_code"}
    m = load_orch(PROMPT_FILE=str(prompt_file), **settings, **TESTER_ONLY)
    assert run_main(m) == 0                                # the role's own CLI may never reach its limit
    warned = [line for line in capsys.readouterr().out.splitlines() if named in line]
    assert len(warned) == 1 and "fallback: cao-server at" in warned[0], warned


def test_check_asks_whether_the_fallback_cli_is_signed_in(load_orch, tmp_path):
    m = load_orch(PROVIDER="codex", FALLBACK_PROVIDER="claude_code")
    side = m.AgentsSide({"HOME": str(tmp_path)}, 1000, {})
    lines = m.check_sign_ins(side)
    assert any(line.text.startswith("every role's fallback: Claude Code: not signed in") and line.ok is None
               for line in lines), lines


def test_a_state_file_from_before_reads_as_no_switch(orch):
    assert orch.STATE_FIELDS_BY_NAME["cli_switches"].parse(None) == []
    assert orch.STATE_FIELDS_BY_NAME["cli_switches"].parse([{"role": "tester"}, "junk", {"x": 1}]) == []
    assert orch.TurnRecord.from_json({"role": "tester"}).provider == ""


# -- the loop: when the fallback acts ----------------------------------------------------------------------

def test_a_reset_within_the_wait_is_waited_out_on_the_roles_own_cli(load_orch, fake_cao, prompt_file):
    fake_cao.script["tester"] = [limited(codex_limit_line(datetime.now()))]
    m = load_orch(PROMPT_FILE=str(prompt_file), USAGE_LIMIT_MARGIN_SECONDS="0.5", **FALLBACK, **TESTER_ONLY)
    assert run_main(m) == 0
    assert [t.provider for t in terminals_of_tester(fake_cao)] == ["codex"]
    assert [message.split(".")[0] for _, message in fake_cao.reminders] == ["Your usage limit has reset"]
    assert state_of(m)["cli_switches"] == []


def test_a_reset_beyond_the_wait_hands_the_turn_to_the_fallback_cli_in_full(load_orch, fake_cao, prompt_file,
                                                                           capsys):
    """The tester stops at a limit two hours away (USAGE_LIMIT_MAX_WAIT one hour): its agent is ended, a new
    one on Claude Code gets the whole prompt as a new conversation, and the turn counts once."""
    fake_cao.script["tester"] = [limited(FAR_LIMIT), PASS_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), USAGE_LIMIT_MAX_WAIT="3600", **FALLBACK, **TESTER_ONLY)
    assert run_main(m) == 0
    first, second = terminals_of_tester(fake_cao)
    assert (first.provider, second.provider) == ("codex", "claude_code")
    assert first.exited or first.deleted
    prompts = fake_cao.prompts_for("tester")
    assert len(prompts) == 2 and EXPLORE_TEXT in prompts[1] and fake_cao.reminders == []
    out = capsys.readouterr().out
    assert ("tester: usage limit beyond USAGE_LIMIT_MAX_WAIT=3600s (resets " in out
            and f"going over from codex (its CLI default) to its fallback claude_code (claude-sonnet-4-5); terminal "
                f"{second.id} (was {first.id}) takes the turn in full, a new conversation, and the role for the rest "
                "of the run" in out)
    state = state_of(m)
    [switch] = state["cli_switches"]
    assert (switch["role"], switch["from_provider"], switch["to_provider"], switch["to_model"],
            switch["old_terminal"], switch["new_terminal"]) == ("tester", "codex", "claude_code",
                                                                "claude-sonnet-4-5", first.id, second.id)
    assert switch["resets_at"] and switch["limit"].startswith("You've hit your usage limit")
    assert state["models"]["tester"] == "claude-sonnet-4-5"
    assert [(t["role"], t["provider"], t["terminal"]) for t in state["turn_records"]] == [
        ("tester", "claude_code", second.id)]
    events = events_of(m)
    [switched] = [e for e in events if e["event"] == "cli_switched"]
    assert (switched["from_provider"], switched["to_provider"], switched["new_terminal"]) == (
        "codex", "claude_code", second.id)
    assert [e["provider"] for e in events if e["event"] == "reply_taken"] == ["claude_code"]
    summary = json.loads(Path(m.run_dir, "summary.json").read_text())
    assert summary["turns"] == 1 and summary["turn_list"][0]["provider"] == "claude_code"
    assert list(summary["clis"]) == ["claude_code"] and summary["clis"]["claude_code"]["turns"] == 1
    assert summary["cli_switches"][0]["to_provider"] == "claude_code"
    page = Path(m.run_dir, "report.html").read_text()
    assert "; claude_code</summary>" in page and 'id="tokens-per-cli"' in page
    assert "tester codex (its CLI default) -&gt; claude_code (claude-sonnet-4-5)" in page

    assert run_main(load_orch(**TESTER_ONLY), "--status") == 0
    assert "on a fallback CLI for the rest of the run: tester codex" in capsys.readouterr().out
    assert run_main(load_orch(**TESTER_ONLY), "--status", "--json") == 0
    assert json.loads(capsys.readouterr().out)["cli_switches"][0]["new_terminal"] == second.id


def test_a_limit_with_no_reset_time_hands_the_turn_over_too(load_orch, fake_cao, prompt_file):
    fake_cao.script["tester"] = [limited(NO_RESET), PASS_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), **FALLBACK, **TESTER_ONLY)
    assert run_main(m) == 0
    assert [t.provider for t in terminals_of_tester(fake_cao)] == ["codex", "claude_code"]
    [switch] = state_of(m)["cli_switches"]
    assert switch["resets_at"] == ""
    assert [e["resets_at"] for e in events_of(m) if e["event"] == "cli_switched"] == [None]


def test_without_a_fallback_such_a_limit_stops_the_run_as_before(load_orch, fake_cao, prompt_file, capsys):
    fake_cao.script["tester"] = [limited(FAR_LIMIT), PASS_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), USAGE_LIMIT_MAX_WAIT="3600", **TESTER_ONLY)
    assert run_main(m) == 3
    assert "stopped at its account's usage limit" in capsys.readouterr().err
    assert [t.provider for t in terminals_of_tester(fake_cao)] == ["codex"]
    assert state_of(m)["cli_switches"] == [] and state_of(m)["in_flight"]["limit_line"]


def test_later_turns_of_the_role_stay_on_the_fallback(load_orch, fake_cao, prompt_file):
    """Round 1's tester turn goes over to Claude Code and FAILs; round 2's tester turn goes to the same agent on
    Claude Code (no switch back once the first limit has reset); the other roles stay on Codex."""
    fake_cao.script["tester"] = [limited(FAR_LIMIT), FAIL_REPLY, PASS_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), USAGE_LIMIT_MAX_WAIT="3600", **FALLBACK, **PROGRAMMER_ON)
    assert run_main(m) == 0
    state = state_of(m)
    by_role = {}
    for record in state["turn_records"]:
        by_role.setdefault(record["role"], set()).add((record["provider"], record["terminal"]))
    [(provider, terminal)] = by_role["tester"]
    assert provider == "claude_code" and terminal == state["cli_switches"][0]["new_terminal"]
    assert {p for role, pairs in by_role.items() if role != "tester" for p, _ in pairs} == {"codex"}
    assert len(state["cli_switches"]) == 1
    summary = json.loads(Path(m.run_dir, "summary.json").read_text())
    assert summary["clis"]["claude_code"]["turns"] == 2 and summary["clis"]["codex"]["turns"] == 4


def test_the_fallbacks_own_limit_stops_the_run_and_never_switches_back(load_orch, fake_cao, prompt_file, capsys):
    """The fallback's agent meets its own far limit: the run stops (exit 3, resumable) as without a fallback;
    a rerun stops again sending nothing and making no agent; after the reset it continues on the fallback."""
    fake_cao.script["tester"] = [limited(FAR_LIMIT), limited(CLAUDE_FAR_LIMIT)]
    m = load_orch(PROMPT_FILE=str(prompt_file), USAGE_LIMIT_MAX_WAIT="3600", **FALLBACK, **TESTER_ONLY)
    assert run_main(m) == 3
    assert "stopped at its account's usage limit" in capsys.readouterr().err
    assert [t.provider for t in terminals_of_tester(fake_cao)] == ["codex", "claude_code"]
    state = state_of(m)
    assert len(state["cli_switches"]) == 1 and state["in_flight"]["limit_line"].startswith("You've hit your session")
    assert state["in_flight"]["limit_until"] > time.time() + 3600

    m = load_orch(PROMPT_FILE=str(prompt_file), USAGE_LIMIT_MAX_WAIT="3600", **FALLBACK, **TESTER_ONLY)
    assert run_main(m) == 3
    assert len(terminals_of_tester(fake_cao)) == 2 and len(fake_cao.prompts_for("tester")) == 2

    state["in_flight"]["limit_until"] = time.time() + 0.3
    Path(m.STATE_FILE).write_text(json.dumps(state))
    m = load_orch(PROMPT_FILE=str(prompt_file), **FALLBACK, **TESTER_ONLY)
    assert run_main(m) == 0
    assert [(role, message.split(".")[0]) for role, message in fake_cao.reminders] == [
        ("tester", "Your usage limit has reset")]
    final = state_of(m)
    assert len(final["cli_switches"]) == 1 and final["turn_records"][0]["provider"] == "claude_code"


def test_a_rerun_with_a_fallback_set_now_hands_over_a_turn_stopped_at_a_limit(load_orch, fake_cao, prompt_file):
    """A run stopped at a far limit without a fallback; the rerun with FALLBACK_PROVIDER goes over at once."""
    fake_cao.script["tester"] = [limited(FAR_LIMIT), PASS_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), USAGE_LIMIT_MAX_WAIT="3600", **TESTER_ONLY)
    assert run_main(m) == 3
    m = load_orch(PROMPT_FILE=str(prompt_file), USAGE_LIMIT_MAX_WAIT="3600", **FALLBACK, **TESTER_ONLY)
    assert run_main(m) == 0
    assert [t.provider for t in terminals_of_tester(fake_cao)] == ["codex", "claude_code"]
    assert len(fake_cao.prompts_for("tester")) == 2


# -- resume and crash safety -------------------------------------------------------------------------------

@pytest.mark.parametrize("step", ["fallback-decided", "fallback-switched"])
def test_a_stop_around_the_switch_is_finished_by_the_rerun_with_one_new_agent(load_orch, fake_cao, prompt_file,
                                                                            monkeypatch, step):
    """Stopped right after the decision is saved (nothing asked of CAO yet), or right after the new agent is
    saved (the old one not yet ended): the same command goes on with the fallback for the role, one agent on
    it, the turn sent to it once and counted once."""
    fake_cao.script["tester"] = [limited(FAR_LIMIT), PASS_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), USAGE_LIMIT_MAX_WAIT="3600", **FALLBACK, **TESTER_ONLY)

    def stop_at(name):
        if name == step:
            raise KeyboardInterrupt
    monkeypatch.setattr(m, "crash_point", stop_at)
    assert run_main(m) == 130
    state = state_of(m)
    [switch] = state["cli_switches"]
    assert switch["new_terminal"] == ("" if step == "fallback-decided" else state["terminals"]["tester"])

    m = load_orch(PROMPT_FILE=str(prompt_file), USAGE_LIMIT_MAX_WAIT="3600", **FALLBACK, **TESTER_ONLY)
    assert run_main(m) == 0
    assert [t.provider for t in terminals_of_tester(fake_cao)] == ["codex", "claude_code"]
    prompts = fake_cao.prompts_for("tester")
    assert len(prompts) == 2 and EXPLORE_TEXT in prompts[1]
    final = state_of(m)
    assert len(final["cli_switches"]) == 1 and final["cli_switches"][0]["new_terminal"]
    assert final["cli_switches"][0]["old_ended"] is True
    limited_agent = terminals_of_tester(fake_cao)[0]
    assert limited_agent.exited or limited_agent.deleted                 # ended by the rerun, if not before
    assert [t["provider"] for t in final["turn_records"]] == ["claude_code"]
    assert [e["event"] for e in events_of(m)].count("cli_switched") == 1
