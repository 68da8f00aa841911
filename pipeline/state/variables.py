"""The state variables the processor keeps, and their schemas for a set of table shapes."""

from __future__ import annotations

from collections.abc import Mapping

from pyspark.sql import types as T

from pipeline.types import TableShape

LAST_APPLIED = T.StructType(
    [
        T.StructField("commit_timestamp_text", T.StringType()),
        T.StructField("server_transaction_id", T.StringType()),
        T.StructField("record_sequence", T.StringType()),
        T.StructField("mod_index", T.IntegerType()),
    ]
)
CHANGE_STATS = T.StructType(
    [
        T.StructField("inserts", T.LongType()),
        T.StructField("updates", T.LongType()),
        T.StructField("deletes", T.LongType()),
        T.StructField("first_commit_timestamp", T.TimestampType()),
        T.StructField("last_commit_timestamp", T.TimestampType()),
    ]
)
TOMBSTONE = LAST_APPLIED
"""The position of the delete, kept (with a TTL) so replays of older changes stay ignored."""
STATE_LAYOUT = 2
"""How row images map Spanner types to state fields (pipeline.types.state_type). Layout 1 kept
each column in its mirror type; layout 2 keeps STRING as bytes and arrays as JSON text."""


def row_variable(table: str) -> str:
    return f"row_{table}"


def state_schemas(shapes: Mapping[str, TableShape]) -> dict[str, T.StructType]:
    """Every state variable of the change applier: one row image per table, then bookkeeping."""
    schemas = {row_variable(name): shape.state_struct() for name, shape in sorted(shapes.items())}
    schemas.update(last_applied=LAST_APPLIED, change_stats=CHANGE_STATS, tombstone=TOMBSTONE)
    return schemas
