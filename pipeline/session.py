"""The Spark session: Delta from jars fetched ahead of time, RocksDB state store, Avro state.

The Delta jars are resolved once (``make jars`` → ``python -m pipeline.session fetch``) into
``.jars/`` so neither tests nor containers download anything at start. The state store provider,
the Avro encoding and the shuffle partitions are frozen into a streaming checkpoint on its first
run, so they are always set here.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from runtime.jvm import JvmLog, loopback_when_unresolvable
from runtime.spark_session import session_settings, start_session
from runtime.storage import jars_dir

DELTA_PACKAGE = "io.delta:delta-spark_4.2_2.13:4.4.0"
GCS_CONNECTOR_URL = (
    "https://repo1.maven.org/maven2/com/google/cloud/bigdataoss/gcs-connector/"
    "hadoop3-2.2.26/gcs-connector-hadoop3-2.2.26-shaded.jar"
)
"""For gs:// tables and checkpoints; images fetch it at build time (``fetch DIR --gcs``)."""
S3_JAR_URLS = tuple(
    f"https://repo1.maven.org/maven2/{path}"
    for path in (
        "org/apache/hadoop/hadoop-aws/3.5.0/hadoop-aws-3.5.0.jar",
        "software/amazon/s3/analyticsaccelerator/analyticsaccelerator-s3/1.3.1/"
        "analyticsaccelerator-s3-1.3.1.jar",
    )
)
S3_SDK_PACKAGES = tuple(
    f"software.amazon.awssdk:{module}:2.35.4" for module in ("s3", "s3-transfer-manager", "sts")
)
"""S3A for s3:// and s3a:// (``fetch DIR --s3``): hadoop-aws of the Hadoop that PySpark ships
(3.5.0) and the modules of the AWS SDK version it was built with that S3A uses. Kept in
``<jars>/s3/`` and added to a session only when one of its URIs is on S3."""


def base_config(shuffle_partitions: int = 4) -> dict[str, str]:
    """The pipeline's own settings: Delta, the RocksDB state store with Avro state, the state's
    partitions (frozen into a checkpoint on its first run), and Delta's log replayed in as many
    partitions as the shuffle's, not Delta's 50: on two cores the change log's first snapshot
    took 15 s with 50, 3 s with 2, and a VACUUM of a 60-version table 37 s and 3.4 s
    (bench/RESULTS.md, "Where one micro-batch's seconds went" and "The suite")."""
    return {
        "spark.databricks.delta.snapshotPartitions": str(shuffle_partitions),
        "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
        "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
        "spark.sql.streaming.stateStore.providerClass": (
            "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
        ),
        "spark.sql.streaming.stateStore.encodingFormat": "avro",
        "spark.sql.shuffle.partitions": str(shuffle_partitions),
    }


def build_session(
    app_name: str = "spanner-cdc",
    master: str | None = "local[2]",
    shuffle_partitions: int = 4,
    extra: Mapping[str, str] | None = None,
    storage_uris: Sequence[str] = (),
    jvm_output: JvmLog | None = None,
):  # -> pyspark.sql.SparkSession (imported lazily: pyspark is heavy)
    """A session with the Delta jars, and S3A's when any of ``storage_uris`` is on S3; the
    JVM's lines to ``jvm_output`` when given (``runtime.jvm.JvmLog``)."""
    jars = sorted(jars_dir().glob("*.jar"))
    if not jars:
        raise RuntimeError(f"no Delta jars in {jars_dir()}: run `make jars` first")
    own = {**base_config(shuffle_partitions), **(extra or {})}
    settings = session_settings(own, jars, storage_uris)
    return start_session(app_name, master, settings, jvm_output)


def fetch_jars(destination: Path) -> list[Path]:
    """Resolve the Delta package and its dependencies from Maven Central into ``destination``."""
    return resolve((DELTA_PACKAGE,), destination)


