"""Tokens used, read from the CLIs' own records: Claude Code's and Codex's JSONL transcripts and
OpenCode's SQLite database. The samples below are written in each CLI's own format (Claude Code
2.1.197, Codex 0.169.0, OpenCode 1.18.33), trimmed to the fields that matter.

A record can span files (a new conversation, a resumed or forked Codex thread): the reader is given
the lines of every file, in any order, and counts each response once by its id.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sqlite3
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

import run_orchestrator_loop

# Other tests run the module's top level again (conftest.fresh_module), which makes a new TokenUse
# class: the readers are looked up at call time and their answers compared as plain numbers.


def figures(reading) -> tuple[int, int, int] | None:
    """(input, cached_input, output) of a reader's answer, summed over its models, or None."""
    if reading is None:
        return None
    uses = list(reading.by_model.values())
    return tuple(sum(getattr(use, name) for use in uses) for name in ("input", "cached_input", "output"))


def tokens(input_: int, cached_input: int, output: int) -> tuple[int, int, int]:
    """The figures a reader's answer should have."""
    return input_, cached_input, output


def plus(*uses: tuple[int, int, int]) -> tuple[int, int, int]:
    return tuple(map(sum, zip(*uses)))


def claude_usage(lines, since, until):
    return figures(run_orchestrator_loop.claude_usage(lines, since, until))


def codex_usage(lines, since, until):
    return figures(run_orchestrator_loop.codex_usage(lines, since, until))


def opencode_usage(db_path, directory, since, until, marker="agent-responses/"):
    return figures(run_orchestrator_loop.opencode_usage(db_path, directory, marker, since, until))


