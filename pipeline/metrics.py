"""Prometheus metrics of the pipeline, served at ``/metrics`` on ``metrics_port``.

Three feeds, each where the fact is known: Spark's ``StreamingQueryListener`` (micro-batches, their
duration, change-log rows read, state rows, reads and writes, change-log files still to read), the
batch function (rows merged per mirror, the newest Spanner commit applied), and the job loop (query
restarts by reason, the state schema deployment running). Freshness is computed when Prometheus
scrapes. One registry per process, no global state; labels are table names and restart reasons only
(bounded), never row values.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ingest.model.timestamps import NANOS_PER_SECOND, Nanos, parse_rfc3339
from runtime.metrics import progress_listener, serve

BATCH_DURATION_BUCKETS = (0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 900)


class _ScrapeCollector(Collector):
    """What is computed when Prometheus scrapes: freshness, and how long a batch has run."""

    def __init__(self, metrics: PipelineMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        metrics = self._metrics
        started = metrics.batch_started_at
        yield GaugeMetricFamily(
            "pipeline_batch_running_seconds",
            "How long the batch function has run on the micro-batch in progress; 0 between "
            "batches (a hung batch shows here, not in the duration histogram)",
            value=0.0 if started is None else metrics.monotonic() - started,
        )
        newest = metrics.newest_commit
        if newest is None:
            return
        yield GaugeMetricFamily(
            "pipeline_newest_commit_applied_seconds",
            "The newest Spanner commit timestamp applied to the mirrors (Unix seconds)",
            value=newest / NANOS_PER_SECOND,
        )
        yield GaugeMetricFamily(
            "pipeline_freshness_lag_seconds",
            "Wall clock minus the newest commit applied; grows while Spanner is quiet too",
            value=(metrics.wall_clock() - newest) / NANOS_PER_SECOND,
        )


class PipelineMetrics:
    def __init__(
        self,
        wall_clock: Callable[[], Nanos] = time.time_ns,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry = CollectorRegistry(auto_describe=True)
        self.wall_clock, self.monotonic = wall_clock, monotonic
        self.newest_commit: Nanos | None = None
        self.batch_started_at: float | None = None
        self._add_progress_metrics(registry)
        self.rows_merged = Counter(
            "pipeline_rows_merged", "Keys merged into a mirror table", ["table"], registry=registry
        )
        self.processor_rows = Counter(
            "pipeline_processor_rows",
            "Rows a user processor appended to its output table",
            labelnames=["processor"],
            registry=registry,
        )
        self.restarts = Counter(
            "pipeline_query_restarts",
            "Restarts of the streaming query on the same checkpoint, by reason",
            labelnames=["reason"],
            registry=registry,
        )
        self.rebases = Counter(
            "pipeline_state_rebases",
            "New state generations seeded from the mirrors (before Spark's evolution limits)",
            registry=registry,
        )
        self.deployment = Gauge(
            "pipeline_state_deployment",
            "Number of the state schema deployment the query runs",
            registry=registry,
        )
        self.query_running = Gauge(
            "pipeline_query_running", "1 while the streaming query runs", registry=registry
        )
        self.registry.register(_ScrapeCollector(self))

    def _add_progress_metrics(self, registry: CollectorRegistry) -> None:
        """What Spark's query progress feeds (``progress``)."""
        self.batches = Counter(
            "pipeline_batches", "Micro-batches the query completed", registry=registry
        )
        self.batch_duration = Histogram(
            "pipeline_batch_duration_seconds",
            "Micro-batch duration: read, transformWithState, MERGE into the mirrors",
            buckets=BATCH_DURATION_BUCKETS,
            registry=registry,
        )
        self.input_rows = Counter(
            "pipeline_input_rows", "Change-log rows the query read", registry=registry
        )
        self.state_rows = Gauge(
            "pipeline_state_rows", "Keys held in the RocksDB state store", registry=registry
        )
        self.state_store = Counter(
            "pipeline_state_store_operations",
            "Reads and writes of the RocksDB state store (Spark's rocksdbGetCount and "
            "rocksdbPutCount): what a key costs (docs/pipeline.md, What a key costs)",
            labelnames=["operation"],
            registry=registry,
        )
        self.files_outstanding = Gauge(
            "pipeline_changelog_files_outstanding",
            "Change-log data files not read yet, as of the last micro-batch",
            registry=registry,
        )

    def query_started(self, deployment: int) -> None:
        self.query_running.set(1)
        self.deployment.set(deployment)

    def query_ended(self) -> None:
        self.query_running.set(0)

    @contextlib.contextmanager
    def batch_running(self) -> Iterator[None]:
        """The batch function works on a micro-batch (the executors compute its state first)."""
        self.batch_started_at = self.monotonic()
        try:
            yield
        finally:
            self.batch_started_at = None

    def batch_landed(self, rows: Mapping[str, int], newest_commit: str | None) -> None:
        """The batch function merged ``rows`` keys per mirror, up to ``newest_commit``."""
        for table, count in rows.items():
            self.rows_merged.labels(table).inc(count)
        if newest_commit is not None:
            newest = parse_rfc3339(newest_commit)
            if self.newest_commit is None or newest > self.newest_commit:
                self.newest_commit = newest

    def progress(self, progress: Any) -> None:
        """One ``StreamingQueryProgress``: a micro-batch completed."""
        self.batch_duration.observe(progress.batchDuration / 1000)
        self.batches.inc()
        self.input_rows.inc(progress.numInputRows)
        self.state_rows.set(sum(s.numRowsTotal for s in progress.stateOperators))
        store = [s.customMetrics for s in progress.stateOperators]
        for operation, metric in (("read", "rocksdbGetCount"), ("write", "rocksdbPutCount")):
            self.state_store.labels(operation).inc(sum(m.get(metric, 0) for m in store))
        outstanding = [s.metrics.get("numFilesOutstanding") for s in progress.sources]
        if outstanding and all(o is not None for o in outstanding):
            self.files_outstanding.set(sum(int(o) for o in outstanding))

    def listener(self) -> Any:
        """A ``StreamingQueryListener`` feeding these metrics."""
        return progress_listener(self.progress)

    def serve(self, port: int) -> Callable[[], None]:
        """Serve ``/metrics`` on ``port`` (all interfaces); returns what stops the server."""
        return serve(self.registry, port)
