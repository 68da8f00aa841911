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
    completed) to ``on_progress`` (pyspark is imported only here)."""
    from pyspark.sql.streaming import StreamingQueryListener

    class Listener(StreamingQueryListener):
        def onQueryStarted(self, event: Any) -> None:
            pass

        def onQueryProgress(self, event: Any) -> None:
            on_progress(event.progress)

        def onQueryIdle(self, event: Any) -> None:
            pass

        def onQueryTerminated(self, event: Any) -> None:
            pass

    return Listener()
