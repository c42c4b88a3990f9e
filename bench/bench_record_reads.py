#!/usr/bin/env python3
"""What one read of a CLI's own records costs during a wait, beside one read of a terminal's screen.

    python bench/bench_record_reads.py [--sizes-mb 1,10,50] [--reads 30]

While a turn's reply file settles, the loop reads the turn's records about every half second (the CLI's
end-of-turn record, its tokens), where it used to read only CAO's status and the terminal's screen. This
measures both, on this machine:

- a records read: `turn_tokens()` for one turn, as the wait calls it, with the agents' home holding one
  long session of the CLI (Claude Code's transcript, Codex's rollout, Copilot CLI's session log, OpenCode's
  database) of the given size, its last turn the one read. The records' formats are those the loop reads
  (section 5 of the script); the lines carry filler text the size of real tool output. Medians of
  `--reads` reads after the first (the first finds where the turn's lines begin in each file and parses
  them; the wait's later reads find both done), and the first alone;
- a screen read: `ApiClient.get_screen()` of a terminal of a private cao-server 2.5.4 whose agent is the
  scripted agent (tests/e2e/harness.py), and a status read; medians of `--reads`.

It prints one row per CLI and size, and the screen and status reads, in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests" / "e2e")]

import run_orchestrator_loop as loop  # noqa: E402
from harness import private_cao  # noqa: E402

FILLER = "x" * 1900                   # a tool result's worth of text on one line
TURN_SECONDS = 60.0
START = 1_795_600_000.0               # the records' first moment (time.time() value)


def stamp(moment: float) -> str:
    return loop.utc_iso(moment, precise=True)


def claude_turn(marker: str, at: float, number: int) -> list[dict]:
    """One Claude Code turn: the prompt naming the file, a tool call, its long result, the answer, the end."""
    base = {"sessionId": "bench-session", "version": "2.1.197", "isSidechain": False}
    usage = {"input_tokens": 30000, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
             "output_tokens": 20}
    return [
        {**base, "type": "user", "message": {"role": "user", "content": f"Write your answer to {marker}"},
         "timestamp": stamp(at)},
        {**base, "type": "assistant", "requestId": f"req_{number}a", "timestamp": stamp(at + 1),
         "message": {"id": f"msg_{number}a", "role": "assistant", "model": "claude-sonnet-4-5", "usage": usage,
                     "content": [{"type": "tool_use", "name": "Bash", "input": {"command": "ls"}}]}},
        {**base, "type": "user", "timestamp": stamp(at + 2),
         "message": {"role": "user", "content": [{"type": "tool_result", "content": FILLER}]}},
        {**base, "type": "assistant", "requestId": f"req_{number}b", "timestamp": stamp(at + 3),
         "message": {"id": f"msg_{number}b", "role": "assistant", "model": "claude-sonnet-4-5", "usage": usage,
                     "stop_reason": "end_turn", "content": [{"type": "text", "text": "Done."}]}},
        {**base, "type": "system", "subtype": "turn_duration", "durationMs": 3000, "timestamp": stamp(at + 4)},
    ]


def codex_turn(marker: str, at: float, number: int) -> list[dict]:
    turn = f"turn-{number}"
    usage = {"input_tokens": 30000, "cached_input_tokens": 1000, "output_tokens": 20}
    return [
        {"type": "turn_context", "timestamp": stamp(at), "payload": {"turn_id": turn, "model": "gpt-6"}},
        {"type": "response_item", "timestamp": stamp(at), "payload": {"type": "message", "role": "user",
                                                                     "content": f"Write your answer to {marker}"}},
        {"type": "response_item", "timestamp": stamp(at + 2), "payload": {"type": "function_call_output",
                                                                         "output": FILLER}},
        {"type": "token_usage_record", "timestamp": stamp(at + 3),
         "payload": {"turn_id": turn, "response_id": f"resp_{number}", "usage": usage}},
        {"type": "event_msg", "timestamp": stamp(at + 4), "payload": {"type": "task_complete", "turn_id": turn}},
    ]


def copilot_turn(marker: str, at: float, number: int) -> list[dict]:
    usage = {"model": "gpt-6", "inputTokens": 30000, "outputTokens": 20, "cacheReadTokens": 1000}
    return [
        {"type": "user.message", "id": f"u{number}", "timestamp": stamp(at),
         "data": {"content": f"Write your answer to {marker}"}},
        {"type": "tool.execution_complete", "id": f"t{number}", "timestamp": stamp(at + 2),
         "data": {"result": {"content": FILLER}}},
        {"type": "session.usage_record", "id": f"r{number}", "timestamp": stamp(at + 3), "data": {"usage": usage}},
        {"type": "session.task_complete", "id": f"c{number}", "timestamp": stamp(at + 4), "data": {}},
    ]


def write_jsonl(path: Path, make_turn, marker: str, megabytes: float) -> tuple[float, float]:
    """A session file of about `megabytes`, turn after turn; the window of its last turn."""
    path.parent.mkdir(parents=True, exist_ok=True)
    written, number, at = 0, 0, START
    with open(path, "w", encoding="utf-8") as handle:
        while written < megabytes * 1_000_000:
            number += 1
            at = START + number * TURN_SECONDS
            for record in make_turn(marker, at, number):
                line = json.dumps(record) + "\n"
                handle.write(line)
                written += len(line)
    os.utime(path, (at + 5, at + 5))
    return at - 1, at + 10


def write_opencode(database: Path, wd: str, marker: str, megabytes: float) -> tuple[float, float]:
    """OpenCode's database with one session of about `megabytes`; the window of its last turn."""
    database.parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(database) as connection:
        connection.executescript(     # the columns and indexes of OpenCode 1.18.33's tables that the loop reads
            "CREATE TABLE session (id TEXT PRIMARY KEY, directory TEXT NOT NULL);"
            "CREATE TABLE message (id TEXT PRIMARY KEY, session_id TEXT NOT NULL, time_created INTEGER NOT NULL,"
            " time_updated INTEGER NOT NULL, data TEXT NOT NULL);"
            "CREATE TABLE part (id TEXT PRIMARY KEY, message_id TEXT NOT NULL, session_id TEXT NOT NULL,"
            " time_created INTEGER NOT NULL, time_updated INTEGER NOT NULL, data TEXT NOT NULL);"
            "CREATE INDEX message_session_time_created_id_idx ON message (session_id, time_created, id);"
            "CREATE INDEX part_message_id_id_idx ON part (message_id, id);"
            "CREATE INDEX part_session_idx ON part (session_id);")
        connection.execute("INSERT INTO session VALUES ('ses_bench', ?)", (wd,))
        written, number, at = 0, 0, START
        while written < megabytes * 1_000_000:
            number += 1
            at = START + number * TURN_SECONDS
            message = {"role": "assistant", "modelID": "gpt-6", "finish": "stop",
                       "time": {"created": int(at * 1000), "completed": int((at + 3) * 1000)},
                       "tokens": {"input": 30000, "output": 20, "reasoning": 0, "cache": {"read": 0, "write": 0}}}
            parts = [{"type": "text", "text": f"Write your answer to {marker}"}, {"type": "tool", "output": FILLER}]
            created, completed = int(at * 1000), int((at + 3) * 1000)
            connection.execute("INSERT INTO message VALUES (?, 'ses_bench', ?, ?, ?)",
                               (f"msg_{number}", created, completed, json.dumps(message)))
            for index, part in enumerate(parts):
                connection.execute("INSERT INTO part VALUES (?, ?, 'ses_bench', ?, ?, ?)",
                                   (f"prt_{number}_{index}", f"msg_{number}", created, created, json.dumps(part)))
            written += len(json.dumps(message)) + sum(len(json.dumps(part)) for part in parts)
    return at - 1, at + 10


