"""Micro-batches as pure rules (``ingest.rules.batches``): the Spark source's driver and tasks
without Spark.

On simulated topologies of both partition modes (splits, moves, merges, key ranges moving),
batches end at random times; each plans its tasks (``plan_batch``) with random partition and
record limits, every task reads its partition up to the batch's end as a bounded query would, and
the driver lands the transactions at or below the batch's cut (``cut_batch``). Whatever the ends
and limits, and after a replay of any batch from its resume point: every transaction lands once,
whole, in commit order, and every batch lands only transactions that are whole.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ingest.model.records import (
    ChangeRecord,
    ChildPartitionsRecord,
    DataChangeRecord,
    PartitionEndRecord,
    PartitionStartRecord,
    Transaction,
    record_timestamp,
    sequence_key,
)
from ingest.model.resume import ResumePoint, start_point
from ingest.model.timestamps import Nanos
from ingest.rules.batches import (
    BatchCut,
    BatchPlanError,
    PartitionRead,
    PartitionReport,
    children_to_follow,
    cut_batch,
    plan_batch,
    stops_at_limit,
)
from ingest.rules.partitions import ends_partition, watermark_after
from tests.simulation import build_topology, mutable_key_range_streams, records_from

LINEAGE = (ChildPartitionsRecord, PartitionStartRecord, PartitionEndRecord)


def read_task(
    stream: list[ChangeRecord], read: PartitionRead
) -> tuple[list[DataChangeRecord], PartitionReport]:
    """A task's bounded query, as ``ingest.sparksource.task`` runs it against Spanner."""
    watermark = read.start - 1
    data: list[DataChangeRecord] = []
    lineage: list[ChangeRecord] = []
    ended = False
    for record in records_from(stream, read.start):
        if record_timestamp(record) > read.end:
            break
        if stops_at_limit(read, len(data), watermark):
            return data, PartitionReport(read.token, tuple(lineage), watermark, False)
        watermark = max(watermark, watermark_after(record))
        ended = ended or ends_partition(read.token, record)
        if isinstance(record, DataChangeRecord):
            data.append(record)
        elif isinstance(record, LINEAGE):
            lineage.append(record)
    closed_at = watermark if ended else max(watermark, read.end)
    return data, PartitionReport(read.token, tuple(lineage), closed_at, True)


def whole_transactions(
    records: list[DataChangeRecord], after: Nanos, cut: Nanos
) -> list[Transaction]:
    """What the driver lands: the records in (after, cut], whole, in commit order."""
    grouped: dict[str, list[DataChangeRecord]] = defaultdict(list)
    for record in records:
        if after < record.commit_timestamp <= cut:
            grouped[record.server_transaction_id].append(record)
    transactions = []
    for txid, parts in grouped.items():
        sequences = {r.record_sequence for r in parts}
        assert len(sequences) == len(parts), f"{txid}: a record read twice in one batch"
        assert len(parts) == parts[0].number_of_records_in_transaction, f"{txid} is not whole"
        ordered = tuple(sorted(parts, key=lambda r: sequence_key(r.record_sequence)))
        transactions.append(Transaction(parts[0].commit_timestamp, txid, ordered))
    return sorted(transactions, key=lambda t: t.order_key)


def read_wave(
    streams: dict[str, list[ChangeRecord]], reads: list[PartitionRead], seed: int
) -> tuple[list[DataChangeRecord], list[PartitionReport]]:
    """Tasks of one partition each, following splits and moves, their reports in any order of
    tasks (in read order within a task)."""
    data: list[DataChangeRecord] = []
    tasks = []
    for planned in reads:
        queue, reports = [planned], []
        while queue:
            read = queue.pop(0)
            records, report = read_task(streams[read.token], read)
            data += records
            queue += children_to_follow(read, report)
            reports.append(replace(report, followed=read is not planned))
        tasks.append(reports)
    random.Random(seed).shuffle(tasks)
    return data, [report for task in tasks for report in task]


