"""The table of agent CLIs (AGENT_CLIS): a CLI is one row, and the loop takes what it knows of a CLI from that
row alone. A made-up CLI, added as a row and nothing else, runs a whole FAIL -> PASS loop through the fake CAO:
its provider is what CAO is asked for, its menu gets the choice its row names, the words its row gives for a
lost conversation make the next prompt carry the full task, and CAO's ready status, which its row says cannot
be trusted, does not end its turns."""

from __future__ import annotations

import json
import re
from pathlib import Path

from conftest import FAST, run_main
from fake_cao import FAIL_REPLY, PASS_REPLY

PROGRAMMER_ON = {**FAST, "MIN_REVIEW_CYCLES_BEFORE_APPROVAL": "1", "START_AGENT": "programmer"}
EXPLORE_TEXT = "Build a greeting CLI: `greet NAME` prints `Hello, NAME!`."

MADE_UP_MENU = """\
  Upgrade to Made-up Pro for faster answers?
› 1. Upgrade now
  2. Not now
"""


def made_up_row(m):
    return m.AgentCli("Made-up CLI", ready_status_trusted=False, still_screen_ends_turn=0.3,
                      conversation_words=(("Memorywiped", "cleared"),),
                      menus=(("Made-up CLI's upsell", "Not now"),))


def test_every_row_names_records_and_settings_the_loop_can_read(orch):
    for provider, cli in orch.AGENT_CLIS.items():
        assert cli.label and re.fullmatch(r"[a-z_]+", provider)
        assert not cli.records or cli.records in orch.RECORD_FORMATS, provider
        assert not cli.compaction_settings or cli.compaction_settings in orch.COMPACTION_READERS, provider
        assert all(what in ("compacted", "cleared") for _, what in cli.conversation_words), provider


def test_a_provider_without_a_row_gets_cao_s_word(orch):
    cli = orch.agent_cli("not_a_cli")
    assert cli.ready_status_trusted and not cli.records and not cli.menus and not cli.conversation_words


def test_a_made_up_cli_added_as_a_row_runs_the_loop(load_orch, fake_cao, prompt_file, monkeypatch, capsys):
    """Round 1: the tester's made-up CLI opens its upsell menu with its answer held back; the loop moves to
    "Not now" and picks it, and the CLI writes its answer (FAIL) and says "Memory wiped". CAO reads
    `completed` at once, but the row says that cannot be trusted: a still screen ends the turn. Round 2's
    tester prompt carries the task in full; PASS."""
    m = load_orch(PROMPT_FILE=str(prompt_file), PROVIDER="made_up_cli", IGNORE_MISSING_CLI="1", **PROGRAMMER_ON)
    monkeypatch.setitem(m.AGENT_CLIS, "made_up_cli", made_up_row(m))
    highlighted_not_now = MADE_UP_MENU.replace("› 1.", "  1.").replace("  2.", "› 2.")

    def upsell(fake, terminal):
        terminal.printed = terminal.last_output = MADE_UP_MENU
        terminal.status = "waiting_user_answer"

    def keys(fake, terminal, key):
        if key == "Down" and terminal.printed == MADE_UP_MENU:
            terminal.printed = highlighted_not_now
        elif key == "Enter" and terminal.printed == highlighted_not_now:
            Path(terminal.response_path).write_text(FAIL_REPLY, encoding="utf-8")
            terminal.printed, terminal.status = "Memory wiped.\n" + FAIL_REPLY, "completed"

    fake_cao.script["tester"] = [{"action": "call", "call": upsell}, PASS_REPLY]
    fake_cao.key_hook = keys
    assert run_main(m) == 0
    assert {terminal.provider for terminal in fake_cao.terminals.values()} == {"made_up_cli"}
    assert fake_cao.keys == [("tester", "Down"), ("tester", "Enter")]
    state = json.loads(Path(m.STATE_FILE).read_text())
    assert state["final_status"] == "PASS" and state["current_round"] == 2
    second = fake_cao.prompts_for("tester")[1]
    assert EXPLORE_TEXT in second and m.EXPLORE_BACK_REFERENCE not in second
    assert [(e["role"], e["what"]) for e in state["agent_events"]] == [("tester", "cleared")]
    out = capsys.readouterr().out
    assert "Made-up CLI's upsell on terminal" in out and 'choosing 2. "Not now"' in out
    tester_ends = re.findall(r"tester: reply received.*turn end seen by ([^,]+),", out)
    assert tester_ends[0] == m.TURN_ENDED_BY_STILL_SCREEN, out


def test_no_provider_is_named_outside_the_table(orch):
    """What docs/code-map.md's awk command checks: outside the table, no line of the script quotes a provider."""
    lines = Path(orch.__file__).read_text(encoding="utf-8").splitlines()
    start = lines.index(next(line for line in lines if line.startswith("# -- The agent CLIs")))
    end = lines.index(next(line for line in lines if line.startswith("DEFAULT_PROVIDER = ")))
    quoted = re.compile("|".join(f'"{re.escape(provider)}"' for provider in orch.AGENT_CLIS))
    outside = [f"{number}: {line}" for number, line in enumerate(lines, 1)
               if not start < number <= end + 1 and quoted.search(line)]
    assert outside == []


def test_the_versions_a_row_says_are_proven_are_those_the_end_to_end_suite_runs(orch):
    """`proven` names the pinned release tests/e2e/test_real_clis.py runs for that CLI."""
    import e2e.agent_clis as pinned

    assert {provider: cli.proven for provider, cli in orch.AGENT_CLIS.items() if cli.proven} == {
        "claude_code": pinned.CLAUDE_CODE_VERSION, "codex": pinned.CODEX_VERSION, "opencode_cli": pinned.OPENCODE_VERSION,
        "copilot_cli": pinned.COPILOT_VERSION, "hermes": pinned.HERMES_VERSION}
