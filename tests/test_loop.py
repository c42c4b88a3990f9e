"""The main loop driven end to end in-process against a respx-mocked CAO.

The fake's agents write their response files as real agents would, so these
tests exercise configuration, init, handoff, review gate, condensation,
state and exit codes together (spec 1 "Orchestration flow", spec 4 shortened
retry, resume and signals).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import httpx
import pytest

from conftest import FAST, run_main
from fake_cao import APPROVED_ANALYSIS, FAIL_REPLY, PASS_REPLY, PROGRAMMER_REPLY, review

FULL_ROUND = ["analyst", "peer_analyst", "analyst", "peer_analyst",
              "programmer", "peer_programmer", "programmer", "peer_programmer", "tester"]
RETRY_ROUND = ["programmer", "peer_programmer", "programmer", "peer_programmer", "tester"]
# With MIN_REVIEW_CYCLES_BEFORE_APPROVAL=1 an approval counts on the first cycle.
QUICK = {**FAST, "MIN_REVIEW_CYCLES_BEFORE_APPROVAL": "1"}
QUICK_ROUND = ["analyst", "peer_analyst", "programmer", "peer_programmer", "tester"]


def state_of(module) -> dict:
    return json.loads(Path(module.STATE_FILE).read_text(encoding="utf-8"))


def archived(module) -> list[str]:
    return sorted(p.name for p in Path(module.run_dir).glob("[0-9][0-9][0-9]-*")
                  if not p.name.endswith(".prompt.md"))


def interrupt(exc: BaseException):
    """A script step that stops the orchestrator while the agent is working."""
    def call(fake, terminal):
        terminal.status = "idle"        # the agent stops too; nothing arrives later
        raise exc
    return {"action": "call", "call": call}


def sigterm_step():
    def call(fake, terminal):
        os.kill(os.getpid(), signal.SIGTERM)
    return {"action": "call", "call": call}


# -- spec 1: orchestration flow ---------------------------------------------

def test_pass_exits_with_code_0_after_one_full_round(load_orch, fake_cao, prompt_file, capsys):
    """Spec 1 Orchestration flow / PASS exits with code 0 (default review minimum of 2 cycles)."""
    m = load_orch(PROMPT_FILE=str(prompt_file), **FAST)
    assert run_main(m) == 0
    assert fake_cao.roles_prompted() == FULL_ROUND
    state = state_of(m)
    assert state["final_status"] == "PASS"
    assert state["current_phase"] == "done"
    assert state["current_round"] == 1
    assert archived(m) == [f"{n:03d}-{role}.md" for n, role in enumerate(FULL_ROUND, 1)]
    assert Path(m.run_dir, "009-tester.md").read_text() == PASS_REPLY
    out = capsys.readouterr().out
    assert "RESULT: PASS" in out
    assert "round 1/8 | analyst phase | cycle 2/3 | peer_analyst: verdict APPROVED: approved" in out
    assert "cycle 1/3 | peer_analyst: verdict APPROVED; approval not counted: approval counts from cycle 2" in out


def test_fail_then_pass_runs_short_retry_round(load_orch, fake_cao, prompt_file):
    """Spec 4 Shortened retry pipeline: round 2 prompts programmer -> peer_programmer -> tester only."""
    fake_cao.script["tester"] = [FAIL_REPLY, PASS_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), **FAST)
    assert run_main(m) == 0
    assert fake_cao.roles_prompted() == FULL_ROUND + RETRY_ROUND
    retry_prompt = fake_cao.prompts_for("programmer")[2]
    assert "round 2 of 8" in retry_prompt
    assert "Test failure feedback:\nRESULT: FAIL\nEVIDENCE:\n- greet World printed Hello World" in retry_prompt
    assert "Your previous changes (context):\n- Files changed: greet.py, tests/test_greet.py" in retry_prompt
    assert "System analyst handoff:" not in retry_prompt
    assert "ANALYST_SUMMARY" not in retry_prompt
    state = state_of(m)
    assert state["current_round"] == 2 and state["final_status"] == "PASS"
    assert state["outputs"]["analyst"].startswith("ANALYST_SUMMARY:")   # kept from round 1
    assert state["programmer_context_for_retry"].startswith("- Files changed:")


def test_multiple_consecutive_fails_stay_on_short_pipeline(load_orch, fake_cao, prompt_file):
    """Spec 4: FAILs in rounds 1-3 make rounds 2-4 start at the programmer, never the analyst."""
    fake_cao.script["tester"] = [FAIL_REPLY, FAIL_REPLY, FAIL_REPLY, PASS_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 0
    retry = ["programmer", "peer_programmer", "tester"]
    assert fake_cao.roles_prompted() == QUICK_ROUND + retry * 3
    assert state_of(m)["current_round"] == 4


def test_max_rounds_exhausted_exits_with_code_1(load_orch, fake_cao, prompt_file, capsys):
    """Spec 1: all rounds without PASS -> final_status FAIL, state saved, exit 1."""
    fake_cao.script["tester"] = [FAIL_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), MAX_ROUNDS="2", **QUICK)
    assert run_main(m) == 1
    assert fake_cao.roles_prompted() == QUICK_ROUND + ["programmer", "peer_programmer", "tester"]
    state = state_of(m)
    assert state["final_status"] == "FAIL"
    assert state["current_phase"] == "done"
    assert "FAIL: no PASS within MAX_ROUNDS=2" in capsys.readouterr().out


def test_reviewer_revise_then_approved_feeds_notes_to_next_analyst_prompt(load_orch, fake_cao, prompt_file):
    """Spec 1 review gate in the loop: REVISE notes reach the analyst's next cycle, APPROVED moves on."""
    fake_cao.script["peer_analyst"] = [
        review("REVISE", "- P1 traceability: empty NAME is not traced to the scenario\n- Artifacts: no design.md"),
        APPROVED_ANALYSIS,
    ]
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 0
    assert fake_cao.roles_prompted() == ["analyst", "peer_analyst"] + QUICK_ROUND
    second = fake_cao.prompts_for("analyst")[1]
    assert ("Latest peer analyst feedback:\nREVIEW_NOTES:\n- P1 traceability: empty NAME is not traced "
            "to the scenario\n- Artifacts: no design.md") in second
    assert "analyst cycle 2 of 3" in second
    assert "Latest peer analyst feedback:\n(none)" in fake_cao.prompts_for("analyst")[0]


