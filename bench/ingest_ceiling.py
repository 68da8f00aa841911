"""The ceiling of one ingest process per core, on the scripted server (another process).

A backlog of production-shaped transactions (data change records of 10 mods over 10 columns,
a third of the transactions spread over several partitions) over 50 partitions that split, move
and merge is read four ways over exactly the same queries, and each is charged the CPU seconds of
this process (the server's are not counted), the fastest of two runs:
- bare client loop, the client's default decoding, rows only;
- bare client loop with ``lazy_decode``, rows only (what the client itself costs);
- the reader (raw mapper, tracker, assembler, release in order);
- the reader and the Delta sink (the service's Batcher: one commit per 20,000 rows).

Usage: python bench/ingest_ceiling.py [--transactions 6000] [--partitions 50]
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from emulator.machine import machine_line
from runtime.process import PROCESS_ENVIRONMENT

os.environ.pop("SPANNER_EMULATOR_HOST", None)
os.environ.update(PROCESS_ENVIRONMENT)  # it forks after using gRPC: runtime/process.py

from decode_speed import in_place_of, production_record
from wide_reader import cpu_seconds, serve

from ingest.changestream.config import ReaderConfig
from ingest.changestream.query import ChangeStreamQuery, statement
from ingest.changestream.reader import ChangeStreamReader
from ingest.delta.batcher import Batcher
from ingest.delta.landing import ChangeLogLanding, WatchedColumnsPoll
from ingest.delta.sink import DeltaChangeLogSink
from ingest.model.records import ChangeRecord, Transaction
from ingest.model.resume import Release
from ingest.model.timestamps import NANOS_PER_SECOND, Nanos, parse_rfc3339
from runtime.logs import make_logger, null_logger
from tests.scripted_spanner import Script, scripted_query
from tests.simulation import Topology, build_wide_topology

START = parse_rfc3339("2026-01-01T00:00:00Z")


def production_topology(partitions: int, transactions: int) -> Topology:
    """A wide topology whose records are replaced by production-shaped ones (same timestamps,
    transactions and owners)."""
    topology = build_wide_topology(
        random.Random(12), partitions, partitions // 5, transactions, START, 60 * NANOS_PER_SECOND
    )
    shaped = []
    for number, transaction in enumerate(topology.transactions):
        records = tuple(
            in_place_of(production_record(number, 10), record) for record in transaction.records
        )
        shaped.append(
            Transaction(transaction.commit_timestamp, transaction.server_transaction_id, records)
        )
    return dataclasses.replace(topology, transactions=shaped)


class Recording:
    """Remembers the reader's queries, to run exactly them again in the bare loops."""

    def __init__(self, inner: ChangeStreamQuery) -> None:
        self.inner = inner
        self.queries: list[tuple[str | None, Nanos, Nanos | None]] = []

    def read(self, token: str | None, start: Nanos, end: Nanos | None) -> Iterator[ChangeRecord]:
        self.queries.append((token, start, end))
        yield from self.inner.read(token, start, end)


def measure(work: Callable[[], int], repeats: int = 2) -> tuple[int, float, float]:
    """The fastest of ``repeats`` runs (the first pays for connections, sessions and imports)."""
    best: tuple[int, float, float] | None = None
    for _ in range(repeats):
        cpu, wall = cpu_seconds(), time.monotonic()
        records = work()
        run = (records, cpu_seconds() - cpu, time.monotonic() - wall)
        best = run if best is None or run[1] < best[1] else best
    assert best is not None
    return best


def bare_loop(source: ChangeStreamQuery, queries: list, lazy: bool) -> int:
    rows = 0
    for token, start, end in queries:
        sql, params, types = statement(
            source.stream, source.dialect, token, start, end, source.heartbeat_ms
        )
        with source.database.snapshot() as snapshot:
            for _ in snapshot.execute_sql(sql, params=params, param_types=types, lazy_decode=lazy):
                rows += 1
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--transactions", type=int, default=6000)
    parser.add_argument("--partitions", type=int, default=50)
    args = parser.parse_args()
    topology = production_topology(args.partitions, args.transactions)
    expected = topology.expected()
    data_records = sum(len(t.records) for t in expected)
    server, port = serve(Script(topology.records_by_partition()), workers=64)
    try:
        config = ReaderConfig(start_timestamp=START, end_timestamp=topology.end)
        query = scripted_query(port)
        recording = Recording(query)

        def reader_only() -> int:
            released: list[Transaction] = []
            recording.queries.clear()
            reader = ChangeStreamReader(recording, config, null_logger())
            reader.run(lambda r: released.extend(r.transactions), threading.Event())
            assert released == expected
            return data_records

        def reader_and_sink() -> int:
            sink = DeltaChangeLogSink(tempfile.mkdtemp(prefix="ceiling-") + "/t", "bench", "o")
            sink.start_job(START)
            log = make_logger(io.StringIO())
            watched = WatchedColumnsPoll(None, 10.0, log)
            batcher = Batcher(
                ChangeLogLanding(sink, watched, log, 7 * 86400 * NANOS_PER_SECOND),
                flush_latency_s=1.0,
                max_rows=20_000,
                checkpoint_interval_s=10.0,
            )
            reader = ChangeStreamReader(query, config, null_logger())

            def land(release: Release) -> None:
                batcher.on_release(release)

            reader.run(land, threading.Event(), on_tick=batcher.on_tick)
            batcher.flush()
            return data_records

        results = {
            "reader": measure(reader_only),
            "bare, default decoding": measure(lambda: bare_loop(query, recording.queries, False)),
            "bare, lazy_decode": measure(lambda: bare_loop(query, recording.queries, True)),
            "reader + Delta sink": measure(reader_and_sink),
        }
    finally:
        server.kill()
        server.wait()
    print(machine_line())
    print(
        f"# {len(expected)} transactions, {data_records} data change records of 10 mods over "
        f"10 columns, {len(topology.partitions)} partitions, {len(recording.queries)} queries"
    )
    print("| path | data records | CPU s | records per CPU second | wall s |")
    print("|---|---|---|---|---|")
    for name, (records, cpu, wall) in results.items():
        print(f"| {name} | {records} | {cpu:.2f} | {records / cpu:,.0f} | {wall:.2f} |")


if __name__ == "__main__":
    main()
