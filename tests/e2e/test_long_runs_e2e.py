"""Long runs with the real Claude Code and Codex: a compacted conversation, a usage limit.

The scripted model reports usage that makes a CLI compact its conversation
(``closing_usage_tokens`` on a turn) and answers a request the way Codex's API answers
an account that has hit its usage limit. What is asserted is what a paying user
cares about: the prompt that sets off a compaction carries the task in full, so
no request after it reaches the model without the task (and only that agent's:
other agents keep their back-references), a usage limit
is waited out without a reminder or a repeated turn, a limit too far away
stops the run cleanly with a rerun that continues the turn, and a model Codex
switched to at a limit, unasked, is said and stops the run before that role's
next turn (kept away by the setting --check asks for).
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .agent_clis import compact_claude_early, compact_codex_early
from .test_orchestrator_e2e import FAIL_REPLY, PASS_REPLY, PROGRAMMER_REPLY, REPO_ROOT, SCRIPT, SHORT_ROUND, Run, \
    explain, numbered
from .test_real_clis import real_cli_run

pytestmark = pytest.mark.e2e

EXPLORE_TEXT = "Build a greeting CLI: `greet NAME` prints `Hello, NAME!`."
SCENARIO_TEXT = "Run `greet World` and expect `Hello, World!` on stdout."
BACK_REFERENCE = "(Same as initial turn -- refer to your conversation history.)"
# Usage the scripted model reports for the tester's second turn: above both CLIs' compaction thresholds
# as the fixtures below set them (Claude Code: autoCompactWindow 100000 -> about 67,000 tokens; Codex:
# model_auto_compact_token_limit 50000).
BIG_USAGE = 90_000
CODEX_COMPACT_LIMIT = 50_000


@contextlib.contextmanager
def files_restored(*paths: Path):
    """Put files back as they were: the servers are shared by the module's other tests."""
    saved = {path: path.read_text(encoding="utf-8") for path in paths}
    try:
        yield
    finally:
        for path, text in saved.items():
            path.write_text(text, encoding="utf-8")


@pytest.fixture
def claude_compacting_cao(claude_cao):
    """Claude Code that compacts early: autoCompactWindow 100000, read by each CLI the run starts."""
    with files_restored(claude_cao.home / ".claude" / "settings.json"):
        compact_claude_early(claude_cao.home)
        yield claude_cao


@pytest.fixture
def codex_compacting_cao(codex_cao):
    """Codex that compacts once a response reports CODEX_COMPACT_LIMIT tokens."""
    with files_restored(codex_cao.home / ".codex" / "config.toml"):
        compact_codex_early(codex_cao.home, CODEX_COMPACT_LIMIT)
        yield codex_cao


def kept_prompts(run, role: str) -> list[str]:
    """The prompts the loop sent to `role`, in order, as it kept them in the run's folder."""
    folder = Path(run.state()["run_dir"])
    return [p.read_text(encoding="utf-8") for p in sorted(folder.glob(f"[0-9][0-9][0-9]-{role}.prompt.md"))]


def carries_the_full_task(prompt: str) -> bool:
    return EXPLORE_TEXT in prompt and SCENARIO_TEXT in prompt and BACK_REFERENCE not in prompt


