"""The streaming checkpoint's surroundings: who may run against it, and undoing a failed batch's
state schema files before a restart.

Only one job version may run against a checkpoint (docs/design.md: two schema versions writing
the same state revert each other's new fields). A lock file with a heartbeat says who runs; a
second job fails fast. On a local path the file is created atomically (O_EXCL); on an object
store the check is read-then-write, so deployments must also keep one replica (deploy/ uses a
single replica).
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
import uuid
from pathlib import Path

from pyarrow import fs as pafs

from pipeline.state.registry import filesystem_for
from runtime.errors import BadInput

LOCK_FILE = "_job_lock.json"


class CheckpointInUse(BadInput, RuntimeError):
    pass


class CheckpointLock:
    def __init__(self, checkpoint_uri: str, stale_s: float, description: str) -> None:
        self._filesystem, root = filesystem_for(checkpoint_uri)
        self._root = root.rstrip("/")
        self._path = f"{self._root}/{LOCK_FILE}"
        self._stale = stale_s
        self._owner = {
            "owner": uuid.uuid4().hex,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "job": description,
        }
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _document(self) -> bytes:
        return json.dumps({**self._owner, "heartbeat": time.time()}).encode()

    def _holder(self) -> dict | None:
        try:
            with self._filesystem.open_input_stream(self._path) as stream:
                text = stream.read()
        except (FileNotFoundError, OSError):
            return None
        try:
            return json.loads(text)
        except ValueError:
            info = self._filesystem.get_file_info(self._path)
            changed = info.mtime.timestamp() if info.mtime else 0.0
            return {"job": "an unreadable lock file", "heartbeat": changed}

    def _is_live(self, holder: dict) -> bool:
        if time.time() - float(holder.get("heartbeat", 0)) > self._stale:
            return False
        if holder.get("host") == socket.gethostname():
            try:
                os.kill(int(holder["pid"]), 0)
            except (ProcessLookupError, ValueError, KeyError):
                return False
            except PermissionError:
                return True
        return True

    def acquire(self) -> None:
        self._filesystem.create_dir(self._root, recursive=True)
        holder = self._holder()
        if holder is not None and self._is_live(holder):
            age = time.time() - float(holder.get("heartbeat", 0))
            raise CheckpointInUse(
                f"checkpoint {self._root} is in use by {holder.get('job')} "
                f"(pid {holder.get('pid')} on {holder.get('host')}, heartbeat {age:.0f} s ago); "
                "only one job version may run against a checkpoint at a time"
            )
        if isinstance(self._filesystem, pafs.LocalFileSystem):
            if holder is not None:
                Path(self._path).unlink(missing_ok=True)
            try:
                descriptor = os.open(self._path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                raise CheckpointInUse(
                    f"checkpoint {self._root} was taken by another job just now"
                ) from None
            with os.fdopen(descriptor, "wb") as file:
                file.write(self._document())
        else:
            self._write()
        self._thread = threading.Thread(target=self._heartbeat, name="checkpoint-lock", daemon=True)
        self._thread.start()

    def _write(self) -> None:
        """Whole or not at all: a heartbeat cut short by kill -9 must not leave an empty lock file,
        which the next start could neither read nor remove. Object stores write whole objects;
        a local file is written aside and renamed."""
        if not isinstance(self._filesystem, pafs.LocalFileSystem):
            with self._filesystem.open_output_stream(self._path) as stream:
                stream.write(self._document())
            return
        aside = f"{self._path}.{self._owner['owner']}"
        with self._filesystem.open_output_stream(aside) as stream:
            stream.write(self._document())
        self._filesystem.move(aside, self._path)

    def _heartbeat(self) -> None:
        while not self._stop.wait(self._stale / 4):
            self._write()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        holder = self._holder()
        if holder is not None and holder.get("owner") == self._owner["owner"]:
            self._filesystem.delete_file(self._path)

    def __enter__(self) -> CheckpointLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _numbered(filesystem: pafs.FileSystem, folder: str) -> set[int]:
    selector = pafs.FileSelector(folder, allow_not_found=True)
    return {
        int(info.base_name)
        for info in filesystem.get_file_info(selector)
        if info.base_name.isdigit()
    }


def committed_batches(checkpoint_uri: str) -> set[int]:
    """Batch ids Spark has committed in the checkpoint (``commits/<n>``)."""
    filesystem, root = filesystem_for(checkpoint_uri)
    return _numbered(filesystem, f"{root.rstrip('/')}/commits")


def roll_back_uncommitted_batch(checkpoint_uri: str) -> list[str]:
    """Delete the state schema and operator metadata files of batches with no commit.

    Spark writes them when a batch plans; if that batch fails (the first one after a state schema
    evolution, say) and the query restarts, Spark reuses them and stores the evolved variable's
    new fields as None for the whole run (open-source bug, docs/design.md). Without them
    the restart plans the batch afresh. Returns the deleted paths.
    """
    filesystem, root = filesystem_for(checkpoint_uri)
    root = root.rstrip("/")
    planned = _numbered(filesystem, f"{root}/offsets")
    uncommitted = planned - _numbered(filesystem, f"{root}/commits")
    if not uncommitted:
        return []
    patterns = [re.compile(rf"^\.?{n}(_.*)?(\.crc)?$") for n in uncommitted]
    deleted = []
    operators = filesystem.get_file_info(pafs.FileSelector(f"{root}/state", allow_not_found=True))
    for operator in operators:
        if operator.type != pafs.FileType.Directory:
            continue
        folders = [f"{operator.path}/_metadata/v2"]
        schema_root = f"{operator.path}/_stateSchema"
        for info in filesystem.get_file_info(pafs.FileSelector(schema_root, allow_not_found=True)):
            if info.type == pafs.FileType.Directory:
                folders.append(info.path)
        for folder in folders:
            for info in filesystem.get_file_info(pafs.FileSelector(folder, allow_not_found=True)):
                if info.type == pafs.FileType.File and any(
                    p.match(info.base_name) for p in patterns
                ):
                    filesystem.delete_file(info.path)
                    deleted.append(info.path)
    return deleted


def checkpoint_id(checkpoint_uri: str) -> str:
    """The query id Spark keeps in ``<checkpoint>/metadata``: stable across restarts."""
    filesystem, root = filesystem_for(checkpoint_uri)
    with filesystem.open_input_stream(f"{root.rstrip('/')}/metadata") as stream:
        return json.loads(stream.read().decode().splitlines()[0])["id"]
