"""Delta commits/s the ingest sustains on an object store against a local path, in one run.

The ingest's sink (``DeltaChangeLogSink``, the service's and the Spark source's only writer)
commits one two-row transaction after another for ``--seconds`` on each store: every commit
reads the job's landed version, writes a Parquet file and puts the next log file if absent. The
same code path on both; only the store differs. MinIO runs on loopback on the same cores, so
its figure holds the store's CPU but no network: a cloud store adds its round trips
(tens of milliseconds each; a commit takes about four).

``--checksums on,off`` runs each store with and without the sink's version checksums
(``Maintenance.version_checksums``): one put more per commit, the only difference.

Usage: python bench/changelog_commits.py [--seconds 30] [--checksums on,off]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from emulator.machine import machine_line
from emulator.object_store import minio
from ingest.delta.sink import DeltaChangeLogSink, Maintenance
from tests.test_sink import COMMIT, point, transactions


def commits_per_second(uri: str, seconds: float, checksums: bool) -> tuple[int, float]:
    maintenance = Maintenance(version_checksums=checksums)
    sink = DeltaChangeLogSink(uri, "bench", "bench-owner", maintenance=maintenance)
    sink.continue_after(None)
    sink.commit(transactions(1), point(COMMIT + 1))
    landed, began = 0, time.monotonic()
    while time.monotonic() - began < seconds:
        base = COMMIT + (landed + 1) * 10**6
        sink.commit(transactions(1, base), point(base + 1))
        landed += 1
    return landed, time.monotonic() - began


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--checksums", default="on", help="on, off, or both: on,off")
    args = parser.parse_args(argv)
    settings = args.checksums.split(",")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    work = Path(tempfile.mkdtemp(prefix="changelog-commits-"))
    print(
        machine_line(
            f"commit {commit}; back-to-back sink commits for {args.seconds:g} s per store; "
            "MinIO on loopback"
        )
    )
    print("store\tchecksums\tcommits\tseconds\tcommits/s\tms/commit\tratio to local")
    with minio(work / "minio") as s3:
        local_rates: dict[str, float] = {}
        for name, folder, env in (
            ("local path", str(work / "local"), {}),
            ("s3 (MinIO)", s3.uri("changelog"), s3.environment()),
        ):
            os.environ.update(env)
            for checksums in settings:
                uri = f"{folder}-{checksums}"
                landed, elapsed = commits_per_second(uri, args.seconds, checksums == "on")
                rate = landed / elapsed
                local_rates.setdefault(checksums, rate)
                print(
                    f"{name}\t{checksums}\t{landed}\t{elapsed:.1f}\t"
                    f"{rate:.1f}\t{1000 / rate:.1f}\t{rate / local_rates[checksums]:.2f}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
