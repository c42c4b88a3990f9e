"""Shared fixtures: a freshly imported orchestrator module per test, and a fake CAO."""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

# The module's code, compiled once: the first import runs it, and so does each test's fresh import (below),
# as importlib.reload would, without compiling the source anew (no .pyc is kept where bytecode is not written).
_MODULE_PATH = ROOT / "run_orchestrator_loop.py"
_MODULE_CODE = compile(_MODULE_PATH.read_text(encoding="utf-8"), str(_MODULE_PATH), "exec", dont_inherit=True)
if "run_orchestrator_loop" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("run_orchestrator_loop", _MODULE_PATH)
    sys.modules["run_orchestrator_loop"] = importlib.util.module_from_spec(_spec)
    exec(_MODULE_CODE, sys.modules["run_orchestrator_loop"].__dict__)
import run_orchestrator_loop  # noqa: E402

# httpx makes a new SSL context for each client it builds, reading the system's CA certificates (~70 ms of CPU),
# even for the plain-http fake CAO; and each test's fresh module builds its clients anew. One default context,
# made once per process, serves them all (a client asking for anything else still gets its own).
try:
    import httpx._transports.default as _httpx_transport
except ImportError:         # another httpx: it keeps its own way, only slower
    _httpx_transport = None
if _httpx_transport is not None and hasattr(_httpx_transport, "create_ssl_context"):
    _make_ssl_context = _httpx_transport.create_ssl_context
    _default_ssl_context = []

    def _shared_ssl_context(verify=True, cert=None, trust_env=True):
        if verify is not True or cert is not None or trust_env is not True:
            return _make_ssl_context(verify=verify, cert=cert, trust_env=trust_env)
        if not _default_ssl_context:
            _default_ssl_context.append(_make_ssl_context())
        return _default_ssl_context[0]

    _httpx_transport.create_ssl_context = _shared_ssl_context

# A suite started without job control (a background job of a script, as some CI runners start it) inherits
# SIGINT ignored -- and so would the workers and every loop it starts, whose Ctrl-C tests need it delivered.
# A handler of our own is reset to the default in the programs this process starts.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

FULL_SUITE_COMMAND = "python -m pytest --full"


