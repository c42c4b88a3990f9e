"""The pinned CAO the end-to-end suite and the demo use: one installed with the project is used as it is.
(The demo itself, `--demo`, runs in tests/e2e/test_own_server_e2e.py and the README's quick start.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from . import cao_env

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
