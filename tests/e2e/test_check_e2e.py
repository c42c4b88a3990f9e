"""`--check` against a real cao-server in a fresh HOME, as a newcomer meets it: each set-up trap planted one
at a time is found with its fix, and once it is fixed the check passes.

The server here is started the way the README starts it (no tmux server of the test's own): CAO's tmux
server then runs the agents in login shells, whose PATH is the system's, not cao-server's. The real
Codex and Claude Code CLIs are only asked for their version; whether they are signed in is read from the
agents' environment and home.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from . import agent_clis
from .cao_env import ensure_cao
from .harness import AGENT_PROFILES, REPO_ROOT, _free_port, _write_mock_cli

pytestmark = [pytest.mark.e2e, pytest.mark.real_cli]

TASK = """*** ORIGINAL EXPLORE SUMMARY ***
Build greet.py: `python greet.py NAME` prints `Hello, NAME!`.
*** SCENARIO TEST ***
1. `python greet.py World` prints `Hello, World!` and exits 0.
"""


class NewcomersMachine:
    """A fresh HOME, a cao-server started from a plain shell's environment, a project folder."""

    def __init__(self, root: Path):
        self.root = root
        self.home, self.bin, self.tmux, self.work = (root / name for name in ("home", "bin", "tmux", "work"))
        for folder in (self.home, self.bin, self.tmux, self.work):
            folder.mkdir()
        _write_mock_cli(self.bin)
        (self.work / "task.md").write_text(TASK, encoding="utf-8")
        self.cao_bin = ensure_cao().parent
        self.port = _free_port()
        self.api = f"http://127.0.0.1:{self.port}"
        self.server: subprocess.Popen | None = None

    def env(self, **extra: str) -> dict[str, str]:
        """A newcomer's shell: this HOME, the system PATH with CAO's venv (where `pip install` put it)."""
        return {"HOME": str(self.home), "TMUX_TMPDIR": str(self.tmux), "SHELL": "/bin/bash",
                "USER": os.environ.get("USER", "root"), "LANG": os.environ.get("LANG", "C.UTF-8"),
                "TERM": "xterm-256color", "PATH": f"{self.cao_bin}:/usr/local/bin:/usr/bin:/bin", **extra}

    def start_server(self, **extra: str) -> None:
        self.server = subprocess.Popen([str(self.cao_bin / "cao-server"), "--host", "127.0.0.1", "--port",
                                        str(self.port)], env=self.env(**extra), cwd=self.root,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with _quiet():
                if httpx.get(f"{self.api}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.3)
        raise AssertionError("cao-server did not answer /health in 120 s")

    def stop_server(self) -> None:
        if self.server is not None:
            with _quiet():
                os.killpg(self.server.pid, signal.SIGKILL)
            self.server.wait(timeout=30)
            self.server = None
        subprocess.run(["tmux", "kill-server"], env=self.env(), capture_output=True, timeout=30)

    def install_profiles(self, provider: str) -> None:
        for name in AGENT_PROFILES:
            subprocess.run([str(self.cao_bin / "cao"), "install", str(REPO_ROOT / "profiles" / f"{name}.md"),
                            "--provider", provider], env=self.env(), check=True, capture_output=True, timeout=120)

    def login_path(self, *folders: Path) -> None:
        """What a user does so that a program is found by login shells: ~/.profile puts it on PATH."""
        (self.home / ".profile").write_text(
            "".join(f'export PATH="{folder}:$PATH"\n' for folder in folders), encoding="utf-8")

    def check(self, provider: str) -> tuple[int, str]:
        """--check as the user runs it, from the project folder, with the README's settings."""
        env = {**os.environ, "API": self.api, "PROVIDER": provider, "PROMPT_FILE": "task.md",
               "WD": str(self.work), "HOME": str(self.home)}
        done = subprocess.run([sys.executable, str(REPO_ROOT / "run_orchestrator_loop.py"), "--check"],
                              cwd=self.work, env=env, capture_output=True, text=True, timeout=180)
        output = done.stdout + done.stderr
        assert "Traceback" not in output, output
        return done.returncode, output


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback):
        return kind is not None and issubclass(kind, (OSError, httpx.HTTPError, ProcessLookupError))


@pytest.fixture
def machine():
    root = Path(tempfile.mkdtemp(prefix="chk-", dir="/tmp"))     # short: the tmux socket path has a limit
    newcomer = NewcomersMachine(root)
    try:
        yield newcomer
    finally:
        newcomer.stop_server()
        shutil.rmtree(root, ignore_errors=True)


def failed_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("✗")]


