"""A rebase seeds state from the mirrors: every mirror value, taken back into state, must give
the same mirror value again, for every Spanner type, arrays and NULL elements included."""

from __future__ import annotations

import base64
import datetime as dt
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ingest.model.timestamps import to_rfc3339
from pipeline.values import mirror_value, state_from_seed, state_value

EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def scalar(code: str, **extra: str) -> dict[str, Any]:
    return {"code": code, **extra}


def array(element: dict[str, Any]) -> dict[str, Any]:
    return {"code": "ARRAY", "array_element_type": element}


def as_seed(spanner_type: dict[str, Any], mirrored: Any) -> Any:
    """The mirror value as the seed carries it (``unix_micros`` for timestamps)."""
    if mirrored is None:
        return None
    if spanner_type["code"] == "ARRAY":
        element = spanner_type["array_element_type"]
        return [as_seed(element, item) for item in mirrored]
    if spanner_type["code"] == "TIMESTAMP":
        return (mirrored - EPOCH) // dt.timedelta(microseconds=1)
    return mirrored


def same(left: Any, right: Any) -> bool:
    if isinstance(left, float) and isinstance(right, float):
        return left == right or (math.isnan(left) and math.isnan(right))
    if isinstance(left, list) and isinstance(right, list):
        return len(left) == len(right) and all(map(same, left, right))
    return bool(left == right)


def assert_round_trip(spanner_type: dict[str, Any], wire: Any) -> None:
    mirrored = mirror_value(spanner_type, state_value(spanner_type, wire))
    seeded = state_from_seed(spanner_type, as_seed(spanner_type, mirrored))
    assert same(mirror_value(spanner_type, seeded), mirrored), (spanner_type, wire)


CASES: list[tuple[dict[str, Any], list[Any]]] = [
    (scalar("INT64"), ["0", "-9223372036854775808", "9223372036854775807"]),
    (scalar("FLOAT64"), [1.5, -0.0, 1e308, "NaN", "Infinity"]),
    (scalar("FLOAT32"), [1.100000023841858, 3.4028234663852886e38]),
    (scalar("BOOL"), [True, False]),
    (scalar("STRING"), ["", "héllo ✓", "x" * 1000]),
    (scalar("BYTES"), ["", "AQID", base64.b64encode(bytes(range(256))).decode()]),
    (scalar("DATE"), ["0001-01-01", "2026-11-24", "9999-12-31"]),
    (
        scalar("TIMESTAMP"),
        ["0001-01-01T00:00:00Z", "2026-11-24T14:00:00.123456789Z", "9999-12-31T23:59:59.999999Z"],
    ),
    (scalar("NUMERIC"), ["0", "1.5", "-99999999999999999999999999999.999999999"]),
    (scalar("JSON"), ['{"a":[1,null,"x"]}', "null", "3"]),
    (scalar("NUMERIC", type_annotation="PG_NUMERIC"), ["NaN", "1.23456789012345678901234567890"]),
    (array(scalar("INT64")), [["1", None, "-2"], []]),
    (array(scalar("FLOAT64")), [[1.5, None, "NaN"]]),
    (array(scalar("STRING")), [["a", None, "ü"], [""]]),
    (array(scalar("BYTES")), [["AQID", None]]),
    (array(scalar("DATE")), [["0001-01-01", None, "2026-11-24"]]),
    (array(scalar("TIMESTAMP")), [["0001-01-01T00:00:00Z", None, "2026-11-24T14:00:00.5Z"]]),
    (array(scalar("NUMERIC")), [["1.5", None, "-0.000000001"]]),
    (array(scalar("JSON")), [['{"a":1}', None]]),
    (array(scalar("BOOL")), [[True, None, False]]),
]


@pytest.mark.parametrize(
    ("spanner_type", "wire"),
    [(t, v) for t, values in CASES for v in [*values, None]],
    ids=lambda value: str(value)[:40],
)
def test_every_type_seeds_state_that_mirrors_to_the_same_value(
    spanner_type: dict[str, Any], wire: Any
) -> None:
    assert_round_trip(spanner_type, wire)


@given(st.integers(-(2**63), 2**63 - 1))
def test_any_int64_round_trips(value: int) -> None:
    assert_round_trip(scalar("INT64"), str(value))
    assert_round_trip(array(scalar("INT64")), [str(value), None])


@given(st.text())
def test_any_text_round_trips(value: str) -> None:
    assert_round_trip(scalar("STRING"), value)
    assert_round_trip(array(scalar("STRING")), [value, None])


@given(st.integers(-62135596800 * 10**9, 253402300799 * 10**9 + 999999999))
def test_any_timestamp_round_trips(nanos: int) -> None:
    assert_round_trip(scalar("TIMESTAMP"), to_rfc3339(nanos))
    assert_round_trip(array(scalar("TIMESTAMP")), [to_rfc3339(nanos), None])
