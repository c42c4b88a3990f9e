"""Start-up: the five terminals of a new run are created at once in one CAO session.

The session (with the analyst's terminal) is requested under a name the loop
picks, and the other four terminals are added to that name without waiting
for the session's answer. These tests drive create_terminals() through main()
against the fake CAO, whose sessions exist, as in CAO 2.5.4, from a moment
into the session request and are gone again if the session's first agent
fails to start. Where a test needs things to happen at the same time, the
fake holds requests until they have (see fake_cao.py), instead of sleeps that
a loaded machine can outlast.
"""

from __future__ import annotations

import json
import re
import signal
import threading
from pathlib import Path

import httpx
import pytest
import respx

from conftest import FAST, run_main
from fake_cao import MainThreadSignals, pool_tasks_elsewhere

QUICK = {**FAST, "MIN_REVIEW_CYCLES_BEFORE_APPROVAL": "1", "START_AGENT": "tester"}
ADD_PROFILES = ("peer_system_analyst", "programmer", "peer_programmer", "tester")


def creation_requests(fake) -> list[tuple[str, dict]]:
    """("session" or "add", query parameters) of every creation request, in the order they arrived."""
    found = []
    for request in fake.requests:
        if request.method == "POST" and request.url.path.startswith("/sessions"):
            kind = "session" if request.url.path == "/sessions" else "add"
            found.append((kind, dict(request.url.params)))
    return found


def answers_for(fake, profile: str) -> list[int]:
    return [status for p, status in fake.create_answers if p == profile]


def refused_at(fake, profile: str) -> list[float]:
    """When each 404 to that profile's creation was answered (time.monotonic())."""
    return [at for (p, status), at in zip(fake.create_answers, fake.create_answered_at)
            if p == profile and status == 404]


def state_of(module) -> dict:
    return json.loads(Path(module.STATE_FILE).read_text(encoding="utf-8"))


# -- all at once, under a chosen name --------------------------------------------------

def test_the_session_request_goes_first_and_the_adds_do_not_wait_for_its_answer(load_orch, fake_cao,
                                                                                 prompt_file):
    fake_cao.creations_at_once = 5                 # each agent start lasts until all five are under way (or 10 s)
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 0
    requests = creation_requests(fake_cao)
    assert [kind for kind, _ in requests] == ["session"] + ["add"] * 4
    assert fake_cao.creating_peak == 5, fake_cao.gave_up  # the four adds started while the session's agent started
    assert sorted(params["agent_profile"] for _, params in requests[1:]) == sorted(ADD_PROFILES)


@pytest.mark.parametrize("lost", [1, 5])
def test_a_creation_whose_answer_is_lost_is_asked_again_and_yields_the_same_agent_not_a_second(load_orch, fake_cao,
                                                                                             prompt_file, lost):
    """The server made the agent, then its answer broke off (a restart, a network fault): the request goes again
    with the same idempotency key, and CAO answers the agent it made. Five agents, never six."""
    fake_cao.broken_answers["create"] = lost
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 0
    assert len(fake_cao.terminals) == 5 and fake_cao.idempotent_answers == lost
    keys = [params["idempotency_key"] for _, params in creation_requests(fake_cao)]
    session = state_of(m)["session_name"]
    assert len(keys) == 5 + lost and len(set(keys)) == 5
    assert set(keys) == {f"{session}:{role}:first" for role in m.ROLES}
    assert set(state_of(m)["terminals"].values()) == set(fake_cao.terminals)


def test_a_full_server_is_said_as_such_and_the_run_is_retried_later(load_orch, fake_cao, prompt_file, capsys):
    """CAO answers 429 when its node runs as many terminals as CAO_MAX_TERMINALS allows: one line says the server
    is full and what frees it; exit 3 (a scheduler retries later), nothing left behind."""
    fake_cao.fail_create["tester"] = (429, "node has 20 tracked terminal(s) and CAO_MAX_TERMINALS/"
                                           "server.max_terminals is 20")
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == m.EXIT_ERROR
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "HTTP 429" in err and "the CAO server is full" in err, err
    assert all(t.deleted or t.exited for t in fake_cao.terminals.values())


def test_a_new_agent_is_asked_for_under_a_key_the_state_gives_again(orch):
    """A replacement (or a new conversation) takes the place of the terminal the state names: asked again --
    its answer lost, or the loop stopped before it saved it -- it is the same key, so the same agent."""
    assert orch.agent_key("programmer", "cao-loop-1a2b3c4d") == "cao-loop-1a2b3c4d:programmer:first"
    assert orch.agent_key("programmer", "cao-loop-1a2b3c4d", replacing="0000000c") == \
        "cao-loop-1a2b3c4d:programmer:after-0000000c"
    assert orch.agent_key("tester", "cao-loop-1a2b3c4d") != orch.agent_key("programmer", "cao-loop-1a2b3c4d")


