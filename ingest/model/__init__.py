"""Plain records and the helpers every stage shares: change records and transactions, column
values, timestamps, canonical JSON, option parsing and logs. Imports nothing else of ``ingest``."""
