"""The object store for the tests (``emulator.object_store``): in CI a missing MinIO fails the
run, elsewhere it skips the test."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from emulator import object_store
from emulator.object_store import S3Store

__all__ = ["S3Store", "minio"]


@contextlib.contextmanager
def minio(folder: Path, bucket: str = "lake") -> Iterator[S3Store]:
    if not object_store.MINIO.exists():
        message = f"{object_store.MINIO} is missing: run `make object-stores`"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    with object_store.minio(folder, bucket) as store:
        yield store
