"""An HTTP proxy on loopback between the product and an object store that injects the store's
faults: a connection dropped before the request reaches the store, an answer held back past the
client's timeout (after the store acted on it), and a write the store accepted whose answer never
reaches the client."""

from __future__ import annotations

import asyncio
import json
import random
import re
import subprocess
import sys
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import yarl
from aiohttp import ClientSession, ClientTimeout, web

HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "content-length",
}
WRITES = ("PUT", "POST", "DELETE")
CONDITIONS = ("if-none-match", "if-match")


@dataclass(frozen=True, slots=True)
class FaultRates:
    """Chance of each fault per request; ``lost_answer`` applies to writes only."""

    drop: float = 0.0
    delay: float = 0.0
    lost_answer: float = 0.0
    delay_s: float = 35.0
    path: str = ""
    """Only requests whose path and query match this pattern are faulted."""
    methods: tuple[str, ...] = ()
    """Only requests of these methods are faulted (all when empty)."""
    ignore_conditions: bool = False
    """Act as a store without conditional writes: drop ``If-None-Match`` and ``If-Match``."""


class StoreFaults:
    """The proxy in a process of its own (delta-rs holds the GIL through some of its requests,
    so a proxy thread in the caller's process would wait for the very call it should answer).
    Rates change and counts are read over ``/__faults__/`` on the proxy's port."""

    def __init__(self, upstream: str, rates: FaultRates, seed: int) -> None:
        self.upstream = upstream
        self._rates = rates
        self._seed = seed
        self._process: subprocess.Popen[str] | None = None
        self.address = ""

    def start(self) -> StoreFaults:
        self._process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.store_faults",
                self.upstream,
                str(self._seed),
                json.dumps(asdict(self._rates)),
            ],
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parent.parent,
        )
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line.startswith("http://"):
            raise RuntimeError(f"the fault proxy did not start: {line!r}")
        self.address = line.strip()
        return self

    def set_rates(self, rates: FaultRates) -> None:
        self._control("rates", json.dumps(asdict(rates)).encode())

    @property
    def counts(self) -> Counter[str]:
        return Counter(json.loads(self._control("counts")))

    def _control(self, what: str, body: bytes | None = None) -> bytes:
        with urllib.request.urlopen(f"{self.address}/__faults__/{what}", body, 30) as answer:
            return answer.read()

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(30)

    def __enter__(self) -> StoreFaults:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Proxy:
    def __init__(self, upstream: str, rates: FaultRates, seed: int) -> None:
        self.upstream = upstream.rstrip("/")
        self.rates = rates
        self.counts: Counter[str] = Counter()
        self._rng = random.Random(seed)
        self._session: ClientSession | None = None

    async def serve(self) -> None:
        self._session = ClientSession(
            timeout=ClientTimeout(total=300),
            auto_decompress=False,
            skip_auto_headers=["Accept", "Accept-Encoding", "User-Agent", "Content-Type"],
        )
        app = web.Application(client_max_size=1 << 30)
        app.router.add_get("/__faults__/counts", self._counts)
        app.router.add_post("/__faults__/rates", self._set_rates)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        print(f"http://127.0.0.1:{port}", flush=True)
        await asyncio.Event().wait()

    async def _counts(self, request: web.Request) -> web.Response:
        return web.json_response(dict(self.counts))

    async def _set_rates(self, request: web.Request) -> web.Response:
        self.rates = FaultRates(**_rates_json(await request.text()))
        return web.json_response({})

    def _draw(self, method: str, path: str) -> str | None:
        rates = self.rates
        if rates.path and not re.search(rates.path, path):
            return None
        if rates.methods and method not in rates.methods:
            return None
        roll = self._rng.random()
        if roll < rates.drop:
            return "drop"
        roll -= rates.drop
        if roll < rates.delay:
            return "delay"
        roll -= rates.delay
        if method in WRITES and roll < rates.lost_answer:
            return "lost_answer"
        return None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        fault = self._draw(request.method, request.path_qs)
        if fault == "drop":
            self.counts["drop"] += 1
            return _cut(request)
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        if self.rates.ignore_conditions:
            headers = {k: v for k, v in headers.items() if k.lower() not in CONDITIONS}
        async with self._session.request(
            request.method,
            yarl.URL(self.upstream + request.raw_path, encoded=True),
            headers=headers,
            data=body if body or request.method in WRITES else None,
            allow_redirects=False,
        ) as answer:
            content = await answer.read()
            answer_headers = [
                (k, v) for k, v in answer.headers.items() if k.lower() not in HOP_BY_HOP
            ]
            length = answer.headers.get("Content-Length")
        self.counts["requests"] += 1
        if fault == "lost_answer":
            self.counts["lost_answer"] += 1
            return _cut(request)
        if fault == "delay":
            self.counts["delay"] += 1
            await asyncio.sleep(self.rates.delay_s)
        response = web.Response(status=answer.status, body=content or None)
        for key, value in answer_headers:
            response.headers.add(key, value)
        if request.method == "HEAD" and length is not None:
            response.headers["Content-Length"] = length
        return response


def _cut(request: web.Request) -> web.StreamResponse:
    """Close the client's connection without an answer."""
    if request.transport is not None:
        request.transport.abort()
    raise asyncio.CancelledError


def _rates_json(text: str) -> dict:
    fields = json.loads(text)
    fields["methods"] = tuple(fields.get("methods", ()))
    return fields


if __name__ == "__main__":
    upstream, seed, rates = sys.argv[1:4]
    proxy = _Proxy(upstream, FaultRates(**_rates_json(rates)), int(seed))
    asyncio.run(proxy.serve())