def timed(call, reads: int) -> tuple[float, float]:
    """(the first call, the median of the next `reads`), in milliseconds."""
    started = time.perf_counter()
    call()
    first = (time.perf_counter() - started) * 1000
    times = []
    for _ in range(reads):
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1000)
    return first, statistics.median(times)


def records_reads(sizes: list[float], reads: int) -> list[tuple[str, float, float, float]]:
    """(CLI, size, first read ms, median read ms) for each CLI's records and size."""
    rows = []
    for megabytes in sizes:
        with tempfile.TemporaryDirectory(prefix="bench-records-") as home:
            wd = str(Path(home) / "project")
            loop.AGENT_HOME, loop.WD, loop.API = home, wd, "http://127.0.0.1:9889"
            marker = str(loop.response_path("tester"))
            cases = {
                "claude_code": lambda: write_jsonl(Path(home, ".claude", "projects", loop.claude_project_folder(wd),
                                                        "bench.jsonl"), claude_turn, marker, megabytes),
                "codex": lambda: write_jsonl(Path(home, ".codex", "sessions", "2026", "11", "27",
                                                  "rollout-bench.jsonl"), codex_turn, marker, megabytes),
                "copilot_cli": lambda: write_jsonl(Path(home, ".copilot", "session-state", "bench", "events.jsonl"),
                                                   copilot_turn, marker, megabytes),
                "opencode_cli": lambda: write_opencode(Path(home, ".local", "share", "opencode", "opencode.db"), wd,
                                                       marker, megabytes),
            }
            for provider, write in cases.items():
                since, until = write()
                loop.PROVIDER = provider
                loop.TESTER_PROVIDER = ""
                reading = loop.turn_tokens("tester", since, until)
                if reading is None or not reading.over:
                    raise SystemExit(f"{provider}: the bench's records did not read as one finished turn")
                loop.PARSED_LINES.records.clear()
                loop.PARSED_LINES.chars = 0
                loop.TURN_OFFSETS.clear()          # the first read finds where the turn's lines begin
                first, median = timed(lambda: loop.turn_tokens("tester", since, until), reads)
                rows.append((provider, megabytes, first, median))
    return rows


def screen_reads(reads: int) -> tuple[float, float]:
    """(median screen read ms, median status read ms) of a scripted agent's terminal on a private cao-server."""
    with private_cao() as cao:
        with cao.http() as client:
            terminal = client.post("/sessions", params={"provider": "mock_cli", "agent_profile": "tester",
                                                        "session_name": "cao-bench-reads",
                                                        "working_directory": str(cao.new_workdir("bench"))}).json()
        api = loop.ApiClient(cao.base_url)
        _, screen = timed(lambda: api.get_screen(terminal["id"]), reads)
        _, status = timed(lambda: api.get_status(terminal["id"]), reads)
        return screen, status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", default="1,10,50")
    parser.add_argument("--reads", type=int, default=30)
    options = parser.parse_args()
    sizes = [float(size) for size in options.sizes_mb.split(",")]
    rows = records_reads(sizes, options.reads)
    screen, status = screen_reads(options.reads)
    print(f"{'records of':14} {'session':>8} {'first read':>11} {'median read':>12}")
    for provider, megabytes, first, median in rows:
        print(f"{provider:14} {megabytes:6g} MB {first:8.1f} ms {median:9.1f} ms")
    print(f"a screen read (CAO's full output of a terminal): median {screen:.1f} ms")
    print(f"a status read: median {status:.1f} ms")


if __name__ == "__main__":
    main()