def compaction_run(cao) -> None:
    """Four rounds from the programmer on (the tester fails three times). The closing message of the tester's
    second turn reports a context past its CLI's compaction point, so the CLI compacts as the tester's third
    prompt is submitted, with a summary that drops the task. The loop foresees it from the CLI's own records:
    that prompt carries the explore summary and the scenario test in full, so no request after the
    compaction reaches the model without the task (the scripted model checks every one), the run passes,
    and every other agent keeps its back-references."""
    run = real_cli_run(cao, START_AGENT="programmer", AGENT_HOME=str(cao.home))     # where its CLI's records are
    tester = [FAIL_REPLY, {"text": FAIL_REPLY, "closing_usage_tokens": BIG_USAGE}, FAIL_REPLY, PASS_REPLY]
    cao.model.set_script({"tester": tester, "programmer": [PROGRAMMER_REPLY]})
    cao.model.require_task(EXPLORE_TEXT, SCENARIO_TEXT)
    result = run.run(timeout=1200)
    assert result.returncode == 0, explain(result)
    state = run.state()
    assert state["final_status"] == "PASS" and state["current_round"] == 4
    assert run.archived() == numbered(SHORT_ROUND * 4), explain(result)
    assert cao.model.turns() == {"programmer": 4, "peer_programmer": 4, "tester": 4}, cao.model.events()

    compactions = cao.model.compactions()
    assert compactions and {c["role"] for c in compactions} == {"tester"}, cao.model.events()
    assert cao.model.without_task() == [], cao.model.without_task()
    assert "tester: its context held" in result.stdout and "at which its CLI compacts it: the next prompt carries " \
        "the full task" in result.stdout, explain(result)
    events = [(e["role"], e["what"]) for e in state["agent_events"]]
    # The compaction itself is seen on the screen when CAO's 32 KB of it still hold its words.
    assert events[0] == ("tester", "compaction foreseen") and set(events[1:]) <= {("tester", "compacted")}, events

    prompts = kept_prompts(run, "tester")
    full = [carries_the_full_task(p) for p in prompts]
    assert full[:3] == [True, False, True], full         # the foreseen compaction's prompt: in full
    assert full[3] == (("tester", "compacted") in events), (full, events)
    for role in ("programmer", "peer_programmer"):       # no compaction there: no byte resent
        later = [carries_the_full_task(p) for p in kept_prompts(run, role)[1:]]
        assert later and not any(later), (role, later)
    print(f"compaction ({cao.env['PROVIDER']}): the tester's prompt before it {len(prompts[2].encode())} bytes in "
          f"full, a back-referencing one {len(prompts[1].encode())} bytes")


@pytest.mark.real_cli
def test_claude_code_compacts_its_conversation_and_gets_the_full_task_again(claude_compacting_cao):
    compaction_run(claude_compacting_cao)


@pytest.mark.real_cli
def test_codex_compacts_its_conversation_and_gets_the_full_task_again(codex_compacting_cao):
    compaction_run(codex_compacting_cao)


# The usage-limit runs start at the programmer and the limit meets the tester's prompt: by then the tester's
# Codex has been up for two turns, so the scripted limit never meets a CLI's start-up by chance.
LIMITED_RUN = {"programmer": 1, "peer_programmer": 1, "tester": 1}


def limited_run(cao, **settings: str):
    """A run from the programmer on whose tester's first prompt meets the account's usage limit."""
    run = real_cli_run(cao, START_AGENT="programmer", **settings)
    cao.model.set_script({"tester": [PASS_REPLY], "programmer": [PROGRAMMER_REPLY]})
    return run


@pytest.fixture
def codex_offering_models_cao(codex_cao):
    """Codex whose config.toml leaves on its offer of another model at a usage limit (no
    `hide_rate_limit_model_nudge = true` under [notice], as a user's Codex has it until told otherwise)."""
    config = codex_cao.home / ".codex" / "config.toml"
    with files_restored(config):
        text = config.read_text(encoding="utf-8")
        assert "hide_rate_limit_model_nudge = true\n" in text
        config.write_text(text.replace("hide_rate_limit_model_nudge = true\n", ""), encoding="utf-8")
        yield codex_cao


def model_offer_run(cao, tester: tuple[str, ...] = (FAIL_REPLY, PASS_REPLY), **settings: str) -> Run:
    """FAIL in round 1, PASS in round 2 (or as `tester` says), every agent asked for scripted-large; the
    tester's first prompt is answered at once with a usage limit (reset in 5 s) and Codex's rate-limit
    headers, within the half second between the two Enters CAO sends with it."""
    run = real_cli_run(cao, START_AGENT="programmer", AGENT_HOME=str(cao.home), MODEL="scripted-large",
                       MIN_REVIEW_CYCLES_BEFORE_APPROVAL="1", USAGE_LIMIT_MARGIN_SECONDS="3", **settings)
    cao.model.set_script({"tester": list(tester), "programmer": [PROGRAMMER_REPLY]})
    cao.model.usage_limit_next(1, resets_in=5, role="tester", limit_headers=True)
    return run


