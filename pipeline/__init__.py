"""The Spark job (transformWithState over the change-log table). Not built yet: see issue 4."""
