"""A respx stand-in for the CAO HTTP API whose "agents" write response files.

Each terminal plays the role its agent profile names. When a prompt arrives
it reports `processing` for a few status polls, then acts out the next step
of the test's script for that role -- by default it writes the reply to the
response file the prompt names, as a real agent following the prompt would
-- and reports `completed`. A `codex` terminal also marks its state on its
screen as Codex does: `idle` once started up, then since each input `working`
once it starts on what it was sent, and `done`, `idle` when it is idle or has
completed its turn again (`turn_marks` adds other CLIs that mark their turns).

A step is either a reply text or a dict:
    {"text": str, "action": "write" | "no_file" | "write_on_reminder" | "error" | "call",
     "polls": int, "idle_polls": int, "idle_seconds": float,
     "permission_polls": int, "ignore_answers": bool,
     "call": callable(fake, terminal) run instead of answering}
The role's last step repeats when its script runs out. A message that names
no response file is a reminder (or a permission answer): it is recorded in
`reminders` and uses no step; "write_on_reminder" writes its text only then.

Tests that depend on what runs at the same time do not sleep and hope: the
fake holds a request until the moment the test needs has come
(`creations_at_once`, `session_exists_when`, `refusals_wait_for_session`,
`wait_until`), and `MainThreadSignals` delivers Ctrl-C or SIGTERM and waits
until Python has handled it. A hold that waits WAIT_SECONDS in vain lets the
request go on and says so in `gave_up`, which such tests assert is empty.
"""

from __future__ import annotations

import concurrent.futures.thread
import itertools
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import respx

PROFILE_ROLES = {
    "system_analyst": "analyst",
    "peer_system_analyst": "peer_analyst",
    "programmer": "programmer",
    "peer_programmer": "peer_programmer",
    "tester": "tester",
}

ANALYST_REPLY = """ANALYST_SUMMARY:
- Change: openspec/changes/add-greeting
- Artifacts: proposal.md, design.md, specs/greeting/spec.md, tasks.md
- P1 requirements: greet NAME prints Hello, NAME! (scenario test step 1)
- Contracts: CLI `greet NAME`, exit code 0, output on stdout
- Handoff: implement greet.py, add tests/test_greet.py
"""

APPROVED_ANALYSIS = """REVIEW_RESULT: APPROVED
REVIEW_NOTES:
- Artifacts: proposal.md and tasks.md exist and match the task
- P1 traceability: the one P1 requirement traces to the scenario test
- Downstream contract: CLI signature and exit code are exact
- Handoff: the first steps are actionable
"""

APPROVED_CODE = """REVIEW_RESULT: APPROVED
REVIEW_NOTES:
- Tests: pytest passed (3 passed)
- Files: greet.py implements the task
- Requirements: the scenario is covered
- Edge cases: empty name handled with an error message
"""

PROGRAMMER_REPLY = """PROGRAMMER_SUMMARY:
- Files changed: greet.py, tests/test_greet.py
- Behavior implemented: greet NAME prints Hello, NAME!
- Tests run: pytest -q (3 passed)
- Known gaps: none
"""

PASS_REPLY = """RESULT: PASS
EVIDENCE:
- greet World printed Hello, World!
"""

FAIL_REPLY = """RESULT: FAIL
EVIDENCE:
- greet World printed Hello World (missing comma)
- Recommended next fix: greet.py format string
"""

DEFAULT_REPLIES = {
    "analyst": ANALYST_REPLY,
    "peer_analyst": APPROVED_ANALYSIS,
    "programmer": PROGRAMMER_REPLY,
    "peer_programmer": APPROVED_CODE,
    "tester": PASS_REPLY,
}

# Codex's turn-state marks, as it prints them (docs/agent-clis.md).
CODEX_WORKING = "\x1b]7501;state=working:app=codex\x1b\\"
CODEX_IDLE = "\x1b]7501;state=idle:app=codex\x1b\\"
CODEX_ENDED = "\x1b]7501;state=done:app=codex\x1b\\" + CODEX_IDLE

