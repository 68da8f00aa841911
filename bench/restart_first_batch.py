"""How soon a pipeline killed with SIGKILL merges again: from the new process's start to its
query's start and to its first merged batch.

``python -m pipeline run`` (continuous, ``local[2]``, the product's defaults) runs on a change log
landed through the real ingest sink (``--keys`` keys INSERTed, then UPDATEs; 10 mods per
transaction) until it has merged a batch of each new version; then it is killed with SIGKILL, one
version more is landed, and it is started again on the same checkpoint and mirrors. Each restart
is timed from the new process's start to its ``pipeline_query_started`` and its first
``pipeline_batch`` event. The first start is timed the same way, for comparison. With ``--store
s3`` the change log, mirrors and checkpoint are on MinIO on loopback (the usual AWS variables).

Usage: python bench/restart_first_batch.py [--keys 20000] [--restarts 3] [--store local|s3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline_throughput import account_transaction

from emulator.local_run import pipeline_process
from emulator.machine import machine_line
from emulator.object_store import minio
from emulator.processes import Process
from ingest.delta.sink import DeltaChangeLogSink
from ingest.model.resume import ResumablePartitions, ResumePoint
from ingest.model.timestamps import parse_rfc3339

START = parse_rfc3339("2026-11-27T00:00:00Z")


class ChangeLogWriter:
    """Lands versions of whole transactions through the real sink, one at a time."""

    def __init__(self, uri: str) -> None:
        self.sink = DeltaChangeLogSink(uri, "bench", "bench")
        self.sink.continue_after(None)
        self.clock, self.number = START, 0

    def land(self, keys: range, mod_type: str) -> None:
        transactions = []
        chosen = list(keys)
        for first in range(0, len(chosen), 10):
            self.clock += 1_000
            self.number += 1
            keys_now = chosen[first : first + 10]
            transactions.append(
                account_transaction(self.clock, self.number, keys_now, lambda _: 1, mod_type)
            )
        self.sink.commit(transactions, ResumePoint(self.clock, ResumablePartitions((), ())))


def timed_start(
    process: Process, batches_before: int, timeout: float
) -> tuple[float, float, subprocess.Popen[bytes]]:
    """Start the pipeline; seconds to its query's start and to its next merged batch."""
    started = time.monotonic()
    popen = process.start()
    process.wait_for(
        "pipeline_query_started", process.count("pipeline_query_started") + 1, timeout, popen
    )
    query = time.monotonic() - started
    process.wait_for("pipeline_batch", batches_before + 1, timeout, popen)
    return query, time.monotonic() - started, popen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keys", type=int, default=20_000)
    parser.add_argument("--restarts", type=int, default=3)
    parser.add_argument("--store", choices=("local", "s3"), default="local")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="restart-bench-"))
    with contextlib.ExitStack() as stack:
        root = str(folder)
        if args.store == "s3":
            store = stack.enter_context(minio(folder / "minio"))
            os.environ.update(store.environment())
            root = store.uri("restart")
        writer = ChangeLogWriter(f"{root}/changelog")
        writer.land(range(args.keys), "INSERT")
        process = pipeline_process(folder, f"{root}/changelog", root)
        print(
            machine_line(
                f"{args.keys} keys on {args.store}, python -m pipeline run (local[2], "
                "defaults), SIGKILL between starts"
            )
        )
        print("start\tquery started s\tfirst batch s")
        for start in range(args.restarts + 1):
            query, first, popen = timed_start(
                process, process.count("pipeline_batch"), args.timeout
            )
            name = "first" if start == 0 else f"after kill {start}"
            print(f"{name}\t{query:.1f}\t{first:.1f}", flush=True)
            writer.land(range(0, args.keys, 7), "UPDATE")
            process.wait_for(
                "pipeline_batch", process.count("pipeline_batch") + 1, args.timeout, popen
            )
            os.killpg(popen.pid, signal.SIGKILL)  # the process group: Python, its JVM, its workers
            popen.wait()
            writer.land(range(3, args.keys, 11), "UPDATE")
    print(f'{{"work": "{folder}"}}')
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
