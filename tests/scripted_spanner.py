"""A scripted Spanner gRPC server for what the emulator cannot do.

It serves change stream queries from a simulated topology (multi-partition transactions, full
nanosecond values) and cuts streams with gRPC errors mid-way. It subclasses the client package's
mock servicer and answers every ExecuteStreamingSql by the partition token and start timestamp
bound in the request, like Spanner does. Rows carry resume tokens, without which the client holds
rows back; ``honor_resume_tokens=False`` restarts from the beginning on resume, like the emulator.
"""

from __future__ import annotations

import base64
import json
import random
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.api_core.client_options import ClientOptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import spanner
from google.cloud.spanner_v1 import PartialResultSet, ResultSetMetadata, StructType, Type, TypeCode
from google.cloud.spanner_v1.testing import spanner_pb2_grpc
from google.cloud.spanner_v1.testing.mock_spanner import SpannerServicer
from google.cloud.spanner_v1.types import ChangeStreamRecord
from google.protobuf import json_format, struct_pb2, timestamp_pb2

from ingest.changestream.query import ChangeStreamQuery, Dialect
from ingest.model.encoding import canonical_json
from ingest.model.records import (
    ChangeRecord,
    ChildPartitionsRecord,
    DataChangeRecord,
    HeartbeatRecord,
    PartitionEndRecord,
    PartitionEventRecord,
    PartitionStartRecord,
    record_timestamp,
)
from ingest.model.timestamps import Nanos, parse_rfc3339, to_rfc3339
from ingest.rules.partitions import INITIAL_PARTITION
from tests.simulation import Topology, mutable_key_range_streams, records_from


def _type(code: int) -> Type:
    """``code`` a TypeCode: proto-plus enums type-check as plain ints."""
    return Type(code=code)


def _array(element: Type) -> Type:
    return Type(code=TypeCode.ARRAY, array_element_type=element)


def _struct(*fields: tuple[str, Type]) -> Type:
    return Type(
        code=TypeCode.STRUCT,
        struct_type=StructType(fields=[StructType.Field(name=n, type_=t) for n, t in fields]),
    )


STRING, BOOL, INT64 = _type(TypeCode.STRING), _type(TypeCode.BOOL), _type(TypeCode.INT64)
TIMESTAMP, JSON = _type(TypeCode.TIMESTAMP), _type(TypeCode.JSON)

# Field order deliberately differs from the documentation's: the reader must map by name.
DATA_CHANGE_FIELDS = (
    ("mod_type", STRING),
    ("commit_timestamp", TIMESTAMP),
    ("server_transaction_id", STRING),
    ("record_sequence", STRING),
    ("is_last_record_in_transaction_in_partition", BOOL),
    ("table_name", STRING),
    (
        "column_types",
        _array(
            _struct(
                ("name", STRING),
                ("type", JSON),
                ("is_primary_key", BOOL),
                ("ordinal_position", INT64),
            )
        ),
    ),
    ("mods", _array(_struct(("keys", JSON), ("new_values", JSON), ("old_values", JSON)))),
    ("value_capture_type", STRING),
    ("number_of_records_in_transaction", INT64),
    ("number_of_partitions_in_transaction", INT64),
    ("transaction_tag", STRING),
    ("is_system_transaction", BOOL),
)
CHANGE_RECORD = _array(
    _struct(
        ("heartbeat_record", _array(_struct(("timestamp", TIMESTAMP)))),
        (
            "child_partitions_record",
            _array(
                _struct(
                    ("start_timestamp", TIMESTAMP),
                    ("record_sequence", STRING),
                    (
                        "child_partitions",
                        _array(
                            _struct(("token", STRING), ("parent_partition_tokens", _array(STRING)))
                        ),
                    ),
                )
            ),
        ),
        ("data_change_record", _array(_struct(*DATA_CHANGE_FIELDS))),
    )
)


def _native(python: Any) -> Any:
    """Row values as proto-plus expects them: native lists and scalars, INT64 as text."""
    if isinstance(python, bool) or python is None or isinstance(python, str):
        return python
    if isinstance(python, int):
        return str(python)
    return [_native(item) for item in python]


