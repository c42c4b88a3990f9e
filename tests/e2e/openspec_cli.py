"""The pinned OpenSpec CLI for end-to-end tests, installed once into a private prefix.

``ensure_openspec()`` installs ``@fission-ai/openspec`` with npm on first use
(into the same cache root as ``agent_clis``) and returns the path of its
``openspec`` executable; later calls reuse it. A lock file serialises
concurrent callers.
"""

from __future__ import annotations

import shutil
from pathlib import Path

if __package__:
    from .cao_env import cache_dir, install_once, installed_version, npm_install_global
else:  # imported as a top-level module, with tests/e2e on sys.path
    from cao_env import cache_dir, install_once, installed_version, npm_install_global

OPENSPEC_PACKAGE = "@fission-ai/openspec"
OPENSPEC_VERSION = "1.13.2"
PREFIX_ENV_VAR = "OPENSPEC_CLI_PREFIX"
_READY_MARKER = ".openspec-install-complete"


class OpenSpecInstallError(RuntimeError):
    """npm is missing or the pinned OpenSpec CLI could not be installed."""


def default_prefix() -> Path:
    return cache_dir(PREFIX_ENV_VAR, f"openspec-{OPENSPEC_VERSION}")


def _is_ready(prefix: Path) -> bool:
    marker = prefix / _READY_MARKER
    return marker.is_file() and marker.read_text().strip() == OPENSPEC_VERSION \
        and (prefix / "bin" / "openspec").exists()


def _install(prefix: Path) -> None:
    marker = prefix / _READY_MARKER
    if marker.exists():
        marker.unlink()
    npm_install_global(prefix, [f"{OPENSPEC_PACKAGE}@{OPENSPEC_VERSION}"], 600, OpenSpecInstallError)
    got = installed_version(prefix / "bin" / "openspec")
    if got != OPENSPEC_VERSION:
        raise OpenSpecInstallError(f"{prefix / 'bin' / 'openspec'} --version answered {got!r} after the "
                                   f"install, expected {OPENSPEC_VERSION}")
    marker.write_text(OPENSPEC_VERSION + "\n")


def ensure_openspec(prefix: Path | str | None = None) -> Path:
    """The path of the pinned ``openspec`` executable; OpenSpecInstallError if it cannot be had."""
    prefix = Path(prefix).expanduser() if prefix is not None else default_prefix()
    if _is_ready(prefix):
        return prefix / "bin" / "openspec"
    missing = [tool for tool in ("npm", "node") if shutil.which(tool) is None]
    if missing:
        raise OpenSpecInstallError(f"{' and '.join(missing)} needed to install {OPENSPEC_PACKAGE}@"
                                   f"{OPENSPEC_VERSION} (Debian/Ubuntu: apt-get install nodejs npm)")
    install_once(prefix, _is_ready, _install, OpenSpecInstallError, PREFIX_ENV_VAR)
    return prefix / "bin" / "openspec"
