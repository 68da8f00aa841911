"""A new state generation's initial state, read from the mirrors (a rebase): no replay of history.

Each mirror row becomes one key's entry: its keys as the change log spells them (``_cdc_keys``),
its image taken back into state (``pipeline.types.state_from_seed``), and the position of its
last applied change (``_cdc_last_applied``), so older rows that arrive later (an on-demand
snapshot's images at T1) stay ignored as before. A row written before the mirrors kept those two
columns gets its keys rebuilt from its key columns, where the change log's spelling is certain
(INT64, STRING, BYTES, BOOL, DATE and types kept as text), and the cut's position. Deleted keys
need no tombstone: a valid change log never brings an older row of a deleted key after its delete
(docs/design.md, contract 3). Change statistics start again at the rebase.

The seed is written once, into the new generation's folder, before the generation is made
current, so a restart before its first batch loads the same rows.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from ingest.model.records import ColumnType
from pipeline.columns import KEYS_COLUMN, LAST_APPLIED_COLUMN, POSITION_COLUMN, mirror_uri
from pipeline.shapes import TableShape
from pipeline.state.variables import LAST_APPLIED, row_variable
from pipeline.types import is_mapped, is_timestamp, spark_type

SPELLED_EXACTLY = {"INT64", "ENUM", "STRING", "BYTES", "BOOL", "DATE"}
"""Key types whose change-log spelling a mirror value gives back exactly."""


class SeedRefused(RuntimeError):
    """The mirrors cannot seed state exactly; the message says why and what to do."""


def write_seed(
    spark: SparkSession,
    mirror_root: str,
    shapes: Mapping[str, TableShape],
    seed_uri: str,
    cut_position: tuple[str, str, str, int],
) -> int:
    """Write the mirrors' rows as initial state to ``seed_uri``; the number of keys."""
    frames = [
        _table_seed(spark, mirror_root, shape, cut_position) for _, shape in sorted(shapes.items())
    ]
    present = [frame for frame in frames if frame is not None]
    if not present:
        return 0
    seed = functools.reduce(lambda a, b: a.unionByName(b, allowMissingColumns=True), present)
    seed.write.mode("overwrite").parquet(seed_uri)
    return spark.read.parquet(seed_uri).count()


def _table_seed(
    spark: SparkSession,
    mirror_root: str,
    shape: TableShape,
    cut_position: tuple[str, str, str, int],
) -> DataFrame | None:
    from deltalake import DeltaTable

    uri = mirror_uri(mirror_root, shape.name)
    if not DeltaTable.is_deltatable(uri):
        return None
    mirror = spark.read.format("delta").load(uri)
    present = set(mirror.columns)
    keys = _keys(mirror, shape, present)
    position = F.struct(
        *[
            F.lit(v).cast(f.dataType).alias(f.name)
            for v, f in zip(cut_position, LAST_APPLIED.fields, strict=True)
        ]
    )
    if POSITION_COLUMN in present:
        position = F.coalesce(F.col(POSITION_COLUMN), position)
    image = F.struct(*[_transported(c) if c.name in present else _absent(c) for c in shape.columns])
    return mirror.select(
        F.lit(shape.name).alias("table_name"),
        keys.alias("keys"),
        image.alias(row_variable(shape.name)),
        position.alias(LAST_APPLIED_COLUMN),
    )


def _keys(mirror: DataFrame, shape: TableShape, present: set[str]) -> Column:
    """``_cdc_keys``, or the keys rebuilt where the change log's spelling is certain."""
    stored = F.col(KEYS_COLUMN) if KEYS_COLUMN in present else F.lit(None).cast(T.StringType())
    unspelled = [c for c in shape.key_columns if not _spelled_exactly(c)]
    if unspelled:
        lacking = mirror.where(stored.isNull()).limit(1).count() if KEYS_COLUMN in present else 1
        if lacking:
            names = ", ".join(f"{c.name} {c.type.get('code')}" for c in unspelled)
            raise SeedRefused(
                f"table {shape.name}: rows written before the mirror kept its keys as the change "
                f"log spells them, and a key column's spelling cannot be rebuilt exactly "
                f"({names}); replay the change log into a new checkpoint instead "
                "(docs/operations.md, Running for years)"
            )
        return stored
    spelled = F.struct(*[_spelled(c) for c in sorted(shape.key_columns, key=lambda c: c.name)])
    rebuilt = F.to_json(spelled, {"ignoreNullFields": "false"})
    return F.coalesce(stored, rebuilt)


def _spelled_exactly(column: ColumnType) -> bool:
    code = column.type.get("code")
    return code in SPELLED_EXACTLY or not is_mapped(column.type)


def _spelled(column: ColumnType) -> Column:
    """A key column as the change log spells it (``canonical_json`` of Spanner's wire JSON:
    keys sorted, INT64 as text, BYTES as base64), for ``SPELLED_EXACTLY`` and text types."""
    value = F.col(_quoted(column.name))
    code = column.type.get("code")
    if code in ("INT64", "ENUM", "DATE"):
        value = value.cast(T.StringType())
    elif code == "BYTES":
        value = F.base64(value)
    return value.alias(column.name)


def _transported(column: ColumnType) -> Column:
    """A mirror column as the seed carries it: timestamps as epoch microseconds, exact at any
    year and in any session time zone; everything else as the mirror holds it."""
    value = F.col(_quoted(column.name))
    if is_timestamp(column.type):
        if column.type.get("code") == "ARRAY":
            value = F.transform(value, F.unix_micros)
        else:
            value = F.unix_micros(value)
    return value.alias(column.name)


def _absent(column: ColumnType) -> Column:
    """A column the mirror does not have yet: NULL, typed as the seed carries it."""
    data_type = T.LongType() if is_timestamp(column.type) else spark_type(column.type)
    if isinstance(data_type, T.LongType) and column.type.get("code") == "ARRAY":
        data_type = T.ArrayType(T.LongType())
    return F.lit(None).cast(data_type).alias(column.name)


def _quoted(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"
