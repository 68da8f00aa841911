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
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def own_session() -> Iterator[None]:
    """While entered, PySpark launches its JVM with ``start_new_session``: wrap the session's
    ``getOrCreate()``. PySpark offers ``popen_kwargs`` only to ``launch_gateway``, which
    ``getOrCreate`` does not pass on, so its ``Popen`` is wrapped for the call."""
    from pyspark import java_gateway

    launch = java_gateway.Popen

    def popen(*args: Any, **kwargs: Any) -> Any:
        return launch(*args, **{**kwargs, "start_new_session": True})

    java_gateway.Popen = popen  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        java_gateway.Popen = launch  # type: ignore[misc]
