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

Usage:  python run_orchestrator_loop.py [config.json]
Exit codes: 0 PASS, 1 FAIL or runtime error, 2 bad usage or configuration,
75 another process drives this run, 130 interrupted (SIGINT), 143 terminated (SIGTERM).

On PASS the run can archive its OpenSpec change and commit its work, and
it can tell the user of its end through ntfy (ARCHIVE_ON_PASS, COMMIT_ON_PASS,
NTFY_TOPIC; all off by default).

Sections, in the order data flows:
    1. Configuration        7. State file
    2. CAO API client       8. Init and resume
    3. Agent handoff        9. Main loop
    4. Review gate         10. After the run: archive, commit, notify
    5. Condensation        11. Entry point
    6. Prompt builders
"""

from __future__ import annotations

__version__ = "0.2.0"

import base64
import difflib
import hashlib
import fcntl
import json
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait as wait_for_futures
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator, Mapping
from urllib.parse import quote

import httpx


# --------------------------------------------------------------------------
# Exits and logging. Every way the loop stops on purpose carries its exit
# code and one line for the user; the exits derive from SystemExit so that
# nothing below main() can turn them into a traceback.
# --------------------------------------------------------------------------

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
        super().__init__(2, message)


class RunError(OrchestratorExit):
    """The run started but cannot go on; its state stays resumable."""

    def __init__(self, message: str):
        super().__init__(1, message)


class RunLocked(OrchestratorExit):
    """Another process drives the run in this state file: nothing was done, try again later."""

    def __init__(self, message: str):
        super().__init__(75, message)       # EX_TEMPFAIL


class AlreadyFinished(OrchestratorExit):
    """REPORT_FINISHED_RUN: the state file holds a finished run; exit with its code, start nothing."""


class Terminated(BaseException):
    """Raised from the SIGTERM handler so the loop unwinds like on Ctrl-C."""


def log(message: str) -> None:
    """Timestamped progress on stdout: what a person or a cron log reads to follow a run."""
    print(f"[{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}] {message}", flush=True)


# ==========================================================================
# 1. Configuration
# ==========================================================================

ROLES = ("analyst", "peer_analyst", "programmer", "peer_programmer", "tester")
OUTPUT_KEYS = ("analyst", "analyst_review", "programmer", "programmer_review", "tester")

# Every provider CAO 2.5.4 knows, plus the older q_cli.
KNOWN_PROVIDERS = (
    "kiro_cli", "claude_code", "codex", "kimi_cli", "copilot_cli", "opencode_cli",
    "hermes", "cursor_cli", "antigravity_cli", "omp", "grok_cli", "mcode",
    "mock_cli", "q_cli",
)

DEFAULT_PROFILES = {
    "analyst": "system_analyst",
    "peer_analyst": "peer_system_analyst",
    "programmer": "programmer",
    "peer_programmer": "peer_programmer",
    "tester": "tester",
}

STATE_FILE_NAME = "codex-3agents-loop-state.json"

# Evidence the peer reviewer's REVIEW_NOTES must show before an approval
# counts: one regex per check the review prompt asks for.
REVIEW_EVIDENCE_PATTERNS = {
    "analyst": (
        r"artifact|proposal",
        r"\bP1\b|traceab",
        r"downstream|contract",
        r"handoff|hand-off|actionable",
    ),
    "programmer": (
        r"\btest(s|ed|ing)?\b|pytest|passed",
        r"\bfiles?\b|\bdiff\b|\.py\b|function",
        r"scenario|requirement|\bspec",
        r"edge case|error handling|regression|\brisk",
    ),
}


@dataclass(frozen=True)
class Setting:
    """One configuration variable: its env name, JSON key, default and kind."""

    env: str
    key: str          # dotted JSON path, e.g. "limits.max_rounds"
    default: object
    kind: str         # see _KIND_RULES
    help: str = ""


def _role_settings() -> list[Setting]:
    """Per-role provider and CAO profile, e.g. PEER_ANALYST_PROFILE."""
    settings = []
    for role in ROLES:
        prefix = role.upper()
        settings.append(Setting(f"{prefix}_PROVIDER", f"agents.{role}.provider", "",
                                "role_provider", f"CAO provider for the {role} (empty: PROVIDER)"))
        settings.append(Setting(f"{prefix}_PROFILE", f"agents.{role}.profile",
                                DEFAULT_PROFILES[role], "name", f"CAO agent profile for the {role}"))
    return settings


SETTINGS: tuple[Setting, ...] = (
    Setting("API", "api", "http://localhost:9889", "url", "CAO server base URL"),
    Setting("PROVIDER", "provider", "codex", "provider", "CAO provider for every agent"),
    Setting("WD", "wd", "", "text", "working directory of the agents (empty: current directory)"),
    Setting("PROMPT", "prompt", "", "text", "task prompt text (same format as a prompt file)"),
    Setting("PROMPT_FILE", "prompt_file", "", "text", "task prompt file"),
    Setting("PROJECT_TEST_CMD", "project_test_cmd", "", "text", "test command for programmer and tester"),
    Setting("STATE_FILE", "state_file", "", "text", "state file (empty: $WD/.tmp/" + STATE_FILE_NAME + ")"),
    Setting("RESUME", "resume", False, "bool", "1: resume the run in STATE_FILE"),
    Setting("CLEANUP_ON_EXIT", "cleanup_on_exit", False, "bool", "1: exit all five agents when the loop stops"),
    Setting("REPORT_FINISHED_RUN", "report_finished_run", False, "bool",
            "1: a finished run in STATE_FILE is reported and the command exits with its code (0 PASS, 1 FAIL) "
            "instead of starting a new run"),
    Setting("START_AGENT", "start_agent", "analyst", "role", "role whose turn starts a new run"),
    Setting("MAX_ROUNDS", "limits.max_rounds", 8, "count", "test rounds before the run fails"),
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
    Setting("NTFY_TOPIC", "notify.ntfy_topic", "", "text",
            "ntfy topic told of PASS, FAIL and stops that need a person (empty: no notifications)"),
    Setting("NTFY_SERVER", "notify.ntfy_server", "https://ntfy.sh", "url", "ntfy server to publish to"),
    *_role_settings(),
)

SETTINGS_BY_ENV = {s.env: s for s in SETTINGS}
SETTINGS_BY_KEY = {s.key: s for s in SETTINGS}
# Keys a config file may carry that are not settings (free text for people).
CONFIG_NOTE_KEYS = ("description",)
# Where a user might try to put a secret in a config file: refused, naming its variable.
SECRET_CONFIG_KEYS = {"notify.ntfy_token": "NTFY_TOKEN", "notify.token": "NTFY_TOKEN"}

_ENV_EXPECTED = {
    "text": "any text",
    "url": "an http:// or https:// URL, e.g. http://localhost:9889",
    "bool": "1 or 0",
    "count": "a whole number of at least 1",
    "count0": "a whole number of at least 0",
    "seconds0": "a number of seconds of at least 0",
    "seconds": "a number of seconds greater than 0",
    "provider": "one of " + ", ".join(KNOWN_PROVIDERS),
    "role_provider": "empty or one of " + ", ".join(KNOWN_PROVIDERS),
    "role": "one of " + ", ".join(ROLES),
    "name": "a CAO agent profile name (letters, digits, '_', '-', '.')",
}
_JSON_EXPECTED = dict(_ENV_EXPECTED, bool="true or false", count="a whole number of at least 1 (not a string)",
                      count0="a whole number of at least 0 (not a string)",
                      seconds="a number greater than 0 (not a string)",
                      seconds0="a number of at least 0 (not a string)")


def _check_value(setting: Setting, value: object) -> object:
    """Apply the kind's rule to an already typed value; ValueError if it breaks it."""
    kind = setting.kind
    if kind in ("count", "count0"):
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if kind == "count" else 0):
            raise ValueError
    elif kind in ("seconds", "seconds0"):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value \
                or value == float("inf") or value < 0 or (kind == "seconds" and value == 0):
            raise ValueError
        value = float(value)
    elif kind == "bool":
        if not isinstance(value, bool):
            raise ValueError
    else:
        if not isinstance(value, str):
            raise ValueError
        if kind == "url" and not re.match(r"^https?://[^\s/]+", value):
            raise ValueError
        if kind == "provider" and value not in KNOWN_PROVIDERS:
            raise ValueError
        if kind == "role_provider" and value and value not in KNOWN_PROVIDERS:
            raise ValueError
        if kind == "role" and value not in ROLES:
            raise ValueError
        if kind == "name" and not re.fullmatch(r"[A-Za-z0-9_.-]+", value):
            raise ValueError
    return value


def _parse_env_value(setting: Setting, raw: str) -> object:
    """Turn an environment string into the setting's type; ValueError if it can't."""
    text = raw.strip()
    if setting.kind == "bool":
        if text not in ("1", "0"):
            raise ValueError
        return text == "1"
    if setting.kind in ("count", "count0"):
        if not re.fullmatch(r"[0-9]+", text):
            raise ValueError
        return _check_value(setting, int(text))
    if setting.kind in ("seconds", "seconds0"):
        try:
            number = float(text)
        except ValueError:
            raise ValueError from None
        return _check_value(setting, number)
    return _check_value(setting, raw if setting.kind == "text" else text)


def read_env_settings(environ: Mapping[str, str]) -> tuple[dict[str, object], list[str]]:
    """Settings given in the environment (an empty variable counts as unset), and errors."""
    values: dict[str, object] = {}
    errors: list[str] = []
    for setting in SETTINGS:
        raw = environ.get(setting.env, "")
        if raw == "":
            continue
        try:
            values[setting.env] = _parse_env_value(setting, raw)
        except ValueError:
            errors.append(f"{setting.env}={raw!r} is not valid: expected {_ENV_EXPECTED[setting.kind]}")
    return values, errors


def _known_children(prefix: str) -> list[str]:
    """Names allowed directly under a JSON path prefix ('' for the top level)."""
    names = set()
    for key in list(SETTINGS_BY_KEY) + list(CONFIG_NOTE_KEYS):
        if prefix and not key.startswith(prefix + "."):
            continue
        rest = key[len(prefix) + 1:] if prefix else key
        names.add(rest.split(".")[0])
    return sorted(names)


def read_config_file(path: str) -> dict[str, object]:
    """Settings from a JSON config file, keyed by env name; ConfigError on any flaw."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory, expected a JSON file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid JSON: {exc.msg} at line {exc.lineno} "
                          f"column {exc.colno}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a JSON object {{...}} at the top level")

    values: dict[str, object] = {}

    def walk(node: dict, prefix: str) -> None:
        for name, value in node.items():
            key = f"{prefix}.{name}" if prefix else name
            if key in CONFIG_NOTE_KEYS:
                if not isinstance(value, str):
                    raise ConfigError(f"config file {path}: key '{key}' must be text")
                continue
            if key in SETTINGS_BY_KEY:
                setting = SETTINGS_BY_KEY[key]
                if value is None or (value == "" and setting.kind in ("text", "role_provider")):
                    continue                # like an empty env variable: not set
                try:
                    values[setting.env] = _check_value(setting, value)
                except ValueError:
                    raise ConfigError(f"config file {path}: key '{key}' is {json.dumps(value)}; expected "
                                      f"{_JSON_EXPECTED[setting.kind]}") from None
                continue
            if key in SECRET_CONFIG_KEYS or name.upper() in SECRET_VARIABLES:
                variable = SECRET_CONFIG_KEYS.get(key, name.upper())
                raise ConfigError(f"config file {path}: key '{key}' is refused: the token is a secret, read only "
                                  f"from the environment variable {variable} (so it never sits in a file)")
            allowed = _known_children(prefix)
            if name not in allowed:
                where = f"in '{prefix}'" if prefix else "at the top level"
                close = difflib.get_close_matches(name, allowed, n=1)
                hint = f"did you mean '{close[0]}'? " if close else ""
                if name.upper() in SETTINGS_BY_ENV:
                    hint = (f"'{name}' is the environment variable; in a config file it is "
                            f"'{SETTINGS_BY_ENV[name.upper()].key}'. ")
                raise ConfigError(f"config file {path}: unknown key '{key}' ({hint}known keys {where}: "
                                  f"{', '.join(allowed)})")
            if not isinstance(value, dict):
                raise ConfigError(f"config file {path}: key '{key}' must be an object with keys "
                                  f"{', '.join(_known_children(key))}")
            walk(value, key)

    walk(data, "")
    return values


def default_state_file(wd: str) -> str:
    """The shell orchestrator's state file location, kept so both find each other's runs."""
    return os.path.join(wd, ".tmp", STATE_FILE_NAME)


# The environment is read when the module starts, as in the shell script. A
# bad value falls back to its default here; main() reports it.
_env_values, _env_errors = read_env_settings(os.environ)


def _initial(env_name: str) -> object:
    return _env_values.get(env_name, SETTINGS_BY_ENV[env_name].default)


def _current_directory() -> str:
    """The default WD; a directory deleted under the process is left for validation to report."""
    try:
        return os.getcwd()
    except OSError:
        return os.environ.get("PWD", ".")


API: str = _initial("API")
PROVIDER: str = _initial("PROVIDER")
WD: str = _initial("WD") or _current_directory()
PROMPT: str = _initial("PROMPT")
PROMPT_FILE: str = _initial("PROMPT_FILE")
PROJECT_TEST_CMD: str = _initial("PROJECT_TEST_CMD")
STATE_FILE: str = _initial("STATE_FILE") or default_state_file(WD)
RESUME: bool = _initial("RESUME")
CLEANUP_ON_EXIT: bool = _initial("CLEANUP_ON_EXIT")
REPORT_FINISHED_RUN: bool = _initial("REPORT_FINISHED_RUN")
START_AGENT: str = _initial("START_AGENT")
MAX_ROUNDS: int = _initial("MAX_ROUNDS")
MAX_REVIEW_CYCLES: int = _initial("MAX_REVIEW_CYCLES")
MIN_REVIEW_CYCLES_BEFORE_APPROVAL: int = _initial("MIN_REVIEW_CYCLES_BEFORE_APPROVAL")
REQUIRE_REVIEW_EVIDENCE: bool = _initial("REQUIRE_REVIEW_EVIDENCE")
REVIEW_EVIDENCE_MIN_MATCH: int = _initial("REVIEW_EVIDENCE_MIN_MATCH")
POLL_SECONDS: float = _initial("POLL_SECONDS")
RESPONSE_TIMEOUT: float = _initial("RESPONSE_TIMEOUT")
STRICT_FILE_HANDOFF: bool = _initial("STRICT_FILE_HANDOFF")
IDLE_GRACE_SECONDS: float = _initial("IDLE_GRACE_SECONDS")
QUIET_SCREEN_SECONDS: float = _initial("QUIET_SCREEN_SECONDS")
MAX_FILE_REMINDERS: int = _initial("MAX_FILE_REMINDERS")
AUTO_ACCEPT_PERMISSIONS: bool = _initial("AUTO_ACCEPT_PERMISSIONS")
API_RETRY_SECONDS: float = _initial("API_RETRY_SECONDS")
STORY_MODE: bool = _initial("STORY_MODE")
STORY_CHANGE: str = _initial("STORY_CHANGE")
MAX_STORY_ATTEMPTS: int = _initial("MAX_STORY_ATTEMPTS")
CONDENSE_EXPLORE_ON_REPEAT: bool = _initial("CONDENSE_EXPLORE_ON_REPEAT")
CONDENSE_REVIEW_FEEDBACK: bool = _initial("CONDENSE_REVIEW_FEEDBACK")
MAX_FEEDBACK_LINES: int = _initial("MAX_FEEDBACK_LINES")
MAX_TEST_EVIDENCE_LINES: int = _initial("MAX_TEST_EVIDENCE_LINES")
CONDENSE_UPSTREAM_ON_REPEAT: bool = _initial("CONDENSE_UPSTREAM_ON_REPEAT")
CONDENSE_CROSS_PHASE: bool = _initial("CONDENSE_CROSS_PHASE")
MAX_CROSS_PHASE_LINES: int = _initial("MAX_CROSS_PHASE_LINES")
ANALYST_PROVIDER: str = _initial("ANALYST_PROVIDER")
ANALYST_PROFILE: str = _initial("ANALYST_PROFILE")
PEER_ANALYST_PROVIDER: str = _initial("PEER_ANALYST_PROVIDER")
PEER_ANALYST_PROFILE: str = _initial("PEER_ANALYST_PROFILE")
PROGRAMMER_PROVIDER: str = _initial("PROGRAMMER_PROVIDER")
PROGRAMMER_PROFILE: str = _initial("PROGRAMMER_PROFILE")
PEER_PROGRAMMER_PROVIDER: str = _initial("PEER_PROGRAMMER_PROVIDER")
PEER_PROGRAMMER_PROFILE: str = _initial("PEER_PROGRAMMER_PROFILE")
TESTER_PROVIDER: str = _initial("TESTER_PROVIDER")
TESTER_PROFILE: str = _initial("TESTER_PROFILE")
ARCHIVE_ON_PASS: bool = _initial("ARCHIVE_ON_PASS")
OPENSPEC_COMMAND: str = _initial("OPENSPEC_COMMAND")
ARCHIVE_TIMEOUT: float = _initial("ARCHIVE_TIMEOUT")
COMMIT_ON_PASS: bool = _initial("COMMIT_ON_PASS")
NTFY_TOPIC: str = _initial("NTFY_TOPIC")
NTFY_SERVER: str = _initial("NTFY_SERVER")

# CAO's own convention for a server started with a token. A secret, so it is
# read from the environment only and never logged or saved.
CAO_AUTH_LOCAL_TOKEN: str = os.environ.get("CAO_AUTH_LOCAL_TOKEN", "")
# The ntfy access token: a secret too, so environment only, never logged,
# never saved, and refused as a config file key.
NTFY_TOKEN: str = os.environ.get("NTFY_TOKEN", "")
SECRET_VARIABLES = ("CAO_AUTH_LOCAL_TOKEN", "NTFY_TOKEN")

# Names of the settings the user chose (environment or config file); on
# resume these win over what the state file recorded.
explicit_settings: set[str] = set(_env_values)

# The task, parsed from PROMPT / PROMPT_FILE (or from the state on resume).
EXPLORE_HEADER = "*** ORIGINAL EXPLORE SUMMARY ***"
SCENARIO_HEADER = "*** SCENARIO TEST ***"
EXPLORE_SUMMARY: str = ""
SCENARIO_TEST: str = ""


def misspelt_settings(environ: Mapping[str, str]) -> list[str]:
    """Warnings for environment variables that look like a setting with a typo (MAX_ROUND)."""
    known = [setting.env for setting in SETTINGS] + list(SECRET_VARIABLES)
    warnings = []
    for name in sorted(environ):
        if name in known or len(name) < 4 or not name.isupper():
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.85)
        if close:
            warnings.append(f"warning: {name} is not a setting (ignored); did you mean {close[0]}?")
    return warnings


def configure(argv: list[str]) -> None:
    """Settle every setting (env > JSON > default) and validate it, before anything runs."""
    global explicit_settings, CAO_AUTH_LOCAL_TOKEN, NTFY_TOKEN
    CAO_AUTH_LOCAL_TOKEN = os.environ.get("CAO_AUTH_LOCAL_TOKEN", "")
    NTFY_TOKEN = os.environ.get("NTFY_TOKEN", "")
    for warning in misspelt_settings(os.environ):
        print(warning, file=sys.stderr, flush=True)
    env_values, env_errors = read_env_settings(os.environ)
    if env_errors:
        raise ConfigError(env_errors[0])
    file_values = read_config_file(argv[0]) if argv else {}
    chosen = {**file_values, **env_values}
    if "WD" in chosen and "STATE_FILE" not in chosen:
        chosen["STATE_FILE"] = default_state_file(os.path.abspath(chosen["WD"]))
    globals().update(chosen)
    explicit_settings = set(chosen)
    validate_settings()


def is_copy_of_this_program(directory: Path) -> bool:
    """This module's own directory, or a checkout of it (an installed command runs from site-packages)."""
    return directory.resolve() == Path(__file__).resolve().parent or \
        ((directory / Path(__file__).name).is_file() and (directory / "pyproject.toml").is_file())


