"""Commit → mirror past what the emulator allows: the stream served by the scripted server.

The emulator's own CPU grows with its stream (about 1.6 cores at 100 transactions/s here), so
end-to-end figures above about 40/s on two cores measure the emulator. Here the stream comes from
the tests' scripted gRPC server in a process of its own, in real time (each record served once
the wall clock reaches its commit timestamp, heartbeats in silences), through the real client:

- ingest, in a process of its own (this script with ``--ingest``): the reader, the Batcher and
  the Delta sink, wired and configured as ``make run`` configures the service (flush latency
  500 ms, checkpoint every 5 s); the service's catalog queries (dialect, stream, watched
  columns) are left out, as the scripted server does not serve ``information_schema``, and the
  table's watched columns are the records' own;
- the pipeline: ``python -m pipeline run`` in a process of its own, as ``make run`` starts it.

The job begins as a job the service starts does, with a schema row of its table in its first
version, and the pipeline starts on it: the stream begins once Spark's first batch (that schema
row) has ended, however long Spark took to start. Transactions insert ``--rows`` new rows into one
table (an INT64 key and 9 columns of mixed types), 5/s during ``--warmup`` (the first batches with
rows: the mirror's first MERGE, the state's first keys) and then at each of ``--rates``; a third of
them spread their rows over several of ``--partitions`` partitions, which split, move and merge.
For each commit after the warm-up: commit → mirror (the end of the micro-batch that made it
readable), split into ingest (commit → the change-log commit whose low watermark passed it) and
pipeline (that → the micro-batch's end), as p50 and p99; and the cores each process (and its
children: Spark's JVM) used from the end of the warm-up on, to show who was busy.

Usage: python bench/commit_to_mirror.py [--rates 20,100,500] [--seconds 60] [--warmup 15]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from emulator.machine import machine_line
from runtime.process import PROCESS_ENVIRONMENT

os.environ.pop("SPANNER_EMULATOR_HOST", None)
os.environ.update(PROCESS_ENVIRONMENT)  # it forks after using gRPC: runtime/process.py

from decode_speed import in_place_of, production_record
from wide_reader import serve

from emulator.local_run import pipeline_process
from emulator.processes import Process, tree_cpu_seconds
from emulator.run_report import (
    landing_marks,
    mirror_latencies,
    percentile,
    pipeline_latencies,
    visible_at,
)
from ingest.changestream.config import ReaderConfig
from ingest.changestream.reader import ChangeStreamReader
from ingest.delta.batcher import Batcher
from ingest.delta.landing import ChangeLogLanding, WatchedColumnsPoll
from ingest.delta.sink import DeltaChangeLogSink
from ingest.model.records import Mod, Transaction
from ingest.model.timestamps import NANOS_PER_SECOND, Nanos, parse_rfc3339
from runtime.logs import make_logger
from runtime.stopping import stop_on_signals
from tests.scripted_spanner import Script, parents_of, scripted_query
from tests.simulation import Topology, build_wide_topology

WARMUP_RATE = 5.0
"""Transactions/s of the warm-up: its batches carry no backlog."""
TABLE = production_record(0, 10)
"""The table the transactions insert into: its name and columns."""
JOB, OWNER = "bench", "owner"
"""The job ``begin_job`` begins and the ingest process continues, as its lease's one owner."""
FLUSH_LATENCY_S = 0.5
CHECKPOINT_INTERVAL_S = 5.0
"""As ``make run`` configures the service (emulator/local_run.py)."""


