"""Ingest benchmark against the emulator: rows/s landed, commit→Delta-visible latency, peak RSS.

- Throughput: a backlog is committed first, then (same run, same rows) the reader alone, the full
  service (reader + Delta commits), and a bare `write_deltalake` of the same rows in the same
  number of commits; the ratios give each stage's cost.
- Latency: the service tails a live workload (another process) at several flush latencies;
  latency is the Delta commit's timestamp minus the Spanner commit timestamp, per transaction.
- Memory for one transaction of 50,000 mods: bench/large_transaction_rss.py (the emulator takes
  more than ten minutes to process such a commit here).

Usage: python bench/ingest_throughput.py [--backlog 3000]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deltalake import write_deltalake
from google.cloud import spanner

from emulator.bootstrap import bootstrap
from emulator.machine import machine_line
from emulator.server import emulator
from emulator.verify import landed_transactions
from emulator.workload import Workload, WorkloadConfig, run_in_subprocess
from ingest.changestream.config import ReaderConfig
from ingest.changestream.query import ChangeStreamQuery, Dialect
from ingest.changestream.reader import ChangeStreamReader
from ingest.contract.changelog import PARTITION_COLUMNS
from ingest.delta import changelog
from ingest.model.timestamps import parse_rfc3339, to_rfc3339
from runtime.logs import make_logger

WORK = Path(tempfile.mkdtemp(prefix="ingest-bench-"))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def service(database_id: str, table: Path, start: int, **env: str) -> subprocess.Popen[bytes]:
    environment = {
        **os.environ,
        "SPANNER_DATABASE": database_id,
        "INGEST_TABLE_URI": str(table),
        "INGEST_START_TIMESTAMP": to_rfc3339(start),
        "INGEST_HEALTH_PORT": "0",
        **env,
    }
    log = (WORK / f"{table.name}.log").open("ab")
    return subprocess.Popen(
        [sys.executable, "-m", "ingest", "run"],
        env=environment,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def wait_landed(table: Path, count: int, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while landed_transactions(str(table)) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {landed_transactions(str(table))} of {count} landed")
        time.sleep(0.2)


def throughput(database, backlog: int) -> None:
    start = time.time_ns() + 200_000_000
    time.sleep(0.3)
    committed = Workload(
        database,
        WorkloadConfig(
            duration_seconds=900, max_transactions=backlog, rows_per_transaction=4, seed=5
        ),
    ).run()
    end = max(t.commit_timestamp for t in committed) + 1

    reader = ChangeStreamReader(
        ChangeStreamQuery(database, "all_changes", Dialect.GOOGLE_STANDARD_SQL, 1000),
        ReaderConfig(start_timestamp=start, end_timestamp=end),
        make_logger(io.StringIO()),
    )
    releases: list = []
    began = time.perf_counter()
    reader.run(releases.append, threading.Event())
    reader_seconds = time.perf_counter() - began
    transactions = [t for r in releases for t in r.transactions]
    rows = sum(t.mod_count for t in transactions)

    table = WORK / "throughput"
    began = time.perf_counter()
    process = service(database.database_id, table, start)
    wait_landed(table, len(committed))
    service_seconds = time.perf_counter() - began
    process.send_signal(signal.SIGTERM)
    process.wait()
    commits = sum(1 for f in (table / "_delta_log").glob("*.json"))

    bare = WORK / "bare"
    chunks = [transactions[i::commits] for i in range(commits)]
    began = time.perf_counter()
    for chunk in chunks:
        write_deltalake(
            str(bare),
            changelog.to_arrow(chunk),
            mode="append",
            partition_by=PARTITION_COLUMNS,
        )
    bare_seconds = time.perf_counter() - began

    print(f"throughput: {len(committed)} transactions, {rows} rows, service made {commits} commits")
    print(f"  reader alone        {rows / reader_seconds:8.0f} rows/s ({reader_seconds:.2f} s)")
    print(
        f"  service (to Delta)  {rows / service_seconds:8.0f} rows/s ({service_seconds:.2f} s, "
        "including process start and catch-up polling)"
    )
    print(
        f"  bare write_deltalake {rows / bare_seconds:7.0f} rows/s ({bare_seconds:.2f} s, "
        f"{commits} commits)"
    )
    print(
        f"  ratios: service/reader {reader_seconds / service_seconds:.2f}, "
        f"bare delta/reader {reader_seconds / bare_seconds:.2f}"
    )


def latency(flush_ms: int, seconds: float, rate: float) -> None:
    database = bootstrap(spanner.Client(project="local-project"), database_id=f"lat_{flush_ms}")
    table = WORK / f"latency_{flush_ms}"
    start = time.time_ns() + 200_000_000
    time.sleep(0.3)
    process = service(
        database.database_id,
        table,
        start,
        INGEST_FLUSH_LATENCY_MS=str(flush_ms),
        INGEST_HEARTBEAT_MS="1000",
    )
    time.sleep(3)
    committed = run_in_subprocess(database.database_id, seconds, rate)
    wait_landed(table, committed)
    process.send_signal(signal.SIGTERM)
    process.wait()
    latencies = []
    for log_file in sorted((table / "_delta_log").glob("*.json")):
        actions = [json.loads(line) for line in log_file.read_text().splitlines()]
        info = next(a["commitInfo"] for a in actions if "commitInfo" in a)
        visible_ms = info["timestamp"]
        for action in actions:
            add = action.get("add")
            if add and add.get("stats"):
                stats = json.loads(add["stats"])
                first = parse_rfc3339(stats["minValues"]["commit_timestamp_text"]) / 1e6
                last = parse_rfc3339(stats["maxValues"]["commit_timestamp_text"]) / 1e6
                latencies += [visible_ms - first, visible_ms - last]
    print(
        f"latency at flush {flush_ms} ms, heartbeat 1000 ms ({committed} transactions at "
        f"{rate:.0f}/s): commit→Delta-visible p50 {percentile(latencies, 0.5):.0f} ms, "
        f"p99 {percentile(latencies, 0.99):.0f} ms (oldest and newest row of each file)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backlog", type=int, default=3000)
    parser.add_argument("--live-seconds", type=float, default=15)
    parser.add_argument("--rate", type=float, default=20)
    args = parser.parse_args()
    print(machine_line())
    try:
        with emulator() as running:
            os.environ["SPANNER_EMULATOR_HOST"] = running.host_port
            database = bootstrap(spanner.Client(project="local-project"), database_id="bench")
            throughput(database, args.backlog)
            for flush_ms in (1000, 200, 50):
                latency(flush_ms, args.live_seconds, args.rate)
    finally:
        shutil.rmtree(WORK, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
