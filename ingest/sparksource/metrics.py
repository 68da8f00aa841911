"""The Spark source's ``/metrics``: the service's figures where they apply (transactions, rows
and commits landed, commit → landed latency, the low watermark and its lag, the snapshot), fed by
each landed batch, and the batches themselves, fed by Spark's ``StreamingQueryListener`` as the
pipeline's are. Labels are outcomes only (bounded), never row values."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import Counter, Histogram

from ingest.job.metrics import IngestMetrics
from ingest.snapshot.parts import PartRead
from ingest.sparksource.landing import LandedBatch
from runtime.metrics import progress_listener, serve

BATCH_DURATION_BUCKETS = (0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 900)


class SparkSourceMetrics:
    def __init__(self, ingest: IngestMetrics | None = None) -> None:
        self.ingest = ingest or IngestMetrics()
        registry = self.ingest.registry
        self.batches = Counter(
            "ingest_spark_batches",
            "Micro-batches landed, by outcome (landed, replayed, superseded)",
            labelnames=["outcome"],
            registry=registry,
        )
        self.partition_queries = Counter(
            "ingest_partition_queries",
            "Partition queries the batches' tasks ran (planned and followed)",
            registry=registry,
        )
        self.rows_read_again = Counter(
            "ingest_rows_read_again",
            "Change rows read above a batch's cut, dropped and read again by the next batch",
            registry=registry,
        )
        self.cuts_lowered = Counter(
            "ingest_spark_cuts_lowered",
            "Batches whose cut fell below their end (a merge, an announced partition, a limit)",
            registry=registry,
        )
        self.snapshot_part_reads = Counter(
            "ingest_snapshot_part_reads",
            "Snapshot key-range reads landed, by outcome (done: the range ended; continued: "
            "the task wrote its budget and the range goes on)",
            labelnames=["outcome"],
            registry=registry,
        )
        self.batch_duration = Histogram(
            "ingest_spark_batch_duration_seconds",
            "Micro-batch duration: planning, the tasks' queries, the landing",
            buckets=BATCH_DURATION_BUCKETS,
            registry=registry,
        )

    def landed(self, batch: LandedBatch) -> None:
        self.batches.labels(batch.outcome).inc()
        self.partition_queries.inc(batch.partitions)
        self.rows_read_again.inc(batch.rows_above_cut)
        if batch.low_watermark < batch.end:
            self.cuts_lowered.inc()
        if batch.outcome == "landed":
            self.ingest.landed(batch.commit_timestamps, batch.rows, batch.low_watermark)

    def part_reads(self, reads: Sequence[PartRead]) -> None:
        for read in reads:
            self.snapshot_part_reads.labels("done" if read.done else "continued").inc()

    def progress(self, progress: Any) -> None:
        """One ``StreamingQueryProgress``: a micro-batch completed."""
        self.batch_duration.observe(progress.batchDuration / 1000)

    def listener(self) -> Any:
        """A ``StreamingQueryListener`` feeding these metrics."""
        return progress_listener(self.progress)

    def serve(self, port: int) -> Callable[[], None]:
        """Serve ``/metrics`` on ``port`` (all interfaces); returns what stops the server."""
        return serve(self.ingest.registry, port)
