"""Hermes Agent's records: its state.db (SQLite) keeps per session and model only running totals, so a
turn's tokens are the totals at its end less those the loop noted when it sent the turn; the turn is over
once an assistant message that did not stop for tool calls was written after its last call was counted.

The database below has the columns of Hermes 0.19.0's schema that the loop reads (hermes_state.py).
"""

from __future__ import annotations

import contextlib
import json
import re
import sqlite3
import time
from pathlib import Path

import pytest

import run_orchestrator_loop
from conftest import FAST, run_main
from fake_cao import DEFAULT_REPLIES, FAIL_REPLY, PASS_REPLY

HERMES_SCHEMA = """
CREATE TABLE sessions (id TEXT PRIMARY KEY, source TEXT NOT NULL, model TEXT, parent_session_id TEXT,
    started_at REAL NOT NULL, input_tokens INTEGER DEFAULT 0, output_tokens INTEGER DEFAULT 0);
CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL REFERENCES sessions(id),
    role TEXT NOT NULL, content TEXT, tool_calls TEXT, timestamp REAL NOT NULL, token_count INTEGER,
    finish_reason TEXT);
CREATE TABLE session_model_usage (session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    model TEXT NOT NULL, billing_provider TEXT NOT NULL DEFAULT '', billing_base_url TEXT NOT NULL DEFAULT '',
    billing_mode TEXT NOT NULL DEFAULT '', task TEXT NOT NULL DEFAULT '', api_call_count INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0, output_tokens INTEGER NOT NULL DEFAULT 0,
    cache_read_tokens INTEGER NOT NULL DEFAULT 0, cache_write_tokens INTEGER NOT NULL DEFAULT 0,
    reasoning_tokens INTEGER NOT NULL DEFAULT 0, first_seen REAL, last_seen REAL,
    PRIMARY KEY (session_id, model, billing_provider, billing_base_url, billing_mode, task));
"""
MARKER = "/w/.tmp/agent-responses/tester_result.md"


