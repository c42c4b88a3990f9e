"""Handoff that holds up when agents and the server misbehave.

Reminders, the startup guard, permission prompts, provider errors, prompts too
long for CAO's query string, server outages and CAO's bearer token -- each
driven through main() against the respx fake CAO.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from conftest import FAST, TASK_PROMPT, run_main
from fake_cao import PASS_REPLY

QUICK = {**FAST, "MIN_REVIEW_CYCLES_BEFORE_APPROVAL": "1"}
TESTER_ONLY = {**QUICK, "START_AGENT": "tester"}


def state_of(module) -> dict:
    return json.loads(Path(module.STATE_FILE).read_text(encoding="utf-8"))


# -- reminders -------------------------------------------------------------------

def test_reminder_then_success(load_orch, fake_cao, prompt_file, capsys):
    """Idle without the file for IDLE_GRACE_SECONDS -> one reminder naming the file -> the answer arrives."""
    fake_cao.script["tester"] = [{"action": "write_on_reminder", "text": PASS_REPLY}]
    m = load_orch(PROMPT_FILE=str(prompt_file), **TESTER_ONLY)
    assert run_main(m) == 0
    assert len(fake_cao.reminders) == 1
    role, message = fake_cao.reminders[0]
    assert role == "tester"
    assert str(Path(m.WD, ".tmp", "agent-responses", "test_result.md")) in message
    assert "reminder 1/1 sent" in capsys.readouterr().out
    assert Path(m.run_dir, "001-tester.md").read_text() == PASS_REPLY


def test_reminder_then_strict_failure(load_orch, fake_cao, prompt_file, capsys):
    """After the reminders, STRICT_FILE_HANDOFF=1 stops the run, naming the missing file."""
    fake_cao.script["tester"] = [{"action": "no_file", "text": "done, see above"}]
    m = load_orch(PROMPT_FILE=str(prompt_file), **TESTER_ONLY)
    assert run_main(m) == 3
    assert [role for role, _ in fake_cao.reminders] == ["tester"]
    err = capsys.readouterr().err
    assert "went idle without writing" in err and "test_result.md" in err
    assert state_of(m)["final_status"] == "RUNNING"


def test_reminder_then_fallback_to_terminal_output(load_orch, fake_cao, prompt_file, capsys):
    """After the reminders, STRICT_FILE_HANDOFF=0 takes the terminal's last output; its line names no turn's
    end, for none was seen."""
    fake_cao.script["tester"] = [{"action": "no_file", "text": PASS_REPLY}]
    m = load_orch(PROMPT_FILE=str(prompt_file), STRICT_FILE_HANDOFF="0", **TESTER_ONLY)
    assert run_main(m) == 0
    assert len(fake_cao.reminders) == 1
    assert Path(m.run_dir, "001-tester.md").read_text() == PASS_REPLY
    [line] = [line for line in capsys.readouterr().out.splitlines() if "reply received" in line]
    assert "no turn end seen: its terminal's output taken" in line and "turn end seen by" not in line


def test_more_reminders_when_configured(load_orch, fake_cao, prompt_file):
    fake_cao.script["tester"] = [{"action": "no_file", "text": "nothing"}]
    m = load_orch(PROMPT_FILE=str(prompt_file), MAX_FILE_REMINDERS="3", **TESTER_ONLY)
    assert run_main(m) == 3
    assert len(fake_cao.reminders) == 3


def test_no_reminder_when_max_file_reminders_is_0(load_orch, fake_cao, prompt_file):
    fake_cao.script["tester"] = [{"action": "no_file", "text": "nothing"}]
    m = load_orch(PROMPT_FILE=str(prompt_file), MAX_FILE_REMINDERS="0", **TESTER_ONLY)
    assert run_main(m) == 3
    assert fake_cao.reminders == []


def test_a_prompt_a_dialog_swallowed_is_sent_again_whole_not_reminded(load_orch, fake_cao, prompt_file, capsys):
    """A dialog took the prompt (Codex's trust question): the screen never shows it, though it changed.
    IDLE_GRACE_SECONDS later the same prompt goes out once more (logged), never a reminder first."""
    fake_cao.swallow["tester"] = 1
    m = load_orch(PROMPT_FILE=str(prompt_file), **{**TESTER_ONLY, "IDLE_GRACE_SECONDS": "0.3"})
    assert run_main(m) == 0
    [(role, swallowed)] = fake_cao.swallowed
    assert role == "tester" and fake_cao.prompts_for("tester") == [swallowed]
    assert fake_cao.reminders == []
    assert "does not show the prompt" in capsys.readouterr().out
    assert Path(m.run_dir, "001-tester.md").read_text() == PASS_REPLY


# -- settle before the first prompt ----------------------------------------------

def _status_reads_before_first_prompt(fake_cao, terminal_id: str) -> int:
    reads = 0
    for request in fake_cao.requests:
        if request.url.path == f"/terminals/{terminal_id}/input":
            return reads
        if request.method == "GET" and request.url.path == f"/terminals/{terminal_id}":
            reads += 1
    raise AssertionError(f"terminal {terminal_id} got no prompt")


def test_a_terminal_just_created_gets_its_first_prompt_without_status_reads(load_orch, fake_cao, prompt_file):
    """CAO answers a terminal creation only once the agent CLI is ready: nothing to ask before the prompt."""
    m = load_orch(PROMPT_FILE=str(prompt_file), **TESTER_ONLY)
    assert run_main(m) == 0
    assert _status_reads_before_first_prompt(fake_cao, fake_cao.terminal_for("tester").id) == 0


def save_run_at_its_tester_phase(m, ids: dict[str, str]) -> None:
    """The state file of a Codex run interrupted before its round-1 tester turn, on the terminals `ids`."""
    outputs = {key: "" for key in m.OUTPUT_KEYS}
    outputs.update(analyst="ANALYST_SUMMARY:\n- done", programmer="PROGRAMMER_SUMMARY:\n- Files changed: a.py")
    state = {"version": 1, "api": m.API, "provider": "codex", "wd": m.WD, "prompt": TASK_PROMPT,
             "current_round": 1, "current_phase": "tester", "final_status": "RUNNING",
             "session_name": "cao-saved", "terminals": ids, "feedback": "", "analyst_feedback": "",
             "programmer_feedback": "", "outputs": outputs}
    Path(m.STATE_FILE).parent.mkdir(parents=True, exist_ok=True)
    Path(m.STATE_FILE).write_text(json.dumps(state))


def test_a_resumed_runs_terminal_gets_its_first_prompt_after_ready_twice(load_orch, fake_cao, prompt_file):
    """A terminal this process did not create may still be starting: two ready readings in a row first."""
    ids = fake_cao.add_terminals()
    tester = fake_cao.terminals[ids["tester"]]
    tester.status, tester.polls_left = "processing", 3       # still starting: two busy readings, then ready
    m = load_orch(PROMPT_FILE=str(prompt_file), **TESTER_ONLY)
    save_run_at_its_tester_phase(m, ids)
    assert run_main(m) == 0
    # the resume check (busy), one more busy reading, then ready twice in a row
    assert _status_reads_before_first_prompt(fake_cao, ids["tester"]) == 2 + 2


CODEX_TURN_ENDED = "\x1b]7501;state=done:app=codex\x07\x1b]7501;state=idle:app=codex\x07"


def test_a_resumed_runs_codex_terminal_whose_screen_says_its_turn_ended_gets_its_prompt(load_orch, fake_cao,
                                                                                       prompt_file):
    """CAO reads Codex `processing` for good after a finished turn: Codex's own end mark on its screen
    says it is at rest, so a resumed run's next prompt goes out (it waited RESPONSE_TIMEOUT, then stopped)."""
    ids = fake_cao.add_terminals()
    fake_cao.reported_status = "processing"
    fake_cao.terminals[ids["tester"]].printed = "• Wrote the answer\n" + CODEX_TURN_ENDED

    def answer(fake, terminal):
        Path(terminal.response_path).write_text(PASS_REPLY, encoding="utf-8")
        terminal.printed = PASS_REPLY + CODEX_TURN_ENDED
        terminal.status = "completed"         # CAO goes on reading it `processing`
    fake_cao.script["tester"] = [{"action": "call", "call": answer}]
    m = load_orch(PROMPT_FILE=str(prompt_file), **{**TESTER_ONLY, "RESPONSE_TIMEOUT": "3"})
    save_run_at_its_tester_phase(m, ids)
    assert run_main(m) == 0
    assert fake_cao.roles_prompted() == ["tester"]


# -- permission prompts ----------------------------------------------------------

def test_blocked_agent_is_logged_once_when_auto_accept_is_off(load_orch, fake_cao, prompt_file, capsys):
    fake_cao.script["tester"] = [{"permission_polls": 20, "text": PASS_REPLY}]
    m = load_orch(PROMPT_FILE=str(prompt_file), **TESTER_ONLY)
    assert run_main(m) == 0
    out = capsys.readouterr().out
    assert out.count("waits for a permission answer") == 1
    assert fake_cao.terminal_for("tester").id in out
    assert fake_cao.reminders == []                 # nobody answered for the user


def test_permission_auto_accept_answers_y(load_orch, fake_cao, prompt_file, capsys):
    fake_cao.script["tester"] = [{"permission_polls": 10**6, "text": PASS_REPLY}]
    m = load_orch(PROMPT_FILE=str(prompt_file), AUTO_ACCEPT_PERMISSIONS="1", **TESTER_ONLY)
    assert run_main(m) == 0
    assert fake_cao.reminders == [("tester", "y")]
    assert "answered 'y' (1/20)" in capsys.readouterr().out


def test_permission_auto_accept_cooldown_and_cap(load_orch, fake_cao, prompt_file, capsys, monkeypatch):
    """At most one 'y' per interval per terminal, and at most MAX_PERMISSION_ANSWERS per turn."""
    fake_cao.script["tester"] = [{"permission_polls": 60, "ignore_answers": True, "text": PASS_REPLY}]
    m = load_orch(PROMPT_FILE=str(prompt_file), AUTO_ACCEPT_PERMISSIONS="1", **TESTER_ONLY)
    # an interval no turn here outlasts, however slow the machine: one answer in the turn
    monkeypatch.setattr(m, "PERMISSION_ANSWER_INTERVAL", 3600.0)
    assert run_main(m) == 0
    assert fake_cao.reminders == [("tester", "y")]

    m = load_orch(PROMPT_FILE=str(prompt_file), AUTO_ACCEPT_PERMISSIONS="1", **TESTER_ONLY)
    monkeypatch.setattr(m, "PERMISSION_ANSWER_INTERVAL", 0.0)
    monkeypatch.setattr(m, "MAX_PERMISSION_ANSWERS", 3)
    fake_cao.reminders.clear()
    fake_cao.turns.clear()
    assert run_main(m) == 0
    assert fake_cao.reminders == [("tester", "y")] * 3
    assert "3 permission prompts answered this turn" in capsys.readouterr().out


# -- agent and provider errors ---------------------------------------------------

PROVIDER_FAILURE = 'API Error: 500 {"type":"error","error":{"type": "api_error","message":"Internal server error"}}'
OVERLOADED = "\u25cf API Error: 529 Overloaded. This is a server-side issue, usually temporary\n\u273b Crunched for 2m 58s"


def test_provider_error_with_no_retries_left_stops_the_run_naming_the_error_line(load_orch, fake_cao, prompt_file,
                                                                                 capsys):
    """Claude Code's `API Error: 500` while idle without a file, PROVIDER_ERROR_RETRIES=0: the run stops
    at once (no reminder), quoting the error line itself."""
    fake_cao.script["tester"] = [{"action": "no_file", "text": PROVIDER_FAILURE}]
    m = load_orch(PROMPT_FILE=str(prompt_file), **TESTER_ONLY, PROVIDER_ERROR_RETRIES="0")
    assert run_main(m) == 3
    err = capsys.readouterr().err.strip()
    assert "tester agent" in err and "model provider error" in err and "API Error: 500" in err
    assert "\n" not in err
    assert fake_cao.reminders == []
    state = state_of(m)
    assert state["final_status"] == "RUNNING" and state["current_phase"] == "tester"


def test_an_overloaded_model_is_waited_out_and_the_agent_told_to_continue(load_orch, fake_cao, prompt_file, capsys):
    """The CLI gave up on an overloaded model and went idle: after a pause it is told to continue its
    task (its prompt is in its conversation), and the turn ends normally."""
    fake_cao.script["tester"] = [{"action": "write_on_reminder", "text": PASS_REPLY, "output": OVERLOADED}]
    m = load_orch(PROMPT_FILE=str(prompt_file), **{**TESTER_ONLY, "IDLE_GRACE_SECONDS": "0.3"},
                  PROVIDER_ERROR_PAUSE_SECONDS="0.2")
    assert run_main(m) == 0
    [(role, told)] = fake_cao.reminders
    assert role == "tester" and told.startswith("The model provider's error has passed. Continue the task above")
    assert str(m.response_path("tester")) in told
    out = capsys.readouterr().out
    assert "model provider error (\u25cf API Error: 529 Overloaded." in out and "retry 1/3" in out
    assert "telling it to continue in 0.2s" in out
    assert fake_cao.prompts_for("tester") and len(fake_cao.prompts_for("tester")) == 1


def test_provider_errors_past_the_retries_stop_the_run(load_orch, fake_cao, prompt_file, capsys):
    """Each pause is twice the one before; after the last retry the run stops as before."""
    fake_cao.script["tester"] = [{"action": "no_file", "text": OVERLOADED}]
    m = load_orch(PROMPT_FILE=str(prompt_file), **{**TESTER_ONLY, "IDLE_GRACE_SECONDS": "0.3"},
                  PROVIDER_ERROR_RETRIES="2", PROVIDER_ERROR_PAUSE_SECONDS="0.1")
    assert run_main(m) == 3
    out, err = capsys.readouterr()
    assert "continue in 0.1s" in out and "continue in 0.2s" in out
    assert len(fake_cao.reminders) == 2
    assert "model provider error (\u25cf API Error: 529 Overloaded." in err and "2 times" in err


def test_api_error_json_body_is_recognised(orch):
    claude = orch.AGENT_CLIS["claude_code"]
    assert orch.provider_error_line('{"type": "api_error", "message": "Overloaded"}', claude)
    assert orch.provider_error_line("API Error: 529 overloaded", claude)
    assert not orch.provider_error_line("The API error handling in api.py is now tested.", claude)
    assert orch.provider_error_line("API Error: 529 overloaded")        # a CLI not known: every CLI's words
    own_words = orch.AgentCli("a CLI with words of its own", error_lines=r"^BOOM \d+")
    assert orch.provider_error_line("BOOM 503", own_words) == "BOOM 503"
    assert not orch.provider_error_line("API Error: 529 overloaded", own_words)


REJECTED = "\u23bf  API Error: Request rejected (429) \u00b7 Rate limited. Please try again later."


def test_a_rate_limit_is_recognised_apart_from_other_provider_errors(orch):
    claude = orch.AGENT_CLIS["claude_code"]
    assert orch.provider_error_line(REJECTED, claude) and orch.rate_limited(REJECTED, claude)
    assert orch.rate_limited("API Error: 429 Too Many Requests", claude)
    assert not orch.rate_limited(OVERLOADED, claude) and not orch.rate_limited(PROVIDER_FAILURE, claude)


def test_a_rate_limit_is_waited_out_past_the_retries_with_growing_pauses(load_orch, fake_cao, prompt_file, capsys,
                                                                       monkeypatch):
    """Claude Code with an API key ends its own retries with `API Error: Request rejected (429)`: the loop
    pauses, twice as long each time, and tells it to continue -- more often than PROVIDER_ERROR_RETRIES,
    within USAGE_LIMIT_MAX_WAIT -- and the turn ends normally once a request gets through."""
    fake_cao.script["tester"] = [{"action": "no_file", "text": REJECTED}]
    m = load_orch(PROMPT_FILE=str(prompt_file), **{**TESTER_ONLY, "IDLE_GRACE_SECONDS": "0.3"},
                  PROVIDER_ERROR_RETRIES="1", PROVIDER_ERROR_PAUSE_SECONDS="0.02", USAGE_LIMIT_MAX_WAIT="60")
    told = []
    real_continue = m.continue_after_provider_error

    def continue_and_get_through_at_the_fifth(turn):
        told.append(turn.role)
        if len(told) == 5:                                   # the limit has passed: this request gets through
            m.response_path("tester").write_text(PASS_REPLY, encoding="utf-8")
        real_continue(turn)
    monkeypatch.setitem(m.NUDGES, m.Verdict.CONTINUE, continue_and_get_through_at_the_fifth)
    assert run_main(m) == 0
    out = capsys.readouterr().out
    pauses = [float(p) for p in re.findall(r"rate limited; pause \d+, [^:]+: telling it to continue in ([\d.]+)s", out)]
    assert pauses == [0.02, 0.04, 0.08, 0.16, 0.32]            # five pauses, though PROVIDER_ERROR_RETRIES=1
    assert state_of(m)["final_status"] == "PASS" and len(fake_cao.prompts_for("tester")) == 1


def test_a_rate_limit_past_the_longest_wait_stops_the_run_resumable(load_orch, fake_cao, prompt_file, capsys):
    fake_cao.script["tester"] = [{"action": "no_file", "text": REJECTED}]
    m = load_orch(PROMPT_FILE=str(prompt_file), **{**TESTER_ONLY, "IDLE_GRACE_SECONDS": "0.3"},
                  PROVIDER_ERROR_PAUSE_SECONDS="0.1", USAGE_LIMIT_MAX_WAIT="0.5")
    assert run_main(m) == 3
    out, err = capsys.readouterr()
    assert "continue in 0.1s" in out and "continue in 0.2s" in out and "continue in 0.2s" in out
    line = err.strip()
    assert "still rate-limited (\u23bf  API Error: Request rejected (429)" in line and "\n" not in line
    assert "rerun the command later to continue the turn, or raise USAGE_LIMIT_MAX_WAIT" in line
    state = state_of(m)
    assert state["final_status"] == "RUNNING" and state["in_flight"]["role"] == "tester"


# -- prompts too long for the query string ---------------------------------------

def test_100kb_prompt_is_delivered_through_a_file(load_orch, fake_cao, tmp_path):
    """A prompt over the safe size is written to .tmp/agent-prompts and the agent told to read it."""
    big_summary = "\n".join(f"- requirement {n}: the greeting must handle case {n} exactly" for n in range(2000))
    assert len(big_summary) > 100_000
    task = tmp_path / "big-task.md"
    task.write_text(TASK_PROMPT.replace("Build a greeting CLI", big_summary + "\nBuild a greeting CLI"))
    m = load_orch(PROMPT_FILE=str(task), **QUICK)
    assert run_main(m) == 0
    role, path, message = fake_cao.prompt_files[0]
    assert role == "analyst"
    assert path == str(Path(m.WD, ".tmp", "agent-prompts", "analyst-1.md"))
    content = Path(path).read_text()
    assert big_summary in content and "Write your complete answer to this file:" in content
    assert len(message) < 1000
    assert all(len(str(r.url)) < 64_000 for r in fake_cao.requests)
    assert fake_cao.roles_prompted() == ["analyst", "peer_analyst", "programmer", "peer_programmer", "tester"]


def test_small_prompt_is_sent_inline(load_orch, fake_cao, prompt_file):
    m = load_orch(PROMPT_FILE=str(prompt_file), **TESTER_ONLY)
    assert run_main(m) == 0
    assert fake_cao.prompt_files == []
    assert not Path(m.WD, ".tmp", "agent-prompts").exists()


# -- server outages --------------------------------------------------------------

def stop_server_for(requests: int):
    """A tester step that takes the server down for the next N requests, then answers PASS."""
    def call(fake, terminal):
        fake.outage = requests
        path = Path(terminal.response_path)
        path.write_text(PASS_REPLY)
        terminal.status = "completed"
    return {"action": "call", "call": call}


def test_server_down_for_a_while_then_back_the_run_continues(load_orch, fake_cao, prompt_file, capsys):
    fake_cao.script["programmer"] = [stop_server_for(6)]
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 0
    out = capsys.readouterr().out
    assert "unreachable" in out and "retrying for up to 120s" in out
    assert state_of(m)["final_status"] == "PASS"


def test_server_that_stays_down_stops_cleanly_then_resume_continues(load_orch, fake_cao, prompt_file, capsys):
    fake_cao.script["programmer"] = [stop_server_for(10**9)]
    m = load_orch(PROMPT_FILE=str(prompt_file), API_RETRY_SECONDS="0.3", **QUICK)
    assert run_main(m) == 3
    err = capsys.readouterr().err.strip()
    assert "not reachable" in err and "API_RETRY_SECONDS=0.3s" in err and "\n" not in err
    state = state_of(m)
    assert state["final_status"] == "RUNNING" and state["current_phase"] == "programmer"

    fake_cao.outage = 0                              # the server is back
    m = load_orch(PROMPT_FILE=str(prompt_file), RESUME="1", **QUICK)
    assert run_main(m) == 0
    assert state_of(m)["final_status"] == "PASS"


def test_server_down_at_start_fails_fast_without_state(load_orch, fake_cao, prompt_file, capsys):
    """Before the run exists nothing is retried: the user is told to start cao-server."""
    fake_cao.outage = 10**9
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 3
    assert "start it with `cao-server`" in capsys.readouterr().err
    assert not Path(m.STATE_FILE).exists()
    assert len(fake_cao.requests) == 1


def test_prompt_whose_delivery_broke_off_after_it_arrived_is_not_sent_again(load_orch, fake_cao, prompt_file,
                                                                             capsys):
    """The server took the prompt, then the answer broke off (a restart): the agent works on it and
    answers; the prompt is never sent twice."""
    fake_cao.broken_answers["input"] = 1
    m = load_orch(PROMPT_FILE=str(prompt_file), **TESTER_ONLY)
    assert run_main(m) == 0
    assert len([r for r in fake_cao.requests if r.url.path.endswith("/input")]) == 1
    assert fake_cao.turns == {"tester": 1}
    out = capsys.readouterr().out
    assert "broke off" in out and "sending the whole prompt again" not in out


def test_prompt_whose_delivery_failed_before_it_arrived_is_sent_again_once(load_orch, fake_cao, prompt_file,
                                                                           capsys):
    """A 5xx answer to the prompt: nothing shows that it arrived (agent idle, no new output), so after
    the idle grace it goes out once more, whole."""
    fake_cao.server_errors["input"] = 1
    m = load_orch(PROMPT_FILE=str(prompt_file), **TESTER_ONLY)
    assert run_main(m) == 0
    inputs = [r for r in fake_cao.requests if r.url.path.endswith("/input")]
    assert len(inputs) == 2 and inputs[0].url == inputs[1].url
    assert fake_cao.turns == {"tester": 1}
    out = capsys.readouterr().out
    assert "HTTP 503" in out and "sending the whole prompt again" in out


def test_prompt_that_never_reached_the_server_is_complete_when_sent_on_rerun(load_orch, fake_cao, prompt_file,
                                                                             monkeypatch):
    """A prompt refused before it left this machine counts as not sent: nothing it carried is recorded,
    and the rerun sends the tester its complete prompt."""
    m = load_orch(PROMPT_FILE=str(prompt_file), API_RETRY_SECONDS="0", **TESTER_ONLY)
    delivered = m.ApiClient.send_input

    def refused_once(self, terminal_id, message):
        monkeypatch.setattr(m.ApiClient, "send_input", delivered)
        raise m.ApiError("CAO server is not reachable", retryable=True, unsent=True)
    monkeypatch.setattr(m.ApiClient, "send_input", refused_once)
    assert run_main(m) == 3
    assert fake_cao.prompts == [] and state_of(m)["context_sent"] == []
    assert run_main(m) == 0
    [prompt] = fake_cao.prompts_for("tester")
    assert "Build a greeting CLI" in prompt and "For example:\nmkdir -p " in prompt


def test_prompt_whose_delivery_broke_off_counts_as_sent(load_orch, fake_cao, prompt_file):
    """The server took the prompt and its answer broke off: the agent may have it, so what it carried in
    full is recorded, and the terminal's next prompt refers back to it."""
    fake_cao.broken_answers["input"] = 1              # the analyst's first prompt
    m = load_orch(PROMPT_FILE=str(prompt_file), **FAST)
    assert run_main(m) == 0
    first, second = fake_cao.prompts_for("analyst")
    assert "Build a greeting CLI" in first
    assert "Build a greeting CLI" not in second and m.EXPLORE_BACK_REFERENCE in second


def test_status_reads_are_retried_on_5xx(load_orch, fake_cao, prompt_file):
    fake_cao.server_errors["status"] = 3
    m = load_orch(PROMPT_FILE=str(prompt_file), **TESTER_ONLY)
    assert run_main(m) == 0


def test_prompt_refused_before_connecting_is_retried_once_delivered(orch, fake_cao):
    """Connection refused means nothing was sent, so POST input is repeated and delivered once."""
    ids = fake_cao.add_terminals()
    orch.api.retry_seconds = 5
    fake_cao.outage = 2
    orch.api.send_input(ids["tester"], "Write your complete answer to this file: /nonexistent/x.md")
    assert [role for role, _ in fake_cao.prompts] == ["tester"]


# -- CAO authentication ----------------------------------------------------------

TOKEN = "tok-3f9a-very-secret"


def test_bearer_token_on_every_request_and_never_shown(load_orch, fake_cao, prompt_file, capsys):
    fake_cao.required_token = TOKEN
    fake_cao.script["tester"] = [{"action": "no_file", "text": "x"}, PASS_REPLY]   # errors print too
    m = load_orch(PROMPT_FILE=str(prompt_file), CAO_AUTH_LOCAL_TOKEN=TOKEN, **QUICK)
    assert run_main(m) == 3
    m = load_orch(PROMPT_FILE=str(prompt_file), CAO_AUTH_LOCAL_TOKEN=TOKEN, **QUICK)
    assert run_main(m) == 0
    assert fake_cao.requests
    assert all(r.headers.get("Authorization") == f"Bearer {TOKEN}" for r in fake_cao.requests)
    captured = capsys.readouterr()
    assert TOKEN not in captured.out and TOKEN not in captured.err
    everything_written = [p for p in Path(m.WD).rglob("*") if p.is_file()]
    assert everything_written
    assert all(TOKEN not in p.read_text(errors="replace") for p in everything_written)


def test_no_authorization_header_without_token(load_orch, fake_cao, prompt_file):
    m = load_orch(PROMPT_FILE=str(prompt_file), **TESTER_ONLY)
    assert run_main(m) == 0
    assert all("Authorization" not in r.headers for r in fake_cao.requests)


def test_401_says_which_variable_provides_the_token(load_orch, fake_cao, prompt_file, capsys):
    fake_cao.required_token = TOKEN
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 2             # bad settings: a retry would not help
    err = capsys.readouterr().err
    assert "requires a token" in err and "CAO_AUTH_LOCAL_TOKEN" in err
    assert not Path(m.STATE_FILE).exists()


def test_401_with_a_wrong_token_says_it_was_rejected(load_orch, fake_cao, prompt_file, capsys):
    fake_cao.required_token = TOKEN
    m = load_orch(PROMPT_FILE=str(prompt_file), CAO_AUTH_LOCAL_TOKEN="wrong-token", **QUICK)
    assert run_main(m) == 2             # bad settings: a retry would not help
    err = capsys.readouterr().err
    assert "rejected the token in CAO_AUTH_LOCAL_TOKEN" in err and "wrong-token" not in err
