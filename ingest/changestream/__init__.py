"""Spanner side: the change stream query (DAO), the row mapper of both dialects, retries, the
threaded reader, and the watched columns read from information_schema."""
