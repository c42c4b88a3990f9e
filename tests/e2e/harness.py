"""A real, private CAO server whose agents are a scripted program or a real agent CLI.

``private_cao()`` starts one and yields a ``CaoServer``; on exit it stops
everything it started and raises if anything was left behind. The pytest
fixtures in ``conftest.py`` are built on it. This
module works both as part of the ``tests/e2e`` package and as a plain module
imported from a script that put ``tests/e2e`` on ``sys.path``.

Layout of one server (all under a fresh temporary root):

    home/       HOME for cao-server and `cao install`: CAO keeps its database,
                logs and installed profiles under $HOME/.aws/cli-agent-orchestrator
    bin/        `mock_cli`, found on PATH by CAO's mock_cli provider
    mock/       MOCK_AGENT_HOME: script.json, counters.json, received.jsonl
    tmux/       TMUX_TMPDIR: the private tmux server's socket lives here
    profiles/   generated fallback agent profiles
    work/       working directories handed to CAO terminals

With ``provider="claude_code"``, ``"codex"``, ``"opencode_cli"``, ``"copilot_cli"`` or ``"hermes"`` the
agents are the pinned real CLIs (``agent_clis.py``), talking to a scripted model endpoint at
``model_url``; home/ then also holds their offline, unattended settings, and
the root defaults to /var/tmp (Codex wants its home outside /tmp, CAO refuses
working directories under /root).

The tmux server is started here before cao-server. Otherwise CAO's first
session would start it, panes would run login shells, and Debian's
/etc/profile would reset PATH and hide `mock_cli`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

if __package__:
    from . import agent_clis
    from .cao_env import ensure_cao
else:  # imported as a top-level module, with tests/e2e on sys.path
    import agent_clis
    from cao_env import ensure_cao

REPO_ROOT = Path(__file__).resolve().parents[2]
MOCK_AGENT_SOURCE = REPO_ROOT / "orchestrator_scripted_agent.py"  # the scripted agent shipped as `mock_cli`

# CAO profile name -> the repository's profile file stem (the same names).
AGENT_PROFILES = (
    "system_analyst",
    "peer_system_analyst",
    "programmer",
    "peer_programmer",
    "tester",
)

PROVIDERS = ("mock_cli", "claude_code", "codex", "opencode_cli", "copilot_cli", "hermes")
REAL_CLI_PROVIDERS = ("claude_code", "codex", "opencode_cli", "copilot_cli", "hermes")
# Default parent of the temporary root for the real CLIs: not /tmp (Codex
# objects to helper files under a temporary directory) and not /root (CAO
# refuses working directories there). CAO_E2E_TMPDIR overrides it.
REAL_CLI_TMP_PARENT = "/var/tmp"
# A closed port: the CLIs start without calling their model, so a server
# started only to check start-up needs no endpoint.
NO_MODEL_URL = "http://127.0.0.1:9"

SERVER_START_TIMEOUT = 60.0
DEFAULT_THINK_MS = "300"
REQUIRED_TOOLS = ("tmux", "bash")
INSTALL_HINT = "Debian/Ubuntu: apt-get install tmux"

# Inherited variables that would break isolation: a parent tmux's socket
# (tmux clients follow $TMUX), a user's CAO settings or token, a user's agent
# CLI settings or keys, or a Python environment that would leak into CAO's own
# virtualenv.
_STRIP_ENV_PREFIXES = ("CAO_", "MOCK_AGENT_", "CLAUDE", "ANTHROPIC_", "OPENAI_", "CODEX_", "COPILOT_", "HERMES_")
_STRIP_ENV_KEYS = {"TMUX", "TMUX_PANE", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP"}


class MissingPrerequisite(RuntimeError):
    """A program the private server needs (tmux, bash) is not installed."""


class LeftBehindError(RuntimeError):
    """Stopping the private server left processes or a tmux server behind."""


def missing_tools() -> list[str]:
    """The required programs that are not on PATH (empty when all are there)."""
    return [tool for tool in REQUIRED_TOOLS if shutil.which(tool) is None]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _is_alive(pid: int) -> bool:
    """True for a running process; zombies (reaped late by a lazy init) count as gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _started_at(pid: int) -> int | None:
    """The process's start time in clock ticks since boot: with its pid, what names one process.

    PIDs come round again (pid_max is 32,768 in many containers, and a suite of real CLIs wraps it
    in minutes), so a pid recorded at set-up may belong to another test's process at teardown.
    """
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _pids_with_env(needle: bytes) -> list[int]:
    """Processes whose environment contains ``needle`` (e.g. our private TMUX_TMPDIR).

    Every process the fixture starts, directly or through tmux and CAO,
    inherits one of our private paths, so this finds stragglers regardless of
    how they were spawned.
    """
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                env = fh.read()
        except OSError:
            continue
        if needle in env.split(b"\0") and _is_alive(int(entry)):
            found.append(int(entry))
    return found


