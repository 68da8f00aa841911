"""The coordinator step (partitions + assembler) over simulated topologies: output equals the
serial commit order.

Hypothesis picks the topology (splits, moves, merges, multi-partition transactions, heartbeats),
the interleaving of partitions, and where queries fail and restart from their resume timestamp.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ingest.model.records import ChangeRecord, Transaction
from ingest.model.resume import ResumePoint
from ingest.rules.coordinator import Coordinator
from ingest.rules.partitions import INITIAL_PARTITION
from tests.simulation import Topology, mutable_key_range_streams, records_from
from tests.simulation import topologies as simulated_topologies


def deliver_next(
    coordinator: Coordinator, remaining: dict[str, list[ChangeRecord]], token: str
) -> bool:
    """Feed the coordinator step a partition's next event, as the reader does; True when the
    partition's stream ended."""
    if remaining[token]:
        coordinator.record_read(token, remaining[token].pop(0))
        return False
    del remaining[token]
    coordinator.stream_ended(token)
    return True


def streams_of(topology: Topology, mutable_key_range: bool) -> dict[str, list[ChangeRecord]]:
    if mutable_key_range:
        return mutable_key_range_streams(topology, random.Random(topology.start + topology.end))
    return topology.records_by_partition()


def drive(
    topology: Topology, data: st.DataObject, with_failures: bool, mutable_key_range: bool = False
) -> dict:
    streams = streams_of(topology, mutable_key_range)
    coordinator = Coordinator(topology.start, topology.end)
    tracker = coordinator.tracker
    remaining: dict[str, list[ChangeRecord]] = {}
    finished: set[str] = set()
    first_queries: Counter[str] = Counter()
    released: list[Transaction] = []
    watermarks: list[int] = []
    raw_watermarks: list[int] = []

    def query(token: str) -> None:
        partition = next(p for p in tracker.unfinished() if p.token == token)
        coordinator.query_started(token, partition.resume_timestamp)
        remaining[token] = records_from(streams[token], partition.resume_timestamp)

    while True:
        for partition in tracker.take_ready(10**6):
            assert partition.parent_tokens <= finished, "child started before its parents ended"
            first_queries[partition.token] += 1
            query(partition.token)
        if not remaining:
            break
        token = data.draw(st.sampled_from(sorted(remaining)))
        choices = ["next"] * 4 + (["restart"] if with_failures else [])
        action = data.draw(st.sampled_from(choices))
        if action == "restart":
            query(token)
        elif deliver_next(coordinator, remaining, token):
            finished.add(token)
        raw = tracker.low_watermark()
        if raw is not None:
            raw_watermarks.append(raw)
        low_watermark = coordinator.low_watermark()
        assert low_watermark is not None
        watermarks.append(low_watermark)
        release = coordinator.release()
        if release is not None:
            released.extend(release.transactions)
    return {
        "released": released,
        "watermarks": watermarks,
        "raw_watermarks": raw_watermarks,
        "first_queries": first_queries,
        "assembler": coordinator.assembler,
        "tracker": tracker,
    }


topologies = simulated_topologies(25, 60)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(topology=topologies, data=st.data(), with_failures=st.booleans())
def test_output_is_the_serial_commit_order(
    topology: Topology, data: st.DataObject, with_failures: bool
) -> None:
    result = drive(topology, data, with_failures)
    assert result["released"] == topology.expected()
    assert result["assembler"].buffered_bytes == 0
    assert result["assembler"].open_transactions == 0
    assert result["tracker"].all_finished


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(topology=topologies, data=st.data(), with_failures=st.booleans())
def test_watermark_never_goes_backwards(
    topology: Topology, data: st.DataObject, with_failures: bool
) -> None:
    result = drive(topology, data, with_failures)
    for series in (result["raw_watermarks"], result["watermarks"]):
        assert all(a <= b for a, b in itertools.pairwise(series))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(topology=topologies, data=st.data())
def test_each_partition_is_queried_once_and_merges_wait_for_all_parents(
    topology: Topology, data: st.DataObject
) -> None:
    result = drive(topology, data, with_failures=True)
    expected_tokens = {*topology.partitions, INITIAL_PARTITION}
    assert set(result["first_queries"]) == expected_tokens
    assert set(result["first_queries"].values()) == {1}


def drive_with_crashes(
    topology: Topology, data: st.DataObject, mutable_key_range: bool = False
) -> list[Transaction]:
    """Like ``drive``, but at random moments all state is lost and restored from the resume
    point of the last release (what the Delta sink stores in each commit)."""
    streams = streams_of(topology, mutable_key_range)
    coordinator = Coordinator(topology.start, topology.end)
    landed: list[Transaction] = []
    resume: ResumePoint | None = None
    remaining: dict[str, list[ChangeRecord]] = {}
    crashes = 0
    while True:
        for partition in coordinator.tracker.take_ready(10**6):
            coordinator.query_started(partition.token, partition.resume_timestamp)
            remaining[partition.token] = records_from(
                streams[partition.token], partition.resume_timestamp
            )
        if not remaining:
            break
        if crashes < 5 and data.draw(st.integers(0, 30)) == 0:
            crashes += 1
            coordinator = Coordinator(topology.start, topology.end, resume_from=resume)
            remaining = {}
            continue
        token = data.draw(st.sampled_from(sorted(remaining)))
        deliver_next(coordinator, remaining, token)
        release = coordinator.release()
        if release is not None:
            landed.extend(release.transactions)
            resume = release.resume_point
    return landed


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(topology=topologies, data=st.data())
def test_restart_from_any_resume_point_loses_and_duplicates_nothing(
    topology: Topology, data: st.DataObject
) -> None:
    assert drive_with_crashes(topology, data) == topology.expected()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(topology=topologies, data=st.data(), with_failures=st.booleans(), crashes=st.booleans())
def test_mutable_key_range_streams_give_the_serial_commit_order(
    topology: Topology, data: st.DataObject, with_failures: bool, crashes: bool
) -> None:
    """The same topologies served as MUTABLE_KEY_RANGE streams (partition start, end and event
    records instead of child partitions records), with retries or restarts from any resume
    point."""
    if crashes:
        assert drive_with_crashes(topology, data, mutable_key_range=True) == topology.expected()
        return
    result = drive(topology, data, with_failures, mutable_key_range=True)
    assert result["released"] == topology.expected()
    assert result["tracker"].all_finished
    assert set(result["first_queries"]) == {*topology.partitions, INITIAL_PARTITION}
    for series in (result["raw_watermarks"], result["watermarks"]):
        assert all(a <= b for a, b in itertools.pairwise(series))
