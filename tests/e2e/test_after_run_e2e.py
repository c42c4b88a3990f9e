"""After a PASS on the real cao-server: the real `openspec archive`, one commit, one ntfy notification.

The scripted programmer edits the project as an agent would (a changed file,
a new test, the change's tasks ticked off) and also leaves an accident file
named `EOF)` behind. The run must archive the change with the pinned OpenSpec
CLI, commit exactly what the agents and the archive changed (not .tmp/, not
the accident, not the user's untracked notes) and tell the local ntfy
recorder.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import running_in_ci
from .openspec_cli import OpenSpecInstallError, ensure_openspec
from .test_orchestrator_e2e import PASS_REPLY, PROGRAMMER_REPLY, Run, explain

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ntfy_recorder import NtfyRecorder  # noqa: E402

pytestmark = pytest.mark.e2e

PROPOSAL = ("## Why\nPeople running the CLI want to be greeted by name, so the tool feels friendly and its "
            "output can be checked in scripts.\n\n## What Changes\n- Add a `greet NAME` command.\n")
TASKS_TODO = "## 1. Print the greeting\n- [ ] 1.1 Print Hello, NAME!\n"
TASKS_DONE = "## 1. Print the greeting\n- [x] 1.1 Print Hello, NAME!\n"
SPEC_DELTA = ("## ADDED Requirements\n### Requirement: Greeting\nThe CLI SHALL print `Hello, NAME!` for a "
              "name.\n\n#### Scenario: Greets\n- **WHEN** `greet World` runs\n- **THEN** it prints "
              "`Hello, World!`\n")


@pytest.fixture(scope="module")
def openspec_bin() -> Path:
    try:
        return ensure_openspec()
    except OpenSpecInstallError as exc:
        if running_in_ci():
            pytest.fail(f"the OpenSpec CLI cannot be installed: {exc}", pytrace=False)
        pytest.skip(f"the OpenSpec CLI cannot be installed: {exc}")


def git(wd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=wd, check=True, capture_output=True, text=True).stdout


def make_project(wd: Path) -> None:
    """A git repository with greet.py and an OpenSpec change committed, and the user's untracked notes."""
    change = wd / "openspec" / "changes" / "add-greeting"
    (change / "specs" / "greeting").mkdir(parents=True)
    (change / "proposal.md").write_text(PROPOSAL)
    (change / "tasks.md").write_text(TASKS_TODO)
    (change / "specs" / "greeting" / "spec.md").write_text(SPEC_DELTA)
    (wd / "greet.py").write_text("print('hi')\n")
    git(wd, "init", "-q")
    git(wd, "config", "user.name", "Pat Developer")
    git(wd, "config", "user.email", "pat@example.test")
    git(wd, "add", ".")
    git(wd, "commit", "-q", "-m", "greeting proposal")
    (wd / "notes.txt").write_text("my own notes, not part of the work\n")


