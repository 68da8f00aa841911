"""The job's state: state variable schemas, their Avro form, the schema registry and the
evolution checker, and the Spark checkpoint's lock."""
