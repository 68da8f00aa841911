"""Command line: ``python -m pipeline run`` keeps the mirror tables; ``python -m pipeline
check-state-schema`` says whether the next deployment's state schemas may run on the checkpoint;
``python -m pipeline rebase`` seeds a new state generation from the mirrors (a lost or corrupt
checkpoint, a state layout change).

A bad option or a refused state schema change ends with one ``error:`` line on stderr and exit 2;
a failure while running exits 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from pipeline import config as config_module
from pipeline.state.compatibility import Evolution, StateSchemaError
from runtime.commands import Parser, run_command
from runtime.logs import make_logger
from runtime.options import ConfigError
from runtime.stopping import stop_on_signals

OPTION_FLAGS = {
    "changelog": "changelog_uri",
    "mirrors": "mirror_root",
    "checkpoint": "checkpoint_uri",
    "trigger": "trigger",
    "master": "master",
    "confirmed_drops": "confirmed_drops",
    "history_tables": "history_tables",
    "history_root": "history_root",
    "processors": "processors",
    "processor_root": "processor_root",
}
COMMANDS = {
    "run": ("run the streaming job", tuple(OPTION_FLAGS)),
    "check-state-schema": (
        "check the state schemas against the recorded ones",
        ("changelog", "checkpoint", "confirmed_drops", "processors"),
    ),
    "rebase": (
        "seed a new state generation from the mirrors (the job must be stopped)",
        ("changelog", "mirrors", "checkpoint", "master", "processors"),
    ),
    "as-of": (
        "every captured table as it was at a Spanner time",
        ("mirrors", "history_tables", "history_root"),
    ),
}
"""Each command with its help line and the options it reads (its --help lists only those)."""


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m pipeline", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (text, flags) in COMMANDS.items():
        command = commands.add_parser(name, help=text)
        command.add_argument("--config", help="TOML file (also PIPELINE_CONFIG_FILE)")
        for flag in flags:
            variable = config_module.ENVIRONMENT[OPTION_FLAGS[flag]]
            command.add_argument(f"--{flag.replace('_', '-')}", dest=flag, help=f"or {variable}")
        if name == "as-of":
            command.add_argument("timestamp", help="RFC 3339, e.g. 2026-11-25T08:00:00.5Z")
            command.add_argument(
                "--source",
                choices=("history", "mirrors"),
                default="history",
                help="history: exactly at the time; mirrors: at the newest batch's W before it",
            )
            command.add_argument("--table", action="append", help="only this table (repeat)")
            command.add_argument(
                "--output", help="write each table as a Delta table under this folder"
            )
    return parser


def load_config(arguments: argparse.Namespace) -> config_module.PipelineConfig:
    environ = dict(os.environ)
    for flag, option in OPTION_FLAGS.items():
        value = getattr(arguments, flag, None)
        if value is not None:
            environ[config_module.ENVIRONMENT[option]] = value
    return config_module.load(environ, arguments.config)


def check_state_schema(config: config_module.PipelineConfig) -> int:
    from pipeline.catalog import discover_shapes
    from pipeline.deployment import checked_state_schemas, only_limits
    from pipeline.state import generations
    from pipeline.state.registry import SchemaRegistry
    from pipeline.user_processors.loading import load_all

    generation = generations.current(config.checkpoint_uri)
    try:
        _, evolution = checked_state_schemas(
            config,
            discover_shapes(config.changelog_uri),
            SchemaRegistry(generation.uri),
            load_all(config.processors),
        )
    except StateSchemaError as refused:
        if not only_limits(refused):
            raise
        print(
            f"ok: the job takes a rebase first (state generation {generation.number + 1}, "
            f"seeded from the mirrors): {refused}"
        )
        return 0
    print(f"ok: {_described(evolution)}")
    return 0


def _described(evolution: Evolution) -> str:
    if not evolution.is_change:
        return "no state schema change"
    return (
        f"added variables {list(evolution.added_variables)}, "
        f"removed {list(evolution.removed_variables)}, "
        f"changed {list(evolution.changed_variables)}"
    )


def session_factory(config: config_module.PipelineConfig, log: Any) -> Callable[[], Any]:
    """The job's Spark session, built when first needed (``run`` and ``rebase``); the JVM's
    lines become the job's own events."""
    from pipeline.query import spark_settings
    from pipeline.session import build_session
    from runtime.jvm import JvmLog

    return lambda: build_session(
        f"spanner-mirrors-{config.job_id}",
        master=config.master or None,
        shuffle_partitions=config.effective_shuffle_partitions,
        extra=spark_settings(config),
        storage_uris=(config.changelog_uri, config.mirror_root, config.checkpoint_uri),
        jvm_output=JvmLog(log),
    )


