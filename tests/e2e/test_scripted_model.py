"""The scripted model endpoint, driven with plain HTTP requests in each API dialect it speaks."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

import pytest

from .scripted_model import ScriptedModel, write_command

SHELL_TOOL_ANTHROPIC = {"name": "Bash", "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}
EXEC_COMMAND = {"type": "function", "name": "exec_command",
                "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}
SHELL_ARRAY = {"type": "function", "name": "shell",
               "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}}}}


@pytest.fixture
def model(tmp_path):
    with ScriptedModel(think_seconds=0.0, log_dir=tmp_path / "log") as m:
        yield m


def post(url: str, payload: dict, headers: dict | None = None) -> tuple[int, bytes]:
    """POST JSON and return (status, body), also for error statuses."""
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def sse(body: bytes) -> list[dict]:
    """The data payloads of a server-sent-events body."""
    return [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: ")]


def prompt_text(path, extra: str = "") -> str:
    return f"Please do the work.{extra}\nWrite your complete answer to this file: {path}"


class AnthropicChat:
    """A conversation as Claude Code keeps it: the whole history goes with every request."""

    def __init__(self, model: ScriptedModel, stream: bool = True):
        self.model, self.stream, self.messages = model, stream, []

    def send(self, content) -> tuple[int, list[dict]]:
        self.messages.append({"role": "user", "content": content})
        return self.request()

    def request(self, tools=(SHELL_TOOL_ANTHROPIC,)) -> tuple[int, list[dict]]:
        body = {"model": "m", "stream": self.stream, "max_tokens": 100, "tools": list(tools),
                "messages": self.messages + [{"role": "system", "content": "noise"}]}
        status, raw = post(self.model.url + "/v1/messages", body)
        if status != 200:
            return status, [json.loads(raw)]
        if not self.stream:
            return status, json.loads(raw)["content"]
        blocks: list[dict] = []
        for ev in sse(raw):
            if ev["type"] == "content_block_start":
                blocks.append(dict(ev["content_block"]))
            elif ev["type"] == "content_block_delta":
                d = ev["delta"]
                if d["type"] == "text_delta":
                    blocks[ev["index"]]["text"] += d["text"]
                else:
                    blocks[ev["index"]]["input"] = json.loads(d["partial_json"])
        return status, blocks

    def run_tools(self, blocks) -> tuple[int, list[dict]]:
        """Run the tool call like the CLI would and send back its result."""
        self.messages.append({"role": "assistant", "content": blocks})
        uses = [b for b in blocks if b["type"] == "tool_use"]
        assert len(uses) == 1
        subprocess.run(["bash", "-c", uses[0]["input"]["command"]], check=True)
        self.messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": uses[0]["id"], "content": "(Bash completed with no output)"}]})
        return self.request()


class CodexChat:
    """A conversation as Codex keeps it, sent as Responses API input items."""

    def __init__(self, model: ScriptedModel, tools=(EXEC_COMMAND,)):
        self.model, self.tools = model, list(tools)
        self.items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
                      {"type": "message", "role": "user",
                       "content": [{"type": "input_text", "text": "<environment_context>x</environment_context>"}]}]

    def send(self, text: str) -> tuple[int, list[dict]]:
        self.items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
        return self.request()

    def request(self) -> tuple[int, list[dict]]:
        status, raw = post(self.model.url + "/v1/responses",
                           {"model": "scripted", "stream": True, "input": self.items, "tools": self.tools})
        if status != 200:
            return status, [json.loads(raw)]
        events = sse(raw)
        assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert done == events[-1]["response"]["output"]
        return status, done

    def run_tools(self, items) -> tuple[int, list[dict]]:
        self.items.extend(items)
        calls = [i for i in items if i["type"] == "function_call"]
        assert len(calls) == 1
        args = json.loads(calls[0]["arguments"])
        argv = args["command"] if "command" in args else ["bash", "-c", args["cmd"]]
        # Codex's `bash -lc` reads the login files of HOME: an empty one, as a test's agents have, not the
        # machine's (whose own start-up, e.g. `pyenv init`, may wait on a lock another shell holds).
        with tempfile.TemporaryDirectory() as home:
            subprocess.run(argv, check=True, env={**os.environ, "HOME": home})
        self.items.append({"type": "function_call_output", "call_id": calls[0]["call_id"], "output": "exit 0"})
        return self.request()


OPENCODE_TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {
    "command": {"type": "string"}, "description": {"type": "string"}}}}} for name in ("read", "bash", "write")]


class OpenCodeChat:
    """A conversation as OpenCode keeps it: chat completions, its session id in a header."""

    def __init__(self, model: ScriptedModel, session: str = "ses_1"):
        self.model, self.session = model, session
        self.messages = [{"role": "system", "content": "You are opencode."}]

    def send(self, text: str) -> tuple[int, dict]:
        self.messages.append({"role": "user", "content": [{"type": "text", "text": text}]})
        return self.request()

    def request(self) -> tuple[int, dict]:
        """The streamed chunks put back together: {"content": str, "tool_calls": [...], "finish": str}."""
        status, raw = post(self.model.url + "/v1/chat/completions",
                           {"model": "scripted", "stream": True, "stream_options": {"include_usage": True},
                            "messages": self.messages, "tools": OPENCODE_TOOLS},
                           headers={"x-session-id": self.session})
        if status != 200:
            return status, json.loads(raw)
        assert raw.decode().rstrip().endswith("data: [DONE]")
        chunks = [c for c in sse(raw.replace(b"data: [DONE]", b""))]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0
        message = {"content": "", "tool_calls": [], "finish": None}
        for chunk in chunks[:-1]:
            choice = chunk["choices"][0]
            message["content"] += choice["delta"].get("content") or ""
            message["tool_calls"] += choice["delta"].get("tool_calls") or []
            message["finish"] = choice["finish_reason"] or message["finish"]
        return status, message

    def run_tools(self, message: dict) -> tuple[int, dict]:
        calls = message["tool_calls"]
        assert len(calls) == 1 and calls[0]["function"]["name"] == "bash"
        subprocess.run(["bash", "-c", json.loads(calls[0]["function"]["arguments"])["command"]], check=True)
        self.messages.append({"role": "assistant", "content": "", "tool_calls": [
            {k: v for k, v in calls[0].items() if k != "index"}]})
        self.messages.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": "exit 0"})
        return self.request()


def test_opencode_chat_prompt_bash_call_then_final_text(model, tmp_path):
    """OpenCode's dialect: the prompt is answered with one streamed `bash` call, its result with text."""
    target = tmp_path / "deep" / "analyst_review.md"
    model.set_script({"peer_analyst": ["APPROVED\n"]})
    chat = OpenCodeChat(model)
    status, message = chat.send(prompt_text(target))
    assert status == 200 and message["finish"] == "tool_calls" and message["content"] == ""
    status, message = chat.run_tools(message)
    assert target.read_text() == "APPROVED\n"
    assert message["finish"] == "stop" and str(target) in message["content"] and message["tool_calls"] == []
    assert [(e["api"], e["kind"], e["action"]) for e in model.events()] == [
        ("chat", "prompt", "write"), ("chat", "tool_result", "text")]


