"""The initial snapshot's source: captured tables read at one timestamp, in key order."""
