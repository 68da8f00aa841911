"""`make run` in a shortened mode: the whole product on one machine, started on a database that
already holds rows, ends with PASS."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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
    snapshot = int(re.search(r"snapshot at T0\s+(\d+) rows", result.stdout)[1])
    assert snapshot >= 100 + 1000 + 100, "the accounts, transfers and all_types rows held at T0"
    committed = int(re.search(r"transactions after T0\s+(\d+)", result.stdout)[1])
    landed = int(re.search(r"transactions landed\s+(\d+)", result.stdout)[1])
    # 15 s at 10/s; the seconds before the service's T0 are in the snapshot, not transactions
    assert committed == landed >= 50
    assert re.search(r"pipeline batches\s+[1-9]", result.stdout)
    assert "WARN" not in result.stdout and "log4j" not in output, "Spark logs belong in files"
    for log in ("ingest.log", "pipeline.log"):
        assert (folder / log).stat().st_size > 0
    assert (folder / "mirrors" / "accounts" / "_delta_log").is_dir()