def turn_models(run) -> list[tuple[str, str]]:
    """(role, model) of each turn in the run's summary.json."""
    summary = json.loads((Path(run.state()["run_dir"]) / "summary.json").read_text(encoding="utf-8"))
    return [(turn["role"], turn["model"]) for turn in summary["turn_list"]]


@pytest.mark.real_cli
def test_codex_taking_its_offer_of_another_model_is_said_and_stops_the_run(codex_offering_models_cao):
    """Codex's offer opens between CAO's Enters and the second Enter takes it: the tester's turn goes on,
    after the wait, on a model nobody chose. The loop reads it from Codex's rollout, says it in one line,
    records it, and stops before the tester's next turn (exit 2, state saved); every turn's model is in
    summary.json and report.html. (Codex sends the model it switched to no tools, so the scripted model
    cannot write the tester's file on it: its terminal output is taken instead, STRICT_FILE_HANDOFF=0.)"""
    cao = codex_offering_models_cao
    run = model_offer_run(cao, STRICT_FILE_HANDOFF="0", MAX_FILE_REMINDERS="0", IDLE_GRACE_SECONDS="8")
    result = run.run(timeout=300)
    switched = [e["model"] for e in cao.model.events() if e["model"] != "scripted-large"]
    assert switched and all("luna" in model for model in switched), (cao.model.events(), explain(result))
    assert result.returncode == 2, explain(result)
    [said] = [line for line in result.stdout.splitlines() if "its model changed" in line]
    # The offer opens at the limit (turn 3) or, where CAO's Enters came first there, at the tester's next prompt
    # (Codex offers it again): the line names the turn it was taken in, and no tester turn goes out after it.
    found = re.search(r"tester: its model changed from scripted-large to \S*luna\S* in turn (\d+) \(round \d\), and "
                      r"not by the run's settings: the run stops before its next turn$", said)
    assert found, said
    assert "went on with another model than it was started with" in result.stderr, explain(result)
    state = run.state()
    assert state["final_status"] == "RUNNING", explain(result)
    assert [e["what"] for e in state["agent_events"]][-1] == "model changed", state["agent_events"]
    models = turn_models(run)
    changed = int(found.group(1)) - 1
    assert models[changed][0] == "tester" and "luna" in models[changed][1], models
    assert all(model == "scripted-large" for _, model in models[:changed]), models
    page = (Path(state["run_dir"]) / "report.html").read_text(encoding="utf-8")
    assert f"model {models[changed][1]}" in page and "model changed" in page
    assert len(kept_prompts(run, "tester")) == [role for role, _ in models].count("tester")   # none after it
    print("model offer taken (codex): " + said)


@pytest.mark.real_cli
def test_codex_with_its_offer_of_another_model_turned_off_keeps_the_model(codex_cao):
    """The same run with `hide_rate_limit_model_nudge = true` in the agents' config.toml (what --check asks
    for): no offer; Codex shows "You've hit your usage limit. Try again at ..."; the loop waits for the reset
    and a margin and tells it to continue (the prompt sent once, no reminder); every turn on the model asked
    for, after the wait too; PASS in round 1."""
    run = model_offer_run(codex_cao, tester=(PASS_REPLY,))
    result = run.run(timeout=300)
    assert result.returncode == 0, explain(result)
    assert re.search(r"tester: usage limit reached; waiting until (?:\w{3} \d\d )?\d\d:\d\d \(in \d+s\), then it continues",
                     result.stdout), explain(result)
    assert re.search(r"then it continues \(You.ve hit your usage limit\. Try again at \d{1,2}:\d\d [AP]M\.\)$",
                     result.stdout, re.MULTILINE), explain(result)
    assert "usage limit reset; telling terminal" in result.stdout
    assert "reminder" not in result.stdout and "sending the whole prompt again" not in result.stdout
    assert len(kept_prompts(run, "tester")) == 1 and codex_cao.model.turns() == LIMITED_RUN, codex_cao.model.events()
    print("usage limit (codex): " + next(line for line in result.stdout.splitlines() if "usage limit reached" in line))
    assert {e["model"] for e in codex_cao.model.events() if e["role"]} == {"scripted-large"}, codex_cao.model.events()
    assert turn_models(run) == [(role, "scripted-large") for role in ("programmer", "peer_programmer", "tester")]
    assert "its model changed" not in result.stdout
    assert [e["what"] for e in run.state()["agent_events"]] == ["usage limit"]


