"""The streaming job: change log → transformWithState → MERGE into mirrors, restarted on evolution.

Each start: learn the table shapes from the change log, derive the state schemas, check them
against the recorded ones (refusals stop here, before Spark starts), record them, bring the mirror
tables up to the shapes, undo a failed batch's schema files, start the query. When the processor
meets a table or column the running schemas lack, its batch fails without committing anything;
the job then evolves (an allowed evolution) and restarts on the same checkpoint.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from pipeline.batch_writer import BatchWriter, JobStats
from pipeline.catalog import version_holding
from pipeline.columns import mirror_uri
from pipeline.config import PipelineConfig
from pipeline.deployment import Plan, only_limits, plan_deployment
from pipeline.foreign_commits import TABLE_CHANGED_BEHIND_JOB
from pipeline.history import ensure_history, mirrors_reached
from pipeline.merges import table_version
from pipeline.metrics import PipelineMetrics
from pipeline.mirror import MIRROR_TARGET_FILE_BYTES, ensure_mirror
from pipeline.processor import (
    INPUT_COLUMNS,
    ROW_NOT_APPLICABLE,
    SOURCE_SCHEMA_CHANGED,
    STATE_ROUNDTRIP_MISMATCH,
    ChangeApplier,
)
from pipeline.rebase import rebase_from_the_changelog
from pipeline.state import cut, generations
from pipeline.state.checkpoint import (
    CheckpointLock,
    CheckpointLockLost,
    roll_back_uncommitted_batch,
)
from pipeline.state.compatibility import StateSchemaError
from pipeline.state.generations import Generation
from pipeline.state.variables import legacy_variables
from pipeline.user_processors.feed import routed
from pipeline.user_processors.host import ChangeApplierWithProcessors, job_output_schema
from pipeline.user_processors.outputs import ensure_output, output_uri
from runtime.errors import ReportedError
from runtime.logs import Logger

PYTHON_WORKER_LATE = "Python worker failed to connect back"
"""A Python worker started slower than Spark waits for it (a host whose CPU is busy: seen with one
core kept busy beside the suite); the batch did not commit, so the query starts again on the
same checkpoint, like after the other markers, at most ``max_restarts`` times in a row."""
RESTART_MARKERS = (
    SOURCE_SCHEMA_CHANGED,
    STATE_ROUNDTRIP_MISMATCH,
    "ConcurrentAppendException",
    PYTHON_WORKER_LATE,
)


class PipelineFailed(ReportedError, RuntimeError):
    pass


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
    log_rows = read_changes(spark, config, generation.starting_version)
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


@contextlib.contextmanager
def _listening(spark: Any, metrics: PipelineMetrics) -> Iterator[None]:
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


def _await(
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


def run_pipeline(
    config: PipelineConfig,
    log: Logger,
    stop: threading.Event,
    session_factory: Callable[[], Any],
    drain: threading.Event | None = None,
    metrics: PipelineMetrics | None = None,
) -> JobStats:
    """Run until stopped (continuous) or until the change log is processed (available-now).

    A restart (a schema change, a conflict) counts against ``max_restarts`` only while no batch
    lands between restarts: a long-running job meets many schema changes over its life.

    Setting ``drain`` ends a continuous run once the mirrors hold what the change log held at
    that moment, on the running query (set before a query starts, that query runs
    available-now), so whoever stopped the writers knows the mirrors have caught up (``make
    run``, a planned upgrade).
    """
    drain = drain or threading.Event()
    metrics = metrics or PipelineMetrics()
    stats = JobStats()
    restarts = _Restarts()
    lock = CheckpointLock(
        config.checkpoint_uri, config.lock_stale_s, f"pipeline {config.job_id}", log
    )
    with lock, contextlib.ExitStack() as cleanup:
        session = _LazySession(session_factory, cleanup, metrics)
        while not stop.is_set():
            generation = generations.current(config.checkpoint_uri)
            running = replace(config, checkpoint_uri=generation.uri)
            try:
                plan = plan_deployment(running, log)
            except StateSchemaError as refused:
                _rebase_before_limit(refused, config, session, log)
                stats.rebases += 1
                metrics.rebases.inc()
                continue
            if not plan.shapes:
                if config.trigger == "available-now" or drain.is_set():
                    log.info("pipeline_no_changes", changelog=config.changelog_uri)
                    return stats
                stop.wait(config.trigger_interval_s or 1.0)
                continue
            _prepare(session(), running, plan, log)
            if drain.is_set() and config.trigger != "available-now":
                config, running = _draining(config, log), _draining(running, None)
            query = start_query(
                session(), running, plan, stats, log, metrics, generation, lock.check_held
            )
            drained = _Drain(drain, config, log)
            error = _watch(query, plan, generation, (stop, lock.lost_event), drained, metrics, log)
            if lock.lost:
                raise CheckpointLockLost(f"pipeline {config.job_id} lost its checkpoint's lease")
            if error is None:
                break
            restarts.record(error, stats, config, metrics, log)
    return stats


@dataclass
class _LazySession:
    """The job's Spark session, started at its first need (a job with nothing to do starts
    none) and kept for every query after."""

    factory: Callable[[], Any]
    cleanup: contextlib.ExitStack
    metrics: PipelineMetrics
    spark: Any = None

    def __call__(self) -> Any:
        if self.spark is None:
            self.spark = _session(self.factory, self.cleanup, self.metrics)
        return self.spark


def _draining(config: PipelineConfig, log: Logger | None) -> PipelineConfig:
    """A continuous run turned available-now on the same session: it processes what the change
    log holds, then returns."""
    if log is not None:
        log.info("pipeline_draining")
    return replace(config, trigger="available-now")


@dataclass
class _Drain:
    """Whether a drain asked of a running query is done: the change log's newest version when it
    was asked is wholly in the mirrors (their cut, recorded after each batch's MERGEs; Spark
    runs a batch of no rows to pass versions that add none)."""

    requested: threading.Event
    config: PipelineConfig
    log: Logger
    target: int | None = None

    def __call__(self) -> bool:
        if not self.requested.is_set() or self.config.trigger == "available-now":
            return False
        if self.target is None:
            self.target = table_version(self.config.changelog_uri)
            self.log.info("pipeline_draining", through_version=self.target)
        reached = cut.read(self.config.mirror_root)
        return reached is not None and reached.starting_version > self.target


def _rebase_before_limit(
    refused: StateSchemaError, config: PipelineConfig, session: Callable[[], Any], log: Logger
) -> None:
    """A state schema change that only Spark's evolution limits refuse: a rebase from the
    change log, unless processors keep state a rebase would start over (then the job stops)."""
    if not only_limits(refused):
        raise refused
    if config.processors:
        raise PipelineFailed(
            f"{_first_line(refused)}; a rebase would start the processors' state "
            "over, so the job stops: raise the limit (max_evolutions_per_variable, "
            "max_evolutions_per_query) or run the processors on a checkpoint of "
            "their own"
        ) from refused
    reason = f"before Spark's limit: {_first_line(refused)}"
    rebase_from_the_changelog(session(), config, log, reason)


def _watch(
    query: Any,
    plan: Plan,
    generation: Generation,
    interrupts: tuple[threading.Event, ...],
    drained: Callable[[], bool],
    metrics: PipelineMetrics,
    log: Logger,
) -> BaseException | None:
    """A started query until it ends, fails (its error) or is interrupted."""
    metrics.query_started(plan.deployment.number)
    log.info(
        "pipeline_query_started",
        tables=sorted(plan.shapes),
        generation=generation.number,
        deployment=plan.deployment.number,
        guarded_fields={k: list(v) for k, v in plan.guarded_fields.items()},
    )
    error = _await(query, *interrupts, drained=drained)
    metrics.query_ended()
    return error


@dataclass(slots=True)
class _Restarts:
    """Restarts count against ``max_restarts`` only while no batch lands between them."""

    in_a_row: int = 0
    batches_at_restart: int = 0

    def record(
        self,
        error: BaseException,
        stats: JobStats,
        config: PipelineConfig,
        metrics: PipelineMetrics,
        log: Logger,
    ) -> None:
        """Count a restart on the same checkpoint; PipelineFailed when the query must not."""
        if stats.batches > self.batches_at_restart:
            self.in_a_row = 0
        reason = _restart_reason(error, self.in_a_row, config)
        stats.restarts += 1
        metrics.restarts.labels(reason).inc()
        self.in_a_row, self.batches_at_restart = self.in_a_row + 1, stats.batches
        log.warning(
            "pipeline_query_restarting",
            reason=reason,
            restarts=stats.restarts,
            restarts_in_a_row=self.in_a_row,
        )


def _session(
    session_factory: Callable[[], Any], cleanup: contextlib.ExitStack, metrics: PipelineMetrics
) -> Any:
    """The job's Spark session, started on first need and feeding the metrics."""
    spark = session_factory()
    cleanup.enter_context(_listening(spark, metrics))
    return spark


