"""Find and start the Cloud Spanner emulator on a free loopback port."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from emulator.processes import terminate

_SDK_ROOTS = ("/usr/lib/google-cloud-sdk", "/usr/share/google-cloud-sdk", "/opt/google-cloud-sdk")
_RELATIVE_BINARY = Path("bin/cloud_spanner_emulator/emulator_main")


class EmulatorNotFound(RuntimeError):
    pass


def find_emulator_binary() -> Path:
    """SPANNER_EMULATOR_BIN, then ``emulator_main`` on PATH, then the gcloud SDK: its usual
    places first, ``gcloud info`` (a Python start, about 1.5 CPU-s) only when none holds it."""
    explicit = os.environ.get("SPANNER_EMULATOR_BIN")
    if explicit:
        if not Path(explicit).is_file():
            raise EmulatorNotFound(f"SPANNER_EMULATOR_BIN={explicit} is not a file")
        return Path(explicit)
    on_path = shutil.which("emulator_main")
    if on_path:
        return Path(on_path)
    gcloud = shutil.which("gcloud")
    roots = [*_SDK_ROOTS, str(Path(gcloud).resolve().parent.parent)] if gcloud else [*_SDK_ROOTS]
    found = _binary_under(roots) or (_binary_under([_gcloud_sdk_root(gcloud)]) if gcloud else None)
    if found is None:
        raise EmulatorNotFound(
            "Cloud Spanner emulator not found: set SPANNER_EMULATOR_BIN, put emulator_main on "
            "PATH or install google-cloud-cli-spanner-emulator"
        )
    return found


def _binary_under(roots: list[str]) -> Path | None:
    for root in roots:
        candidate = Path(root) / _RELATIVE_BINARY
        if root and candidate.is_file():
            return candidate
    return None


def _gcloud_sdk_root(gcloud: str) -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return subprocess.run(
            [gcloud, "info", "--format=value(installation.sdk_root)"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.strip()
    return ""


def free_port() -> int:
    """A loopback port nothing listens on, for a process started later to listen on.

    Not one the kernel would pick (``bind`` to port 0): it takes those from its ephemeral range,
    as it does for every outgoing connection's own port, and such a connection took a port
    chosen minutes before its process bound it (seen in the suite: a pipeline's metrics port,
    ``Address already in use``). Ports come in turn from a block below that range, one block per
    pytest-xdist worker, so no two tests get the same port either."""
    for _ in range(_PORTS.size):
        port = _PORTS.next()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in {_PORTS}")


@dataclass
class _PortBlock:
    """This process's ports for ``free_port``: ``size`` of them from ``first``, handed out in
    turn from a random place (a worker's own scripts share its block)."""

    first: int
    size: int
    turn: int

    @classmethod
    def of_this_process(cls, lowest: int = 10_000) -> _PortBlock:
        ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
        below = int(ephemeral.read_text().split()[0]) if ephemeral.exists() else 32_768
        lowest = min(lowest, below // 3)
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
        worker = os.environ.get("PYTEST_XDIST_WORKER", "")
        index = int(worker.removeprefix("gw")) if worker.startswith("gw") else workers
        size = (below - lowest) // (workers + 1)
        return cls(lowest + index * size, size, random.randrange(size))

    def next(self) -> int:
        port = self.first + self.turn % self.size
        self.turn += 1
        return port


_PORTS = _PortBlock.of_this_process()


@dataclass
class RunningEmulator:
    host_port: str
    process: subprocess.Popen[bytes] | None
    command: list[str] = field(default_factory=list)
    output: Any = subprocess.DEVNULL

    def restart(self) -> None:
        """A fresh emulator on the same address (its databases are gone): after it stalled."""
        if self.process is None:
            raise RuntimeError(f"the emulator at {self.host_port} was not started here")
        terminate(self.process, timeout=10)
        self.process = _start(self.command, self.output)
        _wait_listening(self.host_port, self.process, timeout=30)


def _start(command: list[str], output: Any) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
    )


def _wait_listening(host_port: str, process: subprocess.Popen[bytes], timeout: float) -> None:
    host, port = host_port.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"emulator exited with code {process.returncode}")
        with socket.socket() as probe:
            if probe.connect_ex((host, int(port))) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"emulator did not listen on {host_port} within {timeout} s")


@contextlib.contextmanager
def emulator(
    token_alive_seconds: int | None = None,
    churn: bool = True,
    log_path: Path | None = None,
) -> Iterator[RunningEmulator]:
    """A fresh emulator for the block; nothing persists across emulator restarts."""
    port = free_port()
    host_port = f"127.0.0.1:{port}"
    command = [str(find_emulator_binary()), "--host_port", host_port]
    if token_alive_seconds is not None:
        command.append(
            f"--override_change_stream_partition_token_alive_seconds={token_alive_seconds}"
        )
    if not churn:
        command.append("--enable_change_stream_churning=false")
    with contextlib.ExitStack() as stack:
        output = stack.enter_context(open(log_path, "wb")) if log_path else subprocess.DEVNULL
        running = RunningEmulator(host_port, _start(command, output), command, output)
        try:
            assert running.process is not None
            _wait_listening(host_port, running.process, timeout=30)
            yield running
        finally:
            if running.process is not None:
                terminate(running.process, timeout=10)
