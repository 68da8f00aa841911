"""What `make run` reports: commit → mirror latencies from the processes' events, progress
lines, the mirrors checked against Spanner at the change log's last watermark, and the summary
(also ``summary.json``)."""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from emulator.processes import Process
from emulator.verify import (
    changelog_watermark,
    compare_mirrors,
    landed_transactions,
    latest_checkpoint,
)
from emulator.workload import CommittedTransaction
from ingest.model.timestamps import parse_rfc3339, to_rfc3339
from pipeline.catalog import discover_shapes


def say(text: str, out: Any = sys.stdout) -> None:
    print(text, file=out, flush=True)


EMULATOR_TIMESTAMP_DIGITS = 0
"""The emulator's change stream drops the fraction of TIMESTAMP values (emulator/NOTES.md)."""


@dataclass(frozen=True, slots=True)
class MirrorCheck:
    lines: list[str]
    passed: bool | None
    """None when the check did not run."""
    changelog_version: int | None = None


@dataclass(frozen=True, slots=True)
class Summary:
    snapshot_rows: int | None
    committed: int
    """Transactions committed after T0 (those before are in the snapshot)."""
    landed: int
    missing: tuple[str, ...]
    """Commit timestamps of transactions committed after T0 that the change log lacks."""
    changelog_p50_s: float | None
    """Commit → change log: from a transaction's commit to the change-log commit that landed
    it, for the commits that commit → mirror counts."""
    changelog_p99_s: float | None
    lag_p50_s: float | None
    lag_p99_s: float | None
    pipeline_batches: int
    rows_merged: int
    mirror_p50_s: float | None
    """Commit → mirror visible: from a transaction's commit to the end of the micro-batch that
    made it readable in its mirror, for commits after the pipeline's first batch."""
    mirror_p99_s: float | None
    mirror_every_p50_s: float | None
    """The same over every commit after T0, those that waited for Spark's start included."""
    mirror_every_p99_s: float | None
    changelog_to_mirror_p50_s: float | None
    """The pipeline's share: from the change-log commit that landed a transaction to the end of
    the micro-batch that made it visible, for commits after the pipeline's first batch."""
    changelog_to_mirror_p99_s: float | None
    first_batch_s: float | None
    """From starting `pipeline run` to the end of its first micro-batch."""
    check: MirrorCheck


