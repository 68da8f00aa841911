"""The bench scripts that start Spark, at a smoke size (see ``tests/test_bench_smoke.py``)."""

from __future__ import annotations

import pytest

from tests.test_bench_smoke import assert_figures, run_script

SPARK_SCRIPTS: dict[str, tuple[list[str], str]] = {
    "beyond_mirrors.py": (
        ["--rows", "2000", "--keys", "200", "--batches", "2", "--rounds", "1"],
        r"^processor\t[\d,]+\t[\d.]+\t\d+\.\d\d\t\d+\.\d\d$",
    ),
    "pipeline_throughput.py": (
        # the memory baseline's own state class runs here; operator and read-first are one-line
        # variants of the job's processor, left to full runs for the suite's time
        ["--sizes", "600:60", "--batches", "2", "--variants", "row,stateless,memory"],
        r"^600\t60\tstateless\t[\d,]+\t",
    ),
    "mirror_size_end_to_end.py": (
        ["--sizes", "2000", "--batches", "2", "--kinds", "ordered", "--file-rows", "1000"],
        r"^2000\tordered\t[\d.]+\t",
    ),
    "snapshot_throughput.py": (
        ["--sizes", "300", "--workers", "1"],
        r"ratio service/bare: \d+\.\d\d",
    ),
    "commit_to_mirror.py": (
        # the stream begins once Spark's first batch has ended (77 s with one core kept busy
        # beside the suite, make test-under-load); the warm-up covers the first batches with rows
        ["--rates", "20", "--seconds", "10", "--warmup", "15", "--partitions", "6"],
        r"^20\t\d+\t(\d+)\t\1\t\d+\t[\d.]+\t[\d.]+/[\d.]+\t",
    ),
    "microbatch_cpu.py": (
        ["--warmup", "2", "--versions", "3", "--checkpoint-every", "10", "--checksums", "on"],
        r"^10\ton\t[1-9]\d*\t[\d.]+\t[\d.]+\t[\d.]+\t[\d.]+\t[\d.]+\t\d+%$",
    ),
    "microbatch_profile.py": (
        ["--versions", "3", "--keys", "100", "--rows-per-version", "50", "--event-log"],
        r"^first batch done, from process start\t[\d.]+ s$(.|\n)*^  MERGE\t[\d.]+\t"
        r"(.|\n)*^  time to commit changes\t\d+$",
    ),
    "spark_snapshot.py": (
        # one run of spark-run (2 tasks), not one a task count: each is the same code path and a
        # Spark start; "of linear" (against 1 task) prints "-"
        ["--rows", "25000", "--tasks", "2", "--parts", "4", "--task-mb", "1"],
        r"^2\t[1-9]\d*\t[1-9]\d*\t[\d.]+\t([\d.]+|-)\t[\d.]+\t[\d.]+\t[\d.]+\t[1-9]\d*$",
    ),
    "spark_run_starts.py": (["--starts", "1", "--load", "0", "--signal", "INT"], r"^1\t1\t0$"),
    "pipeline_start.py": (
        ["--versions", "2", "--keys", "100", "--runs", "1"],
        r"^0\t\S+\ton\t[\d.]+\t(cgroup|waited-for only)\t[\d.]+\t[\d.]+$",
    ),
    "restart_first_batch.py": (
        ["--keys", "200", "--restarts", "1"],
        r"^after kill 1\t[\d.]+\t[\d.]+$",
    ),
    "spark_source.py": (
        ["--widths", "50", "--cores", "1", "--seconds", "5", "--warmup", "5", "--rate", "20"],
        r"^50\tspark local\[1\]\t[1-9]\d*\t[\d.]+\t[\d.]+\t[\d.]+\t[\d.]+$",
    ),
    "mirror_latency.py": (
        ["--seconds", "10", "--existing-rows", "20", "--cases", "5:driver:s3"],
        # on s3 the script also fails unless the mirrors equal Spanner at W
        r"^5\tdriver\ts3\t[1-9]\d*\t\d+\t([\d.]+|-)/([\d.]+|-)\t([\d.]+|-)\t([\d.]+|-)\t",
    ),
}


@pytest.mark.parametrize("name", sorted(SPARK_SCRIPTS))
def test_the_spark_bench_script_runs_at_smoke_size(name: str) -> None:
    args, pattern = SPARK_SCRIPTS[name]
    assert_figures(name, run_script(name, args, timeout=600), pattern)
