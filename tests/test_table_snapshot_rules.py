"""The on-demand table snapshot's rules on a real Delta change log, without Spanner: the request
is recorded at a landed low watermark T1, chunks ride on the stream's commits, a crash at any
commit resumes without loss or duplicate, and the keys the change log held alive that Spanner no
longer has at T1 land as deletes, so a replay in the change log's order ends at Spanner's rows."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import DeltaTable
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ingest.contract.changelog import SNAPSHOT_DELETE, SNAPSHOT_ROW
from ingest.delta.absent_keys import absent_keys, deleted_after, keys_of_earlier_jobs
from ingest.delta.sink import DeltaChangeLogSink
from ingest.model.encoding import canonical_json
from ingest.model.records import sequence_key
from ingest.model.resume import ResumablePartitions, ResumePoint
from ingest.model.snapshot import Key, SnapshotChunk, SnapshotProgress
from ingest.model.timestamps import parse_rfc3339, to_rfc3339
from ingest.snapshot.initial import SnapshotSettings, run_snapshot
from ingest.snapshot.on_demand import TableSnapshots
from tests.builders import ACCOUNTS, ChangeLog, captured_logger

KEYS = range(8)


class Crash(Exception):
    pass


def spanner_reader(rows_at_t1: dict[int, int], chunk_rows: int):
    """Reads Spanner's rows at T1 in key order after a key, as ``read_table`` does."""

    def read(
        table: str, columns, read_timestamp: int, after: Key | None
    ) -> Iterator[SnapshotChunk]:
        keys = [k for k in sorted(rows_at_t1) if after is None or k > int(after[0])]
        last: Key | None = after
        rows: list[tuple[str, str]] = []
        for key in keys:
            rows.append(
                (
                    canonical_json({"account_id": str(key)}),
                    canonical_json({"balance": str(rows_at_t1[key])}),
                )
            )
            last = (str(key),)
            if len(rows) == chunk_rows:
                yield SnapshotChunk(table, columns, rows, last, done=False)
                rows = []
        yield SnapshotChunk(table, columns, rows, last, done=True)

    return read


def replay(uri: str) -> dict[str, str]:
    """The rows a reader ends with applying every row in the change log's order (a row applies
    only over older positions of its key: sorting does that)."""
    rows = DeltaTable(uri).to_pyarrow_dataset().to_table(use_threads=False).to_pylist()
    rows = [r for r in rows if r["keys"]]
    rows.sort(
        key=lambda r: (
            r["commit_timestamp_text"],
            r["server_transaction_id"],
            sequence_key(r["record_sequence"]),
            r["mod_index"],
        )
    )
    alive: dict[str, str] = {}
    for row in rows:
        if row["mod_type"] in ("DELETE", SNAPSHOT_DELETE):
            alive.pop(row["keys"], None)
        else:
            merged = {**json.loads(alive.get(row["keys"], "{}")), **json.loads(row["new_values"])}
            alive[row["keys"]] = json.dumps(merged, sort_keys=True)
    return alive


def replay_forgetting_deletes(uri: str) -> dict[str, str]:
    """The rows a reader ends with applying each version's rows in the change log's version
    order, remembering nothing of a deleted key (a pipeline whose tombstones expired at once):
    a row applies over an older position of its key, or to a key it does not hold."""
    log = Path(uri) / "_delta_log"
    held: dict[str, tuple[tuple, str]] = {}
    for commit in sorted(log.glob("*.json")):
        files = [
            action["add"]["path"]
            for line in commit.read_text().splitlines()
            if "add" in (action := json.loads(line))
        ]
        for path in files:
            for row in pq.read_table(Path(uri) / unquote(path)).to_pylist():
                if not row["keys"]:
                    continue
                at = (
                    row["commit_timestamp_text"],
                    row["server_transaction_id"],
                    sequence_key(row["record_sequence"]),
                    row["mod_index"],
                )
                before = held.get(row["keys"])
                if before is not None and at <= before[0]:
                    continue
                if row["mod_type"] in ("DELETE", SNAPSHOT_DELETE):
                    held.pop(row["keys"], None)
                else:
                    values = json.loads(before[1] if before else "{}")
                    merged = json.dumps({**values, **json.loads(row["new_values"])}, sort_keys=True)
                    held[row["keys"]] = (at, merged)
    return {key: values for key, (_, values) in held.items()}


def key_json(key: int) -> str:
    return canonical_json({"account_id": str(key)})


def value_json(balance: int) -> str:
    return json.dumps({"balance": str(balance)}, sort_keys=True)


