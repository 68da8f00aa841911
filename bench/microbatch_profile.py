"""Where a pipeline's seconds go: its first batch after start, and each later micro-batch.

The job (``pipeline.query.start_query``, as ``pipeline run`` starts it) reads a change log landed
through the real ingest sink (``--versions`` versions, ``--keys`` keys INSERTed then UPDATEd at
random, 10 mods per transaction), one version per micro-batch, ``availableNow``, ``local[2]``.
Times, from this process's start:

- the Spark session, the deployment plan and the mirrors' creation;
- per micro-batch, Spark's own ``durationMs`` (latestOffset, getBatch, queryPlanning, addBatch,
  triggerExecution) and, inside addBatch, ``write_batch`` split into the MERGE (on the driver
  through delta-rs, or through delta-spark with ``--merge spark``) and the rest (the stateful
  step's rows, persisted, counted and collected);
- the end of the first batch;
- with ``--event-log``, the stateful stage of each later batch from Spark's own event log: its
  tasks' wall and CPU time, the state stores' commit (RocksDB's flush, checkpoint and sync to the
  checkpoint location) and the Python workers' time; ``--spark-conf`` adds settings to compare.

Timers wrap ``pipeline.batch_writer.write_batch`` and the two mirror MERGE functions where
``pipeline.landing`` calls them; nothing else changes.

Usage: python bench/microbatch_profile.py [--versions 11] [--keys 10000] [--merge driver]
       [--shuffle-partitions 2] [--class-archive on] [--event-log] [--spark-conf KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline_throughput import MODS_PER_TRANSACTION, available_now, land_changelog

import pipeline.batch_writer
import pipeline.landing
from emulator.machine import machine_line
from pipeline.batch_writer import JobStats
from pipeline.columns import mirror_uri
from pipeline.config import PipelineConfig
from pipeline.deployment import plan_deployment
from pipeline.metrics import PipelineMetrics
from pipeline.mirror import ensure_mirror
from pipeline.query import spark_settings, start_query
from pipeline.session import build_session
from runtime.jvm import JIT_SETTINGS
from runtime.logs import null_logger

SPARK_PHASES = ("latestOffset", "getBatch", "queryPlanning", "addBatch", "triggerExecution")


def since_process_start() -> float:
    """Seconds since this process started (/proc), imports included."""
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return uptime - ticks / os.sysconf("SC_CLK_TCK")


@dataclasses.dataclass
class Timers:
    """Seconds spent in each wrapped function, per micro-batch (in call order)."""

    write_batch: list[float] = dataclasses.field(default_factory=list)
    merge: list[float] = dataclasses.field(default_factory=list)
    ended_at: list[float] = dataclasses.field(default_factory=list)

    def wrap(self, module: Any, name: str, into: list[float]) -> None:
        inner: Callable[..., Any] = getattr(module, name)

        @functools.wraps(inner)
        def timed(*args: Any, **kwargs: Any) -> Any:
            began = time.monotonic()
            try:
                return inner(*args, **kwargs)
            finally:
                into.append(time.monotonic() - began)
                if into is self.write_batch:
                    self.ended_at.append(since_process_start())

        setattr(module, name, timed)


def without_archive(off: bool) -> dict[str, str]:
    """The driver's options without the class archive: the same start but for the archive."""
    return (
        {"spark.driver.defaultJavaOptions": JIT_SETTINGS["spark.driver.defaultJavaOptions"]}
        if off
        else {}
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--versions", type=int, default=11)
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--rows-per-version", type=int, default=1_090)
    parser.add_argument("--merge", choices=("driver", "spark"), default="driver")
    parser.add_argument("--shuffle-partitions", type=int, default=2)
    parser.add_argument(
        "--class-archive",
        choices=("on", "off"),
        default="on",
        help="off: the driver starts without the jars' class archive (runtime.jvm.CLASS_ARCHIVE)",
    )
    parser.add_argument(
        "--event-log", action="store_true", help="print the stateful stage from Spark's event log"
    )
    parser.add_argument(
        "--spark-conf", action="append", default=[], metavar="KEY=VALUE", help="a setting added"
    )
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="microbatch-profile-"))
    rows = args.versions * args.rows_per_version
    changelog = str(work / "changelog")
    land_changelog(changelog, rows, min(args.keys, rows), args.versions)
    defaults = PipelineConfig()
    config = available_now(
        changelog,
        work,
        local_merge_max_rows=defaults.local_merge_max_rows if args.merge == "driver" else 0,
        shuffle_partitions=args.shuffle_partitions,
    )
    timers = Timers()
    timers.wrap(pipeline.batch_writer, "write_batch", timers.write_batch)
    timers.wrap(pipeline.landing, "merge_on_driver", timers.merge)
    timers.wrap(pipeline.landing, "merge_into_mirror", timers.merge)
    extra = without_archive(args.class_archive == "off")
    extra.update(item.split("=", 1) for item in args.spark_conf)
    if args.event_log:
        (work / "events").mkdir()
        extra.update(event_log(work / "events"))
    marks, progress = profile(config, timers, extra)
    assert len(progress) == args.versions == len(timers.write_batch), (
        len(progress),
        len(timers.write_batch),
    )
    print(
        machine_line(
            f"local[2], {config.shuffle_partitions} shuffle partitions; "
            f"{args.versions} versions of {args.rows_per_version} change rows "
            f"({MODS_PER_TRANSACTION} mods per transaction), {args.keys} keys, MERGE {args.merge}"
        )
    )
    for name, seconds in marks.items():
        print(f"{name}\t{seconds:.1f} s")
    print_phases(progress, timers)
    if args.event_log:
        print_stateful_stages(work / "events")
    return 0