class HermesDb:
    """A Hermes state.db written as Hermes writes it: a session per agent, its messages, and per model
    and task the running totals of its calls."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        with contextlib.closing(sqlite3.connect(path)) as db, db:
            if not db.execute("SELECT name FROM sqlite_master WHERE name = 'sessions'").fetchall():
                db.executescript(HERMES_SCHEMA)

    def session(self, session: str, parent: str | None = None) -> None:
        with contextlib.closing(sqlite3.connect(self.path)) as db, db:
            db.execute("INSERT OR IGNORE INTO sessions (id, source, parent_session_id, started_at) VALUES (?, 'cli', ?, ?)",
                       (session, parent, time.time()))

    def message(self, session: str, role: str, content: str = "", finish: str | None = None,
                at: float | None = None) -> None:
        with contextlib.closing(sqlite3.connect(self.path)) as db, db:
            db.execute("INSERT INTO messages (session_id, role, content, timestamp, finish_reason) VALUES (?, ?, ?, ?, ?)",
                       (session, role, content, at or time.time(), finish))

    def call(self, session: str, model: str, fresh: int, read: int, written: int, output: int, task: str = "",
             at: float | None = None) -> None:
        """One model call counted, as update_token_counts (task '') or record_auxiliary_usage does."""
        at = at or time.time()
        with contextlib.closing(sqlite3.connect(self.path)) as db, db:
            db.execute("INSERT OR IGNORE INTO session_model_usage (session_id, model, task, first_seen, last_seen)"
                       " VALUES (?, ?, ?, ?, ?)", (session, model, task, at, at))
            db.execute("UPDATE session_model_usage SET api_call_count = api_call_count + 1,"
                       " input_tokens = input_tokens + ?, cache_read_tokens = cache_read_tokens + ?,"
                       " cache_write_tokens = cache_write_tokens + ?, output_tokens = output_tokens + ?,"
                       " last_seen = ? WHERE session_id = ? AND model = ? AND task = ?",
                       (fresh, read, written, output, at, session, model, task))


def figures(reading) -> tuple[int, int, int] | None:
    if reading is None:
        return None
    uses = list(reading.by_model.values())
    return tuple(sum(getattr(use, name) for use in uses) for name in ("input", "cached_input", "output"))


def turn(db: HermesDb, since: float, before: dict) -> tuple[tuple[int, int, int] | None, bool] | None:
    m = run_orchestrator_loop
    record = m.hermes_record(db.path, MARKER, since)
    reading = m.hermes_usage(record, before)
    return None if reading is None else (figures(reading), reading.over)


def test_a_turn_is_the_totals_now_less_those_at_its_send_and_over_with_its_last_answer(tmp_path):
    m = run_orchestrator_loop
    db = HermesDb(tmp_path / "state.db")
    db.session("s1")
    db.message("s1", "user", f"Write your answer to {MARKER}")
    db.call("s1", "scripted-small", 1000, 0, 200, 20)
    db.message("s1", "assistant", "", finish="tool_calls")
    db.call("s1", "scripted-small", 300, 1000, 0, 30)
    db.message("s1", "assistant", "Done.", finish="stop")
    first_turn_before = {}                                   # no session named the file when it was sent
    assert turn(db, 0.0, first_turn_before) == ((1000 + 200 + 300, 1000, 50), True)

    before = m.hermes_record(db.path, MARKER, time.time()).totals      # the second turn is sent
    since = time.time()
    assert turn(db, since, before) is None                   # nothing counted yet
    db.message("s1", "user", f"Again: {MARKER}")
    db.call("s1", "scripted-small", 500, 1500, 0, 40)
    assert turn(db, since, before) == ((500, 1500, 40), False)        # a call, no answer yet
    db.call("s1", "scripted-large", 100, 0, 0, 10)           # a model switched mid-turn counts for its model
    db.message("s1", "assistant", "Done again.", finish="stop")
    reading = m.hermes_usage(m.hermes_record(db.path, MARKER, since), before)
    assert {model: (use.input, use.cached_input, use.output) for model, use in reading.by_model.items()} == \
        {"scripted-small": (500, 1500, 40), "scripted-large": (100, 0, 10)} and reading.over


def test_an_answer_written_before_the_last_call_was_counted_is_not_the_turn_s_end(tmp_path):
    db = HermesDb(tmp_path / "state.db")
    db.session("s1")
    db.message("s1", "user", MARKER)
    now = time.time()
    db.message("s1", "assistant", "first words", finish="stop", at=now)
    db.call("s1", "m", 100, 0, 0, 10, at=now + 1)            # it went on: another call after that answer
    assert turn(db, 0.0, {}) == ((100, 0, 10), False)
    db.message("s1", "assistant", "the answer", finish="stop", at=now + 2)
    assert turn(db, 0.0, {}) == ((100, 0, 10), True)


def test_only_the_sessions_naming_the_file_and_their_continuations_count_and_side_calls_do_not(tmp_path):
    db = HermesDb(tmp_path / "state.db")
    for session in ("mine", "other"):
        db.session(session)
    db.message("mine", "user", MARKER)
    db.message("other", "user", "Write your answer to /w/.tmp/agent-responses/analyst_summary.md")
    db.call("mine", "m", 100, 0, 0, 10)
    db.call("other", "m", 7000, 0, 0, 70)                    # another agent's session
    db.call("mine", "m", 900, 0, 0, 90, task="title_generation")    # a side call: not the agent's turn
    db.session("mine-compressed", parent="mine")             # compressed: the conversation goes on in a new session
    db.call("mine-compressed", "m", 50, 0, 0, 5)
    db.message("mine-compressed", "assistant", "Done.", finish="stop")
    assert turn(db, 0.0, {}) == ((150, 0, 15), True)


def test_hermes_records_are_read_only_and_unreadable_ones_are_unknown(tmp_path):
    m = run_orchestrator_loop
    db = HermesDb(tmp_path / "state.db")
    db.session("s1")
    db.message("s1", "user", MARKER)
    db.call("s1", "m", 100, 0, 0, 10)
    before = db.path.read_bytes()
    assert m.hermes_record(db.path, MARKER, 0.0) is not None
    assert db.path.read_bytes() == before
    (tmp_path / "broken.db").write_text("not a database")
    assert m.hermes_record(tmp_path / "broken.db", MARKER, 0.0) is None
    assert m.hermes_record(tmp_path / "missing.db", MARKER, 0.0) is None


def test_the_totals_at_a_send_read_back_from_the_state_as_they_were_written():
    m = run_orchestrator_loop
    totals = {"s1": {"scripted-small": m.TokenUse(1200, 1000, 50)}, "s2": {}}
    assert m.tokens_before_from_json(json.loads(json.dumps(m.tokens_before_json(totals)))) == totals
    assert m.tokens_before_from_json({"s1": {"by_model": {"m": {"input": -1}}}}) is None
    assert m.tokens_before_from_json("nonsense") is None and m.tokens_before_json(None) is None


# --------------------------------------------------------------------------
# The loop with agents that record their turns as Hermes does
# --------------------------------------------------------------------------

HERMES_FAIL_THEN_PASS = {**FAST, "MIN_REVIEW_CYCLES_BEFORE_APPROVAL": "1", "START_AGENT": "programmer",
                         "PROVIDER": "hermes", "QUIET_SCREEN_SECONDS": "30"}


def hermes_like(db: HermesDb):
    """Fake agents that record their turns as Hermes does (two calls a turn, a side call in a session's
    first turn); what each turn's calls cost, per role."""
    recorded: dict[str, list[tuple[int, int, int]]] = {}

    def step(text: str, then_stop: bool = False) -> dict:
        def act(fake, terminal):
            number = sum(len(turns) for turns in recorded.values()) + 1
            session = f"hermes-{terminal.id}"
            first = terminal.role not in recorded
            db.session(session)
            db.message(session, "user", f"Write your complete answer to this file: {terminal.response_path}")
            db.call(session, "scripted-hermes", 1000 * number, 100, 10, 20)
            if first:
                db.call(session, "scripted-hermes", 40, 0, 0, 8, task="title_generation")
            db.message(session, "assistant", "", finish="tool_calls")
            Path(terminal.response_path).write_text(text, encoding="utf-8")
            db.call(session, "scripted-hermes", 500, 1000 * number, 0, 30)
            db.message(session, "assistant", "Written.", finish="stop")
            recorded.setdefault(terminal.role, []).append((1000 * number + 10 + 500, 100 + 1000 * number, 50))
            terminal.last_output = text
            terminal.status = "completed"             # which the loop does not trust for Hermes
            if then_stop:
                raise KeyboardInterrupt()             # the loop is stopped (Ctrl-C) before it takes the reply
        return {"action": "call", "call": act, "text": text}

    return step, recorded


