#!/usr/bin/env python3
"""Five-agent development loop on top of a CAO server (cli-agent-orchestrator).

The loop creates five CAO terminals -- analyst, peer analyst, programmer, peer
programmer, tester -- and drives them through three phases:

    analyst  <-> peer analyst      (review cycles, evidence-gated approval)
    programmer <-> peer programmer (review cycles, evidence-gated approval)
    tester                         (PASS ends the run, FAIL starts a retry round)

A retry round after a failed test runs programmer -> peer programmer -> tester
only. Each agent writes its answer to a response file; the loop condenses what
passes between agents so that no agent is sent more text than it needs. With
STORY_MODE=1 the programmer works through the OpenSpec change one story
(tasks.md section) at a time.

Progress is saved to a JSON state file after every step (same fields as the
original shell orchestrator) so that an interrupted run continues with
RESUME=1, or automatically when the state file says the run is still RUNNING.
Where no CAO server is named or running, the run starts its own (cao-server in
a tmux server of its own) and ends it with itself.

Usage:  python run_orchestrator_loop.py [config.json]   (--demo [DIR]: a first PASS)
Exit codes: 0 PASS, 1 FAIL, 2 bad usage or configuration (or a stop a setting must lift),
3 runtime error (the same command resumes), 4 budget used, 5 the same failure round after
round (a person is needed), 6 stopped at an APPROVE gate (a person decides), 70 a fault of the loop itself (its traceback in the run folder),
75 another process drives this run, 129 its terminal closed (SIGHUP), 130 interrupted (SIGINT),
131 quit (SIGQUIT), 143 terminated (SIGTERM).

On PASS the run can archive its OpenSpec change and commit its work, and
it can tell the user of its end through ntfy (ARCHIVE_ON_PASS, COMMIT_ON_PASS,
NTFY_TOPIC; all off by default).

Sections, in the order data flows; each uses only what stands above it, save the
few forward references tests/test_docs.py names with their reasons:
    1. Configuration                  10. Condensation
    2. CAO API client                 11. OpenSpec: the run's change and its stories
    3. Run state: the state file      12. Prompt builders
    4. Response files                 13. After the run: archive, commit, notify
    5. Tokens used                    14. Init and resume
    6. The wait for a reply           15. Main loop
    7. The agents' terminals          16. Before a run: --check
    8. Asking an agent                17. Entry point
    9. Review gate
"""

from __future__ import annotations

__version__ = "0.4.0"
PACKAGE_NAME = "cao-orchestrator-loop"

# The public names: those the specs fix (tests and users address them), and main(); one global per setting is
# added in section 1, from SETTINGS. Every other name is the script's own and may change.
__all__ = [
    "ApiClient", "api", "main",
    "is_review_approved", "extract_review_notes", "extract_test_evidence", "condense_analyst_for_programmer",
    "condense_programmer_for_tester", "explore_block_for",
    "build_analyst_prompt", "build_analyst_review_prompt", "build_programmer_prompt",
    "build_programmer_review_prompt", "build_tester_prompt",
    "handle_tester_fail", "save_state", "load_state", "init_new_run", "verify_resume_terminals",
    "session_name", "terminal_ids", "current_round", "current_phase", "final_status", "feedback",
    "analyst_feedback", "programmer_feedback", "programmer_context_for_retry", "outputs",
    "EXPLORE_SUMMARY", "SCENARIO_TEST",
    "PHASE_ANALYST", "PHASE_PROGRAMMER", "PHASE_TESTER", "PHASE_DONE", "_UPSTREAM_PLACEHOLDER",
]

import argparse
import base64
import difflib
import hashlib
import html
import fcntl
import getpass
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor, wait as wait_for_futures
from contextlib import closing, contextmanager, suppress
from dataclasses import MISSING, dataclass, field, fields, replace
from datetime import datetime, timedelta, timezone
from enum import Enum
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from string import Template
from types import SimpleNamespace
from typing import Any, BinaryIO, Callable, ClassVar, Iterable, Iterator, Mapping, TextIO
from urllib.parse import quote, urlparse
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import httpx

try:
    import tomllib                      # Python 3.11+: Codex's config.toml read whole (--check's sign-in)
except ModuleNotFoundError:             # Python 3.10: what needs it says it cannot tell
    tomllib = None


# --------------------------------------------------------------------------
# Exits and logging. A deliberate stop carries its exit code and one line; it derives from SystemExit, so
# nothing below main() turns it into a traceback.
# --------------------------------------------------------------------------

EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_ERROR, EXIT_BUDGET, EXIT_NO_PROGRESS, EXIT_APPROVAL = 0, 1, 2, 3, 4, 5, 6
EXIT_BUG, EXIT_LOCKED = 70, 75
EXIT_SIGHUP, EXIT_SIGINT, EXIT_SIGQUIT, EXIT_SIGTERM = 129, 130, 131, 143     # 128 + the signal's number
TRACEBACK_FILE = "traceback.txt"     # in the run folder: the traceback of a fault of the loop itself (exit 70)
# Each exit code: what it means, and what a job scheduler (cron, a CI job, a Kubernetes Job) should do on it.
EXIT_CODES = (
    (EXIT_PASS, "the tester reported RESULT: PASS", "done"),
    (EXIT_FAIL, "no PASS within MAX_ROUNDS: the tester's verdict; the state is saved",
     "stop, do not retry: a person reads the report (or reruns with a higher MAX_ROUNDS)"),
    (EXIT_USAGE, "bad usage or configuration, or a stop only a person or a setting can lift (the line says what "
                 "to change; also an agent's CLI that changed its model on its own); a run that started has its "
                 "state saved",
     "stop and alert: change what the line says"),
    (EXIT_ERROR, "a runtime error the same command can get past (server unreachable, timeout, usage limit, ...); "
                 "the state is saved",
     "retry: the same command resumes the run"),
    (EXIT_BUDGET, "the run has used MAX_RUN_TOKENS or MAX_RUN_COST; stopped before a turn, the state saved",
     "stop and alert: a person raises the budget, then the same command goes on"),
    (EXIT_NO_PROGRESS, "the same test failure repeated for MAX_ROUNDS_WITHOUT_PROGRESS rounds in a row; the state "
                       "is saved", "stop: a person is needed (reads the report), then RESUME=1 goes on"),
    (EXIT_APPROVAL, "stopped at an APPROVE gate: a person decides with --approve or --reject; the state is saved",
     "stop, a person decides, then the same command goes on"),
    (EXIT_BUG, f"a fault of the loop itself: its traceback is in {TRACEBACK_FILE} in the run folder (the last "
               "line names it); the state is saved", "stop and alert: a bug (report it with its traceback)"),
    (EXIT_LOCKED, "another process is driving the run in this state file; nothing was done",
     "retry later, never beside it"),
    (EXIT_SIGHUP, "stopped by SIGHUP (its terminal closed, e.g. an ssh session dropped); the state is saved",
     "retry: the same command resumes the run"),
    (EXIT_SIGINT, "interrupted by SIGINT (Ctrl-C); the state is saved", "retry: the same command resumes the run"),
    (EXIT_SIGQUIT, "stopped by SIGQUIT (Ctrl-\\); the state is saved", "retry: the same command resumes the run"),
    (EXIT_SIGTERM, "terminated by SIGTERM; the state is saved", "retry: the same command resumes the run"),
)
EXIT_MEANINGS = {code: meaning for code, meaning, _ in EXIT_CODES}
SCHEDULER_ACTIONS = {code: action for code, _, action in EXIT_CODES}


def exit_code_of(result: str, without_progress: bool = False) -> int:
    """The exit code of a finished run's result (PASS or FAIL; a FAIL that stopped without progress: 5)."""
    return EXIT_PASS if result == "PASS" else EXIT_NO_PROGRESS if without_progress else EXIT_FAIL


def result_of(code: int) -> str:
    """The result (PASS or FAIL) a finished run's exit code stands for."""
    return "PASS" if code == EXIT_PASS else "FAIL"


class OrchestratorExit(SystemExit):
    """A deliberate stop with an exit code and a one-line message."""

    def __init__(self, code: int, message: str):
        super().__init__(code)
        self.message = message

    def __str__(self) -> str:
        return self.message


class ConfigError(OrchestratorExit):
    """Bad usage, configuration, prompt or state file: nothing was started."""

    def __init__(self, message: str):
        super().__init__(EXIT_USAGE, message)


class RunError(OrchestratorExit):
    """The run started but cannot go on; its state stays resumable."""

    def __init__(self, message: str, code: int = EXIT_ERROR):
        super().__init__(code, message)


class RunLocked(OrchestratorExit):
    """Another process drives the run in this state file: nothing was done, try again later."""

    def __init__(self, message: str):
        super().__init__(EXIT_LOCKED, message)       # EX_TEMPFAIL


class AlreadyFinished(OrchestratorExit):
    """REPORT_FINISHED_RUN: the state file holds a finished run; exit with its code, start nothing."""


class Terminated(BaseException):
    """Raised by a stop signal other than Ctrl-C (SIGTERM, SIGHUP, SIGQUIT) so the loop unwinds like on Ctrl-C."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(signum)
        self.signum = signum


# The run's own copy of its log ($WD/.tmp/<run>/run.log), from the moment its folder is known
# (open_run_log); the lines printed before that wait here and are written first.
run_log_file: Path | None = None
_early_log_lines: list[str] = []
MAX_EARLY_LOG_LINES = 1000


def emit(line: str, stream=None) -> None:
    """Print a line; a reader that went away (`| head`, a closed terminal) ends the printing, not the run."""
    stream = stream or sys.stdout
    try:
        print(line, file=stream, flush=True)
    except BrokenPipeError:
        with suppress(OSError, ValueError):     # no second error when Python flushes the stream at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
    except (OSError, ValueError):
        pass


def counted(number: int, noun: str) -> str:
    """'1 turn', '3 turns': a count as a person writes it."""
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def log(message: str) -> None:
    """Timestamped progress on stdout: what a person or a cron log reads to follow a run (kept in run.log too)."""
    say_line(f"[{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}] {message}")


def log_detail(line: str) -> None:
    """An indented line under the log line it belongs to (a command's output, test evidence)."""
    say_line(f"    {line}")


def say_error(line: str) -> None:
    """A line about something wrong (the run's last line when it stops): on stderr, and in run.log too."""
    say_line(line, sys.stderr)


def say_line(line: str, stream=None) -> None:
    """Print a line of the run's own and append it to run.log; a log file that cannot be written never stops the
    run."""
    emit(line, stream)
    if run_log_file is None:
        if len(_early_log_lines) < MAX_EARLY_LOG_LINES:
            _early_log_lines.append(line)
        return
    with suppress(OSError), open(run_log_file, "a", encoding="utf-8") as handle:
        handle.write(line + "\n")


def open_run_log(path: Path) -> None:
    """From now on every printed line also goes to `path` (appended: a resumed run goes on in the same file)."""
    global run_log_file
    run_log_file = path
    with suppress(OSError), open(path, "a", encoding="utf-8") as handle:
        handle.writelines(line + "\n" for line in _early_log_lines)
    _early_log_lines.clear()


# --------------------------------------------------------------------------
# Stop signals. Every stop a user's terminal or system can cause ends a run the same way: SIGINT (Ctrl-C), SIGTERM,
# SIGHUP (the terminal closed) and SIGQUIT (Ctrl-\, whose default -- a core dump -- would leave the run's own
# server and agents running, and a core of a Python process helps no user). One handler: it raises the stop where
# the run can stop, and holds it -- noted, said once -- while something must finish first (terminals being
# created, the run's wind-down); a second stop while the first unwinds is held too.
# --------------------------------------------------------------------------

STOP_SIGNALS = {signal.SIGHUP: (EXIT_SIGHUP, "stopped by SIGHUP (its terminal closed)"),
                signal.SIGINT: (EXIT_SIGINT, "interrupted (SIGINT)"),
                signal.SIGQUIT: (EXIT_SIGQUIT, "stopped by SIGQUIT (Ctrl-\\)"),
                signal.SIGTERM: (EXIT_SIGTERM, "terminated (SIGTERM)")}


class StopSignals:
    """Where stop signals go now, the process's one record of it: `holders` (innermost last) note them while not
    empty; `stopping` once a stop was raised, so that a second one does not cut short the unwinding of the first."""

    holders: ClassVar[list[tuple[str, list[int]]]] = []
    stopping: ClassVar[bool] = False


def stop_exception(signum: int) -> BaseException:
    """The exception a stop signal unwinds the run with: KeyboardInterrupt for Ctrl-C, Terminated for the others."""
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


def on_stop_signal(signum: int, frame) -> None:
    """The one handler of STOP_SIGNALS: held (and said once) where something must finish, else raised."""
    if StopSignals.holders:
        what, received = StopSignals.holders[-1]
        if not stop_held():
            log(f"{STOP_SIGNALS[signum][1]}: {what} first, so that nothing is left behind")
        received.append(signum)
        return
    if StopSignals.stopping:                    # the first stop is unwinding: this one is the same stop
        return
    StopSignals.stopping = True
    raise stop_exception(signum)


def stop_held() -> bool:
    """Whether a stop signal waits to be raised: a long wait ends early on it."""
    return any(held for _, held in StopSignals.holders)


def set_stop_handlers(handlers: Mapping[int, object]) -> dict[int, object]:
    """Install a handler per stop signal; the ones they replace. Outside the main thread nothing changes
    (handlers can only be set there)."""
    previous = {}
    with suppress(ValueError, TypeError):
        for signum, handler in handlers.items():
            previous[signum] = signal.signal(signum, handler)
    return previous


@contextmanager
def signals_held(what: str, raise_after: bool = True) -> Iterator[list[int]]:
    """Hold every stop signal while `what` finishes (a creation cut short would leave an agent nobody knows
    about; a wind-down cut short, the run's own server), then raise the first that arrived (`raise_after`), or
    only say it. The list yielded holds them: a long wait in `what` looks at it to end early."""
    received: list[int] = []
    previous = set_stop_handlers(dict.fromkeys(STOP_SIGNALS, on_stop_signal))
    StopSignals.holders.append((what, received))
    try:
        yield received
    finally:
        StopSignals.holders.pop()
        set_stop_handlers(previous)
    if received and raise_after:
        StopSignals.stopping = True
        raise stop_exception(received[0])


# ==========================================================================
# 1. Configuration
# ==========================================================================

ROLES = ("analyst", "peer_analyst", "programmer", "peer_programmer", "tester")
OUTPUT_KEYS = ("analyst", "analyst_review", "programmer", "programmer_review", "tester")


# CAO's words for a terminal's status. Any other word ("unknown" after a cao-server restart, or one of a
# newer CAO) means the server cannot tell; the response file and the screen decide.
READY_STATUSES = ("idle", "completed")
BUSY_STATUSES = ("processing", "waiting_user_answer")
KNOWN_STATUSES = READY_STATUSES + BUSY_STATUSES + ("error",)

# -- When a turn is over: the constants every judge of it uses --------------------
# With the QUIET_SCREEN_SECONDS setting; WAIT_RULES (section 6) holds the rules that use them.
STILL_SCREEN_SECONDS = 2.0      # a busy bar or spinner redraws several times a second: 2 s still, the turn is over
FILE_SETTLE_SECONDS = 0.1        # a reply file unchanged this long is whole (agents write it in one go)
MTIME_SLACK_SECONDS = 1.0        # coarse file times: a file this much older than the prompt still counts as newer
CONFIRM_READ_SECONDS = 0.5       # how often a settled reply file's turn asks whether the agent has finished
RECORD_READ_SECONDS = 0.1        # ... and reads its CLI's own record, where the loop reads it (a local read)
# What ended a turn, as the reply's log line says it ("turn end seen by ..."): one row of WAIT_RULES each.
TURN_ENDED_BY_STATUS = "CAO's ready status"
TURN_ENDED_BY_MARK = "the CLI's end-of-turn mark"
TURN_ENDED_BY_STILL_SCREEN = "a still screen"
TURN_ENDED_BY_RECORD = "its CLI's own record"
TURN_ENDED_BY_AGENT_GONE = "its agent gone, the reply complete"

# -- The agent CLIs: all the loop knows of each, one row a CLI ----------------------------------------
# CAO starts each CLI under a provider of that name; what the loop knows beyond CAO's word is in the CLI's row,
# and nothing else names a provider (adding a CLI: docs/code-map.md; its facts: docs/agent-clis.md). Screen
# words are matched squeezed, without whitespace and escape sequences (Claude Code draws spaces as cursor moves).
@dataclass(frozen=True)
class Trap:
    """A set-up trap of a CLI's that --check looks for (section 16): what must be found where, and what to tell on
    ✓ and on ✗ ({file}, {project} and {tmux} name the file looked at, the project folder, the agents' tmux)."""

    found: str                        # told on ✓
    fix: str                          # told on ✗ ({seen}: the variable as the agents have it, or that they lack it)
    env: str = ""                     # a variable that must be set in the agents' environment ...
    env_value: str = ""               # ... to exactly this value, which a CAO server the run starts itself sets
    root_only: bool = False           # a trap only where the agents run as root
    file: str = ""                    # else a file under the agents' home ({project}/...: under the project) ...
    folder_env: str = ""              # ... in the folder this variable of theirs names instead, where it is set
    pattern: str = ""                 # a regex (multi-line) the file must match; a group `project` must name the
    #                                   project folder (git's top, else WD) or one above it
    json_key: str = ""                # or a key its JSON object must have set ...
    json_holds: str = ""              # ... to a list that holds this


@dataclass(frozen=True)
class CannotStart:
    """Words a CLI shows when it cannot start for a lasting reason (section 7): a second start would meet them again,
    so the run stops (exit 2) quoting them, with what they mean and the fix."""

    words: str                        # regex on a screen line squeezed (no whitespace, no escape sequences)
    why: str                          # what they mean
    fix: str                          # what to do


@dataclass(frozen=True)
class Credential:
    """One way a CLI can be signed in, as its row's `SignIn` lists them: looked for by sign_in_lines() (section
    16) in the agents' environment and home, without a token spent. Its name is told on ✓ ({file}: the file
    looked at, {variable}: the variable found; never a secret's value)."""

    name: str
    env: tuple[str, ...] = ()         # one of these variables set (not empty) in the agents' environment, or in
    #                                   the "env" of one of the CLI's settings files (`SignIn.settings_env`) ...
    settings_only: bool = False       # ... only there (CAO clears it from the agents' environment at start)
    file: str = ""                    # else a file under the agents' home ({project}/...: under the project) ...
    folder_env: str = ""              # ... in the folder this variable of theirs names instead, where it is set,
    json_key: str = ""                # whose JSON object has this key set (a.b: key b of key a) ...
    pattern: str = ""                 # ... or whose text matches this regex (multi-line)
    reader: str = ""                  # else a reader in SIGN_IN_READERS (section 16): what needs more than a look
    unsure: bool = False              # found, yet whether it works cannot be told from here: a "cannot say" line
    not_enough: str = ""              # found, yet it signs nothing in by itself: why, and what to do (told on ✗)


@dataclass(frozen=True)
class SignIn:
    """How a CLI is signed in: the forms it accepts (the first found is named), and the fix when none is."""

    login: str                        # its own login command
    instead: str                      # the variable that also works, as the fix's second half ("or ...")
    forms: tuple[Credential, ...]
    settings_env: tuple[str, ...] = ()  # its settings files whose "env" object sets variables for it

    @property
    def fix(self) -> str:
        """The one fix for a CLI not signed in: --check's, and a start that shows it (its row's `cannot_start`)."""
        return f"run {self.login} as the user the agents run as, {self.instead}"


@dataclass(frozen=True)
class TokenRecords:
    """How the loop reads what a CLI recorded of a turn's tokens (section 5). A CLI that keeps running totals
    only has `totals_now`: they are noted as each turn is first sent, and `read_turn` is given them."""

    name: str                                                  # what they are, for people
    read_turn: Callable[[str, float, float, RunningTotals | None], TokenReading | None]  # (the turn's marker,
    #                                       its window as time.time() values, the totals at its first send)
    totals_now: Callable[[str], RunningTotals | None] | None = None   # (the marker) -> the totals now

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class AgentCli:
    """One agent CLI, as the loop knows it: a provider without a row is refused by the settings."""

    label: str                                  # its name as people call it
    ready_status_trusted: bool = True           # CAO's idle/completed means the turn has ended
    still_screen_ends_turn: float | None = None  # seconds of still screen that confirm a settled reply file
    #                                             (None: QUIET_SCREEN_SECONDS)
    conversation_words: tuple[tuple[str, str], ...] = ()  # (squeezed screen words, 'compacted' or 'cleared')
    context_low: str = ""                       # squeezed regex: its context nearly full, nothing will compact
    #                                             (group `left`: the percent left; without it: full)
    menus: tuple[tuple[str, str], ...] = ()     # (what the loop calls a menu it opens, the choice that keeps
    #                                             what the user chose)
    menu_cursor: str = ""                       # the glyphs that mark its menus' highlighted choice
    records: str | TokenRecords = ""            # its turn records: a format in RECORD_FORMATS (section 5), or
    #                                             their reader itself ('': none)
    compaction_settings: str | Callable[[], int | None] = ""  # where it compacts: settings in COMPACTION_READERS
    #                                             (section 5), or their reader itself ('': none)
    start_hint: str = ""                        # for a user whose CLI did not start under CAO (its traps: only
    #                                             where found sprung)
    cao_name: str = ""                          # what CAO's error messages call it ('': its label)
    start_tries: int = 1                        # tries an agent started alone gets whose start CAO says timed out
    proven: str = ""                            # the version proven end to end with the loop
    usage_limit: str = ""                       # regex: its account's usage limit on its screen (group `what`,
    #                                             and `rest`: the words after it, where usage_limit_resets looks)
    usage_limit_resets: str = ""                # regex: the reset in them (groups `hour`, and where it names
    #                                             them `minute`, `half` (am/pm), `month`, `day`, `year`, `zone`)
    error_lines: str = ""                       # regex: a line of its output that says its model provider failed
    rate_limit_lines: str = ""                  # regex: of those, one that says it is rate limited (429)
    run_tokens: tuple[int, ...] = ()            # the least input tokens a run sends its model: passing in round 1
    #                                             (9 turns), in round 2 (14); measured by bench/bench_run_tokens.py
    program: str = ""                           # the program CAO starts ('': the one CAO names)
    traps: tuple[Trap, ...] = ()                # its set-up traps, looked for by --check (section 16)
    sign_in: SignIn | None = None               # how it is signed in, looked for by --check (None: not known)
    profile_file: str = ""                      # its own copy of an installed profile, under the agents' home
    cao_since: str = ""                         # the first CAO release that knows its provider ('': any)
    turn_marks: tuple[str, ...] = ()            # (regex whose group 1 is a mark's word, its words for working,
    #                                             done and idle): how it marks its turns on the screen (): none
    cannot_start: tuple[CannotStart, ...] = ()  # its words on screen when it cannot start for a lasting reason
    #                                             (a shell's "not found" for its program is read for every row)
    model_names: tuple[str, ...] = ()           # regexes over "<asked>\n<recorded>": other names it records for
    #                                             the model asked for (else only that id is it)

    def status_word(self, status: str) -> str:
        """The status as the loop goes by it: a ready word CAO misreads for this CLI becomes one that cannot tell."""
        return "unknown" if status in READY_STATUSES and not self.ready_status_trusted else status


# An account's usage limit, as Codex and Claude Code say it (their words and reset forms: docs/state-and-resume.md).
HIT_YOUR_LIMIT = r"You(?:'|’|\u2019)ve hit your (?P<what>[\w -]{0,40}?limit)\b(?P<rest>.{0,200})"
CODEX_CONFIG = dict(file=".codex/config.toml", folder_env="CODEX_HOME")

# -- How each CLI is signed in: the forms its own code accepts (docs/agent-clis.md#signed-in) -----------------
# Claude Code 2.1: CAO's launch line clears every CLAUDE* variable but the CLAUDE_CODE_USE_* switches, so a
# CLAUDE_CODE_OAUTH_TOKEN (or CLAUDE_CONFIG_DIR) of the agents' environment never reaches it; its settings'
# "env" does. A key in ANTHROPIC_API_KEY is used only once approved: until then it asks at each start.
CLAUDE_SETTINGS = (".claude/settings.json", "{project}/.claude/settings.json", "{project}/.claude/settings.local.json")
CLAUDE_SIGN_IN = SignIn(
    "`claude`, then /login (or `claude setup-token`)", "or set ANTHROPIC_API_KEY for the agents",
    (Credential("ANTHROPIC_AUTH_TOKEN", env=("ANTHROPIC_AUTH_TOKEN",)),
     Credential("ANTHROPIC_API_KEY", env=("ANTHROPIC_API_KEY",), reader="claude api key"),
     Credential("CLAUDE_CODE_OAUTH_TOKEN in its settings", env=("CLAUDE_CODE_OAUTH_TOKEN",), settings_only=True),
     *(Credential("apiKeyHelper in {file}", file=name, json_key="apiKeyHelper") for name in CLAUDE_SETTINGS),
     Credential("its login, {file}", file=".claude/.credentials.json", json_key="claudeAiOauth.accessToken"),
     Credential("the API key of its login, {file}", file=".claude.json", json_key="primaryApiKey"),
     *(Credential(f"{switch} set: it signs in with {cloud}'s credentials, which --check does not look into",
                  env=(switch,), unsure=True)
       for switch, cloud in (("CLAUDE_CODE_USE_BEDROCK", "Amazon Bedrock"),
                             ("CLAUDE_CODE_USE_VERTEX", "Google Vertex AI"),
                             ("CLAUDE_CODE_USE_FOUNDRY", "Microsoft Foundry"))),
     Credential("CLAUDE_CODE_OAUTH_TOKEN", env=("CLAUDE_CODE_OAUTH_TOKEN",),
                not_enough="CAO clears CLAUDE_CODE_OAUTH_TOKEN before it starts Claude Code: put it under \"env\" "
                           "in ~/.claude/settings.json instead")),
    settings_env=CLAUDE_SETTINGS)
# Codex 0.169: its login (auth.json) or a model provider of its config; OPENAI_API_KEY alone shows its login screen.
CODEX_SIGN_IN = SignIn(
    "`codex login`", "or give it an API key: `printenv OPENAI_API_KEY | codex login --with-api-key`",
    (Credential("its model provider", reader="codex model provider", **CODEX_CONFIG),
     Credential("its login, {file}", file=".codex/auth.json", folder_env="CODEX_HOME",
                pattern=r'"OPENAI_API_KEY"\s*:\s*"[^"\s]|"tokens"\s*:\s*\{'),
     Credential("OPENAI_API_KEY", env=("OPENAI_API_KEY",),
                not_enough="Codex does not sign in with OPENAI_API_KEY alone (it shows its login screen): "
                           "`printenv OPENAI_API_KEY | codex login --with-api-key` saves it")))
# OpenCode: a key in its config (CAO's, ~/.aws/opencode/opencode.json) or its login for the model's provider; a
# provider's own variable is named in its catalogue (models.dev), which the loop does not hold.
OPENCODE_SIGN_IN = SignIn(
    "`opencode auth login`", "or set the provider's own key variable (e.g. ANTHROPIC_API_KEY) for the agents",
    (Credential("the key of its model's provider", reader="opencode provider", file=".aws/opencode/opencode.json"),))
# Copilot CLI: its own model provider (BYOK) needs no GitHub sign-in; else a token variable, its /login (the
# token in the system keychain, or in config.json), or GitHub CLI's login as the last resort.
COPILOT_SIGN_IN = SignIn(
    "`copilot`, then /login", "or set COPILOT_GITHUB_TOKEN (a token with Copilot access) for the agents",
    (Credential("its own model provider, COPILOT_PROVIDER_BASE_URL (no GitHub sign-in needed)",
                env=("COPILOT_PROVIDER_BASE_URL",)),
     Credential("{variable}", env=("COPILOT_GITHUB_TOKEN", "GH_TOKEN", "GITHUB_TOKEN")),
     *(Credential("its /login, {file}", file=".copilot/config.json", json_key=key)
       for key in ("logged_in_users", "loggedInUsers")),
     Credential("it would fall back to GitHub CLI's login ({file}), which --check does not look into",
                file=".config/gh/hosts.yml", folder_env="GH_CONFIG_DIR", pattern=r"\S", unsure=True)))
# Hermes Agent 0.19: a provider's key in the environment or its .env, a provider in config.yaml, or its login.
HERMES_KEY_VARIABLES = (
    "OPENROUTER_API_KEY", "OPENAI_API_KEY", "ANTHROPIC_API_KEY", "ANTHROPIC_TOKEN", "OPENAI_BASE_URL",
    "ALIBABA_CODING_PLAN_API_KEY", "ARCEEAI_API_KEY", "AZURE_FOUNDRY_API_KEY", "CLAUDE_CODE_OAUTH_TOKEN",
    "COPILOT_GITHUB_TOKEN", "DASHSCOPE_API_KEY", "DEEPINFRA_API_KEY", "DEEPSEEK_API_KEY", "FIREWORKS_API_KEY",
    "GEMINI_API_KEY", "GH_TOKEN", "GITHUB_TOKEN", "GLM_API_KEY", "GMI_API_KEY", "GOOGLE_API_KEY", "HF_TOKEN",
    "KILOCODE_API_KEY", "KIMI_API_KEY", "KIMI_CN_API_KEY", "KIMI_CODING_API_KEY", "LM_API_KEY", "MINIMAX_API_KEY",
    "MINIMAX_CN_API_KEY", "NOVITA_API_KEY", "NVIDIA_API_KEY", "OLLAMA_API_KEY", "OPENCODE_GO_API_KEY",
    "OPENCODE_ZEN_API_KEY", "STEPFUN_API_KEY", "TOKENHUB_API_KEY", "UPSTAGE_API_KEY", "XAI_API_KEY",
    "XIAOMI_API_KEY", "ZAI_API_KEY", "Z_AI_API_KEY")
HERMES_SIGN_IN = SignIn(
    "`hermes setup`", "or set OPENROUTER_API_KEY (or another provider's key) for the agents",
    (Credential("{variable}", env=HERMES_KEY_VARIABLES),
     Credential("a provider's key in {file}", file=".hermes/.env", folder_env="HERMES_HOME",
                pattern=rf"^[ \t]*(?:export[ \t]+)?(?:{'|'.join(HERMES_KEY_VARIABLES)})[ \t]*=[ \t]*['\"]?[^\s'\"#]"),
     Credential("its model provider in {file}", file=".hermes/config.yaml", folder_env="HERMES_HOME",
                pattern=r"^model:[ \t]*\n(?:[ \t]+[^\n]*\n)*?[ \t]+(?:provider|base_url|api_key):[ \t]*['\"]?[^\s'\"#]"
                        r'|"model"\s*:\s*\{[^}]*"(?:provider|base_url|api_key)"\s*:\s*"[^"]'),
     Credential("its login, {file}", file=".hermes/auth.json", folder_env="HERMES_HOME", json_key="active_provider")))

AGENT_CLIS: dict[str, AgentCli] = {
    # Claude Code: CAO's status holds; it asks at its usage limit what to do.
    "claude_code": AgentCli(
        "Claude Code",
        conversation_words=(("Compactingconversation", "compacted"),    # while it summarises (also /compact)
                            ("Conversationcompacted", "compacted"),     # "✻ Conversation compacted (ctrl+o ...)"
                            ("Compacted(ctrl+otoseefullsummary)", "compacted"),  # after /compact typed by hand
                            ("❯/clear", "cleared")),                    # /clear typed by hand (nothing else shows)
        context_low=r"Contextlow\((?P<left>\d+)%remaining\)|Contextlimitreached",   # with auto-compact off
        menus=(("Claude Code's usage-limit menu", "Stop and wait for limit to reset"),), menu_cursor="❯",
        usage_limit=HIT_YOUR_LIMIT,      # "· resets 3pm (Europe/Berlin)", "· resets Dec 5, 3:30pm"
        usage_limit_resets=r"resets (?:(?P<month>[A-Z][a-z]{2})[a-z]*\.? (?P<day>\d{1,2}),? )?(?P<hour>\d{1,2})"
                           r"(?::(?P<minute>\d{2}))? ?(?P<half>[AaPp]\.?[Mm]\.?)?(?: \((?P<zone>[\w/+-]+)\))?",
        error_lines=r"API Error: *[45]\d\d|API Error: .{0,60}\([45]\d\d\)"
                    r"|\"type\": *\"(?:api_error|overloaded_error|rate_limit_error)\"",
        rate_limit_lines=r"API Error: *429\b|API Error: .{0,60}\(429\)|\"type\": *\"rate_limit_error\"",
        records="claude transcripts", compaction_settings="claude settings.json",
        model_names=(r"(?P<id>.+)\n(?P=id)-\d{8}",                          # the asked id, dated
                     r"(?P<alias>sonnet|opus|haiku)\nclaude-(?P=alias)-\d+(?:-\d{1,2})?(?:-\d{8})?"),  # its family
        proven="2.1.197", program="claude", run_tokens=(444_750, 700_544),
        traps=(Trap("Claude Code: IS_SANDBOX=1 set for root",
                    "Claude Code as root: its agents' environment has {seen}, and Claude Code takes only IS_SANDBOX=1, "
                    "so it refuses the mode CAO starts it in; start cao-server as `IS_SANDBOX=1 cao-server` (and its "
                    "tmux server with it: stop a running one first)", env="IS_SANDBOX", env_value="1",
                    root_only=True),
               # its first start in a home asks for a theme and a login, and offline stops on the network probe
               Trap("Claude Code: its first-run set-up done ({file})",
                    "Claude Code was never set up in the agents' home: its first start asks for a theme and a "
                    "login, which no agent answers; start `claude` once by hand as that user, or add to {file}: "
                    "\"hasCompletedOnboarding\": true", file=".claude.json", json_key="hasCompletedOnboarding")),
        sign_in=CLAUDE_SIGN_IN,
        # seen on 2.1.197's screen: as root without IS_SANDBOX=1; at its first start in a HOME (its onboarding asks
        # Anthropic's servers) with no network; set up but signed in nowhere (its footer, at an idle prompt)
        cannot_start=(
            CannotStart(r"cannotbeusedwithroot/sudoprivileges",
                        "it refuses --dangerously-skip-permissions as root, as IS_SANDBOX is not exactly 1 in its "
                        "environment", "start cao-server as `IS_SANDBOX=1 cao-server` (and its tmux server with it)"),
            CannotStart(r"UnabletoconnecttoAnthropicservices|Failedtoconnecttoapi\.anthropic\.com",
                        "it could not reach Anthropic's servers, which it asks at its first start in a HOME until it "
                        "is signed in and set up",
                        "sign it in as the user running cao-server (run `claude` once by hand, or set "
                        "ANTHROPIC_API_KEY in cao-server's environment); with no network, also mark its first start "
                        "done in ~/.claude.json (docs/agent-clis.md)"),
            CannotStart(r"Notloggedin·(?:Please)?[Rr]un/login", "it is not signed in", CLAUDE_SIGN_IN.fix))),
    # Codex: CAO's `idle` can last through a first turn; its own screen marks (turn_mark) and a still screen tell.
    "codex": AgentCli(
        "Codex", ready_status_trusted=False,
        conversation_words=(("Compactingcontext", "compacted"),         # while it summarises (also /compact)
                            ("Contextcompacted", "compacted")),         # "• Context compacted · 0s"
        # the agents work in the folder the user gave: the loop trusts it (--check says how beforehand)
        menus=(("Codex's offer to switch the model", "Keep current model"),
               ("Codex's question whether to trust the project", "Trust and continue")), menu_cursor="›",
        usage_limit=HIT_YOUR_LIMIT,      # ". Try again at 3:05 PM.", "... at Jan 5th, 2026 3:05 PM."
        usage_limit_resets=r"[Tt]ry again at (?:(?P<month>[A-Z][a-z]{2})[a-z]*\.? (?P<day>\d{1,2})(?:st|nd|rd|th)?,? "
                           r"(?:(?P<year>\d{4}),? )?)?(?P<hour>\d{1,2})(?::(?P<minute>\d{2}))? ?(?P<half>[AP]M)?\.?",
        records="codex rollouts", compaction_settings="codex config.toml", proven="0.169.0", program="codex",
        run_tokens=(300_716, 457_996),
        traps=(Trap("Codex trusts the project ({project})",
                    "Codex does not trust {project}: it asks at each agent's start (a minute each, the first prompt "
                    "lost); add to {file}: [projects.\"{project}\"] then trust_level = \"trusted\"",
                    pattern=r"""^\[projects\.(["'])(?P<project>.+?)\1\]\s*\n(?:(?!\[)[^\n]*\n)*?\s*"""
                            r"""trust_level\s*=\s*["']trusted["']""", **CODEX_CONFIG),
               # a bare Enter takes its offer of a cheaper model at a usage limit, and CAO sends one after a prompt
               Trap("Codex: its offer of another model at a usage limit is turned off",
                    "Codex offers another model at a usage limit, and the second Enter CAO sends with a prompt takes "
                    "it: the agent goes on with a model nobody chose (the run then stops); add to {file}: [notice] "
                    "then hide_rate_limit_model_nudge = true",
                    pattern=r"^\[notice\][ \t]*\n(?:(?!\s*\[)[^\n]*\n)*?[ \t]*hide_rate_limit_model_nudge[ \t]*="
                            r"[ \t]*true\b|^[ \t]*notice\.hide_rate_limit_model_nudge[ \t]*=[ \t]*true\b",
                    **CODEX_CONFIG)),
        sign_in=CODEX_SIGN_IN,
        turn_marks=(r"\x1b\]7501;state=(\w+)", "working", "done", "idle"),
        # 0.169's first screen in a HOME with no sign-in (no auth.json, no OPENAI_API_KEY, no provider of its own)
        cannot_start=(CannotStart(r"SigninwithChatGPT|ChoosehowyouwanttouseCodex",
                                  "it is not signed in (it asks how to sign in)", CODEX_SIGN_IN.fix),)),
    # OpenCode: CAO reads `idle` or `completed` while it works; its busy bar repaints twenty times a second.
    "opencode_cli": AgentCli(
        "OpenCode", ready_status_trusted=False, still_screen_ends_turn=STILL_SCREEN_SECONDS,
        records="opencode database", model_names=(r"[^/\n]+/(?P<id>.+)\n(?P=id)",),   # provider/model, recorded: model
        start_hint="for OpenCode, start `opencode` once by hand as that user (its first start in a new HOME sets "
                   "itself up) and check the model provider in ~/.aws/opencode/opencode.json",
        proven="1.18.33", program="opencode", run_tokens=(135_448, 216_113),
        traps=(Trap("OpenCode: its model set in {file}",
                    "OpenCode: no model in {file} (CAO starts it with that file): add a provider entry and a "
                    "top-level \"model\": \"<provider>/<model>\" (docs/agent-clis.md)",
                    file=".aws/opencode/opencode.json", json_key="model"),),
        sign_in=OPENCODE_SIGN_IN, profile_file=".aws/opencode/agents/{name}.md"),
    # Copilot CLI: CAO read a ready status while it was still at work; its spinner turns four times a second.
    "copilot_cli": AgentCli(
        "GitHub Copilot CLI", ready_status_trusted=False, still_screen_ends_turn=STILL_SCREEN_SECONDS,
        proven="1.0.102", program="copilot", records="copilot session logs",
        traps=(Trap("Copilot CLI: CAO's MCP server disabled",
                    "Copilot CLI would connect to CAO's MCP server, which it rejects (CAO then reports its terminal "
                    "in error): put {\"disabledMcpServers\": [\"cao-mcp-server\"]} in {file}",
                    file=".copilot/settings.json", json_key="disabledMcpServers", json_holds="cao-mcp-server"),),
        profile_file=".copilot/agents/{name}.agent.md", run_tokens=(338_995, 537_724), sign_in=COPILOT_SIGN_IN),
    # Hermes Agent: the same; its status bar's timers change twice a second while it works. CAO can time out a
    # start whose CLI came up (a late redraw hides the idle prompt): a second start seldom meets the same moment.
    "hermes": AgentCli(
        "Hermes Agent", ready_status_trusted=False, still_screen_ends_turn=STILL_SCREEN_SECONDS,
        records="hermes state.db", proven="0.19.0", program="hermes", run_tokens=(287_911, 455_907),
        cao_name="Hermes", start_tries=2,
        traps=(Trap("Hermes: PROMPT_TOOLKIT_NO_CPR set in its agents' environment",
                    "Hermes: the agents' environment has {seen}, and its screen library takes only "
                    "PROMPT_TOOLKIT_NO_CPR=1 (a start-up then hangs now and then): `{tmux} set-environment -g "
                    "PROMPT_TOOLKIT_NO_CPR 1`, or export it before starting cao-server", env="PROMPT_TOOLKIT_NO_CPR",
                    env_value="1"),), sign_in=HERMES_SIGN_IN),
    # The scripted agent (mock_cli, installed with this project) and the other CLIs CAO knows: CAO's word, their
    # rows only a label (q_cli: CAO's older name for Kiro CLI).
    "mock_cli": AgentCli("the scripted agent", program="mock_cli", run_tokens=(0, 0), cao_since="2.5.4"),
    **{provider: AgentCli(label) for provider, label in (
        ("kiro_cli", "Kiro CLI"), ("kimi_cli", "Kimi CLI"), ("cursor_cli", "Cursor CLI"),
        ("antigravity_cli", "Antigravity CLI"), ("omp", "omp"), ("grok_cli", "Grok CLI"), ("mcode", "mcode"),
        ("q_cli", "Amazon Q CLI"))},
}
SCRIPTED_PROVIDER = "mock_cli"   # the scripted agent, installed with the loop: --demo runs it
SCRIPTED_WORDS = "scripted agents: nothing was built or tested by an AI"    # said wherever a run's result is read
DEFAULT_PROVIDER = "codex"


def agent_cli(provider: str) -> AgentCli:
    """The row of the provider's CLI (the defaults for one without a row)."""
    return AGENT_CLIS.get(provider) or AgentCli(provider)


def row_values(cli: AgentCli | None, field_name: str, own_only: bool = False) -> list:
    """The one reader of a field across rows (words, regexes, pairs): what the CLI's row holds; for a CLI not known
    -- or, unless `own_only`, one whose row holds none -- every CLI's. Each once; a tuple field's items flattened."""
    own = cli is not None and (own_only or getattr(cli, field_name))
    values = [getattr(row, field_name) for row in ([cli] if own else AGENT_CLIS.values())]
    flat = [item for value in values for item in (value if isinstance(value, tuple) else (value,))]
    return [value for value in dict.fromkeys(flat) if value]

def model_is(recorded: str, asked: str, cli: AgentCli) -> bool:
    """Whether a recorded model is the one asked for, by its CLI's rule: that id, or another name of it its row
    declares (`model_names`: a dated id, an alias's family, the model without its provider); a sibling is not."""
    return bool(asked) and (recorded == asked or any(re.fullmatch(form, f"{asked}\n{recorded}")
                                                     for form in cli.model_names))


def price_of(model: str) -> dict[str, float] | None:
    """MODEL_PRICES' price of a recorded model: its own, else that of the priced model it is by a CLI row's
    `model_names` rule (a dated id of a priced model is priced; a sibling is not)."""
    return MODEL_PRICES.get(model) or next((price for asked, price in MODEL_PRICES.items()
                                            if any(model_is(model, asked, cli) for cli in AGENT_CLIS.values())), None)


# The CAO agent profile each role starts with (profiles/): named after the role, the analysts as system analysts.
DEFAULT_PROFILES = {role: role.replace("analyst", "system_analyst") for role in ROLES}

STATE_FILE_NAME = "orchestrator-loop-state.json"
# The shell orchestrator's name for the state file: a state file there is still used, so its run resumes.
OLD_STATE_FILE_NAME = "codex-3agents-loop-state.json"
FRESH_CONTEXT_CHOICES = ("off", "round")     # FRESH_CONTEXT: when an agent starts a new conversation
GATES = ("plan", "commit")                   # APPROVE: where a person decides (section 4, "A person")


@dataclass(frozen=True)
class ReviewCheck:
    """One check a peer review must make: what the prompt asks (12) and the evidence in REVIEW_NOTES the approval
    looks for (9), in one row so that neither is reworded without the other."""

    name: str
    asks: str
    evidence: str


# The checks of each reviewed role's peer review; an approval counts once REVIEW_EVIDENCE_MIN_MATCH of them
# show in its REVIEW_NOTES (REQUIRE_REVIEW_EVIDENCE).
REVIEW_CHECKLISTS: dict[str, tuple[ReviewCheck, ...]] = {
    "analyst": (
        ReviewCheck("Artifacts", "the change's proposal, design, specs and tasks exist and match the task.",
                    r"artifact|proposal"),
        ReviewCheck("P1 traceability", "every P1 requirement traces to the task or the scenario test.",
                    r"\bP1\b|traceab"),
        ReviewCheck("Downstream contracts",
                    "interfaces, formats and commands are exact enough to code and test against.",
                    r"downstream|contract"),
        ReviewCheck("Handoff", "the programmer's first steps are actionable.", r"handoff|hand-off|actionable"),
    ),
    "programmer": (
        ReviewCheck("Tests", "they run and pass (give the command and its result).",
                    r"\btest(s|ed|ing)?\b|pytest|passed"),
        ReviewCheck("Files", "the changed files do what the tasks ask (name them).",
                    r"\bfiles?\b|\bdiff\b|\.py\b|function"),
        ReviewCheck("Requirements", "each requirement and the scenario test is covered by the code.",
                    r"scenario|requirement|\bspec"),
        ReviewCheck("Edge cases and error handling", "no obvious regression or unhandled error.",
                    r"edge case|error handling|regression|\brisk"),
    ),
}


@dataclass(frozen=True)
class VerdictFormat:
    """A reply that ends in a verdict: its line (`label: word`) and the section that says why; the prompts (12)
    ask with it, verdict_line() reads it, reply_verdict() judges it."""

    label: str                     # the verdict line's label: "RESULT"
    good: str                      # the word that passes: "PASS"
    other: str                     # the word that does not: "FAIL"
    section: str                   # the section with the why: "EVIDENCE"
    missing: str                   # what a reply without the line counts as: "FAIL"

    def line(self, passed: bool) -> str:
        return f"{self.label}: {self.good if passed else self.other}"

    def answer_format(self) -> str:
        """How a prompt asks for the verdict: both of its lines, then the section that says why."""
        return f"Answer format:\n{self.line(passed=True)}  (or {self.line(passed=False)})\n{self.section}:\n"


VERDICT_FORMATS = {
    "tester": VerdictFormat("RESULT", "PASS", "FAIL", "EVIDENCE", "FAIL"),
    "review": VerdictFormat("REVIEW_RESULT", "APPROVED", "REVISE", "REVIEW_NOTES", "MISSING"),
}


def verdict_line(form: VerdictFormat, text: str) -> tuple[int | None, str]:
    """The reply's last verdict line (its index among the text's stripped lines; None: none) and its word,
    upper-cased: the one the reply ends on, when it changed its mind on the way."""
    pattern = re.compile(r"^\W*" + re.escape(form.label) + r"\W*:\W*([A-Za-z_]+)")
    found = [(index, match.group(1).upper()) for index, line in enumerate((text or "").strip().splitlines())
             if (match := pattern.match(line))]
    return found[-1] if found else (None, "")


def reply_verdict(kind: str, text: str) -> str:
    """The verdict of a reply in the format VERDICT_FORMATS[kind]: its passing word only if the last verdict line
    says it, else the other word; the row's `missing` without a verdict line (a review's: MISSING, a tester's:
    FAIL)."""
    form = VERDICT_FORMATS[kind]
    at, word = verdict_line(form, text)
    return form.missing if at is None else form.good if word == form.good else form.other


@dataclass(frozen=True)
class Setting:
    """One configuration variable: its env name, JSON key, default and kind."""

    env: str
    key: str          # dotted JSON path, e.g. "limits.max_rounds"
    default: object
    kind: str         # its row in KINDS, e.g. "count", "seconds", "url"
    help: str = ""


def _role_settings() -> list[Setting]:
    """Per-role provider, model and CAO profile, e.g. PEER_ANALYST_PROFILE."""
    forms = (("PROVIDER", "role_provider", "CAO provider for the {} (empty: PROVIDER)"),
             ("MODEL", "model", "model the {}'s agent CLI is started with (empty: MODEL)"),
             ("PROFILE", "name", "CAO agent profile for the {}"),
             ("FALLBACK_PROVIDER", "role_provider", "the {}'s fallback CLI (empty: FALLBACK_PROVIDER)"),
             ("FALLBACK_MODEL", "model", "the model of the {}'s fallback CLI (empty: FALLBACK_MODEL)"))
    return [Setting(f"{role.upper()}_{name}", f"agents.{role}.{name.lower()}",
                    DEFAULT_PROFILES[role] if name == "PROFILE" else "", kind, words.format(role))
            for role in ROLES for name, kind, words in forms]


SETTINGS: tuple[Setting, ...] = (
    Setting("API", "api", "http://localhost:9889", "url", "CAO server base URL"),
    Setting("OWN_SERVER", "own_server", "auto", "auto_bool",
            "auto: the CAO server at API when API (or CAO_API_PORT) is set or a server answers there, else the "
            "run's own, started for the run and ended with it; 1: always the run's own; 0: never (a CAO server "
            "must answer at API); the run's first line says which, why, and how to choose the other"),
    Setting("OWN_SERVER_PORT", "own_server_port", 0, "port0",
            "the port of the run's own CAO server on 127.0.0.1 (0: a free one); one another process holds is an "
            "error, never a server found"),
    Setting("PROVIDER", "provider", DEFAULT_PROVIDER, "provider", "CAO provider for every agent"),
    Setting("MODEL", "model", "", "model",
            "model every agent CLI is started with, passed to CAO at creation (empty: each CLI's own default)"),
    Setting("WD", "wd", "", "text", "working directory of the agents (empty: current directory)"),
    Setting("PROMPT", "prompt", "", "text", "task prompt text (same format as a prompt file)"),
    Setting("PROMPT_FILE", "prompt_file", "", "text", "task prompt file"),
    Setting("PROJECT_TEST_CMD", "project_test_cmd", "", "text", "test command for programmer and tester"),
    Setting("STATE_FILE", "state_file", "", "text", "state file (empty: $WD/.tmp/" + STATE_FILE_NAME + ", or "
            "$WD/.tmp/" + OLD_STATE_FILE_NAME + " where only that one exists)"),
    Setting("RESUME", "resume", False, "bool",
            "unset: resume a RUNNING run, else start a new one; 1: resume (stop if there is none); 0: always "
            "start a new run"),
    Setting("CLEANUP_ON_EXIT", "cleanup_on_exit", False, "bool", "1: exit all five agents when the loop stops"),
    Setting("REPORT_FINISHED_RUN", "report_finished_run", False, "bool",
            "1: a finished run in STATE_FILE is reported and the command exits with its code (0 PASS, 1 FAIL) "
            "instead of starting a new run"),
    Setting("START_AGENT", "start_agent", "analyst", "role", "role whose turn starts a new run"),
    Setting("MAX_ROUNDS", "limits.max_rounds", 8, "count", "test rounds before the run fails"),
    Setting("MAX_ROUNDS_WITHOUT_PROGRESS", "limits.max_rounds_without_progress", 0, "count0",
            "failed rounds in a row whose failure repeats the one before (the same evidence once times, paths "
            "and ordering are set aside) before the run stops (exit 5: a person is needed; RESUME=1 goes on); "
            "0: never"),
    Setting("MAX_REVIEW_CYCLES", "limits.max_review_cycles", 3, "count", "review cycles per phase"),
    Setting("MIN_REVIEW_CYCLES_BEFORE_APPROVAL", "limits.min_review_cycles_before_approval", 2, "count",
            "first cycle whose approval counts"),
    Setting("REQUIRE_REVIEW_EVIDENCE", "limits.require_review_evidence", True, "bool",
            "1: an approval needs evidence in REVIEW_NOTES"),
    Setting("REVIEW_EVIDENCE_MIN_MATCH", "limits.review_evidence_min_match", 3, "count",
            "evidence checks (of 4) an approval must show"),
    Setting("POLL_SECONDS", "handoff.poll_seconds", 2.0, "seconds", "status polling interval"),
    Setting("RESPONSE_TIMEOUT", "handoff.response_timeout", 1800.0, "seconds", "longest wait for one reply"),
    Setting("STRICT_FILE_HANDOFF", "handoff.strict_file_handoff", True, "bool",
            "1: an agent must write its response file; 0: fall back to its terminal output"),
    Setting("IDLE_GRACE_SECONDS", "handoff.idle_grace_seconds", 30.0, "seconds",
            "how long an agent may sit idle without its response file before it is reminded"),
    Setting("QUIET_SCREEN_SECONDS", "handoff.quiet_screen_seconds", 5.0, "seconds",
            "a written response file is taken once the agent's screen has been still this long, "
            "even if CAO still reports it busy"),
    Setting("MAX_FILE_REMINDERS", "handoff.max_file_reminders", 1, "count0",
            "reminders sent to an agent idle without its response file"),
    Setting("AUTO_ACCEPT_PERMISSIONS", "handoff.auto_accept_permissions", False, "bool",
            "1: answer an agent's permission prompt with 'y'"),
    Setting("API_RETRY_SECONDS", "handoff.api_retry_seconds", 120.0, "seconds0",
            "how long to retry an unreachable CAO server during a run"),
    Setting("PROGRESS_SECONDS", "handoff.progress_seconds", 60.0, "seconds0",
            "while an agent works, a log line every this many seconds: who, for how long, what the loop sees; "
            "0: none"),
    Setting("AGENT_STALL_SECONDS", "recovery.agent_stall_seconds", 300.0, "seconds",
            "an agent whose screen has not changed for this long, with no response file, counts as lost "
            "(a working agent CLI repaints its screen every second)"),
    Setting("REPLACE_LOST_AGENTS", "recovery.replace_lost_agents", False, "bool",
            "1: a lost agent (its CLI exited, its session gone, no sign of life) is replaced by a new one and "
            "its turn sent again (and one whose CLI changed its model takes the next turn); 0: the run stops, naming "
            "the agent"),
    Setting("MAX_AGENT_REPLACEMENTS", "recovery.max_agent_replacements", 3, "count0",
            "replacements per run (all agents of a vanished session count as one); then the run stops"),
    Setting("PROVIDER_ERROR_RETRIES", "recovery.provider_error_retries", 3, "count0",
            "times an agent stopped by its model provider's error (overloaded, failing) is told to "
            "continue, after a pause; a rate limit (429) is waited out for up to USAGE_LIMIT_MAX_WAIT instead"),
    Setting("PROVIDER_ERROR_PAUSE_SECONDS", "recovery.provider_error_pause_seconds", 60.0, "seconds",
            "the pause before the first such retry; each further pause is twice as long"),
    Setting("USAGE_LIMIT_MAX_WAIT", "recovery.usage_limit_max_wait", 18000.0, "seconds0",
            "an agent stopped by its account's usage limit is waited for until the limit resets, if that is at "
            "most this many seconds away (5 hours: a 5-hour limit); past it, or with no reset time, the run "
            "stops (exit 3) saying when to rerun; 0: never wait. Also the most a rate limit (429) is waited "
            "out in all, in pauses that double"),
    Setting("USAGE_LIMIT_MARGIN_SECONDS", "recovery.usage_limit_margin_seconds", 60.0, "seconds0",
            "how long after the reset time the agent is told to continue"),
    Setting("FALLBACK_PROVIDER", "recovery.fallback_provider", "", "role_provider",
            "the CAO provider that takes a role over when its agent's account usage limit resets later than "
            "USAGE_LIMIT_MAX_WAIT allows (or names no reset time): the agent is ended, a new one on this CLI gets "
            "the turn in full (a new conversation) and keeps the role for the rest of the run; its own limit is "
            "waited out or stops the run as without it (<ROLE>_FALLBACK_PROVIDER for one role; empty: no fallback, "
            "the run stops at such a limit)"),
    Setting("FALLBACK_MODEL", "recovery.fallback_model", "", "model",
            "the model the fallback CLI is started with (<ROLE>_FALLBACK_MODEL for one role; empty: its CLI's own "
            "default)"),
    Setting("FRESH_CONTEXT", "context.fresh_context", "off", "fresh_context",
            "off: each agent keeps one conversation for the whole run (its CLI compacts it when it fills; the "
            "loop then sends the full task again); round: every round after the first starts each agent "
            "anew, with a new conversation and the full task"),
    Setting("COMPACT_AT_TOKENS", "context.compact_at_tokens", 0, "count0",
            "how full (tokens) an agent's context gets before its CLI compacts it; once the last turn's context "
            "is within 15% of it, the agent's next prompt carries the full task instead of back-references, "
            "so the compaction cannot summarise the task away; 0: what the CLI's own settings say (Claude "
            "Code: autoCompactWindow, Codex: model_auto_compact_token_limit), else its default"),
    Setting("IGNORE_MISSING_CLI", "recovery.ignore_missing_cli", False, "bool",
            "1: create the agents even when cao-server reports their CLI not installed (its PATH differs "
            "from the agents' login PATH)"),
    Setting("STORY_MODE", "stories.enabled", False, "bool",
            "1: the programmer works one OpenSpec story (tasks.md section) at a time"),
    Setting("STORY_CHANGE", "stories.change", "", "text",
            "the OpenSpec change to work story by story and to archive on PASS (empty: the only one in "
            "openspec/changes)"),
    Setting("MAX_STORY_ATTEMPTS", "stories.max_attempts", 3, "count", "attempts per story before moving on"),
    Setting("CONDENSE_EXPLORE_ON_REPEAT", "condensation.condense_explore_on_repeat", True, "bool",
            "1: send the task text and each agent's fixed instructions once per agent, then a back-reference"),
    Setting("CONDENSE_REVIEW_FEEDBACK", "condensation.condense_review_feedback", True, "bool",
            "1: pass only REVIEW_NOTES back to the author"),
    Setting("MAX_FEEDBACK_LINES", "condensation.max_feedback_lines", 30, "count", "lines of review notes passed on"),
    Setting("MAX_TEST_EVIDENCE_LINES", "condensation.max_test_evidence_lines", 120, "count",
            "lines of test evidence passed on"),
    Setting("CONDENSE_UPSTREAM_ON_REPEAT", "condensation.condense_upstream_on_repeat", True, "bool",
            "1: later cycles get a back-reference instead of the upstream handoff"),
    Setting("CONDENSE_CROSS_PHASE", "condensation.condense_cross_phase", True, "bool",
            "1: pass only the summary sections from one phase to the next"),
    Setting("MAX_CROSS_PHASE_LINES", "condensation.max_cross_phase_lines", 40, "count",
            "lines passed from one phase to the next"),
    Setting("ARCHIVE_ON_PASS", "on_pass.archive_change", False, "bool",
            "1: on PASS, archive the run's OpenSpec change with `openspec archive <change> --yes`"),
    Setting("OPENSPEC_COMMAND", "on_pass.openspec_command", "openspec", "text",
            "the OpenSpec CLI that ARCHIVE_ON_PASS runs (a command line, e.g. 'npx openspec')"),
    Setting("ARCHIVE_TIMEOUT", "on_pass.archive_timeout", 120.0, "seconds",
            "longest wait for `openspec archive`; then it is stopped and the PASS stands"),
    Setting("COMMIT_ON_PASS", "on_pass.commit", False, "bool",
            "1: on PASS, commit what the run changed in WD's git repository (never $WD/.tmp/)"),
    Setting("VERIFY_PASS", "on_pass.verify", False, "bool",
            "1: after the tester's PASS, the loop runs PROJECT_TEST_CMD in WD itself; only its exit 0 lets the "
            "PASS stand, anything else counts as a FAIL of that round"),
    Setting("VERIFY_TIMEOUT", "on_pass.verify_timeout", 900.0, "seconds",
            "how long PROJECT_TEST_CMD may run for VERIFY_PASS; at the limit it (and all it started) is stopped"),
    Setting("APPROVE", "approval.gates", "", "gates",
            "where a person decides before the run goes on, a comma list: plan (after the peer analyst's approval, "
            "before the programmer is sent anything), commit (after PASS, before the after-run steps); empty: none"),
    Setting("APPROVAL_MAX_WAIT", "approval.max_wait", 3600.0, "seconds0",
            "how long the run waits in place at a gate, its agents idle, for --approve or --reject; then (0: at "
            "once) it saves its state and stops with exit 6, and the same command goes on once a decision is there"),
    Setting("NTFY_TOPIC", "notify.ntfy_topic", "", "text",
            "ntfy topic told of PASS, FAIL, stops that need a person and gates (with Approve and Reject buttons; "
            "empty: no notifications)"),
    Setting("NTFY_SERVER", "notify.ntfy_server", "https://ntfy.sh", "url", "ntfy server to publish to"),
    Setting("MAX_RUN_TOKENS", "tokens.max_run_tokens", 0, "count0",
            "before each turn is sent: a run whose agents have used this many tokens (input, cached input and "
            "output together, as their CLIs recorded them) stops (exit 4; rerun with a higher budget to go on); "
            "0: no budget"),
    Setting("MAX_RUN_COST", "tokens.max_run_cost", 0.0, "amount0",
            "the same for the estimated cost, from MODEL_PRICES; 0: no cost budget"),
    Setting("MODEL_PRICES", "tokens.model_prices", {}, "prices",
            'price per million tokens of each model, for the estimated cost, e.g. {"claude-sonnet-4-5": '
            '{"input": 3, "cached_input": 0.3, "output": 15}} (cached_input: input\'s price if left out); '
            "empty: no cost shown"),
    Setting("AGENT_HOME", "tokens.agent_home", "", "text",
            "the home folder of the agents' CLIs, where their records of tokens used are read (empty: this "
            "user's home, when the CAO server runs on this machine)"),
    *_role_settings(),
)
__all__ += [setting.env for setting in SETTINGS]

SETTINGS_BY_ENV = {s.env: s for s in SETTINGS}
SETTINGS_BY_KEY = {s.key: s for s in SETTINGS}
# Keys a config file may carry that are not settings (free text for people).
CONFIG_NOTE_KEYS = ("description",)
# Secrets: from the environment only, never logged or saved; a config key that looks like one is refused.
SECRET_VARIABLES = ("CAO_AUTH_LOCAL_TOKEN", "NTFY_TOKEN")
SECRET_HELP = (("CAO_AUTH_LOCAL_TOKEN", "bearer token for a cao-server started with one; never logged or saved"),
               ("NTFY_TOKEN", "ntfy access token, sent as a bearer token with each notification; never logged or "
                              "saved"))
SECRET_CONFIG_KEYS = {"notify.ntfy_token": "NTFY_TOKEN", "notify.token": "NTFY_TOKEN"}

def _is_whole(value: object, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _is_seconds(value: object, least_exclusive: bool) -> bool:
    """A finite number of seconds, at least 0 (greater than 0 if `least_exclusive`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value == float("inf"):
        return False
    return value > 0 if least_exclusive else value >= 0


def _is_price_table(value: object) -> bool:
    """MODEL_PRICES: model name -> prices per million tokens ("input" and "output", "cached_input" optional)."""
    return isinstance(value, dict) and all(
        isinstance(model, str) and model and isinstance(price, dict) and {"input", "output"} <= set(price)
        and set(price) <= {"input", "cached_input", "output"}
        and all(_is_seconds(amount, False) for amount in price.values()) for model, price in value.items())


def _digits(text: str) -> int:
    """A whole number as an environment variable gives it: digits only."""
    if not re.fullmatch(r"[0-9]+", text):
        raise ValueError
    return int(text)


def _flag(text: str) -> bool | str:
    """1 or 0 as an environment variable gives it (auto too: a kind that does not allow it refuses it)."""
    if text not in ("1", "0", "auto"):
        raise ValueError
    return "auto" if text == "auto" else text == "1"


def _json_text(text: str) -> object:
    """A JSON value as an environment variable gives it (empty: an empty object)."""
    try:
        return json.loads(text) if text else {}
    except RecursionError:
        raise ValueError from None


@dataclass(frozen=True)
class Kind:
    """A kind of setting, in one row: the values it holds, how an environment variable's text becomes one, and what
    a user who gave another is told to give."""

    expected: str                           # what to give, in an environment variable's words
    holds: Callable[[object], bool]         # whether an already typed value is one of this kind
    read: Callable[[str], object] = str     # an environment variable's text -> the typed value (ValueError: none);
    #                                         _digits and float: a number, written as one in a config file; float:
    #                                         kept as a float from either
    in_json: str = ""                       # what to give in a config file, where JSON's words differ
    choices: Iterable[str] = ()             # the values it allows, for a "did you mean" on a value that is close

    @property
    def expected_in_json(self) -> str:
        """What a config file must give: JSON's true/false, and a number written as one, not as a string."""
        if self.read in (_digits, float):
            return self.expected.replace(" of seconds", "") + " (not a string)"
        return self.in_json or self.expected


# kind -> its row; Setting.kind names one
KINDS: dict[str, Kind] = {
    "text": Kind("any text", lambda v: isinstance(v, str)),
    "url": Kind("an http:// or https:// URL, e.g. http://localhost:9889",
                lambda v: isinstance(v, str) and bool(re.match(r"^https?://[^\s/]+", v))),
    "bool": Kind("1 or 0", lambda v: isinstance(v, bool), _flag, "true or false"),
    "auto_bool": Kind("auto, 1 or 0", lambda v: v == "auto" or isinstance(v, bool), _flag, '"auto", true or false'),
    "port0": Kind("a port number from 0 to 65535", lambda v: _is_whole(v, 0) and v <= 65535, _digits),
    "count": Kind("a whole number of at least 1", lambda v: _is_whole(v, 1), _digits),
    "count0": Kind("a whole number of at least 0", lambda v: _is_whole(v, 0), _digits),
    "seconds0": Kind("a number of seconds of at least 0", lambda v: _is_seconds(v, False), float),
    "seconds": Kind("a number of seconds greater than 0", lambda v: _is_seconds(v, True), float),
    "amount0": Kind("a number of at least 0", lambda v: _is_seconds(v, False), float),
    "provider": Kind("one of " + ", ".join(AGENT_CLIS), lambda v: isinstance(v, str) and v in AGENT_CLIS,
                     choices=AGENT_CLIS),
    "role_provider": Kind("empty or one of " + ", ".join(AGENT_CLIS),
                          lambda v: isinstance(v, str) and (not v or v in AGENT_CLIS), choices=AGENT_CLIS),
    "role": Kind("one of " + ", ".join(ROLES), lambda v: v in ROLES, choices=ROLES),
    "fresh_context": Kind("one of " + ", ".join(FRESH_CONTEXT_CHOICES), lambda v: v in FRESH_CONTEXT_CHOICES,
                          choices=FRESH_CONTEXT_CHOICES),
    "gates": Kind("empty or a comma list of " + ", ".join(GATES), lambda v: isinstance(v, str) and all(
        word.strip() in GATES for word in v.split(",") if word.strip())),
    "name": Kind("a CAO agent profile name (letters, digits, '_', '-', '.')",
                 lambda v: isinstance(v, str) and bool(re.fullmatch(r"[A-Za-z0-9_.-]+", v))),
    # CAO refuses any other model id (HTTP 400) before it starts anything (docs/agent-clis.md).
    "model": Kind(
        "empty or a model id of at most 128 letters, digits and '.', '_', ':', '/', '-' (e.g. claude-haiku-4-5)",
        lambda v: isinstance(v, str) and (not v or (len(v) <= 128 and bool(re.fullmatch(r"[A-Za-z0-9._:/-]+", v))))),
    "prices": Kind('a JSON object: model -> {"input": price, "output": price, "cached_input": price}, prices per '
                   'million tokens, at least 0', _is_price_table, _json_text),
}


def _check_value(setting: Setting, value: object) -> object:
    """Apply the kind's rule to an already typed value; ValueError if it breaks it. Seconds become floats."""
    kind = KINDS[setting.kind]
    if not kind.holds(value):
        raise ValueError
    return float(value) if kind.read is float else value


def did_you_mean(setting: Setting, value: object) -> str:
    """' (did you mean claude_code?)' for a value close to one the setting allows ('' when nothing is)."""
    choices = KINDS[setting.kind].choices
    if not choices or not isinstance(value, str) or not value.strip():
        return ""
    typed = value.strip().lower()
    close = [choice for choice in choices if choice.lower() == typed] \
        or [choice for choice in choices if choice.startswith(typed) or typed.startswith(choice)] \
        or difflib.get_close_matches(typed, choices, n=1, cutoff=0.7)
    return f" (did you mean {close[0]}?)" if len(close) == 1 else ""


def read_env_settings(environ: Mapping[str, str]) -> tuple[dict[str, object], list[str]]:
    """Settings given in the environment (an empty variable counts as unset), and errors."""
    values: dict[str, object] = {}
    errors: list[str] = []
    for setting in SETTINGS:
        raw = environ.get(setting.env, "")
        if raw == "":
            continue
        try:
            text = raw if setting.kind == "text" else raw.strip()      # text is taken as written
            values[setting.env] = _check_value(setting, KINDS[setting.kind].read(text))
        except ValueError:
            errors.append(f"{setting.env}={raw!r} is not valid{did_you_mean(setting, raw)}: expected "
                          f"{KINDS[setting.kind].expected}")
    return values, errors


def _known_children(prefix: str) -> list[str]:
    """Names allowed directly under a JSON path prefix ('' for the top level)."""
    return sorted({(key[len(prefix) + 1:] if prefix else key).split(".")[0]
                   for key in [*SETTINGS_BY_KEY, *CONFIG_NOTE_KEYS] if not prefix or key.startswith(prefix + ".")})


def _config_setting(path: str, key: str, value: object, values: dict[str, object]) -> None:
    """Put a setting's value into `values`, checked as its variable's would be: a file is read as strictly."""
    setting = SETTINGS_BY_KEY[key]
    if value is None or (value == "" and setting.kind in ("text", "role_provider", "model")):
        return                          # like an empty env variable: not set
    try:
        values[setting.env] = _check_value(setting, value)
    except ValueError:
        raise ConfigError(f"config file {path}: key '{key}' is {json.dumps(value)}"
                          f"{did_you_mean(setting, value)}; expected {KINDS[setting.kind].expected_in_json}") from None


def _refuse_secret(path: str, key: str, name: str) -> None:
    """A token in a config file is refused, naming its variable: secrets come from the environment only."""
    if key in SECRET_CONFIG_KEYS or name.upper() in SECRET_VARIABLES:
        variable = SECRET_CONFIG_KEYS.get(key, name.upper())
        raise ConfigError(f"config file {path}: key '{key}' is refused: the token is a secret, read only "
                          f"from the environment variable {variable} (so it never sits in a file)")


def _misplaced_key_hint(name: str, key: str, allowed: list[str]) -> str:
    """Where an unknown key belongs, when it is a setting's variable name or a setting out of place; else a
    close known name: the likeliest slips say how to write them."""
    close = difflib.get_close_matches(name, allowed, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    setting = SETTINGS_BY_ENV.get(name.upper())
    if setting is None or setting.key == key:
        return hint
    parent, _, leaf = setting.key.rpartition(".")
    return (f"'{name}' is the environment variable; in a config file it is '{setting.key}'. "
            if name == name.upper() else f"'{name}' belongs at the top level. " if not parent else
            f"'{name}' belongs inside '{parent}': {{\"{parent}\": {{\"{leaf}\": ...}}}}. ")


def _refuse_unknown_key(path: str, prefix: str, name: str, key: str) -> None:
    """A key the config file may not hold at this place stops the start, listing the keys it may hold."""
    allowed = _known_children(prefix)
    if name not in allowed:
        where = f"in '{prefix}'" if prefix else "at the top level"
        raise ConfigError(f"config file {path}: unknown key '{key}' ({_misplaced_key_hint(name, key, allowed)}"
                          f"known keys {where}: {', '.join(allowed)})")


def _config_values(path: str, node: dict, prefix: str, values: dict[str, object]) -> None:
    """Check one object of a config file (`prefix` its dotted key), putting its settings into `values`."""
    for name, value in node.items():
        key = f"{prefix}.{name}" if prefix else name
        if key in CONFIG_NOTE_KEYS:
            if not isinstance(value, str):
                raise ConfigError(f"config file {path}: key '{key}' must be text")
        elif key in SETTINGS_BY_KEY:
            _config_setting(path, key, value, values)
        else:
            _refuse_secret(path, key, name)
            _refuse_unknown_key(path, prefix, name, key)
            if not isinstance(value, dict):
                raise ConfigError(f"config file {path}: key '{key}' must be an object with keys "
                                  f"{', '.join(_known_children(key))}")
            _config_values(path, value, key, values)


def read_user_file(path: Path, named: str, expected: str, utf8_fix: str = "") -> str:
    """The text of a file the user names (the config file, PROMPT_FILE); else the ConfigError that says what is
    wrong with it, calling it `named`."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{named} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"{named} is a directory, expected {expected}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{named} is not UTF-8 text{utf8_fix}") from None
    except OSError as exc:
        raise ConfigError(f"{named} cannot be read: {exc.strerror}") from None


def read_config_file(path: str) -> dict[str, object]:
    """Settings from a JSON config file, keyed by env name; ConfigError on any flaw."""
    text = read_user_file(Path(path), f"config file {path}", "a JSON file")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid JSON: {exc.msg} at line {exc.lineno} "
                          f"column {exc.colno}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a JSON object {{...}} at the top level")
    values: dict[str, object] = {}
    _config_values(path, data, "", values)
    return values


def default_state_file(wd: str) -> str:
    """$WD/.tmp/orchestrator-loop-state.json, or the older name where only that file exists (its run goes on)."""
    path, old = (os.path.join(wd, ".tmp", name) for name in (STATE_FILE_NAME, OLD_STATE_FILE_NAME))
    return old if os.path.exists(old) and not os.path.exists(path) else path


# The environment is read at import, as in the shell script; a bad value is its default until main() reports it.
_env_values, _ = read_env_settings(os.environ)


def _current_directory() -> str:
    """The default WD; a directory deleted under the process is left for validation to report."""
    try:
        return os.getcwd()
    except OSError:
        return os.environ.get("PWD", ".")


def set_settings(values: Mapping[str, object]) -> None:
    """The one door through which settings become the module-level names the specs fix (one per SETTINGS row,
    the shell script's names): at import, from configure(), from a resumed state, for the demo."""
    globals().update(values)


# Each setting as a module-level name, from the environment at import (a bad value is its default until main()
# reports it); WD and STATE_FILE default to where the command runs.
set_settings({setting.env: _env_values.get(setting.env, setting.default) for setting in SETTINGS})
WD = WD or _current_directory()                                     # noqa: F821 (set from SETTINGS just above)
STATE_FILE = STATE_FILE or default_state_file(WD)                   # noqa: F821

# The secrets (SECRET_VARIABLES): CAO's own convention for a server started with a token, and ntfy's.
CAO_AUTH_LOCAL_TOKEN: str = os.environ.get("CAO_AUTH_LOCAL_TOKEN", "")
NTFY_TOKEN: str = os.environ.get("NTFY_TOKEN", "")

# The settings the user chose (environment or config file): on resume they win over the state file's.
explicit_settings: set[str] = set(_env_values)
# Warnings for environment variables that look like a misspelt setting: said first and again last.
setting_warnings: list[str] = []
config_argument = ""               # the config file named on the command line ("" if none), for printed commands


def command_name() -> str:
    """The name the user ran: the installed command, or the script (python run_orchestrator_loop.py)."""
    name = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    return name if name in (PACKAGE_NAME, Path(__file__).name) else PACKAGE_NAME


# The task, parsed from PROMPT / PROMPT_FILE (or from the state on resume).
EXPLORE_HEADER = "*** ORIGINAL EXPLORE SUMMARY ***"
SCENARIO_HEADER = "*** SCENARIO TEST ***"
EXPLORE_SUMMARY: str = ""
SCENARIO_TEST: str = ""


def misspelt_settings(environ: Mapping[str, str]) -> list[str]:
    """Warnings for environment variables that look like a setting with a typo (MAX_ROUND)."""
    known = [setting.env for setting in SETTINGS] + list(SECRET_VARIABLES)
    close = {name: difflib.get_close_matches(name, known, n=1, cutoff=0.85) for name in sorted(environ)
             if name not in known and len(name) >= 4 and name.isupper()}
    return [f"warning: {name} is not a setting (ignored); did you mean {match[0]}?"
            for name, match in close.items() if match]


def is_copy_of_this_program(directory: Path) -> bool:
    """This module's own directory, or a checkout of it (an installed command runs from site-packages)."""
    return directory.resolve() == Path(__file__).resolve().parent or \
        ((directory / Path(__file__).name).is_file() and (directory / "pyproject.toml").is_file())


def refuse_wd_in_this_program() -> None:
    """WD may be neither this program's own directory (or a checkout of it) nor a folder inside one."""
    inside = next((folder for folder in Path(WD).parents if is_copy_of_this_program(folder)), None)
    if is_copy_of_this_program(Path(WD)) or inside:
        what = f"is inside {inside}, this program's own directory" if inside else "is this program's own directory"
        raise ConfigError(f"WD={WD} {what} (a checkout of the orchestrator loop): the agents would rewrite the "
                          "orchestrator. Make a directory for your project outside it and set WD to it (or run "
                          "from there)")


def validate_settings() -> None:
    """Cross-checks no single value can make, and making paths absolute."""
    global WD, STATE_FILE
    if not os.path.isdir(WD):
        what = "does not exist" if not os.path.exists(WD) else "is not a directory"
        raise ConfigError(f"WD={WD} {what}: set WD (or 'wd' in the config file) to the project directory")
    WD = os.path.abspath(WD)
    refuse_wd_in_this_program()
    STATE_FILE = os.path.abspath(STATE_FILE)
    if VERIFY_PASS and not PROJECT_TEST_CMD.strip():
        raise ConfigError("VERIFY_PASS=1 needs PROJECT_TEST_CMD: set it to the command that runs the project's "
                          "tests (exit 0 when they pass), or unset VERIFY_PASS")
    if os.path.isdir(STATE_FILE):
        raise ConfigError(f"STATE_FILE={STATE_FILE} is a directory: give it a file path")
    if MIN_REVIEW_CYCLES_BEFORE_APPROVAL > MAX_REVIEW_CYCLES:
        raise ConfigError(f"MIN_REVIEW_CYCLES_BEFORE_APPROVAL={MIN_REVIEW_CYCLES_BEFORE_APPROVAL} is larger than "
                          f"MAX_REVIEW_CYCLES={MAX_REVIEW_CYCLES}, so no review could ever be approved: "
                          "lower it or raise MAX_REVIEW_CYCLES")
    checks = min(len(checklist) for checklist in REVIEW_CHECKLISTS.values())
    if REVIEW_EVIDENCE_MIN_MATCH > checks:
        raise ConfigError(f"REVIEW_EVIDENCE_MIN_MATCH={REVIEW_EVIDENCE_MIN_MATCH} exceeds the {checks} evidence "
                          f"checks a review is scored on: use 1 to {checks}")
    if NTFY_TOPIC and not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", NTFY_TOPIC):
        raise ConfigError(f"NTFY_TOPIC={NTFY_TOPIC!r} is not an ntfy topic: use 1 to 64 letters, digits, '_' or '-'")
    try:
        openspec_words = shlex.split(OPENSPEC_COMMAND)
    except ValueError as exc:
        raise ConfigError(f"OPENSPEC_COMMAND={OPENSPEC_COMMAND!r} is not a command line ({exc})") from None
    if not openspec_words:
        raise ConfigError("OPENSPEC_COMMAND is blank: leave it unset for 'openspec' or name the OpenSpec CLI")
    check_budget_settings()


def check_budget_settings() -> None:
    """A budget the loop could not keep is refused: it counts only what the agents' CLIs record."""
    budget = "MAX_RUN_TOKENS" if MAX_RUN_TOKENS else "MAX_RUN_COST" if MAX_RUN_COST else ""
    check_model_prices()
    if not budget:
        return
    unread = sorted({provider for provider in providers_in_use() if not agent_cli(provider).records})
    if unread:
        read = ", ".join(provider for provider, cli in AGENT_CLIS.items() if cli.records)
        raise ConfigError(f"{budget} counts the tokens recorded by the agents' CLIs, and the loop reads those of "
                          f"{read} only, not {', '.join(unread)}: unset {budget} or use one of those providers")
    if not token_records_readable():
        raise ConfigError(f"{budget} counts the tokens recorded by the agents' CLIs, which are on the machine of the "
                          f"CAO server at {API}, not this one: set AGENT_HOME to where the agents' home folder can "
                          f"be read from here, or unset {budget}")


def check_model_prices() -> None:
    """A cost budget needs a price for each model asked for (the CLIs' defaults are priced once recorded)."""
    unpriced = sorted({model_for(role) for role in ROLES} - set(MODEL_PRICES) - {""})
    if MAX_RUN_COST and (unpriced or not MODEL_PRICES):
        none_for = f"; it has none for {', '.join(unpriced)}" if unpriced else ""
        raise ConfigError("MAX_RUN_COST needs MODEL_PRICES, the price per million tokens of each model the agents "
                          f"use (see --help-settings){none_for}, or unset MAX_RUN_COST")


def cao_cli_address(environ: Mapping[str, str]) -> str:
    """The server CAO's own `cao` command talks to (CAO_API_HOST, CAO_API_PORT): the loop's too, unless API says."""
    port = environ.get("CAO_API_PORT", "").strip() or "9889"
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"CAO_API_PORT={port!r} is not a port number: set it to the port of your CAO server")
    return f"http://{environ.get('CAO_API_HOST', '').strip() or '127.0.0.1'}:{port}"


def configure(argv: list[str]) -> None:
    """Settle every setting (env > JSON > default) and validate it, before anything runs."""
    global explicit_settings, setting_warnings, config_argument, CAO_AUTH_LOCAL_TOKEN, NTFY_TOKEN
    config_argument = argv[0] if argv else ""
    CAO_AUTH_LOCAL_TOKEN = os.environ.get("CAO_AUTH_LOCAL_TOKEN", "")
    NTFY_TOKEN = os.environ.get("NTFY_TOKEN", "")
    setting_warnings = misspelt_settings(os.environ)
    for warning in setting_warnings:
        say_error(warning)
    env_values, env_errors = read_env_settings(os.environ)
    if env_errors:
        raise ConfigError(env_errors[0])
    file_values = read_config_file(argv[0]) if argv else {}
    chosen = {**file_values, **env_values}
    if "API" not in chosen and (os.environ.get("CAO_API_PORT") or os.environ.get("CAO_API_HOST")):
        chosen["API"] = cao_cli_address(os.environ)
    if "WD" in chosen and "STATE_FILE" not in chosen:
        chosen["STATE_FILE"] = default_state_file(os.path.abspath(chosen["WD"]))
    set_settings(chosen)
    explicit_settings = set(chosen)
    validate_settings()


# Lines of prompt_template.md that stand for the user's text: a task holding one is the unedited template.
TEMPLATE_PLACEHOLDERS = (
    "What to build or change, and what the agents should know before they start.",
    "How the tester decides PASS or FAIL: concrete steps with expected results, e.g.",
)


def parse_task_prompt(text: str, source: str) -> tuple[str, str]:
    """Split a task prompt into its explore summary and scenario test sections."""
    sections: dict[str, list[str]] = {}
    current: list[str] = []              # the lines before the first header: no section's
    for line in text.splitlines():
        header = line.strip()
        if header not in (EXPLORE_HEADER, SCENARIO_HEADER):
            current.append(line)
        elif header in sections:
            raise ConfigError(f"{source}: the header line '{header}' appears twice")
        else:
            current = sections[header] = []
    for header in (EXPLORE_HEADER, SCENARIO_HEADER):
        if header not in sections:
            raise ConfigError(f"{source}: missing the header line '{header}' (see prompt_template.md for the format)")
        if not "\n".join(sections[header]).strip():
            raise ConfigError(f"{source}: the '{header}' section is empty; write the text under that header")
        for placeholder in TEMPLATE_PLACEHOLDERS:
            if placeholder in (line.strip() for line in sections[header]):
                raise ConfigError(f"{source} is the unedited template: the '{header}' section still says "
                                  f"'{placeholder}'; replace the template's text with your task")
    return "\n".join(sections[EXPLORE_HEADER]).strip(), "\n".join(sections[SCENARIO_HEADER]).strip()


def read_task_prompt() -> str:
    """The task text from PROMPT_FILE or PROMPT ('' if neither is set), validated."""
    if PROMPT_FILE:
        path = Path(PROMPT_FILE)
        if not path.is_absolute() and not path.exists():
            path = Path(WD) / path
        text = read_user_file(path, f"PROMPT_FILE={PROMPT_FILE}", "a text file", ": save it as UTF-8")
        parse_task_prompt(text, f"PROMPT_FILE={PROMPT_FILE}")
        return text
    if PROMPT:
        parse_task_prompt(PROMPT, "PROMPT")
        return PROMPT
    return ""


def set_task(prompt_text: str) -> None:
    """Make a task prompt the run's task; a malformed one (old state) is all explore summary."""
    global PROMPT, EXPLORE_SUMMARY, SCENARIO_TEST
    PROMPT = prompt_text
    try:
        EXPLORE_SUMMARY, SCENARIO_TEST = parse_task_prompt(prompt_text, "prompt")
    except ConfigError:
        EXPLORE_SUMMARY, SCENARIO_TEST = prompt_text.strip(), ""


def role_setting(role: str, name: str, own: bool = False) -> str:
    """A per-role setting of the role's (<ROLE>_<name>: PROVIDER, MODEL, PROFILE, FALLBACK_PROVIDER or
    FALLBACK_MODEL), read from its global; where the role sets none, the setting <name> of every role applies
    (unless `own`: then '')."""
    return globals()[f"{role.upper()}_{name}"] or ("" if own else globals().get(name, ""))


def switched_to(role: str) -> tuple[str, str] | None:
    """The provider and model the run moved the role to at a usage limit it would not wait out (cli_switches,
    section 3: for the rest of the run), or None."""
    switch = next((s for s in cli_switches if s.role == role), None)
    return (switch.to_provider, switch.to_model) if switch is not None else None


def provider_for(role: str) -> str:
    """The role's provider: its fallback once the run switched the role to it, else its own if set, else
    PROVIDER."""
    switched = switched_to(role)
    return switched[0] if switched else role_setting(role, "PROVIDER")


def model_for(role: str) -> str:
    """The model the role's agent CLI is started with: its fallback's once switched, else its own, else MODEL;
    '' leaves the CLI's default."""
    switched = switched_to(role)
    return switched[1] if switched else role_setting(role, "MODEL")


def fallback_for(role: str) -> tuple[str, str] | None:
    """The provider and model that may take the role over at a usage limit that outlasts the wait: its own
    fallback, else FALLBACK_PROVIDER's; None when none is set, or it is the role's own CLI and model."""
    provider, model = role_setting(role, "FALLBACK_PROVIDER"), role_setting(role, "FALLBACK_MODEL")
    if not provider or (provider, model) == (role_setting(role, "PROVIDER"), role_setting(role, "MODEL")):
        return None
    return provider, model


def providers_of(role: str) -> list[str]:
    """The providers the role runs on or may fall back to."""
    fallback = fallback_for(role)
    return list(dict.fromkeys([provider_for(role)] + ([fallback[0]] if fallback else [])))


def providers_in_use() -> list[str]:
    """Every provider the five roles run on or may fall back to, each once: what a run needs ready."""
    return sorted({provider for role in ROLES for provider in providers_of(role)})


def profile_for(role: str) -> str:
    """The CAO agent profile the role's terminal is created with."""
    return role_setting(role, "PROFILE")


def profiles_in_use() -> list[tuple[str, str]]:
    """Each (CAO profile, provider) a run's agents may be started with, a role's fallback included."""
    return list(dict.fromkeys((profile_for(role), provider) for role in ROLES for provider in providers_of(role)))


# ==========================================================================
# 2. CAO API client
# ==========================================================================

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")    # this machine: a server there is looked at here


class ApiError(RuntimeError):
    """A CAO call that failed. `retryable`: the server may answer if asked again (down, slow, 5xx); `unsent`: the
    request never left this machine, so repeating it is harmless."""

    def __init__(self, message: str, status_code: int | None = None, retryable: bool = False,
                 unsent: bool = False):
        super().__init__(message)
        self.status_code = status_code
        self.retryable = retryable
        self.unsent = unsent


def _what_answered(response: httpx.Response) -> str:
    """A few words on a non-JSON answer: an HTML page's title, else the start of the text, on one line."""
    text = response.text or ""
    title = re.search(r"<title[^>]*>(.*?)</title>", text, re.IGNORECASE | re.DOTALL)
    if title or "html" in response.headers.get("content-type", ""):
        name = " ".join(title.group(1).split())[:80] if title else ""
        return f"an HTML page{f' titled {name!r}' if name else ''}"
    snippet = " ".join(text.split())[:80]
    return f"the text {snippet!r}" if snippet else "an empty body"


def _error_detail(response: httpx.Response) -> str:
    """CAO's {"detail": ...} if it sent one, else the start of the body."""
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    if detail is None:
        return _what_answered(response) if response.text.strip() else response.reason_phrase
    return detail if isinstance(detail, str) else json.dumps(detail)[:300]


class ApiClient:
    """The few CAO HTTP calls the loop needs, over one connection pool; during a run (`retry_seconds` > 0) a
    failure is retried with backoff only where repeating cannot deliver a prompt twice."""

    # Creating a terminal waits until the agent CLI is up (15-30 s); a dead address fails fast.
    TIMEOUT = httpx.Timeout(300.0, connect=10.0)
    # A creation with an idempotency key whose answer was lost is asked again for this long.
    LOST_ANSWER_RETRY_SECONDS = 30.0

    def __init__(self, base_url: str, token: str = "", transport: httpx.BaseTransport | None = None):
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.retry_seconds = 0.0
        self._transport = transport
        self._client: httpx.Client | None = None
        self._client_lock = threading.Lock()

    @property
    def _http(self) -> httpx.Client:
        """The connection pool, made at the first request: its TLS context costs a part of a second that
        `--help` and a refused setting need not pay."""
        with self._client_lock:
            if self._client is None:
                headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
                self._client = httpx.Client(base_url=self.base_url, timeout=self.TIMEOUT, headers=headers,
                                            transport=self._transport)
            return self._client

    def _call(self, what: str, method: str, path: str, params: dict | None = None,
              retry: bool = True, idempotent: bool = False) -> object:
        """One request, retried where safe (a write: unsent, or `idempotent` with its answer lost); every
        failure becomes an ApiError. `retry=False`: a look whose failure means "cannot tell"."""
        started = time.monotonic()
        window = self.retry_seconds if retry else 0.0
        delay = min(POLL_SECONDS, 1.0)
        told = False
        while True:
            try:
                return self._once(what, method, path, params)
            except ApiError as exc:
                # sent, and no answer came back: asking again under the same key cannot make a second agent,
                # so it is asked again even at start-up (a server that is down is still said at once)
                lost_answer = idempotent and exc.status_code is None and not exc.unsent
                if not exc.retryable or (method != "GET" and not exc.unsent and not lost_answer) \
                        or cut_short_here():
                    raise
                if lost_answer:
                    window = max(window, self.LOST_ANSWER_RETRY_SECONDS)
                remaining = started + window - time.monotonic()
                if remaining <= 0:
                    if told:
                        raise ApiError(f"{exc} -- gave up after retrying for API_RETRY_SECONDS="
                                       f"{self.retry_seconds:g}s", exc.status_code) from None
                    raise
                if not told:
                    log(f"CAO server at {self.base_url} unreachable ({exc}); retrying for up to "
                        f"{self.retry_seconds:g}s")
                    told = True
                time.sleep(min(delay, remaining))
                delay = min(delay * 2, 10.0)

    def _once(self, what: str, method: str, path: str, params: dict | None) -> object:
        try:
            response = self._http.request(method, path, params=params)
        except (httpx.ConnectError, httpx.ConnectTimeout):
            raise ApiError(f"CAO server is not reachable at {self.base_url} ({what}): start it with "
                           f"`cao-server` or set API to its address", retryable=True, unsent=True) from None
        except httpx.TimeoutException:
            raise ApiError(f"CAO server at {self.base_url} did not answer in time ({what})",
                           retryable=True) from None
        except httpx.HTTPError as exc:
            raise ApiError(f"CAO {what} failed: {exc.__class__.__name__}: {exc}", retryable=True) from None
        if response.status_code == 401:
            hint = ("rejected the token in CAO_AUTH_LOCAL_TOKEN: set it to the server's token" if self.token
                    else "requires a token: set CAO_AUTH_LOCAL_TOKEN to the server's token")
            raise ApiError(f"CAO server at {self.base_url} {hint} (HTTP 401, {what})", 401)
        if response.status_code >= 400:
            raise ApiError(f"CAO {what} failed: HTTP {response.status_code}: {_error_detail(response)}",
                           response.status_code, retryable=response.status_code >= 500)
        try:
            return response.json()
        except ValueError:
            raise ApiError(f"the server at {self.base_url} is not a CAO server ({what} answered HTTP "
                           f"{response.status_code} with {_what_answered(response)} instead of JSON): set API "
                           f"to the address cao-server listens on") from None

    def _create(self, what: str, path: str, profile: str, provider: str | None, more: dict[str, str | None]) -> dict:
        """POST for a new terminal running `profile` (the values of `more` left empty are not sent); its id and
        session_name, checked."""
        params = {"provider": provider or PROVIDER, "agent_profile": profile, "working_directory": WD}
        params.update((key, value) for key, value in more.items() if value)
        answer = self._call(what, "POST", path, params, idempotent=bool(more.get("idempotency_key")))
        return self._holding(what, answer, "a terminal id and session name", id=str, session_name=str)

    @staticmethod
    def _holding(what: str, answer: object, missing: str, **kinds: type) -> dict:
        """CAO's answer, checked to be an object holding each key of `kinds` with a value of its type; else the
        ApiError saying what CAO answered without."""
        if not isinstance(answer, dict) or not all(isinstance(answer.get(key), kind) for key, kind in kinds.items()):
            raise ApiError(f"CAO {what} answered without {missing}: {answer!r:.200}")
        return answer

    def create_session(self, profile: str, provider: str | None = None, session_name: str | None = None,
                       model: str = "", idempotency_key: str = "") -> dict:
        """A new CAO session whose first terminal runs `profile`: its id and session_name (read it: CAO may put
        `cao-` in front of the name asked for)."""
        return self._create("create session", "/sessions", profile, provider,
                            {"session_name": session_name, "model": model, "idempotency_key": idempotency_key})

    def create_terminal(self, session_name: str, profile: str, provider: str | None = None, model: str = "",
                        idempotency_key: str = "") -> dict:
        """Another terminal in an existing session; returns its id and session_name (idempotency_key: as above)."""
        return self._create(f"create terminal ({profile})", f"/sessions/{quote(session_name, safe='')}/terminals",
                            profile, provider, {"model": model, "idempotency_key": idempotency_key})

    def send_input(self, terminal_id: str, message: str) -> None:
        self._call(f"send input to terminal {terminal_id}", "POST",
                   f"/terminals/{quote(terminal_id, safe='')}/input", {"message": message})

    def send_key(self, terminal_id: str, key: str) -> None:
        """One key press (a digit, Enter, ...), for a menu that a pasted line would not answer."""
        self._call(f"send key {key!r} to terminal {terminal_id}", "POST",
                   f"/terminals/{quote(terminal_id, safe='')}/key", {"key": key})

    def get_status(self, terminal_id: str) -> str:
        """The terminal's status word: idle, processing, completed, waiting_user_answer or error."""
        what = f"status of terminal {terminal_id}"
        answer = self._call(what, "GET", f"/terminals/{quote(terminal_id, safe='')}")
        return self._holding(what, answer, "a status", status=str)["status"]

    def get_last_output(self, terminal_id: str, retry: bool = True) -> str:
        """The agent's last reply as CAO reads it off the terminal screen."""
        return self._output(terminal_id, "last", retry)

    def get_screen(self, terminal_id: str) -> str:
        """Everything the terminal printed lately (CAO's `full` output); never retried."""
        return self._output(terminal_id, "full", retry=False)

    def _output(self, terminal_id: str, mode: str, retry: bool) -> str:
        what = f"{mode} output of terminal {terminal_id}"
        answer = self._call(what, "GET", f"/terminals/{quote(terminal_id, safe='')}/output", {"mode": mode},
                            retry=retry)
        return self._holding(what, answer, "an output", output=str)["output"]

    def provider_report(self) -> dict[str, tuple[str, bool]] | None:
        """Name -> (the CLI's program, installed?); None when the server cannot tell (never an error, but a
        401 is raised: it would refuse the run too). A provider left out is not known missing (`mock_cli`)."""
        try:
            answer = self._call("list providers", "GET", "/agents/providers", retry=False)
        except ApiError as exc:
            if exc.status_code == 401:
                raise
            return None
        if not isinstance(answer, list):
            return None
        return {entry["name"]: (str(entry.get("binary") or entry["name"]), entry.get("installed") is not False)
                for entry in answer if isinstance(entry, dict) and isinstance(entry.get("name"), str)}

    def session_terminals(self, session: str) -> list[str] | None:
        """The terminal ids the session lists, or None when it is gone: unlike GET /terminals/{id}, answered from
        CAO's database, the session is looked up in tmux."""
        what = f"session {session}"
        try:
            answer = self._call(what, "GET", f"/sessions/{quote(session, safe='')}")
        except ApiError as exc:
            if exc.status_code == 404 and "Session '" in str(exc):   # CAO's answer, not a missing route
                return None
            raise
        record = answer.get("session") if isinstance(answer, dict) else None
        if isinstance(record, dict) and record.get("status") == "terminated":
            return None                 # CAO's stand-in for a gone session whose agents failed to start
        terminals = self._holding(what, answer, "its terminals", terminals=list)["terminals"]
        return [entry["id"] for entry in terminals if isinstance(entry, dict) and isinstance(entry.get("id"), str)]

    def session_profiles(self, session: str) -> dict[str, str]:
        """Terminal id -> agent profile of each terminal the session lists, those still starting too (CAO records a
        terminal before its CLI starts); {} where it cannot say. A look: never retried."""
        with suppress(ApiError):
            answer = self._call(f"session {session}", "GET", f"/sessions/{quote(session, safe='')}", retry=False)
            terminals = answer.get("terminals") if isinstance(answer, dict) else None
            return {entry["id"]: str(entry.get("agent_profile") or "") for entry in terminals or ()
                    if isinstance(entry, dict) and isinstance(entry.get("id"), str)}
        return {}

    def delete_terminal(self, terminal_id: str) -> None:
        """Remove a terminal (its tmux window, whatever runs there); one that is gone already is fine."""
        self._delete(f"terminal {terminal_id}", f"/terminals/{quote(terminal_id, safe='')}")

    def delete_session(self, session: str) -> None:
        """Remove a CAO session (its tmux session and its record); one that is gone already is fine."""
        self._delete(f"session {session}", f"/sessions/{quote(session, safe='')}")

    def _delete(self, what: str, path: str) -> None:
        try:
            self._call(f"delete {what}", "DELETE", path)
        except ApiError as exc:
            if exc.status_code != 404:
                raise

    def exit_terminal(self, terminal_id: str) -> None:
        self._call(f"exit terminal {terminal_id}", "POST", f"/terminals/{quote(terminal_id, safe='')}/exit")

    def check_health(self) -> None:
        """Raise ApiError unless a healthy CAO server answers at the address."""
        health = self._call("health check", "GET", "/health", retry=False)
        if not isinstance(health, dict) or health.get("status") != "ok":
            raise ApiError(f"the server at {self.base_url} is not a healthy CAO server (GET /health answered "
                           f"{health!r:.120}): set API to the address cao-server listens on")

    def profile_installed(self, name: str) -> bool | None:
        """Whether the server has the agent profile `name` (None: it cannot tell)."""
        try:
            self._call(f"look up agent profile {name}", "GET", f"/agents/profiles/{quote(name, safe='')}",
                       retry=False)
        except ApiError as exc:
            return False if exc.status_code == 404 else None
        return True

    def close(self) -> None:
        with self._client_lock:
            if self._client is not None:
                self._client.close()


api = ApiClient(API, CAO_AUTH_LOCAL_TOKEN)


def connect_api() -> None:
    """Point `api` at API with the current token if either changed since the client was made."""
    global api
    if isinstance(api, ApiClient) and (api.base_url != API.rstrip("/") or api.token != CAO_AUTH_LOCAL_TOKEN):
        api.close()
        api = ApiClient(API, CAO_AUTH_LOCAL_TOKEN)


# -- The server's own process, when it runs on this machine ---------------------
# Found through /proc (Linux): the process listening on API's port. Its tmux socket (TMUX_TMPDIR, else /tmp)
# is where the agents run, so the printed hints name it.
CAO_PROVEN_VERSION = "2.5.4"      # the cao-server version the loop is proven with (docs/agent-clis.md)


def installed_cao_version(program: str) -> str:
    """The cli-agent-orchestrator version a cao-server program belongs to ('' if it cannot be told)."""
    prefix = Path(program).resolve().parent.parent
    return next((info.name[len("cli_agent_orchestrator-"):-len(".dist-info")]
                 for info in prefix.glob("lib/python*/site-packages/cli_agent_orchestrator-*.dist-info")), "")


@dataclass(frozen=True)
class LocalServer:
    """cao-server, running here: its process, its user and its environment."""

    pid: int
    uid: int
    env: dict[str, str]

    def cao_version(self) -> str:
        """The version of cli-agent-orchestrator it runs ('' if unknown): its API names none."""
        try:
            args = Path(f"/proc/{self.pid}/cmdline").read_bytes().decode("utf-8", "replace").split("\0")
        except OSError:
            return ""
        return next((installed_cao_version(arg) for arg in args if Path(arg).name == "cao-server"), "")

    @property
    def tmux_socket(self) -> str:
        """The socket of the tmux server its agents run in."""
        if self.env.get("TMUX"):
            return self.env["TMUX"].split(",")[0]
        return os.path.join(self.env.get("TMUX_TMPDIR") or "/tmp", f"tmux-{self.uid}", "default")


def _listening_sockets(port: int) -> set[str]:
    """The inodes of the sockets that listen on `port` ('0A' is LISTEN in /proc/net/tcp)."""
    lines: list[str] = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with suppress(OSError):
            lines += Path(table).read_text(encoding="ascii").splitlines()[1:]
    rows = [line.split() for line in lines]
    return {f"socket:[{row[9]}]" for row in rows
            if len(row) > 9 and row[3] == "0A" and int(row[1].rsplit(":", 1)[1], 16) == port}


def _process_of(sockets: set[str]) -> int | None:
    """The process that holds one of the sockets (only processes this user may look into)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with suppress(OSError):
            if any(os.readlink(fd) in sockets for fd in (proc / "fd").iterdir()):
                return int(proc.name)
    return None


def local_server() -> LocalServer | None:
    """cao-server behind API when it runs on this machine and this user may read its /proc; else None."""
    address = urlparse(API)
    if address.hostname not in LOCAL_HOSTS:
        return None
    sockets = _listening_sockets(address.port or (443 if address.scheme == "https" else 80))
    pid = _process_of(sockets) if sockets else None
    if pid is None:
        return None
    with suppress(OSError):
        uid = Path(f"/proc/{pid}").stat().st_uid
        env = process_env(pid)
        return LocalServer(pid, uid, env) if env else None
    return None


def agents_tmux_socket() -> str:
    """The socket of the agents' tmux server ('' when cao-server runs elsewhere or cannot be looked into):
    cao-server's, else this shell's when it runs here (the README starts both from one shell)."""
    server = local_server()
    if server is not None:
        return server.tmux_socket
    if urlparse(API).hostname in LOCAL_HOSTS and os.environ.get("TMUX_TMPDIR"):
        return os.path.join(os.environ["TMUX_TMPDIR"], f"tmux-{os.getuid()}", "default")
    return ""


def tmux_hint(command: str) -> str:
    """A tmux command for the user, naming the agents' server: from any shell it reaches them, not the user's."""
    socket_path = agents_tmux_socket()
    return f"tmux -S {shlex.quote(socket_path)} {command}" if socket_path else f"tmux {command}"


def cao_hint(command: str) -> str:
    """A `cao` command for the user, naming the server at API through CAO_API_HOST and CAO_API_PORT."""
    address = urlparse(API)
    host, port = address.hostname or "127.0.0.1", address.port or (443 if address.scheme == "https" else 80)
    where = ([f"CAO_API_HOST={host}"] if host not in LOCAL_HOSTS else []) + \
        ([f"CAO_API_PORT={port}"] if port != 9889 else [])
    return " ".join([*where, "cao", command])


# -- Notes beside the state file ---------------------------------------------------
# A run keeps two notes beside its state file: its own server's (while it runs) and its start-up's. Each is
# written whole or not at all, read back checked, and removed when what it notes is over.

def write_whole(path: Path, text: str) -> None:
    """Write a file through a temporary file, fsync and a rename: a crash leaves the old file or the new."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(temporary, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_note(path: Path, facts: dict) -> None:
    """Write a note as JSON, whole or not at all."""
    write_whole(path, json.dumps(facts))


def read_note(path: Path, read: Callable[[dict], object]):
    """What `read` makes of the note's JSON object (None: no note); a ValueError says why it cannot be read."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(raw, dict):
            raise TypeError("not a JSON object")
        return read(raw)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise ValueError(f"{path} cannot be read ({exc})") from None


# -- The run's own CAO server ----------------------------------------------------
# A private tmux server and cao-server, ended with the run; noted beside the state file so that the next
# invocation ends what a killed run left behind (docs/agent-clis.md). Every process it starts carries two marks
# in its environment: its tmux folder (OWN_SERVER_MARK) and the run's state file (OWN_SERVER_RUN), so what is
# left is found without the note too. tmux is always named by its socket (-S): with its folder gone, tmux
# would fall back to the user's own server.
OWN_SERVER_HOST = "127.0.0.1"
OWN_SERVER_START_SECONDS = 60.0          # cao-server imports a lot: seconds, more on a loaded machine
OWN_SERVER_MARK = "CAO_LOOP_OWN_SERVER"  # in the environment of all it starts: how what is left is found
OWN_SERVER_RUN = "CAO_LOOP_STATE_FILE"   # likewise: the state file of the run it serves
OWN_SERVER_GRACE_SECONDS = 3.0           # from SIGTERM to SIGKILL for what the own server started
OWN_SESSION_REMOVE_SECONDS = 30.0        # CAO's removal of a session: its agents ended, their screens logged


def process_started_at(pid: int) -> int | None:
    """A process's start time (clock ticks since boot), None when it is gone or a zombie (Linux /proc)."""
    with suppress(OSError, IndexError, ValueError):
        fields = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace").rsplit(")", 1)[1].split()
        return None if fields[0] == "Z" else int(fields[19])
    return None


def process_env(pid: int) -> dict[str, str]:
    """A process's environment as /proc shows it ({} where this user may not look)."""
    with suppress(OSError):
        raw = Path(f"/proc/{pid}/environ").read_bytes()
        return dict(item.decode("utf-8", "replace").split("=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {}


def marked_processes(mark: str, name: str = OWN_SERVER_MARK) -> list[int]:
    """This user's processes that carry name=mark in their environment: all an own server started."""
    pids = [int(proc.name) for proc in Path("/proc").iterdir() if proc.name.isdigit() and int(proc.name) != os.getpid()]
    return [pid for pid in pids if process_env(pid).get(name) == mark]


def end_processes(pids: Iterable[int], group: bool = False) -> None:
    """SIGTERM (to each one's process group with `group`), then SIGKILL what is still there after the grace."""
    pids = list(pids)
    for pid in pids:
        with suppress(OSError):
            os.killpg(pid, signal.SIGTERM) if group else os.kill(pid, signal.SIGTERM)
    give_up = time.monotonic() + OWN_SERVER_GRACE_SECONDS
    while any(process_started_at(pid) is not None for pid in pids) and time.monotonic() < give_up:
        time.sleep(0.05)
    for pid in pids:
        if process_started_at(pid) is not None:
            with suppress(OSError):
                os.killpg(pid, signal.SIGKILL) if group else os.kill(pid, signal.SIGKILL)


def remove_own_sessions(url: str, sessions: list[str]) -> list[str]:
    """Remove the run's CAO sessions through the server at `url`: CAO ends their agents and takes their FIFOs,
    locks and database rows out of its store in HOME, which an ended server would leave. Those it could not remove,
    and those not asked for once a stop signal is held (each removal may take OWN_SESSION_REMOVE_SECONDS)."""
    headers = {"Authorization": f"Bearer {CAO_AUTH_LOCAL_TOKEN}"} if CAO_AUTH_LOCAL_TOKEN else {}
    left = []
    with httpx.Client(base_url=url, headers=headers, timeout=OWN_SESSION_REMOVE_SECONDS) as client:
        for name in sessions:
            try:
                removed = not stop_held() and client.delete(f"/sessions/{quote(name, safe='')}").status_code in (200, 404)
            except httpx.HTTPError:
                removed = False
            if not removed:
                left.append(name)
    return left


@dataclass
class StageAlive:
    """What of a run's own server still runs, as /proc tells it (a pid with another start time is another's)."""

    cao_server: int | None
    tmux: int | None
    agents: int                          # the tmux server's panes: one for each agent
    processes: list[int]                 # every process the own server started, those two included

    def text(self) -> str:
        """'cao-server pid 12, tmux pid 34, 5 agents (22 processes in all)'."""
        parts = [f"{name} pid {pid}" for name, pid in (("cao-server", self.cao_server), ("tmux", self.tmux)) if pid]
        parts += [counted(self.agents, "agent")] if self.tmux else []
        every = f"{len(self.processes)} process{'es' if len(self.processes) != 1 else ''}"
        return f"{', '.join(parts)} ({every} in all)" if parts else f"{every} it started"

    def end_command(self) -> str:
        """A command that ends them without the run: cao-server's process group and the tmux server (whose
        panes end with it), or the processes left when both are gone."""
        leaders = [f"-{self.cao_server}"] * bool(self.cao_server) + [str(self.tmux)] * bool(self.tmux)
        return "kill -- " + " ".join(leaders) if leaders else "kill " + " ".join(map(str, self.processes))


@dataclass
class OwnServer:
    """The run's own cao-server and tmux server, as noted; each process a pid with its start time (a pid is given
    out again)."""

    port: int
    tmux_dir: str
    log_file: str
    processes: dict[str, list[int]] = field(default_factory=dict)    # 'cao-server' / 'tmux' -> [pid, start]
    sessions: list[str] = field(default_factory=list)   # its CAO sessions, each noted before it was asked for

    @property
    def url(self) -> str:
        return f"http://{OWN_SERVER_HOST}:{self.port}"

    @property
    def tmux_socket(self) -> str:
        return os.path.join(self.tmux_dir, f"tmux-{os.getuid()}", "default")

    @classmethod
    def from_note(cls, raw: dict) -> OwnServer:
        return cls(int(raw["port"]), str(raw["tmux_dir"]), str(raw["log_file"]),
                   {str(k): [int(v[0]), int(v[1])] for k, v in raw["processes"].items()},
                   [str(name) for name in raw.get("sessions", [])])

    @classmethod
    def found(cls) -> OwnServer | None:
        """The run's own server as its marks tell it, where no note does: its processes, their tmux folder and port."""
        found, names = None, {"cao-server": "cao-server", "tmux: server": "tmux"}
        for pid in marked_processes(str(Path(STATE_FILE).resolve()), OWN_SERVER_RUN):
            env = process_env(pid)
            found = found or (cls(int(env.get("CAO_API_PORT") or 0), env[OWN_SERVER_MARK], "")
                              if env.get(OWN_SERVER_MARK) else None)
            with suppress(OSError):
                name = names.get(Path(f"/proc/{pid}/comm").read_text(encoding="utf-8").strip())
                if found and name:
                    found.processes[name] = [pid, process_started_at(pid) or 0]
        return found

    def env(self) -> dict[str, str]:
        """The own server's environment: the loop's, its Python's folder on PATH (after the user's own), a private
        tmux folder, CAO's address, its marks, and what each CLI in use needs (its row's traps' `env_value`)."""
        env = {key: value for key, value in os.environ.items() if key not in ("TMUX", "TMUX_PANE")}
        path = [*env.get("PATH", os.defpath).split(os.pathsep), str(Path(sys.executable).parent)]
        env.update(PATH=os.pathsep.join(dict.fromkeys(part for part in path if part)), TMUX_TMPDIR=self.tmux_dir,
                   CAO_API_HOST=OWN_SERVER_HOST, CAO_API_PORT=str(self.port),
                   **{OWN_SERVER_MARK: self.tmux_dir, OWN_SERVER_RUN: str(Path(STATE_FILE).resolve())})
        env.update(own_server_needs())
        return env

    def tmux(self, *args: str) -> subprocess.CompletedProcess:
        """A tmux command to the own tmux server, named by its socket."""
        return subprocess.run(["tmux", "-S", self.tmux_socket, *args], env=self.env(), capture_output=True,
                              text=True, timeout=30)

    def start_tmux(self) -> None:
        """The agents' tmux server, before cao-server: shells without a login profile (it could reset PATH)."""
        shell = "exec bash --noprofile --norc +o history" if shutil.which("bash") else "exec sh"   # no ~/.bash_history
        os.makedirs(os.path.dirname(self.tmux_socket), mode=0o700, exist_ok=True)
        started = self.tmux("-f", os.devnull, "start-server", ";", "set-option", "-g", "exit-empty", "off", ";",
                            "set-option", "-g", "default-command", shell)
        pid = self.tmux("display-message", "-p", "#{pid}").stdout.strip()
        if started.returncode != 0 or not pid.isdigit():
            raise RunError(f"could not start the run's own tmux server: {' '.join(started.stderr.split())[:200]}")
        self.processes["tmux"] = [int(pid), process_started_at(int(pid)) or 0]

    def launch(self, noted: Callable[[], None]) -> bool:
        """cao-server on self.port (noted once started), waited for; False when it ended first (its port taken
        since it was found free). What answers there must be it: a server of another process gets no agent."""
        with open(self.log_file, "ab") as output:
            process = subprocess.Popen([loop_program("cao-server"), "--host", OWN_SERVER_HOST, "--port", str(self.port)],
                                       env=self.env(), cwd=self.tmux_dir, stdin=subprocess.DEVNULL,
                                       stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        self.processes["cao-server"] = [process.pid, process_started_at(process.pid) or 0]
        noted()
        give_up = time.monotonic() + OWN_SERVER_START_SECONDS
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < give_up and process.poll() is None:
                with suppress(httpx.HTTPError):
                    if client.get(f"{self.url}/health").status_code == 200:
                        if _process_of(_listening_sockets(self.port)) in (None, process.pid):
                            return True
                        break
                time.sleep(0.1)
        if process.poll() is None and time.monotonic() >= give_up:
            raise RunError(f"the run's own cao-server did not answer on {self.url} within "
                           f"{OWN_SERVER_START_SECONDS:g} s; its log: {self.log_file}")
        end_processes([process.pid], group=True)
        process.wait()
        return False

    def install_profiles(self) -> None:
        """The run's agent profiles, installed in CAO's store where it lacks them (also where the CLI keeps a
        copy of its own that is missing), from the profiles that come with the loop; all at once."""
        missing = [(profile, provider) for profile, provider in profiles_in_use()
                   if api.profile_installed(profile) is not True
                   or (agent_cli(provider).profile_file
                       and not Path.home().joinpath(agent_cli(provider).profile_file.format(name=profile)).is_file())]
        sources = {profile: bundled_profile(profile) for profile, _ in missing}
        for profile, provider in missing:
            if sources[profile] is None:
                raise ConfigError(f"agent profile {profile} is not installed in CAO and does not come with the loop: "
                                  f"`cao install` it for {provider}, or use the loop's "
                                  f"({', '.join(DEFAULT_PROFILES.values())})")
        with ThreadPoolExecutor(max_workers=len(ROLES)) as pool:
            said = list(pool.map(lambda item: subprocess.run(
                [loop_program("cao"), "install", str(sources[item[0]]), "--provider", item[1]], env=self.env(),
                capture_output=True, text=True, timeout=120), missing))
        for (profile, provider), done in zip(missing, said):
            if api.profile_installed(profile) is not True:
                raise RunError(f"`cao install {sources[profile]} --provider {provider}` did not install it: "
                               + " ".join((done.stdout + done.stderr).split())[-300:])
        if missing:
            log("agent profiles installed in CAO's store: " + ", ".join(f"{profile} ({provider})"
                                                                     for profile, provider in missing))

    def started(self) -> dict[str, int]:
        """Its noted processes that still run: name -> pid."""
        return {name: pid for name, (pid, at) in self.processes.items() if process_started_at(pid) == at}

    def alive(self) -> StageAlive | None:
        """What of it still runs (None: nothing, it ended)."""
        started = self.started()
        processes = sorted(set(marked_processes(self.tmux_dir)) | set(started.values()))
        if not processes:
            return None
        tmux = started.get("tmux")
        return StageAlive(started.get("cao-server"), tmux, self.panes() if tmux else 0, processes)

    def panes(self) -> int:
        """How many panes its tmux server holds: one for each agent (0 when it does not answer)."""
        with suppress(OSError, subprocess.SubprocessError):
            listed = self.tmux("list-panes", "-a", "-F", "#{pane_pid}")
            return len(listed.stdout.split()) if listed.returncode == 0 else 0
        return 0

    def end(self) -> list[str]:
        """Its CAO sessions removed through its cao-server while it lives, then cao-server (it could start a tmux
        server again), the tmux server with the agents, and whatever they started that outlived them; the tmux
        folder goes last. The sessions left in CAO's store (their server was gone, or did not remove them)."""
        started = self.started()
        left = remove_own_sessions(self.url, self.sessions) if "cao-server" in started else list(self.sessions)
        if "cao-server" in started:
            end_processes([started["cao-server"]], group=True)
        if os.path.exists(self.tmux_socket):   # only by its socket: tmux never reaches the user's own server
            with suppress(OSError, subprocess.SubprocessError):
                self.tmux("kill-server")
        if "tmux" in started:
            end_processes([started["tmux"]])
        end_processes(marked_processes(self.tmux_dir))
        shutil.rmtree(self.tmux_dir, ignore_errors=True)
        return left


class OwnStage:
    """The run's own server, the one home of it: started and noted by the run, ended with it (`end`), ended by
    the next invocation where a killed run left it (`end_left`), and seen by --status (`seen`)."""

    def __init__(self) -> None:
        self.server: OwnServer | None = None     # while this invocation's own server runs
        self.sessions_left: list[str] = []       # sessions of a killed run whose server died with it

    @property
    def note(self) -> Path:
        """Where the run's own server is noted while it runs: beside the state file."""
        return Path(STATE_FILE).with_suffix(".own-server.json")

    def write_note(self) -> None:
        write_note(self.note, vars(self.server))    # port, tmux_dir, log_file, processes, sessions

    def note_session(self, name: str) -> None:
        """A CAO session about to be asked of the run's own server, noted first: however the run ends, it is
        removed through CAO (remove_own_sessions), not left in CAO's store."""
        if self.server is not None and name not in self.server.sessions:
            self.server.sessions.append(name)
            self.write_note()

    def seen(self) -> tuple[OwnServer | None, StageAlive | None]:
        """The own server the note names (else the one the run's marks find, where the note cannot be read), and
        what of it still runs."""
        try:
            own = read_note(self.note, OwnServer.from_note)
        except ValueError:
            own = OwnServer.found()
        return own, own.alive() if own is not None else None

    def start(self) -> None:
        """Stand the run's own tmux server and cao-server up (see above); from now on API is theirs."""
        global API
        if missing := own_server_missing():
            raise ConfigError(missing)
        own = self.server = OwnServer(free_port(), own_tmux_folder(), str(Path(STATE_FILE).with_name("cao-server.log")))
        self.write_note()
        own.start_tmux()
        for attempt in range(3):
            if attempt:                      # another process took the port between the look and the start
                own.port = free_port()
                own.tmux("set-environment", "-g", "CAO_API_PORT", str(own.port))
            if own.launch(self.write_note):
                break
            if OWN_SERVER_PORT:
                raise ConfigError(f"OWN_SERVER_PORT={OWN_SERVER_PORT}: another process answers there; choose "
                                  "another port, or 0 for a free one")
        else:
            raise RunError(f"the run's own cao-server could not start; its log: {own.log_file}")
        self.write_note()
        API = own.url
        explicit_settings.add("API")         # the state's server of an earlier invocation is gone
        connect_api()
        log(f"CAO server: the run's own, {own.url} (cao-server's log: {own.log_file}); its agents run in "
            f"a tmux server of their own ({own.tmux_socket}); both end with the run")
        if own_server_overrides():
            log(own_server_overrides())
        own.install_profiles()
        self.remove_sessions_left(own.url)

    def end(self) -> None:
        """End the run's own server, its tmux server and all they started: nothing of the run is left running."""
        if self.server is not None:
            self.sessions_left.extend(self.server.end())
            self.note.unlink(missing_ok=True)
            self.server = None
        self.remove_sessions_left("")          # what no server removed is said

    def end_left(self) -> None:
        """End the own server a run killed with SIGKILL left running (under the run's lock: never a live run's);
        where its note cannot be read, what the run's marks find."""
        try:
            left = read_note(self.note, OwnServer.from_note)
        except ValueError as exc:
            left = OwnServer.found()
            log(f"note: {exc}; " + (f"ending what the run's marks find of its own server ({left.tmux_dir})" if left
                                    else "nothing of the run's own server runs") + "; the note is removed")
        if left is not None:
            alive = [f"{name} pid {pid}" for name, pid in left.started().items()]
            log("ending what the last invocation's own CAO server left running (" + (", ".join(alive) or "nothing")
                + f", its tmux server {left.tmux_socket}): that invocation was killed before it could end it")
            self.sessions_left.extend(left.end())
        self.note.unlink(missing_ok=True)

    def remove_sessions_left(self, url: str) -> None:
        """The sessions a killed run's server left in CAO's store when it died with the run (a reboot, a killed
        process group), removed through the run's new server on the same HOME; said where they stay."""
        if not self.sessions_left:
            return
        left = remove_own_sessions(url, self.sessions_left) if url else list(self.sessions_left)
        if removed := [name for name in self.sessions_left if name not in left]:
            log(f"removed from CAO's store what the killed run's sessions left there: {', '.join(removed)}")
        if left:
            log(f"CAO sessions {', '.join(left)} of the killed run are still in CAO's store "
                f"({Path.home() / '.aws' / 'cli-agent-orchestrator'}: their database rows and FIFOs); `cao shutdown "
                "--session <name>` removes them where a cao-server runs on this HOME")
        self.sessions_left.clear()


own_stage = OwnStage()


def loop_program(name: str) -> str:
    """A program installed with the loop (cao-server, cao), beside its Python first, else on PATH ('' if none)."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else shutil.which(name) or ""


def own_server_needs() -> dict[str, str]:
    """The variables the CLIs in use need, at the values their rows' traps declare (`env_value`): set for the
    own server's agents whatever this environment holds (a CLI takes only its value: IS_SANDBOX=1, not yes)."""
    return {trap.env: trap.env_value for provider in providers_in_use() for trap in agent_cli(provider).traps
            if trap.env_value and (not trap.root_only or os.geteuid() == 0)}


def own_server_overrides() -> str:
    """What the own server sets in place of another value of this environment, said in one line ('': nothing)."""
    replaced = [f"{name}={value} in place of {name}={os.environ[name]}" for name, value in own_server_needs().items()
                if os.environ.get(name) not in (None, value)]
    return ("the agents get " + ", ".join(replaced) + " from this environment: the CLIs take only those values"
            if replaced else "")


def tmux_missing() -> str:
    """The line that says tmux is missing and how to get it ('' when it is there): CAO runs the agents in it."""
    return "" if shutil.which("tmux") else ("tmux is not installed: CAO runs the agents in tmux (Debian/Ubuntu: "
                                            "apt-get install tmux)")


def own_server_missing() -> str:
    """What the own server needs and this machine lacks, as the line that says how to get it ('': nothing)."""
    if missing := tmux_missing():
        return missing
    if not loop_program("cao-server") or not loop_program("cao"):
        return (f"cao-server is not installed here: pip install '{PACKAGE_NAME}[cao]' (CAO {CAO_PROVEN_VERSION}), or "
                "point API at a CAO server you run")
    return ""


def port_holder(port: int) -> str:
    """'pid 1234 (cao-server --port 9890)': the process listening on a port of this machine ('' if none)."""
    pid = _process_of(_listening_sockets(port))
    if pid is None:
        return ""
    with suppress(OSError):
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        return f"pid {pid} ({command[:80]})"
    return f"pid {pid}"


def free_port() -> int:
    """OWN_SERVER_PORT if no process holds it (else a ConfigError), or a port the system gives as free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((OWN_SERVER_HOST, OWN_SERVER_PORT))
        except OSError:
            holder = port_holder(OWN_SERVER_PORT)
            raise ConfigError(f"OWN_SERVER_PORT={OWN_SERVER_PORT}: that port of {OWN_SERVER_HOST} is taken"
                              + (f" by {holder}" if holder else "") + "; choose another, or 0 for a free one") from None
        return probe.getsockname()[1]


def own_tmux_folder() -> str:
    """A new folder for the own tmux server's socket: under TMPDIR, or /tmp where that would make the socket's
    path longer than a socket's path may be (about 100 bytes)."""
    parents = (tempfile.gettempdir(), "/tmp")
    parent = next((p for p in parents if len(os.path.join(p, "cao-loop-12345678", "tmux-4294967295", "default")) < 100),
                  parents[-1])
    return tempfile.mkdtemp(prefix="cao-loop-", dir=parent)


def bundled_profile(name: str) -> Path | None:
    """A profile that comes with the loop: beside the script in a checkout, else where pip put them."""
    places = (Path(__file__).resolve().parent / "profiles", Path(sys.prefix) / "share" / PACKAGE_NAME / "profiles")
    return next((folder / f"{name}.md" for folder in places if (folder / f"{name}.md").is_file()), None)


def server_answers(url: str) -> bool:
    """Whether anything answers HTTP at `url` (a CAO server: the loop then uses it as the user's)."""
    with suppress(httpx.HTTPError):
        httpx.get(url.rstrip("/") + "/health", timeout=3.0)
        return True
    return False


# ==========================================================================
# 3. Run state: the state file and its lock
# ==========================================================================

def utc_iso(timestamp: float | None = None, precise: bool = False) -> str:
    """'2026-11-24T15:04:05Z' (precise: '2026-11-24T15:04:05.123Z'): how the state file and the run
    summary write a time; turns are timed to the millisecond, so short ones still show on the timeline."""
    moment = datetime.fromtimestamp(time.time() if timestamp is None else timestamp, timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S") + (f".{moment.microsecond // 1000:03d}" if precise else "") + "Z"


def parse_utc_iso(text: str) -> datetime | None:
    """A time as utc_iso() writes it, read back (None for anything else): the one reader of those times."""
    with suppress(ValueError, AttributeError):
        return datetime.fromisoformat(text.replace("Z", "+00:00"))
    return None

# What a run remembers is declared once, in STATE_FIELDS; each field is a module global (the specs fix several
# names), changed only by update_run() and the doors beside it.

PHASE_ANALYST = "analyst"
PHASE_PROGRAMMER = "programmer"
PHASE_TESTER = "tester"
PHASE_DONE = "done"
PHASES = (PHASE_ANALYST, PHASE_PROGRAMMER, PHASE_TESTER, PHASE_DONE)
PHASE_STEPS = ("author", "review", "verify", "approval")  # whose turn is next in a phase; "verify": the loop's own
# check of a PASS; "approval": a person's decision at an APPROVE gate (the programmer phase: the plan; tester: commit)
PHASE_ROLES = {PHASE_ANALYST: ("analyst", "peer_analyst"), PHASE_PROGRAMMER: ("programmer", "peer_programmer")}
PHASE_OUTPUTS = {PHASE_ANALYST: ("analyst", "analyst_review"), PHASE_PROGRAMMER: ("programmer", "programmer_review")}
NEXT_PHASE = {PHASE_ANALYST: PHASE_PROGRAMMER, PHASE_PROGRAMMER: PHASE_TESTER}
STATE_VERSION = 1


class StateFileError(Exception):
    """The state file exists but cannot be used."""


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


def _whole(value: object) -> int | None:
    """An int from a state value written by either script (the shell script writes some as text)."""
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _positive_int(value: object) -> int:
    number = _whole(value)
    return number if number is not None and number >= 1 else 1


def _number(value: object) -> float | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _strings(value: object) -> list[str]:
    return [item for item in value if isinstance(item, str)] if isinstance(value, list) else []


# -- the nested records: validated once, when a state file is read -------------

class PlainRecord:
    """A state-file record saved as its fields (record_json()) and read back leniently, each by its annotation
    (record_from_json()); not at all unless the saved entry is an object holding the field `required` as text."""

    required: ClassVar[str] = ""

    def to_json(self) -> dict:
        return record_json(self)

    @classmethod
    def from_json(cls, raw: object):
        if not isinstance(raw, dict) or (cls.required and not isinstance(raw.get(cls.required), str)):
            return None
        return record_from_json(cls, raw)


def record_field(default: object = MISSING, read: Callable[[object], object] | None = None,
                 saved_if: Callable[[Any], object] | None = None) -> Any:
    """A record's field read by `read` rather than by its annotation, or saved only when `saved_if(record)`."""
    return field(default=default, metadata={"read": read, "saved_if": saved_if})


@dataclass
class InFlight(PlainRecord):
    """The prompt sent and not yet answered: which turn it is, when it went, the once-only blocks it carried."""

    required: ClassVar[str] = "role"
    role: str
    round: int
    phase: str
    cycle: int
    # story mode: the story and attempt of a programmer turn
    story: str | None = record_field(None, saved_if=lambda r: r.story is not None)
    attempt: int | None = record_field(None, saved_if=lambda r: r.story is not None)
    sent_at: float | None = None      # time.time() of the (last) send
    sent_in_full: tuple[str, ...] = ()
    number: int | None = None         # NNN of its files in the run's folder: NNN-<role>.prompt.md, NNN-<role>.md
    first_sent_at: float | None = None  # time.time() of the first send
    prompt_bytes: int = 0
    reminders: int = 0
    resends: int = 0
    # the agent stopped at its usage limit: what its screen said ("" if not), and time.time() when it is told to
    # continue (None: no reset time given)
    limit_line: str = record_field("", saved_if=lambda r: r.limit_line)
    limit_until: float | None = record_field(None, saved_if=lambda r: r.limit_line)
    # answered: the reply's name in the run's folder, its outcome not saved yet
    reply_file: str = record_field("", saved_if=lambda r: r.reply_file)
    # at the first send, for a CLI that keeps running totals only
    tokens_before: RunningTotals | None = record_field(None, saved_if=lambda r: r.tokens_before is not None)
    # the terminal it was (last) sent to ("" in a state file from before)
    terminal: str = record_field("", saved_if=lambda r: r.terminal)

    def belongs_to(self, position: dict) -> bool:
        """Whether this is the prompt of the turn at `position` (see turn_position())."""
        return all(getattr(self, key, None) == value for key, value in position.items())


@dataclass
class Gate(PlainRecord):
    """An APPROVE gate the run reached: which, in what round, since when, and the person's decision once taken."""

    required: ClassVar[str] = "id"
    id: str                           # its decision's file in the run folder: decisions/<id>.json
    gate: str                         # "plan" or "commit"
    round: int
    since: str                        # utc_iso() of its reaching
    reply_topic: str = ""             # the ntfy topic its Approve and Reject buttons publish to
    announced: bool = False           # its ntfy message went out
    verdict: str = ""                 # "" while it waits; "approve" or "reject"
    by: str = ""                      # who decided: the user's name, or "ntfy"
    at: str = ""
    words: str = ""                   # a rejection's reason


@dataclass
class PersonNote(PlainRecord):
    """A person's note to a role (--note), carried once by the role's next prompt."""

    required: ClassVar[str] = "id"
    id: str                           # its file in the run folder: notes/<id>.json
    role: str
    text: str
    by: str = ""
    at: str = ""

    @property
    def carried(self) -> bool:
        """Whether a prompt that reached its terminal carried it (its mark among the once-only blocks sent)."""
        return any(mark.startswith(f"note-{self.id}:") for mark in context_sent)


@dataclass
class StoryResult(PlainRecord):
    """How one story of story mode ended."""

    required: ClassVar[str] = "id"
    id: str
    title: str
    status: str = record_field(read=lambda value: _text(value) or "FAILED")    # COMPLETE or FAILED
    attempts: int = record_field(read=_positive_int)
    reason: str = ""
    summary: str = ""


@dataclass
class StoryProgress(PlainRecord):
    """Story mode: the change, the stories still to do, the one under way and how the others went."""

    change: str
    queue: list[str]
    current: str                      # '' once every story in the queue is done
    attempt: int = record_field(1, read=_positive_int)
    last_failure: str = ""            # the reason the last attempt gave, for the retry prompt
    results: list[StoryResult] = field(default_factory=list)


@dataclass(frozen=True)
class TokenUse(PlainRecord):
    """Tokens in three numbers that never overlap, so any two add up: input (cache writes included), cached
    input, output (reasoning included). How each CLI's numbers map: docs/following-a-run.md."""

    input: int = 0
    cached_input: int = 0
    output: int = 0

    def __add__(self, other: TokenUse) -> TokenUse:
        if not isinstance(other, TokenUse):
            return NotImplemented
        return TokenUse(self.input + other.input, self.cached_input + other.cached_input, self.output + other.output)

    @property
    def total(self) -> int:
        """All three together: what MAX_RUN_TOKENS counts."""
        return self.input + self.cached_input + self.output

    @classmethod
    def from_json(cls, raw: object) -> TokenUse | None:
        """Unlike other records, all or nothing: a count missing or below zero makes the tokens unknown."""
        if not isinstance(raw, dict):
            return None
        numbers = [_whole(raw.get(f.name)) for f in fields(cls)]
        if any(number is None or number < 0 for number in numbers):
            return None
        return cls(*numbers)


def tokens_json(by_model: dict[str, TokenUse] | None) -> dict | None:
    """A turn's (or a role's, or the run's) tokens as the state file and summary.json keep them: the three
    sums, then each model's share (the price table is per model). None: unknown."""
    if by_model is None:
        return None
    return {**sum(by_model.values(), TokenUse()).to_json(),
            "by_model": {model: use.to_json() for model, use in sorted(by_model.items())}}


def tokens_from_json(raw: object) -> dict[str, TokenUse] | None:
    """tokens_json() read back; None for anything else (unknown)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("by_model"), dict):
        return None
    found = {model: TokenUse.from_json(use) for model, use in raw["by_model"].items() if isinstance(model, str)}
    return None if None in found.values() else found


# A CLI that keeps running totals only (its records' `totals_now`): a turn's tokens are the totals less those
# noted at its first send (InFlight.tokens_before).
RunningTotals = dict[str, dict[str, TokenUse]]     # session id -> model -> the session's running totals


def tokens_before_json(before: RunningTotals | None) -> dict | None:
    """The running totals noted at a turn's send, as the state file keeps them."""
    return None if before is None else {session: tokens_json(models) for session, models in before.items()}


def tokens_before_from_json(raw: object) -> RunningTotals | None:
    """tokens_before_json() read back; None for anything else (the turn's tokens are then unknown)."""
    if not isinstance(raw, dict):
        return None
    found = {session: tokens_from_json(models) for session, models in raw.items() if isinstance(session, str)}
    return None if None in found.values() else found


def records_reader(cls: type[PlainRecord]) -> Callable[[object], list]:
    """A reader of a saved list of `cls` records: those that can be read, in their order ([]: not a list)."""
    return lambda raw: [record for record in map(cls.from_json, raw) if record] if isinstance(raw, list) else []


def records_json(records: Iterable[PlainRecord]) -> list[dict]:
    """A list of records as the state file keeps it."""
    return [record.to_json() for record in records]


# How a record's field is read back, by its annotation: a value of the wrong type reads as the empty one, never an
# error; and how it is saved where that is not as it is.
RECORD_READERS: dict[str, Callable[[object], object]] = {
    "str": _text, "int": lambda value: _whole(value) or 0, "int | None": _whole, "float | None": _number,
    "bool": lambda value: value is True, "str | None": lambda value: value if isinstance(value, str) else None,
    "list[str]": _strings, "tuple[str, ...]": lambda value: tuple(_strings(value)),
    "list[str] | None": lambda value: _strings(value) if isinstance(value, list) else None,
    "dict | None": lambda value: value if isinstance(value, dict) else None,
    "list[StoryResult]": records_reader(StoryResult),
    "dict[str, TokenUse] | None": tokens_from_json, "RunningTotals | None": tokens_before_from_json}
RECORD_WRITERS: dict[str, Callable[[Any], object]] = {
    "list[str]": list, "tuple[str, ...]": list, "list[StoryResult]": records_json,
    "dict[str, TokenUse] | None": tokens_json, "RunningTotals | None": tokens_before_json}


def record_json(record: Any) -> dict:
    """A record as the state file keeps it: its fields in their order, each saved by its annotation, those whose
    `saved_if` does not hold left out."""
    return {f.name: RECORD_WRITERS.get(f.type, lambda value: value)(getattr(record, f.name)) for f in fields(record)
            if f.metadata.get("saved_if") is None or f.metadata["saved_if"](record)}


def record_from_json(cls: type, raw: dict) -> Any:
    """A record read back from its saved object, each field by its own reader or else by its annotation."""
    return cls(**{f.name: (f.metadata.get("read") or RECORD_READERS[f.type])(raw.get(f.name)) for f in fields(cls)})


def add_tokens(*parts: dict[str, TokenUse] | None) -> dict[str, TokenUse]:
    """Tokens by model summed over turns (the unknown ones left out: the caller says how many there were)."""
    total: dict[str, TokenUse] = {}
    for part in parts:
        for model, use in (part or {}).items():
            total[model] = total.get(model, TokenUse()) + use
    return total


# -- What it costs (MODEL_PRICES: per million tokens, per model) -----------------

def cost_of(tokens: dict[str, TokenUse] | None) -> float | None:
    """The estimated cost of tokens by model; None when a model has no price (or the tokens are unknown)."""
    if tokens is None or any(price_of(model) is None for model in tokens):
        return None
    total = 0.0
    for model, use in tokens.items():
        price = price_of(model)
        total += (use.input * price["input"] + use.cached_input * price.get("cached_input", price["input"])
                  + use.output * price["output"]) / 1_000_000
    return total


def tokens_text(tokens: dict[str, TokenUse] | None) -> str:
    """'12,345 in + 2,000 cached + 60 out (~0.0421)' for a log line or the report; 'unknown' when unknown."""
    if tokens is None:
        return "unknown"
    use = sum(tokens.values(), TokenUse())
    cost = cost_of(tokens) if MODEL_PRICES else None
    return (f"{use.input:,} in + {use.cached_input:,} cached + {use.output:,} out"
            + (f" (~{cost:.4f})" if cost is not None else ""))


@dataclass
class TurnRecord(PlainRecord):
    """One answered turn, for the run summary and its report: who, where in the run, when, how much."""

    role: str
    round: int
    seconds: float | None             # from the (last) send to the reply; None if the send time is unknown
    prompt_bytes: int
    # the review verdict or test result it led to
    outcome: str | None = record_field(None, saved_if=lambda r: r.outcome is not None)
    phase: str = ""
    cycle: int = 0
    sent_at: str = ""                 # ISO times (UTC) of the first send and of the reply taken
    taken_at: str = ""
    reply_bytes: int = 0
    reminders: int = 0
    resends: int = 0
    prompt_file: str = ""             # file names in the run's folder ("" when not kept)
    reply_file: str = ""
    tokens: dict[str, TokenUse] | None = None  # model -> tokens its CLI recorded for the turn; None: unknown
    tokens_final: bool = False        # read up to the role's next send (or the run's end): they stay as they are
    terminal: str = ""                # the terminal that answered ("" in a state file written before it was kept)
    context_tokens: int | None = None  # its agent's context at the turn's last response, as its CLI recorded it
    # its CLI's running totals at the first send (InFlight's), needed until its tokens stand
    tokens_before: RunningTotals | None = record_field(
        None, saved_if=lambda r: r.tokens_before is not None and not r.tokens_final)
    model: str = ""                   # the model its last response named, as its CLI recorded it ("": unknown)
    provider: str = ""                # the provider (CLI) whose agent answered it ("": from before it was kept)


def turns_tokens(records: Iterable[TurnRecord]) -> tuple[dict[str, TokenUse] | None, int]:
    """(the known tokens of some turns by model, None when none is known; how many turns' are unknown)"""
    records = list(records)
    known = [r.tokens for r in records if r.tokens is not None]
    return (add_tokens(*known) if known else None), len(records) - len(known)


@dataclass
class AfterRun(PlainRecord):
    """What a finished run still had to do (`due`), and what it did: each step at most once per run."""

    due: list[str] | None = None      # set when the run ends
    archive: dict | None = None       # archive_change()'s outcome
    commit: dict | None = None        # commit_run()'s outcome
    notified: str | None = None       # the event (PASS or FAIL) the user was told of

    def to_json(self) -> dict | None:
        return {key: value for key, value in vars(self).items() if value is not None} or None


@dataclass
class Replacement(PlainRecord):
    """A lost agent the run replaced: whose, which terminal by which, when (UTC) and why."""

    role: str
    old_terminal: str
    new_terminal: str
    at: str
    why: str
    # the run's n-th replacement (a vanished session's five share one)
    event: int = record_field(1, read=lambda value: _whole(value) or 1)


@dataclass
class CliSwitch(PlainRecord):
    """A role the run moved to its fallback CLI at a usage limit it would not wait out, for the rest of the run:
    saved before the new agent is asked for (`new_terminal` '' until it is up), so a rerun finishes the switch."""

    required: ClassVar[str] = "role"
    role: str
    from_provider: str
    from_model: str                   # '' : its CLI's default
    to_provider: str
    to_model: str
    at: str                           # ISO time (UTC)
    resets_at: str                    # when the limit resets (ISO, UTC; '': its CLI named no time)
    limit: str                        # what the screen said
    old_terminal: str
    new_terminal: str = ""
    old_ended: bool = False           # the limited agent ended (a stop right after the switch leaves it to a rerun)

    def text(self) -> str:
        """'programmer codex (gpt-5) -> claude_code (its CLI default) at ...': the switch, for people."""
        def cli(provider: str, model: str) -> str:
            return f"{provider} ({model or 'its CLI default'})"
        return (f"{self.role} {cli(self.from_provider, self.from_model)} -> {cli(self.to_provider, self.to_model)} "
                f"at {self.at}, its limit resetting {self.resets_at or 'at a time its CLI did not name'}")


@dataclass
class AgentEvent(PlainRecord):
    """Something that happened to an agent's conversation or account (compacted, a usage limit waited out, ...)."""

    required: ClassVar[str] = "what"
    role: str
    terminal: str
    at: str                           # ISO time (UTC)
    what: str                         # one of AGENT_EVENT_KINDS
    detail: str = ""


@dataclass
class FailedRound(PlainRecord):
    """A round the tester FAILed, as the next rounds compare with it (its failure's signature, what WD changed)."""

    round: int
    signature: str
    step: str                         # the first line of the evidence that names what failed
    evidence: str
    files: list[str] | None = None    # paths changed in the WD since the last FAIL (None: not known)
    repeats: int = 0                  # the round whose failure this one repeats (0: progress, or the first)


def files_text(files: list[str] | None) -> str:
    """'no file changed', 'changed greet.py, tests/test_greet.py', or that it is not known."""
    if files is None:
        return "the files changed are not known"
    if not files:
        return "no file changed"
    shown = ", ".join(files[:8]) + (f" and {len(files) - 8} more" if len(files) > 8 else "")
    return f"changed {shown}"


def _terminals(raw: object) -> dict[str, str]:
    raw = {} if raw is None else raw
    if not isinstance(raw, dict) or not all(isinstance(value, str) for value in raw.values()):
        raise ValueError("'terminals' must map roles to terminal id strings")
    return {role: raw.get(role, "") for role in ROLES}


def _models(raw: object) -> dict[str, str]:
    """role -> the model its agent was created with ('' for the CLI's default); lenient, as it only informs."""
    return {role: raw[role] for role in ROLES if isinstance(raw.get(role), str)} if isinstance(raw, dict) else {}


def _outputs(raw: object) -> dict[str, str]:
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ValueError("'outputs' must be an object")
    return {key: _text(raw.get(key)) for key in OUTPUT_KEYS}


def _fingerprints(raw: object) -> dict | None:
    """The start-of-run worktree record if it is well formed (path -> fingerprint text), else None."""
    well_formed = isinstance(raw, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in raw.items())
    return raw if well_formed else None


# -- the table -------------------------------------------------------------------

@dataclass(frozen=True)
class StateField:
    """One key of the state file and its module global. `parse` reads the saved value (None: missing; a
    ValueError makes the file unusable); `kind`: "run" (a new run starts from `new()`), "setting" (restored
    unless chosen now), "task"."""

    key: str
    name: str
    parse: Callable[[object], object]
    new: Callable[[], object] = lambda: None
    dump: Callable[[object], object] = lambda value: value
    shell: bool = False               # a field of the shell orchestrator's state file (spec 1 and 2)
    kind: str = "run"


STATE_FIELDS: tuple[StateField, ...] = (
    # The shell orchestrator's fields (spec 1, and spec 2's retry context), in its order.
    StateField("api", "API", parse=_text, shell=True, kind="setting"),
    StateField("provider", "PROVIDER", parse=_text, shell=True, kind="setting"),
    StateField("wd", "WD", parse=_text, shell=True, kind="setting"),
    StateField("prompt", "PROMPT", parse=_text, shell=True, kind="task"),
    StateField("current_round", "current_round", parse=_positive_int, new=lambda: 1, shell=True),
    StateField("current_phase", "current_phase", parse=lambda v: v if v in PHASES else PHASE_ANALYST,
               new=lambda: PHASE_ANALYST, shell=True),
    StateField("final_status", "final_status", parse=lambda v: _text(v) or "RUNNING", new=lambda: "RUNNING",
               shell=True),
    StateField("session_name", "session_name", parse=_text, new=str, shell=True),
    StateField("terminals", "terminal_ids", parse=_terminals, new=lambda: {role: "" for role in ROLES},
               dump=lambda ids: {role: ids.get(role, "") for role in ROLES}, shell=True),
    StateField("feedback", "feedback", parse=_text, new=str, shell=True),
    StateField("analyst_feedback", "analyst_feedback", parse=_text, new=str, shell=True),
    StateField("programmer_feedback", "programmer_feedback", parse=_text, new=str, shell=True),
    StateField("outputs", "outputs", parse=_outputs, new=lambda: {key: "" for key in OUTPUT_KEYS},
               dump=lambda texts: {key: texts.get(key, "") for key in OUTPUT_KEYS}, shell=True),
    StateField("programmer_context_for_retry", "programmer_context_for_retry", parse=_text, new=str, shell=True),
    # Ours; the shell script ignores them.
    StateField("phase_cycle", "phase_cycle", parse=_positive_int, new=lambda: 1),
    StateField("phase_step", "phase_step", parse=lambda v: v if v in PHASE_STEPS else "author",
               new=lambda: "author"),
    StateField("run_dir", "run_dir", parse=_text, new=str),
    StateField("started_at", "started_at", parse=_text, new=str),
    StateField("models", "agent_models", parse=_models, new=dict),
    StateField("verifications", "verifications", new=list,
               parse=lambda v: [r for r in v if isinstance(r, dict)] if isinstance(v, list) else []),
    StateField("context_sent", "context_sent", parse=lambda v: set(_strings(v)), new=set, dump=sorted),
    StateField("terminals_exited", "terminals_exited", parse=lambda v: v is True, new=bool),
    StateField("own_server", "on_own_server", parse=lambda v: v is True, new=bool),
    StateField("in_flight", "in_flight", parse=InFlight.from_json, dump=lambda r: r and r.to_json()),
    StateField("story_progress", "story_progress", parse=StoryProgress.from_json, dump=lambda r: r and r.to_json()),
    StateField("turn_records", "turn_records", new=list, parse=records_reader(TurnRecord), dump=records_json),
    StateField("worktree_at_start", "worktree_at_start", parse=_fingerprints),
    StateField("after_run", "after_run", parse=lambda v: AfterRun.from_json(v) or AfterRun(), new=AfterRun,
               dump=lambda r: r.to_json()),
    StateField("replacements", "replacements", new=list, parse=records_reader(Replacement), dump=records_json),
    StateField("agent_events", "agent_events", new=list, parse=records_reader(AgentEvent), dump=records_json),
    StateField("failed_rounds", "failed_rounds", new=list, parse=records_reader(FailedRound), dump=records_json),
    StateField("rounds_without_progress", "rounds_without_progress", new=int, parse=lambda v: _whole(v) or 0),
    StateField("worktree_at_fail", "worktree_at_fail", parse=_fingerprints),
    StateField("no_progress_stop", "no_progress_stop", parse=lambda v: v if isinstance(v, dict) else None),
    StateField("cli_switches", "cli_switches", new=list, dump=records_json,
               parse=lambda v: [w for w in records_reader(CliSwitch)(v) if w.role in ROLES and w.to_provider]),
    StateField("gates", "gates", new=list, parse=records_reader(Gate), dump=records_json),
    StateField("person_notes", "person_notes", new=list, dump=records_json,
               parse=lambda v: [n for n in records_reader(PersonNote)(v) if n.role in ROLES]),
    StateField("fresh_agents_due", "fresh_agents_due", new=dict,
               parse=lambda v: {r: w for r, w in v.items() if r in ROLES and isinstance(w, str)}
               if isinstance(v, dict) else {}),
)
RUN_FIELDS = tuple(f.name for f in STATE_FIELDS if f.kind == "run")
STATE_FIELDS_BY_NAME = {f.name: f for f in STATE_FIELDS}


def _new_value(name: str) -> object:
    return STATE_FIELDS_BY_NAME[name].new()


# The run's state: one global per "run" row of STATE_FIELDS, a new run's values.
session_name: str = _new_value("session_name")            # the run's CAO session
terminal_ids: dict[str, str] = _new_value("terminal_ids")  # role -> its CAO terminal
current_round: int = _new_value("current_round")
current_phase: str = _new_value("current_phase")
phase_cycle: int = _new_value("phase_cycle")              # review cycle within the current phase
phase_step: str = _new_value("phase_step")                # "author" or "review": whose turn in the cycle is next
final_status: str = _new_value("final_status")            # RUNNING, PASS or FAIL
feedback: str = _new_value("feedback")                    # condensed tester evidence for the next round
analyst_feedback: str = _new_value("analyst_feedback")    # condensed peer analyst notes for the next analyst cycle
programmer_feedback: str = _new_value("programmer_feedback")  # condensed peer programmer notes, likewise
programmer_context_for_retry: str = _new_value("programmer_context_for_retry")  # the failed round's changes
outputs: dict[str, str] = _new_value("outputs")          # the latest answer of each agent (OUTPUT_KEYS)
run_dir: str = _new_value("run_dir")                      # the run's folder: prompts, replies, run.log, summary
started_at: str = _new_value("started_at")                # when the run started (ISO, UTC)
agent_models: dict[str, str] = _new_value("agent_models")  # role -> the model its agent asked for ("": default)
verifications: list[dict] = _new_value("verifications")    # VERIFY_PASS: each check of a tester's PASS
context_sent: set[str] = _new_value("context_sent")      # "<block>:<terminal id>" of once-only text a terminal has
terminals_exited: bool = _new_value("terminals_exited")  # CLEANUP_ON_EXIT ended the agents: never type into them
on_own_server: bool = _new_value("on_own_server")        # its agents run on a CAO server of its own (OWN_SERVER)
in_flight: InFlight | None = _new_value("in_flight")
story_progress: StoryProgress | None = _new_value("story_progress")
turn_records: list[TurnRecord] = _new_value("turn_records")
worktree_at_start: dict | None = _new_value("worktree_at_start")  # COMMIT_ON_PASS: changed paths at the start
after_run: AfterRun = _new_value("after_run")
replacements: list[Replacement] = _new_value("replacements")   # lost agents replaced (REPLACE_LOST_AGENTS=1)
agent_events: list[AgentEvent] = _new_value("agent_events")    # conversations compacted, cleared, started anew
fresh_agents_due: dict[str, str] = _new_value("fresh_agents_due")  # role -> why its next turn needs a new agent
cli_switches: list[CliSwitch] = _new_value("cli_switches")  # roles moved to their fallback CLI (FALLBACK_PROVIDER)
failed_rounds: list[FailedRound] = _new_value("failed_rounds")   # each FAILed round, compared with the one before
rounds_without_progress: int = _new_value("rounds_without_progress")  # FAILs in a row that repeat the one before
worktree_at_fail: dict | None = _new_value("worktree_at_fail")  # the WD's fingerprints at the last FAIL
no_progress_stop: dict | None = _new_value("no_progress_stop")  # why the run stopped without progress, if it did
gates: list[Gate] = _new_value("gates")                # APPROVE gates reached, and what the person decided at each
person_notes: list[PersonNote] = _new_value("person_notes")  # --note: a person's notes taken from the run folder


def update_run(**changes: object) -> None:
    """The one place run-state globals are assigned; a change inside a value goes through the doors below.
    The doors: set_output(), add_turn_record(), note_turn_outcome(), set_turn_tokens(), record_sent(),
    forget_sent(), set_after_run(), update_story_progress(), add_story_result(), add_failed_round().
    """
    if unknown := set(changes) - set(RUN_FIELDS):
        raise AttributeError(f"not a run-state field: {', '.join(sorted(unknown))}")
    globals().update(changes)


def set_output(key: str, text: str) -> None:
    """The latest answer of an agent (one of OUTPUT_KEYS): what the prompts after it are built from."""
    outputs[key] = text


def add_turn_record(record: TurnRecord) -> None:
    """An answered turn, for the run summary and its report."""
    turn_records.append(record)


def note_turn_outcome(outcome: str) -> None:
    """The verdict or test result of the turn just answered, for the run summary."""
    if turn_records:
        turn_records[-1].outcome = outcome
        record_event("verdict", role=turn_records[-1].role, round=turn_records[-1].round, outcome=outcome)


def set_turn_tokens(number: int, tokens: dict[str, TokenUse] | None, final: bool, context: int | None = None,
                    model: str = "") -> None:
    """What the agent's CLI recorded for an answered turn (its index in turn_records), read again until final;
    a context size or model read stays until another is read."""
    record = turn_records[number]
    record.tokens, record.tokens_final = tokens, final
    if context is not None:
        record.context_tokens = context
    if model:
        record.model = model


def record_sent(marks: Iterable[str]) -> None:
    """Once-only blocks that reached a terminal (or may have): from now on it gets their back-references."""
    context_sent.update(marks)


def forget_sent(marks: Iterable[str]) -> None:
    """Once-only blocks a terminal is not known to hold: its next prompt carries them in full."""
    context_sent.difference_update(marks)


def set_after_run(**done: object) -> None:
    """Fields of after_run: the steps due when the run ended, and what each step did."""
    for name, value in done.items():
        if not hasattr(after_run, name):
            raise AttributeError(f"not a field of after_run: {name}")
        setattr(after_run, name, value)


def update_story_progress(**changes: object) -> None:
    """Fields of story_progress; an attempt's end is what its answered turn led to, so it is in flight no more."""
    for name, value in changes.items():
        if not hasattr(story_progress, name):
            raise AttributeError(f"not a field of story_progress: {name}")
        setattr(story_progress, name, value)
    end_answered_turn()


def end_answered_turn() -> None:
    """An answered turn (its reply kept, in_flight.reply_file) leaves in_flight once the loop moved on from it:
    until then a rerun takes the kept reply again instead of sending the prompt."""
    if in_flight is not None and in_flight.reply_file:
        update_run(in_flight=None)


def add_story_result(result: StoryResult) -> None:
    """How a story ended, for the summary the peer programmer reviews after the story loop."""
    story_progress.results.append(result)


def add_failed_round(record: FailedRound) -> None:
    """A FAILed round as compared with the one before, for the next comparison, the prompt, the report."""
    failed_rounds.append(record)


def reset_run_state() -> None:
    """Every run field at its value for a run that has done nothing yet."""
    update_run(**{name: _new_value(name) for name in RUN_FIELDS})


def save_state() -> None:
    """Write the run's state atomically: a crash leaves the old file or the new one, never half."""
    data = {"version": STATE_VERSION, "updated_at": utc_iso()}
    data.update({f.key: f.dump(globals()[f.name]) for f in STATE_FIELDS})
    path = Path(STATE_FILE)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_whole(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    sync_directory(path.parent)


def sync_directory(directory: Path) -> None:
    """Make a rename in `directory` durable against a power loss; best effort (not every filesystem can)."""
    with suppress(OSError):
        handle = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)


# A test's way to stop the loop at one named instant of taking a reply: ORCHESTRATOR_CRASH_AT=<step>:<n>[:INT]
# kills the process (SIGKILL; SIGINT with ":INT") the n-th time it reaches <step>. Unset, it costs a lookup.
CRASH_AT_VARIABLE = "ORCHESTRATOR_CRASH_AT"
_crash_counts: dict[str, int] = {}


def crash_point(step: str) -> None:
    """Die here if the crash test asks for it (see CRASH_AT_VARIABLE); otherwise nothing."""
    wanted = os.environ.get(CRASH_AT_VARIABLE, "")
    if not wanted.startswith(step + ":"):
        return
    _crash_counts[step] = _crash_counts.get(step, 0) + 1
    parts = wanted.split(":")
    if parts[1].isdigit() and _crash_counts[step] == int(parts[1]):
        os.kill(os.getpid(), signal.SIGINT if parts[2:] == ["INT"] else signal.SIGKILL)
        time.sleep(1)                   # SIGINT arrives as KeyboardInterrupt at the next bytecode


class SavedState(SimpleNamespace):
    """A state file as read back: one attribute per STATE_FIELDS name, plus `updated_at`."""

    @property
    def finished(self) -> bool:
        return self.final_status in ("PASS", "FAIL")


def read_state_file() -> SavedState | None:
    """The state file, parsed and checked; None if there is none; StateFileError if unusable."""
    path = Path(STATE_FILE)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StateFileError(f"state file {path} cannot be parsed ({exc})") from None
    if not isinstance(data, dict):
        raise StateFileError(f"state file {path} does not hold a JSON object")
    if data.get("version", STATE_VERSION) != STATE_VERSION:
        raise StateFileError(f"state file {path} has version {data.get('version')!r}; only version 1 is known")
    try:
        values = {f.name: f.parse(data.get(f.key)) for f in STATE_FIELDS}
    except ValueError as exc:
        raise StateFileError(f"state file {path}: {exc}") from None
    updated_at = data.get("updated_at")
    return SavedState(**values, updated_at=updated_at if isinstance(updated_at, str) else None)


def load_state() -> bool:
    """Restore the run from STATE_FILE (with the terminals' settings, unless chosen now); False if there is none.
    What the prompt in flight carried in full counts as sent only once it is known to have arrived."""
    saved = read_state_file()
    if saved is None:
        return False
    restore_saved_settings(saved)
    set_task(saved.PROMPT)
    update_run(**{name: getattr(saved, name) for name in RUN_FIELDS})
    if in_flight is not None:
        forget_sent(in_flight.sent_in_full)
    return True


def restore_saved_settings(saved: SavedState) -> None:
    """The settings the run's terminals were created with (its server, provider, directory), unless the user
    chose them now: a resume and --status ask the server the run is on."""
    set_settings({f.name: getattr(saved, f.name) for f in STATE_FIELDS
                  if f.kind == "setting" and getattr(saved, f.name) and f.name not in explicit_settings})


def state_backup_path(saved: SavedState | None = None) -> Path:
    """Where a replaced state file is kept: named after its run's folder, else after the time it was set aside."""
    path = Path(STATE_FILE)
    held = Path(saved.run_dir).name if saved is not None and saved.run_dir else ""
    stamp = held if re.fullmatch(r"\d{8}-\d{6}(-\d+)?", held) else datetime.now().strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.name}.{stamp}.bak")
    number = 2
    while target.exists():
        target = path.with_name(f"{path.name}.{stamp}-{number}.bak")
        number += 1
    return target


def describe_state(saved: SavedState) -> str:
    """'finished with PASS in round 2, last saved 2026-11-22T10:00:00Z': what a state file holds."""
    round_text = f"round {saved.current_round}"
    what = (f"finished with {saved.final_status} in {round_text}" if saved.finished
            else f"an unfinished run ({round_text}, {saved.current_phase} phase)")
    return f"{what}, last saved {saved.updated_at or 'at an unknown time'}"


def continue_command(rounds: int) -> str:
    """'RESUME=1 MAX_ROUNDS=3 cao-orchestrator-loop config.json': a FAILed run taken on to `rounds` rounds."""
    return " ".join(part for part in (f"RESUME=1 MAX_ROUNDS={rounds}", command_name(), config_argument) if part)


def go_on_command(round_played: int, without_progress: bool) -> str:
    """The command that takes a run that ended in FAIL on: RESUME=1 alone after a stop without progress with
    rounds left, else with a MAX_ROUNDS one above the rounds played."""
    if without_progress and MAX_ROUNDS > round_played:
        return " ".join(part for part in ("RESUME=1", command_name(), config_argument) if part)
    return continue_command(round_played + 1)


# One process per run: an exclusive lock beside the state file, which the system drops when the process dies
# (a killed run never blocks the next); a lock on a file removed meanwhile is taken again on the new one.
class RunLock:
    """The run's lock, the one home of it: taken (`take`), given back (`give_back`), and looked at without taking
    it (`read`, `holder`, `killed`). Its text names the invocation that holds it ('pid N since ...'), read by
    lock_text_facts() alone. While held: the open lock file, and a folder it made."""

    handle: ClassVar[TextIO | None] = None
    made_folder: ClassVar[Path | None] = None

    @classmethod
    def take(cls) -> None:
        """Take the run's lock, or stop at once (exit 75) naming the process that holds it."""
        path = Path(STATE_FILE + ".lock")
        if not path.parent.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            cls.made_folder = path.parent
        while True:
            handle = open(path, "a+", encoding="utf-8")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                handle.seek(0)
                holder = handle.read().strip() or "a process that has not yet said its pid"
                handle.close()
                raise RunLocked(f"the run in {STATE_FILE} is being driven by {holder}; nothing was done. "
                                f"Try again when it has finished (see its log), or stop that process first") from None
            with suppress(FileNotFoundError):
                if os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino:
                    break
            handle.close()               # its holder removed it as we opened it: lock the file there now
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} since {datetime.now().strftime('%Y-%m-%d %H:%M:%S')}\n")
        handle.flush()
        cls.handle = handle

    @classmethod
    def give_back(cls) -> None:
        """Give the lock back and remove its file (while still holding it, so no other process loses its lock)."""
        if cls.handle is not None:
            Path(cls.handle.name).unlink(missing_ok=True)
            cls.handle.close()
            cls.handle = None
        if cls.made_folder is not None:
            with suppress(OSError):      # kept when the run wrote anything there
                cls.made_folder.rmdir()
            cls.made_folder = None

    @staticmethod
    def read() -> tuple[bool, str] | None:
        """Whether a process holds the run's lock, and the invocation its file names (None: no file); looked at
        without taking the lock or writing anything."""
        try:
            handle = open(STATE_FILE + ".lock", encoding="utf-8")
        except OSError:
            return None
        with handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                return True, handle.read().strip()
            fcntl.flock(handle, fcntl.LOCK_UN)
            return False, handle.read().strip()

    @classmethod
    def holder(cls) -> str:
        """Who holds the run's lock ('' if nobody)."""
        held, holder = cls.read() or (False, "")
        return (holder or "a process") if held else ""

    @classmethod
    def killed(cls) -> str:
        """'pid 123 since 2026-11-24 15:00:00' of an invocation that died holding the run's lock: its file is left
        (every other way out removes it) and no process holds it -- SIGKILL, or the machine stopped. '' otherwise."""
        held, invocation = cls.read() or (True, "")
        return "" if held else invocation    # held: that invocation lives


def lock_text_facts(text: str) -> dict | None:
    """{"pid", "since"} of an invocation the lock's text names ('pid N since ...'), the one reader of that text
    (None: no invocation; both None: a text not in that form)."""
    named = re.fullmatch(r"pid (\d+) since (.+)", text)
    return {"pid": int(named[1]), "since": named[2]} if named else {"pid": None, "since": None} if text else None


# From the lock on until the state file has the run, a note beside it says that a run is starting, since when,
# how far it got and each agent's start ('starting', 'up', or 'failed' and why): --status reads it. It goes
# once the state file holds the run or the stop's line has said why not; an invocation killed in start-up
# leaves it (written whole or not at all, like the own server's note).
class StartUpNote:
    """The start-up note, the one home of it (its one object: `start_up`): `begin()`, `step()`, `agent()`, `end()`,
    and `read()` for --status. While this invocation's run starts, `facts` is its note ({} at any other time)."""

    def __init__(self) -> None:
        self.facts: dict = {}
        self.guard = threading.Lock()    # the agents start in threads of their own

    @staticmethod
    def path() -> Path:
        """Where a starting run is noted: beside the state file."""
        return Path(STATE_FILE).with_suffix(".start-up.json")

    def _change(self, change: Callable[[dict], object], beginning: bool = False) -> None:
        """Change the note of a start-up under way (or one `beginning`) and write it whole; a note that cannot be
        written costs the run nothing."""
        with self.guard:
            if self.facts or beginning:
                change(self.facts)
                with suppress(OSError):
                    write_note(self.path(), self.facts)

    def begin(self, resuming: bool) -> None:
        """Note that this invocation starts a run (a new one, or the saved one resumed), under the run's lock."""
        self._change(lambda facts: facts.update(pid=os.getpid(), since=utc_iso(), resuming=resuming,
                                                step="starting", agents={}), beginning=True)

    def step(self, step: str) -> None:
        """What the start-up does now ('starting the run's own CAO server', 'creating the five agents', ...)."""
        self._change(lambda facts: facts.update(step=step))

    def agent(self, role: str, state: str, reason: str = "", terminal: str = "") -> None:
        """One agent's start: 'starting', 'up' (its terminal), or 'failed' with why in the CLI's or CAO's words
        (the last word on a role wins). Nothing outside a start-up (a replacement mid-run)."""
        self._change(lambda facts: facts["agents"].update({role: {"state": state, "reason": reason,
                                                                  "terminal": terminal}}))

    def end(self) -> None:
        """The start-up is over: the state file holds the run, or the stop's line has said why it did not start."""
        with self.guard:
            if self.facts:
                self.path().unlink(missing_ok=True)
                self.facts.clear()

    def read(self) -> dict | None:
        """The start-up note beside the state file, as --status reads it (None: none, or one that cannot be read)."""
        with suppress(ValueError):
            return read_note(self.path(), lambda note: note if isinstance(note.get("pid"), int)
                             and isinstance(note.get("agents"), dict) else None)
        return None


start_up = StartUpNote()


# ==========================================================================
# 4. Response files and the run record
# ==========================================================================
# Each agent writes its answer to a file of its own: the agent's word, which leads every decision of a turn.

RESPONSE_FILES = {
    "analyst": "analyst_summary.md",
    "peer_analyst": "analyst_review.md",
    "programmer": "programmer_summary.md",
    "peer_programmer": "programmer_review.md",
    "tester": "test_result.md",
}
FILE_CHECK_SECONDS = 0.05      # how often the response file is looked at: a local read, so a reply is seen at once


def new_run_dir() -> str:
    """The run's folder: $WD/.tmp/<run start time>, with -2, -3, ... for a second run in the same second."""
    base = Path(WD) / ".tmp" / datetime.now().strftime("%Y%m%d-%H%M%S")
    folder, number = base, 2
    while folder.exists():
        folder = base.with_name(f"{base.name}-{number}")
        number += 1
    return str(folder)


def prepare_run_folder() -> None:
    """Make the run's folder its record: run.log from now on, `.tmp/latest` pointing at it, and `.tmp/`
    kept out of the project's `git status` by a .gitignore of its own."""
    tmp = Path(WD) / ".tmp"
    folder = Path(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    ignore = tmp / ".gitignore"
    if not ignore.exists():
        ignore.write_text("# The orchestrator loop's own files: state, replies, run records.\n*\n", encoding="utf-8")
    if folder.parent == tmp:
        latest, temporary = tmp / "latest", tmp / f".latest.{os.getpid()}"
        try:
            temporary.unlink(missing_ok=True)
            temporary.symlink_to(folder.name)
            os.replace(temporary, latest)
        except OSError:
            temporary.unlink(missing_ok=True)
    open_run_log(folder / "run.log")


# -- The run's events: events.jsonl, for programs ----------------------------------------------------
# Appended, never rewritten; a torn line is followed by a new one (docs/following-a-run.md says the format).
EVENTS_FILE = "events.jsonl"
# The kinds an event may be; each one's fields: the table in docs/following-a-run.md (tests/test_events.py checks it).
EVENT_KINDS = ("run_started", "run_resumed", "turn_sent", "reply_taken", "verdict", "agent_event", "agent_replaced",
               "cli_switched", "round_compared", "gate_reached", "gate_decided", "note_taken", "run_stopped")
EVENTS_TAIL_BYTES = 65_536          # where the last event's seq is looked for


def last_event_seq(path: Path) -> tuple[int, bool]:
    """(the seq of the last whole event in the file, whether the file ends in a torn line): 0 for no file."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - EVENTS_TAIL_BYTES))
            tail = handle.read()
    except FileNotFoundError:
        return 0, False
    for line in reversed(tail.splitlines()):
        with suppress(ValueError, KeyError, TypeError):
            return int(json.loads(line)["seq"]), not tail.endswith(b"\n")
    return 0, bool(tail) and not tail.endswith(b"\n")


# A failure that would repeat (a record the run could not keep in its folder, a gate's poll): said once each.
said_once: set[str] = set()


def say_once(key: str, line: str) -> None:
    """Say the line in the log the first time `key` comes, only then."""
    if key not in said_once:
        said_once.add(key)
        log(line)


def say_unwritten(what: str, path: Path, exc: OSError) -> None:
    """Say once in the log that a kind of record cannot be written (and why); the run goes on without it."""
    say_once(what, f"warning: could not write {what} to {path} ({exc.__class__.__name__}: {exc}); the run goes on "
             "without them (said once)")


def record_event(event: str, **fields: object) -> None:
    """Append one event to the run's events.jsonl (one write, so a line is whole or torn, never mixed). A
    folder that cannot be written costs the event, never the run: said once in the log."""
    if event not in EVENT_KINDS:
        raise ValueError(f"not an event kind: {event}")
    if not run_dir:
        return
    path = Path(run_dir) / EVENTS_FILE
    try:
        seq, torn = last_event_seq(path)
        line = json.dumps({"seq": seq + 1, "at": utc_iso(precise=True), "event": event, **fields})
        with open(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644), "wb", buffering=0) as handle:
            handle.write((("\n" if torn else "") + line + "\n").encode("utf-8"))      # unbuffered: one write
    except OSError as exc:
        say_unwritten("the run's events", path, exc)


def read_events(path: Path, after: int = 0, mark: bytes = b"") -> list[dict]:
    """The whole events in the file with a seq above `after`, in order; torn or foreign lines skipped, and
    lines without `mark` (only those are parsed)."""
    try:
        lines = path.read_bytes().splitlines()
    except (FileNotFoundError, IsADirectoryError):
        return []
    events = []
    for line in lines:
        with suppress(ValueError):
            event = json.loads(line) if mark in line else None
            if isinstance(event, dict) and isinstance(event.get("seq"), int) and event["seq"] > after:
                events.append(event)
    return events


def response_dir() -> Path:
    return Path(WD) / ".tmp" / "agent-responses"


def response_path(role: str) -> Path:
    return response_dir() / RESPONSE_FILES[role]


def response_file_instruction(role: str) -> str:
    """The closing block of every prompt: where and how to write the answer."""
    path = str(response_path(role))
    return (
        "Response file (required):\n"
        f"Write your complete answer to this file: {path}\n"
        "For example:\n"
        f"mkdir -p {shlex.quote(str(response_dir()))} && cat > {shlex.quote(path)} <<'END_OF_RESPONSE'\n"
        "<your complete answer>\n"
        "END_OF_RESPONSE\n"
        "Only this file is read: an answer left in the terminal alone is lost. "
        "Write it once, when your work is done."
    )


def _next_archive_number() -> int:
    numbers = [int(p.name[:3]) for p in Path(run_dir).glob("[0-9][0-9][0-9]-*")]
    return max(numbers, default=0) + 1


def set_aside_stale_reply(path: Path) -> None:
    """Move an old response file out of the way so it is never taken as the new answer."""
    if path.exists():
        stale = Path(run_dir) / f"{_next_archive_number():03d}-stale-{path.name}"
        stale.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, stale)


def read_reply_file(path: Path) -> str:
    """The response file's text, or '' while it is missing or blank."""
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except (FileNotFoundError, IsADirectoryError):
        return ""


def prompt_file_path(role: str, number: int) -> Path:
    return Path(run_dir) / f"{number:03d}-{role}.prompt.md"


def keep_sent(role: str, kind: str, message: str) -> None:
    """Keep what the turn in flight was sent beside its reply (NNN-<role>.prompt.md), each resend, reminder
    or "continue" appended below; a file that cannot be written costs only the record, said once."""
    if in_flight is None or in_flight.number is None or not run_dir:
        return
    path = prompt_file_path(role, in_flight.number)
    text = message if kind == "prompt" else f"\n\n---- {kind} sent at {utc_iso()} ----\n\n{message}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w" if kind == "prompt" else "a", encoding="utf-8") as handle:
            handle.write(text if text.endswith("\n") else text + "\n")
    except OSError as exc:
        say_unwritten("the copies of the prompts sent", path, exc)
    if kind in ("reminder", "resend"):            # counted on the turn: its `reminders` or `resends`
        update_run(in_flight=replace(in_flight, **{kind + "s": getattr(in_flight, kind + "s") + 1}))


def archive_reply(role: str, text: str, response_file: Path) -> Path:
    """Keep a consumed reply as $WD/.tmp/<run>/NNN-<role>.md, its place saved first: whenever the loop dies,
    a rerun finds the reply and takes it without sending the prompt again."""
    directory = Path(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    number = in_flight.number if in_flight is not None and in_flight.role == role else None
    target = directory / f"{number or _next_archive_number():03d}-{role}.md"
    if target.exists():                 # never over an earlier reply
        target = directory / f"{_next_archive_number():03d}-{role}.md"
    if in_flight is not None and in_flight.role == role:
        update_run(in_flight=replace(in_flight, reply_file=target.name))
        save_state()
    crash_point("reply-file-named")
    if read_reply_file(response_file):
        os.replace(response_file, target)          # at once: the reply is still there, or kept ...
    # ... as the text acted on, byte for byte (its agent may have rewritten it since)
    write_whole(target, text if text.endswith("\n") else text + "\n")
    sync_directory(directory)
    crash_point("reply-archived")
    return target


def taken_reply(role: str) -> Path | None:
    """The reply of the prompt in flight, kept in the run's folder by a process that stopped before it saved
    what the reply led to (None: there is none). The name the state gives, else the one the turn's number
    gives (the loop died between the move and the save); written after the prompt went out."""
    if in_flight is None or in_flight.role != role or in_flight.sent_at is None or not run_dir:
        return None
    for name in filter(None, (in_flight.reply_file, in_flight.number and f"{in_flight.number:03d}-{role}.md")):
        path = Path(run_dir) / name
        if name != path.name or not name.endswith(f"-{role}.md"):
            continue                    # a state file edited by hand: only a file of the run's folder counts
        try:
            fresh = path.stat().st_mtime >= in_flight.sent_at - MTIME_SLACK_SECONDS
        except OSError:
            continue
        if fresh and read_reply_file(path):
            return path
    return None


# The parts each format's reader reads (sections 9-15): a reply cut off as it was written lacks its last.
REPLY_PARTS: dict[str, tuple[str, ...]] = {
    "analyst": ("ANALYST_SUMMARY", "Handoff"),
    "peer_analyst": ("REVIEW_RESULT", "REVIEW_NOTES"),
    "programmer": ("PROGRAMMER_SUMMARY", "Files changed", "Behaviou?r implemented"),
    "peer_programmer": ("REVIEW_RESULT", "REVIEW_NOTES"),
    "tester": ("RESULT", "EVIDENCE"),
}


def reply_complete(role: str, text: str) -> bool:
    """Whether a reply holds every labelled part its format's reader reads (in story mode, the programmer's
    <promise> too): what a reply cut off mid-write lacks."""
    form = VERDICT_FORMATS["tester"]
    return (all(re.search(rf"^\W*(?:\d+[.)]\s*)?(?:{part})\W*:", text, re.MULTILINE | re.IGNORECASE)
                for part in REPLY_PARTS.get(role, ()))
            and (role != "tester" or verdict_line(form, text)[1] in (form.good, form.other))
            and (not (role == "programmer" and STORY_MODE) or bool(promise_signal(text)[0])))


def left_reply(role: str, path: Path) -> str:
    """The answer the gone agent of the turn in flight left: written since the prompt, settled and complete
    ('' if none). The one rule wherever an agent is gone: a reply written is taken, one cut off is not."""
    version = reply_file_version(path)
    if in_flight is None or in_flight.role != role or in_flight.sent_at is None or version is None:
        return ""
    written_at = version[0] / 1e9
    if written_at < in_flight.sent_at - MTIME_SLACK_SECONDS:
        return ""
    if time.time() - written_at < FILE_SETTLE_SECONDS:     # just written: it settles, or it was not all there
        time.sleep(FILE_SETTLE_SECONDS)
        if reply_file_version(path) != version:
            return ""
    reply = read_reply_file(path)
    return reply if reply_complete(role, reply) else ""


def reply_file_version(path: Path) -> tuple[int, int] | None:
    """(mtime, size) of a non-empty response file (blanks count as empty), None while missing or empty."""
    try:
        info = path.stat()
    except OSError:
        return None
    if info.st_size == 0 or not read_reply_file(path):
        return None
    return (info.st_mtime_ns, info.st_size)


def duration_text(seconds: float) -> str:
    """'45s', '2m 5s', '1h 3m': a span of time as a person reads it."""
    seconds = int(max(0, seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m {seconds % 60}s"
    return f"{seconds // 3600}h {seconds % 3600 // 60}m"


def task_title() -> str:
    """The task's first line (without Markdown markers), for commit subjects and notification titles."""
    for line in (EXPLORE_SUMMARY or PROMPT).splitlines():
        text = line.strip().lstrip("#*->").strip()
        if text:
            return text if len(text) <= 72 else text[:69].rstrip() + "..."
    return "orchestrator loop run"


# Words of a task line that only labels what follows ("# Task", "Business goal", "Summary"): never the heading.
TASK_LABEL_WORDS = frozenset(
    "task tasks goal goals business summary overview context background description requirement requirements "
    "problem objective objectives original explore scenario test the our and".split())
# Markdown's marks at the start of a line: headings, quotes, list items.
MARKDOWN_LEAD = re.compile(r"^(?:#{1,6}\s+|>\s*|[-*+]\s+|\d+[.)]\s+)+")


def task_heading() -> str:
    """The task's first meaningful line, whole: the report's heading; a sentence wrapped onto the next lines of
    its paragraph is taken to its end. Lines that only label what follows ("Business goal:", "# Task",
    "*** ORIGINAL EXPLORE SUMMARY ***", a code fence) are passed over."""
    raw = [line.strip() for line in (EXPLORE_SUMMARY or PROMPT).splitlines()] + [""]
    lines = [MARKDOWN_LEAD.sub("", line).replace("**", "").strip() for line in raw]
    for index, line in enumerate(raw[:-1]):
        if not _is_task_label(line, lines[index]):
            end = next(end for end in range(index, len(raw)) if lines[end][-1:] in ".!?:" or not raw[end + 1]
                       or MARKDOWN_LEAD.match(raw[end + 1]) or raw[end + 1].startswith(("```", "~~~")))
            return " ".join(lines[index:end + 1])
    return task_title()


def _is_task_label(line: str, text: str) -> bool:
    """Whether a task line (as written, and without its Markdown markers) only names what follows."""
    if line.startswith(("```", "~~~")) or not re.search(r"\w", text) or text.endswith(":"):
        return True
    if re.fullmatch(r"([*=#~_-])\1{2,}.*\1{3}", line):        # a banner: *** ORIGINAL EXPLORE SUMMARY ***
        return True
    words = re.findall(r"[^\W\d_]+", text.lower())
    return 0 < len(words) <= 4 and all(word in TASK_LABEL_WORDS for word in words)


def _token_totals(records: list[TurnRecord]) -> dict:
    """Tokens of some turns, for summary.json: their sum over the turns whose tokens are known (None when
    none is), how many are not, and the estimated cost (None without a price for each model)."""
    total, unknown = turns_tokens(records)
    return {"tokens": tokens_json(total), "tokens_unknown_turns": unknown,
            "cost": cost_of(total) if MODEL_PRICES else None}


def turn_provider(record: TurnRecord) -> str:
    """The provider whose agent answered the turn (a record from before it was kept: the role's)."""
    return record.provider or provider_for(record.role)


def _totals_by(key: Callable[[TurnRecord], str], keys: Iterable[str],
               more: Callable[[list[TurnRecord]], dict] = lambda mine: {}) -> dict[str, dict]:
    """Per key (in the order given), by what `key` says of an answered turn: how many turns, what `more` says of
    them, and the tokens they used."""
    turns_of = {name: [record for record in turn_records if key(record) == name] for name in keys}
    return {name: {"turns": len(mine), **more(mine), **_token_totals(mine)} for name, mine in turns_of.items()}


def _role_figures(mine: list[TurnRecord]) -> dict:
    """What a role's answered turns add to their totals: their seconds, and the verdicts they led to."""
    return {"seconds": round(sum(record.seconds or 0.0 for record in mine), 1),
            "outcomes": [record.outcome for record in mine if record.outcome]}


def _unanswered_turn() -> dict | None:
    """The prompt in flight, as a turn of the run record with no reply (None when there is none)."""
    if in_flight is None or in_flight.reply_file:
        return None
    facts = {**sent_turn_facts(in_flight.role, time.time()), "seconds": None, "tokens_before": None}
    return {**TurnRecord(in_flight.role, in_flight.round, prompt_bytes=in_flight.prompt_bytes, outcome="unanswered",
                         provider=provider_for(in_flight.role), **facts).to_json(), "cost": None}


def run_interruptions() -> list[dict]:
    """Where the run was cut, from its events: each invocation that stopped with the run unfinished (its
    exit code; null for one that was killed and said nothing) and when the next took the run up ('' not yet).
    Only the run_* lines are read: the page is written after every turn."""
    try:
        events = read_events(Path(run_dir) / EVENTS_FILE, mark=b'"event": "run_') if run_dir else []
    except OSError:
        events = []
    cuts: list[dict] = []
    last: dict = {}
    for event in events:
        if event.get("event") == "run_resumed" and last:
            stopped = last.get("event") == "run_stopped"
            if not stopped or last.get("result") == "RUNNING":
                cuts.append({"stopped_at": last.get("at", "") if stopped else "",
                             "exit_code": last.get("exit_code") if stopped else None,
                             "resumed_at": event.get("at", "")})
        last = event
    if last.get("event") == "run_stopped" and last.get("result") == "RUNNING":
        cuts.append({"stopped_at": last.get("at", ""), "exit_code": last.get("exit_code"), "resumed_at": ""})
    return cuts


def scripted_note(providers: Iterable[str]) -> str:
    """SCRIPTED_WORDS where one of the run's agents is the scripted one ('' otherwise): its PASS is no work."""
    return SCRIPTED_WORDS if SCRIPTED_PROVIDER in providers else ""


def say_scripted_agents() -> None:
    """Once, as a run starts: that its agents are scripted, and with a task not the demo's, that a PASS means
    nothing (the scripted agents answer from their script, whatever the task)."""
    demo = ""
    with suppress(ImportError):          # installed with the loop; a copy of this file alone warns on any task
        from orchestrator_scripted_agent import DEMO_TASK as demo
    note = scripted_note(map(provider_for, ROLES))
    if note:
        log(note + ("" if PROMPT.strip() == demo.strip() else f"; warning: this task is not the demo's, and "
                    f"{SCRIPTED_PROVIDER} answers from its script whatever the task: a PASS here means nothing"))


def run_summary(exit_code: int | None) -> dict:
    """What the run did, from its turn records, for the log, dashboards and the report; a prompt not answered
    counts among the prompts sent. `exit_code` is None while the run goes on."""
    unanswered = _unanswered_turn()
    turns = [{**r.to_json(), "provider": turn_provider(r), "cost": cost_of(r.tokens) if MODEL_PRICES else None}
             for r in turn_records] \
        + ([unanswered] if unanswered else [])
    ended_at, scripted = utc_iso(precise=True), scripted_note(map(provider_for, ROLES))
    return {
        "result": final_status, "exit_code": exit_code, "task": task_title(), "task_heading": task_heading(),
        "scenario_test": SCENARIO_TEST, "wd": WD,
        "providers": {role: provider_for(role) for role in ROLES},
        "scripted_agents": bool(scripted), "scripted_note": scripted,
        "models": {role: agent_models.get(role, "") for role in ROLES},
        "verified": (verifications[-1]["result"] == "passed") if verifications else None,
        "verifications": verifications,
        "started_at": started_at, "ended_at": ended_at, "wall_seconds": _seconds_since(started_at, ended_at),
        "rounds": current_round, "max_rounds": MAX_ROUNDS,
        "turns": len(turn_records), "prompts_sent": len(turns),
        "agent_seconds": round(sum(r.seconds or 0.0 for r in turn_records), 1),
        "prompt_bytes": sum(t["prompt_bytes"] for t in turns),
        "reply_bytes": sum(r.reply_bytes for r in turn_records),
        **_token_totals(turn_records), "model_prices": MODEL_PRICES,
        "roles": _totals_by(lambda record: record.role, ROLES, _role_figures),
        "clis": _totals_by(turn_provider, dict.fromkeys(map(turn_provider, turn_records))),   # in order of first answer
        "session_name": session_name, "state_file": STATE_FILE, "run_dir": run_dir,
        "after_run": after_run.to_json() or {},
        "replacements": [r.to_json() for r in replacements],
        "cli_switches": STATE_FIELDS_BY_NAME["cli_switches"].dump(cli_switches),
        "agent_events": [e.to_json() for e in agent_events],
        "no_progress_stop": no_progress_stop,
        "failed_rounds": STATE_FIELDS_BY_NAME["failed_rounds"].dump(failed_rounds),
        "gates": records_json(gates), "person_notes": [{**n.to_json(), "carried": n.carried} for n in person_notes],
        "interruptions": run_interruptions(),
        "turn_list": turns,
    }


# -- report.html: the page a person opens to see a run ----------------------------
# One template (REPORT_PAGE); every value goes in escaped through _fill() or _join() (ReportHtml: already so).

REPORT_COLOURS = {"PASS": "#2e7d32", "FAIL": "#d32f2f", "APPROVED": "#66bb6a", "REVISE": "#f9a825",
                  "MISSING": "#8d6e63", "COMPLETE": "#26a69a", "unanswered": "#9e9e9e", "": "#1976d2"}
REPORT_TEXT_LIMIT = 200_000          # characters of one prompt or reply shown in the report
REPORT_RELOAD_SECONDS = 10           # a page of a run still going reloads itself this often
REPORT_RUN_FILES = ("run.log", "summary.json")   # linked from the page when they are there
CODE_SPAN = re.compile(r"`([^`\n]+)`")

REPORT_PAGE = Template("""\
<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>$result: $title</title>
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222 }
h1 { font-size: 1.3em; overflow-wrap: anywhere }
h2 { font-size: 1.1em; margin: 1.2em 0 .4em }
code { background: #eee; padding: 0 .25em; border-radius: 3px }
.overview { display: grid; grid-template-columns: minmax(0, 1fr) minmax(0, 1fr); gap: 0 2em }
@media (max-width: 900px) { .overview { grid-template-columns: minmax(0, 1fr) } }
dl { display: grid; grid-template-columns: max-content auto; gap: .2em 1em; margin: 0 }
dt { color: #666 }
dd { margin: 0; overflow-wrap: anywhere }
.lane { display: flex; align-items: center; margin: .3em 0 }
.lane-label { min-width: 10em; margin-right: .6em; flex: none }
.track { position: relative; flex: 1; height: 1.6em; background: #f1f1f1 }
.turn { position: absolute; top: 0; bottom: 0; min-width: 4px; color: #fff; font-size: 11px; text-align: center;
        overflow: hidden; text-decoration: none }
.cut { position: absolute; top: 0; bottom: 0; min-width: 3px; border-left: 2px solid #000;
       background: repeating-linear-gradient(45deg, #fff, #fff 3px, #555 3px, #555 6px) }
.side-by-side { display: grid; grid-template-columns: minmax(0, 1fr) minmax(0, 1fr); gap: 0 1em }
h3 { font-size: 1em; margin: .6em 0 .2em }
pre { white-space: pre-wrap; overflow-wrap: anywhere; background: #f7f7f7; padding: .6em; margin: .3em 0 }
summary { cursor: pointer; padding: .2em 0 }
.legend span { display: inline-block; padding: 0 .5em; margin-right: .4em; color: #fff }
table { border-collapse: collapse; margin: .3em 0 }
th, td { padding: .1em .7em; text-align: right; border-bottom: 1px solid #eee }
th:nth-child(2), td:nth-child(2) { text-align: left }
</style></head>
<body data-result="$result" data-reload-seconds="$reload_seconds">
<h1 id="task">$heading</h1>
<p class="result" data-result="$result" style="font-size:1.2em">Result: <b>$result</b>$scripted</p>
<div class="overview">
<dl id="figures">
$figures
</dl>
<section id="outcome">
$outcome
</section>
</div>
$agent_events
<section id="timeline"><h2>Timeline</h2>
$lanes
<p class="legend">$legend</p><p id="time-axis">$axis</p></section>
<section id="turns"><h2>Turns</h2>
$turns
</section>
$tokens
<script>
(function () {
  var key = "report-view:" + location.pathname;
  // A turn named in the address (a click on its bar) is opened.
  function openTurn() {
    var turn = document.getElementById(location.hash.slice(1));
    if (turn && turn.tagName === "DETAILS") { turn.open = true; }
  }
  // After a reload: the turns the reader had open, and where the page was scrolled to.
  function restoreView() {
    var view = null;
    try { view = JSON.parse(sessionStorage.getItem(key)); sessionStorage.removeItem(key); } catch (e) {}
    if (!view) { return; }
    view.open.forEach(function (id) {
      var turn = document.getElementById(id);
      if (turn) { turn.open = true; }
    });
    window.scrollTo(view.x, view.y);
  }
  function reload() {
    var open = [];
    document.querySelectorAll("details[open]").forEach(function (turn) { open.push(turn.id); });
    try { sessionStorage.setItem(key, JSON.stringify({x: window.scrollX, y: window.scrollY, open: open})); }
    catch (e) {}
    location.reload();
  }
  restoreView();
  openTurn();
  window.addEventListener("hashchange", openTurn);
  // A run still going: its page is rewritten after every prompt and reply, so it reloads itself.
  var seconds = Number(document.body.dataset.reloadSeconds);
  if (seconds > 0) { setTimeout(reload, seconds * 1000); }
})();
</script>
</body></html>
""")
FIGURE = Template("<dt>$name</dt><dd>$value</dd>")
SCRIPTED_LINE = Template(' <span id="scripted-agents" style="color:#d32f2f">-- $note</span>')
LINK = Template('<a href="$href">$text</a>')
CODE = Template("<code>$text</code>")
SCENARIO_BLOCK = Template('<h2>Scenario test</h2>\n<pre id="scenario-test">$text</pre>')
EVIDENCE_BLOCK = Template('<h2>Last test result: $what</h2>\n<pre id="final-evidence">$text</pre>\n'
                          '<p>The whole reply: <a href="#turn-$number">turn $number</a></p>')
NO_PROGRESS_BLOCK = Template(
    '<section id="no-progress"><h2>Stopped without progress</h2>\n<p>$line</p>\n'
    '<div class="side-by-side"><div><h3>Round $first</h3><pre data-round="$first">$before</pre></div>'
    '<div><h3>Round $last</h3><pre data-round="$last">$after</pre></div></div></section>')
NO_EVIDENCE = Template('<h2>Last test result</h2>\n<p id="final-evidence">$text</p>')
AGENT_EVENTS = Template('<section id="agent-events"><h2>Agents\' conversations and limits</h2><ul>\n'
                        '$items\n</ul></section>')
AGENT_EVENT = Template('<li data-what="$what">$at: $role (terminal $terminal): $what$detail</li>')
LANE = Template('<div class="lane" data-role="$role"><span class="lane-label">$role</span><div class="track">'
                '$bars</div></div>')
BAR = Template('<a class="turn" href="#turn-$number" data-turn="$number" data-verdict="$verdict" data-cut="$cut" '
               'style="left:$left%;width:$width%;background:$colour" title="$title">$number$cuts</a>')
GATE_BAR = Template('<span class="turn" data-gate="$gate" data-decision="$verdict" style="left:$left%;width:$width%;'
                    'background:$colour" title="$title">$gate</span>')
CUT_MARK = Template('<span class="cut" data-exit-code="$code" style="left:$left%;width:$width%" title="$title"></span>')
LEGEND_ENTRY = Template('<span data-verdict="$verdict" style="background:$colour">$name</span>')
TURN_DETAIL = Template(
    '<details id="turn-$number" class="turn-detail"><summary>$label</summary>\n'
    '<h3>Prompt ($prompt_bytes bytes, sent $sent)</h3><pre class="prompt">$prompt</pre>\n'
    '<h3>Reply ($reply_bytes bytes, taken $taken)</h3><pre class="reply">$reply</pre></details>')


TOKENS_SECTION = Template('<section id="tokens"><h2>Tokens used</h2>\n<p>$note</p>\n$tables</section>')
TOKEN_TABLE = Template('<table id="tokens-per-$per"><tr><th>$first</th><th>$second</th><th>$third</th><th>input</th>'
                       '<th>cached input</th><th>output</th><th>cost</th></tr>\n$rows</table>')
TOKENS_UNCOUNTED = Template('<section id="tokens"><h2>Tokens used</h2>\n<p>$note</p></section>')
TOKEN_ROW = Template('<tr data-key="$key"><td>$first</td><td>$second</td><td>$third</td><td>$input</td>'
                     '<td>$cached</td><td>$output</td><td>$cost</td></tr>')


class ReportHtml(str):
    """Markup a report builder made with _fill() or _join(): its values are escaped already."""


def _markup(value: object) -> ReportHtml:
    """The one place a value becomes markup: escaped, unless it is a builder's ReportHtml."""
    return value if isinstance(value, ReportHtml) else ReportHtml(html.escape(str(value), quote=True))


def _fill(template: Template, **values: object) -> ReportHtml:
    return ReportHtml(template.substitute({name: _markup(value) for name, value in values.items()}))


def _join(parts: Iterable[object], separator: str = "\n") -> ReportHtml:
    return ReportHtml(separator.join(_markup(part) for part in parts))


def _verdict_of(outcome: str | None) -> str:
    """The REPORT_COLOURS key of a turn's outcome ('APPROVED (not counted)' -> 'APPROVED')."""
    word = (outcome or "").split(" ")[0]
    return word if word in REPORT_COLOURS else ("" if not outcome else "MISSING")


def _seconds_since(start: str, when: str) -> float | None:
    begin, end = parse_utc_iso(start), parse_utc_iso(when)
    return (end - begin).total_seconds() if begin and end else None


def local_time(iso: str) -> str:
    """'2026-11-25 09:13:29 CET': a time of the run record (ISO, UTC) in this machine's zone, for a person."""
    moment = parse_utc_iso(iso)
    return moment.astimezone().strftime("%Y-%m-%d %H:%M:%S %Z") if moment else (iso or "-")


def report_duration(seconds: float | None) -> str:
    """A span on the page: duration_text's '2m 55s', '45s', with a tenth of a second below ten seconds."""
    if seconds is None:
        return "-"
    return f"{max(0.0, seconds):.1f}s" if seconds < 10 else duration_text(seconds)


# The page is written after every prompt and reply: a kept file is read again only when it changed.
_kept_texts: dict[Path, tuple[tuple[int, int], str]] = {}    # path -> ((mtime_ns, size), the text shown)


def _kept_text(name: str) -> str:
    """A prompt or reply kept in the run's folder, for the report ('' when it is not there)."""
    if not name or not run_dir:
        return ""
    path = Path(run_dir) / name
    try:
        stat = path.stat()
        stamp = (stat.st_mtime_ns, stat.st_size)
        if path in _kept_texts and _kept_texts[path][0] == stamp:
            return _kept_texts[path][1]
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    if len(text) > REPORT_TEXT_LIMIT:
        text = text[:REPORT_TEXT_LIMIT] + "\n[... cut here in the report]"
    _kept_texts[path] = (stamp, text)
    return text


def _with_code(text: str) -> ReportHtml:
    """A line with its `code spans` shown as code."""
    parts = CODE_SPAN.split(text)
    return _join((_fill(CODE, text=part) if index % 2 else part for index, part in enumerate(parts)), "")


def _tokens_figure(summary: dict) -> list[tuple[str, str]]:
    """The run's tokens as a figure; none where its CLIs record none (the tokens section says so, once)."""
    if tokens_not_counted(summary):
        return []
    unknown = summary["tokens_unknown_turns"]
    return [("tokens", tokens_text(tokens_from_json(summary["tokens"]))
             + (f" ({unknown} turn(s) unknown)" if unknown and summary["tokens"] else ""))]


def _figures(summary: dict) -> ReportHtml:
    """The run's facts: its times, exit code, size, where it ran, and links to its own files."""
    ended = summary["exit_code"] is not None
    figures = [("started", local_time(summary["started_at"])),
               ("ended" if ended else "last updated", local_time(summary["ended_at"])),
               ("wall time", f"{report_duration(summary['wall_seconds'])}, from the agents' start (their "
                             "start-up not counted)")]
    if ended:
        meaning = EXIT_MEANINGS.get(summary["exit_code"])
        if summary["result"] == "FAIL" and not terminals_exited:
            meaning = (f"{meaning}; to go on: {go_on_command(summary['rounds'], True)}" if no_progress_stop else
                       "no PASS within MAX_ROUNDS; to go on with more rounds: "
                       f"{continue_command(summary['rounds'] + 1)}")
        figures.append(("exit code", f"{summary['exit_code']}" + (f" ({meaning})" if meaning else "")))
    if summary["verifications"]:
        last = summary["verifications"][-1]
        how = "timed out" if last["exit_code"] is None else f"exited {last['exit_code']}"
        figures.append(("verified", f"{'yes' if summary['verified'] else 'no'}: PROJECT_TEST_CMD {how} in "
                                    f"round {last['round']} ({len(summary['verifications'])} check(s))"))
    figures += [("rounds", f"{summary['rounds']} of {summary['max_rounds']}"),
                ("turns", f"{summary['turns']} answered, {summary['prompts_sent']} prompts sent"),
                ("agent time", report_duration(summary["agent_seconds"])),
                *_tokens_figure(summary),
                ("bytes", f"{summary['prompt_bytes']:,} sent, {summary['reply_bytes']:,} received"),
                ("providers", ", ".join(sorted(set(summary["providers"].values())))),
                *[("fallback CLI", record_from_json(CliSwitch, w).text()) for w in summary["cli_switches"]],
                ("session", summary["session_name"] or "-"), ("project", summary["wd"]),
                ("state file", summary["state_file"]), *_run_files_figure(summary["run_dir"])]
    return _join(_fill(FIGURE, name=name, value=value) for name, value in figures)


def _run_files_figure(folder: str) -> list[tuple[str, ReportHtml]]:
    """Links to the run's own files beside the page (relative, so the folder can move), those that are there, as
    a figure (none when none is)."""
    there = [name for name in REPORT_RUN_FILES if folder and (Path(folder) / name).is_file()]
    return [("run files", _join((_fill(LINK, href=name, text=name) for name in there), ", "))] if there else []


def _outcome(summary: dict, replies: list[str]) -> ReportHtml:
    """The test the run must pass and the tester's last word on it, shown open near the result."""
    blocks = [_fill(SCENARIO_BLOCK, text=_with_code(summary["scenario_test"]))] if summary["scenario_test"] else []
    answered = [number for number, turn in enumerate(summary["turn_list"], 1)
                if turn["role"] == "tester" and replies[number - 1]]
    if answered:
        number = answered[-1]
        turn = summary["turn_list"][number - 1]
        what = f"{turn.get('outcome') or 'no result'} in round {turn['round']}"
        evidence = extract_test_evidence(replies[number - 1], uncapped=True)
        blocks.append(_fill(EVIDENCE_BLOCK, what=what, text=evidence, number=number))
    else:
        blocks.append(_fill(NO_EVIDENCE, text="The tester has not answered yet."))
    return _join(blocks + [_no_progress(summary)])


def _no_progress(summary: dict) -> ReportHtml:
    """A stop without progress: its line, and the first and the last of the repeated failures side by side."""
    stop = summary["no_progress_stop"]
    rounds = {r["round"]: r for r in summary["failed_rounds"]}
    if not stop or stop["first_round"] not in rounds or stop["round"] not in rounds:
        return ReportHtml("")
    changed = [f"round {r['round']}: {files_text(r['files'])}" for r in summary["failed_rounds"]
               if stop["first_round"] < r["round"] <= stop["round"]]
    line = (f"The test failed at the same step in rounds {stop['first_round']} to {stop['round']} "
            f"({counted(stop['rounds'], 'round')} in a row without progress): {stop['step']} -- "
            f"{'; '.join(changed)}. About {counted(stop['turns_saved'], 'turn')} not spent.")
    return _fill(NO_PROGRESS_BLOCK, line=line, first=stop["first_round"], last=stop["round"],
                 before=rounds[stop["first_round"]]["evidence"], after=rounds[stop["round"]]["evidence"])


def _agent_events(events: list[dict]) -> ReportHtml:
    """What happened to the agents' conversations and accounts (compacted, cleared, a usage limit), if anything."""
    if not events:
        return ReportHtml("")
    items = (_fill(AGENT_EVENT, what=e["what"], at=local_time(e["at"]), role=e["role"], terminal=e["terminal"],
                   detail=f" -- {e['detail']}" if e["detail"] else "") for e in events)
    return _fill(AGENT_EVENTS, items=_join(items))


def turn_cuts(turn: dict, summary: dict) -> list[dict]:
    """The interruptions (run_interruptions()) that cut the turn: a stop (or, for a killed invocation, the
    resume) between its first send and its reply (or the page's moment, for a turn still unanswered)."""
    sent, taken = parse_utc_iso(turn["sent_at"]), parse_utc_iso(turn["taken_at"] or summary["ended_at"])
    if sent is None or taken is None:
        return []
    return [cut for cut in summary.get("interruptions", [])
            if (at := parse_utc_iso(cut["stopped_at"] or cut["resumed_at"])) is not None and sent <= at <= taken]


def cut_text(cut: dict) -> str:
    """'cut by a stop at 2026-11-25 09:13:29 CET (exit 143: terminated by SIGTERM); went on at ...'."""
    if cut["stopped_at"]:
        code = cut["exit_code"]
        why = f"exit {code}: {EXIT_MEANINGS[code].split(';')[0]}" if code in EXIT_MEANINGS else f"exit {code}"
        text = f"cut by a stop at {local_time(cut['stopped_at'])} ({why})"
    else:
        text = "cut: its invocation was killed (no word from it)"
    return text + (f"; went on at {local_time(cut['resumed_at'])}" if cut["resumed_at"] else "; not taken up yet")


def _cut_marks(cuts: list[dict], start: str, begin: float, end: float) -> ReportHtml:
    """Each cut of a turn on its bar: hatched from the stop to where the run went on, in per cent of the bar."""
    length = max(end - begin, 1e-9)
    marks = []
    for cut in cuts:
        stop = _seconds_since(start, cut["stopped_at"] or cut["resumed_at"]) or begin
        resume = _seconds_since(start, cut["resumed_at"]) if cut["resumed_at"] else end
        left = min(max(0.0, (stop - begin) / length), 1.0)
        width = min(max(0.0, ((resume or stop) - stop) / length), 1.0 - left)
        marks.append(_fill(CUT_MARK, code="" if cut["exit_code"] is None else cut["exit_code"],
                           left=f"{100 * left:.2f}", width=f"{100 * width:.2f}", title=cut_text(cut)))
    return _join(marks, "")


def _bar(number: int, turn: dict, begin: float, end: float, span: float, cuts: ReportHtml, cut: str) -> ReportHtml:
    """A turn's bar on its role's lane: from its send to its reply (or to now), in per cent of the span; where
    an interruption cut it, marked (`cut`: the cuts' words)."""
    verdict = _verdict_of(turn.get("outcome"))
    return _fill(BAR, number=number, verdict=verdict, colour=REPORT_COLOURS[verdict], cut="1" if cut else "",
                 left=f"{100 * begin / span:.2f}", width=f"{max(0.4, 100 * (end - begin) / span):.2f}",
                 title=f"{number}: {turn['role']}, round {turn['round']}, {turn.get('outcome') or ''}"
                       + (f", model {turn['model']}" if turn.get("model") else "") + (f"; {cut}" if cut else ""),
                 cuts=cuts)


def _gate_ends(summary: dict, start: str) -> list[float]:
    """When each gate was decided (a gate still waiting: the page's moment), in seconds from the run's start."""
    return [_seconds_since(start, gate["at"] or summary["ended_at"]) or 0.0 for gate in summary.get("gates", [])]


def _gate_lane(summary: dict, start: str, span: float) -> ReportHtml:
    """APPROVE: the person's lane, a bar per gate from its reaching to its decision (or to now, still waiting)."""
    bars = []
    for gate in summary["gates"]:
        begin = max(0.0, _seconds_since(start, gate["since"]) or 0.0)
        end = max(begin, _seconds_since(start, gate["at"] or summary["ended_at"]) or begin)
        decided = VERDICTS.get(gate["verdict"], "waiting")
        colour = REPORT_COLOURS[{"approved": "APPROVED", "rejected": "FAIL"}.get(decided, "unanswered")]
        bars.append(_fill(GATE_BAR, gate=gate["gate"], verdict=decided, colour=colour, left=f"{100 * begin / span:.2f}",
                          width=f"{max(0.4, 100 * (end - begin) / span):.2f}",
                          title=f"the {gate['gate']} gate, round {gate['round']}: {decided}"
                                + (f" by {gate['by']}" if gate["by"] else "") + (f": {gate['words']}" if gate["words"] else "")))
    return _fill(LANE, role="person", bars=_join(bars, ""))


TIMELINE_GAP_SHARE = 0.1      # a start-up that takes this share of the timeline is labelled


def _timeline(summary: dict) -> dict[str, ReportHtml | str]:
    """One lane per role with a bar per turn, placed by when it was sent and answered; the legend of the
    verdicts that occur; the span the lanes cover."""
    turns = summary["turn_list"]
    start = summary["started_at"] or (turns[0]["sent_at"] if turns else "")
    ends = [_seconds_since(start, t["taken_at"] or summary["ended_at"]) or 0.0 for t in turns]
    span = max([1.0, *ends, *_gate_ends(summary, start)])
    bars: dict[str, list[ReportHtml]] = {role: [] for role in ROLES}
    for number, turn in enumerate(turns, 1):
        if turn["role"] in bars:
            begin = max(0.0, _seconds_since(start, turn["sent_at"]) or 0.0)
            cuts = turn_cuts(turn, summary)
            bars[turn["role"]].append(_bar(number, turn, begin, ends[number - 1], span,
                                           _cut_marks(cuts, start, begin, ends[number - 1]),
                                           "; ".join(map(cut_text, cuts))))
    lanes = _join(_fill(LANE, role=role, bars=_join(role_bars, "")) for role, role_bars in bars.items())
    if summary.get("gates"):
        lanes = _join([lanes, _gate_lane(summary, start, span)], "")
    axis = f"0 (the run's start) to {report_duration(span)}"
    first = _seconds_since(start, turns[0]["sent_at"]) if turns else None
    if first is not None and first >= TIMELINE_GAP_SHARE * span:
        axis += (f"; the first prompt went out {report_duration(first)} in: before it, the agents were started "
                 "(and an earlier run's, if this run replaced one, ended)")
    return {"lanes": lanes, "legend": _legend(turns), "axis": axis}


def _legend(turns: list[dict]) -> ReportHtml:
    """The colours of the verdicts that occur in the run, in REPORT_COLOURS' order."""
    seen = {_verdict_of(turn.get("outcome")) for turn in turns}
    return _join((_fill(LEGEND_ENTRY, verdict=name, colour=colour, name=name or "author turn")
                  for name, colour in REPORT_COLOURS.items() if name in seen), "")


def _turn_details(summary: dict, prompts: list[str], replies: list[str]) -> ReportHtml:
    """Every turn, collapsed: what it was (and where an interruption cut it), its prompt and its reply."""
    details = []
    for number, turn in enumerate(summary["turn_list"], 1):
        where = f"round {turn['round']}, {turn['phase']} phase" + (f", cycle {turn['cycle']}" if turn["cycle"] else "")
        extra = "".join(f", {turn[key]} {key}" for key in ("reminders", "resends") if turn[key])
        took = report_duration(turn["seconds"]) if turn["seconds"] is not None else "no reply yet"
        extra += f"; {turn['provider']}" if turn.get("provider") else ""
        extra += f"; model {turn['model']}" if turn.get("model") else ""
        extra += "".join(f"; {cut_text(cut)}" for cut in turn_cuts(turn, summary))
        label = f"{number:03d} {turn['role']}: {where}; {took}; {turn.get('outcome') or 'no verdict'}{extra}"
        details.append(_fill(TURN_DETAIL, number=number, label=label, prompt_bytes=f"{turn['prompt_bytes']:,}",
                             sent=local_time(turn["sent_at"]), prompt=prompts[number - 1],
                             reply_bytes=f"{turn['reply_bytes']:,}", reply=replies[number - 1],
                             taken=local_time(turn["taken_at"]) if turn["taken_at"] else "-"))
    return _join(details)


def _token_cells(tokens: dict | None, cost: float | None) -> dict[str, str]:
    """A row's figures: its tokens (or 'unknown') and its cost ('-' without prices)."""
    cells = {name: f"{tokens[key]:,}" if tokens else "unknown"
             for name, key in (("input", "input"), ("cached", "cached_input"), ("output", "output"))}
    return {**cells, "cost": f"{cost:.4f}" if cost is not None else "-"}


def _tokens_section(summary: dict) -> ReportHtml:
    """Tokens per answered turn and per role, with the run's total and the estimated cost where MODEL_PRICES
    prices them; one line where the CLIs record none."""
    not_counted = tokens_not_counted(summary)
    if not_counted:
        return _fill(TOKENS_UNCOUNTED, note=f"Not counted: {not_counted}.")
    answered = [(number, turn) for number, turn in enumerate(summary["turn_list"], 1)
                if turn.get("outcome") != "unanswered"]
    turn_rows = [_fill(TOKEN_ROW, key=f"turn-{number}", first=_fill(LINK, href=f"#turn-{number}", text=number),
                       second=turn["role"], third=turn["round"], **_token_cells(turn["tokens"], turn["cost"]))
                 for number, turn in answered]
    totals = {"role": [(role, figures) for role, figures in summary["roles"].items() if figures["turns"]]
              + [("run", summary)], "cli": list(summary["clis"].items())}
    tables = [_fill(TOKEN_TABLE, per="turn", first="turn", second="role", third="round", rows=_join(turn_rows))]
    tables += [_fill(TOKEN_TABLE, per=per, first="turns", second="role" if per == "role" else "CLI", third="unknown",
                     rows=_join(_fill(TOKEN_ROW, key=f"{per}-{name}", first=figures["turns"], second=name,
                                      third=figures["tokens_unknown_turns"] or "",
                                      **_token_cells(figures["tokens"], figures["cost"])) for name, figures in rows))
               for per, rows in totals.items()]
    prices = "cost estimated from MODEL_PRICES" if summary["model_prices"] else "no cost shown: MODEL_PRICES is not set"
    note = (f"As the agents' CLIs recorded them; input leaves out cached input; output includes reasoning; {prices}.")
    return _fill(TOKENS_SECTION, note=note, tables=_join(tables))


def report_html(summary: dict) -> str:
    """report.html: the task, the result, the run's facts and files, a timeline lane per role and every turn's
    prompt and reply, in one file; it reloads itself every REPORT_RELOAD_SECONDS while the run goes on."""
    turns = summary["turn_list"]
    prompts = [_kept_text(turn["prompt_file"]) for turn in turns]       # each kept file read once per page
    replies = [_kept_text(turn["reply_file"]) for turn in turns]
    heading = summary["task_heading"] or "orchestrator loop run"
    running = summary["result"] == "RUNNING" and summary["exit_code"] is None
    page = _fill(REPORT_PAGE, result=summary["result"], title=heading.replace("`", ""), scripted=_fill(
                 SCRIPTED_LINE, note=summary["scripted_note"]) if summary["scripted_note"] else "",
                 heading=_with_code(heading), reload_seconds=REPORT_RELOAD_SECONDS if running else 0,
                 figures=_figures(summary),
                 outcome=_outcome(summary, replies), agent_events=_agent_events(summary["agent_events"]),
                 turns=_turn_details(summary, prompts, replies), tokens=_tokens_section(summary),
                 **_timeline(summary))
    return str(page)


def write_report(exit_code: int | None = None, summary: dict | None = None) -> None:
    """Write report.html into the run's folder after every prompt and reply (at the end, from the summary that
    summary.json keeps, so the two never disagree); a page that cannot be written never stops the run."""
    if not run_dir:
        return
    with suppress(OSError, ValueError):  # ValueError: text the page cannot hold (a lone surrogate from the state)
        write_whole(Path(run_dir) / "report.html", report_html(summary or run_summary(exit_code)))


# -- A person in the loop: APPROVE's gates, the decisions taken there, notes to agents ---------------------------
# Any shell decides (--approve, --reject) or leaves a note (--note) by writing a side file into the run's folder:
# a decision's file is made by a hard link, so the first writer wins and no reader sees half of it. The run takes
# them into its state (`gates`, `person_notes`) and its events; ntfy's buttons reach the same file through the
# waiting run. The whole story: docs/approval.md.

DECISIONS_FOLDER, NOTES_FOLDER = "decisions", "notes"
DECISION_POLL_SECONDS = 1.0          # how often a run waiting at a gate looks for its decision's file
NTFY_POLL_SECONDS = 5.0              # ... and asks the gate's ntfy reply topic
VERDICTS = {"approve": "approved", "reject": "rejected"}
GATE_WHAT = {"plan": "the plan", "commit": "the change that passed the test"}
NOTIFY_TIMEOUT_SECONDS = 5.0


class ApprovalPending(RunError):
    """A gate waits for a person: the run stops with its state saved (exit 6); the same command goes on."""

    def __init__(self, message: str):
        super().__init__(message, EXIT_APPROVAL)


def person_name() -> str:
    """Who decides or leaves a note from this shell, as the run records it."""
    try:
        return os.environ.get("USER") or getpass.getuser()      # else LOGNAME, ..., else the account's name
    except (OSError, KeyError):
        return f"uid {os.getuid()}"


def gate_due(gate: str) -> bool:
    """Whether APPROVE names the gate."""
    return gate in (word.strip() for word in APPROVE.split(","))


def write_first(path: Path, facts: dict) -> bool:
    """Write a JSON side file whole, unless one is there already (a hard link fails on a name taken): True if this
    writer was the first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    write_whole(temporary, json.dumps(facts, ensure_ascii=False))
    try:
        os.link(temporary, path)
        return True
    except FileExistsError:
        return False
    finally:
        temporary.unlink(missing_ok=True)


def _json_file(path: Path) -> dict:
    """A side file's or a CLI's settings file's JSON object ({} when it is missing, cannot be read or is not an
    object: a side file then counts as not written); whole-line // comments, which some CLIs write (Copilot's
    config.json), are passed over."""
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(re.sub(r"(?m)^[ \t]*//.*$", "", text) if "//" in text else text)
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def decision_path(folder: str, gate_id: str) -> Path:
    return Path(folder) / DECISIONS_FOLDER / f"{gate_id}.json"


def read_decision(folder: str, gate_id: str) -> dict | None:
    """The decision written for a gate (verdict, by, at, words), or None while there is none."""
    raw = _json_file(decision_path(folder, gate_id))
    if raw.get("verdict") not in VERDICTS:
        return None
    return {key: _text(raw.get(key)) for key in ("verdict", "by", "at", "words")}


def pending_gate(saved_gates: list[Gate]) -> Gate | None:
    """The gate that waits for a decision: the last one reached, if not decided yet."""
    return saved_gates[-1] if saved_gates and not saved_gates[-1].verdict else None


def ntfy_call(method: str, path: str, what: str, say: Callable[[str], None] = log, sent: str = "", **request: Any):
    """One request to NTFY_SERVER (NTFY_TOKEN as a bearer token); the answer (`sent` said in the log), or None
    with one line said of why. A server down or refusing is never the run's problem."""
    url = f"{NTFY_SERVER.rstrip('/')}/{path}"
    headers = dict(request.pop("headers", {}), **({"Authorization": f"Bearer {NTFY_TOKEN}"} if NTFY_TOKEN else {}))
    try:
        response = httpx.request(method, url, headers=headers, timeout=NOTIFY_TIMEOUT_SECONDS, **request)
    except (httpx.HTTPError, httpx.InvalidURL, OSError) as exc:
        say(f"notify: could not send {what} to {url} ({exc.__class__.__name__}: {exc or 'no answer'}); check "
            "NTFY_SERVER and the network")
        return None
    if response.status_code >= 300:
        hint = " (check NTFY_TOKEN)" if response.status_code in (401, 403) else ""
        say(f"notify: {url} refused {what}: HTTP {response.status_code} {response.text.strip()[:200]}{hint}")
        return None
    if sent:
        log(sent)
    return response


def gate_commands() -> str:
    """How a person decides a gate, from any shell."""
    config = f" {config_argument}" if config_argument else ""
    return f'`{command_name()} --approve{config}` or `{command_name()} --reject "why"{config}`'


def announce_gate(gate: Gate, waiting: list[str]) -> bool:
    """NTFY_TOPIC: one message of what waits, with Approve and Reject buttons that publish to the gate's own reply
    topic (a random name: on a public server the name is the key). True if it went out."""
    target = f"{NTFY_SERVER.rstrip('/')}/{gate.reply_topic}"
    actions = [{"action": "http", "label": label, "url": target, "method": "POST", "body": verdict, "clear": True}
               for label, verdict in (("Approve", "approve"), ("Reject", "reject"))]
    message = {"topic": NTFY_TOPIC, "title": f"Approve {GATE_WHAT[gate.gate]}? Round {gate.round}: {task_title()}",
               "message": "\n".join([*waiting, f"Or from a shell: {gate_commands()}"])[-3000:], "priority": 4, "tags": ["raised_hand"], "actions": actions}
    return ntfy_call("POST", "", f"the {gate.gate} gate's message", json=message, sent=f"notify: the {gate.gate} "
                     f"gate's message, with Approve and Reject buttons, sent to topic {NTFY_TOPIC}") is not None


def ntfy_decision(gate: Gate, say: Callable[[str], None]) -> dict | None:
    """The first decision published to the gate's reply topic ('approve', or 'reject' and words), as a decision."""
    response = ntfy_call("GET", f"{gate.reply_topic}/json", "a poll of the gate's reply topic", say,
                         params={"poll": "1", "since": "all"})
    for line in response.text.splitlines() if response is not None else []:
        with suppress(ValueError):
            message = json.loads(line)
            word, _, words = str(message.get("message", "")).strip().partition(" ")
            if message.get("event") == "message" and word.lower() in VERDICTS:
                when = message.get("time")
                return {"verdict": word.lower(), "by": "ntfy", "at": utc_iso(when if isinstance(when, int) else None),
                        "words": words.strip() or ("rejected from ntfy" if word.lower() == "reject" else "")}
    return None


def gate_stop_line(gate: Gate) -> str:
    """The last line of a run stopped at a gate (exit 6): which, since when, how to decide and go on."""
    return (f"stopped at the {gate.gate} gate: waiting for your approval of {GATE_WHAT[gate.gate]} since "
            f"{gate.since}; decide with {gate_commands()}, then run the same command to go on")


def wait_for_decision(gate: Gate, waiting: list[str]) -> dict:
    """Wait in place, the agents idle, for the gate's decision: its file, or (NTFY_TOPIC) its reply topic. Past
    APPROVAL_MAX_WAIT (at once with 0): ApprovalPending, the state saved."""
    log(f"waiting for your approval of {GATE_WHAT[gate.gate]} (round {gate.round}, since {gate.since}): decide "
        f"with {gate_commands()}" + (f", or with the buttons of the ntfy message" if gate.reply_topic else ""))
    for line in waiting:
        log_detail(line)
    if gate.reply_topic and not gate.announced:
        gate.announced = announce_gate(gate, waiting)
        save_state()
    deadline, next_poll = time.monotonic() + APPROVAL_MAX_WAIT, time.monotonic()
    while True:
        decision = read_decision(run_dir, gate.id)
        if decision is None and gate.reply_topic and time.monotonic() >= next_poll:
            heard = ntfy_decision(gate, lambda line: say_once(f"the poll of {gate.id}", line))   # not every poll
            if heard is not None:
                write_first(decision_path(run_dir, gate.id), heard)     # the file decides: first writer wins
                decision = read_decision(run_dir, gate.id)
            next_poll = time.monotonic() + NTFY_POLL_SECONDS
        if decision is not None:
            return decision
        if time.monotonic() >= deadline:
            raise ApprovalPending(gate_stop_line(gate))
        time.sleep(max(0.0, min(DECISION_POLL_SECONDS, deadline - time.monotonic())))


def open_gate(gate: str) -> Gate:
    """A gate reached: recorded in the state (saved by the caller with the run's position) and the events."""
    record = Gate(id=f"{gate}-{len(gates) + 1}-{secrets.token_hex(4)}", gate=gate, round=current_round,
                  since=utc_iso(), reply_topic=f"cao-loop-{secrets.token_hex(12)}" if NTFY_TOPIC else "")
    update_run(gates=gates + [record])
    record_event("gate_reached", gate=gate, id=record.id, round=current_round)
    return record


def decide_gate(gate: Gate, decision: dict) -> None:
    """The decision taken into the gate's record, the events and the log (the caller acts on it and saves)."""
    gate.verdict, gate.by, gate.at, gate.words = (decision[key] for key in ("verdict", "by", "at", "words"))
    record_event("gate_decided", gate=gate.gate, id=gate.id, round=gate.round, verdict=gate.verdict, by=gate.by,
                 decided_at=gate.at, words=gate.words)
    log(f"{GATE_WHAT[gate.gate]} {VERDICTS[gate.verdict]} by {gate.by}" + (f": {gate.words}" if gate.words else ""))


def take_notes() -> None:
    """The notes left in the run's folder since the last look, into the state, in the order they were left."""
    known = {note.id for note in person_notes}
    folder = Path(run_dir) / NOTES_FOLDER if run_dir else None
    for path in sorted(folder.glob("*.json")) if folder is not None and folder.is_dir() else []:
        raw = _json_file(path)
        if path.stem in known or raw.get("role") not in ROLES or not _text(raw.get("text")).strip():
            continue
        note = PersonNote(path.stem, raw["role"], raw["text"].strip(), _text(raw.get("by")), _text(raw.get("at")))
        update_run(person_notes=person_notes + [note])
        record_event("note_taken", id=note.id, role=note.role, by=note.by, left_at=note.at, text=note.text)
        log(f"a note from {note.by or 'a person'} for the {note.role}: its next prompt carries it")


def notes_due(role: str) -> list[PersonNote]:
    """The role's notes no prompt has carried yet (a prompt that reached its terminal marks them, as once-only
    blocks are marked)."""
    take_notes()
    return [note for note in person_notes if note.role == role and not note.carried]


# ==========================================================================
# 5. Tokens used: the CLIs' own records
# ==========================================================================
# Each CLI records what its responses cost in its own format (its row's `records`; each format's facts are in
# docs/agent-clis.md). The loop only reads them, where they are on this machine; what it cannot read is unknown,
# never 0. A turn's records are those of the sessions that name its response file, from its first send up to the
# role's next send, each response once by its id (a session's records can span files, and be copied).
RECORD_LOOKBACK_SECONDS = 120.0   # a long session is read from this long before the turn's first send


@dataclass(frozen=True)
class TokenReading:
    """What a CLI's records say of one turn: each model's tokens, whether the CLI has recorded the end of its
    turn, and how full the agent's context was at its last response (what its CLI weighs to compact)."""

    by_model: dict[str, TokenUse]
    over: bool = True
    context: int | None = None
    ended_at: float | None = None      # when the CLI recorded the end of the turn (time.time()), once it is over
    model: str = ""                    # the model its last response named ('' when its record does not say)


class _Responses:
    """The responses found in a turn's window, each once by its id, and when the last one and the CLI's
    last end-of-turn record were written."""

    def __init__(self) -> None:
        self.found: dict[object, tuple[str, TokenUse]] = {}
        self.last_response: datetime | None = None
        self.last_end: datetime | None = None
        self.last_key: object = None

    def add(self, key: object, model: str, use: TokenUse, moment: datetime) -> None:
        """A response; one already found keeps the larger output (Claude's early lines may hold 1)."""
        if key not in self.found or use.output > self.found[key][1].output:
            self.found[key] = (model, use)
        if self.last_response is None or moment >= self.last_response:
            self.last_key = key
        self.last_response = max(moment, self.last_response or moment)

    def end_of_turn(self, moment: datetime) -> None:
        self.last_end = max(moment, self.last_end or moment)

    def reading(self, pending: bool = False) -> TokenReading | None:
        """The sum by model; None when no response was found (unknown, not 0)."""
        if not self.found:
            return None
        over = not pending and self.last_end is not None and self.last_end >= self.last_response
        last_model, last_use = self.found[self.last_key]
        return TokenReading(add_tokens(*({model: use} for model, use in self.found.values())), over,
                            last_use.total, self.last_end.timestamp() if over else None, last_model)


def _token_count(value: object) -> int | None:
    """A token count as the CLIs write it: a whole number, never negative (None for anything else)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return max(value, 0)


class ParsedLines:
    """JSONL record lines, each parsed once (None for a line that is not a JSON object): the wait reads a long
    session's records every half second. Up to `limit` characters are kept, then the memory starts over."""

    def __init__(self, limit: int) -> None:
        self.limit, self.chars, self.records = limit, 0, {}

    def get(self, line: str) -> dict | None:
        if line not in self.records:
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):
                record = None
            if self.chars + len(line) > self.limit:
                self.records, self.chars = {}, 0
            self.records[line] = record if isinstance(record, dict) else None
            self.chars += len(line)
        return self.records[line]


PARSED_LINES = ParsedLines(32_000_000)


def _json_records(lines: Iterable[str]) -> Iterator[dict]:
    """The JSON objects of a JSONL transcript. A malformed line is skipped, and so is a last line the CLI
    is still writing: it reads whole on a later call."""
    for line in lines:
        record = PARSED_LINES.get(line)
        if record is not None:
            yield record


def _within(moment: datetime | None, since: datetime, until: datetime) -> bool:
    """Whether a record's time falls in a turn's window (both ends included; since and until are aware)."""
    return moment is not None and moment.tzinfo is not None and since <= moment <= until


def _token_use(usage: dict, input_key: str, output_key: str, cached_key: str, written_key: str = "") -> TokenUse | None:
    """A response's tokens from its record's usage counts (None without whole input and output counts). A CLI
    that counts cache writes apart (`written_key`: Claude Code) leaves the cache out of its input count; the
    others count the part read from the cache (`cached_key`) in it, and it is taken out."""
    prompt, output = _token_count(usage.get(input_key)), _token_count(usage.get(output_key))
    if prompt is None or output is None:
        return None
    cached = _token_count(usage.get(cached_key)) or 0
    if written_key:
        return TokenUse(prompt + (_token_count(usage.get(written_key)) or 0), cached, output)
    return TokenUse(prompt - min(cached, prompt), min(cached, prompt), output)


def _claude_response(record: dict) -> tuple[tuple[str, str], str, TokenUse] | None:
    """The response id, model and tokens a Claude Code transcript line carries; None for other lines, for
    an API error written as a reply (model "<synthetic>") and for usage without its two main numbers."""
    message = record.get("message")
    if record.get("type") != "assistant" or not isinstance(message, dict) or record.get("isApiErrorMessage"):
        return None
    usage, message_id, model = message.get("usage"), message.get("id"), message.get("model")
    if not isinstance(usage, dict) or not isinstance(message_id, str) or not message_id or model == "<synthetic>":
        return None
    use = _token_use(usage, "input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    request_id = record.get("requestId") if isinstance(record.get("requestId"), str) else ""
    return None if use is None else ((message_id, request_id), model if isinstance(model, str) else "", use)


def _jsonl_usage(records: Iterable[dict], since: datetime, until: datetime,
                 response: Callable[[dict], tuple | None], turn_ends: Callable[[dict], bool]) -> TokenReading | None:
    """The responses (id, model, tokens) of JSONL records timed within the window, and the turn's end."""
    responses = _Responses()
    for record in records:
        moment = parse_utc_iso(record["timestamp"]) if isinstance(record.get("timestamp"), str) else None
        if not _within(moment, since, until):
            continue
        if turn_ends(record):
            responses.end_of_turn(moment)
        found = response(record)
        if found is not None:
            responses.add(*found, moment)
    return responses.reading()


def claude_usage(lines: Iterable[str], since: datetime, until: datetime) -> TokenReading | None:
    """Tokens of the Claude Code responses whose transcript lines are timed within the window, each response
    once with its largest output; a turn ends with a turn_duration line."""
    return _jsonl_usage(_json_records(lines), since, until, _claude_response,
                        lambda record: record.get("type") == "system" and record.get("subtype") == "turn_duration")


def _codex_response(record: dict, models: dict[str, str]) -> tuple[str, str, TokenUse] | None:
    """The response id, model (its turn's, in `models`) and tokens of a Codex token_usage_record line (None
    for other lines): only these count, the other lines repeat them."""
    payload = record.get("payload")
    if record.get("type") != "token_usage_record" or not isinstance(payload, dict):
        return None
    usage, response_id = payload.get("usage"), payload.get("response_id")
    if not isinstance(usage, dict) or not isinstance(response_id, str) or not response_id:
        return None
    use = _token_use(usage, "input_tokens", "output_tokens", "cached_input_tokens")
    return None if use is None else (response_id, models.get(_text(payload.get("turn_id")), ""), use)


def _payload(record: dict) -> dict:
    """A Codex line's payload ({} when it has none)."""
    return record["payload"] if isinstance(record.get("payload"), dict) else {}


def codex_usage(lines: Iterable[str], since: datetime, until: datetime) -> TokenReading | None:
    """Tokens of the Codex responses in rollout lines timed within the window, each response_id once, with
    the model its turn_context line names; a turn ends with a task_complete event."""
    records = list(_json_records(lines))
    models = {_text(_payload(record).get("turn_id")): _payload(record)["model"] for record in records
              if record.get("type") == "turn_context" and isinstance(_payload(record).get("model"), str)}
    return _jsonl_usage(records, since, until, lambda record: _codex_response(record, models),
                        lambda record: record.get("type") == "event_msg"
                        and _payload(record).get("type") in ("task_complete", "turn_aborted"))


def _copilot_response(record: dict) -> tuple[str, str, TokenUse] | None:
    """The event id, model and tokens of a Copilot CLI session.usage_record event (None for other events).
    Its inputTokens counts the whole prompt, the part read from the cache (cacheReadTokens) included."""
    data = record.get("data") if isinstance(record.get("data"), dict) else {}
    usage = data.get("usage") if isinstance(data.get("usage"), dict) else None
    if record.get("type") != "session.usage_record" or usage is None:
        return None
    use = _token_use(usage, "inputTokens", "outputTokens", "cacheReadTokens")
    return None if use is None else (_text(record.get("id")), _text(usage.get("model")), use)


def copilot_usage(lines: Iterable[str], since: datetime, until: datetime) -> TokenReading | None:
    """Tokens of the Copilot CLI responses whose session.usage_record events are timed within the window,
    each event once; a task ends with session.task_complete (CAO starts it in autopilot)."""
    return _jsonl_usage(_json_records(lines), since, until, _copilot_response,
                        lambda record: record.get("type") == "session.task_complete")


def _opencode_message(data: object, since: datetime, until: datetime) -> tuple[str, TokenUse | None, bool]:
    """An OpenCode message row's data: (model, its tokens if it is an assistant message completed within
    the window, whether it is one still in progress, without time.completed, that began in it)."""
    if not isinstance(data, dict) or data.get("role") != "assistant" or not isinstance(data.get("time"), dict):
        return "", None, False
    times, tokens, model = data["time"], data.get("tokens"), _text(data.get("modelID"))
    completed, created = _token_count(times.get("completed")), _token_count(times.get("created"))
    if completed is None:
        began = created is not None and _within(datetime.fromtimestamp(created / 1000, timezone.utc), since, until)
        return model, None, began
    if not isinstance(tokens, dict) or not _within(datetime.fromtimestamp(completed / 1000, timezone.utc),
                                                   since, until):
        return model, None, False
    cache = tokens.get("cache") if isinstance(tokens.get("cache"), dict) else {}
    fresh, output = _token_count(tokens.get("input")), _token_count(tokens.get("output"))
    if fresh is None or output is None:
        return model, None, False
    return model, TokenUse(fresh + (_token_count(cache.get("write")) or 0), _token_count(cache.get("read")) or 0,
                           output + (_token_count(tokens.get("reasoning")) or 0)), False


def opencode_usage(db_path: str | Path, directories: str | Iterable[str], marker: str, since: datetime,
                   until: datetime) -> TokenReading | None:
    """Tokens of the assistant messages completed within the window in the directory's OpenCode sessions
    that name the marker, read-only from its database (None when it cannot be read)."""
    uri = Path(db_path).absolute().as_uri() + "?mode=ro"
    folders = sorted({directories} if isinstance(directories, str) else set(directories))
    # only the rows from a little before the turn on: a long session's earlier rows are neither read nor searched
    begin_ms = int((since.timestamp() - RECORD_LOOKBACK_SECONDS) * 1000)
    try:
        with closing(sqlite3.connect(uri, uri=True, timeout=2.0)) as connection:
            rows = connection.execute(
                "SELECT message.id, message.data FROM message JOIN session ON session.id = message.session_id"
                f" WHERE session.directory IN ({', '.join('?' * len(folders))}) AND message.time_created >= ?"
                " AND EXISTS (SELECT 1 FROM message AS recent JOIN part ON part.message_id = recent.id"
                " WHERE recent.session_id = session.id AND recent.time_created >= ? AND instr(part.data, ?) > 0)",
                (*folders, begin_ms, begin_ms, marker)).fetchall()
    except sqlite3.Error:
        return None
    responses, pending = _Responses(), False
    for message_id, text in rows:
        try:
            data = json.loads(text)
        except (TypeError, ValueError, RecursionError):
            continue
        model, use, in_progress = _opencode_message(data, since, until)
        pending = pending or in_progress
        if use is not None:
            moment = datetime.fromtimestamp(data["time"]["completed"] / 1000, timezone.utc)
            responses.add(message_id, model, use, moment)
            if data.get("finish") not in ("tool-calls", None):
                responses.end_of_turn(moment)
    return responses.reading(pending)


@dataclass(frozen=True)
class HermesRecord:
    """What Hermes's state.db says of the sessions that name a turn's marker."""

    totals: RunningTotals
    last_call: float | None        # when the last of their calls since the turn began was counted
    last_answer: float | None      # when the last assistant message since then that ended a turn was written
    last_model: str = ""           # the model of the calls counted last since the turn began


def hermes_record(db_path: str | Path, marker: str, since: float, named_since: float = 0.0) -> HermesRecord | None:
    """The running totals of the Hermes sessions whose messages since `named_since` name the marker (and of
    the sessions they went on in after a compression), read-only; None when the database cannot be read."""
    uri = Path(db_path).absolute().as_uri() + "?mode=ro"
    try:
        with closing(sqlite3.connect(uri, uri=True, timeout=2.0)) as connection:
            named = "SELECT DISTINCT session_id FROM messages WHERE timestamp >= ? AND instr(content, ?) > 0"
            sessions = f"SELECT id FROM sessions WHERE id IN ({named}) OR parent_session_id IN ({named})"
            usage = connection.execute(
                "SELECT session_id, model, input_tokens, cache_write_tokens, cache_read_tokens, output_tokens,"
                f" last_seen FROM session_model_usage WHERE task = '' AND session_id IN ({sessions})",
                (named_since, marker, named_since, marker)).fetchall()
            [(last_answer,)] = connection.execute(
                f"SELECT max(timestamp) FROM messages WHERE session_id IN ({sessions}) AND role = 'assistant'"
                " AND finish_reason IS NOT NULL AND finish_reason != 'tool_calls' AND timestamp >= ?",
                (named_since, marker, named_since, marker, since)).fetchall()
    except (sqlite3.Error, ValueError):
        return None
    totals: RunningTotals = {}
    last_call, last_model = None, ""
    for session, model, fresh, written, read, output, seen in usage:
        counts = [_token_count(value) for value in (fresh, written, read, output)]
        if not isinstance(session, str) or None in counts:
            continue
        totals[session] = add_tokens(totals.get(session), {_text(model): TokenUse(counts[0] + counts[1], *counts[2:])})
        if isinstance(seen, (int, float)) and seen >= since and seen >= (last_call or seen):
            last_call, last_model = seen, _text(model)
    return HermesRecord(totals, last_call, last_answer if isinstance(last_answer, (int, float)) else None,
                        last_model)


def totals_grown(now: RunningTotals, before: RunningTotals) -> dict[str, TokenUse]:
    """What running totals grew by since `before`, by model (a session begun since counts whole)."""
    used: dict[str, TokenUse] = {}
    for session, models in now.items():
        for model, total in models.items():
            then = before.get(session, {}).get(model, TokenUse())
            grown = TokenUse(max(total.input - then.input, 0), max(total.cached_input - then.cached_input, 0),
                             max(total.output - then.output, 0))
            if grown.total:
                used[model] = used.get(model, TokenUse()) + grown
    return used


def hermes_usage(record: HermesRecord, before: RunningTotals) -> TokenReading | None:
    """A Hermes turn: the sessions' totals less those at the turn's first send; None when nothing was counted
    since and no answer was written."""
    used = totals_grown(record.totals, before)
    if not used and record.last_answer is None:
        return None
    over = record.last_answer is not None and record.last_answer >= (record.last_call or 0.0)
    model = record.last_model if record.last_model in used else next(iter(used)) if len(used) == 1 else ""
    return TokenReading(used, over, ended_at=record.last_answer if over else None, model=model)


# -- Where the records are: in the agents' home (AGENT_HOME, else this process's, where a CLI's own variable moves them)
RECORD_SLACK_SECONDS = 2.0      # a file's modification time may be coarse; only files touched since count


def token_records_readable() -> bool:
    """Whether the agents' records are on this machine: CAO runs here, or AGENT_HOME says where they are."""
    return bool(AGENT_HOME) or urlparse(API).hostname in LOCAL_HOSTS


def tokenless_note(providers: Iterable[str]) -> str:
    """'mock_cli records no tokens': the providers whose CLI keeps no record the loop reads ('' if none), said
    once for a run instead of 'unknown' on every line and table."""
    names = sorted({provider for provider in providers if not agent_cli(provider).records})
    if not names:
        return ""
    listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
    return f"{listed} record{'s' if len(names) == 1 else ''} no tokens"


def _cli_folder(variable: str, *default: str) -> Path:
    """Where a CLI keeps its records: its own variable's folder, else under the agents' home."""
    if not AGENT_HOME and os.environ.get(variable):
        return Path(os.environ[variable]).expanduser()
    return Path(AGENT_HOME or Path.home()).expanduser().joinpath(*default)


def claude_project_folder(cwd: str) -> str:
    """The folder name Claude Code keeps a working directory's transcripts in (~/.claude/projects/<it>; its
    rule is in docs/agent-clis.md)."""
    name = re.sub(r"[^a-zA-Z0-9]", "-", cwd)
    if len(name) <= 200:
        return name
    units = cwd.encode("utf-16-le")                   # JavaScript hashes the path's UTF-16 code units
    digest = 0
    for index in range(0, len(units), 2):
        digest = (digest * 31 + int.from_bytes(units[index:index + 2], "little")) & 0xFFFFFFFF
    number, text = abs(digest - (1 << 32) if digest >= 1 << 31 else digest), ""
    while True:
        number, digit = divmod(number, 36)
        text = "0123456789abcdefghijklmnopqrstuvwxyz"[digit] + text
        if not number:
            return f"{name[:200]}-{text}"


# A long session's file is read from its first line timed RECORD_LOOKBACK_SECONDS before the turn began, found
# once per file and turn by a binary search on the lines' times: a read costs what the turn wrote.
LINE_TIME = re.compile(rb'"timestamp"\s*:\s*"([^"]{10,40})"')
TURN_OFFSETS: dict[tuple[str, int, int, float], int] = {}     # a cache: (file, device, inode, since) -> offset


def _line_time_after(file: BinaryIO, offset: int) -> tuple[float | None, int]:
    """The time of the first timed line that starts at or after `offset` (None at the end of the file), and
    where the first line at or after `offset` starts."""
    file.seek(max(offset - 1, 0))
    if offset > 0:
        file.readline()                                  # the rest of the line `offset` falls in
    start = file.tell()
    for _ in range(64):                                  # lines without a time (a session's header) are skipped
        line = file.readline()
        if not line.endswith(b"\n"):
            return None, start
        found = LINE_TIME.search(line[:4096])
        moment = parse_utc_iso(found.group(1).decode("ascii", "replace")) if found else None
        if moment is not None:
            return moment.timestamp(), start
    return None, start


def turn_offset(path: Path, since: float) -> int:
    """Where a record file's lines from RECORD_LOOKBACK_SECONDS before `since` on begin (0 when unsure)."""
    try:
        info = path.stat()
        key = (str(path), info.st_dev, info.st_ino, since)
        if key in TURN_OFFSETS and TURN_OFFSETS[key] <= info.st_size:
            return TURN_OFFSETS[key]
        target, low, high = since - RECORD_LOOKBACK_SECONDS, 0, info.st_size
        with path.open("rb") as file:
            while high - low > 4096:
                middle = (low + high) // 2
                moment, start = _line_time_after(file, middle)
                if moment is None or moment >= target:
                    high = middle
                else:
                    low = start + 1
            _, offset = _line_time_after(file, low)
    except OSError:
        return 0
    if len(TURN_OFFSETS) > 10_000:
        TURN_OFFSETS.clear()
    TURN_OFFSETS[key] = offset
    return offset


def _file_text(path: Path, since: float | None = None) -> str:
    """A record file's text, from the turn's lines on when `since` is given ('' when it cannot be read: it
    was moved away, or never there)."""
    try:
        with path.open("rb") as file:
            file.seek(turn_offset(path, since) if since is not None else 0)
            return file.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def _texts_naming(paths: Iterable[Path], marker: str, since: float) -> dict[Path, str]:
    """The turn's text of each file written since it began (the only ones that can hold its records) that
    names the marker ('' names any)."""
    texts = {}
    for path in paths:
        with suppress(OSError):
            if path.stat().st_mtime >= since - RECORD_SLACK_SECONDS and marker in (text := _file_text(path, since)):
                texts[path] = text
    return texts


def _jsonl_turn(usage: Callable[[Iterable[str], datetime, datetime], TokenReading | None], texts: Iterable[str],
                since: float, until: float) -> TokenReading | None:
    """What a JSONL reader makes of the turn's texts; None when no file names the turn (its records are not
    there)."""
    lines = [line for text in texts for line in text.splitlines()]
    return usage(lines, *_window(since, until)) if texts else None


def read_claude_turn(marker: str, since: float, until: float, before: object = None) -> TokenReading | None:
    """A Claude Code turn, from the transcripts of its working directory that name the marker, and those
    of the sub-agents (its Task tool) those sessions ran: each keeps its own, in <session>/subagents/."""
    folders = {claude_project_folder(WD), claude_project_folder(os.path.realpath(WD))}
    projects = _cli_folder("CLAUDE_CONFIG_DIR", ".claude") / "projects"
    transcripts = (path for folder in folders for path in (projects / folder).glob("*.jsonl"))
    sessions = _texts_naming(transcripts, marker, since)
    sub_agents = _texts_naming((path for session in sessions
                                for path in (session.with_suffix("") / "subagents").glob("*.jsonl")), "", since)
    return _jsonl_turn(claude_usage, [*sessions.values(), *sub_agents.values()], since, until)


def read_codex_turn(marker: str, since: float, until: float, before: object = None) -> TokenReading | None:
    """A Codex turn, from the rollouts that name the marker, of whatever day their thread began."""
    rollouts = (_cli_folder("CODEX_HOME", ".codex") / "sessions").rglob("rollout-*.jsonl")
    return _jsonl_turn(codex_usage, _texts_naming(rollouts, marker, since).values(), since, until)


def read_copilot_turn(marker: str, since: float, until: float, before: object = None) -> TokenReading | None:
    """A Copilot CLI turn, from the session logs that name the marker: CAO starts it with --config-dir
    ~/.copilot (of the agents' home), where each session keeps its events."""
    logs = Path(AGENT_HOME or Path.home()).expanduser().joinpath(".copilot", "session-state").glob("*/events.jsonl")
    return _jsonl_turn(copilot_usage, _texts_naming(logs, marker, since).values(), since, until)


def read_opencode_turn(marker: str, since: float, until: float, before: object = None) -> TokenReading | None:
    """An OpenCode turn, from the one database all its sessions share (None while there is none)."""
    database = _cli_folder("XDG_DATA_HOME", ".local", "share") / "opencode" / "opencode.db"
    return opencode_usage(database, {WD, os.path.realpath(WD)}, marker, *_window(since, until))


def hermes_database() -> Path:
    """Hermes's state.db: in HERMES_HOME, else ~/.hermes of the agents' home."""
    return _cli_folder("HERMES_HOME", ".hermes") / "state.db"


def hermes_totals_now(marker: str) -> RunningTotals | None:
    """The running totals of the Hermes sessions that name the marker ({} before its first turn: no session
    names it yet, or Hermes has not made its database); None when the database cannot be read."""
    if not hermes_database().is_file():
        return {}
    record = hermes_record(hermes_database(), marker, time.time())
    return None if record is None else record.totals


def read_hermes_turn(marker: str, since: float, until: float, before: RunningTotals | None) -> TokenReading | None:
    """A Hermes turn, from the totals of its sessions less those noted when it was first sent (unknown
    without them: a turn sent by a loop that did not note them)."""
    if before is None:
        return None
    record = hermes_record(hermes_database(), marker, since, since - RECORD_LOOKBACK_SECONDS)   # the turn's prompt on
    return None if record is None else hermes_usage(record, before)


def _window(since: float, until: float) -> tuple[datetime, datetime]:
    """The turn's window as the readers take it: two aware datetimes (UTC)."""
    return datetime.fromtimestamp(since, timezone.utc), datetime.fromtimestamp(until, timezone.utc)


# The formats of the CLIs' records that rows name (AgentCli.records): the one place their readers are bound.
RECORD_FORMATS: dict[str, TokenRecords] = {records.name: records for records in (
    TokenRecords("claude transcripts", read_claude_turn), TokenRecords("codex rollouts", read_codex_turn),
    TokenRecords("opencode database", read_opencode_turn), TokenRecords("copilot session logs", read_copilot_turn),
    TokenRecords("hermes state.db", read_hermes_turn, totals_now=hermes_totals_now))}


def cli_records(provider: str) -> TokenRecords | None:
    """How the loop reads the provider's CLI's turn records: its row's reader, or the format it names (None:
    the loop reads none of its records)."""
    records = agent_cli(provider).records
    return RECORD_FORMATS.get(records) if isinstance(records, str) else records


def tokens_readable(role: str, provider: str = "") -> bool:
    """Whether the loop can read what the role's CLI (or `provider`'s) records: one it knows, its records on
    this machine."""
    return cli_records(provider or provider_for(role)) is not None and token_records_readable()


def record_marker(role: str) -> str:
    """What names the role's turns in its CLI's records: its response file's path, as JSON writes it."""
    return json.dumps(str(response_path(role)), ensure_ascii=False)[1:-1]


def read_records(reader: Callable | None, *args: object):
    """What a reader of a CLI's own files answers; None without a reader, where the agents' records are not
    on this machine, and when its files cannot be read."""
    if reader is None or not token_records_readable():
        return None
    try:
        return reader(*args)
    except (OSError, ValueError):
        return None


def turn_tokens(role: str, since: float, until: float, before: RunningTotals | None = None,
                provider: str = "") -> TokenReading | None:
    """What the role's CLI (`provider`'s: the one that answered the turn) recorded between the two times
    (time.time() values); None when its records cannot be read here or hold nothing of it yet. `before`:
    running totals noted at the turn's first send."""
    records = cli_records(provider or provider_for(role))
    return read_records(records and records.read_turn, record_marker(role), since, until, before)


def turn_tokens_before(role: str) -> RunningTotals | None:
    """As the role's turn is first sent: its CLI's running totals, where its CLI keeps only those (None
    for the others, and where they cannot be read: that turn's tokens are then unknown)."""
    records = cli_records(provider_for(role))
    return read_records(records and records.totals_now, record_marker(role))


# -- Where a CLI compacts its conversation (each CLI's rule: docs/state-and-resume.md) ---------------------
CLAUDE_COMPACT_RESERVE = 33_000     # 20,000 kept for output, 13,000 of margin
CLAUDE_DEFAULT_WINDOW = 200_000
CODEX_DEFAULT_WINDOW = 272_000


def claude_compaction_point() -> int | None:
    """The context size at which Claude Code compacts, from its settings.json; None when it never does."""
    settings = _json_file(_cli_folder("CLAUDE_CONFIG_DIR", ".claude") / "settings.json")
    env = settings.get("env") if isinstance(settings.get("env"), dict) else {}
    if settings.get("autoCompactEnabled") is False or str(env.get("DISABLE_AUTO_COMPACT", "")).strip() in ("1", "true"):
        return None
    window = _whole(settings.get("autoCompactWindow")) or _whole(str(env.get("CLAUDE_CODE_AUTO_COMPACT_WINDOW", "")))
    return min(window or CLAUDE_DEFAULT_WINDOW, CLAUDE_DEFAULT_WINDOW * 5) - CLAUDE_COMPACT_RESERVE


def codex_compaction_point() -> int | None:
    """The context size at which Codex compacts, from the top-level keys of its config.toml."""
    try:
        text = (_cli_folder("CODEX_HOME", ".codex") / "config.toml").read_text(encoding="utf-8")
    except OSError:
        text = ""
    top = text.split("\n[", 1)[0]                 # top-level keys stand before the first table
    found = dict(re.findall(r"^\s*(model_auto_compact_token_limit|model_context_window)\s*=\s*(\d[\d_]*)\s*(?:#.*)?$",
                            top, re.MULTILINE))
    if "model_auto_compact_token_limit" in found:
        return int(found["model_auto_compact_token_limit"].replace("_", ""))
    return int(int(found.get("model_context_window", str(CODEX_DEFAULT_WINDOW)).replace("_", "")) * 0.9)


# the settings that say where a CLI compacts (its row's `compaction_settings`) -> their reader
COMPACTION_READERS: dict[str, Callable[[], int | None]] = {
    "claude settings.json": claude_compaction_point, "codex config.toml": codex_compaction_point}


def compaction_point(role: str) -> int | None:
    """How full the role's agent's context may get before its CLI compacts it: COMPACT_AT_TOKENS, else what
    its CLI's settings say (where they are on this machine), else None (unknown, or it never compacts)."""
    if COMPACT_AT_TOKENS:
        return COMPACT_AT_TOKENS
    settings = agent_cli(provider_for(role)).compaction_settings
    return read_records(COMPACTION_READERS.get(settings) if isinstance(settings, str) else settings)


# ==========================================================================
# 6. The wait for a reply
# ==========================================================================
# CAO's status is a hint; the response file is the agent's own word and leads (docs/code-map.md, "One turn,
# end to end"). TurnFacts holds what was observed, turn_state() names the state, WAIT_RULES decides (decide(),
# pure), ReadSchedule says when to ask the server, wait_for_reply() does the I/O.

PERMISSION_ANSWER_INTERVAL = 5.0      # seconds between two automatic "y" answers on one terminal
MAX_PERMISSION_ANSWERS = 20           # automatic answers per turn
LIVENESS_CHECK_SECONDS = 5.0          # how often a turn asks whether its agent is still there
FIRST_LOOK_SECONDS = 0.5              # the first look after a send: a compaction's words can scroll away later

# -- Is the agent still there? -------------------------------------------------
# CAO keeps answering a dead CLI's last status: the session's record and a shell prompt on the screen tell.

# CSI sequences, OSC strings, charset choices and the two-character escapes.
ESCAPE_SEQUENCE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[()*+][0-9A-Za-z]"
                             r"|[@-Z\\-_78=>c])")
SHELL_PROMPT = re.compile(r"^(?:\([^)]*\)\s*)?(?:[\w.-]+@[\w.-]+(?:[: ]\S*)?|(?:ba|z|da|k|fi)?sh(?:-\d+(?:\.\d+)*)?)"
                          r"\s?[$#%>]\s*$")


def screen_lines(screen: str) -> list[str]:
    """A terminal's raw output as the lines a person would read: escape sequences gone, blank lines dropped."""
    return [line.rstrip() for line in re.split(r"\r?\n|\r", ESCAPE_SEQUENCE.sub("", screen)) if line.strip()]


def last_screen_line(screen: str | None) -> str:
    lines = screen_lines(screen or "")
    return lines[-1].strip() if lines else ""


def shows_shell_prompt(screen: str | None) -> bool:
    """True when the screen's last line is a shell prompt: the agent CLI in that pane has exited."""
    return bool(SHELL_PROMPT.match(last_screen_line(screen)))


def _squeezed(text: str) -> str:
    """Text without escape sequences or any whitespace: a CLI wraps, indents and re-renders what it echoes."""
    return re.sub(r"\s+", "", ESCAPE_SEQUENCE.sub("", text))


def prompt_markers(message: str) -> tuple[str, ...]:
    """What shows on the screen once the agent has the message: its first line and its response-file line
    (CAO's screen holds only what was printed since the last input: an earlier prompt is not there)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    markers = [_squeezed(lines[0])[:100]] if lines else []
    markers += [_squeezed(line)[:60] for line in lines if line.startswith("Write your complete answer to this file:")]
    return tuple(marker for marker in markers if marker)


def shows_prompt(screen: str | None, markers: tuple[str, ...]) -> bool:
    return any(marker in _squeezed(screen or "") for marker in markers)


# -- A CLI's own marks of its turns (its row's `turn_marks`) ---------------------
# They outrank CAO's status; only `done` after the newest `working` ends a turn (start-up marks idle too).


def turn_marks_on(screen: str | None, cli: AgentCli) -> list[str]:
    """The marks the CLI printed on the screen, oldest first, as 'working', 'done' or 'idle' (none: no marks)."""
    if not cli.turn_marks:
        return []
    pattern, *words = cli.turn_marks
    meaning = dict(zip(words, ("working", "done", "idle")))
    return [meaning.get(word, word) for word in cli_pattern(pattern).findall(screen or "")]


def turn_mark(screen: str | None, cli: AgentCli, answered_before: bool = False) -> str | None:
    """What the marks say: 'working'; 'ended' (a `done` after the newest `working`); 'rest' (idle after a
    `done`, or after a turn of this run: a task of its own followed the turn); 'idle' (its start-up); or None."""
    marks = turn_marks_on(screen, cli)
    if not marks:
        return None
    newest_working = len(marks) - marks[::-1].index("working") if "working" in marks else 0
    if "done" in marks[newest_working:]:
        return "ended"
    if marks[-1] != "idle":
        return "working"
    return "rest" if "done" in marks or answered_before else "idle"


# -- What the screen says of the agent's conversation and its account -----------
# A compaction or /clear loses what was sent once per conversation (section 12); its row's words tell.


def conversation_change(screen: str | None, cli: AgentCli | None = None) -> tuple[str, str]:
    """('compacted' or 'cleared', ''), ('context low', '8% left') or ('', ''): the whole screen, in its CLI's
    words (None: every CLI's); a CLI may draw its prompt again below its words for a compaction."""
    text = _squeezed(screen or "")
    for words, what in row_values(cli, "conversation_words", own_only=True):
        if words in text:
            return what, ""
    low = [found for low in row_values(cli, "context_low", own_only=True) for found in cli_pattern(low).finditer(text)]
    if not low:
        return "", ""
    left = low[-1].groupdict().get("left")
    return "context low", f"{left}% left" if left else "none left"


@lru_cache(maxsize=None)
def cli_pattern(text: str) -> re.Pattern:
    """A regex of a CLI's row, compiled once."""
    return re.compile(text)


# -- What a CLI that cannot start, or cannot work, shows (its row's `cannot_start`) ----------------
START_SCREEN_LINES = 4                 # the CLI's own lines quoted when it cannot start or work
SHELL_LINE = re.compile(SHELL_PROMPT.pattern.replace(r"\s?[$#%>]\s*$", r"\s?[$#%>](?:\s|$)"))


@dataclass(frozen=True)
class StartScreen:
    """What a terminal CAO started (or failed to) showed: its id, the CLI's last lines as people read them, and the
    lasting reason its words name (None: none known)."""

    terminal_id: str
    lines: tuple[str, ...] = ()
    lasting: CannotStart | None = None
    again: bool = False               # a second start showed the same lines as the first

    def quoted(self) -> str:
        return " | ".join(self.lines)


def readable_lines(screen: str) -> list[str]:
    """A raw terminal stream as the lines a person reads, each once where it last showed: cursor moves along the line
    made a space (CLIs draw spaces so), tmux's passthrough, escape sequences and art gone, shell lines (a prompt,
    CAO's launch line) left out."""
    text = re.sub(r"\x1bP.*?\x1b\\", "", screen, flags=re.S)
    text = re.sub(r"\x1b\[\d*[CG]", " ", text)
    lines: dict[str, None] = {}
    for line in screen_lines(text):
        line = re.sub(r"\s+", " ", line).strip()[:200]
        if re.search(r"[A-Za-z]{2}", line) and not SHELL_LINE.match(line) and "$(" not in line:
            lines.pop(line, None)
            lines[line] = None
    return list(lines)


def cannot_start_reasons(provider: str) -> tuple[CannotStart, ...]:
    """The words that say the provider's CLI cannot start for good: its row's, and a shell's "not found" for its
    program (CAO types the program's name into a shell)."""
    cli = agent_cli(provider)
    program = cli.program or provider
    missing = CannotStart(rf"(?:^|:){re.escape(program)}:(?:command)?notfound",
                          f"the agents' shells do not find its program `{program}`",
                          f"`{command_name()} --check` says where it is missing and how to make it found")
    return (*cli.cannot_start, missing)


def start_screen(provider: str, terminal_id: str, screen: str) -> StartScreen:
    """A starting terminal's screen read: from the first line of its last ones that says its CLI cannot start for
    good (the CLI's words), else its last lines."""
    lines = readable_lines(screen)[-20:]
    for index, line in enumerate(lines):
        squeezed = re.sub(r"\s+", "", line)
        for reason in cannot_start_reasons(provider):
            if cli_pattern(reason.words).search(squeezed):
                return StartScreen(terminal_id, tuple(lines[index:index + START_SCREEN_LINES]), reason)
    return StartScreen(terminal_id, tuple(lines[-START_SCREEN_LINES:]))


class AgentLost(RunError):
    """An agent that is gone or gives no sign of life: replaced (REPLACE_LOST_AGENTS=1), else the run stops
    with exit 2 -- the same command would find it gone again; only a setting (its line names it) gets past it."""

    def __init__(self, role: str, terminal_id: str, why: str, last_line: str = "", ways_on: str = "",
                 when: str = ""):
        self.role, self.terminal_id, self.why, self.last_line = role, terminal_id, why, last_line
        shown = f"; last screen line: {last_line[:120]!r}" if last_line else ""
        ways_on = ways_on or "set REPLACE_LOST_AGENTS=1 to go on with a new agent, or RESUME=0 to start the run over"
        self.ways_on = ways_on
        super().__init__(f"{when}the {role} agent (terminal {terminal_id}) is lost: {why}{shown}; {ways_on}",
                         EXIT_USAGE)


def why_gone(terminal_id: str, screen: str | None = None, unreadable: bool = False) -> str:
    """'' while the agent can take input; else why not: its session, its terminal gone, its CLI exited, or
    (`unreadable`) no screen while CAO cannot tell its status. Without CAO's sessions route the screen tells."""
    try:
        listed = api.session_terminals(session_name) if session_name else None
    except ApiError as exc:
        if exc.status_code not in (404, 405):
            raise
        listed = [terminal_id]
    if listed is None:
        return f"its CAO session {session_name or '?'} is gone (the agents' tmux session ended)"
    if terminal_id not in listed:
        return f"CAO session {session_name} no longer has this terminal"
    if shows_shell_prompt(screen):
        return "its agent CLI exited (its terminal shows a shell prompt)"
    if unreadable:
        return "CAO can neither read its screen nor tell its status (its tmux window is gone)"
    return ""


def _screen(terminal_id: str) -> str | None:
    """The terminal's recent output, or None if the server cannot say."""
    try:
        return api.get_screen(terminal_id)
    except ApiError:
        return None


def lost_agent(role: str, terminal_id: str, why: str, screen: str | None) -> AgentLost:
    """The AgentLost for a terminal, its last lines logged: what a person would look at to judge."""
    lines = screen_lines(screen or "")
    if lines:
        log(f"{role}: terminal {terminal_id} ends with: " + " | ".join(line.strip() for line in lines[-5:]))
    return AgentLost(role, terminal_id, why, lines[-1].strip() if lines else "")


def check_gone(role: str, terminal_id: str, screen: str | None) -> None:
    """Raise AgentLost if the agent is gone (its session, its terminal, its CLI)."""
    why = why_gone(terminal_id, screen)
    if why:
        raise lost_agent(role, terminal_id, why, screen)


def check_alive(role: str, terminal_id: str) -> None:
    """Before typing into a terminal: raise AgentLost if its agent is gone (never type into a shell), and
    close a menu its CLI opened (typed text and Enter would pick the menu's highlighted choice)."""
    screen = _screen(terminal_id)
    check_gone(role, terminal_id, screen)
    menu = open_menu(screen, agent_cli(provider_for(role)))
    if menu is not None:
        answer_menu(role, terminal_id, menu)


# -- Menus an agent CLI opens by itself ------------------------------------------
# Typed text's Enter would pick the highlighted choice: the loop picks the one its row names, which keeps what
# the user chose (its row's `menus`); a menu it does not know stops the turn, naming it. Every answer is logged.
# A choice's line; {cursors}: the glyphs that mark the highlighted one (its row's `menu_cursor`).
MENU_OPTION = r"^\s*(?P<cursor>[{cursors}]\s*)?(?P<number>[1-9])[.)]\s+(?P<text>\S.*?)\s*$"
MENU_LINES = 14                        # a menu is among the screen's last lines
MENU_CLOSE_SECONDS = 5.0               # how long a CLI may take to close a menu once its choice is picked


@dataclass(frozen=True)
class Menu:
    """A numbered menu at the end of a screen: its choices, and the one highlighted."""

    choices: tuple[tuple[int, str], ...]
    highlighted: int
    question: str                     # the line above the first choice (what the menu asks)

    def text(self) -> str:
        return f"{self.question} " + " ".join(f"{number}. {text}" for number, text in self.choices)


def open_menu(screen: str | None, cli: AgentCli | None = None) -> Menu | None:
    """The numbered menu among the screen's last lines, if open: choices 1, 2, ... with exactly one
    highlighted by its CLI's glyph (row_values(); a numbered list in an answer has no such mark)."""
    cursors = "".join(row_values(cli, "menu_cursor"))
    menu_option = cli_pattern(MENU_OPTION.replace("{cursors}", re.escape(cursors)))
    lines = screen_lines(screen or "")[-MENU_LINES:]
    for start, line in enumerate(lines):
        first = menu_option.match(line)
        if not first or first["number"] != "1":
            continue
        choices, highlighted = [(1, first["text"])], [1] if first["cursor"] else []
        for later in lines[start + 1:]:
            option = menu_option.match(later)
            if option and int(option["number"]) == len(choices) + 1:
                choices.append((len(choices) + 1, option["text"]))
                highlighted += [len(choices)] if option["cursor"] else []
        if len(choices) >= 2 and len(highlighted) == 1:
            question = lines[start - 1].strip(" │" + cursors) if start else ""
            return Menu(tuple(choices), highlighted[0], question)
    return None


def safe_menu_choice(menu: Menu, cli: AgentCli | None = None) -> tuple[str, int] | None:
    """(the menu's name, the number of its choice that changes nothing the user chose), or None: not known.
    `cli`: the CLI that opened it (None: the menus of every CLI)."""
    for name, safe_text in row_values(cli, "menus", own_only=True):
        for number, text in menu.choices:
            if text.startswith(safe_text) and not text[len(safe_text):].strip(" ."):
                return name, number
    return None


def menu_keys(menu: Menu, choice: int) -> list[str]:
    """The keys that move the highlight to `choice` and pick it (arrows: a digit is not a shortcut everywhere)."""
    steps = choice - menu.highlighted
    return ["Down"] * max(0, steps) + ["Up"] * max(0, -steps) + ["Enter"]


def pick_menu_choice(role: str, terminal_id: str, menu: Menu, known: tuple[str, int]) -> None:
    """Move to the known menu's safe choice (its name, its number) and pick it, logged."""
    name, choice = known
    log_turn(role, f"{name} on terminal {terminal_id} ({menu.text()[:200]}): choosing {choice}. "
                   f"\"{dict(menu.choices)[choice]}\"")
    for key in menu_keys(menu, choice):
        api.send_key(terminal_id, key)


def answer_menu(role: str, terminal_id: str, menu: Menu) -> None:
    """Pick the choice of a known menu that keeps what the user chose; a menu the loop does not know stops
    the turn (nothing typed), naming it."""
    cli = agent_cli(provider_for(role))
    known = safe_menu_choice(menu, cli)
    if known is None:
        log_turn(role, f"terminal {terminal_id} shows a menu the loop does not answer: {menu.text()[:300]}")
        raise agent_failed(role, terminal_id, f"shows a menu the loop does not answer ({menu.text()[:200]}); "
                                              "answer it yourself", EXIT_USAGE)
    pick_menu_choice(role, terminal_id, menu, known)
    name, choice = known
    deadline = time.monotonic() + MENU_CLOSE_SECONDS
    while open_menu(_screen(terminal_id), cli) == menu:
        if time.monotonic() >= deadline:
            raise agent_failed(role, terminal_id, f"still shows {name} after the loop chose "
                                                  f"\"{dict(menu.choices)[choice]}\"; answer it yourself", EXIT_USAGE)
        time.sleep(0.2)


# -- The turn's states and rules -----------------------------------------------

class TurnState(Enum):
    """Where a turn stands, from what has been observed."""

    LOST = "lost"                                       # the agent's session, terminal or CLI is gone
    AWAITING_SIGN_OF_LIFE = "awaiting a sign of life"   # no file; the prompt not yet on screen, or not yet busy
    PROMPT_NOT_SHOWN = "quiet, the prompt not on its screen"  # no file; the prompt did not arrive (a dialog took it)
    SILENT = "idle, never seen working"                 # a carried-over turn, no file: it may never have started
    WORKING = "working"                                 # no file; the prompt arrived, not idle
    IDLE_WITHOUT_FILE = "idle without a file"           # no file; the prompt arrived, now idle
    FILE_SETTLING = "file settling"                     # a reply file changed less than FILE_SETTLE_SECONDS ago
    FILE_SETTLED = "file settled"                       # its turn-ending rows say whether the turn is over
    FAILED = "failed"                                   # CAO reports the terminal's status as `error`
    BETWEEN_TURNS = "no reply awaited"                  # a terminal about to be prompted: is its last turn over?


class Verdict(Enum):
    """What the wait does next."""

    WAIT = "wait"
    TAKE_REPLY = "take the reply"
    RESEND = "send the prompt again"
    REMIND = "remind, or give up when the reminders are used"
    CONTINUE = "tell the agent to continue after its model provider's error"
    WAIT_OUT_LIMIT = "wait until the account's usage limit resets (or stop, saying when to rerun)"
    CONTINUE_AFTER_LIMIT = "tell the agent to continue: its usage limit has reset"
    RESEND_IN_FULL = "send the prompt again in full: a compaction took what it referred back to"
    LOST = "the agent is lost: replace it or stop"
    ERROR = "stop: the agent reports an error"
    TIMEOUT = "stop: RESPONSE_TIMEOUT"


@dataclass
class TurnFacts:
    """What has been observed of one turn (or of a terminal about to be prompted: no markers, no file).
    The note_* methods take observations in; the rest only asks."""

    started: float                    # when the prompt went out (or the wait began, for a carried-over turn)
    guard_since: float                # the last prompt or reminder: not seen working on it yet at this time
    markers: tuple[str, ...] = ()     # what shows on screen once the prompt arrived; () for a carried-over turn
    prompt_seen: bool = False         # the prompt (or its reply file) has shown up
    seen_working: bool = False
    status: str | None = None
    status_at: float = float("-inf")
    ready_since: float | None = None  # the first of the latest unbroken run of ready status reads
    file_version: tuple[int, int] | None = None
    file_seen_at: float = float("-inf")  # when file_version last changed (appeared, was rewritten, vanished)
    finished_by: str = ""             # since the file's last change, what first said the agent finished
    screen: str | None = None
    mark: str | None = None           # the CLI's own marks: turn_mark() (stands until the screen shows another)
    marked_idle_at: float | None = None  # when the screen first showed a mark that the CLI is idle
    screen_changed_at: float = float("-inf")
    lost: str = ""                    # why the agent is gone ("" while it is there)
    left_reply: bool = False          # ... and it left its reply complete (left_reply(), section 4)
    resend_used: bool = False         # the one resend (or a carried-over turn's first reminder) is spent
    reminders: int = 0
    provider_errors: int = 0          # model provider errors waited out this turn
    rate_limit_waited: float = 0.0    # seconds of pauses for rate limits (429) this turn
    provider_pause_until: float | None = None  # a provider error's pause is under way until then
    cli: AgentCli = AgentCli("an agent CLI")  # its row in AGENT_CLIS: whether its ready status counts, ...
    cao_status: str | None = None     # what CAO last said, as said (`status` is what the rules go by)
    usage_limit: UsageLimit | None = None  # the screen says the account's usage limit stopped the agent
    limit_wait_until: float | None = None  # a usage-limit wait is under way until then
    full_prompt_due: bool = False     # compacted during the turn, its prompt referring back to what that summarised
    answered_before: bool = False     # the agent has answered a turn of this run (its marks: turn_mark())
    awaiting: bool = True             # a reply is awaited (False: a terminal about to be prompted)

    # -- observations ----------------------------------------------------------
    def note_file(self, version: tuple[int, int] | None, now: float) -> None:
        if version != self.file_version:
            self.file_version, self.file_seen_at, self.finished_by = version, now, ""
            if version is not None:
                self.seen_working = self.prompt_seen = True

    def note_status(self, status: str, now: float) -> None:
        # A ready word CAO misreads: the screen decides; before a prompt, the CLI's own idle mark bears it out.
        self.cao_status, status = status, status if not self.awaiting and self.mark == "idle" \
            else self.cli.status_word(status)
        ready = status in READY_STATUSES
        self.ready_since = (self.ready_since if self.status in READY_STATUSES else now) if ready else None
        self.status, self.status_at = status, now
        if ready and not self.finished_by:
            self.finished_by = TURN_ENDED_BY_STATUS
        elif not (ready or self.awaiting) and self.finished_by == TURN_ENDED_BY_STATUS:
            self.finished_by = ""        # before a prompt only the latest status counts
        self.seen_working = self.seen_working or status in BUSY_STATUSES

    def note_screen(self, screen: str | None, now: float) -> None:
        if screen is None:
            return
        if self.markers and not self.prompt_seen and shows_prompt(screen, self.markers):
            self.prompt_seen = True
        self.note_mark(turn_mark(screen, self.cli, self.answered_before), now)
        if screen == self.screen:
            return
        if self.screen is not None and self.status not in KNOWN_STATUSES:
            self.seen_working = True     # nothing else tells that it works
        self.screen, self.screen_changed_at = screen, now

    def note_mark(self, mark: str | None, now: float) -> None:
        """The CLI's marks on a screen; a spinner can push them out of CAO's screen (its tail), so the last stands.
        Only a turn's end confirms a reply file; without one, a CLI at rest after a turn is finished too."""
        self.mark = mark or self.mark
        if self.mark not in ("ended", "rest", "idle"):
            self.marked_idle_at = None
            return
        self.marked_idle_at = now if self.marked_idle_at is None else self.marked_idle_at
        at_rest = self.mark == "ended" or (self.mark == "rest" and self.file_version is None)
        if at_rest and not self.finished_by:
            self.finished_by = TURN_ENDED_BY_MARK

    def note_record(self, turn_over: bool) -> None:
        """Whether the CLI's own record, read after the file's latest version was seen, shows the turn over."""
        if turn_over and self.file_version is not None and not self.finished_by:
            self.finished_by = TURN_ENDED_BY_RECORD

    def note_lost(self, why: str, left_reply: bool = False) -> None:
        """Why the agent is gone ('' : it is there), and whether it left a complete reply (left_reply())."""
        self.lost, self.left_reply = why, bool(why) and left_reply

    def note_usage_limit(self, limit: UsageLimit | None) -> None:
        """What the latest screen says of a usage limit (None: nothing, or a reply file is there)."""
        self.usage_limit = limit if self.file_version is None else None

    def note_sent(self, now: float, whole_prompt: bool = False,
                  markers: tuple[str, ...] | None = None) -> None:
        """After a prompt or reminder went out: not seen working on it yet (nor, after the whole prompt again,
        seen to have it; `markers`: a prompt of other words)."""
        self.guard_since, self.seen_working, self.full_prompt_due = now, False, False
        self.provider_pause_until = self.marked_idle_at = self.mark = self.usage_limit = self.limit_wait_until = None
        self.prompt_seen = self.prompt_seen and not whole_prompt
        self.markers = self.markers if markers is None else markers

    def note_compacted(self, prompt_referred_back: bool) -> None:
        """Compacted during the turn, before a reply file: the prompt is due in full if it referred back."""
        self.full_prompt_due = self.full_prompt_due or (prompt_referred_back and self.file_version is None)

    # -- questions ---------------------------------------------------------------
    def said_finished(self, by: str) -> bool:
        """Whether `by` first said the agent finished since the file's last change, and no mark says it works."""
        return self.finished_by == by and self.mark != "working"

    def still_screen_ends(self, now: float) -> bool:
        """A screen still for its row's window since the file's last change; with no file (a terminal about to
        be prompted) only for a CLI whose ready status CAO misreads, and not at its start-up -- unless CAO cannot
        tell the status at all (`unknown` for good after a server restart): then the screen tells."""
        if self.file_version is None and self.cao_status in KNOWN_STATUSES and \
                (self.cli.ready_status_trusted or self.mark == "idle"):
            return False
        return self.screen_still_since(self.file_seen_at, now, self.cli.still_screen_ends_turn)

    def file_settled(self, now: float) -> bool:
        return self.file_version is not None and now - self.file_seen_at >= FILE_SETTLE_SECONDS

    def screen_still_since(self, since: float, now: float, seconds: float | None = None) -> bool:
        still_for = QUIET_SCREEN_SECONDS if seconds is None else seconds
        return self.screen is not None and now - max(self.screen_changed_at, since) >= still_for

    def is_idle(self, now: float) -> bool:
        if self.mark == "working":        # the CLI's own word outranks CAO's status
            return False
        if self.status in READY_STATUSES or self.marked_idle_at is not None:
            return True
        return self.status not in KNOWN_STATUSES and self.screen_still_since(float("-inf"), now)

    def is_quiet(self, now: float) -> bool:
        """Idle, or -- whatever the status says -- a screen still since the last prompt or reminder."""
        return self.is_idle(now) or self.screen_still_since(self.guard_since, now)

    def quiet_at_limit(self, now: float) -> bool:
        """Idle; or, for a CLI whose ready word CAO cannot be trusted on (Codex reads `processing` through its
        limit), a screen still since the last prompt or reminder."""
        return self.is_idle(now) if self.cli.ready_status_trusted else self.is_quiet(now)

    def idle_from(self) -> float:
        """Since when the agent has been idle without a file, counted from the last prompt or reminder: its run of
        ready status reads (only the latest status sets one), else its CLI's idle mark, else its still screen."""
        became_idle = next((at for at in (self.ready_since, self.marked_idle_at) if at is not None),
                           self.screen_changed_at + QUIET_SCREEN_SECONDS)
        return max(became_idle, self.guard_since, self.file_seen_at)

    def stalled(self, now: float) -> bool:
        """No sign of life: the screen unchanged for AGENT_STALL_SECONDS (not while it asks for permission)."""
        return self.status != "waiting_user_answer" and \
            self.screen_still_since(self.guard_since, now, AGENT_STALL_SECONDS)


def turn_state(facts: TurnFacts, now: float) -> TurnState:
    """The named state the observations put a turn in."""
    if facts.lost:
        return TurnState.LOST
    if facts.status == "error":
        return TurnState.FAILED
    if not facts.awaiting:
        return TurnState.BETWEEN_TURNS
    if facts.file_version is not None:
        return TurnState.FILE_SETTLED if facts.file_settled(now) else TurnState.FILE_SETTLING
    if facts.markers and not facts.prompt_seen:
        return TurnState.PROMPT_NOT_SHOWN if facts.is_quiet(now) else TurnState.AWAITING_SIGN_OF_LIFE
    arrived = facts.seen_working or facts.prompt_seen
    if facts.is_idle(now):
        return TurnState.IDLE_WITHOUT_FILE if arrived else TurnState.SILENT
    return TurnState.WORKING if arrived else TurnState.AWAITING_SIGN_OF_LIFE


@dataclass(frozen=True)
class WaitRule:
    """One row of the decision table."""

    states: frozenset[TurnState]
    condition: str                    # the rule in words
    applies: Callable[[TurnFacts, float], bool]
    verdict: Verdict
    ended_by: str = ""                # a row that ends the turn: what the reply's log line says ended it


ALWAYS: Callable[[TurnFacts, float], bool] = lambda f, now: True        # a rule's condition that always holds
OPEN_STATES = frozenset(TurnState) - {TurnState.FAILED, TurnState.LOST, TurnState.BETWEEN_TURNS}
SETTLED = frozenset({TurnState.FILE_SETTLED, TurnState.BETWEEN_TURNS})   # a whole reply file, or none awaited
IDLE_STATES = frozenset({TurnState.SILENT, TurnState.IDLE_WITHOUT_FILE})
BUSY_STATES = frozenset({TurnState.WORKING, TurnState.AWAITING_SIGN_OF_LIFE})
WAIT_RULES: tuple[WaitRule, ...] = (
    WaitRule(frozenset({TurnState.LOST}), "it left its reply complete: a reply written is a reply taken",
             lambda f, now: f.left_reply, Verdict.TAKE_REPLY, TURN_ENDED_BY_AGENT_GONE),
    WaitRule(frozenset({TurnState.LOST}), "always (its session, terminal or CLI is gone)", ALWAYS, Verdict.LOST),
    WaitRule(frozenset({TurnState.FAILED}), "always", ALWAYS, Verdict.ERROR),
    WaitRule(SETTLED, "a ready status read since the file's last change, for a CLI whose ready word CAO reads right",
             lambda f, now: f.said_finished(TURN_ENDED_BY_STATUS), Verdict.TAKE_REPLY, TURN_ENDED_BY_STATUS),
    WaitRule(SETTLED, "its CLI's end-of-turn mark (its row's turn_marks) since the file's last change",
             lambda f, now: f.said_finished(TURN_ENDED_BY_MARK), Verdict.TAKE_REPLY, TURN_ENDED_BY_MARK),
    WaitRule(frozenset({TurnState.FILE_SETTLED}), "its CLI's own record of the turn's end, read since then",
             lambda f, now: f.said_finished(TURN_ENDED_BY_RECORD), Verdict.TAKE_REPLY, TURN_ENDED_BY_RECORD),
    WaitRule(SETTLED, "the screen still since then for its row's still_screen_ends_turn, else QUIET_SCREEN_SECONDS",
             lambda f, now: f.still_screen_ends(now), Verdict.TAKE_REPLY, TURN_ENDED_BY_STILL_SCREEN),
    WaitRule(OPEN_STATES, "a usage-limit wait is under way",
             lambda f, now: f.limit_wait_until is not None and now < f.limit_wait_until, Verdict.WAIT),
    WaitRule(IDLE_STATES | BUSY_STATES, "a usage-limit wait is over, the agent quiet at its limit",
             lambda f, now: f.limit_wait_until is not None and f.quiet_at_limit(now), Verdict.CONTINUE_AFTER_LIMIT),
    WaitRule(IDLE_STATES | BUSY_STATES, "its screen says its account's usage limit is reached, the agent quiet at it",
             lambda f, now: f.usage_limit is not None and f.quiet_at_limit(now), Verdict.WAIT_OUT_LIMIT),
    WaitRule(IDLE_STATES | BUSY_STATES | {TurnState.PROMPT_NOT_SHOWN},
             "compacted during the turn, whose prompt referred back to what the summary may have dropped",
             lambda f, now: f.full_prompt_due, Verdict.RESEND_IN_FULL),
    WaitRule(frozenset({TurnState.PROMPT_NOT_SHOWN}), "less than IDLE_GRACE_SECONDS since the prompt",
             lambda f, now: now - f.guard_since < IDLE_GRACE_SECONDS, Verdict.WAIT),
    WaitRule(frozenset({TurnState.PROMPT_NOT_SHOWN}), "not sent again yet",
             lambda f, now: not f.resend_used, Verdict.RESEND),
    WaitRule(frozenset({TurnState.PROMPT_NOT_SHOWN}), "sent again, and still not on its screen", ALWAYS, Verdict.LOST),
    WaitRule(frozenset({TurnState.SILENT}), "less than IDLE_GRACE_SECONDS since the wait began",
             lambda f, now: now - f.guard_since < IDLE_GRACE_SECONDS, Verdict.WAIT),
    WaitRule(frozenset({TurnState.SILENT}), "a turn carried over (no prompt to send again), not reminded yet",
             lambda f, now: not f.resend_used, Verdict.REMIND),
    WaitRule(IDLE_STATES, "a model provider error's pause is under way",
             lambda f, now: f.provider_pause_until is not None and now < f.provider_pause_until, Verdict.WAIT),
    WaitRule(IDLE_STATES, "a model provider error's pause is over",
             lambda f, now: f.provider_pause_until is not None, Verdict.CONTINUE),
    WaitRule(IDLE_STATES, "idle for IDLE_GRACE_SECONDS",
             lambda f, now: now - f.idle_from() >= IDLE_GRACE_SECONDS, Verdict.REMIND),
    WaitRule(BUSY_STATES, "screen unchanged for AGENT_STALL_SECONDS, not asking for permission",
             lambda f, now: f.stalled(now), Verdict.LOST),
    WaitRule(OPEN_STATES, "RESPONSE_TIMEOUT since the prompt",
             lambda f, now: now - f.started >= RESPONSE_TIMEOUT, Verdict.TIMEOUT),
)


NO_RULE = WaitRule(frozenset(TurnState), "no rule applies", ALWAYS, Verdict.WAIT)


def decide(facts: TurnFacts, now: float) -> tuple[TurnState, WaitRule]:
    """The turn's state and the first rule that applies to it (NO_RULE: wait). Pure; the one judge of a turn's
    end (the rule's `ended_by`), asked by the wait, a carried-over turn and the settle check alike."""
    state = turn_state(facts, now)
    return state, next((rule for rule in WAIT_RULES if state in rule.states and rule.applies(facts, now)), NO_RULE)


@dataclass
class ReadSchedule:
    """When to ask the server: the status every POLL_SECONDS, a settled file's turn every CONFIRM_READ_SECONDS
    for at most QUIET_SCREEN_SECONDS (its record every RECORD_READ_SECONDS), liveness every LIVENESS_CHECK_SECONDS."""

    next_status_at: float
    next_liveness_at: float = float("-inf")
    records: bool = False                   # the CLI's own records are read here
    next_record_at: float = float("-inf")

    def confirm_read_at(self, facts: TurnFacts, now: float) -> float | None:
        """When a settled file's turn is next asked whether it has finished (None: no such file)."""
        state, rule = decide(facts, now)
        if state is not TurnState.FILE_SETTLED or rule.ended_by:
            return None
        settled_at = facts.file_seen_at + FILE_SETTLE_SECONDS
        if facts.status_at < settled_at:
            return settled_at
        next_at = facts.status_at + CONFIRM_READ_SECONDS
        return next_at if next_at <= settled_at + QUIET_SCREEN_SECONDS else None

    def status_due(self, facts: TurnFacts, now: float) -> bool:
        confirm_at = self.confirm_read_at(facts, now)
        return now >= self.next_status_at or (confirm_at is not None and now >= confirm_at)

    def record_read_at(self, facts: TurnFacts, now: float) -> float | None:
        """When a settled file's turn next reads its CLI's own record between two status reads (None: no
        records here, no such file, or the quick reads are over)."""
        if not self.records or self.confirm_read_at(facts, now) is None:
            return None
        return max(self.next_record_at, facts.file_seen_at + FILE_SETTLE_SECONDS)

    def record_due(self, facts: TurnFacts, now: float) -> bool:
        record_at = self.record_read_at(facts, now)
        return record_at is not None and now >= record_at

    def record_read(self, now: float) -> None:
        self.next_record_at = now + RECORD_READ_SECONDS

    def status_read(self, now: float) -> None:
        self.next_status_at = now + POLL_SECONDS

    def liveness_due(self, now: float) -> bool:
        """Whether to ask again if the agent is still there: in every state of the wait, file or no file."""
        if now < self.next_liveness_at:
            return False
        self.next_liveness_at = now + LIVENESS_CHECK_SECONDS
        return True

    @staticmethod
    def screen_due(facts: TurnFacts, now: float) -> bool:
        """With a status read: while the prompt is not seen, a settled file waits, the agent asks or is idle
        without its file, or the status is one the loop does not know."""
        if facts.markers and not facts.prompt_seen and facts.file_version is None:
            return True
        if facts.status == "error":
            return False
        if facts.status == "waiting_user_answer":
            return True                  # a question: a permission prompt, or Claude Code's usage-limit menu
        if facts.status in READY_STATUSES and facts.file_version is None:
            return True                  # idle without its file: the screen may say why (a compaction, a limit)
        return facts.file_settled(now) or facts.status not in KNOWN_STATUSES

    def next_look_at(self, facts: TurnFacts, now: float) -> float:
        """When something may change: the next status read, the moment a new file settles, or the next
        read that asks whether a settled file's turn has finished."""
        if facts.file_version is not None and not facts.file_settled(now):
            return min(self.next_status_at, facts.file_seen_at + FILE_SETTLE_SECONDS)
        looks = [self.next_status_at, self.confirm_read_at(facts, now), self.record_read_at(facts, now)]
        return min(look for look in looks if look is not None)


@dataclass
class PermissionAnswers:
    """An agent's permission prompts in one turn: answered 'y' (rate-limited, capped) or reported once."""

    answered: int = 0
    last_answer_at: float = float("-inf")
    told_blocked: bool = False

    def next_step(self, now: float) -> str:
        """'answer', 'tell' (that the agent is blocked, once) or '' (nothing now)."""
        if not AUTO_ACCEPT_PERMISSIONS or self.answered >= MAX_PERMISSION_ANSWERS:
            return "" if self.told_blocked else "tell"
        return "answer" if now - self.last_answer_at >= PERMISSION_ANSWER_INTERVAL else ""


@dataclass
class Turn:
    """One agent turn under way: who, where its answer goes, what was sent, and the wait's bookkeeping."""

    role: str
    terminal_id: str
    path: Path
    message: str | None               # what was sent; None for a turn carried over from an earlier process
    facts: TurnFacts
    reads: ReadSchedule
    permissions: PermissionAnswers = field(default_factory=PermissionAnswers)
    told_unknown: bool = False
    menu_answered_at: float = float("-inf")   # when a menu its CLI opened during the turn was last answered
    rebuild: Callable[[], Prompt] | None = None   # builds the turn's prompt again (after a compaction: in full)
    full_prompt: Prompt | None = None         # that prompt, due to go out at once (facts.full_prompt_due)
    sent_wall: float = 0.0                    # time.time() of the turn's first send: its records begin there
    tokens_before: RunningTotals | None = None  # its CLI's running totals then (InFlight.tokens_before)


def _last_output(terminal_id: str) -> str | None:
    """The agent's last reply as CAO extracts it, or None; not retried (500 before a first reply is an answer)."""
    try:
        return api.get_last_output(terminal_id, retry=False)
    except ApiError:
        return None


def _tail(text: str | None, lines: int = 5) -> str:
    return " | ".join((text or "").strip().splitlines()[-lines:])


def log_turn(role: str, message: str) -> None:
    """A log line that says where in the loop it happened."""
    where = f"round {current_round}/{MAX_ROUNDS} | {current_phase} phase"
    if current_phase in (PHASE_ANALYST, PHASE_PROGRAMMER):
        where += f" | cycle {phase_cycle}/{MAX_REVIEW_CYCLES}"
    log(f"{where} | {role}: {message}")


def progress_text(facts: TurnFacts, began: float, now: float) -> str:
    """'working for 2m 0s; screen changing; CAO status processing; no response file yet': what the loop
    sees of a turn under way, for the PROGRESS_SECONDS log line."""
    parts = [f"working for {duration_text(now - began)}"]
    if facts.markers and not facts.prompt_seen:
        parts.append("its screen does not show the prompt yet")
    if facts.screen is not None:
        still = now - facts.screen_changed_at
        parts.append("screen changing" if still < 2 * LIVENESS_CHECK_SECONDS
                     else f"screen still for {duration_text(still)}")
    if facts.cao_status is not None:
        parts.append(f"CAO status {facts.cao_status}")
    if facts.limit_wait_until is not None and now < facts.limit_wait_until:
        parts.append(f"waiting out its usage limit for {duration_text(facts.limit_wait_until - now)} more")
    parts.append("no response file yet" if facts.file_version is None else
                 f"response file written {duration_text(now - facts.file_seen_at)} ago, settling")
    return "; ".join(parts)


def agent_failed(role: str, terminal_id: str, what: str, code: int = EXIT_ERROR) -> RunError:
    """The stop of a turn its agent cannot finish; `code` EXIT_USAGE where a person must act before a rerun."""
    return RunError(f"the {role} agent (terminal {terminal_id}) {what}; look at it with "
                    f"`{tmux_hint('attach -t ' + session_name)}`, then rerun to resume", code)


def deliver(role: str, terminal_id: str, message: str) -> None:
    """Type a message into an agent's terminal, never into a pane whose agent is gone (AgentLost); any other
    failed delivery is the caller's to judge (ApiError)."""
    check_alive(role, terminal_id)
    try:
        api.send_input(terminal_id, message)
    except ApiError as exc:
        if exc.unsent:                   # it never reached the server: nothing to tell about the agent
            raise
        screen = _screen(terminal_id)
        why = why_gone(terminal_id, screen)
        if why:
            raise lost_agent(role, terminal_id, f"{why}; a delivery to it failed ({exc})", screen) from None
        raise


def provider_error_line(output: str, cli: AgentCli | None = None) -> str:
    """The line of an agent's output that names its model provider's error, in its CLI's words ('' if none)."""
    patterns = [*map(cli_pattern, row_values(cli, "error_lines"))]
    return next((line.strip() for line in output.splitlines() if any(p.search(line) for p in patterns)), "")


def rate_limited(error_line: str, cli: AgentCli | None = None) -> bool:
    """Whether a provider's error line says the account is rate limited (it passes with time)."""
    return any(cli_pattern(words).search(error_line) for words in row_values(cli, "rate_limit_lines"))


def check_can_work(role: str, terminal_id: str, output: str, at_rest: bool = True) -> None:
    """Stop (exit 2) where the agent, at rest, answered in its CLI's words for a lasting reason it cannot work (not
    signed in): a reminder, or the same command again, would meet them again."""
    screen = start_screen(provider_for(role), terminal_id, output) if at_rest else None
    if screen is not None and screen.lasting:
        raise RunError(f"the {role}'s {agent_cli(provider_for(role)).label} (terminal {terminal_id}) cannot work: "
                       f"{screen.lasting.why}; it answered: \"{screen.quoted()}\"; {screen.lasting.fix}, then rerun "
                       "to resume", EXIT_USAGE)


def idle_without_file(turn: Turn) -> str | None:
    """The agent stopped without its file: wait out a provider error, remind it, then fail or fall back."""
    role, terminal_id, path = turn.role, turn.terminal_id, turn.path
    output = _last_output(terminal_id) or ""
    check_can_work(role, terminal_id, output)
    error_line = provider_error_line(output, turn.facts.cli)
    if error_line:
        pause_after_provider_error(turn, error_line)
        return None
    if turn.facts.reminders < MAX_FILE_REMINDERS:
        turn.facts.reminders += 1
        log_turn(role, f"idle without {path.name}; reminder {turn.facts.reminders}/{MAX_FILE_REMINDERS} sent")
        reminder = (f"Reminder: your answer has not arrived. Write your complete answer to {path} now; the "
                    "orchestrator reads only that file.")
        keep_sent(role, "reminder", reminder)
        deliver(role, terminal_id, reminder)
        turn.facts.note_sent(time.monotonic())
        return None
    if STRICT_FILE_HANDOFF:
        raise agent_failed(role, terminal_id, f"went idle without writing {path}; set STRICT_FILE_HANDOFF=0 "
                                              "to accept its terminal output instead")
    if not output.strip():
        raise agent_failed(role, terminal_id, f"went idle without writing {path} and its terminal shows no reply")
    log_turn(role, f"no response file; using the terminal's last output ({len(output.strip())} chars)")
    return output.strip()


def pause_after_provider_error(turn: Turn, error_line: str) -> None:
    """The agent stopped on its provider's error: pause (doubling), then tell it to continue; PROVIDER_ERROR_RETRIES
    pauses, or for a rate limit as many as fit in USAGE_LIMIT_MAX_WAIT (then the run stops, resumable)."""
    role, terminal_id, facts = turn.role, turn.terminal_id, turn.facts
    limited = rate_limited(error_line, facts.cli)
    pause = PROVIDER_ERROR_PAUSE_SECONDS * 2 ** facts.provider_errors
    if limited:
        pause = min(pause, USAGE_LIMIT_MAX_WAIT - facts.rate_limit_waited)
        if pause <= 0:
            raise RunError(f"the {role} agent (terminal {terminal_id}) is still rate-limited ({error_line[:200]}) "
                           f"after {duration_text(facts.rate_limit_waited)} of pauses (USAGE_LIMIT_MAX_WAIT="
                           f"{USAGE_LIMIT_MAX_WAIT:g}s); the state is saved: rerun the command later to continue "
                           "the turn, or raise USAGE_LIMIT_MAX_WAIT")
        facts.rate_limit_waited += pause
    elif facts.provider_errors >= PROVIDER_ERROR_RETRIES:
        raise agent_failed(role, terminal_id, f"stopped on a model provider error ({error_line[:200]}) "
                                              f"{counted(facts.provider_errors, 'time')} after being told to continue")
    facts.provider_errors += 1
    facts.provider_pause_until = time.monotonic() + pause
    how_many = (f"rate limited; pause {facts.provider_errors}, {duration_text(facts.rate_limit_waited)} of "
                f"USAGE_LIMIT_MAX_WAIT={USAGE_LIMIT_MAX_WAIT:g}s" if limited
                else f"retry {facts.provider_errors}/{PROVIDER_ERROR_RETRIES}")
    log_turn(role, f"stopped on a model provider error ({error_line[:200]}); {how_many}: telling it to continue "
                   f"in {pause:g}s")


def continue_after_provider_error(turn: Turn) -> None:
    """The pause after a provider error is over: the agent has its task in its conversation; tell it to go on."""
    tell_to_continue(turn, "pause over", "The model provider's error has passed.")


def tell_to_continue(turn: Turn, seen: str, what_passed: str) -> None:
    """What stopped the agent mid-task has passed (`seen`, as logged): one short message to go on (its task is in
    its conversation)."""
    log_turn(turn.role, f"{seen}; telling terminal {turn.terminal_id} to continue its task")
    message = (f"{what_passed} Continue the task above from where you stopped, then write your complete answer "
               f"to {turn.path}; the orchestrator reads only that file.")
    keep_sent(turn.role, "continue", message)
    deliver(turn.role, turn.terminal_id, message)
    turn.facts.note_sent(time.monotonic())


def answer_menu_in_turn(turn: Turn, menu: Menu, known: tuple[str, int]) -> None:
    """A known menu its CLI opened during the turn: its safe choice, at most once per PERMISSION_ANSWER_INTERVAL;
    the wait goes on (the screen then says what the choice led to, e.g. the limit it now waits out)."""
    now = time.monotonic()
    if now - turn.menu_answered_at >= PERMISSION_ANSWER_INTERVAL:
        turn.menu_answered_at = now
        pick_menu_choice(turn.role, turn.terminal_id, menu, known)


def why_lost(facts: TurnFacts, state: TurnState) -> str:
    """The words for a LOST verdict: what the session or screen said, or what never happened."""
    if facts.lost:
        return facts.lost
    if state is TurnState.PROMPT_NOT_SHOWN:
        return "its screen never showed the prompt, though it was sent twice (a dialog may hold the terminal)"
    return f"no sign of life for {AGENT_STALL_SECONDS:g}s (screen unchanged, no response file)"


def resend_unseen_prompt(turn: Turn) -> None:
    """The prompt never showed on the agent's quiet screen (a dialog took it): send it whole, once, as it was; the
    turn's clocks start over."""
    log_turn(turn.role, f"terminal {turn.terminal_id} does not show the prompt ({IDLE_GRACE_SECONDS:g}s after it "
                        "was sent, its screen quiet); sending the whole prompt again")
    turn.facts.resend_used = True
    if in_flight is not None:
        update_run(in_flight=replace(in_flight, sent_at=time.time()))
    keep_sent(turn.role, "resend", turn.message)
    save_state()
    deliver(turn.role, turn.terminal_id, turn.message)
    turn.facts.note_sent(time.monotonic(), whole_prompt=True)


def note_compaction(turn: Turn) -> None:
    """Its CLI compacted the conversation during the turn, before a reply file: if the prompt it works on
    referred back to blocks the summary may have dropped, that prompt is due again in full (RESEND_IN_FULL)."""
    if turn.rebuild is None or turn.facts.file_version is not None:
        return
    full = turn.rebuild()                 # the terminal's blocks are forgotten: every one in full
    sent_in_full = set(in_flight.sent_in_full) if in_flight is not None else set()
    referred_back = bool(set(full.carries_in_full) - sent_in_full)
    turn.full_prompt = full if referred_back else turn.full_prompt
    turn.facts.note_compacted(referred_back)


def resend_in_full(turn: Turn) -> None:
    """Send the turn's prompt again at once with every block in full; the turn's clocks start over."""
    log_turn(turn.role, "its conversation was compacted during the turn, and the prompt referred back to what "
                        "the summary may have dropped; sending the prompt again in full")
    message = send_prompt(turn.role, turn.full_prompt)
    turn.message, turn.full_prompt = message, None
    turn.facts.note_sent(time.monotonic(), whole_prompt=True, markers=prompt_markers(message))


# -- Usage limits: one home -------------------------------------------------------
# An account's usage limit, read from the screen by its row's `usage_limit` and `usage_limit_resets`; the wait
# until its reset (WAIT_RULES' rows WAIT_OUT_LIMIT and CONTINUE_AFTER_LIMIT decide, these carry them out, saved in
# the turn in flight so a rerun waits on); or, beyond USAGE_LIMIT_MAX_WAIT, the role's fallback CLI (FallbackDue,
# taken up by ask_agent, section 8) or the stop saying when to rerun. docs/code-map.md, "what happens at a usage
# limit".

MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


@dataclass(frozen=True)
class UsageLimit:
    """An agent stopped by its account's usage limit: what its screen said, and when the limit resets."""

    line: str
    resets_at: float | None           # time.time() of the reset; None when the CLI names no time


def reset_time(found: re.Match, now: float) -> float | None:
    """The reset a CLI names, read by its row's `usage_limit_resets` ('3:05 PM', 'Jan 5th, 2026 3:05 PM'), as
    time.time() or None: a time of day is the next such (today's within minutes back), in the zone named, else
    this machine's."""
    match = dict.fromkeys(("month", "year", "minute", "half", "zone")) | found.groupdict()   # a row names some
    try:
        tz = ZoneInfo(match["zone"]) if match["zone"] else None
    except (ZoneInfoNotFoundError, ValueError):
        tz = None
    local_now = datetime.fromtimestamp(now, tz) if tz else datetime.fromtimestamp(now).astimezone()
    hour, minute = int(match["hour"]), int(match["minute"] or 0)
    if match["half"]:
        if not 1 <= hour <= 12:
            return None
        hour = hour % 12 + (12 if match["half"][0] in "Pp" else 0)
    try:
        if match["month"]:
            year = int(match["year"] or local_now.year)
            moment = local_now.replace(year=year, month=MONTHS.index(match["month"]) + 1, day=int(match["day"]),
                                       hour=hour, minute=minute, second=0, microsecond=0)
            if not match["year"] and moment < local_now - timedelta(days=1):
                moment = moment.replace(year=year + 1)
        else:
            moment = local_now.replace(hour=hour, minute=minute, second=0, microsecond=0)
            if moment < local_now - timedelta(minutes=10):
                moment += timedelta(days=1)
    except ValueError:                     # no such month, day or hour
        return None
    return moment.timestamp()


def usage_limit_on(screen: str | None, now: float, cli: AgentCli | None = None) -> UsageLimit | None:
    """The usage limit the end of the agent's screen reports, if it reports one (in its CLI's words)."""
    found, patterns = None, [*map(cli_pattern, row_values(cli, "usage_limit"))]
    for line in screen_lines(screen or "")[-30:]:
        for pattern in patterns:
            found = pattern.search(line) or found     # the newest report counts
    if found is None:
        return None
    # The line may run on into what was drawn next: the report ends at its reset time, or its first full stop.
    reset = next(filter(None, (cli_pattern(words).search(found["rest"])
                               for words in row_values(cli, "usage_limit_resets"))), None)
    rest = found["rest"][:reset.end()] if reset else re.split(r"(?<=\.)\s", found["rest"], maxsplit=1)[0]
    line = re.sub(r"\s+", " ", found.group(0)[:found.start("rest") - found.start()] + rest).strip(" ·")
    return UsageLimit(line, reset_time(reset, now) if reset else None)


def clock_text(when: float) -> str:
    """'15:05' (today) or 'Nov 26 15:05': a moment in this machine's local time."""
    moment = datetime.fromtimestamp(when)
    return moment.strftime("%H:%M") if moment.date() == datetime.now().date() else moment.strftime("%b %d %H:%M")


def note_limit_in_flight(role: str, line: str, until: float | None) -> None:
    """Save that the turn in flight waits out a usage limit ('' : no longer): a rerun then continues the turn."""
    if in_flight is not None and in_flight.role == role:
        update_run(in_flight=replace(in_flight, limit_line=line, limit_until=until if line else None))
        save_state()


class UsageLimitStop(RunError):
    """The stop for a usage limit the loop will not wait out: when to rerun, and that the rerun continues."""

    def __init__(self, turn: Turn, line: str, until: float | None):
        rerun = "to continue the turn (its prompt is not sent again)"
        when = f"its CLI names no reset time: rerun the command once the limit has reset {rerun}" if until is None \
            else (f"it resets at {clock_text(until)} (in {duration_text(until - time.time())}), beyond "
                  f"USAGE_LIMIT_MAX_WAIT={USAGE_LIMIT_MAX_WAIT:g}s: rerun the command after {clock_text(until)} "
                  f"{rerun}, or raise USAGE_LIMIT_MAX_WAIT")
        super().__init__(f"the {turn.role} agent (terminal {turn.terminal_id}) stopped at its account's usage limit "
                         f"({line[:200]}); {when}")
        self.role, self.terminal_id, self.line, self.until = turn.role, turn.terminal_id, line, until


class FallbackDue(UsageLimitStop):
    """A usage limit the loop will not wait out, of a role with a fallback CLI to go over to: asking (8) hands
    the role to it (switch_to_fallback(), 8). Its message is the stop's, should nothing take it up."""


def switch_pending(role: str) -> bool:
    """Whether the run decided to move the role to its fallback CLI while its agent is still the limited one
    (a stop came between the decision and the new agent)."""
    return any(w.role == role and w.old_terminal == terminal_ids.get(role) for w in cli_switches)


def limit_outlasting(turn: Turn, line: str, until: float | None) -> RunError:
    """What a usage limit the loop will not wait out leads to: the role's fallback CLI when one is set and the
    role is not on it already (a fallback's own limit is waited out or stops the run: never back and forth), or
    the switch to it is decided already; else the stop."""
    fallback = switch_pending(turn.role) or (switched_to(turn.role) is None and fallback_for(turn.role) is not None)
    return (FallbackDue if fallback else UsageLimitStop)(turn, line, until)


def begin_limit_wait(turn: Turn) -> None:
    """The agent stopped at the usage limit its turn saw: wait until the reset and a margin (at most
    USAGE_LIMIT_MAX_WAIT), else go over to the role's fallback CLI, or stop saying when to rerun. Saved first, so
    a rerun during the wait waits on instead of resending."""
    limit, now = turn.facts.usage_limit, time.time()
    until = None if limit.resets_at is None else max(now, limit.resets_at + USAGE_LIMIT_MARGIN_SECONDS)
    outlasting = None if until is not None and until - now <= USAGE_LIMIT_MAX_WAIT else \
        limit_outlasting(turn, limit.line, until)
    record_agent_event(turn.role, turn.terminal_id, "usage limit", limit.line[:200] + (
        f"; waited until {clock_text(until)}" if outlasting is None else "; the role goes over to its fallback CLI"
        if isinstance(outlasting, FallbackDue) else "; the run stopped"))
    note_limit_in_flight(turn.role, limit.line, until)
    if outlasting is not None:
        raise outlasting
    turn.facts.limit_wait_until = time.monotonic() + (until - now)
    log_turn(turn.role, f"usage limit reached; waiting until {clock_text(until)} (in {duration_text(until - now)}), "
                        f"then it continues ({limit.line[:200]})")


def resume_limit_wait(turn: Turn) -> None:
    """A turn carried over while its agent waited out a usage limit: wait on, or -- the reset still too far, or
    the switch to the role's fallback CLI decided -- go over to it (or stop again); never resend it here."""
    line, until, now = in_flight.limit_line, in_flight.limit_until, time.time()
    if switch_pending(turn.role) or (until is not None and until - now > USAGE_LIMIT_MAX_WAIT):
        raise limit_outlasting(turn, line, until)
    remaining = max(0.0, (until or now) - now)
    turn.facts.limit_wait_until = time.monotonic() + remaining
    log_turn(turn.role, f"its agent stopped at its usage limit before the interruption ({line[:200]}); "
             + (f"waiting until {clock_text(until)} (in {duration_text(remaining)}), then it continues"
                if remaining else "telling it to continue"))


def continue_after_usage_limit(turn: Turn) -> None:
    """The usage limit has reset: the agent has its task in its conversation; tell it to go on. The turn's
    RESPONSE_TIMEOUT counts from here."""
    tell_to_continue(turn, "usage limit reset", "Your usage limit has reset.")
    note_limit_in_flight(turn.role, "", None)
    turn.facts.started = time.monotonic()


def remind_unless_limited(turn: Turn) -> str | None:
    """Before a reminder, the screen once more: a usage limit is waited out, not reminded of."""
    turn.facts.note_usage_limit(usage_limit_on(_screen(turn.terminal_id), time.time(), turn.facts.cli))
    if turn.facts.usage_limit is not None:
        begin_limit_wait(turn)
        return None
    turn.facts.resend_used = True
    return idle_without_file(turn)


def save_new_agents(new_ids: dict[str, str], roles: tuple[str, ...], **more: object) -> None:
    """The roles' new agents saved as theirs (`new_ids`: every role's terminal), each with the model it starts on and
    no new conversation due any more, with whatever else changed with them (`more`)."""
    update_run(terminal_ids=new_ids, agent_models={**agent_models, **{role: model_for(role) for role in roles}},
               fresh_agents_due={role: why for role, why in fresh_agents_due.items() if role not in roles}, **more)
    save_state()


def decide_fallback(due: FallbackDue) -> CliSwitch:
    """The switch of the role to its fallback CLI, saved before anything is asked of CAO (a rerun then
    finishes it), or the one saved by an earlier process whose agent is still the limited one."""
    saved = next((w for w in cli_switches if w.role == due.role and w.old_terminal == due.terminal_id), None)
    if saved is not None:
        return saved
    provider, model = fallback_for(due.role)
    switch = CliSwitch(due.role, provider_for(due.role), model_for(due.role), provider, model, utc_iso(),
                       utc_iso(due.until) if due.until is not None else "", due.line[:200], due.terminal_id)
    update_run(cli_switches=cli_switches + [switch])
    save_state()
    return switch


def switch_to_fallback(due: FallbackDue) -> None:
    """The role's agent stopped at a usage limit the loop will not wait out: a new agent on the role's fallback
    CLI takes the turn in full (a new conversation) and the role for the rest of the run; the limited one is
    ended. The new agent is asked for under the key of the one it replaces: a rerun at any instant makes none
    twice, and sends the turn to it once."""
    role, old = due.role, due.terminal_id
    switch = decide_fallback(due)
    crash_point("fallback-decided")
    new = new_agent_for(role, "creating the agent on the fallback CLI")
    record_agent_event(role, new, "new conversation", f"on its fallback CLI {switch.to_provider}; was terminal {old}")
    unsent = replace(in_flight, sent_at=None, limit_line="", limit_until=None, tokens_before=None) \
        if in_flight is not None and in_flight.role == role and not in_flight.reply_file else in_flight
    switch = replace(switch, new_terminal=new)
    save_new_agents({**terminal_ids, role: new}, (role,), in_flight=unsent,
                    cli_switches=[switch if w.role == role else w for w in cli_switches])
    record_event("cli_switched", role=role, from_provider=switch.from_provider, from_model=switch.from_model,
                 to_provider=switch.to_provider, to_model=switch.to_model, resets_at=switch.resets_at or None,
                 limit=switch.limit, old_terminal=old, new_terminal=new)
    log_turn(role, f"usage limit beyond USAGE_LIMIT_MAX_WAIT={USAGE_LIMIT_MAX_WAIT:g}s "
                   f"(resets {local_time(switch.resets_at) if switch.resets_at else 'at a time its CLI did not name'}):"
                   f" going over from {switch.from_provider} ({switch.from_model or 'its CLI default'}) to its "
                   f"fallback {switch.to_provider} ({switch.to_model or 'its CLI default'}); terminal {new} (was "
                   f"{old}) takes the turn in full, a new conversation, and the role for the rest of the run")
    crash_point("fallback-switched")
    end_agents_switched_from()


def end_agents_switched_from() -> None:
    """End the agents fallback CLIs took their roles from (once the new ones are saved), each noted done: right
    after a switch, and as a run resumes (a stop right after a switch left the old one up)."""
    for switch in [w for w in cli_switches if w.new_terminal and not w.old_ended]:
        exit_terminals([switch.old_terminal])
        with suppress(ApiError):             # gone already: nothing to remove
            api.delete_terminal(switch.old_terminal)
        update_run(cli_switches=[replace(w, old_ended=True) if w is switch else w for w in cli_switches])
        save_state()


# What each verdict that types into the terminal (or waits for its limit) does; none once the reply file came.
NUDGES: dict[Verdict, Callable[[Turn], str | None]] = {
    Verdict.RESEND: resend_unseen_prompt,
    Verdict.REMIND: remind_unless_limited,
    Verdict.CONTINUE: continue_after_provider_error,
    Verdict.WAIT_OUT_LIMIT: begin_limit_wait,
    Verdict.CONTINUE_AFTER_LIMIT: continue_after_usage_limit,
    Verdict.RESEND_IN_FULL: resend_in_full,
}


def act_on(turn: Turn, state: TurnState, verdict: Verdict) -> str | None:
    """Carry out a verdict: the reply once there is one, else None (or a RunError for a turn that failed)."""
    role, terminal_id, path = turn.role, turn.terminal_id, turn.path
    if verdict is Verdict.TAKE_REPLY:
        reply = read_reply_file(path)
        if not reply:
            turn.facts.note_file(None, time.monotonic())     # emptied again: keep waiting
        return reply or None
    if verdict is Verdict.LOST:
        raise lost_agent(role, terminal_id, why_lost(turn.facts, state), _screen(terminal_id))
    if verdict is Verdict.ERROR:
        output = _last_output(terminal_id)
        raise agent_failed(role, terminal_id, "reports status 'error'" + (f" ({_tail(output, 3)})" if output else ""))
    if verdict is Verdict.TIMEOUT:
        raise agent_failed(role, terminal_id, f"gave no reply within RESPONSE_TIMEOUT={RESPONSE_TIMEOUT:g}s; "
                                              "raise RESPONSE_TIMEOUT if it needs longer")
    nudge = NUDGES.get(verdict)
    if nudge is None or reply_file_version(path):
        return None                                          # nothing to do, or the file came in the meantime
    return nudge(turn)


def handle_permission_prompt(turn: Turn) -> None:
    """An agent waits for a yes/no answer: say so once, or answer 'y' (rate-limited) if allowed."""
    role, terminal_id, answers, now = turn.role, turn.terminal_id, turn.permissions, time.monotonic()
    step = answers.next_step(now)
    if step == "tell":
        answers.told_blocked = True
        log_turn(role, f"blocked: {MAX_PERMISSION_ANSWERS} permission prompts answered this turn; no more automatic "
                       f"answers (terminal {terminal_id})" if AUTO_ACCEPT_PERMISSIONS else
                       f"blocked: terminal {terminal_id} waits for a permission answer; answer it in "
                       f"`{tmux_hint('attach -t ' + session_name)}` or set AUTO_ACCEPT_PERMISSIONS=1")
    elif step == "answer":
        answers.answered, answers.last_answer_at = answers.answered + 1, now
        log_turn(role, f"permission prompt on terminal {terminal_id} answered 'y' "
                       f"({answers.answered}/{MAX_PERMISSION_ANSWERS}): {_tail(_last_output(terminal_id))}")
        deliver(role, terminal_id, "y")


def read_turn_record(turn: Turn) -> None:
    """Once a reply file is there, until something says the agent finished: whether its CLI's own record
    shows the turn over (where the loop reads that CLI's records on this machine)."""
    if turn.facts.file_version is not None and not turn.facts.finished_by and tokens_readable(turn.role):
        reading = turn_tokens(turn.role, turn.sent_wall, time.time(), turn.tokens_before)
        turn.facts.note_record(reading is not None and reading.over)
        turn.reads.record_read(time.monotonic())


def observe_terminal(turn: Turn) -> None:
    """One round of server reads for a turn: the status, the screen when it can tell more, and
    (every LIVENESS_CHECK_SECONDS without a file) whether the agent is still there."""
    status = api.get_status(turn.terminal_id)
    now = time.monotonic()
    turn.reads.status_read(now)
    turn.facts.note_status(status, now)
    read_turn_record(turn)
    if status not in KNOWN_STATUSES and not turn.told_unknown:
        turn.told_unknown = True
        log_turn(turn.role, f"CAO cannot tell the status of terminal {turn.terminal_id} ({status!r}, e.g. after "
                            "a server restart); judging the turn by the response file and the screen")
    liveness = turn.reads.liveness_due(now)
    screen, screen_read = None, liveness or turn.reads.screen_due(turn.facts, now)
    if screen_read:
        screen = _screen(turn.terminal_id)
        turn.facts.note_screen(screen, time.monotonic())
        if screen is not None:
            check_can_work(turn.role, turn.terminal_id, screen, at_rest=status in READY_STATUSES and
                           not turn.path.exists())       # at rest without its reply: why, if its CLI says
            turn.facts.note_usage_limit(usage_limit_on(screen, time.time(), turn.facts.cli))
            if note_conversation(turn.role, turn.terminal_id, screen):
                note_compaction(turn)
    note_gone(turn, screen, liveness, unreadable=screen_read and screen is None and status not in KNOWN_STATUSES)
    menu = open_menu(screen, turn.facts.cli)
    known = safe_menu_choice(menu, turn.facts.cli) if menu is not None and not turn.facts.lost else None
    if known:
        answer_menu_in_turn(turn, menu, known)     # e.g. what to do at a usage limit: wait for it
    elif status == "waiting_user_answer" and not turn.facts.lost:
        handle_permission_prompt(turn)


def note_gone(turn: Turn, screen: str | None, liveness: bool, unreadable: bool) -> None:
    """Whether the agent is gone: every LIVENESS_CHECK_SECONDS, and at once on a shell prompt or an unreadable
    screen while CAO cannot tell its status; with it, whether it left its reply complete (left_reply())."""
    if not (liveness or unreadable or shows_shell_prompt(screen)):
        return
    why = why_gone(turn.terminal_id, screen, unreadable)
    left = bool(why) and bool(left_reply(turn.role, turn.path))
    if left:
        log_turn(turn.role, f"terminal {turn.terminal_id} is gone ({why}); the reply it wrote is complete: taking it")
    turn.facts.note_lost(why, left)


def first_sent_at(role: str) -> float:
    """When the role's turn in flight was first sent (time.time()): where its CLI's records of it begin."""
    turn = in_flight if in_flight is not None and in_flight.role == role else None
    return (turn.first_sent_at or turn.sent_at or time.time()) if turn is not None else time.time()


def wait_for_reply(role: str, terminal_id: str, path: Path, message: str | None,
                   rebuild: Callable[[], Prompt] | None = None) -> tuple[str, str]:
    """Wait until the turn's rules say it is over: its answer, and what ended it. `message`: what was sent (None:
    carried over); `rebuild`: the prompt again, in full after a compaction."""
    now = time.monotonic()
    facts = TurnFacts(started=now, guard_since=now, markers=prompt_markers(message) if message else (),
                      cli=agent_cli(provider_for(role)))
    # CAO's send returned only now: nothing new to read yet, but soon (FIRST_LOOK_SECONDS).
    turn = Turn(role, terminal_id, path, message, facts,
                ReadSchedule(next_status_at=now + min(POLL_SECONDS, FIRST_LOOK_SECONDS),
                             next_liveness_at=now + LIVENESS_CHECK_SECONDS, records=tokens_readable(role)),
                rebuild=rebuild, sent_wall=first_sent_at(role),
                tokens_before=in_flight.tokens_before if in_flight is not None and in_flight.role == role else None)
    if message is None and in_flight is not None and in_flight.role == role and in_flight.limit_line \
            and not read_reply_file(path):           # an answer already written is taken, not waited for again
        resume_limit_wait(turn)
    began, next_progress_at = now, now + PROGRESS_SECONDS
    while True:
        now = time.monotonic()
        turn.facts.note_file(reply_file_version(path), now)
        if turn.reads.status_due(turn.facts, now):
            observe_terminal(turn)
        elif turn.reads.record_due(turn.facts, now):
            read_turn_record(turn)
        state, rule = decide(turn.facts, time.monotonic())
        reply = act_on(turn, state, rule.verdict)
        if reply is not None:
            return reply, rule.ended_by
        if PROGRESS_SECONDS and time.monotonic() >= next_progress_at:
            log_turn(role, progress_text(turn.facts, began, time.monotonic()))
            next_progress_at += PROGRESS_SECONDS
        now = time.monotonic()
        time.sleep(max(0.0, min(FILE_CHECK_SECONDS, turn.reads.next_look_at(turn.facts, now) - now)))


# ==========================================================================
# 7. The agents' terminals: created, ended, replaced
# ==========================================================================
# A run's five agents live in one CAO session, created all at once; a lost one is replaced there (all five in a
# new session when it is gone). Terminals known ready for their first prompt: seen ready twice, or made here.
settled_terminals: set[str] = set()


def new_session_name() -> str:
    """A name for a new run's CAO session, unique by its random part; `cao-` first, or CAO would add it and
    the terminals added under the name asked for would miss the session."""
    return f"cao-loop-{secrets.token_hex(4)}"


def agent_key(role: str, session: str, replacing: str = "") -> str:
    """The idempotency key of a request for the role's agent: the same for the same agent asked again, another
    for each new one (named by the terminal it replaces, so the state alone gives the key again)."""
    return f"{session}:{role}:" + (f"after-{replacing}" if replacing else "first")


def request_agent(role: str, session: str, first: bool = False, replacing: str = "") -> dict:
    """Ask CAO for the role's agent: its profile, provider and model; `first` makes the session `session`.
    The request carries agent_key(), so a request whose answer was lost is sent again, never making two."""
    key = agent_key(role, session, replacing)
    start_up.agent(role, "starting")
    if first:
        own_stage.note_session(session)
    try:
        answer = (api.create_session(profile_for(role), provider_for(role), session, model_for(role), key) if first
                  else api.create_terminal(session, profile_for(role), provider_for(role), model_for(role), key))
    except Exception as exc:
        start_up.agent(role, "failed", str(exc))
        raise
    start_up.agent(role, "up", terminal=str(answer.get("id", "")) if isinstance(answer, dict) else "")
    return answer


def note_model_answers(answers: dict[str, dict]) -> None:
    """One warning per role whose model CAO's provider cannot pass on (it answers `model_honored: false`)."""
    for role, answer in answers.items():
        if model_for(role) and answer.get("model_honored") is False:
            log(f"warning: CAO's {provider_for(role)} provider does not start its CLI with a chosen model: the "
                f"{role} runs on its CLI's default model, not {model_for(role)}")


def add_to_session(name: str, role: str, session: Future, interrupted: list[int]) -> dict | None:
    """Add the role's terminal to the session being created under `name` (CAO's answer): an add that comes
    before the session (404) is tried again while the session request is under way and once after, under the
    name the server answered; None, nothing created, when that request failed or the start was interrupted."""
    pause = 0.05
    while True:
        wait_for_futures([session], timeout=pause)
        session_finished = session.done()      # looked at before asking, so a 404 after it is final
        if interrupted or (session_finished and session.exception() is not None):
            return None
        if session_finished:                   # from now on, the name the server answered
            name = session.result()["session_name"]
        try:
            return request_agent(role, name)
        except ApiError as exc:
            if session_finished or not (exc.status_code == 404 and f"Session '{name}' not found" in str(exc)):
                raise
        pause = min(pause * 2, 0.5)


# What CAO answers when an agent CLI did not come up within its start-up limit.
CLI_START_TIMED_OUT = "initialization timed out"
START_WATCH_SECONDS = 1.0              # how often the screens of the terminals CAO is starting are read
START_LOG_TAIL_BYTES = 65_536          # how much of CAO's log of a terminal is read
CAO_TERMINAL_LOGS = ".aws/cli-agent-orchestrator/logs/terminal"   # under cao-server's HOME: one {id}.log a terminal
def read_start_screen(role: str, terminal_id: str, server: LocalServer | None = None) -> StartScreen:
    """The role's terminal's screen while it starts: CAO's output route; once CAO removed a terminal whose start
    failed, its log of it (`server`: cao-server running here, whose HOME holds it)."""
    screen = _screen(terminal_id) or ""
    home = server.env.get("HOME", "") if server is not None and not screen.strip() else ""
    if home:
        with suppress(OSError), open(Path(home) / CAO_TERMINAL_LOGS / f"{terminal_id}.log", "rb") as log_file:
            log_file.seek(max(0, log_file.seek(0, os.SEEK_END) - START_LOG_TAIL_BYTES))
            screen = log_file.read().decode("utf-8", errors="replace")
    return start_screen(provider_for(role), terminal_id, screen)


def starting_roles(session: str, futures: dict[str, Future], known: set[str],
                   seen: dict[str, StartScreen]) -> list[tuple[str, str]]:
    """(terminal id, role) of the terminals the session lists that CAO is still starting for a creation under way
    (by their profile; `known`: the ids of terminals already up)."""
    pending = [role for role, future in futures.items() if not future.done()]
    if all(role in seen for role in pending):           # each one's terminal known: no need to ask the session
        return [(seen[role].terminal_id, role) for role in pending]
    found = []
    for terminal_id, profile in api.session_profiles(session).items():
        if terminal_id in known:
            continue
        role = next((role for role, future in futures.items() if not future.done() and profile_for(role) == profile
                     and seen.get(role, StartScreen(terminal_id)).terminal_id == terminal_id), None)
        if role:
            found.append((terminal_id, role))
    return found


def watch_starts(session: str, futures: dict[str, Future], seen: dict[str, StartScreen],
                 interrupted: list[int], known: Iterable[str] = ()) -> None:
    """Wait for the creations, reading every START_WATCH_SECONDS the screen of each terminal CAO still starts
    (into `seen`): back at once when one shows that its CLI cannot start for good, not after CAO's time limit,
    or on a stop."""
    while True:
        _, pending = wait_for_futures(list(futures.values()), timeout=START_WATCH_SECONDS)
        if not pending or interrupted:     # a stop ends the wait at once (the caller removes the session)
            return
        up = set(known) | {future.result()["id"] for future in futures.values()
                           if future.done() and future.exception() is None and future.result()}
        starting = starting_roles(session, futures, up, seen)
        with ThreadPoolExecutor(max_workers=len(ROLES)) as readers:    # a busy CAO answers each in a second
            screens = list(readers.map(lambda found: read_start_screen(found[1], found[0]), starting))
        for (_, role), screen in zip(starting, screens):
            seen[role] = screen
            if screen.lasting:
                log(f"{role}: its agent CLI cannot start ({screen.lasting.why}); its screen: {screen.quoted()}")
                start_up.agent(role, "failed", f"{screen.lasting.why}: {screen.quoted()}", screen.terminal_id)
                return


def start_failure_hint(error: str) -> str:
    """What to do about a failed start-up whose cause CAO's own message hides or leaves unsaid: a CLI's trap named
    only where --check's look finds it sprung (its own ✗ line), then the CLI's start hint."""
    if re.search(r"Session '[^']*' already exists", error):
        return "; another CAO session has the name this run picked at random: run it again to pick another"
    if "HTTP 429" in error:
        return ("; the CAO server is full: it runs as many agent terminals as its CAO_MAX_TERMINALS allows; rerun "
                f"once other runs' agents have ended (`{cao_hint('shutdown --session <name>')}`), or on a server "
                "of its own")
    if CLI_START_TIMED_OUT not in error:
        return ""
    hint = (f"; the agent CLI did not come up on the cao-server's machine: `{command_name()} --check` finds "
            "what is missing (a CLI its agents' shells do not find, a profile, a known trap); CAO's log is in "
            "~/.aws/cli-agent-orchestrator/logs/ of the user running cao-server")
    named = [provider for provider, cli in AGENT_CLIS.items() if (cli.cao_name or cli.label) in error]
    sprung = [line.text for provider in named for line in sprung_traps(provider)]   # each one's own cause and fix
    return hint + "".join(f"; {text}" for text in sprung + [AGENT_CLIS[p].start_hint for p in named
                                                              if AGENT_CLIS[p].start_hint])


def exit_terminals(ids: list[str]) -> None:
    """Exit agent terminals, logging (not raising) what fails: used while stopping."""
    for terminal_id in filter(None, ids):
        try:
            api.exit_terminal(terminal_id)
        except ApiError as exc:
            if exc.status_code != 404:
                log(f"could not exit terminal {terminal_id}: {exc}")


def end_agents(ids: list[str], session: str) -> None:
    """Exit the agents, then remove their CAO session (one that holds nothing else), so that no session of idle
    shells stays behind; failures are logged, not raised."""
    exit_terminals(ids)
    if not session:
        return
    try:
        api.delete_session(session)
    except ApiError as exc:
        log(f"could not remove CAO session {session}: {exc}")


def creation_answers(futures: dict[str, Future], answers: dict[str, dict]) -> dict[str, str]:
    """CAO's answer for each role (into `answers`), and why each failed one failed (CAO's word): every creation
    is waited for, so that what came up can be exited when another did not (one left unanswered, cut short by the
    watch of the screens, counts as neither); a fault of the loop's own is raised then."""
    done = {role: future for role, future in futures.items() if future.done()}
    errors = {role: future.exception() for role, future in done.items()}
    answers.update((role, future.result()) for role, future in done.items()
                   if errors[role] is None and future.result() is not None)
    fault = next((error for error in errors.values() if error is not None and not isinstance(error, ApiError)), None)
    if fault is not None:
        raise fault
    return {role: f"{role}: {error}" for role, error in errors.items() if error is not None}


def version_tuple(version: str) -> tuple[int, ...]:
    """'2.5.4' -> (2, 5, 4): release numbers compared as numbers."""
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def provider_unknown_line(provider: str, report: dict[str, tuple[str, bool]] | None, version: str) -> str:
    """What to change when the CAO server does not know a provider: the release its row needs, else the
    providers the server lists."""
    cao = f"cao-server at {API}" + (f" (cli-agent-orchestrator {version})" if version else "")
    since = agent_cli(provider).cao_since
    if since:
        return (f"this CAO does not know {provider}: CAO >= {since} ({cao}); install it where cao-server runs "
                f"(`pip install 'cli-agent-orchestrator>={since}'`) and restart cao-server")
    known = ", ".join(sorted(report)) if report else "see `cao --help`"
    return (f"{cao} does not know provider {provider} (it knows: {known}): set PROVIDER (or <ROLE>_PROVIDER) to "
            "one of those, or upgrade CAO where cao-server runs")


def start_up_failure(failures: dict[str, str], screens: dict[str, StartScreen] | None = None) -> OrchestratorExit:
    """The error a failed start-up stops with, saying what to change where CAO's words leave it unsaid; a CLI that
    showed why it cannot start is quoted (exit 2: a retry would meet it again)."""
    error = failures.get("analyst") or "; ".join(failures.values())    # a failed session explains the rest
    if "(HTTP 401," in error:        # the server refuses our token: fixed in the settings, not by a retry
        return ConfigError(error)
    unknown = re.search(r"Unknown provider type:?\s*'?([\w.-]+)", error)
    if unknown:                      # a retry asks the same server again
        server = local_server()
        return ConfigError(provider_unknown_line(unknown.group(1), api.provider_report(),
                                                 server.cao_version() if server else ""))
    if "Working directory not allowed" in error:
        return ConfigError(f"{error}: set WD to a project folder CAO allows (not /tmp itself, nor a folder under "
                           "/root, /etc or another system path)")
    if re.search(r"\bmodel\b.*(is invalid|exceeds the)", error):    # CAO refused the model id, before starting anything
        return ConfigError(f"CAO refuses the model: {error}; set MODEL (or <ROLE>_MODEL) to a model id it "
                           "accepts, or leave it empty for each CLI's own default")
    return screen_failure(failures, screens or {}) or \
        RunError(f"could not create the agent terminals ({error}){start_failure_hint(error)}")


def screen_failure(failures: dict[str, str], screens: dict[str, StartScreen],
                   doing: str = "create the agent terminals") -> OrchestratorExit | None:
    """The stop for a failed role whose screen says why (its CLI's words quoted): exit 2 where they name a lasting
    reason or came again on a second start, else exit 3 with them; None where no failed role's screen was read."""
    shown = [(role, screens[role]) for role in ROLES if role in failures and role in screens and screens[role].lines]
    if not shown:
        return None
    role, screen = next(((role, screen) for role, screen in shown if screen.lasting), shown[0])
    label = agent_cli(provider_for(role)).label
    quoted = f"its screen (terminal {screen.terminal_id}): \"{screen.quoted()}\""
    if screen.lasting:
        return RunError(f"could not {doing}: the {role}'s {label} cannot start: "
                        f"{screen.lasting.why}; {quoted}; {screen.lasting.fix}", EXIT_USAGE)
    error = failures[role]
    if screen.again:
        return RunError(f"could not {doing}: the {role}'s {label} did not start, twice, showing "
                        f"the same: {quoted} ({error}){start_failure_hint(error)}", EXIT_USAGE)
    return RunError(f"could not {doing} ({error}); {quoted}{start_failure_hint(error)}")


def check_screens_started(answers: dict[str, dict], failures: dict[str, str],
                          screens: dict[str, StartScreen]) -> None:
    """A CLI CAO calls up may show on its screen that it cannot work (not signed in): such a role is failed."""
    for role, answer in answers.items():
        screen = read_start_screen(role, answer["id"])
        if screen.lasting:
            screens[role] = screen
            failures[role] = f"{role}: its agent CLI came up but cannot work ({screen.lasting.why})"
            start_up.agent(role, "failed", f"{screen.lasting.why}: {screen.quoted()}", screen.terminal_id)


def final_screens(failures: dict[str, str], screens: dict[str, StartScreen]) -> None:
    """Each failed role's last screen, read once its creation is over (from CAO's log, as CAO removed it); the one
    seen while it started where neither can be read."""
    server = None
    for role in failures:
        if role in screens and not screens[role].lasting:
            server = server or local_server()
            last = read_start_screen(role, screens[role].terminal_id, server)
            screens[role] = last if last.lines else screens[role]
            if screens[role].lines:
                start_up.agent(role, "failed", f"{failures[role]}; its screen: {screens[role].quoted()}",
                                 screens[role].terminal_id)


def in_background(cut_short: threading.Event, call: Callable, *args) -> Future:
    """`call(*args)` in a thread of its own whose answer nobody has to wait for: a creation a stop cut short
    is left to end on its own (the run ends its session), and never keeps the process from exiting; once
    `cut_short` is set, its requests are left to fail, never asked again (cut_short_here())."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(call(*args))
        except BaseException as exc:       # handed to whoever reads the answer
            future.set_exception(exc)

    thread = threading.Thread(target=run, daemon=True, name=f"cao-{getattr(call, '__name__', 'call')}")
    thread.cut_short = cut_short           # type: ignore[attr-defined]
    thread.start()
    return future


def cut_short_here() -> bool:
    """Whether this thread makes an agent whose start was cut short (its session removed): its requests fail with
    it, never asked again."""
    return getattr(threading.current_thread(), "cut_short", threading.Event()).is_set()


def answered_unless_stopped(futures: Iterable[Future], interrupted: list[int]) -> bool:
    """Wait for the answers (CAO answers a creation once its CLI is up: up to a minute) unless a stop signal
    is held first; whether they all came."""
    pending = list(futures)
    while pending and not interrupted:
        pending = list(wait_for_futures(pending, timeout=0.2).not_done)
    return not pending


def end_creation_cut_short(name: str, futures: Mapping[str, Future]) -> None:
    """A stop came while the five were created: the agents that are up are exited and the session is removed,
    which ends those still starting (a creation CAO has not begun finds no session); no answer is waited for."""
    answers = {role: future.result() for role, future in futures.items()
               if future.done() and future.exception() is None and future.result()}
    session = futures.get("analyst")
    with suppress(Exception):          # a server that cannot tell: the session is removed by its name all the same
        if own_stage.server is None and session is not None and not session.done() and api.session_terminals(name) is None:
            answers["analyst"] = session.result()      # not made yet: removed now, it would come after
            name = answers["analyst"]["session_name"]
    end_agents([answer["id"] for answer in answers.values()], name)


def create_terminals() -> tuple[str, dict[str, str]]:
    """Create the five terminals in one CAO session, all at once (CAO waits for each CLI to start) while their
    screens are watched; a start that timed out with no lasting reason shown goes once more alone; a failed start
    exits all it made, a stop removes the session at once."""
    name = new_session_name()
    providers = sorted({provider_for(role) for role in ROLES})
    start_up.step(f"creating the five agents on {API}")
    log(f"creating the five agent terminals on {API} with provider {', '.join(providers)} in {WD}, all at once in "
        f"CAO session {name}; CAO waits for each agent CLI to start (seconds with the scripted agent, up to a "
        "minute with real CLIs)")
    screens: dict[str, StartScreen] = {}
    answers: dict[str, dict] = {}
    cut_short = threading.Event()
    with signals_held("ending the terminals being created") as interrupted:
        failures = None                   # stays None on a fault of the loop's own: what came up is exited too
        try:
            failures = start_all_at_once(name, answers, screens, interrupted, cut_short)
            if failures is None:
                return name, {}            # not reached: signals_held raises the stop
            if failures and not interrupted and start_again_may_help(failures, screens):
                failures = start_again_one_at_a_time(answers, failures, interrupted, screens, cut_short)
        finally:
            if not (failures is None and interrupted) and (failures is None or failures or interrupted
                                                           or len(answers) < len(ROLES)):
                end_started(answers, name, cut_short.is_set())
        if failures and not interrupted:
            raise start_up_failure(failures, screens)
    note_model_answers(answers)
    terminals = {role: answers[role]["id"] for role in ROLES}
    settled_terminals.update(terminals.values())   # CAO answered each creation once its CLI was ready
    return answers["analyst"]["session_name"], terminals


def start_all_at_once(name: str, answers: dict[str, dict], screens: dict[str, StartScreen],
                      interrupted: list[int], cut_short: threading.Event) -> dict[str, str] | None:
    """The five creations at once, the session's first, the four others added to it, their screens watched into
    `screens`: CAO's answers (into `answers`), and why each failed role failed (one whose CLI cannot start cuts the
    wait short: `cut_short` set); None after a stop, which removed the session at once."""
    session = in_background(cut_short, request_agent, "analyst", name, True)
    futures = {"analyst": session}
    for role in ROLES[1:]:
        futures[role] = in_background(cut_short, add_to_session, name, role, session, interrupted)
    watch_starts(name, futures, screens, interrupted)
    if interrupted:
        end_creation_cut_short(name, futures)
        return None
    if any(not future.done() for future in futures.values()):
        cut_short.set()                # the creations cut short fail with the session: not asked again
    failures = creation_answers(futures, answers)
    failures.update({role: f"{role}: its agent CLI cannot start ({screen.lasting.why})"
                     for role, screen in screens.items() if screen.lasting and role not in answers})
    check_screens_started(answers, failures, screens)
    final_screens(failures, screens)
    return failures


def end_started(answers: dict[str, dict], name: str, cut_short: bool) -> None:
    """Exit the agents that came up and remove their session (one cut short too, while its creations are under
    way: CAO removes it slowly then, so beside the stop; a run's own server ends it all anyway)."""
    made = ([answer["id"] for answer in answers.values()],
            answers.get("analyst", {}).get("session_name", name if cut_short else ""))
    if not cut_short:
        end_agents(*made)
    elif own_stage.server is None:
        threading.Thread(target=end_agents, args=made, name="ending the agents").start()


def start_again_may_help(failures: dict[str, str], screens: dict[str, StartScreen]) -> bool:
    """Every failure a start that timed out, none with a lasting reason on its screen."""
    return all(CLI_START_TIMED_OUT in error and not (role in screens and screens[role].lasting)
               for role, error in failures.items())


def start_again_one_at_a_time(answers: dict[str, dict], failures: dict[str, str], interrupted: list[int],
                              screens: dict[str, StartScreen], cut_short: threading.Event) -> dict[str, str]:
    """The agents that did not start in time among five, each started alone (start_alone(); all five in a new
    session when the analyst's, whose session CAO then removed, was one). Fills `answers`; the failures left, each
    with its screen in `screens`. A stop ends the wait at once: the caller removes the session, this the new one
    it was making."""
    if "analyst" not in answers:
        end_agents([answer["id"] for answer in answers.values()], "")
        answers.clear()
    missing = [role for role in ROLES if role not in answers]
    log(f"{', '.join(failures)}: the agent CLI did not start within CAO's time limit while {len(ROLES)} started "
        f"at once; starting {', '.join(missing)} again, one at a time")
    for role in missing:
        session = answers["analyst"]["session_name"] if answers else new_session_name()
        start = start_alone(role, session, interrupted, cut_short, first=role == "analyst",
                            known=[answer["id"] for answer in answers.values()], before=screens.get(role))
        if interrupted:
            if role == "analyst":
                end_agents([], session)
            return {}
        if start.answer is None:
            if start.screen is not None:
                screens[role] = start.screen
            return {role: f"{role}: {start.error or 'its agent CLI cannot start'} (on its second try too, started "
                          "alone)"}
        answers[role] = start.answer
    log("all five agents are up after the second try")
    return {}


def replacements_used() -> int:
    """Replacements this run has made: a vanished session's five new agents count as one."""
    return len({r.event for r in replacements})


def replacement_summary(events: list[Replacement]) -> str:
    """'2 (programmer 1a2b -> 3c4d at ...: its agent CLI exited; ...)': the replacements, for people."""
    count = len({r.event for r in events})
    return f"{count} (" + "; ".join(f"{r.role} {r.old_terminal or '-'} -> {r.new_terminal} at {r.at}: {r.why}"
                                    for r in events) + ")"


def agent_events_summary(events: list[AgentEvent]) -> str:
    """'programmer compacted at ...; tester usage limit at ... (...)': the agent events, for people."""
    return "; ".join(f"{e.role} {e.what} at {e.at}" + (f" ({e.detail})" if e.detail else "") for e in events)


@dataclass(frozen=True)
class AloneStart:
    """How starting one agent alone ended: CAO's answer; else its last error (None: its screen said why) and its
    screen (None: never read, or nothing wrong on it)."""

    answer: dict | None = None
    error: ApiError | None = None
    screen: StartScreen | None = None

    def failure(self, role: str, doing: str) -> OrchestratorExit:
        """The stop for a failed start: its CLI's words where they say why (exit 2), else CAO's error."""
        failed = {role: f"{role}: {self.error or 'its agent CLI cannot start'}"}
        told = self.screen is not None and (self.screen.lasting or self.screen.again)
        return (screen_failure(failed, {role: self.screen}, doing) if told else None) or self.error \
            or RunError(failed[role])


def start_alone(role: str, session: str, interrupted: list[int], cut_short: threading.Event, first: bool = False,
                replacing: str = "", known: Iterable[str] = (), before: StartScreen | None = None) -> AloneStart:
    """The role's agent started alone, its screen watched -- a replacement (`replacing`: the terminal it replaces),
    or one that did not start in time among five (`before`: what it showed then; `first`: it makes the session).
    A start CAO says timed out goes again, up to its CLI's `start_tries`; not after a stop, nor once its screen says
    why its CLI cannot start, nor -- for a CLI of one try -- once it shows what it showed the time before (`again`:
    a CLI given more tries, as Hermes, can time out so with its prompt on screen)."""
    tries = max(agent_cli(provider_for(role)).start_tries, 1)
    for attempt in range(1, tries + 1):
        start = start_once(role, session, interrupted, cut_short, first, replacing, known)
        if start.answer is not None or interrupted:
            return start
        screen = start.screen
        if screen is not None and tries == 1 and before is not None and before.lines and screen.lines == before.lines:
            return replace(start, screen=replace(screen, again=True))
        if (screen is not None and screen.lasting) or CLI_START_TIMED_OUT not in str(start.error) or attempt == tries:
            return start
        before = screen
        log(f"{role}: the {'new ' if replacing else ''}agent's CLI did not start within CAO's time limit "
            f"({start.error}); starting it again")
    return AloneStart()                    # not reached: the last try returns


def start_once(role: str, session: str, interrupted: list[int], cut_short: threading.Event, first: bool,
               replacing: str, known: Iterable[str]) -> AloneStart:
    """One start of the role's agent, watched. A CLI that shows why it cannot start is not waited for (its
    creation, cut short, is never asked again); one that came up so is exited."""
    seen: dict[str, StartScreen] = {}
    future = in_background(cut_short, request_agent, role, session, first, replacing)
    watch_starts(session, {role: future}, seen, interrupted, known)
    if seen.get(role) and seen[role].lasting:
        cut_short.set()
        return AloneStart(screen=seen[role])
    if interrupted:
        return AloneStart()
    try:
        answer = future.result()
    except ApiError as exc:
        final_screens({role: str(exc)}, seen)
        return AloneStart(error=exc, screen=seen.get(role))
    failures: dict[str, str] = {}
    check_screens_started({role: answer}, failures, seen)
    if failures:
        exit_terminals([answer["id"]])
        return AloneStart(screen=seen[role])
    return AloneStart(answer=answer)


def new_agent_for(role: str, doing: str) -> str:
    """A new agent for the role in the run's session (a replacement, or a new conversation), started alone; its
    terminal id. A stop does not wait for CAO's answer: the state still names the terminal replaced, so a rerun's
    request carries the same key and gets the agent this one made."""
    with signals_held(doing) as interrupted:
        cut_short = threading.Event()
        request = in_background(cut_short, start_alone, role, session_name, interrupted, cut_short, False,
                                terminal_ids.get(role, ""), terminal_ids.values())
        if not answered_unless_stopped([request], interrupted):
            return ""          # not reached: the stop is raised; a rerun asks under the same key, never for two
        start = request.result()
    if start.answer is None:
        raise start.failure(role, "start a new agent")
    note_model_answers({role: start.answer})
    settled_terminals.add(start.answer["id"])      # CAO answered once its CLI was ready
    return start.answer["id"]


def remove_terminal(terminal_id: str) -> None:
    """Remove a terminal the run no longer uses; one CAO cannot remove is logged, not fatal."""
    try:
        api.delete_terminal(terminal_id)
    except ApiError as exc:
        log(f"could not remove terminal {terminal_id}: {exc}")


def died_starting(terminal_id: str) -> bool:
    """Whether the terminal's agent was seen up (made by this process, or ready twice) and has never been
    sent a prompt of the run: a CLI that died as it started, with nothing of the run in it."""
    return terminal_id in settled_terminals and f"intro:{terminal_id}" not in context_sent \
        and all(r.terminal != terminal_id for r in turn_records)


def check_replaceable(lost: AgentLost) -> bool:
    """Stop on `lost` unless a new agent may take its place: REPLACE_LOST_AGENTS=1, or a CLI that died as it
    started in a session still there (nothing of the run goes with it, whatever REPLACE_LOST_AGENTS says);
    and never past MAX_AGENT_REPLACEMENTS. Says whether the agents' session is gone."""
    if not REPLACE_LOST_AGENTS and not died_starting(lost.terminal_id):
        raise lost
    session_gone = api.session_terminals(session_name) is None if session_name else True
    if not REPLACE_LOST_AGENTS:
        if session_gone:
            raise lost
        log(f"the {lost.role} agent's CLI is gone before its first prompt ({lost.why}): starting it again, "
            "as nothing of the run goes with it")
    if replacements_used() >= MAX_AGENT_REPLACEMENTS:
        raise AgentLost(lost.role, lost.terminal_id, lost.why, lost.last_line,
                        f"{counted(replacements_used(), 'replacement')} made already, MAX_AGENT_REPLACEMENTS="
                        f"{MAX_AGENT_REPLACEMENTS}: raise it to go on with a new agent, or set RESUME=0 to start "
                        "the run over")
    return session_gone


def turn_goes_again(roles: Iterable[str]) -> bool:
    """Whether the prompt in flight goes again, to a new agent of `roles` (whatever its status reads): not when
    its reply was taken already, or left complete by the gone agent (left_reply())."""
    if in_flight is None or in_flight.role not in roles or taken_reply(in_flight.role) is not None:
        return False
    if left_reply(in_flight.role, response_path(in_flight.role)):
        log(f"{in_flight.role}: its reply, written before its agent was gone, is complete: it is taken, and the "
            "turn is not sent again")
        return False
    return True


def replace_lost_agent(lost: AgentLost) -> None:
    """A new agent for a lost one (REPLACE_LOST_AGENTS=1, or one that died as it started) in its session, all
    five in a new one when it is gone; else the run stops on `lost`. A new agent gets its whole prompt."""
    session_gone = check_replaceable(lost)
    old_ids = dict(terminal_ids)
    if session_gone:
        log(f"replacing all five agents: their CAO session {session_name} is gone ({lost.role}: {lost.why})")
        end_agents([], session_name)              # CAO still lists the gone session's terminals
        new_session, new_ids = create_terminals()
        roles = ROLES
    else:
        log(f"replacing the {lost.role} agent (terminal {lost.terminal_id}: {lost.why})")
        new_id = new_agent_for(lost.role, "creating the replacement agent")
        new_session, new_ids, roles = session_name, {**terminal_ids, lost.role: new_id}, (lost.role,)
        remove_terminal(lost.terminal_id)
    event, at = replacements_used() + 1, utc_iso()
    unsent = replace(in_flight, sent_at=None) if turn_goes_again(roles) else in_flight
    if unsent is not in_flight:         # the person's notes it carried go again with it, to the new agent
        forget_sent(mark for mark in in_flight.sent_in_full if mark.startswith("note-"))
    save_new_agents(new_ids, roles, in_flight=unsent, session_name=new_session,
                    replacements=replacements + [Replacement(role, old_ids.get(role, ""), new_ids[role], at,
                                                             lost.why, event) for role in roles])
    record_event("agent_replaced", roles=list(roles), old_terminals={role: old_ids.get(role) for role in roles},
                 new_terminals={role: new_ids[role] for role in roles}, session=new_session, why=lost.why,
                 replacement=event)
    log(f"replacement {event}/{MAX_AGENT_REPLACEMENTS}: " + ", ".join(
        f"{role} {old_ids.get(role) or '-'} -> {new_ids[role]}" for role in roles)
        + f" in CAO session {new_session}; a new agent gets its whole prompt")


# ==========================================================================
# 8. Asking an agent
# ==========================================================================
# One turn: the prompt out (once, recorded as it goes), the wait, the reply archived; a stop's turn is taken over.

MAX_INLINE_PROMPT_BYTES = 32_000   # CAO refuses a query string of ~64 KB: a longer prompt goes as a file to read


class Prompt(str):
    """A prompt's text (a str) with the once-only blocks it carries in full ("<block>:<terminal id>"), recorded
    as sent once the prompt has (or may have) reached the terminal."""

    def __new__(cls, text: str, carries_in_full: Iterable[str] = ()):
        prompt = super().__new__(cls, text)
        prompt.carries_in_full = tuple(carries_in_full)
        return prompt


def wait_until_settled(role: str, terminal_id: str) -> None:
    """Before the first prompt to a terminal this process did not create (a resumed run's): at rest twice in a
    row (some CLIs show their prompt before they take input) -- its last turn over, as decide() judges it."""
    if terminal_id in settled_terminals:
        return
    started = time.monotonic()
    facts = TurnFacts(started=started, guard_since=started, cli=agent_cli(provider_for(role)), awaiting=False,
                      answered_before=any(record.terminal == terminal_id for record in turn_records))
    at_rest_in_a_row, next_liveness_at, next_note_at = 0, started + LIVENESS_CHECK_SECONDS, started + PROGRESS_SECONDS
    while at_rest_in_a_row < 2:
        facts.note_screen(_screen(terminal_id), time.monotonic())
        facts.note_status(api.get_status(terminal_id), time.monotonic())
        if time.monotonic() >= next_liveness_at:       # a gone agent's stale `processing` is never waited out
            check_gone(role, terminal_id, facts.screen)
            next_liveness_at += LIVENESS_CHECK_SECONDS
        if PROGRESS_SECONDS and time.monotonic() >= next_note_at:     # a long wait says what it waits for
            log_turn(role, f"waiting {time.monotonic() - started:.0f}s for terminal {terminal_id} to be at rest "
                           f"before its prompt ({not_ready_yet(facts)})")
            next_note_at += PROGRESS_SECONDS
        state, rule = decide(facts, time.monotonic())
        if state is TurnState.FAILED:
            raise agent_failed(role, terminal_id, "reports status 'error' before its first prompt")
        at_rest_in_a_row = at_rest_in_a_row + 1 if rule.ended_by else 0
        if time.monotonic() - started >= RESPONSE_TIMEOUT:
            raise agent_failed(role, terminal_id, f"did not become ready within RESPONSE_TIMEOUT="
                                                  f"{RESPONSE_TIMEOUT:g}s ({not_ready_yet(facts)})")
        if at_rest_in_a_row < 2:
            time.sleep(min(FILE_CHECK_SECONDS, POLL_SECONDS))
    settled_terminals.add(terminal_id)


def not_ready_yet(facts: TurnFacts) -> str:
    """What a terminal not yet at rest shows: CAO's status, and its CLI's last marks."""
    marks = turn_marks_on(facts.screen, facts.cli)
    return f"status {facts.cao_status!r}" + (f"; its marks: {', '.join(marks[-4:])}" if marks else "")


def deliverable_message(role: str, prompt: str) -> str:
    """The prompt itself, or -- if too long for CAO's query string -- a pointer to a file holding it."""
    if len(quote(prompt, safe="")) <= MAX_INLINE_PROMPT_BYTES:
        return str(prompt)
    directory = Path(WD) / ".tmp" / "agent-prompts"
    directory.mkdir(parents=True, exist_ok=True)
    number = len(list(directory.glob(f"{role}-*.md"))) + 1
    path = directory / f"{role}-{number}.md"
    path.write_text(prompt, encoding="utf-8")
    log_turn(role, f"prompt of {len(prompt)} chars is too long to paste; sent as {path}")
    return (f"Your instructions for this turn are too long to paste ({len(prompt)} characters). "
            f"Read all of this file first and do exactly what it says, including where to write your answer.\n"
            f"Read and follow the instructions in this file: {path}")


def turn_position(role: str) -> dict:
    """Where in the loop a turn belongs; a resumed run compares it with the prompt in flight."""
    position = {"role": role, "round": current_round, "phase": current_phase, "cycle": phase_cycle}
    if role == "programmer" and story_progress is not None and story_progress.current:
        position.update(story=story_progress.current, attempt=story_progress.attempt)
    return position


def carried_over_turn(role: str, path: Path) -> str:
    """After an interruption, whether this very prompt already went out: 'taken' (its answer kept), 'left' (its
    gone agent left it complete), 'reply', 'limited' (a usage-limit wait), 'working' or '' (send it).
    A response file older than the prompt is an earlier turn's: moved aside."""
    if in_flight is None or in_flight.sent_at is None or not in_flight.belongs_to(turn_position(role)):
        return ""
    if not read_reply_file(path) and taken_reply(role) is not None:
        return "taken"
    if in_flight.terminal not in ("", terminal_ids[role]):
        return "left" if left_reply(role, path) else ""     # the new agent never had it: sent to it (fresh)
    try:
        written_at = path.stat().st_mtime
    except OSError:
        written_at = None
    if written_at is not None:
        if written_at >= in_flight.sent_at - MTIME_SLACK_SECONDS and read_reply_file(path):
            return "reply"
        set_aside_stale_reply(path)
    if in_flight.limit_line:
        return "limited"         # its agent waits out a usage limit: the wait continues the turn
    return "working" if at_work(role) else ""


def at_work(role: str) -> bool:
    """Whether the role's agent may be at work on the prompt sent before an interruption: decide() finds it
    busy with the facts a carried-over wait begins with (not failed, not idle by the status its row trusts
    or by its marks)."""
    terminal_id, now = terminal_ids[role], time.monotonic()
    facts = TurnFacts(started=now, guard_since=now, cli=agent_cli(provider_for(role)))
    facts.note_status(api.get_status(terminal_id), now)
    facts.note_screen(_screen(terminal_id), now)
    return decide(facts, now)[0] in BUSY_STATES


def send_prompt(role: str, prompt: str) -> str:
    """Send a turn's prompt, saved as in flight first; return what was sent. A delivery whose answer broke
    off is watched, not repeated."""
    terminal_id = terminal_ids[role]
    wait_until_settled(role, terminal_id)
    set_aside_stale_reply(response_path(role))
    message = deliverable_message(role, prompt)
    now = time.time()
    position = turn_position(role)
    again = in_flight is not None and in_flight.belongs_to(position) and in_flight.number is not None
    update_run(in_flight=InFlight(**position, sent_at=now, sent_in_full=getattr(prompt, "carries_in_full", ()),
                                  number=in_flight.number if again else _next_archive_number(),
                                  first_sent_at=in_flight.first_sent_at if again else now,
                                  prompt_bytes=len(prompt.encode("utf-8")),
                                  resends=in_flight.resends if again else 0,
                                  tokens_before=in_flight.tokens_before if again and in_flight.tokens_before
                                  else turn_tokens_before(role),
                                  terminal=terminal_id))
    save_state()
    keep_sent(role, "resend" if again else "prompt", prompt)   # sent again by a new process: kept below the first
    write_report()
    log_turn(role, f"prompt sent to terminal {terminal_id} ({len(prompt)} chars)")
    record_event("turn_sent", **position, terminal=terminal_id, number=in_flight.number,
                 prompt_bytes=in_flight.prompt_bytes, resend=again)
    try:
        deliver(role, terminal_id, message)
    except ApiError as exc:
        if exc.unsent or not exc.retryable:
            raise
        # The answer broke off (a server restart): the wait sends it again only if nothing shows it arrived.
        log_turn(role, f"delivery to terminal {terminal_id} broke off ({exc}); watching whether the "
                       "prompt arrived before sending it again")
    record_sent(in_flight.sent_in_full)
    return message


def turn_timing(path: Path) -> str:
    """' after 6.2s (file written 0.4s before)': how long the turn took, and how long the loop took to see it."""
    now = time.time()
    sent_at = in_flight.sent_at if in_flight is not None else None
    text = f" after {now - sent_at:.1f}s" if sent_at is not None else ""
    with suppress(OSError):
        text += f" (file written {max(0.0, now - path.stat().st_mtime):.1f}s before)"
    return text


def recorded_end_text(reading: TokenReading | None, taken: float) -> str:
    """'; its CLI recorded the turn's end 0.12s before': what of the wait after the agent's turn was the loop's
    ('' when the turn's record does not say when)."""
    if reading is None or reading.ended_at is None:
        return ""
    return f"; its CLI recorded the turn's end {max(0.0, taken - reading.ended_at):.2f}s before"


def sent_turn_facts(role: str, taken: float) -> dict:
    """What the role's prompt in flight tells of its answered turn (where in the run, when it went, the
    nudges it took, its file); without one, the turn is placed where the run is now."""
    sent = in_flight if in_flight is not None and in_flight.role == role else None
    if sent is None:
        return {"seconds": None, "phase": current_phase, "cycle": phase_cycle}
    first_sent = sent.first_sent_at or sent.sent_at
    prompt_file = prompt_file_path(role, sent.number) if sent.number else None
    return {"seconds": round(taken - sent.sent_at, 1) if sent.sent_at is not None else None,
            "phase": sent.phase, "cycle": sent.cycle,
            "sent_at": utc_iso(first_sent, precise=True) if first_sent else "",
            "reminders": sent.reminders, "resends": sent.resends, "tokens_before": sent.tokens_before,
            "prompt_file": prompt_file.name if prompt_file is not None and prompt_file.exists() else ""}


def record_turn(role: str, prompt_bytes: int, reply: str, archived: Path,
                taken: float | None = None) -> tuple[TurnRecord, TokenReading | None]:
    """Remember an answered turn (saved with the state) with the tokens its CLI has recorded so far; `taken`:
    when the loop took the reply (time.time()), else now."""
    taken = time.time() if taken is None else taken
    facts = sent_turn_facts(role, taken)
    record = TurnRecord(role, current_round, prompt_bytes=prompt_bytes, taken_at=utc_iso(taken, precise=True),
                        reply_bytes=len(reply.encode("utf-8")), reply_file=archived.name,
                        terminal=terminal_ids.get(role, ""), provider=provider_for(role), **facts)
    add_turn_record(record)
    reading = read_turn_tokens(len(turn_records) - 1)
    if not any(e.get("event") == "reply_taken" and e.get("reply_file") == record.reply_file
               for e in read_events(Path(run_dir) / EVENTS_FILE)):   # a stop before the state saved it: said once
        record_event("reply_taken", role=role, round=record.round, phase=record.phase, cycle=record.cycle,
                     terminal=record.terminal, seconds=record.seconds, reply_bytes=record.reply_bytes,
                     reply_file=record.reply_file, tokens=tokens_json(record.tokens), model=record.model or None,
                     provider=record.provider)
    return record, reading


# -- Tokens used and the run's budget --------------------------------------------------
# Read when a reply is taken, before each send (the budget), and last when the role's next turn is sent.
TOKENS_SETTLE_SECONDS = 10.0   # at a run's end: how long the CLIs may take to record the end of the last turns
TOKENS_CATCH_UP_SECONDS = 3.0  # before a send: how long they may take to record the end of the turns before it


class BudgetReached(RunError):
    """The run has used its MAX_RUN_TOKENS or MAX_RUN_COST: stopped before a turn, resumable with a higher one."""

    def __init__(self, message: str, code: int = EXIT_BUDGET):
        super().__init__(message, code)


def read_turn_tokens(number: int, final: bool = False) -> TokenReading | None:
    """Read what an answered turn's CLI recorded from the turn's first send until now. Figures read before
    stay if the records are gone since (a CLI that archived or removed them)."""
    record = turn_records[number]
    since = parse_utc_iso(record.sent_at)
    reading = None if since is None else turn_tokens(record.role, since.timestamp(), time.time(),
                                                     record.tokens_before, provider=record.provider)
    set_turn_tokens(number, reading.by_model if reading is not None else record.tokens, final,
                    reading.context if reading is not None else None, reading.model if reading is not None else "")
    return reading


def read_growing_tokens(seconds: float, pause: float, final: bool = False, unread_to_come: bool = False) -> list[int]:
    """Read again the turns whose tokens may still grow (their numbers), every `pause` for up to `seconds` until
    their CLIs have recorded their ends, or a stop (`unread_to_come`: a turn of no reading yet is waited for too where
    its role's CLI has recorded others)."""
    deadline = time.monotonic() + seconds
    growing = [number for number, record in enumerate(turn_records) if not record.tokens_final]
    while growing:
        readings = {number: read_turn_tokens(number, final=final) for number in growing}
        roles_found = {record.role for record in turn_records if record.tokens is not None}
        to_come = [number for number, reading in readings.items() if (not reading.over if reading is not None
                   else unread_to_come and turn_records[number].role in roles_found)]
        if not to_come or time.monotonic() >= deadline or stop_held():
            break
        time.sleep(pause)
    return growing


def tokens_before_send(role: str) -> None:
    """Before a turn is sent: the turns whose tokens may still grow are read again -- once their CLIs have
    recorded their ends (up to TOKENS_CATCH_UP_SECONDS: a reply taken at CAO's ready status can be seen before its
    CLI's last response is recorded, and a kill from here on would keep the turn's tokens short), the role's own
    for the last time -- and the run's budget is checked."""
    for number in read_growing_tokens(TOKENS_CATCH_UP_SECONDS, 0.25):
        if turn_records[number].role == role:
            read_turn_tokens(number, final=True)
    check_budget(role)


def settle_tokens(run_ended: bool) -> None:
    """When the loop stops: read again the turns whose tokens may still grow; at a run's end, up to
    TOKENS_SETTLE_SECONDS for the CLIs to record their last turns, whose figures then stand."""
    read_growing_tokens(TOKENS_SETTLE_SECONDS if run_ended else 0.0, 0.5, final=run_ended, unread_to_come=True)


def check_budget(role: str) -> None:
    """Stop before the role's turn is sent if the run has used MAX_RUN_TOKENS or MAX_RUN_COST (BudgetReached)."""
    if not (MAX_RUN_TOKENS or MAX_RUN_COST):
        return
    unread = next((number for number, record in enumerate(turn_records) if record.tokens is None), None)
    if unread is not None:            # counting on without them would spend past the budget unseen
        record = turn_records[unread]
        raise BudgetReached(f"the tokens of turn {unread + 1} (the {record.role}'s, terminal {record.terminal}, "
                            f"sent {record.sent_at}) cannot be read from its CLI's records "
                            f"({agent_cli(provider_for(record.role)).records}): the budget cannot count them, so the "
                            f"{role}'s turn was not sent; state saved. Find why its CLI recorded nothing "
                            "(AGENT_HOME), or unset MAX_RUN_TOKENS and MAX_RUN_COST to go on without a budget",
                            EXIT_USAGE)
    used = turns_tokens(turn_records)[0] or {}
    total = sum(used.values(), TokenUse()).total
    go_on = f"state saved: rerun with a higher {{}} to go on with the {role}'s turn"
    if MAX_RUN_TOKENS and total >= MAX_RUN_TOKENS:
        raise BudgetReached(f"the run has used {total:,} tokens ({tokens_text(used)}), its budget is "
                            f"MAX_RUN_TOKENS={MAX_RUN_TOKENS}; " + go_on.format("MAX_RUN_TOKENS"))
    if not MAX_RUN_COST:
        return
    unpriced = sorted(model for model in used if price_of(model) is None)
    if unpriced:
        raise BudgetReached(f"MAX_RUN_COST cannot be kept: MODEL_PRICES has no price for {', '.join(unpriced)} "
                            f"(the agents' model); add it, then rerun to go on with the {role}'s turn", EXIT_USAGE)
    cost = cost_of(used) or 0.0
    if cost >= MAX_RUN_COST:
        raise BudgetReached(f"the run has cost about {cost:.4f} ({tokens_text(used)}), its budget is "
                            f"MAX_RUN_COST={MAX_RUN_COST:g}; " + go_on.format("MAX_RUN_COST"))


def say_tokens_not_counted() -> None:
    """Once, as a run starts: which of its CLIs record no tokens (their turns' lines then say nothing of them)."""
    note = tokenless_note(providers_in_use())
    if note:
        log(f"{note}: their turns' tokens are not counted")


# -- The agent's conversation ---------------------------------------------------
# Once-only text holds while the conversation does: after a compaction or /clear it goes again in full; a new
# agent starts a conversation anew (FRESH_CONTEXT=round, or a context nearly full that nothing will compact).

def record_agent_event(role: str, terminal_id: str, what: str, detail: str = "") -> None:
    """Keep what happened to an agent's conversation or account in the run's record (saved with the state)."""
    update_run(agent_events=agent_events + [AgentEvent(role, terminal_id, utc_iso(), what, detail)])
    record_event("agent_event", role=role, terminal=terminal_id, what=what, detail=detail)


def conversation_started_over(terminal_id: str) -> bool:
    """Whether the terminal's agent is known to have started (or lost) its conversation during the run."""
    return terminal_id in {r.new_terminal for r in replacements} or any(
        e.terminal == terminal_id for e in agent_events if e.what in ("compacted", "cleared", "new conversation"))


def forget_conversation(role: str, terminal_id: str, what: str, detail: str = "") -> bool:
    """The terminal's conversation lost (or is about to lose) what it was told once: its next prompt carries
    every block in full. False when there was nothing to forget (seen already, or never sent)."""
    marks = {mark for mark in context_sent if mark.rpartition(":")[2] == terminal_id and not mark.startswith("note-")}
    if not marks:
        return False                     # already forgotten (the same words seen again), or never sent
    record_agent_event(role, terminal_id, what, detail)
    forget_sent(marks)
    save_state()
    log_turn(role, f"its conversation was {what}; the next prompt carries the full task again"
             if what in ("compacted", "cleared") else
             f"{detail}: the next prompt carries the full task, not back-references")
    return True


def note_conversation(role: str, terminal_id: str, screen: str | None) -> str:
    """Act on what the agent's screen says of its conversation: compacted or cleared, or its context nearly
    full. Says 'compacted' or 'cleared' when that forgot what the terminal had been sent."""
    change, detail = conversation_change(screen, agent_cli(provider_for(role)))
    if change in ("compacted", "cleared"):
        return change if forget_conversation(role, terminal_id, change) else ""
    if change == "context low" and role not in fresh_agents_due and terminal_ids.get(role) == terminal_id:
        why = f"its context is nearly full ({detail}) and its CLI will not compact it"
        record_agent_event(role, terminal_id, "context low", detail)
        update_run(fresh_agents_due={**fresh_agents_due, role: why})
        save_state()
        log_turn(role, f"{why}; a new agent takes its next turn, with the full task")
    return ""


# A compaction foreseen: a prompt that may set one off keeps the full task (the CLIs keep it after the summary).
COMPACTION_FORESIGHT = 0.85   # of the context at which its CLI compacts, reached by the agent's last turn


def compaction_foreseen(role: str) -> str:
    """Why the role's next prompt may set off a compaction ('' if it is not foreseen): the context its CLI
    recorded at the end of the role's last turn on this terminal, against where that CLI compacts."""
    terminal_id = terminal_ids[role]
    last = next((n for n in range(len(turn_records) - 1, -1, -1) if turn_records[n].role == role), None)
    if last is None or turn_records[last].terminal != terminal_id:
        return ""
    if not turn_records[last].tokens_final:
        read_turn_tokens(last)                # the turn's last responses, recorded since its reply was taken
    context, point = turn_records[last].context_tokens, compaction_point(role)
    if context is None or point is None or context < COMPACTION_FORESIGHT * point:
        return ""
    return (f"its context held {context:,} tokens after its last turn, near the {point:,} at which its CLI "
            "compacts it")


def stale_round_reason(role: str) -> str:
    """FRESH_CONTEXT=round: why the role's conversation must start anew before this turn ('' if it need not)."""
    if FRESH_CONTEXT != "round" or not PromptDraft(role).has_history():
        return ""
    rounds = [record.round for record in turn_records if record.role == role]
    if rounds and max(rounds) < current_round:
        return f"FRESH_CONTEXT=round: round {current_round} starts with a new conversation"
    return ""


def start_fresh_agent(role: str, why: str) -> None:
    """A new agent for the role, in the run's session, and the old one ended: a new conversation."""
    old = terminal_ids[role]
    check_alive(role, old)                # a session that is gone is the replacement's to handle
    new = new_agent_for(role, "creating the new agent")
    record_agent_event(role, new, "new conversation", f"{why}; was terminal {old}")
    save_new_agents({**terminal_ids, role: new}, (role,))
    exit_terminals([old])
    remove_terminal(old)
    log_turn(role, f"{why}: a new agent (terminal {new}, was {old}) takes the turn, with the full task")


# -- The agent's model -------------------------------------------------------------
# A CLI may change the model on its own (Codex's offer at a usage limit): said, then a new agent with the chosen
# one takes the role's next turn (REPLACE_LOST_AGENTS=1), else the run stops (ModelChanged).
class ModelChanged(RunError):
    """An agent's CLI changed the model it was started with: stopped before the role's next turn, resumable."""

    def __init__(self, message: str):
        super().__init__(message, EXIT_USAGE)


def default_model_seen(provider: str) -> str:
    """The first model recorded by an agent of the provider's CLI started without a model asked for ('': none)."""
    return next((r.model for r in turn_records
                 if r.model and (r.provider or provider_for(r.role)) == provider and not agent_models.get(r.role)), "")


def model_change(number: int) -> tuple[str, str] | None:
    """(the model the turn's agent was started with, the other one its last response named), or None; only the
    role's current agent counts, and without a model asked for the CLI's first recorded model is its default."""
    record = turn_records[number]
    if not record.model or not record.terminal or record.terminal != terminal_ids.get(record.role):
        return None
    started = agent_models.get(record.role, "")
    asked = started or default_model_seen(provider_for(record.role))
    if model_is(record.model, asked, agent_cli(provider_for(record.role))):
        return None
    return started or f"{asked} (its CLI's default)", record.model


def model_changed_event(terminal_id: str) -> AgentEvent | None:
    """The change of model recorded for the agent on that terminal, if there was one."""
    return next((e for e in agent_events if e.terminal == terminal_id and e.what == "model changed"), None)


def note_model_change(number: int) -> None:
    """Say and record, once per agent, that an answered turn's requests named a model other than its agent's."""
    change = model_change(number)
    record = turn_records[number]
    if change is None or model_changed_event(record.terminal) is not None:
        return
    detail = f"from {change[0]} to {change[1]} in turn {number + 1} (round {record.round})"
    record_agent_event(record.role, record.terminal, "model changed", detail)
    save_state()
    then = ("a new agent with the chosen model takes its next turn" if REPLACE_LOST_AGENTS
            else "the run stops before its next turn")
    log_turn(record.role, f"its model changed {detail}, and not by the run's settings: {then}")


def model_change_due(role: str) -> str:
    """Before the role's turn: why a new agent takes it, its agent's model having changed ('' if it has not);
    without REPLACE_LOST_AGENTS the run stops instead (ModelChanged)."""
    terminal_id = terminal_ids[role]
    last = next((n for n in range(len(turn_records) - 1, -1, -1) if turn_records[n].terminal == terminal_id), None)
    if last is not None:
        if not turn_records[last].tokens_final:
            read_turn_tokens(last)             # its last responses, recorded since its reply was taken
        note_model_change(last)
    changed = model_changed_event(terminal_id)
    if changed is None:
        return ""
    if REPLACE_LOST_AGENTS:
        return f"its model changed {changed.detail}"
    chosen = agent_models.get(role) or "its CLI's default"
    raise ModelChanged(f"the {role}'s agent (terminal {terminal_id}) went on with another model than it was "
                       f"started with, {changed.detail}; stopped before its next turn, state saved in {STATE_FILE}. "
                       f"Keep its CLI from changing it ({command_name()} --check names the setting), then rerun with "
                       f"REPLACE_LOST_AGENTS=1: a new agent with {chosen} takes the {role}'s turn")


def prepare_conversation(role: str) -> None:
    """Before a turn's prompt is built: hear what the screen says of the conversation, and start a new one
    where one is due (a new agent where the model changed)."""
    if in_flight is not None and in_flight.sent_at is not None and in_flight.belongs_to(turn_position(role)):
        return                            # a turn carried over: its agent has the prompt
    note_conversation(role, terminal_ids[role], _screen(terminal_ids[role]))
    why = fresh_agents_due.get(role) or model_change_due(role) or stale_round_reason(role)
    if why:
        start_fresh_agent(role, why)
        return
    foreseen = compaction_foreseen(role)
    if foreseen:
        forget_conversation(role, terminal_ids[role], "compaction foreseen", foreseen)


def take_turn(role: str, build: Callable[[], Prompt]) -> str:
    """One turn on the role's current terminal: send the prompt built now (unless the turn was carried
    over from an interrupted process), wait, and return the answer (also archived)."""
    prepare_conversation(role)
    path = response_path(role)
    path.parent.mkdir(parents=True, exist_ok=True)
    prompt = build()
    carried = carried_over_turn(role, path)
    if carried:
        record_sent(in_flight.sent_in_full)        # it arrived: the terminal has what it carried
    if carried == "taken":
        return retake_reply(role, len(prompt.encode("utf-8")))
    if carried == "left":
        log_turn(role, f"taking the reply its agent (terminal {in_flight.terminal}) wrote before it was gone: "
                       "complete, so the prompt is not sent again")
        reply, ended_by = read_reply_file(path), TURN_ENDED_BY_AGENT_GONE     # as left_reply() judged it
    else:
        reply, ended_by = wait_for_reply(role, terminal_ids[role], path, begin_turn(role, prompt, carried), build)
    taken = time.time()                              # the reply is taken; keeping it on disk comes next
    crash_point("reply-settled")
    timing = turn_timing(path)
    archived = archive_reply(role, reply, path)
    record, reading = record_turn(role, len(prompt.encode("utf-8")), reply, archived, taken)
    recorded = recorded_end_text(reading, taken) if ended_by == TURN_ENDED_BY_RECORD else ""
    crash_point("turn-recorded")
    write_report()
    crash_point("report-written")
    tokens = f"; tokens: {tokens_text(record.tokens)}" if agent_cli(provider_for(role)).records else ""
    tokens += f"; model: {record.model}" if record.model else ""
    seen = f"turn end seen by {ended_by}" if ended_by else "no turn end seen: its terminal's output taken"
    log_turn(role, f"reply received{timing} ({len(reply)} chars, {seen}, kept as "
                   f"{archived}{tokens}{recorded})")
    note_model_change(len(turn_records) - 1)
    return reply


def begin_turn(role: str, prompt: Prompt, carried: str) -> str | None:
    """Send the turn's prompt (what was sent), or -- a turn carried over -- say what the wait takes up (None)."""
    if not carried:
        tokens_before_send(role)
        return send_prompt(role, prompt)
    if carried != "limited":
        log_turn(role, "taking the reply written while the loop was down (prompt not sent again)"
                 if carried == "reply" else f"terminal {terminal_ids[role]} is still working on the prompt sent "
                 "before the interruption; waiting for it")
    return None


def retake_reply(role: str, prompt_bytes: int) -> str:
    """The answer an interrupted process had taken and kept, taken again: the prompt is not sent again, and
    the turn is recorded once (a Ctrl-C may have saved its record already)."""
    kept = taken_reply(role)
    reply = read_reply_file(kept)
    update_run(in_flight=replace(in_flight, reply_file=kept.name))
    if not turn_records or turn_records[-1].reply_file != kept.name:
        record_turn(role, prompt_bytes, reply, kept)
        write_report()
    log_turn(role, f"taking the reply kept before the interruption ({len(reply)} chars, {kept}; prompt not sent "
                   "again)")
    return reply


def ask_agent(role: str, build: Callable[[], Prompt]) -> str:
    """The role's answer to the prompt `build()` writes for its terminal; a lost agent is replaced, or the role
    goes over to its fallback CLI at a usage limit not waited out, and the turn is sent again (to the new agent
    every once-only block in full)."""
    while True:
        try:
            return take_turn(role, build)
        except AgentLost as lost:
            replace_lost_agent(lost)
        except FallbackDue as due:
            switch_to_fallback(due)


# ==========================================================================
# 9. Review gate
# ==========================================================================

def _first_marker_line(lines: list[str], marker: str) -> int | None:
    """Index of the first line that starts (after markdown decoration) with `marker:`."""
    pattern = re.compile(r"^\W*" + re.escape(marker) + r"\W*:")
    return next((index for index, line in enumerate(lines) if pattern.match(line)), None)


def review_evidence_matches(review_text: str, review_role: str) -> int:
    """How many of the role's evidence checks the REVIEW_NOTES section shows."""
    lines = (review_text or "").splitlines()
    start = _first_marker_line(lines, "REVIEW_NOTES")
    if start is None:
        return 0
    family = review_role.replace("peer_", "")
    if family not in REVIEW_CHECKLISTS:
        raise ValueError(f"review_role must be one of analyst, peer_analyst, programmer, peer_programmer; "
                         f"got {review_role!r}")
    notes = "\n".join(lines[start:])
    return sum(1 for check in REVIEW_CHECKLISTS[family] if re.search(check.evidence, notes, re.IGNORECASE))


def approval_withheld(review_text: str, review_cycle: int, review_role: str) -> str:
    """Why a review does not count as approval, for the log ('' when it counts): approval counts only if stated,
    late enough, and (optionally) backed by evidence."""
    verdict = reply_verdict("review", review_text)
    if verdict != "APPROVED":
        return "reviewer asks for changes" if verdict == "REVISE" else "no REVIEW_RESULT line"
    if review_cycle < MIN_REVIEW_CYCLES_BEFORE_APPROVAL:
        return f"approval counts from cycle {MIN_REVIEW_CYCLES_BEFORE_APPROVAL}"
    if not REQUIRE_REVIEW_EVIDENCE:
        return ""
    matches = review_evidence_matches(review_text, review_role)
    return "" if matches >= REVIEW_EVIDENCE_MIN_MATCH else \
        f"REVIEW_NOTES show {matches} of the {REVIEW_EVIDENCE_MIN_MATCH} evidence checks required"


def is_review_approved(review_text: str, review_cycle: int, review_role: str) -> bool:
    """Approval counts only if stated, late enough, and (optionally) backed by evidence."""
    return not approval_withheld(review_text, review_cycle, review_role)


# ==========================================================================
# 10. Condensation
# ==========================================================================

_UPSTREAM_PLACEHOLDER = ("(No upstream output: this run was started at a later agent with START_AGENT. "
                         "Work from the OpenSpec artifacts and code already on disk.)")
EXPLORE_BACK_REFERENCE = "(Same as initial turn -- refer to your conversation history.)"
UPSTREAM_BACK_REFERENCE = "(Same as in your previous cycle -- refer to your conversation history.)"

# A top-level labelled line: "- Files changed: ...", "**Files changed:**", "## Files changed".
_LABEL_LINE = re.compile(r"^(?:[-*+]\s+|\d+[.)]\s+)?\**([A-Za-z][A-Za-z0-9 _/&()'-]*?)\**\s*:|^#{1,6}\s+(.+?)\s*#*$")


def _head(text: str, max_lines: int | None) -> str:
    return "\n".join((text or "").strip().splitlines()[:max_lines])


def _marked_section(text: str, marker: str, max_lines: int) -> str:
    """From the first `marker:` line on, capped at `max_lines` (else the head of the text)."""
    lines = (text or "").strip().splitlines()
    start = _first_marker_line(lines, marker)
    if start is None:
        return _head(text, max_lines)
    return "\n".join(lines[start:start + max_lines]).strip()


def extract_review_notes(text: str) -> str:
    """The REVIEW_NOTES section onward, capped at MAX_FEEDBACK_LINES (else the head of the text)."""
    return _marked_section(text, "REVIEW_NOTES", MAX_FEEDBACK_LINES)


def extract_test_evidence(text: str, uncapped: bool = False) -> str:
    """The last RESULT line and the EVIDENCE after it, capped at MAX_TEST_EVIDENCE_LINES unless `uncapped`; the
    head of the text when it has no EVIDENCE line."""
    form = VERDICT_FORMATS["tester"]
    limit = None if uncapped else MAX_TEST_EVIDENCE_LINES
    lines = (text or "").strip().splitlines()
    result, _word = verdict_line(form, text)
    after = _first_marker_line(lines[result or 0:], form.section)     # the EVIDENCE line after the RESULT line
    evidence = (result or 0) + after if after is not None else _first_marker_line(lines, form.section)
    if evidence is None:
        return _head(text, limit)
    kept = ([lines[result]] if result is not None and result < evidence else []) + lines[evidence:]
    return "\n".join(kept[:limit]).strip()


# -- a failure's signature: what must repeat for a round to count as one without progress ---------
# The evidence without what differs between two runs of the same test (times, addresses, ids, line order).
NOISE_PATTERNS: tuple[tuple[re.Pattern, str], ...] = tuple((re.compile(pattern, re.IGNORECASE), mark)
                                                           for pattern, mark in (
    (r"\x1b\[[0-9;?]*[A-Za-z]", ""),                                           # terminal colours
    (r"\b\d{4}-\d{2}-\d{2}(?:[T ]\d{1,2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)?", "<time>"),
    (r"\b\d{1,2}:\d{2}(?::\d{2})?(?:[.,]\d+)?(?:\s?[AP]M)?\b", "<time>"),
    (r"(?:/private)?(?:/tmp|/var/tmp|/var/folders|/dev/shm)/\S*|\S*/\.tmp/\S*|\btmp[\w-]{6,}", "<tmp>"),
    (r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b", "<id>"),
    (r"\b0x[0-9a-f]+\b", "<address>"),
    (r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{8,}\b", "<id>"),            # hashes, session ids
    (r"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b|\blocalhost:\d+|\[[0-9a-f:]*\]:\d+", "<host>"),
    (r"\bpid[ =:]*\d+", "pid <n>"),
    (r"\b\d+(?:[.,]\d+)?\s?(?:ns|µs|us|ms|msec|s|secs?|seconds?|mins?|minutes?|h|hrs?|hours?)\b", "<duration>"),
))
EVIDENCE_LEAD = re.compile(r"^(?:[-*+•]\s+|\d+[.)]\s+)+")
EVIDENCE_LABEL = re.compile(r"^\W*(?:RESULT|EVIDENCE)\W*:\W*(?:FAIL|PASS)?\W*$", re.IGNORECASE)


def failure_lines(evidence: str) -> list[str]:
    """The evidence's lines with what varies between runs of the same test set aside, in sorted order (the
    order a tester lists its findings in is not progress); the RESULT and EVIDENCE labels left out."""
    lines = []
    for line in (evidence or "").splitlines():
        for pattern, mark in NOISE_PATTERNS:
            line = pattern.sub(mark, line)
        line = " ".join(EVIDENCE_LEAD.sub("", line.strip()).split())
        if line and not EVIDENCE_LABEL.match(line):
            lines.append(line)
    return sorted(lines)


def failure_signature(evidence: str) -> str:
    """A short hash that two failures share when their evidence differs only in what varies between runs."""
    return hashlib.sha1("\n".join(failure_lines(evidence)).encode("utf-8")).hexdigest()[:16]


def failing_step(evidence: str) -> str:
    """The first finding of the evidence, as the tester wrote it: the line a person reads to know what failed."""
    findings = (EVIDENCE_LEAD.sub("", line.strip()).strip() for line in (evidence or "").splitlines())
    return next((text[:200] for text in findings if text and not EVIDENCE_LABEL.match(text)), "(no evidence)")


def review_feedback_from(review_text: str) -> str:
    """What an author is told of its review: the notes, or all of it if condensing is off."""
    return extract_review_notes(review_text) if CONDENSE_REVIEW_FEEDBACK else (review_text or "").strip()


def _labelled_sections(text: str, wanted: tuple[str, ...]) -> list[str]:
    """Lines of the top-level labelled sections whose label starts with one of `wanted`."""
    kept: list[str] = []
    keeping = False
    for line in text.splitlines():
        match = _LABEL_LINE.match(line)
        if match:
            label = (match.group(1) or match.group(2) or "").strip().lower()
            keeping = any(label.startswith(name) for name in wanted)
        if keeping:
            kept.append(line)
    return kept


def condense_analyst_for_programmer(text: str) -> str:
    """The ANALYST_SUMMARY section, capped at MAX_CROSS_PHASE_LINES (else the head of the text)."""
    if not CONDENSE_CROSS_PHASE or text == _UPSTREAM_PLACEHOLDER:
        return (text or "").strip()
    return _marked_section(text, "ANALYST_SUMMARY", MAX_CROSS_PHASE_LINES)


def condense_programmer_for_tester(text: str) -> str:
    """The 'Files changed' and 'Behavior implemented' sections, capped at MAX_CROSS_PHASE_LINES."""
    if not CONDENSE_CROSS_PHASE or text == _UPSTREAM_PLACEHOLDER or not (text or "").strip():
        return (text or "").strip()
    kept = _labelled_sections(text.strip(), ("files changed", "behavior implemented", "behaviour implemented"))
    if not kept:
        return _head(text, MAX_CROSS_PHASE_LINES)
    return "\n".join(kept[:MAX_CROSS_PHASE_LINES]).strip()


# ==========================================================================
# 11. OpenSpec: the run's change and its stories
# ==========================================================================
# STORY_MODE works the change one story (tasks.md section) at a time; ARCHIVE_ON_PASS archives that change.

STORY_HEADING = re.compile(r"^##\s+(\d+)\.?\s+(.*?)\s*#*\s*$")
TASK_LINE = re.compile(r"^\s*[-*]\s+\[([ xX])\]\s+(.*?)\s*$")
SCENARIO_HEADING = re.compile(r"^####\s+Scenario:\s*(.*?)\s*$")
SCENARIO_STEP = re.compile(r"^\s*(?:[-*]\s+)?\**(GIVEN|WHEN|THEN|AND)\b", re.IGNORECASE)
PROMISE_TAG = re.compile(r"<promise>\s*(.*?)\s*</promise>", re.DOTALL | re.IGNORECASE)


def openspec_changes_dir() -> Path:
    return Path(WD) / "openspec" / "changes"


def openspec_change() -> tuple[str, list[str]]:
    """(the run's change, the active changes found): STORY_CHANGE if it is a directory, else the only active
    one; '' when none can be named."""
    changes = openspec_changes_dir()
    if STORY_CHANGE:
        return (STORY_CHANGE if (changes / STORY_CHANGE).is_dir() else ""), []
    found = sorted(p.name for p in changes.iterdir() if p.is_dir() and p.name != "archive") \
        if changes.is_dir() else []
    return (found[0] if len(found) == 1 else ""), found


def find_story_change() -> Path:
    """The change directory story mode works on; RunError naming the fix if there is none to name."""
    changes = openspec_changes_dir()
    name, found = openspec_change()
    if name:
        return changes / name
    if STORY_CHANGE:
        raise RunError(f"story mode: STORY_CHANGE={STORY_CHANGE} but {changes / STORY_CHANGE} is not a directory",
                       EXIT_USAGE)
    what = ", ".join(found) if found else "no change directory"
    raise RunError(f"story mode needs exactly one OpenSpec change in {changes}, found {what}: "
                   "set STORY_CHANGE to the change to work on", EXIT_USAGE)


@dataclass
class Story:
    """One `## N. Title` section of tasks.md and its checkbox tasks."""

    id: str
    title: str
    tasks: list[tuple[bool, str]]     # (done, "N.M text")

    @property
    def finished(self) -> bool:
        return bool(self.tasks) and all(done for done, _ in self.tasks)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def parse_stories(tasks_md: str) -> list[Story]:
    """Stories and their tasks from tasks.md; lines that fit neither pattern are ignored."""
    stories: list[Story] = []
    for line in tasks_md.splitlines():
        heading = STORY_HEADING.match(line)
        if heading:
            stories.append(Story(heading.group(1), heading.group(2) or f"Story {heading.group(1)}", []))
            continue
        task = TASK_LINE.match(line)
        if task and stories and task.group(2):
            stories[-1].tasks.append((task.group(1) != " ", task.group(2)))
    return stories


def parse_scenarios(specs_dir: Path) -> list[tuple[str, str, list[str]]]:
    """(capability, scenario name, GIVEN/WHEN/THEN/AND lines) from specs/<capability>/spec.md."""
    scenarios = []
    for spec in sorted(specs_dir.glob("*/spec.md")) if specs_dir.is_dir() else []:
        current = None
        for line in _read_text(spec).splitlines():
            heading = SCENARIO_HEADING.match(line)
            if heading:
                current = (spec.parent.name, heading.group(1) or "(unnamed)", [])
                scenarios.append(current)
            elif line.startswith("#"):
                current = None
            elif current is not None and SCENARIO_STEP.match(line):
                current[2].append(line.strip())
    return scenarios


def promise_signal(reply: str) -> tuple[str, str]:
    """The last <promise> tag of a reply: ("COMPLETE", ""), ("FAILED", reason) or ("", "") for none."""
    for tag in reversed(PROMISE_TAG.findall(reply or "")):
        if tag.upper() == "COMPLETE":
            return "COMPLETE", ""
        failed = re.match(r"FAILED\b\s*:?\s*(.*)", tag, re.DOTALL | re.IGNORECASE)
        if failed:
            return "FAILED", failed.group(1).strip() or "(no reason given)"
    return "", ""


# ==========================================================================
# 12. Prompt builders
# ==========================================================================
# What stays the same for a run is sent to a terminal in full once (ONCE_BLOCKS), then by a back-reference
# that keeps the words the loop reads back. Building a prompt changes nothing: ask_agent() records what it sent.

TESTER_FORMAT, REVIEW_FORMAT = VERDICT_FORMATS["tester"], VERDICT_FORMATS["review"]     # section 1


def _review_checks(author: str) -> tuple[str, str]:
    """The checklist and answer format the reviewer of `author` gets in full, from the role's REVIEW_CHECKLISTS, and
    what it is told in their place once it has them."""
    checks = REVIEW_CHECKLISTS[author]
    names = ", ".join(check.name for check in checks)
    return ("Check, citing what you looked at:\n"
            + "".join(f"{number}. {check.name}: {check.asks}\n" for number, check in enumerate(checks, 1))
            + "\n" + REVIEW_FORMAT.answer_format()
            + "- <one line of evidence per check above>\n"
            f"- <for REVISE: each change the {author} must make>",
            f"Checks and answer format: as in your first review -- {NUMBER_WORDS[len(checks)]} checks ({names}), "
            f"each with evidence; REVIEW_RESULT: APPROVED or REVISE, then REVIEW_NOTES: (for REVISE, what "
            f"the {author} must change).")


# role -> (full text, back-reference)
ANSWER_FORMATS = {
    "analyst": (
        "2. Answer with this summary; all five sections are mandatory:\n"
        "ANALYST_SUMMARY:\n"
        "- Change: <OpenSpec change name and directory>\n"
        "- Artifacts: <files created or updated>\n"
        "- P1 requirements: <must-have requirements, each traced to the task or the scenario test>\n"
        "- Contracts: <interfaces, data formats and commands the programmer and tester rely on>\n"
        "- Handoff: <actionable first steps for the programmer; open risks>",
        "2. Answer with the ANALYST_SUMMARY as in your first turn; all five sections are "
        "mandatory: Change, Artifacts, P1 requirements, Contracts, Handoff."),
    "programmer": (
        "Answer format:\n"
        "PROGRAMMER_SUMMARY:\n"
        "- Files changed: <each file and what changed in it>\n"
        "- Behavior implemented: <what the code now does, per requirement>\n"
        "- Tests run: <commands and results>\n"
        "- Known gaps: <anything left undone, or none>",
        "Answer format: as in your first turn -- PROGRAMMER_SUMMARY: with Files changed, "
        "Behavior implemented, Tests run, Known gaps."),
    "tester": (
        TESTER_FORMAT.answer_format()
        + "- <commands run and the output that matters>\n"
        "- <for FAIL: the failing step, error messages, stack trace lines>\n"
        "- Recommended next fix: <for FAIL: where to look first>",
        "Answer format: as in your first turn -- RESULT: PASS or RESULT: FAIL, then EVIDENCE: "
        "(for FAIL the failing step and a recommended next fix)."),
}
NUMBER_WORDS = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
# reviewer -> (full text, back-reference), from the checklist of the role it reviews
REVIEW_CHECKS = {f"peer_{author}": _review_checks(author) for author in REVIEW_CHECKLISTS}
STORY_ANSWER_FORMAT = (
    "Answer format:\n"
    "PROGRAMMER_SUMMARY:\n"
    "- Files changed: <each file and what changed in it>\n"
    "- Behavior implemented: <what the code now does>\n"
    "- Tests run: <commands and results>\n"
    "<promise>COMPLETE</promise>  (or <promise>FAILED: reason</promise>)",
    "Answer format: as in your first story -- PROGRAMMER_SUMMARY: with Files changed, "
    "Behavior implemented, Tests run, then the completion signal.")


# A block sent in full in a terminal's first prompt that holds it, and as a back-reference after:
# its name (marks read "<name>:<terminal id>") -> role -> (the complete text, what stands in for it)
ONCE_BLOCKS: dict[str, Callable[[str], tuple[str, str]]] = {
    "explore": lambda role: (EXPLORE_SUMMARY, EXPLORE_BACK_REFERENCE),
    "scenario": lambda role: (SCENARIO_TEST, EXPLORE_BACK_REFERENCE),
    "intro": lambda role: (" in a five-agent development loop", ""),
    "response-file": lambda role: (response_file_instruction(role),
                                   "Response file (required; as in your first turn):\n"
                                   f"Write your complete answer to this file: {response_path(role)}\n"
                                   "Only this file is read; write it once, when your work is done."),
    "answer-format": lambda role: ANSWER_FORMATS[role],
    "review-checks": lambda role: REVIEW_CHECKS[role],
    "story-answer-format": lambda role: STORY_ANSWER_FORMAT,
}


class PromptDraft:
    """A prompt being written for one role's terminal; notes the once-only blocks it puts in full. A turn's prompt
    (`title` given) opens with who the role is -- 'You are the <title> in a five-agent development loop', the loop
    named on the first prompt only -- and where the run stands (`situation`), then the task and its scenario test."""

    def __init__(self, role: str, title: str = "", situation: str = "", terminal_id: str | None = None):
        self.role = role
        self.terminal_id = terminal_ids.get(role, "") if terminal_id is None else terminal_id
        self.in_full: list[str] = []
        self.opening = [f"You are the {title}" + self.once("intro") + situation, self.task_context()] if title else []

    def once(self, name: str) -> str:
        """The block in full if this terminal has not had it (or condensing is off), else its back-reference."""
        full, back_reference = ONCE_BLOCKS[name](self.role)
        if not self.terminal_id:             # no terminal yet, so no history to refer to
            return full
        mark = f"{name}:{self.terminal_id}"
        if mark in context_sent:
            return back_reference if CONDENSE_EXPLORE_ON_REPEAT else full
        if mark not in self.in_full:
            self.in_full.append(mark)
        return full

    def has_history(self) -> bool:
        """Whether this terminal has had a prompt already (every prompt opens with the "intro" block)."""
        return f"intro:{self.terminal_id}" in context_sent

    def lacks_history(self) -> bool:
        """Whether this terminal is known to lack what earlier prompts said: a new agent (a replacement, a new
        conversation) or a conversation compacted or cleared since, that has had no prompt since."""
        return not self.has_history() and conversation_started_over(self.terminal_id)

    def task_context(self) -> str:
        """The task and its scenario test; one back-reference line for both once the terminal has them."""
        explore, scenario = self.once("explore"), self.once("scenario")
        if explore == scenario == EXPLORE_BACK_REFERENCE:
            return f"Explore summary and scenario test:\n{EXPLORE_BACK_REFERENCE}"
        return (f"Explore summary (the task):\n{explore}\n\n"
                f"Scenario test (how the result will be checked):\n{scenario}")

    def finish(self, parts: list[str]) -> Prompt:
        """The prompt: its parts that are not empty, a person's notes to the role (--note), each carried once, and
        its closing block, the response file."""
        closing = self.once("response-file")
        notes = notes_due(self.role)
        self.in_full += [f"note-{note.id}:{self.terminal_id}" for note in notes]
        blocks = [f"Note from a person ({note.by or 'unnamed'}, {note.at or 'time unknown'}); where it differs from "
                  f"the text above, it wins:\n{note.text}" for note in notes]
        return Prompt("\n\n".join([part for part in self.opening + parts if part] + blocks + [closing]), self.in_full)


def explore_block_for(terminal_id: str) -> str:
    """The explore summary: in full on the first call for this terminal, the back-reference after (spec 1's form
    of a once-only block: the call itself counts as the send)."""
    draft = PromptDraft("analyst", terminal_id=terminal_id)
    text = draft.once("explore")
    record_sent(draft.in_full)
    return text


def _or_none(text: str) -> str:
    return text.strip() if text and text.strip() else "(none)"


def _test_command_line() -> str:
    return "Test command: " + (PROJECT_TEST_CMD or "none configured -- find and run the project's own test suite.")


NO_QUESTIONS = "Do not ask questions: make reasonable assumptions and state them in your summary."
KEEP_TESTS = "Never weaken, skip or delete a test to make it pass."


def _rules(*rules: str) -> str:
    """The Rules block of a prompt, a line each."""
    return "Rules:\n" + "\n".join(f"- {rule}" for rule in rules)


def build_analyst_prompt(round_num: int, analyst_cycle: int) -> Prompt:
    """Analyst turn: turn the task into an OpenSpec change and a five-part summary."""
    draft = PromptDraft("analyst", "system analyst",
                        f" (round {round_num} of {MAX_ROUNDS}, analyst cycle {analyst_cycle} of {MAX_REVIEW_CYCLES}).")
    return draft.finish([
        f"Latest tester feedback:\n{_or_none(feedback)}",
        f"Previous round programmer changes (context only):\n{programmer_context_for_retry.strip()}"
        if round_num > 1 and programmer_context_for_retry.strip() else "",
        f"Latest peer analyst feedback:\n{_or_none(analyst_feedback)}",
        _rules("Do not write or change application code or tests; your work is the OpenSpec change.",
               f"Work only inside {WD}.", NO_QUESTIONS, "Address every point of the feedback above."),
        "Task:\n"
        "1. Use /opsx:explore to study the code and the task, then /opsx:ff to create or update the "
        "OpenSpec change (proposal.md, design.md, specs, tasks.md).\n"
        + draft.once("answer-format"),
    ])


def _review_prompt(reviewer: str, title: str, author: str, work: str, rules: list[str]) -> Prompt:
    """A peer reviewer's turn: the work to review, the rules, the checks with their answer format."""
    draft = PromptDraft(reviewer, title, f" (round {current_round} of {MAX_ROUNDS}, review cycle {phase_cycle} of "
                                         f"{MAX_REVIEW_CYCLES}). Review the {author}'s work.")
    return draft.finish([
        f"{author[0].upper() + author[1:]} output to review:\n{_or_none(work)}",
        _rules("Review only: change no file except your response file.", *rules),
        draft.once("review-checks"),
    ])


def build_analyst_review_prompt(analyst_out: str) -> Prompt:
    """Peer analyst turn: check the analyst's change and say APPROVED or REVISE with evidence."""
    return _review_prompt("peer_analyst", "peer analyst", "system analyst", analyst_out,
                          ["Judge the OpenSpec artifacts on disk, not only the summary."])


def build_programmer_prompt(round_num: int, programmer_cycle: int, analyst_out: str) -> Prompt:
    """Programmer turn: implement the change (round 1) or fix the failed test (retry rounds)."""
    if round_num == 1:
        situation = f"round {round_num} of {MAX_ROUNDS}, "
        # (label, text, shown when empty): what the programmer works from
        upstream = [("System analyst handoff", _or_none(condense_analyst_for_programmer(analyst_out)), True),
                    ("Open peer analyst notes (the analysis was not approved; keep them in mind)",
                     analyst_feedback.strip(), False)]
        task = ("Task:\n"
                "1. Use /opsx:apply to implement the tasks of the OpenSpec change; mark each finished task "
                "in tasks.md.\n"
                "2. Run the tests and fix what fails.")
    else:
        situation = f"round {round_num} of {MAX_ROUNDS}: a retry after a failed test; "
        upstream = [("Test failure feedback", _or_none(feedback), True),
                    ("Your previous changes (context)", programmer_context_for_retry.strip(), False),
                    ("The same failure again", repeated_failure_note(round_num), False)]
        task = ("Task:\n"
                "1. Use /opsx:explore to investigate the failure against the code and the OpenSpec change.\n"
                "2. If the failure shows that the spec or design is wrong, you may update the OpenSpec "
                "artifacts with /opsx:ff; say so in your summary.\n"
                "3. Fix the code, run the tests and fix what fails.")
    draft = PromptDraft("programmer", "programmer",
                        f" ({situation}programmer cycle {programmer_cycle} of {MAX_REVIEW_CYCLES}).")
    # The same upstream as last cycle -- unless this terminal is known to lack it (a new agent, a compacted
    # conversation).
    repeat = programmer_cycle > 1 and CONDENSE_UPSTREAM_ON_REPEAT and not draft.lacks_history()
    return draft.finish([
        *(f"{label}:\n{UPSTREAM_BACK_REFERENCE if repeat else text}" for label, text, always in upstream
          if always or text),
        f"Latest peer programmer feedback:\n{_or_none(programmer_feedback)}",
        _rules(f"Work only inside {WD}.", KEEP_TESTS, NO_QUESTIONS, _test_command_line()),
        task,
        draft.once("answer-format"),
    ])


def repeated_failure_note(round_num: int) -> str:
    """MAX_ROUNDS_WITHOUT_PROGRESS: when the last round's failure repeated the one before, what the programmer
    needs to know of it: its last change did not fix that step, and what that change was ('' otherwise)."""
    last = failed_rounds[-1] if failed_rounds else None
    if last is None or not last.repeats or last.round != round_num - 1:
        return ""
    changed = ("you changed no file in the project" if last.files == [] else
               f"you changed {', '.join(last.files[:8])}" + (f" and {len(last.files) - 8} more files"
                                                             if len(last.files) > 8 else "")
               if last.files else "what you changed is not known")
    return (f"The test failed in round {last.round} the same way as in round {last.repeats} (the feedback above; "
            f"only times, paths and the like differ). Your change in round {last.round} did not fix it: {changed}. "
            "Find out why that step still fails before you change the code again; if you are blocked, say so in "
            "your summary.")


def build_programmer_review_prompt(programmer_out: str) -> Prompt:
    """Peer programmer turn: check the change and say APPROVED or REVISE with evidence."""
    return _review_prompt("peer_programmer", "peer programmer", "programmer", programmer_out,
                          ["Read the changed code and run the tests yourself.", _test_command_line()])


def build_tester_prompt(programmer_out: str) -> Prompt:
    """Tester turn: run the scenario test and report PASS or FAIL with evidence."""
    draft = PromptDraft("tester", "tester", f" (round {current_round} of {MAX_ROUNDS}).")
    return draft.finish([
        f"Programmer handoff:\n{_or_none(condense_programmer_for_tester(programmer_out))}",
        f"Open peer programmer notes (the code was not approved; check these too):\n{programmer_feedback.strip()}"
        if programmer_feedback.strip() else "",
        _rules("Test only: do not change application code, tests or OpenSpec artifacts.", _test_command_line()),
        "Task: run the test command and carry out the scenario test step by step.",
        draft.once("answer-format"),
    ])


def build_story_prompt(story: Story, change_dir: Path, scenarios: list, attempt: int, retry_reason: str) -> Prompt:
    """Programmer turn in story mode: one story of the change, ending in a promise signal."""
    draft = PromptDraft("programmer", "programmer",
                        f" (round {current_round} of {MAX_ROUNDS}), working story by story. This turn: story "
                        f"{story.id} \"{story.title}\" (attempt {attempt} of {MAX_STORY_ATTEMPTS}).")
    tasks = "\n".join(f"- [{'x' if done else ' '}] {text}" for done, text in story.tasks)
    listed = "\n".join(f"[{capability}] Scenario: {name}" + "".join(f"\n  {step}" for step in steps)
                       for capability, name, steps in scenarios)
    return draft.finish([
        f"Test failure feedback:\n{feedback.strip()}" if current_round > 1 and feedback.strip() else "",
        f"Retry of story {story.id} -- the previous attempt failed:\n{retry_reason}\n"
        "Try a different approach this time; do not repeat what failed." if retry_reason else "",
        f"Story {story.id}: {story.title}\nTasks of this story:\n{tasks or '(no tasks defined)'}",
        "Complete only the tasks of this story. Do not start other stories: the orchestrator hands you the "
        "next story when this one is done.",
        f"Change: {change_dir}\nRead {change_dir / 'proposal.md'} and {change_dir / 'design.md'} for the "
        "context of the whole change.",
        "Scenarios of the change (focus on those relevant to this story's tasks):\n"
        + (listed or "(no scenarios defined)"),
        "Verification: after completing the tasks, run the verification and fix what fails.\n"
        f"- {_test_command_line()}",
        # how the agent records progress in the OpenSpec change (the spec tool's own convention)
        "Marking progress: when a task of this story is done and verified, change its line in tasks.md "
        "from `- [ ]` to `- [x]` (keep the task number and text as they are). Do not tick tasks of "
        "other stories.",
        _rules(f"Work only inside {WD}.", KEEP_TESTS, NO_QUESTIONS),
        "Completion signal (required, exactly one, at the end of your answer):\n"
        "- All tasks of this story done and verification passes: <promise>COMPLETE</promise>\n"
        "- Verification fails and you cannot fix it, or you cannot complete the story: "
        "<promise>FAILED: {reason}</promise>, where {reason} says briefly what went wrong. This lets the "
        "orchestrator retry the story with that context.\n"
        "You MUST end with one of these two signals.",
        draft.once("story-answer-format"),
    ])


# ==========================================================================
# 13. After the run: archive, commit, notify
# ==========================================================================
# Opt-in steps (AFTER_RUN_STEPS), each done at most once per run (after_run in the state); none changes the
# exit code.

GIT_TIMEOUT_SECONDS = 60.0
GIT_COMMIT_TIMEOUT_SECONDS = 300.0      # a commit hook may run the project's checks
HASH_LIMIT_BYTES = 64 * 1024 * 1024     # bigger files are fingerprinted by size and mtime only
FALLBACK_GIT_IDENTITY = ("cao-orchestrator-loop", "orchestrator-loop@localhost")
OPENSPEC_PACKAGE = "@fission-ai/openspec"
# Keep an unattended archive from phoning home or asking anything.
OPENSPEC_ENV = {"OPENSPEC_TELEMETRY": "0", "DO_NOT_TRACK": "1", "CI": "1"}

# A new file named like a broken heredoc or redirection (`EOF)`, `x = 1`) is an accident, never committed.
ACCIDENT_CHARACTERS = frozenset("=()'\"$`;|<>&\\")
HEREDOC_MARKER_RE = re.compile(r"(?:[A-Z]+_)?EOF(?:_[A-Z]+)?|PYEOF|SHEOF|EOT|END|EOL|HEREDOC")


def is_accident_name(path: str) -> bool:
    """True for a path an agent surely did not mean to create: shell or code characters or a heredoc marker in
    any part (`$(pwd)/notes.md`); spaces, dots, dashes, brackets and non-ASCII letters are normal."""
    return any(any(ch in ACCIDENT_CHARACTERS or ord(ch) < 32 or ord(ch) == 127 for ch in part)
               or HEREDOC_MARKER_RE.fullmatch(part.strip(" \t'\";)")) for part in path.split("/") if part)


def run_command(cmd: list[str], cwd: str, timeout: float, input_text: str | None = None,
                env: Mapping[str, str] | None = None) -> tuple[int | None, str, str]:
    """(exit code, stdout, stderr) of a program, exit code None after `timeout`; its own process group, so a
    timeout stops its children too (they would hold the pipes open). OSError is the caller's."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdin=subprocess.PIPE if input_text is not None else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                            env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        out, err = proc.communicate(input_text, timeout=timeout)
        return proc.returncode, out, err
    except BaseException as exc:       # the timeout, or Ctrl-C: leave nothing running behind us
        with suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        if not isinstance(exc, subprocess.TimeoutExpired):
            proc.wait()
            raise
        out, err = proc.communicate()
        return None, out or "", err or ""


def _log_output(prefix: str, text: str, lines: int = 20) -> None:
    """A command's last output lines, indented under the log line that explains them."""
    tail = [line for line in text.splitlines() if line.strip()][-lines:]
    for line in tail:
        log_detail(f"{prefix}{line}")


def step_outcome(step: str, result: str, why: str, said: str = "", output: tuple[str, str] | None = None,
                 **facts: object) -> dict:
    """An after-run step's outcome for after_run, said in the log ("<step>: <result>, <why><said>", then the
    last lines of `output`: its prefix and the command's output)."""
    log(f"{step}: {result}, {why}{said}")
    if output is not None:
        _log_output(*output)
    return {"result": result, **facts, "reason": why}


# -- which change ---------------------------------------------------------------

def change_to_archive() -> tuple[str, str]:
    """(the change this run worked on, '') or ('', why none can be named)."""
    name, found = openspec_change()
    changes = openspec_changes_dir()
    if name:
        return name, ""
    if STORY_CHANGE:
        return "", f"STORY_CHANGE={STORY_CHANGE} but {changes / STORY_CHANGE} is not a directory (archived already?)"
    if not found:
        return "", f"no active OpenSpec change in {changes}"
    return "", (f"{len(found)} active OpenSpec changes in {changes} ({', '.join(found)}): set STORY_CHANGE to "
                "the one this run worked on")


# -- archive ----------------------------------------------------------------------

def archive_change() -> dict:
    """ARCHIVE_ON_PASS: `openspec archive <change> --yes` in WD; "archived", "skipped" (no single change) or
    "failed", which keeps the commit from running."""
    change, why = change_to_archive()
    if not change:
        return step_outcome("archive", "skipped", why)
    cmd = shlex.split(OPENSPEC_COMMAND) + ["archive", change, "--yes"]
    shown = " ".join(shlex.quote(word) for word in cmd)
    log(f"archive: running `{shown}` in {WD}")
    try:
        code, out, err = run_command(cmd, WD, ARCHIVE_TIMEOUT, env=OPENSPEC_ENV)
    except OSError as exc:
        why = (f"`{cmd[0]}` cannot be run ({exc.strerror or exc}): install the OpenSpec CLI (npm install -g "
               f"{OPENSPEC_PACKAGE}) or set OPENSPEC_COMMAND to it")
        return step_outcome("archive", "failed", why, change=change)
    output = (out + ("\n" if out and err else "") + err).strip()
    if code == 0:
        log(f"archive: OpenSpec change {change} archived")
        _log_output("openspec: ", output, lines=8)
        return {"result": "archived", "change": change}
    why = (f"`{shown}` did not finish within ARCHIVE_TIMEOUT={ARCHIVE_TIMEOUT:g}s and was stopped"
           if code is None else f"`{shown}` exited with {code}")
    return step_outcome("archive", "failed", why, "; the change stays in openspec/changes/ (run the command "
                        "yourself once the cause below is fixed)", ("openspec: ", output or "(no output)"),
                        change=change)


# -- commit ------------------------------------------------------------------------

GIT_ENV = {"GIT_TERMINAL_PROMPT": "0", "GIT_OPTIONAL_LOCKS": "0", "GIT_EDITOR": "true"}


def git(args: list[str], cwd: str, timeout: float = GIT_TIMEOUT_SECONDS,
        input_text: str | None = None) -> tuple[int | None, str, str]:
    """One git command; OSError if git is not installed."""
    return run_command(["git", *args], cwd, timeout, input_text, GIT_ENV)


def git_top(directory: str) -> str | None:
    """The top of the git work tree holding `directory`, '' if there is none, None if git cannot be run."""
    try:
        code, out, _ = git(["rev-parse", "--show-toplevel"], directory)
    except OSError:
        return None
    return out.strip() if code == 0 else ""


def git_changed_paths(top: str) -> dict[str, str]:
    """{path relative to the repository top: git's two-letter status} for what is changed or untracked under WD."""
    code, out, err = git(["--literal-pathspecs", "status", "--porcelain=v1", "-z", "--untracked-files=all",
                          "--no-renames", "--", WD], top)
    if code != 0:
        raise OSError(f"git status failed: {(err or out).strip() or 'timed out'}")
    return {entry[3:]: entry[:2] for entry in out.split("\0") if len(entry) > 3}


def fingerprint(path: Path) -> str:
    """What a path holds, to tell later whether the run touched it: a content hash, or 'absent'."""
    try:
        if path.is_symlink():
            return "link:" + os.readlink(path)
        stat = path.stat()
        if not path.is_file():
            return "other"
        if stat.st_size > HASH_LIMIT_BYTES:
            return f"size:{stat.st_size}:mtime:{stat.st_mtime_ns}"
        digest = hashlib.sha1()
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        return "sha1:" + digest.hexdigest()
    except FileNotFoundError:
        return "absent"
    except OSError as exc:
        return f"unreadable:{exc.errno}"


HEAD_MARK = "<HEAD>"                 # the key of WD's git HEAD among the fingerprints of what WD holds


def git_fingerprints(top: str) -> dict[str, str]:
    """WD in git: HEAD, and each changed or untracked path (its content), the loop's own files left out: what the
    commit leaves alone (the user's changes at the start) and what tells a round's progress (15)."""
    code, head, _ = git(["rev-parse", "--verify", "-q", "HEAD"], top)
    marks = {path: fingerprint(Path(top) / path) for path in git_changed_paths(top)
             if not is_orchestrator_file((Path(top) / path).resolve())}
    marks[HEAD_MARK] = head.strip() if code == 0 else ""
    return marks


def snapshot_worktree() -> dict | None:
    """COMMIT_ON_PASS at a run's start: each changed or untracked path's fingerprint, taken as the progress check
    takes them (15), so the user's own changes are left alone at the end. None when WD is not in a git repository."""
    top = git_top(WD)
    try:
        return {path: mark for path, mark in git_fingerprints(top).items() if path != HEAD_MARK} if top else None
    except OSError as exc:
        log(f"commit: could not record the working tree at the start ({exc}); only tracked files will be "
            "committed on PASS")
        return None


def is_orchestrator_file(path: Path) -> bool:
    """The loop's own files: everything under $WD/.tmp/, and the state file with its lock and backups."""
    state, tmp = Path(STATE_FILE).resolve(), Path(WD).resolve() / ".tmp"
    if path == tmp or tmp in path.parents:
        return True
    return path.parent == state.parent and (path.name == state.name or path.name.startswith(state.name + ".")
                                            or path.name.startswith("." + state.name + "."))


def choose_commit_paths(top: str) -> tuple[list[str], list[str], list[str]]:
    """(paths to commit, the new ones among them, accident files left out): what git shows changed and the run
    changed since its snapshot; without one, untracked files are left out (nothing says the run made them)."""
    chosen, untracked, accidents = [], [], []
    for path, status in git_changed_paths(top).items():
        absolute = Path(top) / path
        if is_orchestrator_file(absolute) or path.endswith("/"):     # the loop's files; a nested repository
            continue
        if worktree_at_start is not None and worktree_at_start.get(path) == fingerprint(absolute):
            continue                        # as it was before the run: the user's, left alone
        new = status == "??" or status[0] == "A"
        if new and worktree_at_start is None:
            continue
        if new and is_accident_name(path):
            accidents.append(path)
            continue
        chosen.append(path)
        if status == "??":
            untracked.append(path)
    return sorted(chosen), sorted(untracked), sorted(accidents)


def commit_message(archive: dict) -> str:
    """Subject: the task's first line; body: the round it passed in and the OpenSpec change."""
    lines = [task_title(), "", f"The tester reported PASS in round {current_round} of the orchestrator loop."]
    change = archive.get("change") or change_to_archive()[0]
    if change:
        state = {"archived": "archived", "failed": "archive failed"}.get(archive.get("result", ""), "not archived")
        lines.append(f"OpenSpec change: {change} ({state})")
    return "\n".join(lines) + "\n"


def git_identity_args(top: str) -> list[str]:
    """`-c user.name=... -c user.email=...` for what git has no identity for; the user's config is not touched."""
    args = []
    for key, value, variable in (("user.name", FALLBACK_GIT_IDENTITY[0], "GIT_AUTHOR_NAME"),
                                 ("user.email", FALLBACK_GIT_IDENTITY[1], "GIT_AUTHOR_EMAIL")):
        code, out, _ = git(["config", "--get", key], top)
        if (code != 0 or not out.strip()) and not os.environ.get(variable):
            args += ["-c", f"{key}={value}"]
    if args:
        log(f"commit: git has no user.name/user.email here; committing as {FALLBACK_GIT_IDENTITY[0]} "
            f"<{FALLBACK_GIT_IDENTITY[1]}> (set them with `git config user.name/user.email` to commit as you)")
    return args


def stage_and_commit(top: str, paths: list[str], untracked: list[str], archive: dict) -> dict:
    """`git add` the new files among `paths`, then `git commit --only` all of them; the outcome for after_run."""
    tmp_rel = os.path.relpath(Path(WD).resolve() / ".tmp", top)
    not_tmp = f":(top,exclude){tmp_rel}/"
    spec = "\0".join([f":(top,literal){p}" for p in paths] + [not_tmp]) + "\0"
    new_spec = "\0".join([f":(top,literal){p}" for p in untracked] + [not_tmp]) + "\0"
    code, out, err = (git(["add", "--pathspec-from-file=-", "--pathspec-file-nul"], top, input_text=new_spec)
                      if untracked else (0, "", ""))
    if code != 0:
        why = "git add timed out" if code is None else f"git add exited with {code}"
        return step_outcome("commit", "failed", why, output=("git: ", out + err))
    message = commit_message(archive)
    code, out, err = git([*git_identity_args(top), "commit", "--only", "-m", message,
                          "--pathspec-from-file=-", "--pathspec-file-nul"],
                         top, GIT_COMMIT_TIMEOUT_SECONDS, input_text=spec)
    if code != 0:
        why = "git commit timed out" if code is None else f"git commit exited with {code}"
        return step_outcome("commit", "failed", why, " (a commit hook?); the changes are in the working tree, new "
                            "files staged: commit them yourself", ("git: ", out + err))
    _, sha, _ = git(["rev-parse", "--short", "HEAD"], top)
    sha = sha.strip()
    log(f"commit: {sha} \"{message.splitlines()[0]}\" with {counted(len(paths), 'file')}: {', '.join(paths)}")
    return {"result": "committed", "commit": sha, "files": paths}


def commit_run(archive: dict) -> dict:
    """COMMIT_ON_PASS: commit exactly the paths the run changed (`git commit --only`: what the user had staged
    stays staged and out of it); the outcome for after_run."""
    if archive.get("result") == "failed":
        log("commit: skipped, the archive of the OpenSpec change failed (see above); commit by hand once it "
            "is archived")
        return {"result": "skipped", "reason": "archive failed"}
    top = git_top(WD)
    if not top:
        why = "git is not installed" if top is None else f"{WD} is not in a git repository"
        return step_outcome("commit", "skipped", why, " (git init it to have runs committed)")
    try:
        paths, untracked, accidents = choose_commit_paths(top)
    except OSError as exc:
        return step_outcome("commit", "failed", str(exc))
    if accidents:
        log(f"commit: left out {counted(len(accidents), 'file')} whose names look like shell or code fragments an agent "
            f"created by accident (delete them if so): {', '.join(accidents)}")
    if worktree_at_start is None:
        log("commit: no record of the working tree at the run's start (COMMIT_ON_PASS was not set then), so "
            "only changes to tracked files are committed; new files are left for you")
    if not paths:
        log("commit: nothing to commit, the run changed no files in the repository")
        return {"result": "nothing", "left_out": accidents}
    return stage_and_commit(top, paths, untracked, archive) | {"left_out": accidents}


# -- notify ------------------------------------------------------------------------


NOTIFY_EVENTS = {
    # event: (title prefix, priority, tags)
    "PASS": ("PASS", "default", "white_check_mark"),
    "FAIL": ("FAIL", "high", "x"),
    "STOPPED": ("Stopped, needs you", "high", "warning"),
}


def _header_text(text: str) -> str:
    """A header value HTTP can carry: ASCII as it is, anything else as an RFC 2047 word ntfy decodes."""
    if text.isascii():
        return text
    return "=?UTF-8?B?" + base64.b64encode(text.encode("utf-8")).decode("ascii") + "?="


def notify(event: str, message: str) -> bool:
    """Publish one ntfy message if NTFY_TOPIC is set; True if taken. A failure is one log line, never a stop."""
    if not NTFY_TOPIC:
        return False
    prefix, priority, tags = NOTIFY_EVENTS[event]
    title = f"{prefix} in round {current_round}: {task_title()}"
    headers = {"Title": _header_text(title), "Priority": priority, "Tags": tags}
    topic = quote(NTFY_TOPIC, safe="")
    return ntfy_call("POST", topic, f"the {event} notification", content=message.encode("utf-8"), headers=headers,
                     sent=f"notify: {event} notification sent to {NTFY_SERVER.rstrip('/')}/{topic}") is not None


def notify_stopped(error: BaseException) -> None:
    """A stop that needs a person (agent error, timeout, permission prompt, server gone): say so."""
    message = getattr(error, "message", None) or str(error)
    notify("STOPPED", f"Stopped in round {current_round}: {message}; state saved, rerun to resume")


# -- the steps, once ----------------------------------------------------------------

def guarded_step(name: str, step, *args) -> dict:
    """Run an after-run step so that what it runs into (a full disk, a tool that breaks off) does not undo the
    PASS; a fault of the loop's own is exit 70 with its traceback, and a rerun does the step again."""
    try:
        return step(*args)
    except (OSError, subprocess.SubprocessError) as exc:
        return step_outcome(name, "failed", f"unexpected {exc.__class__.__name__}: {exc}")


def record_after_run(**done: object) -> None:
    """Note a step as done in the state file at once, so no resume or rerun repeats it."""
    set_after_run(**done)
    save_state()


def run_end_line(result: str) -> str:
    """The run's last line: its result, and after a PASS short words on what the archive and commit did."""
    if result != "PASS":
        return (f"FAIL: stopped without progress after round {current_round} (the same failure for "
                f"{counted(no_progress_stop['rounds'], 'round')} in a row)" if no_progress_stop else
                f"FAIL: no PASS within MAX_ROUNDS={MAX_ROUNDS}")
    parts = [f"PASS in round {current_round}"]
    archive, commit = after_run.archive, after_run.commit
    if ARCHIVE_ON_PASS and archive is not None:
        done = archive.get("result")
        parts.append(f"OpenSpec change {archive.get('change')} archived" if done == "archived" else
                     f"archive {done}: {archive.get('reason', '')}".rstrip(": "))
    if COMMIT_ON_PASS and commit is not None:
        done = commit.get("result")
        parts.append(f"committed {commit.get('commit')} ({counted(len(commit.get('files', [])), 'file')})"
                     if done == "committed" else "nothing to commit" if done == "nothing" else
                     f"commit {done}: {commit.get('reason', '')}".rstrip(": "))
    return "; ".join(parts)


def _notify_run_end(result: str) -> None:
    if notify(result, run_end_line(result)):
        record_after_run(notified=result)


@dataclass(frozen=True)
class AfterRunStep:
    """One thing done after a run, at most once; listed in after_run.due, so a stop among the steps loses none."""

    name: str
    asked: Callable[[str], bool]                    # the run's result (PASS or FAIL) -> wanted
    run: Callable[[str], None]                      # do it (and record it)
    done: Callable[[AfterRun, str], str] | None = None   # '' or why it is not done again


def _outcome_recorded(step: str) -> Callable[[AfterRun, str], str]:
    """An archive or commit counts as done once its outcome is recorded, whatever it was."""
    def done(record: AfterRun, result: str) -> str:
        outcome = getattr(record, step)
        return "" if outcome is None else f"done already for this run ({outcome.get('result')}), not repeated"
    return done


def _notified(record: AfterRun, result: str) -> str:
    """A notification counts as done once the server took it."""
    return f"the {result} notification was sent already for this run, not repeated" \
        if record.notified == result else ""


# In order: name, asked for when, action, done when (no `done`: not a once-only step).
AFTER_RUN_STEPS: tuple[AfterRunStep, ...] = (
    AfterRunStep("archive", lambda result: result == "PASS" and ARCHIVE_ON_PASS,
                 lambda result: record_after_run(archive=guarded_step("archive", archive_change)),
                 _outcome_recorded("archive")),
    AfterRunStep("commit", lambda result: result == "PASS" and COMMIT_ON_PASS,
                 lambda result: record_after_run(commit=guarded_step("commit", commit_run, after_run.archive or {})),
                 _outcome_recorded("commit")),
    AfterRunStep("report", lambda result: ARCHIVE_ON_PASS or COMMIT_ON_PASS, lambda result: log(run_end_line(result))),
    AfterRunStep("notify", lambda result: bool(NTFY_TOPIC), _notify_run_end, _notified),
)
ONCE_STEPS = tuple(step for step in AFTER_RUN_STEPS if step.done is not None)


def after_run_pending(result: str, record: AfterRun) -> list[str]:
    """The steps that were due when the run ended, are still asked for, and are not done yet."""
    return [step.name for step in ONCE_STEPS
            if step.asked(result) and step.name in (record.due or []) and not step.done(record, result)]


def finish_run(code: int) -> int:
    """The after-run steps, in order, each once per run; returns `code` (a failed step never changes it)."""
    result = result_of(code)
    for step in AFTER_RUN_STEPS:
        if not step.asked(result):
            continue
        already = step.done(after_run, result) if step.done else ""
        if already:
            log(f"{step.name}: {already}")
        else:
            step.run(result)
    return code


def finish_stopped_run() -> None:
    """Do now, each once, the after-run steps a finished run was stopped in (or could not notify); under the
    run's lock, before anything else is decided."""
    try:
        saved = read_state_file()
    except StateFileError:
        return
    if saved is None or not saved.finished or not after_run_pending(saved.final_status, saved.after_run):
        return
    load_state()
    log(f"the run in {STATE_FILE} ended with {final_status} in round {current_round}; still to do after it: "
        f"{', '.join(after_run_pending(final_status, after_run))} (stopped before, or not sent); doing that now")
    finish_run(exit_code_of(final_status, bool(no_progress_stop)))


# ==========================================================================
# 14. Init and resume
# ==========================================================================

# START_AGENT -> (phase, step, the outputs that hold _UPSTREAM_PLACEHOLDER because their agent was skipped)
START_POSITIONS = {
    "analyst": (PHASE_ANALYST, "author", ()),
    "peer_analyst": (PHASE_ANALYST, "review", ("analyst",)),
    "programmer": (PHASE_PROGRAMMER, "author", ("analyst",)),
    "peer_programmer": (PHASE_PROGRAMMER, "review", ("analyst", "programmer")),
    "tester": (PHASE_TESTER, "author", ("analyst", "programmer")),
}


def set_position(phase: str, cycle: int = 1, step: str = "author") -> None:
    """Move the loop to a phase, cycle and step: the one place the position changes. Moving on is what an
    answered turn led to, so it is in flight no more (the next save_state() records both at once)."""
    update_run(current_phase=phase, phase_cycle=cycle, phase_step=step)
    end_answered_turn()


def cleanup_terminals() -> None:
    """CLEANUP_ON_EXIT: end the agents and their session, recorded so that a rerun starts anew, not in shells."""
    log(f"CLEANUP_ON_EXIT=1: ending the five agents and removing CAO session {session_name}; a rerun starts "
        "a new run")
    end_agents([terminal_ids.get(role, "") for role in ROLES], session_name)
    update_run(terminals_exited=True)
    save_state()


@dataclass
class StartPlan:
    """What start_run() will do with the state file it found."""

    resume: bool
    note: str = ""                     # the first log line of a new run: what the old state file held
    set_aside: bool = False            # a new run replaces the state file: keep it as a backup
    old_run: SavedState | None = None  # the run it replaces, if readable: its agents are exited
    continue_failed: bool = False      # RESUME=1 with more rounds: the run that ended in FAIL goes on

    @property
    def unreadable(self) -> bool:
        """The state file cannot be read: said first, before any server is asked (the run's own file comes first)."""
        return self.set_aside and self.old_run is None


def end_old_run(plan: StartPlan) -> None:
    """The new run's state is written: end the replaced run's agents and remove their CAO session."""
    old = plan.old_run if plan.set_aside else None
    ids = [i for i in old.terminal_ids.values() if i] if old is not None else []
    if not ids or old.terminals_exited or old.on_own_server:     # those ended with their own server
        return
    if (old.API or API).rstrip("/") != API.rstrip("/"):
        log(f"the replaced run's agents (CAO session {old.session_name}) ran on {old.API}, another server: "
            "left alone")
        return
    try:
        alive = api.session_terminals(old.session_name) if old.session_name else []
    except ApiError as exc:
        log(f"could not look up the replaced run's CAO session {old.session_name}: {exc}")
        return
    if alive is None:
        log(f"the replaced run's agents (CAO session {old.session_name}) are gone already")
        end_agents([], old.session_name)          # CAO still lists their terminals
        return
    end_agents([i for i in ids if i in alive], old.session_name)
    log(f"ended the replaced run's agents and removed their CAO session {old.session_name}")


def init_new_run(plan: StartPlan | None = None) -> None:
    """Create the session and five terminals, reset the run, and write the first state. The replaced run
    (`plan`) is set aside only once the new terminals exist, so a failed start leaves its state file."""
    with signals_held("writing the new run's state"):
        session, terminals = create_terminals()
        if plan and plan.set_aside:                    # the old state file kept aside (its agents are ended after)
            target = state_backup_path(plan.old_run)
            os.replace(STATE_FILE, target)
            log(f"kept the old state file as {target}")
        reset_run_state()
        phase, step, skipped = START_POSITIONS[START_AGENT]
        update_run(session_name=session, terminal_ids=terminals, run_dir=new_run_dir(), on_own_server=own_stage.server is not None,
                   started_at=utc_iso(precise=True), agent_models={role: model_for(role) for role in ROLES},
                   outputs={key: (_UPSTREAM_PLACEHOLDER if key in skipped else "") for key in OUTPUT_KEYS},
                   worktree_at_start=snapshot_worktree() if COMMIT_ON_PASS else None)
        set_position(phase, 1, step)
        save_state()
    log(f"new run: CAO session {session_name}, terminals "
        + ", ".join(f"{role}={terminal_ids[role]}" for role in ROLES)
        + f"; starting at {START_AGENT}; state in {STATE_FILE}; replies kept in {run_dir}")


def next_role() -> str:
    """The role whose turn the saved run takes next: the one in flight, else the one its position names."""
    if in_flight is not None:
        return in_flight.role
    if current_phase not in PHASE_ROLES:
        return "tester"
    author, reviewer = PHASE_ROLES[current_phase]
    return reviewer if phase_step == "review" else author


def first_lost_agent() -> AgentLost | None:
    """The first of the saved run's agents that is gone (terminal, session or CLI), next turn's role first. CAO
    answers a status from its database even when the session is gone, so the session and screen are asked too."""
    agents = [(role, terminal_ids[role]) for role in sorted(ROLES, key=lambda role: role != next_role())]
    for role, terminal_id in agents:
        try:
            api.get_status(terminal_id)
        except ApiError as exc:
            if exc.status_code is None:
                raise RunError(f"cannot resume: {exc}") from None
            return AgentLost(role, terminal_id, f"CAO cannot reach this terminal ({exc})")
    for role, terminal_id in agents:
        screen = _screen(terminal_id)
        why = why_gone(terminal_id, screen)
        if why:
            return lost_agent(role, terminal_id, why, screen)
    return None


def verify_resume_terminals() -> None:
    """Every agent of the saved run is still there before it is touched; a lost one stops the resume, or is
    replaced with REPLACE_LOST_AGENTS=1."""
    for role in ROLES:
        if not terminal_ids.get(role, ""):
            raise RunError(f"cannot resume: the state file {STATE_FILE} has no terminal for the {role}; "
                           "start a new run with RESUME=0")
    end_agents_switched_from()
    while (lost := first_lost_agent()) is not None:
        try:
            replace_lost_agent(lost)
        except AgentLost as stop:
            raise AgentLost(stop.role, stop.terminal_id, stop.why, stop.last_line,
                            stop.ways_on, when="cannot resume: ") from None


def new_agents_on_own_server() -> None:
    """A resumed run on a new server of its own: five new agents (no replacement counted), each sent its whole
    prompt; the turn in flight goes again unless its reply was taken or left complete."""
    old_ids = dict(terminal_ids)
    new_session, new_ids = create_terminals()
    again = turn_goes_again(ROLES)
    save_new_agents(new_ids, ROLES, in_flight=replace(in_flight, sent_at=None) if again else in_flight,
                    session_name=new_session, on_own_server=True)
    record_event("agent_replaced", roles=list(ROLES), old_terminals=old_ids, new_terminals=new_ids,
                 session=new_session, why="the run's own CAO server was started anew", replacement=0)
    log(f"five new agents on the run's own CAO server, in CAO session {new_session}: "
        + ", ".join(f"{role} {old_ids.get(role) or '-'} -> {new_ids[role]}" for role in ROLES)
        + "; every answered turn is kept, and a new agent gets its whole prompt")


@dataclass(frozen=True)
class ServerChoice:
    """The CAO server a run uses: the run's own or the one at API, and the line that says which, why, and how to
    choose the other (the run's first line, and --check's)."""

    own: bool
    line: str


OWN_INSTEAD = "OWN_SERVER=1 runs it on a CAO server of its own instead"


def choose_server(setting: str | bool, api_url: str, named_by: str, saved_on_own: bool | None,
                  answers: Callable[[], bool]) -> ServerChoice:
    """The server a run uses, from OWN_SERVER (`setting`), the setting that names a server (`named_by`, '' for
    none), the resumed run's server (`saved_on_own`, None for a new run) and whether one answers at API (asked
    only where it decides): the specs' default API, http://localhost:9889, is used where a server answers, said."""
    own = "the run's own CAO server, started for it and ended with it"
    if setting is True:
        return ServerChoice(True, f"using {own} (OWN_SERVER=1); OWN_SERVER=auto uses a CAO server you run at API")
    if setting is False:
        return ServerChoice(False, f"using the CAO server at {api_url} (OWN_SERVER=0: a server you run); {OWN_INSTEAD}")
    if named_by:
        return ServerChoice(False, f"using the CAO server at {api_url}: {named_by} names it; {OWN_INSTEAD}")
    if saved_on_own is not None:
        return ServerChoice(saved_on_own, (f"using {own}: the run resumed was on one" if saved_on_own else
                                           f"using the CAO server at {api_url}: the run resumed has its agents "
                                           "there") + "; RESUME=0 starts a new run on the server you choose")
    if answers():
        return ServerChoice(False, f"using the CAO server at {api_url}, a server you run: one answers there, the "
                                   f"default address (OWN_SERVER=auto); {OWN_INSTEAD}")
    return ServerChoice(True, f"using {own}: none answers at {api_url} and neither API nor CAO_API_PORT names one "
                              "(OWN_SERVER=auto); to use a CAO server you run, set API to its address")


def server_named_by() -> str:
    """The setting that names the CAO server ('' for none): API, the config file's `api`, or CAO's own variables."""
    if "API" not in explicit_settings:
        return ""
    if os.environ.get("API", "").strip():
        return "API"
    if config_argument and "API" in read_config_file(config_argument):
        return f"`api` in {config_argument}"
    return "CAO_API_PORT"


def server_choice(plan: StartPlan) -> ServerChoice:
    """choose_server() for this run: its settings, the saved run it resumes, a look at API where it decides."""
    saved = read_state_file() if plan.resume and OWN_SERVER == "auto" else None
    return choose_server(OWN_SERVER, API, server_named_by(), None if saved is None else saved.on_own_server,
                         lambda: server_answers(API))


def resume_required(saved: SavedState) -> StartPlan:
    """RESUME=1: the saved run goes on (a FAIL with more rounds than it played too), or the start is refused
    saying why it cannot."""
    if saved.finished and saved.final_status == "FAIL" and not saved.terminals_exited:
        if MAX_ROUNDS > saved.current_round:
            return StartPlan(True, continue_failed=True)
        raise ConfigError(f"RESUME=1 but the run in {STATE_FILE} finished with FAIL after round "
                          f"{saved.current_round} and MAX_ROUNDS={MAX_ROUNDS} allows no more; to go on with more "
                          f"rounds: {continue_command(saved.current_round + 1)}; unset RESUME to start a new run")
    if saved.finished:
        raise ConfigError(f"RESUME=1 but the run in {STATE_FILE} already finished with {saved.final_status}; "
                          "unset RESUME to start a new run")
    # Input to an exited agent's terminal lands in a plain shell, so such a run is over.
    if saved.terminals_exited:
        raise ConfigError(f"RESUME=1 but the agents of the run in {STATE_FILE} were exited "
                          "(CLEANUP_ON_EXIT=1), so it cannot be resumed; unset RESUME to start a new run")
    return StartPlan(True)


def resume_or_replace(saved: SavedState) -> StartPlan:
    """RESUME not 1: a run under way goes on; a finished one is reported or replaced, and so is one under way
    whose agents were exited (their terminals are plain shells now) or that the user chose RESUME=0 for."""
    status, finished, exited = saved.final_status, saved.finished, saved.terminals_exited
    chosen = "RESUME" in explicit_settings          # RESUME=0: a new run, whatever the saved one holds
    # A finished run with after-run steps left over is finished first (start_run, under the lock).
    leftover = finished and bool(after_run_pending(status, saved.after_run))
    if finished and REPORT_FINISHED_RUN and not chosen and not leftover:
        raise AlreadyFinished(exit_code_of(status, bool(saved.no_progress_stop)),
                              f"the run in {STATE_FILE} {describe_state(saved)}; REPORT_FINISHED_RUN=1, so "
                              "nothing was started (move the state file away to start a new run)")
    if status == "RUNNING" and not exited and not chosen:
        return StartPlan(True)
    why = " (RESUME=0)" if chosen else " whose agents were exited (CLEANUP_ON_EXIT=1)" if status == "RUNNING" else ""
    instead = (f" (to go on with that run instead: {go_on_command(saved.current_round, bool(saved.no_progress_stop))})"
               if status == "FAIL" and not exited and not chosen else "")
    return StartPlan(False, f"{STATE_FILE} holds {describe_state(saved)}{why}; starting a new run, the old state "
                            f"file will be kept as {state_backup_path(saved)}{instead}", set_aside=True, old_run=saved)


def choose_start() -> StartPlan:
    """Resume, report a finished run, or start a new one, and what happens to an old state file; decides only,
    writes nothing."""
    try:
        saved = read_state_file()
    except StateFileError as exc:
        if RESUME:
            raise ConfigError(f"RESUME=1 but {exc}; fix or remove it, or unset RESUME to start a new run") from None
        return StartPlan(False, f"{exc}; starting a new run, the old file will be kept as {state_backup_path()}",
                         set_aside=True)
    if saved is None:
        if RESUME:
            raise ConfigError(f"RESUME=1 but there is no state file at {STATE_FILE}: set STATE_FILE to the "
                              "run's state file, or unset RESUME to start a new run")
        return StartPlan(False)
    return resume_required(saved) if RESUME else resume_or_replace(saved)


# ==========================================================================
# 15. Main loop
# ==========================================================================

# phase -> (the author's prompt for a cycle, the reviewer's prompt, the run field that tells the author of its review)
REVIEWED_PHASES = {
    PHASE_ANALYST: (lambda cycle: build_analyst_prompt(current_round, cycle),
                    lambda: build_analyst_review_prompt(outputs["analyst"]), "analyst_feedback"),
    PHASE_PROGRAMMER: (lambda cycle: build_programmer_prompt(current_round, cycle, outputs["analyst"]),
                       lambda: build_programmer_review_prompt(outputs["programmer"]), "programmer_feedback"),
}


def story_loop_due() -> bool:
    """Story mode replaces the round's first programmer turn while the change has unfinished stories."""
    if not STORY_MODE:
        return False
    if story_progress is not None:
        return True                      # resumed inside the story loop
    change = find_story_change()
    stories = parse_stories(_read_text(change / "tasks.md"))
    if not stories:
        log_turn("programmer", f"story mode: no '## N. Title' stories in {change / 'tasks.md'}; "
                               "a normal programmer turn instead")
    return any(not story.finished for story in stories)


def story_summary(results: list[StoryResult]) -> str:
    """What the peer programmer reviews after the story loop: each story's outcome and changes."""
    outcomes = [f"- Story {result.id} \"{result.title}\": " + (
        f"COMPLETE (attempt {result.attempts})" if result.status == "COMPLETE"
        else f"FAILED after {result.attempts} attempts -- {result.reason}") for result in results]
    summaries = [line for result in results if result.summary for line in (f"Story {result.id}:", result.summary)]
    return "\n".join(["PROGRAMMER_SUMMARY (story by story):", "Story results:", *outcomes, *summaries])


def story_attempt(story: Story, change: Path, scenarios: list, attempt: int) -> tuple[str, str, str]:
    """One attempt at a story: (reply, signal, reason); an attempt that ended abnormally has no signal, and is
    retried as one that gave none."""
    try:
        reply = ask_agent("programmer", lambda: build_story_prompt(
            story, change, scenarios, attempt, story_progress.last_failure))
    except (AgentLost, ModelChanged):
        raise                        # not the story's fault: the run stops (or the agent was replaced)
    except RunError as exc:          # timeout, error, no file: an abnormal end, retried as such
        log_turn("programmer", f"story {story.id} attempt {attempt} ended abnormally: {exc.message}")
        return "", "", ""
    return reply, *promise_signal(reply)


def end_story_attempt(story: Story, attempt: int, reply: str, signal_name: str, reason: str) -> None:
    """A story is done once COMPLETE or out of attempts, and the next one is up; else it is tried again,
    told why the last attempt failed."""
    if signal_name == "COMPLETE" or attempt >= MAX_STORY_ATTEMPTS:
        status = "COMPLETE" if signal_name == "COMPLETE" else "FAILED"
        add_story_result(StoryResult(story.id, story.title, status, attempt,
                                     "" if status == "COMPLETE" else (reason or "no completion signal"),
                                     condense_programmer_for_tester(reply)))
        queue = story_progress.queue
        following = queue[queue.index(story.id) + 1:] if story.id in queue else []
        update_story_progress(current=following[0] if following else "", attempt=1, last_failure="")
    else:
        update_story_progress(attempt=attempt + 1, last_failure=reason if signal_name == "FAILED" else "")


def run_story_loop() -> str:
    """Each unfinished story in turn, retried on FAILED or no signal; returns the combined summary."""
    change = find_story_change()
    stories = {story.id: story for story in parse_stories(_read_text(change / "tasks.md"))}
    scenarios = parse_scenarios(change / "specs")
    if story_progress is None:
        queue = [story.id for story in stories.values() if not story.finished]
        update_run(story_progress=StoryProgress(str(change), queue, queue[0]))
        save_state()
    while story_progress.current:
        current = story_progress.current
        story = stories.get(current) or Story(current, f"Story {current}", [])
        attempt = story_progress.attempt
        reply, signal_name, reason = story_attempt(story, change, scenarios, attempt)
        log_turn("programmer", f"story {story.id} attempt {attempt}/{MAX_STORY_ATTEMPTS}: "
                               + (f"{signal_name} {reason}".strip() if signal_name else "no completion signal"))
        end_story_attempt(story, attempt, reply, signal_name, reason)
        save_state()
    combined = story_summary(story_progress.results)
    update_run(story_progress=None)
    return combined


def close_run(status: str, **fields: object) -> None:
    """The run over with PASS or FAIL (and `fields` of the state): its after-run steps due, saved with its result so
    that a stop in the middle of them loses none."""
    update_run(final_status=status, **fields)
    set_after_run(due=[step.name for step in ONCE_STEPS if step.asked(status)])
    set_position(PHASE_DONE)
    save_state()


def leave_phase(phase: str) -> None:
    """On to the next phase; from the analysis through the plan gate where APPROVE names it."""
    if phase == PHASE_ANALYST and gate_due("plan"):
        open_gate("plan")
        set_position(PHASE_PROGRAMMER, 1, "approval")
    else:
        set_position(NEXT_PHASE[phase])


# -- APPROVE's gates: the run's side (the person's: section 4) ---------------------------------------------------
GATE_PREVIEW_LINES = 12             # lines of the plan, or of the change that passed, shown at a gate


def gate_preview(gate: str) -> list[str]:
    """What waits at a gate: the reply it comes from (its file in the run's folder) and its first lines."""
    role, text = (("analyst", condense_analyst_for_programmer(outputs["analyst"])) if gate == "plan" else
                  ("programmer", condense_programmer_for_tester(outputs["programmer"])))
    kept = next((r.reply_file for r in reversed(turn_records) if r.role == role and r.reply_file), "")
    lines = [line for line in text.splitlines() if line.strip()]
    return ([f"the {role}'s reply: {Path(run_dir) / kept}"] if kept and run_dir else []) \
        + lines[:GATE_PREVIEW_LINES] + (["..."] if len(lines) > GATE_PREVIEW_LINES else [])


def at_gate(gate_name: str) -> Gate:
    """The run at a gate, its decision taken (waited for); a gate APPROVE no longer names is passed as approved."""
    gate = pending_gate(gates)
    if gate is None or gate.gate != gate_name:
        gate = open_gate(gate_name)
    decision = (wait_for_decision(gate, gate_preview(gate_name)) if gate_due(gate_name) else
                {"verdict": "approve", "by": "APPROVE", "at": utc_iso(), "words": "APPROVE no longer names this gate"})
    decide_gate(gate, decision)
    return gate


def pass_plan_gate() -> None:
    """The plan gate: approved, the programmer starts; rejected, the analyst revises the plan with the person's
    words (their note), from the first cycle whose approval counts, then the peer review and this gate again."""
    gate = at_gate("plan")
    if gate.verdict == "approve":
        set_position(PHASE_PROGRAMMER)
    else:
        update_run(person_notes=person_notes + [PersonNote(
            f"{gate.id}-reason", "analyst", f"Your plan was rejected at the approval gate; revise the OpenSpec change "
            f"to answer this reason:\n{gate.words}", gate.by, gate.at)], analyst_feedback="")
        set_position(PHASE_ANALYST, min(MIN_REVIEW_CYCLES_BEFORE_APPROVAL, MAX_REVIEW_CYCLES))
    save_state()


def pass_commit_gate() -> str:
    """The commit gate after a PASS: approved, the PASS stands ('PASS'); rejected, the round counts as a FAIL
    whose evidence is the person's words, for the programmer as a failed test's would be ('FAIL')."""
    if phase_step != "approval":
        open_gate("commit")
        set_position(PHASE_TESTER, 1, "approval")
        save_state()
    gate = at_gate("commit")
    if gate.verdict == "approve":
        return "PASS"
    set_tester_fail([f"- The tester reported PASS, but {gate.by} rejected the change at the commit gate, saying:",
                     *[f"    {line}" for line in gate.words.splitlines()]])
    log_turn("tester", "the PASS was rejected at the commit gate; the round counts as a FAIL")
    return "FAIL"


def run_reviewed_phase(phase: str) -> None:
    """Author and peer reviewer take turns until an approval counts or the cycles run out."""
    author, reviewer = PHASE_ROLES[phase]
    out_key, review_key = PHASE_OUTPUTS[phase]
    author_prompt, review_prompt, feedback_key = REVIEWED_PHASES[phase]
    while current_phase == phase:
        cycle = phase_cycle
        if phase_step == "author":
            stories = phase == PHASE_PROGRAMMER and cycle == 1 and story_loop_due()
            set_output(out_key, run_story_loop() if stories else ask_agent(author, lambda: author_prompt(cycle)))
            set_position(phase, cycle, "review")
            save_state()
        review = ask_agent(reviewer, review_prompt)
        set_output(review_key, review)
        verdict, approved = reply_verdict("review", review), is_review_approved(review, cycle, reviewer)
        note_turn_outcome(verdict if approved else f"{verdict} (not counted)")
        log_turn(reviewer, f"verdict {verdict}: approved" if approved else
                 f"verdict {verdict}; approval not counted: {approval_withheld(review, cycle, reviewer)}")
        update_run(**{feedback_key: "" if approved else review_feedback_from(review)})
        if not approved and cycle < MAX_REVIEW_CYCLES:
            set_position(phase, cycle + 1, "author")
        else:
            if not approved:
                log_turn(reviewer, f"no approval after {MAX_REVIEW_CYCLES} cycles; going on with the last "
                                   "review notes carried forward")
            leave_phase(phase)
        save_state()


def handle_tester_fail() -> None:
    """Set up the retry round: programmer -> peer programmer -> tester, with the failure evidence."""
    programmer_out = outputs["programmer"]
    update_run(feedback=extract_test_evidence(outputs["tester"]),
               programmer_context_for_retry=("" if programmer_out == _UPSTREAM_PLACEHOLDER
                                             else condense_programmer_for_tester(programmer_out)),
               analyst_feedback="", programmer_feedback="", story_progress=None, current_round=current_round + 1)
    for key in ("programmer", "programmer_review", "tester"):
        set_output(key, "")
    set_position(PHASE_PROGRAMMER)


# -- Progress between failed rounds (MAX_ROUNDS_WITHOUT_PROGRESS) -----------------------------------
# A FAIL whose signature (section 10) repeats the last one is a round without progress, whatever WD changed.
MORE_FILES_MARK = "<more files>"     # the key of one digest for the files beyond PROGRESS_FILE_LIMIT
PROGRESS_FILE_LIMIT = 5000           # files of a WD without git fingerprinted one by one


def _walked_fingerprints() -> dict[str, str]:
    """WD without git: each file's size and time of change, $WD/.tmp/ left out; past PROGRESS_FILE_LIMIT files
    one digest stands for the rest."""
    root, marks, rest = Path(WD), {}, hashlib.sha1()
    for folder, folders, files in os.walk(root):
        folders[:] = sorted(name for name in folders if name != ".git" and not (folder == str(root) and name == ".tmp"))
        for name in sorted(files):
            path = Path(folder) / name
            try:
                stat = path.lstat()
            except OSError:
                continue
            if is_orchestrator_file(path.resolve()):
                continue
            mark = f"{stat.st_size}:{stat.st_mtime_ns}"
            if len(marks) < PROGRESS_FILE_LIMIT:
                marks[str(path.relative_to(root))] = mark
            else:
                rest.update(f"{path}\0{mark}\0".encode("utf-8", "replace"))
                marks[MORE_FILES_MARK] = rest.hexdigest()
    return marks


def worktree_fingerprints() -> dict[str, str] | None:
    """What WD holds now, to tell which files a round changed (None when it cannot be read)."""
    top = git_top(WD)
    try:
        return git_fingerprints(top) if top else _walked_fingerprints()
    except OSError as exc:
        log(f"could not read what {WD} holds ({exc}); the round's changed files are not known")
        return None


def changed_files(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """The paths whose fingerprints differ (with git: and what the commits in between changed)."""
    paths = {path for path in before.keys() | after.keys() if path != HEAD_MARK and before.get(path) != after.get(path)}
    old, new = before.get(HEAD_MARK), after.get(HEAD_MARK)
    if old and new and old != new:
        top = git_top(WD)
        code, out, _ = git(["diff", "--name-only", old, new, "--", WD], top) if top else (1, "", "")
        paths.update(line for line in out.splitlines() if line and code == 0)
    return sorted(paths)


def note_progress() -> None:
    """MAX_ROUNDS_WITHOUT_PROGRESS: compare the FAIL just read with the last one (and what WD holds now with what
    it held then), keep it and count the rounds in a row without progress; before handle_tester_fail() clears the
    tester's answer."""
    if not MAX_ROUNDS_WITHOUT_PROGRESS:
        return
    evidence = extract_test_evidence(outputs["tester"])
    now = worktree_fingerprints()
    files = changed_files(worktree_at_fail, now) if worktree_at_fail is not None and now is not None else None
    signature = failure_signature(evidence)
    repeats = failed_rounds[-1].round if failed_rounds and failed_rounds[-1].signature == signature else 0
    record = FailedRound(current_round, signature, failing_step(evidence), evidence, files, repeats)
    add_failed_round(record)
    streak = rounds_without_progress + 1 if record.repeats else 0
    update_run(rounds_without_progress=streak, worktree_at_fail=now)
    log_turn("tester", (f"the same failure as in round {record.repeats} ({files_text(record.files)} in the round): "
                        f"{streak} of MAX_ROUNDS_WITHOUT_PROGRESS={MAX_ROUNDS_WITHOUT_PROGRESS} rounds without "
                        "progress")
             if record.repeats else "a failure other than the last round's: progress")
    record_event("round_compared", round=record.round, progress=not record.repeats,
                 repeats_round=record.repeats or None, rounds_without_progress=streak, step=record.step,
                 files_changed=record.files)


def progress_stop_due() -> bool:
    """After a FAIL: whether the rounds without progress reached MAX_ROUNDS_WITHOUT_PROGRESS while rounds remain
    (at MAX_ROUNDS the run ends in FAIL as without the setting)."""
    return bool(MAX_ROUNDS_WITHOUT_PROGRESS) and rounds_without_progress >= MAX_ROUNDS_WITHOUT_PROGRESS \
        and current_round <= MAX_ROUNDS


def turns_left_at_most(saved: SavedState) -> int:
    """The most agent turns an unfinished run can still take under today's limits (story attempts not counted)."""
    if saved.finished or saved.current_phase == PHASE_DONE:
        return 0
    reviewed_phase = 2 * (MAX_REVIEW_CYCLES - saved.phase_cycle + 1) - (1 if saved.phase_step == "review" else 0)
    code_round = 2 * MAX_REVIEW_CYCLES + 1
    left_in_round = {PHASE_ANALYST: reviewed_phase + code_round, PHASE_PROGRAMMER: reviewed_phase + 1,
                     PHASE_TESTER: 1}[saved.current_phase]
    return max(0, left_in_round) + max(0, MAX_ROUNDS - saved.current_round) * code_round


def round_figures(rounds: int) -> tuple[int, dict[str, TokenUse] | None]:
    """What `rounds` more retry rounds cost at this run's own pace: the turns (its retry rounds' turns per
    round, else a round in full) and their tokens (None: not known)."""
    retry = [r for r in turn_records if r.round > 1]
    played = len({r.round for r in retry})
    per_round = round(len(retry) / played) if played else 2 * MAX_REVIEW_CYCLES + 1
    known = [r.tokens for r in retry if r.tokens is not None]
    if not known or len(known) < len(retry):
        return rounds * per_round, None
    total = add_tokens(*known)
    share = rounds / played
    return rounds * per_round, {model: TokenUse(round(use.input * share), round(use.cached_input * share),
                                                round(use.output * share)) for model, use in total.items()}


def no_progress_record() -> dict:
    """Why the run stops without progress: the repeated failure, its rounds, what they changed, what it saves."""
    played = current_round - 1
    first_round = played - rounds_without_progress
    first = next((r for r in failed_rounds if r.round == first_round), failed_rounds[-1])
    repeated = [r for r in failed_rounds if first_round < r.round <= played]
    files = sorted({path for r in repeated for path in (r.files or [])})
    turns, tokens = round_figures(MAX_ROUNDS - played)
    left = turns_left_at_most(SimpleNamespace(finished=False, current_phase=PHASE_PROGRAMMER, phase_cycle=1,
                                              phase_step="author", current_round=current_round))
    return {"round": played, "first_round": first.round, "rounds": rounds_without_progress,
            "limit": MAX_ROUNDS_WITHOUT_PROGRESS, "step": first.step,
            "files_changed": files, "files_known": all(r.files is not None for r in repeated),
            "turns_left_at_most": left, "turns_saved": turns, "tokens_saved": tokens_json(tokens)}


def no_progress_line(stop: dict, agents_ended: bool = False) -> str:
    """The stop's one line: which failure repeated, for how many rounds, what they changed, what is saved, and
    how to go on (a run whose agents were ended cannot: a rerun starts a new one)."""
    changed = files_text(stop["files_changed"] if stop.get("files_known", True) else None)
    tokens = tokens_from_json(stop.get("tokens_saved"))
    return (f"stopped without progress: the test failed at the same step in rounds {stop['first_round']} to "
            f"{stop['round']} ({counted(stop['rounds'], 'round')} in a row without progress, "
            f"MAX_ROUNDS_WITHOUT_PROGRESS={stop.get('limit', stop['rounds'])}): {stop['step']}; in those rounds "
            f"{changed}; about {counted(stop['turns_saved'], 'turn')}"
            + (f" ({tokens_text(tokens)})" if tokens else "")
            + f" not spent (at most {stop['turns_left_at_most']}); a person is needed"
            + ("; its agents were ended (CLEANUP_ON_EXIT=1), so a rerun starts a new run" if agents_ended else
               f", then to go on: {go_on_command(stop['round'], True)}"))


def stop_without_progress() -> int:
    """End the run as a FAIL of the round just played, saying why, so that RESUME=1 goes on from there."""
    stop = no_progress_record()
    close_run("FAIL", current_round=stop["round"], no_progress_stop=stop)
    log(f"{no_progress_line(stop, CLEANUP_ON_EXIT)}; state in {STATE_FILE}")
    return EXIT_NO_PROGRESS


def set_tester_fail(evidence: list[str]) -> None:
    """The tester's answer replaced by a FAIL with this evidence: a PASS the loop's own check or a person refused."""
    form = VERDICT_FORMATS["tester"]
    set_output("tester", "\n".join([form.line(passed=False), f"{form.section}:", *evidence]))


def verify_pass() -> str:
    """VERIFY_PASS: 'PASS' when PROJECT_TEST_CMD exits 0 after the tester's PASS, else a FAIL whose evidence is
    the command's tail. A stop during it reruns the command, never the tester."""
    log_turn("tester", f"the tester reported PASS; checking it with PROJECT_TEST_CMD in {WD} (VERIFY_PASS=1, at "
                       f"most {VERIFY_TIMEOUT:g}s): {PROJECT_TEST_CMD}")
    started = time.monotonic()
    try:
        code, out, err = run_command(["sh", "-c", PROJECT_TEST_CMD], WD, VERIFY_TIMEOUT)
    except OSError as exc:
        code, out, err = 127, "", f"could not run sh: {exc}"
    seconds = round(time.monotonic() - started, 1)
    outcome = f"was stopped after VERIFY_TIMEOUT={VERIFY_TIMEOUT:g}s" if code is None else f"exited {code}"
    update_run(verifications=verifications + [{"round": current_round, "result": "passed" if code == 0 else "failed",
                                               "exit_code": code, "seconds": seconds, "at": utc_iso()}])
    if code == 0:
        log_turn("tester", f"PASS verified: PROJECT_TEST_CMD exited 0 after {seconds:g}s")
        return "PASS"
    lines = [line for line in (out + ("\n" if out and err else "") + err).splitlines() if line.strip()]
    shown = lines[-max(1, MAX_TEST_EVIDENCE_LINES - 4):]     # with the lines above it, within the evidence cap
    set_tester_fail([
        f"- The tester reported PASS, but the project's test command disagreed: `{PROJECT_TEST_CMD}` {outcome} "
        f"(run by the orchestrator in {WD}).",
        f"- Its last {len(shown)} lines of output:" if shown else "- It printed nothing.",
        *[f"    {line}" for line in shown]])
    log_turn("tester", f"PASS not verified: PROJECT_TEST_CMD {outcome} after {seconds:g}s; the round counts as a FAIL")
    for line in shown[-10:]:
        log_detail(line)
    return "FAIL"


def run_tester_phase() -> str:
    """One tester turn (and, with VERIFY_PASS, the loop's own check of a PASS); returns PASS or FAIL."""
    result = "PASS"                        # resumed past the tester's turn: it said PASS already
    if phase_step == "verify":             # resumed during the check
        log_turn("tester", "resuming the check of the tester's PASS (the tester is not asked again)" if VERIFY_PASS
                 else "the tester's PASS stands: VERIFY_PASS is off now")
    elif phase_step != "approval":         # (at the commit gate the PASS, checked if asked, waits there)
        set_output("tester", ask_agent("tester", lambda: build_tester_prompt(outputs["programmer"])))
        result = reply_verdict("tester", outputs["tester"])
        note_turn_outcome(result)
        log_turn("tester", f"RESULT: {result}")
        for line in extract_test_evidence(outputs["tester"]).splitlines():
            log_detail(line)
        if result == "PASS" and VERIFY_PASS:
            set_position(PHASE_TESTER, 1, "verify")
            save_state()
    if result == "PASS" and VERIFY_PASS and phase_step == "verify":
        result = verify_pass()
    if result == "PASS" and (gate_due("commit") or phase_step == "approval"):
        result = pass_commit_gate()
    if result == "PASS":
        close_run(result)
    else:
        note_progress()                    # before handle_tester_fail() clears the tester's answer
        handle_tester_fail()
        save_state()
    return result


def drive_rounds() -> int:
    """Drive the phases until the tester passes (0) or the rounds run out (1)."""
    while current_round <= MAX_ROUNDS:
        if current_phase == PHASE_PROGRAMMER and not outputs["analyst"].strip():
            log_turn("programmer", "no analyst output to work from; falling back to the analyst phase")
            set_position(PHASE_ANALYST)
        elif current_phase == PHASE_TESTER and not outputs["programmer"].strip():
            log_turn("tester", "no programmer output to test; falling back to the programmer phase")
            set_position(PHASE_PROGRAMMER)
        elif current_phase == PHASE_DONE:
            set_position(PHASE_TESTER)      # a RUNNING state left at "done": the test decides
        elif current_phase == PHASE_PROGRAMMER and phase_step == "approval":
            pass_plan_gate()
        elif current_phase == PHASE_TESTER:
            if run_tester_phase() == "PASS":
                log("; ".join(filter(None, (f"PASS in round {current_round}", scripted_note(map(provider_for, ROLES)),
                                            f"state in {STATE_FILE}"))))
                return EXIT_PASS
            if progress_stop_due():
                return stop_without_progress()
        else:
            run_reviewed_phase(current_phase)
    # The last FAIL set up a next round (its evidence kept for the programmer): the run played one round less,
    # and RESUME=1 with a higher MAX_ROUNDS goes on with that round (continue_failed_run).
    close_run("FAIL", current_round=max(1, current_round - 1))
    log(f"FAIL: no PASS within MAX_ROUNDS={MAX_ROUNDS}; state in {STATE_FILE}; to go on with more rounds: "
        f"{continue_command(current_round + 1)}")
    return EXIT_FAIL


def run_loop() -> int:
    """Drive the phases to PASS (0) or FAIL (1), then the after-run steps (section 13)."""
    try:
        code = drive_rounds()
    except (RunError, ApiError) as exc:
        if not isinstance(exc, ApprovalPending):      # a gate's own message went out when it was reached
            notify_stopped(exc)
        raise
    return finish_run(code)


def tokens_not_counted(summary: dict) -> str:
    """The run's note when none of its turns' tokens is known because its CLIs record none ('' otherwise)."""
    return "" if summary["tokens"] else tokenless_note(summary["providers"].values())


def summary_tokens(summary: dict) -> str:
    """'programmer 1,500 in + 500 cached + 40 out; ...; run ...': the tokens of each role that took a turn and
    of the run, as run_summary() has them."""
    parts = [(role, totals) for role, totals in summary["roles"].items() if totals["turns"]] + [("run", summary)]
    unknown = summary["tokens_unknown_turns"]
    if len(summary["clis"]) > 1:              # a role went over to its fallback CLI: each CLI's share too
        parts += [(f"{provider} (CLI)", totals) for provider, totals in summary["clis"].items()]
    return "; ".join(f"{role} {tokens_text(tokens_from_json(totals['tokens']))}" for role, totals in parts) \
        + (f" ({counted(unknown, 'turn')} unknown)" if unknown and summary["tokens"] else "")


def report_run_summary(exit_code: int) -> None:
    """Log the run's summary and keep it as summary.json in the run's archive directory, the run's stop recorded
    first, so that summary.json and the page both hold it."""
    record_event("run_stopped", result=final_status, exit_code=exit_code, meaning=EXIT_MEANINGS.get(exit_code),
                 scheduler_action=SCHEDULER_ACTIONS.get(exit_code), turns=len(turn_records),
                 tokens=_token_totals(turn_records)["tokens"], no_progress=no_progress_stop)
    summary = run_summary(exit_code)
    per_role = ", ".join(f"{role} {r['turns']}x {r['seconds']:g}s" for role, r in summary["roles"].items()
                         if r["turns"])
    unanswered = summary["prompts_sent"] - summary["turns"]
    log(f"summary: {summary['result']} after round {summary['rounds']}/{summary['max_rounds']}; "
        f"{counted(summary['turns'], 'turn')}"
        + (f" and {counted(unanswered, 'prompt')} not answered yet" if unanswered else "")
        + f", {summary['agent_seconds']:g}s of agent time ({per_role or 'none'}); "
        f"{summary['prompt_bytes'] / 1000:.1f} KB of prompts")
    verdicts = [f"{role}: {' -> '.join(r['outcomes'])}" for role, r in summary["roles"].items() if r["outcomes"]]
    if verdicts:
        log("summary: " + "; ".join(verdicts))
    if summary["turns"] and not tokens_not_counted(summary):
        log(f"summary: tokens used: {summary_tokens(summary)}")
    if replacements:
        log(f"summary: lost agents replaced: {replacement_summary(replacements)}")
    if cli_switches:
        log(f"summary: on a fallback CLI for the rest of the run: {'; '.join(w.text() for w in cli_switches)}")
    if run_dir:
        path = Path(run_dir) / "summary.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        write_report(exit_code, summary)
        log(f"summary written to {path}; the run's page: {path.with_name('report.html')}")


# ==========================================================================
# 16. Before a run: --check
# ==========================================================================
# `--check [config.json]` looks at all a run needs, without creating an agent: a line each, ✓, ✗ with its fix for
# what stops a run, or ! for what may fail later or cannot be looked at from here (exit 0 with ! lines). The agents'
# side is seen from a probe: a window in the agents' tmux server, started as CAO starts an agent's. A CLI's known
# traps are declared in its row (`AgentCli.traps`), looked for by check_trap().
PROBE_SECONDS = 60.0             # a CLI's first --version may unpack itself (Copilot: 235 MB)
CAO_PANE_KEYS = ("HOME", "PATH", "SHELL", "USER", "LANG", "LC_ALL", "LC_CTYPE", "TERM")  # CAO passes these on


@dataclass(frozen=True)
class CheckLine:
    """One line of --check: True ✓, False ✗ (stops a run; its text says the fix), None ! (a warning: what may fail
    later, e.g. a fallback CLI, or what cannot be looked at from here)."""

    ok: bool | None
    text: str


@dataclass
class AgentsSide:
    """What the probe saw in an agent's shell: its environment, its user, and each CLI program's path
    ('' when the shell does not find it) and the first line its --version printed."""

    env: dict[str, str]
    uid: int
    programs: dict[str, tuple[str, str]]

    def home(self, *parts: str) -> Path:
        return Path(self.env.get("HOME") or Path.home()).joinpath(*parts)


def cli_program(provider: str, report: dict[str, tuple[str, bool]] | None) -> str:
    """The program CAO starts for a provider: its row's, else the one the server names, else its name."""
    return agent_cli(provider).program or (report or {}).get(provider, (provider, True))[0]


def _probe_script(folder: Path, programs: list[str], versions: bool = True) -> Path:
    """A POSIX sh script that writes what the agent's shell sees to folder/out, then folder/done (each program's
    version too with `versions`: a CLI's first --version may take a minute)."""
    lines = ["{", 'echo "@@uid $(id -u)"']
    for program in programs:
        quoted = shlex.quote(program)
        lines += [f'found=$(command -v {quoted} 2>/dev/null)', f'echo "@@program {program} $found"']
        lines += [f'[ -n "$found" ] && "$found" --version </dev/null 2>/dev/null | head -n 3 '
                  f'| sed "s/^/@@version {program} /"'] if versions else []
    lines += ['echo "@@env"', "env", f"}} > {shlex.quote(str(folder / 'out'))} 2>&1",
              f"touch {shlex.quote(str(folder / 'done'))}"]
    script = folder / "probe.sh"
    script.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return script


def _read_probe(text: str) -> AgentsSide:
    """What the probe's out file says: its @@ lines, then after @@env the environment (`env`'s lines)."""
    head, *tail = re.split(r"^@@env$", text, maxsplit=1, flags=re.MULTILINE)
    env = {key: value for key, sep, value in (line.partition("=") for line in "".join(tail).splitlines())
           if sep and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key)}
    programs = {program: (path.strip(), "") for program, path in re.findall(r"^@@program ([^ \n]*) ?(.*)$", head,
                                                                             re.MULTILINE)}
    for program, version in re.findall(r"^@@version ([^ \n]*) (.*)$", head, re.MULTILINE):
        path, seen = programs.get(program, ("", ""))
        if not re.search(r"\d+\.\d+", seen):             # the first of its lines that names a version
            programs[program] = (path, version.strip())
    uid = re.search(r"^@@uid[ \t]*(\d+)\s*$", head, re.MULTILINE)
    return AgentsSide(env, int(uid.group(1)) if uid else -1, programs)


def probe_agents_side(server: LocalServer, programs: list[str], versions: bool = True) -> AgentsSide | str:
    """Look from a new window of the agents' tmux server, made as CAO makes an agent's; a str says why not."""
    socket_path = server.tmux_socket  # named (-S): where its folder is gone, tmux would reach the user's server
    if not os.path.isdir(os.path.dirname(os.path.dirname(socket_path))):
        return f"its folder {os.path.dirname(os.path.dirname(socket_path))} is gone"
    os.makedirs(os.path.dirname(socket_path), mode=0o700, exist_ok=True)   # as tmux makes it for its own socket
    tmux = ["tmux", "-S", socket_path]    # in cao-server's environment: the same server, started if need be
    name = f"cao-loop-check-{secrets.token_hex(4)}"
    passed_on = [arg for key, value in server.env.items()
                 if key in CAO_PANE_KEYS or key.startswith(("CAO_", "AWS_")) for arg in ("-e", f"{key}={value}")]
    with tempfile.TemporaryDirectory(prefix="cao-loop-check-") as scratch:
        folder = Path(scratch)
        script = _probe_script(folder, programs, versions)
        try:
            made = subprocess.run([*tmux, "new-session", "-d", "-s", name, "-x", "220", "-y", "50", "-c", WD,
                                   *passed_on], env=server.env, capture_output=True, text=True, timeout=30)
            if made.returncode != 0:
                return f"tmux could not start a window there: {' '.join(made.stderr.split())[:200]}"
            subprocess.run([*tmux, "send-keys", "-t", name, f"sh {shlex.quote(str(script))}", "Enter"],
                           env=server.env, capture_output=True, timeout=30)
            give_up = time.monotonic() + PROBE_SECONDS
            while not (folder / "done").exists() and time.monotonic() < give_up:
                time.sleep(0.1)
            finished = (folder / "done").exists()
            text = (folder / "out").read_text(encoding="utf-8", errors="replace") if finished else ""
        except (OSError, subprocess.SubprocessError) as exc:
            return f"tmux failed: {exc}"
        finally:
            with suppress(OSError, subprocess.SubprocessError):
                subprocess.run([*tmux, "kill-session", "-t", name], env=server.env, capture_output=True, timeout=30)
    if not finished:
        return f"the shell of a new window gave no answer in {PROBE_SECONDS:g} s"
    return _read_probe(text)


def probe_here(env: dict[str, str], programs: list[str]) -> AgentsSide:
    """What a shell of this machine with `env` sees, by the probe's own script (the run's own server's agents: their
    environment is the loop's, so no window is needed)."""
    with tempfile.TemporaryDirectory(prefix="cao-loop-check-") as scratch:
        script = _probe_script(Path(scratch), programs)
        with suppress(OSError, subprocess.SubprocessError):
            subprocess.run(["sh", str(script)], env=env, cwd=WD, capture_output=True, timeout=PROBE_SECONDS)
        return _read_probe(_read_text(Path(scratch) / "out"))


# -- The checks --------------------------------------------------------------------


def local_cao_version() -> str:
    """The version of cli-agent-orchestrator the server at API runs, where it runs here ('' where unknown)."""
    server = local_server()
    return server.cao_version() if server else ""


def cao_version_words(version: str) -> str:
    """'cli-agent-orchestrator 2.5.4', with the version proven beside one that differs ('' for no version)."""
    note = "" if version == CAO_PROVEN_VERSION else f" (the loop is proven with {CAO_PROVEN_VERSION})"
    return f"cli-agent-orchestrator {version}{note}" if version else ""


def check_server() -> list[CheckLine]:
    """CAO reachable and taking our token (its /health asks for none), and its version (where it runs here)
    against the one proven."""
    try:
        api.check_health()
        api.provider_report()
    except ApiError as exc:
        return [CheckLine(False, f"{exc}")]
    words = cao_version_words(local_cao_version())
    return [CheckLine(True, f"CAO server at {API} answers" + (f": {words}" if words else ""))]


def check_providers(report: dict[str, tuple[str, bool]] | None) -> list[CheckLine]:
    """Each role's provider known to this CAO: listed by it, or (CAO leaves some out of its list) a provider
    whose row names the first CAO release that knows it, against the version running here."""
    version, lines = local_cao_version(), []
    for provider in providers_in_use():
        since = agent_cli(provider).cao_since
        if report is None or provider in report:
            continue
        if not since or (version and version_tuple(version) < version_tuple(since)):
            lines.append(CheckLine(False, provider_unknown_line(provider, report, version)))
        elif not version:
            lines.append(CheckLine(None, f"provider {provider}: CAO leaves it out of its list and its version "
                                         f"cannot be told from here (it needs CAO >= {since})"))
    return lines


def check_profiles(side: AgentsSide | None) -> list[CheckLine]:
    """Each role's CAO agent profile installed, for its provider where that CLI keeps its own copy."""
    lines, missing = [], []
    for profile, provider in profiles_in_use():
        known = api.profile_installed(profile)
        own_copy = agent_cli(provider).profile_file.format(name=profile)
        if known is False or (known and own_copy and side is not None and not side.home(own_copy).is_file()):
            missing.append((profile, provider))
        elif known is None:
            lines.append(CheckLine(None, f"profile {profile}: the server cannot say whether it is installed"))
    if missing:
        return lines + [CheckLine(False, f"agent profiles not installed for their provider: "
                                         f"{', '.join(f'{p} ({q})' for p, q in missing)}; {profiles_fix(missing)}")]
    return lines + [CheckLine(True, "agent profiles installed: " + ", ".join(
        dict.fromkeys(profile_for(role) for role in ROLES)))]


def profiles_fix(missing: list[tuple[str, str]]) -> str:
    """One command that installs the missing profiles from any folder into the store the server at API reads (its
    HOME, or CAO_HOME_DIR, where it runs here), from the profiles installed with the loop; or OWN_SERVER=1."""
    server = local_server()
    store = {key: server.env[key] for key in ("HOME", "CAO_HOME_DIR") if server and server.env.get(key)}
    folder = store.get("CAO_HOME_DIR") or f"{store.get('HOME')}/.aws/cli-agent-orchestrator"
    where = (f"the CAO server at {API} reads its store in {folder}, so install them there" if store else
             f"install them where the CAO server at {API} runs, as its user")
    env = "".join(f"{key}={shlex.quote(value)} " for key, value in store.items())
    cao = shlex.quote(loop_program("cao") or "cao")
    installs = " && ".join(f"{env}{cao} install {shlex.quote(str(bundled_profile(profile) or profile + '.md'))} "
                           f"--provider {provider}" for profile, provider in missing)
    return f"{where}: `{installs}`; or {OWN_INSTEAD}, which installs them itself"


def check_clis(side: AgentsSide, report: dict[str, tuple[str, bool]] | None) -> list[CheckLine]:
    """Each role's CLI found by the agents' shell, and its version against the one proven with the loop."""
    lines = []
    for provider in providers_in_use():
        cli, program = agent_cli(provider), cli_program(provider, report)
        path, version_line = side.programs.get(program, ("", ""))
        if not path:
            here = shutil.which(program)
            fix = (f"it is at {here} here: link it where their shells look, e.g. `ln -sf {here} "
                   f"/usr/local/bin/{program}`" if here else f"install {cli.label} for the user running cao-server")
            lines.append(CheckLine(False, f"{program} ({cli.label}, provider {provider}) is not on the PATH of "
                                          f"the agents' shells (CAO starts agents in its tmux server's shells, "
                                          f"login shells where it runs them): {fix}"))
            continue
        found = re.search(r"\d+\.\d+(?:\.\d+)?", version_line)
        version = found.group(0) if found else ""
        note = ("" if not cli.proven or version == cli.proven else
                f" (proven with {cli.proven}; see docs/agent-clis.md)" if version else
                f" (its version unknown; proven with {cli.proven})")
        lines.append(CheckLine(True, f"{program} found by the agents' shells: {path}"
                                     + (f", {version}" if version else "") + note))
    return [fallback_line(provider, line) for provider, line in zip(providers_in_use(), lines)]


def fallback_line(provider: str, line: CheckLine) -> CheckLine:
    """A line of a CLI that only stands in for roles at a usage limit ('the programmer's fallback: ...'): what it
    lacks does not stop a run (the role's own CLI may never reach its limit), so a ✗ becomes a warning."""
    if any(provider_for(role) == provider for role in ROLES):
        return line
    roles = [f"the {role.replace('_', ' ')}'s" for role in ROLES if provider in providers_of(role)]
    whose = "every role's" if len(roles) == len(ROLES) else " and ".join(roles)
    return CheckLine(None if line.ok is False else line.ok, f"{whose} fallback: {line.text}")


def agents_file(looked_at: Trap | Credential, side: AgentsSide) -> Path:
    """The file a trap or a form of sign-in looks at: under the project ({project}/...), under the agents' home, or
    in the folder its variable names where they set it."""
    if looked_at.file.startswith("{project}/"):
        return trap_project() / looked_at.file.removeprefix("{project}/")
    if looked_at.folder_env and side.env.get(looked_at.folder_env):
        return Path(side.env[looked_at.folder_env]) / Path(looked_at.file).name
    return side.home(looked_at.file)


def trap_project() -> Path:
    """The project folder a trap may name: git's top of WD, else WD."""
    return Path(git_top(WD) or WD).resolve()


def trap_avoided(trap: Trap, side: AgentsSide) -> bool:
    """Whether the agents' side holds what the trap asks for: its variable at its value (set, where the trap
    names none), or its file saying it."""
    if trap.env:
        return side.env.get(trap.env) == trap.env_value if trap.env_value else bool(side.env.get(trap.env))
    if trap.json_key:
        value = _json_file(agents_file(trap, side)).get(trap.json_key)
        return (isinstance(value, list) and trap.json_holds in value) if trap.json_holds else bool(value)
    text = _read_text(agents_file(trap, side)) + "\n"       # a file that is not there holds no match
    pattern = re.compile(trap.pattern, re.MULTILINE)
    found = list(pattern.finditer(text))
    if "project" not in pattern.groupindex:
        return bool(found)
    project = trap_project()
    return any(Path(match.group("project")) in (project, *project.parents) for match in found)


def check_trap(cli: AgentCli, trap: Trap, side: AgentsSide) -> CheckLine:
    """One trap of a CLI's row: ✓ with what was found, else ✗ with its fix."""
    if trap.root_only and side.uid != 0:
        return CheckLine(True, f"{cli.label}: not run as root")
    ok = trap_avoided(trap, side)
    text = trap.found if ok else trap.fix
    # each mark filled in where the text names it (its value looked up only then: {project} asks git)
    fills = {"{project}": lambda: str(trap_project()), "{file}": lambda: str(agents_file(trap, side)),
             "{tmux}": lambda: tmux_hint("").rstrip(),
             "{seen}": lambda: f"{trap.env}={side.env[trap.env]}" if side.env.get(trap.env) else f"no {trap.env}"}
    for mark, fill in fills.items():
        if mark in text:
            text = text.replace(mark, fill())
    return CheckLine(ok, text)


def check_traps(side: AgentsSide) -> list[CheckLine]:
    """Each CLI's known traps, as its row declares them."""
    return [fallback_line(provider, check_trap(agent_cli(provider), trap, side)) for provider in providers_in_use()
            for trap in agent_cli(provider).traps]


def sprung_traps(provider: str) -> list[CheckLine]:
    """The provider's traps found sprung on the agents' side, looked at as --check does (a failed start-up names a
    trap only then); none where the agents' side cannot be looked into from here."""
    traps = agent_cli(provider).traps
    server = local_server() if traps else None
    side = probe_agents_side(server, []) if server is not None and not tmux_missing() else None
    if not isinstance(side, AgentsSide):
        return []
    return [line for line in (check_trap(agent_cli(provider), trap, side) for trap in traps) if line.ok is False]


# -- Signed in: each CLI's forms of credential (its row's `SignIn`), looked for without a token spent ----------


def sign_in_env(cli: AgentCli, side: AgentsSide, settings_only: bool = False) -> dict[str, str]:
    """The variables the CLI will have: the agents' environment's, overridden by those its settings files set
    ("env"); with `settings_only`, those alone."""
    settings: dict[str, str] = {}
    for name in cli.sign_in.settings_env if cli.sign_in else ():
        values = _json_file(agents_file(Credential("", file=name), side)).get("env")
        settings.update({str(k): str(v) for k, v in values.items() if v} if isinstance(values, dict) else {})
    return settings if settings_only else {**{k: v for k, v in side.env.items() if v}, **settings}


def _json_path(data: object, dotted: str) -> object:
    for key in dotted.split("."):
        data = data.get(key) if isinstance(data, dict) else None
    return data


def credential_found(cli: AgentCli, form: Credential, side: AgentsSide) -> tuple[bool, str]:
    """Whether a form of sign-in is there, and what it is called ({file} and {variable} filled in)."""
    where = sign_in_env(cli, side, form.settings_only)
    variable = next((name for name in form.env if where.get(name)), "")
    if form.env:
        return bool(variable), form.name.replace("{variable}", variable or " or ".join(form.env[:3]))
    path = agents_file(form, side)
    named = form.name.replace("{file}", str(path))
    if form.json_key:
        return bool(_json_path(_json_file(path), form.json_key)), named
    return bool(re.search(form.pattern, _read_text(path), re.MULTILINE)), named


def claude_api_key(cli: AgentCli, form: Credential, side: AgentsSide) -> CheckLine | None:
    """ANTHROPIC_API_KEY: Claude Code uses it once approved in ~/.claude.json (its last 20 characters); a key it
    has not been asked about it asks about at each start, a question CAO does not answer (its default: No)."""
    key = sign_in_env(cli, side).get("ANTHROPIC_API_KEY", "")
    if not key:
        return None
    config = side.home(".claude.json")
    answers = _json_file(config)
    if key[-20:] in (_json_path(answers, "customApiKeyResponses.approved") or []):
        return CheckLine(True, f"{cli.label}: signed in (ANTHROPIC_API_KEY, approved in {config})")
    if key[-20:] in (_json_path(answers, "customApiKeyResponses.rejected") or []):
        return CheckLine(False, f"{cli.label}: ANTHROPIC_API_KEY is set, but it was told not to use that key "
                                f"(customApiKeyResponses.rejected in {config}): start `claude` once as the user the "
                                "agents run as and turn \"Use custom API key\" on in /config")
    return CheckLine(False, f"{cli.label}: ANTHROPIC_API_KEY is set, but Claude Code asks at each start whether to "
                            "use it (its default answer is No, and CAO does not answer it): start `claude` once as the "
                            "user the agents run as and answer Yes (or add the key's last 20 characters to "
                            f"customApiKeyResponses.approved in {config})")


CODEX_LOCAL_PROVIDERS = ("ollama", "lmstudio")     # its built-in providers that need no sign-in


def codex_model_provider(cli: AgentCli, form: Credential, side: AgentsSide) -> CheckLine | None:
    """A model provider Codex's config.toml chooses: signed in by its env_key's variable (None: its login decides,
    as for OpenAI's own)."""
    path = agents_file(form, side)
    text = _read_text(path)                        # '' where it is not there: a config that chooses no provider
    if tomllib is None:
        return CheckLine(None, f"{cli.label}: cannot say whether its model provider in {path} is signed in (Python "
                               "3.11 or newer reads it)") if re.search(r"(?m)^\s*model_provider\s*=", text) else None
    try:
        config = tomllib.loads(text)
    except ValueError as exc:
        return CheckLine(None, f"{cli.label}: cannot say whether it is signed in: {path} is not TOML ({exc})")
    name = config.get("model_provider")
    providers = config.get("model_providers") if isinstance(config.get("model_providers"), dict) else {}
    provider = providers.get(name)
    if not isinstance(name, str) or name == "openai" or (isinstance(provider, dict)
                                                          and provider.get("requires_openai_auth")):
        return None                                # its login decides
    if not isinstance(provider, dict):
        return (CheckLine(True, f"{cli.label}: signed in (its model provider {name}, a local one)")
                if name in CODEX_LOCAL_PROVIDERS else
                CheckLine(None, f"{cli.label}: cannot say whether its model provider {name} is signed in (it is "
                                f"not defined in {path})"))
    key = provider.get("env_key")
    if not key:
        return CheckLine(None, f"{cli.label}: cannot say whether its model provider {name} needs a key ({path} "
                               "names no env_key)")
    if side.env.get(str(key)):
        return CheckLine(True, f"{cli.label}: signed in (its model provider {name}, its key in {key})")
    return CheckLine(False, f"{cli.label}: its model provider {name} ({path}) reads its key from {key}, which the "
                            f"agents' environment lacks: set {key} where cao-server starts (for the run's own server, "
                            "in the loop's environment)")


def opencode_provider(cli: AgentCli, form: Credential, side: AgentsSide) -> CheckLine | None:
    """The provider of OpenCode's model: a key in its config, or its login for that provider (auth.json in its
    data folder); its catalogue's variables the loop does not know, so anything else is a "cannot say"."""
    path = agents_file(form, side)
    config = _json_file(path)
    model = config.get("model")
    if not isinstance(model, str) or "/" not in model:
        return CheckLine(None, f"{cli.label}: cannot say whether it is signed in: no model in {path}")
    provider = model.split("/", 1)[0]
    if _json_path(config, f"provider.{provider}.options.apiKey"):
        return CheckLine(True, f"{cli.label}: signed in (the apiKey of provider {provider} in {path})")
    data = Path(side.env["XDG_DATA_HOME"]) if side.env.get("XDG_DATA_HOME") else side.home(".local", "share")
    logins = data / "opencode" / "auth.json"
    if isinstance(_json_file(logins).get(provider), dict):
        return CheckLine(True, f"{cli.label}: signed in (its login for {provider}, {logins})")
    return CheckLine(None, f"{cli.label}: cannot say whether provider {provider} is signed in: no login for it in "
                           f"{logins} and no apiKey in {path}; it may take a variable of its own or need none (a local "
                           f"endpoint); {cli.sign_in.login if cli.sign_in else 'its login'} signs it in")


# a form of sign-in that needs more than a look (its row's Credential.reader) -> its reader
SIGN_IN_READERS: dict[str, Callable[[AgentCli, Credential, AgentsSide], CheckLine | None]] = {
    "claude api key": claude_api_key, "codex model provider": codex_model_provider,
    "opencode provider": opencode_provider}


def form_said(cli: AgentCli, form: Credential, side: AgentsSide) -> CheckLine | str | None:
    """What one form of sign-in says: its line where it is there (a reader's, ✓, or – where the loop cannot tell),
    why a form that is there does not do (a str), or None where it is not there."""
    if form.reader:
        return SIGN_IN_READERS[form.reader](cli, form, side)
    found, name = credential_found(cli, form, side)
    if not found:
        return None
    if form.not_enough:
        return f"{name} is set, but {form.not_enough}"
    return (CheckLine(None, f"{cli.label}: cannot say whether it is signed in: {name}") if form.unsure
            else CheckLine(True, f"{cli.label}: signed in ({name})"))


def sign_in_lines(cli: AgentCli, side: AgentsSide) -> list[CheckLine]:
    """Whether the CLI is signed in where its agents run, as its row's SignIn declares ([] where it declares
    none): ✗ for a form found that will not work or for none found (the CLI's login and the variable that also
    works), else ✓ naming the first found, else – where the loop cannot tell. Callable outside --check."""
    if cli.sign_in is None:
        return []
    said = [form_said(cli, form, side) for form in cli.sign_in.forms]
    ranked = sorted((line for line in said if isinstance(line, CheckLine)),
                    key=lambda line: (False, True, None).index(line.ok))
    if ranked:
        return ranked[:1]
    looked = [credential_found(cli, form, side)[1] for form in cli.sign_in.forms
              if (form.file or form.env) and not (form.unsure or form.not_enough)]
    notes = "".join(f"; {note}" for note in said if isinstance(note, str))
    return [CheckLine(False, f"{cli.label}: not signed in where its agents run (none of: {'; '.join(looked)}){notes}: "
                             f"{cli.sign_in.fix}")]


def check_sign_ins(side: AgentsSide) -> list[CheckLine]:
    """Each CLI in use signed in, as its row declares its forms of credential."""
    return [fallback_line(provider, line) for provider in providers_in_use()
            for line in sign_in_lines(agent_cli(provider), side)]


def agents_side(report: dict[str, tuple[str, bool]] | None, versions: bool = True) -> tuple[AgentsSide | None,
                                                                                        list[CheckLine]]:
    """The agents' side, from a probe in their tmux server; else the line that says why it cannot be looked at."""
    server = local_server()
    if server is None:
        where = ("runs on another machine" if urlparse(API).hostname not in LOCAL_HOSTS else
                 "cannot be looked into from here (another user's process, or no /proc)")
        return None, [CheckLine(None, f"agent CLIs not checked: cao-server at {API} {where}; run --check where it "
                                      "runs, as its user")]
    if missing := tmux_missing():
        return None, [CheckLine(False, missing)]
    side = probe_agents_side(server, sorted({cli_program(provider, report) for provider in providers_in_use()}),
                             versions)
    if isinstance(side, str):
        return None, [CheckLine(False, f"the agents' tmux server ({server.tmux_socket}): {side}")]
    return side, []


def check_reported_clis(report: dict[str, tuple[str, bool]] | None) -> list[CheckLine]:
    """Each role's CLI as cao-server reports it (CAO would wait minutes per terminal for one it lacks): ✗ naming
    the setting that chose it; with IGNORE_MISSING_CLI=1 a warning (the agents' login PATH may have it)."""
    missing = sorted(((role, provider) for role in ROLES for provider in providers_of(role)
                      if report and provider in report and not report[provider][1]),
                     key=lambda missed: all(provider_for(role) != missed[1] for role in ROLES))  # a role's own first
    if not missing:
        return []
    role, provider = missing[0]
    kind = "PROVIDER" if provider == provider_for(role) else "FALLBACK_PROVIDER"
    setting = f"{role.upper()}_{kind}" if role_setting(role, kind, own=True) else kind
    installed = sorted(name for name, (_binary, present) in report.items() if present)
    what = (f"cao-server at {API} reports that `{report[provider][0]}`, the CLI of provider {provider} "
            f"({setting}={provider}), is not installed on its machine")
    if IGNORE_MISSING_CLI:
        return [CheckLine(None, f"warning: {what}; IGNORE_MISSING_CLI=1, so the agents are created anyway")]
    return [fallback_line(provider, CheckLine(False, f"{what} (it reports installed: "
                                                     f"{', '.join(installed) or 'none of the CLIs it lists'}); set "
                                                     f"{setting} to a provider whose CLI is installed, install it "
                                                     "where cao-server runs, or set IGNORE_MISSING_CLI=1 if the "
                                                     "agents' login PATH has it"))]


def server_checks(report: dict[str, tuple[str, bool]] | None, run: bool = False) -> list[CheckLine]:
    """The checks of a CAO server the run did not start, once it answers: the providers it knows, the agent
    profiles, each CLI (found by the agents' shells where a probe can look, else as the server reports it), its
    traps and sign-in. `run`: only what stops a new run before a terminal is made (the profiles and the CLIs; a
    probe that asks no CLI for its version), the same lines --check shows."""
    unknown = check_providers(report)
    if any(line.ok is False for line in unknown):
        return [] if run else unknown    # for a run, its own stop names what the server knows, as --check does
    side, why = agents_side(report, versions=not run)
    clis = check_clis(side, report) if side is not None else check_reported_clis(report)
    if run:
        return check_profiles(side) + ([] if IGNORE_MISSING_CLI and side is not None else clis)
    return unknown + check_profiles(side) + clis + (why or check_traps(side) + check_sign_ins(side))


def check_working_directory() -> list[CheckLine]:
    """WD writable (settings already refused a missing one and this checkout); a git repository where a commit
    is asked for."""
    if not os.access(WD, os.W_OK):
        return [CheckLine(False, f"WD={WD} is not writable: the agents write their replies under it")]
    top = git_top(WD)
    if COMMIT_ON_PASS and not top:
        return [CheckLine(False, f"COMMIT_ON_PASS=1 but WD={WD} is not in a git repository: `git init` it, or unset "
                                 "COMMIT_ON_PASS")]
    return [CheckLine(True, f"working directory {WD}" + (f" (git repository {top})" if top else ""))]


def check_token_budget() -> list[CheckLine]:
    """Where a budget is set, the tokens it counts are readable (settings refused what cannot be)."""
    if not (MAX_RUN_TOKENS or MAX_RUN_COST):
        return []
    return [CheckLine(True, f"token budget: read from the records of {', '.join(providers_in_use())}")]


def check_ntfy() -> list[CheckLine]:
    """The ntfy server reachable where notifications are asked for."""
    if not NTFY_TOPIC:
        return []
    try:
        httpx.get(NTFY_SERVER.rstrip("/") + "/v1/health", timeout=10.0)
    except httpx.HTTPError as exc:
        return [CheckLine(False, f"ntfy server {NTFY_SERVER} not reachable ({exc.__class__.__name__}): fix "
                                 "NTFY_SERVER, or unset NTFY_TOPIC")]
    return [CheckLine(True, f"ntfy server {NTFY_SERVER} answers (topic {NTFY_TOPIC})")]


def cost_estimate() -> list[str]:
    """What a run sends its model at the least, from the figures measured per CLI, and its cost at MODEL_PRICES
    where one priced model serves every role (input at its full price)."""
    providers, models = providers_in_use(), {model_for(role) for role in ROLES}
    price = MODEL_PRICES.get(next(iter(models))) if len(models) == 1 else None
    lines = []
    for provider in providers:
        cli = agent_cli(provider)
        if not cli.run_tokens:
            lines.append(f"estimate: no measured figures for {provider} (docs/following-a-run.md has the other CLIs')")
            continue
        if not any(cli.run_tokens):
            lines.append(f"estimate: {provider} spends no model tokens")
            continue
        nine, fourteen = cli.run_tokens
        text = (f"estimate: with {cli.label} a run sends its model at least {nine:,} input tokens when it passes in "
                f"round 1 (9 turns), {fourteen:,} in round 2 (14 turns)"
                + (" had every role run it" if len(providers) > 1 else ""))
        if price and len(providers) == 1:
            text += (f"; at MODEL_PRICES for {next(iter(models))}: at least {nine * price['input'] / 1e6:.2f} and "
                     f"{fourteen * price['input'] / 1e6:.2f} before cache discounts, output on top")
        lines.append(text + " (measured with a scripted model, two requests a turn; a real model's turns take more)")
    return lines


def check_run_state() -> list[CheckLine]:
    """What the command would do with the state file: a new run, or the saved one resumed."""
    try:
        plan = choose_start()
    except ConfigError as exc:
        return [CheckLine(False, exc.message)]
    if holder := RunLock.holder():
        return [CheckLine(False, f"the run in {STATE_FILE} is driven by {holder}: a second copy would exit "
                                 f"{EXIT_LOCKED}")]
    return [CheckLine(True, f"resumes the run in {STATE_FILE}" if plan.resume else
                      f"starts a new run (state in {STATE_FILE})")]


def check_own_server() -> list[CheckLine]:
    """The run's own server: what it needs here (tmux, cao-server, a free port), and the agents' side as the
    shells it starts will see it (their PATH and environment are the loop's, so no probe is needed)."""
    if missing := own_server_missing():
        return [CheckLine(False, missing)]
    try:
        own = OwnServer(free_port(), "", "")
    except ConfigError as exc:
        return [CheckLine(False, exc.message)]
    server = loop_program("cao-server")
    words = cao_version_words(installed_cao_version(server))
    lines = [CheckLine(True, f"CAO server: the run's own, started for it on a free port of {OWN_SERVER_HOST} (e.g. "
                             f"{own.port}) and ended with it: {server}" + (f", {words}" if words else ""))]
    side = probe_here(own.env(), sorted({cli_program(provider, None) for provider in providers_in_use()}))
    unbundled = [profile_for(role) for role in ROLES if bundled_profile(profile_for(role)) is None]
    profiles = CheckLine(None, f"profiles {', '.join(unbundled)}: not the loop's; the run looks them up in CAO's "
                               "store") if unbundled else CheckLine(True, "agent profiles: the loop's, installed in "
                                                                         "CAO's store where it lacks them")
    overrides = [CheckLine(None, f"the run's own server: {own_server_overrides()}; set them so in this environment "
                                  "too (any other cao-server started from it would pass the wrong ones on)")
                 ] if own_server_overrides() else []
    return lines + [profiles] + check_clis(side, None) + check_traps(side) + overrides + check_sign_ins(side)


def preflight_lines() -> list[CheckLine]:
    """Every check after the settings, in the order a run meets what they look at."""
    lines = check_run_state() + check_working_directory()
    with suppress(ConfigError, StateFileError):
        choice = server_choice(choose_start())
        lines.append(CheckLine(True, choice.line))
        if choice.own:
            return lines + check_own_server() + check_token_budget() + check_ntfy()
    lines += check_server()
    if lines[-1].ok is False:
        return lines
    return lines + server_checks(api.provider_report()) + check_token_budget() + check_ntfy()


def refuse_what_check_refuses(own: bool) -> None:
    """A new run stops before a terminal is made where --check marks its server ✗ (ConfigError, exit 2): the same
    checks, asked once (server_checks); on its own server, the CLIs it reports. A warning is said."""
    if not own:
        api.check_health()               # a server that is not there stops the run at its first request
    report = api.provider_report()
    lines = check_reported_clis(report) if own else server_checks(report, run=True)
    for line in lines:
        if line.ok is None:
            log(line.text)
    if refused := [line for line in lines if line.ok is False]:
        raise ConfigError(f"{refused[0].text} (the CAO server at {API}, as --check says; nothing was started)")


def check_mark(ok: bool | None) -> str:
    """✓, ✗ or ! where the output can show them, else ok, FAIL or !."""
    try:
        "✓✗".encode(sys.stdout.encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        return {True: "ok", False: "FAIL", None: "!"}[ok]
    return {True: "✓", False: "✗", None: "!"}[ok]


def checked_lines(args: list[str]) -> tuple[int, list[CheckLine]]:
    """The settings, then every check after them: the exit code the settings leave (2 when they are wrong, 70
    for a fault of this script), and the lines."""
    lines: list[CheckLine] = []
    try:
        configure(args)
        read_task_prompt()
        connect_api()
        task = f"task from {'PROMPT_FILE=' + PROMPT_FILE if PROMPT_FILE else 'PROMPT'}" if PROMPT_FILE or PROMPT \
            else "no task set (PROMPT_FILE or PROMPT): only a saved run can be resumed"
        lines.append(CheckLine(True, f"settings{' from ' + args[0] if args else ''} and the environment; {task}"))
        lines += preflight_lines()
    except ConfigError as exc:
        return EXIT_USAGE, lines + [CheckLine(False, exc.message)]
    except (OSError, ApiError) as exc:            # the machine, or a server that broke off
        return EXIT_PASS, lines + [CheckLine(False, f"unexpected {exc.__class__.__name__} while checking: {exc}")]
    except Exception as exc:                      # a fault of this script: its traceback on stderr
        emit("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip("\n"), sys.stderr)
        return EXIT_BUG, lines + [CheckLine(False, f"a fault of --check itself ({exc.__class__.__name__}: {exc}); "
                                                   "its traceback is above: report it")]
    return EXIT_PASS, lines


def check_command(args: list[str]) -> int:
    """--check [config.json]: a line for each thing a run needs; 0 when a run can start (! lines warn of what may fail
    later), 1 when a line is marked ✗, 2 for a bad setting."""
    previous = set_stop_handlers(dict.fromkeys(STOP_SIGNALS, on_stop_signal))   # a stop unwinds: the probe's
    try:                                                                          # window is removed first
        code, lines = checked_lines(args)
    except (KeyboardInterrupt, Terminated) as exc:
        code, said = STOP_SIGNALS[getattr(exc, "signum", signal.SIGINT)]
        say_error(f"{said}: --check started nothing and changed nothing")
        return code
    finally:
        set_stop_handlers(previous)
        StopSignals.stopping = False
    for line in lines:
        emit(f"{check_mark(line.ok)} {line.text}")
    if code == EXIT_PASS and any(line.ok is False for line in lines):
        code = EXIT_FAIL
    for line in cost_estimate() if code == EXIT_FAIL or code == EXIT_PASS else []:
        emit(line)
    emit("a run can start" if code == EXIT_PASS else "fix what is marked, then run --check again")
    return code


# ==========================================================================
# 17. Entry point
# ==========================================================================

# The settings most runs set; the short --help lists them, --help-settings all of them.
COMMON_SETTINGS = ("API", "OWN_SERVER", "PROVIDER", "MODEL", "WD", "PROMPT_FILE", "PROJECT_TEST_CMD", "RESUME", "MAX_ROUNDS",
                   "RESPONSE_TIMEOUT", "REPLACE_LOST_AGENTS", "CLEANUP_ON_EXIT")


class CommandLine(argparse.ArgumentParser):
    """argparse, with its errors as the loop's one line (exit 2) and the loop's own --help."""

    def error(self, message: str) -> None:
        message = {"argument --note: expected 2 arguments": '--note takes a role and the text, e.g. --note '
                                                            'programmer "keep the public API"',
                   "argument --reject: expected one argument": '--reject takes the reason, which the agent is told, '
                                                               'e.g. --reject "keep the old flags working"'
                   }.get(message, message)
        if unknown := re.match(r"unrecognized arguments: (.*)", message):
            words = unknown.group(1).split()
            options = [word for word in words if word.startswith("-")]
            message = (f"unknown option {options[0]}" if options else
                       f"one config file at most, got also {' '.join(words)}")
        raise ConfigError(f"{message} (see {command_name()} --help)")


def command_line() -> CommandLine:
    parser = CommandLine(prog=command_name(), add_help=False, allow_abbrev=False)
    parser.add_argument("config", nargs="?")
    parser.add_argument("--demo", nargs="?", const="", default=None, metavar="DIR")
    for flags in (["--check"], ["--status"], ["--json"], ["--follow"], ["--help-settings"], ["--readme"],
                  ["--approve"], ["-h", "--help"], ["-V", "--version"]):
        parser.add_argument(*flags, action="store_true")
    parser.add_argument("--reject", metavar="WHY")
    parser.add_argument("--note", nargs=2, metavar=("ROLE", "TEXT"))
    return parser


def _shown_default(setting: Setting) -> str:
    """A setting's default as a user would type it."""
    special = {"WD": "current directory", "STATE_FILE": f"$WD/.tmp/{STATE_FILE_NAME}",
               "RESUME": "unset (automatic)"}
    if setting.env in special:
        return special[setting.env]
    if setting.kind == "role_provider" and not setting.env.endswith("FALLBACK_PROVIDER"):
        return "PROVIDER"
    if isinstance(setting.default, bool):
        return "1" if setting.default else "0"
    if setting.kind in ("seconds", "seconds0"):
        return f"{setting.default:g} s"
    if setting.kind == "amount0":
        return f"{setting.default:g}"
    return str(setting.default) if setting.default not in ("", {}) else "-"


def agents_left_note(saved: SavedState | SimpleNamespace | None = None) -> str:
    """Where a run's agents are, as the server tells it (how to watch and stop those it still has)."""
    run = saved or SimpleNamespace(session_name=session_name, terminal_ids=terminal_ids)
    session = run.session_name
    try:
        listed = api.session_terminals(session) if session else None
    except ApiError as exc:
        return f"the agents of CAO session {session or '?'}: the server cannot say whether they still run ({exc})"
    if listed is None:
        return f"the agents of CAO session {session or '?'} are gone (the server no longer has their session)"
    running = [i for i in run.terminal_ids.values() if i and i in listed]
    if not running:
        return f"the agents of CAO session {session} are gone (the server no longer has their terminals)"
    count = "the five agents" if len(running) == len(ROLES) else f"{len(running)} of the five agents"
    return (f"{count} of CAO session {session} are still running (watch: `{tmux_hint('attach -t ' + session)}`; stop: "
            f"`{cao_hint('shutdown --session ' + session)}`, or set CLEANUP_ON_EXIT=1)")


def working_now(saved: SavedState) -> str:
    """'programmer (terminal 1a2b3c4d), prompt sent 2026-11-24 15:00:00 UTC, 2m 5s ago': the turn under way."""
    turn = saved.in_flight
    if turn is None:
        return "no agent (between turns)"
    if turn.reply_file:
        return f"no agent: the {turn.role}'s reply is in ({turn.reply_file}); a rerun goes on from it"
    sent = turn.first_sent_at or turn.sent_at
    when = "" if sent is None else (f", prompt sent {utc_iso(sent).replace('T', ' ').replace('Z', ' UTC')}, "
                                    f"{duration_text(time.time() - sent)} ago")
    if turn.limit_line:
        until = (f"continues at {clock_text(turn.limit_until)} (in {duration_text(turn.limit_until - time.time())})"
                 if turn.limit_until is not None else "its CLI named no reset time")
        when += f"; stopped at its usage limit ({turn.limit_line[:120]}), {until}"
    return f"{turn.role} (terminal {saved.terminal_ids.get(turn.role) or '?'}){when}"


def next_step(saved: SavedState) -> str:
    """'the peer analyst's review, cycle 2 of 3 of round 1's analyst phase': the turn a run under way takes next."""
    gate = pending_gate(saved.gates) if saved.phase_step == "approval" else None
    if gate is not None:
        decided = read_decision(saved.run_dir, gate.id) if saved.run_dir else None
        return (f"the {gate.gate} gate, {VERDICTS[decided['verdict']]} by {decided['by']}: the run takes the decision "
                "when it goes on (the same command)" if decided else
                f"waiting for your approval of {GATE_WHAT[gate.gate]} since {since_text(gate.since)}; decide with "
                f"{gate_commands()}")
    if saved.current_phase == PHASE_TESTER:
        step = "the check of the tester's PASS (PROJECT_TEST_CMD)" if saved.phase_step == "verify" else "the test"
        return f"{step}, round {saved.current_round}"
    author, reviewer = PHASE_ROLES[saved.current_phase]
    who = f"the {reviewer.replace('_', ' ')}'s review" if saved.phase_step == "review" else f"the {author}'s turn"
    return (f"{who}, cycle {saved.phase_cycle} of {MAX_REVIEW_CYCLES} of round {saved.current_round}'s "
            f"{saved.current_phase} phase")


@dataclass
class Stage:
    """The stage as --status, --status --json and the report see it, computed once: the run's lock, the notes
    beside the state file, /proc. Every view reads its facts and `own_server`, never derives its own."""

    holder: str                          # 'pid N since ...' of the invocation that drives the run ('': none)
    killed: str                          # the same of an invocation killed holding the lock ('': none)
    own: OwnServer | None                # the run's own server, as noted beside the state file (or its marks)
    alive: StageAlive | None             # what of it still runs (None: nothing)
    starting: dict | None                # the start-up note of the invocation that holds the lock: it starts
    start_left: dict | None              # the start-up note of an invocation killed while it started
    on_own: bool = False                 # the run is on a CAO server of its own: noted, or its state says so

    @classmethod
    def now(cls, saved: SavedState | None = None) -> Stage:
        """The stage as it is now: who holds the lock, what the notes name and whether it still runs."""
        holder = RunLock.holder()
        own, alive = own_stage.seen()
        note = start_up.read()
        driven = lock_text_facts(holder)
        live = note is not None and driven is not None and note["pid"] == driven["pid"]
        return cls(holder, RunLock.killed(), own, alive, note if live else None,
                   note if note is not None and not holder else None,
                   own is not None or bool(saved is not None and saved.on_own_server))

    @property
    def own_server(self) -> str:
        """The run's own server in a word: '' (the run is not on one), 'running' (with the process that drives
        the run), 'starting' (driven, its start-up under way), 'down' (driven, its cao-server not running), 'left'
        (no process drives the run, some of it still runs) or 'ended'."""
        if not self.on_own:
            return ""
        if self.holder:
            return "running" if self.alive and self.alive.cao_server else "starting" if self.starting else "down"
        return "left" if self.alive else "ended"

    def server_lines(self) -> list[str]:
        """The CAO server as the stage shows it: the run's own (with the run, left running, or ended), else API's."""
        state, own, alive = self.own_server, self.own, self.alive
        url = own.url if own is not None else API
        if state in ("running", "starting", "down") and own is not None:
            now = alive.text() if alive else "starting" if state == "starting" else "not running"
            return [f"CAO server: the run's own, {url} ({now}); it ends with the run"]
        if state == "left":
            return [f"CAO server: the run's own ({url}), still running: {alive.text()} -- the same command ends "
                    f"them, or `{alive.end_command()}`"]
        if self.starting:
            return []                    # chosen as the run starts: its step says where
        if state == "ended":
            return [f"CAO server: the run's own, ended (it was at {url}); a rerun starts another"]
        return [f"CAO server: {API}"]

    def last_code(self, saved: SavedState) -> int | None:
        """The exit code the run's last invocation ended with (its summary.json); None while one drives the run,
        after a kill (that invocation kept none: the one there is an earlier one's), or where none is kept."""
        if self.holder or self.killed or not saved.run_dir:
            return None
        code = _json_file(Path(saved.run_dir) / "summary.json").get("exit_code")
        return code if isinstance(code, int) else None

    def facts(self) -> dict:
        """--status --json's fields of the stage: a run starting, an invocation killed, the run's own server's
        processes still running."""
        alive = self.alive
        return {
            "starting": self.starting, "killed": lock_text_facts(self.killed), "killed_start_up": self.start_left,
            "own_server_running": None if alive is None or self.own is None else {
                "url": self.own.url, "cao_server_pid": alive.cao_server, "tmux_pid": alive.tmux,
                "agents": alive.agents, "pids": alive.processes, "driven": bool(self.holder),
                "end_command": alive.end_command()},
        }


def since_text(iso: str) -> str:
    """'2026-11-24 15:00:00 UTC, 2m 5s ago': a time the state or a note wrote, and how long ago it was."""
    moment = parse_utc_iso(iso)
    shown = iso.replace("T", " ").replace("Z", " UTC")
    return shown if moment is None else f"{shown}, {duration_text(time.time() - moment.timestamp())} ago"


def _status_progress(saved: SavedState, stage: Stage) -> list[str]:
    """The server, and for a run under way where it stands: what a person looks at first."""
    server = stage.server_lines()
    if saved.finished:
        return [*server, f"turns: {len(saved.turn_records)} answered"]
    working = working_now(saved)
    if stage.own_server in ("left", "ended") and saved.in_flight and not saved.in_flight.reply_file:
        working = (f"no agent: they ended with the run's own CAO server; {saved.in_flight.role}'s turn goes on with "
                   "a new agent at the rerun" if stage.own_server == "ended" else
                   f"{working}; no process drives it: the rerun ends its agent, and takes its reply if complete, "
                   "else sends the turn to a new agent")
    return [*server, f"next: {next_step(saved)}", f"working now: {working}",
            f"turns: {len(saved.turn_records)} answered, at most {turns_left_at_most(saved)} left "
            f"(MAX_ROUNDS={MAX_ROUNDS}, MAX_REVIEW_CYCLES={MAX_REVIEW_CYCLES}"
            + (", story attempts not counted)" if STORY_MODE else ")")]


def start_up_agents_text(note: dict) -> str:
    """'analyst up (terminal 1a2b3c4d), peer_analyst starting, tester failed: <why>': each agent's start."""
    parts = []
    for role in ROLES:
        agent = note["agents"].get(role)
        if not isinstance(agent, dict):
            continue
        state = agent.get("state")
        parts.append(f"{role} up" + (f" (terminal {agent['terminal']})" if agent.get("terminal") else "")
                     if state == "up" else f"{role} failed: {agent.get('reason') or 'no reason given'}"
                     if state == "failed" else f"{role} starting")
    return ", ".join(parts) or "none asked for yet"


def _status_starting(saved: SavedState | None, stage: Stage) -> list[str]:
    """--status while a new run starts: that run (since when, how far, its agents), not the one before it."""
    note = stage.starting
    lines = [f"state file: {STATE_FILE}", f"run: a new run is starting, since {since_text(str(note.get('since')))}: "
             f"{note.get('step')}", *stage.server_lines(), f"agents: {start_up_agents_text(note)}",
             f"driven by: {stage.holder}"]
    if saved is not None:
        lines.append(f"before it: {describe_state(saved)}; that state file is kept as a backup once the new run's "
                     "agents are up")
    return lines


def _status_start_left(stage: Stage) -> list[str]:
    """An invocation killed while it started its run: how far it got."""
    note = stage.start_left
    if note is None:
        return []
    what = "resuming the run" if note.get("resuming") else "starting a new run"
    return [f"last start-up: pid {note['pid']}, {what} since {note.get('since')}, was killed at "
            f"\"{note.get('step')}\" (agents: {start_up_agents_text(note)})"]


def _status_unsaved(stage: Stage, why: str) -> str:
    """--status's first line where no run is saved: what it found -- a start-up killed, since when, what of it still
    runs -- else why there is no run."""
    note, alive = stage.start_left, stage.alive
    if note is None and alive is None:
        return why
    killed = f" (pid {note['pid']}, since {since_text(str(note.get('since')))})" if note else ""
    return (f"a start-up was killed here{killed} before it saved a run in {STATE_FILE}; "
            + (f"still running: {alive.text()}" if alive else "nothing of it still runs"))


def _status_tokens(saved: SavedState) -> list[str]:
    """What the run's agents used so far, as their CLIs recorded it (read at each reply and send)."""
    if not saved.turn_records:
        return []
    total, unknown = turns_tokens(saved.turn_records)
    if not total and (not_counted := tokenless_note(providers_in_use())):
        return [f"tokens used: not counted ({not_counted})"]
    budgets = [f"{name}={value:g}" for name, value in (("MAX_RUN_TOKENS", MAX_RUN_TOKENS),
                                                        ("MAX_RUN_COST", MAX_RUN_COST)) if value]
    return [f"tokens used: {tokens_text(total)}" + (f" ({counted(unknown, 'turn')} unknown)" if unknown and total
                                                     else "")
            + (f"; budget {', '.join(budgets)}" if budgets else "")]


def agents_line(saved: SavedState, stage: Stage) -> str:
    """Where the run's agents are: exited, ended or still running with the run's own server, or as the server
    at API tells it."""
    alive, own = stage.alive, stage.own_server if saved.on_own_server else ""
    if saved.terminals_exited:
        return "agents: exited (CLEANUP_ON_EXIT=1)"
    if own == "ended":
        return "agents: ended with the run's own CAO server"
    if own and stage.starting:
        return f"agents: five new ones on the run's own CAO server: {start_up_agents_text(stage.starting)}"
    if own == "left":
        return (f"agents: still running on the run's own CAO server ({counted(alive.agents, 'agent terminal')}"
                f"{'' if alive.tmux else ': its tmux server is gone, what it started is not'}), driven by no process "
                "(the same command ends them)")
    if own in ("starting", "down"):
        return ("agents: the run's own cao-server is not running, so none can be asked; the process that drives the "
                "run ends what is left of it when it stops")
    return f"agents: {agents_left_note(saved)}"


def _status_agents(saved: SavedState, stage: Stage) -> list[str]:
    """The run's agents and where their replies are kept: only what the run has to show."""
    lines = [agents_line(saved, stage)]
    if any(saved.agent_models.values()):
        lines.append("models asked for: " + ", ".join(f"{role} {saved.agent_models.get(role) or 'its CLI default'}"
                                                      for role in ROLES))
    if saved.replacements:
        lines.append(f"replaced agents: {replacement_summary(saved.replacements)}")
    if saved.cli_switches:
        lines.append("on a fallback CLI for the rest of the run: " + "; ".join(w.text() for w in saved.cli_switches))
    if saved.agent_events:
        lines.append(f"agents' conversations and limits: {agent_events_summary(saved.agent_events)}")
    if saved.run_dir:
        lines.append(f"replies: {saved.run_dir}")
    return lines


def _status_after_run(saved: SavedState) -> list[str]:
    """What the after-run steps did, and what a finished run still has to do: the next invocation does it."""
    done = saved.after_run
    steps = [f"{step} {outcome.get('result')}" + (f" {outcome['commit']}" if outcome.get("commit") else "")
             for step, outcome in (("archive", done.archive), ("commit", done.commit)) if outcome is not None]
    if done.notified is not None:
        steps.append(f"notified {done.notified}")
    lines = ["after the run: " + ", ".join(steps)] if steps else []
    if saved.finished and (pending := after_run_pending(saved.final_status, done)):
        lines.append(f"still to do after the run: {', '.join(pending)} (the next invocation does it)")
    return lines


def _status_last_stop(facts: dict, stage: Stage) -> list[str]:
    """--status: how the last invocation ended and what a scheduler should do next (exit codes, section 1), as
    --status --json's facts say it; one killed holding the lock kept no exit code (the one summary.json holds is an
    earlier invocation's)."""
    if stage.killed:
        return [f"last stop: killed, no exit code ({stage.killed}; SIGKILL, or the machine stopped); a scheduler: "
                "retry: the same command first ends what it left running"]
    if facts["last_exit_code"] is None:
        return []
    return [f"last stop: exit {facts['last_exit_code']} ({facts['last_exit'] or 'not a code of this program'}); "
            f"a scheduler: {facts['scheduler_action'] or 'alert'}"] + \
        ([f"traceback: {facts['traceback']}"] if facts["traceback"] else [])


def status_next(saved: SavedState) -> str | None:
    """What comes next: the turn a run under way takes, the command that takes a FAIL on (None: nothing)."""
    if not saved.finished:
        return next_step(saved)
    if saved.final_status == "FAIL" and not saved.terminals_exited:
        return (f"to go on, {go_on_command(saved.current_round, True)}" if saved.no_progress_stop else
                f"to go on with more rounds, {continue_command(saved.current_round + 1)}")
    return None


def working_facts(saved: SavedState) -> dict | None:
    """--status --json's "working_now": who works on the turn in flight since when (None: between turns)."""
    turn = saved.in_flight
    if saved.finished or turn is None:
        return None
    sent = turn.first_sent_at or turn.sent_at
    return {"role": turn.role, "terminal": saved.terminal_ids.get(turn.role) or None,
            "since": utc_iso(sent) if sent is not None else None, "reply_taken": bool(turn.reply_file),
            "usage_limit_until": utc_iso(turn.limit_until) if turn.limit_until is not None else None,
            "text": working_now(saved)}


def status_facts(saved: SavedState, stage: Stage) -> dict:
    """--status --json: where the run stands, for a program (a scheduler, a dashboard) -- read from the state
    file, its lock, the notes beside it and its record only, without asking the server."""
    code = stage.last_code(saved)
    total, unknown = turns_tokens(saved.turn_records)
    return {
        "state_file": STATE_FILE, "result": saved.final_status, "round": saved.current_round,
        "max_rounds": MAX_ROUNDS, "phase": saved.current_phase, "next": status_next(saved),
        "working_now": working_facts(saved), "turns": len(saved.turn_records),
        "turns_left_at_most": turns_left_at_most(saved),
        "after_run_pending": after_run_pending(saved.final_status, saved.after_run) if saved.finished else [],
        "driven_by": lock_text_facts(stage.holder),
        "last_exit_code": code, "last_exit": EXIT_MEANINGS.get(code), "scheduler_action": SCHEDULER_ACTIONS.get(code),
        "traceback": str(Path(saved.run_dir) / TRACEBACK_FILE) if code == EXIT_BUG else None,
        "cao_server": API, "own_server": saved.on_own_server, "session": saved.session_name or None,
        "terminals": dict(saved.terminal_ids),
        "replacements": len({r.event for r in saved.replacements}), "run_dir": saved.run_dir or None,
        "cli_switches": STATE_FIELDS_BY_NAME["cli_switches"].dump(saved.cli_switches),
        "tokens": tokens_json(total), "tokens_unknown_turns": unknown,
        "rounds_without_progress": saved.rounds_without_progress, "no_progress_stop": saved.no_progress_stop,
        "waiting_for_approval": pending_gate(saved.gates).to_json()
        if saved.phase_step == "approval" and pending_gate(saved.gates) else None,
        "go_on": go_on_command(saved.current_round, bool(saved.no_progress_stop))
        if saved.final_status == "FAIL" and not saved.terminals_exited else None,
        **stage.facts(),
    }


def saved_run_or_why() -> tuple[SavedState | None, str]:
    """The run in STATE_FILE for --status, or why there is none to tell of (a broken file, no file)."""
    try:
        saved = read_state_file()
    except StateFileError as exc:
        return None, f"{exc}"
    if saved is None:
        return None, f"no state file at {STATE_FILE}: no run has started here (set WD or STATE_FILE to look elsewhere)"
    return saved, ""


def status_report() -> tuple[int, str]:
    """--status: where the run in STATE_FILE stands and who drives it, read without touching anything."""
    saved, why = saved_run_or_why()
    stage = Stage.now(saved)
    if stage.starting and (saved is None or not stage.starting.get("resuming")):
        return EXIT_PASS, "\n".join(_status_starting(saved, stage))
    if saved is None:
        return EXIT_FAIL, "\n".join([_status_unsaved(stage, why), *_status_start_left(stage),
                                     *(stage.server_lines() if stage.alive else [])])
    restore_saved_settings(saved)
    connect_api()
    lines = [f"state file: {STATE_FILE}", f"run: {describe_state(saved)}", *_status_progress(saved, stage),
             *_status_tokens(saved)]
    if stage.starting:
        lines.append(f"starting: the run is being resumed, since {since_text(str(stage.starting.get('since')))}: "
                     f"{stage.starting.get('step')}")
    lines.append(f"driven by: {stage.holder}" if stage.holder else
                 "driven by: no process" + ("" if saved.finished else " -- rerun the command to resume it"))
    if not stage.holder:
        lines += _status_last_stop(status_facts(saved, stage), stage) + _status_start_left(stage)
    if saved.no_progress_stop:
        lines.append(no_progress_line(saved.no_progress_stop, saved.terminals_exited))
    if saved.finished and status_next(saved):
        lines.append(f"next: {status_next(saved)}")
    lines += _status_agents(saved, stage) + _status_after_run(saved)
    return EXIT_PASS, "\n".join(lines)


def readme_text() -> str:
    """The README: beside the script in a checkout, else from the installed package's metadata."""
    with suppress(metadata.PackageNotFoundError):
        return (_read_text(Path(__file__).resolve().with_name("README.md"))
                or metadata.metadata(PACKAGE_NAME).get_payload() or "")
    return ""


# Each exit code in a word or two, for --help (the full meanings: EXIT_CODES, --help-settings, the README).
EXIT_SHORT = {EXIT_PASS: "PASS", EXIT_FAIL: "FAIL", EXIT_USAGE: "bad settings", EXIT_ERROR: "error (rerun)",
              EXIT_BUDGET: "budget used", EXIT_NO_PROGRESS: "no progress", EXIT_APPROVAL: "a person decides",
              EXIT_BUG: "a bug",
              EXIT_LOCKED: "run locked"}      # the stop signals' codes: one entry, "129/130/131/143 a signal"


def help_text() -> str:
    """--help: what the command does, how to run it, the settings most runs set, where the rest is."""
    name = command_name()
    lines = [
        f"usage: {name} [config.json]", f"       {name} --demo [DIR]", f"       {name} --check [config.json]",
        f"       {name} --status [--json] [--follow] [config.json]",
        f"       {name} --help | --help-settings | --readme | --version", "",
        "Runs five AI coding agents (analyst, peer analyst, programmer, peer programmer,",
        "tester) on a CAO server until the tester reports PASS. Settings come from",
        "environment variables and/or a JSON config file; the environment wins.", "",
        "  config.json      settings as JSON (see config-fresh.json in the documentation)",
        "  --demo [DIR]     a first PASS, scripted agents in DIR (~/cao-loop-demo)",
        "  --check          all a run needs; exits 0 a run can start, 1 ✗, 2 bad setting",
        "  --status         where the run in STATE_FILE stands (--follow: its events)",
        "  --approve | --reject WHY | --note ROLE TEXT [config.json]: a person's word",
        "  --help-settings  every setting: variable, JSON key, default, meaning", "",
        "Settings most runs set (environment variable, default):"]
    lines += [f"  {env:20} {_shown_default(SETTINGS_BY_ENV[env])}" for env in COMMON_SETTINGS]
    providers = ", ".join(AGENT_CLIS).replace(SCRIPTED_PROVIDER, f"{SCRIPTED_PROVIDER} (--demo's scripted agent: no AI)")
    lines += [""] + textwrap.wrap("Providers (PROVIDER): " + providers, 78, subsequent_indent="  ")
    lines += [f"Example: PROVIDER=claude_code PROMPT_FILE=task.md {name}", ""]
    signal_codes = "/".join(str(code) for code, _ in sorted(STOP_SIGNALS.values()))
    codes = ", ".join([f"{code} {EXIT_SHORT[code]}".replace(" ", "\xa0") for code, _, _ in EXIT_CODES
                       if code in EXIT_SHORT] + [f"{signal_codes}\xa0a\xa0stop\xa0signal"])
    lines += [line.replace("\xa0", " ") for line in textwrap.wrap(f"Exit codes: {codes}", 78, subsequent_indent="  ")]
    lines.append(f"Documentation: {name} --readme (README.md; the rest in docs/)")
    return "\n".join(lines)


def settings_help_text() -> str:
    """--help-settings: every setting (from SETTINGS, so it cannot drift), and the exit codes."""
    lines = ["Settings: environment variable (JSON key in the config file; default)", ""]
    for head, meaning in [(f"{setting.env}  ({setting.key}; default {_shown_default(setting)})", setting.help)
                          for setting in SETTINGS] + [(f"{env}  (environment only; default -)", meaning)
                                                      for env, meaning in SECRET_HELP]:
        lines += textwrap.wrap(head, 78, subsequent_indent="    ")
        lines += textwrap.wrap(meaning, 78, initial_indent="    ", subsequent_indent="    ")
    lines += ["", "Exit codes:"]
    for code, meaning, action in EXIT_CODES:
        lines += textwrap.wrap(f"  {code:3}  {meaning}; a scheduler: {action}", 78, subsequent_indent=" " * 7)
    return "\n".join(lines)


def refuse_bad_start(task: str) -> StartPlan:
    """A new run needs a task; RESUME=1 needs a resumable state (choose_start raises). Returns the plan."""
    plan = choose_start()
    if not plan.resume and not task:
        raise ConfigError("no task given: set PROMPT_FILE to a prompt file (see prompt_template.md) "
                          "or PROMPT to its text")
    return plan


def continue_failed_run() -> None:
    """RESUME=1 with rounds left after a FAIL: the same run goes on at its next round, all it has kept; its
    after-run steps are due again at its new end."""
    played, why = current_round, "without progress" if no_progress_stop else "in FAIL"
    update_run(final_status="RUNNING", current_round=played + 1, after_run=_new_value("after_run"),
               rounds_without_progress=0, no_progress_stop=None)
    set_position(PHASE_PROGRAMMER)
    log(f"the run ended {why} after round {played}; going on with round {played + 1} of MAX_ROUNDS={MAX_ROUNDS}: "
        "the programmer gets the last test evidence" + (" (the rounds without progress are counted anew)"
                                                         if why != "in FAIL" else ""))


def start_run(task: str) -> StartPlan:
    """Resume the saved run or create a new one for `task`, decided again under the run's lock (another process
    may have moved the state on); the plan's replaced run still has its agents (end_old_run())."""
    finish_stopped_run()
    plan = refuse_bad_start(task)
    if plan.resume:
        load_state()
        connect_api()
        start_up.step(f"resuming the run: its agents on {API}")
        if not PROMPT and task:
            set_task(task)
        elif task and task != PROMPT:
            log("note: resuming with the task saved in the state file; PROMPT/PROMPT_FILE is ignored")
        if own_stage.server is not None:
            new_agents_on_own_server()
        else:
            verify_resume_terminals()
        if not run_dir:                     # a state file written by the shell script
            update_run(run_dir=new_run_dir())
        prepare_run_folder()
        if plan.continue_failed:
            continue_failed_run()
        log(f"resuming run from {STATE_FILE}: round {current_round}, {current_phase} phase, "
            f"session {session_name}")
        record_event("run_resumed", round=current_round, phase=current_phase, cycle=phase_cycle,
                     session=session_name, continued_after_fail=plan.continue_failed)
        return plan
    if plan.note and not plan.unreadable:
        log(plan.note)
    set_task(task)
    init_new_run(plan)
    prepare_run_folder()
    record_event("run_started", session=session_name, terminals=dict(terminal_ids),
                 provider={role: provider_for(role) for role in ROLES}, max_rounds=MAX_ROUNDS)
    return plan


def status_command(args: list[str], as_json: bool = False, follow: bool = False) -> int:
    """--status [--json] [--follow] [config.json]: where the run stands, or its events followed; its exit code."""
    try:
        configure(args)
        connect_api()
    except OrchestratorExit as exc:
        emit(f"error: {exc.message}", sys.stderr)
        return exc.code
    if follow:
        return follow_events(as_json)
    code, report = status_json_report() if as_json else status_report()
    emit(report, sys.stdout if code == EXIT_PASS else sys.stderr)    # a reader gone (`| head`) ends it quietly
    return code


def status_json_report() -> tuple[int, str]:
    """--status --json: status_facts() as one line of JSON; a missing or broken state file as for --status,
    unless a run is starting or a killed one's start-up left something: then what the stage shows."""
    saved, why = saved_run_or_why()
    stage = Stage.now(saved)
    if saved is None:
        if not (stage.starting or stage.start_left or stage.alive):
            return EXIT_FAIL, why
        return EXIT_PASS, json.dumps({"state_file": STATE_FILE, "result": None, "driven_by": lock_text_facts(
            stage.holder), "cao_server": None, "own_server": stage.own is not None, **stage.facts()})
    restore_saved_settings(saved)
    return EXIT_PASS, json.dumps(status_facts(saved, stage))


FOLLOW_POLL_SECONDS = 0.5           # --status --follow: how often the events file is looked at


def event_line(event: dict) -> str:
    """One event for people: '#12 2026-11-27T10:00:00.123Z reply_taken role=tester round=2 ...'."""
    fields = " ".join(f"{key}={json.dumps(value) if isinstance(value, (dict, list)) else value}"
                      for key, value in event.items() if key not in ("seq", "at", "event"))
    return f"#{event.get('seq')} {event.get('at')} {event.get('event')} {fields}".rstrip()


def follow_events(as_json: bool) -> int:
    """--status --follow: print the run's events as they are appended, until its run_stopped (at once when no
    invocation drives it); read only."""
    printed, last_kind, folder = 0, "", ""
    try:
        while True:
            saved, why = saved_run_or_why()
            if saved is None or not saved.run_dir:
                say_error(why or f"the run in {STATE_FILE} keeps no events (a state file of the shell script): "
                                 "rerun it once")
                return EXIT_FAIL
            if saved.run_dir != folder:          # a new run in this state file: its events are numbered anew
                printed, last_kind, folder = 0, "", saved.run_dir
            driven = bool(RunLock.holder())
            for event in read_events(Path(saved.run_dir) / EVENTS_FILE, printed):
                emit(json.dumps(event) if as_json else event_line(event))
                printed, last_kind = event["seq"], event.get("event", "")
            if not driven or (last_kind == "run_stopped" and not RunLock.holder()):
                return EXIT_PASS
            time.sleep(FOLLOW_POLL_SECONDS)
    except KeyboardInterrupt:
        return EXIT_SIGINT


def stop_line(exc: BaseException, started: bool) -> tuple[int, str]:
    """The exit code and the one line for the user of a run that stopped on `exc` (with CLEANUP_ON_EXIT=1 a
    rerun starts a new run, and the line says so)."""
    ended = started and CLEANUP_ON_EXIT
    saved = "" if not started else "; CLEANUP_ON_EXIT=1 ends the agents, so a rerun starts a new run" if ended \
        else "; state saved, rerun to resume"
    if isinstance(exc, ApprovalPending):
        return exc.code, exc.message
    if isinstance(exc, OrchestratorExit):
        message = exc.message
        if ended and isinstance(exc, RunError):
            message = message.replace("then rerun to resume", "then rerun to start a new run (CLEANUP_ON_EXIT=1 "
                                      "ends the agents)")
        return exc.code, f"error: {message}"
    if isinstance(exc, ApiError):          # a server that refuses our token is fixed in the settings, not by a retry
        return (EXIT_USAGE if exc.status_code == 401 else EXIT_ERROR), f"error: {exc}{saved}"
    if isinstance(exc, (KeyboardInterrupt, Terminated)):
        code, said = STOP_SIGNALS[getattr(exc, "signum", signal.SIGINT)]
        return code, f"{said}{saved}"
    if isinstance(exc, OSError):           # the machine (a full disk, a folder gone): the same command may get past it
        return EXIT_ERROR, f"error: unexpected {exc.__class__.__name__}: {exc}{saved}"
    kept = keep_traceback(exc)
    where = f"its traceback is in {kept}" if kept else "its traceback is above"
    saved = "" if not started else "; state saved: once the fault is fixed, the same command goes on"
    return EXIT_BUG, (f"error: a fault of the loop itself ({exc.__class__.__name__}: {exc}); {where}{saved}; "
                      "report it with the traceback")


def keep_traceback(exc: BaseException) -> str:
    """A fault's whole traceback, written to the run folder (else beside the state file); its path. Where no
    file can be written it goes to stderr, and '' is returned."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    for folder in filter(None, (run_dir, os.path.dirname(STATE_FILE))):
        path = Path(folder) / TRACEBACK_FILE
        with suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"{utc_iso()} {command_name()} {__version__}\n{text}", encoding="utf-8")
            return str(path)
    emit(text.rstrip("\n"), sys.stderr)
    return ""


def wind_down(code: int) -> int:
    """A started run's last words: its state saved, its summary, its agents ended or where they are."""
    try:
        settle_tokens(run_ended=final_status in ("PASS", "FAIL"))
        save_state()
        report_run_summary(code)
        if own_stage.server is not None:
            log(f"ending the run's own CAO server ({API}), its tmux server and the five agents"
                + ("; a rerun starts new ones and goes on" if final_status == "RUNNING" else ""))
        elif CLEANUP_ON_EXIT:
            cleanup_terminals()
        else:
            log(agents_left_note())
        for warning in setting_warnings:     # said first, and again last: it must not scroll away unseen
            say_error(warning)
        if code == EXIT_NO_PROGRESS and no_progress_stop:
            say_error(no_progress_line(no_progress_stop, terminals_exited))   # the last line: why, and how to go on
        if code == EXIT_APPROVAL and pending_gate(gates):
            say_error(gate_stop_line(pending_gate(gates)))
    except OSError as exc:
        say_error(f"error: could not save the state to {STATE_FILE}: {exc}")
        return code or EXIT_ERROR
    return code


def run_command_line(args: list[str]) -> int:
    """Configure, start or resume the run, drive it; its exit code. Every stop is one line, never a traceback;
    every stop signal from the lock on ends what the run started (STOP_SIGNALS)."""
    started = False
    previous_handlers: dict[int, object] = {}
    StopSignals.stopping = False
    code = EXIT_ERROR
    try:
        configure(args)
        task = read_task_prompt()
        plan = refuse_bad_start(task)    # usage errors before anything is written, the lock included
        previous_handlers = set_stop_handlers(dict.fromkeys(STOP_SIGNALS, on_stop_signal))
        RunLock.take()
        start_up.begin(plan.resume)
        if plan.unreadable:
            log(plan.note)
        choice = server_choice(plan)
        log(choice.line)
        own_stage.end_left()
        if choice.own:
            start_up.step("starting the run's own CAO server")
            own_stage.start()
        connect_api()
        if not plan.resume:
            refuse_what_check_refuses(choice.own)   # before a terminal is made
        plan = start_run(task)
        started = True                   # from here on the state file is this run's: a stop keeps it
        start_up.end()
        say_tokens_not_counted()
        say_scripted_agents()
        end_old_run(plan)
        if isinstance(api, ApiClient):
            api.retry_seconds = API_RETRY_SECONDS     # from now on, ride out server restarts
        code = run_loop()
    except (OrchestratorExit, ApiError, KeyboardInterrupt, Terminated, Exception) as exc:
        StopSignals.stopping = True            # the run ends now (a finished run reported too): a stop is this end
        finished = isinstance(exc, AlreadyFinished)
        code, line = (exc.code, exc.message) if finished else stop_line(exc, started)
        start_up.end()
        (log if finished else say_error)(line)
    finally:
        StopSignals.stopping = True            # the run ends now: a stop from here on is this end, held till it is done
        # The run's end: a stop held here changes nothing, the run ends as it was ending, with its own exit code.
        with signals_held("ending the run (its state saved, what it started ended)", raise_after=False):
            if started:
                code = wind_down(code)
            own_stage.end()
            RunLock.give_back()
        set_stop_handlers(previous_handlers)
        StopSignals.stopping = False
    return code


DEMO_FOLDER = "~/cao-loop-demo"
DEMO_FILES = {".tmp", "task.md", "README.md", "greet.py", "tests"}    # what a demo leaves in its folder


def demo_command(folder_text: str) -> int:
    """--demo [DIR]: a first PASS with nothing set up -- a throwaway project in DIR, five scripted agents whose
    tester fails once (a retry round), all on the run's own CAO server; then where to look and what next."""
    from orchestrator_scripted_agent import DEMO_SCRIPT, DEMO_TASK
    folder = Path(folder_text or DEMO_FOLDER).expanduser().absolute()
    strangers = sorted(p.name for p in folder.iterdir() if p.name not in DEMO_FILES) if folder.is_dir() else []
    if strangers or (folder.exists() and not folder.is_dir()):
        say_error(f"error: --demo {folder}: it holds files of its own ({', '.join(strangers[:3]) or 'not a folder'}); "
                  "give a new or empty folder")
        return EXIT_USAGE
    agents, going_on = folder / ".tmp" / "demo-agents", False
    set_settings({"STATE_FILE": default_state_file(str(folder))})
    with suppress(StateFileError):       # a stopped demo goes on (its scripted agents' turns counted on), as said
        going_on = getattr(read_state_file(), "final_status", "") == "RUNNING"
    if not going_on:
        shutil.rmtree(agents, ignore_errors=True)
    agents.mkdir(parents=True, exist_ok=True)
    (agents / "script.json").write_text(json.dumps(DEMO_SCRIPT), encoding="utf-8")
    (folder / "task.md").write_text(DEMO_TASK, encoding="utf-8")
    (folder / "README.md").write_text("# The orchestrator loop's demo\n\nA throwaway project: its agents are "
                                      "scripted. Remove this folder when done.\n", encoding="utf-8")
    for setting in SETTINGS:             # the demo is the same everywhere: no setting of the caller's counts
        os.environ.pop(setting.env, None)
    set_settings({setting.env: setting.default for setting in SETTINGS})
    os.environ.update(WD=str(folder), PROMPT_FILE=str(folder / "task.md"), PROVIDER=SCRIPTED_PROVIDER, OWN_SERVER="1",
                      MOCK_AGENT_HOME=str(agents))
    os.environ.setdefault("MOCK_AGENT_THINK_MS", "300")
    emit(f"demo: going on with the demo stopped in {folder}" if going_on else f"demo: a greeting CLI built in "
         f"{folder} by five scripted agents (no AI CLI, nothing paid); the tester fails the first try, so you see "
         "a retry round")
    code = run_command_line([])
    if code == EXIT_PASS:
        emit(f"demo: PASS. What the agents wrote: `python {folder / 'greet.py'} World`; every prompt and reply: "
             f"{folder / '.tmp' / 'latest' / 'report.html'}")
        emit("demo: next, with a real CLI: in your project, write task.md (the template: prompt_template.md) and "
             f"run `PROVIDER=claude_code PROMPT_FILE=task.md {command_name()} --check`, then the same without "
             f"--check; remove the demo with `rm -rf {folder}`")
    return code


def person_command(config: list[str], options: argparse.Namespace) -> int:
    """--approve, --reject WHY, --note ROLE TEXT [config.json]: a person's word to the run in STATE_FILE, as a side
    file in its folder (section 4), whether the run waits in place, is stopped or was killed; one line, its code."""
    try:
        configure(config)
        saved = read_state_file()
        line = leave_note(saved, *options.note) if options.note else \
            decide_at_gate(saved, "approve" if options.approve else "reject", (options.reject or "").strip())
    except (OrchestratorExit, StateFileError) as exc:      # a state file that cannot be read: a bad setting
        say_error(f"error: {exc}")
        return exc.code if isinstance(exc, OrchestratorExit) else EXIT_USAGE
    except OSError as exc:              # the run folder's disk or permissions: the same command gets past it after
        say_error(f"error: could not write into the run's folder ({exc.__class__.__name__}: {exc}); nothing was "
                  "decided or left: fix its disk or permissions, then give the command again")
        return EXIT_ERROR
    go_on = ("the run waiting in place goes on within seconds" if RunLock.holder() else
             f"the run takes it when it goes on: `{' '.join(filter(None, (command_name(), config_argument)))}`")
    emit(f"{line}; {go_on}")
    return EXIT_PASS


def decide_at_gate(saved: SavedState | None, verdict: str, words: str) -> str:
    """The decision for the gate the run waits at, written first-writer-wins; what was decided."""
    if verdict == "reject" and not words:
        raise ConfigError('--reject needs the reason, which the agent is told: --reject "what to change"')
    gate = pending_gate(saved.gates) if saved is not None and saved.run_dir else None
    if gate is None:
        raise ConfigError(f"no gate waits for a decision in the run of {STATE_FILE} ("
                          + (describe_state(saved) if saved is not None else "no run there") + ")")
    facts = {"verdict": verdict, "by": person_name(), "at": utc_iso(), "words": words}
    if not write_first(decision_path(saved.run_dir, gate.id), facts):
        earlier = read_decision(saved.run_dir, gate.id) or {"verdict": "approve", "by": "?", "at": "?"}
        raise ConfigError(f"the {gate.gate} gate of round {gate.round} was already decided: "
                          f"{VERDICTS[earlier['verdict']]} by {earlier['by']} at {earlier['at']}; that decision counts")
    return f"{GATE_WHAT[gate.gate]} {VERDICTS[verdict]} (the {gate.gate} gate of round {gate.round})"


def leave_note(saved: SavedState | None, role: str, text: str) -> str:
    """A person's note for a role's next prompt, left in the run's folder; what was left."""
    role = role.strip().lower().replace("-", "_").replace(" ", "_")
    if role not in ROLES:
        raise ConfigError(f"--note: no role {role!r}; the roles: {', '.join(ROLES)}")
    if not text.strip():
        raise ConfigError("--note needs the text the agent is to read")
    if saved is None or not saved.run_dir or saved.final_status == "PASS":
        raise ConfigError(f"no run in {STATE_FILE} that a prompt could carry the note to ("
                          + (describe_state(saved) if saved is not None else "no run there") + ")")
    note_id = f"{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%S%f')}-{secrets.token_hex(3)}"
    write_first(Path(saved.run_dir) / NOTES_FOLDER / f"{note_id}.json",
                {"role": role, "text": text.strip(), "by": person_name(), "at": utc_iso()})
    return f"note left for the {role}: its next prompt carries it once"


def given_commands(options: argparse.Namespace) -> list[str]:
    """The commands on the command line other than a run's (at most one may be given)."""
    return [name for name, given in (("--check", options.check), ("--status", options.status),
                                     ("--approve", options.approve), ("--reject", options.reject is not None),
                                     ("--note", options.note is not None)) if given]


def refuse_mixed_options(options: argparse.Namespace, config: list[str]) -> None:
    """Exit 2 on options that do not go together (two commands, --json without --status, ...)."""
    commands = given_commands(options)
    mixed = (f"{' and '.join(commands)} are separate commands: give one" if len(commands) > 1 else
             next((f"--{option} goes with --status" for option in ("json", "follow")
                   if getattr(options, option) and not options.status), "") or
             ("--demo takes only a folder" if options.demo is not None and (commands or config)
              else ""))
    if mixed:
        say_error(f"error: {mixed} (see {command_name()} --help)")
        raise SystemExit(EXIT_USAGE)


def main(argv: list[str] | None = None) -> None:
    """Run the loop (or --check, --status, a help page) and exit with its code (EXIT_CODES)."""
    try:
        options = command_line().parse_args(argv)   # None: sys.argv[1:]
    except ConfigError as exc:
        say_error(f"error: {exc.message}")
        raise SystemExit(exc.code) from None
    pages = {"help": help_text, "help_settings": settings_help_text, "readme": readme_text,
             "version": lambda: f"{command_name()} ({PACKAGE_NAME}) {__version__}"}
    for option, page in pages.items():
        if getattr(options, option):
            emit(page().rstrip("\n"))
            raise SystemExit(EXIT_PASS)
    config = [options.config] if options.config else []
    refuse_mixed_options(options, config)
    raise SystemExit(demo_command(options.demo) if options.demo is not None else
                     status_command(config, as_json=options.json, follow=options.follow) if options.status else
                     check_command(config) if options.check else
                     person_command(config, options) if given_commands(options) else run_command_line(config))


if __name__ == "__main__":
    main()
