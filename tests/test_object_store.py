"""The fences on an object store (MinIO on loopback) as on a local path: conditional writes,
the pipeline's checkpoint lease and the ingest's Delta commit."""

from __future__ import annotations

import functools
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

from ingest.delta.sink import DeltaChangeLogSink, WriterFenced
from pipeline.state.checkpoint import (
    LOCK_FILE,
    CheckpointInUse,
    CheckpointLock,
    CheckpointLockLost,
)
from runtime.conditional import ConditionalObject, VersionChanged
from runtime.storage import delta_storage_options
from tests.delta_checks import describe_job_versions, job_versions, read_versions
from tests.object_stores import S3Store, minio
from tests.store_faults import FaultRates, StoreFaults
from tests.test_sink import COMMIT, point, transactions


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Store]:
    with minio(tmp_path_factory.mktemp("minio")) as store:
        yield store


@pytest.fixture(params=["local", "s3"])
def root(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh folder on a local path or in the MinIO bucket, its credentials in the
    environment as a deployment would give them."""
    if request.param == "local":
        return str(tmp_path)
    store: S3Store = request.getfixturevalue("s3")
    for name, value in store.environment().items():
        monkeypatch.setenv(name, value)
    return store.uri(f"test-{uuid.uuid4().hex}")


def at_once(count: int, act: Callable[[int], Any]) -> list[Any]:
    """``act(i)`` in ``count`` threads released together; each result or raised error."""
    barrier = threading.Barrier(count)
    results: list[Any] = [None] * count

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = act(i)
        except Exception as error:
            results[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return results


def create(target: ConditionalObject, i: int) -> str:
    return target.create(f"{i}".encode())


def commit_one(sinks: list[DeltaChangeLogSink], base: int, i: int) -> object:
    return sinks[i].commit(transactions(1, base + i), point(base + 9))


def test_of_writers_racing_to_create_one_object_exactly_one_wins(root: str) -> None:
    for round_ in range(3):
        name = f"object-{round_}"
        results = at_once(6, functools.partial(create, ConditionalObject(root, name)))
        winners = [i for i, r in enumerate(results) if isinstance(r, str)]
        assert len(winners) == 1, results
        assert all(isinstance(r, VersionChanged) for r in results if not isinstance(r, str))
        found = ConditionalObject(root, name).read()
        assert found is not None and found.data == f"{winners[0]}".encode()


def test_a_replace_lands_only_on_the_version_it_read(root: str) -> None:
    lease = ConditionalObject(root, "lease")
    first = lease.create(b"a")
    second = lease.replace(b"b", first)
    with pytest.raises(VersionChanged):
        lease.replace(b"c", first)
    results = at_once(4, lambda i: lease.replace(f"racer {i}".encode(), second))
    assert sum(isinstance(r, str) for r in results) == 1, results
    lease.delete()
    assert lease.read() is None


def test_of_jobs_started_at_once_on_one_checkpoint_exactly_one_runs(root: str) -> None:
    locks = [CheckpointLock(root, 30, f"pipeline {i}") for i in range(4)]
    results = at_once(4, lambda i: locks[i].acquire())
    holders = [i for i, r in enumerate(results) if r is None]
    try:
        assert len(holders) == 1, results
        assert all(isinstance(r, CheckpointInUse) for r in results if r is not None)
        locks[holders[0]].check_held()
    finally:
        for i in holders:
            locks[i].release()


def test_a_job_paused_past_its_lease_finds_it_taken_before_it_writes(root: str) -> None:
    """A pause (a stopped container, a long GC) outlives the lease; the job that took over holds
    it, and the paused one learns so from its own clock and from the store."""
    stale_s = 2.0
    paused = CheckpointLock(root, stale_s, "pipeline paused")
    paused.acquire()
    paused._stop.set()  # its heartbeat stops as a paused process's would
    newcomer = CheckpointLock(root, stale_s, "pipeline newcomer")
    taken = threading.Event()

    def take_over() -> None:
        while not taken.is_set():
            try:
                newcomer.acquire()
                taken.set()
            except CheckpointInUse:
                threading.Event().wait(0.2)

    attempts = threading.Thread(target=take_over, daemon=True)
    attempts.start()
    assert taken.wait(60), "the newcomer never took the stale lease"
    try:
        with pytest.raises(CheckpointLockLost, match="no longer holds"):
            paused.check_held()
        assert paused.renew() is False and paused.lost
        newcomer.check_held()
        lease = ConditionalObject(root, LOCK_FILE)
        before = lease.read()
        assert newcomer.renew() is True
        after = lease.read()
        assert before is not None and after is not None and after.version != before.version
    finally:
        newcomer.release()
        paused.release()


def test_of_two_ingest_writers_racing_every_commit_one_lands_and_the_other_is_fenced(
    root: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On S3 every listing of the log is held back half a second, so both writers find the same
    next version free and both write it: only the store's put-if-absent keeps one of them out.
    The first round races to create the table, the commit delta-rs checks no conflict on."""
    uri = f"{root}/changelog"
    if root.startswith("s3://"):
        store: S3Store = request.getfixturevalue("s3")
        slow_looks = FaultRates(
            delay=1.0, delay_s=0.5, methods=("GET", "HEAD"), path=r"list-type=2.*_delta_log"
        )
        proxy = StoreFaults(store.endpoint, slow_looks, seed=1).start()
        request.addfinalizer(proxy.stop)
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.address)
    for round_ in range(4):
        base = COMMIT + round_ * 10**6
        sinks = [DeltaChangeLogSink(uri, "job", f"racer-{round_}-{i}") for i in range(2)]
        for sink in sinks:
            sink.continue_after(sink.latest_checkpoint())
        results = at_once(2, functools.partial(commit_one, sinks, base))
        landed = [r for r in results if not isinstance(r, Exception)]
        assert len(landed) == 1, results
        assert all(isinstance(r, WriterFenced) for r in results if isinstance(r, Exception))
    if root.startswith("s3://"):
        assert proxy.counts["delay"] > 0, "no look at the log was held back"
    table = DeltaTable(uri)
    assert table.transaction_version("job") == 4
    assert table.to_pyarrow_table().num_rows == 4 * 2
    log = f"{uri}/_delta_log"
    missing = [
        v
        for v in range(table.version() + 1)
        if ConditionalObject(log, f"{v:020d}.crc").read() is None
    ]
    assert not missing, f"versions without a checksum: {missing}"


