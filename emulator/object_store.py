"""MinIO on loopback, for the tests and benchmarks: a real S3-compatible store
with conditional writes, built by ``make object-stores`` into ``.tools/bin``."""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from emulator.processes import terminate
from emulator.server import free_port

MINIO = Path(__file__).resolve().parent.parent / ".tools" / "bin" / "minio"


class StoreMissing(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class S3Store:
    endpoint: str
    access_key: str
    secret_key: str
    bucket: str

    def environment(self, endpoint: str | None = None) -> dict[str, str]:
        """The usual AWS variables, all the product needs; ``endpoint`` puts a proxy between."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint or self.endpoint,
            "AWS_ALLOW_HTTP": "true",
        }

    def uri(self, path: str) -> str:
        return f"s3://{self.bucket}/{path.strip('/')}"


def _wait_until_live(url: str, process: subprocess.Popen, deadline_s: float = 60) -> None:
    deadline = time.monotonic() + deadline_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the store exited with {process.returncode} before serving")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the store did not answer {url} within {deadline_s} s")
        time.sleep(0.1)


@contextlib.contextmanager
def minio(folder: Path, bucket: str = "lake") -> Iterator[S3Store]:
    """A MinIO server on a free loopback port with one bucket, stopped and removed after."""
    if not MINIO.exists():
        raise StoreMissing(f"{MINIO} is missing: run `make object-stores`")
    binary = MINIO
    port, console = free_port(), free_port()
    access_key, secret_key = "cdc-tests", secrets.token_hex(16)
    data = folder / "minio-data"
    data.mkdir(parents=True, exist_ok=True)
    log = open(folder / "minio.log", "wb")  # noqa: SIM115 - kept open for the server's life
    process = subprocess.Popen(
        [
            str(binary),
            "server",
            "--quiet",
            "--address",
            f"127.0.0.1:{port}",
            "--console-address",
            f"127.0.0.1:{console}",
            str(data),
        ],
        env={
            "PATH": os.environ.get("PATH", ""),
            "HOME": str(folder),
            "MINIO_ROOT_USER": access_key,
            "MINIO_ROOT_PASSWORD": secret_key,
            "MINIO_BROWSER": "off",
            "MINIO_UPDATE": "off",
        },
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        _wait_until_live(f"{endpoint}/minio/health/live", process)
        store = S3Store(endpoint, access_key, secret_key, bucket)
        _create_bucket(store)
        yield store
    finally:
        terminate(process, timeout=20)
        log.close()


def _create_bucket(store: S3Store) -> None:
    from pyarrow import fs as pafs

    filesystem = pafs.S3FileSystem(
        access_key=store.access_key,
        secret_key=store.secret_key,
        endpoint_override=store.endpoint.removeprefix("http://"),
        scheme="http",
        region="us-east-1",
        allow_bucket_creation=True,
    )
    filesystem.create_dir(store.bucket)