operations = st.lists(
    st.tuples(
        st.sampled_from(["INSERT", "UPDATE", "DELETE"]), st.sampled_from(KEYS), st.integers(0, 99)
    ),
    max_size=12,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    history=operations,
    spanner_at_t1=st.dictionaries(st.sampled_from(KEYS), st.integers(0, 99)),
    after_t1=operations,
    chunk_rows=st.integers(1, 3),
    crashes=st.lists(st.integers(0, 6), max_size=3),
)
def test_a_table_snapshot_lands_once_and_replays_to_spanner(
    tmp_path_factory,
    history: list[tuple[str, int, int]],
    spanner_at_t1: dict[int, int],
    after_t1: list[tuple[str, int, int]],
    chunk_rows: int,
    crashes: list[int],
) -> None:
    uri = str(tmp_path_factory.mktemp("changelog"))
    log = ChangeLog(uri)
    for mod_type, key, balance in history:
        log.commit(("accounts", mod_type, {"account_id": str(key)}, {"balance": str(balance)}))
    log.clock += 1  # T1, the landed low watermark, just past the last change of the history
    log.land()
    t1 = log.clock
    expected = {key_json(k): value_json(v) for k, v in spanner_at_t1.items()}
    stop = threading.Event()
    stream = iter(after_t1)
    logger, _ = captured_logger()
    commits, recorded, finished = 0, False, False
    crash_points = sorted(set(crashes))
    while not finished:
        snapshots = TableSnapshots(
            log.sink,
            spanner_reader(spanner_at_t1, chunk_rows),
            lambda at: {"accounts": ACCOUNTS},
            lambda table, at, found: absent_keys(DeltaTable(uri), table, at, found),
            lambda table, at: deleted_after(DeltaTable(uri), table, at),
            version_retention=lambda: 10**18,
            workers=1,
            log=logger,
            stop=stop,
        )
        snapshots.resume()
        if not recorded:
            # Queued, not waited for: answered once the next commit records it (the caller of
            # a crashed process asks again).
            assert snapshots.request(["accounts"], timeout_s=0)[0] == 504
            assert snapshots.due()
        try:
            while not finished:
                step = next(stream, None) if recorded else None
                if step is not None:
                    mod_type, key, balance = step
                    log.commit(
                        ("accounts", mod_type, {"account_id": str(key)}, {"balance": str(balance)})
                    )
                chunks, _ = snapshots.before_commit(log.clock, log.pending)
                crash = bool(crash_points) and commits == crash_points[0]
                if crash and commits % 2 == 0:  # before the commit: its chunks are read again
                    crash_points.pop(0)
                    raise Crash
                log.sink.commit(
                    log.pending,
                    ResumePoint(log.clock, ResumablePartitions((), ())),
                    snapshot=chunks,
                )
                log.pending = []
                commits += 1
                if crash:  # after it, before the batcher hears back
                    crash_points.pop(0)
                    recorded = recorded or log.sink.table_snapshot is not None
                    raise Crash
                snapshots.after_commit()
                if not recorded:
                    running = snapshots.running
                    assert running is not None and running.read_timestamp == t1
                    recorded = True
                finished = snapshots.running is None and not snapshots.due() and step is None
        except Crash:
            pending = log.pending
            log = ChangeLog(uri, clock=log.clock)
            log.pending = pending
        finally:
            snapshots.close()
    for mod_type, key, balance in after_t1:
        if mod_type == "DELETE":
            expected.pop(key_json(key), None)
        else:
            expected[key_json(key)] = json.dumps(
                {**json.loads(expected.get(key_json(key), "{}")), "balance": str(balance)},
                sort_keys=True,
            )
    assert replay(uri) == expected
    assert replay_forgetting_deletes(uri) == expected, "a deleted row came back"
    rows = (
        DeltaTable(uri)
        .to_pyarrow_dataset()
        .to_table(
            filter=pc.field("mod_type").isin([SNAPSHOT_ROW, SNAPSHOT_DELETE]), use_threads=False
        )
    )
    snapshot_keys = [r["keys"] for r in rows.to_pylist() if r["mod_type"] == SNAPSHOT_ROW]
    assert len(snapshot_keys) == len(set(snapshot_keys)), "each row once"
    deleted_after_t1 = {key_json(k) for mod_type, k, _ in after_t1 if mod_type == "DELETE"}
    read_at_t1 = {key_json(k) for k in spanner_at_t1}
    assert read_at_t1 - deleted_after_t1 <= set(snapshot_keys) <= read_at_t1
    assert set(rows["commit_timestamp_text"].to_pylist()) <= {to_rfc3339(t1)}
    last_in_history = {key: mod_type for mod_type, key, _ in history}
    alive_before = {k for k, mod_type in last_in_history.items() if mod_type != "DELETE"}
    deletes = [r["keys"] for r in rows.to_pylist() if r["mod_type"] == SNAPSHOT_DELETE]
    absent_at_t1 = {key_json(k) for k in alive_before - set(spanner_at_t1)}
    assert len(deletes) == len(set(deletes)) and set(deletes) <= absent_at_t1
    # A key the stream deleted after T1 needs no delete at T1: that delete removes it.
    assert absent_at_t1 - set(deletes) <= deleted_after_t1
    checkpoint = log.sink.latest_checkpoint()
    assert checkpoint is not None and checkpoint.consistent


