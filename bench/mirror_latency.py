"""Mirror freshness benchmark: commit → mirror visible, end to end, as `make run` runs the product.

Each case is one `make run` (emulator, ingest service, pipeline and workload on this machine) on a
fresh database: the workload's commit timestamps against the end of the micro-batch that made
each commit readable in its mirror (``emulator.local_run.mirror_latencies``). The baseline is the
same run with every MERGE through delta-spark (``PIPELINE_LOCAL_MERGE_MAX_ROWS=0``), the only
path before issue 11.

A case may name a store: ``20:driver:s3`` keeps every table and checkpoint on MinIO on loopback
(``make run --store s3://...`` with the AWS variables; one server for the whole run), against
``20:driver`` (or ``20:driver:local``) on a local path: the same run, only the store differs.

p50/p99 count commits after the pipeline's first batch (before it, commits wait for Spark to
start, reported apart as "first batch s"); "change log" is commit → the change-log commit that
landed it; "lag" is the ingest's watermark lag at its commits.

Usage: python bench/mirror_latency.py [--seconds 120] [--cases 20:driver,20:spark,100:driver]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from emulator.machine import machine_line  # noqa: E402
from emulator.object_store import S3Store, minio  # noqa: E402

MERGE_LIMITS = {"driver": "50000", "spark": "0"}
FIGURES = (
    "changelog_p50_s",
    "changelog_p99_s",
    "mirror_p50_s",
    "mirror_p99_s",
    "changelog_to_mirror_p50_s",
    "changelog_to_mirror_p99_s",
    "first_batch_s",
    "lag_p50_s",
    "lag_p99_s",
)


def _seconds(value: float | None) -> str:
    """A figure the run could not measure (no commit after the first batch) prints as -."""
    return "-" if value is None else f"{value:.2f}"


def run_case(
    rate: float,
    merge: str,
    seconds: float,
    existing_rows: int,
    folder: Path,
    store: S3Store | None = None,
) -> dict:
    began = time.monotonic()
    on_store = ["--store", store.uri(folder.name)] if store else []
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "emulator.local_run",
            "--seconds",
            str(seconds),
            "--rate",
            str(rate),
            "--existing-rows",
            str(existing_rows),
            "--folder",
            str(folder),
            *on_store,
        ],
        cwd=ROOT,
        env={
            **os.environ,
            **(store.environment() if store else {}),
            "PIPELINE_LOCAL_MERGE_MAX_ROWS": MERGE_LIMITS[merge],
        },
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise SystemExit(f"make run failed ({merge}, {rate}/s):\n{result.stdout[-3000:]}")
    if store and not json.loads((folder / "summary.json").read_text())["passed"]:
        raise SystemExit(f"the mirrors differ from Spanner on {store.uri(folder.name)}")
    summary = json.loads((folder / "summary.json").read_text())
    summary["wall_s"] = time.monotonic() - began
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--existing-rows", type=int, default=1000)
    parser.add_argument("--cases", default="20:driver,20:spark,100:driver")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="mirror-latency-"))
    print(
        machine_line(
            f"make run with {args.seconds:g} s of workload, {args.existing_rows} existing rows"
        )
    )
    print(
        "rate/s\tmerge\tstore\tcommitted\tbatches\tchange log p50/p99 s\tp50 s\tp99 s"
        "\tlanded→mirror p50/p99 s\tfirst batch s\tlag p50/p99 s"
    )
    with contextlib.ExitStack() as stack:
        s3: S3Store | None = None
        for case in args.cases.split(","):
            rate, merge, store = [*case.split(":"), "local"][:3]
            if store == "s3" and s3 is None:
                s3 = stack.enter_context(minio(root / "minio"))
            summary = run_case(
                float(rate),
                merge,
                args.seconds,
                args.existing_rows,
                root / case.replace(":", "-"),
                s3 if store == "s3" else None,
            )
            _print_case(rate, merge, store, summary)
    print(json.dumps({"work": str(root)}))
    return 0


def _print_case(rate: str, merge: str, store: str, summary: dict) -> None:
    figures = {name: _seconds(summary.get(name)) for name in FIGURES}
    print(
        f"{rate}\t{merge}\t{store}\t{summary['committed']}\t{summary['pipeline_batches']}\t"
        f"{figures['changelog_p50_s']}/{figures['changelog_p99_s']}\t"
        f"{figures['mirror_p50_s']}\t{figures['mirror_p99_s']}\t"
        f"{figures['changelog_to_mirror_p50_s']}/{figures['changelog_to_mirror_p99_s']}\t"
        f"{figures['first_batch_s']}\t{figures['lag_p50_s']}/{figures['lag_p99_s']}",
        flush=True,
    )
    if summary.get("mirror_p50_s") is None:
        print(
            "# no commit reached a mirror after the pipeline's first batch: run longer "
            "than that batch takes (about 30 s on an idle 2-core machine)",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
