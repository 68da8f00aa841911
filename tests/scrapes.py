"""The processes' ``/metrics`` as tests read them: scraped over HTTP, parsed with
prometheus_client's parser, and checked against the change log read just after the scrape."""

from __future__ import annotations

import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from deltalake import DeltaTable
from prometheus_client.parser import text_string_to_metric_families

from emulator.verify import changelog_watermark
from ingest.model.timestamps import parse_rfc3339
from tests.delta_checks import read_versions

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.status == 200
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def scrape_until(
    port: int,
    done: Callable[[Samples], bool],
    timeout: float,
    process: subprocess.Popen[bytes] | None = None,
) -> Samples:
    """Scrape until ``done`` holds (Spark reports a micro-batch's progress to its listeners
    after the batch, on its own thread), waiting for the process to serve at all; failing at
    once when ``process``, the one serving, has ended."""
    deadline = time.monotonic() + timeout
    samples: Samples = {}
    while True:
        code = process.poll() if process is not None else None
        assert code is None, f"the process serving port {port} ended ({code}) before it served"
        try:
            samples = scrape(port)
        except OSError:
            samples = {}
        if samples and done(samples):
            return samples
        assert time.monotonic() < deadline, f"metrics never reached the condition: {samples}"
        time.sleep(0.2)


def check_ingest(samples: Samples, table: Path) -> None:
    """The landed low watermark is a committed W, and no more transactions are counted than the
    change log holds."""
    versions = [v for v in read_versions(table) if v.checkpoint]
    watermarks = {
        v.checkpoint.resume_point.low_watermark / 1_000_000_000 for v in versions if v.checkpoint
    }
    assert value(samples, "ingest_low_watermark_seconds") in watermarks
    transactions = {
        (r["commit_timestamp"], r["server_transaction_id"]) for v in versions for r in v.rows
    }
    landed = value(samples, "ingest_transactions_landed_total")
    assert landed is not None and 0 < landed <= len(transactions)
    assert (value(samples, "ingest_delta_commits_total") or 0) >= 1
    assert value(samples, "ingest_commit_latency_seconds_count") == landed
    assert (value(samples, "ingest_watermark_lag_seconds") or -1) >= 0


def check_pipeline(samples: Samples, changelog: Path) -> None:
    """The newest commit applied is a commit the change log holds, at or before its W, and every
    micro-batch counted has its duration observed."""
    newest = value(samples, "pipeline_newest_commit_applied_seconds")
    assert newest is not None
    texts = DeltaTable(str(changelog)).to_pyarrow_table(columns=["commit_timestamp_text"])
    commits = {parse_rfc3339(t) for t in texts.column("commit_timestamp_text").to_pylist()}
    # the exposition's float holds Unix seconds to about a microsecond
    assert any(abs(newest * 1e9 - c) < 10_000 for c in commits), newest
    watermark = changelog_watermark(str(changelog))
    assert watermark is not None and newest * 1e9 <= watermark.low_watermark + 10_000
    batches = value(samples, "pipeline_batches_total") or 0
    observed = value(samples, "pipeline_batch_duration_seconds_count") or 0
    # a scrape may fall between a batch's observed duration and its count
    assert 1 <= batches <= observed <= batches + 1, (batches, observed)
    merged = [v for (name, _), v in samples.items() if name == "pipeline_rows_merged_total"]
    assert sum(merged) > 0
    assert value(samples, "pipeline_query_running") == 1
    assert (value(samples, "pipeline_state_deployment") or 0) >= 1
    assert (value(samples, "pipeline_freshness_lag_seconds") or -1) >= 0