def _json(value: Any) -> str:
    return canonical_json(value)


def encode(record: ChangeRecord) -> list[Any]:
    """One ChangeRecord column value: an array of one struct with one record field set."""
    heartbeat: list = []
    children: list = []
    data: list = []
    if isinstance(record, HeartbeatRecord):
        heartbeat = [[to_rfc3339(record.timestamp)]]
    elif isinstance(record, ChildPartitionsRecord):
        children = [
            [
                to_rfc3339(record.start_timestamp),
                record.record_sequence,
                [[c.token, list(c.parent_partition_tokens)] for c in record.child_partitions],
            ]
        ]
    elif isinstance(record, DataChangeRecord):
        data = [
            [
                record.mod_type,
                to_rfc3339(record.commit_timestamp),
                record.server_transaction_id,
                record.record_sequence,
                record.is_last_record_in_transaction_in_partition,
                record.table_name,
                [
                    [c.name, _json(c.type), c.is_primary_key, c.ordinal_position]
                    for c in record.column_types
                ],
                [[_json(m.keys), _json(m.new_values), _json(m.old_values)] for m in record.mods],
                record.value_capture_type,
                record.number_of_records_in_transaction,
                record.number_of_partitions_in_transaction,
                record.transaction_tag,
                record.is_system_transaction,
            ]
        ]
    else:
        raise ValueError(f"{type(record).__name__} is a MUTABLE_KEY_RANGE record: encode_proto")
    return _native([[heartbeat, children, data]])


MUTABLE_KEY_RANGE_RECORD = Type(
    code=TypeCode.PROTO, proto_type_fqn="google.spanner.v1.ChangeStreamRecord"
)
_PROTO = ChangeStreamRecord.pb()
_DATA_PB = ChangeStreamRecord.DataChangeRecord.pb()


