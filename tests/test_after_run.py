"""Section 10: after a run -- archive the OpenSpec change, commit the work, notify through ntfy.

Archive tests use a fake `openspec` script (the real CLI runs in
tests/e2e/test_after_run_e2e.py); git tests use real git in temporary
repositories with an isolated git configuration; notifications go to the
local recorder of tests/ntfy_recorder.py.
"""

from __future__ import annotations

import json
import stat
import subprocess
import time
from pathlib import Path

import pytest

from conftest import FAST, TASK_PROMPT, run_main
from ntfy_recorder import NtfyRecorder, down_url


# -- helpers ---------------------------------------------------------------------

@pytest.fixture(autouse=True)
def isolated_git(monkeypatch, tmp_path):
    """No global or system git configuration, no identity from the environment."""
    empty = tmp_path / "gitconfig-empty"
    empty.write_text("")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(empty))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    for name in ("GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME", "GIT_COMMITTER_EMAIL", "EMAIL"):
        monkeypatch.delenv(name, raising=False)


def git(wd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=wd, check=True, capture_output=True, text=True).stdout


def make_repo(wd: Path, identity: bool = True) -> None:
    """A repository with two committed files and a user-configured identity (unless told not to)."""
    git(wd, "init", "-q")
    if identity:
        git(wd, "config", "user.name", "Pat Developer")
        git(wd, "config", "user.email", "pat@example.test")
    (wd / "app.py").write_text("print('v1')\n")
    (wd / "old.py").write_text("x = 0\n")
    ident = [] if identity else ["-c", "user.name=Setup", "-c", "user.email=setup@example.test"]
    git(wd, "add", "app.py", "old.py")
    git(wd, *ident, "commit", "-q", "-m", "initial")


def commits(wd: Path) -> int:
    return int(git(wd, "rev-list", "--count", "HEAD").strip())


def last_commit_files(wd: Path) -> list[str]:
    return sorted(git(wd, "show", "--name-only", "--format=", "HEAD").split("\n")[:-1])


def write_change(wd: Path, name: str = "add-greeting") -> Path:
    change = wd / "openspec" / "changes" / name
    change.mkdir(parents=True)
    (change / "tasks.md").write_text("## 1. Greet\n- [x] 1.1 Print Hello\n")
    return change