def fetch_s3_jars(destination: Path) -> list[Path]:
    """S3A into ``destination``: hadoop-aws and the analytics accelerator, and the AWS SDK's
    S3, transfer manager and STS modules with their dependencies (about 10 MB) in place of its
    690 MB bundle, which holds every AWS service."""
    from urllib.request import urlretrieve

    fetched = resolve(S3_SDK_PACKAGES, destination)
    for url in S3_JAR_URLS:
        jar = destination / url.rsplit("/", 1)[1]
        urlretrieve(url, jar)
        fetched.append(jar)
    return fetched


def resolve(packages: Sequence[str], destination: Path) -> list[Path]:
    """Maven packages and their dependencies into ``destination`` (its jars replaced), less
    the jars Spark ships: the class loader would find Spark's (newer) ones first. In a process
    of its own: Spark resolves packages only when it launches its JVM."""
    command = [sys.executable, "-m", "pipeline.session", "resolve", str(destination), *packages]
    subprocess.run(command, check=True)
    return sorted(destination.glob("*.jar"))


def _resolve_here(packages: Sequence[str], destination: Path) -> None:
    from pyspark.sql import SparkSession

    ivy = destination / "ivy"
    loopback_when_unresolvable("local[1]")
    session = (
        SparkSession.builder.master("local[1]")
        .config("spark.jars.packages", ",".join(packages))
        .config("spark.jars.ivy", str(ivy))
        .config("spark.ui.enabled", "false")
        .getOrCreate()
    )
    session.stop()
    shipped = {artifact(jar.name) for jar in spark_jars_dir().glob("*.jar")}
    for old in destination.glob("*.jar"):
        old.unlink()
    for jar in sorted((ivy / "jars").glob("*.jar")):
        if artifact(jar.name.split("_", 1)[-1]) not in shipped:
            shutil.copy2(jar, destination / jar.name)
    shutil.rmtree(ivy)


def spark_jars_dir() -> Path:
    """The jars PySpark ships (Spark's own classpath)."""
    import pyspark

    return Path(pyspark.__file__).resolve().parent / "jars"


def artifact(jar_name: str) -> str:
    """A jar file's artifact name without its version: ``hadoop-client-api-3.4.2.jar`` →
    ``hadoop-client-api``; Ivy's ``group_artifact-version.jar`` after its group."""
    found = re.match(r"(.+?)-(\d[\w.\-]*)\.jar$", jar_name)
    return found.group(1) if found else jar_name.removesuffix(".jar")


if __name__ == "__main__":
    if sys.argv[1:2] == ["resolve"]:
        _resolve_here(sys.argv[3:], Path(sys.argv[2]))
        sys.exit(0)
    if sys.argv[1:2] != ["fetch"]:
        flags = "[--gcs] [--s3 | --only-s3] [--no-class-archive | --only-class-archive]"
        sys.exit(f"usage: python -m pipeline.session fetch [DIR] {flags}")
    arguments = [a for a in sys.argv[2:] if not a.startswith("--")]
    target = (Path(arguments[0]) if arguments else jars_dir()).resolve()
    target.mkdir(parents=True, exist_ok=True)
    if "--only-s3" in sys.argv:  # S3A's jars alone, beside a fetch of the rest (make -j)
        (target / "s3").mkdir(exist_ok=True)
        print(f"{len(fetch_s3_jars(target / 's3'))} jars in {target / 's3'}")
        sys.exit(0)
    if "--only-class-archive" not in sys.argv:  # else the archive of the jars already there
        fetched = fetch_jars(target)
        if "--gcs" in sys.argv:
            from urllib.request import urlretrieve

            connector = target / GCS_CONNECTOR_URL.rsplit("/", 1)[1]
            urlretrieve(GCS_CONNECTOR_URL, connector)
            fetched.append(connector)
        if "--s3" in sys.argv:
            (target / "s3").mkdir(exist_ok=True)
            fetched += fetch_s3_jars(target / "s3")
        print(f"{len(fetched)} jars in {target}")
    if "--no-class-archive" not in sys.argv:
        from pipeline.class_archive import make_archive

        print(f"class archive {make_archive(target)}")
