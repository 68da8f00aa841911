"""`make run`: the change stream reader live on a local emulator.

Starts an emulator on a free loopback port (or uses SPANNER_EMULATOR_HOST), bootstraps the sample
database, commits a banking workload and runs `python -m ingest tail` on it, printing whole
transactions as JSON lines; structured logs go to a file whose path is printed. Ctrl-C stops.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from google.cloud import spanner

from emulator.bootstrap import bootstrap
from emulator.server import emulator
from emulator.workload import Workload, WorkloadConfig
from ingest.cli import tail_argv
from ingest.timestamps import NANOS_PER_SECOND


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make run", description=__doc__)
    parser.add_argument("--seconds", type=float, default=30.0, help="how long the workload runs")
    parser.add_argument("--rate", type=float, default=20.0, help="transactions per second")
    args = parser.parse_args(argv)
    run_dir = Path(tempfile.mkdtemp(prefix="spanner-cdc-run-"))
    with contextlib.ExitStack() as stack:
        if not os.environ.get("SPANNER_EMULATOR_HOST"):
            running = stack.enter_context(
                emulator(token_alive_seconds=5, log_path=run_dir / "emulator.log")
            )
            os.environ["SPANNER_EMULATOR_HOST"] = running.host_port
        print(
            f"emulator at {os.environ['SPANNER_EMULATOR_HOST']}; logs in {run_dir}", file=sys.stderr
        )
        database = bootstrap(spanner.Client(project="local-project"))
        start = time.time_ns() + NANOS_PER_SECOND // 5
        time.sleep(0.3)
        end = start + int((args.seconds + 5) * NANOS_PER_SECOND)
        log_file = stack.enter_context(open(run_dir / "tail.log", "w"))
        tail = subprocess.Popen(
            tail_argv(database.database_id, "all_changes", start, end),
            stderr=log_file,
        )
        stop = threading.Event()
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        workload = Workload(
            database,
            WorkloadConfig(duration_seconds=args.seconds, transactions_per_second=args.rate),
        )
        committed = workload.run(stop)
        if stop.is_set():
            tail.terminate()
        code = tail.wait()
        print(
            f"committed {len(committed)} transactions; tail exited {code}; "
            f"logs: {run_dir / 'tail.log'}",
            file=sys.stderr,
        )
        return code


if __name__ == "__main__":
    sys.exit(main())
