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
import bisect
import contextlib
import dataclasses
import itertools
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
from typing import Any, TextIO

from google.cloud import spanner

from emulator.bootstrap import bootstrap, seed_accounts
from emulator.processes import Process
from emulator.server import emulator
from emulator.verify import (
    changelog_watermark,
    compare_mirrors,
    consistent_past,
    landed_transactions,
    latest_checkpoint,
)
from emulator.workload import CommittedTransaction, Workload, WorkloadConfig, load_existing_rows
from ingest.model.timestamps import parse_rfc3339, to_rfc3339
from pipeline.catalog import discover_shapes

EMULATOR_TIMESTAMP_DIGITS = 0
"""The emulator's change stream drops the fraction of TIMESTAMP values (emulator/NOTES.md)."""
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
    land_timeout_s: float = 90.0
    drain_timeout_s: float = 300.0


@dataclass(frozen=True, slots=True)
class MirrorCheck:
    lines: list[str]
    passed: bool | None
    """None when the check did not run."""
    changelog_version: int | None = None


@dataclass(frozen=True, slots=True)
class Summary:
    snapshot_rows: int | None
    committed: int
    """Transactions committed after T0 (those before are in the snapshot)."""
    landed: int
    lag_p50_s: float | None
    lag_p99_s: float | None
    pipeline_batches: int
    rows_merged: int
    mirror_p50_s: float | None
    """Commit → mirror visible: from a transaction's commit to the end of the micro-batch that
    made it readable in its mirror, for commits after the pipeline's first batch."""
    mirror_p99_s: float | None
    mirror_every_p50_s: float | None
    """The same over every commit after T0, those that waited for Spark's start included."""
    mirror_every_p99_s: float | None
    changelog_to_mirror_p50_s: float | None
    """The pipeline's share: from the change-log commit that landed a transaction to the end of
    the micro-batch that made it visible, for commits after the pipeline's first batch."""
    changelog_to_mirror_p99_s: float | None
    first_batch_s: float | None
    """From starting `pipeline run` to the end of its first micro-batch."""
    check: MirrorCheck


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
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.rate <= 0 or args.existing_rows < 0:
        parser.error("--seconds and --rate must be positive, --existing-rows not negative")
    folder = Path(args.folder) if args.folder else Path(tempfile.mkdtemp(prefix="spanner-cdc-run-"))
    folder.mkdir(parents=True, exist_ok=True)
    return RunOptions(args.seconds, args.rate, folder.resolve(), args.existing_rows)


def say(text: str, out: TextIO = sys.stdout) -> None:
    print(text, file=out, flush=True)


