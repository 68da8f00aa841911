"""What a running pipeline costs per micro-batch while the change log gains a version a second.

``python -m pipeline run`` (the product's defaults: a trigger a second, ``local[2]``) tails a
change log that this script extends through the real sink, one version of ``--rows`` UPDATE rows
every second, as the ingest service lands a steady workload. After ``--warmup`` versions, the
pipeline's process tree (its Python, its JVM, the JVM's Python workers: /proc, every descendant)
is measured over ``--versions`` more; then over 10 s with no new version (idle). The pipeline is
started as ``make run`` starts it (``emulator.local_run.pipeline_process``).

Each variant differs only in the change log's Delta checkpoint interval
(``ingest.delta.sink.Maintenance.log_checkpoint_every``), since the pipeline's Delta source
rebuilds the table's protocol and metadata from the JSON written since the last checkpoint at
every trigger. Variants run one after the other in the order given.

Usage: python bench/microbatch_cpu.py [--rows 50] [--warmup 10] [--versions 60]
       [--checkpoint-every 100,10]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from subprocess import Popen

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline_throughput import MODS_PER_TRANSACTION, START, account_transaction

from emulator.local_run import pipeline_process
from emulator.machine import machine_line
from emulator.processes import Process, terminate, tree_cpu_seconds
from ingest.delta.sink import DeltaChangeLogSink, Maintenance
from ingest.model.resume import ResumablePartitions, ResumePoint

KEYS = 500


class Landing:
    """Versions of ``rows`` UPDATEs of random keys, landed by the real sink."""

    def __init__(self, uri: str, rows: int, checkpoint_every: int) -> None:
        maintenance = Maintenance(log_checkpoint_every=checkpoint_every)
        self._sink = DeltaChangeLogSink(uri, "bench", "bench", maintenance=maintenance)
        self._sink.continue_after(None)
        self._rows, self._rng, self._clock, self._number = rows, random.Random(1), START, 0

    def land(self) -> None:
        transactions = []
        for _ in range(max(1, self._rows // MODS_PER_TRANSACTION)):
            self._clock += 1_000
            self._number += 1
            keys = self._rng.sample(range(KEYS), MODS_PER_TRANSACTION)
            balance = lambda _: self._rng.randint(0, 10**6)  # noqa: E731
            transactions.append(
                account_transaction(self._clock, self._number, keys, balance, "UPDATE")
            )
        self._sink.commit(transactions, ResumePoint(self._clock, ResumablePartitions((), ())))


def land_for(landing: Landing, versions: int, process: Process, running: Popen[bytes]) -> None:
    for _ in range(versions):
        landing.land()
        time.sleep(1.0)
        if running.poll() is not None:
            raise RuntimeError(f"the pipeline exited: {process.log.read_text()[-3000:]}")


def measure(args: argparse.Namespace, checkpoint_every: int) -> str:
    work = Path(tempfile.mkdtemp(prefix="microbatch-cpu-"))
    landing = Landing(str(work / "changelog"), args.rows, checkpoint_every)
    landing.land()
    process = pipeline_process(work, work / "changelog")
    running = process.start()
    try:
        process.wait_for("pipeline_batch", 1, 600, running)
        land_for(landing, args.warmup, process, running)
        first = process.count("pipeline_batch")
        spent, began = tree_cpu_seconds(running.pid), time.monotonic()
        land_for(landing, args.versions, process, running)
        time.sleep(2.0)  # the last version's batch
        count = process.count("pipeline_batch") - first
        cpu, seconds = tree_cpu_seconds(running.pid) - spent, time.monotonic() - began
        idle_from, idle_began = tree_cpu_seconds(running.pid), time.monotonic()
        time.sleep(10.0)
        idle = (tree_cpu_seconds(running.pid) - idle_from) / (time.monotonic() - idle_began)
    finally:
        terminate(running, 120)
    return (
        f"{checkpoint_every}\t{count}\t{cpu:.1f}\t{cpu / max(1, count):.3f}\t"
        f"{cpu / seconds:.2f}\t{idle:.3f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=50, help="change rows per version")
    parser.add_argument("--warmup", type=int, default=10, help="versions before measuring")
    parser.add_argument("--versions", type=int, default=60, help="versions measured")
    parser.add_argument("--checkpoint-every", default="100,10")
    args = parser.parse_args(argv)
    print(
        machine_line(
            f"python -m pipeline run (defaults) tailing a version of {args.rows} rows a second"
        )
    )
    print("checkpoint every\tbatches\tCPU s\tCPU s per batch\tcores\tidle cores")
    for every in (int(v) for v in args.checkpoint_every.split(",")):
        print(measure(args, every), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
