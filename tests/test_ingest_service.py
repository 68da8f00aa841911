"""The ingest service against the real emulator: crash anywhere, graceful stop, one writer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from emulator.server import free_port
from ingest.model.timestamps import NANOS_PER_SECOND, parse_rfc3339
from ingest.service.health import HealthServer, token_file
from tests.checks import crash_seed, start_after_setup
from tests.delta_checks import assert_change_log_invariants, read_versions
from tests.processes import (
    INGEST_STOP_S,
    Service,
    background_workload,
    service_in,
    wait_until_landed,
)
from tests.scrapes import check_ingest, scrape, value


@pytest.mark.emulator
def test_kill_9_at_random_moments_keeps_every_invariant(new_database, tmp_path: Path) -> None:
    seed, rng = crash_seed()
    database = new_database("googlesql")
    table = tmp_path / "changelog"
    service = service_in(tmp_path, database.database_id, start_after_setup())
    thread, _, committed = background_workload(database, seconds=35, rate=30, seed=seed)
    kills = 0
    while kills < 10 or thread.is_alive():
        commits = service.count("delta_commit")
        process = service.start()
        try:
            if kills % 2 == 0:
                # Every other process is killed after landing something of its own, so the test
                # does not depend on how fast a loaded machine starts processes; the others at
                # any moment.
                service.wait_for("delta_commit", commits + 1, timeout=120, process=process)
                time.sleep(rng.uniform(0, 2.0))
            else:
                time.sleep(rng.uniform(0.5, 5.0))
        finally:
            process.kill()
            process.wait()
        kills += 1
    thread.join()
    started = sum(e["event"] == "ingest_started" for e in service.events())
    final = service.start()
    try:
        service.wait_for("ingest_started", started + 1)
        wait_until_landed(table, len(committed), timeout=120, service=service, committed=committed)
        final.send_signal(signal.SIGTERM)
        assert final.wait(timeout=INGEST_STOP_S) == 0
    finally:
        final.kill()
    versions = assert_change_log_invariants(table, committed)
    owners = {v.checkpoint.owner for v in versions if v.checkpoint}
    assert len(owners) >= 5, f"seed {seed}: only {len(owners)} processes committed anything"
    # 35 s at 30/s; a loaded machine commits about a third of that
    assert kills >= 10 and len(committed) >= 200, (kills, len(committed))


def test_readiness_fails_once_a_stuck_partition_restarts_without_moving() -> None:
    class Landed:
        commits = 1
        last_commit_at = time.monotonic()

    health = HealthServer(0, 60.0, Landed(), max_stuck_restarts=3)
    try:
        assert health.check("/readyz") == (
            True,
            {
                "commits": 1,
                "last_commit_age_s": pytest.approx(0, abs=5),
                "stuck_partition_restarts": 0,
            },
        )
        health.stuck_restarts = lambda: 2
        assert health.check("/readyz")[0]
        health.stuck_restarts = lambda: 3
        ok, body = health.check("/readyz")
        assert not ok and body["stuck_partition_restarts"] == 3
    finally:
        health.close()


def test_a_control_request_without_the_token_gets_401_and_changes_nothing(tmp_path: Path) -> None:
    class Landed:
        commits = 1
        last_commit_at = time.monotonic()

    asked: list[list[str]] = []

    def snapshot_requests(tables: list[str]) -> tuple[int, dict[str, object]]:
        asked.append(tables)
        return 200, {"tables": tables}

    secret = tmp_path / "token"

    def post(server: HealthServer, headers: dict[str, str]) -> tuple[int, str, str | None]:
        request = urllib.request.Request(
            f"http://127.0.0.1:{server.port}/snapshot?table=transfers", method="POST"
        )
        for name, header in headers.items():
            request.add_header(name, header)
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return response.status, response.read().decode(), None
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode(), error.headers.get("WWW-Authenticate")

    off = HealthServer(0, 60.0, Landed(), control_token=token_file(""))
    open_one = HealthServer(0, 60.0, Landed(), control_token=token_file(str(secret)))
    try:
        for server in (off, open_one):
            server.snapshot_requests = snapshot_requests
        status, body, challenge = post(off, {"Authorization": "Bearer anything"})
        assert status == 401 and "control requests are off" in body and challenge
        secret.write_text("s3cret\n")
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
            status, _, challenge = post(open_one, headers)
            assert status == 401 and challenge, headers
        assert asked == [], "a refused request reached the snapshot"
        assert post(open_one, {"Authorization": "Bearer s3cret"})[0] == 200
        secret.write_text("rotated")
        assert post(open_one, {"Authorization": "Bearer s3cret"})[0] == 401
        assert post(open_one, {"Authorization": "Bearer rotated"})[0] == 200
        assert asked == [["transfers"], ["transfers"]]
        with urllib.request.urlopen(f"http://127.0.0.1:{open_one.port}/readyz", timeout=5) as ok:
            assert ok.status == 200, "reads stay open"
    finally:
        off.close()
        open_one.close()


@pytest.mark.emulator
def test_sigterm_under_load_exits_cleanly_and_restart_loses_nothing(
    new_database, tmp_path: Path
) -> None:
    database = new_database("googlesql")
    table = tmp_path / "changelog"
    port = free_port()
    service = service_in(
        tmp_path,
        database.database_id,
        start_after_setup(),
        INGEST_HEALTH_PORT=str(port),
    )
    thread, _, committed = background_workload(database, seconds=12, rate=40, seed=5)
    process = service.start()
    service.wait_for("delta_commit", 1)
    for path in ("/healthz", "/readyz"):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            assert response.status == 200, path
    first = scrape(port)
    check_ingest(first, table)
    service.wait_for("delta_commit", service.count("delta_commit") + 3)
    second = scrape(port)
    check_ingest(second, table)
    for name in (
        "ingest_transactions_landed_total",
        "ingest_low_watermark_seconds",
        "ingest_records_read_total",
    ):
        assert (value(second, name) or 0) > (value(first, name) or 0), name
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=INGEST_STOP_S) == 0
    assert not any(e["event"] == "stop_slow" for e in service.events()), "the stop dragged on"
    assert any(e["event"] == "ingest_stopped" for e in service.events())
    restarted = service.start()
    try:
        service.wait_for("ingest_started", 2)
        thread.join()
        wait_until_landed(table, len(committed), timeout=60, service=service, committed=committed)
        restarted.send_signal(signal.SIGTERM)
        assert restarted.wait(timeout=INGEST_STOP_S) == 0
    finally:
        restarted.kill()
    assert_change_log_invariants(table, committed)


LEASE_S = 4
"""The standby test's lease: short, so the takeover after the kill comes soon."""


