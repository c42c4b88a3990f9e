"""A local stand-in for an ntfy server that records every publish request.

``NtfyRecorder(mode)`` listens on 127.0.0.1 (a free port) in a thread:
"ok" answers 200 like ntfy, "refuse" answers 403, "hang" holds each request
for ``hang_seconds`` before answering. ``down_url()`` gives an address where
nothing listens. Each request is kept as a dict: method, path, headers
(lower-case names), body (text).

As ntfy does, it keeps what is published to a topic -- `POST /<topic>` with the
message as the body, or `POST /` with ntfy's JSON (`topic`, `message`, ...) --
and answers a poll, `GET /<topic>/json?poll=1`, with one JSON line per message
(`id`, `time`, `event`: "message", `topic`, `message`).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse


class NtfyRecorder:
    def __init__(self, mode: str = "ok", hang_seconds: float = 10.0):
        self.mode = mode
        self.hang_seconds = hang_seconds
        self.requests: list[dict] = []
        self.topics: dict[str, list[dict]] = {}     # topic -> the messages published to it, in order
        self.answered = 0          # requests answered so far (a "hang" answers after hang_seconds)
        self._stop = threading.Event()
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's naming)
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length).decode("utf-8", "replace")
                recorder.requests.append({"method": "POST", "path": self.path,
                                          "headers": {k.lower(): v for k, v in self.headers.items()},
                                          "body": body})
                if recorder.mode == "ok":
                    recorder.keep(self.path, body)
                if recorder.mode == "hang":
                    recorder._stop.wait(recorder.hang_seconds)
                status = 403 if recorder.mode == "refuse" else 200
                answer = json.dumps({"id": "x1", "event": "message"} if status == 200
                                    else {"code": 40301, "error": "forbidden"}).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(answer)))
                    self.end_headers()
                    self.wfile.write(answer)
                    recorder.answered += 1
                except OSError:
                    pass             # the client gave up waiting (the "hang" mode)

            def do_GET(self):  # noqa: N802
                recorder.requests.append({"method": "GET", "path": self.path,
                                          "headers": {k.lower(): v for k, v in self.headers.items()}, "body": ""})
                topic, _, kind = urlparse(self.path).path.strip("/").partition("/")
                status = 200 if recorder.mode == "ok" and kind == "json" else 403 if recorder.mode == "refuse" else 404
                answer = "".join(json.dumps(m) + "\n" for m in recorder.topics.get(topic, [])) if status == 200 else ""
                self.send_response(status)
                self.send_header("Content-Type", "application/x-ndjson")
                self.send_header("Content-Length", str(len(answer.encode())))
                self.end_headers()
                self.wfile.write(answer.encode())

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "NtfyRecorder":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()

    def keep(self, path: str, body: str) -> None:
        """A publish kept under its topic: the path's, or the JSON body's (ntfy's JSON publish to the root)."""
        topic = urlparse(path).path.strip("/")
        fields = {}
        if not topic:
            fields = json.loads(body)
            topic, body = fields["topic"], fields.get("message", "")
        messages = self.topics.setdefault(topic, [])
        messages.append({"id": f"m{len(messages) + 1}", "time": int(time.time()), "event": "message", "topic": topic,
                         "message": body, **{k: v for k, v in fields.items() if k in ("title", "actions")}})

    def published(self, topic: str) -> list[dict]:
        return self.topics.get(topic, [])

    def wait_for(self, count: int, timeout: float = 5.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while len(self.requests) < count and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.requests


def down_url() -> str:
    """An http:// address on this machine where nothing listens (connection refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"