def _minimal_profile(name: str) -> str:
    # The format `cao install` accepts: YAML frontmatter (name = file stem,
    # description), then the markdown body used as the agent's system prompt.
    title = name.replace("_", " ")
    return (
        "---\n"
        f"name: {name}\n"
        f"description: {title} (end-to-end test profile)\n"
        "---\n\n"
        f"# {title.upper()}\n\n"
        "You are a scripted test agent. Write your answer to the file named in each message.\n"
    )


@dataclass
class CaoServer:
    """A running private cao-server plus helpers for tests."""

    root: Path
    home: Path
    bin_dir: Path
    mock_home: Path
    tmux_socket_dir: Path
    cao_bin: Path
    server_env: dict
    port: int = 0
    base_url: str = ""
    env: dict = field(default_factory=dict)
    process: subprocess.Popen | None = None
    tmux_pid: int | None = None
    tmux_started_at: int | None = None  # with tmux_pid: our tmux server, not a later process given its pid
    profiles: dict = field(default_factory=dict)  # profile name -> installed source file
    token: str = ""  # CAO_AUTH_LOCAL_TOKEN the server was started with ("" = no auth)
    provider: str = "mock_cli"  # the CAO provider the profiles were installed for
    model_url: str = ""  # the scripted model endpoint the real CLIs talk to ("" for mock_cli)
    cli_bin: Path | None = None  # directory holding the pinned CLI the provider launches
    tmux_env: dict = field(default_factory=dict)  # set in the tmux server's global environment
    also: tuple = ()  # other real CLIs set up in the same HOME, profiles installed for them too (a fallback)
    model: object = None  # the scripted model endpoint, when a caller attached one
    _workdirs: int = 0

    # -- tmux -------------------------------------------------------------
    def tmux(self, *args: str, check: bool = False) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["tmux", *args],
            env=self.server_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            check=check,
            timeout=30,
        )

    def tmux_sessions(self) -> list[str]:
        proc = self.tmux("list-sessions", "-F", "#{session_name}")
        if proc.returncode != 0:
            return []  # "no server running" / no sessions
        return [line for line in proc.stdout.splitlines() if line]

    def capture_pane(self, session: str, window: str | int = 0) -> str:
        return self.tmux("capture-pane", "-p", "-J", "-t", f"{session}:{window}").stdout

    def kill_all_sessions(self) -> None:
        """Remove every terminal: through CAO first so its database stays consistent."""
        try:
            with self.http(timeout=10) as client:
                for sess in client.get("/sessions").json():
                    client.delete(f"/sessions/{sess['name']}")
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            pass  # the tmux sweep below still removes everything
        for name in self.tmux_sessions():
            self.tmux("kill-session", "-t", f"={name}")

    # -- scripted agents --------------------------------------------------
    def set_script(self, script: dict) -> None:
        """Install a new agent script and forget all turns and received messages."""
        with open(self.mock_home / ".counters.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            _atomic_write(self.mock_home / "script.json", json.dumps(script, indent=1))
            _atomic_write(self.mock_home / "counters.json", "{}")
            (self.mock_home / "received.jsonl").write_text("")

    def received(self) -> list[dict]:
        path = self.mock_home / "received.jsonl"
        if not path.exists():
            return []
        out = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a record still being appended
        return out

    def counters(self) -> dict:
        try:
            return json.loads((self.mock_home / "counters.json").read_text())
        except (OSError, ValueError):
            return {}

    # -- HTTP -------------------------------------------------------------
    def http(self, timeout: float = 60.0) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        return httpx.Client(base_url=self.base_url, timeout=timeout, headers=headers)

    def wait_status(
        self, terminal_id: str, wanted: set[str] | str, timeout: float = 30.0, interval: float = 0.05
    ) -> list[tuple[float, str]]:
        """Poll until the terminal's status is in ``wanted``; return the (elapsed, status) changes seen."""
        wanted = {wanted} if isinstance(wanted, str) else set(wanted)
        seen: list[tuple[float, str]] = []
        start = time.monotonic()
        with self.http(timeout=10) as client:
            while True:
                status = client.get(f"/terminals/{terminal_id}").json().get("status")
                elapsed = time.monotonic() - start
                if not seen or seen[-1][1] != status:
                    seen.append((round(elapsed, 3), status))
                if status in wanted:
                    return seen
                if elapsed > timeout:
                    raise AssertionError(
                        f"terminal {terminal_id} not in {sorted(wanted)} after {timeout}s; seen {seen}"
                    )
                time.sleep(interval)

    def run_turn(self, terminal_id: str, message: str, timeout: float = 30.0) -> str:
        """Send ``message`` and wait until the agent has finished with it; return the final status.

        Status alone cannot tell turns apart: a fast agent may already be
        ``completed`` again when the POST returns, and a slow one still shows
        the previous turn's ``completed``. The mock numbers its replies per
        process ("#3 ..."), so the turn is over when the reply carries the
        number of the message just received.
        """
        before = sum(1 for r in self.received() if r.get("terminal_id") == terminal_id)
        deadline = time.monotonic() + timeout
        with self.http(timeout=10) as client:
            resp = client.post(f"/terminals/{terminal_id}/input", params={"message": message})
            assert resp.status_code == 200, resp.text
            status = last = None
            while time.monotonic() < deadline:
                mine = [r for r in self.received() if r.get("terminal_id") == terminal_id]
                if len(mine) > before:
                    seq = mine[before].get("seq")
                    status = client.get(f"/terminals/{terminal_id}").json().get("status")
                    if status == "error":
                        return status
                    last = client.get(f"/terminals/{terminal_id}/output", params={"mode": "last"}).json()
                    if status in ("completed", "idle") and str(last.get("output", "")).startswith(f"#{seq} "):
                        return status
                time.sleep(0.05)
        raise AssertionError(f"turn on {terminal_id} did not finish in {timeout}s (status {status}, last {last})")

    # -- work directories -------------------------------------------------
    def new_workdir(self, name: str = "wd") -> Path:
        """A fresh directory CAO accepts as working_directory (not /tmp itself).

        For the real CLIs it is also marked trusted in their settings, so no
        trust dialog can swallow the first prompt.
        """
        self._workdirs += 1
        path = self.root / "work" / f"{name}-{self._workdirs}"
        path.mkdir(parents=True)
        self.trust_workdir(path)
        return path

    def trust_workdir(self, path: Path) -> None:
        """Pre-trust ``path`` for this server's CLI (a no-op for mock_cli).

        Call it for a working directory made outside ``new_workdir`` (or one
        that became a git repository: Codex keys trust by repository root).
        Claude Code rewrites ~/.claude.json while it runs, so directories
        under work/ (trusted as a whole at start) are not written again.
        """
        path = Path(path).resolve()
        for provider in (self.provider, *self.also):
            if provider == "codex":
                agent_clis.trust_codex_workdir(self.home, path)
            elif provider == "copilot_cli" and not path.is_relative_to(self.root / "work"):
                agent_clis.trust_copilot_workdir(self.home, path)
            elif provider == "claude_code" and not path.is_relative_to(self.root / "work"):
                agent_clis.trust_claude_workdir(self.home, path)

    # -- agents dying ---------------------------------------------------------
    def agent_cli_pids(self, terminal_id: str) -> list[int]:
        """The processes the terminal's pane shell runs: the agent CLI (empty once it has exited)."""
        with self.http(timeout=10) as client:
            terminal = client.get(f"/terminals/{terminal_id}").json()
        pane = self.tmux("list-panes", "-t", f"={terminal['session_name']}:{terminal['name']}", "-F",
                         "#{pane_pid}").stdout.split()
        if not pane:
            return []
        children = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    parent = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if parent == int(pane[0]) and _is_alive(int(entry)):
                children.append(int(entry))
        return children

    def kill_agent_cli(self, terminal_id: str) -> list[int]:
        """SIGKILL the agent CLI in a terminal, as a crash or the OOM killer would: the pane drops back to
        its shell. Returns the pids killed."""
        pids = self.agent_cli_pids(terminal_id)
        if not pids:
            raise RuntimeError(f"no agent CLI runs in terminal {terminal_id}")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def kill_tmux_server(self) -> None:
        """End the agents' tmux server (a logout, a reboot): every agent and session goes; cao-server stays."""
        self.tmux("kill-server")
        deadline = time.monotonic() + 10
        while self.tmux("list-sessions").returncode == 0:
            if time.monotonic() > deadline:
                raise RuntimeError("the tmux server still answers after kill-server")
            time.sleep(0.1)

    # -- outages ----------------------------------------------------------
    def stop_server(self) -> None:
        """Kill cao-server with SIGKILL, as a crash or an OOM kill would.

        Its whole process group goes (requests it was carrying out die
        mid-way); the tmux server and the agents in it keep running, as they
        would in real life. ``start_server_again`` brings the API back.
        """
        if self.process is None or self.process.poll() is not None:
            raise RuntimeError("cao-server is not running")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)
        # Anything left in the old group would linger unnoticed once the
        # teardown only looks at the new server's group.
        deadline = time.monotonic() + 5
        while True:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes of the killed cao-server's group {self.process.pid} survive")
            time.sleep(0.05)

    def start_server_again(self, attempts: int = 20) -> None:
        """Start cao-server again on the same port, with the same HOME and environment.

        Clients keep their address, as they would after a service manager
        restarted the server. The port can stay refused for a moment after
        the kill, so a server that exits at once is started again.
        """
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError("cao-server is still running")
        for _ in range(attempts):
            if _launch_server(self):
                return
            time.sleep(0.5)
        raise RuntimeError(
            f"cao-server did not start again on port {self.port}:\n" + self.server_log()[-3000:]
        )

    def restart_server(self, down_seconds: float) -> None:
        """SIGKILL cao-server, leave the API down for ``down_seconds``, start it again (same port)."""
        self.stop_server()
        time.sleep(down_seconds)
        self.start_server_again()

    def server_log(self) -> str:
        try:
            return (self.root / "cao-server.log").read_text(errors="replace")
        except OSError:
            return ""


