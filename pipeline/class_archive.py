"""The class archive of Spark's driver (``runtime.jvm.CLASS_ARCHIVE``), made beside the jars.

Java's class data sharing maps an archive of classes instead of loading them from jars, when the
JVM's class path is the one the archive was made with. So the archive is made from what a driver
really loads and the class path it really has: a session runs a small Delta job (a write, a
MERGE, a read, a stream, and a stream through ``transformWithState`` with RocksDB state encoded in
Avro, as the job's is) with ``-XX:DumpLoadedClassList`` and reports its class path and module
options; then ``java -Xshare:dump`` archives those classes with them. Delta's jars lead the
driver's class path (``runtime.jvm.driver_java_options``), so their classes are archived too;
jars a session adds for an object store (S3A's) are loaded by Spark's own class loader and are
not.

A JVM also maps an archive whose class path names other paths to the same files (hard links).
So ``make`` makes one archive per key in its cache, from a venv and jars of the cache's own, and
each clone, whose venv and jars are hard links of the same cached files, takes it (``reuse``)
once ``java -Xshare:on`` has shown that its driver maps it; a clone it does not fit makes its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyspark
from pyspark.sql.streaming.stateful_processor import StatefulProcessor, StatefulProcessorHandle

from runtime.jvm import CLASS_ARCHIVE
from runtime.storage import JARS_VARIABLE

MADE_WITH = "spark-classes.json"
"""Beside the archive: the class path and module options it was dumped with, and where that
class path's Spark and jars were (``reuse`` maps them to a clone's)."""


def make_archive(jars: Path) -> Path:
    """The archive for the jars in ``jars`` (an earlier one replaced). In processes of their
    own: a session's JVM options are fixed when it starts. Written beside and renamed into
    place: a driver starting meanwhile finds a whole archive or none."""
    archive = jars / CLASS_ARCHIVE
    archive.unlink(missing_ok=True)
    partial = archive.with_name(archive.name + ".part")
    with tempfile.TemporaryDirectory(prefix="class-archive-") as work:
        class_list = Path(work) / "classes.lst"
        command = [sys.executable, "-m", "pipeline.class_archive", "load", work, str(class_list)]
        loaded = subprocess.run(
            command,
            env={**os.environ, JARS_VARIABLE: str(jars)},
            check=True,
            capture_output=True,
            text=True,
        )
        driver = json.loads(loaded.stdout.strip().splitlines()[-1])
        dump = [
            _java(),
            "-Xshare:dump",
            f"-XX:SharedClassListFile={class_list}",
            f"-XX:SharedArchiveFile={partial}",
            *driver["modules"],
            "-cp",
            driver["classpath"],
        ]
        dumped = subprocess.run(dump, capture_output=True, text=True)
    if dumped.returncode != 0 or not partial.is_file():
        raise RuntimeError(f"java -Xshare:dump failed: {dumped.stdout[-2000:]}")
    (jars / MADE_WITH).write_text(json.dumps({**driver, "jars": str(jars)}))
    partial.replace(archive)
    return archive


def reuse_archive(made: Path, jars: Path) -> str | None:
    """Hard-link the archive in ``made`` into ``jars`` when this venv's driver maps it; else
    the JVM's reason, and nothing linked. The archive's class path is mapped to this venv's
    Spark and ``jars``, and ``java -Xshare:on`` fails at once on an archive it refuses (a driver
    would run without it, silently)."""
    if not (made / MADE_WITH).is_file():
        return f"no archive made in {made}"
    dumped = json.loads((made / MADE_WITH).read_text())
    moved = {dumped["spark_home"]: _spark_home(), dumped["jars"]: str(jars)}
    classpath = os.pathsep.join(
        _moved(entry, moved) for entry in dumped["classpath"].split(os.pathsep)
    )
    archive = f"-XX:SharedArchiveFile={made / CLASS_ARCHIVE}"
    command = [_java(), "-Xshare:on", archive, *dumped["modules"], "-cp", classpath, "-version"]
    checked = subprocess.run(command, capture_output=True, text=True)
    if checked.returncode != 0:
        return (checked.stderr.strip().splitlines() or ["no output"])[-1]
    for name in (MADE_WITH, CLASS_ARCHIVE):  # each whole or none, for a driver starting now
        partial = jars / f"{name}.part"
        partial.unlink(missing_ok=True)
        try:
            os.link(made / name, partial)
        except OSError as error:  # another filesystem
            return str(error)
        partial.replace(jars / name)
    return None


def _moved(entry: str, moved: dict[str, str]) -> str:
    """A class path entry under one of ``moved``'s folders, under its new one."""
    for old, new in moved.items():
        if entry == old or entry.startswith(old + os.sep):
            return new + entry[len(old) :]
    return entry


