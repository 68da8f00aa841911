"""One small object written only if it is still the version its writer read: the primitive a
lease is built on, on a local path and on object stores alike.

On an object store it is the store's conditional write (obstore: put-if-absent to create, put
if the ETag still matches to replace; S3 ``If-None-Match`` / ``If-Match``, GCS generation
preconditions). On a local path it is ``O_EXCL`` to create and a compare-and-rename under an
exclusive ``flock`` to replace, which holds between processes of one machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.storage import S3_SCHEMES, is_local, s3_endpoint, scheme_of


class VersionChanged(RuntimeError):
    """Another writer created or replaced the object first."""


@dataclass(frozen=True, slots=True)
class Versioned:
    data: bytes
    version: str
    modified: float
    """Seconds since the epoch, by the store's clock."""


class ConditionalObject:
    """``<folder>/<name>`` read with its version and written only against that version."""

    def __init__(self, folder_uri: str, name: str) -> None:
        self.name = name
        self._local = is_local(folder_uri)
        if self._local:
            self._folder = Path(folder_uri.removeprefix("file://")).resolve()
            self._path = self._folder / name
        else:
            self._store = _object_store(folder_uri)

    def read(self) -> Versioned | None:
        if self._local:
            return _local_read(self._path)
        import obstore
        from obstore.exceptions import NotFoundError

        try:
            found = obstore.get(self._store, self.name)
        except (NotFoundError, FileNotFoundError):
            return None
        return Versioned(
            bytes(found.bytes()), _token(found.meta), found.meta["last_modified"].timestamp()
        )

    def create(self, data: bytes) -> str:
        """Write the object if none exists; VersionChanged if one does."""
        if self._local:
            return _local_create(self._path, data)
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        try:
            return _token(obstore.put(self._store, self.name, data, mode="create"))
        except (AlreadyExistsError, PreconditionError, FileExistsError) as taken:
            raise VersionChanged(f"{self.name} exists") from taken

    def replace(self, data: bytes, version: str) -> str:
        """Write the object if it is still at ``version``; VersionChanged if it is not."""
        if self._local:
            return _local_replace(self._path, data, version)
        import obstore
        from obstore.exceptions import NotFoundError, PreconditionError

        try:
            expected = {k: v for k, v in json.loads(version).items() if v is not None}
            result = obstore.put(self._store, self.name, data, mode=expected)  # type: ignore[arg-type]
        except (PreconditionError, NotFoundError, FileNotFoundError) as moved:
            raise VersionChanged(f"{self.name} is no longer at {version}") from moved
        return _token(result)

    def delete(self) -> None:
        if self._local:
            self._path.unlink(missing_ok=True)
            return
        import obstore

        obstore.delete(self._store, self.name)


def _token(meta: Any) -> str:
    """An object's version as the store names it: the ETag, and the generation on GCS (whose
    conditional replace matches the generation, where S3's matches the ETag)."""
    return json.dumps({"e_tag": meta.get("e_tag"), "version": meta.get("version")})


def _object_store(folder_uri: str):  # -> obstore.store.ObjectStore
    """The store from the URI and the environment; on S3, writes conditional on the ETag
    (S3, MinIO and R2 honour ``If-None-Match`` and ``If-Match``)."""
    from obstore.store import from_url

    config: dict[str, Any] = {}
    client_options: dict[str, Any] = {}
    if scheme_of(folder_uri) in S3_SCHEMES:
        config["conditional_put"] = os.environ.get("AWS_CONDITIONAL_PUT", "etag")
        endpoint = s3_endpoint(os.environ)
        if endpoint and endpoint.startswith("http://"):
            client_options["allow_http"] = "true"
    return from_url(folder_uri, config=config or None, client_options=client_options or None)  # type: ignore[arg-type]


def _local_version(path: Path) -> str:
    status = path.stat()
    return f"{status.st_ino}-{status.st_mtime_ns}-{status.st_size}"


def _local_read(path: Path) -> Versioned | None:
    with _guard(path):
        try:
            return Versioned(path.read_bytes(), _local_version(path), path.stat().st_mtime)
        except FileNotFoundError:
            return None


def _local_create(path: Path, data: bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    with _guard(path):
        aside = path.with_name(f"{path.name}.{os.getpid()}.new")
        aside.write_bytes(data)
        try:
            os.link(aside, path)
        except FileExistsError as taken:
            raise VersionChanged(f"{path.name} exists") from taken
        finally:
            aside.unlink(missing_ok=True)
        return _local_version(path)


def _local_replace(path: Path, data: bytes, version: str) -> str:
    with _guard(path):
        try:
            current = _local_version(path)
        except FileNotFoundError as gone:
            raise VersionChanged(f"{path.name} is gone") from gone
        if current != version:
            raise VersionChanged(f"{path.name} is no longer at {version}")
        aside = path.with_name(f"{path.name}.{os.getpid()}.new")
        aside.write_bytes(data)
        os.replace(aside, path)
        return _local_version(path)


@contextlib.contextmanager
def _guard(path: Path) -> Iterator[None]:
    """Whole reads and compare-and-writes of ``path`` exclude each other on this machine (an
    exclusive ``flock`` of its folder, so no file is left beside it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        yield
    finally:
        os.close(folder)
