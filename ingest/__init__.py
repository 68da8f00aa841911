"""Cloud Spanner change streams → a Delta change-log table, exactly once, whole transactions in
commit order. Stages, in flow order: model → changestream → rules → delta → service."""
