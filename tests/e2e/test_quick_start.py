"""The README's quick start, run as written: a fresh clone, a new virtual environment, a new
HOME, a cao-server of its own on the default port, the shipped scripted agent -- and a PASS.

The block is read from README.md (the first ``sh`` block under "## Quick start"), so the test
follows the text a new user follows. Only the surroundings are set: a new HOME, a private tmux
socket directory, and a PATH with nothing but the interpreter and the system directories (no
virtual environment of ours, no settings of the loop). The shell traces every command with
the seconds since the start; the transcript is written to ``$QUICK_START_TRANSCRIPT`` when set.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from .conftest import running_in_ci

REPO_ROOT = Path(__file__).resolve().parents[2]
README = REPO_ROOT / "README.md"
PORT = 9889                                   # the README uses CAO's default address
AGENT_LINK = Path("/usr/local/bin/mock_cli")  # where the README puts the scripted agent
TIMEOUT = 900                                 # pip downloads on a cold cache included

pytestmark = pytest.mark.e2e


def quick_start_block(readme: str) -> str:
    """The first ``sh`` code block of the README's Quick start section."""
    section = readme.split("\n## Quick start", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```sh\n(.*?)\n```", section, re.S)
    assert match, "README.md: the Quick start section has no ```sh block"
    return match.group(1)


# Run while the agents still run (before the block stops them): the tmux command the run printed for watching
# them, as has-session, from a new login shell's environment -- no TMUX_TMPDIR, the system's PATH. It must
# reach the agents' server, not a tmux server of the user's own.
HINT_PROBE = r"""
hint=$(sed -n 's/.*(watch: `\(tmux .*\) attach -t \([^`]*\)`.*/\1 has-session -t \2/p' ~/try-loop/.tmp/*/run.log | tail -n 1)
env -i HOME="$HOME" TERM=dumb bash -l -c "$hint" && echo "the printed hint reached the agents: $hint"
"""


def with_hint_probe(block: str) -> str:
    """The block with HINT_PROBE inserted before the line that stops the agents."""
    before, stop, after = block.partition("\ncao shutdown")
    assert stop, "README.md: the quick start no longer stops the agents with `cao shutdown`"
    return before + "\n" + HINT_PROBE.strip() + stop + after


def test_quick_start_block_is_what_the_test_runs():
    block = quick_start_block(README.read_text(encoding="utf-8"))
    assert "pip install ." in block and "PROVIDER=mock_cli" in block and "cao-orchestrator-loop" in block
    assert "cao shutdown" in block  # the block also stops what it started
    assert "rm -f /usr/local/bin/mock_cli" in block   # and undoes what it changed outside the clone


def _port_in_use(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _fresh_user_env(home: Path, tmux_dir: Path) -> dict[str, str]:
    """What a new user's shell has: a HOME, the system PATH with a Python, pip's machine settings."""
    python_bin = Path(sys.base_prefix) / "bin"
    env = {
        "HOME": str(home),
        "PATH": os.pathsep.join([str(python_bin), "/usr/local/sbin", "/usr/local/bin", "/usr/sbin",
                                 "/usr/bin", "/sbin", "/bin"]),
        "TMUX_TMPDIR": str(tmux_dir),      # a tmux server of its own, not the machine's
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


@dataclass
class QuickStart:
    """What the README's quick start left: its transcript and exit code, and the new user's HOME, clone and
    environment (with the virtual environment the block made)."""

    returncode: int | None
    transcript: str
    tmux_servers_left: list[str]
    left_link: bool
    home: Path
    clone: Path
    env: dict[str, str]


def run_quick_start(tmp_path: Path) -> QuickStart:
    """Run the README's quick start block as a new user would, in a fresh clone, HOME and tmux directory."""
    missing = [tool for tool in ("git", "tmux", "curl", "bash") if shutil.which(tool) is None]
    if missing:
        message = f"the quick start needs {', '.join(missing)}"
        if running_in_ci():
            pytest.fail(message + " (CI is set, so this fails instead of being skipped)", pytrace=False)
        pytest.skip(message)
    if _port_in_use(PORT):
        pytest.fail(f"port {PORT} is in use; the README's quick start starts cao-server there. Stop "
                    "whatever listens on it and run this test again", pytrace=False)
    if not os.access(AGENT_LINK.parent, os.W_OK):
        pytest.fail(f"{AGENT_LINK.parent} is not writable; the quick start links mock_cli there "
                    "(run the suite as root, as CI does)", pytrace=False)

    clone = tmp_path / "orchestrator-loop"
    subprocess.run(["git", "clone", "-q", str(REPO_ROOT), str(clone)], check=True, timeout=120)
    home = tmp_path / "home"
    tmux_dir = tmp_path / "tmux"
    home.mkdir()
    tmux_dir.mkdir()
    env = _fresh_user_env(home, tmux_dir)
    block = quick_start_block(README.read_text(encoding="utf-8"))
    old_link = os.readlink(AGENT_LINK) if AGENT_LINK.is_symlink() else None

    # bash takes no PS4 from the environment when run as root: the trace prefix is set in the script.
    traced = "PS4='+ [${SECONDS}s] '\n" + with_hint_probe(block)
    proc = subprocess.Popen(["bash", "-e", "-x", "-c", traced], cwd=clone, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    left_link, tmux_servers_left = True, []
    try:
        transcript, _ = proc.communicate(timeout=TIMEOUT)
        left_link = AGENT_LINK.is_symlink() or AGENT_LINK.exists()
        tmux_servers_left = _tmux_servers(home)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        transcript, _ = proc.communicate()
        transcript += f"\n(timed out after {TIMEOUT}s)"
    finally:
        _clean_up(proc, env, old_link)
    if os.environ.get("QUICK_START_TRANSCRIPT"):
        Path(os.environ["QUICK_START_TRANSCRIPT"]).write_text(transcript, encoding="utf-8")
    return QuickStart(proc.returncode, transcript, tmux_servers_left, left_link, home, clone, env)


@pytest.fixture(scope="module")
def quick_start(tmp_path_factory) -> QuickStart:
    """The quick start, run once for the tests below: the second goes on where a new user who ran it is."""
    return run_quick_start(tmp_path_factory.mktemp("quick-start"))


def test_readme_quick_start_reaches_pass(quick_start):
    transcript = quick_start.transcript
    assert quick_start.returncode == 0, f"the quick start failed (exit {quick_start.returncode}):\n{transcript[-6000:]}"
    assert not quick_start.tmux_servers_left, f"the quick start left a tmux server running: {quick_start.tmux_servers_left}"
    assert re.search(r"PASS in round 1", transcript), transcript[-4000:]
    assert re.search(r"\n✓ [^\n]*\n(?:estimate: [^\n]*\n)*a run can start\n", transcript), transcript[-4000:]  # --check
    reached = re.search(r"the printed hint reached the agents: tmux -S (\S+) has-session -t cao-loop-\w+",
                        transcript)
    assert reached, transcript[-4000:]
    assert reached.group(1).startswith(str(quick_start.home / ".cache" / "try-loop-tmux"))
    assert not quick_start.left_link, "the quick start left /usr/local/bin/mock_cli behind"
    runs = quick_start.home / "try-loop" / ".tmp"
    summaries = [p for p in runs.glob("*/summary.json") if p.parent.name != "latest"]
    assert len(summaries) == 1, f"expected one run summary under {runs}"
    summary = json.loads(summaries[0].read_text(encoding="utf-8"))
    # Defaults: two review cycles for the analysis and the code (an approval counts from cycle 2),
    # then the tester: 9 turns, each answered once.
    assert (summary["result"], summary["exit_code"], summary["rounds"], summary["turns"]) == ("PASS", 0, 1, 9)


def _tmux_servers(home: Path) -> list[str]:
    """The sockets of tmux servers still answering under the quick start's TMUX_TMPDIR (and the test's own)."""
    sockets = [*(home / ".cache" / "try-loop-tmux").glob("tmux-*/*")]
    alive = []
    for socket_path in sockets:
        if subprocess.run(["tmux", "-S", str(socket_path), "list-sessions"], capture_output=True,
                          timeout=30).returncode == 0 or subprocess.run(
                ["tmux", "-S", str(socket_path), "display-message", "-p", "x"], capture_output=True,
                timeout=30).returncode == 0:
            alive.append(str(socket_path))
    return alive


def _clean_up(proc: subprocess.Popen, env: dict[str, str], old_link: str | None) -> None:
    """Whatever the block left running (cao-server, the tmux server with the agents) is stopped,
    and the machine's /usr/local/bin/mock_cli is what it was before."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    subprocess.run(["tmux", "kill-server"], env=env, capture_output=True, timeout=30)
    private = Path(env["HOME"]) / ".cache" / "try-loop-tmux"
    subprocess.run(["tmux", "kill-server"], env={**env, "TMUX_TMPDIR": str(private)}, capture_output=True,
                   timeout=30)
    if AGENT_LINK.is_symlink() or AGENT_LINK.exists():
        AGENT_LINK.unlink()
    if old_link is not None:
        AGENT_LINK.symlink_to(old_link)


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
