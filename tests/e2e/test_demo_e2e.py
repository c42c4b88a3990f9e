"""The demo a newcomer runs (docs/testing.md, "The demo"), run as written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from . import cao_env

pytestmark = pytest.mark.e2e

DEMO = Path(__file__).resolve().with_name("demo.py")


def test_the_demo_passes_and_its_last_lines_fit_what_it_left():
    result = subprocess.run([sys.executable, str(DEMO)], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "MOCK_AGENT_THINK_MS": "300"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "----- orchestrator exited with 0 (PASS) -----" in out
    # The demo removes its server: the loop ends its agents itself, and nothing points at them.
    assert "CLEANUP_ON_EXIT=1: ending the five agents" in out
    assert "tmux attach" not in out and "cao shutdown" not in out
    assert out.splitlines()[-1].startswith("demo: done in ")


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
