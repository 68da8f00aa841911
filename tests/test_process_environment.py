"""The product's processes set what they need themselves: a user's environment has nothing a
test harness would set (issue 41: ``spark-run`` died at start in users' environments while the
suite, which had set ``GRPC_ENABLE_FORK_SUPPORT`` for every process it started, never did)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from structlog.testing import CapturingLogger

from emulator.processes import Process
from runtime.process import PROCESS_ENVIRONMENT
from runtime.stopping import stop_on_signals

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


def test_a_stop_signal_stops_at_once_and_a_slow_stop_says_where_each_thread_stands() -> None:
    """SIGTERM sets the stop; while the stop has not ended, ``stop_slow`` names each thread and
    its innermost frames (file, line, function), here this test's own. A second signal starts no
    second reporter."""
    log, ended = CapturingLogger(), threading.Event()
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        stop = stop_on_signals(log, slow_after_s=0.05, ended=ended)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.wait(30)
        os.kill(os.getpid(), signal.SIGINT)
        reported = time.monotonic() + 60  # generous: only a reporter that never runs reaches it
        while len(log.calls) < 2 and time.monotonic() < reported:
            stop.wait(0.01)
        reporters = [t for t in threading.enumerate() if t.name == "stop-slow-reports"]
    finally:
        ended.set()
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert len(log.calls) >= 2, "no stop_slow report"
    report = log.calls[0]
    assert (report.method_name, report.args) == ("warning", ("stop_slow",))
    assert report.kwargs["reason"] == "SIGTERM" and report.kwargs["waited_s"] >= 0.05
    threads = report.kwargs["threads"]
    assert any(
        frame.endswith(
            " test_a_stop_signal_stops_at_once_and_a_slow_stop_says_where_each_thread_stands"
        )
        for frame in threads["MainThread"]
    ), threads["MainThread"]
    assert "stop-slow-reports" in threads
    assert len(reporters) == 1, "a second signal started a second reporter"