def utc(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


TURN_START, TURN_END = utc("2026-11-25T12:04:20Z"), utc("2026-11-25T12:04:50Z")


# --------------------------------------------------------------------------
# TokenUse
# --------------------------------------------------------------------------

def test_token_uses_add_up_number_by_number():
    use = run_orchestrator_loop.TokenUse
    assert use(10, 2, 3) + use(1, 1, 1) == use(11, 3, 4)
    assert sum([use(1, 0, 2), use(3, 4, 5)], use()) == use(4, 4, 7)


def test_token_use_reads_back_what_it_writes_and_nothing_else():
    token_use = run_orchestrator_loop.TokenUse
    use = token_use(34263, 2000, 20)
    assert use.to_json() == {"input": 34263, "cached_input": 2000, "output": 20}
    assert token_use.from_json(use.to_json()) == use
    assert token_use.from_json(None) is None
    assert token_use.from_json({"input": 1, "output": 2}) is None
    assert token_use.from_json({"input": -1, "cached_input": 0, "output": 2}) is None


# --------------------------------------------------------------------------
# Claude Code: ~/.claude/projects/<slug>/<session>.jsonl
# --------------------------------------------------------------------------

# A turn: the prompt, a response of three content blocks (one line each, the same message.id; the
# first still holds the stream's first usage, output_tokens 1), an API error written as a reply,
# a one-block response, the turn's end. Lines are not in time order (as observed).
CLAUDE_TURN = [
    '{"type":"last-prompt","lastPrompt":"Write the answer","sessionId":"04e0ec7f-56de-4124-84c8-151f1256d248"}',
    '{"parentUuid":null,"isSidechain":false,"message":{"id":"msg_scripted_000009","type":"message","role":"assistant","model":"claude-sonnet-4-5","content":[{"type":"thinking","thinking":"..."}],"stop_reason":null,"usage":{"input_tokens":34163,"cache_creation_input_tokens":100,"cache_read_input_tokens":2000,"output_tokens":1,"service_tier":"standard","cache_creation":{"ephemeral_1h_input_tokens":0,"ephemeral_5m_input_tokens":100}}},"requestId":"req_011CVU1","type":"assistant","uuid":"a1","timestamp":"2026-11-25T12:04:23.460Z","sessionId":"04e0ec7f-56de-4124-84c8-151f1256d248","version":"2.1.197"}',
    '{"type":"file-history-snapshot","messageId":"40fc2ae4","snapshot":{"trackedFileBackups":{}},"isSnapshotUpdate":false}',
    '{"parentUuid":null,"isSidechain":false,"promptId":"p1","type":"user","message":{"role":"user","content":"Write your answer to .tmp/agent-responses/programmer_summary.md"},"uuid":"40fc2ae4","timestamp":"2026-11-25T12:04:22.598Z","sessionId":"04e0ec7f-56de-4124-84c8-151f1256d248","version":"2.1.197"}',
    '{"parentUuid":"a1","isSidechain":false,"message":{"id":"msg_scripted_000009","type":"message","role":"assistant","model":"claude-sonnet-4-5","content":[{"type":"text","text":"Writing the answer."}],"stop_reason":null,"usage":{"input_tokens":34163,"cache_creation_input_tokens":100,"cache_read_input_tokens":2000,"output_tokens":20,"service_tier":"standard"}},"requestId":"req_011CVU1","type":"assistant","uuid":"a2","timestamp":"2026-11-25T12:04:24.002Z","sessionId":"04e0ec7f-56de-4124-84c8-151f1256d248","version":"2.1.197"}',
    '{"parentUuid":"a2","isSidechain":false,"message":{"id":"msg_scripted_000009","type":"message","role":"assistant","model":"claude-sonnet-4-5","content":[{"type":"tool_use","id":"toolu_scripted_000009","name":"Bash","input":{"command":"cat > .tmp/agent-responses/programmer_summary.md <<\'END_OF_REPLY\'\\n...","description":"Write the answer file"}}],"stop_reason":"tool_use","usage":{"input_tokens":34163,"cache_creation_input_tokens":100,"cache_read_input_tokens":2000,"output_tokens":20,"service_tier":"standard"}},"requestId":"req_011CVU1","type":"assistant","uuid":"a3","timestamp":"2026-11-25T12:04:24.010Z","sessionId":"04e0ec7f-56de-4124-84c8-151f1256d248","version":"2.1.197"}',
    '{"parentUuid":"a3","isSidechain":false,"type":"assistant","message":{"id":"0b6d1a8e-synthetic","type":"message","role":"assistant","model":"<synthetic>","content":[{"type":"text","text":"API Error: 529 Overloaded"}],"usage":{"input_tokens":0,"cache_creation_input_tokens":0,"cache_read_input_tokens":0,"output_tokens":0}},"isApiErrorMessage":true,"apiErrorStatus":529,"uuid":"e1","timestamp":"2026-11-25T12:04:30.000Z"}',
    '{"parentUuid":"e1","isSidechain":false,"message":{"id":"msg_scripted_000010","type":"message","role":"assistant","model":"claude-sonnet-4-5","stop_sequence":null,"content":[{"type":"text","text":"Wrote the answer."}],"stop_reason":"end_turn","usage":{"input_tokens":34200,"cache_creation_input_tokens":0,"cache_read_input_tokens":0,"output_tokens":20,"server_tool_use":{"web_search_requests":0,"web_fetch_requests":0},"service_tier":"standard","cache_creation":{"ephemeral_1h_input_tokens":0,"ephemeral_5m_input_tokens":0},"inference_geo":"","iterations":[],"speed":"standard"},"stop_details":null},"type":"assistant","uuid":"1e151d2e","timestamp":"2026-11-25T12:04:44.187Z","userType":"external","entrypoint":"cli","cwd":"/var/tmp/cao-e2e-my46poh5/work/project-1","sessionId":"04e0ec7f-56de-4124-84c8-151f1256d248","version":"2.1.197","gitBranch":"HEAD"}',
    '{"parentUuid":"1e151d2e","isSidechain":false,"type":"system","subtype":"turn_duration","durationMs":21589,"messageCount":6,"timestamp":"2026-11-25T12:04:45.775Z","uuid":"63df624e","isMeta":false}',
]
# msg_scripted_000009: input 34163 + cache writes 100, cached 2000, output 20; msg_scripted_000010: 34200, 0, 20.
CLAUDE_TURN_USE = tokens(34263 + 34200, 2000, 40)

# The turn before: outside the window.
CLAUDE_EARLIER = '{"parentUuid":null,"isSidechain":false,"message":{"id":"msg_scripted_000004","type":"message","role":"assistant","model":"claude-sonnet-4-5","content":[{"type":"text","text":"Done."}],"stop_reason":"end_turn","usage":{"input_tokens":30100,"cache_creation_input_tokens":0,"cache_read_input_tokens":0,"output_tokens":20}},"type":"assistant","uuid":"b1","timestamp":"2026-11-25T12:03:10.512Z","sessionId":"04e0ec7f-56de-4124-84c8-151f1256d248","version":"2.1.197"}'

# A response line the CLI is still writing.
CLAUDE_PARTIAL = '{"parentUuid":"1e151d2e","isSidechain":false,"message":{"id":"msg_scripted_000011","type":"message","role":"assistant","model":"claude-sonnet-4-5","content":[{"type":"text","text":"Wr'


def test_claude_counts_each_response_once_with_its_largest_output():
    assert claude_usage(CLAUDE_TURN, TURN_START, TURN_END) == CLAUDE_TURN_USE
    # the line order (block by block, or the early line last) does not matter
    assert claude_usage(list(reversed(CLAUDE_TURN)), TURN_START, TURN_END) == CLAUDE_TURN_USE


def test_claude_counts_only_lines_timed_within_the_turn():
    lines = [CLAUDE_EARLIER, *CLAUDE_TURN]
    assert claude_usage(lines, TURN_START, TURN_END) == CLAUDE_TURN_USE
    assert claude_usage(lines, utc("2026-11-25T12:03:00Z"), utc("2026-11-25T12:03:30Z")) == tokens(30100, 0, 20)
    assert claude_usage(lines, utc("2026-11-25T12:04:40Z"), TURN_END) == tokens(34200, 0, 20)


def test_claude_skips_a_malformed_line_and_a_partial_last_line():
    lines = [CLAUDE_TURN[0], "not json {", "[1, 2]", "", *CLAUDE_TURN[1:], CLAUDE_PARTIAL]
    assert claude_usage(lines, TURN_START, TURN_END) == CLAUDE_TURN_USE


def test_claude_reads_a_conversation_whose_turn_spans_two_files():
    """/clear starts a new session file in the same folder: the reader is given the lines of both."""
    first, second = [CLAUDE_EARLIER, *CLAUDE_TURN[:5]], CLAUDE_TURN[5:]
    assert claude_usage(first + second, TURN_START, TURN_END) == CLAUDE_TURN_USE
    assert claude_usage(second + first, TURN_START, TURN_END) == CLAUDE_TURN_USE


def test_claude_usage_is_unknown_when_no_response_was_read():
    assert claude_usage([], TURN_START, TURN_END) is None
    assert claude_usage([CLAUDE_TURN[3], CLAUDE_TURN[-1], CLAUDE_PARTIAL], TURN_START, TURN_END) is None
    assert claude_usage([CLAUDE_EARLIER], TURN_START, TURN_END) is None
    no_id = CLAUDE_EARLIER.replace('"id":"msg_scripted_000004",', "").replace("12:03:10", "12:04:30")
    assert claude_usage([no_id], TURN_START, TURN_END) is None


# --------------------------------------------------------------------------
# Codex: ~/.codex/sessions/YYYY/MM/DD/rollout-*.jsonl
# --------------------------------------------------------------------------

CODEX_EARLIER_RECORD = '{"timestamp":"2026-11-25T12:01:02.100Z","ordinal":6,"type":"token_usage_record","payload":{"thread_id":"01a21297-7292-7213-ab0d-f2342aee5108","turn_id":"01a21297-aaaa-7721-903a-bbcd91709cd2","session_id":"01a21297-7292-7213-ab0d-f2342aee5108","root_turn_id":"01a21297-aaaa-7721-903a-bbcd91709cd2","response_id":"resp_scripted_000001","usage":{"input_tokens":12000,"cached_input_tokens":0,"cache_write_input_tokens":0,"output_tokens":20,"reasoning_output_tokens":0,"total_tokens":12020},"turn_token_usage":{"input_tokens":12000,"cached_input_tokens":0,"cache_write_input_tokens":0,"output_tokens":20,"reasoning_output_tokens":0,"total_tokens":12020},"thread_token_usage":{"input_tokens":12000,"cached_input_tokens":0,"cache_write_input_tokens":0,"output_tokens":20,"reasoning_output_tokens":0,"total_tokens":12020}}}'
CODEX_FIRST_RECORD = '{"timestamp":"2026-11-25T12:04:36.120Z","ordinal":8,"type":"token_usage_record","payload":{"thread_id":"01a21297-7292-7213-ab0d-f2342aee5108","turn_id":"01a21297-e797-7721-903a-bbcd91709cd2","session_id":"01a21297-7292-7213-ab0d-f2342aee5108","root_turn_id":"01a21297-e797-7721-903a-bbcd91709cd2","response_id":"resp_scripted_000004","usage":{"input_tokens":14434,"cached_input_tokens":4000,"cache_write_input_tokens":0,"output_tokens":20,"reasoning_output_tokens":8,"total_tokens":14454},"turn_token_usage":{"input_tokens":14434,"cached_input_tokens":4000,"cache_write_input_tokens":0,"output_tokens":20,"reasoning_output_tokens":8,"total_tokens":14454},"thread_token_usage":{"input_tokens":26434,"cached_input_tokens":4000,"cache_write_input_tokens":0,"output_tokens":40,"reasoning_output_tokens":8,"total_tokens":26474}}}'
CODEX_SECOND_RECORD = '{"timestamp":"2026-11-25T12:04:37.748Z","ordinal":15,"type":"token_usage_record","payload":{"thread_id":"01a21297-7292-7213-ab0d-f2342aee5108","turn_id":"01a21297-e797-7721-903a-bbcd91709cd2","session_id":"01a21297-7292-7213-ab0d-f2342aee5108","root_turn_id":"01a21297-e797-7721-903a-bbcd91709cd2","response_id":"resp_scripted_000005","usage":{"input_tokens":14586,"cached_input_tokens":0,"cache_write_input_tokens":0,"output_tokens":20,"reasoning_output_tokens":0,"total_tokens":14606},"turn_token_usage":{"input_tokens":29020,"cached_input_tokens":4000,"cache_write_input_tokens":0,"output_tokens":40,"reasoning_output_tokens":8,"total_tokens":29060},"thread_token_usage":{"input_tokens":41020,"cached_input_tokens":4000,"cache_write_input_tokens":0,"output_tokens":60,"reasoning_output_tokens":8,"total_tokens":41080}}}'
CODEX_TURN = [
    '{"timestamp":"2026-11-25T12:04:34.919Z","ordinal":1,"type":"event_msg","payload":{"type":"task_started","turn_id":"01a21297-e797-7721-903a-bbcd91709cd2","root_turn_id":"01a21297-e797-7721-903a-bbcd91709cd2","started_at":1795608274,"model_context_window":258400,"collaboration_mode_kind":"default"}}',
    '{"timestamp":"2026-11-25T12:04:34.950Z","ordinal":2,"type":"turn_context","payload":{"turn_id":"01a21297-e797-7721-903a-bbcd91709cd2","cwd":"/var/tmp/cao-e2e-my46poh5/work/project-1"}}',
    CODEX_FIRST_RECORD,
    '{"timestamp":"2026-11-25T12:04:36.300Z","ordinal":10,"type":"event_msg","payload":{"type":"token_count","info":{"total_token_usage":{"input_tokens":26434,"cached_input_tokens":4000,"cache_write_input_tokens":0,"output_tokens":40,"reasoning_output_tokens":8,"total_tokens":26474},"last_token_usage":{"input_tokens":14434,"cached_input_tokens":4000,"cache_write_input_tokens":0,"output_tokens":20,"reasoning_output_tokens":8,"total_tokens":14454},"last_usage_includes_reasoning":false,"model_context_window":258400},"rate_limits":{"limit_id":"codex","limit_name":null,"primary":null,"secondary":null,"credits":null}}}',
    CODEX_SECOND_RECORD,
    '{"timestamp":"2026-11-25T12:04:37.884Z","ordinal":18,"type":"event_msg","payload":{"type":"token_count","info":{"total_token_usage":{"input_tokens":41020,"cached_input_tokens":4000,"cache_write_input_tokens":0,"output_tokens":60,"reasoning_output_tokens":8,"total_tokens":41080},"last_token_usage":{"input_tokens":14586,"cached_input_tokens":0,"cache_write_input_tokens":0,"output_tokens":20,"reasoning_output_tokens":0,"total_tokens":14606},"last_usage_includes_reasoning":false,"model_context_window":258400},"rate_limits":{"limit_id":"codex","limit_name":null,"primary":null,"secondary":null,"credits":null}}}',
    '{"timestamp":"2026-11-25T12:04:37.900Z","ordinal":19,"type":"event_msg","payload":{"type":"token_count","info":null,"rate_limits":{"limit_id":"codex"}}}',
    '{"timestamp":"2026-11-25T12:04:38.132Z","ordinal":23,"type":"event_msg","payload":{"type":"task_complete","turn_id":"01a21297-e797-7721-903a-bbcd91709cd2","root_turn_id":"01a21297-e797-7721-903a-bbcd91709cd2","last_agent_message":"Wrote the answer to .tmp/agent-responses/tester_result.md","started_at":1795608274,"completed_at":1795608278,"duration_ms":3234,"time_to_first_token_ms":551}}',
]
# resp 4: 14434 of which 4000 cached, output 20 (reasoning included); resp 5: 14586, none cached, 20.
CODEX_TURN_USE = tokens(10434 + 14586, 4000, 40)

CODEX_PARTIAL = '{"timestamp":"2026-11-25T12:04:39.001Z","ordinal":24,"type":"token_usage_record","payload":{"thread_id":"01a21297-7292-7213-ab0d-f2342aee5108","turn_id":"01a21297-e797-7721-903a-bbcd91709cd2","response_id":"resp_scripted_000006","usage":{"input_tok'


def test_codex_counts_each_response_once_from_its_usage_record():
    """token_count events and the cumulative turn and thread figures describe the same responses."""
    assert codex_usage(CODEX_TURN, TURN_START, TURN_END) == CODEX_TURN_USE
    repeated = [*CODEX_TURN, CODEX_SECOND_RECORD.replace('"ordinal":15', '"ordinal":30')]
    assert codex_usage(repeated, TURN_START, TURN_END) == CODEX_TURN_USE


def test_codex_counts_only_records_timed_within_the_turn():
    lines = [CODEX_EARLIER_RECORD, *CODEX_TURN]
    assert codex_usage(lines, TURN_START, TURN_END) == CODEX_TURN_USE
    assert codex_usage(lines, utc("2026-11-25T12:01:00Z"), utc("2026-11-25T12:02:00Z")) == tokens(12000, 0, 20)
    assert codex_usage(lines, utc("2026-11-25T12:04:37Z"), TURN_END) == tokens(14586, 0, 20)


def test_codex_skips_a_malformed_line_and_a_partial_last_line():
    lines = ["{\"timestamp\": oops}", *CODEX_TURN, CODEX_PARTIAL]
    assert codex_usage(lines, TURN_START, TURN_END) == CODEX_TURN_USE


def test_codex_reads_a_thread_whose_records_span_two_rollouts():
    """A resumed or forked thread can write into a second rollout file, which may repeat a record
    (compaction's copy, a resumed thread): both files' lines are given, each response counts once."""
    first = [CODEX_EARLIER_RECORD, *CODEX_TURN[:3]]
    second = [*CODEX_TURN[3:],
              CODEX_FIRST_RECORD.replace('"ordinal":8', '"ordinal":2'),
              '{"timestamp":"2026-11-25T12:04:38.500Z","ordinal":25,"type":"compacted","payload":{"message":"summary",'
              '"latest_token_usage_record":' + CODEX_SECOND_RECORD + '}}']
    assert codex_usage(first + second, TURN_START, TURN_END) == CODEX_TURN_USE
    assert codex_usage(second + first, TURN_START, TURN_END) == CODEX_TURN_USE


def test_codex_usage_is_unknown_when_no_response_was_read():
    assert codex_usage([], TURN_START, TURN_END) is None
    assert codex_usage([CODEX_TURN[0], CODEX_TURN[3], CODEX_TURN[-1], CODEX_PARTIAL], TURN_START, TURN_END) is None
    no_id = CODEX_SECOND_RECORD.replace('"response_id":"resp_scripted_000005",', "")
    assert codex_usage([no_id], TURN_START, TURN_END) is None


# --------------------------------------------------------------------------
# OpenCode: ~/.local/share/opencode/opencode.db (SQLite, WAL)
# --------------------------------------------------------------------------

PROJECT = "/var/tmp/cao-e2e-fw7qwjp4/work/project-1"
OTHER_PROJECT = "/var/tmp/cao-e2e-fw7qwjp4/work/project-2"
OPENCODE_START, OPENCODE_END = utc("2026-11-25T12:27:00Z"), utc("2026-11-25T12:28:00Z")

OPENCODE_SCHEMA = """
CREATE TABLE session (id TEXT PRIMARY KEY, project_id TEXT NOT NULL, parent_id TEXT, slug TEXT NOT NULL,
    directory TEXT NOT NULL, title TEXT NOT NULL, version TEXT NOT NULL, agent TEXT, model TEXT,
    cost REAL DEFAULT 0, tokens_input INTEGER DEFAULT 0, tokens_output INTEGER DEFAULT 0,
    tokens_reasoning INTEGER DEFAULT 0, tokens_cache_read INTEGER DEFAULT 0, tokens_cache_write INTEGER DEFAULT 0,
    time_created INTEGER NOT NULL, time_updated INTEGER NOT NULL, time_compacting INTEGER, time_archived INTEGER);
CREATE TABLE message (id TEXT PRIMARY KEY, session_id TEXT NOT NULL REFERENCES session(id) ON DELETE CASCADE,
    time_created INTEGER NOT NULL, time_updated INTEGER NOT NULL, data TEXT NOT NULL);
CREATE TABLE part (id TEXT PRIMARY KEY, message_id TEXT NOT NULL, session_id TEXT NOT NULL,
    time_created INTEGER NOT NULL, time_updated INTEGER NOT NULL, data TEXT NOT NULL);
"""

OPENCODE_ROWS = """
INSERT INTO session (id, project_id, parent_id, slug, directory, title, version, agent, model, time_created, time_updated)
VALUES ('ses_212ac9c83ffe', 'global', NULL, 'calm-river', '/var/tmp/cao-e2e-fw7qwjp4/work/project-1', 'OK.', '1.18.33',
        'programmer', 'scripted/scripted', 1795609500000, 1795609653749),
       ('ses_212ac9c84aaa', 'global', NULL, 'bold-hill', '/var/tmp/cao-e2e-fw7qwjp4/work/project-2', 'OK.', '1.18.33',
        'tester', 'scripted/scripted', 1795609500000, 1795609653749),
       ('ses_212ac9c85bbb', 'global', NULL, 'deep-lake', '/var/tmp/cao-e2e-fw7qwjp4/work/project-1', 'OK.', '1.18.33',
        'build', 'scripted/scripted', 1795609500000, 1795609653749);
INSERT INTO part (id, message_id, session_id, time_created, time_updated, data) VALUES
('prt_1', 'msg_212ac9c85001XX3JUOYWnSM3js', 'ses_212ac9c83ffe', 1795609631877, 1795609631877,
 '{"type":"text","text":"Write your complete answer to this file: /var/tmp/cao-e2e-fw7qwjp4/work/project-1/.tmp/agent-responses/programmer_summary.md"}'),
('prt_2', 'msg_212ac9c8a000', 'ses_212ac9c84aaa', 1795609640000, 1795609640000,
 '{"type":"text","text":"Write your complete answer to this file: /var/tmp/cao-e2e-fw7qwjp4/work/project-2/.tmp/agent-responses/tester_result.md"}'),
('prt_3', 'msg_212ac9c8c000', 'ses_212ac9c85bbb', 1795609640000, 1795609640000,
 '{"type":"text","text":"A session of its own in the same folder, started by a person"}');
INSERT INTO message (id, session_id, time_created, time_updated, data) VALUES
('msg_212ac9c8a000', 'ses_212ac9c84aaa', 1795609640000, 1795609640000, '{"role":"user","time":{"created":1795609640000}}'),
('msg_212ac9c8c000', 'ses_212ac9c85bbb', 1795609640000, 1795609640000, '{"role":"user","time":{"created":1795609640000}}'),
('msg_212ac9c85001XX3JUOYWnSM3js', 'ses_212ac9c83ffe', 1795609631877, 1795609631877,
 '{"role":"user","time":{"created":1795609631877},"agent":"programmer","model":{"providerID":"scripted","modelID":"scripted"},"summary":{"diffs":[]}}'),
('msg_212ac9c86001', 'ses_212ac9c83ffe', 1795609632115, 1795609653749,
 '{"parentID":"msg_212ac9c85001XX3JUOYWnSM3js","role":"assistant","mode":"programmer","agent":"programmer","path":{"cwd":"/var/tmp/cao-e2e-fw7qwjp4/work/project-1","root":"/"},"cost":0,"tokens":{"total":7002,"input":6982,"output":20,"reasoning":0,"cache":{"write":0,"read":0}},"modelID":"scripted","providerID":"scripted","time":{"created":1795609632115,"completed":1795609653749},"finish":"tool-calls"}'),
('msg_212ac9c87001', 'ses_212ac9c83ffe', 1795609653800, 1795609655100,
 '{"parentID":"msg_212ac9c85001XX3JUOYWnSM3js","role":"assistant","mode":"programmer","agent":"programmer","path":{"cwd":"/var/tmp/cao-e2e-fw7qwjp4/work/project-1","root":"/"},"cost":0,"tokens":{"total":8364,"input":7139,"output":15,"reasoning":10,"cache":{"write":200,"read":1000}},"modelID":"scripted","providerID":"scripted","time":{"created":1795609653800,"completed":1795609655100},"finish":"stop"}'),
('msg_212ac9c88001', 'ses_212ac9c83ffe', 1795609656000, 1795609657000,
 '{"parentID":"msg_212ac9c85001XX3JUOYWnSM3js","role":"assistant","mode":"compaction","agent":"compaction","summary":true,"path":{"cwd":"/var/tmp/cao-e2e-fw7qwjp4/work/project-1","root":"/"},"cost":0,"tokens":{"total":520,"input":500,"output":20,"reasoning":0,"cache":{"write":0,"read":0}},"modelID":"scripted","providerID":"scripted","time":{"created":1795609656000,"completed":1795609657000},"finish":"stop"}'),
('msg_212ac9c89001', 'ses_212ac9c83ffe', 1795609658000, 1795609658500,
 '{"parentID":"msg_212ac9c85001XX3JUOYWnSM3js","role":"assistant","mode":"programmer","agent":"programmer","path":{"cwd":"/var/tmp/cao-e2e-fw7qwjp4/work/project-1","root":"/"},"cost":0,"tokens":{"total":7572,"input":7552,"output":20,"reasoning":0,"cache":{"write":0,"read":0}},"modelID":"scripted","providerID":"scripted","time":{"created":1795609658000}}'),
('msg_2129f0000001', 'ses_212ac9c83ffe', 1795609400000, 1795609410000,
 '{"parentID":"msg_2129effff001","role":"assistant","mode":"programmer","agent":"programmer","path":{"cwd":"/var/tmp/cao-e2e-fw7qwjp4/work/project-1","root":"/"},"cost":0,"tokens":{"total":6020,"input":6000,"output":20,"reasoning":0,"cache":{"write":0,"read":0}},"modelID":"scripted","providerID":"scripted","time":{"created":1795609400000,"completed":1795609410000},"finish":"stop"}'),
('msg_212ac9c8c001', 'ses_212ac9c85bbb', 1795609640000, 1795609650000,
 '{"parentID":"msg_212ac9c8c000","role":"assistant","mode":"build","agent":"build","cost":0,"tokens":{"total":5020,"input":5000,"output":20,"reasoning":0,"cache":{"write":0,"read":0}},"modelID":"scripted","providerID":"scripted","time":{"created":1795609640000,"completed":1795609650000},"finish":"stop"}'),
('msg_212ac9c8a001', 'ses_212ac9c84aaa', 1795609640000, 1795609650000,
 '{"parentID":"msg_212ac9c8a000","role":"assistant","mode":"tester","agent":"tester","path":{"cwd":"/var/tmp/cao-e2e-fw7qwjp4/work/project-2","root":"/"},"cost":0,"tokens":{"total":9020,"input":9000,"output":20,"reasoning":0,"cache":{"write":0,"read":0}},"modelID":"scripted","providerID":"scripted","time":{"created":1795609640000,"completed":1795609650000},"finish":"stop"}');
"""
# In the window, project-1: 6982/0/20, 7139+200/1000/15+10, the compaction step 500/0/20; the step
# still running (no time.completed) and the step of the turn before are left out.
OPENCODE_TURN_USE = tokens(6982 + 7339 + 500, 1000, 20 + 25 + 20)

COMPLETED_LATER = ("INSERT INTO message (id, session_id, time_created, time_updated, data) VALUES "
                   "('msg_212ac9c8b001', 'ses_212ac9c83ffe', 1795609659000, 1795609660000, "
                   "'{\"role\":\"assistant\",\"agent\":\"programmer\",\"tokens\":{\"total\":120,\"input\":100,"
                   "\"output\":20,\"reasoning\":0,\"cache\":{\"write\":0,\"read\":0}},"
                   "\"time\":{\"created\":1795609659000,\"completed\":1795609660000}}')")


def opencode_db(folder: Path) -> Path:
    """OpenCode's database, in WAL mode as OpenCode keeps it, its connection closed: `with connect()` alone
    commits but leaves the connection open, and whenever the garbage collector closed it later, SQLite would
    fold the WAL into the file -- its bytes changing under a test that watches them."""
    path = folder / "opencode.db"
    with contextlib.closing(sqlite3.connect(path)) as connection, connection:
        connection.execute("PRAGMA journal_mode=WAL")
        connection.executescript(OPENCODE_SCHEMA + OPENCODE_ROWS)
    return path


def test_opencode_counts_completed_assistant_messages_of_the_directory_in_the_window(tmp_path):
    path = opencode_db(tmp_path)
    assert opencode_usage(path, PROJECT, OPENCODE_START, OPENCODE_END) == OPENCODE_TURN_USE
    assert opencode_usage(str(path), OTHER_PROJECT, OPENCODE_START, OPENCODE_END) == tokens(9000, 0, 20)
    assert opencode_usage(path, PROJECT, utc("2026-11-25T12:23:00Z"), utc("2026-11-25T12:24:00Z")) \
        == tokens(6000, 0, 20)


def test_opencode_leaves_out_a_message_still_in_progress(tmp_path):
    path = opencode_db(tmp_path)
    only_running = (utc("2026-11-25T12:27:37.500Z"), utc("2026-11-25T12:27:59Z"))
    assert opencode_usage(path, PROJECT, *only_running) is None
    with contextlib.closing(sqlite3.connect(path)) as connection, connection:       # the step ends
        connection.execute("UPDATE message SET data = json_set(data, '$.time.completed', 1795609658500)"
                           " WHERE id = 'msg_212ac9c89001'")
    assert opencode_usage(path, PROJECT, *only_running) == tokens(7552, 0, 20)


def test_opencode_is_read_while_another_connection_writes(tmp_path):
    """The db is in WAL mode: committed rows still only in the -wal file are read, a transaction not yet
    committed is not, and the writer holding its lock neither blocks nor fails the read."""
    path = opencode_db(tmp_path)
    writer = sqlite3.connect(path, isolation_level=None)
    try:
        writer.execute("PRAGMA wal_autocheckpoint=0")
        writer.execute(COMPLETED_LATER)                     # committed, left in the WAL
        assert (tmp_path / "opencode.db-wal").stat().st_size > 0
        writer.execute("BEGIN IMMEDIATE")
        writer.execute("UPDATE message SET data = json_set(data, '$.time.completed', 1795609658500)"
                       " WHERE id = 'msg_212ac9c89001'")
        # a read the writer's lock blocked would give up after its timeout, with no figures
        assert opencode_usage(path, PROJECT, OPENCODE_START, OPENCODE_END) == plus(OPENCODE_TURN_USE, (100, 0, 20))
        writer.execute("COMMIT")
        assert opencode_usage(path, PROJECT, OPENCODE_START, OPENCODE_END) \
            == plus(OPENCODE_TURN_USE, (100, 0, 20), (7552, 0, 20))
    finally:
        writer.close()


def test_opencode_usage_never_changes_the_database(tmp_path):
    path = opencode_db(tmp_path)
    before = path.read_bytes()
    opencode_usage(path, PROJECT, OPENCODE_START, OPENCODE_END)
    assert path.read_bytes() == before


@pytest.mark.parametrize("case", ["missing", "not a database", "no tables", "other directory", "no message in window"])
def test_opencode_usage_is_unknown_when_nothing_was_read(tmp_path, case):
    path = tmp_path / "opencode.db"
    directory, since, until = PROJECT, OPENCODE_START, OPENCODE_END
    if case == "not a database":
        path.write_text("hello", encoding="utf-8")
    elif case == "no tables":
        sqlite3.connect(path).close()
    elif case in ("other directory", "no message in window"):
        opencode_db(tmp_path)
        directory = "/elsewhere" if case == "other directory" else PROJECT
        since, until = (utc("2026-11-25T11:00:00Z"), utc("2026-11-25T11:30:00Z")) \
            if case == "no message in window" else (since, until)
    assert opencode_usage(path, directory, since, until) is None
    assert case != "missing" or not path.exists()


def reading_of(reader, *args):
    """A reader's whole answer: (its figures, whether the turn is over), or None."""
    reading = reader(*args)
    return None if reading is None else (figures(reading), reading.over)


def test_each_reader_says_whether_the_cli_has_recorded_the_end_of_its_turn(tmp_path):
    """A turn's last response can be recorded after the loop took the reply: the end-of-turn record says
    nothing more is coming (Claude's turn_duration line, Codex's task_complete, OpenCode's last step)."""
    m = run_orchestrator_loop
    assert reading_of(m.claude_usage, CLAUDE_TURN, TURN_START, TURN_END) == (CLAUDE_TURN_USE, True)
    assert reading_of(m.claude_usage, CLAUDE_TURN[:-1], TURN_START, TURN_END) == (CLAUDE_TURN_USE, False)
    assert reading_of(m.codex_usage, CODEX_TURN, TURN_START, TURN_END) == (CODEX_TURN_USE, True)
    assert reading_of(m.codex_usage, CODEX_TURN[:-1], TURN_START, TURN_END) == (CODEX_TURN_USE, False)
    path = opencode_db(tmp_path)
    marker = "agent-responses/programmer_summary.md"
    first_step_only = (OPENCODE_START, utc("2026-11-25T12:27:34Z"))       # it stopped for a tool call
    assert reading_of(m.opencode_usage, path, PROJECT, marker, *first_step_only) == (tokens(6982, 0, 20), False)
    # the window holds a step still under way (no time.completed)
    assert reading_of(m.opencode_usage, path, PROJECT, marker, OPENCODE_START, OPENCODE_END)[1] is False
    done_by = (OPENCODE_START, utc("2026-11-25T12:27:37.100Z"))
    assert reading_of(m.opencode_usage, path, PROJECT, marker, *done_by)[1] is True


def test_tokens_are_kept_per_model():
    """The price table is per model: Claude names it on each response, Codex on the turn's turn_context."""
    m = run_orchestrator_loop
    claude = m.claude_usage(CLAUDE_TURN, TURN_START, TURN_END)
    assert list(claude.by_model) == ["claude-sonnet-4-5"]
    context = CODEX_TURN[1].replace('"cwd"', '"model":"gpt-5-codex","cwd"')
    codex = m.codex_usage([CODEX_TURN[0], context, *CODEX_TURN[2:]], TURN_START, TURN_END)
    assert list(codex.by_model) == ["gpt-5-codex"] and figures(codex) == CODEX_TURN_USE


def test_opencode_counts_only_the_sessions_that_name_the_turns_file(tmp_path):
    """A session of its own in the same folder (a person's, another role's) is not the turn's."""
    path = opencode_db(tmp_path)
    assert opencode_usage(path, PROJECT, OPENCODE_START, OPENCODE_END,
                          marker="agent-responses/programmer_summary.md") == OPENCODE_TURN_USE
    assert opencode_usage(path, PROJECT, OPENCODE_START, OPENCODE_END,
                          marker="agent-responses/tester_result.md") is None


# --------------------------------------------------------------------------
# Where the records are: a turn's files found in the agents' home
# --------------------------------------------------------------------------

def java_hash_base36(text: str) -> str:
    """Claude Code's hash of a long path, computed the way JavaScript does it (for ASCII text)."""
    value = 0
    for char in text:
        value = (value * 31 + ord(char)) & 0xFFFFFFFF
    value = abs(value - (1 << 32) if value >= 1 << 31 else value)
    digits = ""
    while True:
        value, digit = divmod(value, 36)
        digits = "0123456789abcdefghijklmnopqrstuvwxyz"[digit] + digits
        if not value:
            return digits


def test_claude_project_folder_follows_its_naming_rule():
    m = run_orchestrator_loop
    assert m.claude_project_folder("/var/tmp/cao-e2e-my46poh5/work/project-1") == \
        "-var-tmp-cao-e2e-my46poh5-work-project-1"
    long_path = "/home/someone/" + "a_very_long_folder.name/" * 10
    folder = m.claude_project_folder(long_path)
    assert folder == long_path.replace("/", "-").replace("_", "-").replace(".", "-")[:200] + "-" + \
        java_hash_base36(long_path)
    assert java_hash_base36("hello") == "1n1e4y"        # Java: "hello".hashCode() == 99162322


@pytest.fixture
def home_orch(load_orch, tmp_path):
    """The module with AGENT_HOME in tmp_path: its readers look there."""
    home = tmp_path / "agent-home"
    home.mkdir()
    return load_orch(AGENT_HOME=str(home), PROVIDER="claude_code"), home


def claude_line(when: str, message_id: str, tokens_in: int, text: str = "") -> str:
    return ('{"type":"assistant","timestamp":"%s","message":{"id":"%s","model":"claude-sonnet-4-5","role":'
            '"assistant","content":[{"type":"text","text":"%s"}],"usage":{"input_tokens":%d,'
            '"cache_creation_input_tokens":0,"cache_read_input_tokens":0,"output_tokens":20}}}'
            % (when, message_id, text, tokens_in))


def test_a_claude_turn_is_read_from_the_session_files_that_name_its_response_file(home_orch):
    m, home = home_orch
    folder = home / ".claude" / "projects" / m.claude_project_folder(m.WD)
    folder.mkdir(parents=True)
    path = str(m.response_path("programmer"))
    since, until = time.time() - 60, time.time()
    now = m.utc_iso(since + 30, precise=True)
    (folder / "agent.jsonl").write_text("\n".join([
        '{"type":"user","timestamp":"%s","message":{"role":"user","content":"Write your complete answer to '
        'this file: %s"}}' % (now, path), claude_line(now, "msg_1", 1000)]) + "\n")
    (folder / "a-person.jsonl").write_text(claude_line(now, "msg_2", 5000) + "\n")   # not naming the file
    (folder / "old.jsonl").write_text(claude_line(now, "msg_3", 7000, path) + "\n")
    os.utime(folder / "old.jsonl", (since - 3600, since - 3600))                        # not touched since
    assert figures(m.turn_tokens("programmer", since, until)) == (1000, 0, 20)
    assert m.turn_tokens("tester", since, until) is None                                 # nothing names its file


def test_a_file_the_cli_is_writing_is_read_again_whole_later(home_orch):
    """A last line half written is skipped; read again, it counts."""
    m, home = home_orch
    folder = home / ".claude" / "projects" / m.claude_project_folder(m.WD)
    folder.mkdir(parents=True)
    since = time.time() - 10
    now = m.utc_iso(since + 5, precise=True)
    first = claude_line(now, "msg_1", 1000, str(m.response_path("tester")))
    second = claude_line(now, "msg_2", 3000)
    transcript = folder / "agent.jsonl"
    transcript.write_text(first + "\n" + second[:50])
    assert figures(m.turn_tokens("tester", since, time.time())) == (1000, 0, 20)
    transcript.write_text(first + "\n" + second + "\n")
    assert figures(m.turn_tokens("tester", since, time.time())) == (4000, 0, 40)


def test_a_codex_turn_is_read_from_rollouts_of_any_day_and_a_rotated_one(load_orch, tmp_path):
    """Codex names a rollout after the day its thread began; a new conversation writes a new file."""
    home = tmp_path / "agent-home"
    m = load_orch(AGENT_HOME=str(home), PROVIDER="codex")
    since = time.time() - 10
    now = m.utc_iso(since + 5, precise=True)
    path = str(m.response_path("tester"))
    for day, response, tokens_in in (("2026/11/24", "resp_1", 1000), ("2026/11/25", "resp_2", 2000)):
        rollout = home / ".codex" / "sessions" / day / f"rollout-{response}.jsonl"
        rollout.parent.mkdir(parents=True)
        rollout.write_text(
            '{"timestamp":"%s","type":"response_item","payload":{"type":"message","role":"user","content":'
            '[{"type":"input_text","text":"Write your complete answer to this file: %s"}]}}\n' % (now, path)
            + CODEX_SECOND_RECORD.replace("2026-11-25T12:04:37.748Z", now).replace("resp_scripted_000005", response)
            .replace('"input_tokens":14586', f'"input_tokens":{tokens_in}', 1) + "\n")
    assert figures(m.turn_tokens("tester", since, time.time())) == (3000, 0, 40)


def test_tokens_are_unknown_where_the_records_are_not_on_this_machine(load_orch, tmp_path):
    m = load_orch(API="http://build-server:9889")
    assert not m.token_records_readable()
    assert m.turn_tokens("tester", time.time() - 10, time.time()) is None
    assert load_orch(API="http://127.0.0.1:9889").token_records_readable()
    assert load_orch(PROVIDER="kiro_cli", AGENT_HOME=str(tmp_path)).turn_tokens("tester", 0, time.time()) is None


# --------------------------------------------------------------------------
# GitHub Copilot CLI 1.0.102: ~/.copilot/session-state/<session>/events.jsonl, as it wrote them under CAO
# (autopilot) for one turn against the scripted model: a step that runs the command writing the reply, its
# assistant.turn_end, then a step that calls task_complete.
# --------------------------------------------------------------------------

COPILOT_TURN = [
    '{"type":"user.message","data":{"content":"You are the tester ... Write your complete answer to this file: /w/.tmp/agent-responses/tester_result.md"},"id":"d48715e9","timestamp":"2026-11-26T21:43:25.714Z"}',
    '{"type":"assistant.turn_start","data":{"turnId":"0"},"id":"8f98c4d6","timestamp":"2026-11-26T21:43:25.794Z"}',
    '{"type":"session.usage_record","data":{"usage":{"model":"scripted","inputTokens":18276,"outputTokens":20,'
    '"cacheReadTokens":4569,"cacheWriteTokens":0}},"id":"865af0e4","timestamp":"2026-11-26T21:43:26.109Z"}',
    '{"type":"assistant.turn_end","data":{"turnId":"0"},"id":"5d8c196d","timestamp":"2026-11-26T21:43:26.198Z"}',
    '{"type":"assistant.turn_start","data":{"turnId":"1"},"id":"888fdd4b","timestamp":"2026-11-26T21:43:26.199Z"}',
    '{"type":"session.usage_record","data":{"usage":{"model":"scripted","inputTokens":18411,"outputTokens":20,'
    '"cacheReadTokens":4602,"cacheWriteTokens":0}},"id":"4650a6b5","timestamp":"2026-11-26T21:43:26.256Z"}',
    '{"type":"session.task_complete","data":{"success":true},"id":"b9d5108e","timestamp":"2026-11-26T21:43:26.434Z"}',
    '{"type":"assistant.turn_end","data":{"turnId":"1"},"id":"738b07d7","timestamp":"2026-11-26T21:43:26.435Z"}',
]
COPILOT_START, COPILOT_END = utc("2026-11-26T21:43:25Z"), utc("2026-11-26T21:43:30Z")
# the scripted model reported 13,707 + 13,809 prompt tokens not cached, 4,569 + 4,602 cached, 20 + 20 out
COPILOT_TURN_USE = tokens(13707 + 13809, 4569 + 4602, 40)


def test_copilot_counts_each_usage_record_once_its_cached_part_apart():
    m = run_orchestrator_loop
    assert reading_of(m.copilot_usage, COPILOT_TURN, COPILOT_START, COPILOT_END) == (COPILOT_TURN_USE, True)
    assert reading_of(m.copilot_usage, COPILOT_TURN + COPILOT_TURN[2:3], COPILOT_START, COPILOT_END) == \
        (COPILOT_TURN_USE, True)                                    # an event read twice counts once


def test_a_copilot_step_s_turn_end_is_not_the_end_of_its_task():
    """assistant.turn_end closes each model step; only session.task_complete ends what the loop asked."""
    m = run_orchestrator_loop
    after_first_step = COPILOT_TURN[:4]
    assert reading_of(m.copilot_usage, after_first_step, COPILOT_START, COPILOT_END) == \
        (tokens(13707, 4569, 20), False)
    assert reading_of(m.copilot_usage, COPILOT_TURN[:6], COPILOT_START, COPILOT_END)[1] is False


def test_a_copilot_turn_is_read_from_the_session_log_that_names_its_response_file(load_orch, tmp_path):
    home = tmp_path / "agents-home"
    m = load_orch(AGENT_HOME=str(home), PROVIDER="copilot_cli")
    ours, other = (home / ".copilot" / "session-state" / name for name in ("s-ours", "s-other"))
    for folder in (ours, other):
        folder.mkdir(parents=True)
    (ours / "events.jsonl").write_text("\n".join(COPILOT_TURN) + "\n", encoding="utf-8")
    (other / "events.jsonl").write_text("\n".join(line.replace("tester_result", "programmer_summary")
                                                   for line in COPILOT_TURN) + "\n", encoding="utf-8")
    reading = m.read_copilot_turn("/w/.tmp/agent-responses/tester_result.md", COPILOT_START.timestamp(),
                                  COPILOT_END.timestamp())
    assert (figures(reading), reading.over) == (COPILOT_TURN_USE, True)
    assert m.tokens_readable("tester") and not m.tokenless_note(["copilot_cli"])


# --------------------------------------------------------------------------
# The loop: tokens per turn, role and run; the budget
# --------------------------------------------------------------------------
# The fake agents below act as Codex does: each turn appends its prompt, one token_usage_record per model
# response (input 1000 x the turn's number, 100 of it cached, output 20) and task_complete to the
# terminal's rollout under AGENT_HOME, then writes its answer.

from conftest import FAST, run_main  # noqa: E402
from fake_cao import FAIL_REPLY, PASS_REPLY  # noqa: E402

TESTER_FAIL_THEN_PASS = {**FAST, "MIN_REVIEW_CYCLES_BEFORE_APPROVAL": "1", "START_AGENT": "programmer",
                         "PROVIDER": "codex"}


def rollout_of(home: Path, terminal) -> Path:
    return home / ".codex" / "sessions" / "2026" / "11" / "25" / f"rollout-2026-11-25T12-00-00-{terminal.id}.jsonl"


def usage_record(response_id: str, tokens_in: int, when: str | None = None, turn_id: str = "t") -> str:
    stamp = when or run_orchestrator_loop.utc_iso(time.time(), precise=True)
    return ('{"timestamp":"%s","type":"token_usage_record","payload":{"turn_id":"%s","response_id":"%s","usage":'
            '{"input_tokens":%d,"cached_input_tokens":100,"output_tokens":20}}}' % (stamp, turn_id, response_id,
                                                                                    tokens_in))


def codex_like(home: Path, responses: int = 1):
    """Fake agents that record their turns as Codex does; the log of what they recorded per role."""
    recorded: dict[str, list[tuple[int, int, int]]] = {}

    def step(text: str, model: str = "gpt-5-codex") -> dict:
        def act(fake, terminal):
            number = sum(len(turns) for turns in recorded.values()) + 1
            stamp = run_orchestrator_loop.utc_iso(time.time(), precise=True)
            lines = ['{"timestamp":"%s","type":"turn_context","payload":{"turn_id":"t%d","model":"%s"}}'
                     % (stamp, number, model),
                     '{"timestamp":"%s","type":"response_item","payload":{"role":"user","content":[{"text":'
                     '"Write your complete answer to this file: %s"}]}}' % (stamp, terminal.response_path)]
            lines += [usage_record(f"resp_{number}_{index}", 1000 * number, turn_id=f"t{number}")
                      for index in range(responses)]
            lines.append('{"timestamp":"%s","type":"event_msg","payload":{"type":"task_complete","turn_id":"t%d"}}'
                         % (run_orchestrator_loop.utc_iso(time.time(), precise=True), number))
            rollout = rollout_of(home, terminal)
            rollout.parent.mkdir(parents=True, exist_ok=True)
            with rollout.open("a", encoding="utf-8") as file:
                file.write("\n".join(lines) + "\n")
            recorded.setdefault(terminal.role, []).append(
                ((1000 * number - 100) * responses, 100 * responses, 20 * responses))
            Path(terminal.response_path).write_text(text, encoding="utf-8")
            terminal.last_output = text
            terminal.status = "completed"
        return {"action": "call", "call": act, "text": text}

    return step, recorded


@pytest.fixture
def codex_home(fake_cao, tmp_path):
    """AGENT_HOME with fake agents that record their turns there as Codex does (tester: FAIL, then PASS)."""
    home = tmp_path / "agent-home"
    step, recorded = codex_like(home)
    from fake_cao import DEFAULT_REPLIES
    for role in ("programmer", "peer_programmer"):
        fake_cao.script[role] = [step(DEFAULT_REPLIES[role])]
    fake_cao.script["tester"] = [step(FAIL_REPLY), step(PASS_REPLY)]
    return home, recorded


def summed(uses) -> tuple[int, int, int]:
    return tuple(map(sum, zip(*uses))) if uses else (0, 0, 0)


def test_a_run_reports_the_tokens_of_each_turn_role_and_the_whole_run(load_orch, fake_cao, codex_home,
                                                                        prompt_file, capsys):
    home, recorded = codex_home
    m = load_orch(PROMPT_FILE=str(prompt_file), AGENT_HOME=str(home), **TESTER_FAIL_THEN_PASS,
                  MODEL_PRICES='{"gpt-5-codex": {"input": 2, "cached_input": 0.5, "output": 10}}')
    assert run_main(m) == 0
    state = json.loads(Path(m.STATE_FILE).read_text())
    turns = [(t["role"], (t["tokens"]["input"], t["tokens"]["cached_input"], t["tokens"]["output"]))
             for t in state["turn_records"]]
    expected = [(role, use) for role, uses in recorded.items() for use in uses]
    assert sorted(turns) == sorted(expected) and len(turns) == 6
    assert all(t["tokens_final"] for t in state["turn_records"])
    summary = json.loads(Path(m.run_dir, "summary.json").read_text())
    run_total = summed([use for _, use in expected])
    assert (summary["tokens"]["input"], summary["tokens"]["cached_input"], summary["tokens"]["output"]) == run_total
    assert summary["tokens_unknown_turns"] == 0
    for role, uses in recorded.items():
        figures_ = summary["roles"][role]["tokens"]
        assert (figures_["input"], figures_["cached_input"], figures_["output"]) == summed(uses)
    # the cost: input at 2, cached input at 0.5, output at 10 per million tokens
    assert summary["cost"] == pytest.approx((run_total[0] * 2 + run_total[1] * 0.5 + run_total[2] * 10) / 1e6)
    out = capsys.readouterr().out
    first = recorded["programmer"][0]
    assert f"tokens: {first[0]:,} in + {first[1]:,} cached + {first[2]:,} out" in out
    assert f"summary: tokens used: programmer " in out
    page = Path(m.run_dir, "report.html").read_text()
    assert 'id="tokens-per-turn"' in page and 'data-key="role-tester"' in page and f"{run_total[0]:,}" in page
    code, status = m.status_report()
    assert f"tokens used: {run_total[0]:,} in + {run_total[1]:,} cached + {run_total[2]:,} out" in status


def test_a_response_recorded_after_the_reply_was_taken_counts_in_its_turn(load_orch, fake_cao, codex_home,
                                                                          prompt_file):
    """The CLI records its turn's last response after the loop took the reply (here: while the next
    agent works): the turn's tokens are read up to the role's next send, and stand from then on."""
    home, recorded = codex_home
    late = {}

    def peer_then_late_record(fake, terminal):
        if not late:                     # in round 1
            programmer = fake.terminal_for("programmer")
            with rollout_of(home, programmer).open("a", encoding="utf-8") as file:
                file.write(usage_record("resp_late", 500) + "\n")
            late["added"] = (400, 100, 20)
        Path(terminal.response_path).write_text(fake_cao_reply("peer_programmer"), encoding="utf-8")
        terminal.status = "completed"
    fake_cao.script["peer_programmer"] = [{"action": "call", "call": peer_then_late_record}]
    m = load_orch(PROMPT_FILE=str(prompt_file), AGENT_HOME=str(home), **TESTER_FAIL_THEN_PASS)
    assert run_main(m) == 0
    state = json.loads(Path(m.STATE_FILE).read_text())
    programmer = [t["tokens"] for t in state["turn_records"] if t["role"] == "programmer"]
    first = recorded["programmer"][0]
    assert (programmer[0]["input"], programmer[0]["cached_input"], programmer[0]["output"]) == \
        tuple(a + b for a, b in zip(first, late["added"]))


def test_turns_end_when_the_cli_records_their_end_and_by_the_screen_where_its_records_are_out_of_reach(
        load_orch, fake_cao, codex_home, prompt_file, capsys, tmp_path):
    """Codex's ready status counts for nothing: its rollout's task_complete ends each turn; with AGENT_HOME
    elsewhere the same turns end by the screen, and the log says which rule ended each."""
    home, _ = codex_home
    m = load_orch(PROMPT_FILE=str(prompt_file), AGENT_HOME=str(home), **TESTER_FAIL_THEN_PASS)
    assert run_main(m) == 0
    out = capsys.readouterr().out
    ends = re.findall(r"turn end seen by ([^,]+), kept as", out)
    assert ends == [m.TURN_ENDED_BY_RECORD] * 6, ends
    # each reply's line says how long before it was taken the CLI recorded its turn's end: the loop's part
    lags = [float(lag) for lag in re.findall(r"; its CLI recorded the turn's end ([\d.]+)s before\)$", out, re.M)]
    assert len(lags) == 6 and all(0 <= lag < 30 for lag in lags), out


def test_without_its_records_a_turn_ends_by_the_screen_rules(load_orch, fake_cao, codex_home, prompt_file, capsys,
                                                            tmp_path):
    elsewhere = tmp_path / "another-home"
    elsewhere.mkdir()
    m = load_orch(PROMPT_FILE=str(prompt_file), AGENT_HOME=str(elsewhere), QUIET_SCREEN_SECONDS="0.2",
                  **TESTER_FAIL_THEN_PASS)
    assert run_main(m) == 0
    ends = re.findall(r"turn end seen by ([^,]+), kept as", capsys.readouterr().out)
    assert len(ends) == 6 and set(ends) <= {m.TURN_ENDED_BY_MARK, m.TURN_ENDED_BY_STILL_SCREEN}, ends


def fake_cao_reply(role: str) -> str:
    from fake_cao import DEFAULT_REPLIES
    return DEFAULT_REPLIES[role]


def test_a_run_without_readable_records_says_unknown_never_zero(load_orch, fake_cao, prompt_file, capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), **TESTER_FAIL_THEN_PASS)      # CAO on another machine
    fake_cao.script["tester"] = [FAIL_REPLY, PASS_REPLY]
    assert run_main(m) == 0
    summary = json.loads(Path(m.run_dir, "summary.json").read_text())
    assert summary["tokens"] is None and summary["tokens_unknown_turns"] == 6
    assert all(turn["tokens"] is None for turn in summary["turn_list"])
    assert "tokens: unknown)" in capsys.readouterr().out
    assert "tokens used: unknown" in m.status_report()[1]


