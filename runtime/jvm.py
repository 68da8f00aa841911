"""Spark's JVM started in a session of its own.

A stop signal sent to the product's process group (``kill -TERM -<pgid>``, ``tini -g``, a
terminal's job control) must reach the Python process, which stops the query and hands its
lease over, and not the JVM under it: the JVM ran its shutdown hooks at once, and the job exited
1 with a Py4J traceback instead of stopping cleanly. The JVM still ends with the Python process:
PySpark's gateway exits when its stdin pipe closes. (systemd's default ``KillMode=control-group``
signals every process of the unit, whatever its session: use ``KillMode=mixed``,
docs/operations.md.)
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import subprocess
import threading
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from pathlib import Path
from typing import Any

from runtime.logs import Logger

LOG4J_LINE = re.compile(
    r"^\d\d/\d\d/\d\d \d\d:\d\d:\d\d (TRACE|DEBUG|INFO|WARN|ERROR|FATAL) ([^:]+): ?"
)
"""Spark's default log4j2 pattern: ``%d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n%ex``."""
WORKER_CHATTER = re.compile(r"^Streaming \w+ Python worker ")
"""PySpark's transformWithState workers report each UDF's start and end with whole schemas."""


@contextlib.contextmanager
def own_session(output: Callable[[str], None] | None = None) -> Iterator[None]:
    """While entered, PySpark launches its JVM with ``start_new_session``: wrap the session's
    ``getOrCreate()``. PySpark offers ``popen_kwargs`` only to ``launch_gateway``, which
    ``getOrCreate`` does not pass on, so its ``Popen`` is wrapped for the call. With ``output``,
    every line the JVM writes (log4j, Spark's banner, its Python workers' stderr) is handed to
    it from a thread, instead of going to the process's own stdout and stderr."""
    from pyspark import java_gateway

    launch = java_gateway.Popen

    def popen(*args: Any, **kwargs: Any) -> Any:
        if output is None:
            return launch(*args, **{**kwargs, "start_new_session": True})
        piped = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
        process = launch(*args, **{**kwargs, "start_new_session": True, **piped})
        threading.Thread(
            target=_relay, args=(process.stdout, output), name="jvm-output", daemon=True
        ).start()
        return process

    java_gateway.Popen = popen  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        java_gateway.Popen = launch  # type: ignore[misc]


CODE_CACHE = "-XX:ReservedCodeCacheSize=240m"
"""C1 only shrinks Java 17's code cache to the client VM's 48 MB, and a long-lived driver fills it
with Spark's generated classes and method handles: then a method handle cannot be linked and the
JVM dies (``VirtualMachineError: Out of space in CodeCache``, seen in a session that ran
OPTIMIZE, Z-order and VACUUM beside a job). 240 MB is the server VM's default; it is reserved
address space, committed only as code is compiled."""
JIT_SETTINGS = {
    f"spark.{side}.defaultJavaOptions": f"-XX:TieredStopAtLevel=1 {CODE_CACHE}"
    for side in ("driver", "executor")
}
"""Spark's JVMs compile with C1 only, with the server VM's code cache. A job's JVM mostly runs
cold paths (planning, Delta's log, the state store's commit, Arrow to the Python workers), and
C2 spent its CPU compiling them again: a pipeline's start to its first batch took 45 % less CPU
and 4 s less, and its 20,000-row batches ran 15 % faster, though 250,000-row ones ran 17 %
slower (bench/RESULTS.md, "The JVM's compiler"). Administrators' defaults, so a user's
``spark.*.extraJavaOptions`` come after them and win (``-XX:TieredStopAtLevel=4``)."""


CLASS_ARCHIVE = "spark-classes.jsa"
"""Spark's classes as a job's driver loads them, archived for Java's class data sharing beside the
product's jars (``python -m pipeline.session fetch`` makes it): a driver maps them instead of
reading, parsing and verifying some 17,000 classes from jars. A pipeline's start took 14 % less
CPU and reached its first batch 2.3 s sooner (bench/RESULTS.md, "Spark's classes shared"),
about 6 % less again once Delta's classes were in it too, and 3 % less again with the classes of
the job's stateful operator (``pipeline.class_archive``)."""


def driver_java_options(jars: Path) -> dict[str, str]:
    """The driver's default JVM options: C1 only, and the class archive when ``jars`` holds
    one. A JVM whose jars changed since the archive was made starts without it, silently:
    ``refused_class_archive`` tells.

    The product's jars in ``jars`` (Delta's) lead the driver's class path, whichever runtime
    starts it: loaded by the JVM's own class loader, not Spark's, their classes are archived
    too, and one archive's class path is every driver's (a class path may only add to the
    archive's at its end)."""
    archive = jars / CLASS_ARCHIVE
    options = JIT_SETTINGS["spark.driver.defaultJavaOptions"]
    if archive.is_file():
        options += f" -XX:SharedArchiveFile={archive}"
    settings = {"spark.driver.defaultJavaOptions": options}
    own_jars = sorted(jars.glob("*.jar"))
    if own_jars:
        settings["spark.driver.extraClassPath"] = os.pathsep.join(map(str, own_jars))
    return settings


def refused_class_archive(session: Any) -> str | None:
    """The class archive a session's driver was given but runs without (its jars changed since
    the archive was made); None when it maps it, or was given none."""
    jvm = session._jvm
    diagnostics = jvm.java.lang.management.ManagementFactory.getPlatformMXBean(
        jvm.java.lang.Class.forName("com.sun.management.HotSpotDiagnosticMXBean")
    )
    archive = str(diagnostics.getVMOption("SharedArchiveFile").getValue())
    in_use = diagnostics.getVMOption("UseSharedSpaces").getValue() == "true"
    return archive if archive and not in_use else None


def loopback_when_unresolvable(
    master: str | None, environ: MutableMapping[str, str] = os.environ
) -> None:
    """A local master's driver binds to the loopback when the host's own name does not resolve
    (sandboxed builders, some pods): Spark asks ``InetAddress.getLocalHost`` otherwise, and the
    JVM fails to start (``UnknownHostException``). Values already set win; a cluster's driver
    keeps its address."""
    if not (master or "").startswith("local") or _resolves(socket.gethostname()):
        return
    environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    environ.setdefault("SPARK_LOCAL_HOSTNAME", "localhost")


def _resolves(host: str) -> bool:
    try:
        socket.gethostbyname(host)
    except OSError:
        return False
    return True


def _relay(stream: Iterable[str], output: Callable[[str], None]) -> None:
    for line in stream:
        output(line.rstrip("\n"))


class JvmLog:
    """The JVM's lines as the process's own events (``jvm_output``): a log4j line at its level
    with its logger, a line under it (a stack trace) at the same level; PySpark's workers'
    per-UDF reports at debug; blank lines dropped."""

    def __init__(self, log: Logger) -> None:
        self.log = log
        self._level = logging.INFO

    def __call__(self, line: str) -> None:
        if not line.strip():
            return
        header = LOG4J_LINE.match(line)
        if header is not None:
            self._level = _LEVELS[header.group(1)]
            self.log.log(
                self._level, "jvm_output", logger=header.group(2), message=line[header.end() :]
            )
            return
        level = logging.DEBUG if WORKER_CHATTER.match(line) else self._level
        self.log.log(level, "jvm_output", message=line)


_LEVELS = {
    "TRACE": logging.DEBUG,
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARN": logging.WARNING,
    "ERROR": logging.ERROR,
    "FATAL": logging.CRITICAL,
}
"""log4j's levels as the logging levels structlog filters on."""
