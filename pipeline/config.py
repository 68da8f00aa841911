"""Configuration of the pipeline job: defaults, then an optional TOML file, then environment.

Paths are local paths or object store URIs (``s3a://``, ``gs://``, ``abfss://``) that Spark's
Hadoop file systems understand; the defaults match the ingest service's defaults.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from runtime import options
from runtime.options import (
    choice,
    identifier,
    integer,
    load_options,
    non_empty,
    option,
    seconds,
)

CONFIG_FILE_VARIABLE = "PIPELINE_CONFIG_FILE"
PREFIX = "PIPELINE_"
"""Each option's environment variable: PIPELINE_ and its name in capitals."""


CONFIRMED_DROP = re.compile(r"[^.\s]+(\.[^.\s]+)+")
"""A variable, then a field path of one or more parts: what a rename refusal names."""


def _confirmed_drops(value: Any) -> str:
    for path in str(value).split(","):
        if path.strip() and not CONFIRMED_DROP.fullmatch(path.strip()):
            raise ValueError(
                "expected variable.field paths separated by commas (a nested field as a refusal "
                "names it: entry_items.change_stats.updates)"
            )
    return str(value)


@dataclass(frozen=True, slots=True)
class PipelineConfig:
    changelog_uri: str = option("./data/changelog", non_empty)
    mirror_root: str = option("./data/mirrors", non_empty)
    """One Delta mirror table per Spanner table under this root, named after the table."""
    checkpoint_uri: str = option("./data/pipeline-checkpoint", non_empty)
    history_root: str = option("./data/history", non_empty)
    """One Delta history table (SCD type 2) per table named in ``history_tables``, under this
    root."""
    history_tables: str = option("", str)
    """Comma-separated tables that keep a history; ``*`` for every table; empty for none."""
    processors: str = option("", str)
    """Comma-separated user processors (``module:Class``) run by the job beside the mirrors."""
    processor_root: str = option("./data/processors", non_empty)
    """Each processor's output Delta table under this root, named after it."""
    job_id: str = option("spanner-mirrors", identifier)
    """Application id of the mirror tables' idempotent MERGE commits."""
    trigger: str = option("continuous", choice("continuous", "available-now"))
    """continuous: a batch every trigger_interval_s; available-now: process what is there, stop."""
    trigger_interval_s: float = option(1.0, seconds(0, 86_400))
    max_files_per_trigger: int = option(1000, integer(1, 1_000_000))
    """Change-log files per micro-batch, bounding a catch-up batch (Delta's own default)."""
    max_mb_per_trigger: int = option(32, integer(1, 1 << 20))
    """Change-log MiB per micro-batch (Delta's ``maxBytesPerTrigger``, a soft bound: at least
    one file): files of wide rows make a batch large in bytes long before 1,000 files. With
    Spark's default 1 GiB heap, 64 MiB batches of 1 MiB values ran it out; raise both together."""
    local_merge_max_rows: int = option(50_000, integer(0, 10_000_000))
    """Batches of at most this many mirror rows are merged on the driver by delta-rs, larger
    ones by Spark; 0 merges every batch through Spark."""
    local_merge_max_mb: int = option(64, integer(1, 1 << 20))
    """The same bound in MiB (the batch's rows as JSON, measured before collecting): what the
    driver collects is bounded by bytes, however wide the rows."""
    master: str = option("local[*]", str)
    """Spark master; empty leaves it to spark-submit."""
    shuffle_partitions: int = option(0, integer(0, 10_000))
    """The state's partitions (and Spark's shuffle's), frozen into the checkpoint on its first
    run; 0: a local master's cores, else 8 (``effective_shuffle_partitions``)."""
    tombstone_ttl_s: float = option(86_400.0, seconds(1, 365 * 86_400))
    max_evolutions_per_variable: int = option(16, integer(1, 10_000))
    max_evolutions_per_query: int = option(128, integer(1, 100_000))
    confirmed_drops: str = option("", _confirmed_drops)
    """Comma-separated ``variable.field`` paths whose removal next to a same-typed addition is
    meant; the field may be nested (``entry_items.change_stats.updates``), as a refusal names it."""
    max_restarts: int = option(5, integer(0, 1_000))
    """Query restarts in a row (schema changes, conflicts) before the job gives up."""
    lock_stale_s: float = option(60.0, seconds(5, 86_400))
    metrics_port: int = option(8081, integer(0, 65_535))
    """Prometheus ``/metrics`` on this port; 0 serves none."""
    log_level: str = option("info", choice("debug", "info", "warning", "error"))

    @property
    def effective_shuffle_partitions(self) -> int:
        """Each partition of the state commits its store every micro-batch, so a local job
        keeps one per core: a 50-row batch took 1.39 s with 8 on 2 cores, 0.68 s with 2
        (bench/RESULTS.md). A cluster's executors get 8, or what is configured. ``local[*]``
        counts the CPUs the process may run on, not a container's CPU quota: under a quota, name
        the cores (``local[4]``) or the partitions."""
        if self.shuffle_partitions:
            return self.shuffle_partitions
        if self.master == "local":
            return 1
        local = re.fullmatch(r"local\[(\d+|\*)(,\d+)?\]", self.master)
        if local is None:
            return 8
        if local.group(1) == "*":
            return len(os.sched_getaffinity(0))
        return int(local.group(1))

    @property
    def history_table_set(self) -> frozenset[str]:
        return frozenset(t.strip() for t in self.history_tables.split(",") if t.strip())

    @property
    def confirmed_drop_set(self) -> frozenset[str]:
        return frozenset(p.strip() for p in self.confirmed_drops.split(",") if p.strip())


def load(environ: Mapping[str, str] | None = None, file: str | None = None) -> PipelineConfig:
    environ = os.environ if environ is None else environ
    path = file or environ.get(CONFIG_FILE_VARIABLE)
    return load_options(PipelineConfig, PREFIX, environ, path)


def reference() -> list[tuple[str, str, object]]:
    return options.reference(PipelineConfig, PREFIX)


ENVIRONMENT = options.environment_of(PipelineConfig, PREFIX)
"""Each option's environment variable (the command line's flags set them)."""
