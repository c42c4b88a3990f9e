"""Following a run while it works, and reading it afterwards, on a real cao-server with scripted agents.

A slow agent gets progress lines (PROGRESS_SECONDS); the run leaves its record in
its folder (run.log, each prompt beside its reply, summary.json, .tmp/latest),
an interrupted and resumed run goes on in the same record, and the loop's .tmp/
stays out of the project's `git status`.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .test_orchestrator_e2e import FAIL_REPLY, PASS_REPLY, PROGRAMMER_REPLY, QUICK_ROUND, REPO_ROOT, SCRIPT, \
    SHORT_ROUND, Run, explain, numbered, wait_until_sent

pytestmark = pytest.mark.e2e


def run_folder(run: Run) -> Path:
    return Path(run.state()["run_dir"])


def summary_of(run: Run) -> dict:
    return json.loads((run_folder(run) / "summary.json").read_text(encoding="utf-8"))


def test_a_slow_agent_gets_progress_lines_and_a_fail_then_pass_run_leaves_its_record(cao):
    run = Run(cao, PROGRESS_SECONDS="1")
    subprocess.run(["git", "init", "-q", str(run.wd)], check=True)
    cao.trust_workdir(run.wd)
    cao.set_script({"programmer": [{"text": PROGRAMMER_REPLY, "think_ms": 3500}, PROGRAMMER_REPLY],
                    "tester": [FAIL_REPLY, PASS_REPLY]})
    result = run.run()
    assert result.returncode == 0, explain(result)
    sequence = QUICK_ROUND + SHORT_ROUND

    progress = re.findall(r"\| programmer: (working for \d+s; .*)$", result.stdout, re.MULTILINE)
    assert len(progress) >= 2, explain(result)
    assert "CAO status processing" in progress[0] and progress[0].endswith("no response file yet"), progress

    folder = run_folder(run)
    assert (folder / "run.log").read_text(encoding="utf-8") == result.stdout
    received = [r["message"] for r in cao.received() if r.get("kind") == "prompt"]
    assert len(received) == len(sequence)
    for n, role in enumerate(sequence, 1):
        kept = (folder / f"{n:03d}-{role}.prompt.md").read_text(encoding="utf-8")
        assert kept.rstrip("\n") == received[n - 1].rstrip("\n"), role
    assert run.archived() == numbered(sequence)

    summary = summary_of(run)
    assert summary["result"] == "PASS" and summary["providers"]["tester"] == "mock_cli"
    assert summary["wd"] == str(run.wd) and summary["task"] and summary["wall_seconds"] > 0
    assert [(t["role"], t["round"]) for t in summary["turn_list"]] == \
        [(role, 1) for role in QUICK_ROUND] + [(role, 2) for role in SHORT_ROUND]
    assert [t["outcome"] for t in summary["turn_list"] if t["role"] == "tester"] == ["FAIL", "PASS"]
    assert all(t["prompt_file"] and t["reply_file"] and t["sent_at"] <= t["taken_at"] for t in summary["turn_list"])

    page = (folder / "report.html").read_text(encoding="utf-8")
    assert re.findall(r'<a class="turn" href="#turn-(\d+)"', page) and \
        sorted(map(int, re.findall(r'<a class="turn" href="#turn-(\d+)"', page))) == list(range(1, 9))
    assert 'data-result="PASS"' in page

    assert (run.wd / ".tmp" / "latest").resolve() == folder.resolve()
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=run.wd,
                            capture_output=True, text=True, check=True).stdout
    assert ".tmp" not in status, status


def test_an_interrupted_run_records_its_unanswered_prompt_and_its_resume_goes_on_in_the_same_record(cao):
    run = Run(cao)
    cao.set_script({"programmer": [{"text": PROGRAMMER_REPLY, "think_ms": 3000}, PROGRAMMER_REPLY]})
    process = run.start()
    wait_until_sent(run, process, "programmer")      # the programmer is thinking now (3 s)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=30)
    assert process.returncode == 130, out + err
    folder = run_folder(run)
    interrupted = summary_of(run)
    assert interrupted["result"] == "RUNNING" and interrupted["turns"] == 2 and interrupted["prompts_sent"] == 3
    assert interrupted["turn_list"][-1]["outcome"] == "unanswered" and interrupted["prompt_bytes"] > 0
    log_after_stop = (folder / "run.log").read_text(encoding="utf-8")
    assert "interrupted (SIGINT); state saved, rerun to resume" in log_after_stop

    result = run.run()
    assert result.returncode == 0, explain(result)
    assert run_folder(run) == folder
    assert (folder / "run.log").read_text(encoding="utf-8") == log_after_stop + result.stdout
    summary = summary_of(run)
    assert [t["role"] for t in summary["turn_list"]] == QUICK_ROUND and summary["prompts_sent"] == 5
    assert summary["turn_list"][2]["prompt_file"] == "003-programmer.prompt.md"


def test_a_program_follows_a_fail_then_pass_run_through_its_events(cao):
    """A program started beside the run (`--status --follow --json`) reads every event as it is appended, in
    order, and ends when the run ends; what it read is the run's events.jsonl, and tells the run."""
    run = Run(cao)
    cao.set_script({"tester": [FAIL_REPLY, PASS_REPLY], "programmer": [{"text": PROGRAMMER_REPLY, "think_ms": 1500},
                                                                       PROGRAMMER_REPLY]})
    process = run.start()
    deadline = time.monotonic() + 60
    while not (run.state_file.exists() and (Path(run.state()["run_dir"]) / "events.jsonl").exists()):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.1)
    follower = subprocess.run([sys.executable, str(SCRIPT), "--status", "--follow", "--json"], cwd=REPO_ROOT,
                              env=run.env, capture_output=True, text=True, timeout=120)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, out + err
    assert follower.returncode == 0, follower.stderr
    events = [json.loads(line) for line in follower.stdout.splitlines()]
    written = (Path(run.state()["run_dir"]) / "events.jsonl").read_text(encoding="utf-8").splitlines()
    assert events == [json.loads(line) for line in written]          # all of it, nothing after the end
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    kinds = [e["event"] for e in events]
    assert kinds[0] == "run_started" and kinds[-1] == "run_stopped" and kinds.count("run_stopped") == 1
    taken = [e["role"] for e in events if e["event"] == "reply_taken"]
    assert taken == [e["role"] for e in events if e["event"] == "turn_sent"] == QUICK_ROUND + SHORT_ROUND
    assert [(e["round"], e["outcome"]) for e in events if e["event"] == "verdict" and e["role"] == "tester"] \
        == [(1, "FAIL"), (2, "PASS")]
    assert events[-1]["result"] == "PASS" and events[-1]["exit_code"] == 0
    assert [e["reply_file"] for e in events if e["event"] == "reply_taken"] == run.archived()
