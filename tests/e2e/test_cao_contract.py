"""Contract tests: the real cao-server 2.5.4 driving scripted mock_cli agents.

They prove the end-to-end infrastructure works and pin down the CAO behaviour
the orchestrator relies on (status sequence, file handoff, error answers).
"""

from __future__ import annotations

import concurrent.futures
import re
import time

import pytest

pytestmark = pytest.mark.e2e

RESPONSES = ".tmp/agent-responses"


def create_terminal(client, workdir, profile="system_analyst", session=None, key=None) -> dict:
    params = {"provider": "mock_cli", "agent_profile": profile, "working_directory": str(workdir)}
    if key:
        params["idempotency_key"] = key
    url = f"/sessions/{session}/terminals" if session else "/sessions"
    resp = client.post(url, params=params)
    assert resp.status_code == 201, resp.text
    return resp.json()


def send(client, terminal_id: str, message: str) -> None:
    resp = client.post(f"/terminals/{terminal_id}/input", params={"message": message})
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"success": True}


def prompt_for(workdir, basename: str, body: str = "Do the task.") -> str:
    answer = f"{workdir}/{RESPONSES}/{basename}"
    return f"{body}\nSecond line of the task.\nWrite your complete answer to this file: {answer}"


def test_prompt_round_trip(cao):
    wd = cao.new_workdir()
    cao.set_script({"analyst": [{"text": "ANALYST_SUMMARY:\nscripted answer\n", "think_ms": 1500}]})
    with cao.http() as client:
        term = create_terminal(client, wd)
        assert re.fullmatch(r"[0-9a-f]{8}", term["id"])
        assert re.fullmatch(r"cao-[0-9a-f]{8}", term["session_name"])
        assert term["status"] == "idle"
        assert term["session_name"] in cao.tmux_sessions()

        message = prompt_for(wd, "analyst_summary.md", "Analyse: ünïcode, $HOME, `quotes` & 'more'")
        send(client, term["id"], message)
        seen = cao.wait_status(term["id"], "completed", timeout=15)
        assert "processing" in [s for _, s in seen], seen

        answer = wd / RESPONSES / "analyst_summary.md"
        assert answer.read_text() == "ANALYST_SUMMARY:\nscripted answer\n"

        (record,) = cao.received()
        assert record["kind"] == "prompt"
        assert record["role"] == "analyst"
        assert record["message"] == message
        assert record["raw"] == message
        assert record["terminal_id"] == term["id"]

        last = client.get(f"/terminals/{term['id']}/output", params={"mode": "last"}).json()
        assert last["output"] == "#1 analyst turn 1: wrote analyst_summary.md"

        # The second turn reuses the last step and is counted.
        assert cao.run_turn(term["id"], prompt_for(wd, "analyst_summary.md", "Again")) == "completed"
        assert cao.counters()["turns"] == {"analyst": 2}


def test_error_action_reports_error_and_blocks_input(cao):
    wd = cao.new_workdir()
    cao.set_script({"peer_analyst": [{"action": "error", "think_ms": 100}]})
    with cao.http() as client:
        term = create_terminal(client, wd, profile="peer_system_analyst")
        send(client, term["id"], prompt_for(wd, "analyst_review.md"))
        cao.wait_status(term["id"], "error", timeout=15)
        assert not (wd / RESPONSES / "analyst_review.md").exists()
        # CAO refuses to type into a terminal it believes has failed.
        resp = client.post(f"/terminals/{term['id']}/input", params={"message": "hello"})
        assert resp.status_code == 409
        assert "ERROR state" in resp.json()["detail"]


