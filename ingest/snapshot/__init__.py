"""The snapshot: captured tables read at one timestamp in key order (the reader, a DAO), the
initial snapshot's workers and committer, and on-demand snapshots of some tables riding the
stream's commits; everything it lands goes through ``commits.SnapshotCommits``."""