@pytest.mark.emulator
def test_second_process_for_the_same_job_stands_by(new_database, tmp_path: Path) -> None:
    database = new_database("googlesql")
    table = tmp_path / "changelog"
    first = Service(
        database.database_id,
        table,
        tmp_path / "first.log",
        start_after_setup(),
        INGEST_LEASE_S=str(LEASE_S),
    )
    second = Service(
        database.database_id,
        table,
        tmp_path / "second.log",
        start_after_setup(),
        INGEST_LEASE_S=str(LEASE_S),
    )
    thread, _, committed = background_workload(database, seconds=16, rate=30, seed=9)
    primary = first.start()
    first.wait_for("delta_commit", 1)
    standby = second.start()
    try:
        # Progress, not the wall clock: the standby says it waits, then the first process goes
        # on committing for more than a whole lease after that, however slowly both started.
        second.wait_for("standby_waiting_for_lease", 1, timeout=120, process=standby)
        waiting = next(e for e in second.events() if e["event"] == "standby_waiting_for_lease")
        later = parse_rfc3339(waiting["timestamp"]) + (LEASE_S + 1) * NANOS_PER_SECOND
        first.wait_for(
            "delta_commit",
            1,
            process=primary,
            where=lambda e: parse_rfc3339(e["timestamp"]) > later,
        )
        primary_owner = next(e["owner"] for e in first.events() if e["event"] == "ingest_started")
        owners = {v.checkpoint.owner for v in read_versions(table) if v.checkpoint}
        assert owners == {primary_owner}, "the standby wrote while the first process lived"
        primary.kill()
        primary.wait()
        thread.join()
        wait_until_landed(table, len(committed), timeout=90)
        second.wait_for("writer_lease_taken_over", 1)
        standby.send_signal(signal.SIGTERM)
        assert standby.wait(timeout=INGEST_STOP_S) == 0
    finally:
        primary.kill()
        standby.kill()
    assert_change_log_invariants(table, committed)


