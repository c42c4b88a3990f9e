"""Pinned real agent CLIs (Claude Code, Codex, OpenCode, Copilot, Hermes) for end-to-end tests, and their
private homes.

``ensure_agent_clis()`` installs the pinned npm releases once into a private
prefix (the same cache root ``cao_env`` uses) and returns the directory that
holds ``claude``, ``codex`` and ``opencode``; ``ensure_copilot()`` does the same
for GitHub Copilot CLI in a prefix of its own, and ``ensure_hermes()`` installs
Hermes Agent from PyPI into a virtualenv of its own (Python 3.11 or newer).
``cli_bin_for(provider)`` picks the right one for a CAO provider. The ``write_*_home`` functions prepare a
private HOME so each CLI starts offline and unattended (as root too) against a
scripted model endpoint on 127.0.0.1; ``*_tmux_env`` give the variables that
must be in the environment of the tmux server CAO starts its panes in.
``compact_claude_early`` and ``compact_codex_early`` lower the point where each
CLI compacts its conversation, for tests of long runs (by default neither
compacts before a real model's context window is nearly full).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

if __package__:
    from .cao_env import cache_dir, install_once, installed_version, npm_install_global, run_install_step
else:  # imported as a top-level module, with tests/e2e on sys.path
    from cao_env import cache_dir, install_once, installed_version, npm_install_global, run_install_step

CLAUDE_CODE_PACKAGE = "@anthropic-ai/claude-code"
CLAUDE_CODE_VERSION = "2.1.197"
CODEX_PACKAGE = "@openai/codex"
CODEX_VERSION = "0.169.0"
OPENCODE_PACKAGE = "opencode-ai"
OPENCODE_VERSION = "1.18.33"
NPM_SPECS = (f"{CLAUDE_CODE_PACKAGE}@{CLAUDE_CODE_VERSION}", f"{CODEX_PACKAGE}@{CODEX_VERSION}",
             f"{OPENCODE_PACKAGE}@{OPENCODE_VERSION}")
PREFIX_ENV_VAR = "AGENT_CLI_PREFIX"
COPILOT_PACKAGE = "@github/copilot"       # its native binary comes as @github/copilot-linux-x64
COPILOT_VERSION = "1.0.102"
COPILOT_PREFIX_ENV_VAR = "COPILOT_CLI_PREFIX"
HERMES_PACKAGE = "hermes-agent"
HERMES_VERSION = "0.19.0"
HERMES_REQUIREMENT = f"{HERMES_PACKAGE}=={HERMES_VERSION}"
HERMES_DIR_ENV_VAR = "HERMES_AGENT_DIR"
HERMES_MIN_PYTHON = (3, 11)

# CAO provider name -> the executable it launches.
PROVIDER_BINARIES = {"claude_code": "claude", "codex": "codex", "opencode_cli": "opencode"}

# The CLIs installed on their own (not in the npm prefix above): provider -> executable.
OWN_INSTALL_BINARIES = {"copilot_cli": "copilot", "hermes": "hermes"}

# Written only after a complete, verified install: a prefix left by an
# interrupted npm run is rebuilt instead of reused.
_READY_MARKER = ".agent-clis-install-complete"

# Fake credentials: the scripted endpoint accepts anything, but both CLIs
# refuse to start without a key.
API_KEY = "sk-ant-e2e-scripted-0123456789abcdefghij"
CODEX_PROVIDER_ID = "scripted"
CODEX_MODEL = "scripted"
CODEX_KEY_VAR = "SCRIPTED_MODEL_API_KEY"
OPENCODE_PROVIDER_ID = "scripted"
OPENCODE_MODEL = "scripted"
COPILOT_MODEL = "scripted"
HERMES_MODEL = "scripted"
# Claude Code accepts an auto-compact window of 100000..1000000 tokens; it compacts at about
# window - 33000 (window - min(max output, 20000) - 13000).
CLAUDE_MIN_AUTO_COMPACT_WINDOW = 100_000


class NpmMissing(RuntimeError):
    """npm or node is not installed (or, for Hermes, no Python 3.11+), so a pinned CLI cannot be installed."""


class AgentCliInstallError(RuntimeError):
    """The pinned CLIs could not be installed."""


# -- install -----------------------------------------------------------------
def default_prefix() -> Path:
    return cache_dir(PREFIX_ENV_VAR, f"agent-clis-claude-{CLAUDE_CODE_VERSION}-codex-{CODEX_VERSION}"
                                     f"-opencode-{OPENCODE_VERSION}")


def _marker_text() -> str:
    return "\n".join(NPM_SPECS) + "\n"


def _is_ready(prefix: Path) -> bool:
    marker = prefix / _READY_MARKER
    bins = prefix / "bin"
    return (
        marker.is_file()
        and marker.read_text() == _marker_text()
        and all((bins / name).exists() for name in PROVIDER_BINARIES.values())
    )


def _run(cmd: list[str], what: str, timeout: float, cwd: Path | None = None) -> str:
    return run_install_step(cmd, what, timeout, AgentCliInstallError, cwd)


def ensure_agent_clis(prefix: Path | str | None = None) -> Path:
    """Return the bin directory holding the pinned ``claude``, ``codex`` and ``opencode``.

    Installed with npm on first use and reused afterwards; a lock file
    serialises concurrent callers. Raises ``NpmMissing`` when npm or node is
    not on PATH and ``AgentCliInstallError`` when the install fails.
    """
    prefix = Path(prefix).expanduser() if prefix is not None else default_prefix()
    bins = prefix / "bin"
    if _is_ready(prefix):
        return bins
    missing = [tool for tool in ("npm", "node") if shutil.which(tool) is None]
    if missing:
        raise NpmMissing(
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} required to install "
            f"{' and '.join(NPM_SPECS)}, but not installed (Debian/Ubuntu: apt-get install nodejs npm; "
            f"Node.js 18 or newer)"
        )
    install_once(prefix, _is_ready, _install, AgentCliInstallError, PREFIX_ENV_VAR)
    return bins


def _install(prefix: Path) -> None:
    marker = prefix / _READY_MARKER
    if marker.exists():
        marker.unlink()
    npm_install_global(prefix, NPM_SPECS, 900, AgentCliInstallError)
    bins = prefix / "bin"
    claude_dir = prefix / "lib" / "node_modules" / CLAUDE_CODE_PACKAGE
    # Claude Code's postinstall swaps a placeholder for the native binary;
    # an npm that skips install scripts leaves the placeholder behind.
    if CLAUDE_CODE_VERSION not in installed_version(bins / "claude") and (claude_dir / "install.cjs").is_file():
        _run(["node", "install.cjs"], "Claude Code's postinstall (node install.cjs)", 300, cwd=claude_dir)
    for name, version in (("claude", CLAUDE_CODE_VERSION), ("codex", CODEX_VERSION), ("opencode", OPENCODE_VERSION)):
        got = installed_version(bins / name)
        if version not in got:
            raise AgentCliInstallError(
                f"{bins / name} --version answered {got!r} after the install, expected {version}"
            )
    marker.write_text(_marker_text())


def _require_npm(specs) -> None:
    missing = [tool for tool in ("npm", "node") if shutil.which(tool) is None]
    if missing:
        raise NpmMissing(
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} required to install "
            f"{' and '.join(specs)}, but not installed (Debian/Ubuntu: apt-get install nodejs npm; "
            f"Node.js 18 or newer)"
        )


def cli_bin_for(provider: str) -> Path:
    """The directory holding the pinned executable CAO's ``provider`` launches (installed on first use)."""
    if provider == "copilot_cli":
        return ensure_copilot()
    if provider == "hermes":
        return ensure_hermes()
    return ensure_agent_clis()


