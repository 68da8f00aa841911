"""Thousands of live partitions, splitting and merging, through the real Spanner client on the
scripted server in real time: the reader takes turns at a bounded number of queries, and every
transaction arrives once, whole, in order, across a restart from a random checkpoint."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

import pytest

from ingest.changestream.config import ReaderConfig
from ingest.changestream.reader import ChangeStreamReader
from ingest.changestream.retries import RetryPolicy
from ingest.model.records import Transaction
from ingest.model.resume import Release, ResumePoint
from ingest.model.timestamps import NANOS_PER_SECOND, Nanos
from runtime.logs import null_logger
from tests.scripted_spanner import live_script, scripted_query, start_server
from tests.simulation import build_wide_topology

PARTITIONS = 2_000
TURNS = 32
RSS_GROWTH_BOUND = 128 * 1024 * 1024
"""Measured growth: 37 MiB (the client, the server in this process, 2,000 partitions'
bookkeeping). The bound catches a reader whose memory grows with its partitions' streams or
queries, not a few MiB of noise."""


def turn_threads() -> int:
    return sum(t.name.startswith("partition-") for t in threading.enumerate())


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


@dataclass
class Sampler:
    """Samples the process's threads and RSS while the readers run."""

    most_threads: int = 0
    most_turn_threads: int = 0
    most_rss: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.wait(0.05):
            threads = threading.enumerate()
            self.most_threads = max(self.most_threads, len(threads))
            self.most_turn_threads = max(self.most_turn_threads, turn_threads())
            self.most_rss = max(self.most_rss, rss_bytes())


def run_until(
    reader: ChangeStreamReader, stop_at: Nanos | None
) -> tuple[list[Transaction], list[ResumePoint]]:
    """Run a reader; stop it at the first release past ``stop_at``, keeping every resume point
    a sink would have stored."""
    released: list[Transaction] = []
    resume: list[ResumePoint] = []
    stop = threading.Event()

    def land(release: Release) -> None:
        released.extend(release.transactions)
        resume.append(release.resume_point)
        if stop_at is not None and release.low_watermark >= stop_at:
            stop.set()

    reader.run(land, stop)
    return released, resume


@pytest.mark.parametrize("mutable_key_range", [False, True])
def test_two_thousand_partitions_split_and_merge_and_lose_nothing(
    no_emulator: None, mutable_key_range: bool
) -> None:
    """Original mode: partitions split and merge (child partitions records). MUTABLE_KEY_RANGE:
    partitions are announced and ended by their own records and key ranges move between them."""
    rng = random.Random(2_000)
    start = time.time_ns() + NANOS_PER_SECOND
    horizon = 15 * NANOS_PER_SECOND
    topology = build_wide_topology(
        rng,
        partitions=PARTITIONS,
        changes=400,
        transactions=1_500,
        start=start,
        horizon=horizon,
    )
    script = live_script(topology, rng, mutable_key_range)
    server, servicer, port = start_server(script, workers=4 * TURNS)
    sampler = Sampler()
    rss_before = rss_bytes()
    threads_before = threading.active_count()
    threading.Thread(target=sampler.run, daemon=True).start()

    def reader(resume_from: ResumePoint | None) -> ChangeStreamReader:
        config = ReaderConfig(
            start_timestamp=topology.start,
            end_timestamp=topology.end,
            max_concurrent_partitions=TURNS,
            retry=RetryPolicy(initial_backoff_s=0.01, max_backoff_s=0.1),
        )
        source = scripted_query(port)
        return ChangeStreamReader(source, config, null_logger(), resume_from=resume_from)

    readers = [reader(None)]
    try:
        stop_at = start + int(rng.uniform(0.2, 0.7) * horizon)
        first, stored = run_until(readers[0], stop_at)
        # The newest checkpoint mid-run: on a loaded machine the release past the random point
        # can be the stream's end (a round of 2,000 turns moving the low watermark in one late
        # jump), and a restart from the end would test nothing.
        checkpoint = next(
            (r for r in reversed(stored) if len(r.partitions.partitions) >= PARTITIONS // 2),
            stored[-1] if stored else None,
        )
        assert checkpoint is not None
        landed = [t for t in first if t.commit_timestamp <= checkpoint.low_watermark]
        # the stopped reader's turns end at their next record (a heartbeat: 1 s); only those
        # abandoned to a silent stream by the watchdog may outlive it, until their window ends
        deadline = time.monotonic() + 15
        while turn_threads() > readers[0].watchdog.restarts_total and time.monotonic() < deadline:
            time.sleep(0.05)
        readers.append(reader(checkpoint))
        second, _ = run_until(readers[1], None)
    finally:
        sampler.stop.set()
        server.stop(grace=None)

    expected = topology.expected()
    assert landed + second == expected
    assert landed
    assert len(checkpoint.partitions.partitions) >= PARTITIONS // 2
    assert not servicer.queried_before_parents
    merged = [t for t, parents in script.parents.items() if len(parents) > 1]
    assert mutable_key_range or merged
    assert {t for t, *_ in servicer.queries} >= set(merged)
    assert len(servicer.queries) > 2 * PARTITIONS, "partitions took more than one turn each"
    # the turns, the queries the watchdog abandoned (they end with their window), and a turn
    # that had handed its partition back and was exiting as the next one started
    abandoned = sum(r.watchdog.restarts_total for r in readers)
    assert sampler.most_turn_threads <= TURNS + abandoned + 2, (sampler, abandoned)
    # the coordinator, the turns, the scripted server's workers, the client's and the sampler
    assert sampler.most_threads <= threads_before + TURNS + abandoned + 4 * TURNS + 16
    assert sampler.most_rss - rss_before < RSS_GROWTH_BOUND, (sampler, rss_before)
    print(
        f"threads {threads_before} → {sampler.most_threads}, RSS {rss_before >> 20} → "
        f"{sampler.most_rss >> 20} MiB, queries {len(servicer.queries)}"
    )
