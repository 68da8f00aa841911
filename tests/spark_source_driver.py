"""A Spark source driver for the scripted server, in a process of its own: ``spark-run`` opens
its stream through Spanner's information schema, which the scripted server does not serve, so
this driver starts the job and runs the same query (``start_query``, ``BatchLanding``) until the
change log's low watermark reaches ``--until``. Its executors find the server as the client finds
an emulator (``SPANNER_EMULATOR_HOST``)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from ingest.delta.landing import ChangeLogLanding, WatchedColumnsPoll
from ingest.delta.sink import DeltaChangeLogSink
from ingest.model.timestamps import Nanos, parse_rfc3339, to_rfc3339
from ingest.sparksource.landing import BatchLanding, LandedBatch
from ingest.sparksource.run import SparkSourceConfig, spark_session, start_query, wave_reader
from ingest.sparksource.source import SourceOptions
from runtime.logs import make_logger

JOB = "scripted.s"
OWNER = "spark-scripted"


def command(
    port: int,
    table: Path,
    checkpoint: Path,
    start: Nanos,
    until: Nanos,
    master: str = "local[2]",
    mutable_key_range: bool = False,
    max_batch_span_s: float = 60.0,
) -> list[str]:
    """The command line that runs this driver in a new process of this interpreter."""
    return [
        sys.executable,
        "-m",
        "tests.spark_source_driver",
        f"--port={port}",
        f"--table={table}",
        f"--checkpoint={checkpoint}",
        f"--start={to_rfc3339(start)}",
        f"--until={to_rfc3339(until)}",
        f"--master={master}",
        f"--max-batch-span-s={max_batch_span_s}",
        *(["--mutable-key-range"] if mutable_key_range else []),
    ]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--table", required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--start", required=True)
    parser.add_argument("--until", required=True)
    parser.add_argument("--mutable-key-range", action="store_true")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--partitions-per-task", type=int, default=100)
    parser.add_argument("--max-batch-span-s", type=float, default=60.0)
    args = parser.parse_args()
    os.environ["SPANNER_EMULATOR_HOST"] = f"127.0.0.1:{args.port}"
    log = make_logger(sys.stdout).bind(job_id=JOB)
    sink = DeltaChangeLogSink(args.table, JOB, OWNER, log=log)
    checkpoint = sink.latest_checkpoint()
    sink.continue_after(checkpoint)
    if checkpoint is None:
        sink.start_job(parse_rfc3339(args.start))
    options = SourceOptions(
        "scripted",
        "scripted",
        "scripted",
        "s",
        "googlesql",
        args.mutable_key_range,
        args.table,
        JOB,
        partitions_per_task=args.partitions_per_task,
        max_batch_span_s=args.max_batch_span_s,
    )
    until = parse_rfc3339(args.until)
    reached: list[LandedBatch] = []
    session = spark_session(SparkSourceConfig(master=args.master))
    landing = BatchLanding(
        ChangeLogLanding(sink, WatchedColumnsPoll(None, 10.0, log), log),
        on_landed=lambda batch: reached.append(batch) if batch.low_watermark >= until else None,
        read_wave=wave_reader(session, options),
    )
    query = start_query(session, options, landing, args.checkpoint, 0.5)
    log.info("spark_source_started")
    while not reached and query.isActive:
        time.sleep(0.2)
    query.stop()
    session.stop()
    return 0 if reached else 1


if __name__ == "__main__":
    sys.exit(main())
