"""What ``make test`` makes beside the tests rather than before them (the Makefile's
IMAGE_BUILD and CLASS_ARCHIVE_BUILD): each in a folder holding its log, its exit status once it
ended and the pid of the shell running it. A test that needs one waits for it while it moves."""

from __future__ import annotations

import time
from pathlib import Path

from emulator.processes import tree_cpu_seconds

ROOT = Path(__file__).resolve().parent.parent
IMAGE_BUILD = ROOT / ".image-build"
CLASS_ARCHIVE_BUILD = ROOT / ".class-archive-build"


def wait_for_build(folder: Path, still_s: float = 300) -> None:
    """Wait for the build kept in ``folder`` while it moves (its log grows or its processes
    spend CPU); fail with its log's end when it failed or stood still for ``still_s``. Without
    such a build (pytest run by hand) there is nothing to wait for."""
    pid_file, status_file, log = (folder / n for n in ("pid", "status", "log"))
    if not pid_file.exists():
        return
    pid, seen, moved = int(pid_file.read_text()), (-1, -1.0), time.monotonic()
    while not status_file.exists() and _alive(pid):
        now = (
            log.stat().st_size if log.exists() else 0,
            tree_cpu_seconds(pid, reaped_children=True),
        )
        if now != seen:
            seen, moved = now, time.monotonic()
        if time.monotonic() - moved >= still_s:
            raise AssertionError(f"{folder.name} stood still:\n{_tail(log)}")
        time.sleep(2)
    code = status_file.read_text().strip() if status_file.exists() else "none (it was killed)"
    assert code == "0", f"{folder.name} ended with status {code}:\n{_tail(log)}"


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:] if log.exists() else ""


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()