def test_a_hermes_run_counts_each_turn_exactly_and_ends_each_turn_by_its_record(load_orch, fake_cao, prompt_file,
                                                                                tmp_path, capsys):
    home = tmp_path / "agent-home"
    db = HermesDb(home / ".hermes" / "state.db")
    step, recorded = hermes_like(db)
    for role in ("programmer", "peer_programmer"):
        fake_cao.script[role] = [step(DEFAULT_REPLIES[role])]
    fake_cao.script["tester"] = [step(FAIL_REPLY), step(PASS_REPLY)]
    m = load_orch(PROMPT_FILE=str(prompt_file), AGENT_HOME=str(home), **HERMES_FAIL_THEN_PASS)
    assert run_main(m) == 0
    state = json.loads(Path(m.STATE_FILE).read_text())
    turns = [(t["role"], (t["tokens"]["input"], t["tokens"]["cached_input"], t["tokens"]["output"]))
             for t in state["turn_records"]]
    assert sorted(turns) == sorted((role, use) for role, uses in recorded.items() for use in uses)
    assert len(turns) == 6 and all(t["tokens_final"] and "tokens_before" not in t for t in state["turn_records"])
    ends = re.findall(r"turn end seen by ([^,]+), kept as", capsys.readouterr().out)
    assert ends == [m.TURN_ENDED_BY_RECORD] * 6, ends      # not 30 s of still screen


