"""Configuration of an ingest job, for both runtimes (the service and `spark-run`): defaults, then
an optional TOML file, then the environment.

Every option has a default that works against a local emulator. A bad value raises
``ConfigError`` naming the option, where it came from, and what is allowed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ingest.changestream.query import (
    MAX_HEARTBEAT_MS,
    MIN_HEARTBEAT_MS,
    ChangeStreamRequestError,
    validate_query_window,
)
from ingest.model.timestamps import Nanos, parse_rfc3339
from runtime.options import (
    ConfigError,
    choice,
    identifier,
    in_range,
    integer,
    load_options,
    non_empty,
    seconds,
)

CONFIG_FILE_VARIABLE = "INGEST_CONFIG_FILE"


@dataclass(frozen=True, slots=True)
class JobConfig:
    project: str = "local-project"
    instance: str = "local-instance"
    database: str = "bank"
    stream: str = "all_changes"
    dialect: str = "auto"
    heartbeat_ms: int = 1000
    query_window_s: float = 120.0
    """Each partition query ends this long after it starts, then runs again from where it was."""
    settle_margin_s: float = 1.0
    """A query's clean close proves its end only up to this long before it began (the reader's
    ``settle_margin_s``): the freshness partitions taking turns give up for safety."""
    start_timestamp: Nanos | None = None
    """Where a job without a checkpoint starts; None means now."""
    table_uri: str = "./data/changelog"
    job_id: str = ""
    """Application id in the Delta log; empty means '<database>.<stream>'."""
    memory_budget_mb: int = 256
    flush_latency_ms: int = 1000
    max_batch_rows: int = 100_000
    checkpoint_interval_s: float = 30.0
    watched_columns_interval_s: float = 10.0
    """How often the stream's watched columns are read, so drops land as schema rows."""
    lease_s: float = 90.0
    health_port: int = 8080
    control_token_file: str = ""
    """A file (a mounted secret) holding the bearer token ``POST /snapshot`` must carry; empty
    turns control requests off. Read at each request, so a rotated secret applies at once."""
    readiness_s: float = 120.0
    stats_interval_s: float = 10.0
    max_concurrent_partitions: int = 512
    stuck_after_heartbeats: int = 10
    """A partition silent this many heartbeat intervals while others move is restarted."""
    max_stuck_restarts: int = 3
    """Restarts in a row of a stuck partition, none moving it on, before /readyz fails."""
    snapshot_mode: str = "initial"
    """What a new job does with the rows already in its tables: initial, never, initial_only."""
    snapshot_workers: int = 4
    """Tables read at once during the snapshot."""
    snapshot_chunk_rows: int = 10_000
    """Rows per chunk a snapshot reader hands the committer (memory: about 2 x workers chunks)."""
    snapshot_chunk_mb: int = 8
    """A chunk also ends at this many MiB of row values, and a read holds about five chunks'
    bytes, so memory (about 3 x workers chunks + 5 chunks read ahead per worker) is bounded
    however wide the rows."""
    snapshot_rows_per_s: float = 20_000.0
    """The rate a new job's snapshot is expected to reach: its tables are counted at T0 and a
    snapshot expected to outlive Spanner's retention is refused at start; 0 turns it off."""
    log_level: str = "info"

    @property
    def effective_job_id(self) -> str:
        return self.job_id or f"{self.database}.{self.stream}"


ENVIRONMENT = {
    "project": "SPANNER_PROJECT",
    "instance": "SPANNER_INSTANCE",
    "database": "SPANNER_DATABASE",
    "stream": "SPANNER_CHANGE_STREAM",
    **{
        name: f"INGEST_{name.upper()}"
        for name in (
            "dialect",
            "heartbeat_ms",
            "query_window_s",
            "settle_margin_s",
            "start_timestamp",
            "table_uri",
            "job_id",
            "memory_budget_mb",
            "flush_latency_ms",
            "max_batch_rows",
            "checkpoint_interval_s",
            "watched_columns_interval_s",
            "lease_s",
            "health_port",
            "control_token_file",
            "readiness_s",
            "stats_interval_s",
            "max_concurrent_partitions",
            "stuck_after_heartbeats",
            "max_stuck_restarts",
            "snapshot_mode",
            "snapshot_workers",
            "snapshot_chunk_rows",
            "snapshot_chunk_mb",
            "snapshot_rows_per_s",
            "log_level",
        )
    },
}


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


PARSERS: dict[str, Callable[[Any], Any]] = {
    "project": non_empty,
    "instance": identifier,
    "database": identifier,
    "stream": identifier,
    "dialect": choice("auto", "googlesql", "postgresql"),
    "heartbeat_ms": integer(MIN_HEARTBEAT_MS, MAX_HEARTBEAT_MS),
    "query_window_s": seconds(1, 1800),
    "settle_margin_s": seconds(0, 60),
    "start_timestamp": _timestamp,
    "table_uri": non_empty,
    "job_id": _job_id,
    "memory_budget_mb": integer(1, 1 << 20),
    "flush_latency_ms": integer(10, 3_600_000),
    "max_batch_rows": integer(1, 100_000_000),
    "checkpoint_interval_s": seconds(0.1, 86_400),
    "watched_columns_interval_s": seconds(0.1, 3_000),
    "lease_s": seconds(1, 86_400),
    "health_port": integer(0, 65_535),
    "control_token_file": _token_file,
    "readiness_s": seconds(1, 86_400),
    "stats_interval_s": seconds(0.1, 86_400),
    "max_concurrent_partitions": integer(1, 100_000),
    "stuck_after_heartbeats": integer(2, 10_000),
    "max_stuck_restarts": integer(1, 1_000),
    "snapshot_mode": choice("initial", "never", "initial_only"),
    "snapshot_workers": integer(1, 64),
    "snapshot_chunk_rows": integer(1, 1_000_000),
    "snapshot_chunk_mb": integer(1, 4096),
    "snapshot_rows_per_s": in_range(float, "rows/s", 0, 100_000_000),
    "log_level": choice("debug", "info", "warning", "error"),
}


def load(environ: Mapping[str, str] | None = None, file: str | None = None) -> JobConfig:
    environ = os.environ if environ is None else environ
    path = file or environ.get(CONFIG_FILE_VARIABLE)
    config = load_options(JobConfig, PARSERS, ENVIRONMENT, environ, path)
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
    return [(f.name, ENVIRONMENT[f.name], f.default) for f in fields(JobConfig)]
