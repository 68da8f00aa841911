"""Stop signals: SIGTERM or SIGINT asks the process for a clean stop, and a stop that drags on
says where it hangs.

The signals reach the product through a thread of its own, never through a Python signal
handler that sets an event. A handler runs in the main thread between two bytecodes, possibly
inside ``Event.wait()`` while that thread holds the event's lock; ``Event.set()`` there waits
for that lock forever, and the process never stops (2 of 300 stops of a loop on
``stop.wait()``; a ``spark-run`` in CI of ``0d7a017``). So each signal's handler does nothing,
Python's own C handler writes the signal's number to a pipe (``signal.set_wakeup_fd``), and a
thread reading the pipe sets the events, as any thread may.

A clean stop finishes or abandons the batch in flight, hands the lease over and exits 0. It can
wait on parts the product does not control (a Spark query that does not end, a JVM that does not
answer); a supervisor then ends the process with SIGKILL, and nobody learns where it stood. So
while a stop has not ended, the process logs ``stop_slow`` every ``SLOW_STOP_S`` seconds with
each thread's innermost frames (file, line, function: no values). It does not end the process
itself: a slow stop that ends is still a clean one.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from types import FrameType

from runtime.logs import Logger

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
SLOW_STOP_S = 20.0
"""Below Kubernetes' default grace of 30 s, so the first report comes before its SIGKILL."""
STACK_DEPTH = 12
"""The innermost frames of each thread that a report shows."""


def stop_on_signals(log: Logger, drain: threading.Event | None = None) -> threading.Event:
    """The event SIGTERM and SIGINT set (and SIGUSR1 sets ``drain``, when given); the first stop
    signal also starts the slow-stop reports, which end with the process. Called from the main
    thread, as Python's signals are."""
    stop = threading.Event()
    events = {signum: stop for signum in STOP_SIGNALS}
    if drain is not None:
        events[signal.SIGUSR1] = drain
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write)
    for signum in events:
        signal.signal(signum, _caught)
    threading.Thread(
        target=_deliver, args=(read, events, stop, log), name="stop-signals", daemon=True
    ).start()
    return stop


def _caught(_signum: int, _frame: object) -> None:
    """Python's C handler has written the signal to the wakeup pipe; nothing else to do here."""


def _deliver(
    read: int, events: Mapping[int, threading.Event], stop: threading.Event, log: Logger
) -> None:
    """Set each signal's event as its number arrives; the first stop also starts the reports."""
    while True:
        for signum in os.read(read, 64):
            event = events.get(signum)
            if event is stop and not stop.is_set():
                stop.set()
                report_slow_stop(log, signal.Signals(signum).name, SLOW_STOP_S)
            elif event is not None:
                event.set()


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
