"""A stall told apart by evidence (``tests.stalls``), on the real emulator: the ingest service
stopped (SIGSTOP) while the emulator answers is the product's stall; a transaction missing behind
the change log's W is no stall, and is named; the emulator stopped is the emulator's, named by
the question it did not answer."""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path

import pytest
from google.api_core.exceptions import Aborted

from emulator.server import RunningEmulator, free_port
from tests.checks import SEED_TRANSACTIONS, accounts_written_after_start
from tests.processes import BANKING, background_workload, service_in, wait_until_landed
from tests.stalls import EmulatorStalled, workload_failure

STALLED_AFTER_S = 10


@pytest.mark.emulator
def test_a_stopped_product_and_a_stopped_emulator_are_told_apart(
    new_database, started_emulator: RunningEmulator, tmp_path: Path
) -> None:
    database, start = accounts_written_after_start(new_database)
    table = tmp_path / "changelog"
    service = service_in(tmp_path, database.database_id, start)
    process = service.start()
    workload, stop, committed = background_workload(database, 600, 4, 7, weights=BANKING)
    try:
        wait_until_landed(table, 20, timeout=120, service=service)
        os.kill(process.pid, signal.SIGSTOP)
        with pytest.raises(AssertionError, match="the product stalled") as product:
            wait_until_landed(table, len(committed) + 10_000, STALLED_AFTER_S, service)
        assert not isinstance(product.value, EmulatorStalled)
        os.kill(process.pid, signal.SIGCONT)
        stop.set()
        workload.join()
        wait_until_landed(table, SEED_TRANSACTIONS + len(committed), timeout=120, service=service)
        # a transaction the change log lacks behind its W is no stall: it is named, with what a
        # fresh read of the stream returns there (this one never committed: nothing; the seed
        # transaction landed too)
        absent = dataclasses.replace(
            committed[0], commit_timestamp=committed[0].commit_timestamp + 1
        )
        with pytest.raises(AssertionError, match=r"not a stall: .*\(not returned either\)$"):
            wait_until_landed(
                table,
                SEED_TRANSACTIONS + len(committed) + 1,
                STALLED_AFTER_S,
                service,
                [*committed, absent],
            )
        # a test's own workload that failed is told apart the same way
        failed = Aborted("a workload's transaction")
        answered = workload_failure(database, failed)
        assert not isinstance(answered, EmulatorStalled)
        assert "the emulator answers a trivial read and read-write transaction" in str(answered)
        assert started_emulator.process is not None
        os.kill(started_emulator.process.pid, signal.SIGSTOP)
        try:
            with pytest.raises(EmulatorStalled, match="did not answer a trivial read"):
                wait_until_landed(table, len(committed) + 10_000, STALLED_AFTER_S, service)
            assert isinstance(workload_failure(database, failed), EmulatorStalled)
        finally:
            os.kill(started_emulator.process.pid, signal.SIGCONT)
    finally:
        stop.set()
        os.kill(process.pid, signal.SIGCONT)
        process.kill()


def test_ports_chosen_for_later_processes_are_none_the_kernel_gives_connections() -> None:
    """``free_port``'s ports lie below the kernel's ephemeral range: an outgoing connection took
    one chosen minutes before its pipeline bound it, which then exited ``Address already in
    use``. A worker never hands one out twice."""
    ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(port < ephemeral for port in ports), ports