# GitHub Copilot CLI: its npm package carries a native binary that unpacks its JavaScript into a
# package cache on first start (about 235 MB, by default under each HOME's ~/.cache/copilot). The
# cache below is shared by every private HOME (COPILOT_PKG_CACHE_HOME) and filled at install time.
_COPILOT_MARKER = ".copilot-install-complete"


def default_copilot_prefix() -> Path:
    return cache_dir(COPILOT_PREFIX_ENV_VAR, f"copilot-{COPILOT_VERSION}")


def copilot_pkg_cache(prefix: Path | None = None) -> Path:
    """The package cache the pinned Copilot unpacks into (its COPILOT_PKG_CACHE_HOME)."""
    return (prefix or default_copilot_prefix()) / "pkg-cache"


def _copilot_ready(prefix: Path) -> bool:
    marker = prefix / _COPILOT_MARKER
    return (marker.is_file() and marker.read_text() == f"{COPILOT_PACKAGE}@{COPILOT_VERSION}\n"
            and (prefix / "native-bin" / "copilot").exists()
            and (copilot_pkg_cache(prefix) / "pkg" / "linux-x64" / COPILOT_VERSION / "index.js").is_file())


def ensure_copilot(prefix: Path | str | None = None) -> Path:
    """Return a directory holding the pinned ``copilot`` (its native binary alone), installed with npm on first use."""
    prefix = Path(prefix).expanduser() if prefix is not None else default_copilot_prefix()
    if _copilot_ready(prefix):
        return prefix / "native-bin"
    spec = f"{COPILOT_PACKAGE}@{COPILOT_VERSION}"
    _require_npm([spec])
    install_once(prefix, _copilot_ready, _install_copilot, AgentCliInstallError, COPILOT_PREFIX_ENV_VAR)
    return prefix / "native-bin"