def _prepare(spark: Any, config: PipelineConfig, plan: Plan, log: Logger) -> None:
    """Before a query starts: every mirror, history and processor output exists with its
    shape; a failed batch's state schema files are undone."""
    shapes, histories = plan.shapes, plan.histories
    for processor in plan.processors:
        uri = output_uri(config.processor_root, processor.name)
        ensure_output(uri, processor.output, processor.name, log)
    for table, shape in shapes.items():
        ensure_mirror(spark, mirror_uri(config.mirror_root, table), shape, log)
    if histories is not None:
        for table in sorted(histories.of(shapes)):
            ensure_history(
                spark,
                histories.uri(table),
                shapes[table],
                mirror_uri(config.mirror_root, table),
                lambda: mirrors_reached(config.changelog_uri, config.mirror_root),
                log,
            )
    undone = roll_back_uncommitted_batch(config.checkpoint_uri)
    if undone:
        log.warning("uncommitted_batch_schema_files_removed", files=len(undone))


STATE_UNREADABLE_MARKERS = ("CANNOT_LOAD_STATE_STORE", "CANNOT_READ_STATE_STORE")


def _restart_reason(error: BaseException, in_a_row: int, config: PipelineConfig) -> str:
    """Why a failed query restarts on the same checkpoint; PipelineFailed when it must not."""
    unreadable = _unreadable_state(error, config) or _changelog_files_gone(error, config)
    if unreadable is not None:
        raise PipelineFailed(unreadable) from error
    reason = next((m for m in RESTART_MARKERS if m in str(error)), None)
    if reason is None or in_a_row >= config.max_restarts:
        raise PipelineFailed(_with_changelog_version(_first_line(error), config)) from error
    return reason


