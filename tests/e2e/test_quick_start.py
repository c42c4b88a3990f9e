"""The README's quick start, run as written: a fresh clone, a new virtual environment, a new HOME, the two
commands -- and a PASS, with nothing of the run left running and the user's own tmux server untouched.

The block is read from README.md (the first ``sh`` block under "## Quick start"), so the test follows the
text a new user follows. Only the surroundings are set: a new HOME, a PATH with nothing but the interpreter
and the system directories (no virtual environment of ours, no settings of the loop), and a tmux server of
the user's own with a session, which the block is run inside of (TMUX set, as in a terminal of that tmux):
the run must neither use nor end it. The shell traces every command with the seconds since the start; the
transcript is written to ``$QUICK_START_TRANSCRIPT`` when set.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from .conftest import running_in_ci
from .harness import _pids_with_env

REPO_ROOT = Path(__file__).resolve().parents[2]
README = REPO_ROOT / "README.md"
AGENT_LINK = Path("/usr/local/bin/mock_cli")  # where an earlier quick start linked the scripted agent
TIMEOUT = 900                                 # pip downloads on a cold cache included
USERS_SESSION = "mine"

pytestmark = pytest.mark.e2e


def quick_start_block(readme: str) -> str:
    """The first ``sh`` code block of the README's Quick start section."""
    section = readme.split("\n## Quick start", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```sh\n(.*?)\n```", section, re.S)
    assert match, "README.md: the Quick start section has no ```sh block"
    return match.group(1)


def test_quick_start_block_is_two_commands_install_and_run():
    block = quick_start_block(README.read_text(encoding="utf-8"))
    commands = [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert len(commands) == 2, commands
    assert "pip install '.[cao]'" in commands[0] and "cao-orchestrator-loop --demo" in commands[1]


def _fresh_user_env(home: Path, users_tmux: Path) -> dict[str, str]:
    """What a new user's shell has: a HOME, the system PATH with a Python, pip's machine settings, and
    TMUX_TMPDIR for the user's own tmux server."""
    python_bin = Path(sys.base_prefix) / "bin"
    env = {
        "HOME": str(home),
        "PATH": os.pathsep.join([str(python_bin), "/usr/local/sbin", "/usr/local/bin", "/usr/sbin",
                                 "/usr/bin", "/sbin", "/bin"]),
        "TMUX_TMPDIR": str(users_tmux),      # the user's own tmux server, started below
        "TMPDIR": str(home.parent / "tmp"),  # a temporary folder of its own: the run leaves nothing there
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        "TERM": "xterm-256color",
        "USER": os.environ.get("USER", "root"),
        "SHELL": "/bin/bash",
    }
    env.update({k: v for k, v in os.environ.items() if k.startswith("PIP_")})  # the machine's package index
    # pip's download cache of this machine: the new HOME changes nothing the block does, only where
    # pip would download cli-agent-orchestrator (about 280 MB) to once more.
    env.setdefault("PIP_CACHE_DIR", str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pip"))
    return env


def start_users_tmux(env: dict[str, str]) -> tuple[int, str]:
    """The user's own tmux server with a session, as a user has one: its pid and its socket."""
    subprocess.run(["tmux", "new-session", "-d", "-s", USERS_SESSION, "sleep 100000"], env=env, check=True,
                   timeout=30)
    pid = subprocess.run(["tmux", "display-message", "-p", "#{pid}"], env=env, capture_output=True, text=True,
                         check=True, timeout=30).stdout.strip()
    socket_path = Path(env["TMUX_TMPDIR"]) / f"tmux-{os.getuid()}" / "default"
    return int(pid), str(socket_path)


@dataclass
class QuickStart:
    """What the README's quick start left: its transcript and exit code, what was still running after it,
    whether the user's tmux session lived on, and the new user's HOME, clone and environment."""

    returncode: int | None
    transcript: str
    left_running: list[str]
    users_session_alive: bool
    link_made: bool
    home: Path
    clone: Path
    env: dict[str, str]


def _still_running(home: Path, users_pids: set[int]) -> list[str]:
    """The command lines of the processes started with the new HOME, less the user's tmux server and what
    runs in it: what the run left behind."""
    left = []
    for pid in _pids_with_env(f"HOME={home}".encode()):
        if pid in users_pids or _parent(pid) in users_pids:
            continue
        try:
            left.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return left


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def run_quick_start(tmp_path: Path) -> QuickStart:
    """Run the README's quick start block as a new user would, in a fresh clone and HOME, inside the user's
    own tmux server."""
    missing = [tool for tool in ("git", "tmux", "bash") if shutil.which(tool) is None]
    if missing:
        message = f"the quick start needs {', '.join(missing)}"
        if running_in_ci():
            pytest.fail(message + " (CI is set, so this fails instead of being skipped)", pytrace=False)
        pytest.skip(message)
    clone = tmp_path / "orchestrator-loop"
    subprocess.run(["git", "clone", "-q", str(REPO_ROOT), str(clone)], check=True, timeout=120)
    home = tmp_path / "home"
    users_tmux = tmp_path / "users-tmux"
    home.mkdir()
    users_tmux.mkdir()
    (tmp_path / "tmp").mkdir()
    env = _fresh_user_env(home, users_tmux)
    link_before = AGENT_LINK.is_symlink() or AGENT_LINK.exists()
    tmux_pid, socket_path = start_users_tmux(env)
    block = quick_start_block(README.read_text(encoding="utf-8"))
    # bash takes no PS4 from the environment when run as root: the trace prefix is set in the script.
    traced = "PS4='+ [${SECONDS}s] '\n" + block
    inside_tmux = {**env, "TMUX": f"{socket_path},{tmux_pid},0"}     # a terminal of the user's tmux
    proc = subprocess.Popen(["bash", "-e", "-x", "-c", traced], cwd=clone, env=inside_tmux,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        transcript, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        transcript, _ = proc.communicate()
        transcript += f"\n(timed out after {TIMEOUT}s)"
    try:
        users_pids = {tmux_pid} | {pid for pid in _pids_with_env(f"TMUX_TMPDIR={users_tmux}".encode())
                                   if _parent(pid) == tmux_pid}
        left = _still_running(home, users_pids)
        alive = subprocess.run(["tmux", "has-session", "-t", USERS_SESSION], env=env, capture_output=True,
                               timeout=30).returncode == 0
        link_made = not link_before and (AGENT_LINK.is_symlink() or AGENT_LINK.exists())
    finally:
        subprocess.run(["tmux", "kill-server"], env=env, capture_output=True, timeout=30)
        for pid in _pids_with_env(f"HOME={home}".encode()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    if os.environ.get("QUICK_START_TRANSCRIPT"):
        Path(os.environ["QUICK_START_TRANSCRIPT"]).write_text(transcript, encoding="utf-8")
    return QuickStart(proc.returncode, transcript, left, alive, link_made, home, clone, env)


@pytest.fixture(scope="module")
def quick_start(tmp_path_factory) -> QuickStart:
    """The quick start, run once for the tests below: the second goes on where a new user who ran it is."""
    return run_quick_start(tmp_path_factory.mktemp("quick-start"))


def test_readme_quick_start_reaches_pass_and_leaves_nothing_running(quick_start):
    transcript = quick_start.transcript
    assert quick_start.returncode == 0, f"the quick start failed (exit {quick_start.returncode}):\n{transcript[-6000:]}"
    assert re.search(r"PASS in round 2", transcript), transcript[-4000:]
    assert re.search(r"CAO server: the run's own, http://127\.0\.0\.1:\d+", transcript), transcript[-4000:]
    assert not quick_start.left_running, f"the run left these running: {quick_start.left_running}"
    assert quick_start.users_session_alive, "the user's own tmux session did not outlive the quick start"
    assert not quick_start.link_made, "the quick start linked mock_cli into /usr/local/bin"
    # Nothing written outside the demo's folder but the install (the virtual environment) and CAO's store.
    assert sorted(p.name for p in quick_start.home.iterdir()) == [".aws", ".venvs", "try-loop"]
    assert list((quick_start.home.parent / "tmp").iterdir()) == []
    own_tmux = re.search(r"in a tmux server of their own \((\S+)/tmux-\d+/default\)", transcript)
    assert own_tmux and not Path(own_tmux.group(1)).exists(), "the run's tmux folder was left behind"
    project = quick_start.home / "try-loop"
    greeting = subprocess.run([sys.executable, str(project / "greet.py"), "World"], capture_output=True, text=True,
                              timeout=30)
    assert greeting.stdout == "Hello, World!\n"          # the retry round's fix, written by the scripted agent
    summaries = [p for p in (project / ".tmp").glob("*/summary.json") if p.parent.name != "latest"]
    assert len(summaries) == 1, f"expected one run summary under {project}"
    summary = json.loads(summaries[0].read_text(encoding="utf-8"))
    # Defaults: two review cycles for the analysis and the code (an approval counts from cycle 2), the tester's
    # FAIL, then the retry round: programmer and peer programmer twice more, the tester's PASS. 14 turns.
    assert (summary["result"], summary["exit_code"], summary["rounds"], summary["turns"]) == ("PASS", 0, 2, 14)
    assert re.search(r"demo: PASS\. .*report\.html", transcript), transcript[-2000:]


def readme_unit_test_command(readme: str) -> str:
    """The README's command for the unit tests alone (in its "## Test" section)."""
    section = readme.split("\n## Test", 1)[1].split("\n## ", 1)[0]
    match = re.search(r'`(python -m pytest)` alone runs the fast tier', section)
    assert match, "README.md: the Test section names no unit-test command"
    return match.group(1)


# The fast tier as a whole runs in this suite already (on the machine's interpreter); where the quick start
# left a new user, the README's command collects all of it -- where libtmux's plugin broke collection -- and
# runs these modules of it in one process, chosen with PYTEST_ADDOPTS so that the command stays as written.
UNIT_TESTS_RUN_THERE = "test_cli or test_docs"


def test_readme_unit_test_command_runs_where_the_quick_start_installed_cao(quick_start):
    """Where the quick start left a new user (its clone, and its virtual environment holding the project and
    cli-agent-orchestrator 2.5.4, which brings libtmux, whose pytest plugin broke collection), the README's
    test install and then its unit-test command, run as written, collect the whole suite, pass and report no
    end-to-end section."""
    assert quick_start.returncode == 0, f"the quick start failed, so there is nothing to go on from:\n" \
                                        f"{quick_start.transcript[-3000:]}"
    env = dict(quick_start.env)
    venv = quick_start.home / ".venvs" / "loop"            # where the quick start made it
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
    install = subprocess.run(["pip", "install", "-q", "-e", ".[test]"], cwd=quick_start.clone, env=env,
                             capture_output=True, text=True, timeout=TIMEOUT)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    command = readme_unit_test_command(README.read_text(encoding="utf-8"))
    env["PYTEST_ADDOPTS"] = f"-n 0 -k '{UNIT_TESTS_RUN_THERE}'"
    result = subprocess.run(["bash", "-c", command], cwd=quick_start.clone, env=env, capture_output=True,
                            text=True, timeout=TIMEOUT)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    collected = re.search(r"collected (\d+) items / (\d+) deselected / (\d+) selected", output)
    assert collected and int(collected.group(1)) > 500, output[-3000:]          # the whole suite collected
    assert re.search(rf"\b{collected.group(3)} passed", output), output[-3000:]  # and what was chosen passed
    assert "Marks cannot be applied" not in output, output[-3000:]
    assert "end-to-end tests against a real cao-server" not in output, output[-3000:]


def next_commands(readme: str) -> list[str]:
    """The README's commands after the quick start, as written: the first ``sh`` block of "## Running it for
    real", up to its first `--check` (the command a new user types next)."""
    section = readme.split("\n## Running it for real", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```sh\n(.*?)\n```", section, re.S)
    assert match, "README.md: the section Running it for real has no ```sh block"
    lines = match.group(1).splitlines()
    upto = next(i for i, line in enumerate(lines) if "--check" in line)
    return lines[:upto + 1]


def test_the_readmes_next_command_after_the_quick_start_works_as_written(quick_start, tmp_path):
    """The quick start done, a new user goes on with the README's next block in a new shell (the virtual
    environment not on PATH): its `--check` runs the loop's checks, never "command not found". The block's
    two placeholders are the only words changed: the project's folder and this checkout."""
    assert quick_start.returncode == 0, f"the quick start failed, so there is nothing to go on from:\n" \
                                        f"{quick_start.transcript[-3000:]}"
    project = tmp_path / "project"
    project.mkdir()
    commands = "\n".join(next_commands(README.read_text(encoding="utf-8")))
    commands = commands.replace("/path/to/your/project", str(project)).replace("/path/to/this/checkout",
                                                                               str(quick_start.clone))
    assert "/path/to/" not in commands, commands
    result = subprocess.run(["bash", "-e", "-c", commands], cwd=quick_start.home, env=quick_start.env,
                            capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert "command not found" not in output and result.returncode != 127, output[-3000:]
    # The checks ran, and said what a user who typed the block as written must do next: put the task into
    # task.md (a setting to change: exit 2).
    assert result.returncode == 2, output[-3000:]
    assert "✗ PROMPT_FILE=task.md is the unedited template" in result.stdout, output[-3000:]
    assert result.stdout.rstrip().endswith("fix what is marked, then run --check again"), output[-3000:]
    assert (project / "task.md").is_file()
