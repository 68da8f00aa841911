"""Backpressure between the coordinator and the partition workers (contract 2)."""

from __future__ import annotations

import threading

from ingest.model.timestamps import Nanos


class BackpressureGate:
    """Pauses partitions that run ahead of the low watermark while the buffer is over budget.

    The partition holding the low watermark never waits, so the watermark keeps advancing and
    releases what is buffered: backpressure without deadlock. A paused turn is handed back
    instead when a partition waits for a turn: the one holding the low watermark may be it.
    """

    def __init__(self, turn_wanted: threading.Event) -> None:
        self._turn_wanted = turn_wanted
        self._condition = threading.Condition()
        self._over_budget = False
        self._low_watermark: Nanos | None = None

    def update(self, over_budget: bool, low_watermark: Nanos | None) -> None:
        with self._condition:
            self._over_budget = over_budget
            self._low_watermark = low_watermark
            self._condition.notify_all()

    def wait_turn(self, partition_watermark: Nanos, stop: threading.Event) -> bool:
        """Wait while the partition must; True when it should hand its turn back instead."""
        with self._condition:
            while (
                self._over_budget
                and self._low_watermark is not None
                and partition_watermark > self._low_watermark
                and not stop.is_set()
            ):
                if self._turn_wanted.is_set():
                    return True
                self._condition.wait(0.1)
            return False
