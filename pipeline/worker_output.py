"""How a Python worker sends transformWithState's output rows back to the JVM: many keys' rows
in one Arrow batch.

PySpark 4.2 (``TransformWithStateInPySparkRowSerializer.dump_stream``) writes one Arrow batch per
key: it converts the output schema to Arrow again, builds a record batch of the key's one row and
writes it, each time. That costs per key in proportion to the output's width (about 4 µs per
output column: every captured table's columns, since the output holds a struct per table) and was
half the Python workers' CPU in a batch of 100,000 new keys (bench/RESULTS.md, "Many keys in one
Arrow batch"). Spark's own master no longer has the method (SPARK-58191 moved it into the
worker); until a release does, the job installs this in its workers when the processor's module
is imported there (unpickling the processor, before the worker writes anything). The rows are
the same; only how many share a batch changes, and the JVM reads them the same way.

Installed only over the method it was written against (PySpark 4.2), never over another.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import IO, Any

import pyarrow as pa
import pyspark
from pyspark.sql.pandas import serializers
from pyspark.sql.pandas.types import to_arrow_type

BATCH_BYTES = 4 << 20
"""About how many bytes of rows a batch holds before it is written (rows of a few MiB each go
one or two to a batch, small rows up to ``BATCH_ROWS``)."""
BATCH_ROWS = 1024
"""At most this many rows a batch, whatever their size: a tenth of what Spark's own input
batches to the worker may hold (``spark.sql.execution.arrow.transformWithStateInPySpark.
maxRecordsPerBatch``, 10,000), so a run of large rows after small ones costs no more memory than
the input already may."""
REPLACED = "TransformWithStateInPySparkRowSerializer.dump_stream"


def _batches(iterator: Iterator[Any]) -> Iterator[tuple[pa.RecordBatch, Any]]:
    """The keys' rows, in their order, as few batches as ``BATCH_BYTES`` allows. The first
    batch is one row: its size sets how many rows the next ones take."""
    schema: tuple[Any, Any, pa.Schema] | None = None
    rows: list[dict[str, Any]] = []
    limit = 1
    for packed in iterator:
        key_rows, spark_type = packed[0]
        if schema is None or schema[0] is not spark_type:
            arrow_type = to_arrow_type(spark_type, timezone="UTC", prefers_large_types=False)
            schema = (spark_type, arrow_type, pa.schema(list(arrow_type)))
        for row in key_rows:
            rows.append(row.asDict(True))
            if len(rows) >= limit:
                batch = pa.RecordBatch.from_pylist(rows, schema=schema[2])
                yield batch, schema[1]
                limit = max(1, min(BATCH_ROWS, BATCH_BYTES * len(rows) // max(batch.nbytes, 1)))
                rows = []
    if schema is not None:
        yield pa.RecordBatch.from_pylist(rows, schema=schema[2]), schema[1]


def dump_stream(self: Any, iterator: Iterator[Any], stream: IO[bytes]) -> None:
    """``TransformWithStateInPySparkRowSerializer.dump_stream``, many keys to a batch."""
    return serializers.ArrowStreamUDFSerializer.dump_stream(self, _batches(iterator), stream)


def install() -> bool:
    """Put ``dump_stream`` in place of PySpark 4.2's; whether it is in place."""
    owner = getattr(serializers, "TransformWithStateInPySparkRowSerializer", None)
    current = getattr(owner, "dump_stream", None)
    if current is dump_stream:
        return True
    if not pyspark.__version__.startswith("4.2.") or getattr(current, "__qualname__", "") != (
        REPLACED
    ):
        return False
    owner.dump_stream = dump_stream  # type: ignore[union-attr]
    return True