def validate_settings() -> None:
    """Cross-checks no single value can make, and making paths absolute."""
    global WD, STATE_FILE
    if not os.path.isdir(WD):
        what = "does not exist" if not os.path.exists(WD) else "is not a directory"
        raise ConfigError(f"WD={WD} {what}: set WD (or 'wd' in the config file) to the project directory")
    WD = os.path.abspath(WD)
    if is_copy_of_this_program(Path(WD)):
        raise ConfigError(f"WD={WD} is this program's own directory (a checkout of the orchestrator loop): the "
                          "agents would rewrite the orchestrator. Make a directory for your project and set WD "
                          "to it (or run from there)")
    STATE_FILE = os.path.abspath(STATE_FILE)
    if os.path.isdir(STATE_FILE):
        raise ConfigError(f"STATE_FILE={STATE_FILE} is a directory: give it a file path")
    if MIN_REVIEW_CYCLES_BEFORE_APPROVAL > MAX_REVIEW_CYCLES:
        raise ConfigError(f"MIN_REVIEW_CYCLES_BEFORE_APPROVAL={MIN_REVIEW_CYCLES_BEFORE_APPROVAL} is larger than "
                          f"MAX_REVIEW_CYCLES={MAX_REVIEW_CYCLES}, so no review could ever be approved: "
                          "lower it or raise MAX_REVIEW_CYCLES")
    checks = len(REVIEW_EVIDENCE_PATTERNS["analyst"])
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


# Lines of prompt_template.md that stand for the user's own text: a task that
# still holds one is the unedited template.
TEMPLATE_PLACEHOLDERS = (
    "What to build or change, and what the agents should know before they start.",
    "How the tester decides PASS or FAIL: concrete steps with expected results, e.g.",
)


def parse_task_prompt(text: str, source: str) -> tuple[str, str]:
    """Split a task prompt into its explore summary and scenario test sections."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        header = line.strip()
        if header in (EXPLORE_HEADER, SCENARIO_HEADER):
            if header in sections:
                raise ConfigError(f"{source}: the header line '{header}' appears twice")
            current = header
            sections[current] = []
        elif current is not None:
            sections[current].append(line)
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
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"PROMPT_FILE={PROMPT_FILE} does not exist") from None
        except IsADirectoryError:
            raise ConfigError(f"PROMPT_FILE={PROMPT_FILE} is a directory, expected a text file") from None
        except UnicodeDecodeError:
            raise ConfigError(f"PROMPT_FILE={PROMPT_FILE} is not UTF-8 text: save it as UTF-8") from None
        except OSError as exc:
            raise ConfigError(f"PROMPT_FILE={PROMPT_FILE} cannot be read: {exc.strerror}") from None
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


def provider_for(role: str) -> str:
    """The role's own provider if one is set, else PROVIDER."""
    return globals()[f"{role.upper()}_PROVIDER"] or PROVIDER


def providers_in_use() -> list[str]:
    """Every provider the five roles run on, each once."""
    return sorted({provider_for(role) for role in ROLES})


def profile_for(role: str) -> str:
    return globals()[f"{role.upper()}_PROFILE"]


# ==========================================================================
# 2. CAO API client
# ==========================================================================

class ApiError(RuntimeError):
    """A CAO call that failed; the message names the call and what went wrong.

    `retryable`: the server may answer if asked again (down, slow, 5xx).
    `unsent`: the request never left this machine, so repeating it is harmless.
    """

    def __init__(self, message: str, status_code: int | None = None, retryable: bool = False,
                 unsent: bool = False):
        super().__init__(message)
        self.status_code = status_code
        self.retryable = retryable
        self.unsent = unsent


class ApiClient:
    """The few CAO HTTP calls the loop needs, over one connection pool.

    While a run is under way (`retry_seconds` > 0) a server that cannot be
    reached, times out or answers 5xx is retried with backoff -- but only
    where repeating cannot do harm: reads always, and writes only when the
    connection was never opened, so a prompt is never delivered twice.
    """

    # Creating a terminal waits until the agent CLI is up (15-30 s with real
    # CLIs), so reads get a generous timeout; a dead address fails fast.
    TIMEOUT = httpx.Timeout(300.0, connect=10.0)

    def __init__(self, base_url: str, token: str = "", transport: httpx.BaseTransport | None = None):
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.retry_seconds = 0.0
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.base_url, timeout=self.TIMEOUT, headers=headers,
                                  transport=transport)

    def _call(self, what: str, method: str, path: str, params: dict | None = None,
              retry: bool = True) -> object:
        """One request, retried where safe; every failure becomes an ApiError that says what to do.

        `retry=False` is for a look that may simply fail (the screen of a
        terminal with no reply yet): the caller treats a failure as "cannot tell".
        """
        give_up_at = time.monotonic() + (self.retry_seconds if retry else 0.0)
        delay = min(POLL_SECONDS, 1.0)
        told = False
        while True:
            try:
                return self._once(what, method, path, params)
            except ApiError as exc:
                if not exc.retryable or (method != "GET" and not exc.unsent):
                    raise
                remaining = give_up_at - time.monotonic()
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

    def _terminal_answer(self, what: str, answer: object) -> dict:
        if not isinstance(answer, dict) or not isinstance(answer.get("id"), str) \
                or not isinstance(answer.get("session_name"), str):
            raise ApiError(f"CAO {what} answered without a terminal id and session name: {answer!r:.200}")
        return answer

    def create_session(self, profile: str, provider: str | None = None, session_name: str | None = None) -> dict:
        """A new CAO session whose first terminal runs `profile`; returns its id and session_name.

        With `session_name` the caller picks the name, so that terminals can be
        added to the session before this call returns; CAO 2.5.4 puts `cao-` in
        front of a name that does not start with it, so read the name it answers.
        """
        params = {"provider": provider or PROVIDER, "agent_profile": profile, "working_directory": WD}
        if session_name is not None:
            params["session_name"] = session_name
        return self._terminal_answer("create session", self._call("create session", "POST", "/sessions", params))

    def create_terminal(self, session_name: str, profile: str, provider: str | None = None) -> dict:
        """Another terminal in an existing session; returns its id and session_name."""
        params = {"provider": provider or PROVIDER, "agent_profile": profile, "working_directory": WD}
        what = f"create terminal ({profile})"
        return self._terminal_answer(
            what, self._call(what, "POST", f"/sessions/{quote(session_name, safe='')}/terminals", params))

    def send_input(self, terminal_id: str, message: str) -> None:
        self._call(f"send input to terminal {terminal_id}", "POST",
                   f"/terminals/{quote(terminal_id, safe='')}/input", {"message": message})

    def get_status(self, terminal_id: str) -> str:
        """The terminal's status word: idle, processing, completed, waiting_user_answer or error."""
        what = f"status of terminal {terminal_id}"
        answer = self._call(what, "GET", f"/terminals/{quote(terminal_id, safe='')}")
        if not isinstance(answer, dict) or not isinstance(answer.get("status"), str):
            raise ApiError(f"CAO {what} answered without a status: {answer!r:.200}")
        return answer["status"]

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
        if not isinstance(answer, dict) or not isinstance(answer.get("output"), str):
            raise ApiError(f"CAO {what} answered without an output: {answer!r:.200}")
        return answer["output"]

    def missing_agent_clis(self, providers: list[str]) -> list[tuple[str, str]]:
        """(provider, binary) of each provider whose CLI the server says is not installed.

        An older server without this route, or any other failure, means "cannot
        tell": the answer is then empty, never an error.
        """
        try:
            answer = self._call("list providers", "GET", "/agents/providers", retry=False)
        except ApiError:
            return []
        listed = {entry.get("name"): entry for entry in answer if isinstance(entry, dict)} \
            if isinstance(answer, list) else {}
        return [(name, str(listed[name].get("binary") or name)) for name in providers
                if name in listed and listed[name].get("installed") is False]

    def exit_terminal(self, terminal_id: str) -> None:
        self._call(f"exit terminal {terminal_id}", "POST", f"/terminals/{quote(terminal_id, safe='')}/exit")

    def close(self) -> None:
        self._http.close()


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


api = ApiClient(API, CAO_AUTH_LOCAL_TOKEN)


def connect_api() -> None:
    """Point `api` at API with the current token if either changed since the client was made."""
    global api
    if isinstance(api, ApiClient) and (api.base_url != API.rstrip("/") or api.token != CAO_AUTH_LOCAL_TOKEN):
        api.close()
        api = ApiClient(API, CAO_AUTH_LOCAL_TOKEN)


# ==========================================================================
# 3. Agent handoff
# ==========================================================================

PHASE_ANALYST = "analyst"
PHASE_PROGRAMMER = "programmer"
PHASE_TESTER = "tester"
PHASE_DONE = "done"
PHASES = (PHASE_ANALYST, PHASE_PROGRAMMER, PHASE_TESTER, PHASE_DONE)

RESPONSE_FILES = {
    "analyst": "analyst_summary.md",
    "peer_analyst": "analyst_review.md",
    "programmer": "programmer_summary.md",
    "peer_programmer": "programmer_review.md",
    "tester": "test_result.md",
}
READY_STATUSES = ("idle", "completed")
BUSY_STATUSES = ("processing", "waiting_user_answer")
# Any other word ("unknown" after a cao-server restart, or one of a newer CAO)
# means the server cannot tell; the response file and the screen decide.
KNOWN_STATUSES = READY_STATUSES + BUSY_STATUSES + ("error",)
# How often the response file is looked at between two status polls:
# reading a local file costs nothing, so a reply is noticed quickly.
FILE_CHECK_SECONDS = 0.05
# A response file counts once it has not changed for this long, so a reply
# still being written (or rewritten) is never read half-way. Agents write a
# reply in one go (a tool call, a heredoc), and the turn also needs the agent
# seen idle or its screen still, so a short settle is enough.
FILE_SETTLE_SECONDS = 0.1

# Run state (saved in the state file; see section 7).
session_name: str = ""
terminal_ids: dict[str, str] = {role: "" for role in ROLES}
current_round: int = 1
current_phase: str = PHASE_ANALYST
phase_cycle: int = 1              # review cycle within the current phase
phase_step: str = "author"        # "author": the author's turn is next; "review": the reviewer's
final_status: str = "RUNNING"
feedback: str = ""                # condensed tester evidence for the next round
analyst_feedback: str = ""        # condensed peer analyst notes for the next analyst cycle
programmer_feedback: str = ""     # condensed peer programmer notes for the next programmer cycle
programmer_context_for_retry: str = ""
outputs: dict[str, str] = {key: "" for key in OUTPUT_KEYS}
run_dir: str = ""                 # where consumed replies are archived
terminals_exited: bool = False    # CLEANUP_ON_EXIT ended the agents: never send them input again
in_flight: dict = {}              # the prompt sent and not yet answered: role, position, sent_at, sent_in_full
story_progress: dict = {}         # story mode: change, queue, current story, attempt, last failure, results
context_sent: set[str] = set()    # "<block>:<terminal id>" of once-per-terminal text already sent in full
context_new: list[str] = []       # marks added while building the next prompt: what it carries in full
turn_records: list[dict] = []     # one per answered turn: role, round, seconds, prompt bytes, outcome
worktree_at_start: dict | None = None  # COMMIT_ON_PASS: each path git showed as changed at the start -> fingerprint
after_run: dict = {}              # what was done once the run finished (archive, commit, notified): never twice


def log_turn(role: str, message: str) -> None:
    """A log line that says where in the loop it happened."""
    where = f"round {current_round}/{MAX_ROUNDS} | {current_phase} phase"
    if current_phase in (PHASE_ANALYST, PHASE_PROGRAMMER):
        where += f" | cycle {phase_cycle}/{MAX_REVIEW_CYCLES}"
    log(f"{where} | {role}: {message}")


def new_run_dir() -> str:
    """Where a run keeps its consumed replies: $WD/.tmp/<run start time>."""
    return str(Path(WD) / ".tmp" / datetime.now().strftime("%Y%m%d-%H%M%S"))


def set_run_dir(path: str) -> None:
    global run_dir
    run_dir = path


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


