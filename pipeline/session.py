"""The Spark session: Delta from jars fetched ahead of time, RocksDB state store, Avro state.

The Delta jars are resolved once (``make jars`` → ``python -m pipeline.session fetch``) into
``.jars/`` so neither tests nor containers download anything at start. The state store provider,
the Avro encoding and the shuffle partitions are frozen into a streaming checkpoint on its first
run, so they are always set here.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from runtime.jvm import own_session
from runtime.storage import S3_SCHEMES, scheme_of, spark_config

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
        "software/amazon/awssdk/bundle/2.35.4/bundle-2.35.4.jar",
        "software/amazon/s3/analyticsaccelerator/analyticsaccelerator-s3/1.3.1/"
        "analyticsaccelerator-s3-1.3.1.jar",
    )
)
"""S3A for s3:// and s3a:// (``fetch DIR --s3``): hadoop-aws of the Hadoop that PySpark ships
(3.5.0) and the AWS SDK it was built with. Kept in ``<jars>/s3/`` and added to a session only
when one of its URIs is on S3: the SDK bundle is 690 MB, which every executor would copy."""
JARS_VARIABLE = "SPARK_DELTA_JARS"
DEFAULT_JARS_DIR = Path(__file__).resolve().parent.parent / ".jars"


def jars_dir() -> Path:
    return Path(os.environ.get(JARS_VARIABLE, DEFAULT_JARS_DIR))


def base_config(shuffle_partitions: int = 4) -> dict[str, str]:
    return {
        "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
        "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
        "spark.sql.streaming.stateStore.providerClass": (
            "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
        ),
        "spark.sql.streaming.stateStore.encodingFormat": "avro",
        "spark.sql.shuffle.partitions": str(shuffle_partitions),
        "spark.ui.showConsoleProgress": "false",
        "spark.ui.enabled": "false",
        **spark_config(),
    }


def build_session(
    app_name: str = "spanner-cdc",
    master: str | None = "local[2]",
    shuffle_partitions: int = 4,
    extra: Mapping[str, str] | None = None,
    storage_uris: Sequence[str] = (),
):  # -> pyspark.sql.SparkSession (imported lazily: pyspark is heavy)
    """A session with the Delta jars, and S3A's when any of ``storage_uris`` is on S3."""
    from pyspark.sql import SparkSession

    jars = sorted(jars_dir().glob("*.jar"))
    if not jars:
        raise RuntimeError(f"no Delta jars in {jars_dir()}: run `make jars` first")
    if any(scheme_of(uri) in S3_SCHEMES for uri in storage_uris):
        s3_jars = sorted((jars_dir() / "s3").glob("*.jar"))
        if not s3_jars:
            raise RuntimeError(f"no S3A jars in {jars_dir() / 's3'}: run `make jars` first")
        jars += s3_jars
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name)
    if master:
        builder = builder.master(master)
    settings = {
        **base_config(shuffle_partitions),
        "spark.jars": ",".join(map(str, jars)),
        **(extra or {}),
    }
    for key, value in settings.items():
        builder = builder.config(key, value)
    with own_session():  # a stop signal to the job's group reaches Python only
        session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session


def fetch_jars(destination: Path) -> list[Path]:
    """Resolve the Delta package and its dependencies from Maven Central into ``destination``."""
    from pyspark.sql import SparkSession

    ivy = destination / "ivy"
    session = (
        SparkSession.builder.master("local[1]")
        .config("spark.jars.packages", DELTA_PACKAGE)
        .config("spark.jars.ivy", str(ivy))
        .config("spark.ui.enabled", "false")
        .getOrCreate()
    )
    session.stop()
    copied = []
    for jar in sorted((ivy / "jars").glob("*.jar")):
        target = destination / jar.name
        shutil.copy2(jar, target)
        copied.append(target)
    return copied


if __name__ == "__main__":
    if sys.argv[1:2] != ["fetch"]:
        sys.exit("usage: python -m pipeline.session fetch [DIR] [--gcs] [--s3]")
    arguments = [a for a in sys.argv[2:] if a not in ("--gcs", "--s3")]
    target = (Path(arguments[0]) if arguments else jars_dir()).resolve()
    target.mkdir(parents=True, exist_ok=True)
    fetched = fetch_jars(target)
    if "--gcs" in sys.argv:
        from urllib.request import urlretrieve

        connector = target / GCS_CONNECTOR_URL.rsplit("/", 1)[1]
        urlretrieve(GCS_CONNECTOR_URL, connector)
        fetched.append(connector)
    if "--s3" in sys.argv:
        from urllib.request import urlretrieve

        (target / "s3").mkdir(exist_ok=True)
        for url in S3_JAR_URLS:
            jar = target / "s3" / url.rsplit("/", 1)[1]
            urlretrieve(url, jar)
            fetched.append(jar)
    print(f"{len(fetched)} jars in {target}")