def _unreadable_state(error: BaseException, config: PipelineConfig) -> str | None:
    """The line for a checkpoint whose state Spark cannot load (a truncated or corrupt RocksDB
    file): restarting reads the same files, and a rebase from the mirrors is the way out."""
    text = str(error)
    marker = next((m for m in STATE_UNREADABLE_MARKERS if m in text), None)
    if marker is None:
        return None
    causes = [line.strip() for line in text.splitlines() if line.strip().startswith("Caused by:")]
    cause = causes[-1].removeprefix("Caused by:").strip() if causes else marker
    return (
        f"{marker}: the pipeline checkpoint {config.checkpoint_uri} cannot be read ({cause}); "
        "restarting reads the same files: stop the job, run `python -m pipeline rebase` with "
        "the same change log, mirrors and checkpoint (a new state generation seeded from the "
        "mirrors), then start the job again (docs/operations.md, Rebase)"
    )


CHANGELOG_FILE_GONE = "FAILED_READ_FILE.FILE_NOT_EXIST"


def _changelog_files_gone(error: BaseException, config: PipelineConfig) -> str | None:
    """The line for a change-log data file the job had still to read and that is gone: a VACUUM
    with a retention shorter than the job's stop removed it after the ingest's compaction had
    rewritten its rows (the stream reads the files of each version, not the compacted ones).
    Restarting reads the same versions; the rows are still in the change log's newest version."""
    text = str(error)
    where = config.changelog_uri.split("://", 1)[-1].rstrip("/")  # s3:// reads as s3a://
    if CHANGELOG_FILE_GONE not in text or where not in text:
        return None
    return (
        f"CHANGELOG_FILES_REMOVED: a data file of {config.changelog_uri} that the job has not "
        "read yet is gone (a VACUUM with a retention shorter than the job's stop); restarting "
        "reads the same versions: stop the job, delete its checkpoint and its mirror root, and "
        "start it again (it reads the change log whole), and keep the change log's VACUUM "
        "retention above the longest stop (docs/operations.md)"
    )


def _with_changelog_version(line: str, config: PipelineConfig) -> str:
    """A row the job cannot apply, located in the change log for whoever must resolve it."""
    found = re.search(rf"{ROW_NOT_APPLICABLE}: .*?, commit (\S+),", line)
    if found is None:
        return line
    version = version_holding(config.changelog_uri, found.group(1))
    start = line.index(ROW_NOT_APPLICABLE)
    return f"{line[start:]} (change-log version {version}); the job stops: retrying cannot help"


def _first_line(error: BaseException) -> str:
    """The line an operator needs from a Spark failure: the cause, not the Java stack."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for marker in (*RESTART_MARKERS, ROW_NOT_APPLICABLE, TABLE_CHANGED_BEHIND_JOB):
        for line in lines:
            if marker in line:
                return line[line.index(marker) :]
    causes = [line for line in lines if re.match(r"^[\w.]+(Error|Exception): ", line)]
    return causes[-1] if causes else (lines[0] if lines else type(error).__name__)
