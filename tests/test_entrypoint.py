"""deploy/entrypoint.sh, the recipe's entrypoint for one run on a machine of its own: what it refuses before
anything starts, and the recipe's exit-code policy drawn from the loop's own table. (It is run end to end,
on a fresh machine and under SIGTERM, in tests/e2e/test_fresh_node_e2e.py.)"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENTRYPOINT = REPO / "deploy" / "entrypoint.sh"
SCHEDULING = REPO / "docs" / "scheduling.md"


def run_entrypoint(env: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([shutil.which("bash"), str(ENTRYPOINT)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)


TASK = "*** ORIGINAL EXPLORE SUMMARY ***\nBuild it.\n*** SCENARIO TEST ***\n1. It works.\n"


@pytest.mark.parametrize("missing", ["tmux", "cao-server"])
def test_what_the_machine_lacks_is_one_line_and_exit_2_before_anything_starts(tmp_path, missing):
    """The loop, run by the entrypoint with its own server, says what the machine lacks before it starts
    anything: no state file, no tmux folder, no process."""
    tools = tmp_path / "bin"
    tools.mkdir()
    for name in {"tmux", "cao", "cao-server"} - {missing}:
        (tools / name).write_text("#!/bin/sh\necho started > \"$0.ran\"\n")
        (tools / name).chmod(0o755)
    for name in ("dirname", "bash"):
        (tools / name).symlink_to(shutil.which(name))
    (tools / "python3").symlink_to(sys.executable)
    wd = tmp_path / "project"
    wd.mkdir()
    env = {"PATH": str(tools), "HOME": str(tmp_path), "WD": str(wd), "PROMPT": TASK, "PROVIDER": "mock_cli"}
    result = run_entrypoint(env, tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: {missing} is not installed")
    assert not list(tools.glob("*.ran"))                              # nothing was started
    assert not (wd / ".tmp" / "orchestrator-loop-state.json").exists()


def test_the_recipes_pod_failure_policy_stops_on_the_codes_a_scheduler_must_not_retry(orch):
    text = SCHEDULING.read_text(encoding="utf-8")
    fail_job = re.search(r"action: FailJob.*?values: \[([\d, ]+)\]", text, re.DOTALL)
    stop = [code for code, _, action in orch.EXIT_CODES if action.startswith("stop")]
    assert [int(code) for code in fail_job.group(1).split(",")] == stop == [1, 2, 4, 5, 6, 70]
    assert "deploy/entrypoint.sh" in text and "podReplacementPolicy: Failed" in text


def test_the_recipe_names_each_setting_of_the_entrypoint():
    script = ENTRYPOINT.read_text(encoding="utf-8")
    settings = set(re.findall(r'^(?:export )?([A-Z_]+)="\$\{\1:-', script, re.MULTILINE)) - {"REPLACE_LOST_AGENTS"}
    assert settings == {"PYTHON"}
    assert "export OWN_SERVER=1" in script
    documented = SCHEDULING.read_text(encoding="utf-8")
    for name in settings:
        assert f"| `{name}` |" in documented, name
