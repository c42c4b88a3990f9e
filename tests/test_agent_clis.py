"""The table of agent CLIs (AGENT_CLIS): a CLI is one row, and the loop takes what it knows of a CLI from that
row alone. A made-up CLI, added as a row and nothing else, runs a whole FAIL -> PASS loop through the fake CAO:
its provider is what CAO is asked for, its menu (its own glyph on the highlighted choice) gets the choice its row
names, the words its row gives for a compaction make the next prompt carry the full task, its usage limit is
waited out until the reset its row reads, and CAO's ready status, which its row says cannot be trusted, does
not end its turns, while its own marks on its screen do; its own reader of running totals
gives each turn's tokens, a replacement whose start timed out gets the second try its row gives, and --check
looks for the trap its row declares. No code outside the table names a CLI."""

from __future__ import annotations

import ast
import json
import re
from dataclasses import replace
from datetime import datetime
from pathlib import Path

from conftest import FAST, project_files, run_main
from fake_cao import FAIL_REPLY, PASS_REPLY

PROGRAMMER_ON = {**FAST, "MIN_REVIEW_CYCLES_BEFORE_APPROVAL": "1", "START_AGENT": "programmer"}
EXPLORE_TEXT = "Build a greeting CLI: `greet NAME` prints `Hello, NAME!`."

MADE_UP_MENU = """\
  Upgrade to Made-up Pro for faster answers?
➤ 1. Upgrade now
  2. Not now
"""
MADE_UP_COMPACTION = "✂ History squashed to fit."


def made_up_limit_line(reset: datetime) -> str:
    """The made-up CLI's words for its usage limit, its reset on a 24-hour clock."""
    return f"⚠ Your quota is used up; back at {reset:%Hh%M}. Upgrade for more."


# The made-up CLI's own marks of its turns: another escape than Codex's, other words.
MADE_UP_BUSY, MADE_UP_FINISHED, MADE_UP_RESTING = (f"\x1b]777;turn={word}\x07" for word in ("busy", "finished", "resting"))
MADE_UP_MARKS = (MADE_UP_RESTING, MADE_UP_BUSY, MADE_UP_FINISHED + MADE_UP_RESTING)   # how the fake CAO draws them
MADE_UP_MODEL_USE = {"input": 1000, "cached_input": 0, "output": 100}   # what each prompt costs the made-up CLI


def made_up_row(m):
    """The made-up CLI, all of it in its row: its screen's words (a compaction, a cleared conversation, a nearly
    full context, its usage limit and reset), its menu and the glyph it highlights a choice with, its own marks
    of its turns, a set-up trap, how it is signed in, records that keep running totals only (read by its own
    reader), and a second try for a start CAO says timed out."""
    prompts: dict[str, int] = {}                  # the prompts it has taken, by the turn's marker

    def totals(marker):
        taken = prompts.get(marker, 0)
        return {f"session of {marker}": {"made-up-model": m.TokenUse(
            MADE_UP_MODEL_USE["input"] * taken, 0, MADE_UP_MODEL_USE["output"] * taken)}}

    def totals_now(marker):                       # noted as a turn is first sent; the CLI then takes it
        before = totals(marker)
        prompts[marker] = prompts.get(marker, 0) + 1
        return before

    def read_turn(marker, since, until, before):
        return None if before is None else m.TokenReading(m.totals_grown(totals(marker), before), over=False)

    return m.AgentCli("Made-up CLI", ready_status_trusted=False, still_screen_ends_turn=0.3,
                      conversation_words=(("Historysquashed", "compacted"), ("Memorywiped", "cleared")),
                      context_low=r"Roomleft:(?P<left>\d+)%",
                      menus=(("Made-up CLI's upsell", "Not now"),), menu_cursor="➤",
                      usage_limit=r"Your (?P<what>quota) is used up(?P<rest>.*)",
                      usage_limit_resets=r"back at (?P<hour>\d{2})h(?P<minute>\d{2})",
                      records=m.TokenRecords("made-up running totals", read_turn, totals_now),
                      program="madeup", start_tries=2,
                      turn_marks=(r"\x1b\]777;turn=(\w+)\x07", "busy", "finished", "resting"),
                      traps=(m.Trap("Made-up CLI: its key set in {file}",
                                    'Made-up CLI: no key in {file}: add {"apiKey": "<key>"} to it',
                                    file=".made-up/settings.json", json_key="apiKey"),),
                      sign_in=m.SignIn("`madeup login`", "or set MADEUP_KEY for the agents",
                                       (m.Credential("{variable}", env=("MADEUP_KEY",)),
                                        m.Credential("its login, {file}", file=".made-up/auth.json", json_key="token"))))