def _spark_home() -> str:
    """This venv's PySpark, whose ``jars/`` the driver's class path names."""
    return str(Path(pyspark.__file__).parent)


def _java() -> str:
    """The java that spark-submit starts: JAVA_HOME's, else the one on PATH."""
    home = os.environ.get("JAVA_HOME")
    return str(Path(home) / "bin" / "java") if home else "java"


def _load_classes(work: Path, class_list: Path) -> None:
    """A driver's classes into ``class_list``: a Delta write, MERGE, read and stream; prints
    the driver's class path and module options as JSON."""
    from delta.tables import DeltaTable

    from pipeline.session import build_session

    options = f"-XX:DumpLoadedClassList={class_list}"
    spark = build_session(
        "class-archive", "local[1]", 1, extra={"spark.driver.extraJavaOptions": options}
    )
    table = str(work / "table")
    spark.range(100).selectExpr("id", "id * 2 AS v").write.format("delta").save(table)
    changes = spark.range(50, 150).selectExpr("id", "id * 3 AS v").alias("s")
    merge = DeltaTable.forPath(spark, table).alias("t").merge(changes, "t.id = s.id")
    merge.whenMatchedUpdateAll().whenNotMatchedInsertAll().execute()
    spark.read.format("delta").load(table).count()
    stream = spark.readStream.format("delta").load(table).writeStream
    query = stream.foreachBatch(lambda frame, _: frame.count()).trigger(availableNow=True)
    query.option("checkpointLocation", str(work / "checkpoint")).start().awaitTermination()
    _run_stateful(spark, table, work / "stateful-checkpoint")
    jvm = spark._jvm
    arguments = jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getInputArguments()
    modules = [str(a) for a in arguments if str(a).startswith("--add-modules")]
    classpath = jvm.System.getProperty("java.class.path")
    print(json.dumps({"classpath": classpath, "modules": modules, "spark_home": _spark_home()}))
    spark.stop()


def _run_stateful(spark: Any, table: str, checkpoint: Path) -> None:
    """A stream through transformWithState (the session's RocksDB state, Avro-encoded): the
    classes of the job's stateful operator, its Python runner and Arrow, archived too."""
    counted = (
        spark.readStream.format("delta")
        .load(table)
        .groupBy("id")
        .transformWithState(_Counter(), "id long, n long", "Update", "None")
    )
    query = counted.writeStream.foreachBatch(lambda frame, _: frame.count())
    query = query.option("checkpointLocation", str(checkpoint)).trigger(availableNow=True)
    query.start().awaitTermination()


class _Counter(StatefulProcessor):
    """Rows seen per key: one variable read and written, as the job's processor does."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.seen = handle.getValueState("seen", "n long")

    def handleInputRows(self, key: Any, rows: Iterator[Any], timerValues: Any) -> Iterator[Any]:
        from pyspark.sql import Row

        stored = self.seen.get()
        seen = (stored[0] if stored else 0) + sum(1 for _ in rows)
        self.seen.update((seen,))
        yield Row(id=key[0], n=seen)

    def close(self) -> None:
        pass


if __name__ == "__main__":
    if sys.argv[1:2] == ["load"] and len(sys.argv) == 4:
        _load_classes(Path(sys.argv[2]), Path(sys.argv[3]))
    elif sys.argv[1:2] == ["reuse"] and len(sys.argv) == 4:
        refused = reuse_archive(Path(sys.argv[2]), Path(sys.argv[3]).resolve())
        if refused:
            sys.exit(f"the class archive in {sys.argv[2]} does not fit this venv: {refused}")
        print(f"class archive {sys.argv[2]} linked into {sys.argv[3]}")
    else:
        sys.exit(
            "usage: python -m pipeline.class_archive load WORK_DIR CLASS_LIST\n"
            "       python -m pipeline.class_archive reuse MADE_DIR JARS_DIR"
        )
