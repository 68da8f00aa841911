"""The Spark source's snapshot against the emulator: rows/s with 1, 2 and 4 tasks against the bare
loop, and the two ways to read a table in parallel compared on one core.

One table (`transfers`, ``--rows`` rows) read at one timestamp T0 by:
- the bare loop: the reads the service makes (key ranges in key order, ``lazy_decode``, wire
  JSON), decoded as the service decodes them, nothing else (``snapshot_throughput.bare_loop``);
- Spanner's partitioned query (``BatchSnapshot.generate_query_batches``, the other design), each
  partition read in turn and decoded the same way: its rate, and how many partitions the emulator
  hands out for the table;
- ``python -m ingest spark-run`` with ``snapshot_mode=initial_only`` on ``local[N]`` and
  ``INGEST_SPARK_SNAPSHOT_TASKS=N``, a fresh change log each. Its rate over the snapshot phase
  (the ``snapshot_started`` event to the last range's commit: Spark's session start left out),
  and in steady state: the rows of the reads started once N reads had landed (N tasks, every
  task's Python worker warm), over the time from the first of them to the end. The first reads
  carry the tables' split, Spark's first jobs and the Python workers'
  start, a fixed cost printed apart (``warm after``). ``--task-mb`` is the product's
  ``snapshot_task_mb`` (256): a smaller one cuts ranges into more reads, so the steady window
  holds more of them, each paying a Spark job's start. Also the CPU seconds of the Spark
  process tree and of the emulator, and the peak resident set of one Python worker (a task's
  process), sampled.

Figures: per task, the steady rate of 1 task against the bare loop (goal >= 0.7); scaling, N
tasks against N times 1 task (goal >= 0.8 up to the cores available; the emulator shares them).

Usage: python bench/spark_snapshot.py [--rows 400000] [--tasks 1 2 4] [--parts 64] [--task-mb 256]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from google.cloud import spanner
from snapshot_throughput import bare_loop, snapshot_phase_seconds

from emulator.bootstrap import bootstrap
from emulator.machine import machine_line
from emulator.processes import cpu_seconds, process_tree
from emulator.server import emulator
from emulator.workload import load_existing_rows
from ingest.model.timestamps import NANOS_PER_SECOND, Nanos, parse_rfc3339, to_datetime, to_rfc3339
from ingest.snapshot.reader import wire_json

WORK = Path(tempfile.mkdtemp(prefix="spark-snapshot-bench-"))
COLUMNS = "from_account_id, transfer_id, to_account_id, amount, created_at"
RANGE_ROWS = 5 * 10_000


def partitioned_loop(database: Any, read_at: Nanos) -> tuple[int, int, float]:
    """Rows, partitions and seconds of the table read through a partitioned query at T0, one
    partition after the other, each value decoded as the service decodes it."""
    began = time.perf_counter()
    batch_snapshot = database.batch_snapshot(read_timestamp=to_datetime(read_at))
    try:
        batches = list(batch_snapshot.generate_query_batches(f"SELECT {COLUMNS} FROM transfers"))
        rows = 0
        for batch in batches:
            for row in batch_snapshot.process_query_batch(batch, lazy_decode=True):
                decoded = [wire_json(value) for value in row]
                rows += len(decoded) > 0
    finally:
        batch_snapshot.close()
    return rows, len(batches), time.perf_counter() - began


@dataclass
class Sampled:
    """What sampling a process tree found: a Python worker's peak RSS (KiB), and each process's
    CPU seconds as last seen (a process's CPU is lost once it exits, so sampled)."""

    python_worker_peak_kib: int = 0
    cpu: dict[int, float] = field(default_factory=dict)


def sample(driver: int, stop: threading.Event, found: Sampled) -> None:
    while not stop.wait(0.2):
        for pid in process_tree(driver):
            try:
                found.cpu[pid] = cpu_seconds(pid)
                if pid == driver or b"pyspark" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                    continue
                status = Path(f"/proc/{pid}/status").read_text()
            except (OSError, IndexError):
                continue
            rss = next(int(line.split()[1]) for line in status.splitlines() if "VmRSS" in line)
            found.python_worker_peak_kib = max(found.python_worker_peak_kib, rss)


def read_spans(events: list[dict[str, Any]]) -> list[tuple[Nanos, Nanos, int]]:
    """(started, landed, rows) of every range read, from the driver's log."""
    open_reads: dict[tuple[str, int], Nanos] = {}
    spans = []
    for event in events:
        key = (event.get("table", ""), event.get("part", -1))
        if event["event"] == "snapshot_part_started":
            open_reads[key] = parse_rfc3339(event["timestamp"])
        elif event["event"] == "snapshot_part_landed":
            spans.append((open_reads.pop(key), parse_rfc3339(event["timestamp"]), event["rows"]))
    return spans


@dataclass(frozen=True)
class Run:
    phase_s: float
    """``snapshot_started`` to the last range's commit."""
    warm_s: float
    """``snapshot_started`` to the first read started once N reads had landed (N tasks): the
    tables' split, Spark's first jobs, the Python workers' start."""
    rows_after_warm: int
    """Rows of the reads started from then on: the steady state."""
    python_worker_peak_kib: int
    spark_cpu_s: float
    emulator_cpu_s: float


def spark_snapshot(
    database_id: str, start: Nanos, tasks: int, parts: int, task_mb: int, emulator_pid: int
) -> Run:
    log = WORK / f"spark_{tasks}.log"
    env = {
        **os.environ,
        "SPANNER_DATABASE": database_id,
        "INGEST_TABLE_URI": str(WORK / f"changelog_{tasks}"),
        "INGEST_START_TIMESTAMP": to_rfc3339(start),
        "INGEST_SNAPSHOT_MODE": "initial_only",
        "INGEST_HEALTH_PORT": "0",
        "INGEST_SPARK_MASTER": f"local[{tasks}]",
        "INGEST_SPARK_CHECKPOINT_URI": str(WORK / f"spark_checkpoint_{tasks}"),
        "INGEST_SPARK_SNAPSHOT_TASKS": str(tasks),
        "INGEST_SPARK_SNAPSHOT_PARTS": str(parts),
        "INGEST_SPARK_SNAPSHOT_TASK_MB": str(task_mb),
    }
    emulator_before = cpu_seconds(emulator_pid)
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "ingest", "spark-run"], env=env, stdout=out, stderr=out
        )
        stop, found = threading.Event(), Sampled()
        sampler = threading.Thread(target=sample, args=(process.pid, stop, found))
        sampler.start()
        code = process.wait()
        stop.set()
        sampler.join()
    assert code == 0, log.read_text()[-3000:]
    events = [json.loads(line) for line in log.read_text().splitlines() if line.startswith('{"')]
    started = next(e for e in events if e["event"] == "snapshot_started")
    began = parse_rfc3339(started["timestamp"])
    reads = read_spans(events)
    warm_at = sorted(landed for _, landed, _ in reads)[min(tasks, len(reads)) - 1]
    steady = [(start, rows) for start, _, rows in reads if start >= warm_at]
    steady_from = min((start for start, _ in steady), default=warm_at)
    return Run(
        snapshot_phase_seconds(log),
        (steady_from - began) / NANOS_PER_SECOND,
        sum(rows for _, rows in steady),
        found.python_worker_peak_kib,
        sum(found.cpu.values()),
        cpu_seconds(emulator_pid) - emulator_before,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--tasks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--parts", type=int, default=64)
    parser.add_argument("--task-mb", type=int, default=256, help="INGEST_SPARK_SNAPSHOT_TASK_MB")
    args = parser.parse_args()
    print(machine_line())
    try:
        with emulator() as running:
            os.environ["SPANNER_EMULATOR_HOST"] = running.host_port
            assert running.process is not None
            emulator_pid = running.process.pid
            client = spanner.Client(project="local-project")
            database = bootstrap(
                client,
                database_id="spark_snapshot",
                accounts=0,
                existing=lambda d: load_existing_rows(d, 1000, transfers=args.rows, all_types=0),
            )
            time.sleep(0.2)
            start = time.time_ns()
            read_at = start - 1
            rows, bare_seconds = bare_loop(database, read_at, RANGE_ROWS)
            assert rows == args.rows, (rows, args.rows)
            bare = rows / bare_seconds
            print(f"rows: {rows}")
            print(f"bare loop          {bare:8.0f} rows/s ({bare_seconds:.2f} s)")
            read, partitions, seconds = partitioned_loop(database, read_at)
            assert read == rows, (read, rows)
            print(
                f"partitioned query  {read / seconds:8.0f} rows/s ({seconds:.2f} s, "
                f"{partitions} partitions handed out)"
            )
            print(
                "tasks\trows/s\tsteady rows/s\tper task / bare\tof linear\t"
                "warm after s\tspark CPU s\temulator CPU s\tpython worker peak MiB"
            )
            one_task: float | None = None
            for tasks in args.tasks:
                run = spark_snapshot(
                    database.database_id, start, tasks, args.parts, args.task_mb, emulator_pid
                )
                steady = run.rows_after_warm / max(run.phase_s - run.warm_s, 1e-9)
                one_task = one_task or (steady if tasks == 1 else None)
                linear = f"{steady / (tasks * one_task):.2f}" if one_task else "-"
                print(
                    f"{tasks}\t{rows / run.phase_s:.0f}\t{steady:.0f}\t{steady / tasks / bare:.2f}"
                    f"\t{linear}\t{run.warm_s:.1f}\t{run.spark_cpu_s:.1f}"
                    f"\t{run.emulator_cpu_s:.1f}\t{run.python_worker_peak_kib / 1024:.0f}"
                )
    finally:
        shutil.rmtree(WORK, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