def _copilot_native(prefix: Path) -> Path:
    return prefix / "lib" / "node_modules" / COPILOT_PACKAGE / "node_modules" / "@github" / "copilot-linux-x64" / "copilot"


def _install_copilot(prefix: Path) -> None:
    marker = prefix / _COPILOT_MARKER
    if marker.exists():
        marker.unlink()
    spec = f"{COPILOT_PACKAGE}@{COPILOT_VERSION}"
    npm_install_global(prefix, [spec], 900, AgentCliInstallError)
    got = installed_version(prefix / "bin" / "copilot")
    if COPILOT_VERSION not in got:
        raise AgentCliInstallError(f"{prefix / 'bin' / 'copilot'} --version answered {got!r}, expected {COPILOT_VERSION}")
    native = _copilot_native(prefix)
    if not native.is_file():
        raise AgentCliInstallError(f"{spec} installed without its native binary {native}")
    # Unpack its package now, once, instead of in every private HOME at each first start.
    env = {**os.environ, "COPILOT_SEA_EXTRACT_ONLY": "1", "COPILOT_PKG_CACHE_HOME": str(copilot_pkg_cache(prefix))}
    subprocess.run([str(native)], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=300, check=False)
    if not (copilot_pkg_cache(prefix) / "pkg" / "linux-x64" / COPILOT_VERSION / "index.js").is_file():
        raise AgentCliInstallError(f"Copilot {COPILOT_VERSION} did not unpack its package into {copilot_pkg_cache(prefix)}")
    # The agents run the native binary itself: npm's `copilot` is a node script that starts it as a child,
    # so a kill of the pane's process (a crash, in the tests) would leave the real CLI running.
    native_bin = prefix / "native-bin"
    native_bin.mkdir(exist_ok=True)
    link = native_bin / "copilot"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(native)
    marker.write_text(f"{spec}\n")


# Hermes Agent: a PyPI package needing Python 3.11+, in a virtualenv of its own; only `hermes` is put
# on the agents' PATH (a script in bin/), not the virtualenv's python and pip. That script adds
# --pass-session-id, which puts `Session ID: <id>` in Hermes's system prompt: Hermes sends no session of
# its own with its requests, and the scripted model needs one to tell a new agent's prompt (a replaced
# agent's) from a retry of the same request.
_HERMES_MARKER = ".hermes-install-complete"


