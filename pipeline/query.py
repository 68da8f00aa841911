"""The streaming query of one state generation: its Spark settings, its source (the change
log), its operator (transformWithState) and sink (``BatchWriter``), and how it is awaited."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from pipeline.batch_writer import BatchWriter, JobStats
from pipeline.config import PipelineConfig
from pipeline.deployment import Plan
from pipeline.metrics import PipelineMetrics
from pipeline.mirror import MIRROR_TARGET_FILE_BYTES
from pipeline.processor import INPUT_COLUMNS, ChangeApplier
from pipeline.state import generations
from pipeline.state.generations import Generation
from pipeline.state.variables import legacy_variables
from pipeline.stream_start import fresh_start
from pipeline.user_processors.feed import routed
from pipeline.user_processors.host import ChangeApplierWithProcessors, job_output_schema
from runtime.logs import Logger


def spark_settings(config: PipelineConfig) -> dict[str, str]:
    """Settings the job needs in its session.

    No-data batches are off: in ProcessingTime mode transformWithState would otherwise run one
    every trigger forever (and ``availableNow`` would never end); tombstone TTLs expire on the
    next batch with data instead.

    Mirrors hold timestamps as Parquet INT64 microseconds, not Spark's default INT96, which
    deltalake reads as nanoseconds and cannot hold outside 1677 to 2262; Spanner's DATE and
    TIMESTAMP cover years 1 to 9999 of the proleptic Gregorian calendar, written and read as they
    are (CORRECTED), never rebased to the Julian one.

    Parquet row groups are flushed at the mirrors' target file size (16 MiB), not 128 MiB: a
    writer holds a row group in the JVM heap, and with 1 MiB values a MERGE's writers ran it out
    (tests/test_wide_rows.py).

    Delta's log replay follows the session's shuffle partitions (``session.base_config``).
    """
    return {
        "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
        "spark.hadoop.parquet.block.size": str(MIRROR_TARGET_FILE_BYTES),
        "spark.sql.parquet.datetimeRebaseModeInWrite": "CORRECTED",
        "spark.sql.parquet.datetimeRebaseModeInRead": "CORRECTED",
        "spark.sql.parquet.int96RebaseModeInWrite": "CORRECTED",
        "spark.sql.parquet.int96RebaseModeInRead": "CORRECTED",
        "spark.sql.streaming.noDataMicroBatches.enabled": "false",
        "spark.sql.streaming.stateStore.valueStateSchemaEvolutionThreshold": str(
            config.max_evolutions_per_variable
        ),
        "spark.sql.streaming.stateStore.maxNumStateSchemaFiles": str(
            config.max_evolutions_per_query
        ),
    }


def read_changes(spark: Any, config: PipelineConfig, starting_version: int | None = None) -> Any:
    """The change log as a stream, from its first version or (a rebased generation) from
    ``starting_version``: the job's one source, whichever operators read it."""
    reader = (
        spark.readStream.format("delta")
        .option("maxFilesPerTrigger", config.max_files_per_trigger)
        .option("maxBytesPerTrigger", f"{config.max_mb_per_trigger}m")
    )
    if starting_version is not None:
        reader = reader.option("startingVersion", starting_version)
    return reader.load(config.changelog_uri)


