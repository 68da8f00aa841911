"""Configuration of an ingest job, for both runtimes (the service and `spark-run`): defaults, then
an optional TOML file, then the environment.

Every option has a default that works against a local emulator. A bad value raises
``ConfigError`` naming the option, where it came from, and what is allowed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ingest.changestream.opening import StreamAddress
from ingest.changestream.query import (
    MAX_HEARTBEAT_MS,
    MIN_HEARTBEAT_MS,
    ChangeStreamRequestError,
    validate_query_window,
)
from ingest.model.timestamps import Nanos, parse_rfc3339
from runtime import options
from runtime.options import (
    ConfigError,
    choice,
    identifier,
    in_range,
    integer,
    load_options,
    non_empty,
    option,
    seconds,
)

CONFIG_FILE_VARIABLE = "INGEST_CONFIG_FILE"
PREFIX = "INGEST_"
"""An option's environment variable unless it says another: INGEST_ and its name in capitals."""


def _timestamp(value: Any) -> Nanos | None:
    text = str(value)
    if text in ("", "now"):
        return None
    return parse_rfc3339(text)


def _token_file(value: Any) -> str:
    path = str(value)
    if path and not (os.path.isfile(path) and Path(path).read_text().strip()):
        raise ValueError(f"{path} is not a readable file holding a token")
    return path


def _job_id(value: Any) -> str:
    return "" if str(value) == "" else identifier(value)


@dataclass(frozen=True, slots=True)
class JobConfig:
    project: str = option("local-project", non_empty, "SPANNER_PROJECT")
    instance: str = option("local-instance", identifier, "SPANNER_INSTANCE")
    database: str = option("bank", identifier, "SPANNER_DATABASE")
    stream: str = option("all_changes", identifier, "SPANNER_CHANGE_STREAM")
    dialect: str = option("auto", choice("auto", "googlesql", "postgresql"))
    heartbeat_ms: int = option(1000, integer(MIN_HEARTBEAT_MS, MAX_HEARTBEAT_MS))
    query_window_s: float = option(120.0, seconds(1, 1800))
    """Each partition query ends this long after it starts, then runs again from where it was."""
    settle_margin_s: float = option(1.0, seconds(0, 60))
    """A query's clean close proves its end only up to this long before it began (the reader's
    ``settle_margin_s``): the freshness partitions taking turns give up for safety."""
    start_timestamp: Nanos | None = option(None, _timestamp)
    """Where a job without a checkpoint starts; None means now."""
    table_uri: str = option("./data/changelog", non_empty)
    job_id: str = option("", _job_id)
    """Application id in the Delta log; empty means '<database>.<stream>'."""
    memory_budget_mb: int = option(256, integer(1, 1 << 20))
    flush_latency_ms: int = option(1000, integer(10, 3_600_000))
    max_batch_rows: int = option(100_000, integer(1, 100_000_000))
    checkpoint_interval_s: float = option(30.0, seconds(0.1, 86_400))
    watched_columns_interval_s: float = option(10.0, seconds(0.1, 3_000))
    """How often the stream's watched columns are read, so drops land as schema rows."""
    lease_s: float = option(90.0, seconds(1, 86_400))
    health_port: int = option(8080, integer(0, 65_535))
    control_token_file: str = option("", _token_file)
    """A file (a mounted secret) holding the bearer token ``POST /snapshot`` must carry; empty
    turns control requests off. Read at each request, so a rotated secret applies at once."""
    readiness_s: float = option(120.0, seconds(1, 86_400))
    stats_interval_s: float = option(10.0, seconds(0.1, 86_400))
    max_concurrent_partitions: int = option(512, integer(1, 100_000))
    stuck_after_heartbeats: int = option(10, integer(2, 10_000))
    """A partition silent this many heartbeat intervals while others move is restarted."""
    max_stuck_restarts: int = option(3, integer(1, 1_000))
    """Restarts in a row of a stuck partition, none moving it on, before /readyz fails."""
    snapshot_mode: str = option("initial", choice("initial", "never", "initial_only"))
    """What a new job does with the rows already in its tables: initial, never, initial_only."""
    snapshot_workers: int = option(4, integer(1, 64))
    """Tables read at once during the snapshot."""
    snapshot_chunk_rows: int = option(10_000, integer(1, 1_000_000))
    """Rows per chunk a snapshot reader hands the committer (memory: about 2 x workers chunks)."""
    snapshot_chunk_mb: int = option(8, integer(1, 4096))
    """A chunk also ends at this many MiB of row values, and a read holds about five chunks'
    bytes, so memory (about 3 x workers chunks + 5 chunks read ahead per worker) is bounded
    however wide the rows."""
    snapshot_rows_per_s: float = option(20_000.0, in_range(float, "rows/s", 0, 100_000_000))
    """The rate a new job's snapshot is expected to reach: its tables are counted at T0 and a
    snapshot expected to outlive Spanner's retention is refused at start; 0 turns it off."""
    log_level: str = option("info", choice("debug", "info", "warning", "error"))

    @property
    def effective_job_id(self) -> str:
        return self.job_id or f"{self.database}.{self.stream}"

    @property
    def address(self) -> StreamAddress:
        """The job's change stream and how its partitions are queried."""
        return StreamAddress(
            self.project, self.instance, self.database, self.stream, self.dialect, self.heartbeat_ms
        )


def load(environ: Mapping[str, str] | None = None, file: str | None = None) -> JobConfig:
    environ = os.environ if environ is None else environ
    path = file or environ.get(CONFIG_FILE_VARIABLE)
    config = load_options(JobConfig, PREFIX, environ, path)
    if config.lease_s < 2 * config.checkpoint_interval_s:
        raise ConfigError(
            f"lease_s ({config.lease_s}) must be at least twice checkpoint_interval_s "
            f"({config.checkpoint_interval_s}): a live writer commits once per interval"
        )
    try:
        validate_query_window(config.query_window_s, config.heartbeat_ms)
    except ChangeStreamRequestError as error:
        raise ConfigError(f"query_window_s: {error}") from None
    return config


def reference() -> list[tuple[str, str, object]]:
    """(option, environment variable, default) for every option: the documentation's source."""
    return options.reference(JobConfig, PREFIX)


ENVIRONMENT = options.environment_of(JobConfig, PREFIX)
"""Each option's environment variable."""