def rebase(config: config_module.PipelineConfig) -> int:
    from pipeline.rebase import rebase_on_demand

    log = make_logger(sys.stdout, config.log_level).bind(component="pipeline")
    generation = rebase_on_demand(
        config, log, session_factory(config, log), "on demand (python -m pipeline rebase)"
    )
    print(
        f"ok: state generation {generation.number} seeded from the mirrors; the next run "
        f"reads the change log from version {generation.starting_version}"
    )
    return 0


def run(config: config_module.PipelineConfig) -> int:
    from pipeline.job import run_pipeline
    from pipeline.metrics import PipelineMetrics

    log = make_logger(sys.stdout, config.log_level).bind(component="pipeline")
    drain = threading.Event()
    stop = stop_on_signals(log, drain=drain)
    metrics = PipelineMetrics()
    close_metrics = None
    if config.metrics_port:
        try:
            close_metrics = metrics.serve(config.metrics_port)
        except OSError as error:
            raise ConfigError(
                f"PIPELINE_METRICS_PORT={config.metrics_port}: cannot serve /metrics: "
                f"{error.strerror}"
            ) from error
        log.info("metrics_serving", port=config.metrics_port)
    try:
        stats = run_pipeline(
            config,
            log,
            stop,
            session_factory(config, log),
            drain,
            metrics,
        )
    finally:
        if close_metrics is not None:
            close_metrics()
    log.info(
        "pipeline_stopped",
        batches=stats.batches,
        rows_merged=stats.rows_merged,
        restarts=stats.restarts,
        rebases=stats.rebases,
    )
    return 0


def as_of(config: config_module.PipelineConfig, arguments: argparse.Namespace) -> int:
    """Print each table's rows as JSON lines (``{"table": ..., "row": {...}}``, keys sorted),
    or write each as a Delta table under ``--output``; then one summary line on stderr."""
    import json

    from deltalake import write_deltalake

    from pipeline.as_of import history_as_of, mirrors_as_of
    from pipeline.history import Histories

    if arguments.source == "history":
        histories = Histories(config.history_root, config.history_table_set)
        result = history_as_of(histories, config.mirror_root, arguments.timestamp, arguments.table)
    else:
        result = mirrors_as_of(config.mirror_root, arguments.timestamp, arguments.table)
    for table, rows in result.tables.items():
        if arguments.output:
            target = f"{arguments.output.rstrip('/')}/{table}"
            write_deltalake(target, rows, mode="overwrite", schema_mode="overwrite")
            continue
        for row in rows.to_pylist():
            print(json.dumps({"table": table, "row": row}, sort_keys=True, default=_text))
    counts = ", ".join(f"{t} {r.num_rows}" for t, r in result.tables.items())
    print(
        f"ok: {result.source} as of {result.at}, consistent at {result.consistent_at}: {counts}",
        file=sys.stderr,
    )
    return 0


def _text(value: Any) -> str:
    """JSON for what JSON lacks: bytes as base64, the rest (times, decimals) as text."""
    import base64

    if isinstance(value, bytes | bytearray):
        return base64.b64encode(bytes(value)).decode()
    return str(value)


def main(argv: Sequence[str] | None = None) -> int:
    def command() -> int:
        arguments = build_parser().parse_args(argv)
        config = load_config(arguments)
        if arguments.command == "check-state-schema":
            return check_state_schema(config)
        if arguments.command == "rebase":
            return rebase(config)
        if arguments.command == "as-of":
            return as_of(config, arguments)
        return run(config)

    return run_command(command, sys.stderr)
