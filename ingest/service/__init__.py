"""The composition root: configuration, the long-running service (lease, health, signals) and
the command line."""
