"""Pinned real agent CLIs (Claude Code, Codex, OpenCode) for end-to-end tests, and their private homes.

``ensure_agent_clis()`` installs the pinned npm releases once into a private
prefix (the same cache root ``cao_env`` uses) and returns the directory that
holds ``claude``, ``codex`` and ``opencode``. The ``write_*_home`` functions prepare a
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
import shutil
import signal
import subprocess
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

# CAO provider name -> the executable it launches.
PROVIDER_BINARIES = {"claude_code": "claude", "codex": "codex", "opencode_cli": "opencode"}

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
# Claude Code accepts an auto-compact window of 100000..1000000 tokens; it compacts at about
# window - 33000 (window - min(max output, 20000) - 13000).
CLAUDE_MIN_AUTO_COMPACT_WINDOW = 100_000


class NpmMissing(RuntimeError):
    """npm or node is not installed, so the pinned CLIs cannot be installed."""


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
