"""The sample banking database on the Cloud Spanner emulator: DDL, bootstrap, workload.

Its tools (``make run``) use the Spanner client and then start subprocesses. With grpcio's fork
handlers on, a child of a process with live channels can crash before it execs (grpc/grpc#43055:
EBADF in the child's restarted poller; here Spark's JVM launch failed once in CI, and 7 of 900
``Popen`` calls failed in a probe, 0 of 900 with the handlers off). Nothing here forks without
exec, so they are turned off before grpc loads.
"""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
