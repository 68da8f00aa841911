"""Configuration of the pipeline job: defaults, then an optional TOML file, then environment.

Paths are local paths or object store URIs (``s3a://``, ``gs://``, ``abfss://``) that Spark's
Hadoop file systems understand; the defaults match the ingest service's defaults.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from runtime.options import choice, identifier, integer, load_options, non_empty, seconds

CONFIG_FILE_VARIABLE = "PIPELINE_CONFIG_FILE"


@dataclass(frozen=True, slots=True)
class PipelineConfig:
    changelog_uri: str = "./data/changelog"
    mirror_root: str = "./data/mirrors"
    """One Delta mirror table per Spanner table under this root, named after the table."""
    checkpoint_uri: str = "./data/pipeline-checkpoint"
    history_root: str = "./data/history"
    """One Delta history table (SCD type 2) per table named in ``history_tables``, under this
    root."""
    history_tables: str = ""
    """Comma-separated tables that keep a history; ``*`` for every table; empty for none."""
    processors: str = ""
    """Comma-separated user processors (``module:Class``) run by the job beside the mirrors."""
    processor_root: str = "./data/processors"
    """Each processor's output Delta table under this root, named after it."""
    job_id: str = "spanner-mirrors"
    """Application id of the mirror tables' idempotent MERGE commits."""
    trigger: str = "continuous"
    """continuous: a batch every trigger_interval_s; available-now: process what is there, stop."""
    trigger_interval_s: float = 1.0
    max_files_per_trigger: int = 1000
    """Change-log files per micro-batch, bounding a catch-up batch (Delta's own default)."""
    max_mb_per_trigger: int = 32
    """Change-log MiB per micro-batch (Delta's ``maxBytesPerTrigger``, a soft bound: at least
    one file): files of wide rows make a batch large in bytes long before 1,000 files. With
    Spark's default 1 GiB heap, 64 MiB batches of 1 MiB values ran it out; raise both together."""
    local_merge_max_rows: int = 50_000
    """Batches of at most this many mirror rows are merged on the driver by delta-rs, larger
    ones by Spark; 0 merges every batch through Spark."""
    local_merge_max_mb: int = 64
    """The same bound in MiB (the batch's rows as JSON, measured before collecting): what the
    driver collects is bounded by bytes, however wide the rows."""
    master: str = "local[*]"
    """Spark master; empty leaves it to spark-submit."""
    shuffle_partitions: int = 8
    """Frozen into the checkpoint on its first run."""
    tombstone_ttl_s: float = 86_400.0
    max_evolutions_per_variable: int = 16
    max_evolutions_per_query: int = 128
    confirmed_drops: str = ""
    """Comma-separated ``variable.field`` paths whose removal next to a same-typed addition is
    meant; the field may be nested (``entry_items.change_stats.updates``), as a refusal names it."""
    max_restarts: int = 5
    """Query restarts in a row (schema changes, conflicts) before the job gives up."""
    lock_stale_s: float = 60.0
    metrics_port: int = 8081
    """Prometheus ``/metrics`` on this port; 0 serves none."""
    log_level: str = "info"

    @property
    def history_table_set(self) -> frozenset[str]:
        return frozenset(t.strip() for t in self.history_tables.split(",") if t.strip())

    @property
    def confirmed_drop_set(self) -> frozenset[str]:
        return frozenset(p.strip() for p in self.confirmed_drops.split(",") if p.strip())


ENVIRONMENT = {f.name: f"PIPELINE_{f.name.upper()}" for f in fields(PipelineConfig)}


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


PARSERS: dict[str, Callable[[Any], Any]] = {
    "changelog_uri": non_empty,
    "mirror_root": non_empty,
    "checkpoint_uri": non_empty,
    "history_root": non_empty,
    "history_tables": str,
    "processors": str,
    "processor_root": non_empty,
    "job_id": identifier,
    "trigger": choice("continuous", "available-now"),
    "trigger_interval_s": seconds(0, 86_400),
    "max_files_per_trigger": integer(1, 1_000_000),
    "local_merge_max_rows": integer(0, 10_000_000),
    "local_merge_max_mb": integer(1, 1 << 20),
    "max_mb_per_trigger": integer(1, 1 << 20),
    "master": str,
    "shuffle_partitions": integer(1, 10_000),
    "tombstone_ttl_s": seconds(1, 365 * 86_400),
    "max_evolutions_per_variable": integer(1, 10_000),
    "max_evolutions_per_query": integer(1, 100_000),
    "confirmed_drops": _confirmed_drops,
    "max_restarts": integer(0, 1_000),
    "lock_stale_s": seconds(5, 86_400),
    "metrics_port": integer(0, 65_535),
    "log_level": choice("debug", "info", "warning", "error"),
}


def load(environ: Mapping[str, str] | None = None, file: str | None = None) -> PipelineConfig:
    environ = os.environ if environ is None else environ
    path = file or environ.get(CONFIG_FILE_VARIABLE)
    return load_options(PipelineConfig, PARSERS, ENVIRONMENT, environ, path)


def reference() -> list[tuple[str, str, object]]:
    return [(f.name, ENVIRONMENT[f.name], f.default) for f in fields(PipelineConfig)]