def archive_reply(role: str, text: str, response_file: Path) -> Path:
    """Keep a consumed reply as $WD/.tmp/<run>/NNN-<role>.md, taking the response file along."""
    directory = Path(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"{_next_archive_number():03d}-{role}.md"
    if read_reply_file(response_file):
        os.replace(response_file, target)
    else:                               # the reply came from the terminal, not the file
        target.write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")
    return target


def read_reply_file(path: Path) -> str:
    """The response file's text, or '' while it is missing or blank."""
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except (FileNotFoundError, IsADirectoryError):
        return ""


def reply_file_version(path: Path) -> tuple[int, int] | None:
    """(mtime, size) of a non-empty response file, None while it is missing or empty.

    Looking costs a read of a small local file, so it is done every
    FILE_CHECK_SECONDS; the server is asked far less often. A file of blanks
    counts as empty.
    """
    try:
        info = path.stat()
    except OSError:
        return None
    if info.st_size == 0 or not read_reply_file(path):
        return None
    return (info.st_mtime_ns, info.st_size)


# Terminal text that means the agent's model provider failed, not the agent.
PROVIDER_ERROR = re.compile(r"API Error: *[45]\d\d|\"type\": *\"(?:api_error|overloaded_error|rate_limit_error)\"")
PERMISSION_ANSWER_INTERVAL = 5.0      # seconds between two automatic "y" answers on one terminal
MAX_PERMISSION_ANSWERS = 20           # automatic answers per turn
# CAO takes a message in the URL's query string and refuses one of about 64 KB
# (encoded). Larger prompts are written to a file the agent is told to read.
MAX_INLINE_PROMPT_BYTES = 32_000
# Terminals known ready for their first prompt: seen ready twice in a row, or
# created by this process (CAO answers a creation once the agent CLI is ready).
settled_terminals: set[str] = set()


def _last_output(terminal_id: str) -> str | None:
    """The agent's last reply as CAO extracts it, or None if the server cannot say.

    Not retried: before an agent's first reply CAO answers 500 (nothing to
    extract), which is an answer, not an outage.
    """
    try:
        return api.get_last_output(terminal_id, retry=False)
    except ApiError:
        return None


def _screen(terminal_id: str) -> str | None:
    """The terminal's recent output, or None if the server cannot say."""
    try:
        return api.get_screen(terminal_id)
    except ApiError:
        return None


def _tail(text: str | None, lines: int = 5) -> str:
    return " | ".join((text or "").strip().splitlines()[-lines:])


def agent_failed(role: str, terminal_id: str, what: str) -> RunError:
    return RunError(f"the {role} agent (terminal {terminal_id}) {what}; look at it with "
                    f"`tmux attach -t {session_name}`, then rerun to resume")


def wait_until_settled(role: str, terminal_id: str) -> None:
    """Before the first prompt to a terminal this process did not create (a resumed run's):
    ready twice in a row, since some CLIs show their prompt before they take input.

    A status word the loop does not know (`unknown` after a cao-server
    restart) cannot become ready, so it counts as settled: the prompt goes out
    and the reply file decides.
    """
    if terminal_id in settled_terminals:
        return
    started = time.monotonic()
    ready_in_a_row = 0
    while ready_in_a_row < 2:
        status = api.get_status(terminal_id)
        if status == "error":
            raise agent_failed(role, terminal_id, "reports status 'error' before its first prompt")
        ready_in_a_row = ready_in_a_row + 1 if status not in BUSY_STATUSES else 0
        if time.monotonic() - started >= RESPONSE_TIMEOUT:
            raise agent_failed(role, terminal_id, f"did not become ready within RESPONSE_TIMEOUT="
                                                  f"{RESPONSE_TIMEOUT:g}s (status {status!r})")
        if ready_in_a_row < 2:
            time.sleep(min(FILE_CHECK_SECONDS, POLL_SECONDS))
    settled_terminals.add(terminal_id)


class TurnWatch:
    """One agent turn: what has been observed, and the rules that end it.

    CAO's status is a hint: it can lag, stick at `processing` when it misreads
    a CLI's screen, or read `unknown` after a server restart. The response
    file is the agent's own word, so it leads. wait_for_reply() does all the
    I/O and feeds the observations in; decide() applies the rules:

      file     the response file's (mtime, size), looked at every 0.05 s
      status   CAO's status word, read at most once per POLL_SECONDS (plus
               once when a file has settled, so a finished turn ends at once)
      screen   the terminal's recent output, read with the status while the
               status alone cannot end the turn
      reply    CAO's last reply, read before the prompt and once more before
               sending it again: a change means the agent worked

    Rules, in order:
      error    the status is `error`
      done     the file is settled (unchanged for FILE_SETTLE_SECONDS) and
               either a ready status was read since it appeared, or the
               screen has not changed for QUIET_SCREEN_SECONDS while it was
               there. A changing screen never ends a turn; a rewritten file
               starts its clocks again
      resend   no file, the agent idle and never seen working (no busy
               status, no new reply) for IDLE_GRACE_SECONDS: the prompt never
               arrived (once per turn)
      remind   no file, idle for IDLE_GRACE_SECONDS after it worked
      timeout  RESPONSE_TIMEOUT since the prompt
      wait     anything else

    "Idle" is a ready status, or -- when the status is one the loop does not
    know -- a screen that has not changed for QUIET_SCREEN_SECONDS.
    """

    def __init__(self, role: str, terminal_id: str, path: Path, baseline_reply: str | None):
        self.role, self.terminal_id, self.path = role, terminal_id, path
        now = time.monotonic()
        self.started = now
        self.reminders = 0
        self.resent = False
        self.told_blocked = False
        self.told_unknown = False
        self.permission_answers = 0
        self.last_answer_at = float("-inf")
        self.status: str | None = None
        self.status_at = float("-inf")
        self.next_status_at = now + POLL_SECONDS    # CAO's send returned only now: nothing new yet
        self.early_read_used = False
        self.file_version: tuple[int, int] | None = None
        self.file_seen_at = float("-inf")
        self.ready_since_file = False
        self.screen: str | None = None
        self.screen_changed_at = now
        self.arm_guard(baseline_reply)

    def arm_guard(self, baseline_reply: str | None) -> None:
        """After a prompt or reminder: the agent has not been seen working on it yet."""
        self.guard_since = time.monotonic()
        self.seen_working = False
        self.idle_since: float | None = None
        self.baseline_reply = baseline_reply

    # -- observations --------------------------------------------------------
    def note_file(self, version: tuple[int, int] | None) -> None:
        if version != self.file_version:
            self.file_version = version
            self.file_seen_at = time.monotonic()
            self.ready_since_file = False
            if version is not None:
                self.note_working()

    def note_status(self, status: str) -> None:
        now = time.monotonic()
        self.status, self.status_at = status, now
        self.next_status_at = now + POLL_SECONDS
        if status in READY_STATUSES and self.file_version is not None:
            self.ready_since_file = True
        if status in BUSY_STATUSES:
            self.note_working()

    def note_screen(self, screen: str | None) -> None:
        if screen is None or screen == self.screen:
            return
        if self.screen is not None and self.status not in KNOWN_STATUSES:
            self.note_working()         # nothing else tells that it works
        self.screen, self.screen_changed_at = screen, time.monotonic()

    def note_reply(self, reply: str | None) -> None:
        """A new last reply: it worked (before it went idle, so idle keeps counting)."""
        if reply is not None and self.baseline_reply is not None and reply != self.baseline_reply:
            self.seen_working = True

    def note_working(self) -> None:
        self.seen_working = True
        self.idle_since = None

    # -- what to read --------------------------------------------------------
    def file_settled(self) -> bool:
        return self.file_version is not None and time.monotonic() - self.file_seen_at >= FILE_SETTLE_SECONDS

    def status_due(self) -> bool:
        """Once per POLL_SECONDS -- and once early, when a reply file has just settled."""
        if time.monotonic() >= self.next_status_at:
            return True
        if not self.early_read_used and self.file_settled() and \
                self.status_at < self.file_seen_at + FILE_SETTLE_SECONDS:
            self.early_read_used = True
            return True
        return False

    def next_look_at(self) -> float:
        """When something may change: the next status read, or the moment a new file settles."""
        if self.file_version is not None and not self.file_settled():
            return min(self.next_status_at, self.file_seen_at + FILE_SETTLE_SECONDS)
        return self.next_status_at

    def screen_due(self) -> bool:
        """With a status read, when the status alone cannot end the turn."""
        if self.status in READY_STATUSES or self.status == "error":
            return False
        return self.file_settled() or self.status not in KNOWN_STATUSES

    # -- rules ---------------------------------------------------------------
    def screen_still_since(self, since: float) -> bool:
        quiet_from = max(self.screen_changed_at, since)
        return self.screen is not None and time.monotonic() - quiet_from >= QUIET_SCREEN_SECONDS

    def is_idle(self) -> bool:
        if self.status in READY_STATUSES:
            return True
        return self.status not in KNOWN_STATUSES and self.screen_still_since(float("-inf"))

    def decide(self) -> str:
        now = time.monotonic()
        if self.status == "error":
            return "error"
        if self.file_settled() and (self.ready_since_file or self.screen_still_since(self.file_seen_at)):
            return "done"
        if self.file_version is None and self.is_idle():
            if self.idle_since is None:
                self.idle_since = now
            if not self.seen_working and now - self.guard_since < IDLE_GRACE_SECONDS:
                return "wait"                 # may not have started yet: idle does not count
            if not self.seen_working and not self.resent:
                return "resend"
            if now - self.idle_since >= IDLE_GRACE_SECONDS:
                return "remind"
        else:
            self.idle_since = None
        if now - self.started >= RESPONSE_TIMEOUT:
            return "timeout"
        return "wait"


def wait_for_reply(role: str, terminal_id: str, path: Path, message: str | None,
                   baseline_reply: str | None) -> str:
    """Wait until the turn's rules say the agent is done, and return its answer.

    `message` is what was sent (None for a turn carried over from an earlier
    process); it is sent again once if the agent never showed that it got it.
    """
    turn = TurnWatch(role, terminal_id, path, baseline_reply)
    while True:
        turn.note_file(reply_file_version(path))
        if turn.status_due():
            observe_terminal(turn)
        verdict = turn.decide()
        if verdict == "done":
            reply = read_reply_file(path)
            if reply:
                return reply
            turn.note_file(None)             # emptied again: keep waiting
        elif verdict == "error":
            output = _last_output(terminal_id)
            raise agent_failed(role, terminal_id, "reports status 'error'" + (f" ({_tail(output, 3)})" if output else ""))
        elif verdict == "resend" and message is not None and not reply_file_version(path):
            turn.note_reply(_last_output(terminal_id))    # the one look that can still tell it worked
            if not turn.seen_working:
                log_turn(role, f"terminal {terminal_id} never showed that it got the prompt "
                               f"({IDLE_GRACE_SECONDS:g}s idle, no new output); sending the whole prompt again")
                turn.resent = True
                resend_prompt(role, terminal_id, message, turn)
        elif verdict in ("resend", "remind") and not reply_file_version(path):
            turn.resent = True
            reply = idle_without_file(turn)
            if reply is not None:
                return reply
        elif verdict == "timeout":
            raise agent_failed(role, terminal_id, f"gave no reply within RESPONSE_TIMEOUT={RESPONSE_TIMEOUT:g}s; "
                                                  "raise RESPONSE_TIMEOUT if it needs longer")
        time.sleep(max(0.0, min(FILE_CHECK_SECONDS, turn.next_look_at() - time.monotonic())))


def observe_terminal(turn: TurnWatch) -> None:
    """One round of server reads for a turn: the status, and the screen or reply when they can tell more."""
    status = api.get_status(turn.terminal_id)
    turn.note_status(status)
    if status not in KNOWN_STATUSES and not turn.told_unknown:
        turn.told_unknown = True
        log_turn(turn.role, f"CAO cannot tell the status of terminal {turn.terminal_id} ({status!r}, e.g. after "
                            "a server restart); judging the turn by the response file and the screen")
    if status == "waiting_user_answer":
        handle_permission_prompt(turn)
    if turn.screen_due():
        turn.note_screen(_screen(turn.terminal_id))


def resend_prompt(role: str, terminal_id: str, message: str, turn: TurnWatch) -> None:
    """Send the prompt again, as it was; the turn's clocks start over."""
    baseline = _last_output(terminal_id)
    set_in_flight({**in_flight, "sent_at": time.time()})
    save_state()
    api.send_input(terminal_id, message)
    turn.arm_guard(baseline)


def idle_without_file(turn: TurnWatch) -> str | None:
    """The agent stopped without its file: stop on a provider error, remind it, then fail or fall back."""
    role, terminal_id, path = turn.role, turn.terminal_id, turn.path
    output = _last_output(terminal_id) or ""
    provider_error = PROVIDER_ERROR.search(output)
    if provider_error:
        raise agent_failed(role, terminal_id, f"stopped on a model provider error ({_tail(output, 2)})")
    if turn.reminders < MAX_FILE_REMINDERS:
        turn.reminders += 1
        log_turn(role, f"idle without {path.name}; reminder {turn.reminders}/{MAX_FILE_REMINDERS} sent")
        api.send_input(terminal_id, f"Reminder: your answer has not arrived. Write your complete answer to "
                                    f"{path} now; the orchestrator reads only that file.")
        turn.arm_guard(output)
        return None
    if STRICT_FILE_HANDOFF:
        raise agent_failed(role, terminal_id, f"went idle without writing {path}; set STRICT_FILE_HANDOFF=0 "
                                              "to accept its terminal output instead")
    if not output.strip():
        raise agent_failed(role, terminal_id, f"went idle without writing {path} and its terminal shows no reply")
    log_turn(role, f"no response file; using the terminal's last output ({len(output.strip())} chars)")
    return output.strip()


def handle_permission_prompt(turn: TurnWatch) -> None:
    """An agent waits for a yes/no answer: say so once, or answer 'y' (rate-limited) if allowed."""
    role, terminal_id = turn.role, turn.terminal_id
    if not AUTO_ACCEPT_PERMISSIONS:
        if not turn.told_blocked:
            log_turn(role, f"blocked: terminal {terminal_id} waits for a permission answer; answer it in "
                           f"`tmux attach -t {session_name}` or set AUTO_ACCEPT_PERMISSIONS=1")
            turn.told_blocked = True
        return
    if turn.permission_answers >= MAX_PERMISSION_ANSWERS:
        if not turn.told_blocked:
            log_turn(role, f"blocked: {MAX_PERMISSION_ANSWERS} permission prompts answered this turn; "
                           f"no more automatic answers (terminal {terminal_id})")
            turn.told_blocked = True
        return
    now = time.monotonic()
    if now - turn.last_answer_at < PERMISSION_ANSWER_INTERVAL:
        return
    turn.permission_answers += 1
    turn.last_answer_at = now
    log_turn(role, f"permission prompt on terminal {terminal_id} answered 'y' "
                   f"({turn.permission_answers}/{MAX_PERMISSION_ANSWERS}): {_tail(_last_output(terminal_id))}")
    api.send_input(terminal_id, "y")


def deliverable_message(role: str, prompt: str) -> str:
    """The prompt itself, or -- if too long for CAO's query string -- a pointer to a file holding it."""
    if len(quote(prompt, safe="")) <= MAX_INLINE_PROMPT_BYTES:
        return prompt
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
    if role == "programmer" and story_progress.get("current"):
        position.update(story=story_progress["current"], attempt=story_progress.get("attempt", 1))
    return position


def set_in_flight(turn: dict) -> None:
    global in_flight
    in_flight = turn


def carried_over_turn(role: str, path: Path) -> str:
    """After an interruption: did this very prompt already go out? 'reply', 'working' or ''.

    'reply': the agent has written its answer since the prompt was sent;
    'working': it is still busy with it. Either way the prompt is not sent
    again. A response file older than the prompt is an earlier turn's and is
    moved aside.
    """
    position = turn_position(role)
    if not in_flight or {k: in_flight.get(k) for k in position} != position:
        return ""
    sent_at = in_flight.get("sent_at")
    if not isinstance(sent_at, (int, float)):
        return ""
    try:
        written_at = path.stat().st_mtime
    except OSError:
        written_at = None
    if written_at is not None:
        # Filesystem timestamps can be coarse: a second of slack, and the
        # stale file of an earlier turn was moved aside before the send.
        if written_at >= sent_at - 1.0 and read_reply_file(path):
            return "reply"
        set_aside_stale_reply(path)
    status = api.get_status(terminal_ids[role])
    return "working" if status not in READY_STATUSES and status != "error" else ""


def ask_agent(role: str, prompt: str) -> str:
    """Send one prompt to a role's terminal and return its answer (also archived)."""
    terminal_id = terminal_ids[role]
    path = response_path(role)
    path.parent.mkdir(parents=True, exist_ok=True)
    sent_in_full = take_context_new(terminal_id)
    carried = carried_over_turn(role, path)
    message = baseline_reply = None
    if carried == "reply":
        log_turn(role, "taking the reply written while the loop was down (prompt not sent again)")
    elif carried == "working":
        log_turn(role, f"terminal {terminal_id} is still working on the prompt sent before the interruption; "
                       "waiting for it")
    else:
        wait_until_settled(role, terminal_id)
        set_aside_stale_reply(path)
        message = deliverable_message(role, prompt)
        # Before the send: CAO's send returns only after pasting (seconds with
        # some CLIs), and a quick agent may have answered by then.
        baseline_reply = _last_output(terminal_id)
        set_in_flight({**turn_position(role), "sent_at": time.time(), "sent_in_full": sent_in_full})
        save_state()
        log_turn(role, f"prompt sent to terminal {terminal_id} ({len(prompt)} chars)")
        try:
            api.send_input(terminal_id, message)
        except ApiError as exc:
            if exc.unsent or not exc.retryable:
                forget_context_sent(terminal_id)
                raise
            # The request went out and the answer broke off (a server restart):
            # the agent may have the prompt. The wait tells -- a reply, a busy
            # agent or new output -- and sends it again only if nothing shows.
            log_turn(role, f"delivery to terminal {terminal_id} broke off ({exc}); watching whether the "
                           "prompt arrived before sending it again")
        except BaseException:
            forget_context_sent(terminal_id)
            raise
    reply = wait_for_reply(role, terminal_id, path, message, baseline_reply)
    timing = turn_timing(path)
    record_turn(role, len(prompt.encode("utf-8")))
    archived = archive_reply(role, reply, path)
    set_in_flight({})
    log_turn(role, f"reply received{timing} ({len(reply)} chars, kept as {archived})")
    return reply


def record_turn(role: str, prompt_bytes: int) -> None:
    """Remember an answered turn for the run summary (saved with the state)."""
    sent_at = in_flight.get("sent_at")
    seconds = round(time.time() - sent_at, 1) if isinstance(sent_at, (int, float)) else None
    turn_records.append({"role": role, "round": current_round, "seconds": seconds, "prompt_bytes": prompt_bytes})


def note_turn_outcome(outcome: str) -> None:
    """The verdict or test result of the turn just answered, for the run summary."""
    if turn_records:
        turn_records[-1]["outcome"] = outcome


def turn_timing(path: Path) -> str:
    """' after 6.2s (file written 0.4s before)': how long the turn took, and how long the loop took to see it."""
    now = time.time()
    sent_at = in_flight.get("sent_at")
    text = f" after {now - sent_at:.1f}s" if isinstance(sent_at, (int, float)) else ""
    try:
        text += f" (file written {max(0.0, now - path.stat().st_mtime):.1f}s before)"
    except OSError:
        pass
    return text


# ==========================================================================
# 4. Review gate
# ==========================================================================

def review_verdict(review_text: str) -> str:
    """APPROVED, REVISE or MISSING, from the last REVIEW_RESULT line of a review."""
    verdicts = re.findall(r"^\W*REVIEW_RESULT\W*:\W*([A-Za-z_]+)", review_text or "", re.MULTILINE)
    if not verdicts:
        return "MISSING"
    return "APPROVED" if verdicts[-1].upper() == "APPROVED" else "REVISE"


def _evidence_patterns(review_role: str) -> tuple[str, ...]:
    family = review_role.replace("peer_", "")
    if family not in REVIEW_EVIDENCE_PATTERNS:
        raise ValueError(f"review_role must be one of analyst, peer_analyst, programmer, peer_programmer; "
                         f"got {review_role!r}")
    return REVIEW_EVIDENCE_PATTERNS[family]


def review_evidence_matches(review_text: str, review_role: str) -> int:
    """How many of the role's evidence checks the REVIEW_NOTES section shows."""
    lines = (review_text or "").splitlines()
    start = _first_marker_line(lines, "REVIEW_NOTES")
    if start is None:
        return 0
    notes = "\n".join(lines[start:])
    return sum(1 for pattern in _evidence_patterns(review_role) if re.search(pattern, notes, re.IGNORECASE))


def is_review_approved(review_text: str, review_cycle: int, review_role: str) -> bool:
    """Approval counts only if stated, late enough, and (optionally) backed by evidence."""
    if review_verdict(review_text) != "APPROVED":
        return False
    if review_cycle < MIN_REVIEW_CYCLES_BEFORE_APPROVAL:
        return False
    if REQUIRE_REVIEW_EVIDENCE:
        return review_evidence_matches(review_text, review_role) >= REVIEW_EVIDENCE_MIN_MATCH
    return True


# ==========================================================================
# 5. Condensation
# ==========================================================================

_UPSTREAM_PLACEHOLDER = ("(No upstream output: this run was started at a later agent with START_AGENT. "
                         "Work from the OpenSpec artifacts and code already on disk.)")
EXPLORE_BACK_REFERENCE = "(Same as initial turn -- refer to your conversation history.)"
UPSTREAM_BACK_REFERENCE = "(Same as in your previous cycle -- refer to your conversation history.)"

# A top-level labelled line: "- Files changed: ...", "**Files changed:**", "## Files changed".
_LABEL_LINE = re.compile(r"^(?:[-*+]\s+|\d+[.)]\s+)?\**([A-Za-z][A-Za-z0-9 _/&()'-]*?)\**\s*:|^#{1,6}\s+(.+?)\s*#*$")


def _head(text: str, max_lines: int) -> str:
    return "\n".join((text or "").strip().splitlines()[:max_lines])


def _first_marker_line(lines: list[str], marker: str) -> int | None:
    """Index of the first line that starts (after markdown decoration) with `marker:`."""
    pattern = re.compile(r"^\W*" + re.escape(marker) + r"\W*:")
    for index, line in enumerate(lines):
        if pattern.match(line):
            return index
    return None


def extract_review_notes(text: str) -> str:
    """The REVIEW_NOTES section onward, capped at MAX_FEEDBACK_LINES (else the head of the text)."""
    lines = (text or "").strip().splitlines()
    start = _first_marker_line(lines, "REVIEW_NOTES")
    if start is None:
        return _head(text, MAX_FEEDBACK_LINES)
    return "\n".join(lines[start:start + MAX_FEEDBACK_LINES]).strip()


def extract_test_evidence(text: str) -> str:
    """The RESULT line plus the EVIDENCE section, capped at MAX_TEST_EVIDENCE_LINES."""
    lines = (text or "").strip().splitlines()
    evidence = _first_marker_line(lines, "EVIDENCE")
    if evidence is None:
        return _head(text, MAX_TEST_EVIDENCE_LINES)
    result = _first_marker_line(lines, "RESULT")
    kept = lines[evidence:]
    if result is not None and result < evidence:
        kept = [lines[result]] + kept
    return "\n".join(kept[:MAX_TEST_EVIDENCE_LINES]).strip()


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
    lines = (text or "").strip().splitlines()
    start = _first_marker_line(lines, "ANALYST_SUMMARY")
    if start is None:
        return _head(text, MAX_CROSS_PHASE_LINES)
    return "\n".join(lines[start:start + MAX_CROSS_PHASE_LINES]).strip()


def condense_programmer_for_tester(text: str) -> str:
    """The 'Files changed' and 'Behavior implemented' sections, capped at MAX_CROSS_PHASE_LINES."""
    if not (text or "").strip():
        return ""
    if not CONDENSE_CROSS_PHASE or text == _UPSTREAM_PLACEHOLDER:
        return text.strip()
    kept = _labelled_sections(text.strip(), ("files changed", "behavior implemented", "behaviour implemented"))
    if not kept:
        return _head(text, MAX_CROSS_PHASE_LINES)
    return "\n".join(kept[:MAX_CROSS_PHASE_LINES]).strip()


def _once_per_terminal(block: str, terminal_id: str, text: str, back_reference: str = EXPLORE_BACK_REFERENCE) -> str:
    """Full text the first time a terminal gets this block, a back-reference afterwards.

    A block is text that stays the same for the whole run (the task, a role's
    checks and answer format): the agent keeps it in its conversation, so
    sending it again would only fill its context.
    """
    if not terminal_id:                 # no terminal yet, so no history to refer to
        return text
    mark = f"{block}:{terminal_id}"
    if mark in context_sent:
        if CONDENSE_EXPLORE_ON_REPEAT:
            return back_reference
    else:
        context_sent.add(mark)
        context_new.append(mark)
    return text


def explore_block_for(terminal_id: str) -> str:
    """The explore summary, in full only on the first send to this terminal."""
    return _once_per_terminal("explore", terminal_id, EXPLORE_SUMMARY)


def scenario_block_for(terminal_id: str) -> str:
    """The scenario test, in full only on the first send to this terminal."""
    return _once_per_terminal("scenario", terminal_id, SCENARIO_TEST)


def forget_context_sent(terminal_id: str) -> None:
    """A send failed: the terminal may lack the text sent once per terminal, so send it in full next time."""
    for mark in [m for m in context_sent if m.endswith(":" + terminal_id)]:
        context_sent.discard(mark)


def take_context_new(terminal_id: str) -> list[str]:
    """What the prompt about to go to this terminal carries in full (kept with the prompt in flight)."""
    taken = [m for m in context_new if m.endswith(":" + terminal_id)]
    context_new.clear()
    return taken


def forget_in_flight_context() -> None:
    """On resume: the prompt in flight may never have arrived, so what it carried in full goes in full again.

    If it did arrive, its turn is taken over without sending anything, and
    building the prompt again records the text as sent once more.
    """
    marks = in_flight.get("sent_in_full")
    if isinstance(marks, list):
        context_sent.difference_update(m for m in marks if isinstance(m, str))


# --------------------------------------------------------------------------
# OpenSpec stories (STORY_MODE): what the programmer works through one by one.
# --------------------------------------------------------------------------

STORY_HEADING = re.compile(r"^##\s+(\d+)\.?\s+(.*?)\s*#*\s*$")
TASK_LINE = re.compile(r"^\s*[-*]\s+\[([ xX])\]\s+(.*?)\s*$")
SCENARIO_HEADING = re.compile(r"^####\s+Scenario:\s*(.*?)\s*$")
SCENARIO_STEP = re.compile(r"^\s*(?:[-*]\s+)?\**(GIVEN|WHEN|THEN|AND)\b", re.IGNORECASE)
PROMISE_TAG = re.compile(r"<promise>\s*(.*?)\s*</promise>", re.DOTALL | re.IGNORECASE)


@dataclass
class Story:
    """One `## N. Title` section of tasks.md and its checkbox tasks."""

    id: str
    title: str
    tasks: list[tuple[bool, str]]     # (done, "N.M text")

    @property
    def finished(self) -> bool:
        return bool(self.tasks) and all(done for done, _ in self.tasks)


def find_story_change() -> Path:
    """The change directory story mode works on: STORY_CHANGE, or the only one there is."""
    changes = Path(WD) / "openspec" / "changes"
    if STORY_CHANGE:
        chosen = changes / STORY_CHANGE
        if not chosen.is_dir():
            raise RunError(f"story mode: STORY_CHANGE={STORY_CHANGE} but {chosen} is not a directory")
        return chosen
    found = sorted(p.name for p in changes.iterdir() if p.is_dir() and p.name != "archive") \
        if changes.is_dir() else []
    if len(found) != 1:
        what = ", ".join(found) if found else "no change directory"
        raise RunError(f"story mode needs exactly one OpenSpec change in {changes}, found {what}: "
                       "set STORY_CHANGE to the change to work on")
    return changes / found[0]


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
    tags = PROMISE_TAG.findall(reply or "")
    for tag in reversed(tags):
        if tag.upper() == "COMPLETE":
            return "COMPLETE", ""
        failed = re.match(r"FAILED\b\s*:?\s*(.*)", tag, re.DOTALL | re.IGNORECASE)
        if failed:
            return "FAILED", failed.group(1).strip() or "(no reason given)"
    return "", ""


# ==========================================================================
# 6. Prompt builders
# ==========================================================================

def _or_none(text: str) -> str:
    return text.strip() if text and text.strip() else "(none)"


def _test_command_line() -> str:
    if PROJECT_TEST_CMD:
        return f"Test command: {PROJECT_TEST_CMD}"
    return "Test command: none configured -- find and run the project's own test suite."


def _task_context(role: str) -> str:
    """The task and its scenario test; one back-reference line for both once the terminal has them."""
    terminal_id = terminal_ids.get(role, "")
    explore, scenario = explore_block_for(terminal_id), scenario_block_for(terminal_id)
    if explore == scenario == EXPLORE_BACK_REFERENCE:
        return f"Explore summary and scenario test:\n{EXPLORE_BACK_REFERENCE}"
    return (f"Explore summary (the task):\n{explore}\n\n"
            f"Scenario test (how the result will be checked):\n{scenario}")


def _you_are(role: str, title: str) -> str:
    """'You are the <title> in a five-agent development loop': the loop is named on the first prompt only."""
    return f"You are the {title}" + _standing(role, "intro", " in a five-agent development loop", "")


def _standing(role: str, block: str, text: str, back_reference: str) -> str:
    """A role's fixed instructions (checks, answer format) in full on its terminal's first prompt only.

    The back-reference names what it stands for and keeps the words the loop
    reads back (REVIEW_RESULT, section labels), so nothing is left implicit.
    """
    return _once_per_terminal(block, terminal_ids.get(role, ""), text, back_reference)


def _response_file_block(role: str) -> str:
    """Where to write the answer, in every prompt; the example command only in the terminal's first one."""
    return _standing(role, "response-file", response_file_instruction(role),
                     "Response file (required; as in your first turn):\n"
                     f"Write your complete answer to this file: {response_path(role)}\n"
                     "Only this file is read; write it once, when your work is done.")


def _review_back_reference(checks: str, author: str) -> str:
    """What a reviewer is told in place of the checklist and answer format it already has."""
    return (f"Checks and answer format: as in your first review -- four checks ({checks}), each with "
            f"evidence; REVIEW_RESULT: APPROVED or REVISE, then REVIEW_NOTES: (for REVISE, what {author} "
            f"must change).")


def build_analyst_prompt(round_num: int, analyst_cycle: int) -> str:
    """Analyst turn: turn the task into an OpenSpec change and a five-part summary."""
    parts = [
        _you_are("analyst", "system analyst")
        + f" (round {round_num} of {MAX_ROUNDS}, analyst cycle {analyst_cycle} of {MAX_REVIEW_CYCLES}).",
        _task_context("analyst"),
        f"Latest tester feedback:\n{_or_none(feedback)}",
    ]
    if round_num > 1 and programmer_context_for_retry.strip():
        parts.append(f"Previous round programmer changes (context only):\n{programmer_context_for_retry.strip()}")
    parts += [
        f"Latest peer analyst feedback:\n{_or_none(analyst_feedback)}",
        "Rules:\n"
        "- Do not write or change application code or tests; your work is the OpenSpec change.\n"
        f"- Work only inside {WD}.\n"
        "- Do not ask questions: make reasonable assumptions and state them in your summary.\n"
        "- Address every point of the feedback above.",
        "Task:\n"
        "1. Use /opsx:explore to study the code and the task, then /opsx:ff to create or update the "
        "OpenSpec change (proposal.md, design.md, specs, tasks.md).\n"
        + _standing("analyst", "answer-format",
                    "2. Answer with this summary; all five sections are mandatory:\n"
                    "ANALYST_SUMMARY:\n"
                    "- Change: <OpenSpec change name and directory>\n"
                    "- Artifacts: <files created or updated>\n"
                    "- P1 requirements: <must-have requirements, each traced to the task or the scenario test>\n"
                    "- Contracts: <interfaces, data formats and commands the programmer and tester rely on>\n"
                    "- Handoff: <actionable first steps for the programmer; open risks>",
                    "2. Answer with the ANALYST_SUMMARY as in your first turn; all five sections are "
                    "mandatory: Change, Artifacts, P1 requirements, Contracts, Handoff."),
        _response_file_block("analyst"),
    ]
    return "\n\n".join(parts)


def build_analyst_review_prompt(analyst_out: str) -> str:
    """Peer analyst turn: check the analyst's change and say APPROVED or REVISE with evidence."""
    return "\n\n".join([
        _you_are("peer_analyst", "peer analyst") + f" (round {current_round} of {MAX_ROUNDS}, "
        f"review cycle {phase_cycle} of {MAX_REVIEW_CYCLES}). Review the system analyst's work.",
        _task_context("peer_analyst"),
        f"System analyst output to review:\n{_or_none(analyst_out)}",
        "Rules:\n"
        "- Review only: change no file except your response file.\n"
        "- Judge the OpenSpec artifacts on disk, not only the summary.",
        _standing("peer_analyst", "review-checks",
                  "Check, citing what you looked at:\n"
                  "1. Artifacts: the change's proposal, design, specs and tasks exist and match the task.\n"
                  "2. P1 traceability: every P1 requirement traces to the task or the scenario test.\n"
                  "3. Downstream contracts: interfaces, formats and commands are exact enough to code and "
                  "test against.\n"
                  "4. Handoff: the programmer's first steps are actionable.\n\n"
                  "Answer format:\n"
                  "REVIEW_RESULT: APPROVED  (or REVIEW_RESULT: REVISE)\n"
                  "REVIEW_NOTES:\n"
                  "- <one line of evidence per check above>\n"
                  "- <for REVISE: each change the analyst must make>",
                  _review_back_reference("Artifacts, P1 traceability, Downstream contracts, Handoff",
                                         "the analyst")),
        _response_file_block("peer_analyst"),
    ])


def build_programmer_prompt(round_num: int, programmer_cycle: int, analyst_out: str) -> str:
    """Programmer turn: implement the change (round 1) or fix the failed test (retry rounds)."""
    repeat = programmer_cycle > 1 and CONDENSE_UPSTREAM_ON_REPEAT
    if round_num == 1:
        handoff = UPSTREAM_BACK_REFERENCE if repeat else _or_none(condense_analyst_for_programmer(analyst_out))
        parts = [
            _you_are("programmer", "programmer") + f" (round {round_num} of {MAX_ROUNDS}, "
            f"programmer cycle {programmer_cycle} of {MAX_REVIEW_CYCLES}).",
            _task_context("programmer"),
            f"System analyst handoff:\n{handoff}",
        ]
        if analyst_feedback.strip():
            notes = UPSTREAM_BACK_REFERENCE if repeat else analyst_feedback.strip()
            parts.append(f"Open peer analyst notes (the analysis was not approved; keep them in mind):\n{notes}")
        task = ("Task:\n"
                "1. Use /opsx:apply to implement the tasks of the OpenSpec change; mark each finished task "
                "in tasks.md.\n"
                "2. Run the tests and fix what fails.")
    else:
        failure = UPSTREAM_BACK_REFERENCE if repeat else _or_none(feedback)
        parts = [
            _you_are("programmer", "programmer") + f" (round {round_num} of {MAX_ROUNDS}: "
            f"a retry after a failed test; programmer cycle {programmer_cycle} of {MAX_REVIEW_CYCLES}).",
            _task_context("programmer"),
            f"Test failure feedback:\n{failure}",
        ]
        if programmer_context_for_retry.strip():
            previous = UPSTREAM_BACK_REFERENCE if repeat else programmer_context_for_retry.strip()
            parts.append(f"Your previous changes (context):\n{previous}")
        task = ("Task:\n"
                "1. Use /opsx:explore to investigate the failure against the code and the OpenSpec change.\n"
                "2. If the failure shows that the spec or design is wrong, you may update the OpenSpec "
                "artifacts with /opsx:ff; say so in your summary.\n"
                "3. Fix the code, run the tests and fix what fails.")
    parts += [
        f"Latest peer programmer feedback:\n{_or_none(programmer_feedback)}",
        "Rules:\n"
        f"- Work only inside {WD}.\n"
        "- Never weaken, skip or delete a test to make it pass.\n"
        "- Do not ask questions: make reasonable assumptions and state them in your summary.\n"
        f"- {_test_command_line()}",
        task,
        _standing("programmer", "answer-format",
                  "Answer format:\n"
                  "PROGRAMMER_SUMMARY:\n"
                  "- Files changed: <each file and what changed in it>\n"
                  "- Behavior implemented: <what the code now does, per requirement>\n"
                  "- Tests run: <commands and results>\n"
                  "- Known gaps: <anything left undone, or none>",
                  "Answer format: as in your first turn -- PROGRAMMER_SUMMARY: with Files changed, "
                  "Behavior implemented, Tests run, Known gaps."),
        _response_file_block("programmer"),
    ]
    return "\n\n".join(parts)


def build_programmer_review_prompt(programmer_out: str) -> str:
    """Peer programmer turn: check the change and say APPROVED or REVISE with evidence."""
    return "\n\n".join([
        _you_are("peer_programmer", "peer programmer") + f" (round {current_round} of {MAX_ROUNDS}, "
        f"review cycle {phase_cycle} of {MAX_REVIEW_CYCLES}). Review the programmer's work.",
        _task_context("peer_programmer"),
        f"Programmer output to review:\n{_or_none(programmer_out)}",
        "Rules:\n"
        "- Review only: change no file except your response file.\n"
        "- Read the changed code and run the tests yourself.\n"
        f"- {_test_command_line()}",
        _standing("peer_programmer", "review-checks",
                  "Check, citing what you looked at:\n"
                  "1. Tests: they run and pass (give the command and its result).\n"
                  "2. Files: the changed files do what the tasks ask (name them).\n"
                  "3. Requirements: each requirement and the scenario test is covered by the code.\n"
                  "4. Edge cases and error handling: no obvious regression or unhandled error.\n\n"
                  "Answer format:\n"
                  "REVIEW_RESULT: APPROVED  (or REVIEW_RESULT: REVISE)\n"
                  "REVIEW_NOTES:\n"
                  "- <one line of evidence per check above>\n"
                  "- <for REVISE: each change the programmer must make>",
                  _review_back_reference("Tests, Files, Requirements, Edge cases and error handling",
                                         "the programmer")),
        _response_file_block("peer_programmer"),
    ])


def build_tester_prompt(programmer_out: str) -> str:
    """Tester turn: run the scenario test and report PASS or FAIL with evidence."""
    parts = [
        _you_are("tester", "tester") + f" (round {current_round} of {MAX_ROUNDS}).",
        _task_context("tester"),
        f"Programmer handoff:\n{_or_none(condense_programmer_for_tester(programmer_out))}",
    ]
    if programmer_feedback.strip():
        parts.append(f"Open peer programmer notes (the code was not approved; check these too):\n"
                     f"{programmer_feedback.strip()}")
    parts += [
        "Rules:\n"
        "- Test only: do not change application code, tests or OpenSpec artifacts.\n"
        f"- {_test_command_line()}",
        "Task: run the test command and carry out the scenario test step by step.",
        _standing("tester", "answer-format",
                  "Answer format:\n"
                  "RESULT: PASS  (or RESULT: FAIL)\n"
                  "EVIDENCE:\n"
                  "- <commands run and the output that matters>\n"
                  "- <for FAIL: the failing step, error messages, stack trace lines>\n"
                  "- Recommended next fix: <for FAIL: where to look first>",
                  "Answer format: as in your first turn -- RESULT: PASS or RESULT: FAIL, then EVIDENCE: "
                  "(for FAIL the failing step and a recommended next fix)."),
        _response_file_block("tester"),
    ]
    return "\n\n".join(parts)


def _story_tasks_block(story: Story) -> str:
    if not story.tasks:
        return "(no tasks defined)"
    return "\n".join(f"- [{'x' if done else ' '}] {text}" for done, text in story.tasks)


def _scenarios_block(scenarios: list[tuple[str, str, list[str]]]) -> str:
    if not scenarios:
        return "(no scenarios defined)"
    return "\n".join(f"[{capability}] Scenario: {name}" + "".join(f"\n  {step}" for step in steps)
                     for capability, name, steps in scenarios)


def story_tool_instructions() -> str:
    """How the agent records progress in the OpenSpec change (the spec tool's own convention)."""
    return ("Marking progress: when a task of this story is done and verified, change its line in tasks.md "
            "from `- [ ]` to `- [x]` (keep the task number and text as they are). Do not tick tasks of "
            "other stories.")


def build_story_prompt(story: Story, change_dir: Path, scenarios: list, attempt: int, retry_reason: str) -> str:
    """Programmer turn in story mode: one story of the change, ending in a promise signal."""
    parts = [
        _you_are("programmer", "programmer") + f" (round {current_round} of {MAX_ROUNDS}), "
        f"working story by story. This turn: story {story.id} \"{story.title}\" "
        f"(attempt {attempt} of {MAX_STORY_ATTEMPTS}).",
        _task_context("programmer"),
    ]
    if current_round > 1 and feedback.strip():
        parts.append(f"Test failure feedback:\n{feedback.strip()}")
    if retry_reason:
        parts.append(f"Retry of story {story.id} -- the previous attempt failed:\n{retry_reason}\n"
                     "Try a different approach this time; do not repeat what failed.")
    parts += [
        f"Story {story.id}: {story.title}\nTasks of this story:\n{_story_tasks_block(story)}",
        "Complete only the tasks of this story. Do not start other stories: the orchestrator hands you the "
        "next story when this one is done.",
        f"Change: {change_dir}\nRead {change_dir / 'proposal.md'} and {change_dir / 'design.md'} for the "
        "context of the whole change.",
        "Scenarios of the change (focus on those relevant to this story's tasks):\n" + _scenarios_block(scenarios),
        "Verification: after completing the tasks, run the verification and fix what fails.\n"
        f"- {_test_command_line()}",
        story_tool_instructions(),
        "Rules:\n"
        f"- Work only inside {WD}.\n"
        "- Never weaken, skip or delete a test to make it pass.\n"
        "- Do not ask questions: make reasonable assumptions and state them in your summary.",
        "Completion signal (required, exactly one, at the end of your answer):\n"
        "- All tasks of this story done and verification passes: <promise>COMPLETE</promise>\n"
        "- Verification fails and you cannot fix it, or you cannot complete the story: "
        "<promise>FAILED: {reason}</promise>, where {reason} says briefly what went wrong. This lets the "
        "orchestrator retry the story with that context.\n"
        "You MUST end with one of these two signals.",
        _standing("programmer", "story-answer-format",
                  "Answer format:\n"
                  "PROGRAMMER_SUMMARY:\n"
                  "- Files changed: <each file and what changed in it>\n"
                  "- Behavior implemented: <what the code now does>\n"
                  "- Tests run: <commands and results>\n"
                  "<promise>COMPLETE</promise>  (or <promise>FAILED: reason</promise>)",
                  "Answer format: as in your first story -- PROGRAMMER_SUMMARY: with Files changed, "
                  "Behavior implemented, Tests run, then the completion signal."),
        _response_file_block("programmer"),
    ]
    return "\n\n".join(parts)


# ==========================================================================
# 7. State file
# ==========================================================================

class StateFileError(Exception):
    """The state file exists but cannot be used."""


def save_state() -> None:
    """Write the run's state atomically: a crash leaves the old file or the new one, never half."""
    data = {
        "version": 1,
        "updated_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "api": API,
        "provider": PROVIDER,
        "wd": WD,
        "prompt": PROMPT,
        "current_round": current_round,
        "current_phase": current_phase,
        "final_status": final_status,
        "session_name": session_name,
        "terminals": {role: terminal_ids.get(role, "") for role in ROLES},
        "feedback": feedback,
        "analyst_feedback": analyst_feedback,
        "programmer_feedback": programmer_feedback,
        "outputs": {key: outputs.get(key, "") for key in OUTPUT_KEYS},
        "programmer_context_for_retry": programmer_context_for_retry,
        # Keys the shell script does not know; it ignores them.
        "phase_cycle": phase_cycle,
        "phase_step": phase_step,
        "run_dir": run_dir,
        "context_sent": sorted(context_sent),
        "terminals_exited": terminals_exited,
        "in_flight": in_flight or None,
        "story_progress": story_progress or None,
        "turn_records": turn_records,
        "worktree_at_start": worktree_at_start,
        "after_run": after_run or None,
    }
    path = Path(STATE_FILE)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=2, ensure_ascii=False)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def read_state_file() -> dict | None:
    """The state file's JSON object, None if there is none; StateFileError if unusable."""
    path = Path(STATE_FILE)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StateFileError(f"state file {path} cannot be parsed ({exc})") from None
    if not isinstance(data, dict):
        raise StateFileError(f"state file {path} does not hold a JSON object")
    if data.get("version", 1) != 1:
        raise StateFileError(f"state file {path} has version {data.get('version')!r}; only version 1 is known")
    terminals = data.get("terminals", {})
    if not isinstance(terminals, dict) or not all(isinstance(v, str) for v in terminals.values()):
        raise StateFileError(f"state file {path}: 'terminals' must map roles to terminal id strings")
    if not isinstance(data.get("outputs", {}), dict):
        raise StateFileError(f"state file {path}: 'outputs' must be an object")
    return data


