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
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from pipeline import config as config_module
from pipeline.state.compatibility import StateSchemaError
from runtime.commands import Parser, run_command
from runtime.logs import make_logger
from runtime.options import ConfigError

OPTION_FLAGS = {
    "changelog": "changelog_uri",
    "mirrors": "mirror_root",
    "checkpoint": "checkpoint_uri",
    "trigger": "trigger",
    "master": "master",
    "confirmed_drops": "confirmed_drops",
}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m pipeline", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("run", "run the streaming job"),
        ("check-state-schema", "check the state schemas against the recorded ones"),
        ("rebase", "seed a new state generation from the mirrors (the job must be stopped)"),
    ):
        command = commands.add_parser(name, help=text)
        command.add_argument("--config", help="TOML file (also PIPELINE_CONFIG_FILE)")
        for flag in OPTION_FLAGS:
            command.add_argument(f"--{flag.replace('_', '-')}", dest=flag)
    return parser


def load_config(arguments: argparse.Namespace) -> config_module.PipelineConfig:
    environ = dict(os.environ)
    for flag, option in OPTION_FLAGS.items():
        value = getattr(arguments, flag)
        if value is not None:
            environ[config_module.ENVIRONMENT[option]] = value
    return config_module.load(environ, arguments.config)


def check_state_schema(config: config_module.PipelineConfig) -> int:
    from pipeline.catalog import discover_shapes
    from pipeline.job import checked_state_schemas, only_limits
    from pipeline.state import generations
    from pipeline.state.registry import SchemaRegistry

    generation = generations.current(config.checkpoint_uri)
    try:
        _, evolution = checked_state_schemas(
            config, discover_shapes(config.changelog_uri), SchemaRegistry(generation.uri)
        )
    except StateSchemaError as refused:
        if not only_limits(refused):
            raise
        print(
            f"ok: the job takes a rebase first (state generation {generation.number + 1}, "
            f"seeded from the mirrors): {refused}"
        )
        return 0
    print(
        "ok: "
        + (
            f"added variables {list(evolution.added_variables)}, "
            f"removed {list(evolution.removed_variables)}, "
            f"changed {list(evolution.changed_variables)}"
            if evolution.is_change
            else "no state schema change"
        )
    )
    return 0


def session_factory(config: config_module.PipelineConfig) -> Callable[[], Any]:
    """The job's Spark session, built when first needed (``run`` and ``rebase``)."""
    from pipeline.job import spark_settings
    from pipeline.session import build_session

    return lambda: build_session(
        f"spanner-mirrors-{config.job_id}",
        master=config.master or None,
        shuffle_partitions=config.shuffle_partitions,
        extra=spark_settings(config),
        storage_uris=(config.changelog_uri, config.mirror_root, config.checkpoint_uri),
    )


def rebase(config: config_module.PipelineConfig) -> int:
    from pipeline.rebase import rebase_on_demand

    log = make_logger(sys.stdout, config.log_level).bind(component="pipeline")
    generation = rebase_on_demand(
        config, log, session_factory(config), "on demand (python -m pipeline rebase)"
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
    stop, drain = threading.Event(), threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    signal.signal(signal.SIGUSR1, lambda *_: drain.set())
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
            session_factory(config),
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


def main(argv: Sequence[str] | None = None) -> int:
    def command() -> int:
        arguments = build_parser().parse_args(argv)
        config = load_config(arguments)
        if arguments.command == "check-state-schema":
            return check_state_schema(config)
        if arguments.command == "rebase":
            return rebase(config)
        return run(config)

    return run_command(command, sys.stderr)
