"""Spanner side: the Spanner side of a job opened once, the change stream query (DAO), the row
mappers of both dialects and partition modes, retries, the threaded reader (a coordinator and
its partition workers), and the watched columns read from information_schema."""