def _text(data: dict, key: str) -> str:
    value = data.get(key, "")
    return value if isinstance(value, str) else ""


def _positive_int(value: object, default: int) -> int:
    """An int from a state value written by either script; the default if it is not one."""
    if isinstance(value, bool):
        return default
    if isinstance(value, int):
        number = value
    elif isinstance(value, str) and value.strip().isdigit():
        number = int(value.strip())
    else:
        return default
    return number if number >= 1 else default


def load_state() -> bool:
    """Restore the run from STATE_FILE; False if there is no state file."""
    global API, PROVIDER, WD, session_name, terminal_ids, current_round, current_phase, phase_cycle, \
        phase_step, final_status, feedback, analyst_feedback, programmer_feedback, \
        programmer_context_for_retry, outputs, run_dir, context_sent, terminals_exited, in_flight, story_progress, \
        turn_records, worktree_at_start, after_run
    data = read_state_file()
    if data is None:
        return False
    # What the terminals were created with, unless the user chose otherwise now.
    if "API" not in explicit_settings and _text(data, "api"):
        API = _text(data, "api")
    if "PROVIDER" not in explicit_settings and _text(data, "provider"):
        PROVIDER = _text(data, "provider")
    if "WD" not in explicit_settings and _text(data, "wd"):
        WD = _text(data, "wd")
    set_task(_text(data, "prompt"))
    session_name = _text(data, "session_name")
    terminals = data.get("terminals", {})
    terminal_ids = {role: terminals.get(role, "") for role in ROLES}
    current_round = _positive_int(data.get("current_round"), 1)
    phase = data.get("current_phase")
    current_phase = phase if phase in PHASES else PHASE_ANALYST
    phase_cycle = _positive_int(data.get("phase_cycle"), 1)
    phase_step = data.get("phase_step") if data.get("phase_step") in ("author", "review") else "author"
    final_status = _text(data, "final_status") or "RUNNING"
    feedback = _text(data, "feedback")
    analyst_feedback = _text(data, "analyst_feedback")
    programmer_feedback = _text(data, "programmer_feedback")
    programmer_context_for_retry = _text(data, "programmer_context_for_retry")
    saved_outputs = data.get("outputs", {})
    outputs = {key: saved_outputs.get(key, "") if isinstance(saved_outputs.get(key), str) else ""
               for key in OUTPUT_KEYS}
    run_dir = _text(data, "run_dir")
    marks = data.get("context_sent", [])
    context_sent = {m for m in marks if isinstance(m, str)} if isinstance(marks, list) else set()
    terminals_exited = data.get("terminals_exited") is True
    in_flight = data.get("in_flight") if isinstance(data.get("in_flight"), dict) else {}
    story_progress = data.get("story_progress") if isinstance(data.get("story_progress"), dict) else {}
    records = data.get("turn_records")
    turn_records = [r for r in records if isinstance(r, dict)] if isinstance(records, list) else []
    worktree_at_start = _fingerprints(data.get("worktree_at_start"))
    done = data.get("after_run")
    after_run = {k: v for k, v in done.items() if isinstance(k, str)} if isinstance(done, dict) else {}
    return True


