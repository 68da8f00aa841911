"""Prometheus metrics of the ingest service, served at ``/metrics`` on its health port.

Most values are read from the reader, the sink and the snapshot when Prometheus scrapes (a
custom collector), so the data path makes no metric calls; what happens per commit (transactions,
rows, the commit-latency histogram) is counted by the batcher's commit hook. One registry per
process, no global state. No row values, no partition tokens as labels (unbounded cardinality).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ingest.changestream.reader import ChangeStreamReader
from ingest.model.records import Transaction
from ingest.model.snapshot import SnapshotProgress
from ingest.model.timestamps import NANOS_PER_SECOND, Nanos

LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 900)


@dataclass
class _Sources:
    """What the collector reads at scrape time; set as the service reaches each phase."""

    reader: ChangeStreamReader | None = None
    snapshot: Callable[[], SnapshotProgress | None] = lambda: None
    landed_watermark: Nanos | None = None
    wall_clock: Callable[[], Nanos] = time.time_ns


class _ScrapeCollector(Collector):
    def __init__(self, sources: _Sources) -> None:
        self._sources = sources

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        sources = self._sources
        landed = sources.landed_watermark
        if landed is not None:
            yield _gauge(
                "ingest_low_watermark_seconds",
                "The change log's low watermark W: everything committed at or before it landed "
                "(Unix seconds)",
                landed / NANOS_PER_SECOND,
            )
            yield _gauge(
                "ingest_watermark_lag_seconds",
                "Wall clock minus the landed low watermark",
                (sources.wall_clock() - landed) / NANOS_PER_SECOND,
            )
        reader = sources.reader
        if reader is not None:
            yield _counter("ingest_records_read", "Change stream records read", reader.records_read)
            yield _gauge(
                "ingest_buffered_bytes",
                "Bytes of records held for transactions not released yet",
                reader.assembler.buffered_bytes,
            )
            yield _gauge(
                "ingest_open_transactions",
                "Transactions read in part, waiting for their other records or the watermark",
                reader.assembler.open_transactions,
            )
            partitions = GaugeMetricFamily(
                "ingest_partitions", "Live change stream partitions", labels=["state"]
            )
            partitions.add_metric(["live"], reader.tracker.live_count)
            partitions.add_metric(["in_turn"], reader.turns.in_turn)
            partitions.add_metric(["waiting_for_turn"], reader.turns.waiting)
            partitions.add_metric(["stuck"], reader.watchdog.stuck_partitions)
            yield partitions
            retries = CounterMetricFamily(
                "ingest_partition_query_retries",
                "Partition queries retried, by the exception that caused it",
                labels=["cause"],
            )
            for cause, count in reader.retries_by_cause().items():
                retries.add_metric([cause], count)
            yield retries
            yield _counter(
                "ingest_stuck_partition_restarts",
                "Stuck partitions queried again",
                reader.watchdog.restarts_total,
            )
        progress = sources.snapshot()
        if progress is not None:
            yield _counter("ingest_snapshot_rows", "Snapshot rows landed", progress.rows)
            tables = GaugeMetricFamily(
                "ingest_snapshot_tables", "Tables of the running snapshot", labels=["state"]
            )
            done = sum(t.done for t in progress.tables)
            tables.add_metric(["done"], done)
            tables.add_metric(["pending"], len(progress.tables) - done)
            yield tables


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


class IngestMetrics:
    def __init__(self, wall_clock: Callable[[], Nanos] = time.time_ns) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.sources = _Sources(wall_clock=wall_clock)
        self._wall_clock = wall_clock
        self._transactions = Counter(
            "ingest_transactions_landed",
            "Whole transactions landed in the change log",
            registry=self.registry,
        )
        self._rows = Counter(
            "ingest_rows_landed",
            "Change rows (mods) landed in the change log",
            registry=self.registry,
        )
        self._commits = Counter(
            "ingest_delta_commits", "Delta commits of the change log", registry=self.registry
        )
        self._latency = Histogram(
            "ingest_commit_latency_seconds",
            "Spanner commit to landed in the change log, per transaction",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_ScrapeCollector(self.sources))

    def committed(self, transactions: Sequence[Transaction], low_watermark: Nanos) -> None:
        """A Delta commit landed these transactions, up to ``low_watermark``."""
        self.landed(
            [t.commit_timestamp for t in transactions],
            sum(t.mod_count for t in transactions),
            low_watermark,
        )

    def landed(self, commit_timestamps: Sequence[Nanos], rows: int, low_watermark: Nanos) -> None:
        """A Delta commit landed transactions committed at ``commit_timestamps``, ``rows`` mods
        in all, up to ``low_watermark``."""
        now = self._wall_clock()
        self._commits.inc()
        self._transactions.inc(len(commit_timestamps))
        self._rows.inc(rows)
        for committed_at in commit_timestamps:
            self._latency.observe(max(0, now - committed_at) / NANOS_PER_SECOND)
        self.sources.landed_watermark = low_watermark

    def render(self) -> bytes:
        return generate_latest(self.registry)
