"""A table that keeps gaining columns, on the real emulator, with the ingest service and the
pipeline running continuously: the job never stops at Spark's evolution limit, it rebases, and
after each step the mirrors equal Spanner at the change log's W. Then the checkpoint is lost and
``python -m pipeline rebase`` seeds state from the mirrors alone."""

from __future__ import annotations

import datetime as dt
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable
from google.cloud import spanner

from emulator.verify import changelog_watermark
from emulator.workload import NEW_COLUMN_KINDS
from ingest.model.timestamps import parse_rfc3339, to_rfc3339
from pipeline import batch_log
from pipeline.catalog import version_holding
from pipeline.columns import mirror_uri
from pipeline.state import cut
from tests.checks import apply_ddl, assert_mirrors_equal, compare_at_watermark
from tests.processes import INGEST_STOP_S, PIPELINE_STOP_S, Pipeline, service_in, wait_until

COLUMNS = 40


@pytest.mark.emulator
def test_forty_new_columns_while_running_rebase_and_never_stop_the_job(
    new_database, tmp_path: Path
) -> None:
    database = new_database("googlesql", accounts=5)
    apply_ddl(database, "CREATE TABLE wide (id INT64 NOT NULL, c0 INT64) PRIMARY KEY (id)")
    with database.batch() as batch:
        batch.insert("wide", ["id", "c0"], [(0, 0)])
    changelog = tmp_path / "changelog"
    service = service_in(tmp_path, database.database_id, None)
    pipeline = Pipeline(
        changelog,
        tmp_path,
        tmp_path / "pipeline.log",
        PIPELINE_MAX_EVOLUTIONS_PER_VARIABLE="3",
    )
    uri = mirror_uri(str(tmp_path / "mirrors"), "wide")
    ingest = service.start()
    job = pipeline.start()
    try:
        service.wait_for("ingest_started", 1, timeout=120, process=ingest)
        for number in range(1, COLUMNS + 1):
            kind, value = NEW_COLUMN_KINDS[number % len(NEW_COLUMN_KINDS)]
            name = f"c{number}"
            apply_ddl(database, f"ALTER TABLE wide ADD COLUMN {name} {kind}")
            with database.batch() as batch:
                batch.insert("wide", ["id", name], [(number, value)])
                batch.update("wide", ["id", name], [(0, value)])  # this column alone
            last_commit = batch.committed
            if number % 4 == 0:  # this one in a deployment of its own
                wait_until(
                    lambda: name in _mirror_columns(uri),  # noqa: B023
                    240,
                    f"the mirror never had {name}",
                    ingest,
                    job,
                )
            if number % 10 == 0:
                landed = _quiesced(changelog, tmp_path, last_commit, ingest, job)
                _, comparisons = compare_at_watermark(
                    database, str(changelog), str(tmp_path / "mirrors"), tables=["wide"]
                )
                assert_mirrors_equal(comparisons, f"after {number} columns (W {landed})")
        rebases = pipeline.count("state_rebased")
        assert rebases >= 2, f"{rebases} rebases"
        assert job.poll() is None, "the job never exits"
        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=PIPELINE_STOP_S) == 0

        # The checkpoint is lost: rebase from the mirrors alone, then go on with changes that
        # carry one column each, so every other value must come from the seed.
        shutil.rmtree(tmp_path / "checkpoint")
        rebased = subprocess.run(
            [sys.executable, "-m", "pipeline", "rebase"],
            env=pipeline.env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert rebased.returncode == 0, rebased.stderr[-3000:]
        assert rebased.stdout.strip().splitlines()[-1].startswith("ok: state generation 1")
        job = pipeline.start()
        with database.batch() as batch:
            batch.update("wide", ["id", "c10"], [(0, "after the loss")])  # a STRING
            batch.delete("wide", spanner.KeySet(keys=[[2]]))
        last_commit = batch.committed
        landed = _quiesced(changelog, tmp_path, last_commit, ingest, job)
        _, comparisons = compare_at_watermark(
            database, str(changelog), str(tmp_path / "mirrors"), tables=["wide"]
        )
        assert_mirrors_equal(comparisons, f"after the checkpoint was lost (W {landed})")
        for process in (job, ingest):
            process.send_signal(signal.SIGTERM)
        assert job.wait(timeout=PIPELINE_STOP_S) == 0
        assert ingest.wait(timeout=INGEST_STOP_S) == 0
    finally:
        job.kill()
        ingest.kill()


def _mirror_columns(uri: str) -> list[str]:
    return DeltaTable(uri).schema().to_arrow().names if DeltaTable.is_deltatable(uri) else []


def _quiesced(changelog: Path, root: Path, last_commit: dt.datetime, *processes: Any) -> str:
    """Once the change log holds the last write and the mirrors' batch log says they equal
    Spanner at a W at or past it: the last write's commit timestamp, the change-log version
    holding it, the mirrors' cut and their W, as text for a failed comparison. The wait reads
    the product's own record of where the mirrors stand (``pipeline.batch_log``), not only a
    version computed from the change log: a wait on the cut alone let a comparison through one
    batch early (emulator/NOTES.md, "A mirror one transaction short at W")."""
    text = last_commit.astimezone(dt.UTC).isoformat()
    target = int(last_commit.timestamp()) * 10**9 + last_commit.microsecond * 1000

    def landed() -> bool:
        watermark = changelog_watermark(str(changelog))
        return watermark is not None and watermark.low_watermark >= target

    wait_until(landed, 180, "the change log never passed the writes", *processes)
    holding = version_holding(str(changelog), to_rfc3339(target))
    assert holding is not None
    seen: list[tuple[cut.Cut, batch_log.AppliedBatch]] = []

    def mirrored() -> bool:
        """The cut first: read every poll, it costs nothing, where the batch log's many small
        files cost a tenth of a CPU-second and more."""
        recorded = cut.read(str(root / "mirrors"))
        if recorded is None or recorded.starting_version <= holding:
            return False
        newest = batch_log.consistent(str(root / "mirrors"))[-1:]
        seen[:] = [(recorded, b) for b in newest]
        return bool(seen) and parse_rfc3339(str(seen[0][1].watermark_text)) >= target

    wait_until(mirrored, 300, "the pipeline never read the last write", *processes)
    passed, at = seen[0]
    return (
        f"{text}, in change-log version {holding}; the mirrors at W {at.watermark_text} "
        f"(generation {at.generation}, batch {at.batch_id}, change-log version "
        f"{at.changelog_version}), their cut {passed}"
    )
