"""A user's own CAO server and tmux session, beside the suite: ``python3 tests/e2e/decoy.py start|check|stop DIR``.

The suite must neither use nor touch what else runs on the machine. CI (.ci/run) stands up what a contributor
most likely has running while working on this project -- a cao-server on the default address
(127.0.0.1:9889) with a HOME of its own, whose agents would run in the default tmux server, and a tmux
session there -- runs the whole suite, then checks that the server was never asked for an agent
(no ``POST /sessions`` in its log, no session listed) and that the tmux session is still alive.

``start`` waits for the pinned cao-server (installed by install_tools.py, which CI runs in the background: the
same lock, so it waits for that install instead of making a second one). Standard library only: it runs
before the project's test dependencies exist.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cao_env import ensure_cao  # noqa: E402

ADDRESS = ("127.0.0.1", 9889)           # cao-server's own default: where a user's server answers
SESSION = "users-own"                  # the user's tmux session on the default socket
START_SECONDS = 120


def users_env(folder: Path) -> dict[str, str]:
    """A user's shell with a HOME of its own and the default tmux socket (no TMUX_TMPDIR, not inside tmux)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TMUX", "TMUX_PANE", "TMUX_TMPDIR")
           and not k.startswith("CAO_")}
    env["HOME"] = str(folder / "home")
    return env


def answers(path: str) -> object:
    with urllib.request.urlopen(f"http://{ADDRESS[0]}:{ADDRESS[1]}{path}", timeout=5) as response:
        return json.loads(response.read())


def start(folder: Path) -> int:
    (folder / "home").mkdir(parents=True, exist_ok=True)
    env = users_env(folder)
    subprocess.run(["tmux", "new-session", "-d", "-s", SESSION, "sleep 1000000"], env=env, check=True, timeout=30)
    server = ensure_cao()
    with open(folder / "cao-server.log", "ab") as log:
        process = subprocess.Popen([str(server), "--host", ADDRESS[0], "--port", str(ADDRESS[1])], env=env,
                                   cwd=folder, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    (folder / "cao-server.pid").write_text(str(process.pid), encoding="utf-8")
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if answers("/health").get("status") == "ok":
                print(f"decoy: cao-server pid {process.pid} on {ADDRESS[0]}:{ADDRESS[1]} (HOME {env['HOME']}), "
                      f"tmux session {SESSION!r} on the default socket", flush=True)
                return 0
        except OSError:
            pass
        time.sleep(0.5)
    print(f"decoy: cao-server did not answer on {ADDRESS[0]}:{ADDRESS[1]}; its log: {folder / 'cao-server.log'}",
          flush=True)
    return 1


def check(folder: Path) -> int:
    """0 when the server got no agent request and the tmux session lives; else 1, with what went wrong."""
    problems = []
    log = (folder / "cao-server.log").read_text(encoding="utf-8", errors="replace")
    asked = [line for line in log.splitlines() if "POST /sessions" in line]
    if asked:
        problems.append(f"the user's cao-server was asked for agents {len(asked)} times, first: {asked[0].strip()}")
    try:
        listed = answers("/sessions")
        if listed:
            problems.append(f"the user's cao-server holds sessions: {listed!r:.300}")
    except OSError as exc:
        problems.append(f"the user's cao-server no longer answers: {exc}")
    alive = subprocess.run(["tmux", "has-session", "-t", SESSION], env=users_env(folder), capture_output=True,
                           timeout=30).returncode == 0
    if not alive:
        problems.append(f"the user's tmux session {SESSION!r} on the default socket is gone")
    for problem in problems:
        print(f"decoy: {problem}", flush=True)
    if not problems:
        print("decoy: the user's cao-server got no agent request and the user's tmux session is alive", flush=True)
    return 1 if problems else 0


def stop(folder: Path) -> int:
    pid_file = folder / "cao-server.pid"
    if pid_file.exists():
        try:
            os.killpg(int(pid_file.read_text(encoding="utf-8")), signal.SIGTERM)
        except (OSError, ValueError):
            pass
        pid_file.unlink()
    subprocess.run(["tmux", "kill-session", "-t", SESSION], env=users_env(folder), capture_output=True, timeout=30)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("start", "check", "stop"):
        sys.exit("usage: python3 tests/e2e/decoy.py start|check|stop DIR")
    sys.exit({"start": start, "check": check, "stop": stop}[sys.argv[1]](Path(sys.argv[2]).absolute()))
