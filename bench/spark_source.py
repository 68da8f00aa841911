"""The service's reader against the Spark source, on the scripted server at several widths.

The server (a process of its own) serves a wide topology live: each record when the clock reaches
its commit timestamp, splits, moves and merges, transactions at a fixed rate (a third spread over
several partitions). Each contender lands the same stream in a change log of its own:

- ``service``: the ingest service's reader and batcher in this process (64 turns), the sink's
  Delta commits, as ``python -m ingest run`` runs them;
- ``spark local[N]``: the Spark source driver (``tests/spark_source_driver.py``) on local[N],
  N = 1 and 2 executor cores, a batch every 0.5 s, 100 partitions per task.

Each contender reads a live stream of its own (the same seed, so the same shape), one after the
other, so none shares the two cores with another.

Figures over the steady state (commits from ``--warmup`` seconds into the stream to its end):
commit → change-log visible p50/p99 (the Delta commit's own time minus the commit timestamp),
records/s landed, and for the Spark source the CPU its Python workers spent per partition query
and per record (the executor-core cost that decides how many executors a stream needs).

Usage: python bench/spark_source.py [--seconds 30] [--warmup 20] [--rate 100]
       [--widths 500,5000] [--cores 1,2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.pop("SPANNER_EMULATOR_HOST", None)

from wide_reader import percentile, serve

from emulator.machine import machine_line
from emulator.processes import cpu_seconds, process_tree
from ingest.changestream.config import ReaderConfig
from ingest.changestream.reader import ChangeStreamReader
from ingest.delta.batcher import Batcher
from ingest.delta.landing import ChangeLogLanding, WatchedColumnsPoll
from ingest.delta.sink import DeltaChangeLogSink
from ingest.model.timestamps import NANOS_PER_SECOND, Nanos, parse_rfc3339
from runtime.logs import null_logger
from tests.delta_checks import read_versions
from tests.scripted_spanner import Script, scripted_query
from tests.simulation import build_wide_topology
from tests.spark_source_driver import command as driver_command

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class Figures:
    records_per_s: float
    p50_s: float
    p99_s: float
    worker_cpu_ms_per_query: float | None = None
    worker_cpu_ms_per_record: float | None = None


def visibility(table: Path, steady_from: Nanos, end: Nanos) -> tuple[list[float], int, float]:
    """Commit → visible latencies of the steady window's transactions, their records, and the
    seconds between the first and last commit that landed them."""
    latencies: list[float] = []
    records = 0
    landed_at: list[int] = []
    for version in read_versions(table):
        log = table / "_delta_log" / f"{version.number:020d}.json"
        info = next(
            json.loads(line)["commitInfo"]
            for line in log.read_text().splitlines()
            if "commitInfo" in line
        )
        visible = int(info["timestamp"]) * 1_000_000
        seen: set[str] = set()
        for row in version.rows:
            stamp = parse_rfc3339(row["commit_timestamp_text"])
            if not row["server_transaction_id"] or not steady_from <= stamp <= end:
                continue
            records += row["mod_index"] == 0
            if row["server_transaction_id"] not in seen:
                seen.add(row["server_transaction_id"])
                latencies.append((visible - stamp) / NANOS_PER_SECOND)
                landed_at.append(visible)
    span = (max(landed_at) - min(landed_at)) / NANOS_PER_SECOND if landed_at else float("nan")
    return latencies, records, span


def run_service(port: int, start: Nanos, end: Nanos, table: Path) -> None:
    sink = DeltaChangeLogSink(str(table), "bench.service", "bench", log=null_logger())
    sink.continue_after(None)
    sink.start_job(start)
    reader = ChangeStreamReader(
        scripted_query(port),
        ReaderConfig(start_timestamp=start, end_timestamp=end, max_concurrent_partitions=64),
        null_logger(),
    )
    log = null_logger()
    landing = ChangeLogLanding(
        sink, WatchedColumnsPoll(None, 10.0, log), log, 24 * 3600 * NANOS_PER_SECOND
    )
    batcher = Batcher(landing, 0.2, 100_000, 1.0)
    reader.run(batcher.on_release, threading.Event(), on_tick=batcher.on_tick)
    batcher.flush()


def worker_cpu_s(driver: int) -> float:
    """CPU seconds of the Python workers that run the driver's tasks (the ``pyspark.worker``
    daemon and its forks, reaped ones included); the driver side's own Python processes
    (planning, the streaming source's runner) are not counted."""
    total = 0.0
    for pid in process_tree(driver):
        try:
            arguments = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"pyspark.daemon" in arguments and b"pyspark.worker" in arguments:
                total += cpu_seconds(pid, reaped_children=True)
        except OSError:
            continue
    return total


def run_spark(
    port: int, start: Nanos, end: Nanos, table: Path, cores: int, steady_from: Nanos
) -> tuple[int, float]:
    """The driver until the change log passes ``end``; the partition queries and the worker
    CPU seconds of the batches that landed from ``steady_from`` on."""
    log = table.parent / f"{table.name}.log"
    argv = driver_command(
        port, table, Path(f"{table}.checkpoint"), start, end, master=f"local[{cores}]"
    )
    with log.open("wb") as out:
        driver = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    steady_cpu: float | None = None
    steady_batches = 0
    last_cpu = 0.0
    while driver.poll() is None:
        cpu = worker_cpu_s(driver.pid)
        last_cpu = max(last_cpu, cpu)
        if steady_cpu is None and time.time_ns() >= steady_from:
            steady_cpu = cpu
            steady_batches = log.read_text(errors="replace").count('"spark_batch"')
        time.sleep(0.2)
    assert driver.returncode == 0, log.read_text(errors="replace")[-3000:]
    batches = [
        json.loads(line)
        for line in log.read_text(errors="replace").splitlines()
        if line.startswith("{") and '"spark_batch"' in line
    ]
    queries = sum(b["partitions"] for b in batches[steady_batches:])
    return queries, last_cpu - (steady_cpu or 0.0)


def run_contender(args: argparse.Namespace, width: int, cores: int | None) -> Figures:
    """One contender on a live stream of its own (same seed, so the same shape): the service's
    reader when ``cores`` is None, else the Spark source on local[cores]."""
    duration = args.warmup + args.seconds
    setup_s = 8 + width // 500 + (0 if cores is None else 20)  # build, serve, Spark up
    start = time.time_ns() + setup_s * NANOS_PER_SECOND
    end = start + duration * NANOS_PER_SECOND
    steady_from = start + args.warmup * NANOS_PER_SECOND
    topology = build_wide_topology(
        random.Random(args.seed),
        partitions=width,
        changes=max(2, width // 100),
        transactions=duration * args.rate,
        start=start,
        horizon=duration * NANOS_PER_SECOND,
    )
    server, port = serve(Script(topology.records_by_partition(), live=True), 512)
    table = Path(tempfile.mkdtemp(prefix="spark-source-bench-")) / "changelog"
    try:
        if cores is None:
            run_service(port, start, end, table)
        else:
            queries, cpu_s = run_spark(port, start, end, table, cores, steady_from)
    finally:
        server.kill()
        server.wait()
    latencies, records, _ = visibility(table, steady_from, end)
    base = Figures(records / args.seconds, percentile(latencies, 0.5), percentile(latencies, 0.99))
    if cores is None:
        return base
    return Figures(
        base.records_per_s,
        base.p50_s,
        base.p99_s,
        1000 * cpu_s / max(queries, 1),
        1000 * cpu_s / max(records, 1),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=int, default=30, help="steady state, measured")
    parser.add_argument("--warmup", type=int, default=20, help="before it, not measured")
    parser.add_argument("--rate", type=int, default=100)
    parser.add_argument("--widths", default="500,5000")
    parser.add_argument("--cores", default="1,2")
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()
    print(machine_line())
    print(
        f"# {args.warmup} s warm-up then {args.seconds} s measured, live at {args.rate} "
        "transactions/s; each contender on a stream of its own, one after the other"
    )
    print("partitions\tcontender\trecords/s\tp50 s\tp99 s\tworker ms/query\tworker ms/record")
    contenders: list[tuple[str, int | None]] = [("service (64 turns)", None)]
    contenders += [(f"spark local[{c}]", int(c)) for c in args.cores.split(",")]
    for width in (int(w) for w in args.widths.split(",")):
        for name, cores in contenders:
            f = run_contender(args, width, cores)
            per_query = (
                "-" if f.worker_cpu_ms_per_query is None else f"{f.worker_cpu_ms_per_query:.2f}"
            )
            per_record = (
                "-" if f.worker_cpu_ms_per_record is None else f"{f.worker_cpu_ms_per_record:.2f}"
            )
            print(
                f"{width}\t{name}\t{f.records_per_s:.0f}\t{f.p50_s:.2f}\t{f.p99_s:.2f}\t"
                f"{per_query}\t{per_record}",
                flush=True,
            )


if __name__ == "__main__":
    main()
