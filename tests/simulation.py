"""A simulated change stream: random partition topology and transactions, served per partition.

It follows the Spanner contract the reader relies on: a partition holds the records with
start ≤ commit_timestamp < end; within a partition records come in commit timestamp order;
heartbeats promise that nothing at or below them is still to come; a partition ends with a child
partitions record at its end, reported by every parent of a merged child.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from hypothesis import strategies as st

from ingest.model import records as model
from ingest.model.timestamps import Nanos
from ingest.rules.partitions import INITIAL_PARTITION

T0: Nanos = 1_000_000


@dataclass
class SimPartition:
    token: str
    start: Nanos
    end: Nanos | None = None
    children: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)


@dataclass
class Topology:
    start: Nanos
    end: Nanos
    partitions: dict[str, SimPartition]
    initial_tokens: list[str]
    transactions: list[model.Transaction]
    heartbeats: dict[str, list[Nanos]]
    owner_of: dict[tuple[str, str], str]
    """(server_transaction_id, record_sequence) → the partition that returns the record."""

    def records_by_partition(self) -> dict[str, list[model.ChangeRecord]]:
        data: dict[str, list[model.DataChangeRecord]] = defaultdict(list)
        for transaction in self.transactions:
            for record in transaction.records:
                owner = self.owner_of[(record.server_transaction_id, record.record_sequence)]
                data[owner].append(record)
        streams: dict[str, list[model.ChangeRecord]] = {}
        for token, partition in self.partitions.items():
            timed: list[tuple[Nanos, int, model.ChangeRecord]] = [
                (r.commit_timestamp, 0, r) for r in data[token]
            ]
            timed += [(ts, 1, model.HeartbeatRecord(ts)) for ts in self.heartbeats[token]]
            timed.sort(key=lambda item: (item[0], item[1]))
            stream: list[model.ChangeRecord] = [item[2] for item in timed]
            if partition.end is not None:
                stream.append(
                    model.ChildPartitionsRecord(
                        partition.end,
                        "00000000",
                        tuple(
                            model.ChildPartition(t, parents) for t, parents in partition.children
                        ),
                    )
                )
            streams[token] = stream
        streams[INITIAL_PARTITION] = [
            model.ChildPartitionsRecord(self.start, f"{i:08d}", (model.ChildPartition(token, ()),))
            for i, token in enumerate(self.initial_tokens)
        ]
        return streams

    def expected(self) -> list[model.Transaction]:
        return sorted(self.transactions, key=lambda t: t.order_key)


def alive(partition: SimPartition, ts: Nanos) -> bool:
    return partition.start <= ts and (partition.end is None or ts < partition.end)


def build_topology(
    rng: random.Random,
    events: int,
    transactions: int,
    horizon: int = 400,
    least_initial: int = 1,
) -> Topology:
    """Random splits, moves and merges, then transactions spread over the live partitions.

    ``least_initial``: at least this many partitions from the start (the rest of the topology
    stays what the seed makes), so a test of taking turns has more partitions than turns
    whatever order the reader's threads run in."""
    new = _Partitions("p{}")
    partitions = new.by_token
    initial = [new(T0) for _ in range(max(rng.randint(1, 3), least_initial))]
    live = list(initial)
    end = T0 + horizon
    for ts in sorted(rng.sample(range(T0 + 1, end), events)):
        _change(rng, live, new, ts)

    committed: list[model.Transaction] = []
    owner_of: dict[tuple[str, str], str] = {}
    for number in range(transactions):
        ts = rng.randint(T0, end)
        candidates = [p for p in partitions.values() if alive(p, ts)]
        record_count = rng.randint(1, 4)
        owners = [rng.choice(candidates) for _ in range(record_count)]
        txid = f"tx{number:05d}"
        partitions_touched = len({o.token for o in owners})
        records = tuple(
            _data_record(ts, txid, number, sequence, record_count, partitions_touched)
            for sequence in range(record_count)
        )
        for sequence, owner in enumerate(owners):
            owner_of[(txid, f"{sequence:08d}")] = owner.token
        committed.append(model.Transaction(ts, txid, records))

    heartbeats: dict[str, list[Nanos]] = {}
    for partition in partitions.values():
        last = partition.end - 1 if partition.end is not None else end
        count = rng.randint(0, 3)
        heartbeats[partition.token] = sorted(
            rng.randint(partition.start, last) for _ in range(count) if last >= partition.start
        )
    return Topology(
        T0, end, partitions, [p.token for p in initial], committed, heartbeats, owner_of
    )


def topologies(most_events: int, most_transactions: int) -> st.SearchStrategy[Topology]:
    """Topologies of ``build_topology`` for property tests, from a seed hypothesis shrinks."""
    return st.builds(
        lambda seed, events, count: build_topology(random.Random(seed), events, count),
        st.integers(0, 2**32),
        st.integers(0, most_events),
        st.integers(0, most_transactions),
    )


def records_from(stream: list[model.ChangeRecord], start: Nanos) -> list[model.ChangeRecord]:
    """What a query of the partition from ``start`` returns (Spanner filters on timestamps)."""
    return [record for record in stream if model.record_timestamp(record) >= start]


