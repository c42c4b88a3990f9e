"""Fixtures that run a real, private CAO server whose agents are a scripted program.

The server itself (start, profile install, stop and leak check) lives in
``harness.py``; see its docstring for the layout of the temporary root.

Without tmux or bash the suite is skipped, except in CI (the ``CI``
environment variable set, as CI services do): there a skipped end-to-end
suite would look like a pass, so the fixture fails instead.
"""

from __future__ import annotations

import contextlib
import os

import pytest

from .harness import CaoServer, MissingPrerequisite, private_cao  # noqa: F401  (CaoServer: the fixtures' type)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "e2e: end-to-end test against a real cao-server with scripted mock_cli agents"
    )


_e2e_outcomes: list[tuple[str, str]] = []


def pytest_runtest_logreport(report):
    """Remember each end-to-end test's outcome for the summary below."""
    if "tests/e2e/" not in report.nodeid.replace("\\", "/"):
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _e2e_outcomes.append((report.outcome.upper(), report.nodeid))


def pytest_terminal_summary(terminalreporter):
    """Name every end-to-end scenario and its outcome, so a log shows they ran (and were not skipped)."""
    if not _e2e_outcomes:
        return
    terminalreporter.section("end-to-end tests against a real cao-server")
    for outcome, nodeid in _e2e_outcomes:
        terminalreporter.write_line(f"{outcome:8} {nodeid}")


def running_in_ci() -> bool:
    """True when ``CI`` is set to anything but an empty, ``0``, ``false`` or ``no`` value."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _start_private_cao(stack: contextlib.ExitStack, **options) -> CaoServer:
    try:
        return stack.enter_context(private_cao(keep=bool(os.environ.get("CAO_E2E_KEEP")), **options))
    except MissingPrerequisite as exc:
        if running_in_ci():
            pytest.fail(
                f"end-to-end tests cannot run: {exc}. CI is set, so they fail instead of being "
                "skipped; install the missing program in the CI image.",
                pytrace=False,
            )
        pytest.skip(f"end-to-end tests skipped: {exc}")


@pytest.fixture(scope="session")
def cao_server():
    with contextlib.ExitStack() as stack:
        yield _start_private_cao(stack)


@pytest.fixture
def cao(cao_server):
    """The shared server with a clean slate: no terminals, empty script, no records."""
    cao_server.kill_all_sessions()
    cao_server.set_script({})
    yield cao_server
    cao_server.kill_all_sessions()
    cao_server.set_script({})


E2E_TOKEN = "e2e-token-5d1c0a7f"


@pytest.fixture(scope="module")
def cao_with_token():
    """A second private server, started with CAO_AUTH_LOCAL_TOKEN=E2E_TOKEN."""
    with contextlib.ExitStack() as stack:
        server = _start_private_cao(stack, token=E2E_TOKEN)
        yield server
        server.kill_all_sessions()
