"""Where tables and checkpoints live: a local path or an object store URI (``s3://``, ``s3a://``,
``gs://``, ``abfss://``).

Only the URI and the store's usual credentials environment configure a store, read alike by
delta-rs, pyarrow, obstore and Spark: ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_REGION`` and, for an S3-compatible store, ``AWS_ENDPOINT_URL``; for GCS,
``GOOGLE_APPLICATION_CREDENTIALS``. ``s3://`` and ``s3a://`` name the same object everywhere.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pyarrow import fs as pafs

S3_SCHEMES = ("s3", "s3a")
S3_ATTEMPTS = 6
"""Tries of one request to S3 before pyarrow gives up: a blip of the store is ridden out in
the request, not by restarting the job."""
STORE_ENVIRONMENT = ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_SERVICE_ACCOUNT")
"""Besides every ``AWS_*`` variable: what an executor writing to a store needs from the driver's
environment."""


JARS_VARIABLE = "SPARK_DELTA_JARS"
"""Where the product's jars are: Delta's, and S3A's in ``s3/`` (``python -m pipeline.session
fetch``); the repository's ``.jars`` by default."""
DEFAULT_JARS_DIR = Path(__file__).resolve().parent.parent / ".jars"


def jars_dir() -> Path:
    return Path(os.environ.get(JARS_VARIABLE, DEFAULT_JARS_DIR))


def store_jars(uris: Sequence[str]) -> list[Path]:
    """The jars a Spark session needs for ``uris`` beyond Spark's own: S3A's when one is on S3,
    the GCS connector (fetched beside Delta's jars) when one is on GCS."""
    schemes = {scheme_of(uri) for uri in uris}
    jars = []
    if schemes & set(S3_SCHEMES):
        s3 = sorted((jars_dir() / "s3").glob("*.jar"))
        if not s3:
            raise RuntimeError(f"no S3A jars in {jars_dir() / 's3'}: run `make jars` first")
        jars += s3
    if "gs" in schemes:
        jars += sorted(jars_dir().glob("gcs-connector*.jar"))
    return jars


def scheme_of(uri: str) -> str:
    """The URI's scheme, or ``""`` for a local path."""
    return urlsplit(uri).scheme.lower() if "://" in uri else ""


def is_local(uri: str) -> bool:
    return scheme_of(uri) in ("", "file")


def s3_endpoint(environ: Mapping[str, str]) -> str | None:
    return environ.get("AWS_ENDPOINT_URL_S3") or environ.get("AWS_ENDPOINT_URL") or None


def delta_storage_options(
    uri: str, environ: Mapping[str, str] = os.environ
) -> dict[str, str] | None:
    """What delta-rs needs beyond the environment to commit on ``uri`` safely.

    A Delta commit is a put-if-absent of the next log file. delta-rs refuses to write to S3
    without a way to make it one; S3 and S3-compatible stores (MinIO, R2) refuse a put over an
    existing object when asked (``If-None-Match``), so that is asked for unless the deployment
    configured another way (a DynamoDB locking provider, or its own ``AWS_CONDITIONAL_PUT``).
    """
    if scheme_of(uri) not in S3_SCHEMES:
        return None
    if environ.get("AWS_S3_LOCKING_PROVIDER") or environ.get("AWS_CONDITIONAL_PUT"):
        return None
    return {"conditional_put": "etag"}


def delta_write_mode(creates_table: bool) -> Literal["error", "append"]:
    """How a commit that carries an app transaction (``txn``) writes: one that creates the table
    fails if the table exists by the time it writes (``table_created_meanwhile``).

    A writer that found no table and wrote in mode ``append`` would, when another writer
    created the table in between, append to it with no look at the ``txn`` the creator
    carries: the same version of the job twice. Failing instead, the caller's retry looks
    again and finds its ``txn`` landed, or another writer's."""
    return "error" if creates_table else "append"


def table_created_meanwhile(error: BaseException) -> bool:
    """delta-rs's refusal of a creating write (``delta_write_mode``): the table exists now."""
    return "A table already exists at" in str(error)


def delta_commit_retries(creates_table: bool) -> int | None:
    """delta-rs's own retries of a commit that carries a ``txn``: none for the commit that
    creates the table, delta-rs's default otherwise.

    Finding version 0 taken (by a writer racing to create the table, or by this very commit
    when the store took the put, its answer was lost and the retried put was refused),
    delta-rs commits again at version 1 with no conflict check, so the ``txn`` lands twice.
    Without the retry the commit fails instead, and the caller's own retry finds its ``txn`` in
    the table (pipeline/NOTES.md). Every later commit is checked against those it races."""
    return 0 if creates_table else None


def arrow_filesystem(
    uri: str, environ: Mapping[str, str] = os.environ
) -> tuple[pafs.FileSystem, str]:
    """A pyarrow file system and the path in it, for the files kept beside the Delta tables.

    On S3 a file opens only when its first part is due, so a small file is one put: its retry
    after a lost answer writes it again. A file written in parts would fail for good when the
    answer to its completion is lost (the retried completion finds the upload gone)."""
    scheme = scheme_of(uri)
    if scheme in ("", "file"):
        from pathlib import Path

        return pafs.LocalFileSystem(), str(Path(uri.removeprefix("file://")).resolve())
    if scheme in S3_SCHEMES:
        parts = urlsplit(uri)
        endpoint = s3_endpoint(environ)
        options: dict[str, object] = {}
        if endpoint:
            address = urlsplit(endpoint)
            options["endpoint_override"] = address.netloc
            options["scheme"] = address.scheme or "https"
        region = environ.get("AWS_REGION") or environ.get("AWS_DEFAULT_REGION")
        if region:
            options["region"] = region
        path = f"{parts.netloc}{parts.path}".rstrip("/")
        return (
            pafs.S3FileSystem(
                allow_delayed_open=True,
                retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=S3_ATTEMPTS),
                **options,
            ),
            path,
        )
    return pafs.FileSystem.from_uri(uri)


def spark_config(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Spark settings that let Spark read and write the same URIs: ``s3://`` through S3A, and
    an S3-compatible endpoint taken from the environment (S3A reads the credentials itself)."""
    config = {
        "spark.hadoop.fs.s3.impl": "org.apache.hadoop.fs.s3a.S3AFileSystem",
        "spark.hadoop.fs.AbstractFileSystem.s3.impl": "org.apache.hadoop.fs.s3a.S3A",
        "spark.hadoop.fs.AbstractFileSystem.gs.impl": (
            "com.google.cloud.hadoop.fs.gcs.GoogleHadoopFS"
        ),
    }
    endpoint = s3_endpoint(environ)
    if endpoint:
        config["spark.hadoop.fs.s3a.endpoint"] = endpoint
        config["spark.hadoop.fs.s3a.path.style.access"] = "true"
        config["spark.hadoop.fs.s3a.connection.ssl.enabled"] = str(
            urlsplit(endpoint).scheme == "https"
        ).lower()
    region = environ.get("AWS_REGION") or environ.get("AWS_DEFAULT_REGION")
    if region:
        config["spark.hadoop.fs.s3a.endpoint.region"] = region
    return config