def run_batch(
    streams: dict[str, list[ChangeRecord]],
    resume: ResumePoint,
    end: Nanos,
    max_partitions: int | None,
    max_records: int | None,
    waves: int = 1,
) -> tuple[list[Transaction], ResumePoint]:
    reads = plan_batch(resume, end, max_partitions, max_records)
    assert reads, "a batch past the watermark always has a partition to read"
    batch = BatchCut(resume, end)
    data: list[DataChangeRecord] = []
    for wave in range(waves):
        read, reports = read_wave(streams, reads, seed=end + wave)
        data += read
        batch.apply(reports)
        reads = batch.next_wave(max_records)
        if not reads:
            break
    cut = batch.cut()
    assert resume.low_watermark <= cut.low_watermark <= end
    return whole_transactions(data, resume.low_watermark, cut.low_watermark), cut


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    events=st.integers(0, 10),
    mutable_key_range=st.booleans(),
    data=st.data(),
)
def test_batches_land_every_transaction_once_whole_and_in_commit_order(
    seed: int, events: int, mutable_key_range: bool, data: st.DataObject
) -> None:
    rng = random.Random(seed)
    topology = build_topology(rng, events, transactions=rng.randint(1, 40))
    streams = (
        mutable_key_range_streams(topology, rng)
        if mutable_key_range
        else topology.records_by_partition()
    )
    resume = start_point(topology.start)
    landed: list[Transaction] = []
    history: list[tuple[ResumePoint, Nanos, int | None, int | None, int]] = []
    stalled = 0
    while resume.low_watermark < topology.end:
        end = min(topology.end, resume.low_watermark + data.draw(st.integers(1, 150)))
        max_partitions = data.draw(st.one_of(st.none(), st.integers(1, 4)))
        max_records = data.draw(st.one_of(st.none(), st.integers(1, 5)))
        waves = data.draw(st.integers(1, 3))
        history.append((resume, end, max_partitions, max_records, waves))
        transactions, cut = run_batch(streams, resume, end, max_partitions, max_records, waves)
        landed += transactions
        stalled = stalled + 1 if cut.low_watermark == resume.low_watermark else 0
        assert stalled < 50, "the cut stopped moving"
        resume = cut
    assert [t.order_key for t in landed] == [t.order_key for t in topology.expected()]
    assert landed == topology.expected()

    replayed = data.draw(st.sampled_from(history))
    assert run_batch(streams, *replayed) == run_batch(streams, *replayed), (
        "a replayed batch plans and cuts the same"
    )


def test_a_merge_found_in_a_batch_lowers_the_cut_below_its_start_unless_a_wave_reads_it() -> None:
    topology = build_topology(random.Random(7), events=3, transactions=10)
    streams = topology.records_by_partition()
    merges = [
        p
        for p in topology.partitions.values()
        if len(p.children) == 1 and len(p.children[0][1]) == 2
    ]
    assert merges, "the topology of seed 7 merges"
    first_end = min(p.end for p in merges if p.end is not None)
    resume = start_point(topology.start)
    _, resume = run_batch(streams, resume, topology.start + 1, None, None)
    assert resume.low_watermark == topology.start - 1, "the initial query's children start at T0"
    _, cut = run_batch(streams, resume, topology.end, None, None)
    assert cut.low_watermark == first_end - 1
    _, cut = run_batch(streams, resume, topology.end, None, None, waves=10)
    assert cut.low_watermark == topology.end, "further waves read every merge's child"


def test_reports_that_do_not_match_the_plan_are_refused() -> None:
    resume = start_point(1_000)
    reads = plan_batch(resume, 2_000)
    report = PartitionReport(reads[0].token, (), 1_500, True)
    with pytest.raises(BatchPlanError):
        cut_batch(resume, 2_000, [report, report])
    with pytest.raises(BatchPlanError):
        cut_batch(resume, 2_000, [PartitionReport("not-planned", (), 1_500, True)])


def test_an_end_at_or_below_the_watermark_plans_nothing() -> None:
    resume = start_point(1_000)
    assert plan_batch(resume, resume.low_watermark) == []
