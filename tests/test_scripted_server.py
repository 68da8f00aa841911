"""The reader through the real google-cloud-spanner client against a scripted gRPC server:
transactions spread over several partitions, and streams cut mid-way."""

from __future__ import annotations

import dataclasses
import json
import random
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from ingest.changestream.config import ReaderConfig
from ingest.changestream.query import ChangeStreamQuery
from ingest.changestream.reader import ChangeStreamReader
from ingest.changestream.retries import RetryPolicy
from ingest.model.records import (
    ChangeRecord,
    ChildPartition,
    ChildPartitionsRecord,
    ColumnType,
    HeartbeatRecord,
    Mod,
    PartitionStartRecord,
    Transaction,
)
from ingest.model.timestamps import parse_rfc3339
from ingest.model.values import decode_value
from ingest.rules.partitions import INITIAL_PARTITION
from tests.builders import captured_logger, record
from tests.scripted_spanner import (
    Fault,
    Script,
    ScriptedChangeStreamServicer,
    Stall,
    scripted_query,
    start_server,
)
from tests.simulation import build_topology, mutable_key_range_streams

FAST_RETRY = RetryPolicy(initial_backoff_s=0.01, max_backoff_s=0.05)


@pytest.fixture
def serve(monkeypatch: pytest.MonkeyPatch) -> Iterator:
    monkeypatch.delenv("SPANNER_EMULATOR_HOST", raising=False)
    servers: list[grpc.Server] = []

    def start(script: Script) -> tuple[ScriptedChangeStreamServicer, ChangeStreamQuery]:
        server, servicer, port = start_server(script)
        servers.append(server)
        return servicer, scripted_query(port)

    yield start
    for server in servers:
        server.stop(grace=None)


def read_all(source: ChangeStreamQuery, start: int, end: int) -> tuple[list[Transaction], list]:
    log, events = captured_logger()
    reader = ChangeStreamReader(
        source,
        ReaderConfig(start_timestamp=start, end_timestamp=end, retry=FAST_RETRY),
        log,
    )
    released: list[Transaction] = []
    failures: list[BaseException] = []

    def run() -> None:
        try:
            reader.run(lambda r: released.extend(r.transactions), threading.Event())
        except BaseException as error:
            failures.append(error)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive()
    if failures:
        raise failures[0]
    return released, list(events)


@pytest.mark.parametrize("seed", range(3))
def test_transactions_spread_over_partitions_are_reassembled(serve, seed: int) -> None:
    topology = build_topology(random.Random(seed), events=10, transactions=120)
    _, source = serve(Script(topology.records_by_partition()))
    released, _ = read_all(source, topology.start, topology.end)
    assert released == topology.expected()
    spread = [t for t in released if t.records[0].number_of_partitions_in_transaction >= 2]
    assert len(spread) >= 5


@pytest.mark.parametrize("seed", range(3))
def test_mutable_key_range_partitions_announce_end_and_move_key_ranges(serve, seed: int) -> None:
    """The MUTABLE_KEY_RANGE mode: PROTO records, partitions announced by partition start
    records, ended by partition end records, key ranges moving (event records)."""
    rng = random.Random(seed)
    topology = build_topology(rng, events=10, transactions=120)
    streams = mutable_key_range_streams(topology, rng)
    _, source = serve(Script(streams, mutable_key_range=True))
    released, events = read_all(source, topology.start, topology.end)
    assert released == topology.expected()
    finished = {e["partition_token"] for e in events if e["event"] == "partition_finished"}
    assert finished == {*topology.partitions, INITIAL_PARTITION}
    ended = {t for t, p in topology.partitions.items() if p.end is not None}
    kinds = {type(r).__name__ for rows in streams.values() for r in rows}
    assert {"PartitionStartRecord", "PartitionEndRecord", "PartitionEventRecord"} <= kinds
    assert ended and not [e for e in events if e["event"] == "partition_query_retry"]


def test_a_partition_left_hanging_is_restarted_through_the_client_and_nothing_is_lost(
    serve,
) -> None:
    """Partition 'stalled' sends three rows, then its stream stays open with no heartbeat while
    'steady' keeps moving: the reader reports it stuck and queries it again."""
    times = range(1010, 1010 + 10 * 300, 10)
    stalled = [record(ts, f"tx{ts}", 0, 1) for ts in times[:50]]
    streams: dict[str, list] = {
        INITIAL_PARTITION: [
            ChildPartitionsRecord(
                1000, "00000000", (ChildPartition("steady", ()), ChildPartition("stalled", ()))
            )
        ],
        "steady": [HeartbeatRecord(ts) for ts in times],
        "stalled": stalled,
    }
    script = Script(streams, stalls={"stalled": Stall(after_rows=3)}, pace_s={"steady": 0.01})
    servicer, source = serve(script)
    log, events = captured_logger()
    config = ReaderConfig(
        start_timestamp=1000,
        end_timestamp=times[-1],
        # silent for 1 s: 'steady' (10 ms apart for 3 s) stays well inside it on a loaded machine
        heartbeat_ms=200,
        stuck_after_heartbeats=5,
        retry=FAST_RETRY,
    )
    released: list[Transaction] = []
    ChangeStreamReader(source, config, log).run(
        lambda r: released.extend(r.transactions), threading.Event()
    )
    assert released == [
        Transaction(r.commit_timestamp, r.server_transaction_id, (r,)) for r in stalled
    ]
    assert servicer.stalls_fired == 1
    stuck = [e for e in events if e["event"] == "partition_stuck"]
    assert [e["partition_token"] for e in stuck] == ["stalled"]
    assert [q[1] for q in servicer.queries if q[0] == "stalled"] == [1000, 1030]


