"""``python -m ingest`` and the ``spanner-cdc-ingest`` script."""

import sys

from runtime.process import prepare


def main() -> int:
    prepare()  # before grpc loads (runtime/process.py): the command line imports the client
    from ingest.cli import main as command_line

    return command_line()


if __name__ == "__main__":
    sys.exit(main())
