"""An agent whose CLI cannot start says why, in its own words, and the exit code says whether a retry helps.

While CAO creates the five terminals (it answers only once each CLI is ready, or at its time limit), the loop
reads the screen of each terminal still starting: CAO lists it in its session, with its profile, from the start.
Words a CLI's row declares for a lasting reason (no sign-in, a refusal as root) or a shell's "not found" for its
program stop the run at once with exit 2, quoting the CLI's lines; a start that timed out with nothing known on
its screen goes once more alone, and stops with exit 2 only if the second shows the same. The fake CAO plays the
screens (`start_screens`) and holds a failing creation as CAO does, until the loop gave up on it
(`held_starts`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import FAST, run_main

QUICK = {**FAST, "MIN_REVIEW_CYCLES_BEFORE_APPROVAL": "1", "START_AGENT": "tester", "PROVIDER": "claude_code"}
PROFILES = ("system_analyst", "peer_system_analyst", "programmer", "peer_programmer", "tester")
TIMED_OUT = (500, "Claude Code initialization timed out after 60s")
SHELL = "\r\n\x1b[?2004hbash-5.2# "
LAUNCH = "bash-5.2# unset $(env | sed -n 's/^\\(CLAUDE[A-Z_]*\\)=.*/\\1/p'); claude --dangerously-skip-permissions\r\n"

# Claude Code 2.1.197's screens, as seen in tmux (words drawn with cursor moves, as it draws spaces)
NO_NETWORK_FIRST_START = (LAUNCH + "\x1b[?25l Welcome to Claude Code v2.1.197\r\n \u2588\u2588\u2584\u2588\u2588\u2588\r\n"
                          "\x1b[1C\x1b[31mUnable\x1b[1Cto\x1b[1Cconnect to Anthropic services\x1b[39m\r\n"
                          " Failed to connect to api.anthropic.com: ENOTFOUND\r\n"
                          " Please check your internet connection and network settings.\r\n"
                          " Note: Claude Code might not be available in your country." + SHELL)
ROOT_REFUSAL = LAUNCH + ("--dangerously-skip-permissions cannot be used with root/sudo privileges for security "
                         "reasons") + SHELL
NOT_FOUND = LAUNCH + "bash: claude: command not found" + SHELL
NOT_SIGNED_IN = ("\u256d\u2500\u2500\u2500 Claude Code v2.1.197 \u2500\u2500\u2500\u256e\r\n Welcome back!\r\n"
                 "\u276f \r\n  \u23f5\u23f5 bypass permissions on (shift+tab to cycle)"
                 "\x1b[40CNot logged in \u00b7 Run /login\r\n")
CODEX_SIGN_IN = ("  Welcome to Codex, OpenAI's command-line coding agent\r\n  Choose how you want to use Codex.\r\n"
                 "> 1. Sign in with ChatGPT\r\n     Usage included with Plus, Pro, Business, and Enterprise plans\r\n")


# CAO's log of a real terminal: Claude Code 2.1.197's first start in a fresh HOME, as root, offline (its launch line
# typed by CAO, spaces drawn as cursor moves, tmux's passthrough), from tests/e2e/test_start_failure_e2e.py
REAL_LOG = Path(__file__).parent / "data" / "claude-2.1.197-offline-first-start.log"


def every_start(fake, screen, fail: bool = True, held: str = "deleted") -> None:
    for profile in PROFILES:
        fake.start_screens[profile] = screen
        if fail:
            fake.fail_create[profile] = TIMED_OUT
            fake.fail_late.add(profile)             # the session exists while its first agent starts
            fake.held_starts[profile] = held


def stop_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def nothing_left(fake) -> bool:
    return all(t.deleted or t.exited for t in fake.terminals.values())


@pytest.mark.parametrize("screen, words, fix", [
    (NO_NETWORK_FIRST_START, "Failed to connect to api.anthropic.com: ENOTFOUND", "ANTHROPIC_API_KEY"),
    (ROOT_REFUSAL, "cannot be used with root/sudo privileges", "IS_SANDBOX=1 cao-server"),
    (NOT_FOUND, "bash: claude: command not found", "--check"),
], ids=["no-sign-in-offline", "root-refusal", "not-found"])
def test_a_cli_that_shows_a_lasting_reason_stops_the_start_at_once_with_exit_2_quoting_it(
        load_orch, fake_cao, prompt_file, capsys, screen, words, fix):
    """CAO would answer only at its time limit: the creations are held until the loop removed their session, so
    a loop that waited for CAO's answer would find them held for good (`gave_up`). No second start: it would
    meet the same."""
    every_start(fake_cao, screen)
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == m.EXIT_USAGE
    line = stop_line(capsys)
    assert fake_cao.gave_up == []
    assert words in line and "cannot start" in line and fix in line, line
    assert "\x1b" not in line and "unset $(env" not in line and "bash-5.2#" not in line, line
    assert set(fake_cao.starts_seen.values()) == {1}, fake_cao.starts_seen
    assert nothing_left(fake_cao) and fake_cao.prompts == [] and not Path(m.STATE_FILE).exists()


def test_a_wrong_cause_is_never_named_the_root_hint_only_on_its_words(load_orch, fake_cao, prompt_file, capsys):
    """Not signed in, offline: nothing of IS_SANDBOX in the line (the old line blamed it)."""
    every_start(fake_cao, NO_NETWORK_FIRST_START)
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == m.EXIT_USAGE
    assert "IS_SANDBOX" not in stop_line(capsys)


def test_a_cli_that_came_up_but_is_not_signed_in_stops_before_any_prompt(load_orch, fake_cao, prompt_file, capsys):
    """Claude Code set up but signed in nowhere starts to its idle prompt (CAO answers it ready) and says so in
    its footer: exit 2, every agent exited, nothing sent."""
    every_start(fake_cao, NOT_SIGNED_IN, fail=False)
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == m.EXIT_USAGE
    line = stop_line(capsys)
    assert "Not logged in · Run /login" in line and "/login" in line and "ANTHROPIC_API_KEY" in line, line
    assert fake_cao.prompts == [] and nothing_left(fake_cao)


def test_codex_asking_how_to_sign_in_stops_with_exit_2(load_orch, fake_cao, prompt_file, capsys):
    for profile in PROFILES:
        fake_cao.start_screens[profile] = CODEX_SIGN_IN
        fake_cao.fail_create[profile] = (500, "Codex initialization timed out after 60s")
        fake_cao.fail_late.add(profile)
        fake_cao.held_starts[profile] = "deleted"
    m = load_orch(PROMPT_FILE=str(prompt_file), **{**QUICK, "PROVIDER": "codex"})
    assert run_main(m) == m.EXIT_USAGE
    line = stop_line(capsys)
    assert "Sign in with ChatGPT" in line and "codex login" in line and "OPENAI_API_KEY" in line, line
    assert fake_cao.gave_up == []


def test_a_timeout_with_nothing_known_on_screen_goes_again_and_the_same_screen_twice_is_exit_2(
        load_orch, fake_cao, prompt_file, capsys):
    hang = LAUNCH + " Starting up the agent...\r\n Loading plugins"
    every_start(fake_cao, hang, held="read")
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == m.EXIT_USAGE
    line = stop_line(capsys)
    assert fake_cao.starts_seen["system_analyst"] == 2, fake_cao.starts_seen     # tried again, alone
    assert "twice, showing the same" in line and "Starting up the agent... | Loading plugins" in line, line
    assert nothing_left(fake_cao)


def test_a_timeout_whose_second_screen_differs_stays_a_retry_exit_3_with_the_screen_quoted(
        load_orch, fake_cao, prompt_file, capsys):
    every_start(fake_cao, [LAUNCH + " Starting up: step 1", LAUNCH + " Starting up: step 2"], held="read")
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == m.EXIT_ERROR
    line = stop_line(capsys)
    assert "Starting up: step 2" in line and "initialization timed out" in line, line
    assert nothing_left(fake_cao)


@pytest.mark.parametrize("sprung", [False, True])
def test_a_row_s_start_hint_is_given_only_when_its_trap_is_found_sprung(load_orch, fake_cao, prompt_file, capsys,
                                                                       monkeypatch, sprung):
    """A start that timed out, nothing on screen: the IS_SANDBOX hint only where --check's look finds it unset."""
    for profile in PROFILES:
        fake_cao.fail_create[profile] = TIMED_OUT
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    asked = []
    monkeypatch.setattr(m, "sprung_traps", lambda provider: asked.append(provider) or (
        [m.CheckLine(False, "Claude Code as root: its agents' environment has no IS_SANDBOX=1")] if sprung else []))
    assert run_main(m) == m.EXIT_ERROR
    line = stop_line(capsys)
    assert asked and set(asked) == {"claude_code"}
    assert ("IS_SANDBOX=1" in line) == sprung, line


