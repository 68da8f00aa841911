"""A source that makes records visible late and closes queries without waiting for them.

The scripted server, in real time, holds data change records back for a while after their
commit timestamp (a commit in flight) and closes every query once the clock reaches its end,
held records or not: the hazard of trusting a query's clean close as proof of its end. With more
partitions than turns the reader's catching-up queries meet it on every round. Property: the low
watermark never passes a record the server had not sent, so every transaction arrives once,
whole and in order.
"""

from __future__ import annotations

import os
import random
import threading
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ingest.changestream.config import ReaderConfig
from ingest.changestream.reader import ChangeStreamReader
from ingest.changestream.retries import RetryPolicy
from ingest.model.records import Transaction
from ingest.model.resume import Release
from ingest.model.timestamps import NANOS_PER_SECOND, to_rfc3339
from ingest.rules.assembler import IncompleteTransactionError
from runtime.logs import null_logger
from tests.scripted_spanner import Script, parents_of, scripted_query, start_server
from tests.simulation import Topology, build_wide_topology

MOST_HELD_S = 0.3
MARGIN_S = 0.4


def read_held_back(
    seed: int, partitions: int, turns: int, held_share: float, margin_s: float
) -> tuple[Topology, list[Transaction], list[str], list[BaseException]]:
    """Read a live topology whose records are held back up to MOST_HELD_S; return what the
    reader released, every release whose low watermark passed a record not yet sent, and the
    reader's failure if it stopped on one."""
    rng = random.Random(seed)
    start = time.time_ns() + NANOS_PER_SECOND // 5
    topology = build_wide_topology(
        rng,
        partitions=partitions,
        changes=2,
        transactions=30,
        start=start,
        horizon=2 * NANOS_PER_SECOND,
    )
    streams = topology.records_by_partition()
    hold_back = {
        (record.server_transaction_id, record.record_sequence): int(
            rng.uniform(0, MOST_HELD_S) * NANOS_PER_SECOND
        )
        for transaction in topology.transactions
        for record in transaction.records
        if rng.random() < held_share
    }
    script = Script(
        streams, parents=parents_of(streams), live=True, hold_back_ns=hold_back, close_at_end=True
    )
    server, servicer, port = start_server(script, workers=4 * turns + 8)
    config = ReaderConfig(
        start_timestamp=topology.start,
        end_timestamp=topology.end,
        heartbeat_ms=100,
        max_concurrent_partitions=turns,
        settle_margin_s=margin_s,
        retry=RetryPolicy(initial_backoff_s=0.01, max_backoff_s=0.1),
    )
    reader = ChangeStreamReader(scripted_query(port, heartbeat_ms=100), config, null_logger())
    released: list[Transaction] = []
    passed_unsent: list[str] = []
    commit_of = {
        (r.server_transaction_id, r.record_sequence): r.commit_timestamp
        for t in topology.transactions
        for r in t.records
    }

    def land(release: Release) -> None:
        now = time.time_ns()
        released.extend(release.transactions)
        for key, commit in commit_of.items():
            sent = servicer.sent_at.get(key)
            if commit <= release.low_watermark and (sent is None or sent > now):
                passed_unsent.append(
                    f"low watermark {to_rfc3339(release.low_watermark)} passed {key} "
                    f"(commit {to_rfc3339(commit)}, held "
                    f"{hold_back.get(key, 0) / NANOS_PER_SECOND:.3f} s) before it was sent"
                )

    stop = threading.Event()
    failures: list[BaseException] = []

    def run() -> None:
        try:
            reader.run(land, stop)
        except Exception as error:
            failures.append(error)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(timeout=60)
    stop.set()
    worker.join(timeout=10)
    server.stop(grace=None)
    assert not worker.is_alive(), "reader did not finish"
    return topology, released, passed_unsent, failures


@settings(
    max_examples=int(os.environ.get("HELD_BACK_EXAMPLES", "4")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    seed=st.integers(0, 2**16),
    partitions=st.integers(6, 10),
    turns=st.integers(1, 2),
    held_share=st.sampled_from([0.3, 1.0]),
)
def test_a_clean_close_never_lets_the_low_watermark_pass_a_held_record(
    no_emulator: None, seed: int, partitions: int, turns: int, held_share: float
) -> None:
    topology, released, passed_unsent, failures = read_held_back(
        seed, partitions, turns, held_share, MARGIN_S
    )
    assert failures == []
    assert passed_unsent == []
    assert released == topology.expected()


def test_without_a_margin_the_held_records_are_lost(no_emulator: None) -> None:
    """The check above can fail: trusting a catching-up query's clean close up to now (the
    previous rule) lets the low watermark pass records still held back: the reader then finds a
    transaction incomplete behind it, or misses it whole."""
    _, _, passed_unsent, failures = read_held_back(7, 6, 1, 1.0, 0.0)
    assert passed_unsent or any(isinstance(f, IncompleteTransactionError) for f in failures)
