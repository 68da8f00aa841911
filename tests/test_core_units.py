"""Edge cases of the pure core: timestamps, mapper, assembler, tracker, values."""

from __future__ import annotations

import datetime as dt
import re
from decimal import Decimal

import pyarrow as pa
import pytest
from google.api_core.datetime_helpers import DatetimeWithNanoseconds
from google.cloud.spanner_v1.data_types import JsonObject
from hypothesis import example, given
from hypothesis import strategies as st

from ingest.changestream.mapper import UnknownRecordError, plain_json, records_from_change_record
from ingest.contract.changelog import SCHEMA, in_total_order, position
from ingest.model import timestamps
from ingest.model.records import (
    ChildPartition,
    ChildPartitionsRecord,
    HeartbeatRecord,
)
from ingest.model.values import decode_value
from ingest.rules.assembler import (
    IncompleteTransactionError,
    InconsistentTransactionError,
    TransactionAssembler,
)
from ingest.rules.partitions import PartitionLifecycleError, PartitionTracker
from tests.builders import record

SPANNER_FIRST = -62135596800 * 10**9
"""0001-01-01T00:00:00Z, Spanner's first TIMESTAMP."""
SPANNER_LAST = 253402300799 * 10**9 + 999999999
"""9999-12-31T23:59:59.999999999Z, its last."""
RFC3339_UTC = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{9}Z")


class TestTimestamps:
    def test_rfc3339_keeps_nanoseconds_and_offsets(self) -> None:
        ns = timestamps.parse_rfc3339("2024-02-29T23:59:59.123456789Z")
        assert timestamps.to_rfc3339(ns) == "2024-02-29T23:59:59.123456789Z"
        assert timestamps.parse_rfc3339("2024-03-01T01:59:59.123456789+02:00") == ns
        assert timestamps.parse_rfc3339("2026-11-22T06:20:17.69167+00:00") % 10**9 == 691670000

    def test_datetime_with_nanoseconds_round_trips(self) -> None:
        value = DatetimeWithNanoseconds(2024, 1, 1, 0, 0, 0, nanosecond=7, tzinfo=dt.UTC)
        ns = timestamps.from_datetime(value)
        assert ns % 10**9 == 7
        assert timestamps.from_datetime(timestamps.to_datetime(ns)) == ns
        assert timestamps.to_datetime(ns).rfc3339() == "2024-01-01T00:00:00.000000007Z"

    def test_before_epoch(self) -> None:
        ns = timestamps.parse_rfc3339("1900-01-01T00:00:00.5Z")
        assert timestamps.to_rfc3339(ns) == "1900-01-01T00:00:00.500000000Z"

    @given(st.integers(SPANNER_FIRST, SPANNER_LAST), st.integers(SPANNER_FIRST, SPANNER_LAST))
    @example(SPANNER_FIRST, SPANNER_LAST)
    def test_any_instant_spanner_holds_is_rfc3339_text_that_sorts_as_it(
        self, a: int, b: int
    ) -> None:
        """Years before 1000 too: ``strftime`` writes year 1 as "1", not "0001"."""
        texts = timestamps.to_rfc3339(a), timestamps.to_rfc3339(b)
        for nanos, text in zip((a, b), texts, strict=True):
            assert RFC3339_UTC.fullmatch(text), text
            assert timestamps.parse_rfc3339(text) == nanos
        assert (texts[0] < texts[1]) == (a < b)

    @pytest.mark.parametrize("text", ["2024-01-01", "yesterday", "2024-01-01T00:00:00"])
    def test_rejects_incomplete_text(self, text: str) -> None:
        with pytest.raises(ValueError, match="RFC 3339"):
            timestamps.parse_rfc3339(text)


ROWS_IN_ANY_ORDER = st.lists(
    st.fixed_dictionaries(
        {
            "keys": st.sampled_from(['["1"]', '["2"]']),
            "commit_timestamp_text": st.sampled_from(
                ["0999-01-01T00:00:00.000000000Z", "2026-11-29T10:00:00.000000000Z"]
            ),
            "server_transaction_id": st.sampled_from(["a", "b"]),
            "record_sequence": st.sampled_from(["9", "10", "00000010", "00000009"]),
            "mod_index": st.integers(0, 12),
        }
    ),
    max_size=30,
)


class TestTotalOrder:
    @given(ROWS_IN_ANY_ORDER)
    def test_the_arrow_order_is_position_s(self, rows: list[dict[str, object]]) -> None:
        names = ["keys", "commit_timestamp_text", "server_transaction_id", "record_sequence"]
        schema = pa.schema([SCHEMA.field(name) for name in [*names, "mod_index"]])
        table = pa.Table.from_pylist(rows, schema=schema)
        by_key = sorted(rows, key=lambda r: (r["keys"], position(r)))
        assert in_total_order(table, ["keys"]).to_pylist() == by_key
        assert in_total_order(table).to_pylist() == sorted(rows, key=position)


