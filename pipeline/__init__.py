"""The Spark job: change-log table → transformWithState (per table and key) → Delta mirrors.
Stages, in flow order: catalog and types (table shapes) → state → processor → mirror → job."""
