"""Initial snapshot benchmark against the emulator: rows/s, peak RSS, time to a consistent mirror.

For each table size, one run: rows are loaded into `transfers`, then (same database, same read
timestamp T0) the ingest service snapshots it with `snapshot_mode=initial_only` (a process of its
own, its peak RSS taken from wait4), and a bare client loop reads the same table at the same
timestamp as the service reads it (50,000-row key ranges, ``lazy_decode``, wire JSON) and nothing
else. The ratio service/bare is the figure: what the product adds to the reads it must make.
For the smallest size the pipeline then builds the mirror from the change log
(`--trigger available-now`): service start → mirror equal to Spanner at T0.

Usage: python bench/snapshot_throughput.py [--sizes 100000 1000000] [--workers 4]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from google.cloud import spanner
from google.cloud.spanner_v1 import KeyRange, KeySet

from emulator.bootstrap import bootstrap
from emulator.machine import machine_line
from emulator.server import emulator
from emulator.verify import compare_mirrors
from emulator.workload import load_existing_rows
from ingest.model.timestamps import parse_rfc3339, to_datetime, to_rfc3339
from ingest.snapshot.reader import wire_json
from pipeline.catalog import discover_shapes

WORK = Path(tempfile.mkdtemp(prefix="snapshot-bench-"))
COLUMNS = ["from_account_id", "transfer_id", "to_account_id", "amount", "created_at"]
KEY_WIDTH = 2
RANGE_ROWS = 5 * 10_000
"""The service's range per read: five chunks of the default ``snapshot_chunk_rows``."""


def run(argv: list[str], env: dict[str, str], log: Path) -> tuple[float, int, int]:
    """Wall seconds, exit code and peak RSS (KiB) of one process."""
    began = time.perf_counter()
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, *argv], env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT
        )
        _, status, usage = os.wait4(process.pid, 0)
    return time.perf_counter() - began, os.waitstatus_to_exitcode(status), usage.ru_maxrss


def snapshot_phase_seconds(log: Path) -> float:
    events = [json.loads(line) for line in log.read_text().splitlines() if line.startswith('{"')]
    started = next(e for e in events if e["event"] == "snapshot_started")
    done = next(e for e in events if e["event"] == "snapshot_progress" and e["complete"])
    return (parse_rfc3339(done["timestamp"]) - parse_rfc3339(started["timestamp"])) / 1e9


def bare_loop(database, read_at: int, range_rows: int) -> tuple[int, float]:
    """The reads the service makes, decoded as it decodes them, and nothing else: key ranges of
    ``range_rows`` rows (Spanner's ``limit``, the next range starting just after the last key),
    ``lazy_decode`` and each value turned into its wire JSON (``wire_json``); no change-log rows,
    no Delta."""
    began = time.perf_counter()
    rows, last_key = 0, None
    with database.snapshot(read_timestamp=to_datetime(read_at), multi_use=True) as snapshot:
        while True:
            keys = (
                KeySet(all_=True)
                if last_key is None
                else KeySet(ranges=[KeyRange(start_open=list(last_key), end_closed=[])])
            )
            read = 0
            for row in snapshot.read(
                "transfers", COLUMNS, keys, limit=range_rows, lazy_decode=True
            ):
                decoded = [wire_json(value) for value in row]
                last_key = decoded[:KEY_WIDTH]
                read += 1
            rows += read
            if read < range_rows:
                break
    return rows, time.perf_counter() - began


def one_size(client, size: int, workers: int, mirror: bool) -> None:
    began = time.perf_counter()
    database = bootstrap(
        client,
        database_id=f"snap_{size}",
        accounts=0,
        existing=lambda d: load_existing_rows(d, 1000, transfers=size, all_types=0, seed=size),
    )
    load_seconds = time.perf_counter() - began
    time.sleep(0.2)
    start = time.time_ns()
    read_at = start - 1
    changelog = WORK / f"changelog_{size}"
    log = WORK / f"ingest_{size}.log"
    seconds, code, rss_kib = run(
        ["-m", "ingest", "run"],
        {
            "SPANNER_DATABASE": database.database_id,
            "INGEST_TABLE_URI": str(changelog),
            "INGEST_START_TIMESTAMP": to_rfc3339(start),
            "INGEST_SNAPSHOT_MODE": "initial_only",
            "INGEST_SNAPSHOT_WORKERS": str(workers),
            "INGEST_HEALTH_PORT": "0",
        },
        log,
    )
    assert code == 0, log.read_text()[-2000:]
    phase = snapshot_phase_seconds(log)
    rows, bare_seconds = bare_loop(database, read_at, RANGE_ROWS)
    print(f"{size} rows (loaded in {load_seconds:.0f} s):")
    print(
        f"  service   {size / phase:8.0f} rows/s in the snapshot phase ({phase:.1f} s); "
        f"process {seconds:.1f} s; peak RSS {rss_kib / 1024:.0f} MiB"
    )
    print(f"  bare loop {rows / bare_seconds:8.0f} rows/s ({bare_seconds:.1f} s, {rows} rows)")
    print(f"  ratio service/bare: {bare_seconds / phase:.2f}")
    if not mirror:
        return
    root = WORK / f"pipeline_{size}"
    pipeline_seconds, code, _ = run(
        ["-m", "pipeline", "run", "--trigger", "available-now"],
        {
            "PIPELINE_CHANGELOG_URI": str(changelog),
            "PIPELINE_MIRROR_ROOT": str(root / "mirrors"),
            "PIPELINE_CHECKPOINT_URI": str(root / "checkpoint"),
            "PIPELINE_MASTER": "local[2]",
            "PIPELINE_METRICS_PORT": "0",
        },
        WORK / f"pipeline_{size}.log",
    )
    assert code == 0, (WORK / f"pipeline_{size}.log").read_text()[-2000:]
    shapes = discover_shapes(str(changelog))
    comparisons = compare_mirrors(database, str(root / "mirrors"), shapes, read_at, 0)
    equal = all(c.equal for c in comparisons)
    print(
        f"  service start → mirror equal to Spanner at T0: {seconds + pipeline_seconds:.0f} s "
        f"(snapshot process {seconds:.0f} s, then pipeline {pipeline_seconds:.0f} s); "
        f"equal: {equal}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()
    print(machine_line())
    try:
        with emulator() as running:
            os.environ["SPANNER_EMULATOR_HOST"] = running.host_port
            client = spanner.Client(project="local-project")
            for number, size in enumerate(sorted(args.sizes)):
                one_size(client, size, args.workers, mirror=number == 0)
    finally:
        shutil.rmtree(WORK, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