def test_review_cycles_exhausted_proceed_with_last_notes_carried_forward(load_orch, fake_cao, prompt_file, capsys):
    """After MAX_REVIEW_CYCLES without approval the loop goes on and the notes travel with it."""
    fake_cao.script["peer_analyst"] = [review("REVISE", "- Contract: exit codes unspecified")]
    m = load_orch(PROMPT_FILE=str(prompt_file), MAX_REVIEW_CYCLES="2", **QUICK)
    assert run_main(m) == 0
    assert fake_cao.roles_prompted()[:4] == ["analyst", "peer_analyst", "analyst", "peer_analyst"]
    programmer_prompt = fake_cao.prompts_for("programmer")[0]
    assert "Open peer analyst notes" in programmer_prompt
    assert "- Contract: exit codes unspecified" in programmer_prompt
    assert "no approval after 2 cycles" in capsys.readouterr().out


def test_approval_without_evidence_is_not_accepted_in_the_loop(load_orch, fake_cao, prompt_file):
    """Spec 1 evidence gate: a bare APPROVED never ends the phase early."""
    fake_cao.script["peer_programmer"] = [review("APPROVED", "- looks good")]
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 0
    assert fake_cao.roles_prompted().count("programmer") == 3      # all MAX_REVIEW_CYCLES used


def test_start_agent_programmer_skips_analysis_and_retries_short(load_orch, fake_cao, prompt_file):
    """Spec 4: START_AGENT=programmer uses the placeholder, and a FAIL still retries short."""
    fake_cao.script["tester"] = [FAIL_REPLY, PASS_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="programmer", **QUICK)
    assert run_main(m) == 0
    retry = ["programmer", "peer_programmer", "tester"]
    assert fake_cao.roles_prompted() == retry + retry
    first, second = fake_cao.prompts_for("programmer")
    assert f"System analyst handoff:\n{m._UPSTREAM_PLACEHOLDER}" in first
    assert "Test failure feedback:" in second and "System analyst handoff:" not in second
    state = state_of(m)
    assert state["outputs"]["analyst"] == m._UPSTREAM_PLACEHOLDER
    assert state["current_phase"] == "done"


@pytest.mark.parametrize("start, expected", [
    ("peer_analyst", ["peer_analyst", "programmer", "peer_programmer", "tester"]),
    ("peer_programmer", ["peer_programmer", "tester"]),
    ("tester", ["tester"]),
])
def test_start_agent_later_roles(load_orch, fake_cao, prompt_file, start, expected):
    """START_AGENT starts the run at that role's turn, with placeholders for the skipped outputs."""
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT=start, **QUICK)
    assert run_main(m) == 0
    assert fake_cao.roles_prompted() == expected
    first_prompt = fake_cao.prompts[0][1]
    assert m._UPSTREAM_PLACEHOLDER in first_prompt


def test_missing_analyst_output_falls_back_to_analyst_phase(load_orch, fake_cao, prompt_file):
    """Spec 1/4: a programmer phase with an empty analyst output falls back to the analyst (with context)."""
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    write_state(m, fake_cao, current_round=2, current_phase="programmer",
                outputs={"analyst": ""}, programmer_context_for_retry="- Files changed: greet.py",
                feedback="RESULT: FAIL\nEVIDENCE:\n- wrong greeting")
    assert run_main(m) == 0
    assert fake_cao.roles_prompted() == QUICK_ROUND
    analyst_prompt = fake_cao.prompts_for("analyst")[0]
    assert "Latest tester feedback:\nRESULT: FAIL\nEVIDENCE:\n- wrong greeting" in analyst_prompt
    assert "Previous round programmer changes (context only):\n- Files changed: greet.py" in analyst_prompt
    # Round 2 is a retry round: the programmer works from the failure, not the new analysis.
    assert "Test failure feedback:" in fake_cao.prompts_for("programmer")[0]


def test_tester_with_empty_programmer_output_falls_back_to_programmer(load_orch, fake_cao, prompt_file):
    """The tester phase never tests nothing: it falls back to the programmer phase."""
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    write_state(m, fake_cao, current_phase="tester", outputs={"analyst": "ANALYST_SUMMARY:\n- x", "programmer": ""})
    assert run_main(m) == 0
    assert fake_cao.roles_prompted() == ["programmer", "peer_programmer", "tester"]


# -- handoff ------------------------------------------------------------------

def test_stale_response_file_is_moved_away_before_sending(load_orch, fake_cao, prompt_file):
    """A response file left from an earlier turn is never taken as the new answer."""
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", **QUICK)
    stale = Path(m.WD, ".tmp", "agent-responses", "test_result.md")
    stale.parent.mkdir(parents=True)
    stale.write_text("RESULT: FAIL\nEVIDENCE:\n- stale from yesterday\n")
    assert run_main(m) == 0
    assert archived(m) == ["001-stale-test_result.md", "002-tester.md"]
    assert "stale from yesterday" in Path(m.run_dir, "001-stale-test_result.md").read_text()
    assert not stale.exists()


def test_agent_error_status_stops_run_naming_role_and_terminal(load_orch, fake_cao, prompt_file, capsys):
    """Terminal status `error` stops the run: exit 3, message names role and terminal, state resumable."""
    fake_cao.script["programmer"] = [{"action": "error"}]
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 3
    err = capsys.readouterr().err.strip().splitlines()
    terminal = fake_cao.terminal_for("programmer").id
    assert len(err) == 1
    assert "programmer agent" in err[0] and terminal in err[0] and "'error'" in err[0]
    state = state_of(m)
    assert state["final_status"] == "RUNNING"
    assert state["current_phase"] == "programmer"


def test_strict_file_handoff_fails_when_agent_idles_without_file(load_orch, fake_cao, prompt_file, capsys):
    """STRICT_FILE_HANDOFF=1: idle without the response file is an error naming the file."""
    fake_cao.script["analyst"] = [{"action": "no_file", "text": "I am done (in the terminal only)"}]
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 3
    err = capsys.readouterr().err
    assert "analyst agent" in err and "analyst_summary.md" in err and "STRICT_FILE_HANDOFF=0" in err
    assert state_of(m)["final_status"] == "RUNNING"


def test_non_strict_handoff_falls_back_to_last_output(load_orch, fake_cao, prompt_file):
    """STRICT_FILE_HANDOFF=0: the terminal's last output is taken instead of the file."""
    fake_cao.script["tester"] = [{"action": "no_file", "text": PASS_REPLY}]
    m = load_orch(PROMPT_FILE=str(prompt_file), STRICT_FILE_HANDOFF="0", **QUICK)
    assert run_main(m) == 0
    assert any(r.url.path.endswith("/output") for r in fake_cao.requests)
    assert Path(m.run_dir, "005-tester.md").read_text() == PASS_REPLY