def _write_tmux_conf(cao: CaoServer) -> None:
    """The same options in HOME's ~/.tmux.conf: a tmux server that cao-server has to start itself
    (after the agents' tmux server was killed) reads it, and must run the agents as this one does."""
    settings = {"PATH": cao.server_env["PATH"], "MOCK_AGENT_HOME": cao.server_env["MOCK_AGENT_HOME"],
                "MOCK_AGENT_THINK_MS": cao.server_env["MOCK_AGENT_THINK_MS"], **cao.tmux_env}
    lines = ["set-option -g exit-empty off", 'set-option -g default-command "exec bash --noprofile --norc"']
    lines += [f"set-environment -g {key} {shlex.quote(value)}" for key, value in settings.items()]
    (cao.home / ".tmux.conf").write_text("\n".join(lines) + "\n", encoding="utf-8")


def _start_tmux(cao: CaoServer) -> None:
    _write_tmux_conf(cao)
    # Options go in the same invocation as start-server: an empty server
    # would otherwise exit before a second command could reach it.
    extra: list[str] = []
    for key, value in cao.tmux_env.items():
        extra += [";", "set-environment", "-g", key, value]
    proc = cao.tmux(
        "-f", "/dev/null", "start-server",
        ";", "set-option", "-g", "exit-empty", "off",
        ";", "set-option", "-g", "default-command", "exec bash --noprofile --norc",
        ";", "set-environment", "-g", "PATH", cao.server_env["PATH"],
        ";", "set-environment", "-g", "MOCK_AGENT_HOME", cao.server_env["MOCK_AGENT_HOME"],
        ";", "set-environment", "-g", "MOCK_AGENT_THINK_MS", cao.server_env["MOCK_AGENT_THINK_MS"],
        *extra,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"could not start the private tmux server: {proc.stderr.strip()}")
    pid = cao.tmux("display-message", "-p", "#{pid}").stdout.strip()
    cao.tmux_pid = int(pid) if pid.isdigit() else None
    cao.tmux_started_at = _started_at(cao.tmux_pid) if cao.tmux_pid else None