def _timestamp_pb(nanos: Nanos) -> timestamp_pb2.Timestamp:
    return timestamp_pb2.Timestamp(seconds=nanos // 10**9, nanos=nanos % 10**9)


def encode_proto(record: ChangeRecord) -> str:
    """One ``MUTABLE_KEY_RANGE`` row: a ``google.spanner.v1.ChangeStreamRecord`` (Spanner v1
    ``change_stream.proto``), serialized and base64-encoded as Spanner sends PROTO values."""
    message = _PROTO()
    if isinstance(record, DataChangeRecord):
        data = message.data_change_record
        data.commit_timestamp.CopyFrom(_timestamp_pb(record.commit_timestamp))
        data.record_sequence = record.record_sequence
        data.server_transaction_id = record.server_transaction_id
        data.is_last_record_in_transaction_in_partition = (
            record.is_last_record_in_transaction_in_partition
        )
        data.table = record.table_name
        index = {}
        for position, column in enumerate(record.column_types):
            index[column.name] = position
            metadata = data.column_metadata.add()
            metadata.name = column.name
            json_format.ParseDict(column.type, metadata.type_)
            metadata.is_primary_key = column.is_primary_key
            metadata.ordinal_position = column.ordinal_position
        for mod in record.mods:
            out = data.mods.add()
            for target, values in (
                (out.keys, mod.keys),
                (out.new_values, mod.new_values),
                (out.old_values, mod.old_values),
            ):
                for name, value in values.items():
                    if name not in index:  # a value of a column the record does not list
                        index[name] = len(index)
                        data.column_metadata.add().name = name
                    item = target.add()
                    item.column_metadata_index = index[name]
                    json_format.ParseDict(value, item.value)
        data.mod_type = _DATA_PB.ModType.Value(record.mod_type)
        data.value_capture_type = _DATA_PB.ValueCaptureType.Value(record.value_capture_type)
        data.number_of_records_in_transaction = record.number_of_records_in_transaction
        data.number_of_partitions_in_transaction = record.number_of_partitions_in_transaction
        data.transaction_tag = record.transaction_tag
        data.is_system_transaction = record.is_system_transaction
    elif isinstance(record, HeartbeatRecord):
        message.heartbeat_record.timestamp.CopyFrom(_timestamp_pb(record.timestamp))
    elif isinstance(record, PartitionStartRecord):
        start = message.partition_start_record
        start.start_timestamp.CopyFrom(_timestamp_pb(record.start_timestamp))
        start.record_sequence = record.record_sequence
        start.partition_tokens.extend(record.partition_tokens)
    elif isinstance(record, PartitionEndRecord):
        end = message.partition_end_record
        end.end_timestamp.CopyFrom(_timestamp_pb(record.end_timestamp))
        end.record_sequence = record.record_sequence
        end.partition_token = record.partition_token
    elif isinstance(record, PartitionEventRecord):
        event = message.partition_event_record
        event.commit_timestamp.CopyFrom(_timestamp_pb(record.commit_timestamp))
        event.record_sequence = record.record_sequence
        event.partition_token = record.partition_token
    else:
        raise TypeError(f"no MUTABLE_KEY_RANGE form for {type(record).__name__}")
    return base64.b64encode(message.SerializeToString()).decode()


def row_value(record: ChangeRecord, mutable_key_range: bool = False) -> struct_pb2.Value:
    """One row's ``ChangeRecord`` value as the server sends it, in either partition mode."""
    if mutable_key_range:
        return struct_pb2.Value(string_value=encode_proto(record))
    return json_format.ParseDict(encode(record), struct_pb2.Value())


def change_record_metadata(column: Type = CHANGE_RECORD) -> ResultSetMetadata:
    return ResultSetMetadata(
        row_type=StructType(fields=[StructType.Field(name="ChangeRecord", type_=column)])
    )


def result_messages(
    values: list[struct_pb2.Value], column: Type = CHANGE_RECORD
) -> list[PartialResultSet]:
    """Rows as a stream carries them to the client: one PartialResultSet each, with a resume
    token, the first with the metadata (to feed the client's own StreamedResultSet)."""
    messages = []
    for index, value in enumerate(values):
        partial = PartialResultSet(resume_token=str(index).encode())
        partial._pb.values.append(value)
        if index == 0:
            partial.metadata = change_record_metadata(column)
        messages.append(partial)
    return messages


@dataclass
class Fault:
    """Abort the partition's stream with ``code`` after ``after_rows`` rows, ``times`` times."""

    after_rows: int
    code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE
    times: int = 1


@dataclass
class Stall:
    """Hold the partition's stream open and silent after ``after_rows`` rows, ``times`` times,
    until the client goes away or ``seconds`` pass: Spanner leaving a partition hanging."""

    after_rows: int
    times: int = 1
    seconds: float = 30.0


@dataclass
class Script:
    streams: dict[str, list[ChangeRecord]]
    faults: dict[str, Fault] = field(default_factory=dict)
    honor_resume_tokens: bool = True
    stalls: dict[str, Stall] = field(default_factory=dict)
    pace_s: dict[str, float] = field(default_factory=dict)
    """Seconds before each row of a partition: one that keeps moving in real time."""
    parents: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Each child partition's parents: a child queried before all of them reported it is
    recorded in ``queried_before_parents``."""
    mutable_key_range: bool = False
    """Send each record as the ``MUTABLE_KEY_RANGE`` mode does: one PROTO ``ChangeRecord``
    column holding a serialized ``google.spanner.v1.ChangeStreamRecord``."""
    live: bool = False
    """Serve the streams in real time, as Spanner does: a record no sooner than the wall clock
    reaches its timestamp, a heartbeat after each silent heartbeat interval, and a query that
    reaches no child partitions record closes once the clock reaches its end timestamp."""
    hold_back_ns: dict[tuple[str, str], int] = field(default_factory=dict)
    """Live: (server transaction id, record sequence) → how long after its commit timestamp
    the data change record becomes visible (a commit in flight). A held record holds back the
    partition's later records and heartbeats; it is never skipped."""
    close_at_end: bool = False
    """Live: close a query once the clock reaches its end timestamp even while records up to
    it are held back, as a server that does not wait for its end to be safe would."""


class ScriptedChangeStreamServicer(SpannerServicer):
    def __init__(self, script: Script) -> None:
        super().__init__()
        self.script = script
        self._lock = threading.Lock()
        self.queries: list[tuple[str, Nanos, bytes]] = []
        self.faults_fired = 0
        self.stalls_fired = 0
        self.reported_by: dict[str, set[str]] = {}
        self.queried_before_parents: list[str] = []
        self.sent_at: dict[tuple[str, str], int] = {}
        """Live: when each data change record was first sent (wall clock)."""

    def ExecuteStreamingSql(
        self, request: Any, context: grpc.ServicerContext
    ) -> Iterator[PartialResultSet]:
        params = json.loads(type(request).to_json(request))["params"]
        token = params.get("partition_token") or INITIAL_PARTITION
        start = parse_rfc3339(params["start_timestamp"])
        end = parse_rfc3339(params["end_timestamp"]) if params.get("end_timestamp") else None
        resume = bytes(request.resume_token)
        with self._lock:
            self.queries.append((token, start, resume))
            if not set(self.script.parents.get(token, ())) <= self.reported_by.get(token, set()):
                self.queried_before_parents.append(token)
        rows = [
            row
            for row in records_from(self.script.streams[token], start)
            if end is None or record_timestamp(row) <= end
        ]
        if self.script.live:
            heartbeat_ms = int(params.get("heartbeat_milliseconds") or 1000)
            yield from self._serve_live(token, rows, start, end, heartbeat_ms, resume, context)
            return
        first = int(resume) + 1 if resume and self.script.honor_resume_tokens else 0
        metadata = self._metadata()
        for index in range(first, len(rows)):
            with self._lock:
                fault = self.script.faults.get(token)
                if fault and fault.times > 0 and index == fault.after_rows:
                    fault.times -= 1
                    self.faults_fired += 1
                    context.abort(fault.code, f"stream cut by the script at row {index}")
                stall = self.script.stalls.get(token)
                stalled = stall is not None and stall.times > 0 and index == stall.after_rows
                if stall is not None and stalled:
                    stall.times -= 1
                    self.stalls_fired += 1
            if stall is not None and stalled:
                deadline = time.monotonic() + stall.seconds
                while context.is_active() and time.monotonic() < deadline:
                    time.sleep(0.05)
                return
            time.sleep(self.script.pace_s.get(token, 0.0))
            partial = PartialResultSet(resume_token=str(index).encode())
            partial._pb.values.append(self._row(rows[index]))
            if index == first:
                partial.metadata = metadata
            yield partial
        if first >= len(rows):
            yield PartialResultSet(metadata=metadata)

    def _visible_at(self, record: ChangeRecord) -> Nanos:
        held = 0
        if isinstance(record, DataChangeRecord):
            key = (record.server_transaction_id, record.record_sequence)
            held = self.script.hold_back_ns.get(key, 0)
        return record_timestamp(record) + held

    def _metadata(self) -> ResultSetMetadata:
        column = MUTABLE_KEY_RANGE_RECORD if self.script.mutable_key_range else CHANGE_RECORD
        return change_record_metadata(column)

    def _row(self, record: ChangeRecord) -> struct_pb2.Value:
        return row_value(record, self.script.mutable_key_range)

    def _serve_live(
        self,
        token: str,
        rows: list[ChangeRecord],
        start: Nanos,
        end: Nanos | None,
        heartbeat_ms: int,
        resume: bytes,
        context: grpc.ServicerContext,
    ) -> Iterator[PartialResultSet]:
        metadata = self._metadata()
        first = int(resume) + 1 if resume else 0
        heartbeat = heartbeat_ms * 1_000_000
        quiet_since = time.time_ns()
        sent_metadata = False

        def partial(record: ChangeRecord, index: int) -> PartialResultSet:
            nonlocal sent_metadata
            if isinstance(record, ChildPartitionsRecord):
                with self._lock:
                    for child in record.child_partitions:
                        self.reported_by.setdefault(child.token, set()).add(token)
            result = PartialResultSet(resume_token=str(index).encode())
            result._pb.values.append(self._row(record))
            if not sent_metadata:
                result.metadata = metadata
                sent_metadata = True
            return result

        pending = [
            (self._visible_at(row), record_timestamp(row), index, row)
            for index, row in enumerate(rows)
        ][first:]
        pending.reverse()
        last_sent = first - 1
        while context.is_active():
            now = time.time_ns()
            if pending and pending[-1][0] <= now:
                _, _, last_sent, row = pending.pop()
                if isinstance(row, DataChangeRecord):
                    with self._lock:
                        key = (row.server_transaction_id, row.record_sequence)
                        self.sent_at.setdefault(key, now)
                yield partial(row, last_sent)
                quiet_since = now
                more_children = pending and isinstance(pending[-1][3], ChildPartitionsRecord)
                if isinstance(row, ChildPartitionsRecord) and not more_children:
                    return
                continue
            if end is not None and now >= end and (not pending or self.script.close_at_end):
                if not sent_metadata:
                    yield PartialResultSet(metadata=metadata)
                return
            beat = min(now, pending[-1][1] - 1) if pending else now
            if now - quiet_since >= heartbeat and beat >= start:
                # Resumed after it, the stream goes on from the last row sent: a heartbeat is
                # never replayed, which is harmless.
                yield partial(HeartbeatRecord(beat), last_sent)
                quiet_since = now
            wake = min(
                pending[-1][0] if pending else now + heartbeat,
                end if end is not None else now + heartbeat,
                quiet_since + heartbeat,
            )
            time.sleep(min(max(wake - now, 0) / 1e9, 0.05))


def live_script(topology: Topology, rng: random.Random, mutable_key_range: bool) -> Script:
    """A topology served live in either partition mode: child partitions records (the parents
    recorded, to catch a child queried early), or ``MUTABLE_KEY_RANGE``'s partition start and end
    records with key ranges moving."""
    if mutable_key_range:
        return Script(mutable_key_range_streams(topology, rng), mutable_key_range=True, live=True)
    streams = topology.records_by_partition()
    return Script(streams, parents=parents_of(streams), live=True)


def start_server(
    script: Script, workers: int = 32
) -> tuple[grpc.Server, ScriptedChangeStreamServicer, int]:
    """A server in this process; each open stream holds one of its ``workers`` threads."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    servicer = ScriptedChangeStreamServicer(script)
    spanner_pb2_grpc.add_SpannerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, servicer, port


def scripted_query(port: int, heartbeat_ms: int = 1000) -> ChangeStreamQuery:
    """The product's change stream DAO, through the real client, on a scripted server (the
    caller unsets SPANNER_EMULATOR_HOST first: the client prefers it to the endpoint)."""
    client = spanner.Client(
        project="scripted",
        credentials=AnonymousCredentials(),
        client_options=ClientOptions(api_endpoint=f"127.0.0.1:{port}"),
        disable_builtin_metrics=True,
    )
    database = client.instance("scripted").database("scripted")
    return ChangeStreamQuery(database, "s", Dialect.GOOGLE_STANDARD_SQL, heartbeat_ms)


def parents_of(streams: dict[str, list[ChangeRecord]]) -> dict[str, tuple[str, ...]]:
    """Each child partition's parents, from the child partitions records of a script."""
    return {
        child.token: child.parent_partition_tokens
        for rows in streams.values()
        for row in rows
        if isinstance(row, ChildPartitionsRecord)
        for child in row.child_partitions
    }


def main() -> None:
    """Serve a pickled ``Script`` in a process of its own (benchmarks: the server must not share
    the reader's GIL or CPU). Prints the port, then serves until killed."""
    import argparse
    import pickle

    parser = argparse.ArgumentParser()
    parser.add_argument("--script", required=True)
    parser.add_argument("--workers", type=int, default=32)
    args = parser.parse_args()
    with open(args.script, "rb") as file:
        script = pickle.load(file)
    server, _, port = start_server(script, workers=args.workers)
    print(port, flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
