"""The service's health endpoints, for container probes, its Prometheus ``/metrics``, and the one
control request it takes: ``POST /snapshot?table=…`` (an on-demand table snapshot).

Reads are open, as probes and scrapers need. The control request changes data (full table reads,
change-log writes), so it needs ``Authorization: Bearer <token>`` with the token of a mounted
secret; without a configured token it is refused, never open."""

from __future__ import annotations

import hmac
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Protocol
from urllib.parse import parse_qs, urlsplit

SnapshotRequests = Callable[[list[str]], tuple[int, dict[str, object]]]
ControlToken = Callable[[], str | None]
"""The token a control request must carry, read when the request comes (a rotated secret takes
effect without a restart); None when control is off."""
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def token_file(path: str) -> ControlToken:
    """The control token kept in ``path`` (a mounted secret), read at each request; '' turns
    control off."""

    def read() -> str | None:
        if not path:
            return None
        try:
            token = Path(path).read_text().strip()
        except OSError:
            return None
        return token or None

    return read


class Committer(Protocol):
    """What readiness looks at: the snapshot's committer first, then the batcher."""

    @property
    def commits(self) -> int: ...

    @property
    def last_commit_at(self) -> float: ...


@dataclass
class Commits:
    commits: int = 0
    last_commit_at: float = 0.0

    def count(self) -> None:
        self.commits += 1
        self.last_commit_at = time.monotonic()


class HealthServer:
    """``/healthz``: the reader loop (or the snapshot's committer) is turning. ``/readyz``: a
    commit within ``readiness_s``, and no stuck partition restarted ``max_stuck_restarts`` times
    in a row without moving."""

    def __init__(
        self,
        port: int,
        readiness_s: float,
        committer: Committer,
        max_stuck_restarts: int = 3,
        control_token: ControlToken = lambda: None,
    ) -> None:
        self._control_token = control_token
        self.last_tick = time.monotonic()
        self.committer = committer
        self.snapshot_requests: SnapshotRequests | None = None
        self.stuck_restarts: Callable[[], int] = lambda: 0
        """Restarts in a row of the reader's most stuck partition that did not move it on."""
        self.metrics: Callable[[], bytes] | None = None
        """The Prometheus exposition of the service's metrics (``/metrics``)."""
        self._readiness_s = readiness_s
        self._max_stuck_restarts = max_stuck_restarts
        health = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.startswith("/metrics") and health.metrics is not None:
                    payload = health.metrics()
                    self.send_response(200)
                    self.send_header("Content-Type", METRICS_CONTENT_TYPE)
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                ok, body = health.check(self.path)
                self._send(200 if ok else 503, body)

            def do_POST(self) -> None:
                self._send(*health.post(self.path, self.headers.get("Authorization")))

            def _send(self, status: int, body: dict[str, object]) -> None:
                self.send_response(status)
                if status == 401:
                    self.send_header("WWW-Authenticate", 'Bearer realm="ingest control"')
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
            committed = self.committer.commits > 0
            age = now - self.committer.last_commit_at
            stuck = self.stuck_restarts()
            ready = committed and age < self._readiness_s and stuck < self._max_stuck_restarts
            return ready, {
                "commits": self.committer.commits,
                "last_commit_age_s": round(age, 3) if committed else None,
                "stuck_partition_restarts": stuck,
            }
        return False, {"error": "unknown path"}

    def post(self, path: str, authorization: str | None) -> tuple[int, dict[str, object]]:
        url = urlsplit(path)
        if url.path != "/snapshot":
            return 404, {"error": "unknown path"}
        refused = self._unauthorized(authorization)
        if refused is not None:
            return 401, {"error": refused}
        if self.snapshot_requests is None:
            return 503, {"error": "not streaming yet (the initial snapshot is running)"}
        return self.snapshot_requests(parse_qs(url.query).get("table", []))

    def _unauthorized(self, authorization: str | None) -> str | None:
        """Why the request may not change anything, or None when its bearer token is the one."""
        expected = self._control_token()
        if expected is None:
            return "control requests are off: no readable control token (control_token_file)"
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            return "a control request needs 'Authorization: Bearer <token>'"
        if not hmac.compare_digest(given.strip().encode(), expected.encode()):
            return "the token does not match the service's control token"
        return None

    def tick(self) -> None:
        self.last_tick = time.monotonic()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