def test_a_cli_that_records_no_tokens_is_said_once_not_on_every_line_and_table(load_orch, fake_cao, prompt_file,
                                                                             capsys):
    m = load_orch(PROMPT_FILE=str(prompt_file), **{**TESTER_FAIL_THEN_PASS, "PROVIDER": "mock_cli"})
    fake_cao.script["tester"] = [FAIL_REPLY, PASS_REPLY]
    assert run_main(m) == 0
    out = capsys.readouterr().out
    assert out.count("mock_cli records no tokens") == 1
    assert "mock_cli records no tokens: their turns' tokens are not counted" in out
    assert "tokens: unknown" not in out and "tokens used" not in out
    assert out.count("reply received") == 6
    page = Path(m.run_dir, "report.html").read_text()
    assert "Not counted: mock_cli records no tokens." in page
    assert 'id="tokens-per-turn"' not in page and "unknown" not in page
    assert "tokens used: not counted (mock_cli records no tokens)" in m.status_report()[1]


def test_a_budget_reached_stops_before_the_next_turn_and_a_higher_one_goes_on(load_orch, fake_cao, codex_home,
                                                                               prompt_file, capsys):
    """After three turns the run has used 1,020 + 2,020 + 3,020 tokens: with MAX_RUN_TOKENS=6000 the
    programmer's round-2 prompt is not sent; the state is saved, and a rerun with a higher budget sends
    it -- no turn is sent twice."""
    home, recorded = codex_home
    settings = {"PROMPT_FILE": str(prompt_file), "AGENT_HOME": str(home), **TESTER_FAIL_THEN_PASS}
    m = load_orch(MAX_RUN_TOKENS="6000", **settings)
    assert run_main(m) == 4
    err = capsys.readouterr().err
    line = [text for text in err.splitlines() if "MAX_RUN_TOKENS" in text]
    assert line == ["error: the run has used 6,060 tokens (5,700 in + 300 cached + 60 out), its budget is "
                    "MAX_RUN_TOKENS=6000; state saved: rerun with a higher MAX_RUN_TOKENS to go on with the "
                    "programmer's turn"]
    state = json.loads(Path(m.STATE_FILE).read_text())
    assert state["final_status"] == "RUNNING" and state["in_flight"] is None and len(state["turn_records"]) == 3
    assert [role for role, _ in fake_cao.prompts] == ["programmer", "peer_programmer", "tester"]
    m = load_orch(MAX_RUN_TOKENS="100000", **settings)
    assert run_main(m) == 0
    assert [role for role, _ in fake_cao.prompts] == ["programmer", "peer_programmer", "tester"] * 2
    assert len(json.loads(Path(m.STATE_FILE).read_text())["turn_records"]) == 6


