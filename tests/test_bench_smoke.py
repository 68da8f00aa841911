"""Every script in ``bench/`` runs at a smoke size and prints its figures (issue 25): a benchmark
that rots (a changed signature, a renamed field) fails the suite instead of the next person who
tries to reproduce a figure. Seconds each, real code paths; the figures themselves are not
checked, only that each script produced them (benchmarks are not timed tests).

The scripts that need Spark run in ``tests/test_bench_smoke_spark.py``, so the suite's two
workers share the load.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPTS: dict[str, tuple[list[str], str]] = {
    "changelog_commits.py": (
        ["--seconds", "2"],
        r"^s3 \(MinIO\)\ton\t[1-9]\d*\t[\d.]+\t[\d.]+\t[\d.]+\t[\d.]+$",
    ),
    "decode_speed.py": (["--records", "200", "--repeats", "1"], r"ratio: \d+\.\d\d"),
    "ingest_ceiling.py": (
        ["--transactions", "300", "--partitions", "5"],
        r"\| [^|]+ \| \d+ \| [\d.]+ \| [\d,]+ \| [\d.]+ \|",
    ),
    "wide_reader.py": (
        ["--seconds", "3", "--warmup", "2", "--rate", "20", "--widths", "10", "--turns", "8"],
        r"\| 10 \|",
    ),
    "large_transaction_rss.py": (
        ["--mods", "2000", "--records", "10"],
        r"2000 rows landed in [\d.]+ s; peak RSS \d+ MiB",
    ),
    "mirror_merge_scaling.py": (
        ["--sizes", "2000", "--repeats", "1", "--file-rows", "1000"],
        r"^2000\tordered\t[\d.]+\t\d+\t",
    ),
    "reader_throughput.py": (
        ["--backlog", "60", "--live-seconds", "3", "--rate", "10"],
        r"ratio reader/bare: \d+\.\d\d",
    ),
    "live_audit.py": (
        ["--repeats", "1", "--seconds", "3", "--rate", "10"],
        r"^0\t30\t\d+\t\d+\t\d+\t",
    ),
    "snapshot_read_shapes.py": (
        ["--sizes", "300", "--ranges", "0", "100"],
        r"^300\tranges of 100\t\d+\t[\d,]+$",
    ),
    "ingest_throughput.py": (
        ["--backlog", "60", "--live-seconds", "3", "--rate", "10"],
        r"commit→Delta-visible p50 \d+ ms",
    ),
}


def run_script(name: str, args: list[str], timeout: float) -> str:
    result = subprocess.run(
        [sys.executable, str(BENCH / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=BENCH.parent,
    )
    assert result.returncode == 0, (
        f"{name} exited {result.returncode}:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    )
    return result.stdout


def assert_figures(name: str, output: str, pattern: str) -> None:
    assert re.search(pattern, output, re.MULTILINE), f"{name} printed no figure:\n{output[-3000:]}"


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_the_bench_script_runs_at_smoke_size(name: str) -> None:
    args, pattern = SCRIPTS[name]
    assert_figures(name, run_script(name, args, timeout=300), pattern)


def test_every_bench_script_has_a_smoke_run() -> None:
    from tests.test_bench_smoke_spark import SPARK_SCRIPTS
    from tests.test_soak_smoke import SCRIPT as SOAK

    scripts = {p.name for p in BENCH.glob("*.py")}
    smoked = set(SCRIPTS) | set(SPARK_SCRIPTS) | {SOAK}
    assert scripts == smoked, "a bench script without a smoke run"
