"""Pipeline benchmark: change rows/s and micro-batch latency, three ways, on the same change log.

- ``row``: the job itself (``pipeline.query.start_query``): transformWithState, Row API.
- ``pandas``: the same processor behind transformWithStateInPandas.
- ``stateless``: no state; each micro-batch keeps the newest change per key (a window) and runs
  the same MERGE. It is not a correct mirror for partial updates or replays; it prices the state.
- ``memory``: the job's processor with its state kept in the Python worker's memory instead of
  Spark's state server (correct here only because each key stays in one worker): what the
  state-server calls cost, against ``row``.
- ``operator``: the same transformWithState over the same groups, with a processor that reads its
  rows and returns nothing: what Spark's operator costs per group before any state call.
- ``read-first``: the job's processor made to read every key in its first batch too (a seeded
  store's first batch), against ``row``, which knows batch 0 of an unseeded store is empty.

Each size lands a synthetic change log (one table, INSERT then UPDATEs of random keys, 10 mods
per transaction) through the real ingest sink in ``--batches`` versions, read one version per
micro-batch (``maxFilesPerTrigger=1``), ``availableNow``. Rows/s counts change rows over the
query's wall time; latency is Spark's ``triggerExecution`` per micro-batch; state size is the
checkpoint's ``state`` folder on disk.

Usage: python bench/pipeline_throughput.py [--sizes 100000:10000,1000000:100000] [--batches 10]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pandas as pd
from pyspark.sql import DataFrame, Window
from pyspark.sql import functions as F
from pyspark.sql import types as T

from emulator.machine import machine_line
from ingest.delta.sink import DeltaChangeLogSink
from ingest.model.records import ColumnType, DataChangeRecord, Mod, Transaction
from ingest.model.resume import ResumablePartitions, ResumePoint
from ingest.model.timestamps import parse_rfc3339, to_rfc3339
from pipeline.batch_writer import JobStats
from pipeline.columns import OPERATION, mirror_uri
from pipeline.config import PipelineConfig
from pipeline.deployment import Plan, plan_deployment
from pipeline.landing import write_batch
from pipeline.metrics import PipelineMetrics
from pipeline.mirror import ensure_mirror
from pipeline.processor import INPUT_COLUMNS, ChangeApplier, output_schema
from pipeline.query import read_changes, spark_settings, start_query
from pipeline.session import build_session
from pipeline.state.variables import row_variable
from pipeline.stream_start import fresh_start
from runtime.logs import null_logger

COLUMNS = (
    ColumnType("account_id", {"code": "INT64"}, True, 1),
    ColumnType("owner", {"code": "STRING"}, False, 2),
    ColumnType("balance", {"code": "INT64"}, False, 3),
    ColumnType("updated_at", {"code": "TIMESTAMP"}, False, 4),
)
MODS_PER_TRANSACTION = 10
START = parse_rfc3339("2026-11-22T00:00:00Z")


def one_record_transaction(
    clock: int, number: int, columns: tuple[ColumnType, ...], mods: tuple[Mod, ...], mod_type: str
) -> Transaction:
    """A transaction of one data change record of table ``accounts``, as the sink lands it."""
    record = DataChangeRecord(
        commit_timestamp=clock,
        record_sequence="00000000",
        server_transaction_id=f"tx-{number:09d}",
        is_last_record_in_transaction_in_partition=True,
        table_name="accounts",
        column_types=columns,
        mods=mods,
        mod_type=mod_type,
        value_capture_type="NEW_ROW_AND_OLD_VALUES",
        number_of_records_in_transaction=1,
        number_of_partitions_in_transaction=1,
        transaction_tag="",
        is_system_transaction=False,
    )
    return Transaction(clock, record.server_transaction_id, (record,))


def account_transaction(
    clock: int, number: int, keys: Iterable[int], balance: Callable[[int], int], mod_type: str
) -> Transaction:
    """One transaction writing ``keys`` of ``accounts`` at ``clock`` (owner, balance, updated_at):
    the benches' change logs are made of these."""
    stamp = to_rfc3339(clock)
    mods = tuple(
        Mod(
            {"account_id": str(k)},
            {"owner": f"owner-{k}", "balance": str(balance(k)), "updated_at": stamp},
            {},
        )
        for k in keys
    )
    return one_record_transaction(clock, number, COLUMNS, mods, mod_type)


def land_changelog(uri: str, rows: int, keys: int, versions: int, seed: int = 7) -> None:
    """INSERT every key once, then UPDATE random keys, through the real sink."""
    rng = random.Random(seed)
    sink = DeltaChangeLogSink(uri, "bench", "bench")
    sink.continue_after(None)
    clock, written, number = START, 0, 0
    per_version = rows // versions
    for _ in range(versions):
        transactions = []
        target = min(rows, written + per_version)
        while written < target:
            count = min(MODS_PER_TRANSACTION, target - written)
            if written < keys:
                chosen = list(range(written, min(keys, written + count)))
                mod_type = "INSERT"
            else:
                chosen = rng.sample(range(keys), count)
                mod_type = "UPDATE"
            clock += 1_000
            number += 1
            balance = lambda _: rng.randint(0, 10**6)  # noqa: E731
            transactions.append(account_transaction(clock, number, chosen, balance, mod_type))
            written += len(chosen)
        sink.commit(transactions, ResumePoint(clock, ResumablePartitions((), ())))