def event_log(folder: Path) -> dict[str, str]:
    """Spark's event log, uncompressed, into ``folder``."""
    return {
        "spark.eventLog.enabled": "true",
        "spark.eventLog.dir": folder.as_uri(),
        "spark.eventLog.compress": "false",
    }


STAGE_METRICS = (
    "time to commit changes",
    "RocksDB: commit - flush time",
    "RocksDB: commit - checkpoint time",
    "RocksDB: commit - file sync to external storage time",
    "RocksDB: commit - changelog commit time",
    "time to execute Python code",
)
"""The stateful stage's metrics printed, each summed over the stage's tasks (one a state store)."""


def print_stateful_stages(folder: Path) -> None:
    """The stateful stage of each batch after the first (the stage with state stores): the
    medians of its wall time, its tasks' wall and CPU time, and ``STAGE_METRICS``, in ms."""
    stages: list[tuple[int, dict[str, float]]] = []
    tasks: dict[int, list[dict[str, Any]]] = {}
    for path in folder.rglob("events_*"):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event["Event"] == "SparkListenerTaskEnd":
                tasks.setdefault(event["Stage ID"], []).append(event["Task Metrics"])
            elif event["Event"] == "SparkListenerStageCompleted":
                stage = _stateful_stage(event["Stage Info"])
                if stage is not None:
                    stages.append(stage)
    later = stages[1:]
    for stage_id, figures in later:
        ran = tasks.get(stage_id, [])
        figures["tasks' wall time"] = sum(t["Executor Run Time"] for t in ran)
        figures["tasks' CPU time"] = sum(t["Executor CPU Time"] for t in ran) / 1e6
    print(f"stateful stage, {len(later)} batches after the first\tmedian ms (summed over tasks)")
    for name in later[0][1] if later else ():
        print(f"  {name}\t{statistics.median(figures[name] for _, figures in later):.0f}")


def _stateful_stage(info: dict[str, Any]) -> tuple[int, dict[str, float]] | None:
    """A stage's id, and its wall time and ``STAGE_METRICS``; None without a state store."""
    metrics = {a.get("Name"): a.get("Value") for a in info.get("Accumulables", [])}
    if "time to commit changes" not in metrics:
        return None
    return info["Stage ID"], {
        "stage's wall time": info["Completion Time"] - info["Submission Time"],
        **{name: float(metrics.get(name) or 0) for name in STAGE_METRICS},
    }


def profile(
    config: PipelineConfig, timers: Timers, extra: dict[str, str]
) -> tuple[dict[str, float], list[Any]]:
    """The job's query over the change log, available-now: the marks on the way to its first
    batch (seconds) and the progress of each batch that read rows."""
    marks = {"process start → profile start (imports, change log landed)": since_process_start()}
    began = time.monotonic()
    spark = build_session(
        "microbatch-profile",
        master="local[2]",
        shuffle_partitions=config.shuffle_partitions,
        extra={**spark_settings(config), **extra},
    )
    spark.sparkContext.setLogLevel("ERROR")
    marks["Spark session"] = time.monotonic() - began
    began = time.monotonic()
    log = null_logger()
    plan = plan_deployment(config, log)
    for table, shape in plan.shapes.items():
        ensure_mirror(spark, mirror_uri(config.mirror_root, table), shape, log)
    marks["deployment plan and mirrors"] = time.monotonic() - began
    query_started = since_process_start()
    query = start_query(spark, config, plan, JobStats(), log, PipelineMetrics())
    marks["query started (start_query returned), from process start"] = since_process_start()
    query.awaitTermination()
    marks["first batch done, from process start"] = timers.ended_at[0]
    marks["first batch done, from start_query"] = timers.ended_at[0] - query_started
    progress = [p for p in query.recentProgress if p["numInputRows"] > 0]
    spark.stop()  # its event log complete
    return marks, progress


def print_phases(progress: list[Any], timers: Timers) -> None:
    """Each phase's seconds: the first batch's, and the median and range of the later ones."""
    print("phase\tfirst batch s\tlater batches median s\tmin-max s")
    phases: dict[str, list[float]] = {
        f"spark {name}": [p["durationMs"].get(name, 0) / 1000 for p in progress]
        for name in SPARK_PHASES
    }
    phases["write_batch"] = timers.write_batch
    phases["  MERGE"] = timers.merge
    phases["  rest (stateful rows: persist, count, collect)"] = [
        whole - merge for whole, merge in zip(timers.write_batch, timers.merge, strict=True)
    ]
    for name, values in phases.items():
        later = values[1:]
        print(
            f"{name}\t{values[0]:.2f}\t{statistics.median(later):.2f}\t"
            f"{min(later):.2f}-{max(later):.2f}"
        )


if __name__ == "__main__":
    sys.exit(main())