def test_every_row_names_records_and_settings_the_loop_can_read(orch):
    for provider, cli in orch.AGENT_CLIS.items():
        assert cli.label and re.fullmatch(r"[a-z_]+", provider)
        assert not cli.records or cli.records in orch.RECORD_FORMATS, provider
        assert not cli.compaction_settings or cli.compaction_settings in orch.COMPACTION_READERS, provider
        assert all(what in ("compacted", "cleared") for _, what in cli.conversation_words), provider


def test_a_provider_without_a_row_gets_cao_s_word(orch):
    cli = orch.agent_cli("not_a_cli")
    assert cli.ready_status_trusted and not cli.records and not cli.menus and not cli.conversation_words


def test_a_made_up_cli_s_screen_is_read_by_its_row_alone(orch):
    """Its words for a compaction, a cleared conversation, a nearly full context and its usage limit with its
    reset, and its menu highlighted by its own glyph, are read with its row -- and with no other CLI's."""
    row, codex = made_up_row(orch), orch.agent_cli("codex")
    for screen, change in ((MADE_UP_COMPACTION, ("compacted", "")), ("Memory wiped.", ("cleared", "")),
                           ("Room left: 12%", ("context low", "12% left"))):
        assert orch.conversation_change(screen, row) == change and orch.conversation_change(screen) == ("", "")
    now = datetime(2026, 11, 25, 14, 0).timestamp()
    limit = orch.usage_limit_on(f"working...\n{made_up_limit_line(datetime(2026, 11, 25, 15, 5))}\n", now, row)
    assert limit == orch.UsageLimit("Your quota is used up; back at 15h05", datetime(2026, 11, 25, 15, 5).timestamp())
    assert orch.usage_limit_on(made_up_limit_line(datetime.now()), now, codex) is None
    menu = orch.open_menu(MADE_UP_MENU, row)
    assert menu.highlighted == 1 and menu.question == "Upgrade to Made-up Pro for faster answers?"
    assert orch.safe_menu_choice(menu, row) == ("Made-up CLI's upsell", 2)
    assert orch.open_menu(MADE_UP_MENU, codex) is None and orch.open_menu(MADE_UP_MENU) is None