def test_a_cost_budget_stops_the_run_and_a_model_without_a_price_is_named(load_orch, fake_cao, codex_home,
                                                                          prompt_file, capsys):
    home, _ = codex_home
    settings = {"PROMPT_FILE": str(prompt_file), "AGENT_HOME": str(home), **TESTER_FAIL_THEN_PASS}
    m = load_orch(MAX_RUN_COST="0.01", MODEL_PRICES='{"gpt-5-codex": {"input": 5, "output": 10}}', **settings)
    assert run_main(m) == 4              # 2,800 in and 200 cached at 5, 40 out at 10: 0.0154 after two turns
    assert "its budget is MAX_RUN_COST=0.01; state saved: rerun with a higher MAX_RUN_COST to go on with the " \
           "tester's turn" in capsys.readouterr().err
    m = load_orch(MAX_RUN_COST="1", MODEL_PRICES='{"gpt-5": {"input": 5, "output": 10}}', **settings)
    assert run_main(m) == 2              # its CLI's default model, unpriced: a setting to change, not the budget
    assert "error: MAX_RUN_COST cannot be kept: MODEL_PRICES has no price for gpt-5-codex (the agents' model); add " \
           "it, then rerun to go on with the tester's turn" in capsys.readouterr().err
    assert [role for role, _ in fake_cao.prompts] == ["programmer", "peer_programmer"]