def default_hermes_dir() -> Path:
    return cache_dir(HERMES_DIR_ENV_VAR, f"hermes-agent-{HERMES_VERSION}")


def _hermes_ready(root: Path) -> bool:
    marker = root / _HERMES_MARKER
    script = root / "bin" / "hermes"
    return (marker.is_file() and marker.read_text().strip() == HERMES_REQUIREMENT
            and script.is_file() and not script.is_symlink())


def hermes_python() -> str | None:
    """A Python 3.11+ to build Hermes's virtualenv with: this one, else python3.11..3.13 on PATH."""
    if sys.version_info[:2] >= HERMES_MIN_PYTHON:
        return sys.executable
    return next((found for name in ("python3.13", "python3.12", "python3.11") if (found := shutil.which(name))), None)


def ensure_hermes(root: Path | str | None = None) -> Path:
    """Return the directory holding the pinned ``hermes`` (alone), installed with pip on first use."""
    root = Path(root).expanduser() if root is not None else default_hermes_dir()
    if _hermes_ready(root):
        return root / "bin"
    if hermes_python() is None:
        raise NpmMissing(f"{HERMES_REQUIREMENT} needs Python 3.11 or newer, and none is installed")
    install_once(root, _hermes_ready, _install_hermes, AgentCliInstallError, HERMES_DIR_ENV_VAR)
    return root / "bin"


def _install_hermes(root: Path) -> None:
    marker = root / _HERMES_MARKER
    if marker.exists():
        marker.unlink()
    venv = root / "venv"
    python = venv / "bin" / "python"
    if not python.exists():
        run_install_step([hermes_python(), "-m", "venv", "--clear", str(venv)], "creating Hermes's virtualenv", 300,
                         AgentCliInstallError)
    run_install_step([str(python), "-m", "pip", "--disable-pip-version-check", "--no-input", "install", "--quiet",
                      HERMES_REQUIREMENT], f"pip install {HERMES_REQUIREMENT}", 900, AgentCliInstallError)
    bins = root / "bin"
    bins.mkdir(parents=True, exist_ok=True)
    script = bins / "hermes"
    if script.is_symlink() or script.exists():
        script.unlink()
    script.write_text(f"#!/bin/sh\nexec {shlex.quote(str(venv / 'bin' / 'hermes'))} --pass-session-id \"$@\"\n")
    script.chmod(0o755)
    # Its metadata, not `hermes --version`: that writes ~/.hermes into the HOME it runs in.
    got = run_install_step([str(python), "-c", f"import importlib.metadata as m; print(m.version({HERMES_PACKAGE!r}))"],
                           "reading Hermes's installed version", 60, AgentCliInstallError).strip()
    if got != HERMES_VERSION:
        raise AgentCliInstallError(f"{HERMES_PACKAGE} {got!r} installed into {venv}, expected {HERMES_VERSION}")
    marker.write_text(HERMES_REQUIREMENT + "\n")


# -- private homes -------------------------------------------------------------
def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def claude_tmux_env(model_url: str, api_key: str = API_KEY) -> dict[str, str]:
    """Variables for the tmux server's global environment (CAO unsets CLAUDE*, not these)."""
    return {
        "ANTHROPIC_BASE_URL": model_url,
        "ANTHROPIC_API_KEY": api_key,
        # Claude Code refuses --dangerously-skip-permissions for root otherwise.
        "IS_SANDBOX": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_BUG_COMMAND": "1",
    }