def test_a_made_up_cli_added_as_a_row_runs_the_loop(load_orch, fake_cao, prompt_file, monkeypatch, capsys):
    """Round 1: the tester's made-up CLI opens its upsell menu, its own glyph on the highlighted choice, with
    its answer held back; the loop moves to "Not now" and picks it, and the CLI compacts its conversation and
    writes its answer (FAIL). CAO reads `completed` at once, but the row says that cannot be trusted: a still
    screen ends the turn. Round 2's tester prompt carries the task in full; the CLI stops at its usage limit,
    which resets this minute: the loop waits it out and tells it to continue -- no reminder, the prompt not
    sent again; PASS."""
    m = load_orch(PROMPT_FILE=str(prompt_file), PROVIDER="made_up_cli", IGNORE_MISSING_CLI="1",
                  USAGE_LIMIT_MARGIN_SECONDS="0.2", QUIET_SCREEN_SECONDS="0.3", **PROGRAMMER_ON)
    monkeypatch.setitem(m.AGENT_CLIS, "made_up_cli", made_up_row(m))
    highlighted_not_now = MADE_UP_MENU.replace("➤ 1.", "  1.").replace("  2.", "➤ 2.")

    def upsell(fake, terminal):
        terminal.printed = terminal.last_output = MADE_UP_MENU
        terminal.status = "waiting_user_answer"

    def keys(fake, terminal, key):
        if key == "Down" and terminal.printed == MADE_UP_MENU:
            terminal.printed = highlighted_not_now
        elif key == "Enter" and terminal.printed == highlighted_not_now:
            Path(terminal.response_path).write_text(FAIL_REPLY, encoding="utf-8")
            terminal.printed, terminal.status = f"{MADE_UP_COMPACTION}\n{FAIL_REPLY}", "completed"

    limited = {"action": "write_on_reminder", "text": PASS_REPLY, "output": made_up_limit_line(datetime.now())}
    fake_cao.script["tester"] = [{"action": "call", "call": upsell}, limited]
    fake_cao.key_hook = keys
    assert run_main(m) == 0
    assert {terminal.provider for terminal in fake_cao.terminals.values()} == {"made_up_cli"}
    assert fake_cao.keys == [("tester", "Down"), ("tester", "Enter")]
    state = json.loads(Path(m.STATE_FILE).read_text())
    assert state["final_status"] == "PASS" and state["current_round"] == 2
    tester_prompts = fake_cao.prompts_for("tester")
    assert len(tester_prompts) == 2 and EXPLORE_TEXT in tester_prompts[1]
    assert m.EXPLORE_BACK_REFERENCE not in tester_prompts[1]
    assert [message.split(".")[0] for _, message in fake_cao.reminders] == ["Your usage limit has reset"]
    assert [(e["role"], e["what"]) for e in state["agent_events"]] == [("tester", "compacted"),
                                                                      ("tester", "usage limit")]
    out = capsys.readouterr().out
    assert "Made-up CLI's upsell on terminal" in out and 'choosing 2. "Not now"' in out
    assert "tester: usage limit reached; waiting until" in out and "(Your quota is used up; back at" in out
    tester_ends = re.findall(r"tester: reply received.*turn end seen by ([^,]+),", out)
    assert tester_ends[0] == m.TURN_ENDED_BY_STILL_SCREEN, out


def test_a_made_up_cli_that_marks_its_turns_has_each_ended_by_its_mark(load_orch, fake_cao, prompt_file, monkeypatch,
                                                                       capsys):
    """Its row names its turn marks; CAO reads `processing` for good and no still screen is waited for (60 s):
    every turn, FAIL then PASS, ends by the made-up CLI's own end-of-turn mark."""
    m = load_orch(PROMPT_FILE=str(prompt_file), PROVIDER="made_up_cli", IGNORE_MISSING_CLI="1",
                  QUIET_SCREEN_SECONDS="60", **PROGRAMMER_ON)
    monkeypatch.setitem(m.AGENT_CLIS, "made_up_cli", replace(made_up_row(m), still_screen_ends_turn=None))
    fake_cao.turn_marks["made_up_cli"] = MADE_UP_MARKS
    fake_cao.reported_status = "processing"
    fake_cao.script["tester"] = [FAIL_REPLY, PASS_REPLY]
    assert run_main(m) == 0
    state = json.loads(Path(m.STATE_FILE).read_text())
    assert state["final_status"] == "PASS" and state["current_round"] == 2
    ends = re.findall(r"(\w+): reply received.*turn end seen by ([^,]+),", capsys.readouterr().out)
    assert [role for role, _ in ends].count("tester") == 2
    assert {ended_by for _, ended_by in ends} == {m.TURN_ENDED_BY_MARK}, ends


MADE_UP_TIMEOUT = "Failed to create terminal: Made-up CLI initialization timed out after 120 seconds"