def test_response_timeout_stops_run(load_orch, fake_cao, prompt_file, capsys):
    """RESPONSE_TIMEOUT bounds the wait for an agent that keeps working."""
    fake_cao.script["analyst"] = [{"polls": 10**9, "text": "never"}]
    m = load_orch(PROMPT_FILE=str(prompt_file), **{**QUICK, "RESPONSE_TIMEOUT": "0.3"})
    assert run_main(m) == 3
    err = capsys.readouterr().err
    assert "RESPONSE_TIMEOUT=0.3s" in err and "analyst agent" in err


def test_idle_before_working_does_not_count_until_grace_passes(load_orch, fake_cao, prompt_file):
    """A terminal still idle right after the prompt is not taken as 'done without a file'."""
    fake_cao.script["tester"] = [{"idle_polls": 5, "text": PASS_REPLY}]
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", **{**QUICK, "IDLE_GRACE_SECONDS": "30"})
    assert run_main(m) == 0
    assert Path(m.run_dir, "001-tester.md").read_text() == PASS_REPLY


def test_agent_never_seen_working_counts_as_idle_after_grace(load_orch, fake_cao, prompt_file, capsys):
    """After IDLE_GRACE_SECONDS an agent that never started is idle without a file (strict: error). Its
    CLI is one whose idle status CAO reads right (Codex would mark a turn it started on its screen)."""
    fake_cao.script["tester"] = [{"idle_polls": 10**9, "text": PASS_REPLY}]
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", PROVIDER="claude_code",
                  **{**QUICK, "IDLE_GRACE_SECONDS": "0.2"})
    assert run_main(m) == 3
    assert "went idle without writing" in capsys.readouterr().err


# -- init ----------------------------------------------------------------------

def test_new_run_creates_session_and_five_terminals(load_orch, fake_cao, prompt_file):
    """Spec 1 Init: one session with the analyst profile, four more terminals, per-role profiles."""
    m = load_orch(PROMPT_FILE=str(prompt_file), PROVIDER="claude_code", TESTER_PROVIDER="kiro_cli",
                  START_AGENT="tester", **QUICK)
    assert run_main(m) == 0
    created = {t.role: (t.profile, t.provider, t.session) for t in fake_cao.terminals.values()}
    first = next(iter(fake_cao.terminals.values()))
    assert first.role == "analyst"                     # the session is created with the analyst
    session = first.session
    assert created == {"analyst": ("system_analyst", "claude_code", session),
                       "peer_analyst": ("peer_system_analyst", "claude_code", session),
                       "programmer": ("programmer", "claude_code", session),
                       "peer_programmer": ("peer_programmer", "claude_code", session),
                       "tester": ("tester", "kiro_cli", session)}
    assert all(t.working_directory == m.WD for t in fake_cao.terminals.values())
    state = state_of(m)
    assert state["session_name"] == session
    assert state["terminals"] == {t.role: t.id for t in fake_cao.terminals.values()}


def test_failed_terminal_creation_exits_created_terminals_and_writes_no_state(load_orch, fake_cao, prompt_file,
                                                                             capsys):
    """A run that fails before its terminals exist writes no state; terminals already made are exited."""
    fake_cao.fail_create["programmer"] = (400, "Unknown provider type: nope")
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 2                    # the same server would refuse it again: a setting to change
    made = [t for t in fake_cao.terminals.values()]
    assert sorted(t.role for t in made) == ["analyst", "peer_analyst", "peer_programmer", "tester"]
    assert sorted(fake_cao.exited_ids()) == sorted(t.id for t in made)
    assert not Path(m.STATE_FILE).exists()
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "does not know provider nope (it knows: claude_code, codex, kiro_cli): set PROVIDER" in err


def test_failed_session_creation_writes_no_state(load_orch, fake_cao, prompt_file, capsys):
    fake_cao.fail_create["system_analyst"] = (400, "Working directory not allowed: /tmp")
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 2
    assert fake_cao.terminals == {}
    assert not Path(m.STATE_FILE).exists()
    assert "Working directory not allowed" in capsys.readouterr().err


def test_agent_cli_start_up_timeout_says_what_to_check(load_orch, fake_cao, prompt_file, capsys, monkeypatch):
    """CAO's 'initialization timed out' hides the cause: the error line says where to look, and for
    Claude Code under a root cao-server whose agents lack IS_SANDBOX=1 (as --check finds it), which variable
    it needs (tests/test_start_failure.py: never where the trap is not found sprung)."""
    fake_cao.fail_create["system_analyst"] = (
        500, "Failed to create session: Claude Code initialization timed out after 60s")
    m = load_orch(PROMPT_FILE=str(prompt_file), PROVIDER="claude_code", **QUICK)
    monkeypatch.setattr(m, "sprung_traps", lambda provider: [m.CheckLine(False, "no IS_SANDBOX=1")])
    assert run_main(m) == 3
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert "cao-orchestrator-loop --check` finds what is missing" in err
    assert "~/.aws/cli-agent-orchestrator/logs/" in err and "IS_SANDBOX=1" in err


def test_a_cli_the_server_reports_missing_stops_the_start_before_anything_is_created(
        load_orch, fake_cao, prompt_file, capsys):
    """CAO lists each provider's CLI and whether it is installed: a missing one stops the start at once
    (exit 2), naming the provider, the setting that chose it and the providers that are installed,
    instead of after the minutes CAO waits for it to start."""
    fake_cao.missing_clis = {"codex"}
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", **QUICK)
    assert run_main(m) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert "`codex`, the CLI of provider codex (PROVIDER=codex), is not installed" in err
    assert "(it reports installed: claude_code, kiro_cli)" in err and "IGNORE_MISSING_CLI=1" in err
    assert fake_cao.create_answers == [] and not fake_cao.terminals
    assert not Path(m.STATE_FILE).exists()
    assert not Path(m.WD, ".tmp").exists()              # exit 2: nothing written, not even the lock


def test_a_finished_run_leaves_no_lock_file_behind(load_orch, fake_cao, prompt_file):
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", **QUICK)
    assert run_main(m) == 0
    assert Path(m.STATE_FILE).exists() and not Path(m.STATE_FILE + ".lock").exists()


