"""The CAO API client.

Spec 1 "API client with httpx" (scenarios "Create session returns terminal ID
and session name" and "Send input to terminal"), the HTTP API in
shared/cao-facts.md, and the error handling the loop promises: clear ApiErrors for a server
that is down, an HTTP error or an answer of the wrong shape, and main()
stopping with exit 3 (a runtime error, rerun to resume) and one line when the server cannot be reached.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import respx

from conftest import FAST, run_main

BASE = "http://cao.test"
TID = "1a2b3c4d"
SESSION = "cao-session-1"
STATE_NAME = "orchestrator-loop-state.json"


def terminal_answer(terminal_id: str = TID, session: str = SESSION) -> dict:
    return {"id": terminal_id, "session_name": session, "status": "idle"}


@pytest.fixture
def router():
    with respx.mock(base_url=BASE, assert_all_called=False, assert_all_mocked=True) as mock:
        yield mock


@pytest.fixture
def client(orch):
    """The module's own client: the loaded module points `api` at the fake server's address."""
    assert isinstance(orch.api, orch.ApiClient)
    return orch.api


# --------------------------------------------------------------------------
# the calls
# --------------------------------------------------------------------------

def test_create_session_returns_terminal_id_and_session_name(orch, client, router, workdir):
    """Spec 1 'Create session returns terminal ID and session name': POST /sessions with the three params."""
    route = router.post("/sessions").mock(return_value=httpx.Response(201, json=terminal_answer()))
    result = client.create_session("system_analyst")
    assert result["id"] == TID
    assert result["session_name"] == SESSION
    assert route.call_count == 1
    request = route.calls.last.request
    assert request.method == "POST"
    assert request.url.path == "/sessions"
    assert dict(request.url.params) == {"provider": "codex", "agent_profile": "system_analyst",
                                        "working_directory": str(workdir)}


def test_create_session_provider_defaults_to_provider_setting(load_orch, router):
    """Spec README: create_session(profile, provider=None) uses PROVIDER when no provider is given."""
    m = load_orch(PROVIDER="claude_code")
    route = router.post("/sessions").mock(return_value=httpx.Response(201, json=terminal_answer()))
    api = m.ApiClient(BASE)
    try:
        api.create_session("system_analyst")
    finally:
        api.close()
    assert route.calls.last.request.url.params["provider"] == "claude_code"


def test_create_session_with_explicit_provider(client, router):
    """Spec README: create_session(profile, provider) sends the given provider instead of PROVIDER."""
    route = router.post("/sessions").mock(return_value=httpx.Response(201, json=terminal_answer()))
    client.create_session("tester", provider="mock_cli")
    params = route.calls.last.request.url.params
    assert params["provider"] == "mock_cli"
    assert params["agent_profile"] == "tester"


def test_create_session_under_a_chosen_name(client, router):
    """The caller may pick the session's name; without one CAO picks it (no session_name is sent)."""
    route = router.post("/sessions").mock(return_value=httpx.Response(201, json=terminal_answer()))
    client.create_session("system_analyst", session_name="cao-loop-0a1b2c3d")
    assert route.calls.last.request.url.params["session_name"] == "cao-loop-0a1b2c3d"
    client.create_session("system_analyst")
    assert "session_name" not in route.calls.last.request.url.params


def test_create_terminal_adds_terminal_to_session(client, router, workdir):
    """Spec README: create_terminal(session_name, profile) POSTs /sessions/{name}/terminals with the params."""
    route = router.post(f"/sessions/{SESSION}/terminals").mock(
        return_value=httpx.Response(201, json=terminal_answer("0000beef")))
    result = client.create_terminal(SESSION, "peer_programmer")
    assert result["id"] == "0000beef"
    assert result["session_name"] == SESSION
    request = route.calls.last.request
    assert request.method == "POST"
    assert dict(request.url.params) == {"provider": "codex", "agent_profile": "peer_programmer",
                                        "working_directory": str(workdir)}


