"""A Spark session as both Spark runtimes start it (the pipeline and ``ingest spark-run``).

What every session of the product needs is set here once: the UI off, the JIT settings and
the class archive, the object stores' Hadoop settings and jars, the JVM in a session of its own
bound to the loopback where the host's name does not resolve, and its log level. A runtime adds
only its own settings.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from runtime.jvm import (
    JIT_SETTINGS,
    JvmLog,
    driver_java_options,
    loopback_when_unresolvable,
    own_session,
    refused_class_archive,
)
from runtime.storage import jars_dir, spark_config, store_jars

COMMON_SETTINGS = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.python.daemon.module": "runtime.python_daemon",
    **JIT_SETTINGS,
}


def session_settings(
    own: Mapping[str, str], jars: Sequence[Path] = (), storage_uris: Sequence[str] = ()
) -> dict[str, str]:
    """Every setting a session starts with: the common ones, the object stores', ``jars`` and
    the stores' jars for ``storage_uris`` (S3A's, GCS's), then the runtime's ``own`` (they win)."""
    every_jar = [*jars, *(jar for jar in store_jars(storage_uris) if jar not in jars)]
    settings = {**COMMON_SETTINGS, **driver_java_options(jars_dir()), **spark_config()}
    if every_jar:
        settings["spark.jars"] = ",".join(map(str, every_jar))
    return {**settings, **own}


def start_session(
    app_name: str,
    master: str | None,
    settings: Mapping[str, str],
    jvm_output: JvmLog | None = None,
) -> Any:  # pyspark.sql.SparkSession (imported lazily: pyspark is heavy)
    """The session (``session_settings``' result as ``settings``); the JVM's lines to
    ``jvm_output`` when given (``runtime.jvm.JvmLog``). A stop signal to the process's group
    reaches Python only. PySpark's context replaces SIGINT's handler with one that cancels every
    job and raises ``KeyboardInterrupt`` in the main thread; the process's own is put back, so a
    Ctrl-C is the same clean stop as SIGTERM."""
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name)
    if master:
        builder = builder.master(master)
    for key, value in settings.items():
        builder = builder.config(key, value)
    loopback_when_unresolvable(master)
    interrupt = signal.getsignal(signal.SIGINT)
    with own_session(jvm_output):
        session = builder.getOrCreate()
    if interrupt is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, interrupt)  # PySpark's own raises KeyboardInterrupt
    session.sparkContext.setLogLevel("ERROR")
    refused = refused_class_archive(session)
    if refused is not None and jvm_output is not None:
        jvm_output.log.warning(
            "class_archive_unused",
            archive=refused,
            reason="the jars changed since it was made: the driver starts slower",
            remedy="python -m pipeline.session fetch <jars dir> makes it again",
        )
    return session
