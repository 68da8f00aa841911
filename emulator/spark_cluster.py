"""A Spark standalone cluster on loopback from the pyspark distribution: a master and workers
started with ``spark-class``, each in a process group of its own so a test can kill a worker
together with its executor (as a lost node)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pyspark

from emulator.server import free_port

SPARK_HOME = Path(pyspark.__file__).parent


class StandaloneCluster:
    def __init__(self, root: Path, worker_memory: str = "2g") -> None:
        self.root = root
        self.worker_memory = worker_memory
        self.port = free_port()
        self.ui_port = free_port()
        self.processes: list[subprocess.Popen[bytes]] = []
        self.env = {**os.environ, "SPARK_HOME": str(SPARK_HOME), "SPARK_LOCAL_IP": "127.0.0.1"}

    @property
    def master_url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    def _spark_class(self, name: str, *arguments: str) -> subprocess.Popen[bytes]:
        log = self.root / f"{name}-{len(self.processes)}.log"
        with log.open("ab") as out:
            process = subprocess.Popen(
                [str(SPARK_HOME / "bin" / "spark-class"), *arguments],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.processes.append(process)
        return process

    def start(self, workers: int) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self._spark_class(
            "master",
            "org.apache.spark.deploy.master.Master",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--webui-port",
            str(self.ui_port),
        )
        for _ in range(workers):
            self.start_worker()
        self.wait_for_workers(workers)

    def start_worker(self) -> subprocess.Popen[bytes]:
        """A worker offering one core; its executors run in its process group."""
        work = self.root / f"work-{len(self.processes)}"
        work.mkdir()
        return self._spark_class(
            "worker",
            "org.apache.spark.deploy.worker.Worker",
            self.master_url,
            "--host",
            "127.0.0.1",
            "--cores",
            "1",
            "--memory",
            self.worker_memory,
            "--webui-port",
            "0",
            "--work-dir",
            str(work),
        )

    def state(self, timeout: float = 30) -> dict[str, Any]:
        """The master's view (its web UI's JSON): workers, applications. A busy master can
        answer its page empty (seen in CI under load): asked again until ``timeout``."""
        url = f"http://127.0.0.1:{self.ui_port}/json/"
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    return json.loads(response.read())
            except ValueError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.2)

    def wait_for_workers(self, count: int, timeout: float = 120) -> set[str]:
        """Until ``count`` workers are alive; their ids."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                alive = self.alive_worker_ids()
            except OSError:
                alive = set()
            if len(alive) == count:
                return alive
            assert time.monotonic() < deadline, f"{len(alive)} of {count} workers alive"
            time.sleep(0.5)

    def wait_for_a_worker_besides(self, known: set[str], timeout: float = 120) -> set[str]:
        """Until a worker not in ``known`` is alive (the master may list a killed one as alive
        for a while, so a count alone cannot tell the replacement has registered); the new ids."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                new = self.alive_worker_ids() - known
            except OSError:
                new = set()
            if new:
                return new
            assert time.monotonic() < deadline, "no new worker registered"
            time.sleep(0.5)

    def executor_pids(self, worker: subprocess.Popen[bytes]) -> list[int]:
        """Executor JVMs the worker started (children in its process group)."""
        found = subprocess.run(
            ["pgrep", "-g", str(worker.pid), "-f", "CoarseGrainedExecutorBackend"],
            capture_output=True,
            text=True,
        )
        return [int(pid) for pid in found.stdout.split()]

    def alive_worker_ids(self) -> set[str]:
        return {w["id"] for w in self.state()["workers"] if w["state"] == "ALIVE"}

    def kill_worker(self, worker: subprocess.Popen[bytes]) -> None:
        """kill -9 of the worker, its executor and the executor's Python workers: a lost node."""
        _kill_group(worker)

    def stop(self) -> None:
        for process in reversed(self.processes):
            _kill_group(process)


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