def test_opencode_sessions_tell_a_new_agent_from_a_retry(model, tmp_path):
    """The same prompt again in the same OpenCode session is a retry (no step); in a new session
    (a replaced agent) it is a new turn and takes the next step."""
    target = tmp_path / "test_result.md"
    model.set_script({"tester": ["one\n", "two\n"]})
    for session, expected in (("ses_a", "one\n"), ("ses_a", "one\n"), ("ses_b", "two\n")):
        chat = OpenCodeChat(model, session)
        _, message = chat.send(prompt_text(target))
        chat.run_tools(message)
        assert target.read_text() == expected
    assert model.turns() == {"tester": 2}


def test_opencode_rate_limited_gets_an_openai_error_body(model, tmp_path):
    model.fail_next(1, status=429)
    status, body = OpenCodeChat(model).send(prompt_text(tmp_path / "test_result.md"))
    assert status == 429 and body["error"]["type"] == "rate_limit_exceeded"


def test_anthropic_prompt_tool_call_then_final_text(model, tmp_path):
    target = tmp_path / "deep" / "dir" / "test_result.md"
    text = "RESULT: FAIL\nline with 'quotes' and $HOME and `ticks`\nEND_OF_REPLY\n<promise>COMPLETE</promise>\n"
    model.set_script({"tester": [text]})
    chat = AnthropicChat(model)
    status, blocks = chat.send([{"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                                {"type": "text", "text": prompt_text(target)}])
    assert status == 200 and [b["type"] for b in blocks] == ["tool_use"] and blocks[0]["name"] == "Bash"
    status, blocks = chat.run_tools(blocks)
    assert target.read_text() == text
    assert [b["type"] for b in blocks] == ["text"] and str(target) in blocks[0]["text"]
    assert [(e["kind"], e["action"]) for e in model.events()] == [("prompt", "write"), ("tool_result", "text")]
    assert model.writes()[0]["role"] == "tester" and model.turns() == {"tester": 1}


def test_anthropic_turns_follow_script_and_retries_take_no_step(model, tmp_path):
    target = tmp_path / "test_result.md"
    model.set_script({"tester": ["RESULT: FAIL one\n", "RESULT: PASS two\n"]})
    chat = AnthropicChat(model, stream=False)
    _, blocks = chat.send(prompt_text(target))
    _, again = chat.request()  # the CLI retries the same request
    assert again[0]["input"]["command"] == blocks[0]["input"]["command"]
    chat.run_tools(blocks)
    assert target.read_text() == "RESULT: FAIL one\n"
    for expected in ("RESULT: PASS two\n", "RESULT: PASS two\n"):  # the last step repeats
        _, blocks = chat.send(prompt_text(target))
        chat.run_tools(blocks)
        assert target.read_text() == expected
    assert model.turns() == {"tester": 3}
    assert [e["kind"] for e in model.events()].count("repeat") == 1


def test_side_requests_and_token_count(model):
    chat = AnthropicChat(model)
    chat.messages.append({"role": "user", "content": prompt_text("/x/test_result.md")})
    status, blocks = chat.request(tools=())
    assert status == 200 and blocks == [{"type": "text", "text": "OK."}]
    assert model.turns() == {} and model.events()[0]["kind"] == "side"
    status, raw = post(model.url + "/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and json.loads(raw)["input_tokens"] > 0


def test_indirection_file_is_the_prompt(model, tmp_path):
    target = tmp_path / "analyst_summary.md"
    instructions = tmp_path / "prompt.md"
    instructions.write_text(prompt_text(target))
    chat = AnthropicChat(model)
    _, blocks = chat.send(f"Read and follow the instructions in this file: {instructions}")
    chat.run_tools(blocks)
    assert target.read_text().startswith("ANALYST_SUMMARY:")
    assert model.turns() == {"analyst": 1}


def test_codex_exec_command_and_shell_array(model, tmp_path):
    for tools in ([EXEC_COMMAND], [SHELL_ARRAY]):
        target = tmp_path / tools[0]["name"] / "programmer_summary.md"
        chat = CodexChat(model, tools)
        status, items = chat.send(prompt_text(target))
        assert status == 200 and items[0]["name"] == tools[0]["name"]
        _, items = chat.run_tools(items)
        assert target.read_text().startswith("PROGRAMMER_SUMMARY:")
        assert items[0]["type"] == "message" and str(target) in items[0]["content"][0]["text"]
    assert model.turns() == {"programmer": 2}


def test_no_file_error_and_write_on_reminder(model, tmp_path):
    target = tmp_path / "analyst_review.md"
    model.set_script({"peer_analyst": [{"action": "error"}, {"action": "no_file"},
                                      {"action": "write_on_reminder", "text": "REVIEW_RESULT: APPROVED\n"}]})
    chat = CodexChat(model)
    status, body = chat.send(prompt_text(target, " one"))
    assert status == 500 and body[0]["error"]["type"] == "server_error"
    status, items = chat.send(prompt_text(target, " two"))
    assert [i["type"] for i in items] == ["message"] and not target.exists()
    status, items = chat.send(prompt_text(target, " three"))
    assert [i["type"] for i in items] == ["message"] and not target.exists()
    chat.items.extend(items)
    status, items = chat.send(f"Reminder: your answer belongs in {target}.")
    chat.run_tools(items)
    assert target.read_text() == "REVIEW_RESULT: APPROVED\n"
    assert model.writes()[0]["turn"] == 3
    status, items = chat.send(f"Reminder: your answer belongs in {target}.")
    assert items[0]["type"] == "message" and len(model.writes()) == 1
    assert [e["action"] for e in model.events()] == ["error", "text", "hold", "write", "text", "text"]


def test_anthropic_error_body(model, tmp_path):
    model.set_script({"tester": {"action": "error", "status": 503}})
    status, body = AnthropicChat(model).send(prompt_text(tmp_path / "test_result.md"))
    assert status == 503 and body[0]["type"] == "error"


def test_write_twice_rewrites_after_the_draft(model, tmp_path):
    target = tmp_path / "programmer_review.md"
    model.set_script({"peer_programmer": [{"action": "write_twice", "draft": "draft\n", "text": "final\n",
                                           "rewrite_after_ms": 50}]})
    chat = AnthropicChat(model)
    _, blocks = chat.send(prompt_text(target))
    _, blocks = chat.run_tools(blocks)
    assert target.read_text() == "draft\n" and blocks[0]["type"] == "tool_use"
    _, blocks = chat.run_tools(blocks)
    assert target.read_text() == "final\n" and blocks[0]["type"] == "text"
    assert [w["draft"] for w in model.writes()] == [True, False]


def test_unknown_route_is_logged(model, tmp_path):
    status, _ = post(model.url + "/v1/other", {"x": 1})
    assert status == 404 and model.unknown_requests[0]["path"] == "/v1/other"
    assert (tmp_path / "log" / "unknown.jsonl").exists()


def test_write_command_keeps_text_without_final_newline(tmp_path):
    target = tmp_path / "a b" / "f.md"
    subprocess.run(["bash", "-c", write_command(str(target), "no newline")], check=True)
    assert target.read_text() == "no newline\n"


def test_title_request_gets_json_for_its_schema(model):
    schema = {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}
    status, raw = post(model.url + "/v1/responses", {
        "model": "scripted", "stream": False, "tools": [], "text": {"format": {"type": "json_schema", "schema": schema}},
        "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "name this"}]}]})
    text = json.loads(raw)["output"][0]["content"][0]["text"]
    assert status == 200 and isinstance(json.loads(text)["title"], str)


def test_same_prompt_in_a_new_session_takes_the_next_step(model, tmp_path):
    target = tmp_path / "test_result.md"
    model.set_script({"tester": ["one\n", "two\n"]})
    for session, expected in (("s1", "one\n"), ("s1", "one\n"), ("s2", "two\n")):
        body = {"model": "m", "stream": False, "tools": [SHELL_TOOL_ANTHROPIC],
                "metadata": {"user_id": json.dumps({"session_id": session})},
                "messages": [{"role": "user", "content": prompt_text(target)}]}
        _, raw = post(model.url + "/v1/messages", body)
        subprocess.run(["bash", "-c", json.loads(raw)["content"][0]["input"]["command"]], check=True)
        assert target.read_text() == expected
    assert model.turns() == {"tester": 2}


def test_a_client_hanging_up_prints_nothing_but_other_errors_do(model, capsys):
    """An agent CLI killed with a keep-alive connection open must not print into another test's stderr."""
    server = model._server
    try:
        raise ConnectionResetError(104, "Connection reset by peer")
    except ConnectionResetError:
        server.handle_error(None, ("127.0.0.1", 43258))
    assert capsys.readouterr().err == ""
    try:
        raise ValueError("a bug in the handler")
    except ValueError:
        server.handle_error(None, ("127.0.0.1", 43259))
    assert "ValueError: a bug in the handler" in capsys.readouterr().err


def test_overloaded_answers_then_a_continue_carries_out_the_prompt_left_undone(model, tmp_path):
    """fail_next(): the next task requests get 529 "overloaded" (429 "rate limited" likewise), side
    requests do not; the first message that gets through afterwards does the prompt that was left undone."""
    target = tmp_path / "test_result.md"
    model.set_script({"tester": ["RESULT: PASS\n"]})
    model.fail_next(2, status=529)
    chat = AnthropicChat(model)
    status, [error] = chat.send(prompt_text(target))
    assert status == 529 and error["error"]["type"] == "overloaded_error"
    assert chat.request(tools=())[0] == 200                        # a title request: not counted
    chat.messages.append({"role": "assistant", "content": "API Error: 529"})
    status, _ = chat.send(f"Continue the task above, then write your complete answer to {target}.")
    assert status == 529
    chat.messages.append({"role": "assistant", "content": "API Error: 529"})
    status, blocks = chat.send(f"Continue the task above, then write your complete answer to {target}.")
    assert status == 200 and [b["type"] for b in blocks] == ["tool_use"]
    chat.run_tools(blocks)
    assert target.read_text() == "RESULT: PASS\n" and model.turns() == {"tester": 1}
    assert [e["action"] for e in model.events() if e["kind"] != "side"][:2] == ["error", "error"]


CLAUDE_COMPACT_PROMPT = ("CRITICAL: Respond with TEXT ONLY. Do NOT call any tools.\n\nYour task is to create a detailed "
                         "summary of the conversation so far, paying close attention to the user's explicit requests.")
CODEX_COMPACT_PROMPT = "You are performing a CONTEXT CHECKPOINT COMPACTION. Create a handoff summary for another LLM."


def test_usage_tokens_are_reported_by_every_response_of_that_turn_only(model, tmp_path):
    """A step's usage_tokens is what a CLI's auto-compaction counts: its tool call and its closing text
    report it, in each dialect's usage fields, a quarter of it as read from the cache; the turns before and
    after report the request's size. usage_by_turn() keeps what each turn's responses reported."""
    target = tmp_path / "programmer_summary.md"
    model.set_script({"programmer": [{"text": "one\n", "usage_tokens": 90000}, "two\n"]})
    status, raw = post(model.url + "/v1/messages", {"model": "m", "stream": True, "tools": [SHELL_TOOL_ANTHROPIC],
                                                    "messages": [{"role": "user", "content": prompt_text(target)}]})
    start = sse(raw)[0]
    usage = start["message"]["usage"]          # Anthropic: the cached part apart from input_tokens
    assert start["type"] == "message_start" and (usage["input_tokens"], usage["cache_read_input_tokens"]) \
        == (67500, 22500)
    tool_use = [e for e in sse(raw) if e["type"] == "content_block_start"][0]["content_block"]
    body = {"model": "m", "stream": False, "tools": [SHELL_TOOL_ANTHROPIC], "messages": [
        {"role": "user", "content": prompt_text(target)},
        {"role": "assistant", "content": [{**tool_use, "input": {"command": "true"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use["id"], "content": "ok"}]}]}
    _, raw = post(model.url + "/v1/messages", body)
    assert json.loads(raw)["content"][0]["type"] == "text" and json.loads(raw)["usage"]["input_tokens"] == 67500
    assert model.usage_by_turn() == {("programmer", 1): (2 * 67500, 2 * 22500, 40)}

    model.set_script({"programmer": [{"text": "one\n", "usage_tokens": 70000}, "two\n"]})
    chat = CodexChat(model)
    status, raw = post(model.url + "/v1/responses", {"model": "scripted", "stream": True, "tools": chat.tools,
                                                     "input": chat.items + [{"type": "message", "role": "user",
                                                                             "content": prompt_text(target)}]})
    usage = sse(raw)[-1]["response"]["usage"]
    assert usage["input_tokens"] == 70000 and usage["total_tokens"] == 70000 + usage["output_tokens"]
    assert usage["input_tokens_details"]["cached_tokens"] == 17500     # the Responses API counts it inside
    _, items = chat.send(prompt_text(target, " again"))
    chat.run_tools(items)
    assert target.read_text() == "two\n"

    model.set_script({"programmer": [{"text": "one\n", "usage_tokens": 50000}]})
    status, raw = post(model.url + "/v1/chat/completions", {
        "model": "scripted", "stream": False, "tools": OPENCODE_TOOLS,
        "messages": [{"role": "user", "content": prompt_text(target)}]})
    usage = json.loads(raw)["usage"]
    assert (usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]) == (50000, 12500)
    assert model.usage_by_turn() == {("programmer", 1): (37500, 12500, 20)}


def test_claude_compaction_is_answered_with_a_summary_and_takes_no_step(model, tmp_path):
    """Claude Code appends its compaction prompt to the last message of the request it compacts (a
    prompt, or a tool result). The answer is a summary without the prompt's write-marker line; the
    prompt that follows the summary is still a prompt for its role."""
    target = tmp_path / "programmer_summary.md"
    model.set_script({"programmer": ["one\n", "two\n", "three\n"]})
    chat = AnthropicChat(model)
    _, blocks = chat.send(prompt_text(target))
    chat.run_tools(blocks)
    # compacting while the next prompt is being answered: the compaction prompt shares its message
    compacting = chat.messages + [{"role": "user", "content": [{"type": "text", "text": prompt_text(target, " 2")},
                                                               {"type": "text", "text": CLAUDE_COMPACT_PROMPT}]}]
    status, raw = post(model.url + "/v1/messages", {"model": "m", "stream": False, "tools": [SHELL_TOOL_ANTHROPIC],
                                                    "messages": compacting})
    [block] = json.loads(raw)["content"]
    assert status == 200 and block["type"] == "text"
    assert block["text"].startswith("<analysis>") and "<summary>" in block["text"]
    assert "Write your complete answer to this file:" not in block["text"]
    # after a tool result, as /compact sends it after a finished turn
    status, raw = post(model.url + "/v1/messages", {"model": "m", "stream": False, "tools": [SHELL_TOOL_ANTHROPIC],
                                                    "messages": chat.messages[:-1] + [{"role": "user", "content": [
                                                        *chat.messages[-1]["content"],
                                                        {"type": "text", "text": CLAUDE_COMPACT_PROMPT}]}]})
    assert json.loads(raw)["content"][0]["text"].startswith("<analysis>")
    assert [(c["role"], c["action"], c["path"]) for c in model.compactions()] == [
        ("programmer", "text", str(target))] * 2
    assert model.turns() == {"programmer": 1}
    summary = block["text"].split("<summary>")[1].split("</summary>")[0]
    continued = AnthropicChat(model)
    continued.messages = [{"role": "user", "content": "This session is being continued from a previous conversation "
                                                      "that ran out of context.\n\nSummary:\n" + summary}]
    _, blocks = continued.send(prompt_text(target, " 2"))
    continued.run_tools(blocks)
    assert target.read_text() == "two\n" and model.turns() == {"programmer": 2}
    # compacting again, with only the summary left to name the role
    post(model.url + "/v1/messages", {"model": "m", "stream": False, "tools": [SHELL_TOOL_ANTHROPIC], "messages": [
        continued.messages[0], {"role": "user", "content": CLAUDE_COMPACT_PROMPT}]})
    assert model.compactions()[-1]["role"] == "programmer" and model.turns() == {"programmer": 2}


def test_codex_compaction_is_answered_with_a_summary_and_takes_no_step(model, tmp_path):
    target = tmp_path / "test_result.md"
    model.set_script({"tester": ["RESULT: FAIL\n", "RESULT: PASS\n"]})
    chat = CodexChat(model)
    _, items = chat.send(prompt_text(target))
    _, items = chat.run_tools(items)
    chat.items.extend(items)
    status, items = chat.send(CODEX_COMPACT_PROMPT)
    assert status == 200 and [i["type"] for i in items] == ["message"]
    text = items[0]["content"][0]["text"]
    assert "<summary>" in text and "Write your complete answer to this file:" not in text
    assert [(c["role"], c["kind"]) for c in model.compactions()] == [("tester", "compaction")]
    chat.items = chat.items[:2] + [{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": prompt_text(target)}]}, {"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "Another language model started to solve this problem:\n" + text}]}]
    _, items = chat.send(prompt_text(target, " next"))
    chat.run_tools(items)
    assert target.read_text() == "RESULT: PASS\n" and model.turns() == {"tester": 2}


def test_a_compaction_is_never_failed_and_takes_no_failure(model, tmp_path):
    model.fail_next(1, status=529)
    status, items = CodexChat(model).send(CODEX_COMPACT_PROMPT)
    assert status == 200 and model.compactions()[0]["role"] is None
    status, _ = CodexChat(model).send(prompt_text(tmp_path / "test_result.md"))
    assert status == 529


def test_codex_usage_limit_then_the_continue_message_carries_out_the_prompt(model, tmp_path):
    """usage_limit_next(): the 429 body Codex reads as a spent plan (usage_limit_reached, resets_at);
    after the reset, "continue the task above" does the prompt that was refused."""
    target = tmp_path / "test_result.md"
    model.set_script({"tester": ["RESULT: PASS\n"]})
    model.usage_limit_next(1, resets_at=1767625500)
    chat = CodexChat(model)
    status, [body] = chat.send(prompt_text(target))
    assert status == 429
    assert body["error"]["type"] == "usage_limit_reached" and body["error"]["resets_at"] == 1767625500
    chat.items.append({"type": "message", "role": "assistant", "content": [
        {"type": "output_text", "text": "You've hit your usage limit."}]})
    status, items = chat.send(f"Your usage limit has reset. Continue the task above from where you stopped, then "
                              f"write your complete answer to {target}; the orchestrator reads only that file.")
    assert status == 200
    chat.run_tools(items)
    assert target.read_text() == "RESULT: PASS\n" and model.turns() == {"tester": 1}
    errors = [e for e in model.events() if e["action"] == "error"]
    assert errors[0]["usage_limit"] and errors[0]["resets_at"] == 1767625500 and errors[0]["status"] == 429

    model.usage_limit_next(1)
    status, [body] = CodexChat(model).send(prompt_text(target))
    assert status == 429 and body["error"]["type"] == "usage_limit_reached" and "resets_at" not in body["error"]
    model.usage_limit_next(1, resets_at=1767625500)
    status, [body] = AnthropicChat(model).send(prompt_text(target))
    assert status == 429 and body["error"]["type"] == "rate_limit_error"


def test_a_usage_limit_for_one_role_waits_for_that_roles_prompt_and_resets_counted_from_the_answer(model, tmp_path):
    """usage_limit_next(role=..., resets_in=...): other roles' prompts go through; the limit meets the named
    role's prompt, with a reset time counted from that answer."""
    model.set_script({"tester": ["RESULT: PASS\n"], "programmer": ["PROGRAMMER_SUMMARY: done\n"]})
    model.usage_limit_next(1, role="tester", resets_in=600)
    status, _ = CodexChat(model).send(prompt_text(tmp_path / "programmer_summary.md"))
    assert status == 200 and model.turns() == {"programmer": 1}
    before = time.time()
    status, [body] = CodexChat(model).send(prompt_text(tmp_path / "test_result.md"))
    assert status == 429 and body["error"]["type"] == "usage_limit_reached"
    assert before + 600 - 1 <= body["error"]["resets_at"] <= time.time() + 600
    status, _ = CodexChat(model).send(prompt_text(tmp_path / "test_result.md"))
    assert status == 200                                           # one limit, spent


def chat_tool(name: str, *params: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {param: {"type": "string"} for param in params}}}}


COPILOT_TOOLS = [chat_tool("bash", "command", "description"), chat_tool("view", "path"),
                 chat_tool("task_complete", "summary")]
HERMES_TOOLS = [chat_tool("read_file", "path"), chat_tool("terminal", "command", "workdir"),
                chat_tool("execute_code", "code")]


class ToolChat(OpenCodeChat):
    """A chat completions conversation with another CLI's tools (Copilot's, Hermes's), no session header."""

    def __init__(self, model: ScriptedModel, tools: list[dict]):
        super().__init__(model, session="")
        self.tools = tools

    def request(self) -> tuple[int, dict]:
        status, raw = post(self.model.url + "/v1/chat/completions",
                           {"model": "scripted", "stream": True, "stream_options": {"include_usage": True},
                            "messages": self.messages, "tools": self.tools})
        assert status == 200, raw
        message = {"content": "", "tool_calls": [], "finish": None}
        for chunk in sse(raw.replace(b"data: [DONE]", b""))[:-1]:
            choice = chunk["choices"][0]
            message["content"] += choice["delta"].get("content") or ""
            message["tool_calls"] += choice["delta"].get("tool_calls") or []
            message["finish"] = choice["finish_reason"] or message["finish"]
        return status, message

    def answer_tool(self, message: dict, output: str = "exit 0") -> tuple[int, dict]:
        """Record the single tool call and send back ``output`` as its result (without running it)."""
        call = message["tool_calls"][0]
        self.messages.append({"role": "assistant", "content": None, "tool_calls": [
            {k: v for k, v in call.items() if k != "index"}]})
        self.messages.append({"role": "tool", "tool_call_id": call["id"], "content": output})
        return self.request()


def test_copilot_turn_ends_with_task_complete_after_the_write(model, tmp_path):
    """Copilot's autopilot ends a turn only on `task_complete`: the write is a `bash` call (with its
    description), its result is answered with task_complete {"summary": ...} instead of plain text, and
    task_complete's own result with plain text, finishing the turn."""
    target = tmp_path / "analyst_review.md"
    model.set_script({"peer_analyst": ["APPROVED\n"]})
    chat = ToolChat(model, COPILOT_TOOLS)
    _, message = chat.send(prompt_text(target))
    call = message["tool_calls"][0]["function"]
    assert message["finish"] == "tool_calls" and call["name"] == "bash"
    assert json.loads(call["arguments"])["description"]
    status, message = chat.run_tools(message)
    assert target.read_text() == "APPROVED\n"
    assert message["finish"] == "tool_calls" and message["content"] == ""
    complete = message["tool_calls"][0]["function"]
    assert complete["name"] == "task_complete" and str(target) in json.loads(complete["arguments"])["summary"]
    status, message = chat.answer_tool(message, "Task marked complete.")
    assert message["finish"] == "stop" and message["tool_calls"] == [] and message["content"]
    assert model.turns() == {"peer_analyst": 1}


def test_copilot_nudge_to_mark_the_task_complete_gets_task_complete(model):
    """Copilot's "You have not yet marked the task as complete" (a message naming no response file) is
    answered with the task_complete call, not with text that would make it ask again."""
    chat = ToolChat(model, COPILOT_TOOLS)
    _, message = chat.send("You have not yet marked the task as complete using the task_complete tool.")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["task_complete"]
    assert model.turns() == {}


def test_hermes_terminal_tool_gets_only_a_command(model, tmp_path):
    """Hermes's shell tool is `terminal`, which declares no `description`: the call carries only `command`."""
    target = tmp_path / "test_result.md"
    model.set_script({"tester": ["PASS\n"]})
    chat = ToolChat(model, HERMES_TOOLS)
    _, message = chat.send(prompt_text(target))
    call = message["tool_calls"][0]["function"]
    assert call["name"] == "terminal" and list(json.loads(call["arguments"])) == ["command"]
    subprocess.run(["bash", "-c", json.loads(call["arguments"])["command"]], check=True)
    _, message = chat.answer_tool(message)
    assert target.read_text() == "PASS\n"
    assert message["finish"] == "stop" and message["tool_calls"] == [] and str(target) in message["content"]


def test_hermes_title_request_is_answered_without_a_stream(model, tmp_path):
    """Hermes asks for a title after its first turn without `stream` and without tools: one JSON chat
    completion with short text (a streamed answer there leaves a warning on its screen), no step taken."""
    body = {"model": "scripted", "temperature": 0.3, "messages": [
        {"role": "system", "content": "Generate a short, descriptive title (3-7 words) for a conversation"},
        {"role": "user", "content": "User: " + prompt_text(tmp_path / "test_result.md") + "\n\nAssistant: Done."}]}
    status, raw = post(model.url + "/v1/chat/completions", body)
    answer = json.loads(raw)
    assert status == 200 and answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"]["content"] and answer["choices"][0]["finish_reason"] == "stop"
    assert model.turns() == {} and [e["kind"] for e in model.events()] == ["side"]


def test_models_are_listed_and_each_answers_by_id(model):
    """`GET /v1/models` (Copilot, Hermes) lists the scripted model; `GET /v1/models/<id>` (Hermes) answers any id."""
    with urllib.request.urlopen(model.url + "/v1/models", timeout=10) as resp:
        assert [m["id"] for m in json.loads(resp.read())["data"]] == ["scripted"]
    with urllib.request.urlopen(model.url + "/v1/models/scripted-small", timeout=10) as resp:
        assert json.loads(resp.read())["id"] == "scripted-small"
    assert model.unknown_requests == []


def test_hermes_sessions_in_the_system_prompt_tell_a_new_agent_from_a_retry(model, tmp_path):
    """Hermes (with --pass-session-id) names its session in its system prompt: the same prompt again in
    that session is a retry (no step); in another session (a replaced agent) it takes the next step."""
    target = tmp_path / "programmer_summary.md"
    model.set_script({"programmer": ["one\n", "two\n"]})
    for session, expected in (("20261125_1_aa", "one\n"), ("20261125_1_aa", "one\n"), ("20261125_2_bb", "two\n")):
        chat = ToolChat(model, HERMES_TOOLS)
        chat.messages = [{"role": "system", "content": f"You are Hermes.\nConversation started: today\n"
                                                       f"Session ID: {session}\nModel: scripted"}]
        _, message = chat.send(prompt_text(target))
        subprocess.run(["bash", "-c", json.loads(message["tool_calls"][0]["function"]["arguments"])["command"]],
                       check=True)
        assert target.read_text() == expected
    assert model.turns() == {"programmer": 2}