def _start_server(cao: CaoServer, attempts: int = 3) -> None:
    """Start cao-server on a free port and wait for /health.

    The port is only known free when probed, so a server that dies at once
    (most likely: someone else took the port) is retried on a new one.
    """
    for attempt in range(1, attempts + 1):
        cao.port = _free_port()
        cao.base_url = f"http://127.0.0.1:{cao.port}"
        if _launch_server(cao):
            return
        if attempt == attempts:
            raise RuntimeError(
                f"cao-server exited with {cao.process.returncode} during startup:\n"
                + cao.server_log()[-3000:]
            )


def _launch_server(cao: CaoServer) -> bool:
    """Start cao-server on ``cao.port``; True once /health answers, False if it exited first.

    Raises if it neither answers nor exits within SERVER_START_TIMEOUT.
    """
    log = open(cao.root / "cao-server.log", "ab")
    try:
        cao.process = subprocess.Popen(
            [str(cao.cao_bin / "cao-server"), "--host", "127.0.0.1", "--port", str(cao.port)],
            env=cao.server_env,
            cwd=cao.root,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            # Own process group: teardown signals the server and anything
            # it spawned, and nothing else.
            start_new_session=True,
        )
    finally:
        log.close()
    deadline = time.monotonic() + SERVER_START_TIMEOUT
    with cao.http(timeout=2) as client:
        while time.monotonic() < deadline and cao.process.poll() is None:
            try:
                if client.get("/health").status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    if cao.process.poll() is None:
        raise RuntimeError(
            f"cao-server not healthy after {SERVER_START_TIMEOUT}s:\n" + cao.server_log()[-3000:]
        )
    return False


