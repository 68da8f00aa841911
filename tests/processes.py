"""The product's processes as tests start them: the ingest service and the pipeline."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from emulator.processes import Process, wait_on_progress
from emulator.verify import LandedTransactions
from emulator.workload import CommittedTransaction, Workload, WorkloadConfig
from ingest.model.timestamps import Nanos, to_rfc3339

BANKING = dict(transfer_weight=1.0, all_types_weight=0.0, cleanup_weight=0.0)
BANKING_TABLES = ("accounts", "transfers")
"""The tables the BANKING workload writes (all_types stays empty, its mirror too)."""
INGEST_STOP_S = 60
"""How long a clean stop of the ingest service may take: its pod's grace period
(deploy/kubernetes/ingest.yaml), after which Kubernetes kills it. A stop the product itself
finds slow logs ``stop_slow`` after 20 s (runtime/stopping.py)."""
PIPELINE_STOP_S = 120
"""The same for a running pipeline, whose stop lets the batch in flight end
(deploy/kubernetes/pipeline.yaml)."""


STARTED_SERVICES: list[Service] = []
"""The services the running test started, and those a module's fixture started that still run:
a failed emulator test audits their change logs (tests/conftest.py), so an emulator omission is
told apart from the product's loss."""


class Service(Process):
    """``python -m ingest run`` for one job, with short intervals so tests move fast; no snapshot
    unless a test asks for one (its databases' rows are written after the job starts). It logs
    at debug: the reader's ``record_received`` lines are what tell an emulator omission from a
    transaction the product dropped (emulator/omissions.py)."""

    def __init__(
        self, database_id: str, table: Path | str, log: Path, start: int | None, **env: str
    ) -> None:
        """``start`` None: no configured start timestamp, so a new job starts at "now"."""
        super().__init__(
            ["-m", "ingest", "run"],
            log,
            {
                "SPANNER_DATABASE": database_id,
                "INGEST_TABLE_URI": str(table),
                **({} if start is None else {"INGEST_START_TIMESTAMP": to_rfc3339(start)}),
                "INGEST_CHECKPOINT_INTERVAL_S": "1",
                "INGEST_LEASE_S": "3",
                "INGEST_FLUSH_LATENCY_MS": "200",
                "INGEST_HEARTBEAT_MS": "1000",
                "INGEST_QUERY_WINDOW_S": "5",
                "INGEST_HEALTH_PORT": "0",
                "INGEST_SNAPSHOT_MODE": "never",
                "INGEST_LOG_LEVEL": "debug",
                **env,
            },
        )
        if start is None:
            self.env.pop("INGEST_START_TIMESTAMP", None)
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self, *extra: str) -> subprocess.Popen[bytes]:
        if self not in STARTED_SERVICES:
            STARTED_SERVICES.append(self)
        process = super().start(*extra)
        self.started.append(process)
        return process

    @property
    def running(self) -> bool:
        return any(process.poll() is None for process in self.started)


def service_in(folder: Path, database_id: str, start: int | None, **env: str) -> Service:
    """The service of a test's folder: its change log in ``folder/changelog``, its log in
    ``folder/ingest.log``."""
    return Service(database_id, folder / "changelog", folder / "ingest.log", start, **env)


class SparkSource(Service):
    """``python -m ingest spark-run`` for one job on ``master``, with the service's test
    settings and short batches."""

    def __init__(
        self,
        database_id: str,
        table: Path | str,
        checkpoint: Path | str,
        log: Path,
        start: int | None,
        master: str = "local[2]",
        **env: str,
    ) -> None:
        super().__init__(
            database_id,
            table,
            log,
            start,
            INGEST_SPARK_MASTER=master,
            INGEST_SPARK_CHECKPOINT_URI=str(checkpoint),
            INGEST_SPARK_TRIGGER_S="1",
            INGEST_SPARK_MAX_BATCH_SPAN_S="10",
            **env,
        )
        self.argv = ["-m", "ingest", "spark-run"]