def kill_cli_and_time_out_its_next_start(fake, terminal) -> None:
    """The made-up CLI dies; CAO says the new agent's first start timed out, and its second starts."""
    fake.fail_create[terminal.profile] = (500, MADE_UP_TIMEOUT)

    def on_create(created: str) -> None:
        if created == terminal.profile:
            fake.create_hook = lambda created: fake.fail_create.pop(created, None)
    fake.create_hook = on_create
    fake.kill_cli(terminal.role)


def test_a_made_up_cli_s_records_and_start_tries_come_from_its_row(load_orch, fake_cao, prompt_file, tmp_path,
                                                                   monkeypatch, capsys):
    """The same row, FAIL -> PASS, with its marks on its screen: each turn ends by its end-of-turn mark, and
    its tokens are what its reader made of the totals noted at the turn's first send and those read after; the
    tester's CLI dies in round 2 and CAO says its replacement's start timed out: the row's second try starts it,
    and the turn goes to it."""
    m = load_orch(PROMPT_FILE=str(prompt_file), PROVIDER="made_up_cli", IGNORE_MISSING_CLI="1",
                  REPLACE_LOST_AGENTS="1", AGENT_HOME=str(tmp_path), **PROGRAMMER_ON)   # its records read here
    monkeypatch.setitem(m.AGENT_CLIS, "made_up_cli", made_up_row(m))
    monkeypatch.setattr(m, "TOKENS_SETTLE_SECONDS", 0.0)    # its records never say a turn is over
    monkeypatch.setattr(m, "TOKENS_CATCH_UP_SECONDS", 0.0)  # ... so no send waits for them to
    monkeypatch.setattr(m, "LIVENESS_CHECK_SECONDS", 0.05)
    fake_cao.turn_marks["made_up_cli"] = MADE_UP_MARKS
    fake_cao.script["tester"] = [FAIL_REPLY, {"action": "call", "call": kill_cli_and_time_out_its_next_start},
                                 PASS_REPLY]
    assert run_main(m) == 0
    state = json.loads(Path(m.STATE_FILE).read_text())
    assert state["final_status"] == "PASS" and state["current_round"] == 2
    assert [status for profile, status in fake_cao.create_answers if profile == "tester"] == [201, 500, 201]
    out = capsys.readouterr().out
    assert "tester: the new agent's CLI did not start within CAO's time limit" in out
    ends = re.findall(r"(\w+): reply received.*turn end seen by ([^,]+),", out)
    assert len(ends) == 6 and {ended_by for _, ended_by in ends} == {m.TURN_ENDED_BY_MARK}, ends
    turns = state["turn_records"]
    assert len(turns) == 6 and all(turn["tokens_final"] for turn in turns)
    assert [turn["tokens"] for turn in turns] == [{**MADE_UP_MODEL_USE, "by_model": {"made-up-model":
                                                                                     MADE_UP_MODEL_USE}}] * 6


def test_check_reports_a_made_up_cli_s_trap_from_its_row(load_orch, fake_cao, prompt_file, tmp_path, monkeypatch,
                                                         capsys):
    """--check looks for the trap and the sign-in the row declares, on what the probe saw of the agents' side: ✗
    with its fix, then ✓ once the agents' home and environment hold what they ask for."""
    home = tmp_path / "agents-home"
    home.mkdir()
    m = load_orch(PROMPT_FILE=str(prompt_file), PROVIDER="made_up_cli")
    monkeypatch.setitem(m.AGENT_CLIS, "made_up_cli", made_up_row(m))
    fake_cao.providers_status = 404                 # a server that does not list its providers
    side = m.AgentsSide({"HOME": str(home)}, 1000, {"madeup": ("/usr/local/bin/madeup", "madeup 1.0.0")})
    monkeypatch.setattr(m, "local_server", lambda: m.LocalServer(0, 1000, {}))
    monkeypatch.setattr(m, "probe_agents_side", lambda server, programs, versions=True: side if programs == ["madeup"]
                            else "?")
    settings = home / ".made-up" / "settings.json"
    assert run_main(m, "--check") == 1
    out = capsys.readouterr().out
    assert f'✗ Made-up CLI: no key in {settings}: add {{"apiKey": "<key>"}} to it' in out.splitlines(), out
    [signed_out] = [line for line in out.splitlines() if line.startswith("✗ Made-up CLI: not signed in")]
    assert signed_out.endswith("run `madeup login` as the user the agents run as, or set MADEUP_KEY for the agents")
    settings.parent.mkdir()
    settings.write_text('{"apiKey": "k"}', encoding="utf-8")
    (home / ".made-up" / "auth.json").write_text('{"token": "t"}', encoding="utf-8")
    assert run_main(m, "--check") == 0
    out = capsys.readouterr().out.splitlines()
    assert f"✓ Made-up CLI: its key set in {settings}" in out
    assert f"✓ Made-up CLI: signed in (its login, {home / '.made-up' / 'auth.json'})" in out
    side.env["MADEUP_KEY"] = "k"
    assert run_main(m, "--check") == 0 and "✓ Made-up CLI: signed in (MADEUP_KEY)" in capsys.readouterr().out


