"""What a running pipeline costs per micro-batch while the change log gains a version a second.

``python -m pipeline run`` (the product's defaults: a trigger a second, ``local[2]``) tails a
change log that this script extends through the real sink, one version of ``--rows`` UPDATE rows
every second, as the ingest service lands a steady workload. After ``--warmup`` versions, the
pipeline's process tree (its Python, its JVM, the JVM's Python workers: /proc, every descendant)
is measured over ``--versions`` more; then over 10 s with no new version (idle). The pipeline is
started as ``make run`` starts it (``emulator.local_run.pipeline_process``), with ``/metrics``
served: the micro-batches' durations over the measured versions are Spark's own
(``pipeline_batch_duration_seconds``, each batch from its trigger to its commit).

Each variant differs only in how the sink writes the change log
(``ingest.delta.sink.Maintenance``): its Delta checkpoint interval (``--checkpoint-every``) and
whether each version has a checksum (``--checksums``), since the pipeline's Delta source makes a
snapshot of each new version, whose protocol and metadata come from the checksum or else from a
Spark job over the JSON written since the last checkpoint. Variants run one after the other, each
interval with each checksum setting in the order given.

Usage: python bench/microbatch_cpu.py [--rows 50] [--warmup 10] [--versions 60]
       [--checkpoint-every 100] [--checksums on,off]
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
from emulator.server import free_port
from ingest.delta.sink import DeltaChangeLogSink, Maintenance
from ingest.model.resume import ResumablePartitions, ResumePoint
from tests.scrapes import Samples, scrape, value

KEYS = 500


class Landing:
    """Versions of ``rows`` UPDATEs of random keys, landed by the real sink."""

    def __init__(self, uri: str, rows: int, maintenance: Maintenance) -> None:
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


def measure(args: argparse.Namespace, maintenance: Maintenance) -> str:
    work = Path(tempfile.mkdtemp(prefix="microbatch-cpu-"))
    landing = Landing(str(work / "changelog"), args.rows, maintenance)
    landing.land()
    process = pipeline_process(work, work / "changelog")
    port = free_port()
    process.env["PIPELINE_METRICS_PORT"] = str(port)
    running = process.start()
    try:
        process.wait_for("pipeline_batch", 1, 600, running)
        land_for(landing, args.warmup, process, running)
        first = process.count("pipeline_batch")
        spent, began, before = tree_cpu_seconds(running.pid), time.monotonic(), scrape(port)
        land_for(landing, args.versions, process, running)
        time.sleep(2.0)  # the last version's batch
        count = process.count("pipeline_batch") - first
        cpu, seconds = tree_cpu_seconds(running.pid) - spent, time.monotonic() - began
        durations = BatchDurations(before, scrape(port))
        idle_from, idle_began = tree_cpu_seconds(running.pid), time.monotonic()
        time.sleep(10.0)
        idle = (tree_cpu_seconds(running.pid) - idle_from) / (time.monotonic() - idle_began)
    finally:
        terminate(running, 120)
    checksums = "on" if maintenance.version_checksums else "off"
    return (
        f"{maintenance.log_checkpoint_every}\t{checksums}\t{count}\t{cpu:.1f}\t"
        f"{cpu / max(1, count):.3f}\t{cpu / seconds:.2f}\t{idle:.3f}\t"
        f"{durations.mean():.2f}\t{durations.share_within(1.0):.0%}"
    )


class BatchDurations:
    """Spark's micro-batch durations between two scrapes of the pipeline's histogram."""

    NAME = "pipeline_batch_duration_seconds"

    def __init__(self, before: Samples, after: Samples) -> None:
        self._before, self._after = before, after
        self.count = self._grown(f"{self.NAME}_count")

    def _grown(self, name: str, **labels: str) -> float:
        after, before = value(self._after, name, **labels), value(self._before, name, **labels)
        return (after or 0) - (before or 0)

    def mean(self) -> float:
        return self._grown(f"{self.NAME}_sum") / max(1, self.count)

    def share_within(self, seconds: float) -> float:
        """The share of batches at most ``seconds`` long (a bucket's bound)."""
        return self._grown(f"{self.NAME}_bucket", le=str(seconds)) / max(1, self.count)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=50, help="change rows per version")
    parser.add_argument("--warmup", type=int, default=10, help="versions before measuring")
    parser.add_argument("--versions", type=int, default=60, help="versions measured")
    parser.add_argument("--checkpoint-every", default="100")
    parser.add_argument("--checksums", default="on,off", help="on, off or both, in turn")
    args = parser.parse_args(argv)
    print(
        machine_line(
            f"python -m pipeline run (defaults) tailing a version of {args.rows} rows a second"
        )
    )
    print(
        "checkpoint every\tchecksums\tbatches\tCPU s\tCPU s per batch\tcores\tidle cores\t"
        "batch s mean\tbatches <= 1 s"
    )
    for every in (int(v) for v in args.checkpoint_every.split(",")):
        for checksums in args.checksums.split(","):
            maintenance = Maintenance(every, version_checksums=checksums == "on")
            print(measure(args, maintenance), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