def write_claude_home(home: Path, api_key: str = API_KEY, workdirs: list[Path] = (),
                      auto_compact_window: int | None = None) -> None:
    """``~/.claude.json`` and ``~/.claude/settings.json`` for an offline, dialog-free start.

    ``auto_compact_window``: see ``compact_claude_early`` (None: Claude Code's default).
    """
    projects = {str(Path(wd)): _claude_project_entry() for wd in workdirs}
    _write_json(
        home / ".claude.json",
        {
            "hasCompletedOnboarding": True,
            "lastOnboardingVersion": CLAUDE_CODE_VERSION,
            "lastReleaseNotesSeen": CLAUDE_CODE_VERSION,
            "numStartups": 1,
            "theme": "dark",
            "autoUpdates": False,
            "bypassPermissionsModeAccepted": True,
            "hasSeenTasksHint": True,
            "hasAcknowledgedCostThreshold": True,
            "fallbackAvailableWarningThreshold": 1.0,
            "customApiKeyResponses": {"approved": [api_key[-20:]], "rejected": []},
            "projects": projects,
        },
    )
    _write_json(
        home / ".claude" / "settings.json",
        {
            "env": {
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
                "CLAUDE_CODE_DISABLE_TERMINAL_TITLE": "1",
                "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1",
                "CLAUDE_CODE_IDE_SKIP_AUTO_INSTALL": "1",
                "DISABLE_AUTOUPDATER": "1",
                "DISABLE_TELEMETRY": "1",
                "DISABLE_ERROR_REPORTING": "1",
                "DISABLE_BUG_COMMAND": "1",
            },
            "skipDangerousModePermissionPrompt": True,
            "includeCoAuthoredBy": False,
        },
    )
    if auto_compact_window is not None:
        compact_claude_early(home, auto_compact_window)


def compact_claude_early(home: Path, window: int = CLAUDE_MIN_AUTO_COMPACT_WINDOW) -> None:
    """Give Claude Code an auto-compact window of ``window`` tokens (``autoCompactWindow``).

    It must be a setting in ``~/.claude/settings.json``: CAO's launch line unsets every
    ``CLAUDE*`` variable, CLAUDE_CODE_AUTO_COMPACT_WINDOW included. Claude Code reads it when it
    starts, so call this before creating the terminals. With the smallest window (100000) a
    response reporting about 70000 input tokens makes it compact before its next request.
    """
    if not CLAUDE_MIN_AUTO_COMPACT_WINDOW <= window <= 1_000_000:
        raise ValueError(f"Claude Code ignores an autoCompactWindow of {window} (100000..1000000)")
    path = home / ".claude" / "settings.json"
    data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    data["autoCompactWindow"] = int(window)
    _write_json(path, data)


def _claude_project_entry() -> dict:
    return {"hasTrustDialogAccepted": True, "hasCompletedProjectOnboarding": True, "allowedTools": []}


def trust_claude_workdir(home: Path, workdir: Path) -> None:
    """Mark ``workdir`` trusted in ``~/.claude.json`` (CAO would otherwise answer the dialog)."""
    path = home / ".claude.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    data.setdefault("projects", {})[str(Path(workdir))] = _claude_project_entry()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def codex_tmux_env(api_key: str = API_KEY) -> dict[str, str]:
    return {CODEX_KEY_VAR: api_key, "CODEX_DISABLE_UPDATE_CHECK": "1"}


