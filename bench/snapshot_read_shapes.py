"""Peak memory of reading a table for the snapshot, by read shape, on the emulator.

Each read runs alone in a process of its own (peak RSS from ``wait4``), over the same table at
the same timestamp, rows decoded as the service decodes them (``lazy_decode``, wire JSON) and
then dropped: one streaming read of the whole table, or single-use key-range reads of at most
``N`` rows each (Spanner's ``limit``, each starting just after the last key), as the snapshot
reader makes them (50,000 by default). What it separates: the memory the client's read itself
takes from what the product keeps (``bench/snapshot_throughput.py`` measures the service).

Usage: python bench/snapshot_read_shapes.py [--sizes 100000 400000] [--ranges 0 50000 10000]
  (a range of 0 is one streaming read)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from google.cloud import spanner
from snapshot_throughput import bare_loop, run

from emulator.bootstrap import DEFAULT_INSTANCE, bootstrap
from emulator.machine import machine_line
from emulator.server import emulator
from emulator.workload import load_existing_rows

WHOLE_TABLE = 10**12
"""A ``limit`` no table reaches: one read."""


def read_once(database_id: str, read_at: int, range_rows: int) -> None:
    instance = spanner.Client(project="local-project").instance(DEFAULT_INSTANCE)
    rows, seconds = bare_loop(instance.database(database_id), read_at, range_rows or WHOLE_TABLE)
    print(f"{rows} {seconds:.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 400_000])
    parser.add_argument("--ranges", type=int, nargs="+", default=[0, 50_000, 10_000])
    parser.add_argument("--read", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.read:
        database_id, read_at, range_rows = args.read
        read_once(database_id, int(read_at), int(range_rows))
        return 0
    work = Path(tempfile.mkdtemp(prefix="snapshot-shapes-"))
    print(machine_line("each read alone in its process"))
    print("rows\tread shape\tpeak RSS MiB\trows/s")
    with emulator() as running:
        os.environ["SPANNER_EMULATOR_HOST"] = running.host_port
        client = spanner.Client(project="local-project")
        for size in sorted(args.sizes):
            database = bootstrap(
                client,
                database_id=f"shapes_{size}",
                accounts=0,
                existing=partial(
                    load_existing_rows, accounts=1000, transfers=size, all_types=0, seed=size
                ),
            )
            read_at = time.time_ns()
            time.sleep(0.2)
            for range_rows in args.ranges:
                log = work / f"read-{size}-{range_rows}.log"
                argv_read = [__file__, "--read", database.database_id, str(read_at)]
                _, code, rss_kib = run([*argv_read, str(range_rows)], {}, log)
                assert code == 0, log.read_text()[-2000:]
                rows, read_seconds = log.read_text().split()[-2:]
                assert int(rows) == size, (rows, size)
                shape = "one streaming read" if range_rows == 0 else f"ranges of {range_rows:,}"
                print(
                    f"{size}\t{shape}\t{rss_kib / 1024:.0f}\t{size / float(read_seconds):,.0f}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
