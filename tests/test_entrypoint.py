"""deploy/entrypoint.sh, the recipe's entrypoint for one run on a machine of its own: what it refuses before
anything starts, and the recipe's exit-code policy drawn from the loop's own table. (It is run end to end,
on a fresh machine and under SIGTERM, in tests/e2e/test_fresh_node_e2e.py.)"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENTRYPOINT = REPO / "deploy" / "entrypoint.sh"
SCHEDULING = REPO / "docs" / "scheduling.md"


def run_entrypoint(env: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([shutil.which("bash"), str(ENTRYPOINT)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("missing", ["tmux", "cao", "cao-server"])
def test_a_tool_missing_on_the_machine_is_one_line_and_exit_2_before_anything_starts(tmp_path, missing):
    tools = tmp_path / "bin"
    tools.mkdir()
    for name in {"tmux", "cao", "cao-server"} - {missing}:
        (tools / name).write_text("#!/bin/sh\necho started > \"$0.ran\"\n")
        (tools / name).chmod(0o755)
    for name in ("dirname", "basename", "python3"):                  # and what a shell script needs
        (tools / name).symlink_to(shutil.which(name))
    env = {"PATH": str(tools), "HOME": str(tmp_path)}
    result = run_entrypoint(env, tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"entrypoint: error: {missing} is not on PATH: install it in the image (tmux; pip install "
        "cli-agent-orchestrator)"]
    assert not list(tools.glob("*.ran"))                              # nothing was started


def test_the_recipes_pod_failure_policy_stops_on_the_codes_a_scheduler_must_not_retry(orch):
    text = SCHEDULING.read_text(encoding="utf-8")
    fail_job = re.search(r"action: FailJob.*?values: \[([\d, ]+)\]", text, re.DOTALL)
    stop = [code for code, _, action in orch.EXIT_CODES if action.startswith("stop")]
    assert [int(code) for code in fail_job.group(1).split(",")] == stop == [1, 2, 4, 70]
    assert "deploy/entrypoint.sh" in text and "podReplacementPolicy: Failed" in text


def test_the_recipe_names_each_setting_of_the_entrypoint():
    script = ENTRYPOINT.read_text(encoding="utf-8")
    settings = set(re.findall(r'^([A-Z_]+)="\$\{\1:-', script, re.MULTILINE)) - {"API", "REPLACE_LOST_AGENTS"}
    assert settings == {"CAO_PORT", "PROFILES_DIR", "CAO_SERVER_LOG", "CAO_START_SECONDS", "PYTHON"}
    documented = SCHEDULING.read_text(encoding="utf-8")
    for name in settings:
        assert f"| `{name}` |" in documented, name
