"""The service's health endpoints, for container probes."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ingest.delta.batcher import Batcher


class HealthServer:
    """``/healthz``: the reader loop is turning. ``/readyz``: a commit within ``readiness_s``."""

    def __init__(self, port: int, readiness_s: float, batcher: Batcher) -> None:
        self.last_tick = time.monotonic()
        self._batcher = batcher
        self._readiness_s = readiness_s
        health = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                ok, body = health.check(self.path)
                self.send_response(200 if ok else 503)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(json.dumps(body).encode())

            def log_message(self, *_: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("0.0.0.0", port), Handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def check(self, path: str) -> tuple[bool, dict[str, object]]:
        now = time.monotonic()
        if path.startswith("/healthz"):
            age = now - self.last_tick
            return age < 30, {"reader_loop_age_s": round(age, 3)}
        if path.startswith("/readyz"):
            committed = self._batcher.commits > 0
            age = now - self._batcher.last_commit_at
            return committed and age < self._readiness_s, {
                "commits": self._batcher.commits,
                "last_commit_age_s": round(age, 3) if committed else None,
            }
        return False, {"error": "unknown path"}

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
