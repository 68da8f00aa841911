"""Spark's Python daemon for both runtimes' workers, importing PySpark from its installed files.

Spark puts its own copies of PySpark and Py4J first on every Python worker's path: zips of
their sources in ``$SPARK_HOME/python/lib``, and Spark's core jar after them. A zip holds no
bytecode cache, so each worker process compiled every PySpark module it imported again, and
the jar (some 6,000 entries, no Python in it) was read whenever a worker's import caches were
invalidated: about a quarter of the Python CPU of a pipeline's start (bench/RESULTS.md, "A
pipeline's start"). Where the installed packages are the zips' own versions (pip's
pyspark ships both), the daemon drops the zips, and any jar that holds no Python module, from
its path before anything imports PySpark; the workers it forks then import the installed,
compiled modules. Any other installation (a Spark distribution beside another pyspark) keeps
Spark's zips. Spark runs it as ``spark.python.daemon.module``.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

SPARK_ZIPS = {
    "pyspark": (re.compile(r"pyspark\.zip"), "pyspark/version.py"),
    "py4j": (re.compile(r"py4j-(?P<version>.+)-src\.zip"), None),
}
"""Spark's zips on a worker's path: the package, the zip's name, and the file in it that holds
its version when the name does not."""
VERSION_LINE = re.compile(r"""^__version__\s*(?::\s*str\s*)?=\s*["']([^"']+)["']""", re.M)


def worker_path(path: Sequence[str]) -> list[str]:
    """``path`` without Spark's zips of the packages installed at the same versions and
    without jars that hold no Python module."""
    return [entry for entry in path if not (_same_as_installed(entry) or _holds_no_python(entry))]


def _holds_no_python(entry: str) -> bool:
    if not entry.endswith(".jar"):
        return False
    try:
        with zipfile.ZipFile(entry) as jar:
            return not any(name.endswith((".py", ".pyc")) for name in jar.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def _same_as_installed(entry: str) -> bool:
    name = Path(entry).name
    for package, (zip_name, version_file) in SPARK_ZIPS.items():
        match = zip_name.fullmatch(name)
        if match is None:
            continue
        zipped = match.groupdict().get("version") or _zipped_version(entry, version_file)
        return zipped is not None and zipped == _installed_version(package)
    return False


def _zipped_version(archive: str, version_file: str | None) -> str | None:
    try:
        with zipfile.ZipFile(archive) as zipped:
            text = zipped.read(version_file or "").decode()
    except (OSError, KeyError, zipfile.BadZipFile):
        return None
    found = VERSION_LINE.search(text)
    return None if found is None else found.group(1)


def _installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def main() -> None:
    kept = worker_path(sys.path)
    for dropped in set(sys.path) - set(kept):
        sys.path_importer_cache.pop(dropped, None)  # each task invalidates every cached importer
    sys.path[:] = kept
    from pyspark.daemon import manager

    manager()


if __name__ == "__main__":
    main()