def fake_openspec(tmp_path: Path, body: str) -> Path:
    """An executable `openspec` that records its arguments and then runs `body` (bash)."""
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "openspec"
    script.write_text(f"#!/bin/bash\necho \"$@\" >> {tmp_path / 'openspec-calls.txt'}\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def is_running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie waiting to be reaped."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat_line.rsplit(")", 1)[1].split()[0] != "Z"


def ends_soon(pid: int) -> bool:
    """Whether process `pid` is gone within a few seconds: a killed process dies when the kernel gets to it,
    which on a busy machine is not at once."""
    deadline = time.monotonic() + 10
    while is_running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not is_running(pid)


def openspec_calls(tmp_path: Path) -> list[str]:
    path = tmp_path / "openspec-calls.txt"
    return path.read_text().splitlines() if path.exists() else []


def passed_run(m, round_no: int = 2) -> None:
    """The module as it stands right after a PASS in `round_no`, with the start snapshot taken."""
    m.set_task(TASK_PROMPT)
    m.update_run(current_round=round_no, final_status="PASS")
    m.update_run(worktree_at_start=m.snapshot_worktree() if m.COMMIT_ON_PASS else None)


# -- the accident-file rule ------------------------------------------------------

@pytest.mark.parametrize("name", ["EOF", "EOF)", "'EOF'", "PYEOF", "END", "CODE_EOF", "EOF;", "x = 1", "a=b", "print('hi')",
                                  "$(pwd)/notes.md", "`date`", "a;b", "out|tee", "<stdin>", "log>2",
                                  'say "hi"', "a&b", "back\\slash", "line\nbreak", "My Notes (1).md"])
def test_accident_names_are_recognised(orch, name):
    """Shell and code characters, heredoc markers (in any path part) make a name an accident."""
    assert orch.is_accident_name(name)


@pytest.mark.parametrize("name", ["greet.py", "src/app/main.py", "My Notes.md", "[id].tsx", "café.txt",
                                  "eof_handling.md", "Endpoint.java", "GEOFF", "EOFS.txt", "ENDING", "v1.2.3-rc1.tar.gz", "README",
                                  ".github/workflows/ci.yml", "docs/END-USER.md", "a+b.txt", "@scope/x.js"])
def test_ordinary_names_are_not_accidents(orch, name):
    assert not orch.is_accident_name(name)


# -- which change is archived ----------------------------------------------------

def test_change_is_the_only_active_one_archive_folder_ignored(orch, workdir):
    write_change(workdir)
    (workdir / "openspec" / "changes" / "archive" / "2026-01-01-old").mkdir(parents=True)
    assert orch.change_to_archive() == ("add-greeting", "")


def test_several_changes_name_them_and_how_to_choose(orch, workdir):
    write_change(workdir, "b-second")
    write_change(workdir, "a-first")
    change, why = orch.change_to_archive()
    assert change == ""
    assert "2 active OpenSpec changes" in why and "a-first, b-second" in why and "STORY_CHANGE" in why


def test_no_change_says_so(orch, workdir):
    assert orch.change_to_archive() == ("", f"no active OpenSpec change in {workdir / 'openspec' / 'changes'}")


def test_story_change_names_the_change_among_several(load_orch, workdir):
    write_change(workdir, "a-first")
    write_change(workdir, "b-second")
    m = load_orch(STORY_CHANGE="b-second", STORY_MODE="1")
    assert m.change_to_archive() == ("b-second", "")


# -- archive ---------------------------------------------------------------------

def test_archive_runs_openspec_archive_yes_for_the_change(load_orch, workdir, tmp_path, capsys):
    write_change(workdir)
    tool = fake_openspec(tmp_path, "echo \"Change '$2' archived as 'x-$2'.\"")
    m = load_orch(ARCHIVE_ON_PASS="1", OPENSPEC_COMMAND=str(tool))
    passed_run(m)
    assert m.finish_run(0) == 0
    assert openspec_calls(tmp_path) == ["archive add-greeting --yes"]
    assert m.after_run.archive == {"result": "archived", "change": "add-greeting"}
    out = capsys.readouterr().out
    assert "archive: OpenSpec change add-greeting archived" in out and "openspec: Change 'add-greeting'" in out
    assert "PASS in round 2; OpenSpec change add-greeting archived" in out


def test_archive_skipped_with_reason_when_changes_are_ambiguous(load_orch, workdir, tmp_path, capsys):
    write_change(workdir, "a-first")
    write_change(workdir, "b-second")
    tool = fake_openspec(tmp_path, "exit 0")
    m = load_orch(ARCHIVE_ON_PASS="1", OPENSPEC_COMMAND=str(tool))
    passed_run(m)
    assert m.finish_run(0) == 0
    assert openspec_calls(tmp_path) == []
    assert m.after_run.archive["result"] == "skipped"
    assert "archive: skipped, 2 active OpenSpec changes" in capsys.readouterr().out


def test_missing_openspec_is_logged_pass_stays_and_commit_is_skipped(load_orch, workdir, capsys):
    make_repo(workdir)
    write_change(workdir)
    m = load_orch(ARCHIVE_ON_PASS="1", COMMIT_ON_PASS="1", OPENSPEC_COMMAND="/nonexistent/openspec")
    passed_run(m)
    (workdir / "app.py").write_text("print('v2')\n")
    assert m.finish_run(0) == 0
    out = capsys.readouterr().out
    assert "archive: failed, `/nonexistent/openspec` cannot be run" in out
    assert "npm install -g @fission-ai/openspec" in out
    assert "commit: skipped, the archive of the OpenSpec change failed" in out
    assert m.after_run.commit == {"result": "skipped", "reason": "archive failed"}
    assert commits(workdir) == 1


def test_failing_archive_logs_its_output(load_orch, workdir, tmp_path, capsys):
    write_change(workdir)
    tool = fake_openspec(tmp_path, "echo 'Delta parsing found no operations' >&2; exit 1")
    m = load_orch(ARCHIVE_ON_PASS="1", OPENSPEC_COMMAND=str(tool))
    passed_run(m)
    assert m.finish_run(0) == 0
    out = capsys.readouterr().out
    assert "exited with 1" in out and "openspec: Delta parsing found no operations" in out
    assert m.after_run.archive["result"] == "failed"
    assert (workdir / "openspec" / "changes" / "add-greeting").is_dir()


def test_hanging_archive_is_stopped_after_archive_timeout(load_orch, workdir, tmp_path, capsys):
    write_change(workdir)
    sleeper_pid_file = tmp_path / "sleeper.pid"
    # It hangs until stopped; ARCHIVE_TIMEOUT is ample for it to have said its word and started its child (a
    # busy machine may take a second to start bash), and the test takes that long whatever the machine.
    tool = fake_openspec(tmp_path, f"echo working; sleep 60 >/dev/null 2>&1 & echo $! > {sleeper_pid_file}; wait; echo never")
    m = load_orch(ARCHIVE_ON_PASS="1", OPENSPEC_COMMAND=str(tool), ARCHIVE_TIMEOUT="3")
    passed_run(m)
    assert m.finish_run(0) == 0
    assert ends_soon(int(sleeper_pid_file.read_text()))          # the child it started was stopped too
    out = capsys.readouterr().out
    assert "never" not in out
    assert "did not finish within ARCHIVE_TIMEOUT=3s and was stopped" in out and "openspec: working" in out
    assert m.after_run.archive["result"] == "failed"


# -- commit ----------------------------------------------------------------------

def test_commit_takes_exactly_what_the_run_changed(load_orch, workdir, capsys):
    """Modified, deleted and new files are committed; the user's untracked and staged files, .tmp/
    and accident files are not."""
    make_repo(workdir)
    (workdir / "notes.txt").write_text("my own notes\n")             # untracked before the run
    (workdir / "draft.md").write_text("draft v1\n")                   # untracked before, changed by the run
    (workdir / "staged.txt").write_text("staged by the user\n")
    git(workdir, "add", "staged.txt")
    m = load_orch(COMMIT_ON_PASS="1")
    passed_run(m)
    (workdir / "app.py").write_text("print('v2')\n")
    (workdir / "old.py").unlink()
    (workdir / "greet").mkdir()
    (workdir / "greet" / "cli.py").write_text("def main(): pass\n")
    (workdir / "draft.md").write_text("draft v2\n")
    (workdir / "EOF)").write_text("junk\n")
    (workdir / "x = 1").write_text("junk\n")
    (workdir / ".tmp").mkdir(exist_ok=True)
    (workdir / ".tmp" / "scratch.md").write_text("reply\n")
    assert m.finish_run(0) == 0
    assert commits(workdir) == 2
    assert last_commit_files(workdir) == ["app.py", "draft.md", "greet/cli.py", "old.py"]
    status = git(workdir, "status", "--porcelain", "--untracked-files=all")
    assert "A  staged.txt" in status                                   # still staged, not committed
    assert "?? notes.txt" in status and '?? "x = 1"' in status and "?? EOF)" in status
    record = m.after_run.commit
    assert record["result"] == "committed" and record["files"] == ["app.py", "draft.md", "greet/cli.py", "old.py"]
    assert sorted(record["left_out"]) == ["EOF)", "x = 1"]
    out = capsys.readouterr().out
    assert "commit: left out 2 files whose names look like shell or code fragments" in out
    assert f"committed {record['commit']} (4 files)" in out


def test_commit_message_names_task_round_and_change(load_orch, workdir, tmp_path):
    make_repo(workdir)
    write_change(workdir)
    tool = fake_openspec(tmp_path, "mkdir -p openspec/changes/archive && mv openspec/changes/$2 "
                                   "openspec/changes/archive/2026-01-01-$2")
    m = load_orch(ARCHIVE_ON_PASS="1", COMMIT_ON_PASS="1", OPENSPEC_COMMAND=str(tool))
    passed_run(m, round_no=3)
    (workdir / "app.py").write_text("print('v2')\n")
    assert m.finish_run(0) == 0
    message = git(workdir, "log", "-1", "--format=%B")
    assert message.splitlines()[0] == "Build a greeting CLI: `greet NAME` prints `Hello, NAME!`."
    assert "The tester reported PASS in round 3 of the orchestrator loop." in message
    assert "OpenSpec change: add-greeting (archived)" in message
    files = last_commit_files(workdir)
    assert "app.py" in files and "openspec/changes/archive/2026-01-01-add-greeting/tasks.md" in files


def test_long_first_line_is_shortened_for_the_subject(orch):
    orch.set_task("*** ORIGINAL EXPLORE SUMMARY ***\n# " + "word " * 40 + "\n*** SCENARIO TEST ***\nRun it.\n")
    title = orch.task_title()
    assert len(title) <= 72 and title.endswith("...") and title.startswith("word word")


def test_no_git_repository_is_logged_and_pass_stays(load_orch, workdir, capsys):
    m = load_orch(COMMIT_ON_PASS="1")
    passed_run(m)
    (workdir / "app.py").write_text("x\n")
    assert m.finish_run(0) == 0
    assert f"commit: skipped, {workdir} is not in a git repository" in capsys.readouterr().out
    assert m.after_run.commit["result"] == "skipped"


def test_nothing_to_commit(load_orch, workdir, capsys):
    make_repo(workdir)
    (workdir / "notes.txt").write_text("mine\n")
    m = load_orch(COMMIT_ON_PASS="1")
    passed_run(m)
    (workdir / ".tmp").mkdir()
    (workdir / ".tmp" / "state-ish.json").write_text("{}")
    assert m.finish_run(0) == 0
    assert commits(workdir) == 1
    assert "commit: nothing to commit" in capsys.readouterr().out
    assert m.after_run.commit["result"] == "nothing"


def test_failing_commit_hook_is_logged_and_pass_stays(load_orch, workdir, capsys):
    make_repo(workdir)
    hook = workdir / ".git" / "hooks" / "pre-commit"
    hook.write_text("#!/bin/sh\necho 'lint: 3 problems' >&2\nexit 1\n")
    hook.chmod(0o755)
    m = load_orch(COMMIT_ON_PASS="1")
    passed_run(m)
    (workdir / "app.py").write_text("print('v2')\n")
    assert m.finish_run(0) == 0
    out = capsys.readouterr().out
    assert "commit: failed, git commit exited with 1 (a commit hook?)" in out and "git: lint: 3 problems" in out
    assert commits(workdir) == 1
    assert m.after_run.commit["result"] == "failed"


def test_missing_identity_uses_a_fallback_without_touching_git_config(load_orch, workdir, capsys):
    make_repo(workdir, identity=False)
    m = load_orch(COMMIT_ON_PASS="1")
    passed_run(m)
    (workdir / "app.py").write_text("print('v2')\n")
    assert m.finish_run(0) == 0
    assert git(workdir, "log", "-1", "--format=%an <%ae>").strip() == \
        "cao-orchestrator-loop <orchestrator-loop@localhost>"
    assert subprocess.run(["git", "config", "--get", "user.name"], cwd=workdir).returncode == 1
    assert "git has no user.name/user.email here; committing as cao-orchestrator-loop" in capsys.readouterr().out


def test_configured_identity_is_used(load_orch, workdir, capsys):
    make_repo(workdir)
    m = load_orch(COMMIT_ON_PASS="1")
    passed_run(m)
    (workdir / "app.py").write_text("print('v2')\n")
    m.finish_run(0)
    assert git(workdir, "log", "-1", "--format=%an").strip() == "Pat Developer"
    assert "git has no user.name" not in capsys.readouterr().out


def test_without_a_start_snapshot_only_tracked_files_are_committed(load_orch, workdir, capsys):
    make_repo(workdir)
    m = load_orch(COMMIT_ON_PASS="1")
    passed_run(m)
    m.update_run(worktree_at_start=None)  # a run started without COMMIT_ON_PASS
    (workdir / "app.py").write_text("print('v2')\n")
    (workdir / "new.py").write_text("new\n")
    m.finish_run(0)
    assert last_commit_files(workdir) == ["app.py"]
    assert "no record of the working tree at the run's start" in capsys.readouterr().out


def test_fail_neither_archives_nor_commits(load_orch, workdir, tmp_path):
    make_repo(workdir)
    write_change(workdir)
    tool = fake_openspec(tmp_path, "exit 0")
    m = load_orch(ARCHIVE_ON_PASS="1", COMMIT_ON_PASS="1", OPENSPEC_COMMAND=str(tool))
    passed_run(m)
    (workdir / "app.py").write_text("print('v2')\n")
    assert m.finish_run(1) == 1
    assert openspec_calls(tmp_path) == [] and commits(workdir) == 1 and m.after_run == m.AfterRun()


# -- once per run ----------------------------------------------------------------

def test_state_keeps_the_records_and_a_resumed_finish_does_not_repeat_them(load_orch, workdir, tmp_path, capsys):
    make_repo(workdir)
    write_change(workdir)
    tool = fake_openspec(tmp_path, "exit 0")
    m = load_orch(ARCHIVE_ON_PASS="1", COMMIT_ON_PASS="1", OPENSPEC_COMMAND=str(tool))
    passed_run(m)
    (workdir / "app.py").write_text("print('v2')\n")
    m.finish_run(0)
    assert openspec_calls(tmp_path) == ["archive add-greeting --yes"] and commits(workdir) == 2
    saved = json.loads(Path(m.STATE_FILE).read_text())
    assert saved["after_run"]["archive"]["result"] == "archived"
    assert saved["after_run"]["commit"]["result"] == "committed"
    assert isinstance(saved["worktree_at_start"], dict)

    # The same run, loaded again from its state file (as a resume does), finishing once more.
    m2 = load_orch(ARCHIVE_ON_PASS="1", COMMIT_ON_PASS="1", OPENSPEC_COMMAND=str(tool))
    assert m2.load_state()
    (workdir / "app.py").write_text("print('v3')\n")
    capsys.readouterr()
    assert m2.finish_run(0) == 0
    assert openspec_calls(tmp_path) == ["archive add-greeting --yes"]
    assert commits(workdir) == 2
    out = capsys.readouterr().out
    assert "archive: done already for this run (archived), not repeated" in out
    assert "commit: done already for this run (committed), not repeated" in out


def test_a_malformed_record_of_the_start_is_dropped(orch, workdir):
    Path(orch.STATE_FILE).parent.mkdir(parents=True)
    Path(orch.STATE_FILE).write_text(json.dumps({"worktree_at_start": {"a.py": 3}, "after_run": "x"}))
    assert orch.load_state()
    assert orch.worktree_at_start is None and orch.after_run == orch.AfterRun()


# -- notifications ---------------------------------------------------------------

def test_pass_notification_carries_title_round_and_last_line(load_orch, workdir):
    with NtfyRecorder() as ntfy:
        m = load_orch(NTFY_TOPIC="loop-alerts", NTFY_SERVER=ntfy.url)
        passed_run(m, round_no=2)
        assert m.finish_run(0) == 0
    [request] = ntfy.requests
    assert request["method"] == "POST" and request["path"] == "/loop-alerts"
    assert request["headers"]["title"] == "PASS in round 2: Build a greeting CLI: `greet NAME` prints `Hello, NAME!`."
    assert request["headers"]["priority"] == "default" and request["headers"]["tags"] == "white_check_mark"
    assert request["body"] == "PASS in round 2"
    assert "authorization" not in request["headers"]
    assert m.after_run.notified == "PASS"


def test_token_is_sent_as_bearer_only_when_set_and_never_logged_or_saved(load_orch, workdir, capsys):
    with NtfyRecorder() as ntfy:
        m = load_orch(NTFY_TOPIC="loop-alerts", NTFY_SERVER=ntfy.url, NTFY_TOKEN="tk_secret123")
        passed_run(m)
        m.finish_run(0)
    assert ntfy.requests[0]["headers"]["authorization"] == "Bearer tk_secret123"
    assert "tk_secret123" not in capsys.readouterr().out
    assert "tk_secret123" not in Path(m.STATE_FILE).read_text()


def test_fail_notification(load_orch, workdir):
    with NtfyRecorder() as ntfy:
        m = load_orch(NTFY_TOPIC="loop-alerts", NTFY_SERVER=ntfy.url, MAX_ROUNDS="3")
        passed_run(m, round_no=3)
        assert m.finish_run(1) == 1
    [request] = ntfy.requests
    assert request["headers"]["title"].startswith("FAIL in round 3: ") and request["headers"]["priority"] == "high"
    assert request["body"] == "FAIL: no PASS within MAX_ROUNDS=3"


def test_non_ascii_title_is_encoded_for_the_header(load_orch, workdir):
    with NtfyRecorder() as ntfy:
        m = load_orch(NTFY_TOPIC="t", NTFY_SERVER=ntfy.url)
        m.set_task("*** ORIGINAL EXPLORE SUMMARY ***\nGrüße ausgeben\n*** SCENARIO TEST ***\nRun it.\n")
        m.finish_run(0)
    import base64
    title = ntfy.requests[0]["headers"]["title"]
    assert title.startswith("=?UTF-8?B?")
    assert base64.b64decode(title[10:-2]).decode() == "PASS in round 1: Grüße ausgeben"


def test_nothing_is_sent_without_a_topic(load_orch, workdir):
    with NtfyRecorder() as ntfy:
        m = load_orch(NTFY_SERVER=ntfy.url)
        passed_run(m)
        m.finish_run(0)
        m.notify_stopped(m.RunError("the tester terminal reported an error"))
    assert ntfy.requests == []


def test_stop_that_needs_a_person_is_notified_and_still_raised(load_orch, workdir, monkeypatch):
    with NtfyRecorder() as ntfy:
        m = load_orch(NTFY_TOPIC="loop-alerts", NTFY_SERVER=ntfy.url)
        m.set_task(TASK_PROMPT)
        m.update_run(current_round=2)

        def stop():
            raise m.RunError("the programmer did not answer within RESPONSE_TIMEOUT=60s")
        monkeypatch.setattr(m, "drive_rounds", stop)
        with pytest.raises(m.RunError):
            m.run_loop()
    [request] = ntfy.requests
    assert request["headers"]["title"].startswith("Stopped, needs you in round 2: ")
    assert request["headers"]["tags"] == "warning"
    assert request["body"] == ("Stopped in round 2: the programmer did not answer within RESPONSE_TIMEOUT=60s; "
                               "state saved, rerun to resume")


def test_server_down_is_logged_and_pass_stays(load_orch, workdir, capsys):
    url = down_url()
    m = load_orch(NTFY_TOPIC="loop-alerts", NTFY_SERVER=url)
    passed_run(m)
    assert m.finish_run(0) == 0
    assert f"notify: could not send the PASS notification to {url}/loop-alerts" in capsys.readouterr().out
    assert m.after_run.notified is None


def test_hanging_server_is_given_up_on_quickly(load_orch, workdir, capsys):
    with NtfyRecorder(mode="hang", hang_seconds=30) as ntfy:
        m = load_orch(NTFY_TOPIC="loop-alerts", NTFY_SERVER=ntfy.url)
        m.NOTIFY_TIMEOUT_SECONDS = 0.5
        passed_run(m)
        assert m.finish_run(0) == 0
        assert len(ntfy.requests) == 1 and ntfy.answered == 0     # the run did not wait for the answer
    assert "notify: could not send the PASS notification" in capsys.readouterr().out


def test_refusing_server_is_logged_with_a_hint(load_orch, workdir, capsys):
    with NtfyRecorder(mode="refuse") as ntfy:
        m = load_orch(NTFY_TOPIC="loop-alerts", NTFY_SERVER=ntfy.url)
        passed_run(m)
        assert m.finish_run(0) == 0
    assert "refused the PASS notification: HTTP 403" in capsys.readouterr().out


def test_notification_is_sent_once_per_finished_run(load_orch, workdir):
    with NtfyRecorder() as ntfy:
        m = load_orch(NTFY_TOPIC="loop-alerts", NTFY_SERVER=ntfy.url)
        passed_run(m)
        m.finish_run(0)
        m.finish_run(0)
    assert len(ntfy.requests) == 1


# -- settings --------------------------------------------------------------------

def test_token_in_the_config_file_is_refused(load_orch, workdir, tmp_path, capsys):
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"notify": {"ntfy_topic": "t", "ntfy_token": "tk"}}))
    m = load_orch()
    assert run_main(m, str(config)) == 2
    assert "key 'notify.ntfy_token' is refused" in capsys.readouterr().err


