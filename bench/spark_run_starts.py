"""``python -m ingest spark-run`` started again and again as a user starts it (issue 41): in an
environment no harness prepared (``emulator.processes.Process`` hands the product none of what
``runtime/process.py`` sets), with CPU-bound load beside it. The driver opens Spanner before
Spark launches its JVM; with gRPC's fork handlers on, that launch died in 2 of 5 starts on a
loaded machine. Each start is stopped by ``--signal`` to its process group once it has started:
TERM as a supervisor stops it, INT as a terminal's Ctrl-C does. Prints one line: starts, started,
died. A start whose stop has not ended after ``STOP_S`` counts as died, with what the driver
logged (its ``stop_slow`` reports) and where the JVM's threads stood.

    python bench/spark_run_starts.py --starts 10 --load 1
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from google.cloud import spanner

from emulator.bootstrap import bootstrap
from emulator.machine import machine_line
from emulator.processes import Process, kill_tree, process_tree
from emulator.server import emulator

STOP_S = 120
"""A clean stop takes seconds; Spark's own bound on stopping a query is 30 s."""
BUSY = ("StreamExecution", "py4j", "Python")
"""Words in the stack of a JVM thread that takes part in a stop: the query's, Py4J's, the
Python workers'."""
IDLE = "Idle Worker Monitor"


def start_once(database_id: str, folder: Path, number: int, stop: signal.Signals) -> bool:
    """One driver from nothing to ``spark_source_started``; True when it got there."""
    driver = Process(
        ["-m", "ingest", "spark-run"],
        folder / f"driver-{number}.log",
        {
            "SPANNER_DATABASE": database_id,
            "INGEST_TABLE_URI": str(folder / "changelog"),
            "INGEST_SPARK_CHECKPOINT_URI": str(folder / "checkpoint"),
            "INGEST_SPARK_MASTER": "local[1]",
            "INGEST_SNAPSHOT_MODE": "never",
            "INGEST_HEALTH_PORT": "0",
        },
    )
    process = driver.start()
    deadline = time.monotonic() + 300
    try:
        while driver.count("spark_source_started") == 0:
            if process.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        os.killpg(process.pid, stop)
        try:
            return process.wait(timeout=STOP_S) == 0
        except subprocess.TimeoutExpired:
            print(f"start {number}: its stop had not ended after {STOP_S} s", file=sys.stderr)
            print(stuck_stop(driver, process.pid), file=sys.stderr)
            return False
    finally:
        if process.poll() is None:
            kill_tree(process)


def stuck_stop(driver: Process, pid: int) -> str:
    """The driver's last events but the JVM's lines, its threads in its newest ``stop_slow``
    report, and the stacks of the JVM's threads that run Spark's or Py4J's code."""
    events = driver.events()
    lines = [
        json.dumps({k: v for k, v in e.items() if k != "threads"})[:400]
        for e in events
        if e["event"] != "jvm_output"
    ][-15:]
    slow = [e for e in events if e["event"] == "stop_slow"]
    for name, frames in slow[-1]["threads"].items() if slow else ():
        lines.append(f"python thread {name}: " + " > ".join(frames))
    for jvm in filter(_is_java, process_tree(pid)):
        dump = subprocess.run(["jstack", str(jvm)], capture_output=True, text=True, timeout=60)
        blocks = [
            b for b in dump.stdout.split("\n\n") if any(w in b for w in BUSY) and IDLE not in b
        ]
        lines += ["\n".join(b.splitlines()[:40]) for b in blocks[:12]]
    return "\n".join(lines)


def _is_java(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == "java"
    except OSError:
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--starts", type=int, default=10)
    parser.add_argument("--load", type=int, default=1, help="busy processes beside the starts")
    parser.add_argument("--signal", choices=("TERM", "INT"), default="TERM")
    args = parser.parse_args()
    stop = signal.Signals[f"SIG{args.signal}"]
    print(machine_line())
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        with emulator() as running, tempfile.TemporaryDirectory() as work:
            os.environ["SPANNER_EMULATOR_HOST"] = running.host_port
            database = bootstrap(spanner.Client(project="local-project"), database_id="starts")
            outcomes = [
                start_once(database.database_id, Path(work), n, stop) for n in range(args.starts)
            ]
    finally:
        for process in busy:
            process.kill()
    started = sum(outcomes)
    print("starts\tstarted\tdied")
    print(f"{args.starts}\t{started}\t{args.starts - started}")
    return 0 if started == args.starts else 1


if __name__ == "__main__":
    sys.exit(main())