@pytest.mark.emulator
def test_a_clean_stop_hands_over_at_once_and_a_kill_does_not(new_database, tmp_path: Path) -> None:
    """SIGTERM: the writer's last commit releases its lease, and the next process commits within
    seconds although the lease is 60 s. kill -9: the lease stays held and the next one waits."""
    database = new_database("googlesql")
    table = tmp_path / "changelog"
    start = start_after_setup()

    def service(name: str) -> Service:
        log = tmp_path / f"{name}.log"
        return Service(database.database_id, table, log, start, INGEST_LEASE_S="60")

    thread, _, _ = background_workload(database, seconds=20, rate=20, seed=21)
    first, second, third = service("first"), service("second"), service("third")
    processes = [first.start()]
    try:
        first.wait_for("delta_commit", 2, process=processes[0])
        processes[0].send_signal(signal.SIGTERM)
        assert processes[0].wait(timeout=INGEST_STOP_S) == 0
        first.wait_for("writer_lease_released", 1)
        processes.append(second.start())
        second.wait_for("delta_commit", 1, timeout=45, process=processes[1])
        second.wait_for("writer_lease_released_by_previous_owner", 1)
        processes[1].kill()
        processes[1].wait()
        processes.append(third.start())
        third.wait_for("standby_waiting_for_lease", 1, process=processes[2])
        processes[2].send_signal(signal.SIGTERM)
        assert processes[2].wait(timeout=INGEST_STOP_S) == 0
    finally:
        for process in processes:
            process.kill()
        thread.join()
    checkpoints = [v.checkpoint for v in read_versions(table) if v.checkpoint]
    owner = {
        name: next(e["owner"] for e in s.events() if e["event"] == "ingest_started")
        for name, s in (("first", first), ("second", second))
    }
    by_first = [c for c in checkpoints if c.owner == owner["first"]]
    by_second = [c for c in checkpoints if c.owner == owner["second"]]
    assert {c.owner for c in checkpoints} == set(owner.values())
    assert by_first[-1].lease_released and not any(c.lease_released for c in by_first[:-1])
    assert not any(c.lease_released for c in by_second)
    handover_s = (by_second[0].committed_at - by_first[-1].committed_at) / 1e9
    assert handover_s < 30, f"the next writer waited {handover_s:.1f} s (lease 60 s)"
    assert [c.version for c in (*by_first, *by_second)] == list(
        range(by_first[0].version, by_second[-1].version + 1)
    )


@pytest.mark.parametrize(
    ("variable", "value", "text"),
    [
        ("INGEST_HEARTBEAT_MS", "999", "INGEST_HEARTBEAT_MS='999': expected an integer from 1000"),
        ("INGEST_FLUSH_LATENCY_MS", "soon", "expected an integer from 10 to 3600000"),
        ("INGEST_START_TIMESTAMP", "yesterday", "not an RFC 3339 timestamp"),
        ("INGEST_DIALECT", "mysql", "expected one of auto, googlesql, postgresql"),
        ("SPANNER_CHANGE_STREAM", "a b", "SPANNER_CHANGE_STREAM='a b'"),
        ("INGEST_LEASE_S", "10", "must be at least twice checkpoint_interval_s"),
        ("INGEST_QUERY_WINDOW_S", "1801", "expected seconds from 1 to 1800"),
        ("INGEST_QUERY_WINDOW_S", "1.5", "query_window_s: query window must be between 2 s"),
        ("INGEST_CONFIG_FILE", "/nonexistent.toml", "config file /nonexistent.toml"),
    ],
)
def test_bad_configuration_is_one_line_and_exit_2(variable: str, value: str, text: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ingest", "run"],
        env={**os.environ, variable: value},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ")
    assert text in result.stderr, result.stderr


@pytest.mark.emulator
def test_a_start_before_the_change_stream_existed_is_refused_before_anything_lands(
    new_database, tmp_path: Path
) -> None:
    before_the_stream = time.time_ns()
    database = new_database("googlesql", accounts=0)
    table = tmp_path / "changelog"
    service = service_in(tmp_path, database.database_id, before_the_stream)
    result = subprocess.run(
        service.command(), env=service.env, capture_output=True, text=True, timeout=60
    )
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(errors) == 1 and result.stderr.strip().splitlines()[-1] == errors[0]
    assert "is before change stream all_changes can be read" in errors[0], errors[0]
    assert "earliest readable" in errors[0], errors[0]
    assert not table.exists(), "nothing may be recorded for a start that cannot be read"


@pytest.mark.emulator
def test_connections_cut_at_random_lose_and_duplicate_nothing(
    new_database, tmp_path: Path, spanner_emulator: str
) -> None:
    from tests.tcp_proxy import chaos_proxy

    database = new_database("googlesql")
    table = tmp_path / "changelog"
    with chaos_proxy(spanner_emulator, cut_every=(0.5, 2.0), seed=3) as proxy:
        service = service_in(
            tmp_path,
            database.database_id,
            start_after_setup(),
            SPANNER_EMULATOR_HOST=proxy.address,
        )
        thread, _, committed = background_workload(database, seconds=20, rate=30, seed=13)
        process = service.start()
        try:
            thread.join()
            wait_until_landed(
                table, len(committed), timeout=120, service=service, committed=committed
            )
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=INGEST_STOP_S) == 0
        finally:
            process.kill()
        assert proxy.cuts >= 5
    assert_change_log_invariants(table, committed)
    # A cut stream is resumed by the client itself or retried by the reader; the emulator replays
    # resumed streams from their start, so either way the reader must have dropped duplicates.
    events = service.events()
    retries = [e for e in events if e["event"] == "partition_query_retry"]
    [stopped] = [e for e in events if e["event"] == "ingest_stopped"]
    assert retries or stopped["duplicates_dropped"] > 0