def _toml_str(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def write_codex_home(home: Path, model_url: str, workdirs: list[Path] = (),
                     auto_compact_token_limit: int | None = None) -> None:
    """``~/.codex/config.toml``: the scripted provider, no approvals, no network chatter.

    ``auto_compact_token_limit``: see ``compact_codex_early`` (None: Codex's default).
    """
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    lines = [
        f"model = {_toml_str(CODEX_MODEL)}",
        f"model_provider = {_toml_str(CODEX_PROVIDER_ID)}",
        'approval_policy = "never"',
        'sandbox_mode = "danger-full-access"',
        "check_for_update_on_startup = false",
        "hide_agent_reasoning = true",
        "",
        f"[model_providers.{CODEX_PROVIDER_ID}]",
        'name = "Scripted model"',
        f"base_url = {_toml_str(model_url.rstrip('/') + '/v1')}",
        'wire_api = "responses"',
        f"env_key = {_toml_str(CODEX_KEY_VAR)}",
        "request_max_retries = 0",
        "stream_max_retries = 0",
        "",
        "[analytics]",
        "enabled = false",
        "",
        "[feedback]",
        "enabled = false",
        "",
        "[history]",
        'persistence = "none"',
        "",
        "[tui]",
        "notifications = false",
        "",
        "[notice]",
        "hide_full_access_warning = true",
        "hide_world_writable_warning = true",
        "hide_rate_limit_model_nudge = true",
        "",
    ]
    (codex_home / "config.toml").write_text("\n".join(lines), encoding="utf-8")
    if auto_compact_token_limit is not None:
        compact_codex_early(home, auto_compact_token_limit)
    for wd in workdirs:
        trust_codex_workdir(home, wd)


CODEX_COMPACTION_KEYS = ("model_auto_compact_token_limit", "model_context_window")


def compact_codex_early(home: Path, token_limit: int, context_window: int | None = None) -> None:
    """Make Codex compact once a response reports ``token_limit`` total tokens or more.

    Sets ``model_auto_compact_token_limit`` and ``model_context_window`` (default: four times the
    limit; Codex knows no window for the scripted model's slug) at the top of
    ``~/.codex/config.toml``, where top-level keys must stand. Codex reads them when it starts, so
    call this before creating the terminals.
    """
    config = home / ".codex" / "config.toml"
    window = int(context_window) if context_window is not None else 4 * int(token_limit)
    lines = config.read_text(encoding="utf-8").splitlines()
    first_table = next((i for i, line in enumerate(lines) if line.startswith("[")), len(lines))
    top = [line for line in lines[:first_table] if line.split("=", 1)[0].strip() not in CODEX_COMPACTION_KEYS]
    while top and not top[-1].strip():
        top.pop()
    top += [f"model_auto_compact_token_limit = {int(token_limit)}", f"model_context_window = {window}", ""]
    config.write_text("\n".join(top + lines[first_table:]) + "\n", encoding="utf-8")


def trust_codex_workdir(home: Path, workdir: Path) -> None:
    """Append a ``trusted`` project entry: Codex 0.169's trust dialog is unknown to CAO 2.5.4."""
    config = home / ".codex" / "config.toml"
    header = f"[projects.{_toml_str(str(Path(workdir)))}]"
    text = config.read_text(encoding="utf-8")
    if header in text.splitlines():
        return
    with open(config, "a", encoding="utf-8") as fh:
        fh.write(f"\n{header}\ntrust_level = \"trusted\"\n")


def opencode_config_path(home: Path) -> Path:
    """Where CAO's opencode_cli provider points OpenCode for its config (OPENCODE_CONFIG)."""
    return home / ".aws" / "opencode" / "opencode.json"


def opencode_tmux_env() -> dict[str, str]:
    """Offline quiet: no model catalogue fetch from the internet, no update check."""
    return {"OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_AUTOUPDATE": "1"}


def write_opencode_home(home: Path, model_url: str, api_key: str = API_KEY) -> None:
    """``~/.aws/opencode/opencode.json``: the scripted endpoint as a custom provider, no dialogs.

    `cao install --provider opencode_cli` adds its agents to this file's
    directory and keeps these keys. Paths outside the project (the loop's
    reply files) are allowed, or each such command would stop on a
    permission dialog.
    """
    model = f"{OPENCODE_PROVIDER_ID}/{OPENCODE_MODEL}"
    _write_json(opencode_config_path(home), {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            OPENCODE_PROVIDER_ID: {
                "npm": "@ai-sdk/openai-compatible",
                "name": "Scripted model",
                "options": {"baseURL": model_url.rstrip("/") + "/v1", "apiKey": api_key},
                "models": {OPENCODE_MODEL: {"name": "Scripted", "tool_call": True}},
            }
        },
        "model": model,
        "small_model": model,
        "autoupdate": False,
        "share": "disabled",
        "permission": {"external_directory": "allow"},
    })


