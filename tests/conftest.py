"""Shared fixtures: a freshly imported orchestrator module per test, and a fake CAO."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

import run_orchestrator_loop  # noqa: E402

FULL_SUITE_COMMAND = "python -m pytest --full"


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="run the whole suite: also the end-to-end tests (a real cao-server, the real agent "
                          "CLIs, npm installs on first use); without it only the fast tier runs")


def _fast_tier_only(config) -> bool:
    """A plain run (no --full, no -m, no paths named) is the fast tier: what needs no server or CLI."""
    return not (config.getoption("--full") or config.getoption("markexpr") or config.option.file_or_dir)


def pytest_collection_modifyitems(config, items):
    """Leave the end-to-end tests out of the fast tier, saying so in the summary (never silently)."""
    if not _fast_tier_only(config):
        return
    slow = [item for item in items if item.get_closest_marker("e2e")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("e2e")]
        config._left_out_e2e = len(slow)


def pytest_terminal_summary(terminalreporter, config):
    left_out = getattr(config, "_left_out_e2e", 0)
    if left_out:
        terminalreporter.write_line(f"fast tier: {left_out} end-to-end tests left out; `{FULL_SUITE_COMMAND}` "
                                    "runs the whole suite")

SETTING_NAMES = [s.env for s in run_orchestrator_loop.SETTINGS] + list(run_orchestrator_loop.SECRET_VARIABLES)

TASK_PROMPT = """Notes above the first header are ignored.
*** ORIGINAL EXPLORE SUMMARY ***
Build a greeting CLI: `greet NAME` prints `Hello, NAME!`.
*** SCENARIO TEST ***
Run `greet World` and expect `Hello, World!` on stdout.
"""


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    wd = tmp_path / "project"
    wd.mkdir()
    return wd


# The module's code, compiled once: a fresh import runs it again in the module's namespace, as
# importlib.reload does, without compiling the source anew for each of several hundred tests.
_MODULE_CODE = compile(Path(run_orchestrator_loop.__file__).read_text(encoding="utf-8"),
                       run_orchestrator_loop.__file__, "exec", dont_inherit=True)


def fresh_module():
    """The module imported afresh: its top level run again, every global back at what it reads from the
    environment now."""
    exec(_MODULE_CODE, run_orchestrator_loop.__dict__)
    return run_orchestrator_loop


@pytest.fixture
def load_orch(monkeypatch, workdir):
    """Import the module afresh under a given environment, as a new process would.

    Every setting variable is cleared first, WD points at a temporary
    project and API at the fake server, so no test sees the caller's
    environment or writes outside tmp_path.
    """

    def load(**env: str):
        for name in SETTING_NAMES:
            monkeypatch.delenv(name, raising=False)
        defaults = {"WD": str(workdir), "API": "http://cao.test"}
        for name, value in {**defaults, **env}.items():
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, str(value))
        module = fresh_module()
        # In-process runs take many turns: a reply file settles at once here.
        # The settle rule itself is tested with the real value (test_turn_completion.py).
        module.FILE_SETTLE_SECONDS = FAST_FILE_SETTLE_SECONDS
        return module

    return load


@pytest.fixture
def orch(load_orch):
    """The module with default settings (WD in tmp_path, API at the fake server)."""
    return load_orch()


@pytest.fixture
def prompt_file(workdir: Path) -> Path:
    path = workdir.parent / "task.md"
    path.write_text(TASK_PROMPT, encoding="utf-8")
    return path


@pytest.fixture
def fake_cao():
    """A respx-mocked CAO at http://cao.test whose agents write their response files."""
    import respx
    from fake_cao import FakeCao

    with respx.mock(assert_all_called=False) as router:
        yield FakeCao().install(router)


FAST_FILE_SETTLE_SECONDS = 0.02

# Fast but otherwise default loop settings for in-process runs.
FAST = {"POLL_SECONDS": "0.01", "IDLE_GRACE_SECONDS": "0.05", "RESPONSE_TIMEOUT": "5"}


def run_main(module, *args: str) -> int:
    """Call main() as the command line would and return its exit code."""
    with pytest.raises(SystemExit) as stopped:
        module.main(list(args))
    return stopped.value.code
