"""The stuck-partition watchdog (contract 2), as Debezium's: Spanner can leave a partition's
stream open and silent. A partition whose reader has waited on its stream for
``stuck_after_heartbeats`` heartbeat intervals without a record (Spanner sends a heartbeat every
interval) is stuck, whatever the others do: alone, or holding the low watermark over the memory
budget. Its query is then started again; restarts that do not move it on are counted, so health
can fail a partition that stays stuck.

Pure: the clock is injected and the caller says since when each partition has waited.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class Watchdog:
    def __init__(
        self, heartbeat_s: float, stuck_after_heartbeats: int, clock: Callable[[], float]
    ) -> None:
        self._heartbeat_s = heartbeat_s
        self._limit_s = stuck_after_heartbeats * heartbeat_s
        self._clock = clock
        self._next_check = 0.0
        self._restarts: dict[str, int] = {}
        self.restarts_total = 0

    def stuck(self, waiting_since: Iterable[tuple[str, float | None]]) -> list[tuple[str, float]]:
        """The partitions silent past the limit, with their seconds of silence, each counted as
        restarted; looked at every half heartbeat (``waiting_since`` is not read in between).
        ``waiting_since``: per running partition, since when (the injected clock) its reader
        waits on the stream, None while it does anything else (applies a record, waits for
        backpressure, backs off)."""
        now = self._clock()
        if now < self._next_check:
            return []
        self._next_check = now + self._heartbeat_s / 2
        silent = [
            (token, now - since)
            for token, since in waiting_since
            if since is not None and now - since > self._limit_s
        ]
        for token, _ in silent:
            self._restarts[token] = self._restarts.get(token, 0) + 1
            self.restarts_total += 1
        return silent

    def restarts_in_a_row(self, token: str) -> int:
        """Restarts of a stuck partition since it last moved on."""
        return self._restarts.get(token, 0)

    def moved(self, token: str) -> None:
        """Its watermark advanced (or it finished): it is not stuck any more."""
        self._restarts.pop(token, None)

    @property
    def stuck_partitions(self) -> int:
        return len(self._restarts)

    @property
    def most_restarts_in_a_row(self) -> int:
        """Read by the health server's thread: a copy, taken at once."""
        return max(tuple(self._restarts.values()), default=0)