def build_wide_topology(
    rng: random.Random,
    partitions: int,
    changes: int,
    transactions: int,
    start: Nanos,
    horizon: Nanos,
) -> Topology:
    """Thousands of live partitions from the start, ``changes`` splits, moves and merges spread
    over ``horizon``, and transactions over the partitions alive at their commit timestamp
    (a third of them spread over several partitions). Built in one pass over time, so it stays
    fast at any width."""
    new = _Partitions("w{:06d}")
    by_token = new.by_token
    live = [new(start) for _ in range(partitions)]
    end = start + horizon
    change_times = sorted(rng.sample(range(start + 1, end), changes))
    commit_times = sorted(rng.randint(start + 1, end - 1) for _ in range(transactions))
    committed: list[model.Transaction] = []
    owner_of: dict[tuple[str, str], str] = {}
    changes_left = iter(change_times)
    next_change = next(changes_left, None)
    for number, ts in enumerate(commit_times):
        while next_change is not None and next_change <= ts:
            _change(rng, live, new, next_change)
            next_change = next(changes_left, None)
        spread = rng.random() < 1 / 3
        record_count = rng.randint(2, 4) if spread else 1
        owners = rng.sample(live, record_count) if spread else [rng.choice(live)]
        txid = f"tx{number:06d}"
        records = tuple(
            _data_record(ts, txid, number, sequence, record_count, len(owners))
            for sequence in range(record_count)
        )
        for sequence, owner in enumerate(owners):
            owner_of[(txid, f"{sequence:08d}")] = owner.token
        committed.append(model.Transaction(ts, txid, records))
    while next_change is not None:
        _change(rng, live, new, next_change)
        next_change = next(changes_left, None)
    heartbeats: dict[str, list[Nanos]] = {token: [] for token in by_token}
    initial = [p.token for p in by_token.values() if p.start == start]
    return Topology(start, end, by_token, initial, committed, heartbeats, owner_of)


class _Partitions:
    """Makes the topology's partitions, each under a token of ``pattern`` and a new number."""

    def __init__(self, pattern: str) -> None:
        self._pattern = pattern
        self.by_token: dict[str, SimPartition] = {}

    def __call__(self, start: Nanos) -> SimPartition:
        partition = SimPartition(self._pattern.format(len(self.by_token)), start)
        self.by_token[partition.token] = partition
        return partition


def _change(
    rng: random.Random,
    live: list[SimPartition],
    new: Callable[[Nanos], SimPartition],
    at: Nanos,
) -> None:
    """A split, a move or (of two live partitions) a merge at ``at``."""
    action = rng.choice(["split", "move", "merge"] if len(live) > 1 else ["split", "move"])
    if action == "merge":
        parents = [live.pop(rng.randrange(len(live))) for _ in range(2)]
        child = new(at)
        for parent in parents:
            parent.end = at
            parent.children.append((child.token, tuple(p.token for p in parents)))
        live.append(child)
        return
    parent = live.pop(rng.randrange(len(live)))
    parent.end = at
    for _ in range(2 if action == "split" else 1):
        child = new(at)
        parent.children.append((child.token, (parent.token,)))
        live.append(child)


def _data_record(
    ts: Nanos, txid: str, number: int, sequence: int, records: int, partitions: int
) -> model.DataChangeRecord:
    return model.DataChangeRecord(
        commit_timestamp=ts,
        record_sequence=f"{sequence:08d}",
        server_transaction_id=txid,
        is_last_record_in_transaction_in_partition=False,
        table_name="t",
        column_types=(
            model.ColumnType("k", {"code": "INT64"}, True, 1),
            model.ColumnType("v", {"code": "INT64"}, False, 2),
        ),
        mods=(model.Mod({"k": str(number * 10 + sequence)}, {"v": sequence}, {}),),
        mod_type="INSERT",
        value_capture_type="NEW_ROW_AND_OLD_VALUES",
        number_of_records_in_transaction=records,
        number_of_partitions_in_transaction=partitions,
        transaction_tag="",
        is_system_transaction=False,
    )


def mutable_key_range_streams(
    topology: Topology, rng: random.Random
) -> dict[str, list[model.ChangeRecord]]:
    """The same topology as a ``MUTABLE_KEY_RANGE`` stream serves it: the initial query
    announces the first partitions in a partition start record; a partition whose key ranges
    move on sends a move-out event, a partition start record announcing where they go (a merge's
    two parents announce the same one) and its partition end record, all at its end; each new
    partition opens with a move-in event; and key ranges move between live partitions at random
    times too (event records in both)."""
    streams: dict[str, list[model.ChangeRecord]] = {}
    for token, stream in topology.records_by_partition().items():
        if token == INITIAL_PARTITION:
            streams[token] = [
                model.PartitionStartRecord(
                    topology.start, "00000000", tuple(topology.initial_tokens)
                )
            ]
            continue
        partition = topology.partitions[token]
        records: list[model.ChangeRecord] = [
            r for r in stream if not isinstance(r, model.ChildPartitionsRecord)
        ]
        if partition.start > topology.start:
            records.insert(0, model.PartitionEventRecord(partition.start, "00000000", token))
        last = partition.end if partition.end is not None else topology.end
        for _ in range(rng.randint(0, 2)):
            if last - 1 > partition.start:
                at = rng.randint(partition.start + 1, last - 1)
                records.append(model.PartitionEventRecord(at, "00000009", token))
        if partition.end is not None:
            children = tuple(child for child, _ in partition.children)
            records += [
                model.PartitionEventRecord(partition.end, "00000010", token),
                model.PartitionStartRecord(partition.end, "00000011", children),
                model.PartitionEndRecord(partition.end, "00000012", token),
            ]
        records.sort(key=lambda r: (model.record_timestamp(r), _rank(r)))
        streams[token] = records
    return streams


def _rank(record: model.ChangeRecord) -> int:
    """Order at one timestamp: events and data, then heartbeats, then the partition's end."""
    if isinstance(record, model.PartitionStartRecord):
        return 2
    if isinstance(record, model.PartitionEndRecord):
        return 3
    if isinstance(record, model.HeartbeatRecord):
        return 1
    return 0
