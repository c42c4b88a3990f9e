"""Install every pinned tool the end-to-end suite drives, all at once: ``python3 tests/e2e/install_tools.py``.

The suite installs each tool on first use anyway (a lock file per tool lets many callers wait for
one install); CI starts this in the background before installing the project, so the npm and pip
downloads overlap with that install and with the fast tests instead of holding up the first
end-to-end tests. Standard library only: it runs before the project's test dependencies exist.
Prints one line per tool (its path, or why it could not be installed) and exits 1 if any failed.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agent_clis import ensure_agent_clis, ensure_copilot, ensure_hermes  # noqa: E402
from cao_env import ensure_cao  # noqa: E402
from openspec_cli import ensure_openspec  # noqa: E402

TOOLS = {
    "cao-server": ensure_cao,
    "Claude Code, Codex and OpenCode": ensure_agent_clis,
    "Copilot CLI": ensure_copilot,
    "Hermes": ensure_hermes,
    "OpenSpec": ensure_openspec,
}


def install(name: str, ensure) -> str:
    """One tool's line: where it is and how long it took, or what went wrong."""
    began = time.monotonic()
    try:
        where = ensure()
    except Exception as exc:        # noqa: BLE001 -- each tool's own error class; the line names it
        return f"FAILED {name}: {type(exc).__name__}: {str(exc).splitlines()[0]}"
    return f"ok {name}: {where} ({time.monotonic() - began:.0f}s)"


def main() -> int:
    with ThreadPoolExecutor(max_workers=len(TOOLS)) as pool:
        lines = list(pool.map(lambda item: install(*item), TOOLS.items()))
    print("\n".join(lines), flush=True)
    return 1 if any(line.startswith("FAILED") for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
