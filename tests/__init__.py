"""Tests. Their processes talk gRPC (the Spanner client, the scripted server) and then start
subprocesses (Spark's JVM, the product's services), so they prepare themselves as the product's
entry points do (``runtime/process.py``); the product's processes they start get an environment
without what that sets (``emulator.processes.Process``), so each sets it itself."""

from runtime.process import prepare

prepare()