@pytest.mark.parametrize("env, words", [
    ({"MAX_RUN_TOKENS": "1000"}, "not this one: set AGENT_HOME"),
    ({"MAX_RUN_TOKENS": "1000", "PROVIDER": "kiro_cli", "AGENT_HOME": "/tmp"}, "not kiro_cli"),
    ({"MAX_RUN_COST": "2"}, "MAX_RUN_COST needs MODEL_PRICES"),
    ({"MAX_RUN_COST": "2", "MODEL": "gpt-5.1-codex", "TESTER_MODEL": "gpt-5.1-codex-mini", "AGENT_HOME": "/tmp",
      "MODEL_PRICES": '{"gpt-5.1-codex": {"input": 1.25, "output": 10}}'}, "it has none for gpt-5.1-codex-mini"),
    ({"MODEL_PRICES": "{not json"}, "MODEL_PRICES"),
    ({"MODEL_PRICES": '{"m": {"input": -1, "output": 1}}'}, "MODEL_PRICES"),
    ({"MODEL_PRICES": '{"m": {"input": 1}}'}, "MODEL_PRICES"),
])
def test_a_budget_that_cannot_be_kept_is_refused_before_anything_starts(load_orch, fake_cao, prompt_file, capsys,
                                                                        env, words):
    m = load_orch(PROMPT_FILE=str(prompt_file), **{**FAST, **env})
    assert run_main(m) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err
    assert fake_cao.prompts == [] and not Path(m.STATE_FILE).exists()


