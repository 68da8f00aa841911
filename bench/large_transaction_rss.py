"""Peak RSS of the reader + Delta sink while landing one transaction of 50,000 mods.

The emulator takes more than ten minutes to process a 50,000-row commit on this machine, so the
transaction is served by the tests' scripted gRPC server (in a process of its own, so only the
reader and the sink are measured), through the real google-cloud-spanner client.

Usage: python bench/large_transaction_rss.py [--mods 50000] [--records 50]
"""

from __future__ import annotations

import argparse
import io
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

START = 1_700_000_000 * 10**9


def streams(mods: int, records: int) -> dict:
    from ingest.model.records import ChildPartition, ChildPartitionsRecord, HeartbeatRecord, Mod
    from ingest.rules.partitions import INITIAL_PARTITION
    from tests.test_core_units import record

    per_record = mods // records
    commit = START + 1000
    data = [
        record(
            commit,
            "big",
            seq,
            records,
            mods=tuple(
                Mod({"k": str(seq * per_record + i)}, {"v": "x" * 64, "n": str(i)}, {})
                for i in range(per_record)
            ),
        )
        for seq in range(records)
    ]
    return {
        INITIAL_PARTITION: [ChildPartitionsRecord(START, "0", (ChildPartition("p", ()),))],
        "p": [*data, HeartbeatRecord(commit + 10)],
    }


def serve(mods: int, records: int) -> None:
    from tests.scripted_spanner import Script, start_server

    server, _, port = start_server(Script(streams(mods, records)))
    print(port, flush=True)
    server.wait_for_termination()


def land(port: int, table: str) -> None:
    from google.api_core.client_options import ClientOptions
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import spanner

    from ingest.changestream.config import ReaderConfig
    from ingest.changestream.query import ChangeStreamQuery, Dialect
    from ingest.changestream.reader import ChangeStreamReader
    from ingest.delta.sink import DeltaChangeLogSink
    from runtime.logs import make_logger

    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    client = spanner.Client(
        project="p",
        credentials=AnonymousCredentials(),
        client_options=ClientOptions(api_endpoint=f"127.0.0.1:{port}"),
        disable_builtin_metrics=True,
    )
    source = ChangeStreamQuery(
        client.instance("i").database("d"), "s", Dialect.GOOGLE_STANDARD_SQL, 1000
    )
    sink = DeltaChangeLogSink(table, "bench", "owner")
    reader = ChangeStreamReader(
        source,
        ReaderConfig(start_timestamp=START, end_timestamp=START + 10**6),
        make_logger(io.StringIO()),
    )
    rows = 0
    began = time.perf_counter()

    def commit(release) -> None:
        nonlocal rows
        if release.transactions:
            rows += sink.commit(release.transactions, release.resume_point).rows

    reader.run(commit, threading.Event())
    seconds = time.perf_counter() - began
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        f"{rows} rows landed in {seconds:.1f} s; peak RSS {peak / 1024:.0f} MiB "
        f"(process after imports and client setup: {baseline / 1024:.0f} MiB)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mods", type=int, default=50_000)
    parser.add_argument("--records", type=int, default=50)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--land", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.mods, args.records)
        return 0
    if args.land is not None:
        land(args.land, tempfile.mkdtemp(prefix="large-tx-") + "/t")
        return 0
    env = {k: v for k, v in os.environ.items() if k != "SPANNER_EMULATOR_HOST"}
    server = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--serve",
            "--mods",
            str(args.mods),
            "--records",
            str(args.records),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        print(f"one transaction of {args.mods} mods in {args.records} data change records:")
        subprocess.run([sys.executable, __file__, "--land", str(port)], check=True, env=env)
    finally:
        server.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
