"""Mirror MERGEs over any primary key Spanner accepts (issue 24): one to four key columns of every
key type, in any order, NULLs in nullable key columns, names that SQL must quote.

Each example writes two or three micro-batches of processor output (one row per key: the final
image, UPSERT, or the key alone, DELETE) into a new mirror through ``write_batch``, the batch
function's own entry point, once merged on the driver by delta-rs and once by delta-spark, and
compares both mirrors with a plain Python model: a dict from key tuple to row. A NULL key once
stopped the driver MERGE for good (delta-rs read ``a IS NOT DISTINCT FROM b AND ...`` with the
wrong precedence).
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
from deltalake import DeltaTable
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ingest.model.records import ColumnType
from pipeline.catalog import scan
from pipeline.columns import OPERATION, mirror_uri
from pipeline.landing import write_batch
from pipeline.mirror import create_mirror, mirror_struct
from pipeline.processor import output_schema
from pipeline.shapes import TableShape
from pipeline.state.variables import row_variable
from runtime.logs import null_logger

TABLE = "ck"
NAMES = ("select", "Order", "from", "key", "AND", "null", "Is", "t", "s", "Group", "distinct")
"""Column names SQL must quote: reserved words, mixed case, the MERGEs' own aliases."""
KEY_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "INT64": st.integers(-(2**63), 2**63 - 1),
    "STRING": st.text(max_size=4),
    "BYTES": st.binary(max_size=4),
    "NUMERIC": st.decimals(
        min_value=Decimal("-99999999999999999999999999999.999999999"),
        max_value=Decimal("99999999999999999999999999999.999999999"),
        places=9,
    ),
    "DATE": st.dates(),
    "TIMESTAMP": st.datetimes(timezones=st.just(dt.UTC)),
    "BOOL": st.booleans(),
    # -0.0 and 0.0 are one key in Spanner, and in Spark's and delta-rs's equality.
    "FLOAT64": st.floats().map(lambda f: f + 0.0),
    "FLOAT32": st.floats(width=32).map(lambda f: f + 0.0),
}


def spanner_type(code: str) -> dict[str, str]:
    return {"code": code}


@st.composite
def table_shapes(draw: st.DrawFn) -> tuple[TableShape, tuple[bool, ...]]:
    """A table of 1-4 key columns in any order and one value column; which keys are nullable."""
    names = draw(st.lists(st.sampled_from(NAMES), min_size=2, max_size=5, unique=True))
    *keys, value = names
    codes = [draw(st.sampled_from(sorted(KEY_VALUES))) for _ in keys]
    columns = [
        ColumnType(name, spanner_type(code), True, n)
        for n, (name, code) in enumerate(zip(keys, codes, strict=True), 1)
    ]
    columns.append(ColumnType(value, spanner_type("INT64"), False, len(keys) + 1))
    nullable = tuple(draw(st.booleans()) for _ in keys)
    return TableShape(TABLE, tuple(columns)), nullable


@st.composite
def histories(draw: st.DrawFn) -> tuple[TableShape, list[dict[tuple, int | None]]]:
    """A shape and 2-3 batches over a small pool of keys: key → new value, or None to delete."""
    shape, nullable = draw(table_shapes())
    key_values = [
        st.one_of(st.none(), KEY_VALUES[c.type["code"]]) if null else KEY_VALUES[c.type["code"]]
        for c, null in zip(shape.key_columns, nullable, strict=True)
    ]
    pool = draw(st.lists(st.tuples(*key_values), min_size=1, max_size=5, unique_by=canonical_key))
    batches = []
    for _ in range(draw(st.integers(2, 3))):
        touched = draw(st.lists(st.sampled_from(pool), min_size=1, unique_by=canonical_key))
        batches.append({key: draw(st.one_of(st.none(), st.integers(0, 9))) for key in touched})
    return shape, batches


def canonical_key(key: tuple) -> tuple:
    """A key as Spanner compares it: NaN equals NaN."""
    return tuple("NaN" if isinstance(v, float) and math.isnan(v) else v for v in key)


