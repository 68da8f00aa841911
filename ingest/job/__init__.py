"""The job both ingest runtimes stand on, as peers: its configuration, taking it (stand by, resume
or start), handing it over, its snapshot window, its metrics."""