def test_sprung_traps_reads_the_agents_side_as_check_does(orch, monkeypatch):
    """The trap's own check (check_trap) on what the probe sees: IS_SANDBOX=yes is sprung for root."""
    seen = {}
    monkeypatch.setattr(orch, "local_server", lambda: object())
    monkeypatch.setattr(orch, "probe_agents_side", lambda server, programs: orch.AgentsSide(seen, 0, {}))
    seen.update(IS_SANDBOX="1")
    assert not [line for line in orch.sprung_traps("claude_code") if "IS_SANDBOX" in line.text]
    seen.update(IS_SANDBOX="yes")
    assert [line.ok for line in orch.sprung_traps("claude_code") if "IS_SANDBOX" in line.text] == [False]
    monkeypatch.setattr(orch, "local_server", lambda: None)
    assert orch.sprung_traps("claude_code") == []                 # cannot look: no trap named


def test_a_failed_terminal_s_screen_is_read_from_cao_s_log_once_cao_removed_it(orch, tmp_path):
    """CAO removes the terminal of a failed start (its output route answers 404), not its log file: its tail is read
    (here the real one), cleaned to the CLI's own lines."""
    logs = tmp_path / ".aws" / "cli-agent-orchestrator" / "logs" / "terminal"
    logs.mkdir(parents=True)
    (logs / "0000abcd.log").write_bytes(b"x" * 70_000 + REAL_LOG.read_bytes())
    server = orch.LocalServer(1, 0, {"HOME": str(tmp_path)})
    orch.PROVIDER = "claude_code"
    orch.api = type("NoScreen", (), {"get_screen": lambda self, terminal_id: (_ for _ in ()).throw(
        orch.ApiError("HTTP 404", 404))})()
    screen = orch.read_start_screen("analyst", "0000abcd", server)
    assert screen.lasting is not None and screen.lines == (
        "Unable to connect to Anthropic services", "Failed to connect to api.anthropic.com: ENOTFOUND",
        "Check your internet connection and network settings.",
        "Claude Code might not be available in your country. Check supported countries at "
        "https://anthropic.com/supported-countries")