# The longest the fake holds a request for what a test arranged; then it goes on, noting it in `gave_up`.
WAIT_SECONDS = 10.0

RESPONSE_LINE = re.compile(r"^Write your complete answer to this file: (.+)$", re.MULTILINE)
PROMPT_FILE_LINE = re.compile(r"^Read and follow the instructions in this file: (.+)$", re.MULTILINE)


@dataclass
class Terminal:
    id: str
    session: str
    role: str
    profile: str
    provider: str
    working_directory: str
    status: str = "idle"
    polls_left: int = 0
    idle_polls: int = 0       # polls still showing idle before the agent starts working
    idle_until: float = 0.0
    pending: dict | None = None
    held_text: str | None = None     # "write_on_reminder": written when a reminder arrives
    permission_polls: int = 0        # polls still showing waiting_user_answer
    permission_answers: int = 0
    response_path: str = ""
    last_output: str = ""
    exited: bool = False
    echo: str = ""                   # the input echoed since the last input (CAO clears its screen then)
    printed: str = ""                # what the agent printed since the last input (likewise)
    started: bool = False            # the agent has started on the last input (a codex terminal marks its turn)
    sent_to: bool = False            # it had input (before, a codex terminal's screen shows its start-up mark)
    cli_dead: bool = False           # the agent CLI died: the pane shows a shell prompt, input runs as commands
    window_gone: bool = False        # its tmux window is gone: CAO cannot read its screen (404)
    deleted: bool = False


