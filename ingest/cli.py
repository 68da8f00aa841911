"""Command line: ``python -m ingest tail`` prints whole, ordered transactions as JSON lines;
``python -m ingest run`` lands them in a Delta change-log table, exactly once;
``python -m ingest spark-run`` lands the same change log with a Spark streaming query;
``python -m ingest audit`` reads a past window again and compares it with the change log;
``python -m ingest snapshot-table`` asks a running service to snapshot tables again.

Every bad input ends with one ``error:`` line on stderr and a non-zero exit: 2 for a request that
cannot be valid, 1 for a failure while running; ``audit`` exits 3 when it finds a difference.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from google.api_core import exceptions as api_exceptions

from ingest.changestream import query
from ingest.changestream.config import (
    SETTLE_MARGIN_S,
    STUCK_AFTER_HEARTBEATS,
    ReaderConfig,
    reader_config,
)
from ingest.changestream.opening import StreamAddress, open_stream
from ingest.changestream.reader import ChangeStreamReader
from ingest.job import config as config_module
from ingest.model.encoding import canonical_json, transaction_to_dict
from ingest.model.resume import Release
from ingest.model.timestamps import Nanos, parse_rfc3339, to_rfc3339
from ingest.service.audit import audit, newest_watermark
from ingest.service.run import run_service
from runtime.commands import Parser, UsageError, one_line, run_command
from runtime.errors import BadInput, ReportedError
from runtime.logs import make_logger
from runtime.stopping import stop_on_signals

EXIT_DIFFERENCES = 3
"""``audit`` found transactions missing, extra or differing."""


def _timestamp(text: str) -> Nanos:
    if text == "now":
        return time.time_ns()
    try:
        return parse_rfc3339(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m ingest", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    tail = commands.add_parser("tail", help="print committed transactions as JSON lines")
    _stream_arguments(tail, start_default="now")
    tail.add_argument(
        "--end-timestamp",
        type=_timestamp,
        default=None,
        help="RFC 3339; stop once everything up to it is printed",
    )
    audit = commands.add_parser(
        "audit",
        help="read a past window of the stream again and compare it with the change log",
    )
    _stream_arguments(audit, start_default=None)
    audit.add_argument(
        "--end-timestamp",
        type=_timestamp,
        default=None,
        help="RFC 3339; default: the change log's low watermark",
    )
    audit.add_argument(
        "--changelog",
        default=os.environ.get("INGEST_TABLE_URI"),
        required=os.environ.get("INGEST_TABLE_URI") is None,
        help="the change-log table (default $INGEST_TABLE_URI)",
    )
    for name, does in (
        ("run", "land the change stream in a Delta change-log table (long-running)"),
        ("spark-run", "land the change stream with a Spark streaming query on any master"),
    ):
        commands.add_parser(name, help=does).add_argument(
            "--config",
            default=None,
            help=f"TOML file (or {config_module.CONFIG_FILE_VARIABLE}); environment overrides it",
        )
    again = commands.add_parser(
        "snapshot-table",
        help="ask the running service to snapshot tables again (POST /snapshot on its health port)",
    )
    again.add_argument("--table", action="append", required=True, help="repeat for more tables")
    again.add_argument(
        "--url",
        default=f"http://127.0.0.1:{os.environ.get('INGEST_HEALTH_PORT', '8080')}",
        help="the service's health port (default http://127.0.0.1:$INGEST_HEALTH_PORT or 8080)",
    )
    again.add_argument(
        "--token-file",
        default=os.environ.get("INGEST_CONTROL_TOKEN_FILE", ""),
        help="the service's control token (default $INGEST_CONTROL_TOKEN_FILE)",
    )
    return parser


def _stream_arguments(command: argparse.ArgumentParser, start_default: str | None) -> None:
    """What ``tail`` and ``audit`` read: the stream, and how its partitions are queried."""
    env = os.environ.get
    command.add_argument("--project", default=env("SPANNER_PROJECT", "local-project"))
    command.add_argument("--instance", default=env("SPANNER_INSTANCE", "local-instance"))
    command.add_argument("--database", default=env("SPANNER_DATABASE", "bank"))
    command.add_argument("--stream", default=env("SPANNER_CHANGE_STREAM", "all_changes"))
    command.add_argument(
        "--dialect", choices=["auto", *(d.value for d in query.Dialect)], default="auto"
    )
    command.add_argument("--heartbeat-ms", type=int, default=1000)
    if start_default is None:
        command.add_argument("--start-timestamp", type=_timestamp, required=True, help="RFC 3339")
    else:
        command.add_argument(
            "--start-timestamp",
            type=_timestamp,
            default=start_default,
            help=f"RFC 3339 or 'now' (default {start_default})",
        )
    command.add_argument("--max-concurrent-partitions", type=int, default=512)
    command.add_argument("--memory-budget-mb", type=int, default=256)
    command.add_argument("--stats-interval-s", type=float, default=10.0)
    command.add_argument(
        "--query-window-s",
        type=float,
        default=120.0,
        help="each partition query ends this long after it starts, then runs again",
    )
    command.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    command.set_defaults(
        settle_margin_s=SETTLE_MARGIN_S, stuck_after_heartbeats=STUCK_AFTER_HEARTBEATS
    )


@dataclass(frozen=True)
class TailRequest:
    source: query.ChangeStreamQuery
    config: ReaderConfig


def prepare_tail(args: argparse.Namespace) -> TailRequest:
    """Validate everything that can be validated before the first partition query."""
    query.validate_heartbeat(args.heartbeat_ms)
    query.validate_query_window(args.query_window_s, args.heartbeat_ms)
    if args.max_concurrent_partitions < 1:
        raise UsageError("--max-concurrent-partitions must be at least 1")
    if args.memory_budget_mb < 1:
        raise UsageError("--memory-budget-mb must be at least 1")
    if args.end_timestamp is not None and args.end_timestamp < args.start_timestamp:
        raise UsageError(
            f"end timestamp {to_rfc3339(args.end_timestamp)} is before the start timestamp "
            f"{to_rfc3339(args.start_timestamp)}"
        )
    opened = open_stream(
        StreamAddress(
            args.project, args.instance, args.database, args.stream, args.dialect, args.heartbeat_ms
        )
    )
    query.validate_start(args.start_timestamp, time.time_ns(), opened.info)
    return TailRequest(
        opened.query(), reader_config(args, args.start_timestamp, args.end_timestamp)
    )


def run_ingest(args: argparse.Namespace, out: TextIO) -> int:
    config = config_module.load(file=args.config)
    log = make_logger(out, config.log_level).bind(command="run", stream=config.stream)
    return run_service(config, log, stop_on_signals(log))


def run_on_spark(args: argparse.Namespace, out: TextIO) -> int:
    from ingest.sparksource.run import load_spark_config, run_spark_source

    config = config_module.load(file=args.config)
    spark = load_spark_config()
    log = make_logger(out, config.log_level).bind(command="spark-run", stream=config.stream)
    return run_spark_source(config, spark, log, stop_on_signals(log))


def _regular_sessions_on_the_emulator() -> None:
    """The emulator loses the transactions of concurrent reads on one multiplexed session, the
    client's default ("Transaction not found", "Invalid transaction ID"; emulator/NOTES.md), so
    against it the client uses regular sessions. Cloud Spanner is not affected; an explicit
    setting wins."""
    if os.environ.get("SPANNER_EMULATOR_HOST"):
        os.environ.setdefault("GOOGLE_CLOUD_SPANNER_MULTIPLEXED_SESSIONS", "false")


class SnapshotRequestRefused(BadInput):
    """The service answered the request with an error."""


def request_table_snapshot(args: argparse.Namespace, out: TextIO) -> int:
    """Print the service's answer (T1 and the tables) once the request is recorded."""
    query_text = urllib.parse.urlencode([("table", t) for t in args.table])
    headers = {}
    if args.token_file:
        try:
            headers["Authorization"] = f"Bearer {Path(args.token_file).read_text().strip()}"
        except OSError as error:
            raise SnapshotRequestRefused(f"cannot read the control token: {error}") from None
    request = urllib.request.Request(
        f"{args.url}/snapshot?{query_text}", method="POST", headers=headers
    )
    try:
        with urllib.request.urlopen(request, timeout=90) as response:
            out.write(response.read().decode() + "\n")
            return 0
    except urllib.error.HTTPError as error:
        raise SnapshotRequestRefused(
            f"the service refused the snapshot ({error.code}): {error.read().decode()}"
        ) from None
    except OSError as error:
        raise SnapshotRequestRefused(f"no service answers at {args.url}: {error}") from None


