"""What the product's processes set for themselves before any library loads.

gRPC's fork handlers (on by default in grpcio) restart a poller in every child forked from a
process that holds channels; a child that then closes descriptors before it execs, as
``subprocess.Popen`` with ``preexec_fn`` does when PySpark launches its JVM, can crash there
(grpc/grpc#43055: ``epoll_wait ... Bad file descriptor``, then ``JAVA_GATEWAY_EXITED``).
``spark-run`` opens Spanner before it starts Spark, so 2 of 5 starts died on a loaded machine.
No process of the product forks without exec, so the handlers are turned off.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

PROCESS_ENVIRONMENT = {"GRPC_ENABLE_FORK_SUPPORT": "false"}
"""Read by grpc when it loads; the product's children (Spark's JVM, its Python workers) inherit
it."""


def prepare(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set the process's own environment; each entry point calls it before importing grpc."""
    environ.update(PROCESS_ENVIRONMENT)