def percentile(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


def product_processes(options: RunOptions, database: str) -> tuple[Process, Process]:
    folder = options.folder
    ingest = Process(
        ["-m", "ingest", "run"],
        folder / "ingest.log",
        {
            "SPANNER_DATABASE": database,
            "INGEST_TABLE_URI": str(folder / "changelog"),
            "INGEST_CHECKPOINT_INTERVAL_S": "5",
            "INGEST_FLUSH_LATENCY_MS": "500",
            "INGEST_HEALTH_PORT": "0",
            "INGEST_SNAPSHOT_MODE": "initial",
        },
    )
    return ingest, pipeline_process(folder, folder / "changelog")


def pipeline_process(folder: Path, changelog: Path) -> Process:
    """``python -m pipeline run`` on ``changelog``; mirrors, checkpoint and log in ``folder``."""
    return Process(
        ["-m", "pipeline", "run"],
        folder / "pipeline.log",
        {
            "PIPELINE_CHANGELOG_URI": str(changelog),
            "PIPELINE_MIRROR_ROOT": str(folder / "mirrors"),
            "PIPELINE_CHECKPOINT_URI": str(folder / "pipeline-checkpoint"),
            "PIPELINE_MASTER": "local[2]",
            "PIPELINE_SHUFFLE_PARTITIONS": "2",
            "PIPELINE_METRICS_PORT": "0",
        },
    )


def visible_at(commit_timestamps: list[int], marks: list[tuple[int, int]]) -> list[int | None]:
    """When each commit became visible: the earliest time of a mark (reached through, at) whose
    reach is at or past it; None if none is. Marks may come in any order."""
    ends = sorted(marks)
    reached = [r for r, _ in ends]
    earliest = list(itertools.accumulate((at for _, at in reversed(ends)), min))[::-1]
    return [
        earliest[index] if (index := bisect.bisect_left(reached, commit)) < len(ends) else None
        for commit in commit_timestamps
    ]


def batch_marks(batches: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """Micro-batches as (newest commit applied, end): the change log lands in commit order, so
    a batch has applied every commit up to its newest."""
    return [
        (parse_rfc3339(b["newest_commit"]), parse_rfc3339(b["timestamp"]))
        for b in batches
        if b.get("newest_commit")
    ]


def landing_marks(commits: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """Change-log commits as (low watermark, time): a transaction lands once W passes it."""
    return [(parse_rfc3339(c["low_watermark"]), parse_rfc3339(c["timestamp"])) for c in commits]


def mirror_latencies(commit_timestamps: list[int], batches: list[dict[str, Any]]) -> list[float]:
    """Seconds from each commit to the end of the first micro-batch whose newest applied commit
    is at or past it."""
    visible = visible_at(commit_timestamps, batch_marks(batches))
    return [(v - c) / 1e9 for c, v in zip(commit_timestamps, visible, strict=True) if v is not None]


def pipeline_latencies(
    commit_timestamps: list[int], batches: list[dict[str, Any]], commits: list[dict[str, Any]]
) -> list[float]:
    """The pipeline's share of commit → mirror: seconds from the change-log commit that landed a
    transaction to the end of the micro-batch that made it visible."""
    landed = visible_at(commit_timestamps, landing_marks(commits))
    mirrored = visible_at(commit_timestamps, batch_marks(batches))
    return [
        (mirror - land) / 1e9
        for land, mirror in zip(landed, mirrored, strict=True)
        if land is not None and mirror is not None
    ]


def freshness(batches: list[dict[str, Any]], now_ns: int) -> str:
    """How far the mirrors trail now: the newest commit applied, as seconds ago."""
    applied = [b["newest_commit"] for b in batches if b.get("newest_commit")]
    if not applied:
        return ""
    return f", mirrors fresh to {(now_ns - parse_rfc3339(max(applied))) / 1e9:.1f} s ago"


def progress_line(elapsed: float, committed: int, ingest: Process, pipeline: Process) -> str:
    events = ingest.events()
    commits = [e for e in events if e["event"] == "delta_commit"]
    snapshot = [e for e in events if e["event"] == "snapshot_progress"]
    batches = [e for e in pipeline.events() if e["event"] == "pipeline_batch"]
    landed = sum(e["transactions"] for e in commits)
    lag = f", lag {commits[-1]['watermark_lag_seconds']:.1f} s" if commits else ""
    version = f"v{commits[-1]['delta_version']}" if commits else "no commit yet"
    if snapshot and not snapshot[-1]["complete"]:
        last = snapshot[-1]
        version = (
            f"snapshot {last['rows']} rows, {last['tables_done']}/{last['tables']} tables, "
            f"{last['rows_per_second']} rows/s"
        )
    elif snapshot:
        version += f", snapshot {snapshot[-1]['rows']} rows"
    if batches:
        pipeline_text = f"{len(batches)} batches, last {batches[-1]['seconds']:.1f} s"
        pipeline_text += freshness(batches, time.time_ns())
    elif any(e["event"] == "pipeline_query_started" for e in pipeline.events()):
        pipeline_text = "first micro-batch running"
    else:
        pipeline_text = "starting Spark"
    return (
        f"{elapsed:5.0f} s  committed {committed:>6} ({committed / max(elapsed, 1):4.1f}/s)  "
        f"landed {landed:>6} ({version}{lag})  "
        f"pipeline: {pipeline_text}"
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


def check_mirrors(database: Any, folder: Path) -> MirrorCheck:
    watermark = changelog_watermark(str(folder / "changelog"))
    if watermark is None:
        return MirrorCheck(["the change log has no landing commit"], False)
    shapes = discover_shapes(str(folder / "changelog"))
    comparisons = compare_mirrors(
        database,
        str(folder / "mirrors"),
        shapes,
        watermark.low_watermark,
        timestamp_digits=EMULATOR_TIMESTAMP_DIGITS,
    )
    lines = [f"read at {to_rfc3339(watermark.low_watermark)} (change-log v{watermark.version})"]
    lines += [c.describe() for c in comparisons]
    passed = bool(comparisons) and all(c.equal for c in comparisons)
    return MirrorCheck(lines, passed, watermark.version)


def summarize(
    committed: list[CommittedTransaction],
    ingest: Process,
    pipeline: Process,
    check: MirrorCheck,
    pipeline_started_ns: int,
) -> Summary:
    folder = ingest.log.parent
    commits = [e for e in ingest.events() if e["event"] == "delta_commit"]
    lags = [e["watermark_lag_seconds"] for e in commits]
    batches = [e for e in pipeline.events() if e["event"] == "pipeline_batch"]
    checkpoint = latest_checkpoint(str(folder / "changelog"))
    snapshot = checkpoint.snapshot if checkpoint else None
    after = snapshot.read_timestamp if snapshot else 0
    first = next((b for b in batches if b.get("newest_commit")), None)
    first_batch_ns = parse_rfc3339(first["timestamp"]) if first else None
    # from the first batch on: before it, commits wait for Spark to start
    measured_after = after if first_batch_ns is None else max(after, first_batch_ns)
    measured = [t.commit_timestamp for t in committed if t.commit_timestamp > measured_after]
    latencies = mirror_latencies(measured, batches)
    pipeline_share = pipeline_latencies(measured, batches, commits)
    every = mirror_latencies(
        [t.commit_timestamp for t in committed if t.commit_timestamp > after], batches
    )
    return Summary(
        snapshot_rows=snapshot.rows if snapshot else None,
        committed=sum(t.commit_timestamp > after for t in committed),
        landed=landed_transactions(str(folder / "changelog")),
        lag_p50_s=percentile(lags, 0.5),
        lag_p99_s=percentile(lags, 0.99),
        pipeline_batches=len(batches),
        rows_merged=sum(sum(e["rows"].values()) for e in batches),
        mirror_p50_s=percentile(latencies, 0.5),
        mirror_p99_s=percentile(latencies, 0.99),
        mirror_every_p50_s=percentile(every, 0.5),
        mirror_every_p99_s=percentile(every, 0.99),
        changelog_to_mirror_p50_s=percentile(pipeline_share, 0.5),
        changelog_to_mirror_p99_s=percentile(pipeline_share, 0.99),
        first_batch_s=None
        if first_batch_ns is None
        else (first_batch_ns - pipeline_started_ns) / 1e9,
        check=check,
    )


def print_summary(summary: Summary, folder: Path) -> None:
    """To the terminal, and as ``summary.json`` in the run folder for tools (bench/)."""
    record = {k: v for k, v in dataclasses.asdict(summary).items() if k != "check"}
    record["passed"] = summary.check.passed
    (folder / "summary.json").write_text(json.dumps(record, indent=2))

    def seconds(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.2f} s"

    verdict = {True: "PASS", False: "FAIL", None: "NOT RUN"}[summary.check.passed]
    say("")
    say("summary")
    snapshot = "n/a" if summary.snapshot_rows is None else f"{summary.snapshot_rows} rows"
    say(f"  snapshot at T0           {snapshot}")
    say(f"  transactions after T0    {summary.committed}")
    say(f"  transactions landed      {summary.landed}")
    say(f"  change-log version       {summary.check.changelog_version}")
    say(f"  watermark lag p50 / p99  {seconds(summary.lag_p50_s)} / {seconds(summary.lag_p99_s)}")
    say(
        f"  pipeline batches         {summary.pipeline_batches} ({summary.rows_merged} rows merged)"
    )
    say(
        f"  commit → mirror p50/p99  {seconds(summary.mirror_p50_s)} / "
        f"{seconds(summary.mirror_p99_s)} (commits after the pipeline's first batch)"
    )
    say(
        f"                 p50/p99  {seconds(summary.mirror_every_p50_s)} / "
        f"{seconds(summary.mirror_every_p99_s)} (every commit after T0)"
    )
    say(
        f"  change log → mirror      {seconds(summary.changelog_to_mirror_p50_s)} / "
        f"{seconds(summary.changelog_to_mirror_p99_s)} (the pipeline's share, p50/p99)"
    )
    say(f"  pipeline first batch     {seconds(summary.first_batch_s)} after its start")
    say(f"  mirrors equal Spanner    {verdict}")
    for line in summary.check.lines:
        say(f"    {line}")
    python = Path(sys.executable)
    say("")
    say(f"tables and logs in {folder}")
    say("open a table:")
    say(
        f'  {python} -c "from deltalake import DeltaTable; '
        f"print(DeltaTable('{folder}/mirrors/accounts').to_pyarrow_dataset()"
        f'.to_table(use_threads=False).to_pandas())"'
    )
    say(f"  (the change log is {folder}/changelog; Spark: spark.read.format('delta').load(...))")


def stop_process(process: subprocess.Popen[bytes] | None, timeout: float = 30) -> int | None:
    if process is None or process.poll() is not None:
        return None if process is None else process.returncode
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def run(options: RunOptions, interrupted: threading.Event) -> int:
    folder = options.folder
    say(f"run folder {folder} (logs: ingest.log, pipeline.log, emulator.log)")
    with contextlib.ExitStack() as stack:
        if not os.environ.get("SPANNER_EMULATOR_HOST"):
            say("starting the Spanner emulator")
            running = stack.enter_context(
                emulator(token_alive_seconds=5, log_path=folder / "emulator.log")
            )
            os.environ["SPANNER_EMULATOR_HOST"] = running.host_port
        name = f"bank_{time.strftime('%m%d%H%M%S')}"
        say(f"emulator at {os.environ['SPANNER_EMULATOR_HOST']}; creating database {name!r}")
        database = bootstrap(spanner.Client(project="local-project"), database_id=name, accounts=0)
        seed_accounts(database, ACCOUNTS, 1000)
        existing = ACCOUNTS + load_existing_rows(
            database, ACCOUNTS, options.existing_rows, options.existing_rows // 10, seed=1
        )
        say(f"the database holds {existing} rows before the services start")
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
        ingest, pipeline = product_processes(options, name)
        say(
            "starting the ingest service (snapshot_mode=initial: the existing rows at T0, then "
            "the stream) and the pipeline (Spark takes 20-40 s to start)"
        )
        ingest_process = ingest.start()
        pipeline_started_ns = time.time_ns()
        pipeline_process = pipeline.start()
        stack.callback(stop_process, pipeline_process, 60)
        stack.callback(stop_process, ingest_process)

        watched = {"ingest": ingest_process, "pipeline": pipeline_process}
        """Processes that must stay up; an exit before we stop one is a failure."""

        def report() -> None:
            say(progress_line(time.monotonic() - began, len(workload.committed), ingest, pipeline))
            for role, process in watched.items():
                if process.poll() is not None:
                    raise RuntimeError(
                        f"the {role} process exited {process.returncode}; see its log"
                    )

        try:
            wait_until(
                lambda: not thread.is_alive(),
                options.seconds + 30,
                interrupted,
                report,
                "the workload's end",
            )
            last = max((t.commit_timestamp for t in committed), default=0)
            say(f"workload done: {len(committed)} transactions committed; waiting for them to land")
            wait_until(
                lambda: consistent_past(str(folder / "changelog"), last),
                options.land_timeout_s,
                interrupted,
                report,
                "the change log's consistent cut past the last committed transaction",
            )
            say("all landed; stopping the ingest service, draining the pipeline")
            watched.clear()
            code = stop_process(ingest_process)
            if code != 0:
                raise RuntimeError(f"the ingest service exited {code}; see {ingest.log}")
            wait_until(  # its first event comes after its SIGUSR1 handler is installed
                lambda: bool(pipeline.events()) or pipeline_process.poll() is not None,
                options.drain_timeout_s,
                interrupted,
                report,
                "the pipeline's start",
            )
            pipeline_process.send_signal(signal.SIGUSR1)
            wait_until(
                lambda: pipeline_process.poll() is not None,
                options.drain_timeout_s,
                interrupted,
                report,
                "the pipeline's drain",
            )
            if pipeline_process.returncode != 0:
                raise RuntimeError(
                    f"the pipeline exited {pipeline_process.returncode}; see {pipeline.log}"
                )
        except Interrupted:
            stop_workload.set()
            thread.join()
            say("interrupted: stopping the ingest service and the pipeline")
            stop_process(ingest_process)
            stop_process(pipeline_process, 60)
            print_summary(
                summarize(
                    committed,
                    ingest,
                    pipeline,
                    MirrorCheck(["interrupted"], None),
                    pipeline_started_ns,
                ),
                folder,
            )
            return 130
        finally:
            stop_workload.set()
            thread.join()
        say("checking every mirror table against Spanner at the last watermark")
        summary = summarize(
            committed, ingest, pipeline, check_mirrors(database, folder), pipeline_started_ns
        )
        print_summary(summary, folder)
        return 0 if summary.check.passed else 1


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    interrupted = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: interrupted.set())
    signal.signal(signal.SIGTERM, lambda *_: interrupted.set())
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
