"""The sample banking database on the Cloud Spanner emulator: DDL, bootstrap, workload."""