def test_create_terminal_with_explicit_provider(client, router):
    """Spec README: create_terminal(session_name, profile, provider) sends the given provider."""
    route = router.post(f"/sessions/{SESSION}/terminals").mock(
        return_value=httpx.Response(201, json=terminal_answer()))
    client.create_terminal(SESSION, "tester", provider="kiro_cli")
    assert route.calls.last.request.url.params["provider"] == "kiro_cli"


def test_send_input_posts_message_param(client, router):
    """Spec 1 'Send input to terminal': POST /terminals/{id}/input with the message param."""
    route = router.post(f"/terminals/{TID}/input").mock(return_value=httpx.Response(200, json={"success": True}))
    client.send_input(TID, "hello")
    assert route.call_count == 1
    request = route.calls.last.request
    assert request.method == "POST"
    assert request.url.params["message"] == "hello"


def test_send_input_multiline_message_with_special_characters_arrives_intact(client, router):
    """Spec 1 'Send input to terminal': a multi-line message with special characters reaches CAO unchanged."""
    message = (
        "*** ORIGINAL EXPLORE SUMMARY ***\n"
        "Line two: a & b = c ? d # e % f + g ; h / i\n"
        "  indented, \"double\" and 'single' quotes, `backticks`, $HOME, \\backslash\\\n"
        "unicode: caf\u00e9 \u00fc\u00df \u65e5\u672c \u276f \u2714\ttab\n"
        "\n"
        "100% done?key=value&x=1 <tag> {json: [1, 2]}\n"
    )
    route = router.post(f"/terminals/{TID}/input").mock(return_value=httpx.Response(200, json={"success": True}))
    client.send_input(TID, message)
    assert route.calls.last.request.url.params["message"] == message


def test_send_input_through_fake_cao_arrives_intact(orch, fake_cao):
    """Spec 1 'Send input to terminal': the fake CAO receives the exact multi-line text."""
    ids = fake_cao.add_terminals()
    message = "first line\nsecond & third = 100% + more\n\u276f done"
    orch.api.send_input(ids["tester"], message)
    assert fake_cao.reminders == [("tester", message)]


def test_get_status_returns_status_string(client, router):
    """Spec README: get_status GETs /terminals/{id} and returns the status word."""
    route = router.get(f"/terminals/{TID}").mock(
        return_value=httpx.Response(200, json={"id": TID, "status": "processing", "session_name": SESSION}))
    assert client.get_status(TID) == "processing"
    assert route.calls.last.request.method == "GET"


def test_get_last_output_returns_output_text(client, router):
    """Spec README: get_last_output GETs /terminals/{id}/output?mode=last and returns the output string."""
    route = router.get(f"/terminals/{TID}/output").mock(
        return_value=httpx.Response(200, json={"output": "RESULT: PASS\nEVIDENCE:\n- ok", "mode": "last"}))
    assert client.get_last_output(TID) == "RESULT: PASS\nEVIDENCE:\n- ok"
    assert route.calls.last.request.url.params["mode"] == "last"


def test_exit_terminal_posts_exit(client, router):
    """Spec README: exit_terminal POSTs /terminals/{id}/exit."""
    route = router.post(f"/terminals/{TID}/exit").mock(return_value=httpx.Response(200, json={"success": True}))
    client.exit_terminal(TID)
    assert route.call_count == 1
    assert route.calls.last.request.method == "POST"


def test_calls_work_against_fake_cao(orch, fake_cao, workdir):
    """Spec 1 'API client with httpx': the calls drive the CAO API end to end (fake server)."""
    first = orch.api.create_session("system_analyst")
    other = orch.api.create_terminal(first["session_name"], "tester", provider="mock_cli")
    assert other["session_name"] == first["session_name"]
    assert fake_cao.terminals[first["id"]].profile == "system_analyst"
    assert fake_cao.terminals[first["id"]].working_directory == str(workdir)
    assert fake_cao.terminals[other["id"]].provider == "mock_cli"
    assert orch.api.get_status(other["id"]) == "idle"
    assert orch.api.get_last_output(other["id"]) == ""
    orch.api.exit_terminal(other["id"])
    assert fake_cao.exited_ids() == [other["id"]]