def test_check_finds_each_trap_planted_alone_with_its_fix_and_passes_once_fixed(machine):
    # CAO down
    code, output = machine.check("mock_cli")
    assert code == 1 and failed_lines(output) == [
        line for line in output.splitlines() if line.startswith(f"✗ CAO server is not reachable at {machine.api}")]
    assert "start it with `cao-server`" in output

    # profiles missing
    machine.start_server()
    machine.login_path(machine.bin)
    code, output = machine.check("mock_cli")
    [line] = failed_lines(output)
    assert code == 1 and "agent profiles not installed" in line
    [command] = line.split("`")[1::2]          # the one command it prints, run as printed: another folder, HOME
    assert command.startswith(f"HOME={machine.home} ") and command.count(" && ") == len(AGENT_PROFILES) - 1
    subprocess.run(["sh", "-c", command], cwd="/", env=machine.env(HOME=str(machine.root)), check=True,
                   capture_output=True, timeout=300)

    # mock_cli on cao-server's PATH (the README's venv) but not on the agents' login PATH
    (machine.home / ".profile").unlink()
    code, output = machine.check("mock_cli")
    [line] = failed_lines(output)
    assert code == 1 and line.startswith("✗ mock_cli (the scripted agent, provider mock_cli) is not on the PATH")

    machine.login_path(machine.bin)
    code, output = machine.check("mock_cli")
    assert code == 0 and output.splitlines()[-1] == "a run can start", output
    assert f"✓ mock_cli found by the agents' shells: {machine.bin / 'mock_cli'}" in output

    # Codex in a project it does not trust
    clis = agent_clis.cli_bin_for("codex")
    machine.login_path(machine.bin, clis)
    code, output = machine.check("codex")
    config = machine.home / ".codex" / "config.toml"
    untrusted, offer, signed_out = failed_lines(output)
    assert code == 1 and untrusted.startswith(f"✗ Codex does not trust {machine.work.resolve()}")
    assert offer.startswith("✗ Codex offers another model at a usage limit") and \
        offer.endswith(f"add to {config}: [notice] then hide_rate_limit_model_nudge = true")
    assert signed_out.startswith("✗ Codex: not signed in where its agents run") and "`codex login`" in signed_out
    assert f"✓ codex found by the agents' shells: {clis / 'codex'}, {agent_clis.CODEX_VERSION}" in output, output
    config.parent.mkdir()                                     # what the fixes say, as a user writes them
    config.write_text(f'[projects."{machine.work.resolve()}"]\ntrust_level = "trusted"\n\n'
                      '[notice]\nhide_rate_limit_model_nudge = true\n', encoding="utf-8")
    (config.parent / "auth.json").write_text('{"auth_mode": "apikey", "OPENAI_API_KEY": "sk-e2e-0123"}\n',
                                             encoding="utf-8")   # what `codex login --with-api-key` writes
    code, output = machine.check("codex")
    assert code == 0 and "✓ Codex trusts the project" in output, output
    assert "✓ Codex: its offer of another model at a usage limit is turned off" in output, output
    assert f"✓ Codex: signed in (its login, {config.parent / 'auth.json'})" in output, output

    # Claude Code as root: cao-server started without IS_SANDBOX, then with a value Claude Code does not take;
    # signed in by a key in cao-server's environment that Claude Code was told to use
    code, output = machine.check("claude_code")
    assert code == 1 and failed_lines(output)[-1].startswith("✗ Claude Code: not signed in where its agents run")
    key = {"ANTHROPIC_API_KEY": agent_clis.API_KEY}
    if os.getuid() == 0:
        assert "IS_SANDBOX=1 cao-server" in failed_lines(output)[0]
        machine.stop_server()
        machine.start_server(IS_SANDBOX="yes", **key)
        code, output = machine.check("claude_code")
        [line, onboarding, _] = failed_lines(output)
        assert onboarding.startswith("✗ Claude Code was never set up in the agents' home"), output
        assert code == 1 and "has IS_SANDBOX=yes, and Claude Code takes only IS_SANDBOX=1" in line, output
        key["IS_SANDBOX"] = "1"
    machine.stop_server()
    machine.start_server(**key)
    agent_clis.write_claude_home(machine.home, workdirs=[machine.work])       # onboarding done, the key approved
    code, output = machine.check("claude_code")
    assert "✓ Claude Code: IS_SANDBOX=1 set for root" in output or os.getuid() != 0
    assert "✓ Claude Code: signed in (ANTHROPIC_API_KEY, approved in" in output, output
    assert code == 0 and output.splitlines()[-1] == "a run can start", output