def test_the_session_is_requested_under_a_fresh_cao_loop_name_and_that_name_is_saved(load_orch, fake_cao,
                                                                                      prompt_file, capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 0
    (_, session_params), *adds = creation_requests(fake_cao)
    name = session_params["session_name"]
    assert re.fullmatch(r"cao-loop-[0-9a-f]{8}", name)
    assert {t.session for t in fake_cao.terminals.values()} == {name}
    assert state_of(m)["session_name"] == name
    assert f"all at once in CAO session {name}" in capsys.readouterr().out
    assert m.new_session_name() != m.new_session_name()


def test_the_name_cao_answers_is_the_one_saved_and_used_for_the_adds(orch, monkeypatch):
    """A server (or a proxy in front of it) that answers another name than the one asked for: the adds
    still sent to the asked name are refused, and go to the answered name instead; that name is kept."""
    monkeypatch.setattr(orch, "new_session_name", lambda: "cao-loop-asked")
    ids = iter(range(2, 6))
    added_to: list[str] = []

    def add(request: httpx.Request) -> httpx.Response:
        name = request.url.path.split("/")[2]
        if name != "cao-loop-asked-2":
            return httpx.Response(404, json={"detail": f"Session '{name}' not found"})
        added_to.append(name)
        return httpx.Response(201, json={"id": f"{next(ids):08x}", "session_name": name})

    with respx.mock(assert_all_mocked=True) as router:
        router.post("http://cao.test/sessions").mock(return_value=httpx.Response(
            201, json={"id": "00000001", "session_name": "cao-loop-asked-2", "status": "idle"}))
        router.post(url__regex=r"^http://cao\.test/sessions/[^/]+/terminals").mock(side_effect=add)
        router.get(url__regex=r"^http://cao\.test/(terminals/[^/]+/output|sessions/[^/]+$)").mock(   # screens read
            return_value=httpx.Response(200, json={"output": "", "terminals": []}))
        session_name, terminals = orch.create_terminals()
    assert session_name == "cao-loop-asked-2"
    assert added_to == ["cao-loop-asked-2"] * 4
    assert terminals["analyst"] == "00000001"
    assert sorted(terminals.values()) == [f"{i:08x}" for i in range(1, 6)]


def test_an_add_that_comes_before_the_session_exists_is_tried_again(load_orch, fake_cao, prompt_file, capsys):
    """CAO answers 404 "Session ... not found" until the session exists: the adds wait and try again."""
    # The session comes to exist only once every add has been refused twice (or after 10 s).
    fake_cao.session_exists_when = lambda: all(answers_for(fake_cao, p).count(404) >= 2 for p in ADD_PROFILES)
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 0
    assert fake_cao.gave_up == []
    for profile in ADD_PROFILES:
        statuses = answers_for(fake_cao, profile)
        assert statuses[0] == 404 and statuses[-1] == 201 and set(statuses) == {404, 201}
        refused = refused_at(fake_cao, profile)
        pauses = [later - earlier for earlier, later in zip(refused, refused[1:])]
        assert min(pauses) >= 0.04, pauses        # a pause before each new try, not a tight loop
    assert len(fake_cao.terminals) == 5
    assert "not found" not in capsys.readouterr().err


# -- failures: every terminal made is exited, the error names the role ----------------------

def test_a_session_refused_at_once_stops_the_adds(load_orch, fake_cao, prompt_file, capsys):
    fake_cao.fail_create["system_analyst"] = (400, "Working directory not allowed: /srv")
    fake_cao.refusals_wait_for_session = True      # an add that came too early hears 404 once the session failed
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 2                        # the same server would refuse the same WD: a setting to change
    assert fake_cao.gave_up == []
    assert fake_cao.terminals == {}
    assert all(status == 404 for profile in ADD_PROFILES for status in answers_for(fake_cao, profile))
    assert len(creation_requests(fake_cao)) <= 1 + 4 * 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert "analyst: CAO create session failed: HTTP 400: Working directory not allowed: /srv: set WD to" in err
    assert not Path(m.STATE_FILE).exists()


def test_a_session_whose_agent_fails_to_start_exits_the_terminals_added_meanwhile(load_orch, fake_cao,
                                                                                  prompt_file, capsys):
    """The adds joined the session while its first agent started; that agent failed, and failed again when
    tried alone: they are all exited."""
    fake_cao.fail_create["system_analyst"] = (
        500, "Failed to create session: Claude Code initialization timed out after 60s")
    fake_cao.fail_late.add("system_analyst")
    fake_cao.creations_at_once = 5                 # the session's agent fails once all four adds are under way
    m = load_orch(PROMPT_FILE=str(prompt_file), PROVIDER="claude_code", **QUICK)
    assert run_main(m) == 3
    assert fake_cao.gave_up == []
    assert sorted(t.role for t in fake_cao.terminals.values()) == \
        ["peer_analyst", "peer_programmer", "programmer", "tester"]
    assert sorted(fake_cao.exited_ids()) == sorted(fake_cao.terminals)
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert "analyst: CAO create session failed: HTTP 500" in err and "peer_analyst" not in err
    assert "(on its second try too, started alone)" in err
    assert "--check` finds what is missing" in err      # start_failure_hint still applies
    assert not Path(m.STATE_FILE).exists()


def fail_first_try(fake, profile: str, detail: str, late: bool = False) -> None:
    """The agent CLI of `profile` does not start in time on its first try, and starts on its second."""
    tries = []
    fake.fail_create[profile] = (500, detail)
    if late:
        fake.fail_late.add(profile)

    def on_create(created: str) -> None:
        if created == profile:
            tries.append(created)
            if len(tries) == 2:
                fake.fail_create.pop(profile)
                fake.creations_at_once = 0         # the second try goes alone
    fake.create_hook = on_create


OPENCODE_TIMEOUT = "Failed to create terminal: OpenCode CLI initialization timed out after 120 seconds"


def test_an_agent_that_did_not_start_in_time_among_five_is_started_again_alone(load_orch, fake_cao,
                                                                             prompt_file, capsys):
    """Five CLIs starting at once outlast CAO's limit for one of them: it is created again, alone, in the same
    session; the four that came up are kept and the run goes on."""
    fail_first_try(fake_cao, "peer_programmer", OPENCODE_TIMEOUT)
    m = load_orch(PROMPT_FILE=str(prompt_file), PROVIDER="opencode_cli", **QUICK)
    assert run_main(m) == 0
    out = capsys.readouterr().out
    assert ("peer_programmer: the agent CLI did not start within CAO's time limit while 5 started at once; "
            "starting peer_programmer again, one at a time") in out
    assert "all five agents are up after the second try" in out
    assert answers_for(fake_cao, "peer_programmer") == [500, 201]
    assert [kind for kind, _ in creation_requests(fake_cao)] == ["session"] + ["add"] * 5
    state = state_of(m)
    assert sorted(state["terminals"].values()) == sorted(fake_cao.terminals)
    assert {t.session for t in fake_cao.terminals.values()} == {state["session_name"]}


def test_a_session_whose_agent_did_not_start_in_time_is_made_again_one_agent_at_a_time(load_orch, fake_cao,
                                                                                     prompt_file, capsys):
    """The session's own agent timed out after the four others joined it: CAO removed the session, so the four
    are ended and all five are made again in a new session, one at a time."""
    fail_first_try(fake_cao, "system_analyst", OPENCODE_TIMEOUT.replace("terminal", "session"), late=True)
    fake_cao.creations_at_once = 5
    m = load_orch(PROMPT_FILE=str(prompt_file), PROVIDER="opencode_cli", **QUICK)
    assert run_main(m) == 0
    out = capsys.readouterr().out
    assert "starting analyst, peer_analyst, programmer, peer_programmer, tester again, one at a time" in out
    first_four = [t for t in fake_cao.terminals.values() if t.exited]
    assert sorted(t.role for t in first_four) == ["peer_analyst", "peer_programmer", "programmer", "tester"]
    state = state_of(m)
    live = {t.id for t in fake_cao.terminals.values() if not t.exited}
    assert sorted(state["terminals"].values()) == sorted(live) and len(live) == 5
    assert state["session_name"] != creation_requests(fake_cao)[0][1]["session_name"]


def test_a_failed_add_exits_the_session_and_the_other_terminals(load_orch, fake_cao, prompt_file, capsys):
    fake_cao.fail_create["peer_programmer"] = (500, "Failed to create terminal: tmux failed")
    fake_cao.create_delay = 0.1
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 3
    assert sorted(t.role for t in fake_cao.terminals.values()) == ["analyst", "peer_analyst", "programmer", "tester"]
    assert sorted(fake_cao.exited_ids()) == sorted(fake_cao.terminals)
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert "peer_programmer: CAO create terminal (peer_programmer) failed: HTTP 500" in err
    assert not Path(m.STATE_FILE).exists()


def test_a_name_that_is_taken_is_said_so_and_the_terminals_added_to_it_are_exited(load_orch, fake_cao,
                                                                                  prompt_file, capsys):
    """Another session already has the name picked at random: nothing of the run is left in it."""
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    m.new_session_name = lambda: "cao-loop-0badf00d"
    fake_cao.sessions.add("cao-loop-0badf00d")
    assert run_main(m) == 3
    assert sorted(fake_cao.exited_ids()) == sorted(fake_cao.terminals)
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert "analyst: CAO create session failed: HTTP 400: Session 'cao-loop-0badf00d' already exists" in err
    assert "run it again to pick another" in err


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupt_while_the_terminals_are_created_ends_all_of_them(load_orch, fake_cao, prompt_file,
                                                                       signum, code):
    """Ctrl-C or SIGTERM while the five creations are under way: the session is removed by its name at once
    (the agents that are up are exited first); a creation that ends after that made nothing that lives."""
    def interrupt_while_creating(profile: str) -> None:
        if profile == "tester":                    # its agent starts once this returns, the other four's have
            fake_cao.wait_until("the other four creations to be under way", lambda: fake_cao.creating_now == 4)
            signals.send(signum)
            fake_cao.wait_until(f"the main thread to handle signal {signum}", signals.handled.is_set)

    fake_cao.create_hook = interrupt_while_creating
    fake_cao.creations_at_once = 5
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    with MainThreadSignals() as signals:
        assert run_main(m) == code
    fake_cao.wait_until("the five creations to be answered", lambda: len(fake_cao.create_answers) == 5)
    assert fake_cao.gave_up == []
    session = creation_requests(fake_cao)[0][1]["session_name"]
    assert fake_cao.deleted_sessions == [session]
    assert all(t.exited or t.deleted for t in fake_cao.terminals.values())
    assert not Path(m.STATE_FILE).exists()


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_a_stop_while_an_agent_is_still_starting_ends_the_start_without_waiting_for_it(load_orch, fake_cao,
                                                                                      prompt_file, signum, code):
    """A stop while the tester's CLI is still starting (CAO answers only once it is up): the run does not wait
    for that answer; it exits the agents that are up, removes the session (which ends the one still
    starting) and exits with the stop's code, nothing written."""
    let_go = threading.Event()
    answered_before_the_exit: list[bool] = []

    def hold_the_tester(profile: str) -> None:
        if profile == "tester":
            fake_cao.wait_until("the other four to be up", lambda: len(fake_cao.terminals) == 4)
            signals.send(signum)
            let_go.wait(60)                        # CAO still starting this agent: no answer yet

    fake_cao.create_hook = hold_the_tester
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    with MainThreadSignals() as signals:
        assert run_main(m) == code
    answered_before_the_exit.append(any(profile == "tester" for profile, _ in fake_cao.create_answers))
    let_go.set()
    assert answered_before_the_exit == [False]     # the exit did not wait for the tester's answer
    session = next(t.session for t in fake_cao.terminals.values())
    assert fake_cao.deleted_sessions == [session]
    assert sorted(fake_cao.exited_ids()) == sorted(fake_cao.terminals)
    assert fake_cao.gave_up == []
    assert not Path(m.STATE_FILE).exists()


def test_an_interrupt_before_the_session_exists_stops_the_adds(load_orch, fake_cao, prompt_file):
    """Ctrl-C while the session is still being set up: the adds give up, the session's terminal is exited."""
    def interrupt_while_creating(profile: str) -> None:
        if profile == "system_analyst":            # its session exists once this returns
            signals.send(signal.SIGINT)
            fake_cao.wait_until("the main thread to handle SIGINT", signals.handled.is_set)
            fake_cao.wait_until("the adds to give up", lambda: pool_tasks_elsewhere() == 0)

    fake_cao.create_hook = interrupt_while_creating
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    with MainThreadSignals() as signals:
        assert run_main(m) == 130
    assert fake_cao.gave_up == []
    assert [t.role for t in fake_cao.terminals.values()] == ["analyst"]
    assert fake_cao.exited_ids() == list(fake_cao.terminals)
    assert all(status == 404 for profile in ADD_PROFILES for status in answers_for(fake_cao, profile))


def test_a_start_cut_short_leaves_its_own_requests_unretried_and_no_other(load_orch, fake_cao, prompt_file):
    """A start cut short (its session removed) is not asked again: its requests fail at once while the server
    is down. Requests of anything else -- later in the same process -- still ride out a server restart."""
    import threading
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    m.api.retry_seconds = 30.0
    cut_short = threading.Event()
    cut_short.set()
    fake_cao.outage = 2
    with pytest.raises(m.ApiError):
        m.in_background(cut_short, m.api.get_status, "t-none").result(timeout=10)
    assert fake_cao.outage == 1                                   # asked once, not again
    fake_cao.outage = 2
    with pytest.raises(m.ApiError) as elsewhere:
        m.in_background(threading.Event(), m.api.get_status, "t-none").result(timeout=30)
    assert fake_cao.outage == 0 and elsewhere.value.status_code == 404   # asked again until the server answered