@pytest.mark.parametrize("env, message", [({"NTFY_TOPIC": "my topic"}, "is not an ntfy topic"),
                                          ({"NTFY_SERVER": "ntfy.sh"}, "NTFY_SERVER='ntfy.sh' is not valid"),
                                          ({"OPENSPEC_COMMAND": "npx 'openspec"}, "is not a command line")])
def test_bad_settings_are_refused(load_orch, prompt_file, capsys, env, message):
    m = load_orch(PROMPT_FILE=str(prompt_file), **env)
    assert run_main(m) == 2
    assert message in capsys.readouterr().err


def test_settings_from_the_config_file(load_orch, tmp_path):
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"on_pass": {"archive_change": True, "commit": True, "archive_timeout": 30,
                                              "openspec_command": "npx openspec"},
                                  "notify": {"ntfy_topic": "alerts", "ntfy_server": "http://127.0.0.1:1"}}))
    m = load_orch()
    m.configure([str(config)])
    assert (m.ARCHIVE_ON_PASS, m.COMMIT_ON_PASS, m.ARCHIVE_TIMEOUT, m.OPENSPEC_COMMAND) == (True, True, 30.0,
                                                                                         "npx openspec")
    assert (m.NTFY_TOPIC, m.NTFY_SERVER) == ("alerts", "http://127.0.0.1:1")


