"""A live stream audited after the fact, with every missing transaction classified (issue 25).

Each repeat, on a fresh database of a fresh emulator: the ingest service reads the stream from
now (debug logs: every data record the client handed the reader, every end a query's clean close
proved), single-row transactions commit at ``--rate`` for ``--seconds``, the service
drains and stops, and ``ingest.service.audit`` reads the window again with bounded catch-up
queries. A transaction committed but not in the change log is then:

- ``product dropped it``: the client handed the reader one of its records (a product loss);
- ``live query never sent it, re-read has it``: the emulator's live query skipped it, and the
  note says whether a query's clean close proved past it (trusted up to what had settled when
  the query began) or a record or heartbeat did;
- ``never sent, not even on re-read``.

Usage: python bench/live_audit.py [--repeats 10] [--seconds 60] [--rate 50]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from google.cloud import spanner

from emulator.bootstrap import bootstrap
from emulator.machine import machine_line
from emulator.omissions import PRODUCT_DROPPED, classify, reread_commits
from emulator.processes import Process
from emulator.server import emulator
from emulator.verify import changelog_watermark
from ingest.changestream.query import Dialect
from ingest.model.timestamps import Nanos, from_datetime, to_rfc3339
from ingest.service.audit import changelog_digests


def commit_at_rate(database: Any, rate: float, seconds: float) -> list[Nanos]:
    """Single-row blind writes on a fixed schedule; their commit timestamps."""
    committed: list[Nanos] = []
    began = time.monotonic()
    for n in range(int(rate * seconds)):
        delay = began + n / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        with database.batch() as batch:
            batch.insert("ticks", ["id", "n"], [(n, n)])
        committed.append(from_datetime(batch.committed))
    return committed


def ingest_service(database_id: str, changelog: Path, log: Path) -> Process:
    """``python -m ingest run`` from now, no snapshot, logging at debug."""
    return Process(
        ["-m", "ingest", "run"],
        log,
        {
            "SPANNER_DATABASE": database_id,
            "INGEST_TABLE_URI": str(changelog),
            "INGEST_SNAPSHOT_MODE": "never",
            "INGEST_HEALTH_PORT": "0",
            "INGEST_LOG_LEVEL": "debug",
        },
    )


def repeat(client: spanner.Client, number: int, rate: float, seconds: float, work: Path) -> dict:
    database = bootstrap(client, database_id=f"audit{number}_{os.getpid() % 10000}", accounts=0)
    operation = database.update_ddl(
        ["CREATE TABLE ticks (id INT64 NOT NULL, n INT64) PRIMARY KEY (id)"]
    )
    operation.result(120)
    changelog = work / f"changelog-{number}"
    service = ingest_service(database.database_id, changelog, work / f"ingest-{number}.log")
    process = service.start()
    try:
        service.wait_for("ingest_started", 1, timeout=60, process=process)
        committed = commit_at_rate(database, rate, seconds)
        deadline = time.monotonic() + 120
        while landed_watermark(changelog) < committed[-1]:
            assert time.monotonic() < deadline, "the change log did not pass the last commit"
            time.sleep(0.2)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    start, end = committed[0], committed[-1]
    landed = {key[0] for key in changelog_digests(str(changelog), start, end).by_transaction}
    missing = [t for t in committed if to_rfc3339(t) not in landed]
    reread = reread_commits(database, "all_changes", Dialect.GOOGLE_STANDARD_SQL, start, end)
    return {
        "committed": len(committed),
        "landed": len(landed),
        "reread": len(reread),
        "omissions": classify(missing, service.events(), reread),
    }


def landed_watermark(changelog: Path) -> Nanos:
    watermark = changelog_watermark(str(changelog))
    return -1 if watermark is None else watermark.low_watermark


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=50.0)
    args = parser.parse_args(argv)
    os.environ.setdefault("GOOGLE_CLOUD_SPANNER_MULTIPLEXED_SESSIONS", "false")
    work = Path(tempfile.mkdtemp(prefix="live-audit-"))
    print(
        machine_line(
            f"{args.repeats} x {args.seconds:g} s at {args.rate:g} single-row transactions/s"
        )
    )
    print("repeat\tcommitted\tlanded\tre-read\tmissing\tclassified")
    totals: Counter[str] = Counter()
    for number in range(args.repeats):
        with emulator() as running:
            os.environ["SPANNER_EMULATOR_HOST"] = running.host_port
            client = spanner.Client(project="local-project")
            result = repeat(client, number, args.rate, args.seconds, work)
        omissions = result["omissions"]
        kinds = Counter(o.verdict for o in omissions)
        totals.update(kinds)
        print(
            f"{number}\t{result['committed']}\t{result['landed']}\t{result['reread']}\t"
            f"{len(omissions)}\t{dict(kinds) or '-'}",
            flush=True,
        )
        for omission in omissions:
            print(f"#   {omission}", flush=True)
    print(f"missing transactions by cause: {dict(totals) or 'none'}")
    print(json.dumps({"work": str(work)}))
    return 1 if totals[PRODUCT_DROPPED] else 0


if __name__ == "__main__":
    sys.exit(main())