@pytest.mark.parametrize("over_budget", [False, True])
def test_the_only_live_partition_left_hanging_is_cancelled_and_restarted(
    serve, over_budget: bool
) -> None:
    """One live partition sends three rows, then its stream stays open and silent for 30 s,
    nothing else moving (and, over the memory budget, the buffer full): the watchdog restarts
    it, and the query's deadline cancels the hung stream so its thread ends."""
    times = range(1010, 1010 + 10 * 50, 10)
    stalled = [record(ts, f"tx{ts}", 0, 1) for ts in times]
    streams: dict[str, list] = {
        INITIAL_PARTITION: [ChildPartitionsRecord(1000, "0", (ChildPartition("alone", ()),))],
        "alone": stalled,
    }
    servicer, source = serve(Script(streams, stalls={"alone": Stall(after_rows=3, seconds=30)}))
    log, events = captured_logger()
    config = ReaderConfig(
        start_timestamp=1000,
        end_timestamp=times[-1],
        heartbeat_ms=100,
        stuck_after_heartbeats=3,
        retry=FAST_RETRY,
        memory_budget_bytes=1 if over_budget else 256 * 1024 * 1024,
    )
    released: list[Transaction] = []
    reader = ChangeStreamReader(dataclasses.replace(source, deadline_slack_s=2.0), config, log)
    reader.run(lambda r: released.extend(r.transactions), threading.Event())
    assert released == [
        Transaction(r.commit_timestamp, r.server_transaction_id, (r,)) for r in stalled
    ]
    stuck = [e for e in events if e["event"] == "partition_stuck"]
    assert [e["partition_token"] for e in stuck] == ["alone"] and servicer.stalls_fired == 1
    hung_until = time.monotonic() + 20
    while any(t.name == "partition-alone" for t in threading.enumerate()):
        assert time.monotonic() < hung_until, "the hung stream's thread never ended"
        time.sleep(0.05)


