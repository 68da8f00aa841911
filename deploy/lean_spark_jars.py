"""Spark's jars in the image without what the product never loads (``--build-arg SPARK_JARS=lean``,
the default; ``full`` keeps them all): MLlib and its linear algebra, GraphX, Hive's metastore and
its Derby database, Spark Connect, the Kubernetes and YARN schedulers (the image runs a local
master or an executor; deploy/spark.Dockerfile is the image for clusters), and RocksDB's native
libraries for other platforms than this one (RocksDB keeps the state store).

Usage: python deploy/lean_spark_jars.py <pyspark jars folder>
"""

from __future__ import annotations

import fnmatch
import platform
import sys
import zipfile
from pathlib import Path

UNUSED = (
    "spark-mllib*",
    "breeze*",
    "spire*",
    "cats-kernel*",
    "algebra*",
    "arpack*",
    "blas*",
    "lapack*",
    "JTransforms*",
    "JLargeArrays*",
    "spark-graphx*",
    "hive-beeline*",
    "hive-cli*",
    "hive-exec*",
    "hive-jdbc*",
    "hive-metastore*",
    "hive-service-rpc*",
    "hive-shims*",
    "derby*",
    "datanucleus*",
    "spark-hive*",
    "spark-connect*",
    "kubernetes-*",
    "spark-kubernetes*",
    "spark-yarn*",
    "libthrift*",
    "libfb303*",
    "jdo-api*",
    "javolution*",
)
NATIVE = {"x86_64": "librocksdbjni-linux64.so", "aarch64": "librocksdbjni-linux-aarch64.so"}


def lean(jars: Path) -> int:
    """Bytes removed from ``jars``."""
    before = sum(jar.stat().st_size for jar in jars.glob("*.jar"))
    for jar in sorted(jars.glob("*.jar")):
        if any(fnmatch.fnmatch(jar.name, pattern) for pattern in UNUSED):
            jar.unlink()
    for rocksdb in jars.glob("rocksdbjni-*.jar"):
        _keep_one_native(rocksdb, NATIVE[platform.machine()])
    return before - sum(jar.stat().st_size for jar in jars.glob("*.jar"))


def _keep_one_native(jar: Path, keep: str) -> None:
    """The jar rewritten with this platform's native library only."""
    natives = (".so", ".jnilib", ".dll")
    lean_jar = jar.with_suffix(".lean")
    with zipfile.ZipFile(jar) as source, zipfile.ZipFile(lean_jar, "w") as target:
        for item in source.infolist():
            if item.filename.endswith(natives) and item.filename != keep:
                continue
            target.writestr(item, source.read(item.filename))
    lean_jar.replace(jar)


if __name__ == "__main__":
    removed = lean(Path(sys.argv[1]))
    print(f"removed {removed / 1e6:.0f} MB of Spark's jars")
