"""Cloud Spanner change streams → a Delta change-log table, exactly once, whole transactions in
commit order. The stages and their layout: docs/design.md, "Layout"."""
