"""Turns and the watchdog as pure rules (``ingest.rules.turns``, ``ingest.rules.watchdog``).

The property test is a reader without threads, as a Spark source would be: on simulated
topologies and a simulated clock, partitions take turns (``Turns``), every query is planned by
``plan_query`` and closed by ``after_clean_close``, and the source is live (a record is visible
once the clock passes it; a query ends at its end timestamp, not before). Whatever the turns, the
interleaving and the clock, the output is the serial commit order and turns stay bounded.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ingest.model.records import ChangeRecord, HeartbeatRecord, Transaction, record_timestamp
from ingest.model.timestamps import Nanos
from ingest.rules import turns
from ingest.rules.coordinator import Coordinator
from ingest.rules.partitions import ends_partition, resume_timestamp, watermark_after
from ingest.rules.watchdog import Watchdog
from tests.simulation import Topology
from tests.simulation import topologies as simulated_topologies

MARGIN: Nanos = 3
WINDOW: Nanos = 40


@dataclass
class Query:
    plan: turns.QueryPlan
    records: list[ChangeRecord]
    before: Nanos
    """The partition's watermark when the query began."""


@dataclass
class Turn:
    watermark: Nanos
    """The partition's watermark as its turn's reader sees it."""
    began_at: Nanos
    """Its watermark when the turn began: a new window hands back once it moved on."""
    ended: bool = False
    query: Query | None = None


def run_without_threads(
    topology: Topology, max_concurrent: int, rng: random.Random
) -> tuple[list[Transaction], Coordinator]:
    streams = topology.records_by_partition()
    coordinator = Coordinator(topology.start, topology.end)
    tracker = coordinator.tracker
    schedule = turns.Turns(max_concurrent)
    reading: dict[str, Turn] = {}
    released: list[Transaction] = []
    queued: dict[str, Nanos] = {}
    """Who waits for a turn, with the watermark it waits at."""
    now = topology.start
    for _ in range(20_000):
        for partition in tracker.take_ready():
            schedule.wait(partition.token, partition.watermark)
            queued[partition.token] = partition.watermark
        for token in schedule.grant(None):
            granted = queued.pop(token)
            assert all(granted <= other for other in queued.values()), "lowest watermark first"
            watermark = tracker.partition(token).watermark
            reading[token] = Turn(watermark, watermark)
        assert schedule.in_turn <= max_concurrent and schedule.waiting == len(queued)
        wanted = schedule.wanted(None)
        if tracker.all_finished:
            return released, coordinator
        movable = sorted(t for t in reading if _can_move(reading[t], now, wanted))
        if not movable or rng.random() < 0.2:
            now += rng.randint(1, 30)
            continue
        token = rng.choice(movable)
        outcome = _step(
            token, reading[token], streams[token], now, wanted, coordinator, topology.end
        )
        if outcome is turns.Outcome.FINISHED:
            del reading[token]
            schedule.ended(token)
            coordinator.stream_ended(token)
        elif outcome is turns.Outcome.HANDED_BACK:
            del reading[token]
            queued[token] = tracker.partition(token).watermark
            schedule.handed_back(token, queued[token])
        release = coordinator.release()
        if release is not None:
            released.extend(release.transactions)
    raise AssertionError("the simulated reader never finished")


def _can_move(turn: Turn, now: Nanos, wanted: bool) -> bool:
    query = turn.query
    if query is None:
        start = resume_timestamp(0, turn.watermark)
        return turns.wait_to_settle(start, now, MARGIN, wanted) == 0
    if query.records:
        return record_timestamp(query.records[0]) <= now
    return turn.ended or now >= query.plan.end


def _step(
    token: str,
    turn: Turn,
    stream: list[ChangeRecord],
    now: Nanos,
    wanted: bool,
    coordinator: Coordinator,
    topology_end: Nanos,
) -> turns.Outcome | None:
    """One thing the turn's reader does: begin a query, read a record, or see its query close."""
    query = turn.query
    if query is None:
        if wanted and turn.watermark > turn.began_at:
            return turns.Outcome.HANDED_BACK
        start = resume_timestamp(
            coordinator.tracker.partition(token).start_timestamp, turn.watermark
        )
        plan = turns.plan_query(start, now, MARGIN, WINDOW, topology_end, wanted)
        coordinator.query_started(token, plan.start)
        inside = [r for r in stream if plan.start <= record_timestamp(r) <= plan.end]
        turn.query = Query(plan, inside, turn.watermark)
        return None
    if query.records:
        record = query.records.pop(0)
        turn.watermark = max(turn.watermark, watermark_after(record))
        turn.ended = turn.ended or ends_partition(token, record)
        coordinator.record_read(token, record)
        if turns.hands_back(query.plan, turn.ended, wanted, turn.watermark, query.before):
            return turns.Outcome.HANDED_BACK
        return None
    closed = turns.after_clean_close(
        query.plan, turn.watermark, turn.ended, query.before, now, MARGIN, topology_end
    )
    if closed.proven is not None:
        turn.watermark = closed.proven
        coordinator.record_read(token, HeartbeatRecord(closed.proven))
    assert closed.outcome is not None, "a live source's query closed before its end"
    turn.query = None
    return closed.outcome if closed.outcome is not turns.Outcome.WINDOW_CLOSED else None