def test_the_totals_noted_at_a_send_are_saved_before_it_and_count_after_a_resume(load_orch, fake_cao, prompt_file,
                                                                                 tmp_path):
    """The loop is stopped just as the tester has answered its second turn, before the reply is taken (the
    totals of the tester's session then hold both turns): the rerun takes the reply and counts only what
    the second turn cost, from the totals saved with its send."""
    home = tmp_path / "agent-home"
    db = HermesDb(home / ".hermes" / "state.db")
    step, recorded = hermes_like(db)
    for role in ("programmer", "peer_programmer"):
        fake_cao.script[role] = [step(DEFAULT_REPLIES[role])]
    fake_cao.script["tester"] = [step(FAIL_REPLY), step(PASS_REPLY, then_stop=True)]
    m = load_orch(PROMPT_FILE=str(prompt_file), AGENT_HOME=str(home), **HERMES_FAIL_THEN_PASS)
    assert run_main(m) != 0
    saved = json.loads(Path(m.STATE_FILE).read_text())["in_flight"]
    tester_session = f"hermes-{fake_cao.terminal_for('tester').id}"
    assert saved["role"] == "tester" and saved["tokens_before"][tester_session]["input"] == recorded["tester"][0][0]
    m = load_orch(PROMPT_FILE=str(prompt_file), AGENT_HOME=str(home), RESUME="1", **HERMES_FAIL_THEN_PASS)
    assert run_main(m) == 0
    testers = [t["tokens"] for t in json.loads(Path(m.STATE_FILE).read_text())["turn_records"] if t["role"] == "tester"]
    assert [(t["input"], t["cached_input"], t["output"]) for t in testers] == recorded["tester"]


def test_the_totals_at_a_send_find_a_session_named_long_before_and_a_turn_reads_only_its_own(tmp_path):
    """The role's session named the file in a turn long ago: its totals are noted at the next send all the
    same (else that turn would count the whole session); a turn's reading looks only at sessions named since
    a little before it began."""
    m = run_orchestrator_loop
    db = HermesDb(tmp_path / "state.db")
    db.session("s1")
    long_ago = time.time() - 3600
    db.message("s1", "user", MARKER, at=long_ago)
    db.call("s1", "m", 5000, 0, 0, 50, at=long_ago + 5)
    assert figures_of(m.hermes_record(db.path, MARKER, time.time()).totals) == (5000, 0, 50)
    since = time.time()
    assert m.hermes_record(db.path, MARKER, since, since - m.RECORD_LOOKBACK_SECONDS).totals == {}
    db.message("s1", "user", MARKER)
    db.call("s1", "m", 700, 0, 0, 7)
    db.message("s1", "assistant", "Done.", finish="stop")
    before = {"s1": {"m": m.TokenUse(5000, 0, 50)}}
    reading = m.hermes_usage(m.hermes_record(db.path, MARKER, since, since - m.RECORD_LOOKBACK_SECONDS), before)
    assert figures(reading) == (700, 0, 7) and reading.over


def figures_of(totals: dict) -> tuple[int, int, int]:
    uses = [use for models in totals.values() for use in models.values()]
    return tuple(sum(getattr(use, name) for use in uses) for name in ("input", "cached_input", "output"))


def test_a_hermes_turn_s_model_is_the_one_its_last_counted_call_named(tmp_path):
    m = run_orchestrator_loop
    db = HermesDb(tmp_path / "state.db")
    db.session("s1")
    db.message("s1", "user", f"Write your answer to {MARKER}")
    db.call("s1", "scripted-small", 1000, 0, 0, 20, at=100.0)
    db.call("s1", "scripted-title", 50, 0, 0, 5, task="title_generation", at=103.0)   # a side call: not the turn's
    db.message("s1", "assistant", "Done.", finish="stop", at=101.0)
    assert m.hermes_usage(m.hermes_record(db.path, MARKER, 0.0), {}).model == "scripted-small"
    before = m.hermes_record(db.path, MARKER, 0.0).totals
    db.call("s1", "scripted-small", 100, 0, 0, 10, at=110.0)
    db.call("s1", "scripted-large", 100, 0, 0, 10, at=111.0)              # switched mid-turn
    db.message("s1", "assistant", "Done again.", finish="stop", at=112.0)
    assert m.hermes_usage(m.hermes_record(db.path, MARKER, 105.0), before).model == "scripted-large"