def test_all_off_by_default(orch):
    assert (orch.ARCHIVE_ON_PASS, orch.COMMIT_ON_PASS, orch.NTFY_TOPIC) == (False, False, "")
    assert orch.NTFY_SERVER == "https://ntfy.sh"


# -- a whole run in-process ------------------------------------------------------

def test_whole_run_commits_its_work_and_notifies(load_orch, fake_cao, prompt_file, workdir, monkeypatch, capsys):
    """main() on the fake CAO: PASS, one commit of what changed after the start, one notification."""
    make_repo(workdir)
    (workdir / "notes.txt").write_text("mine\n")
    with NtfyRecorder() as ntfy:
        m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", COMMIT_ON_PASS="1",
                      NTFY_TOPIC="loop-alerts", NTFY_SERVER=ntfy.url, **FAST)
        fake_cao.router.route(host="127.0.0.1").pass_through()
        take_snapshot = m.snapshot_worktree

        def snapshot_then_work():
            snapshot = take_snapshot()
            (workdir / "app.py").write_text("print('v2')\n")    # what the agents do during the run
            (workdir / "EOF").write_text("junk\n")
            return snapshot
        monkeypatch.setattr(m, "snapshot_worktree", snapshot_then_work)
        assert run_main(m) == 0
    assert commits(workdir) == 2 and last_commit_files(workdir) == ["app.py"]
    [request] = ntfy.requests
    assert request["body"].startswith("PASS in round 1; committed ")
    summary = json.loads((Path(m.run_dir) / "summary.json").read_text())
    assert summary["after_run"]["commit"]["files"] == ["app.py"]


