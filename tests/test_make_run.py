"""`make run` in a shortened mode: the whole product on one machine, started on a database that
already holds rows, ends with PASS."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from emulator.processes import log_events
from emulator.run_report import freshness, mirror_latencies, pipeline_latencies
from ingest.model.timestamps import parse_rfc3339

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.emulator
def test_make_run_ends_with_pass(spanner_emulator: str, tmp_path: Path) -> None:
    """Uses the session's emulator; the run's own emulator start is the same code as the tests'."""
    folder = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "emulator.local_run",
            "--seconds",
            "15",
            "--rate",
            "10",
            "--folder",
            str(folder),
            "--existing-rows",
            "1000",
        ],
        cwd=ROOT,
        env={**os.environ, "SPANNER_EMULATOR_HOST": spanner_emulator},
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert re.search(r"mirrors equal Spanner\s+PASS", result.stdout), output[-4000:]
    snapshot = int(_found(r"snapshot at T0\s+(\d+) rows", result.stdout))
    assert snapshot >= 100 + 1000 + 100, "the accounts, transfers and all_types rows held at T0"
    committed = int(_found(r"transactions after T0\s+(\d+)", result.stdout))
    landed = int(_found(r"transactions landed\s+(\d+)", result.stdout))
    summary = json.loads((folder / "summary.json").read_text())
    # A transaction the change log lacks fails the test when the stream holds it (a re-read
    # returns it: the service lost it, or the emulator's live query skipped it, emulator/NOTES.md);
    # one a re-read does not return either is not in the emulator's stream: not the product's.
    assert summary.get("missing_returned_by_reread", []) == [], output[-4000:]
    # 15 s at 10/s; the seconds before the service's T0 are in the snapshot, not transactions
    assert committed == landed + len(summary["missing"]) and landed >= 50, summary["missing"]
    assert re.search(r"pipeline batches\s+[1-9]", result.stdout)
    # a 15 s workload ends before Spark's first batch: only the every-commit figures exist
    assert re.search(
        r"commit → mirror p50/p99 .*\n\s+p50/p99\s+\d+\.\d+ s / \d+\.\d+ s", result.stdout
    )
    assert summary["passed"] is True and summary["first_batch_s"] > 0
    assert 0 < summary["mirror_every_p50_s"] <= summary["mirror_every_p99_s"]
    # the pipeline's share is measured over the same commits, after the first batch: none here
    share, whole = summary["changelog_to_mirror_p50_s"], summary["mirror_p50_s"]
    assert (share is None) == (whole is None)
    assert share is None or 0 < share <= whole
    assert "WARN" not in result.stdout and "log4j" not in output, "Spark logs belong in files"
    # the job's first commit names every captured table, so the query starts with all three and
    # the snapshot's tables landing one after another restart nothing (no column changes here)
    events = log_events(folder / "pipeline.log")
    started = [e["tables"] for e in events if e["event"] == "pipeline_query_started"]
    assert started[0] == ["accounts", "all_types", "transfers"], started
    restarts = [e for e in events if e["event"] == "pipeline_query_restarting"]
    assert not [e for e in restarts if e["reason"] == "SOURCE_SCHEMA_CHANGED"], restarts
    for log in ("ingest.log", "pipeline.log"):
        assert (folder / log).stat().st_size > 0
    assert (folder / "mirrors" / "accounts" / "_delta_log").is_dir()


def test_a_commit_is_visible_when_the_first_batch_at_or_past_it_ends() -> None:
    def at(second: float) -> str:
        return f"2026-01-01T00:00:{second:09.6f}Z"

    batches = [  # logged out of order; the later-ending batch reached further
        {"newest_commit": at(10), "timestamp": at(11.5)},
        {"newest_commit": at(5), "timestamp": at(7)},
        {"event": "pipeline_batch with nothing applied", "timestamp": at(8)},
    ]
    commits = [parse_rfc3339(at(s)) for s in (4, 5, 6, 11)]
    assert mirror_latencies(commits, batches) == [3.0, 2.0, 5.5]
    landings = [  # the change-log commit at 6.5 s landed every transaction up to 6 s
        {"low_watermark": at(6), "timestamp": at(6.5)},
        {"low_watermark": at(11), "timestamp": at(11.25)},
    ]
    assert pipeline_latencies(commits, batches, landings) == [0.5, 0.5, 5.0]
    assert freshness(batches, parse_rfc3339(at(12.25))) == ", mirrors fresh to 2.2 s ago"
    assert freshness([], parse_rfc3339(at(12.25))) == ""


def _found(pattern: str, text: str) -> str:
    match = re.search(pattern, text)
    assert match is not None, f"no {pattern!r} in the summary"
    return match[1]


def test_make_run_spark_lands_the_change_log_with_the_spark_source_on_the_cluster(
    tmp_path: Path,
) -> None:
    """``make run-spark``'s wiring: the same run, the change log landed by ``spark-run`` on the
    cluster's master (its end-to-end path is tests/test_spark_source.py's cluster test)."""
    from emulator.local_run import parse_args, product_processes

    options = parse_args(["--folder", str(tmp_path), "--spark-cluster", "2"])
    assert options.spark_workers == 2
    ingest, _ = product_processes(options, "bank_x", "spark://127.0.0.1:7077")
    assert ingest.argv == ["-m", "ingest", "spark-run"]
    assert ingest.env["INGEST_SPARK_MASTER"] == "spark://127.0.0.1:7077"
    assert ingest.env["INGEST_SPARK_CHECKPOINT_URI"] == str(tmp_path / "spark-source-checkpoint")
    service, _ = product_processes(parse_args(["--folder", str(tmp_path)]), "bank_x")
    assert service.argv == ["-m", "ingest", "run"]
