"""`--check` with the run's own server, as a user meets it in a fresh HOME with the real CLIs on PATH: whether each
CLI is signed in, told without a token spent (no agent is started, no model asked); and IS_SANDBOX=yes, which
Claude Code as root refuses, named with the value it takes -- the value the run's own server gives its agents.

Every set-up the other end-to-end tests run the real CLIs with against the scripted model (a key in the
environment, Codex's model provider with its env_key, OpenCode's and Hermes's config, Copilot's own provider)
is a sign-in --check accepts. The run that passes with IS_SANDBOX=yes: tests/e2e/test_fresh_node_e2e.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from . import agent_clis
from .cao_env import ensure_cao
from .harness import REPO_ROOT, _server_env

pytestmark = [pytest.mark.e2e, pytest.mark.real_cli]

TASK = """*** ORIGINAL EXPLORE SUMMARY ***
Build greet.py: `python greet.py NAME` prints `Hello, NAME!`.
*** SCENARIO TEST ***
1. `python greet.py World` prints `Hello, World!` and exits 0.
"""
NOWHERE = "http://127.0.0.1:9"          # the model's address in the CLIs' settings: --check never calls it
AS_ROOT = os.geteuid() == 0


class FreshHome:
    """A fresh HOME and project folder, and --check run there with the run's own server and a CLI's PATH."""

    def __init__(self, root: Path, provider: str):
        self.root, self.provider = root, provider
        self.dirs = {name: root / name for name in ("home", "bin", "mock", "tmux", "work")}
        for folder in self.dirs.values():
            folder.mkdir()
        self.home, self.work = self.dirs["home"], self.dirs["work"]
        (self.work / "task.md").write_text(TASK, encoding="utf-8")

    def check(self, **extra: str) -> tuple[int, str]:
        env = _server_env(self.dirs, ensure_cao().parent, think_ms=None,
                          cli_bin=agent_clis.cli_bin_for(self.provider), extra=extra)
        env.update(OWN_SERVER="1", PROVIDER=self.provider, PROMPT_FILE="task.md", WD=str(self.work),
                   STATE_FILE=str(self.root / "state" / "orchestrator-loop-state.json"))
        for name in ("GH_TOKEN", "GITHUB_TOKEN", "OPENROUTER_API_KEY", "IS_SANDBOX", "PROMPT_TOOLKIT_NO_CPR"):
            if name not in extra:
                env.pop(name, None)
        done = subprocess.run([sys.executable, str(REPO_ROOT / "run_orchestrator_loop.py"), "--check"], cwd=self.work,
                              env=env, capture_output=True, text=True, timeout=300)
        output = done.stdout + done.stderr
        assert "Traceback" not in output, output
        return done.returncode, output


@pytest.fixture
def fresh(request):
    made = []

    def make(provider: str) -> FreshHome:
        made.append(Path(tempfile.mkdtemp(prefix="sgn-", dir="/tmp")))    # short: the tmux socket path has a limit
        return FreshHome(made[-1], provider)

    yield make
    for root in made:
        shutil.rmtree(root, ignore_errors=True)


def failed(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("✗")]


def test_claude_code_is_sandbox_yes_no_credential_then_an_approved_key(fresh):
    machine = fresh("claude_code")
    code, output = machine.check(IS_SANDBOX="yes")
    if AS_ROOT:                                           # the run's own server gives its agents the value it takes
        assert "✓ Claude Code: IS_SANDBOX=1 set for root" in output, output
        assert "! the run's own server: the agents get IS_SANDBOX=1 in place of IS_SANDBOX=yes" in output, output
    assert "✗ Claude Code was never set up in the agents' home" in output, output      # its first-run set-up
    [line] = [line for line in failed(output) if "never set up" not in line]
    assert code == 1 and line.startswith("✗ Claude Code: not signed in where its agents run"), output
    assert "run `claude`, then /login (or `claude setup-token`)" in line and "ANTHROPIC_API_KEY" in line, line
    assert output.rstrip().endswith("fix what is marked, then run --check again")

    key = {"ANTHROPIC_API_KEY": agent_clis.API_KEY, "ANTHROPIC_BASE_URL": NOWHERE}
    code, output = machine.check(**key)                    # a key Claude Code was never asked about
    [line] = [line for line in failed(output) if "never set up" not in line]
    assert code == 1 and "ANTHROPIC_API_KEY is set, but Claude Code asks at each start whether to use it" in line

    agent_clis.write_claude_home(machine.home, workdirs=[machine.work])     # onboarding done, the key approved
    code, output = machine.check(**key)
    assert code == 0 and output.rstrip().endswith("a run can start"), output
    assert f"✓ Claude Code: signed in (ANTHROPIC_API_KEY, approved in {machine.home / '.claude.json'})" in output
    assert agent_clis.API_KEY[-20:] not in output                           # never the secret


def test_codex_with_no_login_and_no_key_then_its_model_provider(fresh):
    machine = fresh("codex")
    config = machine.home / ".codex" / "config.toml"        # its traps avoided: only the sign-in is missing
    config.parent.mkdir()
    config.write_text(f'[projects."{machine.work}"]\ntrust_level = "trusted"\n\n'
                      '[notice]\nhide_rate_limit_model_nudge = true\n', encoding="utf-8")
    code, output = machine.check()
    [line] = failed(output)
    assert code == 1 and line.startswith("✗ Codex: not signed in where its agents run"), output
    assert "run `codex login`" in line and "printenv OPENAI_API_KEY | codex login --with-api-key" in line, line

    code, output = machine.check(OPENAI_API_KEY="sk-e2e-0123456789")       # alone, Codex shows its login screen
    [line] = failed(output)
    assert code == 1 and "OPENAI_API_KEY is set, but Codex does not sign in with OPENAI_API_KEY alone" in line

    agent_clis.write_codex_home(machine.home, NOWHERE, workdirs=[machine.work])   # the tests' scripted provider
    code, output = machine.check()
    [line] = failed(output)
    assert f"reads its key from {agent_clis.CODEX_KEY_VAR}, which the agents' environment lacks" in line, output
    code, output = machine.check(**agent_clis.codex_tmux_env())
    assert code == 0 and output.rstrip().endswith("a run can start"), output
    assert f"✓ Codex: signed in (its model provider scripted, its key in {agent_clis.CODEX_KEY_VAR})" in output


def _opencode(machine: FreshHome) -> dict:
    agent_clis.write_opencode_home(machine.home, NOWHERE)
    return agent_clis.opencode_tmux_env()


def _copilot(machine: FreshHome) -> dict:
    agent_clis.write_copilot_home(machine.home, workdirs=[machine.work])
    return agent_clis.copilot_tmux_env(NOWHERE)


def _hermes(machine: FreshHome) -> dict:
    agent_clis.write_hermes_home(machine.home, NOWHERE)
    return agent_clis.hermes_tmux_env()


@pytest.mark.parametrize("provider, set_up, named", [
    ("opencode_cli", _opencode, "OpenCode: signed in (the apiKey of provider scripted in"),
    ("copilot_cli", _copilot, "GitHub Copilot CLI: signed in (its own model provider, COPILOT_PROVIDER_BASE_URL"),
    ("hermes", _hermes, "Hermes Agent: signed in (its model provider in"),
])
def test_the_other_clis_set_ups_against_the_scripted_model_are_sign_ins(fresh, provider, set_up, named):
    machine = fresh(provider)
    code, output = machine.check()
    assert not any(named in line for line in output.splitlines()), output
    code, output = machine.check(**set_up(machine))
    assert code == 0 and output.rstrip().endswith("a run can start"), output
    assert f"✓ {named}" in output, output