def _fingerprints(value: object) -> dict | None:
    """The start-of-run worktree record if it is well formed (path -> fingerprint text), else None."""
    if not isinstance(value, dict):
        return None
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return None
    return value


def state_backup_path() -> Path:
    """Where an old state file is kept when a new run replaces it."""
    path = Path(STATE_FILE)
    return path.with_name(f"{path.name}.{datetime.now().strftime('%Y%m%d-%H%M%S')}.bak")


def describe_state(data: dict) -> str:
    """'finished with PASS in round 2, last saved 2026-11-22T10:00:00Z': what a state file holds."""
    status = data.get("final_status")
    round_text = f"round {data.get('current_round', '?')}"
    what = (f"finished with {status} in {round_text}" if status in ("PASS", "FAIL")
            else f"an unfinished run ({round_text}, {data.get('current_phase', '?')} phase)")
    return f"{what}, last saved {data.get('updated_at', 'at an unknown time')}"


# One process per run: an exclusive lock on a file beside the state file, held
# until the process ends. The operating system drops it when the process dies,
# so a killed run never blocks the next one.
run_lock = None


def acquire_run_lock() -> None:
    """Take the run's lock, or stop at once (exit 75) naming the process that holds it."""
    global run_lock
    path = Path(STATE_FILE + ".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a+", encoding="utf-8")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "a process that has not yet said its pid"
        handle.close()
        raise RunLocked(f"the run in {STATE_FILE} is being driven by {holder}; nothing was done. "
                        f"Try again when it has finished (see its log), or stop that process first") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} since {datetime.now().strftime('%Y-%m-%d %H:%M:%S')}\n")
    handle.flush()
    run_lock = handle


def lock_holder() -> str:
    """Who holds the run's lock ('' if nobody): looked at without taking it or writing anything."""
    try:
        handle = open(STATE_FILE + ".lock", encoding="utf-8")
    except OSError:
        return ""
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return handle.read().strip() or "a process"
        fcntl.flock(handle, fcntl.LOCK_UN)
    return ""


def release_run_lock() -> None:
    global run_lock
    if run_lock is not None:
        run_lock.close()
        run_lock = None


# ==========================================================================
# 8. Init and resume
# ==========================================================================

# Where a run starts for each START_AGENT: phase, step, and the outputs
# that hold _UPSTREAM_PLACEHOLDER because their agent was skipped.
START_POSITIONS = {
    "analyst": (PHASE_ANALYST, "author", ()),
    "peer_analyst": (PHASE_ANALYST, "review", ("analyst",)),
    "programmer": (PHASE_PROGRAMMER, "author", ("analyst",)),
    "peer_programmer": (PHASE_PROGRAMMER, "review", ("analyst", "programmer")),
    "tester": (PHASE_TESTER, "author", ("analyst", "programmer")),
}


def set_position(phase: str, cycle: int = 1, step: str = "author") -> None:
    """Move the loop to a phase, cycle and step: the one place the position changes."""
    global current_phase, phase_cycle, phase_step
    current_phase, phase_cycle, phase_step = phase, cycle, step


def cleanup_terminals() -> None:
    """CLEANUP_ON_EXIT: end the five agents and record it, so no resume types into their shells."""
    global terminals_exited
    log("CLEANUP_ON_EXIT=1: exiting the five agent terminals")
    exit_terminals([terminal_ids.get(role, "") for role in ROLES])
    terminals_exited = True
    save_state()


