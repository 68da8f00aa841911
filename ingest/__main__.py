import sys

from ingest.service.cli import main

sys.exit(main())