def test_a_table_snapshot_that_cannot_finish_is_abandoned_and_the_stream_goes_on(
    tmp_path,
) -> None:
    uri = str(tmp_path / "changelog")
    log = ChangeLog(uri)
    log.commit(("accounts", "INSERT", {"account_id": "1"}, {"balance": "5"}))
    log.clock += 1
    log.land()
    logger, events = captured_logger()

    def dropped_table(table: str, columns, read_timestamp: int, after: Key | None):
        yield SnapshotChunk(table, columns, [(key_json(1), value_json(5))], ("1",), done=False)
        raise LookupError("table accounts was dropped")

    def snapshots(retention: int) -> TableSnapshots:
        return TableSnapshots(
            log.sink,
            dropped_table,
            lambda at: {"accounts": ACCOUNTS},
            lambda table, at, found: absent_keys(DeltaTable(uri), table, at, found),
            lambda table, at: deleted_after(DeltaTable(uri), table, at),
            version_retention=lambda: retention,
            workers=1,
            log=logger,
            stop=threading.Event(),
        )

    def commit(running: TableSnapshots) -> None:
        chunks, _ = running.before_commit(log.clock, [])
        log.sink.commit([], ResumePoint(log.clock, ResumablePartitions((), ())), snapshot=chunks)
        running.after_commit()

    running = snapshots(10**18)
    assert running.request(["accounts"], timeout_s=0)[0] == 504
    commit(running)  # records the request and starts the reader
    assert running.running is not None
    deadline = time.monotonic() + 10
    while running.running is not None:
        assert time.monotonic() < deadline, "the reader's error never reached the committer"
        commit(running)
    running.close()
    checkpoint = log.sink.latest_checkpoint()
    assert checkpoint is not None and checkpoint.table_snapshot is None and checkpoint.consistent
    abandoned = [e for e in events if e["event"] == "table_snapshot_abandoned"]
    assert abandoned and "LookupError" in abandoned[0]["cause"]

    # A resumed snapshot whose T1 is out of the version retention is abandoned, not fatal.
    log.sink.track_table_snapshot(SnapshotProgress.begin(log.clock, ["accounts"]))
    log.land()
    resumed = snapshots(retention=1)
    resumed.resume()
    assert resumed.running is None
    assert sum(e["event"] == "table_snapshot_abandoned" for e in events) == 2


def test_a_new_job_after_an_abandoned_snapshot_leaves_none_of_its_rows_applicable(
    tmp_path,
) -> None:
    """The recovery for a snapshot that outlived retention: a new job id on the same change log.
    Its snapshot deletes at its T0 every key the abandoned one landed that Spanner no longer
    has, so replaying the whole change log ends at Spanner's rows."""
    uri = str(tmp_path / "changelog")
    logger, _ = captured_logger()
    t0_old = parse_rfc3339("2026-11-20T10:00:00Z")
    old = DeltaChangeLogSink(uri, "bank.all_changes", "owner-1")
    old.continue_after(None)
    progress = SnapshotProgress.begin(t0_old, ["accounts"])
    old.start_job(t0_old + 1, progress)
    rows = {k: 10 * k for k in range(10)}
    first = next(spanner_reader(rows, chunk_rows=6)("accounts", ACCOUNTS, t0_old, None))
    old.commit_snapshot([first], progress.advanced(first))  # then abandoned: out of retention

    t0_new = parse_rfc3339("2026-11-22T10:00:00Z")
    rows_now = {0: 1, 2: 2, 42: 3}  # keys 1, 3, 4, 5 deleted meanwhile; 42 added
    new = DeltaChangeLogSink(uri, "bank.all_changes.2", "owner-2")
    new.continue_after(None)
    progress = SnapshotProgress.begin(t0_new, ["accounts"])
    new.start_job(t0_new + 1, progress)
    assert not keys_of_earlier_jobs(DeltaTable(uri), "transfers", t0_new, [])
    run_snapshot(
        new,
        progress,
        {"accounts": ACCOUNTS},
        spanner_reader(rows_now, chunk_rows=2),
        SnapshotSettings(workers=1),
        logger,
        threading.Event(),
        absent_keys=lambda table, at, found: keys_of_earlier_jobs(
            DeltaTable(uri), table, at, found
        ),
    )
    assert replay(uri) == {key_json(k): value_json(v) for k, v in rows_now.items()}
    assert replay_forgetting_deletes(uri) == replay(uri)