@dataclass
class FakeCao:
    base_url: str = "http://cao.test"
    script: dict[str, list] = field(default_factory=dict)
    polls_per_turn: int = 1
    terminals: dict[str, Terminal] = field(default_factory=dict)
    prompts: list[tuple[str, str]] = field(default_factory=list)     # (role, message) in order
    reminders: list[tuple[str, str]] = field(default_factory=list)   # (role, message) of other inputs
    prompt_files: list[tuple[str, str, str]] = field(default_factory=list)  # (role, path, message sent)
    requests: list[httpx.Request] = field(default_factory=list)
    fail_create: dict[str, tuple[int, str]] = field(default_factory=dict)  # profile -> (status, detail)
    fail_late: set[str] = field(default_factory=set)  # profiles in fail_create whose session request fails
                                                      # only after its session existed (agent start-up)
    turns: dict[str, int] = field(default_factory=dict)
    create_delay: float = 0.0            # seconds each terminal's agent takes to "start"
    session_setup: float = 0.0           # seconds into a session request before its session exists
    sessions: set[str] = field(default_factory=set)     # names of the sessions that exist
    create_answers: list[tuple[str, int]] = field(default_factory=list)  # (profile, HTTP status) of creations
    startup_polls: int = 0               # polls a new terminal shows `processing` before it is ready
    outage: int = 0                      # the next N requests find the server down (connection refused)
    required_token: str = ""             # answer 401 to requests without this bearer token
    server_errors: dict[str, int] = field(default_factory=dict)  # route kind -> number of 503 answers
    broken_answers: dict[str, int] = field(default_factory=dict)  # route kind -> requests carried out whose
                                                                  # answer then breaks off (a server restart)
    # As CAO 2.5.4: an idempotency key -> the terminal its first request made; the same key asked again answers
    # that terminal while it exists (a key whose terminal is gone makes a new one).
    idempotency: dict[str, str] = field(default_factory=dict)
    idempotent_answers: int = 0          # creations answered with the terminal an earlier request made
    reported_status: str = ""            # answer every status read with this word (e.g. "unknown")
    create_hook: object = None           # callable(profile) run as each terminal creation starts (for an
                                         # add: once its session exists)
    missing_clis: set = field(default_factory=set)  # providers whose CLI /agents/providers reports missing
    provider_lookups: int = 0
    missing_profiles: set = field(default_factory=set)  # agent profiles GET /agents/profiles/{name} does not know
    providers_status: int = 200          # e.g. 404: a server without the providers route
    creating_now: int = 0
    creating_peak: int = 0
    creations_at_once: int = 0           # each agent start waits until this many creations are under way at once
    session_exists_when: object = None  # callable() -> bool: a session request waits for it before its
                                         # session exists (after create_hook)
    refusals_wait_for_session: bool = False  # an add refused "Session ... not found" is answered only once
                                             # the session request is over (its thread done with it)
    create_answered_at: list[float] = field(default_factory=list)  # time.monotonic() of each create_answers entry
    gave_up: list[str] = field(default_factory=list)   # holds that waited WAIT_SECONDS in vain
    swallow: dict[str, int] = field(default_factory=dict)  # role -> prompts a dialog swallows (never shown)
    swallowed: list[tuple[str, str]] = field(default_factory=list)  # (role, message) taken by a dialog
    shell_inputs: list[tuple[str, str]] = field(default_factory=list)  # (role, message) typed into a shell
    deleted_sessions: list[str] = field(default_factory=list)
    keys: list[tuple[str, str]] = field(default_factory=list)  # (role, key) of single key presses
    key_hook: object = None              # callable(fake, terminal, key) run on each key press
    # provider -> (its start-up mark, the mark of a turn started, of a turn ended): a CLI that marks its turns
    turn_marks: dict[str, tuple[str, str, str]] = field(
        default_factory=lambda: {"codex": (CODEX_IDLE, CODEX_WORKING, CODEX_ENDED)})
    _session_thread: int | None = None   # the thread that sent the (last) session request
    _session_answered: bool = False
    _lock: threading.RLock = field(default_factory=threading.RLock)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    # -- what tests look at -------------------------------------------------
    def roles_prompted(self) -> list[str]:
        return [role for role, _ in self.prompts]

    def prompts_for(self, role: str) -> list[str]:
        return [message for r, message in self.prompts if r == role]

    def terminal_for(self, role: str) -> Terminal:
        return next(t for t in self.terminals.values() if t.role == role)

    def exited_ids(self) -> list[str]:
        return [t.id for t in self.terminals.values() if t.exited]

    # -- faults ------------------------------------------------------------------
    def kill_cli(self, role: str) -> Terminal:
        """The role's agent CLI dies (a crash, the OOM killer): a shell prompt in its pane, the status stuck."""
        terminal = self.current_terminal(role)
        terminal.cli_dead, terminal.pending, terminal.status = True, None, "processing"
        terminal.echo += "Killed\n\x1b[?2004hbash-5.2# "
        return terminal

    def end_session(self, session: str, screens_too: bool = False) -> None:
        """The agents' tmux session ends (a killed tmux server, a reboot): CAO still answers for the terminals,
        with their old screens or (`screens_too`, as CAO 2.5.4 did once) none."""
        with self._lock:
            self.sessions.discard(session)
        for terminal in self.terminals.values():
            if terminal.session == session:
                terminal.pending, terminal.window_gone = None, screens_too

    def current_terminal(self, role: str) -> Terminal:
        """The role's newest terminal that is not deleted (after a replacement, the new one)."""
        return [t for t in self.terminals.values() if t.role == role and not t.deleted][-1]

    def wait_until(self, what: str, ready) -> bool:
        """Hold the calling request until ready() is true; after WAIT_SECONDS in vain go on, noting it in
        `gave_up` (then later holds go on at once: the test fails anyway, and soon)."""
        deadline = time.monotonic() + WAIT_SECONDS
        with self._changed:
            while not ready():
                if self.gave_up or time.monotonic() >= deadline:
                    self.gave_up.append(f"waited {WAIT_SECONDS:g}s for {what}")
                    return False
                self._changed.wait(0.01)    # also looks again by itself: some conditions are other threads' state
        return True

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def _session_request_over(self) -> bool:
        return self._session_answered and not running_pool_task(self._session_thread)

    def add_terminals(self, session: str = "cao-saved") -> dict[str, str]:
        """Terminals that already exist on the server, as a saved run left them."""
        ids = {}
        self.sessions.add(session)
        for profile, role in PROFILE_ROLES.items():
            terminal = Terminal(id=f"{next(self._ids):08x}", session=session, role=role, profile=profile,
                                provider="codex", working_directory="")
            self.terminals[terminal.id] = terminal
            ids[role] = terminal.id
        return ids

    # -- wiring ---------------------------------------------------------------
    def __post_init__(self) -> None:
        self._changed = threading.Condition(self._lock)

    def install(self, router: respx.MockRouter) -> "FakeCao":
        self.router = router              # a test may add routes, e.g. pass-through to a local server
        base = self.base_url
        # The routes match apart, so their order is free: respx tries them in turn, the most asked first.
        routes = [
            ("status", "GET", r"/terminals/[^/?]+$", self._status),
            ("output", "GET", r"/terminals/[^/]+/output", self._output),
            ("create", "POST", r"/sessions\?", self._create_session),
            ("create", "POST", r"/sessions/[^/]+/terminals", self._create_terminal),
            ("input", "POST", r"/terminals/[^/]+/input", self._input),
            ("key", "POST", r"/terminals/[^/]+/key", self._key),
            ("exit", "POST", r"/terminals/[^/]+/exit", self._exit),
            ("delete", "DELETE", r"/terminals/[^/?]+$", self._delete_terminal),
            ("session", "GET", r"/sessions/[^/?]+$", self._session),
            ("delete", "DELETE", r"/sessions/[^/?]+$", self._delete_session),
        ]
        for kind, method, path, handler in routes:
            router.route(method=method, url__regex=rf"^{re.escape(base)}{path}").mock(
                side_effect=self._guarded(kind, handler))
        # Outside the guard: the start-up look at the providers is not part of what tests count.
        router.route(method="GET", url__regex=rf"^{re.escape(base)}/agents/providers").mock(
            side_effect=self._providers)
        router.route(method="GET", url__regex=rf"^{re.escape(base)}/health$").mock(
            side_effect=self._guarded("health", lambda request: httpx.Response(200, json={"status": "ok"})))
        router.route(method="GET", url__regex=rf"^{re.escape(base)}/agents/profiles/[^/?]+$").mock(
            side_effect=self._guarded("profile", self._profile))
        return self

    def _profile(self, request: httpx.Request) -> httpx.Response:
        name = request.url.path.rsplit("/", 1)[1]
        if name in self.missing_profiles:
            return httpx.Response(404, json={"detail": f"Agent profile not found: {name}"})
        return httpx.Response(200, json={"name": name})

    def _providers(self, request: httpx.Request) -> httpx.Response:
        self.provider_lookups += 1
        if self.providers_status != 200:
            return httpx.Response(self.providers_status, json={"detail": "Not Found"})
        return httpx.Response(200, json=[
            {"name": name, "binary": binary, "installed": name not in self.missing_clis}
            for name, binary in (("claude_code", "claude"), ("codex", "codex"), ("kiro_cli", "kiro-cli"))])

    def _guarded(self, kind: str, handler):
        """Outages, auth and injected 5xx answers apply to every route alike."""
        def handle(request: httpx.Request) -> httpx.Response:
            self.requests.append(request)
            if self.outage > 0:
                self.outage -= 1
                raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
            if self.required_token and request.headers.get("Authorization") != f"Bearer {self.required_token}":
                return httpx.Response(401, json={"detail": "Unauthorized"})
            if self.server_errors.get(kind, 0) > 0:
                self.server_errors[kind] -= 1
                return httpx.Response(503, json={"detail": "Service Unavailable"})
            response = handler(request)
            if self.broken_answers.get(kind, 0) > 0:
                self.broken_answers[kind] -= 1
                raise httpx.RemoteProtocolError("Server disconnected without sending a response.",
                                                request=request)
            return response
        return handle

    # -- handlers -------------------------------------------------------------
    def _params(self, request: httpx.Request) -> dict[str, str]:
        return {k: v[0] for k, v in parse_qs(urlsplit(str(request.url)).query, keep_blank_values=True).items()}

    def _create_session(self, request: httpx.Request) -> httpx.Response:
        with self._changed:
            self._session_thread, self._session_answered = threading.get_ident(), False
        try:
            return self._create_session_now(request)
        finally:
            with self._changed:
                self._session_answered = True
                self._changed.notify_all()

    def _made_before(self, request: httpx.Request) -> httpx.Response | None:
        """The answer for a creation whose idempotency key made a terminal that still exists (None: none)."""
        params = self._params(request)
        with self._lock:
            terminal = self.terminals.get(self.idempotency.get(params.get("idempotency_key", ""), ""))
            if terminal is None or terminal.deleted:
                return None
            self.idempotent_answers += 1
        return httpx.Response(201, json={"id": terminal.id, "session_name": terminal.session, "status": "idle",
                                         "provider": terminal.provider, "agent_profile": terminal.profile,
                                         "model": params.get("model"),
                                         "model_honored": terminal.provider != "mock_cli"})

    def _create_session_now(self, request: httpx.Request) -> httpx.Response:
        """As CAO 2.5.4: the session exists while its first agent starts, and is gone again if that fails."""
        made = self._made_before(request)
        if made is not None:
            return made
        params = self._params(request)
        profile = params.get("agent_profile", "")
        name = params.get("session_name") or f"{len(self.terminals) + 1:04d}"
        name = name if name.startswith("cao-") else f"cao-{name}"
        with self._lock:
            if name in self.sessions:
                return self._answer(profile, 400, {"detail": f"Session '{name}' already exists"})
        if self.create_hook is not None:
            self.create_hook(profile)
        if profile in self.fail_create and profile not in self.fail_late:
            return self._answer(profile, *self._refusal(profile))
        if self.session_exists_when is not None:
            self.wait_until(f"what the test set before session {name} may exist", self.session_exists_when)
        time.sleep(self.session_setup)
        with self._lock:
            self.sessions.add(name)
        self._notify()
        response = self._start_agent(request, name)
        if response.status_code >= 400:
            with self._lock:
                self.sessions.discard(name)
            self._notify()
        return response

    def _create_terminal(self, request: httpx.Request) -> httpx.Response:
        made = self._made_before(request)
        if made is not None:
            return made
        session = urlsplit(str(request.url)).path.split("/")[2]
        profile = self._params(request).get("agent_profile", "")
        with self._lock:
            refused = session not in self.sessions
        if refused:
            if self.refusals_wait_for_session:
                self.wait_until("the session request to be over", self._session_request_over)
            return self._answer(profile, 404, {"detail": f"Session '{session}' not found"})
        if self.create_hook is not None:
            self.create_hook(profile)
        return self._start_agent(request, session)

    def _start_agent(self, request: httpx.Request, session: str) -> httpx.Response:
        """The agent CLI starts (create_delay), then the terminal is answered, or its injected failure."""
        params = self._params(request)
        profile = params.get("agent_profile", "")
        with self._changed:
            self.creating_now += 1
            self.creating_peak = max(self.creating_peak, self.creating_now)
            self._changed.notify_all()
        if self.creations_at_once:
            self.wait_until(f"{self.creations_at_once} creations under way at once",
                            lambda: self.creating_peak >= self.creations_at_once)
        time.sleep(self.create_delay)
        with self._changed:
            self.creating_now -= 1
            self._changed.notify_all()
            if profile in self.fail_create:
                return self._answer(profile, *self._refusal(profile))
            if session in self.deleted_sessions:   # DELETE /sessions while the agent started: its window went too
                return self._answer(profile, 500, {"detail": f"Session '{session}' not found"})
            terminal = Terminal(id=f"{next(self._ids):08x}", session=session,
                                role=PROFILE_ROLES.get(profile, profile), profile=profile,
                                provider=params.get("provider", ""),
                                working_directory=params.get("working_directory", ""))
            if self.startup_polls:
                terminal.status, terminal.polls_left = "processing", self.startup_polls
            self.terminals[terminal.id] = terminal
            if params.get("idempotency_key"):
                self.idempotency[params["idempotency_key"]] = terminal.id
            # As CAO 2.5.4: the model asked for, and whether the provider passes it to its CLI (mock_cli does not).
            model = params.get("model")
            return self._answer(profile, 201, {"id": terminal.id, "session_name": session, "status": "idle",
                                               "provider": terminal.provider, "agent_profile": profile,
                                               "model": model, "model_honored": terminal.provider != "mock_cli"})

    def _refusal(self, profile: str) -> tuple[int, dict]:
        status, detail = self.fail_create[profile]
        return status, {"detail": detail}

    def _answer(self, profile: str, status: int, body: dict) -> httpx.Response:
        with self._changed:
            self.create_answers.append((profile, status))
            self.create_answered_at.append(time.monotonic())
            self._changed.notify_all()
        return httpx.Response(status, json=body)

    def _terminal(self, request: httpx.Request) -> Terminal | None:
        terminal_id = urlsplit(str(request.url)).path.split("/")[2]
        terminal = self.terminals.get(terminal_id)
        return None if terminal is None or terminal.exited or terminal.deleted else terminal

    def _missing(self, request: httpx.Request) -> httpx.Response:
        terminal_id = urlsplit(str(request.url)).path.split("/")[2]
        return httpx.Response(404, json={"detail": f"Terminal '{terminal_id}' not found"})

    def _session(self, request: httpx.Request) -> httpx.Response:
        name = urlsplit(str(request.url)).path.split("/")[2]
        with self._lock:
            if name not in self.sessions:
                return httpx.Response(404, json={"detail": f"Session '{name}' not found"})
            listed = [{"id": t.id, "status": t.status} for t in self.terminals.values()
                      if t.session == name and not t.deleted]
        return httpx.Response(200, json={"session": {"id": name, "name": name}, "terminals": listed})

    def _delete_session(self, request: httpx.Request) -> httpx.Response:
        name = urlsplit(str(request.url)).path.split("/")[2]
        with self._lock:
            self.deleted_sessions.append(name)
            self.sessions.discard(name)
            for terminal in self.terminals.values():
                if terminal.session == name:
                    terminal.deleted = True
        return httpx.Response(200, json={"success": True, "deleted": [name]})

    def _delete_terminal(self, request: httpx.Request) -> httpx.Response:
        terminal_id = urlsplit(str(request.url)).path.split("/")[2]
        terminal = self.terminals.get(terminal_id)
        if terminal is None or terminal.deleted:
            return self._missing(request)
        terminal.deleted = True
        return httpx.Response(200, json={"success": True})

    def _input(self, request: httpx.Request) -> httpx.Response:
        params = self._params(request)
        terminal = self._terminal(request)
        if terminal is None:
            return self._missing(request)
        message = params.get("message", "")
        if terminal.session not in self.sessions:
            return httpx.Response(500, json={"detail": "Failed to send input: Command '['tmux', 'load-buffer', "
                                                       "'-b', 'cao_x', '-']' returned non-zero exit status 1."})
        if terminal.cli_dead:
            self.shell_inputs.append((terminal.role, message))
            return httpx.Response(200, json={"success": True})
        if self.swallow.get(terminal.role, 0) > 0 and RESPONSE_LINE.search(message):
            self.swallow[terminal.role] -= 1
            self.swallowed.append((terminal.role, message))
            terminal.echo = "Trust this folder?\n> 1. Trust and continue\n"
            return httpx.Response(200, json={"success": True})
        terminal.printed, terminal.started, terminal.sent_to = "", False, True
        lines = [line for line in message.splitlines() if line.strip()]
        shown = lines[:1] + [line for line in lines[1:] if RESPONSE_LINE.match(line)]
        terminal.echo = "".join(f"> {line}\n" for line in shown)
        indirect = PROMPT_FILE_LINE.search(message)
        if indirect:                      # a long prompt, handed over as a file
            self.prompt_files.append((terminal.role, indirect.group(1).strip(), message))
            message = Path(indirect.group(1).strip()).read_text(encoding="utf-8")
        found = RESPONSE_LINE.search(message)
        if not found:
            return self._other_input(terminal, message)
        self.prompts.append((terminal.role, message))
        terminal.response_path = found.group(1).strip() if found else ""
        turn = self.turns.get(terminal.role, 0)
        self.turns[terminal.role] = turn + 1
        steps = self.script.get(terminal.role) or [DEFAULT_REPLIES.get(terminal.role, "ok")]
        step = steps[min(turn, len(steps) - 1)]
        step = {"text": step} if isinstance(step, str) else dict(step)
        terminal.pending = step
        terminal.polls_left = step.get("polls", self.polls_per_turn)
        terminal.idle_polls = step.get("idle_polls", 0)
        if "idle_seconds" in step:          # idle by the clock, whatever the polling rate
            terminal.idle_until = time.monotonic() + step["idle_seconds"]
            terminal.idle_polls = 10**9
        terminal.permission_polls = step.get("permission_polls", 0)
        terminal.status = "idle" if terminal.idle_polls else "processing"
        terminal.started = terminal.status == "processing"
        return httpx.Response(200, json={"success": True})

    def _key(self, request: httpx.Request) -> httpx.Response:
        key = self._params(request).get("key", "")
        terminal = self._terminal(request)
        if terminal is None:
            return self._missing(request)
        self.keys.append((terminal.role, key))
        if self.key_hook is not None:
            self.key_hook(self, terminal, key)
        return httpx.Response(200, json={"success": True})

    def _other_input(self, terminal: Terminal, message: str) -> httpx.Response:
        self.reminders.append((terminal.role, message))
        terminal.printed, terminal.started, terminal.sent_to = "", False, True
        terminal.idle_polls = 0
        if message == "y" and terminal.status == "waiting_user_answer":
            terminal.permission_answers += 1
            if not (terminal.pending or {}).get("ignore_answers"):
                terminal.permission_polls = 0
                terminal.status = "processing"
        elif terminal.held_text is not None:
            terminal.pending = {"text": terminal.held_text}
            terminal.held_text = None
            terminal.polls_left = self.polls_per_turn
            terminal.status = "processing"
        elif terminal.status in ("idle", "completed"):
            terminal.pending = {"action": "no_file", "text": terminal.last_output}
            terminal.polls_left = self.polls_per_turn
            terminal.status = "processing"
        terminal.started = terminal.status == "processing"
        return httpx.Response(200, json={"success": True})

    def _status(self, request: httpx.Request) -> httpx.Response:
        self._params(request)
        terminal = self._terminal(request)
        if terminal is None:
            return self._missing(request)
        self._status_for(terminal)
        return httpx.Response(200, json={"id": terminal.id, "status": self.reported_status or terminal.status,
                                         "session_name": terminal.session})

    def _status_for(self, terminal: Terminal) -> None:
        """One status reading: the terminal's agent moves on by one step (none once it is gone)."""
        if terminal.cli_dead or terminal.session not in self.sessions:
            return
        if terminal.idle_polls > 0:
            terminal.idle_polls -= 1
            if terminal.idle_until and time.monotonic() >= terminal.idle_until:
                terminal.idle_polls, terminal.idle_until = 0, 0.0
            if terminal.idle_polls == 0:
                terminal.status, terminal.started = "processing", True
        elif terminal.status == "processing" and terminal.permission_polls > 0:
            terminal.status = "waiting_user_answer"
        elif terminal.status == "waiting_user_answer":
            terminal.permission_polls -= 1
            if terminal.permission_polls <= 0:
                terminal.status, terminal.started = "processing", True
        elif terminal.status == "processing" and terminal.pending is None and terminal.polls_left > 0:
            terminal.polls_left -= 1          # still starting up
            if terminal.polls_left == 0:
                terminal.status = "idle"
        elif terminal.status == "processing":
            if terminal.polls_left > 0:
                terminal.polls_left -= 1
            else:
                self._finish_turn(terminal)

    def _finish_turn(self, terminal: Terminal) -> None:
        step, terminal.pending = terminal.pending or {}, None
        action = step.get("action", "write")
        text = step.get("text", "")
        terminal.last_output = terminal.printed = text
        if action == "call":
            step["call"](self, terminal)
            return
        if action == "error":
            terminal.status = "error"
            return
        if action == "write_on_reminder":
            terminal.held_text = text
            terminal.last_output = terminal.printed = step.get("output", "")
        if action == "write" and terminal.response_path:
            path = Path(terminal.response_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        terminal.status = "completed"

    def _output(self, request: httpx.Request) -> httpx.Response:
        mode = self._params(request).get("mode", "full")
        terminal = self._terminal(request)
        if terminal is None:
            return self._missing(request)
        if terminal.window_gone:
            return httpx.Response(404, json={"detail": f"Terminal '{terminal.id}' output not found"})
        if mode == "full":              # the screen since the last input: the echoed prompt, then the reply
            screen = terminal.echo if terminal.cli_dead else terminal.echo + self._marked(terminal)
            return httpx.Response(200, json={"output": screen, "mode": "full"})
        return httpx.Response(200, json={"output": terminal.last_output, "mode": "last"})

    def _marked(self, terminal: Terminal) -> str:
        """What the agent printed, with the marks its CLI (Codex, or one of `turn_marks`) puts around a turn."""
        marks = self.turn_marks.get(terminal.provider)
        if marks is None or not terminal.started:
            return (marks[0] if marks and not terminal.sent_to else "") + terminal.printed
        return marks[1] + terminal.printed + (marks[2] if terminal.status in ("idle", "completed") else "")

    def _exit(self, request: httpx.Request) -> httpx.Response:
        self._params(request)
        terminal = self._terminal(request)
        if terminal is None:
            return self._missing(request)
        terminal.exited = True
        return httpx.Response(200, json={"success": True})


_POOL_TASK = concurrent.futures.thread._WorkItem.run.__code__


def running_pool_task(thread_id: int | None) -> bool:
    """Whether that thread is running a creation: a thread the loop started for one (in_background(), named
    `cao-...`), or a task of a concurrent.futures thread pool."""
    if any(thread.ident == thread_id and thread.name.startswith("cao-") for thread in threading.enumerate()):
        return True
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if frame.f_code is _POOL_TASK:
            return True
        frame = frame.f_back
    return False


def pool_tasks_elsewhere() -> int:
    """How many threads other than the caller's are running a creation (running_pool_task())."""
    me = threading.get_ident()
    return sum(running_pool_task(ident) for ident in sys._current_frames() if ident != me)


class MainThreadSignals:
    """Ctrl-C or SIGTERM sent to the main thread as from outside, and a way to know it has been handled.

    A signal from a terminal or `kill` reaches the main thread, where Python
    runs its handler at some moment afterwards. `send` follows the signal with
    a marker signal of a higher number: CPython runs the handlers of pending
    signals in the order of their numbers, so once the marker's handler has
    set `handled`, the handler of the signal sent has run. Enter it in the
    main thread (signal handlers can only be set there); `send` from any.
    """

    MARKER = getattr(signal, "SIGRTMIN", signal.SIGUSR2)

    def __enter__(self) -> "MainThreadSignals":
        assert self.MARKER > max(signal.SIGINT, signal.SIGTERM)
        self.handled = threading.Event()
        self._previous = signal.signal(self.MARKER, lambda signum, frame: self.handled.set())
        return self

    def __exit__(self, *exc_info) -> None:
        signal.signal(self.MARKER, self._previous)

    def send(self, signum: int) -> None:
        self.handled.clear()
        main = threading.main_thread().ident
        signal.pthread_kill(main, signum)
        signal.pthread_kill(main, self.MARKER)


def review(verdict: str, notes: str = "") -> str:
    """A review reply with the given verdict and notes."""
    return f"REVIEW_RESULT: {verdict}\nREVIEW_NOTES:\n{notes}\n"

