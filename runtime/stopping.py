"""A stop signal: SIGTERM or SIGINT asks the process for a clean stop, and a stop that drags on
says where it hangs.

A clean stop finishes or abandons the batch in flight, hands the lease over and exits 0. It can
wait on parts the product does not control (a Spark query that does not end, a JVM that does not
answer); a supervisor then ends the process with SIGKILL, and nobody learns where it stood. So
while a stop has not ended, the process logs ``stop_slow`` every ``slow_after_s`` seconds with
each thread's innermost frames (file, line, function: no values). It does not end the process
itself: a slow stop that ends is still a clean one.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

from runtime.logs import Logger

SLOW_STOP_S = 20.0
"""Below Kubernetes' default grace of 30 s, so the first report comes before its SIGKILL."""
STACK_DEPTH = 12
"""The innermost frames of each thread that a report shows."""


def stop_on_signals(
    log: Logger, slow_after_s: float = SLOW_STOP_S, ended: threading.Event | None = None
) -> threading.Event:
    """The event SIGTERM and SIGINT set; the first of them also starts the slow-stop reports,
    which end with the process (or when ``ended`` is set)."""
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        if stop.is_set():
            return
        stop.set()
        report_slow_stop(log, signal.Signals(signum).name, slow_after_s, ended)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    return stop


def report_slow_stop(
    log: Logger,
    reason: str,
    every_s: float,
    ended: threading.Event | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> threading.Thread:
    """A daemon thread logging ``stop_slow`` every ``every_s`` seconds until the process ends
    (or ``ended`` is set)."""
    asked, ended = clock(), ended or threading.Event()

    def report() -> None:
        while not ended.wait(every_s):
            log.warning(
                "stop_slow",
                reason=reason,
                waited_s=round(clock() - asked, 1),
                threads=thread_stacks(),
            )

    thread = threading.Thread(target=report, name="stop-slow-reports", daemon=True)
    thread.start()
    return thread


def thread_stacks(depth: int = STACK_DEPTH) -> dict[str, list[str]]:
    """Each live thread's innermost ``depth`` frames as ``file:line function``, outermost first."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    return {
        names.get(ident, str(ident)): _innermost(top, depth)
        for ident, top in sys._current_frames().items()
    }


def _innermost(top: FrameType, depth: int) -> list[str]:
    lines: list[str] = []
    frame: FrameType | None = top
    while frame is not None and len(lines) < depth:
        lines.append(f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back
    return lines[::-1]
