"""APPROVE's gates, --approve / --reject / --note, and ntfy's buttons, on the fake CAO (docs/approval.md)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
from conftest import run_main
from fake_cao import FAIL_REPLY, PASS_REPLY
from ntfy_recorder import NtfyRecorder
from test_loop import QUICK, QUICK_ROUND

ANALYSIS = ["analyst", "peer_analyst"]
CODE_ROUND = ["programmer", "peer_programmer", "tester"]


def state_of(m) -> dict:
    return json.loads(Path(m.STATE_FILE).read_text(encoding="utf-8"))


def events_of(m) -> list[dict]:
    return [json.loads(line) for line in (Path(m.run_dir) / "events.jsonl").read_text().splitlines()]


def stop_at_plan_gate(load_orch, prompt_file, capsys, **env):
    """A run with APPROVE=plan and no wait: it stops after the analysis with exit 6, nothing sent on."""
    m = load_orch(PROMPT_FILE=str(prompt_file), APPROVE="plan", APPROVAL_MAX_WAIT="0", **QUICK, **env)
    assert run_main(m) == 6
    return m


def test_the_plan_gate_stops_before_the_programmer_and_the_same_command_goes_on_once_approved(
        load_orch, fake_cao, prompt_file, capsys, monkeypatch):
    m = stop_at_plan_gate(load_orch, prompt_file, capsys)
    assert fake_cao.roles_prompted() == ANALYSIS                     # nothing for the programmer yet
    out, err = capsys.readouterr()
    assert "waiting for your approval of the plan (round 1" in out and "--approve" in out
    assert "SUMMARY" in out or "analyst's reply" in out              # what waits is shown
    assert err.strip().splitlines()[-1].startswith("stopped at the plan gate: waiting for your approval of the plan")
    state = state_of(m)
    assert (state["current_phase"], state["phase_step"], state["final_status"]) == ("programmer", "approval", "RUNNING")
    assert [(g["gate"], g["verdict"]) for g in state["gates"]] == [("plan", "")]
    assert [e["event"] for e in events_of(m)].count("gate_reached") == 1
    assert json.loads((Path(m.run_dir) / "summary.json").read_text())["exit_code"] == 6

    # --status tells what waits, and how to decide
    assert run_main(m, "--status") == 0
    assert "next: waiting for your approval of the plan since" in capsys.readouterr().out

    # the same command before a decision: exit 6 again, nothing sent
    m = load_orch(PROMPT_FILE=str(prompt_file), APPROVE="plan", APPROVAL_MAX_WAIT="0", **QUICK)
    assert run_main(m) == 6 and fake_cao.roles_prompted() == ANALYSIS
    capsys.readouterr()

    monkeypatch.setenv("USER", "pat")
    assert run_main(m, "--approve") == 0
    assert capsys.readouterr().out.startswith("the plan approved (the plan gate of round 1); the run takes it when")
    assert run_main(m, "--approve") == 2
    assert "the plan gate of round 1 was already decided: approved by pat" in capsys.readouterr().err
    assert run_main(m, "--reject", "too late") == 2          # the first decision counts

    m = load_orch(PROMPT_FILE=str(prompt_file), APPROVE="plan", APPROVAL_MAX_WAIT="0", **QUICK)
    assert run_main(m) == 0
    assert fake_cao.roles_prompted() == QUICK_ROUND
    gate = state_of(m)["gates"][0]
    assert (gate["verdict"], gate["by"]) == ("approve", "pat")
    decided = [e for e in events_of(m) if e["event"] == "gate_decided"]
    assert [(e["gate"], e["verdict"], e["by"]) for e in decided] == [("plan", "approve", "pat")]
    summary = json.loads((Path(m.run_dir) / "summary.json").read_text())
    assert [(g["gate"], g["verdict"]) for g in summary["gates"]] == [("plan", "approve")]
    assert 'data-role="person"' in (Path(m.run_dir) / "report.html").read_text()


def test_a_rejected_plan_goes_back_to_the_analyst_with_the_words_then_review_and_the_gate_again(
        load_orch, fake_cao, prompt_file, capsys, monkeypatch):
    m = stop_at_plan_gate(load_orch, prompt_file, capsys)
    capsys.readouterr()
    assert run_main(m, "--reject", "") == 2
    assert "--reject needs the reason" in capsys.readouterr().err
    monkeypatch.setenv("USER", "pat")
    assert run_main(m, "--reject", "Keep the old flags working.") == 0
    m = load_orch(PROMPT_FILE=str(prompt_file), APPROVE="plan", APPROVAL_MAX_WAIT="0", **QUICK)
    assert run_main(m) == 6                                  # the new plan waits at the gate again
    assert fake_cao.roles_prompted() == ANALYSIS + ANALYSIS
    second = fake_cao.prompts_for("analyst")[1]
    assert "Note from a person (pat, " in second and "Keep the old flags working." in second
    assert "Your plan was rejected at the approval gate" in second
    assert "Keep the old flags working." not in fake_cao.prompts_for("peer_analyst")[1]
    gates = state_of(m)["gates"]
    assert [(g["gate"], g["verdict"], g["words"]) for g in gates] == [
        ("plan", "reject", "Keep the old flags working."), ("plan", "", "")]


def test_bad_decisions_and_notes_are_one_line_exit_2_and_change_nothing(load_orch, fake_cao, prompt_file, capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m, "--approve") == 2
    assert "no gate waits for a decision in the run of" in capsys.readouterr().err
    assert run_main(m, "--note", "programmer", "hello") == 2     # no run there yet
    assert "no run in" in capsys.readouterr().err
    assert run_main(m) == 0                                      # a run without gates: as before
    assert run_main(m, "--approve") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no gate waits for a decision" in err and "finished with PASS" in err
    assert run_main(m, "--note", "designer", "hello") == 2
    assert capsys.readouterr().err.strip() == ("error: --note: no role 'designer'; the roles: analyst, peer_analyst, "
                                               "programmer, peer_programmer, tester")
    assert run_main(m, "--approve", "--status") == 2
    assert "--status and --approve are separate commands" in capsys.readouterr().err
    assert run_main(m, "--note", "programmer") == 2
    assert '--note takes a role and the text, e.g. --note programmer "' in capsys.readouterr().err
    assert run_main(m, "--reject") == 2
    assert "--reject takes the reason" in capsys.readouterr().err
    assert not (Path(m.run_dir) / "decisions").exists() and not (Path(m.run_dir) / "notes").exists()
    bad = load_orch(PROMPT_FILE=str(prompt_file), APPROVE="plan,deploy", **QUICK)
    assert run_main(bad) == 2
    assert "APPROVE" in capsys.readouterr().err


def test_a_note_is_carried_by_exactly_one_prompt_of_its_role(load_orch, fake_cao, prompt_file, capsys, monkeypatch):
    fake_cao.script["tester"] = [FAIL_REPLY, PASS_REPLY]                 # two programmer turns
    m = stop_at_plan_gate(load_orch, prompt_file, capsys)
    monkeypatch.setenv("USER", "sam")
    assert run_main(m, "--note", "programmer", "Use the standard library only.") == 0
    assert run_main(m, "--note", "peer-programmer", "Check the exit codes.") == 0
    assert run_main(m, "--approve") == 0
    m = load_orch(PROMPT_FILE=str(prompt_file), APPROVE="plan", APPROVAL_MAX_WAIT="0", **QUICK)
    assert run_main(m) == 0
    assert fake_cao.roles_prompted() == QUICK_ROUND + CODE_ROUND
    carrying = [p for p in fake_cao.prompts_for("programmer") if "Use the standard library only." in p]
    assert len(carrying) == 1 and carrying[0] == fake_cao.prompts_for("programmer")[0]
    assert "Note from a person (sam, " in carrying[0]
    assert carrying[0].index("Use the standard library only.") < carrying[0].index("Response file")
    assert [("Check the exit codes." in p) for p in fake_cao.prompts_for("peer_programmer")] == [True, False]
    summary = json.loads((Path(m.run_dir) / "summary.json").read_text())
    assert [(n["role"], n["by"], n["carried"]) for n in summary["person_notes"]] == [
        ("programmer", "sam", True), ("peer_programmer", "sam", True)]
    assert [e["role"] for e in events_of(m) if e["event"] == "note_taken"] == ["programmer", "peer_programmer"]


def test_the_commit_gate_holds_the_after_run_steps_and_a_rejection_is_a_failed_test(
        load_orch, fake_cao, prompt_file, capsys, monkeypatch):
    env = dict(PROMPT_FILE=str(prompt_file), APPROVE="commit", APPROVAL_MAX_WAIT="0", COMMIT_ON_PASS="1", **QUICK)
    m = load_orch(**env)
    assert run_main(m) == 6
    state = state_of(m)
    assert (state["current_phase"], state["phase_step"], state["final_status"]) == ("tester", "approval", "RUNNING")
    assert (state["after_run"] or {}).get("commit") is None              # nothing committed before the approval
    monkeypatch.setenv("USER", "pat")
    assert run_main(m, "--reject", "The greeting must end with a full stop.") == 0
    m = load_orch(**env)
    assert run_main(m) == 6                                       # round 2 passed: the gate again
    assert fake_cao.roles_prompted() == QUICK_ROUND + CODE_ROUND
    retry = fake_cao.prompts_for("programmer")[1]
    assert "Test failure feedback:" in retry
    assert "The tester reported PASS, but pat rejected the change at the commit gate, saying:" in retry
    assert "The greeting must end with a full stop." in retry
    assert run_main(m, "--approve") == 0
    m = load_orch(**env)
    assert run_main(m) == 0
    assert fake_cao.roles_prompted() == QUICK_ROUND + CODE_ROUND   # no agent asked again
    assert state_of(m)["after_run"]["commit"] is not None
    assert [(g["gate"], g["round"], g["verdict"]) for g in state_of(m)["gates"]] == [
        ("commit", 1, "reject"), ("commit", 2, "approve")]


def test_a_run_waiting_in_place_goes_on_once_a_decision_is_written(load_orch, fake_cao, prompt_file, capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), APPROVE="plan", APPROVAL_MAX_WAIT="120", **QUICK)
    m.DECISION_POLL_SECONDS = 0.05

    def approve_once_waiting():           # once the gate is in the state file, as another shell would find it
        while not (Path(m.STATE_FILE).exists() and m.pending_gate(m.read_state_file().gates)):
            time.sleep(0.02)
        decided.append(m.decide_at_gate(m.read_state_file(), "approve", ""))
    decided = []
    helper = threading.Thread(target=approve_once_waiting, daemon=True)
    helper.start()
    assert run_main(m) == 0
    helper.join(5)
    assert decided == ["the plan approved (the plan gate of round 1)"]
    assert fake_cao.roles_prompted() == QUICK_ROUND
    assert "waiting for your approval of the plan" in capsys.readouterr().out


def test_ntfy_the_gate_message_has_both_buttons_and_the_first_decision_on_its_own_topic_counts(
        load_orch, fake_cao, prompt_file, capsys):
    with NtfyRecorder() as ntfy:
        fake_cao.router.route(host="127.0.0.1").pass_through()
        m = load_orch(PROMPT_FILE=str(prompt_file), APPROVE="plan", APPROVAL_MAX_WAIT="120", NTFY_TOPIC="my-loop",
                      NTFY_SERVER=ntfy.url, **QUICK)
        m.DECISION_POLL_SECONDS = m.NTFY_POLL_SECONDS = 0.05
        pressed = {}

        def press_reject_elsewhere_then_approve():
            while not ntfy.published("my-loop"):
                time.sleep(0.02)
            message = ntfy.published("my-loop")[0]
            pressed["message"] = message
            buttons = {a["label"]: a for a in message["actions"]}
            httpx.post(f"{ntfy.url}/cao-loop-0123456789abcdef01234567", content="reject")    # another gate's topic
            time.sleep(0.3)
            httpx.request(buttons["Approve"]["method"], buttons["Approve"]["url"], content=buttons["Approve"]["body"])
        helper = threading.Thread(target=press_reject_elsewhere_then_approve, daemon=True)
        helper.start()
        assert run_main(m) == 0
        helper.join(5)
    message = pressed["message"]
    assert message["title"].startswith("Approve the plan? Round 1:")
    buttons = {a["label"]: a for a in message["actions"]}
    assert set(buttons) == {"Approve", "Reject"}
    assert {a["action"] for a in buttons.values()} == {"http"} and buttons["Reject"]["body"] == "reject"
    reply_topic = buttons["Approve"]["url"].rsplit("/", 1)[1]
    assert reply_topic.startswith("cao-loop-") and len(reply_topic) == len("cao-loop-") + 24
    assert buttons["Reject"]["url"] == buttons["Approve"]["url"]
    gate = state_of(m)["gates"][0]
    assert (gate["verdict"], gate["by"], gate["reply_topic"]) == ("approve", "ntfy", reply_topic)
    assert fake_cao.roles_prompted() == QUICK_ROUND
    polls = [r for r in ntfy.requests if r["method"] == "GET"]
    assert polls and all(r["path"].startswith(f"/{reply_topic}/json?") and "poll=1" in r["path"] for r in polls)


def test_a_run_folder_that_cannot_be_written_is_one_line_exit_3_not_a_traceback(
        load_orch, fake_cao, prompt_file, capsys, monkeypatch):
    m = stop_at_plan_gate(load_orch, prompt_file, capsys)
    capsys.readouterr()

    def refuse(*args):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(m.os, "link", refuse)
    assert run_main(m, "--approve") == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: could not write into the run's folder (PermissionError")
    assert not list((Path(m.run_dir) / "decisions").glob("*.json"))