def exit_terminals(ids: list[str]) -> None:
    """Exit agent terminals, logging (not raising) what fails: used while stopping."""
    for terminal_id in ids:
        if not terminal_id:
            continue
        try:
            api.exit_terminal(terminal_id)
        except ApiError as exc:
            log(f"could not exit terminal {terminal_id}: {exc}")


@contextmanager
def signals_held(what: str) -> Iterator[list[int]]:
    """Hold Ctrl-C and SIGTERM while `what` finishes, then act on them.

    Creating terminals cannot be cut short safely: a creation the server is
    still carrying out would leave an agent nobody knows about. The list
    yielded holds the signals that arrived; on leaving, the first one is
    raised as usual (KeyboardInterrupt or Terminated).
    """
    received: list[int] = []

    def hold(signum, frame) -> None:
        if not received:
            log(f"interrupted: {what} first, so that nothing is left behind")
        received.append(signum)

    previous = {}
    try:
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, hold)
    except ValueError:                     # not the main thread: signals cannot be held here
        pass
    try:
        yield received
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if received:
        raise KeyboardInterrupt if received[0] == signal.SIGINT else Terminated()


def new_session_name() -> str:
    """A name for a new run's CAO session: recognizably this loop's, and unique by its random part.

    It starts with `cao-` because CAO stores any other name with that prefix
    added, and the terminals are added to the session under the name asked for.
    """
    return f"cao-loop-{secrets.token_hex(4)}"


def create_terminals() -> tuple[str, dict[str, str]]:
    """Create the five terminals in one CAO session, all at once.

    CAO waits for each agent CLI to start (seconds per terminal), so the
    session (with the analyst's terminal) is requested under a name chosen
    here and the other four are added to that name at the same time, without
    waiting for the session's answer (see add_to_session). A failed or
    interrupted start-up exits every terminal it created (interrupts wait for
    the creations under way), and a failure names the role. Returns the
    session name CAO answered and the terminal id of each role.
    """
    name = new_session_name()
    answers: dict[str, dict] = {}
    failures: dict[str, str] = {}
    providers = providers_in_use()
    log(f"creating the five agent terminals on {API} with provider {', '.join(providers)} in {WD}, all at once in "
        f"CAO session {name}; CAO waits for each agent CLI to start (seconds with the scripted agent, up to a "
        "minute with real CLIs)")
    with ThreadPoolExecutor(max_workers=len(ROLES)) as pool, \
            signals_held("exiting the terminals being created") as interrupted:
        session = pool.submit(api.create_session, profile_for("analyst"), provider_for("analyst"), name)
        futures = {"analyst": session}
        for role in ROLES[1:]:
            futures[role] = pool.submit(add_to_session, name, role, session, interrupted)
        for role, future in futures.items():
            try:
                answer = future.result()
            except Exception as exc:       # ApiError, or anything else: the others are still exited
                failures[role] = f"{role}: {exc}"
                continue
            if answer is not None:
                answers[role] = answer
        if failures or interrupted:
            exit_terminals([answer["id"] for answer in answers.values()])
        if failures and not interrupted:
            # A failed session explains the rest: the adds failed or stopped because of it.
            error = failures.get("analyst") or "; ".join(failures.values())
            raise RunError(f"could not create the agent terminals ({error}){start_failure_hint(error)}")
    return answers["analyst"]["session_name"], {role: answers[role]["id"] for role in ROLES}


def add_to_session(name: str, role: str, session: Future, interrupted: list[int]) -> dict | None:
    """Add the terminal of `role` to the session being created under `name`; returns CAO's answer.

    The session request gets a head start of a few hundredths of a second.
    An add that still reaches CAO before the session exists is answered 404
    "Session '<name>' not found": it is tried again after a growing pause
    while the session request is under way, and once more after it succeeded.
    It gives up, having created nothing (None), when the session request
    failed or the start-up was interrupted.
    """
    pause = 0.05
    while True:
        wait_for_futures([session], timeout=pause)
        session_finished = session.done()      # looked at before asking, so a 404 after it is final
        if interrupted or (session_finished and session.exception() is not None):
            return None
        try:
            return api.create_terminal(name, profile_for(role), provider_for(role))
        except ApiError as exc:
            if session_finished or not (exc.status_code == 404 and f"Session '{name}' not found" in str(exc)):
                raise
        pause = min(pause * 2, 0.5)


def warn_about_missing_clis() -> None:
    """Say at once when cao-server reports an agent CLI missing: its terminals would time out minutes later.

    Only a warning: CAO looks the program up on its own PATH, while the
    agents start in login shells, whose PATH can differ.
    """
    for provider, binary in api.missing_agent_clis(providers_in_use()):
        log(f"warning: cao-server at {API} reports that `{binary}`, the CLI of provider {provider}, is not "
            f"installed on its machine; creating its terminals will time out after a minute or two. Install "
            f"it (and log in) where cao-server runs, or set PROVIDER to a CLI you have")


def start_failure_hint(error: str) -> str:
    """What to do about a failed start-up whose cause CAO's own message hides or leaves unsaid.

    CAO gives up waiting for an agent CLI to start without saying why, and
    refuses a session name that is taken without saying that it was picked here.
    """
    if re.search(r"Session '[^']*' already exists", error):
        return "; another CAO session has the name this run picked at random: run it again to pick another"
    if "initialization timed out" not in error:
        return ""
    hint = ("; the agent CLI did not come up on the cao-server's machine: check that it is installed, on "
            "cao-server's PATH and logged in, and read CAO's log in ~/.aws/cli-agent-orchestrator/logs/ "
            "of the user running cao-server")
    if "Claude Code" in error:
        hint += ("; a cao-server running as root needs IS_SANDBOX=1 in its environment for Claude Code "
                 "(which otherwise refuses --dangerously-skip-permissions)")
    return hint


def init_new_run(plan: StartPlan | None = None) -> None:
    """Create the session and five terminals, reset the run, and write the first state.

    The run it replaces (`plan`) is set aside only once the new terminals
    exist, so a start that fails leaves the old state file where it was.
    """
    global session_name, terminal_ids, current_round, final_status, feedback, analyst_feedback, \
        programmer_feedback, programmer_context_for_retry, outputs, run_dir, context_sent, terminals_exited, \
        in_flight, story_progress, turn_records, worktree_at_start, after_run
    session_name, terminal_ids = create_terminals()
    settled_terminals.update(terminal_ids.values())   # CAO answered each creation once its CLI was ready
    replace_old_run(plan or StartPlan(False))
    current_round = 1
    final_status = "RUNNING"
    feedback = analyst_feedback = programmer_feedback = programmer_context_for_retry = ""
    phase, step, skipped = START_POSITIONS[START_AGENT]
    set_position(phase, 1, step)
    outputs = {key: (_UPSTREAM_PLACEHOLDER if key in skipped else "") for key in OUTPUT_KEYS}
    run_dir = new_run_dir()
    context_sent = set()
    terminals_exited = False
    in_flight = story_progress = {}
    turn_records = []
    worktree_at_start = snapshot_worktree() if COMMIT_ON_PASS else None
    after_run = {}
    save_state()
    log(f"new run: CAO session {session_name}, terminals "
        + ", ".join(f"{role}={terminal_ids[role]}" for role in ROLES)
        + f"; starting at {START_AGENT}; state in {STATE_FILE}; replies kept in {run_dir}")


def verify_resume_terminals() -> None:
    """Make sure every terminal of the saved run still exists before touching it."""
    for role in ROLES:
        terminal_id = terminal_ids.get(role, "")
        if not terminal_id:
            raise RunError(f"cannot resume: the state file {STATE_FILE} has no terminal for the {role}; "
                           "start a new run with RESUME=0")
        try:
            api.get_status(terminal_id)
        except ApiError as exc:
            if exc.status_code is None:
                raise RunError(f"cannot resume: {exc}") from None
            raise RunError(f"cannot resume: the {role} terminal {terminal_id} is not reachable ({exc}); "
                           "start a new run with RESUME=0 (the old state file is kept aside)") from None


@dataclass
class StartPlan:
    """What start_run() will do with the state file it found."""

    resume: bool
    note: str = ""                 # the first log line of a new run: what the old state file held
    old_state: dict | None = None  # a run the new one replaces: its file is kept aside, its agents exited


def choose_start() -> StartPlan:
    """Resume, report a finished run, or start a new one -- and what happens to an old state file.

    Decides only: nothing is moved or written here, so a run that then fails
    to start leaves the state file as it found it.
    """
    try:
        data = read_state_file()
    except StateFileError as exc:
        if RESUME:
            raise ConfigError(f"RESUME=1 but {exc}; fix or remove it, or unset RESUME to start a new run") from None
        return StartPlan(False, f"{exc}; starting a new run, the old file will be kept as {state_backup_path()}",
                         {})
    status = (data or {}).get("final_status")
    finished = status in ("PASS", "FAIL")
    # Input to an exited agent's terminal lands in a plain shell, so such a run is over.
    exited = data is not None and data.get("terminals_exited") is True
    if RESUME:
        if data is None:
            raise ConfigError(f"RESUME=1 but there is no state file at {STATE_FILE}: set STATE_FILE to the "
                              "run's state file, or unset RESUME to start a new run")
        if finished:
            raise ConfigError(f"RESUME=1 but the run in {STATE_FILE} already finished with {status}; "
                              "unset RESUME to start a new run")
        if exited:
            raise ConfigError(f"RESUME=1 but the agents of the run in {STATE_FILE} were exited "
                              "(CLEANUP_ON_EXIT=1), so it cannot be resumed; unset RESUME to start a new run")
        return StartPlan(True)
    if data is None:
        return StartPlan(False)
    # A finished run with after-run steps left over is finished first (start_run, under the lock).
    record = data.get("after_run") if isinstance(data.get("after_run"), dict) else {}
    leftover = finished and bool(after_run_pending(0 if status == "PASS" else 1, record))
    if finished and REPORT_FINISHED_RUN and "RESUME" not in explicit_settings and not leftover:
        raise AlreadyFinished(0 if status == "PASS" else 1,
                              f"the run in {STATE_FILE} {describe_state(data)}; REPORT_FINISHED_RUN=1, so "
                              "nothing was started (move the state file away to start a new run)")
    if status == "RUNNING" and not exited and "RESUME" not in explicit_settings:
        return StartPlan(True)
    why = " (RESUME=0)" if "RESUME" in explicit_settings else \
        " whose agents were exited (CLEANUP_ON_EXIT=1)" if status == "RUNNING" else ""
    return StartPlan(False, f"{STATE_FILE} holds {describe_state(data)}{why}; starting a new run, the old state "
                            f"file will be kept as {state_backup_path()}", data)


def replace_old_run(plan: StartPlan) -> None:
    """The new run's terminals exist: keep the old state file aside and exit the old run's agents."""
    if plan.old_state is None:
        return
    target = state_backup_path()
    os.replace(STATE_FILE, target)
    log(f"kept the old state file as {target}")
    old = plan.old_state
    ids = [i for i in (old.get("terminals") or {}).values() if isinstance(i, str) and i]
    if not ids or old.get("terminals_exited") is True:
        return
    if str(old.get("api", API)).rstrip("/") != API.rstrip("/"):
        log(f"the replaced run's agents (CAO session {old.get('session_name')}) ran on {old.get('api')}, "
            "another server: left alone")
        return
    exited = 0
    for terminal_id in ids:
        try:
            api.exit_terminal(terminal_id)
            exited += 1
        except ApiError as exc:
            if exc.status_code != 404:
                log(f"could not exit terminal {terminal_id} of the replaced run: {exc}")
    log(f"exited {exited} agent terminal(s) of the replaced run (CAO session {old.get('session_name')})"
        if exited else f"the replaced run's agents (CAO session {old.get('session_name')}) are gone already")


# ==========================================================================
# 9. Main loop
# ==========================================================================

PHASE_ROLES = {PHASE_ANALYST: ("analyst", "peer_analyst"), PHASE_PROGRAMMER: ("programmer", "peer_programmer")}
PHASE_OUTPUTS = {PHASE_ANALYST: ("analyst", "analyst_review"), PHASE_PROGRAMMER: ("programmer", "programmer_review")}
NEXT_PHASE = {PHASE_ANALYST: PHASE_PROGRAMMER, PHASE_PROGRAMMER: PHASE_TESTER}


def set_review_feedback(phase: str, text: str) -> None:
    """What the phase's author is told about its last review."""
    global analyst_feedback, programmer_feedback
    if phase == PHASE_ANALYST:
        analyst_feedback = text
    else:
        programmer_feedback = text


def author_prompt(phase: str, cycle: int) -> str:
    if phase == PHASE_ANALYST:
        return build_analyst_prompt(current_round, cycle)
    return build_programmer_prompt(current_round, cycle, outputs["analyst"])


def review_prompt(phase: str) -> str:
    if phase == PHASE_ANALYST:
        return build_analyst_review_prompt(outputs["analyst"])
    return build_programmer_review_prompt(outputs["programmer"])


def set_story_progress(progress: dict) -> None:
    global story_progress
    story_progress = progress


def story_loop_due() -> bool:
    """Story mode replaces the round's first programmer turn while the change has unfinished stories."""
    if not STORY_MODE:
        return False
    if story_progress:
        return True                      # resumed inside the story loop
    change = find_story_change()
    stories = parse_stories(_read_text(change / "tasks.md"))
    if not stories:
        log_turn("programmer", f"story mode: no '## N. Title' stories in {change / 'tasks.md'}; "
                               "a normal programmer turn instead")
    return any(not story.finished for story in stories)


def run_story_loop() -> str:
    """Each unfinished story in turn, retried on FAILED or no signal; returns the combined summary."""
    change = find_story_change()
    stories = {story.id: story for story in parse_stories(_read_text(change / "tasks.md"))}
    scenarios = parse_scenarios(change / "specs")
    if not story_progress:
        queue = [story.id for story in stories.values() if not story.finished]
        set_story_progress({"change": str(change), "queue": queue, "current": queue[0], "attempt": 1,
                            "last_failure": "", "results": []})
        save_state()
    progress = story_progress
    while progress.get("current"):
        story = stories.get(progress["current"]) or Story(progress["current"], f"Story {progress['current']}", [])
        attempt = progress["attempt"]
        prompt = build_story_prompt(story, change, scenarios, attempt, progress["last_failure"])
        try:
            reply = ask_agent("programmer", prompt)
            signal_name, reason = promise_signal(reply)
        except RunError as exc:          # timeout, error, no file: an abnormal end, retried as such
            log_turn("programmer", f"story {story.id} attempt {attempt} ended abnormally: {exc.message}")
            reply, signal_name, reason = "", "", ""
        log_turn("programmer", f"story {story.id} attempt {attempt}/{MAX_STORY_ATTEMPTS}: "
                               + (f"{signal_name} {reason}".strip() if signal_name else "no completion signal"))
        if signal_name == "COMPLETE" or attempt >= MAX_STORY_ATTEMPTS:
            status = "COMPLETE" if signal_name == "COMPLETE" else "FAILED"
            progress["results"].append({
                "id": story.id, "title": story.title, "status": status, "attempts": attempt,
                "reason": "" if status == "COMPLETE" else (reason or "no completion signal"),
                "summary": condense_programmer_for_tester(reply)})
            queue = progress["queue"]
            following = queue[queue.index(story.id) + 1:] if story.id in queue else []
            progress.update(current=following[0] if following else "", attempt=1, last_failure="")
        else:
            progress.update(attempt=attempt + 1, last_failure=reason if signal_name == "FAILED" else "")
        save_state()
    combined = story_summary(progress["results"])
    set_story_progress({})
    return combined


def story_summary(results: list[dict]) -> str:
    """What the peer programmer reviews after the story loop: each story's outcome and changes."""
    lines = ["PROGRAMMER_SUMMARY (story by story):", "Story results:"]
    for result in results:
        outcome = (f"COMPLETE (attempt {result['attempts']})" if result["status"] == "COMPLETE"
                   else f"FAILED after {result['attempts']} attempts -- {result['reason']}")
        lines.append(f"- Story {result['id']} \"{result['title']}\": {outcome}")
    for result in results:
        if result.get("summary"):
            lines += [f"Story {result['id']}:", result["summary"]]
    return "\n".join(lines)


