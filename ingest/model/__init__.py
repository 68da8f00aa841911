"""Plain records every stage shares: change records and transactions, column values,
timestamps, canonical JSON, snapshot progress, resume points. Imports nothing else of the
product."""