topologies = simulated_topologies(20, 40)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(topology=topologies, max_concurrent=st.integers(1, 4), seed=st.integers(0, 2**32))
def test_a_reader_without_threads_on_the_turn_rules_gives_the_serial_commit_order(
    topology: Topology, max_concurrent: int, seed: int
) -> None:
    """The simulated clock's steps and which turn moves next come from ``seed``."""
    released, coordinator = run_without_threads(topology, max_concurrent, random.Random(seed))
    assert released == topology.expected()
    assert coordinator.assembler.open_transactions == 0


def test_over_the_budget_only_partitions_at_the_low_watermark_get_a_turn() -> None:
    schedule = turns.Turns(max_concurrent=3)
    for token, watermark in (("b", 20), ("a", 10), ("c", 30)):
        schedule.wait(token, watermark)
    assert schedule.grant(limit=15) == ["a"]
    assert schedule.wanted(limit=15) is False and schedule.wanted(limit=None) is True
    assert schedule.grant(limit=None) == ["b", "c"]
    assert (schedule.in_turn, schedule.waiting, schedule.started) == (3, 0, 3)


def test_turns_start_cycling_once_more_partitions_live_than_turns() -> None:
    schedule = turns.Turns(max_concurrent=1)
    schedule.wait("a", 1)
    assert schedule.grant(None) == ["a"] and schedule.cycling_changed() is False
    schedule.wait("b", 2)
    assert schedule.cycling_changed() is True and schedule.cycling
    schedule.handed_back("a", 5)
    assert schedule.grant(None) == ["b"] and schedule.waiting == 1
    schedule.ended("b")
    assert schedule.grant(None) == ["a"]
    assert schedule.cycling_changed() is True and not schedule.cycling


def test_a_catching_up_query_reads_to_what_has_settled_and_a_tailing_one_a_window() -> None:
    catching_up = turns.plan_query(100, 1_000, MARGIN, WINDOW, None, turn_wanted=True)
    assert (catching_up.end, catching_up.catching_up) == (997, True)
    tailing = turns.plan_query(100, 1_000, MARGIN, WINDOW, None, turn_wanted=False)
    assert (tailing.end, tailing.catching_up) == (1_040, False)
    assert turns.plan_query(100, 1_000, MARGIN, WINDOW, 500, False).end == 500
    assert turns.wait_to_settle(999, 1_000, MARGIN, turn_wanted=True) == 3
    assert turns.wait_to_settle(999, 1_000, MARGIN, turn_wanted=False) == 0


def test_a_clean_close_proves_only_what_had_settled_when_the_query_began() -> None:
    plan = turns.plan_query(100, 1_000, MARGIN, WINDOW, None, turn_wanted=False)
    closed = turns.after_clean_close(plan, 150, False, 150, 1_040, MARGIN, None)
    assert closed == turns.Closed(997, turns.Outcome.WINDOW_CLOSED)
    early = turns.after_clean_close(plan, 997, False, 997, 1_010, MARGIN, None)
    assert early == turns.Closed(None, None), "closed before its end, without progress"
    unsettled = turns.plan_query(995, 996, MARGIN, WINDOW, 996, turn_wanted=False)
    waits = turns.after_clean_close(unsettled, 994, False, 994, 1_000, MARGIN, 2_000)
    assert waits == turns.Closed(
        None, turns.Outcome.WINDOW_CLOSED, wait=unsettled.end + MARGIN - 1_000
    )


def test_the_watchdog_finds_a_lone_silent_partition_and_forgets_it_once_it_moves() -> None:
    now = [0.0]
    watchdog = Watchdog(heartbeat_s=1.0, stuck_after_heartbeats=10, clock=lambda: now[0])
    assert watchdog.stuck([("p", 0.0)]) == []
    now[0] = 10.5
    assert watchdog.stuck([("p", 0.0), ("q", None)]) == [("p", 10.5)]
    now[0] = 10.7
    assert watchdog.stuck([("p", 0.0)]) == [], "looked at every half heartbeat"
    now[0] = 11.2
    assert watchdog.stuck([("p", 0.0)]) == [("p", 11.2)]
    assert (watchdog.restarts_in_a_row("p"), watchdog.most_restarts_in_a_row) == (2, 2)
    assert (watchdog.stuck_partitions, watchdog.restarts_total) == (1, 2)
    watchdog.moved("p")
    assert (watchdog.stuck_partitions, watchdog.restarts_total) == (0, 2)
