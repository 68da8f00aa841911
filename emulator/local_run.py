"""`make run`: the whole product on one machine, ending with a PASS or FAIL check.

Starts an emulator on a free loopback port (or uses SPANNER_EMULATOR_HOST) and bootstraps the
sample database, which then already holds rows (``--existing-rows`` transfers, a tenth as many
rows of every type) and takes a banking workload for ``--seconds``. While the workload runs, the
ingest service starts on that existing database with ``snapshot_mode=initial`` (it snapshots
every table at T0, then streams after it) and the pipeline starts. Then it stops everything in
order: the workload; the ingest service once the change log is a consistent cut past the last
committed transaction; the pipeline after draining the change log (SIGUSR1). It prints a summary
and whether every mirror table equals Spanner read at the change log's last watermark. Progress
goes to the terminal, logs to files in the run folder. Ctrl-C stops everything cleanly, without
the check.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.cloud import spanner

from emulator.bootstrap import bootstrap
from emulator.omissions import returned_by_reread
from emulator.processes import Process
from emulator.run_report import (
    MirrorCheck,
    Summary,
    check_mirrors,
    print_summary,
    progress_line,
    say,
    summarize,
)
from emulator.server import emulator
from emulator.spark_cluster import StandaloneCluster
from emulator.verify import (
    consistent_past,
)
from emulator.workload import CommittedTransaction, Workload, WorkloadConfig, load_existing_rows
from ingest.changestream.query import Dialect
from runtime.logs import null_logger
from runtime.stopping import stop_on_signals

ACCOUNTS = 100
PROGRESS_EVERY_S = 5.0


class Interrupted(Exception):
    pass


@dataclass(frozen=True, slots=True)
class RunOptions:
    seconds: float
    rate: float
    folder: Path
    existing_rows: int = 20_000
    spark_workers: int = 0
    """0: the ingest service lands the change log; N: the Spark source does, on a loopback
    standalone cluster of N one-core workers."""
    land_timeout_s: float = 90.0
    drain_timeout_s: float = 300.0
    store: str | None = None
    """Where the tables and checkpoints go (an object store URI); None: in ``folder``."""

    @property
    def root(self) -> str:
        return (self.store or str(self.folder)).rstrip("/")


def parse_args(argv: list[str] | None) -> RunOptions:
    parser = argparse.ArgumentParser(prog="make run", description=__doc__)
    parser.add_argument("--seconds", type=float, default=90.0, help="how long the workload runs")
    parser.add_argument("--rate", type=float, default=20.0, help="transactions per second")
    parser.add_argument("--folder", help="where the tables and logs go (default: a new temp dir)")
    parser.add_argument(
        "--existing-rows",
        type=int,
        default=20_000,
        help="transfers the database holds before the services start (the snapshot's input)",
    )
    parser.add_argument(
        "--spark-cluster",
        type=int,
        default=0,
        metavar="WORKERS",
        help="land the change log with the Spark source on a loopback standalone cluster",
    )
    parser.add_argument(
        "--store",
        metavar="URI",
        help="keep the tables and checkpoints there (s3://bucket/path with the AWS_* variables)"
        " instead of the run folder; logs stay in the folder",
    )
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.rate <= 0 or args.existing_rows < 0 or args.spark_cluster < 0:
        parser.error(
            "--seconds and --rate must be positive, --existing-rows and --spark-cluster "
            "not negative"
        )
    folder = Path(args.folder) if args.folder else Path(tempfile.mkdtemp(prefix="spanner-cdc-run-"))
    folder.mkdir(parents=True, exist_ok=True)
    return RunOptions(
        args.seconds,
        args.rate,
        folder.resolve(),
        args.existing_rows,
        args.spark_cluster,
        store=args.store,
    )


def product_processes(
    options: RunOptions, database: str, spark_master: str | None = None
) -> tuple[Process, Process]:
    """The ingest (``run``, or ``spark-run`` on ``spark_master``) and the pipeline."""
    folder, root = options.folder, options.root
    spark = {
        "INGEST_SPARK_MASTER": spark_master or "",
        "INGEST_SPARK_CHECKPOINT_URI": f"{root}/spark-source-checkpoint",
        "SPARK_LOCAL_IP": "127.0.0.1",
    }
    ingest = Process(
        ["-m", "ingest", "spark-run" if spark_master else "run"],
        folder / "ingest.log",
        {
            "SPANNER_DATABASE": database,
            "INGEST_TABLE_URI": f"{root}/changelog",
            "INGEST_CHECKPOINT_INTERVAL_S": "5",
            "INGEST_FLUSH_LATENCY_MS": "500",
            "INGEST_HEALTH_PORT": "0",
            "INGEST_SNAPSHOT_MODE": "initial",
            **(spark if spark_master else {}),
        },
    )
    return ingest, pipeline_process(folder, f"{root}/changelog", root)


def pipeline_process(folder: Path, changelog: Path | str, root: str | None = None) -> Process:
    """``python -m pipeline run`` on ``changelog``; its log in ``folder``, mirrors and checkpoint
    in ``root`` (default ``folder``)."""
    root = (root or str(folder)).rstrip("/")
    return Process(
        ["-m", "pipeline", "run"],
        folder / "pipeline.log",
        {
            "PIPELINE_CHANGELOG_URI": str(changelog),
            "PIPELINE_MIRROR_ROOT": f"{root}/mirrors",
            "PIPELINE_CHECKPOINT_URI": f"{root}/pipeline-checkpoint",
            "PIPELINE_MASTER": "local[2]",
            "PIPELINE_METRICS_PORT": "0",
        },
    )


def wait_until(
    condition: Callable[[], bool],
    timeout: float,
    interrupted: threading.Event,
    report: Callable[[], None],
    what: str,
) -> None:
    deadline = time.monotonic() + timeout
    last_report = time.monotonic()
    while not condition():
        if interrupted.is_set():
            raise Interrupted
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout:.0f} s")
        if time.monotonic() - last_report >= PROGRESS_EVERY_S:
            report()
            last_report = time.monotonic()
        time.sleep(0.5)


def stop_process(process: subprocess.Popen[bytes] | None, timeout: float = 30) -> int | None:
    if process is None or process.poll() is not None:
        return None if process is None else process.returncode
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


@dataclass
class _Running:
    """What `make run` started, in the order it stops them."""

    workload: Workload
    thread: threading.Thread
    stop_workload: threading.Event
    committed: list[CommittedTransaction]
    ingest: Process
    ingest_process: subprocess.Popen[bytes]
    pipeline: Process
    pipeline_process: subprocess.Popen[bytes]
    pipeline_started_ns: int
    began: float
    watched: dict[str, subprocess.Popen[bytes]]
    """Processes that must stay up; an exit before we stop one is a failure."""

    def report(self) -> None:
        elapsed = time.monotonic() - self.began
        say(progress_line(elapsed, len(self.workload.committed), self.ingest, self.pipeline))
        for role, process in self.watched.items():
            if process.poll() is not None:
                raise RuntimeError(f"the {role} process exited {process.returncode}; see its log")


def run(options: RunOptions, interrupted: threading.Event) -> int:
    folder = options.folder
    say(f"run folder {folder} (logs: ingest.log, pipeline.log, emulator.log)")
    with contextlib.ExitStack() as stack:
        database, name = _sample_database(options, stack)
        running = _start(options, database, name, stack)
        try:
            _stop_in_order(options, interrupted, running)
        except Interrupted:
            running.stop_workload.set()
            running.thread.join()
            say("interrupted: stopping the ingest service and the pipeline")
            stop_process(running.ingest_process)
            stop_process(running.pipeline_process, 60)
            check = MirrorCheck(["interrupted"], None)
            print_summary(_summary(running, check, options.root), folder)
            return 130
        finally:
            running.stop_workload.set()
            running.thread.join()
        say("checking every mirror table against Spanner at the last watermark")
        summary = _summary(running, check_mirrors(database, options.root), options.root)
        print_summary(summary, folder)
        if summary.missing:
            _reread_missing(database, summary.missing, folder)
        return 0 if summary.check.passed else 1


def _reread_missing(database: Any, missing: tuple[str, ...], folder: Path) -> None:
    """Whether a fresh bounded re-read of the stream returns each transaction the change log
    lacks: if it does not, the emulator's stream does not hold it and the service could not
    land it; if it does, the service missed what the stream holds (summary.json says which)."""
    returned = returned_by_reread(database, "all_changes", Dialect.GOOGLE_STANDARD_SQL, missing)
    for text in missing:
        where = "returned" if text in returned else "not returned either"
        say(f"  re-read of the stream at {text}: {where}")
    record = json.loads((folder / "summary.json").read_text())
    record["missing_returned_by_reread"] = returned
    (folder / "summary.json").write_text(json.dumps(record, indent=2))


def _sample_database(options: RunOptions, stack: contextlib.ExitStack) -> tuple[Any, str]:
    """An emulator (unless one is given) and a sample database that already holds rows,
    written before its change streams were created (as a database a user starts capturing)."""
    if not os.environ.get("SPANNER_EMULATOR_HOST"):
        say("starting the Spanner emulator")
        running = stack.enter_context(
            emulator(token_alive_seconds=5, log_path=options.folder / "emulator.log")
        )
        os.environ["SPANNER_EMULATOR_HOST"] = running.host_port
    name = f"bank_{time.strftime('%m%d%H%M%S')}"
    say(f"emulator at {os.environ['SPANNER_EMULATOR_HOST']}; creating database {name!r}")
    rows = options.existing_rows, options.existing_rows // 10
    database = bootstrap(
        spanner.Client(project="local-project"),
        database_id=name,
        accounts=ACCOUNTS,
        existing=lambda d: load_existing_rows(d, ACCOUNTS, *rows, seed=1),
    )
    existing = ACCOUNTS + sum(rows)
    say(f"the database holds {existing} rows before the services start")
    return database, name


def _start(options: RunOptions, database: Any, name: str, stack: contextlib.ExitStack) -> _Running:
    """The workload, then the ingest service and the pipeline on the existing database."""
    stop_workload = threading.Event()
    workload = Workload(
        database,
        WorkloadConfig(duration_seconds=options.seconds, transactions_per_second=options.rate),
    )
    committed: list[CommittedTransaction] = []
    thread = threading.Thread(target=lambda: committed.extend(workload.run(stop_workload)))
    say(f"workload: {options.rate:g} transactions/s for {options.seconds:g} s")
    began = time.monotonic()
    thread.start()
    master = None
    if options.spark_workers:
        cluster = StandaloneCluster(options.folder / "spark-cluster")
        stack.callback(cluster.stop)
        cluster.start(options.spark_workers)
        master = cluster.master_url
        say(f"standalone cluster at {master} with {options.spark_workers} one-core workers")
    ingest, pipeline = product_processes(options, name, master)
    say(
        f"starting the ingest ({'the Spark source on the cluster' if master else 'the service'};"
        " snapshot_mode=initial: the existing rows at T0, then the stream) and the pipeline "
        "(Spark takes 20-40 s to start)"
    )
    ingest_process = ingest.start()
    pipeline_started_ns = time.time_ns()
    pipeline_process = pipeline.start()
    stack.callback(stop_process, pipeline_process, 60)
    stack.callback(stop_process, ingest_process)
    return _Running(
        workload,
        thread,
        stop_workload,
        committed,
        ingest,
        ingest_process,
        pipeline,
        pipeline_process,
        pipeline_started_ns,
        began,
        {"ingest": ingest_process, "pipeline": pipeline_process},
    )


def _stop_in_order(options: RunOptions, interrupted: threading.Event, running: _Running) -> None:
    """The workload's end; the change log past its last commit; the ingest stopped; the
    pipeline drained (SIGUSR1) and stopped. Each must exit 0."""
    wait_until(
        lambda: not running.thread.is_alive(),
        options.seconds + 30,
        interrupted,
        running.report,
        "the workload's end",
    )
    last = max((t.commit_timestamp for t in running.committed), default=0)
    say(f"workload done: {len(running.committed)} transactions committed; waiting for them to land")
    wait_until(
        lambda: consistent_past(f"{options.root}/changelog", last),
        options.land_timeout_s,
        interrupted,
        running.report,
        "the change log's consistent cut past the last committed transaction",
    )
    say("all landed; stopping the ingest service, draining the pipeline")
    running.watched.clear()
    code = stop_process(running.ingest_process)
    if code != 0:
        raise RuntimeError(f"the ingest service exited {code}; see {running.ingest.log}")
    pipeline, process = running.pipeline, running.pipeline_process
    wait_until(  # its first event comes after its SIGUSR1 handler is installed
        lambda: bool(pipeline.events()) or process.poll() is not None,
        options.drain_timeout_s,
        interrupted,
        running.report,
        "the pipeline's start",
    )
    process.send_signal(signal.SIGUSR1)
    wait_until(
        lambda: process.poll() is not None,
        options.drain_timeout_s,
        interrupted,
        running.report,
        "the pipeline's drain",
    )
    if process.returncode != 0:
        raise RuntimeError(f"the pipeline exited {process.returncode}; see {pipeline.log}")


def _summary(running: _Running, check: MirrorCheck, root: str) -> Summary:
    return summarize(
        running.committed,
        running.ingest,
        running.pipeline,
        check,
        running.pipeline_started_ns,
        root,
    )


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    interrupted = stop_on_signals(null_logger())
    try:
        return run(options, interrupted)
    except (RuntimeError, TimeoutError) as error:
        say(f"error: {error}", sys.stderr)
        say(f"logs in {options.folder}", sys.stderr)
        return 1


def exit_now(code: int) -> None:
    """Exit without tearing down native thread pools: deltalake's runtime can abort the
    interpreter's shutdown ("terminate called without an active exception", delta-rs #2184,
    seen once in the make-run test on 2026-11-23, after PASS was printed)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
