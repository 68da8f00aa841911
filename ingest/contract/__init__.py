"""What the ingest service and the pipeline agree on: the change log.

Imports only ``ingest.model``."""