def test_the_environment_alone_configures_every_client_for_s3() -> None:
    from runtime.storage import arrow_filesystem, delta_storage_options, spark_config

    environ = {
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
        "AWS_REGION": "eu-west-1",
        "AWS_ACCESS_KEY_ID": "k",
        "AWS_SECRET_ACCESS_KEY": "s",
    }
    assert delta_storage_options("s3://b/t", environ) == {"conditional_put": "etag"}
    assert delta_storage_options("s3a://b/t", environ) == {"conditional_put": "etag"}
    assert delta_storage_options("s3://b/t", {"AWS_S3_LOCKING_PROVIDER": "dynamodb"}) is None
    assert delta_storage_options("gs://b/t", environ) is None
    assert delta_storage_options("/tmp/t", environ) is None
    spark = spark_config(environ)
    assert spark["spark.hadoop.fs.s3.impl"] == "org.apache.hadoop.fs.s3a.S3AFileSystem"
    assert spark["spark.hadoop.fs.s3a.endpoint"] == "http://127.0.0.1:9000"
    assert spark["spark.hadoop.fs.s3a.connection.ssl.enabled"] == "false"
    assert spark["spark.hadoop.fs.s3a.endpoint.region"] == "eu-west-1"
    assert "spark.hadoop.fs.s3a.endpoint" not in spark_config({})
    filesystem, path = arrow_filesystem("s3a://bucket/cdc/changelog/", environ)
    assert (filesystem.type_name, path) == ("s3", "bucket/cdc/changelog")


