"""A new job's start position is durable before anything is read (real emulator, real service).

Without it, a job started at "now" and killed before its first commit restarted at a new "now",
silently skipping every transaction committed in between.
"""

from __future__ import annotations

import functools
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable
from deltalake.exceptions import TableNotFoundError

from emulator.verify import latest_checkpoint
from emulator.workload import CommittedTransaction
from ingest.contract.changelog import SCHEMA_ROW
from ingest.model.timestamps import Nanos, parse_rfc3339, to_rfc3339
from tests.checks import crash_seed
from tests.delta_checks import assert_change_log_invariants
from tests.processes import (
    INGEST_STOP_S,
    background_workload,
    service_in,
    wait_until_committed,
    wait_until_landed,
)


def _landed_state(table: Path) -> str:
    """What the job had made durable when a process was killed."""
    try:
        rows = (
            DeltaTable(str(table))
            .to_pyarrow_dataset()
            .count_rows(filter=pc.field("mod_type") != SCHEMA_ROW)
        )
    except TableNotFoundError:
        return "nothing recorded"
    return EXPOSED if rows == 0 else "rows landed"


EXPOSED = "start recorded, no row landed"
"""A kill after the job recorded its start and before its first data commit."""
MIN_AT_STAKE = 5
"""Commits between the recorded start and the restart after the first exposed kill."""


def wait_until_at_stake(
    committed: list[CommittedTransaction], job_start: Nanos, timeout: float = 60
) -> None:
    """Until ``MIN_AT_STAKE`` transactions committed at or after the recorded start, before this
    host's now: what the test checks later, counted the same way. A wait on the list's growth
    let a CI run restart with 1 transaction at stake, after the emulator had committed nothing
    for 2.4 s following the job's start (how the list's count missed it was not established)."""
    deadline = time.monotonic() + timeout
    while True:
        since = [t.commit_timestamp for t in committed if t.commit_timestamp >= job_start]
        if len(since) >= MIN_AT_STAKE and time.time_ns() > max(since):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{len(since)} transactions committed since the recorded start")
        time.sleep(0.1)


@pytest.mark.emulator
def test_a_new_job_killed_before_its_first_commit_loses_nothing(
    new_database, tmp_path: Path
) -> None:
    seed, rng = crash_seed()
    database = new_database("googlesql")
    table = tmp_path / "changelog"
    # A flush latency and checkpoint interval longer than the tests' usual ones leave a new job
    # a window of seconds between its start commit and its first data commit.
    service = service_in(
        tmp_path,
        database.database_id,
        None,
        INGEST_FLUSH_LATENCY_MS="1500",
        INGEST_CHECKPOINT_INTERVAL_S="2",
        INGEST_LEASE_S="4",
    )
    thread, stop_workload, committed = background_workload(
        database, seconds=600, rate=20, seed=seed
    )
    starts: list[int] = []
    kills: list[str] = []

    def start() -> subprocess.Popen[bytes]:
        starts.append(time.time_ns())
        return service.start()

    def start_running() -> subprocess.Popen[bytes]:
        """A process whose start is durable: it logged ``ingest_started``."""
        started = service.count("ingest_started")
        process = start()
        service.wait_for("ingest_started", started + 1, timeout=90, process=process)
        return process

    def kill(process: subprocess.Popen[bytes]) -> None:
        process.kill()
        process.wait()
        kills.append(_landed_state(table))
        if kills.count(EXPOSED) == 1 and kills[-1] == EXPOSED:
            # The next start is what a restart at a new "now" would skip from: let commits
            # accumulate since the recorded start first. A loaded machine's workload can fall
            # far below its rate (CI once had 4 commits in that window).
            checkpoint = latest_checkpoint(str(table))
            assert checkpoint is not None and checkpoint.job_start is not None
            wait_until_at_stake(committed, checkpoint.job_start)

    try:
        # On a loaded machine the workload's first commit can come late; a job that started
        # before it would have nothing at stake.
        wait_until_committed(committed, 5, timeout=60)
        # A crash loop at start-up, before the process can have committed anything.
        for _ in range(3):
            process = start()
            time.sleep(rng.uniform(0.2, 1.5))
            kill(process)
        # Killed once its start is durable, before (mostly) its first data commit.
        for _ in range(4):
            process = start_running()
            time.sleep(rng.uniform(0.0, 0.3))
            kill(process)
        # Killed within the first seconds after a data commit.
        for _ in range(3):
            process = start_running()
            owner = [e for e in service.events() if e["event"] == "ingest_started"][-1]["owner"]
            service.wait_for(
                "delta_commit",
                1,
                timeout=90,
                process=process,
                where=functools.partial(_landed_by, owner),
            )
            time.sleep(rng.uniform(0.0, 2.0))
            kill(process)
        [job_started] = [e for e in service.events() if e["event"] == "job_started"]
        job_start = parse_rfc3339(job_started["job_start"])
        # The last process is configured with another start: the recorded one wins.
        service.env["INGEST_START_TIMESTAMP"] = to_rfc3339(job_start - 10**9)
        final = start()
    finally:
        stop_workload.set()
        thread.join()
    try:
        events = service.events()
        first_start = next(e for e in events if e["event"] == "ingest_started")
        assert parse_rfc3339(first_start["start_timestamp"]) == job_start, (
            "every process must resume from the start the first commit recorded"
        )
        expected = [t for t in committed if t.commit_timestamp >= job_start]
        service.wait_for("configured_start_ignored", 1, process=final)
        wait_until_landed(table, len(expected), timeout=120, service=service)
        final.send_signal(signal.SIGTERM)
        assert final.wait(timeout=INGEST_STOP_S) == 0
    finally:
        final.kill()

    versions = assert_change_log_invariants(table, expected)
    recorded = {v.checkpoint.job_start for v in versions if v.checkpoint}
    assert recorded == {job_start}, f"seed {seed}: checkpoints disagree on the start: {recorded}"
    states = Counter(kills)
    exposed = [n for n, state in enumerate(kills) if state == EXPOSED]
    assert len(kills) >= 10 and exposed, f"seed {seed}: kills left {dict(states)}"
    # What a restart at a new "now" would have skipped: commits from the job's start until the
    # process after the first kill that left only the start recorded.
    restarted_at = starts[exposed[0] + 1]
    at_stake = sum(job_start <= t.commit_timestamp < restarted_at for t in committed)
    assert at_stake >= MIN_AT_STAKE, f"seed {seed}: only {at_stake} transactions at stake"


def _landed_by(owner: str, event: dict[str, Any]) -> bool:
    return bool(event["owner"] == owner and event["transactions"] > 0)
