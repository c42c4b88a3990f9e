"""A run that stops when its rounds stop making progress (MAX_ROUNDS_WITHOUT_PROGRESS).

The comparison of two failures (what varies between two runs of the same test does not count), then whole
runs through the fake CAO: the same failure round after round stops the run with exit 5, saying why, in the
state, the report, the events and --status; RESUME=1 goes on; a failure that changes every round, or the
setting left at 0, changes nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import FAST, run_main
from fake_cao import PASS_REPLY

REPLY = """RESULT: FAIL
EVIDENCE:
- Step 2 (`greet World`) failed at {when}: printed 'Hello World', expected 'Hello, World!' (took {took})
- pytest: 1 failed, 3 passed in {took}
- temp dir {tmp}, server {host}, object at {address}
- Recommended next fix: the format string in greet.py
"""


def failure(when="2026-11-27T17:15:10Z", took="0.52s", tmp="/tmp/pytest-of-u/pytest-12/test0",
            host="127.0.0.1:43211", address="0x7f3a2b10", step="Step 2 (`greet World`)") -> str:
    return REPLY.format(when=when, took=took, tmp=tmp, host=host, address=address).replace(
        "Step 2 (`greet World`)", step)


# --------------------------------------------------------------------------
# the comparison
# --------------------------------------------------------------------------

@pytest.mark.parametrize("other", [
    failure(when="2026-11-28T09:01:02.123+01:00"),                         # another time
    failure(when="17:20:31"),                                              # a clock time
    failure(took="1.9 s"),                                                  # durations, counts of seconds
    failure(took="12 seconds"),
    failure(tmp="/tmp/pytest-of-u/pytest-99/test7"),                        # temporary paths
    failure(tmp="/private/var/folders/x1/abc/T/tmpk2j4h6"),
    failure(host="127.0.0.1:5000"),                                         # addresses
    failure(host="localhost:8080"),
    failure(address="0xdeadbeef"),
    "\n".join(reversed(failure().splitlines())),                            # the order of the findings
    failure().replace("- ", "* ").replace("  ", " "),                       # bullets and spacing
    "\x1b[31m" + failure() + "\x1b[0m",                                     # colours
], ids=["iso-time", "clock-time", "duration", "seconds", "tmp-path", "macos-tmp", "ip-port", "localhost-port",
        "memory-address", "line-order", "bullets-spacing", "colours"])
def test_what_varies_between_runs_of_the_same_test_is_not_progress(orch, other):
    assert orch.failure_signature(other) == orch.failure_signature(failure())


@pytest.mark.parametrize("other", [
    failure(step="Step 3 (`greet --help`)"),                                # another failing step
    failure().replace("printed 'Hello World'", "printed 'Hello,World!'"),   # the same step, other output
    failure() + "- Step 4 also failed: exit code 2\n",                      # a step more
    failure().replace("- Recommended next fix: the format string in greet.py\n", ""),   # a finding less
], ids=["other-step", "other-output", "a-step-more", "a-finding-less"])
def test_a_different_failure_is_progress(orch, other):
    assert orch.failure_signature(other) != orch.failure_signature(failure())


def test_the_failing_step_is_the_first_finding_as_the_tester_wrote_it(orch):
    assert orch.failing_step(failure()) == ("Step 2 (`greet World`) failed at 2026-11-27T17:15:10Z: printed "
                                            "'Hello World', expected 'Hello, World!' (took 0.52s)")
    assert orch.failing_step("RESULT: FAIL\nEVIDENCE:\n") == "(no evidence)"


def test_the_files_a_round_changed_in_a_directory_without_git_leave_the_loops_own_files_out(load_orch, tmp_path):
    m = load_orch(WD=str(tmp_path))
    (tmp_path / "greet.py").write_text("print('Hello World')\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_greet.py").write_text("def test(): pass\n")
    before = m.worktree_fingerprints()
    assert set(before) == {"greet.py", "tests/test_greet.py"}
    (tmp_path / ".tmp").mkdir()
    (tmp_path / ".tmp" / "orchestrator-loop-state.json").write_text("{}")
    assert m.changed_files(before, m.worktree_fingerprints()) == []
    (tmp_path / "greet.py").write_text("print('Hello, World!')\n")
    (tmp_path / "notes.md").write_text("x\n")
    assert m.changed_files(before, m.worktree_fingerprints()) == ["greet.py", "notes.md"]


# --------------------------------------------------------------------------
# whole runs through the fake CAO
# --------------------------------------------------------------------------

def events(m) -> list[dict]:
    return m.read_events(Path(m.run_dir) / m.EVENTS_FILE)


def test_the_same_failure_round_after_round_stops_the_run_and_says_why(load_orch, fake_cao, prompt_file, capsys):
    """Rounds 2 and 3 repeat round 1's failure (only its times differ) and the programmer changes nothing: the run
    stops after round 3 of 8 with exit 5; state, summary, report, events and --status say why."""
    fake_cao.script["tester"] = [failure(when=f"2026-11-27T17:1{n}:00Z", took=f"0.{n}s") for n in range(3)]
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", MAX_ROUNDS_WITHOUT_PROGRESS="2",
                  MIN_REVIEW_CYCLES_BEFORE_APPROVAL="1", **FAST)
    assert run_main(m) == 5
    captured = capsys.readouterr()
    last = captured.err.strip().splitlines()[-1]
    assert last.startswith("stopped without progress: the test failed at the same step in rounds 1 to 3 (2 rounds "
                           "in a row without progress, MAX_ROUNDS_WITHOUT_PROGRESS=2): Step 2 (`greet World`) "
                           "failed at 2026-11-27T17:10:00Z")
    assert "in those rounds no file changed" in last
    assert last.endswith("a person is needed, then to go on: RESUME=1 cao-orchestrator-loop")
    assert fake_cao.roles_prompted() == ["tester"] + ["programmer", "peer_programmer", "tester"] * 2

    state = json.loads(Path(m.STATE_FILE).read_text())
    assert (state["final_status"], state["current_round"], state["current_phase"]) == ("FAIL", 3, "done")
    stop = state["no_progress_stop"]
    assert (stop["first_round"], stop["round"], stop["rounds"], stop["files_changed"]) == (1, 3, 2, [])
    assert stop["turns_saved"] == 5 * 3                # 5 rounds left, 3 turns each at this run's pace
    assert stop["turns_left_at_most"] == 5 * 7         # 3 review cycles and a test per round at most
    assert [r["repeats"] for r in state["failed_rounds"]] == [0, 1, 2]

    compared = [e for e in events(m) if e["event"] == "round_compared"]
    assert [(e["round"], e["progress"], e["rounds_without_progress"]) for e in compared] == \
        [(1, True, 0), (2, False, 1), (3, False, 2)]
    stopped = events(m)[-1]
    assert stopped["event"] == "run_stopped" and stopped["exit_code"] == 5
    assert stopped["no_progress"]["round"] == 3 and stopped["scheduler_action"].startswith("stop: a person")

    summary = json.loads((Path(m.run_dir) / "summary.json").read_text())
    assert summary["exit_code"] == 5 and summary["no_progress_stop"]["rounds"] == 2
    report = (Path(m.run_dir) / "report.html").read_text()
    assert '<section id="no-progress">' in report
    assert '<pre data-round="1">' in report and "17:10:00Z" in report
    assert '<pre data-round="3">' in report and "17:12:00Z" in report

    # what the programmer was told: its last change did not fix the step, and what it changed (nothing)
    third = fake_cao.prompts_for("programmer")[1]
    assert "Test failure feedback:\nRESULT: FAIL" in third
    assert ("The same failure again:\nThe test failed in round 2 the same way as in round 1 (the feedback above; "
            "only times, paths and the like differ). Your change in round 2 did not fix it: you changed no file in "
            "the project.") in third
    assert "The same failure again:" not in fake_cao.prompts_for("programmer")[0]

    assert run_main(m, "--status") == 0
    out = capsys.readouterr().out
    assert "last stop: exit 5 (the same test failure repeated" in out
    assert "stopped without progress: the test failed at the same step in rounds 1 to 3" in out
    assert "next: to go on, RESUME=1 cao-orchestrator-loop" in out
    assert run_main(m, "--status", "--json") == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["last_exit_code"] == 5 and facts["no_progress_stop"]["round"] == 3
    assert facts["go_on"] == "RESUME=1 cao-orchestrator-loop"


def test_resume_goes_on_after_the_stop_and_counts_the_rounds_without_progress_anew(load_orch, fake_cao,
                                                                                 prompt_file, capsys):
    """Stopped after rounds 1-3 failed alike; RESUME=1 plays round 4 (the same failure again: one round without
    progress, counted anew, not three) and round 5, which passes."""
    fake_cao.script["tester"] = [failure()] * 4 + [PASS_REPLY]
    settings = dict(PROMPT_FILE=str(prompt_file), START_AGENT="tester", MAX_ROUNDS_WITHOUT_PROGRESS="2",
                    MIN_REVIEW_CYCLES_BEFORE_APPROVAL="1", **FAST)
    m = load_orch(**settings)
    assert run_main(m) == 5
    assert json.loads(Path(m.STATE_FILE).read_text())["current_round"] == 3
    capsys.readouterr()
    m = load_orch(RESUME="1", **settings)
    assert run_main(m) == 0
    out = capsys.readouterr().out
    assert "the run ended without progress after round 3; going on with round 4" in out
    state = json.loads(Path(m.STATE_FILE).read_text())
    assert (state["final_status"], state["current_round"], state["no_progress_stop"]) == ("PASS", 5, None)
    assert [r["repeats"] for r in state["failed_rounds"]] == [0, 1, 2, 3]
    resumed = [e for e in events(m) if e["event"] == "run_resumed"]
    assert resumed[-1]["continued_after_fail"] is True
    assert fake_cao.roles_prompted()[-6:] == ["programmer", "peer_programmer", "tester"] * 2


def test_a_failure_that_changes_every_round_is_progress_and_the_run_goes_on_to_pass(load_orch, fake_cao,
                                                                                    prompt_file):
    fake_cao.script["tester"] = [failure(step=f"Step {n}") for n in (1, 2, 3)] + [PASS_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", MAX_ROUNDS_WITHOUT_PROGRESS="1", **FAST)
    assert run_main(m) == 0
    state = json.loads(Path(m.STATE_FILE).read_text())
    assert (state["final_status"], state["current_round"], state["no_progress_stop"]) == ("PASS", 4, None)
    assert [r["repeats"] for r in state["failed_rounds"]] == [0, 0, 0]


def test_left_at_0_the_same_failure_runs_to_max_rounds_as_before(load_orch, fake_cao, prompt_file, capsys):
    fake_cao.script["tester"] = [failure()]
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", MAX_ROUNDS="3", **FAST)
    assert m.MAX_ROUNDS_WITHOUT_PROGRESS == 0
    assert run_main(m) == 1
    assert "FAIL: no PASS within MAX_ROUNDS=3" in capsys.readouterr().out
    state = json.loads(Path(m.STATE_FILE).read_text())
    assert (state["current_round"], state["failed_rounds"], state["no_progress_stop"]) == (3, [], None)
    assert not [e for e in events(m) if e["event"] == "round_compared"]
    assert all("The same failure again" not in prompt for prompt in fake_cao.prompts_for("programmer"))


def test_a_repeat_in_the_last_round_ends_as_a_fail_at_max_rounds(load_orch, fake_cao, prompt_file):
    """The rounds without progress reach the setting in round MAX_ROUNDS: nothing is saved by stopping, so the
    run ends as it would without the setting (exit 1, more rounds to go on)."""
    fake_cao.script["tester"] = [failure()]
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", MAX_ROUNDS="2", MAX_ROUNDS_WITHOUT_PROGRESS="1",
                  **FAST)
    assert run_main(m) == 1
    assert json.loads(Path(m.STATE_FILE).read_text())["no_progress_stop"] is None


def test_the_files_a_round_changed_in_git_count_its_commits_and_untracked_files_not_tmp(load_orch, tmp_path):
    import subprocess

    def git(*args: str) -> None:
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)
    git("init", "-q")
    (tmp_path / "greet.py").write_text("print('Hello World')\n")
    (tmp_path / "README.md").write_text("greet\n")
    git("add", ".")
    git("commit", "-qm", "start")
    m = load_orch(WD=str(tmp_path))
    before = m.worktree_fingerprints()
    (tmp_path / ".tmp").mkdir()
    (tmp_path / ".tmp" / "reply.md").write_text("x\n")
    assert m.changed_files(before, m.worktree_fingerprints()) == []
    (tmp_path / "greet.py").write_text("print('Hello, World!')\n")          # changed, then committed
    git("commit", "-qam", "fix")
    (tmp_path / "tests.py").write_text("assert True\n")                     # untracked
    assert m.changed_files(before, m.worktree_fingerprints()) == ["greet.py", "tests.py"]


def test_help_names_every_exit_code_the_no_progress_stop_among_them(orch):
    text = " ".join(orch.help_text().split())
    for code, _, _ in orch.EXIT_CODES:
        if code in orch.EXIT_SHORT:
            assert f" {code} {orch.EXIT_SHORT[code]}" in text
    assert "5 no progress" in text
    assert " 129/130/131/143 a stop signal" in text
    assert sorted(orch.EXIT_SHORT) + sorted(code for code, _ in orch.STOP_SIGNALS.values()) == \
        [code for code, _, _ in orch.EXIT_CODES]


def test_a_stop_whose_agents_are_ended_says_a_rerun_starts_a_new_run(load_orch, fake_cao, prompt_file, capsys):
    fake_cao.script["tester"] = [failure()]
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", MAX_ROUNDS_WITHOUT_PROGRESS="1",
                  MIN_REVIEW_CYCLES_BEFORE_APPROVAL="1", CLEANUP_ON_EXIT="1", **FAST)
    assert run_main(m) == 5
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.endswith("a person is needed; its agents were ended (CLEANUP_ON_EXIT=1), so a rerun starts a new run")
    assert "RESUME=1" not in last


def test_what_the_rounds_left_would_cost_comes_from_this_runs_own_retry_rounds(orch):
    use = orch.TokenUse
    records = [orch.TurnRecord("tester", 1, 1.0, 10, tokens={"m": use(1000, 0, 10)})] + [
        orch.TurnRecord(role, number, 1.0, 10, tokens={"m": use(100, 50, 10)})
        for number in (2, 3) for role in ("programmer", "peer_programmer", "tester")]
    orch.update_run(turn_records=records)
    turns, tokens = orch.round_figures(4)
    assert turns == 4 * 3 and tokens == {"m": use(4 * 300, 4 * 150, 4 * 30)}   # round 1 (the analysis) left out
    orch.update_run(turn_records=records + [orch.TurnRecord("programmer", 4, 1.0, 10)])
    assert orch.round_figures(4)[1] is None                                    # a turn's tokens not known