class Pipeline(Process):
    """``python -m pipeline run`` on local[2] with few shuffle partitions."""

    def __init__(self, changelog: Path | str, root: Path | str, log: Path, **env: str) -> None:
        """``root``: a folder or an object store URI holding the mirrors and the checkpoint."""
        root = str(root).rstrip("/")
        super().__init__(
            ["-m", "pipeline", "run"],
            log,
            {
                "PIPELINE_CHANGELOG_URI": str(changelog),
                "PIPELINE_MIRROR_ROOT": f"{root}/mirrors",
                "PIPELINE_CHECKPOINT_URI": f"{root}/checkpoint",
                "PIPELINE_MASTER": "local[2]",
                "PIPELINE_SHUFFLE_PARTITIONS": "2",
                "PIPELINE_LOCK_STALE_S": "5",
                "PIPELINE_METRICS_PORT": "0",
                **env,
            },
        )


def wait_until(condition: Callable[[], bool], timeout: float, what: str, *processes: Any) -> float:
    """Seconds until ``condition`` held; fails at once when one of ``processes`` exits."""
    started = time.monotonic()
    while not condition():
        for process in processes:
            assert process.poll() is None, f"a process exited ({process.returncode}) {what}"
        assert time.monotonic() - started < timeout, f"{what}: not within {timeout} s"
        time.sleep(0.5)
    return time.monotonic() - started


def wait_until_committed(
    committed: list[CommittedTransaction], transactions: int, timeout: float
) -> None:
    """Wait for a background workload's first commits, so a test's window holds some."""
    deadline = time.monotonic() + timeout
    while len(committed) < transactions:
        if time.monotonic() > deadline:
            raise AssertionError(f"the workload committed {len(committed)} of {transactions}")
        time.sleep(0.1)


def wait_until_landed(
    table: Path | str,
    transactions: int,
    timeout: float,
    service: Any = None,
    committed: Sequence[CommittedTransaction] = (),
) -> None:
    """Wait while transactions land; fail when none has landed for ``timeout`` seconds (with
    the figures, and with ``service``, which of the emulator and the product stopped, or with
    ``committed`` too, the transactions missing behind the change log's W: ``tests.stalls``).
    A slow, loaded machine that keeps landing is waited on."""
    landed = wait_on_progress(LandedTransactions(str(table)), transactions, timeout, 0.5)
    if landed < transactions:
        figures = f"{landed} of {transactions} landed, none for {timeout:.0f} s"
        if service is None:
            raise AssertionError(figures)
        from tests.stalls import triage

        raise triage(service, figures, str(table), committed)


def background_workload(
    database: Any,
    seconds: float,
    rate: float,
    seed: int,
    least_transactions: int = 0,
    weights: Mapping[str, float] = BANKING,
) -> tuple[threading.Thread, threading.Event, list[CommittedTransaction]]:
    """The workload on a thread; the list it returns fills as transactions commit. With
    ``least_transactions`` it goes on past ``seconds`` until that many have committed."""
    stop = threading.Event()
    workload = Workload(
        database,
        WorkloadConfig(
            duration_seconds=seconds,
            transactions_per_second=rate,
            least_transactions=least_transactions,
            seed=seed,
            transfer_weight=weights["transfer_weight"],
            all_types_weight=weights["all_types_weight"],
            cleanup_weight=weights["cleanup_weight"],
        ),
    )
    thread = WorkloadThread(target=workload.run, args=(stop,))
    thread.start()
    return thread, stop, workload.committed


class WorkloadThread(threading.Thread):
    """A workload's thread whose ``join`` raises what ended it: a workload that died early
    would otherwise leave a test checking fewer transactions than it meant to."""

    error: BaseException | None = None

    def run(self) -> None:
        try:
            super().run()
        except BaseException as error:
            self.error = error
            raise

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self.error is not None:
            raise AssertionError("the workload ended with an error") from self.error


def tail_argv(
    database: str, stream: str, start: Nanos, end: Nanos | None = None, *extra: str
) -> list[str]:
    """The command line that runs ``tail`` in a new process of this interpreter."""
    argv = [
        sys.executable,
        "-m",
        "ingest",
        "tail",
        "--database",
        database,
        "--stream",
        stream,
        "--start-timestamp",
        to_rfc3339(start),
    ]
    if end is not None:
        argv += ["--end-timestamp", to_rfc3339(end)]
    return [*argv, *extra]
