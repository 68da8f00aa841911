"""The sample banking database on the Cloud Spanner emulator: DDL, bootstrap, workload.

Its tools (``make run``) use the Spanner client and then start subprocesses, so they prepare
themselves as the product's entry points do (``runtime/process.py``, grpc/grpc#43055); the
product's processes they start get an environment without what that sets
(``emulator.processes.Process``), so each sets it itself.
"""

from runtime.process import prepare

prepare()