@pytest.mark.parametrize("provider, screen, lasting", [
    ("claude_code", NO_NETWORK_FIRST_START, True), ("claude_code", ROOT_REFUSAL, True),
    ("claude_code", NOT_SIGNED_IN, True), ("codex", CODEX_SIGN_IN, True), ("claude_code", NOT_FOUND, True),
    ("codex", "bash: codex: command not found" + SHELL, True), ("claude_code", "bash: codex: command not found", False),
    ("claude_code", "\u276f \r\n  \u23f5\u23f5 bypass permissions on (shift+tab to cycle)", False),
])
def test_each_row_s_words_name_its_cli_s_lasting_screens(orch, provider, screen, lasting):
    """Read by one generic reader from the rows' `cannot_start` (and a shell's "not found" for the row's program)."""
    assert (orch.start_screen(provider, "t", screen).lasting is not None) == lasting


def test_a_replacement_whose_cli_shows_why_it_cannot_start_stops_the_run_with_exit_2(load_orch, fake_cao,
                                                                                   prompt_file, capsys):
    """REPLACE_LOST_AGENTS=1: the tester's CLI dies, its new agent's CLI refuses to start as root: the run stops
    on its words (exit 2), not after CAO's limit, and no second start is made though the row would give one."""
    def kill_and_refuse(fake, terminal) -> None:
        fake.start_screens[terminal.profile] = ROOT_REFUSAL
        fake.fail_create[terminal.profile] = TIMED_OUT
        fake.held_starts[terminal.profile] = "read"
        fake.kill_cli(terminal.role)

    fake_cao.script["tester"] = [{"action": "call", "call": kill_and_refuse}]
    # The loss is found by the liveness check, asked often here; RESPONSE_TIMEOUT is far off, so the two never race.
    m = load_orch(PROMPT_FILE=str(prompt_file), REPLACE_LOST_AGENTS="1", **{**QUICK, "RESPONSE_TIMEOUT": "120"})
    m.LIVENESS_CHECK_SECONDS = 0.05
    assert run_main(m) == m.EXIT_USAGE
    line = stop_line(capsys)
    assert "could not start a new agent: the tester's Claude Code cannot start" in line, line
    assert "cannot be used with root/sudo privileges" in line and "IS_SANDBOX=1 cao-server" in line, line
    assert fake_cao.starts_seen["tester"] == 2 and fake_cao.gave_up == []      # its first start, one replacement


