import os
import sys

from pipeline.cli import main

code = main()
# Without tearing down native thread pools: deltalake's and Arrow's runtimes can abort the
# interpreter's shutdown ("terminate called without an active exception", delta-rs #2184;
# pipeline/NOTES.md), which would turn a clean stop into exit -6. Spark's JVM ends with its pipe.
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