def test_no_file_and_reminder_actions(cao):
    wd = cao.new_workdir()
    cao.set_script(
        {
            "programmer": [{"action": "no_file"}],
            "tester": [{"action": "write_on_reminder", "text": "RESULT: FAIL\nEVIDENCE:\n- late\n"}],
        }
    )
    summary = wd / RESPONSES / "programmer_summary.md"
    result = wd / RESPONSES / "test_result.md"
    with cao.http() as client:
        term = create_terminal(client, wd, profile="programmer")
    tid = term["id"]

    assert cao.run_turn(tid, prompt_for(wd, "programmer_summary.md")) == "completed"
    assert not summary.exists()
    # A reminder with nothing held back writes nothing.
    assert cao.run_turn(tid, f"Reminder: write your answer to {summary}") == "completed"
    assert not summary.exists()

    assert cao.run_turn(tid, prompt_for(wd, "test_result.md")) == "completed"
    assert not result.exists()
    assert cao.run_turn(tid, f"Reminder: you have not written {result} yet.") == "completed"
    assert result.read_text() == "RESULT: FAIL\nEVIDENCE:\n- late\n"

    kinds = [(r["kind"], r["role"]) for r in cao.received()]
    assert kinds == [
        ("prompt", "programmer"),
        ("reminder", "programmer"),
        ("prompt", "tester"),
        ("reminder", "tester"),
    ]
    # Reminders do not consume script steps.
    assert cao.counters()["turns"] == {"programmer": 1, "tester": 1}


def test_large_message_arrives_intact(cao):
    wd = cao.new_workdir()
    lines = []
    i = 0
    while sum(len(line) + 1 for line in lines) < 40_000:
        # Lines beyond 4095 bytes would be cut by a canonical-mode tty.
        filler = "x" * 5000 if i % 9 == 4 else "é ❯ $PATH `cmd` 'q' \"dq\" a&b %20 \ttab"
        lines.append(f"line {i:04d}: {filler}")
        i += 1
    message = "\n".join(lines) + f"\nWrite your complete answer to this file: {wd}/{RESPONSES}/test_result.md"
    with cao.http() as client:
        term = create_terminal(client, wd, profile="tester")
        send(client, term["id"], message)
        cao.wait_status(term["id"], "completed", timeout=20)
    (record,) = cao.received()
    assert record["raw"] == message
    assert record["role"] == "tester"
    assert (wd / RESPONSES / "test_result.md").read_text().startswith("RESULT: PASS")


def test_instructions_file_indirection(cao):
    wd = cao.new_workdir()
    instructions = wd / ".tmp" / "prompts" / "programmer_prompt.md"
    instructions.parent.mkdir(parents=True)
    content = prompt_for(wd, "programmer_summary.md", "A prompt too big for the query string.")
    instructions.write_text(content)
    message = f"Read and follow the instructions in this file: {instructions}"
    with cao.http() as client:
        term = create_terminal(client, wd, profile="programmer")
        send(client, term["id"], message)
        cao.wait_status(term["id"], "completed", timeout=15)
    (record,) = cao.received()
    assert (record["raw"], record["message"], record["role"]) == (message, content, "programmer")
    assert "PROGRAMMER_SUMMARY:" in (wd / RESPONSES / "programmer_summary.md").read_text()


def test_five_agents_in_one_session(cao):
    wd = cao.new_workdir()
    files = {
        "system_analyst": "analyst_summary.md",
        "peer_system_analyst": "analyst_review.md",
        "programmer": "programmer_summary.md",
        "peer_programmer": "programmer_review.md",
        "tester": "test_result.md",
    }
    with cao.http() as client:
        first = create_terminal(client, wd, profile="system_analyst")

        def add(profile):
            with cao.http() as own_client:
                return create_terminal(own_client, wd, profile=profile, session=first["session_name"])

        # CAO handles terminal creation concurrently; this is how an
        # orchestrator saves ~15 s at start-up.
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            others = list(pool.map(add, list(files)[1:]))
        terms = dict(zip(files, [first, *others]))
        assert len({t["id"] for t in terms.values()}) == 5
        assert cao.tmux_sessions() == [first["session_name"]]
        for profile, term in terms.items():
            send(client, term["id"], prompt_for(wd, files[profile]))
        for term in terms.values():
            cao.wait_status(term["id"], "completed", timeout=20)
    assert cao.counters()["turns"] == {
        "analyst": 1,
        "peer_analyst": 1,
        "programmer": 1,
        "peer_programmer": 1,
        "tester": 1,
    }
    by_role = {r["role"]: r["terminal_id"] for r in cao.received()}
    assert by_role["analyst"] == terms["system_analyst"]["id"]
    assert "REVIEW_RESULT: APPROVED" in (wd / RESPONSES / "programmer_review.md").read_text()


