"""A scripted model endpoint that real agent CLIs can talk to offline.

``ScriptedModel`` is an HTTP server on 127.0.0.1 that plays the *model* behind
Claude Code (Anthropic Messages API: ``POST /v1/messages`` and
``/v1/messages/count_tokens``), Codex CLI (OpenAI Responses API:
``POST /v1/responses``, ``GET /v1/models``), and OpenCode, GitHub Copilot CLI and Hermes
Agent (OpenAI chat completions: ``POST /v1/chat/completions``, streaming, their
shell tool ``bash`` or, for Hermes, ``terminal``; ``GET /v1/models`` and
``/v1/models/<id>``). Where the request offers Copilot's ``task_complete`` tool,
every answer that would end the turn with plain text calls it instead, with that
text as its ``summary`` (Copilot in autopilot mode, as CAO starts it, otherwise
asks the model again); its result is answered with plain text. Requests that do not
ask for a stream (Hermes's title request after a first turn) get one JSON answer.
It drives each CLI the way a real
model would: it reads the newest user prompt, and answers it with one shell
tool call that writes the scripted reply into the prompt's response file;
when the CLI sends back that tool's result, it ends the turn with a short text.

Prompts are recognised like the scripted agent (``orchestrator_scripted_agent``) does:

* ``Read and follow the instructions in this file: <path>`` -> the file's
  content is the prompt.
* ``Write your complete answer to this file: <path>`` -> a prompt for the role
  given by the file name (``RESPONSE_FILE_ROLES``); each prompt takes that
  role's next script step.
* A message that names a response file without that line is a reminder: it
  takes no step and only releases an answer held back by ``write_on_reminder``.
* Requests that offer no tools (titles, topic checks) and anything else get a
  short plain text.

The script (``set_script``) is ``{"<role>": [step, ...]}``; turn N uses step N,
the last step repeats. A step is the answer text or a dict::

    {"text": str, "think_ms": int, "action": "write" | "no_file" | "error"
     | "write_on_reminder" | "write_twice", "draft": str,
     "rewrite_after_ms": int, "closing_ms": int, "status": int, "usage_tokens": int,
     "closing_usage_tokens": int}

``write_twice`` writes ``draft`` first and, ``rewrite_after_ms`` after the CLI
reported that command's result, the final text with a second tool call.
``closing_ms`` is how long the model takes over its closing message, after the CLI reported that
the reply was written (0: at once), as a real model's few closing words take.
``error`` answers HTTP ``status`` (500) with an API style error body. Both
CLIs retry 5xx answers on their own with growing pauses (Claude Code for
minutes); ``"status": 400`` makes them give up at once. ``fail_next(n, 529)``
answers the next n task requests "overloaded" (or 429 "rate limited"), whatever
the script says, and then lets the first message that gets through carry out
the prompt they left undone. ``usage_limit_next(n, resets_at)`` does the same with
the HTTP 429 a spent plan gets (for Codex: ``usage_limit_reached`` and the unix
time the limit resets, which it shows as ``You've hit your usage limit. Try again
at ...`` and does not retry).

``usage_tokens`` makes every response of that turn report that many input
tokens as its usage (default: the request's size / 4), so a CLI whose
auto-compaction threshold is below it compacts its conversation before its next
request; ``closing_usage_tokens`` makes only the turn's closing message (after
the reply was written) report them, so the CLI compacts as its next prompt is
submitted, not within the turn. Compaction requests (Claude Code's "create a detailed summary of the
conversation so far", Codex's "CONTEXT CHECKPOINT COMPACTION") get a short
``<analysis>``/``<summary>`` text whatever tools they offer; they take no step
and are recorded with kind ``compaction`` (``compactions()``). The summary
names the last response file but never carries the prompt's
``Write your complete answer to this file:`` line, so the message that
continues a compacted conversation is no new prompt. ``require_task(*texts)``
makes the model check every prompt or reminder that reaches it after a
compaction of that role's conversation: one whose request lacks any of the
texts (the task) is recorded with kind ``without task`` (``without_task()``)
and answered as a real model would, asking what the task is, without writing.

Every CLI sends the whole conversation each time, so decisions depend only on
the newest message(s). A decision is remembered under (kind, role, hash of the
prompt, number of user messages in the conversation, and the conversation id
the CLI sends, if any): a CLI retrying the same request gets the same answer again
without taking another step, and a tool result is answered once per tool call.

Files written by the shell command end with a newline (a heredoc adds one to
a text that has none).

Run ``python tests/e2e/scripted_model.py --port 8765`` for manual use.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import itertools
import json
import os
import re
import shlex
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from orchestrator_scripted_agent import (  # installed with the project
    DEFAULT_TEXTS,
    INDIRECTION_MARKER,
    RESPONSE_FILE_ROLES,
    WRITE_MARKER,
    classify_message,
    find_marker_path,
)

ACTIONS = {"write", "no_file", "write_on_reminder", "write_twice", "error"}
REPLY_DELIMITER = "END_OF_REPLY"
SIDE_TEXT = "OK."
FALLBACK_TEXT = "MOCK ANSWER\n"
DEFAULT_DRAFT = "DRAFT: work in progress, the final answer follows.\n"
SYSTEM_REMINDER_RE = re.compile(r"<system-reminder>.*?</system-reminder>", re.S)
# Codex sends its environment and project instructions as user messages.
CODEX_CONTEXT_PREFIXES = ("<environment_context>", "<user_instructions>", "# AGENTS.md", "<INSTRUCTIONS>")
# Shell tools as the CLIs name them, best first.
ANTHROPIC_SHELL_TOOLS = ("Bash",)
RESPONSES_SHELL_TOOLS = ("exec_command", "shell_command", "shell", "container.exec")
CHAT_SHELL_TOOLS = ("bash", "terminal", "shell", "exec_command")   # OpenCode and Copilot: bash; Hermes: terminal
# Copilot CLI in autopilot mode (as CAO starts it) ends a turn only on this tool call; a turn that ends
# with plain text is sent back to the model with "You have not yet marked the task as complete".
COMPLETE_TOOL = "task_complete"
COMPLETE_CALL_PREFIX = "call_complete_"
# Hermes started with --pass-session-id ends its system prompt's date line with its session.
HERMES_SESSION_LINE = re.compile(r"^Session ID: (\S+)\s*$", re.M)
MAX_LOGGED_BODIES = 5000
# The last user message of a compaction request: Claude Code's (it begins "CRITICAL: Respond with
# TEXT ONLY") contains the first, Codex's begins with the second.
CLAUDE_COMPACTION_MARKER = "Your task is to create a detailed summary of the conversation so far"
CODEX_COMPACTION_PREFIX = "You are performing a CONTEXT CHECKPOINT COMPACTION"


# ---------------------------------------------------------------- data


@dataclass
class Conversation:
    """A request reduced to what a decision needs, the same for every dialect."""

    api: str
    tool_names: list[str]
    newest: str  # "user", "tool_result", "assistant" or "none"
    user_text: str = ""
    user_count: int = 0
    tool_call_id: str | None = None
    tool_output: str = ""
    earlier_user_texts: list[str] = field(default_factory=list)
    schema: dict | None = None  # a JSON schema the answer must follow (title requests)
    conversation_id: str = ""  # sent by the CLI, the same across its own retries
    model: str = ""            # the model the request names
    # The newest user message's text, also when it carries tool results: Claude Code appends its
    # compaction prompt to the last message of the request it compacts, a tool result too.
    newest_text: str = ""


@dataclass
class Reply:
    """One model response: plain text, one shell command, or an HTTP error."""

    text: str = ""
    command: str | None = None
    call_id: str | None = None
    error_status: int | None = None
    error_message: str = ""
    usage_tokens: int | None = None   # input tokens to report (None: the request's size / 4)
    usage_limit: bool = False         # the error is a spent plan, not a busy API
    limit_headers: bool = False       # with Codex's rate-limit headers (its plan 100% used)
    resets_at: int | None = None      # when that plan limit resets (unix seconds)
    role: str | None = None           # the role and turn (the role's prompt count) it answers; None: a side request
    turn: int | None = None


# ---------------------------------------------------------------- helpers


def _strip_reminders(text: str) -> str:
    """Drop Claude Code's ``<system-reminder>`` blocks: they are context, not the prompt."""
    return SYSTEM_REMINDER_RE.sub("", text).strip()


