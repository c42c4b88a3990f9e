"""A local stand-in for an ntfy server that records every publish request.

``NtfyRecorder(mode)`` listens on 127.0.0.1 (a free port) in a thread:
"ok" answers 200 like ntfy, "refuse" answers 403, "hang" holds each request
for ``hang_seconds`` before answering. ``down_url()`` gives an address where
nothing listens. Each request is kept as a dict: method, path, headers
(lower-case names), body (text).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class NtfyRecorder:
    def __init__(self, mode: str = "ok", hang_seconds: float = 10.0):
        self.mode = mode
        self.hang_seconds = hang_seconds
        self.requests: list[dict] = []
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
