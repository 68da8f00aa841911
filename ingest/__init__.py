"""Cloud Spanner change streams → a Delta change-log table, exactly once, whole transactions in
commit order. Stages, in flow order: model → contract → changestream → rules → delta → service."""
