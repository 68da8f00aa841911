"""The pure rules of reading a change stream: partition lifecycle and watermarks, whole
transactions released in commit order, where a job resumes. Import only ``ingest.model``."""