def run_reviewed_phase(phase: str) -> None:
    """Author and peer reviewer take turns until an approval counts or the cycles run out."""
    author, reviewer = PHASE_ROLES[phase]
    out_key, review_key = PHASE_OUTPUTS[phase]
    while True:
        cycle = phase_cycle
        if phase_step == "author":
            if phase == PHASE_PROGRAMMER and cycle == 1 and story_loop_due():
                outputs[out_key] = run_story_loop()
            else:
                outputs[out_key] = ask_agent(author, author_prompt(phase, cycle))
            set_position(phase, cycle, "review")
            save_state()
        review = ask_agent(reviewer, review_prompt(phase))
        outputs[review_key] = review
        verdict = review_verdict(review)
        approved = is_review_approved(review, cycle, reviewer)
        note_turn_outcome(verdict if approved else f"{verdict} (not counted)")
        if approved:
            log_turn(reviewer, f"verdict {verdict}: approved")
            set_review_feedback(phase, "")
            set_position(NEXT_PHASE[phase])
        else:
            log_turn(reviewer, f"verdict {verdict}; approval not counted: {_why_not_approved(verdict, review, cycle, reviewer)}")
            set_review_feedback(phase, review_feedback_from(review))
            if cycle >= MAX_REVIEW_CYCLES:
                log_turn(reviewer, f"no approval after {MAX_REVIEW_CYCLES} cycles; going on with the last "
                                   "review notes carried forward")
                set_position(NEXT_PHASE[phase])
            else:
                set_position(phase, cycle + 1, "author")
        save_state()
        if current_phase != phase:
            return


def _why_not_approved(verdict: str, review: str, cycle: int, reviewer: str) -> str:
    """A short reason for the log when a review does not count as approval."""
    if verdict != "APPROVED":
        return "reviewer asks for changes" if verdict == "REVISE" else "no REVIEW_RESULT line"
    if cycle < MIN_REVIEW_CYCLES_BEFORE_APPROVAL:
        return f"approval counts from cycle {MIN_REVIEW_CYCLES_BEFORE_APPROVAL}"
    return (f"REVIEW_NOTES show {review_evidence_matches(review, reviewer)} of the "
            f"{REVIEW_EVIDENCE_MIN_MATCH} evidence checks required")


def tester_result(text: str) -> str:
    """PASS only if the last RESULT line says so; anything else is a FAIL."""
    results = re.findall(r"^\W*RESULT\W*:\W*([A-Za-z]+)", text or "", re.MULTILINE)
    return "PASS" if results and results[-1].upper() == "PASS" else "FAIL"


def handle_tester_fail() -> None:
    """Set up the retry round: programmer -> peer programmer -> tester, with the failure evidence."""
    global feedback, programmer_context_for_retry, analyst_feedback, programmer_feedback, current_round
    feedback = extract_test_evidence(outputs["tester"])
    programmer_out = outputs["programmer"]
    programmer_context_for_retry = ("" if programmer_out == _UPSTREAM_PLACEHOLDER
                                    else condense_programmer_for_tester(programmer_out))
    for key in ("programmer", "programmer_review", "tester"):
        outputs[key] = ""
    analyst_feedback = programmer_feedback = ""
    set_story_progress({})
    set_position(PHASE_PROGRAMMER)
    current_round += 1


def run_tester_phase() -> str:
    """One tester turn; returns PASS or FAIL."""
    global final_status
    outputs["tester"] = ask_agent("tester", build_tester_prompt(outputs["programmer"]))
    result = tester_result(outputs["tester"])
    note_turn_outcome(result)
    log_turn("tester", f"RESULT: {result}")
    for line in extract_test_evidence(outputs["tester"]).splitlines():
        print(f"    {line}", flush=True)
    if result == "PASS":
        final_status = "PASS"
        mark_after_run_due(0)
        set_position(PHASE_DONE)
    else:
        handle_tester_fail()
    save_state()
    return result


def run_loop() -> int:
    """Drive the phases to PASS (0) or FAIL (1), then do what the user asked for after a run (section 10).

    A stop that needs a person (an agent error, a timeout, an unreachable
    server) is announced on its way out to main().
    """
    try:
        code = drive_rounds()
    except (RunError, ApiError) as exc:
        notify_stopped(exc)
        raise
    return finish_run(code)


def drive_rounds() -> int:
    """Drive the phases until the tester passes (0) or the rounds run out (1)."""
    global final_status
    while current_round <= MAX_ROUNDS:
        if current_phase == PHASE_PROGRAMMER and not outputs["analyst"].strip():
            log_turn("programmer", "no analyst output to work from; falling back to the analyst phase")
            set_position(PHASE_ANALYST)
        elif current_phase == PHASE_TESTER and not outputs["programmer"].strip():
            log_turn("tester", "no programmer output to test; falling back to the programmer phase")
            set_position(PHASE_PROGRAMMER)
        elif current_phase == PHASE_DONE:
            set_position(PHASE_TESTER)      # a RUNNING state left at "done": the test decides
        elif current_phase == PHASE_TESTER:
            if run_tester_phase() == "PASS":
                log(f"PASS in round {current_round}; state in {STATE_FILE}")
                return 0
        else:
            run_reviewed_phase(current_phase)
    final_status = "FAIL"
    mark_after_run_due(1)
    set_position(PHASE_DONE)
    save_state()
    log(f"FAIL: no PASS within MAX_ROUNDS={MAX_ROUNDS}; state in {STATE_FILE}")
    return 1


def run_summary(exit_code: int) -> dict:
    """What the run did, from its turn records: for the last log lines and for CI dashboards."""
    roles = {}
    for role in ROLES:
        mine = [r for r in turn_records if r.get("role") == role]
        seconds = [r["seconds"] for r in mine if isinstance(r.get("seconds"), (int, float))]
        roles[role] = {"turns": len(mine), "seconds": round(sum(seconds), 1),
                       "outcomes": [r["outcome"] for r in mine if r.get("outcome")]}
    return {
        "result": final_status, "exit_code": exit_code, "rounds": current_round, "max_rounds": MAX_ROUNDS,
        "turns": len(turn_records),
        "agent_seconds": round(sum(r["seconds"] for r in turn_records
                                   if isinstance(r.get("seconds"), (int, float))), 1),
        "prompt_bytes": sum(r.get("prompt_bytes", 0) for r in turn_records),
        "roles": roles, "session_name": session_name, "state_file": STATE_FILE, "run_dir": run_dir,
        "after_run": after_run,
    }


def report_run_summary(exit_code: int) -> None:
    """Log the run's summary and keep it as summary.json in the run's archive directory."""
    summary = run_summary(exit_code)
    per_role = ", ".join(f"{role} {r['turns']}x {r['seconds']:g}s" for role, r in summary["roles"].items()
                         if r["turns"])
    log(f"summary: {summary['result']} after round {summary['rounds']}/{summary['max_rounds']}; "
        f"{summary['turns']} turns, {summary['agent_seconds']:g}s of agent time ({per_role or 'none'}); "
        f"{summary['prompt_bytes'] / 1000:.1f} KB of prompts")
    verdicts = [f"{role}: {' -> '.join(r['outcomes'])}" for role, r in summary["roles"].items() if r["outcomes"]]
    if verdicts:
        log("summary: " + "; ".join(verdicts))
    if run_dir:
        path = Path(run_dir) / "summary.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        log(f"summary written to {path}")


# ==========================================================================
# 10. After the run: archive, commit, notify
# ==========================================================================
# Opt-in steps for runs nobody watches (ARCHIVE_ON_PASS, COMMIT_ON_PASS,
# NTFY_TOPIC). Each is done at most once per run -- after_run in the state
# file records it -- and none of them can turn a PASS into a failure: what
# goes wrong is logged with how to fix it, and the run's exit code stands.

GIT_TIMEOUT_SECONDS = 60.0
GIT_COMMIT_TIMEOUT_SECONDS = 300.0      # a commit hook may run the project's checks
NOTIFY_TIMEOUT_SECONDS = 5.0
HASH_LIMIT_BYTES = 64 * 1024 * 1024     # bigger files are fingerprinted by size and mtime only
FALLBACK_GIT_IDENTITY = ("cao-orchestrator-loop", "orchestrator-loop@localhost")
OPENSPEC_PACKAGE = "@fission-ai/openspec"
# Keep an unattended archive from phoning home or asking anything.
OPENSPEC_ENV = {"OPENSPEC_TELEMETRY": "0", "DO_NOT_TRACK": "1", "CI": "1"}

# A new file whose path holds one of these characters, or a part that is a
# heredoc end marker, is taken for an agent's accident (a broken heredoc or
# redirection writes files named `EOF)` or `x = 1`) and never committed.
ACCIDENT_CHARACTERS = frozenset("=()'\"$`;|<>&\\")
HEREDOC_MARKER_RE = re.compile(r"(?:[A-Z]+_)?EOF(?:_[A-Z]+)?|PYEOF|SHEOF|EOT|END|EOL|HEREDOC")


def is_accident_name(path: str) -> bool:
    """True for a path an agent surely did not mean to create: shell or code characters, a heredoc marker.

    Every part of the path counts, so `$(pwd)/notes.md` is caught too.
    Spaces, dots, dashes, brackets and non-ASCII letters alone are normal names.
    """
    for part in path.split("/"):
        if not part:
            continue
        if any(ch in ACCIDENT_CHARACTERS or ord(ch) < 32 or ord(ch) == 127 for ch in part):
            return True
        if HEREDOC_MARKER_RE.fullmatch(part.strip(" \t'\";)")):
            return True
    return False


def task_title() -> str:
    """The task's first line (without Markdown markers), for commit subjects and notification titles."""
    for line in (EXPLORE_SUMMARY or PROMPT).splitlines():
        text = line.strip().lstrip("#*->").strip()
        if text:
            return text if len(text) <= 72 else text[:69].rstrip() + "..."
    return "orchestrator loop run"


