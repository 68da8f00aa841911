"""Does a micro-batch cost grow with the mirror, counted through the whole job? The pipeline
(``pipeline.query.start_query``: Delta source, transformWithState, the driver MERGE) runs batches of
1,000 keys into mirrors of different sizes; ``bench/mirror_merge_scaling.py`` times the MERGE alone.

Each mirror is built as in that benchmark (created by the product, appended in key order). The
change log, landed through the real ingest sink, holds ``--batches`` versions of 1,000 mods (500
UPDATEs of existing keys, 500 INSERTs past the end, NEW_ROW_AND_OLD_VALUES), read one version per
micro-batch. Keys are ``ordered`` (recent rows and inserts past the end) or ``random`` updates.
The figure is the median of Spark's ``triggerExecution`` over the batches after the first
(the first pays the query's start), after one discarded run that warms the JVM.

Usage: python bench/mirror_size_end_to_end.py [--sizes 10000,10000000] [--batches 6]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mirror_merge_scaling import SHAPE, batch_keys, build_mirror, ratio_to_first
from pipeline_throughput import one_record_transaction

from emulator.machine import machine_line
from ingest.delta.sink import DeltaChangeLogSink
from ingest.model.records import Mod
from ingest.model.resume import ResumablePartitions, ResumePoint
from ingest.model.timestamps import parse_rfc3339
from pipeline.batch_writer import JobStats
from pipeline.columns import mirror_uri
from pipeline.config import PipelineConfig
from pipeline.deployment import plan_deployment
from pipeline.metrics import PipelineMetrics
from pipeline.query import spark_settings, start_query
from pipeline.session import build_session
from runtime.logs import null_logger

START = parse_rfc3339("2026-11-23T00:00:00Z")


def land_changelog(uri: str, key_batches: list[list[int]], mirror_rows: int) -> None:
    """One Delta version per batch; keys below ``mirror_rows`` are UPDATEs, the rest INSERTs."""
    sink = DeltaChangeLogSink(uri, "bench", "bench")
    sink.continue_after(None)
    sink.start_job(START)
    clock, number = START, 0
    for keys in key_batches:
        transactions = []
        for key in keys:
            clock += 1_000
            number += 1
            values = {"owner": f"owner-{key}", "balance": str(number), "updated_at": None}
            transactions.append(
                one_record_transaction(
                    clock,
                    number,
                    SHAPE.columns,
                    (Mod({"account_id": str(key)}, values, {}),),
                    "UPDATE" if key < mirror_rows else "INSERT",
                )
            )
        sink.commit(transactions, ResumePoint(clock, ResumablePartitions((), ())))


def run_job(spark: object, work: Path) -> list[float]:
    """Seconds of each micro-batch (Spark's triggerExecution)."""
    config = PipelineConfig(
        changelog_uri=str(work / "changelog"),
        mirror_root=str(work / "mirrors"),
        checkpoint_uri=str(work / "checkpoint"),
        trigger="available-now",
        max_files_per_trigger=1,
        shuffle_partitions=2,
    )
    plan = plan_deployment(config, null_logger())
    query = start_query(spark, config, plan, JobStats(), null_logger(), PipelineMetrics())
    query.awaitTermination()
    return [
        p["durationMs"]["triggerExecution"] / 1000
        for p in map(json.loads, (p.json for p in query.recentProgress))
        if p.get("numInputRows", 0) > 0
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="10000,10000000")
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--kinds", default="ordered,random")
    parser.add_argument("--file-rows", type=int, default=1_000_000)
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="mirror-size-"))
    spark = build_session(
        "mirror-size", extra=spark_settings(PipelineConfig()), shuffle_partitions=2
    )
    print(
        machine_line(
            "the job's micro-batches of 1,000 keys, median triggerExecution of batches "
            f"2..{args.batches}"
        )
    )
    print("mirror rows\tkeys\tmedian s\tmax s\tbuild s")
    rng = random.Random(11)
    warmup = root / "warmup"
    build_mirror(mirror_uri(str(warmup / "mirrors"), "accounts"), 10_000, args.file_rows)
    land_changelog(str(warmup / "changelog"), [batch_keys("ordered", 10_000, 0, rng)] * 3, 10_000)
    run_job(spark, warmup)  # the JVM's first jobs and Delta warm-up, not counted
    baseline: dict[str, tuple[float, int]] = {}
    for size in (int(s) for s in args.sizes.split(",")):
        for kind in args.kinds.split(","):
            work = root / f"{size}-{kind}"
            began = time.monotonic()
            build_mirror(mirror_uri(str(work / "mirrors"), "accounts"), size, args.file_rows)
            built = time.monotonic() - began
            keys = [batch_keys(kind, size, n, rng) for n in range(args.batches)]
            land_changelog(str(work / "changelog"), keys, size)
            seconds = run_job(spark, work)[1:]
            median = statistics.median(seconds)
            ratio = ratio_to_first(baseline, kind, size, median)
            print(
                f"{size}\t{kind}\t{median:.2f}\t{max(seconds):.2f}\t{built:.0f}{ratio}", flush=True
            )
            shutil.rmtree(work, ignore_errors=True)
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