class TestMapper:
    def test_postgresql_document(self) -> None:
        [heartbeat] = records_from_change_record(
            {"heartbeat_record": {"timestamp": "2026-11-22T06:20:17.69167+00:00"}}
        )
        assert isinstance(heartbeat, HeartbeatRecord)

    def test_googlesql_named_struct(self) -> None:
        ts = DatetimeWithNanoseconds(2026, 1, 1, nanosecond=5, tzinfo=dt.UTC)
        [child] = records_from_change_record(
            {
                "data_change_record": [],
                "heartbeat_record": [],
                "child_partitions_record": [
                    {
                        "start_timestamp": ts,
                        "record_sequence": "00000001",
                        "child_partitions": [{"token": "a", "parent_partition_tokens": ["p"]}],
                    }
                ],
            }
        )
        assert child == ChildPartitionsRecord(
            timestamps.from_datetime(ts), "00000001", (ChildPartition("a", ("p",)),)
        )

    def test_json_object_unwrapping(self) -> None:
        assert plain_json(JsonObject({"a": {"b": "1"}})) == {"a": {"b": "1"}}
        assert plain_json(JsonObject([1, "x"])) == [1, "x"]
        assert plain_json(JsonObject(None)) is None
        assert plain_json('{"k":"9007199254740993"}') == {"k": "9007199254740993"}

    @pytest.mark.parametrize(
        "document",
        [
            {"unknown_record": {}},
            {"data_change_record": [], "heartbeat_record": [], "child_partitions_record": []},
            {"heartbeat_record": {"time": "x"}},
            {"data_change_record": {"commit_timestamp": "2024-01-01T00:00:00Z"}},
        ],
    )
    def test_unknown_shapes_are_clear_errors(self, document: dict) -> None:
        with pytest.raises(UnknownRecordError):
            records_from_change_record(document)


class TestAssembler:
    def test_waits_for_all_records_and_the_watermark(self) -> None:
        assembler = TransactionAssembler(released_watermark=0)
        assembler.add(record(10, "a", 1, 2))
        assert assembler.release(9) == []
        assembler.add(record(10, "a", 0, 2))
        assert assembler.buffered_bytes > 0
        [transaction] = assembler.release(10)
        assert [r.record_sequence for r in transaction.records] == ["00000000", "00000001"]
        assert assembler.buffered_bytes == 0

    def test_orders_by_commit_timestamp_then_transaction_id(self) -> None:
        assembler = TransactionAssembler(released_watermark=0)
        for ts, txid in [(5, "b"), (5, "a"), (3, "z")]:
            assembler.add(record(ts, txid, 0, 1))
        assert [t.order_key for t in assembler.release(5)] == [(3, "z"), (5, "a"), (5, "b")]

    def test_duplicates_are_dropped(self) -> None:
        assembler = TransactionAssembler(released_watermark=0)
        assembler.add(record(5, "a", 0, 2))
        assembler.add(record(5, "a", 0, 2))
        assembler.add(record(5, "a", 1, 2))
        assembler.add(record(5, "a", 1, 2))
        assert len(assembler.release(5)[0].records) == 2
        assembler.add(record(5, "a", 0, 2))
        assert assembler.stats.duplicates_dropped == 3
        assert assembler.open_transactions == 0

    def test_incomplete_transaction_behind_the_watermark_stops(self) -> None:
        assembler = TransactionAssembler(released_watermark=0)
        assembler.add(record(5, "a", 0, 3))
        with pytest.raises(IncompleteTransactionError, match="has 1 of 3 records"):
            assembler.release(5)

    def test_inconsistent_records_are_refused(self) -> None:
        assembler = TransactionAssembler(released_watermark=0)
        assembler.add(record(5, "a", 0, 2))
        with pytest.raises(InconsistentTransactionError):
            assembler.add(record(6, "a", 1, 2))
        with pytest.raises(InconsistentTransactionError):
            assembler.add(record(5, "a", 1, 3))