class PandasChangeApplier(ChangeApplier):
    """The job's processor behind the pandas API: rows in as DataFrames, out as one DataFrame."""

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
        records = (record for frame in rows for record in frame.to_dict("records"))
        applied = list(super().handleInputRows(key, records, timerValues))
        if applied:
            yield pd.DataFrame([self._plain(row.asDict()) for row in applied])

    def _plain(self, values: dict[str, Any]) -> dict[str, Any]:
        """Row images as dicts, which Arrow takes from pandas for a struct column."""
        for table, struct in self.structs.items():
            image = values[row_variable(table)]
            if image is not None:
                values[row_variable(table)] = dict(zip(struct.fieldNames(), image, strict=True))
        return values


class _MemoryValue:
    """A value state kept in a dict of the worker, keyed by the processor's current key."""

    def __init__(self, owner: MemoryChangeApplier) -> None:
        self.values: dict[Any, Any] = {}
        self.owner = owner

    def get(self) -> Any:
        return self.values.get(self.owner.current)

    def update(self, value: Any) -> None:
        self.values[self.owner.current] = value

    def clear(self) -> None:
        self.values.pop(self.owner.current, None)


class MemoryChangeApplier(ChangeApplier):
    """The job's processor, its entries and tombstones in the worker's memory: no state calls."""

    def init(self, handle: Any) -> None:
        super().init(handle)
        self.current: Any = None
        self.entries = {table: _MemoryValue(self) for table in self.entries}  # type: ignore[misc]
        self.tombstone = _MemoryValue(self)  # type: ignore[assignment]

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
        self.current = key
        return super().handleInputRows(key, rows, timerValues)


class RowsOnly(ChangeApplier):
    """Reads a group's rows and returns nothing: Spark's operator alone."""

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
        for _ in rows:
            pass
        return iter(())


def newest_change_per_key(batch: DataFrame, shapes: dict[str, Any]) -> DataFrame:
    """The stateless baseline's whole logic: the last change of each key in this batch wins."""
    order = Window.partitionBy("table_name", "keys").orderBy(
        *[
            F.col(c).desc()
            for c in (
                "commit_timestamp_text",
                "server_transaction_id",
                "record_sequence",
                "mod_index",
            )
        ]
    )
    newest = batch.withColumn("n", F.row_number().over(order)).where("n = 1")
    shape = shapes["accounts"]
    text = T.StructType([T.StructField(c.name, T.StringType()) for c in shape.columns])
    keys, values = F.from_json("keys", text), F.from_json("new_values", text)
    image = F.struct(
        *[
            F.coalesce(keys[f.name], values[f.name]).cast(f.dataType).alias(f.name)
            for f in shape.struct().fields
        ]
    )
    return newest.select(
        "table_name",
        "keys",
        F.when(F.col("mod_type") == "DELETE", "DELETE").otherwise("UPSERT").alias(OPERATION),
        "commit_timestamp_text",
        image.alias(row_variable("accounts")),
        F.struct(
            "commit_timestamp_text",
            "server_transaction_id",
            "record_sequence",
            F.col("mod_index").cast("int").alias("mod_index"),
        ).alias("last_applied"),
    )


ROW_PROCESSORS: dict[str, Callable[[Any], ChangeApplier]] = {
    "memory": MemoryChangeApplier,
    "operator": RowsOnly,
    "read-first": lambda shapes: ChangeApplier(shapes, seeded=True),
}


def available_now(changelog: str, work: Path, **overrides: Any) -> PipelineConfig:
    """The job over the whole change log, one version per micro-batch, then stop."""
    return PipelineConfig(
        changelog_uri=changelog,
        mirror_root=str(work / "mirrors"),
        checkpoint_uri=str(work / "checkpoint"),
        trigger="available-now",
        max_files_per_trigger=1,
        **overrides,
    )


def run_variant(spark: Any, variant: str, changelog: str, work: Path) -> dict[str, Any]:
    config = available_now(changelog, work)
    log = null_logger()
    plan = plan_deployment(config, log)
    for table, shape in plan.shapes.items():
        ensure_mirror(spark, mirror_uri(config.mirror_root, table), shape, log)
    started = time.monotonic()
    if variant == "row":
        query = start_query(spark, config, plan, JobStats(), log, PipelineMetrics())
    else:
        query = start_baseline(spark, variant, config, plan)
    query.awaitTermination()
    seconds = time.monotonic() - started
    return figures(spark, variant, query, seconds, mirror_uri(config.mirror_root, "accounts"), work)


