"""The suite's own CPU accounting (``tests.cpu_use``): what each test's processes cost, by kind."""

from __future__ import annotations

import subprocess
import sys

from tests.cpu_use import CpuSampler, kind_of

JAVA = "/usr/lib/jvm/java-17-openjdk-amd64/bin/java -cp /x"


def test_a_process_is_told_by_its_command_line_and_a_jvm_by_its_parent() -> None:
    driver = f"{JAVA} org.apache.spark.deploy.SparkSubmit pyspark-shell"
    assert kind_of(driver, "pipeline (Python)") == "JVM of pipeline"
    assert kind_of(f"{JAVA} org.apache.spark.deploy.SparkSubmit", "the test worker") == (
        "JVM of the test worker"
    )
    executor = f"{JAVA} org.apache.spark.executor.CoarseGrainedExecutorBackend --app-id x"
    assert kind_of(executor, "Spark cluster") == "Spark executor"
    assert kind_of("/venv/bin/python -m runtime.python_daemon pyspark.worker", "JVM of x") == (
        "Spark's Python workers"
    )
    assert (
        kind_of("/venv/bin/python -m ingest spark-run", "the test worker") == "spark-run (Python)"
    )
    assert kind_of("/venv/bin/python -m ingest run", "the test worker") == "ingest"
    emulator = "/usr/lib/google-cloud-sdk/bin/cloud_spanner_emulator/emulator_main --host_port x"
    assert kind_of(emulator, "the test worker") == "emulator"


def test_the_cpu_of_a_child_that_has_ended_is_counted_by_its_kind() -> None:
    sampler = CpuSampler(interval_s=0.1).start()
    try:
        since = sampler.mark()
        loop = "import time\nend = time.process_time() + 1.0\nwhile time.process_time() < end: pass"
        subprocess.run([sys.executable, "-c", loop], check=True)
        spent = sampler.spent(since)
    finally:
        sampler.stop()
    assert spent.get("other Python", 0) >= 0.8, spent
