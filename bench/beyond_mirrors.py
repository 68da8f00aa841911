"""What histories and a user processor cost the mirror job: change rows/s of the job alone, with
a history of every table, and with one user processor (``examples.bank:RunningBalance``), in one
run on one change log and one Spark session.

Each case is the whole job (``pipeline.job.run_pipeline``, available-now, one change-log version
per micro-batch), so the baseline takes the same path (read, state, MERGE, cut, batch log) but
for the one thing added. The change log is ``bench/pipeline_throughput.py``'s: one table, INSERT
then UPDATEs of random keys, 10 mods per transaction, landed by the real sink. Each case is
checked: the mirror holds every key, the history a version per change, the processor a row per
change.

A warm-up run of the mirror job on a change log a tenth the size comes first (its time is not
counted: without it the first case carried the session's warm-up, 90 s against 72 s for the same
case later). Then the cases run in ``--rounds`` rounds, each round in the order opposite to the
one before, so whatever the machine does meanwhile falls on every case alike; each case's figure
is its median over the rounds, each round's ratio is printed too.

Usage: python bench/beyond_mirrors.py [--rows 200000] [--keys 20000] [--batches 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deltalake import DeltaTable
from pipeline_throughput import land_changelog

from emulator.machine import machine_line
from pipeline.config import PipelineConfig
from pipeline.job import run_pipeline
from pipeline.query import spark_settings
from pipeline.session import build_session
from runtime.logs import null_logger

CASES = {
    "mirrors": {},
    "history": {"history_tables": "*"},
    "processor": {"processors": "examples.bank:RunningBalance"},
}


def run_case(spark: object, name: str, changelog: str, work: Path) -> float:
    config = PipelineConfig(
        changelog_uri=changelog,
        mirror_root=str(work / "mirrors"),
        checkpoint_uri=str(work / "checkpoint"),
        history_root=str(work / "history"),
        processor_root=str(work / "processors"),
        trigger="available-now",
        max_files_per_trigger=1,
        metrics_port=0,
        **CASES[name],  # type: ignore[arg-type]
    )
    started = time.monotonic()
    stats = run_pipeline(config, null_logger(), threading.Event(), lambda: spark)
    seconds = time.monotonic() - started
    assert stats.batches >= 1 and stats.restarts == 0, stats
    return seconds


def rows_of(uri: Path) -> int:
    return DeltaTable(str(uri)).to_pyarrow_dataset().count_rows()


def check_case(name: str, work: Path, rows: int, keys: int) -> None:
    """What the case must have written: every key mirrored, a version or a row per change."""
    assert rows_of(work / "mirrors" / "accounts") == keys
    if name == "history":
        assert rows_of(work / "history" / "accounts") == rows
    if name == "processor":
        assert rows_of(work / "processors" / "running_balance") == rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--keys", type=int, default=20_000)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES), help="a subset, to profile one")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="beyond-mirrors-bench-"))
    spark = build_session(
        "beyond-mirrors-bench",
        master="local[2]",
        shuffle_partitions=2,
        extra=spark_settings(PipelineConfig()),
    )
    spark.sparkContext.setLogLevel("ERROR")
    changelog = str(root / "changelog")
    land_changelog(changelog, args.rows, args.keys, args.batches)
    warm_up = str(root / "warm-up-changelog")
    land_changelog(warm_up, args.rows // 10, max(1, args.keys // 10), 2)
    run_case(spark, "mirrors", warm_up, root / "warm-up")
    print(
        machine_line(
            f"local[2], {args.rows} change rows of {args.keys} keys in {args.batches} versions, "
            f"one version per micro-batch, {args.rounds} rounds in alternating order"
        )
    )
    print("round\tcase\tseconds")
    cases = [name for name in CASES if name in args.cases.split(",")]
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    for number in range(args.rounds):
        order = cases if number % 2 == 0 else list(reversed(cases))
        for name in order:
            work = root / f"{name}-{number}"
            seconds[name].append(run_case(spark, name, changelog, work))
            check_case(name, work, args.rows, args.keys)
            print(f"{number}\t{name}\t{seconds[name][-1]:.1f}", flush=True)
            shutil.rmtree(work, ignore_errors=True)
    print("case\trows/s\tseconds\tratio to mirrors\tratio per round")
    reference = seconds.get("mirrors", next(iter(seconds.values())))
    baseline = statistics.median(reference)
    for name, taken in seconds.items():
        median = statistics.median(taken)
        rounds = ",".join(f"{t / m:.2f}" for t, m in zip(taken, reference, strict=True))
        print(
            f"{name}\t{args.rows / median:,.0f}\t{median:.1f}\t{median / baseline:.2f}\t{rounds}",
            flush=True,
        )
    spark.stop()
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
