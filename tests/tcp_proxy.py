"""A loopback TCP proxy that cuts its connections at random: network faults for a real client."""

from __future__ import annotations

import contextlib
import random
import socket
import threading
from collections.abc import Iterator


class ChaosProxy:
    def __init__(self, upstream: str, cut_every: tuple[float, float], seed: int) -> None:
        host, port = upstream.rsplit(":", 1)
        self._upstream = (host, int(port))
        self._cut_every = cut_every
        self._rng = random.Random(seed)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._connections: list[tuple[socket.socket, socket.socket]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.cuts = 0

    def start(self) -> None:
        threading.Thread(target=self._accept, daemon=True).start()
        threading.Thread(target=self._chaos, daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self._listener.close()
        with self._lock:
            for pair in self._connections:
                self._close(pair)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self._upstream)
            with self._lock:
                self._connections.append((client, upstream))
            for source, target in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(source, target), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, target: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                target.sendall(data)
        with contextlib.suppress(OSError):
            target.shutdown(socket.SHUT_WR)

    @staticmethod
    def _close(pair: tuple[socket.socket, socket.socket]) -> None:
        for sock in pair:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _chaos(self) -> None:
        while not self._stop.wait(self._rng.uniform(*self._cut_every)):
            with self._lock:
                if not self._connections:
                    continue
                pair = self._connections.pop(self._rng.randrange(len(self._connections)))
            self._close(pair)
            self.cuts += 1


@contextlib.contextmanager
def chaos_proxy(upstream: str, cut_every: tuple[float, float], seed: int) -> Iterator[ChaosProxy]:
    proxy = ChaosProxy(upstream, cut_every, seed)
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()
