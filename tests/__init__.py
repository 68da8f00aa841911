"""Tests. Their processes talk gRPC (the Spanner client, the scripted server) and then start
subprocesses (Spark's JVM, the product's services): gRPC's fork handlers are turned off before
grpc loads, see ``emulator/__init__.py``."""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