def test_agent_staged_deletion_and_addition_are_committed(load_orch, workdir):
    """Files an agent put in the index itself (git rm, git add) are part of the run's work."""
    make_repo(workdir)
    m = load_orch(COMMIT_ON_PASS="1")
    passed_run(m)
    git(workdir, "rm", "-q", "old.py")
    (workdir / "added.py").write_text("y = 2\n")
    git(workdir, "add", "added.py")
    m.finish_run(0)
    assert m.after_run.commit["result"] == "committed"
    assert last_commit_files(workdir) == ["added.py", "old.py"]


def test_wd_below_the_repository_top_commits_only_its_own_files(load_orch, tmp_path):
    top = tmp_path / "mono"
    (top / "svc").mkdir(parents=True)
    make_repo(top)
    m = load_orch(WD=str(top / "svc"), COMMIT_ON_PASS="1")
    passed_run(m)
    (top / "svc" / "main.py").write_text("run()\n")
    (top / "app.py").write_text("outside WD\n")
    m.finish_run(0)
    assert last_commit_files(top) == ["svc/main.py"]


def test_what_a_step_runs_into_does_not_undo_the_pass_and_a_fault_of_the_loop_is_not_hidden(load_orch, workdir,
                                                                                             monkeypatch, capsys):
    """A full disk in a step: said, recorded as failed, the PASS stands. A fault of the loop's own in it is
    raised (exit 70 with its traceback), nothing recorded: a rerun does the step again."""
    m = load_orch(COMMIT_ON_PASS="1")
    passed_run(m)

    def broken(archive):
        raise ValueError("something odd")
    monkeypatch.setattr(m, "commit_run", broken)
    with pytest.raises(ValueError, match="something odd"):
        m.finish_run(0)
    assert m.after_run.commit is None

    def disk_full(archive):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(m, "commit_run", disk_full)
    assert m.finish_run(0) == 0
    assert "commit: failed, unexpected OSError: [Errno 28] No space left on device" in capsys.readouterr().out
    assert m.after_run.commit["result"] == "failed"


