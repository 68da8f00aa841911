"""Cloud Spanner change streams → whole, ordered transactions (and, later, Delta Lake)."""
