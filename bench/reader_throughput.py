"""Reader benchmark against the emulator: throughput and commit→release latency.

Throughput: commit a backlog, read it with the reader (bounded), then re-run exactly the queries
the reader issued with a bare client loop (no mapping, no ordering): the ratio is the reader's cost.
Latency: tail live while a workload (another process, so it does not share the reader's GIL)
commits at a fixed rate, at heartbeat 1 s and 100 ms; report
commit→release (reader output) next to commit→arrival (the same records as the client received
them, before any ordering) from the same run.

Usage: python bench/reader_throughput.py [--backlog 3000] [--live-seconds 20]
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from google.cloud import spanner

from emulator.bootstrap import bootstrap
from emulator.machine import machine_line
from emulator.server import emulator
from emulator.workload import Workload, WorkloadConfig, run_in_subprocess
from ingest.changestream.config import ReaderConfig
from ingest.changestream.query import ChangeStreamQuery, Dialect, statement
from ingest.changestream.reader import ChangeStreamReader
from ingest.model.records import ChangeRecord, DataChangeRecord
from ingest.model.resume import Release
from ingest.model.timestamps import Nanos
from runtime.logs import make_logger


class RecordingSource:
    """Wraps the DAO: remembers every query and when each data record reached the client."""

    def __init__(self, inner: ChangeStreamQuery) -> None:
        self.inner = inner
        self.queries: list[tuple[str | None, Nanos, Nanos | None]] = []
        self.arrivals: dict[tuple[str, str], int] = {}
        self.records = 0

    def read(self, token: str | None, start: Nanos, end: Nanos | None) -> Iterator[ChangeRecord]:
        self.queries.append((token, start, end))
        for record in self.inner.read(token, start, end):
            self.records += 1
            if isinstance(record, DataChangeRecord):
                key = (record.server_transaction_id, record.record_sequence)
                self.arrivals.setdefault(key, time.time_ns())
            yield record


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def throughput(database, backlog: int) -> dict[str, float]:
    start = time.time_ns() + 200_000_000
    time.sleep(0.3)
    workload = Workload(
        database,
        WorkloadConfig(
            duration_seconds=600, max_transactions=backlog, rows_per_transaction=4, seed=5
        ),
    )
    committed = workload.run()
    end = max(t.commit_timestamp for t in committed) + 1
    source = RecordingSource(
        ChangeStreamQuery(database, "all_changes", Dialect.GOOGLE_STANDARD_SQL, 1000)
    )
    reader = ChangeStreamReader(
        source, ReaderConfig(start_timestamp=start, end_timestamp=end), make_logger(io.StringIO())
    )
    released: list = []
    began = time.perf_counter()
    reader.run(lambda r: released.extend(r.transactions), threading.Event())
    reader_seconds = time.perf_counter() - began
    assert len(released) == len(committed), (len(released), len(committed))

    rows = 0
    began = time.perf_counter()
    for token, query_start, query_end in source.queries:
        sql, params, types = statement(
            "all_changes", Dialect.GOOGLE_STANDARD_SQL, token, query_start, query_end, 1000
        )
        with database.snapshot() as snapshot:
            for _ in snapshot.execute_sql(sql, params=params, param_types=types):
                rows += 1
    bare_seconds = time.perf_counter() - began
    return {
        "transactions": len(committed),
        "records": source.records,
        "queries": len(source.queries),
        "reader_records_per_s": source.records / reader_seconds,
        "bare_rows_per_s": rows / bare_seconds,
        "reader_seconds": reader_seconds,
        "bare_seconds": bare_seconds,
    }


def latency(database, heartbeat_ms: int, seconds: float, rate: float) -> dict[str, float]:
    start = time.time_ns() + 200_000_000
    time.sleep(0.3)
    source = RecordingSource(
        ChangeStreamQuery(database, "all_changes", Dialect.GOOGLE_STANDARD_SQL, heartbeat_ms)
    )
    reader = ChangeStreamReader(
        source,
        ReaderConfig(start_timestamp=start, heartbeat_ms=heartbeat_ms),
        make_logger(io.StringIO()),
    )
    released_at: list[tuple[int, int, tuple[DataChangeRecord, ...]]] = []

    def on_release(release: Release) -> None:
        now = time.time_ns()
        for transaction in release.transactions:
            released_at.append((transaction.commit_timestamp, now, transaction.records))

    stop = threading.Event()
    thread = threading.Thread(target=reader.run, args=(on_release, stop))
    thread.start()
    time.sleep(2)
    committed = run_in_subprocess(database.database_id, seconds, rate, heartbeat_ms)
    deadline = time.monotonic() + 60
    while len(released_at) < committed and time.monotonic() < deadline:
        time.sleep(0.1)
    stop.set()
    thread.join(timeout=30)
    release_ms = [(at - ts) / 1e6 for ts, at, _ in released_at]
    arrival_ms = [
        (source.arrivals[(r.server_transaction_id, r.record_sequence)] - ts) / 1e6
        for ts, _, records in released_at
        for r in records[:1]
    ]
    return {
        "committed": committed,
        "transactions": len(released_at),
        "release_p50_ms": percentile(release_ms, 0.5),
        "release_p99_ms": percentile(release_ms, 0.99),
        "arrival_p50_ms": percentile(arrival_ms, 0.5),
        "arrival_p99_ms": percentile(arrival_ms, 0.99),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backlog", type=int, default=3000)
    parser.add_argument("--live-seconds", type=float, default=20)
    parser.add_argument("--rate", type=float, default=100)
    args = parser.parse_args()
    print(machine_line())
    with emulator() as running:
        os.environ["SPANNER_EMULATOR_HOST"] = running.host_port
        database = bootstrap(spanner.Client(project="local-project"), database_id="bench")
        figures = throughput(database, args.backlog)
        print(
            f"throughput: {figures['transactions']} transactions, {figures['records']} records "
            f"over {figures['queries']} partition queries"
        )
        print(
            f"  reader     {figures['reader_records_per_s']:9.0f} records/s "
            f"({figures['reader_seconds']:.2f} s)"
        )
        print(
            f"  bare loop  {figures['bare_rows_per_s']:9.0f} rows/s    "
            f"({figures['bare_seconds']:.2f} s)"
        )
        ratio = figures["reader_records_per_s"] / figures["bare_rows_per_s"]
        print(f"  ratio reader/bare: {ratio:.2f}")
        for heartbeat in (1000, 100):
            # A fresh database: the emulator's live queries slow down as its stream fills up.
            live = bootstrap(
                spanner.Client(project="local-project"), database_id=f"live_{heartbeat}"
            )
            result = latency(live, heartbeat, args.live_seconds, args.rate)
            print(
                f"latency at heartbeat {heartbeat} ms ({result['transactions']} of "
                f"{result['committed']} committed transactions released, "
                f"{args.rate:.0f}/s): commit→release p50 {result['release_p50_ms']:.0f} ms "
                f"p99 {result['release_p99_ms']:.0f} ms; commit→arrival at the client "
                f"p50 {result['arrival_p50_ms']:.0f} ms p99 {result['arrival_p99_ms']:.0f} ms"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
