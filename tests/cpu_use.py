"""CPU seconds a test cost: the worker's own and that of every process it started (the
product's processes and their Spark JVMs and Python workers, MinIO), with the share of the
worker's emulator and shared Spark JVM used meanwhile.

The suite is CPU-bound on two cores, so its wall time follows the CPU its tests spend, not their
durations (a test waiting on stream time beside a busy one looks long and costs little). A JVM
outlives the Python process that started it by a moment and is then nobody's child, so processes
are followed by sampling ``/proc``, not by the kernel's count of waited-for children: a process
that lived less than one interval (1 s) is missed. A sample reads every process's stat: about
1 ms per hundred processes, half a percent of a core per worker.

Each process is also given a kind from its command line when first seen (a JVM by the process that
started it: a pipeline's, ``spark-run``'s, the test worker's own session; a script, which may
exec java, is looked at again), so a run says where its CPU went: Spark's JVMs, their Python
workers, the emulator, the ingest service, the tests' own code.
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from pathlib import Path

PROPERTY = "cpu_s"
"""The user property (and junit property) holding a test's CPU seconds."""
_TICKS = os.sysconf("SC_CLK_TCK")
Process = tuple[int, int]
"""A process: its pid and its start time (pids are reused)."""
KINDS_PROPERTY = "cpu_s_by_kind"
"""The user property holding a test's CPU seconds by kind of process (``kind_of``)."""
TEST_WORKER = "the test worker"
"""The kind of the sampler's own process: the tests' code, their clients and workloads."""
_PYTHON_KINDS = (
    ("runtime.python_daemon", "Spark's Python workers"),
    ("pyspark.", "Spark's Python workers"),
    ("-m pipeline", "pipeline (Python)"),
    ("spark-run", "spark-run (Python)"),
    ("-m ingest", "ingest"),
    ("bench/", "bench script (Python)"),
)
"""A Python process's kind by the first of these its command line holds."""


def core_speed(turns: int = 1_000_000, rounds: int = 3) -> float:
    """Millions of turns of a fixed pure-Python loop per CPU-second of this process, the best of
    a few rounds (the first is often slower): the speed of one of this machine's cores, so runs
    on VMs of one name but another speed compare (the same tests have cost 2,964 to 3,998 CPU-s
    on two "AMD EPYC" VMs). CPU time, not wall time: with both cores of a VM kept busy the
    figure stayed within the spread of idle runs (bench/RESULTS.md, "The suite")."""
    best = 0.0
    for _ in range(rounds):
        started = time.process_time()
        total = 0
        for turn in range(turns):
            total += turn & 7
        best = max(best, turns / 1e6 / max(time.process_time() - started, 1e-9))
    return best


def kind_of(command: str, parent: str) -> str:
    """What a process is, from its command line and its parent's kind (a JVM is its parent's
    Spark driver, unless it is a cluster's)."""
    program = Path(command.split(" ", 1)[0]).name
    if program == "java":
        for name, kind in (
            ("CoarseGrainedExecutorBackend", "Spark executor"),
            ("deploy.master.Master", "Spark cluster"),
            ("deploy.worker.Worker", "Spark cluster"),
        ):
            if name in command:
                return kind
        return f"JVM of {parent.removesuffix(' (Python)')}"
    if program in ("emulator_main", "gateway_main"):
        return "emulator"
    if program == "minio":
        return "MinIO"
    if program.startswith("python"):
        return next((kind for word, kind in _PYTHON_KINDS if word in command), "other Python")
    return "other"


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
        root = _stat(self._root)
        self._kinds: dict[Process, str] = {}
        if root is not None:
            self._kinds[(self._root, root[1])] = TEST_WORKER
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
                    if self._kinds.get(process, "other") == "other":  # a script may exec java
                        self._kinds[process] = self._kind(pid, stats)

    def _kind(self, pid: int, stats: dict[int, tuple[int, int, float] | None]) -> str:
        """A new process's kind; its parent's first, where the sampler has not met it yet."""
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            return "other"
        stat = stats.get(pid)
        parent_stat = None if stat is None else stats.get(stat[0])
        parent = "other"
        if stat is not None and parent_stat is not None:
            key = (stat[0], parent_stat[1])
            if key not in self._kinds:
                self._kinds[key] = self._kind(stat[0], stats)
            parent = self._kinds[key]
        return kind_of(command.decode(errors="replace").strip(), parent)

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

    def spent(self, since: dict[Process, float]) -> dict[str, float]:
        """CPU seconds since ``since`` by kind of process: each process's growth, a new one
        whole."""
        now = self.mark()
        by_kind: defaultdict[str, float] = defaultdict(float)
        with self._lock:
            for process, cpu in now.items():
                by_kind[self._kinds.get(process, "other")] += cpu - since.get(process, 0.0)
        return dict(by_kind)
