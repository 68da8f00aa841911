"""The operator's output written many keys to an Arrow batch (``pipeline/worker_output.py``)."""

from __future__ import annotations

import io
import struct

import pyarrow as pa
from pyspark.sql import Row
from pyspark.sql import types as T
from pyspark.sql.pandas import serializers

from pipeline import worker_output

OUTPUT = T.StructType(
    [
        T.StructField("keys", T.StringType()),
        T.StructField("row_a", T.StructType([T.StructField("v", T.BinaryType())])),
        T.StructField("row_b", T.StructType([T.StructField("n", T.LongType())])),
    ]
)
OutputRow = Row(*OUTPUT.fieldNames())


def written(groups: list[list[Row]]) -> list[list[dict]]:
    """What the worker writes for ``groups`` (each a key's output rows): each batch's rows."""
    stream = io.BytesIO()
    serializer = serializers.TransformWithStateInPySparkRowSerializer(
        arrow_max_records_per_batch=10_000
    )
    serializer.dump_stream(([(iter(rows), OUTPUT)] for rows in groups), stream)
    stream.seek(0)
    if not stream.getvalue():
        return []
    assert struct.unpack("!i", stream.read(4))[0] == serializers.SpecialLengths.START_ARROW_STREAM
    return [
        pa.Table.from_arrays(batch.column(0).flatten(), names=OUTPUT.fieldNames()).to_pylist()
        for batch in pa.ipc.open_stream(stream)
    ]


def test_installed_over_pyspark_4_2_s_method() -> None:
    assert worker_output.install()
    owner = serializers.TransformWithStateInPySparkRowSerializer
    assert owner.dump_stream is worker_output.dump_stream


def test_every_key_s_rows_in_order_in_few_batches_bounded_by_bytes() -> None:
    worker_output.install()
    small = [[OutputRow(f"[{i}]", None, (i,))] if i % 3 else [] for i in range(3000)]
    batches = written(small)
    expected = [{"keys": f"[{i}]", "row_a": None, "row_b": {"n": i}} for i in range(3000) if i % 3]
    assert [r for b in batches for r in b] == expected
    assert len(batches) <= 4, [len(b) for b in batches]  # not one per key

    wide = [[OutputRow(f"[{i}]", (bytes([i]) * (3 << 20),), None)] for i in range(6)]
    batches = written(wide)
    assert [r["row_a"]["v"][:1] for b in batches for r in b] == [bytes([i]) for i in range(6)]
    assert max(len(b) for b in batches) <= 2  # 3 MiB rows: at most two to a 4 MiB batch

    assert written([]) == []  # no key: nothing written, as PySpark's own
