"""The product's processes set what they need themselves: a user's environment has nothing a
test harness would set (issue 41: ``spark-run`` died at start in users' environments while the
suite, which had set ``GRPC_ENABLE_FORK_SUPPORT`` for every process it started, never did)."""

from __future__ import annotations

import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from structlog.testing import CapturingLogger

from emulator.processes import Process
from runtime.logs import make_logger
from runtime.process import PROCESS_ENVIRONMENT
from runtime.stopping import report_slow_stop

ROOT = Path(__file__).resolve().parent.parent
PROBE = """
import importlib.abc, os, sys
seen = {}
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in ("grpc", "pyspark") and name not in seen:
            seen[name] = {k: os.environ.get(k) for k in KEYS}
        return None
sys.meta_path.insert(0, Watch())
sys.argv = [PACKAGE, *ARGS]
import runpy
try:
    runpy.run_module(PACKAGE, run_name="__main__")
except SystemExit:
    pass
print(repr(seen))
print(repr({k: os.environ.get(k) for k in KEYS}))
"""


def clean_environment() -> dict[str, str]:
    """What a user's shell has: none of the variables the product sets for itself."""
    return {k: v for k, v in os.environ.items() if k not in PROCESS_ENVIRONMENT}


@pytest.mark.parametrize(
    "package, args, loads",
    [
        ("ingest", ["spark-run", "--help"], "grpc"),
        ("ingest", ["run", "--help"], "grpc"),
        ("pipeline", ["run", "--help"], None),
    ],
)
def test_each_entry_point_prepares_its_process_before_grpc_loads(
    package: str, args: list[str], loads: str | None
) -> None:
    script = (
        f"KEYS = {sorted(PROCESS_ENVIRONMENT)!r}\nPACKAGE = {package!r}\nARGS = {args!r}\n" + PROBE
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=clean_environment(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    at_import, at_exit = (eval(line) for line in done.stdout.strip().splitlines()[-2:])
    assert at_exit == PROCESS_ENVIRONMENT
    if loads is not None:
        assert at_import[loads] == PROCESS_ENVIRONMENT, f"{loads} loaded before the preparation"


def test_harnesses_start_the_product_without_what_it_sets_itself() -> None:
    """Tests, the sample tools and benchmarks prepare their own processes the product's way
    and never hand that on: only ``runtime/process.py`` names the variables."""
    started = Process(["-m", "ingest", "run"], Path(os.devnull), {"SPANNER_DATABASE": "db"})
    assert not PROCESS_ENVIRONMENT.keys() & started.env.keys()
    naming = [
        str(path.relative_to(ROOT))
        for folder in ("tests", "emulator", "bench", "ingest", "pipeline", "runtime", "examples")
        for path in (ROOT / folder).rglob("*.py")
        if path not in (ROOT / "runtime" / "process.py", Path(__file__))
        for name in PROCESS_ENVIRONMENT
        if name in path.read_text()
    ]
    assert naming == []


def test_a_growing_log_is_read_line_by_line_once_and_a_line_in_progress_waits(
    tmp_path: Path,
) -> None:
    """What tests poll: each complete JSON line once, in order; a line still being written, and
    what is not an event (a JVM's stack trace), left out; a log written anew (shorter) read
    again."""
    log = tmp_path / "service.log"
    process = Process(["-m", "ingest", "run"], log, {})
    assert process.events() == []
    log.write_bytes(b'{"event": "a"}\nat org.apache.spark.Foo\n{"event": "b", "t": "\xc3')
    assert [e["event"] for e in process.events()] == ["a"]
    with log.open("ab") as out:
        out.write(b'\xbc"}\n{"event": "c"}\n')
    assert [e.get("t") for e in process.events()] == [None, "ü", None]
    assert process.count("c") == 1
    log.write_bytes(b'{"event": "d"}\n')
    assert [e["event"] for e in process.events()] == ["d"]


def test_a_wait_for_events_fails_only_when_they_stop_coming(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wait for many events is a wait on progress: one that comes every 40 s of a clock is
    waited on past its 60 s timeout, and the wait fails 60 s after the last one, saying how
    many came."""
    log = tmp_path / "pipeline.log"
    process = Process(["-m", "pipeline", "run"], log, {})
    clock = {"now": 0.0}

    def sleep(seconds: float) -> None:
        clock["now"] += seconds
        logged = process.count("pipeline_batch")
        if logged < 5 and clock["now"] >= 40 * (logged + 1):
            with log.open("a") as out:
                out.write('{"event": "pipeline_batch"}\n')

    monkeypatch.setattr(
        "emulator.processes.time", SimpleNamespace(monotonic=lambda: clock["now"], sleep=sleep)
    )
    process.wait_for("pipeline_batch", 5, timeout=60)
    assert clock["now"] >= 200
    with pytest.raises(AssertionError, match="5 so far, none for 60 s") as stopped:
        process.wait_for("pipeline_batch", 6, timeout=60)
    assert 260 <= clock["now"] <= 261, stopped.value


STOPS = """
import sys, threading
from runtime.logs import null_logger
from runtime.stopping import stop_on_signals
drain = threading.Event()
stop = stop_on_signals(null_logger(), drain=drain)
print("ready", flush=True)
print("drained" if drain.wait(60) else "not drained", flush=True)
for number in range(int(sys.argv[1])):
    stop = stop_on_signals(null_logger())
    print(f"ready {number}", flush=True)
    while not stop.wait(0):  # the main thread in and out of Event.wait's lock, as in a loop
        pass
    print(f"stopped {number}", flush=True)
"""


def test_every_stop_signal_stops_the_process_whatever_its_main_thread_waits_in() -> None:
    """50 stops, each signalled while the main thread spins on ``stop.wait(0)``: every one ends.
    An event set from a Python signal handler hung within the first three such stops (and 2 of
    300 fresh processes looping on ``stop.wait(0.0002)``), the handler waiting for the lock of
    the very ``Event.wait()`` it had interrupted. SIGUSR1 sets the drain."""
    stops = 50
    child = subprocess.Popen(
        [sys.executable, "-c", STOPS, str(stops)], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_lines, args=(child, lines), daemon=True).start()
    rng = random.Random(43)
    try:
        assert _next(lines) == "ready\n"
        child.send_signal(signal.SIGUSR1)
        assert _next(lines) == "drained\n"
        for number in range(stops):
            assert _next(lines) == f"ready {number}\n"
            time.sleep(rng.uniform(0, 0.002))  # not a wait: where in the loop the signal lands
            child.send_signal(signal.SIGINT if number % 2 else signal.SIGTERM)
            assert _next(lines) == f"stopped {number}\n", f"stop {number} of {stops} hung"
    finally:
        child.kill()
        child.wait()


def _lines(child: subprocess.Popen[str], lines: queue.Queue[str]) -> None:
    for line in child.stdout or ():
        lines.put(line)


def _next(lines: queue.Queue[str]) -> str:
    """The child's next line; empty when it printed none within a minute (it hangs)."""
    try:
        return lines.get(timeout=60)
    except queue.Empty:
        return ""


def test_a_slow_stop_says_where_each_thread_stands() -> None:
    """While a stop has not ended, ``stop_slow`` names each thread and its innermost frames
    (file, line, function), here this test's own, and how long the stop has waited."""
    log, ended = CapturingLogger(), threading.Event()
    try:
        report_slow_stop(log, "SIGTERM", 0.05, ended)
        reported = time.monotonic() + 60  # generous: only a reporter that never runs reaches it
        while len(log.calls) < 2 and time.monotonic() < reported:
            ended.wait(0.01)
    finally:
        ended.set()
    assert len(log.calls) >= 2, "no stop_slow report"
    report = log.calls[0]
    assert (report.method_name, report.args) == ("warning", ("stop_slow",))
    assert report.kwargs["reason"] == "SIGTERM" and report.kwargs["waited_s"] >= 0.05
    threads = report.kwargs["threads"]
    assert any(
        frame.endswith(" test_a_slow_stop_says_where_each_thread_stands")
        for frame in threads["MainThread"]
    ), threads["MainThread"]
    assert "stop-slow-reports" in threads


class _Writes:
    """A stream that keeps each ``write`` call apart."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_each_log_event_is_one_write_of_its_whole_line() -> None:
    """A line and its newline written apart were split by a process's end: the JVM's output,
    relayed on a daemon thread, left a JSON line glued to the ``error:`` line that followed it
    (CI of ``89857a3``, the S3 end-to-end test's paused pipeline)."""
    stream = _Writes()
    log = make_logger(stream)  # type: ignore[arg-type]
    log.info("jvm_output", message="at java.base/java.util.regex.Pattern$Loop.match")
    log.warning("stop_slow", waited_s=20.0)
    assert len(stream.writes) == 2
    assert all(w.endswith("}\n") and w.count("\n") == 1 for w in stream.writes), stream.writes
