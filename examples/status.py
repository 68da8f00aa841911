"""How long each row of the edge-case table (``all_types``) stays in each status, order-style:
its status is its ``col_string``, and each change of it ends a period. One output row per
period that ended (by another status or by the row's delete), with how long it lasted in commit
time and the row's running total in that status, kept in a map.

``col_string`` may turn BYTES (Spanner converts the values): the typed feed then hands bytes,
and the tracker reads both as text, so a status keeps its identity across the change.

Three deployments of one processor (its ``name`` stays): ``StatusDurations`` first;
``StatusDurationsV2`` widens the period counter from int to bigint (allowed: widening);
``StatusDurationsV3`` changes the totals map's key, which the job refuses before Spark starts:
a state map's key schema never changes.

Run: ``PIPELINE_PROCESSORS=examples.status:StatusDurations python -m pipeline run``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from pyspark.sql import types as T

from pipeline.user_processors import (
    FIRST_IMAGE,
    INSERT,
    Change,
    ChangeProcessor,
    MapOf,
    State,
    Value,
)

STATUS_COLUMN = "col_string"
TOTALS_KEY = T.StructType([T.StructField("status", T.StringType())])
TOTAL = T.StructType([T.StructField("seconds", T.DoubleType())])
OUTPUT = T.StructType(
    [
        T.StructField("id", T.LongType()),
        T.StructField("variant", T.StringType()),
        T.StructField("status", T.StringType()),
        T.StructField("entered_text", T.StringType()),
        T.StructField("left_text", T.StringType()),
        T.StructField("seconds", T.DoubleType()),
        T.StructField("total_seconds_in_status", T.DoubleType()),
        T.StructField("period", T.LongType()),
    ]
)


def current_struct(counter: T.DataType) -> T.StructType:
    return T.StructType(
        [
            T.StructField("status", T.StringType()),
            T.StructField("entered_text", T.StringType()),
            T.StructField("entered_at", T.TimestampType()),
            T.StructField("periods", counter),
        ]
    )


def as_text(value: Any) -> str | None:
    """A status as text, whether the column was STRING (str) or BYTES (bytes) at the change."""
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", errors="replace")
    return value


class StatusDurations(ChangeProcessor):
    name = "status_durations"
    tables = ("all_types",)
    group_by = {"all_types": (("id", "variant"),)}
    state = {
        "current": Value(current_struct(T.IntegerType())),
        "totals": MapOf(TOTALS_KEY, TOTAL),
    }
    output = OUTPUT

    def process(
        self, group: str | None, changes: Sequence[Change], state: State
    ) -> Iterator[dict[str, Any]]:
        current = state.value("current").get()
        for change in changes:
            if change.is_delete:
                if current is not None:
                    yield self.ended(change, current, state)
                current = None
            elif STATUS_COLUMN in change.values or change.kind in (INSERT, FIRST_IMAGE):
                status = as_text(change.values.get(STATUS_COLUMN))
                if current is not None and status == current["status"]:
                    continue
                periods = 0
                if current is not None:
                    yield self.ended(change, current, state)
                    periods = current["periods"]
                current = {
                    "status": status,
                    "entered_text": change.commit_timestamp_text,
                    "entered_at": change.commit_timestamp,
                    "periods": periods,
                }
        if current is None:
            state.value("current").clear()
        else:
            state.value("current").set(current)

    def ended(self, change: Change, current: dict[str, Any], state: State) -> dict[str, Any]:
        """The period ``current`` ends at ``change``: counted, totalled, reported."""
        seconds = (change.commit_timestamp - current["entered_at"]).total_seconds()
        totals = state.map("totals")
        key = {"status": str(current["status"])}
        total = (totals.get(key) or {"seconds": 0.0})["seconds"] + seconds
        totals.put(key, {"seconds": total})
        current["periods"] = (current["periods"] or 0) + 1
        return {
            "id": change.get("id"),
            "variant": change.get("variant"),
            "status": current["status"],
            "entered_text": current["entered_text"],
            "left_text": change.commit_timestamp_text,
            "seconds": seconds,
            "total_seconds_in_status": total,
            "period": current["periods"],
        }


class StatusDurationsV2(StatusDurations):
    """The period counter widened from int to bigint."""

    state = {
        "current": Value(current_struct(T.LongType())),
        "totals": MapOf(TOTALS_KEY, TOTAL),
    }


class StatusDurationsV3(StatusDurationsV2):
    """The totals map keyed by bytes instead of text: refused (a map key change)."""

    state = {
        "current": Value(current_struct(T.LongType())),
        "totals": MapOf(T.StructType([T.StructField("status", T.BinaryType())]), TOTAL),
    }
