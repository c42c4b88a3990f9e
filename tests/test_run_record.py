"""The run record: what a run leaves in its folder under $WD/.tmp/ to be read afterwards.

run.log (everything the run printed, resumed parts appended), each prompt beside
the reply it got (NNN-<role>.prompt.md and NNN-<role>.md, reminders and resends
appended), summary.json with the run's times, providers and ordered turns,
.tmp/latest pointing at the newest run, .tmp/ out of `git status`, and old state
files kept under the name of the run they hold.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from conftest import run_main
from fake_cao import FAIL_REPLY, PASS_REPLY
from test_loop import QUICK, QUICK_ROUND, interrupt, state_of

FAIL_THEN_PASS = QUICK_ROUND + ["programmer", "peer_programmer", "tester"]


def run_folder(module) -> Path:
    return Path(state_of(module)["run_dir"])


def summary_of(module) -> dict:
    return json.loads((run_folder(module) / "summary.json").read_text(encoding="utf-8"))


def test_a_fail_then_pass_run_leaves_its_log_prompts_replies_and_summary(load_orch, fake_cao, prompt_file, capsys):
    fake_cao.script["tester"] = [FAIL_REPLY, PASS_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), PROVIDER="mock_cli", **QUICK)
    assert run_main(m) == 0
    printed = capsys.readouterr().out
    folder = run_folder(m)

    log_lines = (folder / "run.log").read_text(encoding="utf-8").splitlines()
    assert log_lines == printed.splitlines()           # all that the run printed, from its first line on
    assert "    RESULT: FAIL" in log_lines                 # the test evidence under the tester's line too
    assert "using the CAO server at http://cao.test: API names it" in log_lines[0]     # which server, and why
    assert "creating the five agent terminals" in log_lines[1]

    replies = sorted(p.name for p in folder.glob("[0-9][0-9][0-9]-*.md") if not p.name.endswith(".prompt.md"))
    assert replies == [f"{n:03d}-{role}.md" for n, role in enumerate(FAIL_THEN_PASS, 1)]
    sent = [message for role, message in fake_cao.prompts]
    for n, role in enumerate(FAIL_THEN_PASS, 1):
        assert (folder / f"{n:03d}-{role}.prompt.md").read_text(encoding="utf-8").rstrip("\n") \
            == sent[n - 1].rstrip("\n")

    summary = summary_of(m)
    assert summary["result"] == "PASS" and summary["exit_code"] == 0
    assert summary["wd"] == m.WD and summary["providers"] == {role: "mock_cli" for role in m.ROLES}
    assert summary["task"] and summary["task"] in prompt_file.read_text(encoding="utf-8")
    assert summary["started_at"] <= summary["ended_at"] and summary["wall_seconds"] >= 0
    turns = summary["turn_list"]
    assert [t["role"] for t in turns] == FAIL_THEN_PASS
    assert [t["round"] for t in turns] == [1] * 5 + [2] * 3
    assert [t["phase"] for t in turns[:5]] == ["analyst", "analyst", "programmer", "programmer", "tester"]
    assert [t["outcome"] for t in turns if t["role"] == "tester"] == ["FAIL", "PASS"]
    for n, turn in enumerate(turns, 1):
        assert turn["prompt_file"] == f"{n:03d}-{turn['role']}.prompt.md"
        assert turn["reply_file"] == f"{n:03d}-{turn['role']}.md"
        assert turn["sent_at"] <= turn["taken_at"] and turn["prompt_bytes"] > 0 and turn["reply_bytes"] > 0
        assert turn["reminders"] == 0 and turn["resends"] == 0
    assert summary["prompt_bytes"] == sum(t["prompt_bytes"] for t in turns)

    latest = Path(m.WD) / ".tmp" / "latest"
    assert latest.is_symlink() and latest.resolve() == folder.resolve()


def test_the_loops_tmp_folder_stays_out_of_git_status(load_orch, fake_cao, prompt_file, workdir):
    subprocess.run(["git", "init", "-q", str(workdir)], check=True)
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", **QUICK)
    assert run_main(m) == 0
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=workdir,
                            capture_output=True, text=True, check=True).stdout
    assert ".tmp" not in status


def test_a_reminder_is_kept_below_the_prompt_and_counted(load_orch, fake_cao, prompt_file):
    fake_cao.script["tester"] = [{"action": "write_on_reminder", "text": PASS_REPLY}]
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", **QUICK)
    assert run_main(m) == 0
    kept = (run_folder(m) / "001-tester.prompt.md").read_text(encoding="utf-8")
    assert "\n---- reminder sent at " in kept and kept.rstrip().endswith("the orchestrator reads only that file.")
    assert kept.index("Write your complete answer to this file:") < kept.index("---- reminder sent at ")
    [turn] = summary_of(m)["turn_list"]
    assert turn["reminders"] == 1 and turn["resends"] == 0


def test_an_interrupted_run_counts_the_prompt_it_sent_and_a_resume_goes_on_in_the_same_record(
        load_orch, fake_cao, prompt_file, capsys):
    fake_cao.script["programmer"] = [interrupt(KeyboardInterrupt())]
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 130
    first = capsys.readouterr()
    folder = run_folder(m)
    summary = summary_of(m)
    assert summary["turns"] == 2 and summary["prompts_sent"] == 3
    unanswered = summary["turn_list"][-1]
    assert unanswered["role"] == "programmer" and unanswered["outcome"] == "unanswered"
    assert unanswered["prompt_bytes"] > 0 and unanswered["prompt_file"] == "003-programmer.prompt.md"
    assert summary["prompt_bytes"] == sum(t["prompt_bytes"] for t in summary["turn_list"])
    assert "2 turns and 1 prompt not answered yet" in first.out
    log_text = (folder / "run.log").read_text(encoding="utf-8")
    stop_line = first.err.strip().splitlines()[-1]
    logged = log_text.splitlines()
    assert sorted(logged) == sorted(first.out.splitlines() + [stop_line])
    assert logged.index(stop_line) < next(i for i, line in enumerate(logged) if "] summary: " in line)

    fake_cao.script["programmer"] = []
    m = load_orch(PROMPT_FILE=str(prompt_file), RESUME="1", **QUICK)
    assert run_main(m) == 0
    second = capsys.readouterr()
    assert run_folder(m) == folder
    assert (folder / "run.log").read_text(encoding="utf-8") == log_text + second.out
    summary = summary_of(m)
    assert [t["role"] for t in summary["turn_list"]] == QUICK_ROUND
    programmer = summary["turn_list"][2]
    assert programmer["prompt_file"] == "003-programmer.prompt.md" and programmer["reply_file"] == "003-programmer.md"
    assert programmer["resends"] == 1                   # the new process sent the interrupted prompt again
    assert "---- resend sent at " in (folder / "003-programmer.prompt.md").read_text(encoding="utf-8")


def test_a_replaced_state_file_is_kept_under_the_name_of_the_run_it_holds(load_orch, fake_cao, prompt_file):
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", **QUICK)
    assert run_main(m) == 0
    first_run = run_folder(m).name
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", RESUME="0", **QUICK)
    assert run_main(m) == 0
    backups = sorted(p.name for p in Path(m.STATE_FILE).parent.glob("*.bak"))
    assert backups == [f"{Path(m.STATE_FILE).name}.{first_run}.bak"]
    assert json.loads((Path(m.STATE_FILE).parent / backups[0]).read_text())["run_dir"].endswith(first_run)
    assert (Path(m.WD) / ".tmp" / "latest").resolve() == run_folder(m).resolve() != Path(m.WD, ".tmp", first_run)


def test_counts_read_as_a_person_writes_them(load_orch, fake_cao, prompt_file, capsys):
    """One turn is "1 turn", not "1 turns"."""
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", **QUICK)
    assert run_main(m) == 0
    out = capsys.readouterr().out
    assert "summary: PASS after round 1/8; 1 turn, " in out
    assert m.counted(1, "prompt") == "1 prompt" and m.counted(0, "prompt") == "0 prompts"


def test_a_turn_is_timed_to_the_moment_its_reply_was_taken_not_to_when_it_was_kept_on_disk(
        load_orch, fake_cao, prompt_file, monkeypatch):
    """Keeping a reply (the state and the run folder written to disk) can take a while on a busy disk: a
    turn's taken_at and seconds are those of the moment the loop took the reply, as its log line's are."""
    import time
    fake_cao.script["tester"] = [FAIL_REPLY, PASS_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), PROVIDER="mock_cli", **QUICK)
    kept_from = []
    keep = m.archive_reply

    def slow_keep(role, text, response_file):
        kept_from.append(time.time())
        time.sleep(0.3)                                   # a slow fsync
        return keep(role, text, response_file)

    monkeypatch.setattr(m, "archive_reply", slow_keep)
    assert run_main(m) == 0
    turns = summary_of(m)["turn_list"]
    taken = [m.parse_utc_iso(turn["taken_at"]).timestamp() for turn in turns]
    assert len(taken) == len(kept_from) == len(FAIL_THEN_PASS)
    assert all(took <= kept + 0.001 for took, kept in zip(taken, kept_from)), (taken, kept_from)