def test_a_lock_file_removed_as_it_was_opened_is_locked_again_where_it_now_is(orch, monkeypatch):
    """Between our open and our lock the holder gave the lock back and removed the file, and a third process
    made it anew: the lock is taken on the file at the path, never on the removed one."""
    import fcntl
    original_flock = fcntl.flock
    path = Path(orch.STATE_FILE + ".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    calls = []

    def flock(handle, operation):
        if not calls:                     # the first lock attempt: the file at the path is replaced first
            path.unlink()
            path.write_text("")
        calls.append(handle.fileno())
        return original_flock(handle, operation)

    monkeypatch.setattr(orch.fcntl, "flock", flock)
    orch.RunLock.take()
    try:
        assert len(calls) == 2
        assert orch.os.fstat(orch.RunLock.handle.fileno()).st_ino == path.stat().st_ino
    finally:
        monkeypatch.undo()
        orch.RunLock.give_back()
    assert not path.exists()


def test_a_role_provider_reported_missing_names_its_own_setting(load_orch, fake_cao, prompt_file, capsys):
    fake_cao.missing_clis = {"claude_code"}
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", TESTER_PROVIDER="claude_code", **QUICK)
    assert run_main(m) == 2
    assert "(TESTER_PROVIDER=claude_code)" in capsys.readouterr().err


def test_ignore_missing_cli_creates_the_agents_anyway_with_a_warning(load_orch, fake_cao, prompt_file, capsys):
    """For a server whose PATH differs from the agents' login PATH."""
    fake_cao.missing_clis = {"codex"}
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", IGNORE_MISSING_CLI="1", **QUICK)
    assert run_main(m) == 0
    out = capsys.readouterr().out
    warning = next(line for line in out.splitlines() if "warning:" in line)
    assert "`codex`, the CLI of provider codex (PROVIDER=codex), is not installed" in warning
    assert out.index("warning:") < out.index("creating the five agent terminals")


def test_no_warning_when_the_cli_is_installed_or_the_server_cannot_tell(load_orch, fake_cao, prompt_file,
                                                                         capsys):
    fake_cao.missing_clis = {"claude_code"}           # not the provider this run uses
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", **QUICK)
    assert run_main(m) == 0
    assert "warning:" not in capsys.readouterr().out
    assert fake_cao.provider_lookups == 1


def test_provider_lookup_that_fails_is_ignored(load_orch, fake_cao, prompt_file, capsys):
    """A server without the route (or answering it with an error) does not stop the start."""
    fake_cao.providers_status = 404
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", **QUICK)
    assert m.api.provider_report() is None
    assert run_main(m) == 0
    assert "warning:" not in capsys.readouterr().out
    assert fake_cao.provider_lookups == 2


def test_terminal_creation_runs_concurrently(load_orch, fake_cao, prompt_file):
    """All five terminals are created at the same time, the session's among them, not one after another."""
    fake_cao.creations_at_once = 5       # each agent start lasts until all five are under way (or 10 s)
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", **QUICK)
    assert run_main(m) == 0
    assert fake_cao.creating_peak == 5, fake_cao.gave_up
    assert len(fake_cao.terminals) == 5


def test_new_run_does_not_overwrite_state_when_it_fails_to_start(load_orch, fake_cao, prompt_file):
    """A finished state file stays byte-identical if the next run cannot create its terminals."""
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    Path(m.STATE_FILE).parent.mkdir(parents=True)
    Path(m.STATE_FILE).write_text('{"version": 1, "final_status": "PASS", "terminals": {}}')
    before = Path(m.STATE_FILE).read_bytes()
    fake_cao.fail_create["system_analyst"] = (500, "boom")
    assert run_main(m) == 3
    assert Path(m.STATE_FILE).read_bytes() == before


# -- signals and cleanup -------------------------------------------------------

def test_sigint_saves_state_and_exits_130(load_orch, fake_cao, prompt_file, capsys):
    """Spec 1 Signal handling / SIGINT saves state: exit 130, state saved mid-run."""
    fake_cao.script["programmer"] = [interrupt(KeyboardInterrupt())]
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 130
    state = state_of(m)
    assert state["final_status"] == "RUNNING"
    assert state["current_phase"] == "programmer"
    assert state["outputs"]["analyst"].startswith("ANALYST_SUMMARY:")
    assert "interrupted (SIGINT); state saved" in capsys.readouterr().err


def test_sigterm_saves_state_and_exits_143(load_orch, fake_cao, prompt_file):
    """SIGTERM saves state and exits 143, and the handler is removed afterwards."""
    fake_cao.script["tester"] = [sigterm_step()]
    before = signal.getsignal(signal.SIGTERM)
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 143
    assert state_of(m)["current_phase"] == "tester"
    assert signal.getsignal(signal.SIGTERM) == before


def test_cleanup_on_exit_exits_all_five_terminals(load_orch, fake_cao, prompt_file):
    """Spec 1 Cleanup exits terminals when enabled: exit_terminal for all 5 ids."""
    m = load_orch(PROMPT_FILE=str(prompt_file), CLEANUP_ON_EXIT="1", **QUICK)
    assert run_main(m) == 0
    assert sorted(fake_cao.exited_ids()) == sorted(state_of(m)["terminals"].values())
    assert len(fake_cao.exited_ids()) == 5


def test_cleanup_on_exit_also_after_interrupt(load_orch, fake_cao, prompt_file):
    m = load_orch(PROMPT_FILE=str(prompt_file), CLEANUP_ON_EXIT="1", **QUICK)
    fake_cao.script["analyst"] = [interrupt(KeyboardInterrupt())]
    assert run_main(m) == 130
    assert len(fake_cao.exited_ids()) == 5


def test_without_cleanup_terminals_stay(load_orch, fake_cao, prompt_file):
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 0
    assert fake_cao.exited_ids() == []


# -- resume --------------------------------------------------------------------

def write_state(module, fake, **fields) -> dict:
    """A RUNNING state file for terminals that exist on the fake server."""
    ids = fake.add_terminals()
    outputs = {key: "" for key in module.OUTPUT_KEYS}
    outputs.update(fields.pop("outputs", {}))
    state = {"version": 1, "updated_at": "2026-11-20T10:00:00Z", "api": module.API, "provider": "codex",
             "wd": module.WD, "prompt": Path(module.PROMPT_FILE).read_text(), "current_round": 1,
             "current_phase": "analyst", "final_status": "RUNNING", "session_name": "cao-saved",
             "terminals": ids, "feedback": "", "analyst_feedback": "", "programmer_feedback": "",
             "outputs": outputs}
    state.update(fields)
    path = Path(module.STATE_FILE)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(state))
    return state