def test_api_client_uses_one_httpx_client_closed_by_close(orch, router, monkeypatch):
    """Spec 1 'API client with httpx': ApiClient wraps one httpx.Client for all calls; close() closes it."""
    made: list[httpx.Client] = []

    class RecordingClient(httpx.Client):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(httpx, "Client", RecordingClient)
    router.post("/sessions").mock(return_value=httpx.Response(201, json=terminal_answer()))
    router.post(f"/sessions/{SESSION}/terminals").mock(return_value=httpx.Response(201, json=terminal_answer()))
    router.post(f"/terminals/{TID}/input").mock(return_value=httpx.Response(200, json={"success": True}))
    router.get(f"/terminals/{TID}").mock(return_value=httpx.Response(200, json={"id": TID, "status": "idle"}))
    router.get(f"/terminals/{TID}/output").mock(return_value=httpx.Response(200, json={"output": "x"}))
    router.post(f"/terminals/{TID}/exit").mock(return_value=httpx.Response(200, json={"success": True}))
    api = orch.ApiClient(BASE)
    api.create_session("system_analyst")
    api.create_terminal(SESSION, "tester")
    api.send_input(TID, "hi")
    api.get_status(TID)
    api.get_last_output(TID)
    api.exit_terminal(TID)
    assert len(made) == 1
    assert not made[0].is_closed
    api.close()
    assert made[0].is_closed


# --------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------

CALLS = {
    "create_session": (lambda api: api.create_session("system_analyst"), "POST", "/sessions"),
    "create_terminal": (lambda api: api.create_terminal(SESSION, "tester"), "POST", f"/sessions/{SESSION}/terminals"),
    "send_input": (lambda api: api.send_input(TID, "hello"), "POST", f"/terminals/{TID}/input"),
    "get_status": (lambda api: api.get_status(TID), "GET", f"/terminals/{TID}"),
    "get_last_output": (lambda api: api.get_last_output(TID), "GET", f"/terminals/{TID}/output"),
    "exit_terminal": (lambda api: api.exit_terminal(TID), "POST", f"/terminals/{TID}/exit"),
}

