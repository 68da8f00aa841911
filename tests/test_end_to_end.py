"""The whole product on the real emulator: ingest service → change log → pipeline → mirrors,
histories and the example processors.

The promises checked: after the pipeline has processed the change log up to version v, every
mirror table equals its Spanner table read at exactly W(v), through a Spanner ADD COLUMN mid-run,
a kill -9 of the pipeline (its restart deploys the processors' v2) and a STRING column turned
BYTES. Both processes' ``/metrics`` are scraped on the way and must move with the workload and
agree with the change log. Each example processor's output equals a plain recomputation from
Spanner read at every commit timestamp; their v3 is refused with one line. At 50 random times
T the histories read as of T equal Spanner read at T, and the mirrors read as of T equal Spanner
at the batch W they name.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from google.api_core import exceptions as api_exceptions
from tenacity import (
    retry,
    retry_if_exception,
    retry_if_exception_type,
    stop_after_attempt,
    wait_random,
)

from emulator.server import free_port
from emulator.verify import changelog_watermark, mirror_rows
from ingest.model.timestamps import to_rfc3339
from pipeline.columns import mirror_uri
from tests.beyond_mirrors import (
    assert_examples_equal_recomputed,
    assert_reads_as_of_equal_spanner,
    check_state_schema,
    spanner_history,
    statuses_as_bytes,
)
from tests.checks import (
    SEED_TRANSACTIONS,
    accounts_written_after_start,
    apply_ddl,
    assert_mirrors_equal,
    compare_at_watermark,
    crash_seed,
)
from tests.processes import (
    INGEST_STOP_S,
    PIPELINE_STOP_S,
    Pipeline,
    background_workload,
    service_in,
    wait_until_landed,
)
from tests.scrapes import Samples, check_ingest, check_pipeline, scrape, scrape_until, value

ALL_KINDS = dict(transfer_weight=0.6, all_types_weight=0.3, cleanup_weight=0.1)
EXAMPLES_V1 = "examples.bank:RunningBalance,examples.status:StatusDurations"
EXAMPLES_V2 = "examples.bank:RunningBalanceV2,examples.status:StatusDurationsV2"
EXAMPLES_V3 = (
    (
        "examples.bank:RunningBalanceV3,examples.status:StatusDurationsV2",
        "state variable 'running_balance.account', field 'balance': rename",
    ),
    (
        "examples.bank:RunningBalanceV2,examples.status:StatusDurationsV3",
        "state variable 'status_durations.totals', field 'entries': map key change",
    ),
)


@retry(
    retry=retry_if_exception_type((api_exceptions.Aborted, api_exceptions.NotFound)),
    stop=stop_after_attempt(20),
    wait=wait_random(0.05, 0.5),
)
def name_accounts(database, accounts: range) -> None:
    """Blind writes of the new column (the emulator aborts a DML transaction that overlaps the
    workload's with NotFound, which run_in_transaction does not retry)."""
    with database.batch() as batch:
        batch.update("accounts", ["account_id", "nickname"], [(i, f"nick-{i}") for i in accounts])


@retry(
    retry=retry_if_exception(
        lambda e: isinstance(e, api_exceptions.FailedPrecondition) and "concurrent" in str(e)
    ),
    stop=stop_after_attempt(50),
    wait=wait_random(0.05, 0.3),
)
def add_column(database, ddl: str) -> None:
    """The emulator refuses DDL while any read-write transaction runs; the workload's are short."""
    apply_ddl(database, ddl)


def scrape_both(
    ingest_port: int, pipeline_port: int, changelog: Path, after: list[Samples] | None = None
) -> list[Samples]:
    """Both processes' ``/metrics`` once a micro-batch with rows is counted (after ``after``'s
    ones: then what landed and what was applied must have moved on), checked against the change
    log."""

    def applied_more(samples: Samples) -> bool:
        return all(
            (value(samples, name) or 0) > (value(after[1], name) or 0 if after else 0)
            for name in ("pipeline_newest_commit_applied_seconds", "pipeline_batches_total")
        )

    pipeline = scrape_until(pipeline_port, applied_more, timeout=300)
    check_pipeline(pipeline, changelog)
    ingest = scrape(ingest_port)
    check_ingest(ingest, changelog)
    if after:
        for name in ("ingest_transactions_landed_total", "ingest_low_watermark_seconds"):
            assert (value(ingest, name) or 0) > (value(after[0], name) or 0), name
        # A batch after a query restart was seen reporting no input rows (Spark's progress).
        name = "pipeline_input_rows_total"
        assert (value(pipeline, name) or 0) >= (value(after[1], name) or 0), name
    return [ingest, pipeline]


@pytest.mark.emulator
def test_mirrors_equal_spanner_at_the_watermark_through_add_column_and_kill_9(
    new_database, tmp_path: Path
) -> None:
    seed, rng = crash_seed()
    database, start = accounts_written_after_start(new_database)
    changelog = tmp_path / "changelog"
    ingest_port, pipeline_port = free_port(), free_port()
    ingest = service_in(
        tmp_path,
        database.database_id,
        start,
        INGEST_HEALTH_PORT=str(ingest_port),
    )
    pipeline = Pipeline(
        changelog,
        tmp_path,
        tmp_path / "pipeline.log",
        PIPELINE_METRICS_PORT=str(pipeline_port),
        PIPELINE_HISTORY_TABLES="*",
        PIPELINE_HISTORY_ROOT=str(tmp_path / "history"),
        PIPELINE_PROCESSORS=EXAMPLES_V1,
        PIPELINE_PROCESSOR_ROOT=str(tmp_path / "processors"),
    )
    ingest_process = ingest.start()
    running = pipeline.start()
    try:
        pipeline.wait_for("pipeline_batch", 1, timeout=300, process=running)
        workload, _, committed = background_workload(
            database, 45, 10, seed, least_transactions=300, weights=ALL_KINDS
        )
        scrapes = scrape_both(ingest_port, pipeline_port, changelog)
        time.sleep(rng.uniform(2, 6))
        add_column(database, "ALTER TABLE accounts ADD COLUMN nickname STRING(MAX)")
        name_accounts(database, range(0, 10))
        pipeline.wait_for(
            "pipeline_query_started",
            1,
            timeout=180,
            process=running,
            where=lambda e: "image.nickname" in e["guarded_fields"].get("entry_accounts", ()),
        )
        batches_before = pipeline.count("pipeline_batch")
        pipeline.wait_for("pipeline_batch", batches_before + 1, timeout=300, process=running)
        scrapes += scrape_both(ingest_port, pipeline_port, changelog, after=scrapes)
        schema_restarts = {"reason": "SOURCE_SCHEMA_CHANGED"}
        scraped_restarts = value(scrapes[3], "pipeline_query_restarts_total", **schema_restarts)
        assert scraped_restarts and scraped_restarts >= 1, f"seed {seed}"
        time.sleep(rng.uniform(0, 3))
        running.kill()
        running.wait()
        starts = pipeline.count("pipeline_query_started")
        pipeline.env["PIPELINE_PROCESSORS"] = EXAMPLES_V2
        running = pipeline.start()
        pipeline.wait_for("pipeline_query_started", starts + 1, timeout=300, process=running)
        name_accounts(database, range(10, 20))
        workload.join()
        add_column(database, "ALTER TABLE all_types ALTER COLUMN col_string BYTES(MAX)")
        statuses_as_bytes(database)
        own = SEED_TRANSACTIONS + 3  # the two naming transactions, the statuses as bytes
        wait_until_landed(
            changelog, len(committed) + own, timeout=120, service=ingest, committed=committed
        )
        # SIGTERM to each process group, as tini -g and job control send it: a clean stop
        os.killpg(ingest_process.pid, signal.SIGTERM)
        assert ingest_process.wait(timeout=INGEST_STOP_S) == 0
        os.killpg(running.pid, signal.SIGTERM)
        assert running.wait(timeout=PIPELINE_STOP_S) == 0, pipeline.log.read_text()[-3000:]
        catch_up = pipeline.start("--trigger", "available-now")
        assert catch_up.wait(timeout=300) == 0, pipeline.log.read_text()[-3000:]
    finally:
        for process in (ingest_process, running):
            process.kill()
    shapes, comparisons = compare_at_watermark(database, str(changelog), str(tmp_path / "mirrors"))
    assert set(shapes) == {"accounts", "transfers", "all_types"}, f"seed {seed}"
    assert shapes["accounts"].column("nickname") is not None, f"seed {seed}"
    assert_mirrors_equal(comparisons, f"seed {seed}")
    watermark = changelog_watermark(str(changelog))
    assert watermark is not None
    accounts = mirror_rows(mirror_uri(str(tmp_path / "mirrors"), "accounts"), shapes["accounts"], 0)
    named = {key for key, row in accounts.items() if row["nickname"] is not None}
    assert {(i,) for i in range(20)} <= named, f"seed {seed}: named accounts {sorted(named)}"
    assert len(committed) >= 300 and comparisons[0].mirror_rows > 0
    batches = [e for e in pipeline.events() if e["event"] == "pipeline_batch" and e["rows"]]
    assert all(e["newest_commit"] <= to_rfc3339(watermark.low_watermark) for e in batches)
    restarts = [e for e in pipeline.events() if e["event"] == "pipeline_query_restarting"]
    assert any(e["reason"] == "SOURCE_SCHEMA_CHANGED" for e in restarts), restarts

    for breaking, refusal in EXAMPLES_V3:
        checked = check_state_schema(pipeline.env, breaking)
        assert checked.returncode == 2, checked.stdout
        lines = checked.stderr.strip().splitlines()
        assert len(lines) == 1 and refusal in lines[0], checked.stderr
    commits = spanner_history(database, str(changelog), shapes)
    assert_examples_equal_recomputed(tmp_path / "processors", commits, f"seed {seed}")
    assert_reads_as_of_equal_spanner(
        database, str(changelog), tmp_path, shapes, rng, f"seed {seed}"
    )
