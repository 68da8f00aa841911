"""Which entries of a Python worker's path the product's daemon drops (``runtime.python_daemon``):
Spark's zips of the installed versions of PySpark and Py4J, jars without Python; nothing else."""

from __future__ import annotations

import importlib.metadata
import zipfile
from pathlib import Path

from runtime.python_daemon import worker_path


def _zip(path: Path, files: dict[str, str]) -> str:
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return str(path)


def test_only_spark_s_zips_of_the_installed_versions_and_jars_without_python_are_dropped(
    tmp_path: Path,
) -> None:
    pyspark, py4j = importlib.metadata.version("pyspark"), importlib.metadata.version("py4j")
    (tmp_path / "same").mkdir()
    (tmp_path / "other").mkdir()
    same = _zip(
        tmp_path / "same" / "pyspark.zip",
        {"pyspark/version.py": f'__version__: str = "{pyspark}"\n'},
    )
    other = _zip(
        tmp_path / "other" / "pyspark.zip", {"pyspark/version.py": '__version__ = "3.5.1"\n'}
    )
    unreadable = _zip(tmp_path / "pyspark.zip", {"pyspark/__init__.py": ""})
    py4j_same = _zip(tmp_path / f"py4j-{py4j}-src.zip", {"py4j/__init__.py": ""})
    py4j_other = _zip(tmp_path / "py4j-0.10.7-src.zip", {"py4j/__init__.py": ""})
    no_python = _zip(tmp_path / "spark-core.jar", {"org/apache/spark/A.class": ""})
    with_python = _zip(tmp_path / "old-assembly.jar", {"pyspark/__init__.py": ""})
    missing = str(tmp_path / "gone.jar")
    path = [
        str(tmp_path), same, other, unreadable, py4j_same, py4j_other,
        no_python, with_python, missing, "/usr/lib/python3.11",
    ]  # fmt: skip
    assert worker_path(path) == [
        str(tmp_path),
        other,
        unreadable,
        py4j_other,
        with_python,
        missing,
        "/usr/lib/python3.11",
    ]