def test_no_provider_is_named_outside_the_table(orch):
    """What docs/code-map.md's awk command checks: outside the table, no line of the script quotes a provider."""
    lines = Path(orch.__file__).read_text(encoding="utf-8").splitlines()
    start, end = _table_lines(lines)
    quoted = re.compile("|".join(f'"{re.escape(provider)}"' for provider in orch.AGENT_CLIS))
    outside = [f"{number}: {line}" for number, line in enumerate(lines, 1)
               if not start < number <= end and quoted.search(line)]
    assert outside == []


def _table_lines(lines: list[str]) -> tuple[int, int]:
    """The lines of the table of agent CLIs: from its heading to DEFAULT_PROVIDER's line."""
    start = lines.index(next(line for line in lines if line.startswith("# -- The agent CLIs")))
    return start, lines.index(next(line for line in lines if line.startswith("DEFAULT_PROVIDER = "))) + 1


# Texts for people that name a CLI as an example, and the old state file's name: none changes what the loop does.
FOR_PEOPLE = ("PROVIDER=claude_code", "claude-haiku-4-5", "claude-sonnet-4-5",
              "(Claude Code: autoCompactWindow, Codex: model_auto_compact_token_limit)",
              "codex-3agents-loop-state.json")


# The tables that bind the readers of the formats the rows name, each with the section it and its readers are in.
FORMAT_TABLES = {"RECORD_FORMATS": "# 5. ", "COMPACTION_READERS": "# 5. ", "SIGN_IN_READERS": "# 16. "}


def _formats_code(lines: list[str], top: dict) -> set[str]:
    """The definitions the rows reach by the names of their formats: the readers RECORD_FORMATS and
    COMPACTION_READERS (section 5) and SIGN_IN_READERS (section 16) bind, and all of their section they use."""
    reached = set()
    for table, heading in FORMAT_TABLES.items():
        first = next(number for number, line in enumerate(lines) if line.startswith(heading))
        last = next(number for number, line in enumerate(lines) if number > first and re.match(r"# \d+\. ", line))
        todo = [table]
        while todo:
            name = todo.pop()
            if name in top and name not in reached and first < top[name].lineno <= last:
                reached.add(name)
                todo += [node.id for node in ast.walk(top[name]) if isinstance(node, ast.Name)]
    return reached


def _naming(orch, providers=None) -> re.Pattern:
    """A CLI named in code (of `providers`; None: every one but the scripted agent): its provider id, program or
    label (or what CAO calls it) as a word, in a text whose underscores are spaces."""
    names = {name for provider, cli in orch.AGENT_CLIS.items()
             if (provider != orch.SCRIPTED_PROVIDER if providers is None else provider in providers)
             for name in (provider, cli.program, cli.label, cli.cao_name) if name}
    return re.compile(r"(?<![A-Za-z])(" + "|".join(map(re.escape, sorted(names, key=len, reverse=True)))
                      + r")(?![A-Za-z])", re.IGNORECASE)


