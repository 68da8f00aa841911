"""The product's processes started as a user would: ``python -m <package> <command>``, with an
environment, logging JSON lines to one file that the caller reads back as events."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from runtime.process import PROCESS_ENVIRONMENT


def terminate(process: subprocess.Popen[Any], timeout: float) -> None:
    """SIGTERM, then kill -9 if it has not exited within ``timeout`` seconds."""
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class Process:
    """Starts processes of one command with one environment, all logging to one file."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str]) -> None:
        """The caller's environment and ``env``, less what the caller's own preparation set:
        the product's processes set that themselves, as they must for a user."""
        self.argv = argv
        self.log = log
        inherited = {k: v for k, v in os.environ.items() if k not in PROCESS_ENVIRONMENT}
        self.env = {**inherited, **env}
        self._read = LogReader(log)

    def command(self, *extra: str) -> list[str]:
        return [sys.executable, *self.argv, *extra]

    def start(self, *extra: str) -> subprocess.Popen[bytes]:
        """In a session of its own, so a terminal's Ctrl-C reaches only the caller, which stops
        the product's processes in order."""
        with self.log.open("ab") as out:
            return subprocess.Popen(
                self.command(*extra),
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def events(self) -> list[dict[str, Any]]:
        """The complete lines logged so far: a line the process is still writing (no newline
        yet) is left for the next read."""
        return self._read.events()

    def count(self, event: str) -> int:
        return sum(e["event"] == event for e in self.events())

    def wait_for(
        self,
        event: str,
        count: int,
        timeout: float = 60,
        process: subprocess.Popen[bytes] | None = None,
        where: Callable[[dict[str, Any]], bool] = lambda _: True,
    ) -> None:
        """Until the log holds ``count`` such events (signals before it race startup). Fails
        when ``timeout`` seconds pass without one more of them: a loaded machine whose process
        keeps logging them is waited on, a process that stopped is not."""

        def exited() -> None:
            if process is not None and process.poll() is not None:
                tail = self.log.read_text(errors="replace")[-3000:]
                raise AssertionError(f"exited {process.returncode} before {event}:\n{tail}")

        found = wait_on_progress(
            lambda: sum(e["event"] == event and where(e) for e in self.events()),
            count,
            timeout,
            0.2,
            exited,
        )
        assert found >= count, (
            f"no {event} #{count}: {found} so far, none for {timeout} s: {self.log}"
        )


def wait_on_progress(
    progress: Callable[[], int],
    target: int,
    still_s: float,
    poll_s: float,
    check: Callable[[], None] = lambda: None,
) -> int:
    """Poll ``progress`` (a count that only grows: events logged, transactions landed) until it
    reaches ``target`` or stands still for ``still_s`` seconds, calling ``check`` at each poll;
    the last count, below ``target`` only when it stood still. A wait on what a test can see
    move, not on the wall clock."""
    reached, moved = progress(), time.monotonic()
    while reached < target:
        if time.monotonic() - moved > still_s:
            break
        check()
        time.sleep(poll_s)
        if (now := progress()) > reached:
            reached, moved = now, time.monotonic()
    return reached


def process_tree(pid: int) -> Iterator[int]:
    """A process and its live descendants (the pipeline's JVM and its Python workers), as /proc
    lists them: each thread's children, as a JVM starts processes from threads other than its
    main one."""
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            threads = list(Path(f"/proc/{current}/task").iterdir())
        except OSError:
            continue
        yield current
        for thread in threads:
            try:
                children = (thread / "children").read_text().split()
            except OSError:
                continue
            pending.extend(int(child) for child in children)


def kill_tree(process: subprocess.Popen[Any]) -> None:
    """kill -9 of a process and all its descendants at once, as a container's end kills them:
    Spark's JVM runs in a session of its own (runtime/jvm.py), so the process group alone would
    leave it to end with its stdin pipe."""
    pids = list(process_tree(process.pid))
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.wait()


def cpu_seconds(pid: int, reaped_children: bool = False) -> float:
    """A process's CPU seconds (user and system), with those of the children it has reaped
    when asked, from ``/proc/<pid>/stat``; OSError once the process is gone."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    used = fields[11:15] if reaped_children else fields[11:13]
    return sum(int(value) for value in used) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int, reaped_children: bool = False) -> float:
    """CPU seconds of a process and its live descendants (the pipeline's JVM and its Python
    workers), as /proc has them now; with those of the children each has reaped when asked."""
    total = 0.0
    for current in process_tree(pid):
        try:
            total += cpu_seconds(current, reaped_children)
        except OSError:
            continue
    return total


def log_events(log: Path) -> list[dict[str, Any]]:
    """The complete JSON lines of a process's log so far (a line still being written, with no
    newline yet, is left for the next read; lines that are not events are passed over)."""
    return LogReader(log).events()


class LogReader:
    """A log's events, each line parsed once: a test polls a log many times a second while it
    grows (a service at debug logs a line per change record), so each read parses only what
    was appended since the last one."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self._offset = 0
        self._events: list[dict[str, Any]] = []

    def events(self) -> list[dict[str, Any]]:
        try:
            with self.log.open("rb") as stream:
                if stream.seek(0, os.SEEK_END) < self._offset:  # written anew: read it again
                    self._offset, self._events = 0, []
                stream.seek(self._offset)
                appended = stream.read()
        except FileNotFoundError:
            return []
        complete = appended[: appended.rfind(b"\n") + 1]
        self._offset += len(complete)
        for line in complete.split(b"\n"):
            if line.startswith(b'{"'):
                self._events.append(_event(self.log, line.decode(errors="replace")))
        return list(self._events)


def _event(log: Path, line: str) -> dict[str, Any]:
    """One JSON event; a line that starts as one and is not fails the caller by name."""
    try:
        event: dict[str, Any] = json.loads(line)
    except json.JSONDecodeError as error:
        raise AssertionError(
            f"{log}: a line that is not one JSON event ({error}): {line[:300]}"
        ) from None
    return event