def warm_opencode_home(cao, timeout: float = 240.0) -> float:
    """Start OpenCode once, alone, in the server's HOME and end it once it has drawn its screen: what a user who
    has run `opencode` before has (its first start in a new HOME sets itself up, and five such first starts at
    once are what can keep one of them past CAO's 120 s; docs/agent-clis.md). Returns the seconds it took.
    A fresh HOME's first start-up is measured by bench/bench_start_up.py."""
    started = time.monotonic()
    session = "warm-opencode"
    config, binary = opencode_config_path(cao.home), cao.cli_bin / "opencode"
    # The environment CAO 2.5.4's opencode_cli provider starts it with (its _build_launch_command).
    launch_env = {"OPENCODE_CONFIG": str(config), "OPENCODE_CONFIG_DIR": str(config.parent),
                  "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MOUSE": "1",
                  "OPENCODE_DISABLE_TERMINAL_TITLE": "1", "OPENCODE_CLIENT": "cao", "TERM": "xterm-256color"}
    command = "env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in launch_env.items()) + " " + \
        shlex.quote(str(binary))
    # As CAO does: a shell in the pane first, the command typed into it.
    cao.tmux("new-session", "-d", "-s", session, "-x", "200", "-y", "50", "-c", str(cao.root / "work"), check=True)
    time.sleep(1)
    cao.tmux("send-keys", "-t", f"={session}:", command, "Enter", check=True)
    try:
        while time.monotonic() - started < timeout:
            screen = cao.tmux("capture-pane", "-p", "-t", f"={session}:").stdout
            if re.search(rf"(?<![-\w.]){re.escape(OPENCODE_VERSION)}\s*$", screen, re.MULTILINE):  # its footer
                return time.monotonic() - started
            time.sleep(0.5)
        raise AgentCliInstallError(f"OpenCode did not draw its screen within {timeout:.0f}s in {cao.home}")
    finally:
        cao.tmux("kill-session", "-t", f"={session}")


def copilot_tmux_env(model_url: str, api_key: str = API_KEY, pkg_cache: Path | None = None) -> dict[str, str]:
    """Copilot's own provider settings (BYOK) pointing at the scripted endpoint, offline, no updates.

    CAO launches `copilot` as a plain command line in the pane, so these reach it from the tmux server's
    environment. The prompt and output token limits silence its warning that the model is not in its
    catalogue.
    """
    return {
        "COPILOT_OFFLINE": "true",
        "COPILOT_PROVIDER_BASE_URL": model_url.rstrip("/") + "/v1",
        "COPILOT_PROVIDER_TYPE": "openai",
        "COPILOT_PROVIDER_API_KEY": api_key,
        "COPILOT_MODEL": COPILOT_MODEL,
        "COPILOT_PROVIDER_MAX_PROMPT_TOKENS": "200000",
        "COPILOT_PROVIDER_MAX_OUTPUT_TOKENS": "16000",
        "COPILOT_AUTO_UPDATE": "false",
        "COPILOT_PKG_CACHE_HOME": str(pkg_cache or copilot_pkg_cache()),
    }


def copilot_config_path(home: Path) -> Path:
    """Copilot's own state file (CAO starts it with --config-dir ~/.copilot)."""
    return home / ".copilot" / "config.json"