def test_at_the_runs_end_the_last_turns_are_read_once_their_cli_has_recorded_their_end(load_orch, fake_cao,
                                                                                        codex_home, prompt_file):
    """The tester's PASS is taken before its CLI has recorded the turn's last response: the run's figures
    wait (up to TOKENS_SETTLE_SECONDS) for the CLI's end-of-turn record, and count that response."""
    home, recorded = codex_home
    step, _ = codex_like(home)

    def pass_then_late_response(fake, terminal):
        Path(terminal.response_path).write_text(PASS_REPLY, encoding="utf-8")
        terminal.last_output, terminal.status = PASS_REPLY, "completed"

        def later():
            time.sleep(0.5)
            with rollout_of(home, terminal).open("a", encoding="utf-8") as file:
                file.write(usage_record("resp_closing", 9000) + "\n" + '{"timestamp":"%s","type":"event_msg",'
                           '"payload":{"type":"task_complete","turn_id":"t"}}\n'
                           % run_orchestrator_loop.utc_iso(time.time(), precise=True))
        threading.Thread(target=later, daemon=True).start()
    fake_cao.script["tester"] = [step(FAIL_REPLY), {"action": "call", "call": pass_then_late_response}]
    m = load_orch(PROMPT_FILE=str(prompt_file), AGENT_HOME=str(home), **TESTER_FAIL_THEN_PASS)
    assert run_main(m) == 0
    last = json.loads(Path(m.STATE_FILE).read_text())["turn_records"][-1]
    assert last["role"] == "tester" and last["tokens_final"]
    assert (last["tokens"]["input"], last["tokens"]["cached_input"], last["tokens"]["output"]) == (8900, 100, 20)


