"""A data file that a table's log lists and the store lacks, told from a failed query's error:
which table it belongs to (the change log, a mirror, a history) and the one line that says how
to recover. Restarting would read the same log and fail the same way."""

from __future__ import annotations

import os
import re
from urllib.parse import urlparse

from pipeline.config import PipelineConfig

MISSING_FILE_PATTERNS = (
    r"FILE_NOT_EXIST\] Encountered error while reading file (\S+?)\. File does not exist",
    r"Object at location (\S+) not found",
)
"""Spark's words for a file its read could not find, and delta-rs's (object_store's, whose
location on S3 is the key within the bucket)."""
CHANGELOG_FILES_REMOVED = "CHANGELOG_FILES_REMOVED"
MIRROR_FILES_REMOVED = "MIRROR_FILES_REMOVED"


def missing_files(text: str) -> list[str]:
    """The paths of the files an error says it could not find."""
    return [path for pattern in MISSING_FILE_PATTERNS for path in re.findall(pattern, text)]


def files_gone_line(text: str, config: PipelineConfig) -> str | None:
    """The line for a data file an error says is gone, by the table it lies in; None when the
    error names no such file.

    The change log's: a VACUUM with a retention shorter than the job's stop removed it after the
    ingest's compaction had rewritten its rows (the stream reads the files of each version, not
    the compacted ones); its rows are still in the change log's newest version. A mirror's (or a
    history's): a Spark VACUUM FULL of retention 0 beside the job (pipeline/NOTES.md) or a file
    deleted by hand; every MERGE into that table reads the same log, and its rows are only in
    the change log."""
    paths = missing_files(text)
    if any(_folder_under(path, config.changelog_uri) for path in paths):
        return (
            f"{CHANGELOG_FILES_REMOVED}: a data file of {config.changelog_uri} that the job has "
            "not read yet is gone (a VACUUM with a retention shorter than the job's stop); "
            "restarting reads the same versions: stop the job, delete its checkpoint and its "
            "mirror root, and start it again (it reads the change log whole), and keep the "
            "change log's VACUUM retention above the longest stop (docs/operations.md)"
        )
    for path in paths:
        for kind, root in (("mirror", config.mirror_root), ("history", config.history_root)):
            folder = _folder_under(path, root)
            if folder:
                table, _, file = folder.partition("/")
                return (
                    f"{MIRROR_FILES_REMOVED}: {kind} {table} lists a data file that is gone "
                    f"({file}; a Spark VACUUM of retention 0 that was not LITE, or a file "
                    "deleted by hand); every MERGE into it reads the same log: stop the job, "
                    "delete the mirror root, the history root and the checkpoint, and start it "
                    "again (it reads the change log from its start; docs/operations.md)"
                )
    return None


def _folder_under(path: str, root: str) -> str | None:
    """What of ``path`` lies under ``root`` (a local folder or a store's URI, which an error may
    name with another scheme, s3a:// for s3://, or by its key alone), else None."""
    key = urlparse(root).path if "://" in root else os.path.abspath(root)
    key = key.strip("/")
    found = re.search(rf"(?:^|/){re.escape(key)}/(\S+)$", path.rstrip("."))
    return found.group(1) if found else None
