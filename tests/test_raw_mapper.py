"""The raw (``lazy_decode``) mappers: any record the scripted server encodes, in either partition
mode, comes back equal through the client's own StreamedResultSet; a shape it cannot read fails
the query with one clear error."""

from __future__ import annotations

from typing import Any

import pytest
from google.cloud.spanner_v1 import Type
from google.cloud.spanner_v1.streamed import StreamedResultSet
from google.protobuf import json_format, struct_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.changestream.mapper import UnknownRecordError
from ingest.changestream.proto_mapper import proto_row_mapper
from ingest.changestream.raw_mapper import googlesql_raw_row_mapper
from ingest.model import records as model
from tests.scripted_spanner import (
    CHANGE_RECORD,
    MUTABLE_KEY_RANGE_RECORD,
    STRING,
    _struct,
    encode,
    result_messages,
    row_value,
)

timestamps = st.integers(min_value=0, max_value=253_402_300_799_999_999_999)
texts = st.text(max_size=20)
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    texts,
    st.floats(allow_nan=False, allow_infinity=False),
    st.integers(-(2**53), 2**53),
)
json_objects = st.dictionaries(
    texts, st.one_of(json_scalars, st.lists(json_scalars, max_size=3)), max_size=4
)
column_types = st.lists(
    st.builds(
        model.ColumnType,
        name=texts,
        type=st.sampled_from(
            [
                {"code": "INT64"},
                {"code": "STRING"},
                {"code": "ARRAY", "array_element_type": {"code": "JSON"}},
                {"code": "NUMERIC", "type_annotation": "PG_NUMERIC"},
            ]
        ),
        is_primary_key=st.booleans(),
        ordinal_position=st.integers(1, 1000),
    ),
    max_size=4,
).map(tuple)
data_change_records = st.builds(
    model.DataChangeRecord,
    commit_timestamp=timestamps,
    record_sequence=texts,
    server_transaction_id=texts,
    is_last_record_in_transaction_in_partition=st.booleans(),
    table_name=texts,
    column_types=column_types,
    mods=st.lists(st.builds(model.Mod, json_objects, json_objects, json_objects), max_size=4).map(
        tuple
    ),
    mod_type=st.sampled_from(["INSERT", "UPDATE", "DELETE"]),
    value_capture_type=st.sampled_from(["OLD_AND_NEW_VALUES", "NEW_ROW", "NEW_VALUES"]),
    number_of_records_in_transaction=st.integers(1, 2**31 - 1),
    number_of_partitions_in_transaction=st.integers(1, 2**31 - 1),
    transaction_tag=texts,
    is_system_transaction=st.booleans(),
)
child_partitions_records = st.builds(
    model.ChildPartitionsRecord,
    start_timestamp=timestamps,
    record_sequence=texts,
    child_partitions=st.lists(
        st.builds(
            model.ChildPartition,
            token=texts.filter(bool),
            parent_partition_tokens=st.lists(texts.filter(bool), max_size=2).map(tuple),
        ),
        min_size=1,
        max_size=3,
    ).map(tuple),
)
records = st.one_of(
    data_change_records, child_partitions_records, st.builds(model.HeartbeatRecord, timestamps)
)


def through_the_client(rows: list[list[Any]], row_type: Type = CHANGE_RECORD) -> list:
    values = [json_format.ParseDict(row, struct_pb2.Value()) for row in rows]
    results = StreamedResultSet(iter(result_messages(values, row_type)), lazy_decode=True)
    out: list[model.ChangeRecord] = []
    to_records = None
    for row in results:
        to_records = to_records or googlesql_raw_row_mapper(results.fields)
        out.extend(to_records(row))
    return out


@settings(max_examples=150, deadline=None)
@given(st.lists(records, min_size=1, max_size=6))
def test_every_record_comes_back_equal(sent: list[model.ChangeRecord]) -> None:
    assert through_the_client([encode(record) for record in sent]) == sent


def test_column_types_built_once_are_shared_by_later_records() -> None:
    columns = (model.ColumnType("id", {"code": "INT64"}, True, 1),)
    sent = [
        model.DataChangeRecord(
            n,
            "0",
            f"t{n}",
            True,
            "t",
            columns,
            (model.Mod({"id": str(n)}, {}, {}),),
            "INSERT",
            "NEW_ROW",
            1,
            1,
            "",
            False,
        )
        for n in range(3)
    ]
    received = through_the_client([encode(record) for record in sent])
    assert received == sent
    assert received[0].column_types is received[2].column_types


def test_a_shape_without_a_needed_field_fails_the_query() -> None:
    heartbeat_only = _struct(
        ("heartbeat_record", Type(code=8, array_element_type=_struct(("time", STRING))))
    )
    row_type = Type(code=8, array_element_type=heartbeat_only)
    with pytest.raises(UnknownRecordError, match="heartbeat_record without fields"):
        through_the_client([[[[["2026-01-01T00:00:00Z"]]]]], row_type)


def test_a_change_record_with_no_record_set_fails() -> None:
    with pytest.raises(UnknownRecordError, match="no record set"):
        through_the_client([[[[], [], []]]])


def mutable_key_range_data_records() -> st.SearchStrategy[model.DataChangeRecord]:
    """Data change records whose mods name only listed columns, as Spanner sends them."""

    @st.composite
    def build(draw: st.DrawFn) -> model.DataChangeRecord:
        names = draw(st.lists(texts, min_size=1, max_size=4, unique=True))
        types = [
            draw(column_types.map(lambda c: c[0].type if c else {"code": "INT64"})) for _ in names
        ]
        columns = tuple(
            model.ColumnType(name, t, i == 0, i + 1)
            for i, (name, t) in enumerate(zip(names, types, strict=True))
        )
        values = st.dictionaries(st.sampled_from(names), json_scalars, max_size=len(names))
        record = draw(data_change_records)
        mods = tuple(
            model.Mod(draw(values), draw(values), draw(values))
            for _ in range(draw(st.integers(0, 3)))
        )
        return model.DataChangeRecord(
            **{
                **{f: getattr(record, f) for f in record.__slots__},
                "column_types": columns,
                "mods": mods,
            }
        )

    return build()


mutable_key_range_records = st.one_of(
    mutable_key_range_data_records(),
    st.builds(model.HeartbeatRecord, timestamps),
    st.builds(
        model.PartitionStartRecord, timestamps, texts, st.lists(texts, max_size=3).map(tuple)
    ),
    st.builds(model.PartitionEndRecord, timestamps, texts, texts),
    st.builds(model.PartitionEventRecord, timestamps, texts, texts),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(mutable_key_range_records, min_size=1, max_size=6))
def test_every_mutable_key_range_record_comes_back_equal(sent: list[model.ChangeRecord]) -> None:
    """The PROTO ChangeStreamRecord of the MUTABLE_KEY_RANGE mode, through the client."""
    values = [row_value(record, mutable_key_range=True) for record in sent]
    messages = result_messages(values, MUTABLE_KEY_RANGE_RECORD)
    results = StreamedResultSet(iter(messages), lazy_decode=True)
    received: list[model.ChangeRecord] = []
    for row in results:
        received.extend(proto_row_mapper(results.fields)(row))
    assert received == sent
