"""Fixtures that run a real, private CAO server whose agents are a scripted program.

``claude_cao``, ``codex_cao``, ``opencode_cao``, ``copilot_cao`` and ``hermes_cao`` run the real Claude Code,
Codex, OpenCode, GitHub Copilot or Hermes Agent CLI instead,
against a scripted model endpoint (``scripted_model.py``).

The server itself (start, profile install, stop and leak check) lives in
``harness.py``; see its docstring for the layout of the temporary root.

Without tmux or bash the suite is skipped, except in CI (the ``CI``
environment variable set, as CI services do): there a skipped end-to-end
suite would look like a pass, so the fixture fails instead.
"""

from __future__ import annotations

import contextlib
import json
import os

import pytest

from .harness import CaoServer, MissingPrerequisite, private_cao  # noqa: F401  (CaoServer: the fixtures' type)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "e2e: end-to-end test against a real cao-server with scripted mock_cli agents"
    )
    config.addinivalue_line(
        "markers",
        "real_cli: end-to-end test running a real agent CLI (Claude Code, Codex, OpenCode, Copilot, Hermes) under a private "
        "cao-server, against a scripted model endpoint",
    )


# What a module starts once for its tests (module-scoped fixtures: a server, the README's quick start).
# Under pytest-xdist (`--dist loadgroup`, as pyproject.toml sets) the tests of a module that share one of
# these are one group: one worker runs them in order, on the one server. Every other end-to-end test may
# run on any worker, each worker with its own mock_cli server (`cao_server`), so the waits overlap.
STARTED_ONCE_PER_MODULE = ("claude_cao", "codex_cao", "opencode_cao", "copilot_cao", "hermes_cao",
                           "restartable_cao_server", "cao_with_token", "quick_start")


def pytest_collection_modifyitems(items):
    """Group the tests that share what their module started once, so that one worker runs them."""
    for item in items:
        shared = next((name for name in STARTED_ONCE_PER_MODULE if name in getattr(item, "fixturenames", ())),
                      None)
        if shared:
            item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__.rsplit('.', 1)[-1]}:{shared}"))


# The summary of the end-to-end tests (each one's outcome, the real CLIs' times) is printed by
# tests/conftest.py: under pytest-xdist the controller, which prints it, never loads this file.

REAL_CLI_THINK_SECONDS = 0.2    # the scripted model's think time per request in the real-CLI tests

# Real agent CLIs: provider -> [(role, turn seconds, seconds from reply file written to reply taken, what
# ended the turn, seconds from the model's last answer of the turn to reply taken, whether the loop read the
# CLI's records, seconds from the CLI's record of the turn's end to reply taken)], as the loop's own log and
# the scripted model reported them (filled by test_real_clis.py).
REAL_CLI_TURN_TIMES: dict[str, list[tuple[str, float, float, str, float | None, bool, float | None]]] = {}
# provider -> [(seconds until all five agents were up, whether some needed a second try)], in a fresh HOME.
REAL_CLI_START_UPS: dict[str, list[tuple[float, bool]]] = {}


def pytest_sessionfinish(session):
    """Hand the real CLIs' turn and start-up times to the summary, which tests/conftest.py prints: on a
    pytest-xdist worker through the controller, in a run without workers on the config."""
    times = [REAL_CLI_TURN_TIMES, REAL_CLI_START_UPS]
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["real_cli_times"] = json.dumps(times)
    else:
        session.config.real_cli_times = times


