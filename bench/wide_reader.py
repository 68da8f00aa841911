"""Reader at 10, 500 and 5,000 live partitions on the scripted server, in real time.

The server (another process, so it does not share the reader's GIL) serves a wide topology live:
each record when the clock reaches its commit timestamp, heartbeats on silent partitions, a few
hundred splits, moves and merges, transactions at a fixed rate (a third spread over several
partitions). The reader runs with the product's default turns (512) and with 64, and reports
records/s, commit→release latency, the reader's CPU per record and per query, threads and RSS,
all over the steady state: commits from ``--warmup`` seconds into the stream to its end, so the
start of thousands of partitions and the drain are left out.

Usage: python bench/wide_reader.py [--seconds 20] [--warmup 10] [--rate 100] [--widths 10,500,5000]
"""

from __future__ import annotations

import argparse
import os
import pickle
import random
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from emulator.machine import machine_line
from runtime.process import PROCESS_ENVIRONMENT

os.environ.pop("SPANNER_EMULATOR_HOST", None)
os.environ.update(PROCESS_ENVIRONMENT)  # it forks after using gRPC: runtime/process.py

from ingest.changestream.config import ReaderConfig
from ingest.changestream.reader import ChangeStreamReader
from ingest.model.records import ChangeRecord
from ingest.model.resume import Release
from ingest.model.timestamps import NANOS_PER_SECOND, Nanos
from runtime.logs import null_logger
from tests.scripted_spanner import Script, scripted_query
from tests.simulation import build_wide_topology


def serve(script: Script, workers: int) -> tuple[subprocess.Popen[str], int]:
    """The scripted server in a process of its own, serving ``script``."""
    path = Path(tempfile.mkdtemp()) / "script.pickle"
    path.write_bytes(pickle.dumps(script))
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.scripted_spanner",
            f"--script={path}",
            f"--workers={workers}",
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    return server, int(server.stdout.readline())  # type: ignore[union-attr]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


@dataclass(frozen=True, slots=True)
class Sample:
    at: Nanos
    cpu_s: float
    records: int
    queries: int
    threads: int
    rss_mib: float


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Counters:
    """What a run counts as it goes: the queries the reader issues, the records it releases,
    the commit → release latency of the steady state's transactions, and samples of them all."""

    steady_from: Nanos
    end: Nanos
    queries: int = 0
    records: int = 0
    latencies: list[float] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)

    def land(self, release: Release) -> None:
        now = time.time_ns()
        for transaction in release.transactions:
            if self.steady_from <= transaction.commit_timestamp <= self.end:
                self.latencies.append((now - transaction.commit_timestamp) / NANOS_PER_SECOND)
            self.records += len(transaction.records)

    def sample_until(self, done: threading.Event) -> None:
        while not done.wait(0.1):
            self.samples.append(
                Sample(
                    time.time_ns(),
                    cpu_seconds(),
                    self.records,
                    self.queries,
                    threading.active_count(),
                    rss_mib(),
                )
            )


@dataclass
class CountingQuery:
    """The scripted server's query, counting the partition queries the reader issues."""

    query: Any
    counters: Counters

    def read(self, token: str | None, start: Nanos, end: Nanos | None) -> Iterator[ChangeRecord]:
        self.counters.queries += 1
        return self.query.read(token, start, end)


def run(
    width: int, turns: int, seconds: int, warmup: int, rate: int, seed: int
) -> dict[str, float]:
    """Figures from the steady state only: commits from ``warmup`` seconds into the stream to
    its end (start-up, the first round of turns and the drain left out)."""
    transactions = (warmup + seconds) * rate
    start = time.time_ns() + 3 * NANOS_PER_SECOND + width * 1_000_000  # time to build and serve
    horizon = (warmup + seconds) * NANOS_PER_SECOND
    changes = min(400, max(2, width // 10))
    args = dict(
        partitions=width, changes=changes, transactions=transactions, start=start, horizon=horizon
    )
    topology = build_wide_topology(random.Random(seed), **args)
    server, port = serve(Script(topology.records_by_partition(), live=True), 4 * turns + 16)
    counters = Counters(start + warmup * NANOS_PER_SECOND, start + horizon)
    try:
        config = ReaderConfig(
            start_timestamp=start, end_timestamp=start + horizon, max_concurrent_partitions=turns
        )
        query = CountingQuery(scripted_query(port), counters)
        reader = ChangeStreamReader(query, config, null_logger())
        done = threading.Event()
        threading.Thread(target=counters.sample_until, args=(done,), daemon=True).start()
        reader.run(counters.land, threading.Event())
        done.set()
    finally:
        server.kill()
        server.wait()
    return figures(width, turns, counters)


def figures(width: int, turns: int, counters: Counters) -> dict[str, float]:
    steady = [s for s in counters.samples if counters.steady_from <= s.at <= counters.end]
    assert len(steady) >= 2, "no steady state sampled: run longer"
    first, last = steady[0], steady[-1]
    span = (last.at - first.at) / NANOS_PER_SECOND
    steady_records = last.records - first.records
    cpu = last.cpu_s - first.cpu_s
    return {
        "width": width,
        "turns": turns,
        "records_per_s": steady_records / span,
        "p50_s": percentile(counters.latencies, 0.5),
        "p99_s": percentile(counters.latencies, 0.99),
        "cpu_ms_per_record": 1000 * cpu / max(steady_records, 1),
        "queries_per_s": (last.queries - first.queries) / span,
        "cpu_ms_per_query": 1000 * cpu / max(last.queries - first.queries, 1),
        "threads": max(s.threads for s in steady),
        "rss_mib": max(s.rss_mib for s in steady),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=int, default=20, help="steady state, measured")
    parser.add_argument("--warmup", type=int, default=10, help="before it, not measured")
    parser.add_argument("--rate", type=int, default=100)
    parser.add_argument("--widths", default="10,500,5000")
    parser.add_argument("--turns", default="512,64")
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()
    print(machine_line())
    print(
        f"# {args.warmup} s warm-up then {args.seconds} s measured, live at {args.rate} "
        "transactions/s, server in its own process"
    )
    header = "| partitions | turns | records/s | commit→release p50 | p99 | reader CPU ms/record |"
    print(header + " threads | RSS MiB | queries/s | reader CPU ms/query |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for width in (int(w) for w in args.widths.split(",")):
        for turns in (int(t) for t in args.turns.split(",")):
            r = run(width, turns, args.seconds, args.warmup, args.rate, args.seed)
            print(
                f"| {width:,} | {turns} | {r['records_per_s']:.0f} | {r['p50_s']:.2f} s | "
                f"{r['p99_s']:.2f} s | {r['cpu_ms_per_record']:.2f} | {r['threads']} | "
                f"{r['rss_mib']:.0f} | {r['queries_per_s']:,.0f} | {r['cpu_ms_per_query']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
