"""The Spark source at 2,000 partitions on the scripted server (in a process of its own, serving
in real time), in both partition modes: splits, moves and merges, or partitions announced and
ended with key ranges moving between them. The driver is killed at a random batch and restarted;
the change log holds every transaction once, whole, in commit order."""

from __future__ import annotations

import pickle
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from emulator.processes import kill_tree
from ingest.contract.changelog import SCHEMA_ROW, SNAPSHOT_ROW
from ingest.model.records import Transaction
from ingest.model.timestamps import NANOS_PER_SECOND, parse_rfc3339
from tests.delta_checks import read_versions
from tests.scripted_spanner import Script, live_script
from tests.simulation import build_wide_topology
from tests.spark_source_driver import command

PARTITIONS = 2_000
HORIZON_S = 12
"""Seconds of stream time holding the changes and transactions: six batches of at most 2 s, the
kill after one to four. 20 s cost each run about 25 CPU-s more (alone on 2 cores), mostly
every partition's heartbeats read and served."""


def serve(script: Script, path: Path) -> tuple[subprocess.Popen[str], int]:
    path.write_bytes(pickle.dumps(script))
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.scripted_spanner", "--script", str(path), "--workers", "256"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert server.stdout is not None
    return server, int(server.stdout.readline())


def landed_in_order(table: Path) -> list[tuple[int, str, int]]:
    """(commit timestamp, transaction id, records) of each landed transaction, version by
    version, as the change log lists them."""
    landed: dict[str, tuple[int, str, set[str]]] = {}
    for version in read_versions(table):
        for row in version.rows:
            if row["mod_type"] in (SCHEMA_ROW, SNAPSHOT_ROW):
                continue
            txid = row["server_transaction_id"]
            stamp = parse_rfc3339(row["commit_timestamp_text"])
            landed.setdefault(txid, (stamp, txid, set()))[2].add(row["record_sequence"])
    return [(stamp, txid, len(records)) for stamp, txid, records in landed.values()]


@pytest.mark.parametrize("mutable_key_range", [False, True])
def test_two_thousand_partitions_through_a_driver_restart_land_once_whole_in_order(
    no_emulator: None, mutable_key_range: bool, tmp_path: Path
) -> None:
    rng = random.Random(2_028)
    start = time.time_ns() + 20 * NANOS_PER_SECOND  # after Spark's start
    topology = build_wide_topology(
        rng,
        partitions=PARTITIONS,
        changes=12,
        transactions=600,
        start=start,
        horizon=HORIZON_S * NANOS_PER_SECOND,
    )
    script = live_script(topology, rng, mutable_key_range)
    server, port = serve(script, tmp_path / "script.pickle")
    table, log = tmp_path / "changelog", tmp_path / "driver.log"
    argv = command(
        port,
        table,
        tmp_path / "checkpoint",
        topology.start,
        topology.end,
        mutable_key_range=mutable_key_range,
        max_batch_span_s=2,  # a loaded machine's late start must still leave batches to kill in
    )
    kill_after = rng.randint(1, 4)
    try:
        with log.open("ab") as out:
            driver = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + 300
        while log.read_text(errors="replace").count('"spark_batch"') < kill_after:
            assert driver.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "no batch landed in time"
            time.sleep(0.2)
        kill_tree(driver)
        driver.wait()
        with log.open("ab") as out:
            restarted = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=900)
        assert restarted.returncode == 0, log.read_text(errors="replace")[-3000:]
    finally:
        kill_tree(server)
        server.wait()
    expected: list[Transaction] = topology.expected()
    assert landed_in_order(table) == [
        (t.commit_timestamp, t.server_transaction_id, len(t.records)) for t in expected
    ]
