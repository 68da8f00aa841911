"""``bench/soak.py`` at a smoke size: a minute, a column every 14 s with one state evolution
allowed (so the pipeline rebases), one kill -9 of each process (at 20 and 40 s), one table
re-snapshot; the script exits 0 only if the audit finds the change log equal to the stream and
every mirror equals Spanner."""

from __future__ import annotations

import pytest

from tests.test_bench_smoke import assert_figures, run_script

SCRIPT = "soak.py"
ARGS = [
    *("--minutes", "1", "--rate", "5", "--schema-every", "14", "--kill-every", "40"),
    *("--calm-minutes", "0.25", "--max-evolutions", "1", "--existing-rows", "100"),
    *("--sample-s", "1"),
]
FIGURES = (
    r"^1\t\d+\t4\t1\t1\t\d+\t[1-9]\d*\t1 \(\d+\)$"
    r"(.|\n)*^ingest\t2\t\d+\t"
    r"(.|\n)*^pipeline\t2\t\d+\t"
    r"(.|\n)*^audit \(exit 0\): .* 0 missing, 0 extra, 0 differing$"
    r"(.|\n)*^mirrors equal to Spanner at W: yes$"
)


@pytest.mark.emulator
def test_the_soak_runs_at_smoke_size() -> None:
    assert_figures(SCRIPT, run_script(SCRIPT, ARGS, timeout=900), FIGURES)