class TestTracker:
    def test_merge_child_waits_for_every_parent_and_is_created_once(self) -> None:
        tracker = PartitionTracker(start_timestamp=100, end_timestamp=None)
        tracker.add_initial()
        [initial] = tracker.take_ready(10)
        tracker.mark_running(initial.token, 100)
        tracker.on_record(
            "", ChildPartitionsRecord(100, "0", (ChildPartition("a", ()), ChildPartition("b", ())))
        )
        tracker.on_stream_end("")
        for partition in tracker.take_ready(10):
            tracker.mark_running(partition.token, 100)
        merged = ChildPartitionsRecord(200, "0", (ChildPartition("c", ("a", "b")),))
        assert [p.token for p in tracker.on_record("a", merged)] == ["c"]
        tracker.on_stream_end("a")
        assert tracker.take_ready(10) == []
        assert tracker.low_watermark() == 100 - 1
        assert tracker.on_record("b", merged) == []
        assert tracker.low_watermark() == 199
        tracker.on_stream_end("b")
        assert [p.token for p in tracker.take_ready(10)] == ["c"]

    def test_unstarted_children_hold_the_low_watermark(self) -> None:
        tracker = PartitionTracker(start_timestamp=100, end_timestamp=None)
        tracker.add_initial()
        tracker.take_ready(1)
        tracker.mark_running("", 100)
        tracker.on_record("", ChildPartitionsRecord(100, "0", (ChildPartition("a", ()),)))
        tracker.on_stream_end("")
        assert tracker.low_watermark() == 99

    def test_unbounded_stream_without_children_cannot_finish(self) -> None:
        tracker = PartitionTracker(start_timestamp=100, end_timestamp=None)
        tracker.add_initial()
        tracker.take_ready(1)
        tracker.mark_running("", 100)
        tracker.on_record("", HeartbeatRecord(150))
        with pytest.raises(PartitionLifecycleError, match="without its last record"):
            tracker.on_stream_end("")


class TestValues:
    def test_every_type(self) -> None:
        assert decode_value({"code": "INT64"}, "9007199254740993") == 9007199254740993
        assert decode_value({"code": "NUMERIC"}, "0.000000001") == Decimal("0.000000001")
        assert decode_value({"code": "BYTES"}, "AP8=") == b"\x00\xff"
        assert decode_value({"code": "DATE"}, "2024-01-02") == dt.date(2024, 1, 2)
        assert decode_value({"code": "TIMESTAMP"}, "1970-01-01T00:00:01.000000001Z") == 10**9 + 1
        year_one = decode_value({"code": "TIMESTAMP"}, "0001-01-01T00:00:00Z")
        assert decode_value({"code": "TIMESTAMP"}, "1-01-01T00:00:00Z") == year_one  # emulator
        assert decode_value({"code": "JSON"}, '{"a":[1]}') == {"a": [1]}
        assert decode_value({"code": "FLOAT64"}, "NaN") != decode_value({"code": "FLOAT64"}, 1.0)
        array = {"code": "ARRAY", "array_element_type": {"code": "INT64"}}
        assert decode_value(array, ["1", "NULL", None]) == [1, None, None]
        strings = {"code": "ARRAY", "array_element_type": {"code": "STRING"}}
        assert decode_value(strings, ["NULL"]) == ["NULL"]
        documents = {"code": "ARRAY", "array_element_type": {"code": "JSON"}}
        assert decode_value(documents, ['{"a":null}', "NULL", "null"]) == [{"a": None}, None, None]


class TestStreamInfo:
    """The stream's options as information_schema lists them (one row per option)."""

    def test_retention_and_unknown_streams(self) -> None:
        from ingest.changestream.query import ChangeStreamRequestError, stream_info

        rows = [
            ("orders", "retention_period", "36h"),
            ("orders", "value_capture_type", "NEW_ROW"),
            ("audit", None, None),
        ]
        assert stream_info("orders", "db", rows).retention_nanos == 36 * 3600 * 10**9
        assert stream_info("audit", "db", rows).retention_nanos == 24 * 3600 * 10**9
        with pytest.raises(ChangeStreamRequestError, match=r"streams: audit, orders"):
            stream_info("missing", "db", rows)

    def test_the_partition_mode_is_read_and_an_unknown_one_refused(self) -> None:
        from ingest.changestream.query import ChangeStreamRequestError, stream_info

        mutable: list[tuple[str, str | None, str | None]] = [
            ("orders", "partition_mode", "MUTABLE_KEY_RANGE")
        ]
        assert stream_info("orders", "db", mutable).mutable_key_range
        immutable: list[tuple[str, str | None, str | None]] = [
            ("orders", "partition_mode", "IMMUTABLE_KEY_RANGE")
        ]
        assert not stream_info("orders", "db", immutable).mutable_key_range
        assert not stream_info("orders", "db", [("orders", None, None)]).mutable_key_range
        with pytest.raises(ChangeStreamRequestError, match="partition_mode SOMETHING_NEW"):
            stream_info("orders", "db", [("orders", "partition_mode", "SOMETHING_NEW")])
