"""Provision a pinned CAO (cli-agent-orchestrator) installation for end-to-end tests.

The server is installed into a virtualenv of its own so its dependencies never
mix with the project's test interpreter, and so every machine tests against the
exact same release.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

CAO_VERSION = "2.5.4"
CAO_REQUIREMENT = f"cli-agent-orchestrator=={CAO_VERSION}"
VENV_ENV_VAR = "CAO_TEST_VENV"

# A marker written only after a fully successful install: a venv left behind by
# an interrupted or failed pip run is detected and rebuilt instead of reused.
_READY_MARKER = ".cao-install-complete"


class CaoInstallError(RuntimeError):
    """Raised when the pinned CAO release cannot be installed."""


def cache_dir(env_var: str, name: str) -> Path:
    """Where a pinned test tool is installed: ``$env_var`` if set, else ``name`` in the shared test cache."""
    override = os.environ.get(env_var)
    if override:
        return Path(override).expanduser()
    cache_root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache_root / "orchestrator-loop-tests" / name


def default_venv_dir() -> Path:
    return cache_dir(VENV_ENV_VAR, f"cao-{CAO_VERSION}")


def installed_version(binary: Path) -> str:
    """What ``binary --version`` prints, or "" when it cannot be run or fails."""
    try:
        proc = subprocess.run([str(binary), "--version"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout.strip() if proc.returncode == 0 else ""


def npm_install_global(prefix: Path, specs: list[str] | tuple[str, ...], timeout: float,
                       error: type[Exception]) -> None:
    """``npm install --global`` of the pinned ``specs`` into a private ``prefix`` (bin/ and lib/ below it)."""
    prefix.mkdir(parents=True, exist_ok=True)
    run_install_step(["npm", "install", "--global", "--prefix", str(prefix), "--no-audit", "--no-fund",
                      "--no-update-notifier", *specs], f"npm install {' '.join(specs)}", timeout, error)


def _bin_dir(venv: Path) -> Path:
    return venv / ("Scripts" if os.name == "nt" else "bin")


def run_install_step(cmd: list[str], what: str, timeout: float, error: type[Exception] = None,
                     cwd: Path | None = None) -> str:
    """Run one install command; `error` (default CaoInstallError) with its last output if it fails."""
    error = error or CaoInstallError
    try:
        proc = subprocess.run(
            cmd,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        raise error(f"{what} timed out after {timeout:.0f}s: {' '.join(cmd)}") from exc
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-40:])
        raise error(
            f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n"
            f"--- last output ---\n{tail}"
        )
    return proc.stdout


def install_once(target: Path, is_ready, install, error: type[Exception], env_var: str) -> None:
    """Install into `target` unless a finished install is there; a lock file serialises
    concurrent callers (parallel pytest workers, two checkouts sharing a cache)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if is_ready(target):          # another process finished it while we waited
                return
            try:
                install(target)
            except error as exc:
                raise error(f"{exc}\n(installed into {target}; set {env_var} to install elsewhere)") from None
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _is_ready(venv: Path) -> bool:
    marker = venv / _READY_MARKER
    bins = _bin_dir(venv)
    return (
        marker.is_file()
        and marker.read_text().strip() == CAO_REQUIREMENT
        and (bins / "cao-server").exists()
        and (bins / "cao").exists()
    )


def installed_here() -> Path | None:
    """``cao-server`` of the pinned release if this Python environment has it (pip install
    cli-agent-orchestrator==CAO_VERSION), with ``cao`` beside it; else None."""
    try:
        if importlib.metadata.version("cli-agent-orchestrator") != CAO_VERSION:
            return None
    except importlib.metadata.PackageNotFoundError:
        return None
    server = Path(sys.executable).parent / "cao-server"
    return server if server.is_file() and (server.parent / "cao").is_file() else None


def ensure_cao(cache_dir: Path | str | None = None) -> Path:
    """Return the path of a ``cao-server`` executable from the pinned release.

    The ``cao`` CLI lives in the same directory. The pinned release installed
    in this Python environment is used as it is; else a private virtualenv is
    created on first use and reused afterwards; a lock file serialises
    concurrent callers (parallel pytest workers, two checkouts sharing a cache).
    """
    if cache_dir is None and installed_here() is not None:
        return installed_here()
    venv = Path(cache_dir).expanduser() if cache_dir is not None else default_venv_dir()
    server = _bin_dir(venv) / "cao-server"
    if _is_ready(venv):
        return server

    install_once(venv, _is_ready, _install, CaoInstallError, VENV_ENV_VAR)
    return server


def _install(venv: Path) -> None:
    marker = venv / _READY_MARKER
    if marker.exists():
        marker.unlink()
    python = _bin_dir(venv) / "python"
    if not python.exists():
        # --clear: a half-built directory from a crashed run must not confuse venv.
        run_install_step([sys.executable, "-m", "venv", "--clear", str(venv)], "creating the CAO virtualenv", 300)
    pip = [str(python), "-m", "pip", "--disable-pip-version-check", "--no-input"]
    run_install_step(pip + ["install", "--quiet", CAO_REQUIREMENT], f"pip install {CAO_REQUIREMENT}", 900)
    bins = _bin_dir(venv)
    missing = [name for name in ("cao-server", "cao") if not (bins / name).exists()]
    if missing:
        raise CaoInstallError(
            f"{CAO_REQUIREMENT} installed into {venv} but {', '.join(missing)} is missing from {bins}"
        )
    marker.write_text(CAO_REQUIREMENT + "\n")


if __name__ == "__main__":
    print(ensure_cao())
