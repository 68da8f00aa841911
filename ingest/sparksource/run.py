"""``python -m ingest spark-run``: the change stream read by a Spark streaming query on any master,
landing the service's change log (the composition root of the Spark source).

The job's life is the service's: open the Spanner side, wait out another writer's lease, record a
new job's start (and finish its snapshot), then read; a clean stop hands the lease over with a
last commit. The reading is a streaming query of ``source.ChangeStreamDataSource`` whose batches
``landing.BatchLanding`` commits. Each driver process is an owner of its own (named after its
Spark checkpoint), so a second driver started on the same checkpoint by mistake stands by, as a
second service does, until the first hands the lease over or its lease runs out.
"""

from __future__ import annotations

import hashlib
import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from ingest.job.config import JobConfig
from ingest.job.taking import TakenJob, release_lease, take_job
from ingest.model.snapshot import SnapshotMode
from ingest.rules.batches import PartitionRead
from ingest.sparksource.landing import BatchLanding, ReadWave
from ingest.sparksource.metrics import SparkSourceMetrics
from ingest.sparksource.rows import BatchIdentity
from ingest.sparksource.snapshot import SparkSnapshotSettings, snapshot_in_tasks
from ingest.sparksource.source import NAME, WAVE, ChangeStreamDataSource, SourceOptions, wave_json
from runtime.errors import BadInput, ReportedError
from runtime.jvm import JvmLog
from runtime.logs import Logger
from runtime.options import in_range, integer, load_options, non_empty, option, reference, seconds
from runtime.spark_session import session_settings, start_session
from runtime.storage import STORE_ENVIRONMENT


@dataclass(frozen=True, slots=True)
class SparkSourceConfig:
    """What only the Spark source has; everything else is the job's ``JobConfig``."""

    master: str = option("local[2]", non_empty)
    checkpoint_uri: str = option("./data/spark-source-checkpoint", non_empty)
    """Spark's offset and commit logs of the query; one per job."""
    trigger_s: float = option(2.0, seconds(0.1, 3_600))
    """A batch starts at most this often (a batch that takes longer starts the next at once)."""
    max_batch_span_s: float = option(60.0, seconds(1, 1_800))
    max_partitions_per_batch: int = option(0, integer(0, 1_000_000))
    max_records_per_batch: int = option(0, in_range(int, "records", 0, 1_000_000_000))
    partitions_per_task: int = option(8, integer(1, 100_000))
    max_waves_per_batch: int = option(4, integer(1, 100))
    """Waves of one batch: the first reads the planned partitions, each further one those that
    became ready within the batch (merges' children, announced partitions)."""
    snapshot_tasks: int = option(0, integer(0, 100_000))
    """Key ranges the snapshot reads at once, a task each (0: Spark's default parallelism)."""
    snapshot_parts: int = option(64, integer(1, 100_000))
    """Key ranges a table is cut into at most when its snapshot starts (one per 100,000 rows,
    and one per task at least while each keeps 10,000 rows)."""
    snapshot_task_mb: int = option(256, integer(1, 1_048_576))
    """Rows a snapshot task writes before the driver commits its range's progress: what a
    driver's death costs a range at most."""


SPARK_PREFIX = "INGEST_SPARK_"
"""Each Spark source option's environment variable: INGEST_SPARK_ and its name in capitals."""


def spark_reference() -> list[tuple[str, str, object]]:
    """(option, environment variable, default) of the Spark source's own options."""
    return reference(SparkSourceConfig, SPARK_PREFIX)


def load_spark_config(environ: dict[str, str] | None = None) -> SparkSourceConfig:
    config: SparkSourceConfig = load_options(
        SparkSourceConfig, SPARK_PREFIX, dict(os.environ) if environ is None else environ, None
    )
    return config


def owner_of(checkpoint_uri: str, driver: str) -> str:
    """The writer one driver process is: its Spark checkpoint (for whoever reads the change
    log's owners) and the driver's own id, so two drivers of one checkpoint are two writers."""
    where = checkpoint_uri if "://" in checkpoint_uri else str(Path(checkpoint_uri).resolve())
    return f"spark-{hashlib.sha256(where.encode()).hexdigest()[:16]}-{driver}"


def run_spark_source(
    config: JobConfig, spark: SparkSourceConfig, log: Logger, stop: threading.Event
) -> int:
    """1. open the Spanner side; 2. wait for the lease, continue after the newest checkpoint;
    3. a new job records its start (and snapshot), a resumed one keeps it; 4. serve
    ``/metrics`` on ``health_port`` (0: not served); 5. finish the snapshot in tasks
    (``snapshot``); 6. run the streaming query until stopped or failed; 7. hand the lease over
    with a last commit."""
    owner = owner_of(spark.checkpoint_uri, uuid.uuid4().hex[:12])
    job = take_job(config, owner, log, stop)
    if job is None:
        return 0
    opened, sink, snapshot, log = job.opened, job.sink, job.snapshot, job.log
    unfinished = sink.table_snapshot
    if unfinished is not None and not unfinished.complete:
        release_lease(sink, log)
        raise OnDemandSnapshotRunning(
            "an on-demand snapshot of "
            + ", ".join(t.table for t in unfinished.tables)
            + " is unfinished: the Spark source does not run it; let `python -m ingest run` "
            "finish it first"
        )
    metrics = SparkSourceMetrics()
    metrics.ingest.sources.landed_watermark = job.resume.low_watermark
    metrics.ingest.sources.snapshot = lambda: sink.table_snapshot or sink.snapshot
    close_metrics = metrics.serve(config.health_port) if config.health_port else None
    session = spark_session(spark, JvmLog(log))
    try:
        if snapshot is not None and not snapshot.complete:
            snapshot = snapshot_in_tasks(
                session,
                opened,
                config,
                snapshot_settings(spark, session),
                snapshot,
                sink,
                log,
                stop,
                job.table_rows,
                on_reads=metrics.part_reads,
            )
            if not snapshot.complete:
                return release_lease(sink, log)
        if SnapshotMode(config.snapshot_mode) is SnapshotMode.INITIAL_ONLY:
            return release_lease(sink, log)
        return _read_stream(job, config, spark, session, metrics, log, stop)
    finally:
        session.stop()
        if close_metrics is not None:
            close_metrics()