def project_files(folder: str = "") -> list[Path]:
    """The project's files (under `folder`), as git tracks them: what a test reads of the tree, never whatever
    else lies in the checkout (a contributor's virtualenv, build output, a draft not yet added)."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--", folder or "."], cwd=ROOT, capture_output=True,
                                check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.fail(f"the project's files are what git tracks, and `git ls-files` in {ROOT} failed ({exc}): "
                    "run the tests in a clone of the project", pytrace=False)
    return sorted(ROOT / name for name in listed.decode("utf-8").split("\0") if name and (ROOT / name).is_file())


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="run the whole suite: also the end-to-end tests (a real cao-server, the real agent "
                          "CLIs, npm installs on first use); without it only the fast tier runs")


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session):
    """pytest rewrites the asserts of every test module it imports, in each process of the run (a few
    seconds of CPU apiece), and keeps what it made in __pycache__ for the next run -- unless bytecode is
    not to be written (PYTHONDONTWRITEBYTECODE): while the tests are collected, it is kept all the same."""
    dont_write = sys.dont_write_bytecode
    sys.dont_write_bytecode = False
    try:
        yield
    finally:
        sys.dont_write_bytecode = dont_write


def _fast_tier_only(config) -> bool:
    """A plain run (no --full, no -m, no paths named) is the fast tier: what needs no server or CLI."""
    return not (config.getoption("--full") or config.getoption("markexpr") or config.option.file_or_dir)


def leave_out_e2e(config, items) -> None:
    """Leave the end-to-end tests out of the fast tier, saying so in the summary (never silently)."""
    if not _fast_tier_only(config):
        return
    slow = [item for item in items if item.get_closest_marker("e2e")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("e2e")]
        config._left_out_e2e = len(slow)


# -- Under pytest-xdist: workers sized to the machine, the longest work first ---------------------------------
WORKERS_PER_CORE, MIN_WORKERS, MAX_WORKERS = 2.5, 2, 8     # five on 2 cores (four left CPU idle)
FAST_TIER_WORKERS_PER_CORE = 3     # the fast tier alone: short tests that wait on a fake CAO's polls, few on the CPU


def cores_available() -> int:
    """The cores this process may run on (a container's or taskset's limit, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject.toml): two and a half workers a core -- the tests mostly wait, on agents, servers
    and installs -- three for the fast tier alone, at least two, at most eight (each worker runs a server of
    its own for its tests)."""
    per_core = FAST_TIER_WORKERS_PER_CORE if _fast_tier_only(config) else WORKERS_PER_CORE
    return max(MIN_WORKERS, min(MAX_WORKERS, int(per_core * cores_available())))


# pyproject.toml runs the suite on those workers (`-n auto --dist loadgroup`). A unit of work is one test, or a
# group of tests that share what their module started once (tests/e2e/conftest.py). Most of the suite's time
# is a few long units (the real agent CLIs, the README's quick start), so they are handed out first and the
# short ones fill the gaps: the whole run then takes about as long as its longest unit, not longer.
# Seconds a unit takes, as measured on a 2-core machine running the suite (only their order matters):
EXPECTED_UNIT_SECONDS = {
    "test_real_clis:codex_cao": 300,
    "test_real_clis:opencode_cao": 290,
    "test_real_clis:hermes_cao": 150,
    "test_real_clis:claude_cao": 280,
    "test_long_runs_e2e:codex_cao": 250,
    "test_quick_start:quick_start": 160,
    "test_unattended_e2e:restartable_cao_server": 190,
    "test_long_runs_e2e:claude_cao": 190,
    "test_real_clis:copilot_cao": 170,
    "test_lost_agents_e2e:restartable_cao_server": 190,
    "test_a_machine_killed_right_after_a_reply_was_written_goes_on_on_a_fresh_machine[complete]": 80,
    "test_a_machine_killed_right_after_a_reply_was_written_goes_on_on_a_fresh_machine[cut off]": 75,
    "test_a_pod_deleted_while_an_agent_works_stops_with_its_state_saved_and_the_next_pod_finishes": 45,
    "test_a_run_whose_machine_is_killed_goes_on_on_a_fresh_machine_from_its_working_directory": 40,
    "test_a_claude_code_run_whose_machine_is_killed_goes_on_on_a_fresh_machine_with_its_tokens_kept": 90,
}
# Any other unit: by kind (a test marked real_cli, other end-to-end tests, unit tests); a unit test that drives
# the loop through the fake CAO takes longer than one that calls a function, and a few wait out real seconds.
EXPECTED_TEST_SECONDS = {"real_cli": 150, "e2e": 15}
UNIT_TEST_SECONDS, LOOP_TEST_SECONDS = 0.05, 0.5
SLOW_UNIT_TESTS = ("test_processes_starting_in_the_same_instant_get_one_lock",
                   "test_a_reader_that_closes_the_pipe_ends_help_quietly",
                   "test_a_resumed_codex_whose_marks_left_the_screen_is_settled_once_its_screen_is_still",
                   "test_a_turn_is_timed_to_the_moment_its_reply_was_taken_not_to_when_it_was_kept_on_disk",
                   "test_prompt_refused_before_connecting_is_retried_once_delivered",
                   "test_headless_chromium_paints_the_fail_and_pass_bars_in_their_colours")


def _unit_name(item) -> str:
    """The unit an item belongs to: its xdist group, else the test itself."""
    group = item.get_closest_marker("xdist_group")
    return group.args[0] if group else item.nodeid


def _expected_seconds(unit: str, items: list) -> float:
    """How long a unit should take: measured for the long ones, by the kind of its tests for the rest."""
    for name, seconds in EXPECTED_UNIT_SECONDS.items():
        if unit == name or unit.endswith(name):
            return seconds
    return sum(next((s for m, s in EXPECTED_TEST_SECONDS.items() if item.get_closest_marker(m)), None)
               or _unit_test_seconds(item) for item in items)


def _unit_test_seconds(item) -> float:
    if item.originalname in SLOW_UNIT_TESTS:
        return 3.0
    return LOOP_TEST_SECONDS if "fake_cao" in getattr(item, "fixturenames", ()) else UNIT_TEST_SECONDS


@pytest.hookimpl(trylast=True)     # after tests/e2e/conftest.py has put tests in their groups
def pytest_collection_modifyitems(config, items):
    """The fast tier alone without --full; under xdist, the tests longest unit first."""
    leave_out_e2e(config, items)
    for item in items:          # a report carries this to the summary (its keywords also hold folder names)
        if item.get_closest_marker("e2e"):
            item.user_properties.append(("marked", "e2e"))
    if hasattr(config, "workerinput"):      # a pytest-xdist worker: the workers collect, the controller schedules
        longest_unit_first(items)


def longest_unit_first(items) -> None:
    """Order the collected tests longest unit first, a unit's tests together in their own order: the order
    in which the scheduler below hands them out."""
    units: dict[str, list] = {}
    for item in items:
        units.setdefault(_unit_name(item), []).append(item)
    ordered = sorted(units.items(), key=lambda unit: -_expected_seconds(*unit))
    items[:] = [item for _, unit_items in ordered for item in unit_items]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup, handing out units in collection order (longest first, above), and a worker's next
    unit only when the last test of its current one is left: no long unit waits in one worker's queue
    while another worker sits idle."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class LongestFirst(LoadGroupScheduling):
        def _reschedule(self, node) -> None:
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
                return
            # A worker runs a test only once it knows the next one: one test left is the time to send more.
            if self._pending_of(self.assigned_work[node]) <= 1:
                self._assign_work_unit(node)

    config.option.loadscopereorder = False
    return LongestFirst(config, log)


# -- The summary: what the fast tier left out, each end-to-end test's outcome, the real CLIs' times -----------
# Under pytest-xdist the workers collect and run the tests and the controller prints the summary: what the
# workers counted and measured reaches it in their `workeroutput` (tests/e2e/conftest.py fills it).

_e2e_outcomes: list[tuple[str, str]] = []
# provider -> [(role, turn seconds, seconds from reply file written to reply taken, what ended the turn,
# seconds from the agent's turn ended (the model's last answer) to reply taken, whether the loop read the
# CLI's records, seconds from the CLI's record of the turn's end to reply taken)], from the loop's log and
# the scripted model
_real_cli_turn_times: dict[str, list] = {}
# provider -> [(seconds until all five agents were up, whether some needed a second try)], in a fresh HOME
_real_cli_start_ups: dict[str, list] = {}


def pytest_runtest_logreport(report):
    """Remember each end-to-end test's outcome (marked e2e; the scripted model's own tests are not)."""
    if ("marked", "e2e") not in report.user_properties:
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _e2e_outcomes.append((report.outcome.upper(), report.nodeid.rsplit("@", 1)[0]))


def _add_real_cli_times(turn_times: dict, start_ups: dict) -> None:
    for provider, times in turn_times.items():
        _real_cli_turn_times.setdefault(provider, []).extend(tuple(t) for t in times)
    for provider, times in start_ups.items():
        _real_cli_start_ups.setdefault(provider, []).extend(tuple(t) for t in times)


def pytest_sessionfinish(session):
    """On a worker: hand the count of end-to-end tests it left out to the controller."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["left_out_e2e"] = getattr(session.config, "_left_out_e2e", 0)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """On the controller: every worker collected the whole suite, so any one of them has the count; each
    has the real-CLI times of the tests it ran."""
    output = getattr(node, "workeroutput", {})
    node.config._left_out_e2e = max(getattr(node.config, "_left_out_e2e", 0), output.get("left_out_e2e", 0))
    _add_real_cli_times(*json.loads(output.get("real_cli_times", "[{}, {}]")))


def pytest_terminal_summary(terminalreporter, config):
    left_out = getattr(config, "_left_out_e2e", 0)
    if left_out:
        terminalreporter.write_line(f"fast tier: {left_out} end-to-end tests left out; `{FULL_SUITE_COMMAND}` "
                                    "runs the whole suite")
    _e2e_summary(terminalreporter, config)


def _e2e_summary(terminalreporter, config) -> None:
    """Name every end-to-end test and its outcome, so a log shows they ran (and were not skipped), then the
    real CLIs' turn and start-up times."""
    if not _e2e_outcomes:
        return
    _add_real_cli_times(*getattr(config, "real_cli_times", [{}, {}]))      # a run without workers
    terminalreporter.section("end-to-end tests against a real cao-server")
    for outcome, nodeid in _e2e_outcomes:
        terminalreporter.write_line(f"{outcome:8} {nodeid}")
    for provider, times in sorted(_real_cli_turn_times.items()):
        took = [t[1] for t in times]
        lag = [t[2] for t in times]
        ends = collections.Counter(t[3] for t in times if len(t) > 3)
        terminalreporter.write_line(
            f"{provider}: {len(times)} turns; turn {statistics.median(took):.1f}s median, {max(took):.1f}s max; "
            f"reply taken {statistics.median(lag):.1f}s median, {max(lag):.1f}s max after its file was written"
            + ("; turn end seen by " + ", ".join(f"{what} {count}" for what, count in ends.most_common())
               if ends else ""))
        for records, how in ((True, "with its records read"), (False, "without its records (screen rules)")):
            after_end = [t[4] for t in times if len(t) > 5 and t[5] is records and t[4] is not None]
            after_record = [t[6] for t in times if len(t) > 6 and t[5] is records and t[6] is not None]
            if after_end:
                terminalreporter.write_line(
                    f"{provider}: {how}: reply taken {statistics.median(after_end):.2f}s median, "
                    f"{max(after_end):.2f}s max after the agent's turn ended (the model's last answer; "
                    f"{len(after_end)} turns)"
                    + (f"; {statistics.median(after_record):.2f}s median after the CLI recorded the turn's end "
                       f"({len(after_record)} turns ended by it)" if after_record else ""))
    for provider, start_ups in sorted(_real_cli_start_ups.items()):
        terminalreporter.write_line(
            f"{provider}: five agents started at once in a fresh HOME {len(start_ups)} times: all up after "
            + ", ".join(f"{seconds:.1f}s" + (" (with a second try)" if again else "") for seconds, again in start_ups))


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