def start_query(
    spark: Any,
    config: PipelineConfig,
    plan: Plan,
    stats: JobStats,
    log: Logger,
    metrics: PipelineMetrics,
    generation: Generation | None = None,
    lease: Callable[[], None] = lambda: None,
) -> Any:
    """The query of one state generation (``config.checkpoint_uri`` is its folder): a rebased
    one reads from its starting version and loads its seed until its first batch commits."""
    generation = generation or Generation(0, config.checkpoint_uri)
    arguments = (
        plan.shapes,
        plan.deleted_variables,
        plan.guarded_fields,
        int(config.tombstone_ttl_s * 1000),
        legacy_variables(plan.deployment.schemas),
        plan.kept,
    )
    seed = None
    if generation.seed_uri is not None and not generations.has_committed(generation):
        seed = spark.read.parquet(generation.seed_uri).groupBy("table_name", "keys")
    seeded = seed is not None
    log_rows = read_changes(spark, config, _starting_version(config, generation, log))
    if plan.processors:
        processor: ChangeApplier = ChangeApplierWithProcessors(
            plan.processors, *arguments, seeded=seeded
        )
        changes = routed(log_rows, plan.processors)
    else:
        processor = ChangeApplier(*arguments, seeded=seeded)
        changes = log_rows.select(*INPUT_COLUMNS)
    applied = changes.groupBy("table_name", "keys").transformWithState(
        processor,
        job_output_schema(plan.shapes, plan.kept, plan.processors),
        "Update",
        "ProcessingTime",
        initialState=seed,
    )
    writer = (
        applied.writeStream.foreachBatch(
            BatchWriter(config, plan, stats, log, metrics, generation, lease)
        )
        .option("checkpointLocation", config.checkpoint_uri)
        .queryName(config.job_id)
    )
    if config.trigger == "available-now":
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=f"{config.trigger_interval_s} seconds")
    return writer.start()


def _starting_version(config: PipelineConfig, generation: Generation, log: Logger) -> int | None:
    """A rebased generation's own version; otherwise the change log's first commit or Delta's
    initial snapshot (``stream_start``)."""
    if generation.starting_version is not None:
        return generation.starting_version
    start = fresh_start(config.changelog_uri, config.checkpoint_uri)
    log.info("pipeline_stream_start", starting_version=start.version, reason=start.reason)
    return start.version


@contextlib.contextmanager
def listening(spark: Any, metrics: PipelineMetrics) -> Iterator[None]:
    """Spark's query events feed the metrics while the session runs the job's queries."""
    listener = metrics.listener()
    spark.streams.addListener(listener)
    try:
        yield
    finally:
        from py4j.protocol import Py4JError

        _deliver_pending_events(spark)
        with contextlib.suppress(Py4JError, ConnectionError):  # a JVM stopped with the job
            spark.streams.removeListener(listener)


def _deliver_pending_events(spark: Any) -> None:
    """Spark posts a query's last progress after the query ends; delivered once the Python side
    has gone, it logs a Java stack trace on a clean exit. PySpark's own tests drain the listener
    bus the same way (an internal method, reached through py4j)."""
    from py4j.protocol import Py4JError

    context = getattr(spark, "sparkContext", None)
    if context is None:
        return
    with contextlib.suppress(Py4JError, ConnectionError):
        context._jsc.sc().listenerBus().waitUntilEmpty(10_000)


def await_query(
    query: Any,
    stop: threading.Event,
    *interrupts: threading.Event,
    drained: Callable[[], bool] = lambda: False,
) -> BaseException | None:
    """Until the query ends, fails (its error), ``drained`` holds or ``stop`` or one of
    ``interrupts`` is set (stop it). A JVM gone once ``stop`` is set went down with the same
    signal (systemd's default control-group kill reaches every process): a stop, the batch in
    flight replayed next time."""
    from py4j.protocol import Py4JError
    from pyspark.errors import StreamingQueryException

    try:
        while not any(event.is_set() for event in (stop, *interrupts)) and not drained():
            if query.awaitTermination(0.5):
                return None
        query.stop()
        return None
    except StreamingQueryException as error:
        return None if stop.is_set() and _jvm_gone(query) else error
    except (Py4JError, ConnectionError):
        if stop.is_set():
            return None
        raise


def _jvm_gone(query: Any) -> bool:
    """Whether the query's JVM no longer answers."""
    from py4j.protocol import Py4JError

    try:
        query.isActive  # noqa: B018 (a call to the JVM)
    except (Py4JError, ConnectionError):
        return True
    return False
