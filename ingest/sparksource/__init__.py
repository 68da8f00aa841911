"""The change stream as a Spark streaming source: one stream read by a cluster's executors,
landing the service's change log (docs/scaling.md, design B)."""