def batch_rows(shape: TableShape, batch: dict[tuple, int | None]) -> Iterator[dict[str, Any]]:
    """The processor's output rows for one batch (pipeline.processor.output_schema)."""
    for key, value in batch.items():
        image = [*key, value]
        yield {
            "table_name": TABLE,
            "keys": repr(canonical_key(key)),
            OPERATION: "DELETE" if value is None else "UPSERT",
            "commit_timestamp_text": "2026-11-24T10:00:00Z",
            row_variable(TABLE): tuple(image) if value is not None else (*key, None),
            "last_applied": ("2026-11-24T10:00:00Z", "tx", "00000000", 0),
        }


def mirrored(uri: str, shape: TableShape) -> dict[tuple, Any]:
    names = [c.name for c in shape.columns]
    rows = scan(DeltaTable(uri)).to_pylist()
    return {canonical_key(tuple(r[n] for n in names[:-1])): r[names[-1]] for r in rows}


def the_issue_s_table() -> tuple[TableShape, list[dict[tuple, int | None]]]:
    """``ck_date (d DATE NOT NULL, s STRING(32), n NUMERIC NOT NULL, b BYTES(64) NOT NULL,
    ts TIMESTAMP NOT NULL, v INT64) PRIMARY KEY (d, s, n, b, ts)`` with NULL in ``s``: inserted,
    updated next to a key without NULLs, then deleted."""
    codes = {"d": "DATE", "s": "STRING", "n": "NUMERIC", "b": "BYTES", "ts": "TIMESTAMP"}
    columns = [ColumnType(n, spanner_type(c), True, i) for i, (n, c) in enumerate(codes.items(), 1)]
    shape = TableShape(TABLE, (*columns, ColumnType("v", spanner_type("INT64"), False, 6)))
    moment = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    null_s = (dt.date(2026, 1, 2), None, Decimal("1.500000000"), b"\x00", moment)
    plain = (dt.date(1, 1, 1), "x", Decimal("-2.000000000"), b"", moment)
    return shape, [{null_s: 1}, {null_s: 2, plain: 3}, {null_s: None}]


def a_decimal_key_past_float_precision() -> tuple[TableShape, list[dict[tuple, int | None]]]:
    """Found by this test: delta-rs kept the NUMERIC key's file statistics as a float above the
    value, pruned the file holding it, and the driver MERGE inserted the key a second time."""
    codes = {"select": "NUMERIC", "Order": "BOOL", "from": "DATE", "key": "BOOL"}
    columns = [ColumnType(n, spanner_type(c), True, i) for i, (n, c) in enumerate(codes.items(), 1)]
    shape = TableShape(TABLE, (*columns, ColumnType("AND", spanner_type("INT64"), False, 5)))
    first = (Decimal("-1013600356.374246144"), None, dt.date(1109, 6, 15), False)
    second = (Decimal(-570272), None, dt.date(8055, 6, 27), False)
    return shape, [{first: 1, second: None}, {second: 2}, {first: 6}]


@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(history=histories())
@example(history=the_issue_s_table())
@example(history=a_decimal_key_past_float_precision())
def test_any_primary_key_merges_to_the_model_on_the_driver_and_through_spark(
    spark,
    tmp_path_factory: pytest.TempPathFactory,
    history: tuple[TableShape, list[dict[tuple, int | None]]],
) -> None:
    shape, batches = history
    model: dict[tuple, int] = {}
    folder = tmp_path_factory.mktemp("keys")
    roots = {"driver": str(folder / "driver"), "spark": str(folder / "spark")}
    for root in roots.values():
        create_mirror(mirror_uri(root, TABLE), mirror_struct(shape))
    schema = output_schema({TABLE: shape})
    for batch_id, batch in enumerate(batches):
        for key, value in batch.items():
            if value is None:
                model.pop(canonical_key(key), None)
            else:
                model[canonical_key(key)] = value
        changes = spark.createDataFrame(list(batch_rows(shape, batch)), schema)
        for way, limit in (("driver", 1_000_000), ("spark", 0)):
            write_batch(changes, batch_id, {TABLE: shape}, roots[way], "test", null_logger(), limit)
    columns = [(c.name, c.type["code"]) for c in shape.columns]
    for way, root in roots.items():
        assert mirrored(mirror_uri(root, TABLE), shape) == model, (way, columns, batches)