def test_a_claude_turn_counts_the_sub_agents_its_session_ran(home_orch):
    """Claude Code's Task tool runs a sub-agent whose responses go to a transcript of its own, beside the
    session's (<session>/subagents/agent-*.jsonl), which does not name the turn's file."""
    m, home = home_orch
    folder = home / ".claude" / "projects" / m.claude_project_folder(m.WD)
    (folder / "agent" / "subagents").mkdir(parents=True)
    since = time.time() - 10
    now = m.utc_iso(since + 5, precise=True)
    (folder / "agent.jsonl").write_text(claude_line(now, "msg_1", 1000, str(m.response_path("analyst"))) + "\n")
    (folder / "agent" / "subagents" / "agent-a1.jsonl").write_text(
        claude_line(now, "msg_2", 3000).replace('"type":"assistant"', '"isSidechain":true,"type":"assistant"') + "\n")
    (folder / "other" / "subagents").mkdir(parents=True)        # another session's sub-agent
    (folder / "other" / "subagents" / "agent-b2.jsonl").write_text(claude_line(now, "msg_3", 5000) + "\n")
    assert figures(m.turn_tokens("analyst", since, time.time())) == (4000, 0, 40)


def test_tokens_read_once_stay_when_the_cli_removes_its_records(load_orch, fake_cao, codex_home, prompt_file):
    """Codex moves a thread it archives out of sessions/: what the loop read of its turns stays."""
    home, recorded = codex_home

    def archive_programmers_rollout(fake, terminal):
        if fake.turns["peer_programmer"] == 1:                # in round 1
            for rollout in (home / ".codex" / "sessions").rglob(f"*{fake.terminal_for('programmer').id}.jsonl"):
                rollout.unlink()
        Path(terminal.response_path).write_text(fake_cao_reply("peer_programmer"), encoding="utf-8")
        terminal.status = "completed"
    fake_cao.script["peer_programmer"] = [{"action": "call", "call": archive_programmers_rollout}]
    m = load_orch(PROMPT_FILE=str(prompt_file), AGENT_HOME=str(home), **TESTER_FAIL_THEN_PASS)
    assert run_main(m) == 0
    first = json.loads(Path(m.STATE_FILE).read_text())["turn_records"][0]
    assert first["role"] == "programmer" and (first["tokens"]["input"], first["tokens"]["cached_input"],
                                              first["tokens"]["output"]) == recorded["programmer"][0]


def test_record_lines_are_parsed_once_and_the_memory_starts_over_at_its_limit(monkeypatch):
    """The wait reads a session's records every half second: a line already parsed is not parsed again."""
    m = run_orchestrator_loop
    calls = []
    real_loads = m.json.loads
    monkeypatch.setattr(m.json, "loads", lambda text: calls.append(text) or real_loads(text))
    lines = m.ParsedLines(limit=100)
    assert lines.get('{"a": 1}') == {"a": 1} and lines.get('{"a": 1}') == {"a": 1} and len(calls) == 1
    assert lines.get('{"a": ') is None and lines.get('{"a": 2}') == {"a": 2}     # a line still being written
    lines.get('{"b": "' + "x" * 90 + '"}')                                       # past the limit: starts over
    assert '{"a": 1}' not in lines.records and lines.chars <= 100


# --------------------------------------------------------------------------
# A long session's file is read from the turn's lines on
# --------------------------------------------------------------------------

def timed_line(moment: float, text: str = "x") -> str:
    return json.dumps({"timestamp": run_orchestrator_loop.utc_iso(moment, precise=True), "text": text})


def test_a_record_file_is_read_from_a_little_before_the_turn_not_whole(tmp_path):
    m = run_orchestrator_loop
    start = time.time() - 20_000
    lines = ['{"type":"session_meta","payload":{}}']                      # a header without a time
    lines += [timed_line(start + second, "earlier turns " * 20) for second in range(0, 19_000, 2)]
    since = start + 19_500
    lines += [timed_line(since - 5, "just before"), '{"no":"time"}', timed_line(since + 1, "the turn")]
    path = tmp_path / "rollout.jsonl"
    path.write_text("\n".join(lines) + "\n" + '{"timestamp":"partial', encoding="utf-8")
    offset = m.turn_offset(path, since)
    head = path.read_bytes()[:offset].decode()
    tail = path.read_bytes()[offset:].decode()
    assert "just before" in tail and "the turn" in tail                  # every line of the window is read
    assert len(tail) < 10_000 < len(head)                                 # and not the session's 3 MB
    assert head.endswith("\n") and all(json.loads(line)["timestamp"] for line in head.splitlines()[1:])
    assert m._file_text(path, since) == tail and m._file_text(path) == path.read_text()


def test_a_record_file_without_times_or_rewritten_is_read_from_its_start(tmp_path):
    m = run_orchestrator_loop
    path = tmp_path / "session.jsonl"
    path.write_text("\n".join('{"n": %d}' % n for n in range(5000)) + "\n", encoding="utf-8")
    assert m.turn_offset(path, time.time()) == 0                        # no times: nothing can be skipped
    old = time.time() - 10_000
    path.write_text("\n".join(timed_line(old + n) for n in range(3000)) + "\n", encoding="utf-8")
    assert m.turn_offset(path, old + 2900) > 0
    replaced = tmp_path / "replaced.jsonl"                                # a file written anew in its place
    replaced.write_text(timed_line(old) + "\n" + timed_line(old + 2950) + "\n", encoding="utf-8")
    replaced.replace(path)
    assert m._file_text(path, old + 2900) == path.read_text()
    assert m.turn_offset(tmp_path / "missing.jsonl", old) == 0


def test_a_budget_run_whose_turn_left_no_readable_record_stops_before_the_next_turn(load_orch, fake_cao, codex_home,
                                                                                    prompt_file, capsys):
    """The peer programmer's turn leaves no record: under MAX_RUN_TOKENS the run does not go on counting less
    than was spent -- the tester's turn is not sent, the line names the turn, the state is saved (exit 2: the
    same command would find the same record missing); without a budget the same state goes on."""
    home, _ = codex_home
    fake_cao.script["peer_programmer"] = [fake_cao_reply("peer_programmer")]          # answers, records nothing
    settings = {"PROMPT_FILE": str(prompt_file), "AGENT_HOME": str(home), **TESTER_FAIL_THEN_PASS}
    m = load_orch(MAX_RUN_TOKENS="1000000", **settings)
    assert run_main(m) == 2
    err = capsys.readouterr().err
    assert "error: the tokens of turn 2 (the peer_programmer's, terminal" in err
    assert "cannot be read from its CLI's records (codex rollouts)" in err and "tester's turn was not sent" in err
    state = json.loads(Path(m.STATE_FILE).read_text())
    assert state["final_status"] == "RUNNING" and state["in_flight"] is None and len(state["turn_records"]) == 2
    assert [role for role, _ in fake_cao.prompts] == ["programmer", "peer_programmer"]
    m = load_orch(**settings)
    assert run_main(m) == 0
    assert [role for role, _ in fake_cao.prompts][:3] == ["programmer", "peer_programmer", "tester"]


# --------------------------------------------------------------------------
# The model of a turn: the one its last response named, as each CLI records it
# --------------------------------------------------------------------------

def test_a_claude_turn_s_model_is_the_one_its_last_response_named():
    m = run_orchestrator_loop
    assert m.claude_usage(CLAUDE_TURN, TURN_START, TURN_END).model == "claude-sonnet-4-5"
    switched = [*CLAUDE_TURN[:-2], CLAUDE_TURN[-2].replace('"model":"claude-sonnet-4-5"', '"model":"claude-haiku-4-5"'),
                CLAUDE_TURN[-1]]
    reading = m.claude_usage(switched, TURN_START, TURN_END)
    assert reading.model == "claude-haiku-4-5" and list(reading.by_model) == ["claude-sonnet-4-5", "claude-haiku-4-5"]


def test_a_codex_turn_s_model_is_the_one_its_turn_context_named():
    """Codex names the model on each turn's turn_context line: a turn continued after a switch to another
    model (a new turn id) records the other one."""
    m = run_orchestrator_loop
    context = CODEX_TURN[1].replace('"cwd"', '"model":"gpt-5.5","cwd"')
    assert m.codex_usage([CODEX_TURN[0], context, *CODEX_TURN[2:]], TURN_START, TURN_END).model == "gpt-5.5"
    later = [line.replace("e797", "f000").replace("resp_scripted_000005", "resp_scripted_000007")
             .replace("12:04:37", "12:04:45") for line in (context, CODEX_SECOND_RECORD)]
    later[0] = later[0].replace('"gpt-5.5"', '"gpt-6-luna"')
    reading = m.codex_usage([CODEX_TURN[0], context, *CODEX_TURN[2:], *later], TURN_START, TURN_END)
    assert reading.model == "gpt-6-luna" and list(reading.by_model) == ["gpt-5.5", "gpt-6-luna"]
    assert m.codex_usage(CODEX_TURN, TURN_START, TURN_END).model == ""       # a turn_context without a model


def test_a_copilot_turn_s_model_is_the_one_its_last_usage_record_named():
    m = run_orchestrator_loop
    assert m.copilot_usage(COPILOT_TURN, COPILOT_START, COPILOT_END).model == "scripted"
    switched = [*COPILOT_TURN[:5], COPILOT_TURN[5].replace('"model":"scripted"', '"model":"scripted-mini"'),
                *COPILOT_TURN[6:]]
    assert m.copilot_usage(switched, COPILOT_START, COPILOT_END).model == "scripted-mini"


