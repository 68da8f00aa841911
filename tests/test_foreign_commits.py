"""Users' commits to a mirror between the job's batches (``pipeline.foreign_commits``), as rules.

A simulated Delta table: each version has rows (an id), the job commits a batch only after its
check passed, users run maintenance that keeps the rows (OPTIMIZE, VACUUM, SET TBLPROPERTIES),
change rows (DELETE, a MERGE of their own) or RESTORE to any version. Whatever the history, and
whether the checking process is new or has checked before, the check refuses exactly when the
table's rows are not the ones the job's newest commit left, and its line names the commit that
changed them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.foreign_commits import (
    TABLE_CHANGED_BEHIND_JOB,
    ForeignCommitCheck,
    TableChangedBehindJob,
)
from pipeline.merges import JOB_COMMIT_KEY

KEEPS_ROWS = ("OPTIMIZE", "VACUUM START", "VACUUM END", "SET TBLPROPERTIES")
CHANGES_ROWS = ("DELETE", "MERGE", "UPDATE", "WRITE")
URI = "memory://mirror"


@dataclass
class SimulatedTable:
    """Commit infos as delta-rs returns them, and each version's rows."""

    commits: list[dict[str, Any]] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    reads: int = 0

    def commit(self, info: dict[str, Any], rows: int) -> None:
        self.commits.append({**info, "version": len(self.commits)})
        self.rows.append(rows)

    def version(self, uri: str) -> int:
        return len(self.commits) - 1

    def history(self, uri: str, limit: int | None) -> list[dict[str, Any]]:
        self.reads += 1
        newest_first = self.commits[::-1]
        return newest_first if limit is None else newest_first[:limit]


def job_commit(table: SimulatedTable, engine: str) -> None:
    mark = {JOB_COMMIT_KEY: '{"batch_id": 1}'}
    info = {"operation": "MERGE", **mark} if engine == "rs" else {"userMetadata": str(mark)}
    table.commit({"operation": "MERGE", **info}, rows=len(table.commits) + 1000)


steps = st.lists(
    st.one_of(
        st.tuples(st.just("job"), st.sampled_from(["rs", "spark"])),
        st.tuples(st.just("keep"), st.sampled_from(KEEPS_ROWS)),
        st.tuples(st.just("change"), st.sampled_from(CHANGES_ROWS)),
        st.tuples(st.just("restore"), st.integers(0, 40)),
        st.tuples(st.just("check"), st.booleans()),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(steps)
def test_the_check_refuses_exactly_when_the_rows_are_not_the_job_s(
    history: list[tuple[str, Any]],
) -> None:
    table = SimulatedTable()
    table.commit({"operation": "CREATE TABLE"}, rows=0)
    job_commit(table, "rs")
    expected = table.rows[-1]  # the rows the job's newest commit left
    check = ForeignCommitCheck(table)
    for action, argument in history:
        if action == "job":
            if _refused(check) is None:
                job_commit(table, argument)
                expected = table.rows[-1]
                check.wrote(URI, table.version(URI))
        elif action == "keep":
            table.commit({"operation": argument}, rows=table.rows[-1])
        elif action == "change":
            table.commit({"operation": argument}, rows=-len(table.commits))
        elif action == "restore":
            target = argument % len(table.commits)
            params = {"version": str(target)}
            table.commit(
                {"operation": "RESTORE", "operationParameters": params}, table.rows[target]
            )
        elif argument:  # a new process checks the table
            check = ForeignCommitCheck(table)
    refusal = _refused(check)
    if table.rows[-1] == expected:
        assert refusal is None
    else:
        assert refusal is not None and refusal.startswith(TABLE_CHANGED_BEHIND_JOB), refusal
        culprit = int(refusal.split(" at Delta version ")[1].split()[0])
        assert table.rows[culprit] != expected
        assert all(table.rows[v] != expected for v in range(culprit, len(table.rows)))


def _refused(check: ForeignCommitCheck) -> str | None:
    try:
        check.check("mirror accounts", URI)
    except TableChangedBehindJob as refusal:
        return str(refusal)
    return None


def test_a_steady_run_reads_no_commit_and_a_restore_to_the_job_s_version_goes_on() -> None:
    table = SimulatedTable()
    job_commit(table, "rs")
    check = ForeignCommitCheck(table)
    check.check("mirror accounts", URI)
    for _ in range(5):
        job_commit(table, "spark")
        check.wrote(URI, table.version(URI))
        check.check("mirror accounts", URI)
    assert table.reads == 1  # only the process's first look
    job_version = table.version(URI)
    table.commit({"operation": "RESTORE", "operationParameters": {"version": "1"}}, table.rows[1])
    with pytest.raises(TableChangedBehindJob, match=r"RESTORE to version 1 at Delta version 6"):
        check.check("mirror accounts", URI)
    params = {"version": str(job_version)}
    table.commit({"operation": "RESTORE", "operationParameters": params}, table.rows[job_version])
    check.check("mirror accounts", URI)