def test_a_cli_s_behaviour_lives_in_its_row(orch):
    """Outside the table, no code (its comments and docstrings aside) names a CLI -- by its provider, program or
    label, in a string or a name -- but the readers of the record and settings formats the rows name; and
    each row's formats are bound there, each bound format named by a row."""
    source = Path(orch.__file__).read_text(encoding="utf-8")
    tree = ast.parse(source)
    top = {}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", node)]
        top.update({getattr(target, "id", getattr(target, "name", "")): node for target in targets})
    allowed, naming = _formats_code(source.splitlines(), top), _naming(orch)
    start, end = _table_lines(source.splitlines())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    found = []
    for statement in tree.body:
        if start < statement.lineno <= end or any(top.get(name) is statement for name in allowed):
            continue
        for node in ast.walk(statement):
            text = (node.value if isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and id(node) not in docstrings else
                    node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else
                    getattr(node, "name", None) if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else None)
            for example in FOR_PEOPLE:
                text = text.replace(example, "") if isinstance(text, str) else text
            if isinstance(text, str) and naming.search(text.replace("_", " ")):
                found.append(f"{node.lineno}: {text[:80]!r}")
    assert found == []
    named = {cli.records for cli in orch.AGENT_CLIS.values() if isinstance(cli.records, str) and cli.records}
    assert named == set(orch.RECORD_FORMATS) and all(records.name == name
                                                     for name, records in orch.RECORD_FORMATS.items())
    settings = {cli.compaction_settings for cli in orch.AGENT_CLIS.values() if isinstance(cli.compaction_settings, str)}
    assert settings - {""} == set(orch.COMPACTION_READERS)
    sign_ins = {form.reader for cli in orch.AGENT_CLIS.values() if cli.sign_in for form in cli.sign_in.forms}
    assert sign_ins - {""} == set(orch.SIGN_IN_READERS)


def test_the_versions_a_row_says_are_proven_are_those_the_end_to_end_suite_runs(orch):
    """`proven` names the pinned release tests/e2e/test_real_clis.py runs for that CLI."""
    import e2e.agent_clis as pinned

    assert {provider: cli.proven for provider, cli in orch.AGENT_CLIS.items() if cli.proven} == {
        "claude_code": pinned.CLAUDE_CODE_VERSION, "codex": pinned.CODEX_VERSION, "opencode_cli": pinned.OPENCODE_VERSION,
        "copilot_cli": pinned.COPILOT_VERSION, "hermes": pinned.HERMES_VERSION}


def test_the_places_a_new_cli_touches_are_listed(orch):
    """docs/code-map.md's list of the places a new CLI touches holds to the tree: each file it names exists, and
    every file that names each CLI proven end to end (a place that has one for each) is among them."""
    root = Path(orch.__file__).parent
    text = (root / "docs" / "code-map.md").read_text(encoding="utf-8")
    section = text.split("A new CLI touches exactly these places", 1)[1].split("\n| field |", 1)[0]
    listed = set(re.findall(r"`([\w/.-]+\.(?:py|md))`", section))
    assert {"run_orchestrator_loop.py", "tests/fake_cao.py", "README.md"} <= listed
    assert [place for place in sorted(listed) if not (root / place).is_file()] == []
    each = [_naming(orch, {provider}) for provider, cli in orch.AGENT_CLIS.items() if cli.proven]
    naming_each = set()
    for path in project_files():
        place = path.relative_to(root).as_posix()
        if re.search(r"(^|/)\.", place):
            continue
        try:
            words = path.read_text(encoding="utf-8").replace("_", " ")
        except (UnicodeDecodeError, OSError):
            continue
        if all(naming.search(words) for naming in each):
            naming_each.add(place)
    assert len(each) >= 5 and naming_each - listed - {"docs/code-map.md"} == set()
