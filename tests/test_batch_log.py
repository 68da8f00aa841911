"""The batch log's order after a lost checkpoint: a rebase then numbers its generation from 1
again, below the generations before it, and a read as of a time must still take the newest batch
at or before it and the mirror versions it left (``pipeline.batch_log``, ``pipeline.as_of``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import deltalake
import pyarrow as pa
import pytest
from deltalake import write_deltalake
from deltalake.exceptions import TableNotFoundError

from pipeline import batch_log
from pipeline.as_of import history_as_of, mirrors_as_of
from pipeline.batch_log import AppliedBatch
from pipeline.columns import mirror_uri
from pipeline.history import Histories
from runtime.logs import null_logger

START = "2026-11-27T10:00:00.000000000Z"


def at(second: int) -> str:
    return f"2026-11-27T10:00:{second:02d}.000000000Z"


def test_a_generation_numbered_again_after_a_lost_checkpoint_reads_as_of_its_own_batches(
    tmp_path: Path,
) -> None:
    root = str(tmp_path / "mirrors")
    uri = mirror_uri(root, "accounts")
    landed = [
        # (generation, batch, change-log version, W second, the mirror's value after it)
        (3, 7, 10, 10, "before the loss"),
        (1, 0, 12, 12, "rebased"),  # the checkpoint was lost: generation 1 again
        (1, 1, 13, 13, "after"),
    ]
    for version, (generation, batch_id, changelog_version, second, value) in enumerate(landed):
        rows = pa.table({"account_id": [1], "owner": [value]})
        write_deltalake(uri, rows, mode="overwrite" if version else "error")
        applied = AppliedBatch(
            batch_id, generation, changelog_version, at(second), True, START, {"accounts": version}
        )
        batch_log.record(root, applied, f"job:checkpoint-{generation}", null_logger())

    assert [(b.generation, b.batch_id) for b in batch_log.read(root)] == [(3, 7), (1, 0), (1, 1)]
    for second, expected, consistent_at in [(11, "before the loss", 10), (30, "after", 13)]:
        read = mirrors_as_of(root, at(second))
        assert read.consistent_at == at(consistent_at)
        assert read.tables["accounts"].column("owner").to_pylist() == [expected]

    # the newest batch bounds what the histories may answer: T13, not the older generation's T10
    histories = Histories(str(tmp_path / "histories"), frozenset({"accounts"}))
    refused = _refusal(lambda: history_as_of(histories, root, at(20), ["accounts"]))
    assert "newest consistent batch's W " + at(13) in refused


def test_a_batch_log_created_after_the_commit_looked_holds_the_batch_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch's commit looked for the log and found none; before it wrote, an earlier attempt
    of the same commit (whose answer was lost) created the log with the batch. The write must
    fail and look again, not append the batch a second time."""
    root = str(tmp_path / "mirrors")
    applied = AppliedBatch(0, 1, 5, at(5), True, START, {"accounts": 0})
    look = deltalake.DeltaTable
    looked: list[str] = []

    def created_after_the_look(uri: str, *args: Any, **kwargs: Any) -> deltalake.DeltaTable:
        if looked:
            return look(uri, *args, **kwargs)
        looked.append(uri)
        batch_log.record(root, applied, "job:checkpoint-1", null_logger())
        raise TableNotFoundError(f"no table at {uri} (as the first look found)")

    monkeypatch.setattr(deltalake, "DeltaTable", created_after_the_look)
    batch_log.record(root, applied, "job:checkpoint-1", null_logger())
    monkeypatch.undo()
    assert looked, "the look was not made"
    assert [(b.generation, b.batch_id) for b in batch_log.read(root)] == [(1, 0)]


def _refusal(read: Callable[[], object]) -> str:
    try:
        read()
    except ValueError as error:
        return str(error)
    raise AssertionError("the read was not refused")