def run_tail(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    log = make_logger(err, args.log_level).bind(command="tail", stream=args.stream)
    request = prepare_tail(args)
    stop = stop_on_signals(log)

    def print_release(release: Release) -> None:
        for transaction in release.transactions:
            out.write(canonical_json(transaction_to_dict(transaction)) + "\n")
        out.flush()
        if release.transactions:
            log.debug(
                "transactions_released",
                transactions=len(release.transactions),
                low_watermark=to_rfc3339(release.low_watermark),
            )

    reader = ChangeStreamReader(request.source, request.config, log)
    log.info(
        "tail_started",
        dialect=request.source.dialect.value,
        start_timestamp=to_rfc3339(request.config.start_timestamp),
        end_timestamp=(
            None
            if request.config.end_timestamp is None
            else to_rfc3339(request.config.end_timestamp)
        ),
        heartbeat_ms=request.config.heartbeat_ms,
    )
    reader.run(print_release, stop)
    log.info(
        "tail_stopped",
        low_watermark=to_rfc3339(reader.assembler.released_watermark),
        transactions=reader.assembler.stats.transactions_released,
        duplicates_dropped=reader.assembler.stats.duplicates_dropped,
    )
    return 0


def run_audit(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Exit 0 when the window agrees, EXIT_DIFFERENCES when it does not."""
    log = make_logger(err, args.log_level).bind(command="audit", stream=args.stream)
    watermark = newest_watermark(args.changelog)
    if args.end_timestamp is None:
        args.end_timestamp = watermark
    request = prepare_tail(args)
    report = audit(
        args.changelog, watermark, request.source, request.config, log, stop_on_signals(log)
    )
    out.write(report.summary() + "\n")
    for difference in report.differences:
        out.write(f"{difference}\n")
    out.flush()
    return EXIT_DIFFERENCES if report.differences else 0


def main(
    argv: Sequence[str] | None = None, out: TextIO | None = None, err: TextIO | None = None
) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    _regular_sessions_on_the_emulator()

    def command() -> int:
        args = build_parser().parse_args(argv)
        if args.command == "run":
            return run_ingest(args, out)
        if args.command == "spark-run":
            return run_on_spark(args, out)
        if args.command == "snapshot-table":
            return request_table_snapshot(args, out)
        if args.command == "audit":
            return run_audit(args, out, err)
        return run_tail(args, out, err)

    return run_command(command, err, _spanner_refused)


def _spanner_refused(error: Exception) -> ReportedError | None:
    """Spanner's answers as the product's errors: a request it refuses can never succeed."""
    if isinstance(error, REFUSED):
        return BadInput(f"spanner refused the request: {one_line(error)}")
    if isinstance(error, api_exceptions.GoogleAPICallError):
        return ReportedError(one_line(error))
    return None


REFUSED = (
    api_exceptions.NotFound,
    api_exceptions.InvalidArgument,
    api_exceptions.OutOfRange,
    api_exceptions.FailedPrecondition,
)