def _text_of(content) -> str:
    """Join the text parts of a message content (a string or a list of blocks)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    parts = []
    for block in content:
        if isinstance(block, dict) and isinstance(block.get("text"), str):
            parts.append(block["text"])
        elif isinstance(block, str):
            parts.append(block)
    return "\n".join(parts)


def _digest(text: str) -> str:
    """Short stable hash that keys a prompt."""
    return hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()[:16]


def model_entry(model_id: str) -> dict:
    """One model as ``GET /v1/models`` lists it."""
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "scripted", "type": "model",
            "display_name": "Scripted model"}


def chat_tool_arguments(body: dict, tool: str, command: str) -> str:
    """The JSON arguments of a shell call in chat completions: ``command``, and ``description`` where the
    tool declares one (OpenCode's and Copilot's ``bash`` do, Hermes's ``terminal`` does not)."""
    for t in body.get("tools") or []:
        function = (t.get("function") or {}) if isinstance(t, dict) else {}
        if function.get("name") == tool:
            props = (function.get("parameters") or {}).get("properties") or {}
            if "description" not in props:
                return json.dumps({"command": command})
    return json.dumps({"command": command, "description": "Write the answer file"})


def sample_for_schema(schema) -> object:
    """A small value that satisfies a JSON schema, for side requests that want JSON."""
    if not isinstance(schema, dict):
        return "Scripted turn"
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    if "enum" in schema and schema["enum"]:
        return schema["enum"][0]
    if kind == "object":
        props = schema.get("properties") or {}
        return {name: sample_for_schema(sub) for name, sub in props.items()}
    if kind == "array":
        return []
    if kind == "boolean":
        return False
    if kind in ("integer", "number"):
        return 0
    return "Scripted turn"


def side_text(convo: "Conversation") -> str:
    """Short text for a side request, as JSON when the request asks for a schema."""
    if convo.schema is not None:
        return json.dumps(sample_for_schema(convo.schema))
    return SIDE_TEXT


def error_type(status: int, api: str) -> str:
    """The error type name each API uses for an HTTP status."""
    if status == 429:
        return "rate_limit_error" if api == "anthropic" else "rate_limit_exceeded"
    if status == 529 and api == "anthropic":
        return "overloaded_error"
    if 400 <= status < 500:
        return "invalid_request_error"
    return "api_error" if api == "anthropic" else "server_error"


def is_compaction(convo: "Conversation") -> bool:
    """True for a CLI's request to summarise its conversation (auto-compaction or /compact)."""
    text = convo.newest_text or (convo.user_text if convo.newest == "user" else "")
    return CLAUDE_COMPACTION_MARKER in text or text.lstrip().startswith(CODEX_COMPACTION_PREFIX)


def compaction_summary(role: str | None, path: str | None) -> str:
    """A real model's kind of summary, short; it must not repeat a prompt's write-marker line."""
    work = f"the {role} role" if role else "the tasks given"
    where = f" The latest answer is in {path}." if path else ""
    return (
        "<analysis>\nThe user sent tasks one after another; each was answered by writing the "
        "requested file with one shell command.\n</analysis>\n"
        f"<summary>\n1. Primary Request and Intent: work as {work}; every answer goes into the "
        f"file the task names.{where}\n2. Pending Tasks: none; wait for the next task.\n</summary>"
    )


def last_prompted_role(texts: list[str], mentions: bool = False) -> tuple[str | None, str | None]:
    """(role, response path) of the newest text that names a response file to write; with
    ``mentions``, also of one that only names a response file (as a compacted conversation's summary does)."""
    for earlier in reversed(texts):
        text = resolve_indirection(earlier)
        p = find_marker_path(text, WRITE_MARKER)
        if p and os.path.basename(p) in RESPONSE_FILE_ROLES:
            return RESPONSE_FILE_ROLES[os.path.basename(p)], p
        if mentions:
            kind, role, path = classify(text, None)
            if kind == "reminder":
                return role, path
    return None, None


def error_body(reply: Reply, api: str) -> tuple[dict, dict]:
    """(JSON body, extra headers) of an error reply in an API's dialect.

    A plan limit is, for Codex, a 429 whose ``error.type`` is ``usage_limit_reached`` with
    ``resets_at`` (unix seconds; left out when unknown); for Claude Code it carries the
    ``anthropic-ratelimit-unified-*`` headers a subscription's limit comes with.
    """
    status = reply.error_status or 500
    if reply.usage_limit and api == "anthropic":
        headers = {"anthropic-ratelimit-unified-status": "rejected",
                   "anthropic-ratelimit-unified-representative-claim": "five_hour"}
        if reply.resets_at is not None:
            headers["anthropic-ratelimit-unified-reset"] = str(reply.resets_at)
        return {"type": "error", "error": {"type": "rate_limit_error", "message": reply.error_message}}, headers
    if reply.usage_limit:
        error = {"type": "usage_limit_reached", "code": "usage_limit_reached", "message": reply.error_message}
        if reply.resets_at is not None:
            error["resets_at"] = int(reply.resets_at)
        headers = {}
        if reply.limit_headers:          # Codex reads them with usage_limit_reached, and offers a cheaper model
            headers = {"x-codex-primary-used-percent": "100", "x-codex-primary-window-minutes": "300",
                       "x-codex-primary-reset-at": str(int(reply.resets_at or time.time() + 3600))}
        return {"error": error}, headers
    kind = error_type(status, api)
    if api == "anthropic":
        return {"type": "error", "error": {"type": kind, "message": reply.error_message}}, {}
    return {"error": {"type": kind, "code": kind, "message": reply.error_message, "param": None}}, {}


def input_tokens(reply: Reply, size: int) -> int:
    """The input tokens a response reports: the script's ``usage_tokens``, else the request's size / 4."""
    return reply.usage_tokens if reply.usage_tokens is not None else max(1, size // 4)


OUTPUT_TOKENS = 20


def cached_tokens(prompt_tokens: int) -> int:
    """The part of a prompt every response reports as read from the provider's cache: a quarter, so that a
    reader which mixes up cached and fresh input gets the sums wrong."""
    return prompt_tokens // 4


def write_command(path: str, text: str) -> str:
    """Shell command that writes ``text`` to ``path`` through a quoted heredoc."""
    body = text if text.endswith("\n") else text + "\n"
    lines = set(body.splitlines())
    delimiter = REPLY_DELIMITER
    for n in itertools.count(1):
        if delimiter not in lines:
            break
        delimiter = f"{REPLY_DELIMITER}_{n}"
    directory = os.path.dirname(path) or "."
    return (
        f"mkdir -p {shlex.quote(directory)} && cat > {shlex.quote(path)} <<'{delimiter}'\n"
        f"{body}{delimiter}"
    )


def classify(message: str, last_role: str | None) -> tuple[str, str | None, str | None]:
    """Return (kind, role, response path): kind is "prompt", "reminder" or "side" (the scripted agent's rule)."""
    kind, role, path = classify_message(message, last_role)
    return ("side" if kind == "other" else kind), role, path


def resolve_indirection(message: str) -> str:
    """Replace a "read and follow this file" message by that file's content."""
    source = find_marker_path(message, INDIRECTION_MARKER)
    if not source:
        return message
    try:
        return Path(source).read_text(encoding="utf-8")
    except OSError:
        return message


def normalise_step(step, role: str | None, think_seconds: float) -> dict:
    """Turn a script entry (string or dict) into a complete step dict."""
    if isinstance(step, str):
        step = {"text": step}
    if not isinstance(step, dict):
        step = {}
    action = step.get("action", "write")
    if action not in ACTIONS:
        action = "write"
    text = step.get("text")
    if not isinstance(text, str):
        text = DEFAULT_TEXTS.get(role or "", FALLBACK_TEXT)
    draft = step.get("draft")
    if not isinstance(draft, str):
        draft = DEFAULT_DRAFT

    def number(key: str, default: float) -> float:
        try:
            return max(0.0, float(step.get(key, default)))
        except (TypeError, ValueError):
            return default

    return {
        "text": text,
        "action": action,
        "draft": draft,
        "think": number("think_ms", think_seconds * 1000) / 1000.0,
        "rewrite_after": number("rewrite_after_ms", 1000) / 1000.0,
        "closing": number("closing_ms", 0) / 1000.0,
        "status": int(number("status", 500)) or 500,
        "usage_tokens": int(step["usage_tokens"]) if isinstance(step.get("usage_tokens"), (int, float)) else None,
        "closing_usage_tokens": int(step["closing_usage_tokens"])
        if isinstance(step.get("closing_usage_tokens"), (int, float)) else None,
    }


# ---------------------------------------------------------------- request parsing


def anthropic_conversation_id(body: dict) -> str:
    """The conversation id Claude Code puts in ``metadata.user_id`` (a JSON string or a plain id)."""
    user_id = (body.get("metadata") or {}).get("user_id") if isinstance(body.get("metadata"), dict) else None
    if not isinstance(user_id, str):
        return ""
    try:
        data = json.loads(user_id)
    except ValueError:
        return user_id
    if isinstance(data, dict) and data.get("session_id"):
        return str(data["session_id"])
    return user_id


def parse_anthropic(body: dict) -> Conversation:
    """Reduce a Messages API request to the newest user/assistant message and its context."""
    tools = [t.get("name", "") for t in body.get("tools") or [] if isinstance(t, dict)]
    messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
    convo = Conversation(api="anthropic", tool_names=tools, newest="none")
    convo.model = str(body.get("model") or "")
    convo.conversation_id = anthropic_conversation_id(body)
    fmt = (body.get("output_config") or {}).get("format") or {}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        convo.schema = fmt.get("schema") or {}
    user_texts = []
    newest = None
    for m in messages:
        if m.get("role") not in ("user", "assistant"):
            continue  # Claude Code mixes "system" messages in, sometimes last
        newest = m
        if m.get("role") == "user":
            blocks = m.get("content")
            text = _strip_reminders(_text_of(blocks))
            if text:
                user_texts.append(text)
    convo.user_count = len(user_texts)
    if newest is None:
        return convo
    if newest.get("role") == "assistant":
        convo.newest = "assistant"
        return convo
    content = newest.get("content")
    convo.newest_text = _strip_reminders(_text_of(content)) if newest.get("role") == "user" else ""
    results = [b for b in content if isinstance(b, dict) and b.get("type") == "tool_result"] if isinstance(
        content, list
    ) else []
    if results:
        convo.newest = "tool_result"
        convo.tool_call_id = results[-1].get("tool_use_id")
        convo.tool_output = _text_of(results[-1].get("content"))[:2000]
        convo.earlier_user_texts = user_texts
        return convo
    convo.newest = "user"
    convo.user_text = user_texts[-1] if user_texts else ""
    convo.earlier_user_texts = user_texts[:-1]
    return convo


def parse_responses(body: dict) -> Conversation:
    """Reduce a Responses API request (Codex) to its newest relevant input item."""
    tools = []
    for t in body.get("tools") or []:
        if isinstance(t, dict):
            tools.append(t.get("name") or t.get("type") or "")
    items = body.get("input")
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    convo = Conversation(api="responses", tool_names=tools, newest="none")
    convo.model = str(body.get("model") or "")
    meta = body.get("client_metadata") if isinstance(body.get("client_metadata"), dict) else {}
    convo.conversation_id = str(body.get("prompt_cache_key") or meta.get("session_id") or "")
    fmt = (body.get("text") or {}).get("format") or {}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        convo.schema = fmt.get("schema") or {}
    user_texts = []
    newest = None
    for item in items or []:
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role == "user":
                text = _text_of(item.get("content")).strip()
                if not text or text.startswith(CODEX_CONTEXT_PREFIXES):
                    continue
                user_texts.append(text)
                newest = item
            elif role == "assistant":
                newest = item
        elif kind.endswith("_call_output"):
            newest = item
    if newest is None:
        return _with_newest(convo, "none", user_texts)
    if newest.get("type", "message") != "message":
        output = newest.get("output")
        return _with_newest(convo, "tool_result", user_texts, newest.get("call_id"),
                            output if isinstance(output, str) else json.dumps(output))
    return _with_newest(convo, "assistant" if newest.get("role") == "assistant" else "user", user_texts)


def _with_newest(convo: Conversation, newest: str, user_texts: list[str], call_id: str | None = None,
                 output: str = "") -> Conversation:
    """Complete a parsed request from what its newest relevant message is (the same for every dialect)."""
    convo.user_count, convo.newest = len(user_texts), newest
    if newest == "tool_result":
        convo.tool_call_id, convo.tool_output, convo.earlier_user_texts = call_id, output[:2000], user_texts
    elif newest == "user":
        convo.user_text, convo.earlier_user_texts = user_texts[-1], user_texts[:-1]
    return convo


def parse_chat(body: dict) -> Conversation:
    """Reduce a chat completions request (OpenCode) to its newest user, tool or assistant message."""
    tools = []
    for t in body.get("tools") or []:
        if isinstance(t, dict):
            tools.append(((t.get("function") or {}).get("name")) or t.get("type") or "")
    convo = Conversation(api="chat", tool_names=tools, newest="none")
    convo.model = str(body.get("model") or "")
    fmt = body.get("response_format") or {}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        convo.schema = (fmt.get("json_schema") or {}).get("schema") or {}
    user_texts = []
    newest = None
    for message in body.get("messages") or []:
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        if role == "system" and not convo.conversation_id:
            found = HERMES_SESSION_LINE.search(_text_of(message.get("content")))
            convo.conversation_id = found.group(1) if found else ""
        if role == "user":
            text = _strip_reminders(_text_of(message.get("content")))
            if text:
                user_texts.append(text)
                newest = message
        elif role in ("assistant", "tool"):
            newest = message
    if newest is None:
        return _with_newest(convo, "none", user_texts)
    if newest.get("role") == "tool":
        return _with_newest(convo, "tool_result", user_texts, newest.get("tool_call_id"),
                            _text_of(newest.get("content")))
    return _with_newest(convo, "assistant" if newest.get("role") == "assistant" else "user", user_texts)


# ---------------------------------------------------------------- the model


class ScriptedModel:
    """The scripted model server; use it as a context manager."""

    def __init__(self, think_seconds: float = 0.5, log_dir: Path | None = None):
        self.think_seconds = think_seconds
        self.log_dir = Path(log_dir) if log_dir else None
        self.url = ""
        self.unknown_requests: list[dict] = []
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._logged = itertools.count(1)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.set_script({})

    # ---- lifecycle

    def __enter__(self) -> "ScriptedModel":
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self, port: int = 0) -> None:
        """Serve on 127.0.0.1 (a free port unless given) in a daemon thread."""
        if self.log_dir:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        handler = type("Handler", (_Handler,), {"model": self})
        self._server = _QuietServer(("127.0.0.1", port), handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name="scripted-model", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop serving; requests still thinking finish in their own threads."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    # ---- test interface

    def set_script(self, script: dict) -> None:
        """Install a script and forget all turns, decisions and records."""
        with self._lock:
            self._script = dict(script or {})
            self._turns: dict[str, int] = {}
            self._decided: dict[tuple, dict] = {}
            self._calls: dict[str, dict] = {}
            self._after_tool: dict[str, Reply] = {}
            self._pending: dict[str, dict] = {}
            self._events: list[dict] = []
            self._usage: list[dict] = []              # the usage each response reported (note_usage)
            self._failures: list[dict] = []           # errors the next task requests get, in order
            self._unanswered: dict[str, str] = {}     # role -> a prompt a failure left undone
            self._compacted: set[str] = set()         # roles whose conversation has been compacted
            self._task_texts: tuple[str, ...] = ()    # require_task(): what every later prompt's request holds

    def require_task(self, *texts: str) -> None:
        """After a compaction of a role's conversation, every prompt or reminder of that role must reach the
        model in a request that holds each of ``texts``; one that does not is recorded (``without_task``)
        and not carried out. Cleared by ``set_script``."""
        with self._lock:
            self._task_texts = tuple(texts)

    def without_task(self) -> list[dict]:
        """The prompts and reminders that reached the model after a compaction without the task."""
        with self._lock:
            return [dict(e) for e in self._events if e["kind"] == "without task"]

    def fail_next(self, count: int, status: int = 529) -> None:
        """Answer the next ``count`` requests that carry a task (a prompt, or a message telling the agent
        to go on) with HTTP ``status``: 529 "overloaded" or 429 "rate limited", as a busy model API does.
        Side requests are answered as usual. A prompt left undone is carried out by the first later
        message to that agent that gets through, as a model told to continue the task above would."""
        with self._lock:
            self._failures.extend({"status": status} for _ in range(count))

    def usage_limit_next(self, count: int, resets_at: float | None = None, role: str | None = None,
                         resets_in: float | None = None, limit_headers: bool = False) -> None:
        """As ``fail_next``, with the HTTP 429 of a spent plan: Codex reads ``usage_limit_reached`` and
        ``resets_at`` (unix seconds; None: unknown; ``resets_in``: that many seconds after the answer) and
        stops the turn without retrying. With ``role``, only that role's task requests get them: a test then
        lets the limit meet a turn of an agent whose CLI started long before, never a CLI's start-up by
        chance. ``limit_headers``: the answer also carries Codex's rate-limit headers (x-codex-primary-*,
        100% used), with which Codex offers to switch to a cheaper model."""
        with self._lock:
            self._failures.extend({"status": 429, "usage_limit": True, "role": role, "resets_in": resets_in,
                                   "limit_headers": limit_headers,
                                   "resets_at": None if resets_at is None else int(resets_at)}
                                  for _ in range(count))

    def events(self) -> list[dict]:
        """Every decision taken, oldest first; ``time`` is when the answer went out (after thinking)."""
        with self._lock:
            return [dict(e) for e in self._events]

    def writes(self) -> list[dict]:
        """The decisions that sent a write command (a draft carries ``"draft": True``)."""
        with self._lock:
            return [
                {"time": e["time"], "role": e["role"], "turn": e["turn"], "path": e["path"], "draft": e.get("draft", False)}
                for e in self._events
                if e["action"] == "write"
            ]

    def turns(self) -> dict[str, int]:
        """Prompts taken per role."""
        with self._lock:
            return dict(self._turns)

    def compactions(self) -> list[dict]:
        """The compaction requests answered, oldest first, each with the role whose conversation it was."""
        with self._lock:
            return [dict(e) for e in self._events if e["kind"] == "compaction"]

    # ---- decisions

    def note_usage(self, reply: Reply, prompt_tokens: int) -> None:
        """Keep the usage a response reported: (role, turn) -> input not cached, cached input, output."""
        cached = cached_tokens(prompt_tokens)
        with self._lock:
            self._usage.append({"role": reply.role, "turn": reply.turn, "input": prompt_tokens - cached,
                                "cached_input": cached, "output": OUTPUT_TOKENS, "time": time.time()})

    def usage_entries(self) -> list[dict]:
        """Every response's usage as reported, side requests (role None) included, with when it was answered."""
        with self._lock:
            return [dict(entry) for entry in self._usage]

    def usage_by_turn(self) -> dict[tuple[str, int], tuple[int, int, int]]:
        """(role, its prompt count) -> the tokens its responses reported (side requests, with no role, left
        out): what the CLIs should have recorded for each turn."""
        found: dict[tuple[str, int], tuple[int, int, int]] = {}
        with self._lock:
            for entry in self._usage:
                if entry["role"] is not None:
                    key = (entry["role"], entry["turn"])
                    before = found.get(key, (0, 0, 0))
                    found[key] = (before[0] + entry["input"], before[1] + entry["cached_input"],
                                  before[2] + entry["output"])
        return found

    def models_by_role(self) -> dict[str, set[str]]:
        """role -> the models its requests named (side requests, which have no role, left out)."""
        found: dict[str, set[str]] = {}
        for event in self.events():
            if event["role"] is not None:
                found.setdefault(event["role"], set()).add(event["model"])
        return found

    def _record(self, convo: "Conversation", role, turn, kind: str, action: str, path, **extra) -> None:
        """Append one decision record, with the model the request named (caller holds no lock)."""
        entry = {"time": time.time(), "api": convo.api, "model": convo.model, "role": role, "turn": turn,
                 "kind": kind, "action": action, "path": path}
        entry.update(extra)
        with self._lock:
            self._events.append(entry)
        self._log("decisions.jsonl", entry)

    def _new_call(self, api: str, plan: dict, stage: str) -> str:
        """Register a tool call id so its result can be matched to the plan."""
        prefix = "toolu_scripted_" if api == "anthropic" else "call_scripted_"
        call_id = f"{prefix}{next(self._ids):06d}"
        with self._lock:
            self._calls[call_id] = {"plan": plan, "stage": stage}
        return call_id

    def _write_reply(self, convo: Conversation, plan: dict, text: str, stage: str, kind: str) -> Reply:
        """A tool call writing ``text`` to the plan's path, recorded as a write."""
        call_id = self._new_call(convo.api, plan, stage)
        self._record(convo, plan["role"], plan["turn"], kind, "write", plan["path"], draft=stage == "draft")
        return Reply(command=write_command(plan["path"], text), call_id=call_id, usage_tokens=plan.get("usage_tokens"),
                     role=plan["role"], turn=plan["turn"])

    def decide(self, convo: Conversation) -> Reply:
        """Choose the answer to one request, waiting the think time where the script says so."""
        if is_compaction(convo):
            # The prompt of the turn being compacted may share the message with the compaction prompt.
            role, path = last_prompted_role(convo.earlier_user_texts + [convo.newest_text or convo.user_text],
                                            mentions=True)
            self._record(convo, role, None, "compaction", "text", path)
            if role is not None:
                with self._lock:
                    self._compacted.add(role)
            return Reply(text=compaction_summary(role, path))
        if not convo.tool_names:
            self._record(convo, None, None, "side", "text", None)
            return Reply(text=side_text(convo))
        if convo.newest == "tool_result":
            return self._answer_tool_result(convo)
        if convo.newest != "user":
            self._record(convo, None, None, "side", "text", None)
            return Reply(text=side_text(convo))

        message = resolve_indirection(convo.user_text)
        last_role, _ = last_prompted_role(convo.earlier_user_texts)
        kind, role, path = classify(message, last_role)
        if kind == "side":
            self._record(convo, None, None, "side", "text", None)
            return Reply(text=side_text(convo))
        if self._lacks_task(convo, role):
            self._record(convo, role, None, "without task", "text", path)
            return Reply(text="The summary of our conversation does not say what the task is. Which task do you "
                              f"mean, and what should go into {path}?")

        with self._lock:
            failure = next((f for f in self._failures if f.get("role") in (None, role)), None)
            if failure is not None:
                self._failures.remove(failure)
            if failure is not None and kind == "prompt" and role is not None:
                self._unanswered[role] = message
            elif failure is None and kind == "reminder" and role in self._unanswered:
                message = self._unanswered.pop(role)          # "continue": the task above, done now
                kind, role, path = classify(message, last_role)
            elif failure is None and kind == "prompt":
                self._unanswered.pop(role, None)              # a new prompt supersedes the one left undone
        if failure is not None:
            status, limit = failure["status"], failure.get("usage_limit", False)
            if failure.get("resets_in") is not None:
                failure = {**failure, "resets_at": int(time.time() + failure["resets_in"])}
            extra = {"usage_limit": True, "resets_at": failure.get("resets_at")} if limit else {}
            self._record(convo, role, None, kind, "error", path, status=status, **extra)
            message = ("You've hit your usage limit." if limit
                       else "Overloaded" if status == 529 else "Rate limited")
            return Reply(error_status=status, error_message=message, usage_limit=limit,
                         resets_at=failure.get("resets_at"), limit_headers=failure.get("limit_headers", False))
        key = (kind, role, _digest(message), convo.user_count, convo.conversation_id)
        with self._lock:
            plan = self._decided.get(key)
            repeat = plan is not None
            if not repeat:
                plan = self._plan_prompt(role, path) if kind == "prompt" else self._plan_reminder(role, path)
                self._decided[key] = plan
        time.sleep(plan["think"])
        return self._carry_out(convo, plan, "repeat" if repeat else kind)

    def _lacks_task(self, convo: Conversation, role: str | None) -> bool:
        """Whether a request of a role whose conversation was compacted lacks one of require_task()'s texts."""
        with self._lock:
            texts, compacted = self._task_texts, role in self._compacted
        if not texts or not compacted:
            return False
        held = "\n".join([*convo.earlier_user_texts, convo.user_text, convo.newest_text])
        held += "\n" + "\n".join(resolve_indirection(text) for text in [*convo.earlier_user_texts, convo.user_text])
        return not all(text in held for text in texts)

    def _plan_prompt(self, role: str | None, path: str) -> dict:
        """Take the role's next step (lock held)."""
        turn = None
        steps = self._script.get(role) if role else None
        if role is not None:
            turn = self._turns.get(role, 0) + 1
            self._turns[role] = turn
        if isinstance(steps, (str, dict)):
            steps = [steps]
        step = steps[min(turn, len(steps)) - 1] if isinstance(steps, list) and steps and turn else {}
        step = normalise_step(step, role, self.think_seconds)
        if role is not None:
            self._pending.pop(role, None)  # a new prompt supersedes a held-back answer
            if step["action"] == "write_on_reminder":
                self._pending[role] = {"text": step["text"], "path": path, "turn": turn}
        return {**step, "role": role, "turn": turn, "path": path}

    def _plan_reminder(self, role: str, path: str) -> dict:
        """A reminder writes a held-back answer, or just says where the answer is (lock held)."""
        pending = self._pending.pop(role, None)
        if pending is None:
            return {"action": "no_file", "role": role, "turn": None, "path": path, "think": self.think_seconds,
                    "say": f"The answer is already in {path}."}
        target = path if os.path.isabs(path) else pending["path"]
        return {"action": "write", "role": role, "turn": pending["turn"], "path": target,
                "think": self.think_seconds, "text": pending["text"]}

    def _carry_out(self, convo: Conversation, plan: dict, kind: str) -> Reply:
        """Turn a plan into the reply for a prompt or reminder."""
        action = plan["action"]
        role, turn, path = plan["role"], plan["turn"], plan["path"]
        if action == "error":
            self._record(convo, role, turn, kind, "error", path)
            return Reply(error_status=plan["status"], error_message="Scripted server error")
        if action == "write_on_reminder":
            self._record(convo, role, turn, kind, "hold", path)
            return Reply(text=f"I have the answer ready and will write it to {path} when asked again.",
                         usage_tokens=plan.get("usage_tokens"), role=role, turn=turn)
        if action == "no_file":
            self._record(convo, role, turn, kind, "text", path)
            return Reply(text=plan.get("say", "I looked into it and have nothing to write this time."),
                         usage_tokens=plan.get("usage_tokens"), role=role, turn=turn)
        if action == "write_twice":
            return self._write_reply(convo, plan, plan["draft"], "draft", kind)
        return self._write_reply(convo, plan, plan["text"], "final", kind)

    def _answer_tool_result(self, convo: Conversation) -> Reply:
        """Finish the turn after a write; after a draft, write the final text once."""
        call_id = convo.tool_call_id or ""
        with self._lock:
            cached = self._after_tool.get(call_id)
            call = self._calls.get(call_id)
        if cached is not None:
            self._record(convo, call["plan"]["role"] if call else None, call["plan"]["turn"] if call else None,
                         "repeat", "write" if cached.command else "text", call["plan"]["path"] if call else None)
            return cached
        if call is None:
            self._record(convo, None, None, "tool_result", "text", None)
            return Reply(text="Done.")
        plan = call["plan"]
        if call["stage"] == "draft":
            time.sleep(plan["rewrite_after"])
            reply = self._write_reply(convo, plan, plan["text"], "final", "tool_result")
        else:
            time.sleep(plan.get("closing", 0.0))
            self._record(convo, plan["role"], plan["turn"], "tool_result", "text", plan["path"])
            usage = plan.get("closing_usage_tokens") or plan.get("usage_tokens")
            reply = Reply(text=f"Wrote the answer to {plan['path']}.", usage_tokens=usage,
                          role=plan["role"], turn=plan["turn"])
        with self._lock:
            self._after_tool[call_id] = reply
        return reply

    # ---- logging

    def _log(self, name: str, entry: dict) -> None:
        """Append a JSON line to a file in the log directory, if there is one."""
        if not self.log_dir:
            return
        try:
            with self._lock, open(self.log_dir / name, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(entry, ensure_ascii=False) + "\n")
        except OSError:
            pass

    def log_request(self, method: str, path: str, headers, body: bytes | dict | None, known: bool) -> None:
        """Keep every request for diagnosis: a summary line, plus the full body as a file."""
        n = next(self._logged)
        summary = {"n": n, "time": time.time(), "method": method, "path": path, "known": known}
        if isinstance(body, dict):
            summary["model"] = body.get("model")
            summary["stream"] = body.get("stream")
            summary["tools"] = [t.get("name") or (t.get("function") or {}).get("name") or t.get("type")
                                for t in body.get("tools") or [] if isinstance(t, dict)]
        summary["headers"] = {k.lower(): v for k, v in dict(headers or {}).items()
                              if k.lower() not in ("authorization", "x-api-key")}
        if not known:
            raw = body if isinstance(body, bytes) else json.dumps(body)[:200000].encode()
            record = {**summary, "headers": dict(headers), "body": raw.decode("utf-8", "replace")[:200000]}
            with self._lock:
                self.unknown_requests.append(record)
            self._log("unknown.jsonl", record)
        self._log("requests.jsonl", summary)
        if self.log_dir and isinstance(body, dict) and n <= MAX_LOGGED_BODIES:
            try:
                bodies = self.log_dir / "bodies"
                bodies.mkdir(exist_ok=True)
                (bodies / f"{n:05d}.json").write_text(json.dumps(body, indent=1, ensure_ascii=False), encoding="utf-8")
            except OSError:
                pass


# ---------------------------------------------------------------- HTTP


class _QuietServer(ThreadingHTTPServer):
    """A threading server that does not print when a client hangs up.

    The agent CLIs keep HTTP/1.1 connections open between requests; when a
    CLI exits or is killed, the idle connection is reset. The base class
    prints a traceback for that on sys.stderr, which at that moment belongs
    to whichever test is running (and may be asserting on its stderr).
    Other errors still print.
    """

    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    """Routes requests of every dialect to the model."""

    model: ScriptedModel
    protocol_version = "HTTP/1.1"
    server_version = "ScriptedModel/1.0"

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        """Keep test output quiet; requests are logged to files instead."""

    # ---- plumbing

    def _read_body(self) -> bytes:
        """Read the request body, plain or chunked, and undo gzip/deflate."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            data = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                data += self.rfile.read(size)
                self.rfile.readline()
            raw = bytes(data)
        else:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        encoding = self.headers.get("Content-Encoding", "").lower()
        if encoding == "gzip":
            raw = gzip.decompress(raw)
        elif encoding == "deflate":
            raw = zlib.decompress(raw)
        return raw

    def _send_json(self, status: int, payload, headers: dict | None = None) -> None:
        """Send a complete JSON response."""
        data = json.dumps(payload).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _start_stream(self) -> None:
        """Send the headers of a server-sent-events response; the connection closes at its end."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

    def _event(self, name: str, payload: dict) -> None:
        """Send one server-sent event."""
        self.wfile.write(f"event: {name}\ndata: {json.dumps(payload)}\n\n".encode("utf-8"))
        self.wfile.flush()

    def _unknown(self, body) -> None:
        """Log and refuse a route this server does not play."""
        self.model.log_request(self.command, self.path, self.headers, body, known=False)
        self._send_json(404, {"error": {"type": "not_found_error", "message": f"no route {self.command} {self.path}"}})

    # ---- routes

    def do_HEAD(self):  # noqa: N802 - http.server's naming
        """Connectivity probes get an empty 200."""
        self.model.log_request("HEAD", self.path, self.headers, None, known=True)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self):  # noqa: N802
        """Model listings and a health check."""
        route = self.path.split("?", 1)[0].rstrip("/")
        if route in ("/v1/models", "/models"):
            self.model.log_request("GET", self.path, self.headers, None, known=True)
            self._send_json(200, {"object": "list", "data": [model_entry("scripted")], "models": [], "has_more": False})
        elif route.startswith(("/v1/models/", "/models/")):
            self.model.log_request("GET", self.path, self.headers, None, known=True)
            self._send_json(200, model_entry(route.rsplit("/", 1)[1]))
        elif route in ("", "/health"):
            self.model.log_request("GET", self.path, self.headers, None, known=True)
            self._send_json(200, {"status": "ok"})
        else:
            self._unknown(b"")

    def do_POST(self):  # noqa: N802
        """Messages, token counts and responses."""
        route = self.path.split("?", 1)[0].rstrip("/")
        try:
            raw = self._read_body()
            body = json.loads(raw or b"{}")
        except (ValueError, OSError, zlib.error) as exc:
            self.model.log_request("POST", self.path, self.headers, f"undecodable body: {exc}".encode(), known=False)
            self._send_json(400, {"error": {"type": "invalid_request_error", "message": str(exc)}})
            return
        if not isinstance(body, dict):
            self._unknown(raw)
            return
        if route == "/v1/messages/count_tokens":
            self.model.log_request("POST", self.path, self.headers, body, known=True)
            self._send_json(200, {"input_tokens": max(1, len(raw) // 4)})
        elif route == "/v1/messages":
            self.model.log_request("POST", self.path, self.headers, body, known=True)
            self._anthropic(body, len(raw))
        elif route in ("/v1/responses", "/responses"):
            self.model.log_request("POST", self.path, self.headers, body, known=True)
            self._responses(body, len(raw))
        elif route in ("/v1/chat/completions", "/chat/completions"):
            self.model.log_request("POST", self.path, self.headers, body, known=True)
            self._chat(body, len(raw))
        else:
            self._unknown(body)

    # ---- Anthropic Messages API

    def _anthropic(self, body: dict, size: int) -> None:
        """Answer a Messages API request, streaming when asked to."""
        convo = parse_anthropic(body)
        reply = self.model.decide(convo)
        if reply.error_status:
            self._send_json(reply.error_status, *error_body(reply, "anthropic"))
            return
        blocks = []
        if reply.text:
            blocks.append({"type": "text", "text": reply.text})
        if reply.command is not None:
            tool = next((t for t in ANTHROPIC_SHELL_TOOLS if t in convo.tool_names), None)
            if tool is None:
                self.model._log("problems.jsonl", {"time": time.time(), "problem": "no shell tool", "tools": convo.tool_names})
                blocks.append({"type": "text", "text": f"I cannot run commands here; the answer was:\n{reply.command}"})
            else:
                blocks.append({"type": "tool_use", "id": reply.call_id, "name": tool,
                               "input": {"command": reply.command, "description": "Write the answer file"}})
        stop = "tool_use" if any(b["type"] == "tool_use" for b in blocks) else "end_turn"
        prompt_tokens = input_tokens(reply, size)
        cached = cached_tokens(prompt_tokens)       # Anthropic counts the cached part apart from input_tokens
        usage = {"input_tokens": prompt_tokens - cached, "output_tokens": OUTPUT_TOKENS,
                 "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}
        self.model.note_usage(reply, prompt_tokens)
        message = {"id": f"msg_scripted_{next(self.model._ids):06d}", "type": "message", "role": "assistant",
                   "model": body.get("model") or "scripted", "stop_sequence": None}
        if not body.get("stream"):
            self._send_json(200, {**message, "content": blocks, "stop_reason": stop, "usage": usage})
            return
        self._start_stream()
        self._event("message_start", {"type": "message_start", "message": {
            **message, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 1}}})
        self._event("ping", {"type": "ping"})
        for index, block in enumerate(blocks):
            if block["type"] == "text":
                self._event("content_block_start", {"type": "content_block_start", "index": index,
                                                    "content_block": {"type": "text", "text": ""}})
                delta = {"type": "text_delta", "text": block["text"]}
            else:
                self._event("content_block_start", {"type": "content_block_start", "index": index,
                                                    "content_block": {**block, "input": {}}})
                delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
            self._event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
            self._event("content_block_stop", {"type": "content_block_stop", "index": index})
        self._event("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                                      "usage": {"output_tokens": OUTPUT_TOKENS}})
        self._event("message_stop", {"type": "message_stop"})

    # ---- OpenAI Responses API

    def _responses(self, body: dict, size: int) -> None:
        """Answer a Responses API request, streaming when asked to."""
        convo = parse_responses(body)
        reply = self.model.decide(convo)
        if reply.error_status:
            self._send_json(reply.error_status, *error_body(reply, "responses"))
            return
        n = next(self.model._ids)
        items = []
        if reply.text:
            items.append({"type": "message", "id": f"msg_scripted_{n:06d}", "role": "assistant", "status": "completed",
                          "content": [{"type": "output_text", "text": reply.text, "annotations": []}]})
        if reply.command is not None:
            items.append(self._shell_item(body, reply, n))
        tokens = input_tokens(reply, size)
        usage = {"input_tokens": tokens, "input_tokens_details": {"cached_tokens": cached_tokens(tokens)},
                 "output_tokens": OUTPUT_TOKENS, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": tokens + OUTPUT_TOKENS}
        self.model.note_usage(reply, tokens)
        response = {"id": f"resp_scripted_{n:06d}", "object": "response", "created_at": int(time.time()),
                    "model": body.get("model") or "scripted", "status": "completed", "output": items, "usage": usage}
        if not body.get("stream"):
            self._send_json(200, response)
            return
        self._start_stream()
        seq = itertools.count()

        def send(payload: dict) -> None:
            self._event(payload["type"], {**payload, "sequence_number": next(seq)})

        started = {**response, "status": "in_progress", "output": [], "usage": None}
        send({"type": "response.created", "response": started})
        send({"type": "response.in_progress", "response": started})
        for index, item in enumerate(items):
            if item["type"] == "message":
                text = item["content"][0]["text"]
                send({"type": "response.output_item.added", "output_index": index,
                      "item": {**item, "status": "in_progress", "content": []}})
                part = {"type": "output_text", "text": "", "annotations": []}
                send({"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                      "content_index": 0, "part": part})
                send({"type": "response.output_text.delta", "item_id": item["id"], "output_index": index,
                      "content_index": 0, "delta": text})
                send({"type": "response.output_text.done", "item_id": item["id"], "output_index": index,
                      "content_index": 0, "text": text})
                send({"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                      "content_index": 0, "part": {**part, "text": text}})
            elif item["type"] == "function_call":
                send({"type": "response.output_item.added", "output_index": index,
                      "item": {**item, "status": "in_progress", "arguments": ""}})
                send({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                      "output_index": index, "delta": item["arguments"]})
                send({"type": "response.function_call_arguments.done", "item_id": item["id"],
                      "output_index": index, "arguments": item["arguments"]})
            else:
                send({"type": "response.output_item.added", "output_index": index, "item": item})
            send({"type": "response.output_item.done", "output_index": index, "item": item})
        send({"type": "response.completed", "response": response})

    def _shell_item(self, body: dict, reply: Reply, n: int) -> dict:
        """The output item that runs the reply's command with the shell tool Codex offered."""
        tools = {}
        for t in body.get("tools") or []:
            if isinstance(t, dict):
                tools.setdefault(t.get("name") or t.get("type"), t)
        for name in RESPONSES_SHELL_TOOLS:
            tool = tools.get(name)
            if tool is None or tool.get("type", "function") != "function":
                continue
            props = (tool.get("parameters") or {}).get("properties") or {}
            if "cmd" in props:
                args = {"cmd": reply.command}
            elif (props.get("command") or {}).get("type") == "array":
                args = {"command": ["bash", "-lc", reply.command]}
            else:
                args = {"command": reply.command}
            return {"type": "function_call", "id": f"fc_scripted_{n:06d}", "call_id": reply.call_id,
                    "name": name, "arguments": json.dumps(args), "status": "completed"}
        if "local_shell" in tools:
            return {"type": "local_shell_call", "id": f"lsh_scripted_{n:06d}", "call_id": reply.call_id,
                    "status": "completed", "action": {"type": "exec", "command": ["bash", "-lc", reply.command],
                                                      "env": {}, "timeout_ms": None, "working_directory": None,
                                                      "user": None}}
        self.model._log("problems.jsonl", {"time": time.time(), "problem": "no shell tool", "tools": list(tools)})
        return {"type": "message", "id": f"msg_noshell_{n:06d}", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "annotations": [],
                             "text": f"I cannot run commands here; the command was:\n{reply.command}"}]}

    # ---- OpenAI chat completions

    def _chat(self, body: dict, size: int) -> None:
        """Answer a chat completions request (OpenCode, Copilot, Hermes), streaming when asked to."""
        convo = parse_chat(body)
        # OpenCode's session, in a header; else Hermes's, in its system prompt (parse_chat)
        convo.conversation_id = self.headers.get("x-session-id") or convo.conversation_id
        reply = self.model.decide(convo)
        if reply.error_status:
            self._send_json(reply.error_status, *error_body(reply, "chat"))
            return
        n = next(self.model._ids)
        text = reply.text
        tool_calls = []
        if reply.command is not None:
            tool = next((t for t in CHAT_SHELL_TOOLS if t in convo.tool_names), None)
            if tool is None:
                self.model._log("problems.jsonl", {"time": time.time(), "problem": "no shell tool",
                                                   "tools": convo.tool_names})
                text = f"I cannot run commands here; the command was:\n{reply.command}"
            else:
                tool_calls.append({"id": reply.call_id, "type": "function",
                                   "function": {"name": tool, "arguments": chat_tool_arguments(body, tool, reply.command)}})
        elif COMPLETE_TOOL in convo.tool_names and not (convo.tool_call_id or "").startswith(COMPLETE_CALL_PREFIX):
            # Copilot's autopilot: the turn ends on task_complete, with what would have been said as its summary.
            tool_calls.append({"id": f"{COMPLETE_CALL_PREFIX}{n:06d}", "type": "function",
                               "function": {"name": COMPLETE_TOOL, "arguments": json.dumps({"summary": text or "Done."})}})
            text = ""
        finish = "tool_calls" if tool_calls else "stop"
        prompt_tokens = input_tokens(reply, size)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": OUTPUT_TOKENS,
                 "total_tokens": prompt_tokens + OUTPUT_TOKENS,
                 "prompt_tokens_details": {"cached_tokens": cached_tokens(prompt_tokens)}}
        self.model.note_usage(reply, prompt_tokens)
        head = {"id": f"chatcmpl-scripted-{n:06d}", "created": int(time.time()),
                "model": body.get("model") or "scripted"}
        if not body.get("stream"):
            message = {"role": "assistant", "content": text or None}
            if tool_calls:
                message["tool_calls"] = tool_calls
            self._send_json(200, {**head, "object": "chat.completion", "usage": usage,
                                  "choices": [{"index": 0, "message": message, "finish_reason": finish}]})
            return
        self._start_stream()

        def send_chunk(chunk: dict) -> None:
            self.wfile.write(f"data: {json.dumps({**head, 'object': 'chat.completion.chunk', **chunk})}\n\n".encode())
            self.wfile.flush()

        def send(delta: dict, finish_reason=None) -> None:
            send_chunk({"choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]})

        send({"role": "assistant", "content": ""})
        if text:
            send({"content": text})
        for index, call in enumerate(tool_calls):
            send({"tool_calls": [{"index": index, **call}]})
        send({}, finish)
        if (body.get("stream_options") or {}).get("include_usage"):
            send_chunk({"choices": [], "usage": usage})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


# ---------------------------------------------------------------- manual use


def main(argv: list[str] | None = None) -> int:
    """Serve until interrupted, for trying a CLI against the scripted model by hand."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--think", type=float, default=0.5, help="default think time in seconds")
    parser.add_argument("--log-dir", type=Path, default=None)
    parser.add_argument("--script", type=Path, default=None, help="JSON file {role: [step, ...]}")
    args = parser.parse_args(argv)
    model = ScriptedModel(think_seconds=args.think, log_dir=args.log_dir)
    if args.script:
        model.set_script(json.loads(args.script.read_text(encoding="utf-8")))
    model.start(args.port)
    print(f"scripted model listening on {model.url}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        model.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