# Words that name each call in an error message.
CALL_WORDS = {
    "create_session": "session",
    "create_terminal": "terminal",
    "send_input": "input",
    "get_status": "status",
    "get_last_output": "output",
    "exit_terminal": "exit",
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_refused_connection_says_server_not_reachable(orch, client, router, call):
    """a refused connection is an ApiError saying CAO is not reachable at API, mentioning cao-server."""
    do, method, path = CALLS[call]
    router.route(method=method, path=path).mock(side_effect=httpx.ConnectError("[Errno 111] Connection refused"))
    with pytest.raises(orch.ApiError) as caught:
        do(client)
    message = str(caught.value)
    assert "not reachable" in message
    assert BASE in message
    assert "cao-server" in message


HTTP_ERRORS = [
    ("create_session", 400, "Unknown provider type: gpt4"),
    ("create_session", 500, "Internal Server Error: tmux failed"),
    ("create_terminal", 404, "Session 'cao-session-1' not found"),
    ("send_input", 409, "Input is blocked while the agent is busy"),
    ("get_status", 404, f"Terminal '{TID}' not found"),
    ("get_last_output", 422, "Invalid terminal id"),
    ("exit_terminal", 404, f"Terminal '{TID}' not found"),
]


@pytest.mark.parametrize("call, status, detail", HTTP_ERRORS, ids=[f"{c}-{s}" for c, s, _ in HTTP_ERRORS])
def test_http_error_names_call_status_and_detail(orch, client, router, call, status, detail):
    """an HTTP error is an ApiError naming the call, the HTTP status and the server's detail."""
    do, method, path = CALLS[call]
    router.route(method=method, path=path).mock(return_value=httpx.Response(status, json={"detail": detail}))
    with pytest.raises(orch.ApiError) as caught:
        do(client)
    message = str(caught.value)
    assert CALL_WORDS[call] in message.lower()
    assert str(status) in message
    assert detail in message


@pytest.mark.parametrize("call", ["create_session", "create_terminal", "get_status", "get_last_output"])
def test_answer_that_is_not_json_is_api_error(orch, client, router, call):
    """an answer that is not JSON is a clear ApiError naming the call, not a decoding traceback."""
    do, method, path = CALLS[call]
    router.route(method=method, path=path).mock(
        return_value=httpx.Response(200, text="<html>proxy login</html>", headers={"content-type": "text/html"}))
    with pytest.raises(orch.ApiError) as caught:
        do(client)
    message = str(caught.value)
    assert CALL_WORDS[call] in message.lower()
    assert "JSON" in message


SHAPE_ERRORS = [
    ("create_session", {"session_name": SESSION, "status": "idle"}, "answered without a terminal id and session name"),
    ("create_session", [TID, SESSION], "answered without a terminal id and session name"),
    ("create_terminal", {"id": TID, "session_name": 7}, "answered without a terminal id and session name"),
    ("get_status", {"id": TID}, "answered without a status"),
    ("get_status", "idle", "answered without a status"),
    ("get_last_output", {"mode": "last"}, "answered without an output"),
    ("get_last_output", {"output": None, "mode": "last"}, "answered without an output"),
]


@pytest.mark.parametrize("call, answer, missing", SHAPE_ERRORS,
                         ids=[f"{c}-{type(a).__name__}-{m}" for c, a, m in SHAPE_ERRORS])
def test_answer_lacking_id_status_or_output_is_api_error(orch, client, router, call, answer, missing):
    """an answer without id / status / output is a clear ApiError naming what is missing."""
    do, method, path = CALLS[call]
    router.route(method=method, path=path).mock(return_value=httpx.Response(200, json=answer))
    with pytest.raises(orch.ApiError) as caught:
        do(client)
    assert missing in str(caught.value)


def test_a_session_answer_without_its_terminals_is_api_error_unless_the_session_is_gone(orch, client, router):
    """GET /sessions/{name} must list the session's terminals; CAO's record of a terminated session means gone."""
    route = router.get(f"/sessions/{SESSION}")
    route.mock(return_value=httpx.Response(200, json={"session": {"status": "active"}}))
    with pytest.raises(orch.ApiError, match=f"^CAO session {SESSION} answered without its terminals: "):
        client.session_terminals(SESSION)
    route.mock(return_value=httpx.Response(200, json={"session": {"status": "terminated"}}))
    assert client.session_terminals(SESSION) is None
    route.mock(return_value=httpx.Response(200, json={"terminals": [{"id": TID}, {"id": 3}, "x"]}))
    assert client.session_terminals(SESSION) == [TID]


# --------------------------------------------------------------------------
# main() with the server down
# --------------------------------------------------------------------------

def test_main_with_server_unreachable_exits_3_with_one_line(load_orch, prompt_file, fake_cao, capsys, workdir):
    """main() with CAO unreachable exits 3 with one error line naming API and cao-server; no state file."""
    fake_cao.outage = 10**6
    m = load_orch(PROMPT_FILE=str(prompt_file), **FAST)
    capsys.readouterr()
    assert run_main(m) == 3
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "not reachable" in lines[0]
    assert BASE in lines[0]
    assert "cao-server" in lines[0]
    assert "Traceback" not in out + err
    assert fake_cao.requests, "the server was never asked"
    assert not (workdir / ".tmp" / STATE_NAME).exists()
    assert not Path(m.STATE_FILE).exists()


def test_main_with_nothing_listening_exits_3(load_orch, prompt_file, capsys, workdir):
    """main() against an address where the connection is refused exits 3 with one line, no state file."""
    m = load_orch(PROMPT_FILE=str(prompt_file), API="http://cao.test", **FAST)
    with respx.mock(assert_all_called=False) as mock:
        mock.route().mock(side_effect=httpx.ConnectError("[Errno 111] Connection refused"))
        capsys.readouterr()
        assert run_main(m) == 3
    _, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "cao-server" in lines[0] and "http://cao.test" in lines[0]
    assert not (workdir / ".tmp" / STATE_NAME).exists()