def write_copilot_home(home: Path, workdirs: list[Path] = ()) -> None:
    """``~/.copilot/config.json``: first start done, tips seen, ``workdirs`` trusted (no folder-trust dialog);
    ``~/.copilot/settings.json``: CAO's own MCP server disabled (see COPILOT_DISABLED_MCP_SERVERS)."""
    _write_json(copilot_config_path(home), {
        "firstLaunchAt": "2026-01-01T00:00:00.000Z",
        "appTipShown": True,
        "reasoningSummariesCleanupDone": True,
        "trustedFolders": [str(Path(wd)) for wd in workdirs],
    })
    _write_json(copilot_settings_path(home), {"disabledMcpServers": COPILOT_DISABLED_MCP_SERVERS})


def copilot_settings_path(home: Path) -> Path:
    return home / ".copilot" / "settings.json"


# CAO 2.5.4 hands Copilot its own MCP server (cao-mcp-server, --additional-mcp-config); Copilot 1.0.102's
# MCP client fails its handshake ("connection is serving the 2026-07-28 protocol; the initialize handshake
# is not accepted"), waits for it first ("taking longer than expected to connect"), and the failure it
# prints (`JSON-RPC error: -32022`) makes CAO read the finished turn as `error`. The loop uses no MCP tool.
COPILOT_DISABLED_MCP_SERVERS = ["cao-mcp-server"]


def trust_copilot_workdir(home: Path, workdir: Path) -> None:
    """Add ``workdir`` to Copilot's trusted folders (CAO would otherwise answer its dialog)."""
    path = copilot_config_path(home)
    data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    folders = data.setdefault("trustedFolders", [])
    if str(Path(workdir)) not in folders:
        folders.append(str(Path(workdir)))
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)


def hermes_config_path(home: Path) -> Path:
    return home / ".hermes" / "config.yaml"


def hermes_tmux_env() -> dict[str, str]:
    """No cursor-position request (CPR) from Hermes's prompt_toolkit screen.

    Hermes draws its screen, asks the terminal where the cursor is (ESC[6n) and draws
    it again when the answer comes back, ~0.2 s later. When the status bar's session
    clock has moved on in between (1s -> 2s), that second drawing writes the one
    changed digit and then blank lines, and nothing after it while Hermes waits. CAO
    2.5.4 reads Hermes's status from the last 30 lines of the raw output (each
    "\r\r\n" counting as two), and the digit pushes the `❯` prompt out of them: the
    terminal stays `processing` and CAO fails its creation after 120 s ("Hermes
    initialization timed out") with the prompt on screen. A lone, quick start (a
    replacement agent) hits it far more often than five starting at once. Without
    CPR, Hermes draws once.
    """
    return {"PROMPT_TOOLKIT_NO_CPR": "1"}


def write_hermes_home(home: Path, model_url: str, api_key: str = API_KEY) -> None:
    """``~/.hermes/config.yaml``: the scripted endpoint as Hermes's custom provider (chat completions).

    Written as JSON, which is YAML too.
    """
    path = hermes_config_path(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    config = {"model": {"provider": "custom", "base_url": model_url.rstrip("/") + "/v1", "default": HERMES_MODEL,
                        "api_key": api_key, "api_mode": "chat_completions"}}
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def stop_codex_daemons(home: Path, codex_bin: Path | None = None, env: dict | None = None) -> list[str]:
    """Stop app-server daemons Codex left running under ``home``; return what was stopped."""
    stopped = []
    pid_dir = home / ".codex" / "app-server-daemon"
    pid_files = sorted(pid_dir.glob("*.pid")) if pid_dir.is_dir() else []
    if pid_files and codex_bin is not None:
        try:
            subprocess.run(
                [str(codex_bin), "app-server", "daemon", "stop"],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=20,
            )
        except (OSError, subprocess.TimeoutExpired):
            pass
    for pid_file in pid_files:
        try:
            pid = int(pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                ours = f"HOME={home}".encode() in fh.read().split(b"\0")
        except OSError:
            continue
        if not ours:
            continue  # a stale file whose PID now belongs to someone else
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
                time.sleep(0.1)
        stopped.append(f"codex app-server daemon pid {pid}")
    return stopped


if __name__ == "__main__":
    print(ensure_agent_clis())