def _install_profiles(cao: CaoServer) -> dict[str, Path]:
    """Install the five agent profiles; the repository's own files win over fallbacks."""
    installed = {}
    fallback_dir = cao.root / "profiles"
    fallback_dir.mkdir(exist_ok=True)
    for name, provider in ((name, provider) for provider in (cao.provider, *cao.also) for name in AGENT_PROFILES):
        source = REPO_ROOT / "profiles" / f"{name}.md"
        if not source.is_file():
            source = fallback_dir / f"{name}.md"
            source.write_text(_minimal_profile(name))
        proc = subprocess.run(
            [str(cao.cao_bin / "cao"), "install", str(source), "--provider", provider],
            env=cao.server_env,
            cwd=cao.root,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=120,
        )
        # `cao install` exits 0 even when it rejects a profile, so its output
        # and the stored copy are the only reliable signal.
        stored = cao.home / ".aws" / "cli-agent-orchestrator" / "agent-store" / f"{name}.md"
        if proc.returncode != 0 or "installed successfully" not in proc.stdout or not stored.is_file():
            raise RuntimeError(f"`cao install {source} --provider {provider}` failed:\n{proc.stdout}")
        installed[name] = source
    return installed


def _stop(cao: CaoServer) -> list[str]:
    """Tear everything down; return a list of problems (empty when clean)."""
    problems = []
    server_up = cao.process is not None and cao.process.poll() is None
    if server_up:
        cao.kill_all_sessions()

    # Server before tmux: once cao-server is gone nothing can start a new
    # tmux server on our socket behind our back.
    if cao.process is not None:
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            if cao.process.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(cao.process.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                cao.process.wait(timeout=wait)
        if cao.process.poll() is None:
            problems.append(f"cao-server pid {cao.process.pid} survived SIGKILL")
        # The group should be empty now; anything still in it is reported.
        try:
            os.killpg(cao.process.pid, signal.SIGKILL)
            problems.append("processes were left in cao-server's process group (killed)")
        except (ProcessLookupError, PermissionError):
            pass

    cao.tmux("kill-server")

    if cao.provider == "codex":
        # Its app-server daemon outlives the CLI and would show up as a
        # leftover below: stop it the documented way, then by its PID file.
        agent_clis.stop_codex_daemons(
            cao.home, cao.cli_bin / "codex" if cao.cli_bin else None, cao.server_env
        )

    # tmux forks its server off, and panes belong to it: find leftovers by the
    # private paths in their environment.
    needles = [
        f"TMUX_TMPDIR={cao.tmux_socket_dir}".encode(),
        f"MOCK_AGENT_HOME={cao.mock_home}".encode(),
        f"HOME={cao.home}".encode(),
    ]
    deadline = time.monotonic() + 10
    leftovers: dict[int, int | None] = {}  # pid -> its start time, so a pid given out again is never ours
    while time.monotonic() < deadline:
        leftovers = {pid: _started_at(pid) for n in needles for pid in _pids_with_env(n)}
        if cao.tmux_pid and _is_alive(cao.tmux_pid) and _started_at(cao.tmux_pid) == cao.tmux_started_at:
            leftovers[cao.tmux_pid] = cao.tmux_started_at
        if not leftovers:
            break
        time.sleep(0.2)
    for pid, started_at in sorted(leftovers.items()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone since the last look
        if _started_at(pid) != started_at:
            continue  # gone, and its pid already belongs to another process (perhaps another test's)
        problems.append(f"left running: pid {pid}: {cmd}")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if cao.tmux("list-sessions").returncode == 0:
        problems.append("private tmux server still answers after kill-server")
    return problems


def _write_mock_cli(bin_dir: Path) -> None:
    mock_cli = bin_dir / "mock_cli"
    mock_cli.write_text(
        "#!/bin/sh\n"
        f"exec {shlex.quote(sys.executable)} -I {shlex.quote(str(MOCK_AGENT_SOURCE))} \"$@\"\n"
    )
    mock_cli.chmod(0o755)


def _server_env(
    dirs: dict[str, Path],
    venv_bin: Path,
    think_ms: int | None,
    token: str = "",
    cli_bin: Path | None = None,
    extra: dict | None = None,
) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _STRIP_ENV_KEYS and not k.startswith(_STRIP_ENV_PREFIXES)
    }
    path = [str(dirs["bin"]), str(venv_bin)] + ([str(cli_bin)] if cli_bin else [])
    env.update(
        HOME=str(dirs["home"]),
        TMUX_TMPDIR=str(dirs["tmux"]),
        PATH=os.pathsep.join([*path, os.environ.get("PATH", "/usr/bin:/bin")]),
        MOCK_AGENT_HOME=str(dirs["mock"]),
        MOCK_AGENT_THINK_MS=(
            str(int(think_ms)) if think_ms is not None
            else os.environ.get("MOCK_AGENT_THINK_MS", DEFAULT_THINK_MS)
        ),
    )
    if token:
        env["CAO_AUTH_LOCAL_TOKEN"] = token  # the server then requires it on every API call
    env.update(extra or {})
    return env


def _prepare_cli_home(provider: str, dirs: dict[str, Path], model_url: str | None) -> dict[str, str]:
    """Write the real CLI's settings into the private HOME; the variables its tmux server needs ({} for
    mock_cli). work/ itself is trusted up front: both CLIs extend that to plain subdirectories. Codex keys
    trust by git repository root, so new_workdir() adds an entry per directory too (see trust_workdir)."""
    if provider == "claude_code":
        agent_clis.write_claude_home(dirs["home"], workdirs=[dirs["work"]])
        return agent_clis.claude_tmux_env(model_url)
    if provider == "codex":
        agent_clis.write_codex_home(dirs["home"], model_url, workdirs=[dirs["work"]])
        return agent_clis.codex_tmux_env()
    if provider == "opencode_cli":
        agent_clis.write_opencode_home(dirs["home"], model_url)
        return agent_clis.opencode_tmux_env()
    if provider == "copilot_cli":
        agent_clis.write_copilot_home(dirs["home"], workdirs=[dirs["work"]])
        return agent_clis.copilot_tmux_env(model_url)
    if provider == "hermes":
        agent_clis.write_hermes_home(dirs["home"], model_url)
        return agent_clis.hermes_tmux_env()
    return {}


@contextlib.contextmanager
def private_cao(
    think_ms: int | None = None,
    keep: bool = False,
    token: str = "",
    provider: str = "mock_cli",
    model_url: str | None = None,
    also: tuple[str, ...] = (),
) -> Iterator[CaoServer]:
    """Run a private cao-server with the five profiles installed; yield it as a ``CaoServer``.

    ``think_ms`` is the scripted agents' default think time per turn (None:
    ``$MOCK_AGENT_THINK_MS``, else 300). With ``token`` the server is started
    with CAO_AUTH_LOCAL_TOKEN and every API call needs it. The first call on a machine installs
    the pinned CAO release (``ensure_cao``). On exit every terminal, the
    server, the tmux server and anything they started are stopped, and the
    temporary root is removed unless ``keep`` is true or something was left
    behind. Raises ``MissingPrerequisite`` without starting anything when tmux
    or bash is missing, and ``LeftBehindError`` on exit if the teardown found
    leftovers (they are killed, and listed in the message).

    ``provider`` is the CAO provider the profiles are installed for:
    ``mock_cli`` (the scripted program), ``claude_code``, ``codex``, ``opencode_cli``, ``copilot_cli`` or
    ``hermes`` (the pinned real CLIs, installed with npm, or for Hermes pip, on first use; no npm, or no
    Python 3.11+ for Hermes, is a ``MissingPrerequisite``). The real CLIs talk to ``model_url`` (a scripted
    model endpoint, e.g. ``ScriptedModel.url``); without it they still start,
    but any turn fails. ``also``: other real CLIs set up in the same HOME and on the same PATH, with the
    profiles installed for them too (a role's fallback CLI); only CLIs of the same npm install as ``provider``.
    """
    if provider not in PROVIDERS:
        raise ValueError(f"unknown provider {provider!r}; expected one of {', '.join(PROVIDERS)}")
    missing = missing_tools()
    if missing:
        raise MissingPrerequisite(
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} required to run a "
            f"private cao-server, but not installed ({INSTALL_HINT})"
        )
    real_cli = provider in REAL_CLI_PROVIDERS
    cli_bin: Path | None = None
    if real_cli:
        try:
            cli_bin = agent_clis.cli_bin_for(provider)
            if any(agent_clis.cli_bin_for(other) != cli_bin for other in also):
                raise ValueError(f"{', '.join(also)}: not of the npm install {provider} is")
        except agent_clis.NpmMissing as exc:
            raise MissingPrerequisite(str(exc)) from None
        model_url = (model_url or NO_MODEL_URL).rstrip("/")
    venv_bin = ensure_cao().parent

    # A short root keeps the tmux socket path far below the 108-byte limit.
    # CAO refuses working directories under /root, /etc and similar, so the
    # root must sit in a plain temp directory (CAO_E2E_TMPDIR overrides it).
    parent = os.environ.get("CAO_E2E_TMPDIR") or (REAL_CLI_TMP_PARENT if real_cli else tempfile.gettempdir())
    root = Path(tempfile.mkdtemp(prefix="cao-e2e-", dir=parent)).resolve()
    cao: CaoServer | None = None
    problems: list[str] = []
    try:
        dirs = {name: root / name for name in ("home", "bin", "mock", "tmux", "work")}
        for d in dirs.values():
            d.mkdir()
        _write_mock_cli(dirs["bin"])
        tmux_env: dict[str, str] = {}
        for name in (provider, *also):
            tmux_env.update(_prepare_cli_home(name, dirs, model_url))
        cao = CaoServer(
            root=root,
            home=dirs["home"],
            bin_dir=dirs["bin"],
            mock_home=dirs["mock"],
            tmux_socket_dir=dirs["tmux"],
            cao_bin=venv_bin,
            server_env=_server_env(dirs, venv_bin, think_ms, token, cli_bin, tmux_env),
            token=token,
            provider=provider,
            model_url=model_url or "",
            cli_bin=cli_bin,
            tmux_env=tmux_env,
            also=tuple(also),
        )
        cao.set_script({})
        _start_tmux(cao)
        _start_server(cao)
        cao.profiles = _install_profiles(cao)
        # What an orchestrator process needs to talk to this server.
        cao.env = {"API": cao.base_url, "PROVIDER": provider}

        yield cao
    finally:
        if cao is not None:
            problems = _stop(cao)
        if not problems and not keep:
            shutil.rmtree(root, ignore_errors=True)
        if problems:
            # Raised even while another exception is on its way out: that one
            # stays attached as the context, and leftovers are never silent.
            raise LeftBehindError(
                f"stopping the private cao-server (root {root}, kept) left things behind:\n"
                + "\n".join(problems)
            )
