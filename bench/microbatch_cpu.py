"""What a running pipeline costs per micro-batch while the change log gains a version a second.

``python -m pipeline run`` (the product's defaults: a trigger a second, ``local[2]``) tails a
change log that this script extends through the real sink, one version of ``--rows`` UPDATE rows
every second, as the ingest service lands a steady workload. After ``--warmup`` versions, the
pipeline's process tree (its Python, its JVM, the JVM's Python workers: /proc, every descendant)
is measured over ``--versions`` more; then over 10 s with no new version (idle).

Each variant differs only in the change log's Delta checkpoint interval
(``ingest.delta.sink.Maintenance.log_checkpoint_every``), since the pipeline's Delta source
rebuilds the table's protocol and metadata from the JSON written since the last checkpoint at
every trigger. Variants run one after the other in the order given.

Usage: python bench/microbatch_cpu.py [--rows 50] [--warmup 10] [--versions 60]
       [--checkpoint-every 100,10]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline_throughput import MODS_PER_TRANSACTION, START, account_transaction

from ingest.delta.sink import DeltaChangeLogSink, Maintenance
from ingest.model.resume import ResumablePartitions, ResumePoint

ROOT = Path(__file__).resolve().parent.parent
KEYS = 500
TICKS = os.sysconf("SC_CLK_TCK")


def tree_cpu(root: int) -> float:
    """CPU seconds of ``root`` and every process below it, as /proc has them now."""
    children: dict[int, list[int]] = {}
    spent: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry.name)
        children.setdefault(int(fields[1]), []).append(pid)
        spent[pid] = (int(fields[11]) + int(fields[12])) / TICKS
    total, stack = 0.0, [root]
    while stack:
        pid = stack.pop()
        total += spent.get(pid, 0.0)
        stack.extend(children.get(pid, []))
    return total


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


def batches(log: Path) -> int:
    return log.read_text(errors="replace").count('"pipeline_batch"')


def land_for(landing: Landing, versions: int, log: Path, pipeline: subprocess.Popen[bytes]) -> None:
    for _ in range(versions):
        landing.land()
        time.sleep(1.0)
        if pipeline.poll() is not None:
            raise RuntimeError(f"the pipeline exited: {log.read_text()[-3000:]}")


def measure(args: argparse.Namespace, checkpoint_every: int) -> str:
    work = Path(tempfile.mkdtemp(prefix="microbatch-cpu-"))
    landing = Landing(str(work / "changelog"), args.rows, checkpoint_every)
    landing.land()
    env = dict(
        os.environ,
        PIPELINE_CHANGELOG_URI=str(work / "changelog"),
        PIPELINE_MIRROR_ROOT=str(work / "mirrors"),
        PIPELINE_CHECKPOINT_URI=str(work / "checkpoint"),
    )
    log = work / "pipeline.log"
    with log.open("wb") as out:
        pipeline = subprocess.Popen(
            [sys.executable, "-m", "pipeline", "run"], env=env, stdout=out, stderr=out, cwd=ROOT
        )
    try:
        while batches(log) < 1:
            if pipeline.poll() is not None:
                raise RuntimeError(f"the pipeline exited: {log.read_text()[-3000:]}")
            time.sleep(0.2)
        land_for(landing, args.warmup, log, pipeline)
        first, spent, began = batches(log), tree_cpu(pipeline.pid), time.monotonic()
        land_for(landing, args.versions, log, pipeline)
        time.sleep(2.0)  # the last version's batch
        count, cpu = batches(log) - first, tree_cpu(pipeline.pid) - spent
        seconds = time.monotonic() - began
        idle_from, idle_began = tree_cpu(pipeline.pid), time.monotonic()
        time.sleep(10.0)
        idle = (tree_cpu(pipeline.pid) - idle_from) / (time.monotonic() - idle_began)
    finally:
        pipeline.terminate()
        pipeline.wait(timeout=120)
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
        f"# {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC {platform.node()} {os.cpu_count()} "
        f"cores; python -m pipeline run (defaults) tailing a version of {args.rows} rows a second"
    )
    print("checkpoint every\tbatches\tCPU s\tCPU s per batch\tcores\tidle cores")
    for every in (int(v) for v in args.checkpoint_every.split(",")):
        print(measure(args, every), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