@pytest.mark.parametrize("role, phase, remaining", [
    ("analyst", "analyst", QUICK_ROUND),
    ("peer_analyst", "analyst", ["peer_analyst", "programmer", "peer_programmer", "tester"]),
    ("programmer", "programmer", ["programmer", "peer_programmer", "tester"]),
    ("peer_programmer", "programmer", ["peer_programmer", "tester"]),
    ("tester", "tester", ["tester"]),
])
def test_interrupted_run_resumes_automatically_at_the_same_turn(load_orch, fake_cao, prompt_file, role, phase,
                                                                remaining):
    """Auto-resume of a RUNNING state continues at the interrupted turn, in each phase."""
    fake_cao.script[role] = [interrupt(KeyboardInterrupt()), *([fake_default(role)])]
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 130
    assert state_of(m)["current_phase"] == phase
    before = fake_cao.roles_prompted()
    creates = len(fake_cao.terminals)
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)     # the same command again, no RESUME
    assert run_main(m) == 0
    assert len(fake_cao.terminals) == creates                # no new terminals: resumed
    assert fake_cao.roles_prompted()[len(before):] == remaining
    assert state_of(m)["final_status"] == "PASS"


def fake_default(role: str) -> str:
    from fake_cao import DEFAULT_REPLIES
    return DEFAULT_REPLIES[role]


def test_resume_keeps_archive_numbering_in_the_same_run_directory(load_orch, fake_cao, prompt_file):
    fake_cao.script["programmer"] = [interrupt(KeyboardInterrupt()), PROGRAMMER_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 130
    first_dir = m.run_dir
    m = load_orch(PROMPT_FILE=str(prompt_file), RESUME="1", **QUICK)
    assert run_main(m) == 0
    assert m.run_dir == first_dir
    assert archived(m) == ["001-analyst.md", "002-peer_analyst.md", "003-programmer.md",
                           "004-peer_programmer.md", "005-tester.md"]


def test_auto_resume_when_state_file_has_running_status(load_orch, fake_cao, prompt_file):
    """Spec 1 Auto-resume / RUNNING: load state, verify terminals, resume (no new session)."""
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    saved = write_state(m, fake_cao, current_phase="tester",
                        outputs={"analyst": "ANALYST_SUMMARY:\n- a", "programmer": PROGRAMMER_REPLY})
    assert run_main(m) == 0
    assert len(fake_cao.terminals) == 5
    assert fake_cao.roles_prompted() == ["tester"]
    status_checks = [r.url.path for r in fake_cao.requests if r.method == "GET"]
    assert all(f"/terminals/{tid}" in status_checks for tid in saved["terminals"].values())


@pytest.mark.parametrize("status", ["PASS", "FAIL"])
def test_no_auto_resume_when_state_file_is_finished(load_orch, fake_cao, prompt_file, status):
    """Spec 1 Auto-resume: a PASS or FAIL state starts a new run instead."""
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    write_state(m, fake_cao, final_status=status, current_phase="done")
    assert run_main(m) == 0
    assert len(fake_cao.terminals) == 10                      # five saved + five new
    assert fake_cao.roles_prompted() == QUICK_ROUND
    assert state_of(m)["session_name"] != "cao-saved"


def test_no_auto_resume_when_no_state_file_exists(load_orch, fake_cao, prompt_file):
    """Spec 1 Auto-resume: no state file -> a new run."""
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert not Path(m.STATE_FILE).exists()
    assert run_main(m) == 0
    assert len(fake_cao.terminals) == 5


def test_resume_0_starts_new_run_and_keeps_old_running_state_aside(load_orch, fake_cao, prompt_file, capsys):
    """RESUME=0 starts fresh; the unfinished state is moved aside, not overwritten."""
    m = load_orch(PROMPT_FILE=str(prompt_file), RESUME="0", **QUICK)
    saved = write_state(m, fake_cao)
    assert run_main(m) == 0
    assert len(fake_cao.terminals) == 10
    backups = list(Path(m.STATE_FILE).parent.glob(Path(m.STATE_FILE).name + ".*.bak"))
    assert len(backups) == 1
    assert json.loads(backups[0].read_text()) == saved
    assert str(backups[0]) in capsys.readouterr().out


def test_resume_1_without_state_file_is_a_usage_error(load_orch, fake_cao, prompt_file, capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), RESUME="1", **QUICK)
    assert run_main(m) == 2
    assert "RESUME=1 but there is no state file" in capsys.readouterr().err
    assert fake_cao.requests == []
    assert not Path(m.STATE_FILE).exists()


def test_resume_1_of_finished_run_is_a_usage_error(load_orch, fake_cao, prompt_file, capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), RESUME="1", **QUICK)
    write_state(m, fake_cao, final_status="PASS")
    before = Path(m.STATE_FILE).read_bytes()
    assert run_main(m) == 2
    assert "already finished with PASS" in capsys.readouterr().err
    assert Path(m.STATE_FILE).read_bytes() == before


def test_unparsable_state_with_resume_1_is_an_error_and_untouched(load_orch, fake_cao, prompt_file, capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), RESUME="1", **QUICK)
    Path(m.STATE_FILE).parent.mkdir(parents=True)
    Path(m.STATE_FILE).write_text('{"version": 1, "current_round": ')
    assert run_main(m) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot be parsed" in err and m.STATE_FILE in err and "\n" not in err
    assert Path(m.STATE_FILE).read_text() == '{"version": 1, "current_round": '
    assert fake_cao.requests == []