# Most of that run is dataclasses.dataclass writing and compiling each class's __init__, __eq__, __repr__ ...
# anew. A class whose body comes out the same as in an earlier import (the same code, defaults and annotations)
# is that earlier class: its methods read the module's globals when called, so they see this import's.
# A body that differs (a default read from the environment, say) makes a class of its own, as before.
_make_dataclass = dataclasses.dataclass
_dataclasses_made: dict = {}


def _same_value(value):
    """What decides whether a class body's value is the same in two imports: functions by their code and
    defaults, dataclass fields by their settings, other values by equality (or identity, when unhashable)."""
    if isinstance(value, (staticmethod, classmethod)):
        return type(value), _same_value(value.__func__)
    if isinstance(value, property):
        return property, tuple(_same_value(f) for f in (value.fget, value.fset, value.fdel))
    if isinstance(value, types.FunctionType):
        return (value.__code__, _same_value(value.__defaults__), _same_value(value.__kwdefaults__),
                value.__closure__ is None)
    if isinstance(value, dataclasses.Field):
        return dataclasses.Field, tuple(_same_value(getattr(value, name)) for name in dataclasses.Field.__slots__
                                        if name not in ("name", "type", "_field_type"))
    if isinstance(value, (tuple, list)):
        return type(value), tuple(_same_value(item) for item in value)
    if isinstance(value, dict):
        return dict, tuple((key, _same_value(item)) for key, item in value.items())
    try:
        hash(value)
    except TypeError:
        return id(value)
    return type(value), value