def snapshot_settings(spark: SparkSourceConfig, session: Any) -> SparkSnapshotSettings:
    return SparkSnapshotSettings(
        spark.snapshot_tasks or session.sparkContext.defaultParallelism,
        spark.snapshot_parts,
        spark.snapshot_task_mb * 1024 * 1024,
    )


def _read_stream(
    job: TakenJob,
    config: JobConfig,
    spark: SparkSourceConfig,
    session: Any,
    metrics: SparkSourceMetrics,
    log: Logger,
    stop: threading.Event,
) -> int:
    opened = job.opened
    options = SourceOptions(
        config.project,
        config.instance,
        config.database,
        config.stream,
        opened.dialect.value,
        opened.info.mutable_key_range,
        config.table_uri,
        config.effective_job_id,
        config.heartbeat_ms,
        config.settle_margin_s,
        spark.max_batch_span_s,
        spark.max_partitions_per_batch,
        spark.max_records_per_batch,
        spark.partitions_per_task,
    )
    landing = BatchLanding(
        job.landing(config),
        on_landed=metrics.landed,
        read_wave=wave_reader(session, options),
        max_waves=spark.max_waves_per_batch,
    )
    session.streams.addListener(metrics.listener())
    _stream(session, options, spark, landing, log, stop)
    result = landing.hand_over()  # a failed query leaves the lease to run out
    if result is not None:
        log.info("writer_lease_released", version=result.version)
    return 0


def _stream(
    session: Any,
    options: SourceOptions,
    spark: SparkSourceConfig,
    landing: BatchLanding,
    log: Logger,
    stop: threading.Event,
) -> None:
    query = start_query(session, options, landing, spark.checkpoint_uri, spark.trigger_s)
    log.info("spark_source_started", master=spark.master, checkpoint_uri=spark.checkpoint_uri)
    while query.isActive and not stop.wait(0.5):
        pass
    failure = query.exception()
    query.stop()
    if failure is not None:
        raise SparkQueryFailed(_first_line(str(failure)))
    if not stop.is_set():  # its thread died without an exception Spark recorded
        raise SparkQueryFailed("the streaming query ended without being stopped; see its log")
    log.info("spark_source_stopped")


def wave_reader(session: Any, options: SourceOptions) -> ReadWave:
    """A further wave of a batch, read on the executors as a batch read of the same source."""

    def read(reads: list[PartitionRead], batch: BatchIdentity) -> pa.Table:
        wave = {WAVE: wave_json(reads, batch)}
        frame = session.read.format(NAME).options(**options.to_options(), **wave).load()
        return frame.toArrow()

    return read


def start_query(
    session: Any,
    options: SourceOptions,
    on_batch: Callable[[Any, int], None],
    checkpoint_uri: str,
    trigger_s: float,
) -> Any:
    """The streaming query: the change stream source, each batch handed to ``on_batch``."""
    session.dataSource.register(ChangeStreamDataSource)
    return (
        session.readStream.format(NAME)
        .options(**options.to_options())
        .load()
        .writeStream.foreachBatch(on_batch)
        .option("checkpointLocation", checkpoint_uri)
        .trigger(processingTime=f"{trigger_s} seconds")
        .queryName(f"changelog-{options.job_id}")
        .start()
    )


class OnDemandSnapshotRunning(BadInput):
    """The job's newest checkpoint carries an unfinished on-demand snapshot."""


class SparkQueryFailed(ReportedError, RuntimeError):
    """The streaming query stopped with an error (a task's or the landing's)."""


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0][:500] if text.strip() else "unknown failure"


def spark_session(spark: SparkSourceConfig, jvm_output: JvmLog | None = None) -> Any:
    """The driver's session: its checkpoint's object store, the emulator's address and the
    store's credentials forwarded to the executors (their tasks open Spanner and the store)."""
    forwarded = ("SPANNER_EMULATOR_HOST", "GOOGLE_CLOUD_SPANNER_MULTIPLEXED_SESSIONS")
    own = {"spark.sql.streaming.stopTimeout": "30s"}
    for name in sorted(os.environ):
        if name in forwarded or name in STORE_ENVIRONMENT or name.startswith("AWS_"):
            own[f"spark.executorEnv.{name}"] = os.environ[name]
    settings = session_settings(own, storage_uris=[spark.checkpoint_uri])
    return start_session("spanner-cdc-source", spark.master, settings, jvm_output)
