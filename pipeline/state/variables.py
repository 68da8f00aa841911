"""The state variables the processor keeps, and their schemas for a set of table shapes."""

from __future__ import annotations

from collections.abc import Mapping

from pyspark.sql import types as T

from pipeline.shapes import TableShape

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
STATE_LAYOUT = 4
"""How row images map Spanner types to state fields (pipeline.types.state_type), and how a key's
state is split into variables. Layout 1 kept each column in its mirror type; layout 2 keeps STRING
as bytes and arrays as JSON text; layout 3 keeps a key's image, position and statistics in one
value (``entry_<table>``), read and written with one state-server call each instead of three;
layout 4 keeps TIMESTAMP as epoch microseconds (the same Avro long: Spark evolves a layout-3
entry in place)."""
LEGACY_BOOKKEEPING = ("last_applied", "change_stats")
"""Layout 2's variables for what layout 3 keeps in the entry, with the ``row_<table>`` images."""


def row_variable(table: str) -> str:
    """The output column of a table's mirror rows; in layout 2 also its image variable."""
    return f"row_{table}"


def entry_variable(table: str) -> str:
    return f"entry_{table}"


def entry_struct(shape: TableShape) -> T.StructType:
    """One key's state: the row image (one field per column generation), the position of the
    last applied row and the change statistics, nested so no column name can collide."""
    return T.StructType(
        [
            T.StructField("image", shape.state_struct()),
            T.StructField("last_applied", LAST_APPLIED),
            T.StructField("change_stats", CHANGE_STATS),
        ]
    )


def legacy_variables(recorded: Mapping[str, T.StructType]) -> dict[str, T.StructType]:
    """Layout 2's per-key variables of a checkpoint, as recorded (frozen: nothing writes them).

    A key not rewritten since the checkpoint moved to layout 3 still has its image and position
    there; they are kept declared, whatever the tables do later, so such a key is read from them
    once and moved into its entry.
    """
    if not all(name in recorded for name in LEGACY_BOOKKEEPING):
        return {}
    return {
        name: struct
        for name, struct in recorded.items()
        if name in LEGACY_BOOKKEEPING or name.startswith("row_")
    }


def state_schemas(
    shapes: Mapping[str, TableShape], recorded: Mapping[str, T.StructType] | None = None
) -> dict[str, T.StructType]:
    """Every state variable of the change applier: one entry per table, the tombstone, and the
    layout-2 variables a recorded checkpoint still holds."""
    schemas = {entry_variable(name): entry_struct(shape) for name, shape in sorted(shapes.items())}
    schemas["tombstone"] = TOMBSTONE
    schemas.update(legacy_variables(recorded or {}))
    return schemas