def _dataclass_once(cls=None, /, **options):
    """dataclasses.dataclass, which gives back the class an earlier import made of the same body."""
    def make(cls):
        body = tuple((name, _same_value(value)) for name, value in vars(cls).items()
                     if name not in ("__dict__", "__weakref__"))
        key = (cls.__module__, cls.__qualname__, tuple(sorted(options.items())), body)
        if key not in _dataclasses_made:
            _dataclasses_made[key] = _make_dataclass(cls, **options)
        return _dataclasses_made[key]
    return make if cls is None else make(cls)


def fresh_module():
    """The module imported afresh: its top level run again, every global back at what it reads from the
    environment now."""
    dataclasses.dataclass = _dataclass_once
    try:
        exec(_MODULE_CODE, run_orchestrator_loop.__dict__)
    finally:
        dataclasses.dataclass = _make_dataclass
    return run_orchestrator_loop


@pytest.fixture(autouse=True)
def no_waits_for_the_disk(request, monkeypatch):
    """os.fsync returns at once in a unit test: the files are written all the same, and what it guards
    against -- a machine that loses power before its disk has the data -- no unit test brings about, while
    each call waits for the disk (the loop syncs its state and folders after every step: thousands of
    waits a run of the suite). The end-to-end tests keep it."""
    if not request.node.get_closest_marker("e2e"):
        monkeypatch.setattr(os, "fsync", lambda fd: None)