def running_in_ci() -> bool:
    """True when ``CI`` is set to anything but an empty, ``0``, ``false`` or ``no`` value."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _missing(exc: Exception) -> None:
    """Skip on a missing prerequisite, except in CI, where a skip would look like a pass."""
    if running_in_ci():
        pytest.fail(
            f"end-to-end tests cannot run: {exc}. CI is set, so they fail instead of being "
            "skipped; install the missing program in the CI image.",
            pytrace=False,
        )
    pytest.skip(f"end-to-end tests skipped: {exc}")


def _start_private_cao(stack: contextlib.ExitStack, **options) -> CaoServer:
    try:
        return stack.enter_context(private_cao(keep=bool(os.environ.get("CAO_E2E_KEEP")), **options))
    except MissingPrerequisite as exc:
        _missing(exc)


def _start_real_cli_cao(stack: contextlib.ExitStack, provider: str, **options) -> CaoServer:
    """A private server for ``provider`` (``also``: and other CLIs) whose CLIs talk to its own ScriptedModel
    (``.model``)."""
    try:
        from .scripted_model import ScriptedModel
    except ImportError as exc:
        _missing(MissingPrerequisite(f"the scripted model endpoint cannot be imported ({exc})"))
    # A quick model: the CLIs' own work (and the loop's handoff) is what these tests time.
    model = stack.enter_context(ScriptedModel(think_seconds=REAL_CLI_THINK_SECONDS))
    server = _start_private_cao(stack, provider=provider, model_url=model.url, **options)
    server.model = model
    return server


def _real_cli_server(provider: str, warm=None, **options):
    """The body of a real-CLI server fixture: the server for its module (its HOME first made ready by
    ``warm(server)`` where given), its agents ended at the close."""
    with contextlib.ExitStack() as stack:
        server = _start_real_cli_cao(stack, provider, **options)
        if warm is not None:
            warm(server)
        yield server
        server.kill_all_sessions()


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


@pytest.fixture(scope="module")
def restartable_cao_server():
    """A private server for one module whose tests kill and restart cao-server.

    Kept apart from the shared ``cao_server``: terminals created before a
    restart answer ``unknown`` for good, which other modules must never see.
    """
    with contextlib.ExitStack() as stack:
        yield _start_private_cao(stack)


@pytest.fixture
def restartable_cao(restartable_cao_server):
    """As ``cao``, on ``restartable_cao_server``; brings the server back if a test left it down."""
    server = restartable_cao_server
    if server.process is None or server.process.poll() is not None:
        server.start_server_again()
    server.kill_all_sessions()
    server.set_script({})
    yield server
    if server.process is None or server.process.poll() is not None:
        server.start_server_again()
    server.kill_all_sessions()
    server.set_script({})


E2E_TOKEN = "e2e-token-5d1c0a7f"


@pytest.fixture(scope="module")
def cao_with_token():
    """A second private server, started with CAO_AUTH_LOCAL_TOKEN=E2E_TOKEN."""
    with contextlib.ExitStack() as stack:
        server = _start_private_cao(stack, token=E2E_TOKEN)
        yield server
        server.kill_all_sessions()


REAL_CLI_SERVERS = ("claude_cao", "codex_cao", "opencode_cao", "copilot_cao", "hermes_cao")


@pytest.fixture(autouse=True)
def _agents_end_with_their_test(request):
    """A real-CLI server lives for its module, its agents for one test: an idle agent CLI still uses CPU
    (five idle OpenCode agents about half a core), which the tests running beside it would pay for."""
    yield
    for name in REAL_CLI_SERVERS:
        if name in request.fixturenames:
            request.getfixturevalue(name).kill_all_sessions()


@pytest.fixture(scope="module")
def claude_cao():
    """A private server whose profiles run the pinned Claude Code against a ScriptedModel.

    ``claude_cao.model`` is that model: ``set_script``, ``events``, ``writes``, ``turns``.
    Use ``claude_cao.new_workdir()`` for working directories (they are pre-trusted).
    """
    yield from _real_cli_server("claude_code")


@pytest.fixture(scope="module")
def codex_cao():
    """A private server whose profiles run the pinned Codex CLI against a ScriptedModel.

    As ``claude_cao``. CAO 2.5.4 keeps reporting ``processing`` after a finished
    Codex turn: wait for the response file (or ``model.writes()``), not the status.
    """
    yield from _real_cli_server("codex")


@pytest.fixture(scope="module")
def opencode_cao():
    """A private server whose profiles run the pinned OpenCode against a ScriptedModel.

    As ``claude_cao``. CAO 2.5.4 answers ``completed`` for the whole of every
    later turn in an OpenCode terminal: wait for the response file, not the status.
    OpenCode has been started once in its HOME, as by a user who has run it before
    (``agent_clis.warm_opencode_home``; a fresh HOME: bench/bench_start_up.py).
    """
    from .agent_clis import warm_opencode_home
    yield from _real_cli_server("opencode_cli", warm=warm_opencode_home)


@pytest.fixture(scope="module")
def copilot_cao():
    """A private server whose profiles run the pinned GitHub Copilot CLI against a ScriptedModel.

    As ``claude_cao``. CAO starts Copilot with --autopilot: the scripted model ends each turn with a
    ``task_complete`` tool call.
    """
    yield from _real_cli_server("copilot_cli")


@pytest.fixture(scope="module")
def hermes_cao():
    """A private server whose profiles run the pinned Hermes Agent against a ScriptedModel. As ``claude_cao``."""
    yield from _real_cli_server("hermes")