def percentile(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


def visible_at(commit_timestamps: list[int], marks: list[tuple[int, int]]) -> list[int | None]:
    """When each commit became visible: the earliest time of a mark (reached through, at) whose
    reach is at or past it; None if none is. Marks may come in any order."""
    ends = sorted(marks)
    reached = [r for r, _ in ends]
    earliest = list(itertools.accumulate((at for _, at in reversed(ends)), min))[::-1]
    return [
        earliest[index] if (index := bisect.bisect_left(reached, commit)) < len(ends) else None
        for commit in commit_timestamps
    ]


def batch_marks(batches: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """Micro-batches as (newest commit applied, end): the change log lands in commit order, so
    a batch has applied every commit up to its newest."""
    return [
        (parse_rfc3339(b["newest_commit"]), parse_rfc3339(b["timestamp"]))
        for b in batches
        if b.get("newest_commit")
    ]


def landing_marks(commits: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """Change-log commits as (low watermark, time): a transaction lands once W passes it."""
    return [(parse_rfc3339(c["low_watermark"]), parse_rfc3339(c["timestamp"])) for c in commits]


def mirror_latencies(commit_timestamps: list[int], batches: list[dict[str, Any]]) -> list[float]:
    """Seconds from each commit to the end of the first micro-batch whose newest applied commit
    is at or past it."""
    visible = visible_at(commit_timestamps, batch_marks(batches))
    return [(v - c) / 1e9 for c, v in zip(commit_timestamps, visible, strict=True) if v is not None]


def changelog_latencies(commit_timestamps: list[int], commits: list[dict[str, Any]]) -> list[float]:
    """Seconds from each commit to the change-log commit whose W first reached it."""
    landed = visible_at(commit_timestamps, landing_marks(commits))
    pairs = zip(commit_timestamps, landed, strict=True)
    return [(at - commit) / 1e9 for commit, at in pairs if at is not None]


def pipeline_latencies(
    commit_timestamps: list[int], batches: list[dict[str, Any]], commits: list[dict[str, Any]]
) -> list[float]:
    """The pipeline's share of commit → mirror: seconds from the change-log commit that landed a
    transaction to the end of the micro-batch that made it visible."""
    landed = visible_at(commit_timestamps, landing_marks(commits))
    mirrored = visible_at(commit_timestamps, batch_marks(batches))
    return [
        (mirror - land) / 1e9
        for land, mirror in zip(landed, mirrored, strict=True)
        if land is not None and mirror is not None
    ]


def freshness(batches: list[dict[str, Any]], now_ns: int) -> str:
    """How far the mirrors trail now: the newest commit applied, as seconds ago."""
    applied = [b["newest_commit"] for b in batches if b.get("newest_commit")]
    if not applied:
        return ""
    return f", mirrors fresh to {(now_ns - parse_rfc3339(max(applied))) / 1e9:.1f} s ago"


def progress_line(elapsed: float, committed: int, ingest: Process, pipeline: Process) -> str:
    events = ingest.events()
    commits = [e for e in events if e["event"] == "delta_commit"]
    snapshot = [e for e in events if e["event"] == "snapshot_progress"]
    batches = [e for e in pipeline.events() if e["event"] == "pipeline_batch"]
    landed = sum(e["transactions"] for e in commits)
    lag = f", lag {commits[-1]['watermark_lag_seconds']:.1f} s" if commits else ""
    version = f"v{commits[-1]['delta_version']}" if commits else "no commit yet"
    if snapshot and not snapshot[-1]["complete"]:
        last = snapshot[-1]
        version = (
            f"snapshot {last['rows']} rows, {last['tables_done']}/{last['tables']} tables, "
            f"{last['rows_per_second']} rows/s"
        )
    elif snapshot:
        version += f", snapshot {snapshot[-1]['rows']} rows"
    if batches:
        pipeline_text = f"{len(batches)} batches, last {batches[-1]['seconds']:.1f} s"
        pipeline_text += freshness(batches, time.time_ns())
    elif any(e["event"] == "pipeline_query_started" for e in pipeline.events()):
        pipeline_text = "first micro-batch running"
    else:
        pipeline_text = "starting Spark"
    return (
        f"{elapsed:5.0f} s  committed {committed:>6} ({committed / max(elapsed, 1):4.1f}/s)  "
        f"landed {landed:>6} ({version}{lag})  "
        f"pipeline: {pipeline_text}"
    )


def check_mirrors(database: Any, root: Path | str) -> MirrorCheck:
    """Every mirror under ``root`` (a folder or a store URI) against Spanner at the change
    log's W."""
    root = str(root).rstrip("/")
    watermark = changelog_watermark(f"{root}/changelog")
    if watermark is None:
        return MirrorCheck(["the change log has no landing commit"], False)
    shapes = discover_shapes(f"{root}/changelog")
    comparisons = compare_mirrors(
        database,
        f"{root}/mirrors",
        shapes,
        watermark.low_watermark,
        timestamp_digits=EMULATOR_TIMESTAMP_DIGITS,
    )
    lines = [f"read at {to_rfc3339(watermark.low_watermark)} (change-log v{watermark.version})"]
    lines += [c.describe() for c in comparisons]
    passed = bool(comparisons) and all(c.equal for c in comparisons)
    return MirrorCheck(lines, passed, watermark.version)


def summarize(
    committed: list[CommittedTransaction],
    ingest: Process,
    pipeline: Process,
    check: MirrorCheck,
    pipeline_started_ns: int,
    root: str | None = None,
) -> Summary:
    """``root``: where the tables are (default: the ingest log's folder)."""
    root = (root or str(ingest.log.parent)).rstrip("/")
    commits = [e for e in ingest.events() if e["event"] == "delta_commit"]
    lags = [e["watermark_lag_seconds"] for e in commits]
    batches = [e for e in pipeline.events() if e["event"] == "pipeline_batch"]
    checkpoint = latest_checkpoint(f"{root}/changelog")
    snapshot = checkpoint.snapshot if checkpoint else None
    after = snapshot.read_timestamp if snapshot else 0
    first = next((b for b in batches if b.get("newest_commit")), None)
    first_batch_ns = parse_rfc3339(first["timestamp"]) if first else None
    # from the first batch on: before it, commits wait for Spark to start
    measured_after = after if first_batch_ns is None else max(after, first_batch_ns)
    measured = [t.commit_timestamp for t in committed if t.commit_timestamp > measured_after]
    latencies = mirror_latencies(measured, batches)
    pipeline_share = pipeline_latencies(measured, batches, commits)
    landing = changelog_latencies(measured, commits)
    every = mirror_latencies(
        [t.commit_timestamp for t in committed if t.commit_timestamp > after], batches
    )
    return Summary(
        snapshot_rows=snapshot.rows if snapshot else None,
        committed=sum(t.commit_timestamp > after for t in committed),
        landed=landed_transactions(f"{root}/changelog"),
        missing=missing_commits(committed, after, f"{root}/changelog"),
        changelog_p50_s=percentile(landing, 0.5),
        changelog_p99_s=percentile(landing, 0.99),
        lag_p50_s=percentile(lags, 0.5),
        lag_p99_s=percentile(lags, 0.99),
        pipeline_batches=len(batches),
        rows_merged=sum(sum(e["rows"].values()) for e in batches),
        mirror_p50_s=percentile(latencies, 0.5),
        mirror_p99_s=percentile(latencies, 0.99),
        mirror_every_p50_s=percentile(every, 0.5),
        mirror_every_p99_s=percentile(every, 0.99),
        changelog_to_mirror_p50_s=percentile(pipeline_share, 0.5),
        changelog_to_mirror_p99_s=percentile(pipeline_share, 0.99),
        first_batch_s=None
        if first_batch_ns is None
        else (first_batch_ns - pipeline_started_ns) / 1e9,
        check=check,
    )


def missing_commits(
    committed: list[CommittedTransaction], after: int, changelog: str
) -> tuple[str, ...]:
    """The commits after ``after`` the change log does not hold, as RFC 3339 texts: its
    transactions' commit timestamps only (a schema or snapshot row at the same time, which has
    no transaction id, does not stand for one)."""
    from deltalake import DeltaTable

    from pipeline.catalog import scan

    rows = scan(DeltaTable(changelog), ["server_transaction_id", "commit_timestamp_text"])
    ids, texts = rows.column(0).to_pylist(), rows.column(1).to_pylist()
    held = {text for transaction, text in zip(ids, texts, strict=True) if transaction}
    wanted = sorted(to_rfc3339(t.commit_timestamp) for t in committed if t.commit_timestamp > after)
    return tuple(text for text in wanted if text not in held)


def print_summary(summary: Summary, folder: Path) -> None:
    """To the terminal, and as ``summary.json`` in the run folder for tools (bench/)."""
    record = {k: v for k, v in dataclasses.asdict(summary).items() if k != "check"}
    record["passed"] = summary.check.passed
    (folder / "summary.json").write_text(json.dumps(record, indent=2))

    def seconds(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.2f} s"

    verdict = {True: "PASS", False: "FAIL", None: "NOT RUN"}[summary.check.passed]
    say("")
    say("summary")
    snapshot = "n/a" if summary.snapshot_rows is None else f"{summary.snapshot_rows} rows"
    say(f"  snapshot at T0           {snapshot}")
    say(f"  transactions after T0    {summary.committed}")
    say(f"  transactions landed      {summary.landed}")
    for text in summary.missing:
        say(f"  missing from the change log: a transaction committed at {text}")
    say(f"  change-log version       {summary.check.changelog_version}")
    say(f"  watermark lag p50 / p99  {seconds(summary.lag_p50_s)} / {seconds(summary.lag_p99_s)}")
    say(
        f"  commit → change log      {seconds(summary.changelog_p50_s)} / "
        f"{seconds(summary.changelog_p99_s)} (p50/p99)"
    )
    say(
        f"  pipeline batches         {summary.pipeline_batches} ({summary.rows_merged} rows merged)"
    )
    say(
        f"  commit → mirror p50/p99  {seconds(summary.mirror_p50_s)} / "
        f"{seconds(summary.mirror_p99_s)} (commits after the pipeline's first batch)"
    )
    say(
        f"                 p50/p99  {seconds(summary.mirror_every_p50_s)} / "
        f"{seconds(summary.mirror_every_p99_s)} (every commit after T0)"
    )
    say(
        f"  change log → mirror      {seconds(summary.changelog_to_mirror_p50_s)} / "
        f"{seconds(summary.changelog_to_mirror_p99_s)} (the pipeline's share, p50/p99)"
    )
    say(f"  pipeline first batch     {seconds(summary.first_batch_s)} after its start")
    say(f"  mirrors equal Spanner    {verdict}")
    for line in summary.check.lines:
        say(f"    {line}")
    python = Path(sys.executable)
    say("")
    say(f"tables and logs in {folder}")
    say("open a table:")
    say(
        f'  {python} -c "from deltalake import DeltaTable; '
        f"print(DeltaTable('{folder}/mirrors/accounts').to_pyarrow_dataset()"
        f'.to_table(use_threads=False).to_pandas())"'
    )
    say(f"  (the change log is {folder}/changelog; Spark: spark.read.format('delta').load(...))")