def test_unparsable_state_without_resume_is_moved_aside_and_new_run_starts(load_orch, fake_cao, prompt_file, capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    Path(m.STATE_FILE).parent.mkdir(parents=True)
    Path(m.STATE_FILE).write_text("not json at all")
    assert run_main(m) == 0
    backups = list(Path(m.STATE_FILE).parent.glob("*.bak"))
    assert [b.read_text() for b in backups] == ["not json at all"]
    assert str(backups[0]) in capsys.readouterr().out
    assert state_of(m)["final_status"] == "PASS"


def test_resume_with_unreachable_terminal_fails_and_keeps_state(load_orch, fake_cao, prompt_file, capsys):
    """Spec 1 Init and resume / unreachable terminal: exit with an error, state untouched."""
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    saved = write_state(m, fake_cao)
    gone = saved["terminals"]["peer_programmer"]
    fake_cao.terminals[gone].exited = True
    before = Path(m.STATE_FILE).read_bytes()
    assert run_main(m) == 2                    # lost: a setting, not a retry, gets past it
    err = capsys.readouterr().err
    assert "cannot resume" in err and "peer_programmer" in err and gone in err and "not found" in err
    assert Path(m.STATE_FILE).read_bytes() == before
    assert fake_cao.prompts == []


def test_verify_resume_terminals_exits_when_a_terminal_is_unreachable(orch, fake_cao):
    """Spec 1: verify_resume_terminals() exits with an error message naming the terminal."""
    ids = fake_cao.add_terminals()
    fake_cao.terminals[ids["tester"]].exited = True
    orch.terminal_ids, orch.session_name = ids, "cao-saved"
    with pytest.raises(SystemExit) as stopped:
        orch.verify_resume_terminals()
    assert stopped.value.code == 2
    assert ids["tester"] in str(stopped.value) and "tester" in str(stopped.value)


def test_verify_resume_terminals_called_alone_asks_only_the_terminals_records(orch):
    """Spec 1, as the spec states it: with only GET /terminals/{id} answered (one terminal unknown to the
    server), verify_resume_terminals() stops with an error naming it, having asked nothing else."""
    import respx

    ids = {role: f"{n:08x}" for n, role in enumerate(orch.ROLES, 1)}
    orch.terminal_ids, orch.session_name = dict(ids), "cao-saved"
    with respx.mock(assert_all_called=False) as router:
        for role, terminal in ids.items():
            if role == "programmer":
                answer = httpx.Response(404, json={"detail": f"Terminal '{terminal}' not found"})
            else:
                answer = httpx.Response(200, json={"id": terminal, "status": "idle"})
            router.get(f"http://cao.test/terminals/{terminal}").mock(return_value=answer)
        with pytest.raises(SystemExit) as stopped:
            orch.verify_resume_terminals()
        asked = [call.request.url.path for call in router.calls]
    assert stopped.value.code == 2
    assert "programmer" in str(stopped.value) and ids["programmer"] in str(stopped.value)
    assert asked == [f"/terminals/{ids[role]}" for role in orch.ROLES[:orch.ROLES.index("programmer") + 1]]


def test_resume_in_retry_state_preserves_short_pipeline(load_orch, fake_cao, prompt_file):
    """Spec 4: state at round 2, programmer phase, analyst output kept -> resume at the programmer."""
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    write_state(m, fake_cao, current_round=2, current_phase="programmer",
                outputs={"analyst": "ANALYST_SUMMARY:\n- Change: add-greeting", "analyst_review": APPROVED_ANALYSIS},
                feedback="RESULT: FAIL\nEVIDENCE:\n- missing comma",
                programmer_context_for_retry="- Files changed: greet.py")
    assert run_main(m) == 0
    assert fake_cao.roles_prompted() == ["programmer", "peer_programmer", "tester"]
    prompt = fake_cao.prompts_for("programmer")[0]
    assert "Test failure feedback:\nRESULT: FAIL\nEVIDENCE:\n- missing comma" in prompt
    assert "Your previous changes (context):\n- Files changed: greet.py" in prompt


def test_resume_ignores_start_agent(load_orch, fake_cao, prompt_file):
    """START_AGENT applies to new runs only."""
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", **QUICK)
    write_state(m, fake_cao, current_phase="analyst")
    assert run_main(m) == 0
    assert fake_cao.roles_prompted() == QUICK_ROUND


def test_runtime_error_keeps_state_resumable(load_orch, fake_cao, prompt_file):
    """After an agent error the same command resumes where the run stopped."""
    fake_cao.script["peer_programmer"] = [{"action": "error"}]
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 3
    fake_cao.terminal_for("peer_programmer").status = "idle"
    fake_cao.script["peer_programmer"] = [fake_default("peer_programmer")]
    fake_cao.turns["peer_programmer"] = 0
    prompted = len(fake_cao.prompts)
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 0
    assert fake_cao.roles_prompted()[prompted:] == ["peer_programmer", "tester"]


def test_explore_summary_sent_once_per_terminal_across_resume(load_orch, fake_cao, prompt_file):
    """The task text goes to each terminal once, even across an interruption."""
    fake_cao.script["peer_analyst"] = [review("REVISE", "- Artifacts: missing"), interrupt(KeyboardInterrupt()),
                                       APPROVED_ANALYSIS]
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 130
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 0
    summary = "Build a greeting CLI"
    analyst_prompts = fake_cao.prompts_for("analyst")
    assert summary in analyst_prompts[0]
    assert all(summary not in p and m.EXPLORE_BACK_REFERENCE in p for p in analyst_prompts[1:])
    reviews = fake_cao.prompts_for("peer_analyst")
    assert [summary in p for p in reviews] == [True, False, False]
    assert ["Check, citing what you looked at:" in p for p in reviews] == [True, False, False]
    assert all("Checks and answer format: as in your first review" in p for p in reviews[1:])


def test_new_run_sends_complete_prompts_to_its_new_terminals(load_orch, fake_cao, prompt_file):
    """A new run after a finished one has new agents with no history: each gets the complete text first."""
    fake_cao.script["tester"] = [FAIL_REPLY, PASS_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 0
    first_run = len(fake_cao.prompts)
    fake_cao.script["tester"] = [PASS_REPLY]
    fake_cao.turns.clear()
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 0
    assert [role for role, _ in fake_cao.prompts[first_run:]] == QUICK_ROUND
    for role, prompt in fake_cao.prompts[first_run:]:
        assert "Build a greeting CLI" in prompt and "For example:\nmkdir -p " in prompt, role
        assert "in a five-agent development loop" in prompt, role
    repeated = fake_cao.prompts_for("tester")[1]
    assert "Build a greeting CLI" not in repeated and "Answer format: as in your first turn" in repeated


def test_run_whose_agents_were_exited_is_never_resumed(load_orch, fake_cao, prompt_file, capsys):
    """After CLEANUP_ON_EXIT the agents are gone: input would land in a shell, so no resume."""
    fake_cao.script["programmer"] = [interrupt(KeyboardInterrupt()), PROGRAMMER_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), CLEANUP_ON_EXIT="1", **QUICK)
    assert run_main(m) == 130
    assert state_of(m)["terminals_exited"] is True
    prompts_before = len(fake_cao.prompts)
    fake_cao.terminals.clear()        # what the saved ids point at no longer matters

    m = load_orch(PROMPT_FILE=str(prompt_file), RESUME="1", **QUICK)
    assert run_main(m) == 2
    assert "cannot be resumed" in capsys.readouterr().err
    assert len(fake_cao.prompts) == prompts_before

    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)          # automatic: a new run instead
    assert run_main(m) == 0
    assert fake_cao.roles_prompted()[prompts_before:] == QUICK_ROUND
    assert len(list(Path(m.STATE_FILE).parent.glob("*.bak"))) == 1
    assert "were exited" in capsys.readouterr().out


