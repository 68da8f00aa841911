"""The whole product on an object store (MinIO on loopback, ``s3://``), configured only by URIs
and the usual AWS variables, through a proxy that drops connections, holds answers past the
client's timeout and loses the answers to writes the store accepted.

On the way: kill -9 of the ingest service (a second one, started by mistake, stood by and takes
over); a second pipeline started by mistake is refused; a pipeline paused past its lease is
replaced and, resumed, stops without writing; its replacement is killed with -9 after its first
batch and a last run catches up. At the end every committed transaction is in the change log
once and the mirrors equal Spanner at W.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.checks import (
    SEED_TRANSACTIONS,
    accounts_written_after_start,
    assert_mirrors_equal,
    assert_mirrors_hold,
    compare_at_watermark,
    crash_seed,
)
from tests.delta_checks import assert_change_log_invariants
from tests.object_stores import minio
from tests.processes import (
    BANKING_TABLES,
    Pipeline,
    Service,
    background_workload,
    wait_until,
    wait_until_landed,
)
from tests.store_faults import FaultRates, StoreFaults

FAULTS = FaultRates(drop=0.01, delay=0.004, lost_answer=0.02, delay_s=6.0)
"""Per request; a held answer outlasts the ingest's 5 s client timeout (``AWS_TIMEOUT``)."""
LOCK_STALE_S = 20.0
"""The pipeline trusts its lease for three quarters of it (15 s) and renews every quarter (5 s):
a renewal whose answer the proxy held past the 5 s timeout is retried by the store's client, and
two such in a row fit. At 8 s (6 s of trust) one held answer and a busy start of Spark's query
ran the first pipeline's lease out before its first batch (CI, 2026-11-26)."""
INGEST_LEASE_S = "20"
"""Longer than a stall of two held answers (12 s), so the standby takes over only after the kill;
no longer, as the standby reads again everything from the killed writer's W (under CI's load
its reader read the emulator's churning partitions at a third of real time)."""


def lease_age(checkpoint_uri: str) -> float | None:
    """Seconds since the pipeline lease's last heartbeat, or None without a lease."""
    from runtime.conditional import ConditionalObject

    found = ConditionalObject(checkpoint_uri, "_job_lock.json").read()
    return None if found is None else time.time() - json.loads(found.data)["heartbeat"]


@pytest.mark.emulator
def test_on_s3_through_faults_kills_and_replicas_started_by_mistake_nothing_is_lost(
    new_database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed, rng = crash_seed()
    with minio(tmp_path) as store, StoreFaults(store.endpoint, FAULTS, seed) as proxy:
        for name, value in store.environment().items():
            monkeypatch.setenv(name, value)
        through_proxy = {**store.environment(proxy.address), "AWS_TIMEOUT": "5s"}
        database, start = accounts_written_after_start(new_database)
        changelog, root = store.uri("cdc/changelog"), store.uri("cdc")

        def ingest(name: str) -> Service:
            log = tmp_path / f"{name}.log"
            return Service(
                database.database_id,
                changelog,
                log,
                start,
                INGEST_LEASE_S=INGEST_LEASE_S,
                **through_proxy,
            )

        def pipeline(name: str) -> Pipeline:
            return Pipeline(
                changelog,
                root,
                tmp_path / f"{name}.log",
                PIPELINE_LOCK_STALE_S=str(LOCK_STALE_S),
                **through_proxy,
            )

        first_ingest, standby_ingest = ingest("ingest-1"), ingest("ingest-2")
        first, second, replacement = (
            pipeline(n) for n in ("pipeline-1", "pipeline-2", "pipeline-3")
        )
        processes = [first_ingest.start()]
        stops: list[threading.Event] = []
        try:
            first_ingest.wait_for("delta_commit", 1, timeout=120, process=processes[0])
            # Writes go on until the standby has taken over: it lands at least a lease's worth
            # of them after the pipeline is paused, so the replacement has changes to apply.
            workload, stop_workload, committed = background_workload(database, 900, 5, seed)
            stops.append(stop_workload)
            processes.append(standby_ingest.start())
            standby_ingest.wait_for("standby_waiting_for_lease", 1, process=processes[1])
            running = first.start()
            processes.append(running)
            first.wait_for("pipeline_batch", 1, timeout=300, process=running)

            mistaken = second.start()
            assert mistaken.wait(timeout=120) == 2, "a second pipeline ran on a held checkpoint"
            assert "is in use by pipeline" in second.log.read_text()

            time.sleep(rng.uniform(0, 4))
            processes[0].kill()
            processes[0].wait()
            standby_ingest.wait_for("writer_lease_taken_over", 1, timeout=120)
            stop_workload.set()

            running.send_signal(signal.SIGSTOP)
            batches_when_paused = first.count("pipeline_batch")
            wait_until(
                lambda: (lease_age(f"{root}/checkpoint") or 0) > LOCK_STALE_S + 1,
                120,
                "the paused pipeline's lease running out",
            )
            taking_over = replacement.start()
            processes.append(taking_over)
            replacement.wait_for("pipeline_query_started", 1, timeout=300, process=taking_over)
            running.send_signal(signal.SIGCONT)
            assert running.wait(timeout=120) == 1, "the paused pipeline went on after resuming"
            assert first.count("pipeline_batch") == batches_when_paused
            assert any(e["event"] == "checkpoint_lock_lost" for e in first.events())

            replacement.wait_for("pipeline_batch", 1, timeout=300, process=taking_over)
            time.sleep(rng.uniform(0, 4))
            taking_over.kill()
            taking_over.wait()

            workload.join()
            writer = processes[1]
            if writer.poll() == 1:
                # A stall outlived the lease before the kill: the killed writer's last commit
                # landed after the standby's look, and the standby was fenced. An orchestrator
                # starts it again; so does the test.
                assert "was committed by another process" in standby_ingest.log.read_text()
                restarted = ingest("ingest-3")
                writer = restarted.start()
                processes.append(writer)
            wait_until_landed(changelog, SEED_TRANSACTIONS + len(committed), timeout=300)
            writer.send_signal(signal.SIGTERM)
            assert writer.wait(timeout=60) == 0
            catch_up = replacement.start("--trigger", "available-now")
            processes.append(catch_up)
            assert catch_up.wait(timeout=300) == 0, replacement.log.read_text()[-3000:]
        finally:
            for stop in stops:
                stop.set()
            for process in processes:
                process.kill()
        counts = proxy.counts

        assert counts["drop"] and counts["delay"] and counts["lost_answer"], counts
        versions = assert_change_log_invariants(changelog, committed, unlisted=1)
        killed = next(e["owner"] for e in first_ingest.events() if e["event"] == "ingest_started")
        writers = [v.checkpoint.owner for v in versions if v.checkpoint]
        handover = next(i for i, owner in enumerate(writers) if owner != killed)
        assert killed not in writers[handover:], "the first writer wrote after another took over"
        _, comparisons = compare_at_watermark(database, changelog, f"{root}/mirrors")
        assert_mirrors_equal(comparisons, f"seed {seed}, faults {dict(counts)}")
        assert_mirrors_hold(comparisons, BANKING_TABLES)