def inserting_topology(
    rate: float, warmup: float, seconds: float, partitions: int, rows: int, start: Nanos
) -> Topology:
    """A live topology from ``start`` whose transactions insert new rows of one table, at
    WARMUP_RATE for ``warmup`` seconds, then at ``rate``."""
    rng = random.Random(25)
    horizon = int((warmup + seconds) * NANOS_PER_SECOND)
    count = int(rate * (warmup + seconds))
    topology = build_wide_topology(rng, partitions, max(2, partitions // 5), count, start, horizon)
    measured_from = start + int(warmup * NANOS_PER_SECOND)
    kept = [
        t
        for t in topology.transactions
        if t.commit_timestamp >= measured_from or rng.random() < WARMUP_RATE / rate
    ]
    shaped = []
    for number, transaction in enumerate(kept):
        records = []
        for record in transaction.records:
            sequence = int(record.record_sequence)
            template = production_record(number, 10)
            mods = tuple(
                Mod({"c0": str((number * 8 + sequence) * rows + row)}, mod.new_values, {})
                for row, mod in enumerate(template.mods[:rows])
            )
            inserting = dataclasses.replace(
                template, mods=mods, mod_type="INSERT", value_capture_type="NEW_ROW"
            )
            records.append(in_place_of(inserting, record))
        shaped.append(
            Transaction(
                transaction.commit_timestamp, transaction.server_transaction_id, tuple(records)
            )
        )
    return dataclasses.replace(topology, transactions=shaped)


def begin_job(changelog: str) -> None:
    """The job's first version, as the service lands it for a new job: its start and a schema
    row of the captured table, so the pipeline knows the table before its first row."""
    sink = DeltaChangeLogSink(changelog, JOB, OWNER)
    sink.start_job(time.time_ns(), None, {TABLE.table_name: TABLE.column_types})


def ingest(port: int, changelog: str, start: Nanos) -> None:
    """The ingest half, in a process of its own until SIGTERM, continuing the job
    ``begin_job`` began and reading from ``start``: the reader, the Batcher and the sink as the
    service wires them; its events (``delta_commit``) as JSON lines on stdout."""
    log = make_logger(sys.stdout)
    sink = DeltaChangeLogSink(changelog, JOB, OWNER, log=log)
    sink.continue_after(sink.latest_checkpoint())
    landing = ChangeLogLanding(
        sink, WatchedColumnsPoll(None, 10.0, log), log, 86400 * NANOS_PER_SECOND
    )
    batcher = Batcher(
        landing,
        flush_latency_s=FLUSH_LATENCY_S,
        max_rows=20_000,
        checkpoint_interval_s=CHECKPOINT_INTERVAL_S,
    )
    reader = ChangeStreamReader(scripted_query(port), ReaderConfig(start_timestamp=start), log)
    stop = stop_on_signals(log)
    reader.run(batcher.on_release, stop, on_tick=batcher.on_tick)
    batcher.flush()


def run_case(args: argparse.Namespace, rate: float, folder: Path) -> dict[str, Any]:
    folder.mkdir(parents=True)
    changelog = folder / "changelog"
    begin_job(str(changelog))
    pipeline = pipeline_process(folder, changelog)
    pipeline_started = time.time_ns()
    running: dict[str, subprocess.Popen[Any]] = {"pipeline": pipeline.start()}
    try:
        pipeline.wait_for("pipeline_batch", 1, timeout=600, process=running["pipeline"])
        start = time.time_ns() + 3 * NANOS_PER_SECOND
        topology = inserting_topology(
            rate, args.warmup, args.seconds, args.partitions, args.rows, start
        )
        warm_until = start + int(args.warmup * NANOS_PER_SECOND)
        streams = topology.records_by_partition()
        running["server"], port = serve(
            Script(streams, parents=parents_of(streams), live=True), workers=64
        )
        ingest = Process(
            [__file__, "--ingest", f"{port},{changelog},{start}"], folder / "ingest.log", {}
        )
        running["ingest"] = ingest.start()
        last_commit = topology.transactions[-1].commit_timestamp
        deadline = time.monotonic() + args.warmup + args.seconds + 300
        cpu = cpu_until_mirrored(pipeline, running, last_commit, warm_until, deadline)
    finally:
        for name in ("ingest", "pipeline"):
            if name in running:
                running[name].send_signal(signal.SIGTERM)
                running[name].wait(timeout=60)
        if "server" in running:
            running["server"].kill()
            running["server"].wait()
    return figures(rate, topology, ingest, pipeline, (pipeline_started, warm_until), cpu)


def cpu_until_mirrored(
    pipeline: Process,
    running: dict[str, subprocess.Popen[Any]],
    last_commit: Nanos,
    warm_until: Nanos,
    deadline: float,
) -> dict[str, float]:
    """Once a batch has mirrored the last commit: each process's cores used from the warm-up's
    end (empty if it never ended)."""

    def cpu_now() -> dict[str, float]:
        return {name: tree_cpu_seconds(process.pid) for name, process in running.items()}

    baseline: tuple[int, dict[str, float]] | None = None
    while time.monotonic() < deadline:
        batches = [e for e in pipeline.events() if e["event"] == "pipeline_batch"]
        newest = [parse_rfc3339(b["newest_commit"]) for b in batches if b.get("newest_commit")]
        if newest and max(newest) >= last_commit:
            break
        assert running["pipeline"].poll() is None, "the pipeline stopped"
        if baseline is None and time.time_ns() >= warm_until:
            baseline = time.time_ns(), cpu_now()
        time.sleep(1.0)
    if baseline is None:
        return {}
    then, before = baseline
    seconds = (time.time_ns() - then) / 1e9
    return {name: (used - before[name]) / seconds for name, used in cpu_now().items()}


def figures(
    rate: float,
    topology: Topology,
    ingest: Process,
    pipeline: Process,
    times: tuple[Nanos, Nanos],
    cpu: dict[str, float],
) -> dict[str, Any]:
    """The case's latencies (``times``: when the pipeline started, when the warm-up ended);
    the first batch's time is Spark's first batch (the schema row's) from the pipeline's start."""
    pipeline_started, warm_until = times
    batches = [e for e in pipeline.events() if e["event"] == "pipeline_batch"]
    spark_first = parse_rfc3339(batches[0]["timestamp"])
    commits = [e for e in ingest.events() if e["event"] == "delta_commit"]
    first = next(parse_rfc3339(b["timestamp"]) for b in batches if b.get("newest_commit"))
    measured = [
        t.commit_timestamp
        for t in topology.transactions
        if t.commit_timestamp > max(first, warm_until)
    ]
    mirror = mirror_latencies(measured, batches)
    landed = visible_at(measured, landing_marks(commits))
    ingest_share = [(land - c) / 1e9 for c, land in zip(measured, landed, strict=True) if land]
    pipeline_share = pipeline_latencies(measured, batches, commits)
    return {
        "rate": rate,
        "committed": len(topology.transactions),
        "measured": len(measured),
        "mirrored": len(mirror),
        "batches": len(batches),
        "first_batch_s": (spark_first - pipeline_started) / 1e9,
        "first_batch_in_warmup": first <= warm_until,
        "mirror": (percentile(mirror, 0.5), percentile(mirror, 0.99)),
        "ingest": (percentile(ingest_share, 0.5), percentile(ingest_share, 0.99)),
        "pipeline": (percentile(pipeline_share, 0.5), percentile(pipeline_share, 0.99)),
        "cpu": cpu,
    }


def pair(values: tuple[float | None, float | None]) -> str:
    return "/".join("-" if v is None else f"{v:.2f}" for v in values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rates", default="20,100,500")
    parser.add_argument("--seconds", type=float, default=60.0, help="measured, after warm-up")
    parser.add_argument(
        "--warmup", type=float, default=15.0, help="stream time for the first batches with rows"
    )
    parser.add_argument("--partitions", type=int, default=10)
    parser.add_argument("--rows", type=int, default=1, help="rows per data change record")
    parser.add_argument("--ingest", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.partitions < 6:
        parser.error("--partitions must be at least 6 (transactions spread over up to 4)")
    if args.ingest:
        port, changelog, start = args.ingest.split(",")
        ingest(int(port), changelog, int(start))
        return 0
    work = Path(tempfile.mkdtemp(prefix="commit-to-mirror-"))
    print(
        machine_line(
            f"scripted server, {args.partitions} partitions, {args.rows} row(s) per record, "
            f"{args.seconds:g} s measured after {args.warmup:g} s of warm-up"
        )
    )
    print(
        "rate/s\tcommitted\tmeasured\tmirrored\tbatches\tfirst batch s\tmirror p50/p99 s"
        "\tingest p50/p99 s\tpipeline p50/p99 s\tcores: server/ingest/pipeline"
    )
    results = []
    for rate in (float(r) for r in args.rates.split(",")):
        result = run_case(args, rate, work / f"rate-{rate:g}")
        results.append(result)
        print(
            f"{rate:g}\t{result['committed']}\t{result['measured']}\t{result['mirrored']}\t"
            f"{result['batches']}\t{result['first_batch_s']:.1f}\t{pair(result['mirror'])}\t"
            f"{pair(result['ingest'])}\t{pair(result['pipeline'])}\t"
            + "/".join(
                f"{result['cpu'].get(name, 0):.2f}" for name in ("server", "ingest", "pipeline")
            ),
            flush=True,
        )
    print(json.dumps({"work": str(work)}))
    for result in results:
        if not result["first_batch_in_warmup"]:
            print(
                f"# {result['rate']:g}/s: the first batch with rows ended after the warm-up, so "
                "the first measured commits waited for it: raise --warmup"
            )
    return 0 if all(r["mirrored"] == r["measured"] > 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
