"""Commits to a mirror or a history by anyone but the job, checked before the job writes there.

Users maintain these tables while the job runs. Maintenance keeps every row (``OPTIMIZE`` with or
without Z-order, ``VACUUM``, ``SET TBLPROPERTIES``, a protocol upgrade): the job goes on, its
conflicts retried (``pipeline.merges``). A commit that changes rows behind the job (``RESTORE``
to a version older than the job's newest commit, a ``DELETE``, ``UPDATE``, ``MERGE`` or write of
its own) leaves the table different from Spanner, and the job's later MERGEs would not notice: the
table's ``txn`` still says it holds every batch. So the job stops with one line naming the commit
and the way back: ``RESTORE`` to the job's newest commit (content the job wrote) lets it go on.

Every commit the job makes carries ``JOB_COMMIT_KEY`` in its commit info (``pipeline.merges``):
the newest such commit is where the check starts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pipeline.merges import JOB_COMMIT_KEY
from runtime.errors import BadInput

Commit = Mapping[str, Any]
"""One commit's ``commitInfo`` as delta-rs's ``history()`` returns it (with its ``version``)."""

ROW_CHANGES = frozenset(
    {
        "WRITE",
        "CREATE OR REPLACE TABLE",
        "REPLACE TABLE",
        "CREATE OR REPLACE TABLE AS SELECT",
        "REPLACE TABLE AS SELECT",
        "STREAMING UPDATE",
        "MERGE",
        "DELETE",
        "UPDATE",
        "TRUNCATE",
        "RESTORE",
    }
)
"""Operations that change a table's rows (delta-spark's and delta-rs's names). Everything else
(``OPTIMIZE``, ``VACUUM START``/``END``, ``SET TBLPROPERTIES``, ``UPGRADE PROTOCOL``, …) keeps
them."""
TABLE_CHANGED_BEHIND_JOB = "TABLE_CHANGED_BEHIND_JOB"
"""How the refusal's line starts, found again in Spark's report of the failed batch."""
FIRST_LOOK = 20
"""Commits read back at a process's first check of a table before reading its whole history."""


class TableChangedBehindJob(BadInput, RuntimeError):
    """Another writer changed the rows of a table the job keeps; the message names the commit."""


def is_jobs(commit: Commit) -> bool:
    """Whether the job wrote the commit: delta-rs keeps custom metadata as commit-info keys,
    delta-spark as the JSON text of ``userMetadata``."""
    return JOB_COMMIT_KEY in commit or JOB_COMMIT_KEY in str(commit.get("userMetadata") or "")


def since_job(newest_first: Iterable[Commit]) -> tuple[int | None, list[Commit]]:
    """The version of the job's newest commit (None: none found) and the commits after it,
    oldest first."""
    after: list[Commit] = []
    for commit in newest_first:
        if is_jobs(commit):
            return int(commit["version"]), after[::-1]
        after.append(commit)
    return None, after[::-1]


def first_row_change(job_version: int, commits: Iterable[Commit]) -> Commit | None:
    """The commit that left the table's rows other than the job's newest commit left them (None:
    they are the same). A version's rows are the job's when the version before it had them and
    it kept them (maintenance), or it is a ``RESTORE`` to a version that had them."""
    kept = {job_version}
    same, culprit = True, None
    for commit in commits:
        operation = str(commit.get("operation") or "")
        if operation == "RESTORE":
            now_same = _restored_version(commit) in kept
        elif operation in ROW_CHANGES and not is_jobs(commit):
            now_same = False
        else:
            now_same = same
        if now_same:
            kept.add(int(commit["version"]))
        elif same:
            culprit = commit
        same = now_same
    return None if same else culprit


def _restored_version(commit: Commit) -> int | None:
    parameters = commit.get("operationParameters") or {}
    version = parameters.get("version")
    return None if version in (None, "", "null") else int(version)


class TableCommits(Protocol):
    def version(self, uri: str) -> int: ...

    def history(self, uri: str, limit: int | None) -> Sequence[Commit]:
        """A table's commits, newest first, at most ``limit`` of them (None: all)."""
        ...


@dataclass
class ForeignCommitCheck:
    """Checks each table the job writes, reading only commits it has not seen: in a steady run
    the table's version is the one the job's last commit left, and no commit is read."""

    commits: TableCommits
    seen: dict[str, int] = field(default_factory=dict)

    def check(self, name: str, uri: str) -> None:
        """Raise ``TableChangedBehindJob`` when another writer changed ``uri``'s rows since the
        job's newest commit to it."""
        version = self.commits.version(uri)
        known = self.seen.get(uri)
        if known == version:
            return
        limit = FIRST_LOOK if known is None else version - known
        job_version, after = since_job(self.commits.history(uri, limit))
        if job_version is None and known is None:
            job_version, after = since_job(self.commits.history(uri, None))
        if job_version is None:
            job_version = known
        culprit = None if job_version is None else first_row_change(job_version, after)
        if culprit is not None:
            raise TableChangedBehindJob(_refusal(name, uri, job_version, culprit))
        self.seen[uri] = version

    def wrote(self, uri: str, version: int) -> None:
        """The job's own commit left ``uri`` at ``version``."""
        self.seen[uri] = version


def _refusal(name: str, uri: str, job_version: int | None, culprit: Commit) -> str:
    operation = culprit.get("operation")
    parameters = culprit.get("operationParameters") or {}
    detail = f" to version {parameters['version']}" if operation == "RESTORE" else ""
    return (
        f"{TABLE_CHANGED_BEHIND_JOB}: {name}: {operation}{detail} at Delta version "
        f"{culprit['version']} of {uri} changed its rows behind the job (its newest commit is "
        f"version {job_version}); RESTORE the table to version {job_version} to go on, or "
        "rebuild it (docs/operations.md)"
    )


@dataclass
class DeltaCommits:
    """Tables' versions and commit infos by delta-rs; each table loaded once, then brought up
    to date by reading only the log's new entries."""

    tables: dict[str, Any] = field(default_factory=dict)

    def version(self, uri: str) -> int:
        from deltalake import DeltaTable

        from runtime.storage import delta_storage_options

        table = self.tables.get(uri)
        if table is None:
            table = DeltaTable(uri, storage_options=delta_storage_options(uri))
            self.tables[uri] = table
        else:
            table.update_incremental()
        return int(table.version())

    def history(self, uri: str, limit: int | None) -> list[Commit]:
        """The commits of the table as ``version`` last read it."""
        if uri not in self.tables:
            self.version(uri)
        return list(self.tables[uri].history(limit))
