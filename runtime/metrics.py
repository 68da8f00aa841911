"""What both Spark processes (the pipeline and the Spark source) need to publish metrics: their
registry served at ``/metrics``, and Spark's query progress handed to a callback."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server


def serve(registry: CollectorRegistry, port: int) -> Callable[[], None]:
    """Serve ``/metrics`` on ``port`` (all interfaces); returns what stops the server."""
    server, thread = start_http_server(port, registry=registry)

    def close() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return close


def progress_listener(on_progress: Callable[[Any], None]) -> Any:
    """A ``StreamingQueryListener`` handing each ``StreamingQueryProgress`` (a micro-batch
    completed) to ``on_progress`` (pyspark is imported only here).

    pyspark's own bridge builds each progress from the JVM's object field by field, one Py4J
    call a field: about a tenth of a running pipeline's JVM CPU went to it (bench/RESULTS.md,
    "A micro-batch's CPU"). This one reads the progress as JSON in one call, as
    ``StreamingQuery.lastProgress`` does, and converts no event it does not use."""
    import json

    from pyspark import SparkContext
    from pyspark.sql.streaming.listener import (
        JStreamingQueryListener,
        QueryProgressEvent,
        StreamingQueryListener,
        StreamingQueryProgress,
    )

    class FromJson(JStreamingQueryListener):
        def onQueryStarted(self, jevent: Any) -> None:
            pass

        def onQueryProgress(self, jevent: Any) -> None:
            progress = StreamingQueryProgress.fromJson(json.loads(jevent.progress().json()))
            self.pylistener.onQueryProgress(QueryProgressEvent(progress))

        def onQueryIdle(self, jevent: Any) -> None:
            pass

        def onQueryTerminated(self, jevent: Any) -> None:
            pass

    class Listener(StreamingQueryListener):
        def onQueryStarted(self, event: Any) -> None:
            pass

        def onQueryProgress(self, event: Any) -> None:
            on_progress(event.progress)

        def onQueryIdle(self, event: Any) -> None:
            pass

        def onQueryTerminated(self, event: Any) -> None:
            pass

        @property
        def _jlistener(self) -> Any:
            """What ``addListener`` and ``removeListener`` register: the one bridge."""
            if not hasattr(self, "_jlistenerobj"):
                jvm = SparkContext._jvm
                assert jvm is not None
                self._jlistenerobj = jvm.PythonStreamingQueryListenerWrapper(FromJson(self))
            return self._jlistenerobj

    return Listener()
