"""The streaming job's life: the deployment gate, the tables, the query, its restarts.

Each start: learn the table shapes from the change log, derive the state schemas, check them
against the recorded ones (refusals stop here, before Spark starts), record them, bring the mirror
tables up to the shapes, undo a failed batch's schema files, start the query (``query``). When
the processor meets a table or column the running schemas lack, its batch fails without
committing anything; the job then evolves (an allowed evolution) and restarts on the same
checkpoint (``restarts`` says which failures restart it).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from pipeline.batch_writer import JobStats
from pipeline.columns import mirror_uri
from pipeline.config import PipelineConfig
from pipeline.deployment import Plan, only_limits, plan_deployment
from pipeline.history import ensure_history, mirrors_reached
from pipeline.merges import table_version
from pipeline.metrics import PipelineMetrics
from pipeline.mirror import ensure_mirror
from pipeline.query import await_query, listening, start_query
from pipeline.rebase import rebase_from_the_changelog
from pipeline.restarts import PipelineFailed, Restarts, first_line
from pipeline.state import cut, generations
from pipeline.state.checkpoint import (
    CheckpointLock,
    CheckpointLockLost,
    roll_back_uncommitted_batch,
)
from pipeline.state.compatibility import StateSchemaError
from pipeline.state.generations import Generation
from pipeline.user_processors.outputs import ensure_output, output_uri
from runtime.logs import Logger


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
    restarts = Restarts()
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
            f"{first_line(refused)}; a rebase would start the processors' state "
            "over, so the job stops: raise the limit (max_evolutions_per_variable, "
            "max_evolutions_per_query) or run the processors on a checkpoint of "
            "their own"
        ) from refused
    reason = f"before Spark's limit: {first_line(refused)}"
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
    error = await_query(query, *interrupts, drained=drained)
    metrics.query_ended()
    return error


def _session(
    session_factory: Callable[[], Any], cleanup: contextlib.ExitStack, metrics: PipelineMetrics
) -> Any:
    """The job's Spark session, started on first need and feeding the metrics."""
    spark = session_factory()
    cleanup.enter_context(listening(spark, metrics))
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