def start_baseline(spark: Any, variant: str, config: PipelineConfig, plan: Plan) -> Any:
    """The query of a variant other than the job's own: the same read, the same MERGE of each
    batch, another way from the change log's rows to the mirror's."""
    log = null_logger()

    def merge(transform: Callable[[DataFrame], DataFrame]) -> Callable[[DataFrame, int], None]:
        def land(batch: DataFrame, batch_id: int) -> None:
            write_batch(
                transform(batch),
                batch_id,
                plan.shapes,
                config.mirror_root,
                variant,
                log,
                config.local_merge_max_rows,
            )

        return land

    start = fresh_start(config.changelog_uri, config.checkpoint_uri).version
    changes = read_changes(spark, config, start).select(*INPUT_COLUMNS)
    grouped = changes.groupBy("table_name", "keys")
    if variant == "pandas":
        applied = grouped.transformWithStateInPandas(
            PandasChangeApplier(plan.shapes),
            output_schema(plan.shapes),
            "Update",
            "ProcessingTime",
        )
        sink = applied.writeStream.foreachBatch(merge(lambda b: b))
    elif variant in ROW_PROCESSORS:
        processor = ROW_PROCESSORS[variant](plan.shapes)
        applied = grouped.transformWithState(
            processor, output_schema(plan.shapes), "Update", "ProcessingTime"
        )
        sink = applied.writeStream.foreachBatch(merge(lambda b: b))
    else:
        sink = changes.writeStream.foreachBatch(
            merge(lambda b: newest_change_per_key(b, plan.shapes))
        )
    return (
        sink.option("checkpointLocation", config.checkpoint_uri).trigger(availableNow=True).start()
    )


def figures(
    spark: Any, variant: str, query: Any, seconds: float, mirror: str, work: Path
) -> dict[str, Any]:
    """What the ended query's progress reports, its state's size on disk and the mirror's rows."""
    progress = [p for p in query.recentProgress if p["numInputRows"] > 0]
    store = [o["customMetrics"] for p in progress for o in p["stateOperators"]]
    batch_ms = sorted(p["durationMs"]["triggerExecution"] for p in progress)
    state_bytes = sum(
        f.stat().st_size for f in (work / "checkpoint" / "state").rglob("*") if f.is_file()
    )
    return {
        "variant": variant,
        "input_rows": sum(p["numInputRows"] for p in progress),
        "seconds": seconds,
        "batches": len(batch_ms),
        "batch_ms_p50": batch_ms[len(batch_ms) // 2] if batch_ms else 0,
        "batch_ms_max": batch_ms[-1] if batch_ms else 0,
        "state_mib": state_bytes / 2**20,
        "state_reads": sum(m.get("rocksdbGetCount", 0) for m in store),
        "state_writes": sum(m.get("rocksdbPutCount", 0) for m in store),
        "mirror_rows": spark.read.format("delta").load(mirror).count(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--sizes",
        default="100000:10000,100000:100000,1000000:10000,1000000:100000",
        help="rows:keys pairs",
    )
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--variants", default="row,pandas,stateless")
    parser.add_argument("--shuffle-partitions", type=int, default=8)
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="pipeline-bench-"))
    spark = build_session(
        "pipeline-bench",
        master="local[2]",
        shuffle_partitions=args.shuffle_partitions,
        extra=spark_settings(PipelineConfig()),
    )
    spark.sparkContext.setLogLevel("ERROR")
    print(
        machine_line(
            f"local[2], shuffle partitions {args.shuffle_partitions}, "
            f"{args.batches} micro-batches per run"
        )
    )
    print(
        "rows\tkeys\tvariant\trows/s\tseconds\tbatches\tbatch p50 ms\tbatch max ms\tstate MiB\t"
        "state reads\tstate writes"
    )
    for size in args.sizes.split(","):
        rows, keys = (int(v) for v in size.split(":"))
        changelog = str(root / f"changelog-{rows}-{keys}")
        began = time.monotonic()
        land_changelog(changelog, rows, keys, args.batches)
        print(f"# landed {rows} change rows in {time.monotonic() - began:.0f} s", flush=True)
        for variant in args.variants.split(","):
            work = root / f"{variant}-{rows}-{keys}"
            result = run_variant(spark, variant, changelog, work)
            assert result["input_rows"] == rows, result
            assert result["mirror_rows"] == (0 if variant == "operator" else keys), result
            print(
                f"{rows}\t{keys}\t{variant}\t{rows / result['seconds']:,.0f}\t"
                f"{result['seconds']:.1f}\t{result['batches']}\t{result['batch_ms_p50']:,}\t"
                f"{result['batch_ms_max']:,}\t{result['state_mib']:.1f}\t"
                f"{result['state_reads']:,}\t{result['state_writes']:,}",
                flush=True,
            )
            shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(changelog, ignore_errors=True)
    spark.stop()
    print(json.dumps({"work": str(root)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