# Each run looks for misspelt settings among the environment's names (difflib against every setting, some
# milliseconds); a test's environment is mostly the one the tests before it had. The answer depends on those
# names and the settings alone, so the same question is answered once per process.
_misspelt_settings_answers: dict = {}


def _misspelt_settings_remembered(misspelt_settings):
    def remembered(environ):
        module = run_orchestrator_loop
        known = tuple(setting.env for setting in module.SETTINGS) + tuple(module.SECRET_VARIABLES)
        question = (known, tuple(sorted(environ)))
        if question not in _misspelt_settings_answers:
            _misspelt_settings_answers[question] = misspelt_settings(environ)
        return list(_misspelt_settings_answers[question])
    return remembered


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
        module.misspelt_settings = _misspelt_settings_remembered(module.misspelt_settings)
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
        end_the_runs_threads()


# The loop's own threads (a creation nobody waits for, agents ended beside a stop): one a test's run left
# would otherwise go on into the next test and send its requests to that test's fake CAO.
RUN_THREADS = ("cao-", "ending the agents")


def end_the_runs_threads(seconds: float = 60) -> None:
    """Wait for the loop's threads still running to end (each ends with its request)."""
    deadline = time.monotonic() + seconds
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and thread.name.startswith(RUN_THREADS):
            thread.join(max(0.0, deadline - time.monotonic()))


FAST_FILE_SETTLE_SECONDS = 0.005

# Fast but otherwise default loop settings for in-process runs.
FAST = {"POLL_SECONDS": "0.01", "IDLE_GRACE_SECONDS": "0.05", "RESPONSE_TIMEOUT": "5"}


def run_main(module, *args: str) -> int:
    """Call main() as the command line would and return its exit code."""
    with pytest.raises(SystemExit) as stopped:
        module.main(list(args))
    return stopped.value.code


def lock_holder_process(state_file: str) -> subprocess.Popen:
    """Another process holding the run's lock beside `state_file`, as a running invocation does, until killed."""
    holder = subprocess.Popen([sys.executable, "-c", (
        f"import sys, time; sys.path.insert(0, {str(ROOT)!r}); import run_orchestrator_loop as loop; "
        f"loop.STATE_FILE = {state_file!r}; loop.RunLock.take(); print('HOLDING', flush=True); "
        "time.sleep(30)")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "HOLDING"
    return holder