def test_an_opencode_turn_s_model_is_the_one_its_last_message_named(tmp_path):
    m = run_orchestrator_loop
    path = opencode_db(tmp_path)
    reading = m.opencode_usage(path, PROJECT, "agent-responses/", OPENCODE_START, OPENCODE_END)
    assert reading.model == "scripted"
    with contextlib.closing(sqlite3.connect(path)) as connection, connection:       # its last completed message named another model
        connection.execute("UPDATE message SET data = json_set(data, '$.modelID', 'scripted-mini')"
                           " WHERE json_extract(data, '$.time.completed') = 1795609657000")
    assert m.opencode_usage(path, PROJECT, "agent-responses/", OPENCODE_START, OPENCODE_END).model == "scripted-mini"


# --------------------------------------------------------------------------
# A model its CLI changed on its own: said, recorded, and the role's next turn not sent to it
# --------------------------------------------------------------------------

def test_each_turn_s_model_is_kept_in_the_state_summary_report_and_events(load_orch, fake_cao, codex_home,
                                                                          prompt_file, capsys):
    home, _ = codex_home
    m = load_orch(PROMPT_FILE=str(prompt_file), AGENT_HOME=str(home), **TESTER_FAIL_THEN_PASS)
    assert run_main(m) == 0
    state = json.loads(Path(m.STATE_FILE).read_text())
    assert [t["model"] for t in state["turn_records"]] == ["gpt-5-codex"] * 6
    summary = json.loads(Path(m.run_dir, "summary.json").read_text())
    assert [t["model"] for t in summary["turn_list"]] == ["gpt-5-codex"] * 6
    events = [json.loads(line) for line in Path(m.run_dir, "events.jsonl").read_text().splitlines()]
    assert [e["model"] for e in events if e["event"] == "reply_taken"] == ["gpt-5-codex"] * 6
    assert capsys.readouterr().out.count("; model: gpt-5-codex") == 6
    page = Path(m.run_dir, "report.html").read_text()
    assert 'title="1: programmer, round 1, , model gpt-5-codex"' in page and "; model gpt-5-codex</summary>" in page
    assert "model changed" not in json.dumps(summary["agent_events"])


def model_switching_run(fake_cao, home: Path, programmer_models: tuple[str, ...]):
    """The scripted agents of a FAIL-then-PASS run recording as Codex does; the programmer's turns name
    the given models."""
    step, _ = codex_like(home)
    from fake_cao import DEFAULT_REPLIES
    fake_cao.script["programmer"] = [step(DEFAULT_REPLIES["programmer"], model) for model in programmer_models]
    fake_cao.script["peer_programmer"] = [step(DEFAULT_REPLIES["peer_programmer"])]
    fake_cao.script["tester"] = [step(FAIL_REPLY), step(PASS_REPLY)]


def test_a_model_changed_by_the_cli_stops_the_run_before_the_role_s_next_turn(load_orch, fake_cao, prompt_file,
                                                                               tmp_path, capsys):
    """MODEL=gpt-5-codex, and the programmer's first turn went out on gpt-6-luna (Codex's offer taken at
    a usage limit): one line says so, the agent event records it, and the programmer's round-2 prompt is
    not sent (exit 2, the state saved); rerun with REPLACE_LOST_AGENTS=1, a new agent with gpt-5-codex
    takes the turn and the run goes on."""
    home = tmp_path / "agent-home"
    model_switching_run(fake_cao, home, ("gpt-6-luna", "gpt-5-codex"))
    settings = {"PROMPT_FILE": str(prompt_file), "AGENT_HOME": str(home), "MODEL": "gpt-5-codex",
                **TESTER_FAIL_THEN_PASS}
    m = load_orch(**settings)
    assert run_main(m) == 2
    out, err = capsys.readouterr()
    said = [line for line in out.splitlines() if "its model changed" in line]
    assert len(said) == 1 and "programmer" in said[0]
    assert "its model changed from gpt-5-codex to gpt-6-luna in turn 1 (round 1)" in said[0]
    assert "the run stops before its next turn" in said[0]
    assert "went on with another model than it was started with, from gpt-5-codex to gpt-6-luna" in err
    assert "--check names the setting" in err and "REPLACE_LOST_AGENTS=1" in err
    assert [role for role, _ in fake_cao.prompts] == ["programmer", "peer_programmer", "tester"]
    state = json.loads(Path(m.STATE_FILE).read_text())
    assert state["final_status"] == "RUNNING" and len(state["turn_records"]) == 3
    changed = [e for e in state["agent_events"] if e["what"] == "model changed"]
    assert [(e["role"], e["detail"]) for e in changed] == [
        ("programmer", "from gpt-5-codex to gpt-6-luna in turn 1 (round 1)")]
    events = [json.loads(line) for line in Path(m.run_dir, "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "agent_event" and e["what"] == "model changed" for e in events)
    old_terminal = changed[0]["terminal"]

    m = load_orch(**settings)                       # the same command again: it stops again, sends nothing
    assert run_main(m) == 2
    assert len(fake_cao.prompts) == 3
    capsys.readouterr()

    m = load_orch(**settings, REPLACE_LOST_AGENTS="1")
    assert run_main(m) == 0
    state = json.loads(Path(m.STATE_FILE).read_text())
    assert [role for role, _ in fake_cao.prompts] == ["programmer", "peer_programmer", "tester"] * 2
    assert state["terminals"]["programmer"] != old_terminal
    assert state["turn_records"][3]["model"] == "gpt-5-codex"
    fresh = [e for e in state["agent_events"] if e["what"] == "new conversation"]
    assert len(fresh) == 1 and "its model changed from gpt-5-codex to gpt-6-luna" in fresh[0]["detail"]


def test_without_a_model_chosen_a_change_from_the_first_model_seen_is_said(load_orch, fake_cao, prompt_file,
                                                                           tmp_path, capsys):
    """No MODEL: the first model the agent's CLI recorded stands for its default; a later turn on another is
    said and recorded, and a new agent takes the next turn with REPLACE_LOST_AGENTS=1."""
    home = tmp_path / "agent-home"
    model_switching_run(fake_cao, home, ("gpt-5-codex", "gpt-6-luna"))
    m = load_orch(PROMPT_FILE=str(prompt_file), AGENT_HOME=str(home), REPLACE_LOST_AGENTS="1",
                  **TESTER_FAIL_THEN_PASS)
    assert run_main(m) == 0
    out = capsys.readouterr().out
    assert "its model changed from gpt-5-codex (its CLI's default) to gpt-6-luna in turn 4 (round 2), and not by " \
           "the run's settings: a new agent with the chosen model takes its next turn" in out
    summary = json.loads(Path(m.run_dir, "summary.json").read_text())
    assert [t["model"] for t in summary["turn_list"] if t["role"] == "programmer"] == ["gpt-5-codex", "gpt-6-luna"]
    assert [e["what"] for e in summary["agent_events"]] == ["model changed"]
    assert "model changed" in Path(m.run_dir, "report.html").read_text()


def test_without_a_model_chosen_a_switch_in_an_agent_s_first_turn_shows_against_the_others(load_orch, fake_cao,
                                                                                            prompt_file, tmp_path,
                                                                                            capsys):
    """The tester's first turn is on another model than the other agents of the same CLI, all started with
    its default: said, and the run stops before the tester's next turn."""
    home = tmp_path / "agent-home"
    step, _ = codex_like(home)
    from fake_cao import DEFAULT_REPLIES
    fake_cao.script["programmer"] = [step(DEFAULT_REPLIES["programmer"])]
    fake_cao.script["peer_programmer"] = [step(DEFAULT_REPLIES["peer_programmer"])]
    fake_cao.script["tester"] = [step(FAIL_REPLY, "gpt-6-luna"), step(PASS_REPLY)]
    m = load_orch(PROMPT_FILE=str(prompt_file), AGENT_HOME=str(home), **TESTER_FAIL_THEN_PASS)
    assert run_main(m) == 2
    assert "tester: its model changed from gpt-5-codex (its CLI's default) to gpt-6-luna in turn 3 (round 1)" \
        in capsys.readouterr().out
    assert [role for role, _ in fake_cao.prompts] == \
        ["programmer", "peer_programmer", "tester", "programmer", "peer_programmer"]


def test_only_the_model_of_the_agent_s_own_last_response_counts_as_its_model(monkeypatch):
    """A sub-agent it ran (Claude Code's Task tool) may use another model: its tokens count, it is no change."""
    m = run_orchestrator_loop
    use = m.TokenUse(100, 0, 10)
    turn = m.TurnRecord("programmer", 1, 1.0, 10, terminal="t1", model="claude-sonnet-4-5",
                        tokens={"claude-haiku-4-5": use, "claude-sonnet-4-5": use})
    monkeypatch.setattr(m, "turn_records", [turn])
    monkeypatch.setattr(m, "terminal_ids", {"programmer": "t1"})
    monkeypatch.setattr(m, "agent_models", {"programmer": "claude-sonnet-4-5"})
    assert m.model_change(0) is None
    monkeypatch.setattr(m, "agent_models", {"programmer": ""})          # its CLI's default: the first model seen
    assert m.model_change(0) is None
    monkeypatch.setattr(m, "turn_records", [turn, m.TurnRecord("programmer", 2, 1.0, 10, terminal="t1",
                                                               model="claude-haiku-4-5")])
    assert m.model_change(1) == ("claude-sonnet-4-5 (its CLI's default)", "claude-haiku-4-5")
    monkeypatch.setattr(m, "terminal_ids", {"programmer": "t2"})        # a turn of an agent since replaced
    assert m.model_change(1) is None


def test_a_dated_id_of_a_priced_model_is_priced_as_the_rows_model_names_rule_says_it_is_that_model(load_orch):
    """Claude Code records `claude-sonnet-4-5-20250929` for `claude-sonnet-4-5`: the price of the model asked
    for is its price (the same rule that says it is the model asked for); a sibling model is not priced."""
    m = load_orch(MODEL_PRICES='{"claude-sonnet-4-5": {"input": 3, "output": 15}}')
    use = m.TokenUse(input=1_000_000, output=100_000)
    assert m.cost_of({"claude-sonnet-4-5-20250929": use}) == m.cost_of({"claude-sonnet-4-5": use}) == 4.5
    assert m.cost_of({"claude-sonnet-4-6": use}) is None
    assert m.cost_of({"claude-sonnet-4-5-20250929": use, "claude-sonnet-4-6": use}) is None