def test_a_creation_asked_again_under_its_idempotency_key_answers_the_same_terminal(cao):
    """What the loop relies on to ask again for an agent whose answer was lost: the same key and request answer
    the terminal the first made (session and added terminal alike), nothing more started; once that terminal
    is gone, the same key makes a new one."""
    wd = cao.new_workdir()
    with cao.http() as client:
        first = create_terminal(client, wd, key="cao-loop-contract:analyst:first")
        again = create_terminal(client, wd, key="cao-loop-contract:analyst:first")
        assert again["id"] == first["id"] and again["session_name"] == first["session_name"]
        session = first["session_name"]
        added = create_terminal(client, wd, profile="tester", session=session, key=f"{session}:tester:first")
        added_again = create_terminal(client, wd, profile="tester", session=session, key=f"{session}:tester:first")
        assert added_again["id"] == added["id"]
        listed = client.get(f"/sessions/{session}").json()
        assert sorted(t["id"] for t in listed["terminals"]) == sorted([first["id"], added["id"]]), listed
        assert client.delete(f"/terminals/{added['id']}").status_code in (200, 204)
        renewed = create_terminal(client, wd, profile="tester", session=session, key=f"{session}:tester:first")
        assert renewed["id"] != added["id"]


def test_exit_leaves_window_with_a_shell(cao):
    wd = cao.new_workdir()
    with cao.http() as client:
        term = create_terminal(client, wd)
        resp = client.post(f"/terminals/{term['id']}/exit")
        assert resp.status_code == 200
        deadline = time.monotonic() + 10
        while "bye" not in cao.capture_pane(term["session_name"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "bye" in cao.capture_pane(term["session_name"])
        # The tmux window and the CAO terminal survive; only the agent is gone.
        assert term["session_name"] in cao.tmux_sessions()
        assert client.get(f"/terminals/{term['id']}").status_code == 200
        assert client.delete(f"/terminals/{term['id']}").status_code == 200
        assert term["session_name"] not in cao.tmux_sessions()
    assert [r["message"] for r in cao.received()] == ["/exit"]


def test_error_answers(cao):
    wd = cao.new_workdir()
    with cao.http() as client:
        resp = client.get("/terminals/deadbeef")
        assert (resp.status_code, resp.json()["detail"]) == (404, "Terminal 'deadbeef' not found")
        assert client.post("/terminals/deadbeef/input", params={"message": "x"}).status_code == 404
        assert client.get("/terminals/not-an-id").status_code == 422
        resp = client.post(
            "/sessions", params={"provider": "nope", "agent_profile": "tester", "working_directory": str(wd)}
        )
        assert (resp.status_code, resp.json()["detail"]) == (400, "Unknown provider type: nope")
        for bad in ("/tmp", "/etc", str(wd / "missing")):
            resp = client.post(
                "/sessions",
                params={"provider": "mock_cli", "agent_profile": "tester", "working_directory": bad},
            )
            assert resp.status_code == 400, (bad, resp.text)
            assert "Working directory" in resp.json()["detail"]
    assert cao.tmux_sessions() == []


def test_no_terminals_leak_between_tests(cao_server):
    # Runs last and without the cleaning fixture: whatever earlier tests
    # created must already be gone.
    assert cao_server.tmux_sessions() == []
    with cao_server.http() as client:
        assert client.get("/sessions").json() == []
