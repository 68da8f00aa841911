"""Change stream records decoded per second on one core: the client's default decoding with the
reader's former mapper, next to ``lazy_decode`` with the raw protobuf mapper the reader now uses
(``ingest.changestream.raw_mapper``).

Rows are production-shaped GoogleSQL ChangeRecord values (data change records of 10 mods over
10 columns of mixed types, as the scripted server encodes them), fed as PartialResultSet messages
through the client's own StreamedResultSet, so the client's merging and decoding run as they do
on a live stream; only the network is left out. Both paths must produce equal records.

Usage: python bench/decode_speed.py [--records 5000] [--columns 10] [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from google.cloud.spanner_v1 import PartialResultSet, TypeCode
from google.cloud.spanner_v1.streamed import StreamedResultSet

from emulator.machine import machine_line
from ingest.changestream import mapper, raw_mapper
from ingest.model.records import ChangeRecord, ColumnType, DataChangeRecord, Mod
from tests.scripted_spanner import result_messages, row_value

COLUMN_TYPES: list[dict[str, Any]] = [
    {"code": "INT64"},
    {"code": "STRING"},
    {"code": "TIMESTAMP"},
    {"code": "NUMERIC"},
    {"code": "BOOL"},
    {"code": "FLOAT64"},
    {"code": "JSON"},
    {"code": "BYTES"},
    {"code": "DATE"},
    {"code": "ARRAY", "array_element_type": {"code": "INT64"}},
]
SAMPLE = {
    "INT64": "9007199254740993",
    "STRING": "a customer name of medium length",
    "TIMESTAMP": "2026-11-23T12:34:56.123456789Z",
    "NUMERIC": "12345.678900000",
    "BOOL": True,
    "FLOAT64": 0.1,
    "JSON": '{"tier":"gold","tags":["a","b"]}',
    "BYTES": "AAECAwQFBgcICQ==",
    "DATE": "2026-11-23",
    "ARRAY": ["1", "2", "3"],
}


def production_record(number: int, columns: int) -> DataChangeRecord:
    types = [COLUMN_TYPES[i % len(COLUMN_TYPES)] for i in range(columns)]
    column_types = tuple(ColumnType(f"c{i}", t, i == 0, i + 1) for i, t in enumerate(types))
    mods = tuple(
        Mod(
            {"c0": str(number * 10 + m)},
            {f"c{i}": SAMPLE[t["code"]] for i, t in enumerate(types) if i},
            {},
        )
        for m in range(10)
    )
    return DataChangeRecord(
        commit_timestamp=1_795_000_000_000_000_000 + number,
        record_sequence="00000000",
        server_transaction_id=f"tx{number}",
        is_last_record_in_transaction_in_partition=True,
        table_name="orders",
        column_types=column_types,
        mods=mods,
        mod_type="UPDATE",
        value_capture_type="NEW_ROW_AND_OLD_VALUES",
        number_of_records_in_transaction=1,
        number_of_partitions_in_transaction=1,
        transaction_tag="",
        is_system_transaction=False,
    )


def in_place_of(template: DataChangeRecord, record: DataChangeRecord) -> DataChangeRecord:
    """``template``'s table and mods, in ``record``'s place: its commit timestamp, transaction
    and sequence (a simulated topology's record given a production shape)."""
    return dataclasses.replace(
        template,
        commit_timestamp=record.commit_timestamp,
        record_sequence=record.record_sequence,
        server_transaction_id=record.server_transaction_id,
        is_last_record_in_transaction_in_partition=False,
        number_of_records_in_transaction=record.number_of_records_in_transaction,
        number_of_partitions_in_transaction=record.number_of_partitions_in_transaction,
    )


def struct_namer(field_type: Any) -> Callable[[Any], Any]:
    """The reader's mapper before ``lazy_decode``: names the client's decoded lists."""
    if field_type.code == TypeCode.ARRAY:
        element = struct_namer(field_type.array_element_type)
        return lambda value: None if value is None else [element(item) for item in value]
    if field_type.code == TypeCode.STRUCT:
        fields = [(f.name, struct_namer(f.type_)) for f in field_type.struct_type.fields]
        return lambda value: (
            None
            if value is None
            else {name: convert(item) for (name, convert), item in zip(fields, value, strict=True)}
        )
    return lambda value: value


def decode(messages: list[PartialResultSet], lazy: bool) -> list[ChangeRecord]:
    results = StreamedResultSet(iter(messages), lazy_decode=lazy)
    out: list[ChangeRecord] = []
    to_records: Callable[[list[Any]], list[ChangeRecord]] | None = None
    name_row: Callable[[Any], Any] | None = None
    for row in results:
        if lazy:
            to_records = to_records or raw_mapper.googlesql_raw_row_mapper(results.fields)
            out.extend(to_records(row))
            continue
        name_row = name_row or struct_namer(results.fields[0].type_)
        for change_record in name_row(row[0]) or []:
            out.extend(mapper.records_from_change_record(change_record))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=5000)
    parser.add_argument("--columns", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    records: list[ChangeRecord] = [production_record(n, args.columns) for n in range(args.records)]
    messages = result_messages([row_value(record) for record in records])
    assert decode(messages, lazy=True) == decode(messages, lazy=False) == records
    print(machine_line())
    print(f"# {args.records} data change records of 10 mods over {args.columns} columns")
    rates: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeats):
        for lazy in (False, True):
            began = time.process_time()
            decode(messages, lazy)
            rates[lazy].append(args.records / (time.process_time() - began))
    default, fast = max(rates[False]), max(rates[True])
    print(f"client default decoding + mapper: {default:,.0f} records/s per core")
    print(f"lazy_decode + raw records:       {fast:,.0f} records/s per core")
    print(f"ratio: {fast / default:.2f}")


if __name__ == "__main__":
    main()
