"""Bad input to `python -m ingest tail`: one clear `error:` line on stderr and a non-zero exit."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from ingest.model.timestamps import NANOS_PER_SECOND, to_rfc3339


def tail(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ingest", "tail", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def assert_one_error_line(result: subprocess.CompletedProcess[str], code: int, text: str) -> None:
    assert result.returncode == code, result.stderr
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    assert lines[-1] == errors[0], "the error must be the last line"
    assert text in errors[0], errors[0]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (["--heartbeat-ms", "500"], "heartbeat must be between 1000 and 300000 ms, got 500"),
        (["--heartbeat-ms", "300001"], "heartbeat must be between 1000 and 300000 ms"),
        (["--query-window-s", "0.5"], "query window must be between 2 s (at least 1 s and two"),
        (["--start-timestamp", "yesterday"], "not an RFC 3339 timestamp"),
        (["--stream", "x; DROP TABLE accounts"], "is not a valid identifier"),
        (["--max-concurrent-partitions", "0"], "--max-concurrent-partitions must be at least 1"),
        (
            [
                "--start-timestamp",
                "2024-01-02T00:00:00Z",
                "--end-timestamp",
                "2024-01-01T00:00:00Z",
            ],
            "is before the start timestamp",
        ),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_values_refused_before_connecting(args: list[str], text: str) -> None:
    assert_one_error_line(tail(*args), 2, text)


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (
            ["--changelog", "/nonexistent/changelog", "--start-timestamp", "2026-11-24T00:00:00Z"],
            "no change log at /nonexistent/changelog",
        ),
        (["--changelog", "/nonexistent/changelog"], "arguments are required: --start-timestamp"),
    ],
)
def test_an_audit_without_a_change_log_or_a_start_is_refused(args: list[str], text: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ingest", "audit", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert_one_error_line(result, 2, text)


@pytest.mark.emulator
class TestAgainstTheEmulator:
    @pytest.fixture(autouse=True)
    def database(self, new_database) -> None:
        self.database_id = new_database("googlesql").database_id

    def test_unknown_change_stream(self) -> None:
        result = tail("--database", self.database_id, "--stream", "no_such_stream")
        assert_one_error_line(
            result, 2, "change stream 'no_such_stream' does not exist in database"
        )
        assert "all_changes" in result.stderr

    def test_start_in_the_future(self) -> None:
        future = to_rfc3339(time.time_ns() + 3600 * NANOS_PER_SECOND)
        result = tail(
            "--database", self.database_id, "--stream", "all_changes", "--start-timestamp", future
        )
        assert_one_error_line(result, 2, "is in the future")

    def test_start_outside_the_retention_period(self) -> None:
        old = to_rfc3339(time.time_ns() - 2 * 86400 * NANOS_PER_SECOND)
        result = tail(
            "--database", self.database_id, "--stream", "all_changes", "--start-timestamp", old
        )
        assert_one_error_line(result, 2, "is outside the retention period of change stream")

    def test_unknown_database(self) -> None:
        result = tail("--database", "missing_db", "--stream", "all_changes")
        assert_one_error_line(result, 2, "spanner refused the request")


def test_the_spark_source_refuses_a_heartbeat_spanner_would_refuse() -> None:
    """Seed 003: 1,000 to 300,000 ms. A job resumed with a lower value would fail at every
    start on Cloud Spanner (the emulator accepts it)."""
    from ingest.changestream.query import ChangeStreamRequestError
    from ingest.sparksource.source import SourceOptions

    with pytest.raises(ChangeStreamRequestError, match="between 1000 and 300000 ms, got 500"):
        SourceOptions("p", "i", "d", "s", "googlesql", False, "/t", "j", heartbeat_ms=500)