def run_command(cmd: list[str], cwd: str, timeout: float, input_text: str | None = None,
                env: Mapping[str, str] | None = None) -> tuple[int | None, str, str]:
    """Run a program without a terminal: (exit code, stdout, stderr); exit code None after `timeout`.

    It runs in its own process group, so a timeout stops the program and
    everything it started (a wrapper script's children would otherwise
    hold the output pipes open). OSError (not installed) is the caller's.
    """
    proc = subprocess.Popen(cmd, cwd=cwd, stdin=subprocess.PIPE if input_text is not None else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                            env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        out, err = proc.communicate(input_text, timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        out, err = proc.communicate()
        return None, out or "", err or ""
    except BaseException:              # Ctrl-C: leave nothing running behind us
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait()
        raise


def _log_output(prefix: str, text: str, lines: int = 20) -> None:
    """A command's last output lines, indented under the log line that explains them."""
    tail = [line for line in text.splitlines() if line.strip()][-lines:]
    for line in tail:
        print(f"    {prefix}{line}", flush=True)


# -- which change ---------------------------------------------------------------

def change_to_archive() -> tuple[str, str]:
    """(the change this run worked on, '') or ('', why none can be named).

    Story mode (or STORY_CHANGE) names it; otherwise it is the only active
    change under $WD/openspec/changes/ (the archive folder does not count).
    """
    changes = Path(WD) / "openspec" / "changes"
    if STORY_CHANGE:
        if (changes / STORY_CHANGE).is_dir():
            return STORY_CHANGE, ""
        return "", f"STORY_CHANGE={STORY_CHANGE} but {changes / STORY_CHANGE} is not a directory (archived already?)"
    found = sorted(p.name for p in changes.iterdir() if p.is_dir() and p.name != "archive") \
        if changes.is_dir() else []
    if len(found) == 1:
        return found[0], ""
    if not found:
        return "", f"no active OpenSpec change in {changes}"
    return "", (f"{len(found)} active OpenSpec changes in {changes} ({', '.join(found)}): set STORY_CHANGE to "
                "the one this run worked on")


# -- archive ----------------------------------------------------------------------

def archive_change() -> dict:
    """ARCHIVE_ON_PASS: `openspec archive <change> --yes` in WD; the outcome for after_run.

    result is "archived", "skipped" (no single change) or "failed" (missing
    command, error, timeout); a failure keeps the commit from running.
    """
    change, why = change_to_archive()
    if not change:
        log(f"archive: skipped, {why}")
        return {"result": "skipped", "reason": why}
    cmd = shlex.split(OPENSPEC_COMMAND) + ["archive", change, "--yes"]
    shown = " ".join(shlex.quote(word) for word in cmd)
    log(f"archive: running `{shown}` in {WD}")
    try:
        code, out, err = run_command(cmd, WD, ARCHIVE_TIMEOUT, env=OPENSPEC_ENV)
    except OSError as exc:
        why = (f"`{cmd[0]}` cannot be run ({exc.strerror or exc}): install the OpenSpec CLI (npm install -g "
               f"{OPENSPEC_PACKAGE}) or set OPENSPEC_COMMAND to it")
        log(f"archive: failed, {why}")
        return {"result": "failed", "change": change, "reason": why}
    output = (out + ("\n" if out and err else "") + err).strip()
    if code == 0:
        log(f"archive: OpenSpec change {change} archived")
        _log_output("openspec: ", output, lines=8)
        return {"result": "archived", "change": change}
    why = (f"`{shown}` did not finish within ARCHIVE_TIMEOUT={ARCHIVE_TIMEOUT:g}s and was stopped"
           if code is None else f"`{shown}` exited with {code}")
    log(f"archive: failed, {why}; the change stays in openspec/changes/ (run the command yourself once "
        "the cause below is fixed)")
    _log_output("openspec: ", output or "(no output)")
    return {"result": "failed", "change": change, "reason": why}


# -- commit ------------------------------------------------------------------------

GIT_ENV = {"GIT_TERMINAL_PROMPT": "0", "GIT_OPTIONAL_LOCKS": "0", "GIT_EDITOR": "true"}


def git(args: list[str], cwd: str, timeout: float = GIT_TIMEOUT_SECONDS,
        input_text: str | None = None) -> tuple[int | None, str, str]:
    """One git command; OSError if git is not installed."""
    return run_command(["git", *args], cwd, timeout, input_text, GIT_ENV)


def git_top(directory: str) -> str:
    """The top of the git work tree holding `directory`, '' if there is none (or no git)."""
    try:
        code, out, _ = git(["rev-parse", "--show-toplevel"], directory)
    except OSError:
        return ""
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


def snapshot_worktree() -> dict | None:
    """COMMIT_ON_PASS at a run's start: every path git shows as changed or untracked, with its fingerprint.

    At the end, a path whose fingerprint is unchanged was the user's before
    the run and is left alone. None when WD is not in a git repository.
    """
    top = git_top(WD)
    if not top:
        return None
    try:
        paths = git_changed_paths(top)
    except OSError as exc:
        log(f"commit: could not record the working tree at the start ({exc}); only tracked files will be "
            "committed on PASS")
        return None
    return {path: fingerprint(Path(top) / path) for path in paths}


def is_orchestrator_file(path: Path) -> bool:
    """The loop's own files: everything under $WD/.tmp/, and the state file with its lock and backups."""
    state, tmp = Path(STATE_FILE).resolve(), Path(WD).resolve() / ".tmp"
    if path == tmp or tmp in path.parents:
        return True
    return path.parent == state.parent and (path.name == state.name or path.name.startswith(state.name + ".")
                                            or path.name.startswith("." + state.name + "."))


def choose_commit_paths(top: str) -> tuple[list[str], list[str], list[str]]:
    """(paths to commit, the new ones among them, accident files left out), relative to the repository top.

    A path is committed when git shows it changed and the run changed it: it
    was not in the start snapshot, or its content differs from then. The
    loop's own files and files with accident names are never committed.
    Without a snapshot, untracked files are left out (nothing says the run
    made them).
    """
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


def commit_run(archive: dict) -> dict:
    """COMMIT_ON_PASS: commit exactly the paths the run changed; the outcome for after_run.

    New files are added by literal pathspec (with $WD/.tmp/ excluded), then
    `git commit --only` takes just the chosen paths, so whatever the user
    had staged stays staged and out of this commit.
    """
    if archive.get("result") == "failed":
        log("commit: skipped, the archive of the OpenSpec change failed (see above); commit by hand once it "
            "is archived")
        return {"result": "skipped", "reason": "archive failed"}
    top = git_top(WD)
    if not top:
        why = "git is not installed" if not _git_installed() else f"{WD} is not in a git repository"
        log(f"commit: skipped, {why} (git init it to have runs committed)")
        return {"result": "skipped", "reason": why}
    try:
        paths, untracked, accidents = choose_commit_paths(top)
    except OSError as exc:
        log(f"commit: failed, {exc}")
        return {"result": "failed", "reason": str(exc)}
    if accidents:
        log(f"commit: left out {len(accidents)} file(s) whose names look like shell or code fragments an agent "
            f"created by accident (delete them if so): {', '.join(accidents)}")
    if worktree_at_start is None:
        log("commit: no record of the working tree at the run's start (COMMIT_ON_PASS was not set then), so "
            "only changes to tracked files are committed; new files are left for you")
    if not paths:
        log("commit: nothing to commit, the run changed no files in the repository")
        return {"result": "nothing", "left_out": accidents}
    tmp_rel = os.path.relpath(Path(WD).resolve() / ".tmp", top)
    not_tmp = f":(top,exclude){tmp_rel}/"
    spec = "\0".join([f":(top,literal){p}" for p in paths] + [not_tmp]) + "\0"
    new_spec = "\0".join([f":(top,literal){p}" for p in untracked] + [not_tmp]) + "\0"
    code, out, err = (git(["add", "--pathspec-from-file=-", "--pathspec-file-nul"], top, input_text=new_spec)
                      if untracked else (0, "", ""))
    if code != 0:
        why = "git add timed out" if code is None else f"git add exited with {code}"
        log(f"commit: failed, {why}")
        _log_output("git: ", out + err)
        return {"result": "failed", "reason": why, "left_out": accidents}
    message = commit_message(archive)
    code, out, err = git([*git_identity_args(top), "commit", "--only", "-m", message,
                          "--pathspec-from-file=-", "--pathspec-file-nul"],
                         top, GIT_COMMIT_TIMEOUT_SECONDS, input_text=spec)
    if code != 0:
        why = "git commit timed out" if code is None else f"git commit exited with {code}"
        log(f"commit: failed, {why} (a commit hook?); the changes are in the working tree, new files staged: "
            "commit them yourself")
        _log_output("git: ", out + err)
        return {"result": "failed", "reason": why, "left_out": accidents}
    _, sha, _ = git(["rev-parse", "--short", "HEAD"], top)
    sha = sha.strip()
    log(f"commit: {sha} \"{message.splitlines()[0]}\" with {len(paths)} file(s): {', '.join(paths)}")
    return {"result": "committed", "commit": sha, "files": paths, "left_out": accidents}


def _git_installed() -> bool:
    try:
        return git(["--version"], WD)[0] == 0
    except OSError:
        return False


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
    """Publish one ntfy message (POST {server}/{topic}); True if the server took it.

    Nothing is sent without NTFY_TOPIC. A server that is down, slow or says
    no is logged in one line and never stops the run; the token is sent
    only when NTFY_TOKEN is set, and never shown.
    """
    if not NTFY_TOPIC:
        return False
    prefix, priority, tags = NOTIFY_EVENTS[event]
    title = f"{prefix} in round {current_round}: {task_title()}"
    headers = {"Title": _header_text(title), "Priority": priority, "Tags": tags}
    if NTFY_TOKEN:
        headers["Authorization"] = f"Bearer {NTFY_TOKEN}"
    url = f"{NTFY_SERVER.rstrip('/')}/{quote(NTFY_TOPIC, safe='')}"
    try:
        response = httpx.post(url, content=message.encode("utf-8"), headers=headers,
                              timeout=NOTIFY_TIMEOUT_SECONDS)
    except Exception as exc:             # down, hanging, refused, a bad proxy: never the run's problem
        log(f"notify: could not send the {event} notification to {url} ({exc.__class__.__name__}: "
            f"{exc or 'no answer'}); check NTFY_SERVER and the network")
        return False
    if response.status_code >= 300:
        hint = " (check NTFY_TOKEN)" if response.status_code in (401, 403) else ""
        log(f"notify: {url} refused the {event} notification: HTTP {response.status_code} "
            f"{response.text.strip()[:200]}{hint}")
        return False
    log(f"notify: {event} notification sent to {url}")
    return True


def notify_stopped(error: BaseException) -> None:
    """A stop that needs a person (agent error, timeout, permission prompt, server gone): say so."""
    message = getattr(error, "message", None) or str(error)
    notify("STOPPED", f"Stopped in round {current_round}: {message}; state saved, rerun to resume")


# -- the steps, once ----------------------------------------------------------------

def guarded_step(name: str, step, *args) -> dict:
    """Run an after-run step so that nothing it runs into (a full disk, a fault here) undoes the PASS."""
    try:
        return step(*args)
    except Exception as exc:
        why = f"unexpected {exc.__class__.__name__}: {exc}"
        log(f"{name}: failed, {why}")
        return {"result": "failed", "reason": why}


def after_run_steps(code: int) -> list[str]:
    """The steps the settings ask for after a run that ended with `code` (0: PASS)."""
    asked = [("archive", code == 0 and ARCHIVE_ON_PASS), ("commit", code == 0 and COMMIT_ON_PASS),
             ("notify", bool(NTFY_TOPIC))]
    return [step for step, wanted in asked if wanted]


def mark_after_run_due(code: int) -> None:
    """Saved with the run's result: the steps still to do, so a stop in the middle of them loses none."""
    after_run["due"] = after_run_steps(code)


def after_run_pending(code: int, record: dict) -> list[str]:
    """The steps that were due when the run ended, are still asked for, and are not done yet."""
    due = record.get("due") if isinstance(record.get("due"), list) else []
    done = {"archive": "archive" in record, "commit": "commit" in record,
            "notify": record.get("notified") == ("PASS" if code == 0 else "FAIL")}
    return [step for step in after_run_steps(code) if step in due and not done[step]]


def finish_stopped_run() -> None:
    """A finished run stopped during its after-run steps (a kill, a reboot), or whose notification could
    not be sent: do the rest now, each once.

    Runs under the run's lock, before anything else is decided; a state file
    that cannot be read is left to choose_start() to report.
    """
    try:
        data = read_state_file()
    except StateFileError:
        return
    status = (data or {}).get("final_status")
    record = data.get("after_run") if data and isinstance(data.get("after_run"), dict) else {}
    if status not in ("PASS", "FAIL") or not after_run_pending(0 if status == "PASS" else 1, record):
        return
    load_state()
    code = 0 if final_status == "PASS" else 1
    log(f"the run in {STATE_FILE} ended with {final_status} in round {current_round}; still to do after it: "
        f"{', '.join(after_run_pending(code, after_run))} (stopped before, or not sent); doing that now")
    finish_run(code)


def record_after_run(step: str, outcome: object) -> None:
    """Note a step as done in the state file at once, so no resume or rerun repeats it."""
    after_run[step] = outcome
    save_state()


def finish_run(code: int) -> int:
    """After PASS: archive, then commit; after PASS or FAIL: notify. Each once per run; returns `code`.

    Nothing here changes the exit code: a step that fails is logged and the
    run's result stands.
    """
    parts = [f"PASS in round {current_round}" if code == 0 else
             f"FAIL: no PASS within MAX_ROUNDS={MAX_ROUNDS}"]
    if code == 0:
        if ARCHIVE_ON_PASS and "archive" in after_run:
            log(f"archive: done already for this run ({after_run['archive'].get('result')}), not repeated")
        elif ARCHIVE_ON_PASS:
            record_after_run("archive", guarded_step("archive", archive_change))
        if COMMIT_ON_PASS and "commit" in after_run:
            log(f"commit: done already for this run ({after_run['commit'].get('result')}), not repeated")
        elif COMMIT_ON_PASS:
            record_after_run("commit", guarded_step("commit", commit_run, after_run.get("archive") or {}))
        parts += _after_run_notes()
    final_line = "; ".join(parts)
    if ARCHIVE_ON_PASS or COMMIT_ON_PASS:
        log(final_line)
    event = "PASS" if code == 0 else "FAIL"
    if NTFY_TOPIC and after_run.get("notified") == event:
        log(f"notify: the {event} notification was sent already for this run, not repeated")
    elif notify(event, final_line):
        record_after_run("notified", event)
    return code


def _after_run_notes() -> list[str]:
    """Short words on the archive and commit for the run's last line."""
    notes = []
    archive, commit = after_run.get("archive"), after_run.get("commit")
    if ARCHIVE_ON_PASS and isinstance(archive, dict):
        result = archive.get("result")
        notes.append(f"OpenSpec change {archive.get('change')} archived" if result == "archived" else
                     f"archive {result}: {archive.get('reason', '')}".rstrip(": "))
    if COMMIT_ON_PASS and isinstance(commit, dict):
        result = commit.get("result")
        count = len(commit.get("files", []))
        notes.append(f"committed {commit.get('commit')} ({count} file{'' if count == 1 else 's'})"
                     if result == "committed" else "nothing to commit" if result == "nothing" else
                     f"commit {result}: {commit.get('reason', '')}".rstrip(": "))
    return notes


# ==========================================================================
# 11. Entry point
# ==========================================================================

USAGE = "usage: run_orchestrator_loop.py [config.json] | --status [config.json] | --help | --version"

EXIT_CODES = (
    (0, "the tester reported RESULT: PASS"),
    (1, "no PASS within MAX_ROUNDS, or a runtime error (the state is saved: rerun to resume)"),
    (2, "bad usage or configuration; nothing was started, contacted or written"),
    (75, "another process is driving the run in this state file; try again later"),
    (130, "interrupted by SIGINT (Ctrl-C); state saved"),
    (143, "terminated by SIGTERM; state saved"),
)


def _shown_default(setting: Setting) -> str:
    """A setting's default as a user would type it."""
    special = {"WD": "current directory", "STATE_FILE": f"$WD/.tmp/{STATE_FILE_NAME}"}
    if setting.env in special:
        return special[setting.env]
    if setting.kind == "role_provider":
        return "PROVIDER"
    if isinstance(setting.default, bool):
        return "1" if setting.default else "0"
    if isinstance(setting.default, float):
        return f"{setting.default:g}"
    return str(setting.default) if setting.default != "" else "-"


def status_report() -> tuple[int, str]:
    """--status: where the run in STATE_FILE stands and who drives it, read without touching anything."""
    try:
        data = read_state_file()
    except StateFileError as exc:
        return 1, f"{exc}"
    if data is None:
        return 1, f"no state file at {STATE_FILE}: no run has started here (set WD or STATE_FILE to look elsewhere)"
    lines = [f"state file: {STATE_FILE}", f"run: {describe_state(data)}"]
    if data.get("final_status") not in ("PASS", "FAIL"):
        lines[-1] += f" (cycle {data.get('phase_cycle', 1)}, next: {data.get('phase_step', 'author')})"
    holder = lock_holder()
    lines.append(f"driven by: {holder}" if holder else
                 "driven by: no process" + ("" if data.get("final_status") in ("PASS", "FAIL")
                                            else " -- rerun the command to resume it"))
    session = data.get("session_name") or "?"
    lines.append("agents: exited (CLEANUP_ON_EXIT=1)" if data.get("terminals_exited") is True else
                 f"agents: CAO session {session} (watch: `tmux attach -t {session}`)")
    if data.get("run_dir"):
        lines.append(f"replies: {data['run_dir']}")
    done = data.get("after_run") if isinstance(data.get("after_run"), dict) else {}
    steps = [f"{step} {outcome.get('result')}" + (f" {outcome['commit']}" if outcome.get("commit") else "")
             for step, outcome in done.items() if isinstance(outcome, dict)]
    if isinstance(done.get("notified"), str):
        steps.append(f"notified {done['notified']}")
    if steps:
        lines.append("after the run: " + ", ".join(steps))
    if data.get("final_status") in ("PASS", "FAIL"):
        pending = after_run_pending(0 if data["final_status"] == "PASS" else 1, done)
        if pending:
            lines.append(f"still to do after the run: {', '.join(pending)} (the next invocation does it)")
    return 0, "\n".join(lines)


def help_text() -> str:
    """--help: usage, every setting (from SETTINGS, so it cannot drift), exit codes, where the README is."""
    readme = Path(__file__).resolve().with_name("README.md")
    lines = [USAGE, "",
             "Runs a five-agent development loop (analyst, peer analyst, programmer, peer programmer,",
             "tester) on a CAO server until the tester reports PASS. Settings come from environment",
             "variables and/or the JSON config file; environment wins. RESUME=1 continues an",
             "interrupted run (a RUNNING state file is resumed anyway).", "",
             "Settings (environment variable, JSON key, default: meaning):"]
    for setting in SETTINGS:
        lines.append(f"  {setting.env:34} {setting.key:40} {_shown_default(setting)}")
        lines.append(f"      {setting.help}")
    lines.append(f"  {'CAO_AUTH_LOCAL_TOKEN':34} {'(environment only)':40} -")
    lines.append("      bearer token for a cao-server started with one; never logged or saved")
    lines.append(f"  {'NTFY_TOKEN':34} {'(environment only)':40} -")
    lines.append("      ntfy access token, sent as a bearer token with each notification; never logged or saved")
    lines += ["", "Exit codes:"] + [f"  {code:3}  {meaning}" for code, meaning in EXIT_CODES]
    lines += ["", f"Documentation: {readme if readme.exists() else 'README.md of the cao-orchestrator-loop project'}"]
    return "\n".join(lines)


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


def _install_sigterm(handler) -> None:
    """Handlers can only be set from the main thread; elsewhere SIGTERM keeps its default."""
    try:
        signal.signal(signal.SIGTERM, handler)
    except (ValueError, TypeError):
        pass


def refuse_bad_start(task: str) -> StartPlan:
    """A new run needs a task; RESUME=1 needs a resumable state (choose_start raises). Returns the plan."""
    plan = choose_start()
    if not plan.resume and not task:
        raise ConfigError("no task given: set PROMPT_FILE to a prompt file (see prompt_template.md) "
                          "or PROMPT to its text")
    return plan


def start_run(task: str) -> None:
    """Resume the saved run or create a new one for `task`; nothing is written if this fails.

    Decided again under the run's lock: another process may have moved the
    state on since refuse_bad_start() looked. A finished run that was stopped
    during its after-run steps gets them done first (section 10).
    """
    finish_stopped_run()
    plan = refuse_bad_start(task)
    if plan.resume:
        load_state()
        forget_in_flight_context()
        connect_api()
        if not PROMPT and task:
            set_task(task)
        elif task and task != PROMPT:
            log("note: resuming with the task saved in the state file; PROMPT/PROMPT_FILE is ignored")
        verify_resume_terminals()
        if not run_dir:                     # a state file written by the shell script
            set_run_dir(new_run_dir())
        log(f"resuming run from {STATE_FILE}: round {current_round}, {current_phase} phase, "
            f"session {session_name}")
        return
    if plan.note:
        log(plan.note)
    set_task(task)
    warn_about_missing_clis()
    init_new_run(plan)


def main(argv: list[str] | None = None) -> None:
    """Run the loop and exit with its code: 0 PASS, 1 FAIL/error, 2 usage, 130 SIGINT, 143 SIGTERM."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args and args[0] in ("-h", "--help"):
        print(help_text())
        raise SystemExit(0)
    if args and args[0] in ("-V", "--version"):
        print(f"run_orchestrator_loop.py (cao-orchestrator-loop) {__version__}")
        raise SystemExit(0)
    if args and args[0] == "--status":
        try:
            if len(args) > 2:
                raise ConfigError(f"--status takes at most a config file. {USAGE}")
            configure(args[1:])
        except OrchestratorExit as exc:
            print(f"error: {exc.message}", file=sys.stderr, flush=True)
            raise SystemExit(exc.code) from None
        code, report = status_report()
        print(report, file=sys.stdout if code == 0 else sys.stderr, flush=True)
        raise SystemExit(code)
    started = False
    previous_sigterm = signal.getsignal(signal.SIGTERM)
    code = 1
    try:
        if len(args) > 1:
            raise ConfigError(f"expected at most one argument (a config file), got {len(args)}. {USAGE}")
        configure(args)
        task = read_task_prompt()
        refuse_bad_start(task)           # usage errors before anything is written, the lock included
        acquire_run_lock()
        connect_api()
        _install_sigterm(_raise_terminated)
        start_run(task)
        started = True
        if isinstance(api, ApiClient):
            api.retry_seconds = API_RETRY_SECONDS     # from now on, ride out server restarts
        code = run_loop()
    except AlreadyFinished as exc:
        code = exc.code
        log(exc.message)
    except OrchestratorExit as exc:
        code = exc.code
        print(f"error: {exc.message}", file=sys.stderr, flush=True)
    except ApiError as exc:
        code = 1
        print(f"error: {exc}" + ("; state saved, rerun to resume" if started else ""), file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        code = 130
        print("interrupted (SIGINT)" + ("; state saved, rerun to resume" if started else ""), file=sys.stderr)
    except Terminated:
        code = 143
        print("terminated (SIGTERM)" + ("; state saved, rerun to resume" if started else ""), file=sys.stderr)
    except Exception as exc:              # the machine (a full disk, ...) or a fault of this script
        code = 1
        print(f"error: unexpected {exc.__class__.__name__}: {exc}"
              + ("; state saved, rerun to resume" if started else ""), file=sys.stderr, flush=True)
    finally:
        _install_sigterm(previous_sigterm)
        if started:
            try:
                save_state()
                report_run_summary(code)
                if CLEANUP_ON_EXIT:
                    cleanup_terminals()
                else:
                    log(agents_left_note())
            except OSError as exc:
                code = code or 1
                print(f"error: could not save the state to {STATE_FILE}: {exc}", file=sys.stderr, flush=True)
        release_run_lock()
    raise SystemExit(code)


def agents_left_note() -> str:
    """The last line of a run whose agents stay up: where they are and how to stop them."""
    return (f"the five agents of CAO session {session_name} are still running (watch: `tmux attach -t "
            f"{session_name}`; stop: `cao shutdown --session {session_name}`, or set CLEANUP_ON_EXIT=1)")


if __name__ == "__main__":
    main()