def test_the_checkpoint_s_own_files_land_whole_though_the_store_s_answers_are_lost(
    s3: S3Store, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fifth of the writes' answers are cut after MinIO accepted them. A file written in parts
    would be lost on the retry of its completion (``NO_SUCH_UPLOAD``: the upload already
    completed, CI saw the pipeline exit on it); one written by a single put is retried whole."""
    from pyspark.sql import types as T

    from pipeline.state import cut
    from pipeline.state.registry import SchemaRegistry

    lost = FaultRates(lost_answer=0.2, methods=("PUT", "POST"))
    proxy = StoreFaults(s3.endpoint, lost, seed=7).start()
    request.addfinalizer(proxy.stop)
    for name, value in s3.environment(proxy.address).items():
        monkeypatch.setenv(name, value)
    root = s3.uri(f"test-{uuid.uuid4().hex}")
    for number in range(1, 16):
        schemas = {
            "row": T.StructType([T.StructField(f"c{i}", T.LongType()) for i in range(number)])
        }
        assert SchemaRegistry(root).record(schemas, ()).number == number
        cut.record(root, cut.Cut(number, 0, number))
        assert cut.read(root) == cut.Cut(number, 0, number)
    assert proxy.counts["lost_answer"] >= 3, proxy.counts
    history = SchemaRegistry(root).history()
    assert [d.number for d in history] == list(range(1, 16))
    assert [len(d.schemas["row"].fields) for d in history] == list(range(1, 16))


def test_a_snapshot_file_whose_completed_upload_lost_its_answer_is_kept(
    s3: S3Store, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A snapshot task's file of more than one part: every answer to completing its upload is
    cut after MinIO completed it. The file is whole in the store, so the task keeps it."""
    from ingest.delta.snapshot_files import SnapshotFileWriter, read_keys
    from ingest.model.records import ColumnType
    from ingest.model.snapshot import SnapshotChunk

    completions = FaultRates(lost_answer=1.0, methods=("POST",), path=r"uploadId=")
    proxy = StoreFaults(s3.endpoint, completions, seed=1).start()
    request.addfinalizer(proxy.stop)
    for name, value in s3.environment(proxy.address).items():
        monkeypatch.setenv(name, value)
    uri = s3.uri(f"test-{uuid.uuid4().hex}/changelog")
    columns = (ColumnType("k", {"code": "INT64"}, True, 1),)
    rows = [(f'{{"k":"{n}"}}', f'{{"v":"{os.urandom(64 << 10).hex()}"}}') for n in range(200)]
    writer = SnapshotFileWriter(uri, COMMIT - 1, target_bytes=1 << 30)
    writer.write([SnapshotChunk("a", columns, rows, None, False)])
    files = writer.close()
    assert proxy.counts["lost_answer"] >= 1, proxy.counts
    assert [f.rows for f in files] == [200] and files[0].size > 20 << 20
    assert read_keys(uri, files) == [k for k, _ in rows]


def test_a_batch_s_own_commit_whose_answer_was_lost_is_recognised_not_failed(
    s3: S3Store, spark: Any, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Half the answers to Delta log puts are cut after MinIO took the put. delta-rs's retry of
    the put then finds the version taken by a commit with the batch's own ``txn`` and reports a
    concurrent transaction (CI saw the pipeline exit on it recording the batch log); the job
    finds its batch there and goes on, and nothing lands twice."""
    from pyspark.sql import types as T

    from pipeline import batch_log
    from pipeline.user_processors.outputs import append_batch, ensure_output
    from runtime.logs import null_logger

    root = s3.uri(f"test-{uuid.uuid4().hex}")
    for name, value in s3.environment().items():
        monkeypatch.setenv(name, value)
    schema = T.StructType([T.StructField("n", T.LongType())])
    output = f"{root}/processors/counts"
    ensure_output(output, schema, "counts", null_logger())
    batch_log.record(root, batch_log.AppliedBatch(0, 0, 0, None, False, None), "job", null_logger())

    log_puts = FaultRates(lost_answer=0.5, methods=("PUT",), path=r"_delta_log/")
    proxy = StoreFaults(s3.endpoint, log_puts, seed=3).start()
    request.addfinalizer(proxy.stop)
    for name, value in s3.environment(proxy.address).items():
        monkeypatch.setenv(name, value)
    batches = range(1, 9)
    for batch_id in batches:
        landed = batch_log.AppliedBatch(batch_id, 0, batch_id, None, False, None)
        batch_log.record(root, landed, "job", null_logger())
        rows = spark.createDataFrame([(batch_id,), (batch_id * 10,)], schema)
        append_batch(rows, output, "job", batch_id, 1000, null_logger())
    assert proxy.counts["lost_answer"] >= 4, proxy.counts

    assert [b.batch_id for b in batch_log.read(root)] == [0, *batches]
    table = DeltaTable(output, storage_options=delta_storage_options(output))
    assert sorted(r["n"] for r in table.to_pyarrow_table().to_pylist()) == sorted(
        [*batches, *(b * 10 for b in batches)]
    )


def test_a_first_commit_whose_answer_was_lost_creates_the_table_once(
    s3: S3Store, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commit that creates a table (the change log's, the batch log's) has its answer cut
    after MinIO took it, and the store's retry of the put is refused. delta-rs, finding its own
    version 0 there, would commit again at version 1 without checking the ``txn`` (CI saw the
    change log hold the job's version 1 twice); the writer's own retry finds it landed."""
    from pipeline import batch_log
    from runtime.logs import null_logger

    def lose_first_answer() -> StoreFaults:
        """The first put of a version 0 loses its answer; the store's retry gets its 412."""
        rates = FaultRates(
            lost_answer=0.5, methods=("PUT",), path=r"_delta_log/00000000000000000000\.json"
        )
        proxy = StoreFaults(s3.endpoint, rates, seed=1).start()
        request.addfinalizer(proxy.stop)
        for name, value in s3.environment(proxy.address).items():
            monkeypatch.setenv(name, value)
        return proxy

    root = s3.uri(f"test-{uuid.uuid4().hex}")
    proxy = lose_first_answer()
    sink = DeltaChangeLogSink(f"{root}/changelog", "job", "owner-a")
    sink.continue_after(None)
    results = [
        sink.commit(transactions(1, COMMIT + n * 10**6), point(COMMIT + n * 10**6 + 9))
        for n in (1, 2)
    ]
    assert proxy.counts["lost_answer"] == 1, proxy.counts
    assert [r.replayed for r in results] == [True, False], "the first commit's answer was lost"
    appends = [v for v in read_versions(f"{root}/changelog") if v.operation == "WRITE"]
    assert job_versions(appends) == [1, 2], describe_job_versions(appends)

    proxy = lose_first_answer()
    for batch_id in range(2):
        applied = batch_log.AppliedBatch(batch_id, 0, batch_id, None, False, None)
        batch_log.record(root, applied, "job", null_logger())
    assert proxy.counts["lost_answer"] == 1, proxy.counts
    log = DeltaTable(batch_log.log_uri(root), storage_options=delta_storage_options(root))
    assert log.version() == 1, "batch 0 was committed twice (the reader keeps one of them)"
    assert [b.batch_id for b in batch_log.read(root)] == [0, 1]