@pytest.mark.real_cli
def test_codex_usage_limit_beyond_the_longest_wait_stops_and_the_rerun_continues_the_turn(codex_cao):
    """A reset three hours away with USAGE_LIMIT_MAX_WAIT=1h: the run stops (exit 3) saying when to rerun;
    once the reset time has come, the rerun tells the agent to continue -- the prompt is not sent again."""
    run = limited_run(codex_cao, USAGE_LIMIT_MAX_WAIT="3600", USAGE_LIMIT_MARGIN_SECONDS="1")
    codex_cao.model.usage_limit_next(1, resets_in=3 * 3600, role="tester")
    stopped = run.run(timeout=600)
    assert stopped.returncode == 3, explain(stopped)
    last = stopped.stderr.strip().splitlines()[-1]
    assert "stopped at its account's usage limit (You" in last and "rerun the command after" in last, last
    state = run.state()
    assert state["final_status"] == "RUNNING" and state["in_flight"]["limit_line"], state["in_flight"]

    # The reset has come (the state says when it is due): the same command continues the turn.
    state["in_flight"]["limit_until"] = time.time() + 1
    run.state_file.write_text(json.dumps(state, indent=2), encoding="utf-8")
    result = run.run(timeout=600)
    assert result.returncode == 0, explain(result)
    assert "its agent stopped at its usage limit before the interruption" in result.stdout, explain(result)
    assert codex_cao.model.turns() == LIMITED_RUN, codex_cao.model.events()
    assert len(kept_prompts(run, "tester")) == 1
    assert run.state()["final_status"] == "PASS"
    print("usage limit stop (codex): " + last)


@pytest.mark.real_cli
def test_codex_reply_written_before_a_usage_limit_stop_is_taken_by_the_rerun(codex_cao):
    """Codex stops at a limit three hours away (exit 3); the tester's complete answer is then in its file (written
    before the limit showed, or by a person): the same command takes it -- no stop at the limit again, no message
    to the agent, no turn at the model."""
    run = limited_run(codex_cao, USAGE_LIMIT_MAX_WAIT="3600", USAGE_LIMIT_MARGIN_SECONDS="1")
    codex_cao.model.usage_limit_next(1, resets_in=3 * 3600, role="tester")
    stopped = run.run(timeout=600)
    assert stopped.returncode == 3, explain(stopped)
    turns = codex_cao.model.turns()
    (run.wd / ".tmp" / "agent-responses" / "test_result.md").write_text(PASS_REPLY, encoding="utf-8")

    result = run.run(timeout=600)
    assert result.returncode == 0, explain(result)
    assert "usage limit" not in result.stdout and "reminder" not in result.stdout, explain(result)
    assert codex_cao.model.turns() == turns, codex_cao.model.events()
    assert len(kept_prompts(run, "tester")) == 1
    assert run.state()["final_status"] == "PASS" and run.state()["in_flight"] is None


