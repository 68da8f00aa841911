"""Does a batch's MERGE cost grow with the mirror? The driver MERGE (delta-rs, the path every batch
of up to ``local_merge_max_rows`` takes) of one 1,000-key batch into mirrors of different sizes.

Each mirror is created by ``pipeline.mirror.create_mirror`` (with its ``delta.targetFileSize``)
and holds ``rows`` rows of the benchmark's ``accounts`` shape (INT64 key, STRING, INT64,
TIMESTAMP), appended in key order ``--file-rows`` at a time, as a mirror grows from an initial
snapshot. Batches are 1,000 keys, half updates of existing keys and half inserts past
the end, either consecutive keys (``ordered``: keys that arrive in key order, as a workload that
inserts and touches recent rows) or keys spread over the whole table (``random``). Each MERGE goes
through ``pipeline.mirror.merge_on_driver``; the figure is the median of ``--repeats`` MERGEs.

Usage: python bench/mirror_merge_scaling.py [--sizes 10000,10000000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake

from emulator.machine import machine_line
from ingest.model.records import ColumnType
from pipeline.columns import KEYS_COLUMN, OPERATION, POSITION_COLUMN
from pipeline.mirror import create_mirror, merge_on_driver, mirror_struct
from pipeline.shapes import TableShape
from pipeline.state.variables import row_variable

SHAPE = TableShape(
    "accounts",
    (
        ColumnType("account_id", {"code": "INT64"}, True, 1),
        ColumnType("owner", {"code": "STRING"}, False, 2),
        ColumnType("balance", {"code": "INT64"}, False, 3),
        ColumnType("updated_at", {"code": "TIMESTAMP"}, False, 4),
    ),
)
BATCH_KEYS = 1000
STAMP = pa.scalar(dt.datetime(2026, 11, 23, tzinfo=dt.UTC), pa.timestamp("us", tz="UTC"))


def rows_of(keys: list[int]) -> pa.Table:
    count = len(keys)
    return pa.table(
        {
            "account_id": pa.array(keys, pa.int64()),
            "owner": pa.array([f"owner-{k}" for k in keys]),
            "balance": pa.array(keys, pa.int64()),
            "updated_at": pa.array([STAMP.as_py()] * count, pa.timestamp("us", tz="UTC")),
        }
    )


def bookkeeping_of(keys: list[int]) -> dict[str, pa.Array]:
    """The change-log keys and position the product keeps beside each mirror row."""
    position = {
        "commit_timestamp_text": "2026-11-23T00:00:00.000000000Z",
        "server_transaction_id": "bench",
        "record_sequence": "00000000",
        "mod_index": 0,
    }
    return {
        "keys": pa.array([f'{{"account_id":"{k}"}}' for k in keys]),
        "last_applied": pa.array([position] * len(keys), pa.struct(_POSITION_FIELDS)),
    }


_POSITION_FIELDS = [
    pa.field("commit_timestamp_text", pa.string()),
    pa.field("server_transaction_id", pa.string()),
    pa.field("record_sequence", pa.string()),
    pa.field("mod_index", pa.int32()),
]


def build_mirror(uri: str, rows: int, file_rows: int) -> None:
    """Created as the product creates a mirror, then appended to as its first batches would be."""
    create_mirror(uri, mirror_struct(SHAPE))
    for start in range(0, rows, file_rows):
        keys = list(range(start, min(rows, start + file_rows)))
        bookkeeping = bookkeeping_of(keys)
        table = rows_of(keys).append_column(KEYS_COLUMN, bookkeeping["keys"])
        table = table.append_column(POSITION_COLUMN, bookkeeping["last_applied"])
        write_deltalake(uri, table, mode="append")


def batch(keys: list[int]) -> pa.Table:
    """Processor output as the driver MERGE receives it: operation, the row image struct, the
    keys and the position."""
    image = rows_of(keys)
    columns = [c.combine_chunks() for c in image.columns]
    struct = pa.StructArray.from_arrays(columns, names=image.column_names)
    return pa.table(
        {
            "table_name": pa.array(["accounts"] * len(keys)),
            OPERATION: pa.array(["UPSERT"] * len(keys)),
            row_variable("accounts"): struct,
            **bookkeeping_of(keys),
        }
    )


def batch_keys(kind: str, rows: int, round_: int, rng: random.Random) -> list[int]:
    half = BATCH_KEYS // 2
    inserts = list(range(rows + round_ * half, rows + (round_ + 1) * half))
    if kind == "ordered":
        updates = list(range(max(0, rows - half * (round_ + 1)), rows - half * round_))
    else:
        updates = rng.sample(range(rows), half)
    return sorted(updates + inserts)


def ratio_to_first(
    baseline: dict[str, tuple[float, int]], kind: str, size: int, median: float
) -> str:
    """The median against the first size measured for the same kind of keys (recorded in
    ``baseline``), as a column to print; empty for that first size."""
    first, first_size = baseline.setdefault(kind, (median, size))
    return "" if size == first_size else f"\t({median / first:.1f}x the {first_size}-row mirror)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="10000,10000000")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--file-rows", type=int, default=1_000_000)
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="merge-scaling-"))
    print(
        machine_line(
            f"deltalake MERGE of {BATCH_KEYS}-key batches, median of {args.repeats}; "
            f"built {args.file_rows} rows at a time"
        )
    )
    print("mirror rows\tkeys\tmedian s\tfiles rewritten (median)\tbuild s")
    rng = random.Random(11)
    baseline: dict[str, tuple[float, int]] = {}
    for size in (int(s) for s in args.sizes.split(",")):
        for kind in ("ordered", "random"):
            uri = str(root / f"mirror-{size}-{kind}")
            began = time.monotonic()
            build_mirror(uri, size, args.file_rows)
            built = time.monotonic() - began
            seconds, rewritten = [], []
            for round_ in range(args.repeats):
                source = batch(batch_keys(kind, size, round_, rng))
                before = DeltaTable(uri).version()
                started = time.monotonic()
                merge_on_driver(uri, SHAPE, source, "bench", round_)
                seconds.append(time.monotonic() - started)
                table = DeltaTable(uri)
                assert table.version() == before + 1
                metrics = table.history(1)[0].get("operationMetrics", {})
                rewritten.append(int(metrics.get("num_target_files_removed", 0)))
            median = statistics.median(seconds)
            ratio = ratio_to_first(baseline, kind, size, median)
            print(
                f"{size}\t{kind}\t{median:.3f}\t{statistics.median(rewritten):.0f}\t{built:.0f}"
                f"{ratio}",
                flush=True,
            )
            shutil.rmtree(uri, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
