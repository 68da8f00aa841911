"""CPU seconds a test cost: the worker's own and that of every process it started (the
product's processes and their Spark JVMs and Python workers, MinIO), with the share of the
worker's emulator and shared Spark JVM used meanwhile.

The suite is CPU-bound on two cores, so its wall time follows the CPU its tests spend, not their
durations (a test waiting on stream time beside a busy one looks long and costs little). A JVM
outlives the Python process that started it by a moment and is then nobody's child, so processes
are followed by sampling ``/proc``, not by the kernel's count of waited-for children: a process
that lived less than one interval (1 s) is missed. A sample reads every process's stat: about
1 ms per hundred processes, half a percent of a core per worker.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

PROPERTY = "cpu_s"
"""The user property (and junit property) holding a test's CPU seconds."""
_TICKS = os.sysconf("SC_CLK_TCK")
Process = tuple[int, int]
"""A process: its pid and its start time (pids are reused)."""


def _stat(pid: int) -> tuple[int, int, float] | None:
    """(parent pid, start time, CPU seconds) of a process, None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return int(fields[1]), int(fields[19]), (int(fields[11]) + int(fields[12])) / _TICKS


class CpuSampler:
    """Follows this process and every process started under it, alive or since ended."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self._root = os.getpid()
        self._seen: dict[Process, float] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(interval_s,), name="cpu-sampler", daemon=True
        )

    def start(self) -> CpuSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()

    def _run(self, interval_s: float) -> None:
        while not self._stopped.wait(interval_s):
            self.sample()

    def sample(self) -> None:
        """The latest CPU of each process under the root, or followed before (an orphan)."""
        stats = {int(p): _stat(int(p)) for p in os.listdir("/proc") if p.isdigit()}
        with self._lock:
            for pid, stat in stats.items():
                if stat is None:
                    continue
                process = (pid, stat[1])
                if process in self._seen or self._under_root(pid, stats):
                    self._seen[process] = stat[2]

    def _under_root(self, pid: int, stats: dict[int, tuple[int, int, float] | None]) -> bool:
        while pid > 1:
            if pid == self._root:
                return True
            stat = stats.get(pid)
            if stat is None:
                return False
            pid = stat[0]
        return False

    def mark(self) -> dict[Process, float]:
        """The CPU seen so far, process by process."""
        self.sample()
        with self._lock:
            return dict(self._seen)

    def spent(self, since: dict[Process, float]) -> float:
        """CPU seconds since ``since``: each process's growth, a new one whole."""
        now = self.mark()
        return round(sum(cpu - since.get(process, 0.0) for process, cpu in now.items()), 1)