# -- no repeated work after a resume --------------------------------------------

def interrupt_while_agent_keeps_working(reply: str, polls: int = 2):
    """Ctrl-C reaches the loop while the agent goes on and answers a little later."""
    def call(fake, terminal):
        terminal.pending = {"text": reply}
        terminal.polls_left = polls
        terminal.status = "processing"
        raise KeyboardInterrupt
    return {"action": "call", "call": call}


def test_resume_takes_reply_written_while_the_loop_was_down(load_orch, fake_cao, prompt_file, capsys):
    """The agent finished while the loop was down: its reply is used, the prompt is not sent again."""
    fake_cao.script["programmer"] = [interrupt_while_agent_keeps_working(PROGRAMMER_REPLY)]
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 130
    assert state_of(m)["in_flight"]["role"] == "programmer"
    for _ in range(3):                                   # time passes; the agent writes its file
        fake_cao._status_for(fake_cao.terminal_for("programmer"))
    assert Path(m.WD, ".tmp", "agent-responses", "programmer_summary.md").exists()
    prompted = fake_cao.roles_prompted()

    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 0
    assert fake_cao.roles_prompted()[len(prompted):] == ["peer_programmer", "tester"]
    assert "taking the reply written while the loop was down" in capsys.readouterr().out
    assert archived(m) == ["001-analyst.md", "002-peer_analyst.md", "003-programmer.md",
                           "004-peer_programmer.md", "005-tester.md"]
    assert Path(m.run_dir, "003-programmer.md").read_text() == PROGRAMMER_REPLY
    assert state_of(m)["in_flight"] is None


def test_resume_waits_for_agent_still_working_on_the_prompt(load_orch, fake_cao, prompt_file, capsys):
    fake_cao.script["tester"] = [interrupt_while_agent_keeps_working(PASS_REPLY, polls=5)]
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", **QUICK)
    assert run_main(m) == 130
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 0
    assert fake_cao.roles_prompted() == ["tester"]
    assert "still working on the prompt sent before the interruption" in capsys.readouterr().out
    assert state_of(m)["final_status"] == "PASS"


def test_resume_waits_for_an_agent_whose_cli_cao_reports_ready_while_it_works(load_orch, fake_cao, prompt_file,
                                                                              capsys):
    """OpenCode is reported `completed` while it works: after a Ctrl-C, that word does not make the loop
    send the prompt again (a paid turn twice); it waits for the reply file."""
    fake_cao.script["tester"] = [interrupt_while_agent_keeps_working(PASS_REPLY, polls=5)]
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", PROVIDER="opencode_cli", **QUICK)
    assert run_main(m) == 130
    fake_cao.reported_status = "completed"
    m = load_orch(PROMPT_FILE=str(prompt_file), PROVIDER="opencode_cli", **QUICK)
    assert run_main(m) == 0
    assert fake_cao.roles_prompted() == ["tester"]
    assert "still working on the prompt sent before the interruption" in capsys.readouterr().out
    assert state_of(m)["final_status"] == "PASS"


def test_resume_ignores_a_reply_older_than_the_prompt_in_flight(load_orch, fake_cao, prompt_file):
    """A response file from an earlier turn is never taken for the interrupted prompt's answer."""
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    sent_at = 1_700_000_000.0
    write_state(m, fake_cao, current_phase="tester",
                outputs={"analyst": "ANALYST_SUMMARY:\n- a", "programmer": PROGRAMMER_REPLY},
                in_flight={"role": "tester", "round": 1, "phase": "tester", "cycle": 1, "sent_at": sent_at},
                run_dir=str(Path(m.WD, ".tmp", "run")))
    stale = Path(m.WD, ".tmp", "agent-responses", "test_result.md")
    stale.parent.mkdir(parents=True)
    stale.write_text(FAIL_REPLY)
    os.utime(stale, (sent_at - 3600, sent_at - 3600))
    assert run_main(m) == 0
    assert fake_cao.roles_prompted() == ["tester"]               # sent again
    assert archived(m) == ["001-stale-test_result.md", "002-tester.md"]
    assert state_of(m)["final_status"] == "PASS"


@pytest.mark.parametrize("first_prompt", [True, False])
def test_resent_in_flight_prompt_is_complete_if_it_was_the_terminals_first(load_orch, fake_cao, prompt_file,
                                                                            first_prompt):
    """The loop stopped before its prompt arrived: sent again on resume, it is complete if it was the first."""
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    state = write_state(m, fake_cao, current_phase="tester",
                        outputs={"analyst": "ANALYST_SUMMARY:\n- a", "programmer": PROGRAMMER_REPLY})
    tester = state["terminals"]["tester"]
    marks = [f"{block}:{tester}" for block in ("intro", "explore", "scenario", "answer-format", "response-file")]
    state.update(context_sent=marks, in_flight={"role": "tester", "round": 1, "phase": "tester", "cycle": 1,
                                                "sent_at": 1_700_000_000.0,
                                                "sent_in_full": marks if first_prompt else []})
    Path(m.STATE_FILE).write_text(json.dumps(state))
    assert run_main(m) == 0
    [prompt] = fake_cao.prompts_for("tester")
    assert ("Build a greeting CLI" in prompt) is first_prompt
    assert ("Answer format:\nRESULT: PASS  (or RESULT: FAIL)" in prompt) is first_prompt
    assert ("For example:\nmkdir -p " in prompt) is first_prompt
    assert (m.EXPLORE_BACK_REFERENCE in prompt) is not first_prompt


def test_prompt_in_flight_records_what_it_carried_in_full(load_orch, fake_cao, prompt_file):
    """The state names the text the prompt in flight carried in full, so a resume can send it again."""
    fake_cao.script["tester"] = [interrupt(KeyboardInterrupt())]
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", **QUICK)
    assert run_main(m) == 130
    tester = state_of(m)["terminals"]["tester"]
    assert sorted(state_of(m)["in_flight"]["sent_in_full"]) == sorted(
        f"{block}:{tester}" for block in ("answer-format", "explore", "intro", "response-file", "scenario"))