def test_pass_archives_commits_exactly_the_work_and_notifies(cao, openspec_bin, tmp_path):
    with NtfyRecorder() as ntfy:
        run = Run(cao, START_AGENT="programmer", ARCHIVE_ON_PASS="1", COMMIT_ON_PASS="1",
                  OPENSPEC_COMMAND=str(openspec_bin), NTFY_TOPIC="loop-e2e", NTFY_SERVER=ntfy.url)
        empty = tmp_path / "gitconfig"
        empty.write_text("")
        run.env.update(GIT_CONFIG_GLOBAL=str(empty), GIT_CONFIG_NOSYSTEM="1")
        make_project(run.wd)
        head_before = git(run.wd, "rev-parse", "HEAD").strip()
        cao.set_script({
            "programmer": [{"text": PROGRAMMER_REPLY, "files": {
                str(run.wd / "greet.py"): "import sys\nprint(f'Hello, {sys.argv[1]}!')\n",
                str(run.wd / "tests" / "test_greet.py"): "def test_greet():\n    assert True\n",
                str(run.wd / "openspec" / "changes" / "add-greeting" / "tasks.md"): TASKS_DONE,
                str(run.wd / "EOF)"): "print('half a heredoc')\n",
            }}],
            "tester": [PASS_REPLY],
        })
        result = run.run(timeout=180)
    assert result.returncode == 0, explain(result)

    archive = run.wd / "openspec" / "changes" / "archive"
    [archived] = [p.name for p in archive.iterdir()]
    assert archived.endswith("-add-greeting")
    assert not (run.wd / "openspec" / "changes" / "add-greeting").exists()
    assert "### Requirement: Greeting" in (run.wd / "openspec" / "specs" / "greeting" / "spec.md").read_text()

    assert git(run.wd, "rev-list", "--count", f"{head_before}..HEAD").strip() == "1"
    changed = git(run.wd, "show", "--no-renames", "--name-status", "--format=", "HEAD").splitlines()
    assert sorted(changed) == sorted([
        "M\tgreet.py",
        "A\ttests/test_greet.py",
        "D\topenspec/changes/add-greeting/proposal.md",
        "D\topenspec/changes/add-greeting/specs/greeting/spec.md",
        "D\topenspec/changes/add-greeting/tasks.md",
        f"A\topenspec/changes/archive/{archived}/proposal.md",
        f"A\topenspec/changes/archive/{archived}/specs/greeting/spec.md",
        f"A\topenspec/changes/archive/{archived}/tasks.md",
        "A\topenspec/specs/greeting/spec.md",
    ])
    message = git(run.wd, "log", "-1", "--format=%B")
    assert message.startswith("Build a greeting CLI: `greet NAME` prints `Hello, NAME!`.\n")
    assert "PASS in round 1" in message and "OpenSpec change: add-greeting (archived)" in message
    status = git(run.wd, "status", "--porcelain", "--untracked-files=all")
    assert "?? EOF)" in status and "?? notes.txt" in status
    assert "commit: left out 1 file whose names look like shell or code fragments" in result.stdout

    [request] = ntfy.requests
    assert request["path"] == "/loop-e2e" and request["headers"]["title"].startswith("PASS in round 1: ")
    sha = git(run.wd, "rev-parse", "--short", "HEAD").strip()
    assert request["body"] == f"PASS in round 1; OpenSpec change add-greeting archived; committed {sha} (9 files)"
    assert "authorization" not in request["headers"]
    assert run.state()["after_run"]["commit"]["commit"] == sha


def test_agent_error_stop_is_notified(cao):
    """An agent that reports an error stops the run (exit 3, resumable) and the user is told, once."""
    with NtfyRecorder() as ntfy:
        run = Run(cao, START_AGENT="tester", NTFY_TOPIC="loop-e2e", NTFY_SERVER=ntfy.url, NTFY_TOKEN="tk_e2e_secret")
        cao.set_script({"tester": [{"action": "error", "think_ms": 100}]})
        result = run.run()
    assert result.returncode == 3, explain(result)
    [request] = ntfy.requests
    assert request["headers"]["title"].startswith("Stopped, needs you in round 1: ")
    assert request["headers"]["authorization"] == "Bearer tk_e2e_secret"
    assert request["body"].startswith("Stopped in round 1: ") and "tester" in request["body"]
    assert "tk_e2e_secret" not in result.stdout + result.stderr + run.state_file.read_text()


def test_pass_stands_when_the_ntfy_server_hangs(cao):
    with NtfyRecorder(mode="hang", hang_seconds=30) as ntfy:
        run = Run(cao, START_AGENT="tester", NTFY_TOPIC="loop-e2e", NTFY_SERVER=ntfy.url)
        cao.set_script({"tester": [PASS_REPLY]})
        result = run.run()
        unanswered_when_the_run_ended = ntfy.answered == 0
    assert result.returncode == 0, explain(result)
    assert len(ntfy.requests) == 1 and unanswered_when_the_run_ended
    assert "notify: could not send the PASS notification" in result.stdout
