"""The pinned CAO the end-to-end suite and the demo use: one installed with the project is used as it is.
The demo itself, `--demo`, runs in the README's quick start; here, a demo stopped and taken up again."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from . import cao_env
from .cao_env import ensure_cao
from .harness import _pids_with_env

pytestmark = pytest.mark.e2e

def test_a_cao_of_the_pinned_version_installed_here_is_used_as_it_is(monkeypatch, tmp_path):
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("cao-server", "cao"):
        (bin_dir / name).write_text("#!/bin/sh\n")
    monkeypatch.setattr(cao_env.sys, "executable", str(bin_dir / "python"))
    monkeypatch.setattr(cao_env.importlib.metadata, "version",
                        lambda name: cao_env.CAO_VERSION if name == "cli-agent-orchestrator" else "0")
    assert cao_env.ensure_cao() == bin_dir / "cao-server"
    monkeypatch.setattr(cao_env.importlib.metadata, "version", lambda name: "2.5.3")
    assert cao_env.installed_here() is None


# -- a stopped demo: what it says, then what the same command does ---------------------------------------

SCRIPT = Path(__file__).resolve().parents[2] / "run_orchestrator_loop.py"


def prompts_of(folder: Path) -> list[str]:
    """The roles the demo's scripted agents got a prompt for, in order."""
    received = folder / ".tmp" / "demo-agents" / "received.jsonl"
    lines = received.read_text(encoding="utf-8").splitlines() if received.exists() else []
    return [record["role"] for record in map(json.loads, lines) if record.get("kind") == "prompt"]


@pytest.mark.parametrize("signum, code, said", [
    (signal.SIGHUP, 129, "stopped by SIGHUP (its terminal closed)"),
    (signal.SIGINT, 130, "interrupted (SIGINT)")])
def test_a_stopped_demo_says_the_same_command_goes_on_and_the_same_command_does(tmp_path, signum, code, said):
    """The terminal closes (SIGHUP to its process group) or Ctrl-C is pressed while the demo's programmer works:
    the loop says the state is saved and a rerun resumes, --status that the same command resumes the run; the
    same command then goes on with that run to PASS (no answered turn sent again), and says nothing of RESUME=0
    or of a new run."""
    home, folder = tmp_path / "home", tmp_path / "demo"
    home.mkdir()
    env = {key: value for key, value in os.environ.items() if not key.startswith(("CAO_", "MOCK_AGENT_", "TMUX"))}
    env.update(HOME=str(home), PATH=f"{os.environ['PATH']}{os.pathsep}{ensure_cao().parent}",
               MOCK_AGENT_THINK_MS="1500")
    command = [sys.executable, str(SCRIPT), "--demo", str(folder)]
    loop = subprocess.Popen(command, cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "programmer" not in prompts_of(folder):
            assert loop.poll() is None and time.monotonic() < deadline, loop.communicate()
            time.sleep(0.1)
        os.killpg(loop.pid, signum)
        out, err = loop.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(loop.pid, signal.SIGKILL)
    assert loop.returncode == code, out[-3000:] + err[-2000:]
    assert err.strip().splitlines()[-1] == f"{said}; state saved, rerun to resume"
    status = subprocess.run([sys.executable, str(SCRIPT), "--status"], cwd=folder, env=env, capture_output=True,
                            text=True, timeout=60)
    assert "the same command resumes the run" in status.stdout + status.stderr, status.stdout + status.stderr
    answered = prompts_of(folder)
    again = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-2000:]
    said_again = again.stdout + again.stderr
    assert f"demo: going on with the demo stopped in {folder}" in said_again
    assert "resuming run from" in said_again and "demo: PASS." in said_again
    assert "RESUME=0" not in said_again and "starting a new run" not in said_again
    assert prompts_of(folder)[:len(answered)] == answered and prompts_of(folder).count("analyst") == 2
    assert not _pids_with_env(f"HOME={home}".encode())
