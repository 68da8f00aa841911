"""A rebase: a new state generation seeded from the mirrors at their cut, with no replay of history.

Taken automatically when the next state schema change would pass Spark's evolution limits (the
job would otherwise stop for good), and on demand (``python -m pipeline rebase``): after the
checkpoint was lost or corrupted, or to change the state layout. The new generation's schema
registry starts empty, so its evolution counts start from zero; its stream starts at the first
change-log version the mirrors do not wholly hold (``pipeline.state.cut``); its first batch loads
the seed as initial state. The old generation is kept until the new one has committed a batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from deltalake import DeltaTable

from ingest.contract.changelog import newest_checkpoint
from ingest.model.timestamps import to_rfc3339
from pipeline.config import PipelineConfig
from pipeline.shapes import TableShape
from pipeline.state import cut, generations
from pipeline.state.checkpoint import committed_batches
from pipeline.state.generations import Generation
from pipeline.state.seed import SeedRefused, write_seed
from runtime.errors import BadInput
from runtime.logs import Logger


class RebaseRefused(BadInput, RuntimeError):
    """No rebase can be taken; the message says why and what to do."""


def starting_version(config: PipelineConfig, running: Generation) -> int:
    """The first change-log version the mirrors do not wholly hold: the cut recorded beside
    them, else the running generation's last committed batch, else where the running generation
    started (it never committed a batch: a job killed before its first one, or stopped by a
    limit before it). Every mirror row carries its position, so starting early only reads again
    what the seed already holds."""
    recorded = cut.read(config.mirror_root)
    if recorded is not None:
        return recorded.starting_version
    batches = committed_batches(running.uri)
    offset = cut.batch_end_offset(running.uri, max(batches)) if batches else None
    if offset is None:
        return running.starting_version or 0
    return cut.next_version(offset)


def cut_position(changelog_uri: str, version: int) -> tuple[str, str, str, int]:
    """A position after every row of the change log's versions before ``version``: what a
    mirror row written before mirrors kept positions is known to hold at most."""
    if version == 0:
        return ("", "", "", 0)
    newest = newest_checkpoint(DeltaTable(changelog_uri, version=version - 1))
    if newest is None:
        return ("", "", "", 0)
    watermark = to_rfc3339(newest[1].resume_point.low_watermark)
    return (watermark, "\U0010ffff", "9" * 32, 2**31 - 1)


def rebase(
    spark: Any,
    config: PipelineConfig,
    shapes: dict[str, TableShape],
    log: Logger,
    reason: str,
) -> Generation:
    """Seed the next generation from the mirrors and make it current; the mirrors must already
    have every column of ``shapes`` (``ensure_mirror``)."""
    running = generations.current(config.checkpoint_uri)
    start = starting_version(config, running)
    number = running.number + 1
    uri = generations.generation_uri(config.checkpoint_uri, number)
    generations.retire(config.checkpoint_uri, number)  # a crashed attempt's leftovers
    seed_uri = f"{uri.rstrip('/')}/_seed"
    position = cut_position(config.changelog_uri, start)
    try:
        keys = write_seed(spark, config.mirror_root, shapes, seed_uri, position)
    except SeedRefused as refused:
        raise RebaseRefused(f"rebase refused: {refused}") from None
    following = Generation(number, uri, start, seed_uri, reason, position[0])
    generations.make_current(config.checkpoint_uri, following)
    log.warning(
        "state_rebased",
        generation=number,
        previous_generation=running.number,
        starting_version=start,
        cut=position[0] or None,
        keys=keys,
        reason=reason,
    )
    return following


def rebase_on_demand(
    config: PipelineConfig, log: Logger, session_factory: Callable[[], Any], reason: str
) -> Generation:
    """``python -m pipeline rebase``: under the job's lock (the job must not run), the same
    rebase as the job's own (``rebase_from_the_changelog``)."""
    from pipeline.state.checkpoint import CheckpointLock

    if config.processors:
        raise BadInput(
            "rebase: the job runs user processors, whose state a rebase cannot carry over "
            "(it seeds state from the mirrors only); run them on a checkpoint of their own"
        )
    refuse_without_own_cut(config)
    description = f"rebase {config.job_id}"
    lock = CheckpointLock(config.checkpoint_uri, config.lock_stale_s, description, log)
    with lock:
        return rebase_from_the_changelog(session_factory(), config, log, reason)


def refuse_without_own_cut(config: PipelineConfig) -> None:
    """A rebase on demand seeds from mirrors this change log's job wrote: a root holding no
    cut (a typo, a missing mount, an empty folder) or another change log's cut has nothing to
    seed from, and a rebase there would start the state over from nothing. Checked before the
    lock, so a refusal changes nothing."""
    recorded = cut.read(config.mirror_root)
    if recorded is None:
        raise RebaseRefused(
            f"rebase refused: no {cut.CUT_FILE} under the mirror root {config.mirror_root!r}, "
            "so no job of this change log wrote mirrors there (check --mirrors); nothing was "
            "changed"
        )
    own = cut.changelog_id(config.changelog_uri)
    if recorded.changelog_id and recorded.changelog_id != own:
        raise RebaseRefused(
            f"rebase refused: the mirrors under {config.mirror_root!r} belong to change log "
            f"{recorded.changelog_id}, not to {config.changelog_uri!r} ({own}); nothing was "
            "changed"
        )


def rebase_from_the_changelog(
    spark: Any, config: PipelineConfig, log: Logger, reason: str
) -> Generation:
    """Bring the mirrors to the change log's table shapes, then seed the next generation from
    them."""
    from pipeline.catalog import discover_shapes
    from pipeline.columns import mirror_uri
    from pipeline.mirror import ensure_mirror

    shapes = discover_shapes(config.changelog_uri)
    if not shapes:
        raise RebaseRefused("rebase refused: the change log holds no table yet")
    for table, shape in shapes.items():
        ensure_mirror(spark, mirror_uri(config.mirror_root, table), shape, log)
    return rebase(spark, config, shapes, log, reason)


def retire_replaced(running: Generation, log: Logger) -> None:
    """Remove the generations before ``running`` once it has committed a batch."""
    if running.number == 0 or not generations.has_committed(running):
        return
    root = generations.root_of(running)
    removed = [
        path for number in range(running.number) for path in generations.retire(root, number)
    ]
    if removed:
        log.info("state_generation_retired", generation=running.number, removed=len(removed))