@pytest.mark.parametrize("honor_resume_tokens", [True, False])
@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED])
def test_stream_cut_mid_way_loses_and_duplicates_nothing(
    serve, honor_resume_tokens: bool, code: grpc.StatusCode
) -> None:
    topology = build_topology(random.Random(42), events=8, transactions=150)
    streams = topology.records_by_partition()
    faults = {
        token: Fault(after_rows=len(rows) // 2, code=code, times=2)
        for token, rows in streams.items()
        if token != INITIAL_PARTITION and len(rows) >= 4
    }
    servicer, source = serve(Script(streams, faults, honor_resume_tokens))
    released, events = read_all(source, topology.start, topology.end)
    assert released == topology.expected()
    # A retry from the resume timestamp re-queries fewer rows, so a second cut may not be reached.
    assert len(faults) <= servicer.faults_fired <= 2 * len(faults)
    assert all(fault.times < 2 for fault in faults.values())
    retries = [e for e in events if e["event"] == "partition_query_retry"]
    if code == grpc.StatusCode.UNAVAILABLE and honor_resume_tokens:
        assert any(resume for _, _, resume in servicer.queries), "client resumed by token"
    if code == grpc.StatusCode.ABORTED:
        assert len(retries) == servicer.faults_fired
        assert all("Aborted" in e["cause"] for e in retries)
        partition_starts = {t: p.start for t, p in topology.partitions.items()}
        resumed_later = [
            s for t, s, _ in servicer.queries if t in faults and s > partition_starts[t]
        ]
        assert resumed_later, "a retried query must start at the partition's resume timestamp"


@pytest.mark.parametrize("mutable_key_range", [False, True])
def test_full_precision_values_pass_through(serve, mutable_key_range: bool) -> None:
    start = parse_rfc3339("2026-01-01T00:00:00.000000001Z")
    commit = parse_rfc3339("2026-01-01T00:00:00.123456789Z")
    end = commit + 1000
    columns = (
        ColumnType("id", {"code": "INT64"}, True, 1),
        ColumnType("at", {"code": "TIMESTAMP"}, False, 2),
        ColumnType("amount", {"code": "NUMERIC"}, False, 3),
        ColumnType("tags", {"code": "ARRAY", "array_element_type": {"code": "INT64"}}, False, 4),
    )
    values = {
        "at": "2026-01-01T00:00:00.987654321Z",
        "amount": "99999999999999999999999999999.999999999",
        "tags": ["-9223372036854775808", None],
    }
    data = record(
        commit,
        "t1",
        0,
        1,
        column_types=columns,
        mods=(Mod({"id": "9223372036854775807"}, values, {}),),
    )
    announce = (
        PartitionStartRecord(start, "0", ("p",))
        if mutable_key_range
        else ChildPartitionsRecord(start, "0", (ChildPartition("p", ()),))
    )
    streams: dict[str, list[ChangeRecord]] = {INITIAL_PARTITION: [announce], "p": [data]}
    _, source = serve(Script(streams, mutable_key_range=mutable_key_range))
    [transaction], _ = read_all(source, start, end)
    assert transaction.records == (data,)
    [mod] = transaction.records[0].mods
    types = {c.name: c.type for c in transaction.records[0].column_types}
    assert transaction.commit_timestamp == commit
    assert decode_value(types["id"], mod.keys["id"]) == 2**63 - 1
    assert decode_value(types["at"], mod.new_values["at"]) % 10**9 == 987654321
    assert str(decode_value(types["amount"], mod.new_values["amount"])) == values["amount"]
    assert decode_value(types["tags"], mod.new_values["tags"]) == [-(2**63), None]


def test_values_the_emulator_loses_reach_mirror_values_at_full_fidelity(serve) -> None:
    """NULL elements the emulator cannot store, non-finite floats it sends as null, and the
    PostgreSQL types: through the real client and reader, then the pipeline's state and mirror
    value rules (the Spark side of them is tested on change logs built by the real sink)."""
    from pipeline.values import mirror_value, state_value

    start = parse_rfc3339("2026-01-01T00:00:00.000000001Z")
    commit = parse_rfc3339("2026-01-01T00:00:00.5Z")

    def array(code: str) -> dict:
        return {"code": "ARRAY", "array_element_type": {"code": code}}

    pg_numeric = {"code": "NUMERIC", "type_annotation": "PG_NUMERIC"}
    pg_jsonb = {"code": "JSON", "type_annotation": "PG_JSONB"}
    sent: dict[str, tuple[dict, object, object]] = {
        "f64": (array("FLOAT64"), ["Infinity", None, "-Infinity", 1.5], [float("inf"), None]),
        "f32": (array("FLOAT32"), [0.1, None], [0.10000000149011612, None]),
        "flags": (array("BOOL"), [True, None], [True, None]),
        "names": (array("STRING"), ["NULL", None, ""], ["NULL", None, ""]),
        "blobs": (array("BYTES"), ["AP8=", None], [b"\x00\xff", None]),
        "ats": (array("TIMESTAMP"), ["0001-01-01T00:00:00.000000001Z", None], None),
        "amount": (pg_numeric, "NaN", "NaN"),
        "huge": (pg_numeric, "1e400", "1e400"),
        "doc": (pg_jsonb, '{"b": [1, null], "a": "ü"}', None),
        "docs": (array("JSON"), ['{"a":1}', None], ['{"a":1}', None]),
    }
    columns = (
        ColumnType("id", {"code": "INT64"}, True, 1),
        *(ColumnType(n, t, False, i) for i, (n, (t, _, _)) in enumerate(sent.items(), 2)),
    )
    data = record(
        commit,
        "t1",
        0,
        1,
        column_types=columns,
        mods=(Mod({"id": "1"}, {n: v for n, (_, v, _) in sent.items()}, {}),),
    )
    streams: dict[str, list[ChangeRecord]] = {
        INITIAL_PARTITION: [ChildPartitionsRecord(start, "0", (ChildPartition("p", ()),))],
        "p": [data],
    }
    _, source = serve(Script(streams))
    [transaction], _ = read_all(source, start, commit + 1000)
    [mod] = transaction.records[0].mods
    assert mod.new_values == {n: v for n, (_, v, _) in sent.items()}
    mirrored = {
        n: mirror_value(t, state_value(t, mod.new_values[n])) for n, (t, _, _) in sent.items()
    }
    for name, (_, _, expected) in sent.items():
        if expected is None:
            continue
        got = mirrored[name]
        if name == "f64":
            assert got[:2] == expected and got[2] == float("-inf") and got[3] == 1.5
        else:
            assert got == expected, name
    first_at = mirrored["ats"][0]
    assert (first_at.year, first_at.microsecond, mirrored["ats"][1]) == (1, 0, None)
    assert json.loads(mirrored["doc"]) == {"a": "ü", "b": [1, None]}
