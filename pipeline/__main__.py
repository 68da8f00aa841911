"""``python -m pipeline``."""

import os
import sys

from runtime.process import prepare


def main() -> None:
    prepare()  # before any library loads: runtime/process.py
    from pipeline.cli import main as command_line

    code = command_line()
    # Without tearing down native thread pools: deltalake's and Arrow's runtimes can abort the
    # interpreter's shutdown ("terminate called without an active exception", delta-rs #2184;
    # pipeline/NOTES.md), which would turn a clean stop into exit -6. Spark's JVM ends with its
    # pipe.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
