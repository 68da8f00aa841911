"""Delta side: the change-log contract (rows and checkpoint, shared with the pipeline), the sink
that commits exactly once, and the flush policy."""