def test_in_flight_prompt_of_another_turn_is_not_carried_over(load_orch, fake_cao, prompt_file):
    """A reply only counts for the very turn whose prompt was in flight."""
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    write_state(m, fake_cao, current_phase="tester",
                outputs={"analyst": "ANALYST_SUMMARY:\n- a", "programmer": PROGRAMMER_REPLY},
                in_flight={"role": "tester", "round": 3, "phase": "tester", "cycle": 1, "sent_at": 0.0})
    reply = Path(m.WD, ".tmp", "agent-responses", "test_result.md")
    reply.parent.mkdir(parents=True)
    reply.write_text(FAIL_REPLY)
    assert run_main(m) == 0
    assert fake_cao.roles_prompted() == ["tester"]


def test_unexpected_failure_is_one_line_and_keeps_state(load_orch, fake_cao, prompt_file, capsys, monkeypatch):
    """A full disk while archiving a reply: exit 3, one line, no traceback, state resumable."""
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)

    def disk_full(role, text, response_file):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(m, "archive_reply", disk_full)
    assert run_main(m) == 3
    err = capsys.readouterr().err.strip()
    assert err == ("error: unexpected OSError: [Errno 28] No space left on device; state saved, rerun to resume")
    assert state_of(m)["final_status"] == "RUNNING"


def test_state_that_cannot_be_saved_is_reported_not_a_traceback(load_orch, fake_cao, prompt_file, capsys,
                                                                monkeypatch):
    m = load_orch(PROMPT_FILE=str(prompt_file), START_AGENT="tester", **QUICK)
    original = m.save_state
    calls = []

    def save_then_fail():
        calls.append(1)
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        original()
    monkeypatch.setattr(m, "save_state", save_then_fail)
    assert run_main(m) == 3
    err = capsys.readouterr().err
    assert "No space left on device" in err and "Traceback" not in err


# -- a run that ended in FAIL goes on with more rounds ---------------------------------------------------------

def test_a_fail_counts_the_rounds_played_and_says_how_to_go_on(load_orch, fake_cao, prompt_file, capsys):
    """The figures after a FAIL are the rounds played (not one more), and the last line names the command
    that goes on with more rounds."""
    fake_cao.script["tester"] = [FAIL_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), MAX_ROUNDS="2", **QUICK)
    assert run_main(m) == 1
    state = state_of(m)
    assert state["final_status"] == "FAIL" and state["current_round"] == 2
    out = capsys.readouterr().out
    assert "summary: FAIL after round 2/2;" in out
    assert "to go on with more rounds: RESUME=1 MAX_ROUNDS=3 cao-orchestrator-loop" in out
    summary = json.loads(Path(m.run_dir, "summary.json").read_text(encoding="utf-8"))
    assert (summary["rounds"], summary["max_rounds"]) == (2, 2)
    assert "RESUME=1 MAX_ROUNDS=3" in Path(m.run_dir, "report.html").read_text(encoding="utf-8")


def test_resume_with_more_rounds_goes_on_after_a_fail_in_the_same_run(load_orch, fake_cao, prompt_file, capsys):
    """RESUME=1 MAX_ROUNDS=2 after a FAIL at MAX_ROUNDS=1: round 2 of the same run (no analyst turn again, the
    tester's evidence in the programmer's prompt, the same agents), to PASS; one record covers both."""
    fake_cao.script["tester"] = [FAIL_REPLY, PASS_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), MAX_ROUNDS="1", **QUICK)
    assert run_main(m) == 1
    first_dir, terminals = m.run_dir, state_of(m)["terminals"]
    creates = len(fake_cao.terminals)
    capsys.readouterr()
    m = load_orch(PROMPT_FILE=str(prompt_file), MAX_ROUNDS="2", RESUME="1", **QUICK)
    assert run_main(m) == 0
    out = capsys.readouterr().out
    assert "the run ended in FAIL after round 1; going on with round 2 of MAX_ROUNDS=2" in out
    assert fake_cao.roles_prompted() == QUICK_ROUND + ["programmer", "peer_programmer", "tester"]
    assert "Test failure feedback:\nRESULT: FAIL" in fake_cao.prompts_for("programmer")[1]
    assert len(fake_cao.terminals) == creates and state_of(m)["terminals"] == terminals   # the same agents
    state = state_of(m)
    assert state["final_status"] == "PASS" and state["current_round"] == 2 and m.run_dir == first_dir
    summary = json.loads(Path(m.run_dir, "summary.json").read_text(encoding="utf-8"))
    assert [t["role"] for t in summary["turn_list"]] == QUICK_ROUND + ["programmer", "peer_programmer", "tester"]
    assert (summary["result"], summary["rounds"], summary["max_rounds"]) == ("PASS", 2, 2)


def test_resume_of_a_fail_without_more_rounds_is_refused_with_the_command(load_orch, fake_cao, prompt_file, capsys):
    fake_cao.script["tester"] = [FAIL_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), MAX_ROUNDS="1", **QUICK)
    assert run_main(m) == 1
    before = Path(m.STATE_FILE).read_bytes()
    capsys.readouterr()
    m = load_orch(PROMPT_FILE=str(prompt_file), MAX_ROUNDS="1", RESUME="1", **QUICK)
    assert run_main(m) == 2
    err = capsys.readouterr().err.strip()
    assert "finished with FAIL after round 1 and MAX_ROUNDS=1 allows no more" in err and "\n" not in err
    assert "RESUME=1 MAX_ROUNDS=2 cao-orchestrator-loop" in err
    assert Path(m.STATE_FILE).read_bytes() == before


def test_a_plain_rerun_after_a_fail_starts_a_new_run_and_says_how_to_go_on_instead(load_orch, fake_cao, prompt_file,
                                                                                   capsys):
    fake_cao.script["tester"] = [FAIL_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), MAX_ROUNDS="1", **QUICK)
    assert run_main(m) == 1
    first_dir = m.run_dir
    capsys.readouterr()
    fake_cao.script["tester"] = [PASS_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), MAX_ROUNDS="1", **QUICK)
    assert run_main(m) == 0
    out = capsys.readouterr().out
    assert "finished with FAIL in round 1" in out and "starting a new run" in out
    assert "(to go on with that run instead: RESUME=1 MAX_ROUNDS=2 cao-orchestrator-loop)" in out
    assert m.run_dir != first_dir