@pytest.mark.real_cli
def test_codex_usage_limit_wait_survives_a_kill_9_and_the_rerun_never_resends(codex_cao):
    """The loop is killed (-9) while it waits out Codex's usage limit: --status says the tester waits for its
    limit, and the same command run again waits on and tells the agent to continue -- the prompt is sent
    once in all, no reminder, one turn at the model."""
    run = limited_run(codex_cao, USAGE_LIMIT_MARGIN_SECONDS="30")
    codex_cao.model.usage_limit_next(1, resets_in=10, role="tester")
    process = run.start()
    try:
        deadline = time.monotonic() + 300
        while not (run.state_file.exists() and (run.state().get("in_flight") or {}).get("limit_line")):
            assert process.poll() is None and time.monotonic() < deadline, "the loop never waited for the limit"
            time.sleep(0.2)
        process.kill()
        process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    status = subprocess.run([sys.executable, str(SCRIPT), "--status"], cwd=REPO_ROOT, env=run.env,
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0 and "stopped at its usage limit (You" in status.stdout, explain(status)
    assert re.search(r"continues at (?:\w{3} \d\d )?\d\d:\d\d", status.stdout), status.stdout   # a date past midnight

    result = run.run(timeout=600)
    assert result.returncode == 0, explain(result)
    assert "its agent stopped at its usage limit before the interruption" in result.stdout, explain(result)
    assert "reminder" not in result.stdout and "sending the whole prompt again" not in result.stdout
    assert codex_cao.model.turns() == LIMITED_RUN, codex_cao.model.events()
    assert len(kept_prompts(run, "tester")) == 1
    assert run.state()["final_status"] == "PASS"


def test_fresh_context_round_gives_later_rounds_new_agents(cao):
    """FRESH_CONTEXT=round on a real cao-server: round 2's agents are new terminals in the run's session (the
    old ones removed) whose prompts carry the full task; round 1's back-references are unchanged."""
    run = Run(cao, START_AGENT="programmer", FRESH_CONTEXT="round")
    cao.set_script({"tester": [FAIL_REPLY, PASS_REPLY]})
    result = run.run(timeout=300)
    assert result.returncode == 0, explain(result)
    state = run.state()
    fresh = [e for e in state["agent_events"] if e["what"] == "new conversation"]
    assert [e["role"] for e in fresh] == SHORT_ROUND, explain(result)
    old = [re.search(r"was terminal (\w+)", e["detail"]).group(1) for e in fresh]
    assert [state["terminals"][e["role"]] for e in fresh] == [e["terminal"] for e in fresh]
    with cao.http() as http:                              # the old agents are gone from the server
        assert [http.get(f"/terminals/{terminal}").status_code for terminal in old] == [404] * len(old)
    for role in SHORT_ROUND:
        first, second = kept_prompts(run, role)
        assert carries_the_full_task(first) and carries_the_full_task(second), role


@pytest.fixture
def claude_without_auto_compact(claude_cao):
    """Claude Code with auto-compact off (DISABLE_AUTO_COMPACT=1 in its settings' env)."""
    settings = claude_cao.home / ".claude" / "settings.json"
    with files_restored(settings):
        data = json.loads(settings.read_text(encoding="utf-8"))
        data.setdefault("env", {})["DISABLE_AUTO_COMPACT"] = "1"
        settings.write_text(json.dumps(data, indent=2), encoding="utf-8")
        yield claude_cao


@pytest.mark.real_cli
def test_claude_code_with_its_context_nearly_full_gets_a_new_agent(claude_without_auto_compact):
    """Auto-compact off and the tester's first answer reporting 960,000 tokens (of Claude Code's 1M window for
    its default model): it shows "Context low (2% remaining)" in its status line -- drawn at once, or only
    when its next prompt arrives -- and the tester's next turn after the loop saw it goes to a new agent
    whose prompt carries the full task. Three rounds, so either way a turn follows."""
    cao = claude_without_auto_compact
    run = real_cli_run(cao, START_AGENT="programmer")
    cao.model.set_script({"tester": [{"text": FAIL_REPLY, "usage_tokens": 960_000}, FAIL_REPLY, PASS_REPLY],
                          "programmer": [PROGRAMMER_REPLY]})
    result = run.run(timeout=900)
    assert result.returncode == 0, explain(result)
    state = run.state()
    events = [(e["role"], e["what"]) for e in state["agent_events"]]
    assert events == [("tester", "context low"), ("tester", "new conversation")], explain(result)
    assert re.search(r"tester: its context is nearly full \(\d+% left\)", result.stdout), explain(result)
    assert cao.model.compactions() == []
    low, fresh = state["agent_events"]
    assert state["terminals"]["tester"] == fresh["terminal"] != low["terminal"]
    prompts = kept_prompts(run, "tester")
    full = [carries_the_full_task(p) for p in prompts]
    assert full[0] and full[1:] in ([True, False], [False, True]), full      # the new agent's first prompt
