"""The streaming checkpoint's surroundings: who may run against it, and undoing a failed batch's
state schema files before a restart.

Only one job version may run against a checkpoint (docs/design.md: two schema versions writing
the same state revert each other's new fields). A lease object with a heartbeat says who runs,
written only with the store's conditional writes (``runtime.conditional``): a second job fails
fast, two starting at once cannot both take it, and a job that lost it (paused past
``lock_stale_s``, its lease taken over) finds out before it writes a batch.
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

import structlog
from pyarrow import fs as pafs

from runtime.conditional import ConditionalObject, VersionChanged, Versioned
from runtime.errors import BadInput, ReportedError
from runtime.logs import null_logger
from runtime.storage import arrow_filesystem

LOCK_FILE = "_job_lock.json"


class CheckpointInUse(BadInput, RuntimeError):
    pass


class CheckpointLockLost(ReportedError, RuntimeError):
    """This job no longer holds the checkpoint: it must write nothing more."""


def process_started(pid: int) -> str | None:
    """Which process a pid is: the kernel's boot and the process's start in clock ticks since
    it (/proc), so a pid used again, by this process or another, is told apart; None off Linux."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        ticks = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None
    return f"{boot}:{ticks}"


class CheckpointLock:
    """A lease on the checkpoint, renewed every quarter of ``stale_s``.

    The holder trusts its lease for three quarters of ``stale_s`` after the start of its last
    successful renewal (a monotonic clock, so a pause counts); a newcomer takes it over only
    after ``stale_s`` without a heartbeat. Between the two lies a quarter of ``stale_s`` for
    clocks and the store to disagree.
    """

    def __init__(
        self,
        checkpoint_uri: str,
        stale_s: float,
        description: str,
        log: structlog.typing.FilteringBoundLogger | None = None,
    ) -> None:
        self._log = log or null_logger()
        self._root = checkpoint_uri.rstrip("/")
        self._object = ConditionalObject(self._root, LOCK_FILE)
        self._stale = stale_s
        self._owner = {
            "owner": uuid.uuid4().hex,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": process_started(os.getpid()),
            "job": description,
        }
        self._version: str | None = None
        self._renewed = 0.0
        self._lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _document(self) -> bytes:
        return json.dumps({**self._owner, "heartbeat": time.time()}).encode()

    @staticmethod
    def _holder(found: Versioned) -> dict:
        try:
            holder = json.loads(found.data)
            if isinstance(holder, dict):
                return holder
        except ValueError:
            pass
        return {"job": "an unreadable lock file", "heartbeat": found.modified}

    def _is_live(self, holder: dict) -> bool:
        """A fresh heartbeat is live, unless its writer was a process of this host that is gone:
        its pid answers nothing, or answers as another process (a container restarted after a
        kill -9 has the same host name and, under tini, the same pid as the one it replaces)."""
        if time.time() - float(holder.get("heartbeat", 0)) > self._stale:
            return False
        if holder.get("host") != socket.gethostname():
            return True
        try:
            pid = int(holder["pid"])
            os.kill(pid, 0)
        except (ProcessLookupError, ValueError, KeyError):
            return False
        except PermissionError:
            return True
        started = holder.get("started")
        return started is None or started == process_started(pid)

    def acquire(self) -> None:
        found = self._object.read()
        started = time.monotonic()
        try:
            if found is None:
                self._version = self._object.create(self._document())
            else:
                holder = self._holder(found)
                if self._is_live(holder):
                    age = time.time() - float(holder.get("heartbeat", 0))
                    raise CheckpointInUse(
                        f"checkpoint {self._root} is in use by {holder.get('job')} "
                        f"(pid {holder.get('pid')} on {holder.get('host')}, heartbeat {age:.0f} s "
                        "ago); only one job version may run against a checkpoint at a time"
                    )
                self._version = self._object.replace(self._document(), found.version)
        except VersionChanged:
            self._version = self._written_by_us()
            if self._version is None:
                raise CheckpointInUse(
                    f"checkpoint {self._root} was taken by another job just now"
                ) from None
        self._renewed = started
        self._thread = threading.Thread(target=self._heartbeat, name="checkpoint-lock", daemon=True)
        self._thread.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self._stale / 4) and self.renew():
            pass

    def renew(self) -> bool:
        """Write a new heartbeat over this job's own; False once another job has taken the lease.
        A store that cannot be reached leaves the lease to run out (``check_held``)."""
        started = time.monotonic()
        assert self._version is not None
        try:
            self._version = self._object.replace(self._document(), self._version)
        except VersionChanged:
            self._version = self._written_by_us()
            if self._version is not None:
                return True
            self._lost.set()
            self._log.error("checkpoint_lock_lost", checkpoint=self._root, cause="taken over")
            return False
        except Exception as failed:
            self._log.warning("checkpoint_lock_renewal_failed", cause=type(failed).__name__)
            return True
        self._renewed = started
        return True

    def _written_by_us(self) -> str | None:
        """The lease's version if the object holds this job's own document: a write whose answer
        was lost (a timeout, a cut connection) may have landed, and a retry then finds it."""
        found = self._object.read()
        if found is not None and self._holder(found).get("owner") == self._owner["owner"]:
            return found.version
        return None

    def check_held(self) -> None:
        """Raise CheckpointLockLost unless the lease is surely still this job's."""
        age = time.monotonic() - self._renewed
        if self._lost.is_set() or self._version is None or age > self._stale * 3 / 4:
            if not self._lost.is_set():
                self._log.error("checkpoint_lock_lost", checkpoint=self._root, cause="expired")
            self._lost.set()
            raise CheckpointLockLost(
                f"this job no longer holds checkpoint {self._root} "
                f"(last renewed {age:.0f} s ago, stale after {self._stale:.0f} s)"
            )

    @property
    def lost(self) -> bool:
        return self._lost.is_set()

    @property
    def lost_event(self) -> threading.Event:
        """Set once the lease is known lost: whatever waits on the job should stop it."""
        return self._lost

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._lost.is_set() or self._version is None:
            return
        found = self._object.read()
        if found is not None and found.version == self._version:
            self._object.delete()

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
    filesystem, root = arrow_filesystem(checkpoint_uri)
    return _numbered(filesystem, f"{root.rstrip('/')}/commits")


def planned_batches(checkpoint_uri: str) -> set[int]:
    """Batch ids Spark has planned in the checkpoint (``offsets/<n>``), committed or not."""
    filesystem, root = arrow_filesystem(checkpoint_uri)
    return _numbered(filesystem, f"{root.rstrip('/')}/offsets")


def roll_back_uncommitted_batch(checkpoint_uri: str) -> list[str]:
    """Delete the state schema and operator metadata files of batches with no commit.

    Spark writes them when a batch plans; if that batch fails (the first one after a state schema
    evolution, say) and the query restarts, Spark reuses them and stores the evolved variable's
    new fields as None for the whole run (open-source bug, docs/design.md). Without them
    the restart plans the batch afresh. Returns the deleted paths.
    """
    filesystem, root = arrow_filesystem(checkpoint_uri)
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
    filesystem, root = arrow_filesystem(checkpoint_uri)
    with filesystem.open_input_stream(f"{root.rstrip('/')}/metadata") as stream:
        return json.loads(stream.read().decode().splitlines()[0])["id"]