def test_status_during_the_start_up_says_which_cli_cannot_start_in_its_words(load_orch, fake_cao, prompt_file,
                                                                            monkeypatch, capsys):
    """--status while the start-up stops: the failed agent with its CLI's words, from the start-up note."""
    every_start(fake_cao, ROOT_REFUSAL)
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    seen, failure = {}, m.start_up_failure

    def look_then_fail(failures, *screens):
        seen["text"] = m.status_report()[1]
        return failure(failures, *screens)

    monkeypatch.setattr(m, "start_up_failure", look_then_fail)
    assert run_main(m) == m.EXIT_USAGE
    assert "failed" in seen["text"] and "cannot be used with root/sudo privileges" in seen["text"], seen["text"]


def test_an_agent_that_answers_it_is_not_signed_in_stops_the_run_with_exit_2_without_a_reminder(
        load_orch, fake_cao, prompt_file, capsys):
    """Claude Code set up, signed in nowhere, came up without saying so (its footer quiet): its answer to the first
    prompt is its words. The run stops on them (exit 2), no reminder sent, instead of a retry-for-ever exit 3."""
    fake_cao.script["tester"] = [{"text": "Not logged in · Please run /login", "action": "no_file"}]
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == m.EXIT_USAGE
    line = stop_line(capsys)
    assert "cannot work: it is not signed in" in line and "Not logged in · Please run /login" in line, line
    assert fake_cao.reminders == [] and len(fake_cao.prompts) == 1


HERMES_TIMED_OUT = (500, "Failed to create terminal: Hermes initialization timed out after 120 seconds")
HERMES_AT_ITS_PROMPT = "bash-5.2# hermes\r\n Hermes Agent v0.19.0 | gpt-5 | 1s\r\n\u276f \r\n"


def test_hermes_timed_out_at_its_prompt_among_five_and_again_alone_gets_its_row_s_tries_and_the_run_goes_on(
        load_orch, fake_cao, prompt_file, capsys):
    """CAO 2.5.4 times out a Hermes start whose CLI came up (its prompt on screen; about half of lone quick
    starts): the start alone gets the tries its row gives (`start_tries`), as a replacement does, and the same
    screen shown again is no lasting failure for such a CLI (no exit 2)."""
    fake_cao.start_screens["peer_programmer"] = HERMES_AT_ITS_PROMPT
    fake_cao.fail_create["peer_programmer"] = HERMES_TIMED_OUT
    fake_cao.held_starts["peer_programmer"] = "read"
    tries = []

    def on_create(profile: str) -> None:
        if profile == "peer_programmer":
            tries.append(profile)
            if len(tries) == 3:                    # among five, alone, alone again: this one starts
                fake_cao.fail_create.pop(profile)
    fake_cao.create_hook = on_create
    m = load_orch(PROMPT_FILE=str(prompt_file), **{**QUICK, "PROVIDER": "hermes"})
    assert m.AGENT_CLIS["hermes"].start_tries == 2
    assert run_main(m) == 0
    assert fake_cao.starts_seen["peer_programmer"] == 3, fake_cao.starts_seen
    out = capsys.readouterr().out
    assert "peer_programmer: the agent's CLI did not start within CAO's time limit" in out
    assert "all five agents are up after the second try" in out