def test_help_and_settings_doc_list_the_new_settings(orch):
    doc = (Path(__file__).resolve().parent.parent / "docs" / "settings.md").read_text(encoding="utf-8")
    help_text = orch.settings_help_text()
    for name in ("ARCHIVE_ON_PASS", "OPENSPEC_COMMAND", "ARCHIVE_TIMEOUT", "COMMIT_ON_PASS", "NTFY_TOPIC",
                 "NTFY_SERVER"):
        setting = orch.SETTINGS_BY_ENV[name]
        assert f"| `{name}` | `{setting.key}` |" in doc
        assert name in help_text and setting.key in help_text
    assert "| `NTFY_TOKEN` | – (environment only) |" in doc and "NTFY_TOKEN" in help_text


def test_status_shows_what_was_done_after_the_run(load_orch, workdir):
    make_repo(workdir)
    m = load_orch(COMMIT_ON_PASS="1")
    passed_run(m)
    (workdir / "app.py").write_text("print('v2')\n")
    m.finish_run(0)
    m.save_state()
    code, report = m.status_report()
    sha = git(workdir, "rev-parse", "--short", "HEAD").strip()
    assert code == 0 and f"after the run: commit committed {sha}" in report


# -- a run stopped during its after-run steps ------------------------------------

def test_steps_a_stopped_run_left_undone_are_done_by_the_next_invocation_once(
        load_orch, fake_cao, prompt_file, workdir, monkeypatch, capsys):
    """Killed while committing: the PASS is saved, the commit and the notification are not lost.
    The next invocation (cron's, with REPORT_FINISHED_RUN=1) does them, once, and reports the run."""
    make_repo(workdir)
    settings = dict(PROMPT_FILE=str(prompt_file), START_AGENT="tester", COMMIT_ON_PASS="1",
                    NTFY_TOPIC="loop-alerts", REPORT_FINISHED_RUN="1", **FAST)
    with NtfyRecorder() as ntfy:
        m = load_orch(NTFY_SERVER=ntfy.url, **settings)
        fake_cao.router.route(host="127.0.0.1").pass_through()
        take_snapshot = m.snapshot_worktree

        def snapshot_then_work():
            snapshot = take_snapshot()
            (workdir / "app.py").write_text("print('v2')\n")
            return snapshot

        def killed(*args):
            raise KeyboardInterrupt
        monkeypatch.setattr(m, "snapshot_worktree", snapshot_then_work)
        monkeypatch.setattr(m, "commit_run", killed)
        assert run_main(m) == 130
        state = json.loads(Path(m.STATE_FILE).read_text())
        assert state["final_status"] == "PASS" and state["after_run"]["due"] == ["commit", "notify"]
        assert commits(workdir) == 1 and ntfy.requests == []
        assert "still to do after the run: commit, notify (the next invocation does it)" in m.status_report()[1]
        prompts = len(fake_cao.prompts)

        m = load_orch(NTFY_SERVER=ntfy.url, **settings)
        assert run_main(m) == 0
        out = capsys.readouterr().out
        assert "still to do after it: commit, notify (stopped before, or not sent); doing that now" in out
        assert commits(workdir) == 2 and last_commit_files(workdir) == ["app.py"]
        assert len(ntfy.requests) == 1 and ntfy.requests[0]["body"].startswith("PASS in round 1; committed ")

        m = load_orch(NTFY_SERVER=ntfy.url, **settings)
        assert run_main(m) == 0
        assert "doing that now" not in capsys.readouterr().out
    assert commits(workdir) == 2 and len(ntfy.requests) == 1
    assert len(fake_cao.prompts) == prompts          # no agent was asked anything again


def test_steps_turned_on_after_a_run_finished_are_not_applied_to_it(load_orch, fake_cao, prompt_file, workdir,
                                                                    capsys):
    """Only what the run was asked to do when it ended is finished later: a new setting is for new runs."""
    make_repo(workdir)
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", **FAST)
    assert run_main(m) == 0
    assert "after the run" not in m.status_report()[1]          # nothing was asked, nothing to say
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", COMMIT_ON_PASS="1",
                  REPORT_FINISHED_RUN="1", **FAST)
    assert run_main(m) == 0
    assert "doing that now" not in capsys.readouterr().out
    assert commits(workdir) == 1
