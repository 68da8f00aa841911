"""A Delta version checksum (``_delta_log/<version>.crc``) beside each change-log commit.

delta-spark reads a new version's protocol and metadata from its checksum when there is one, and
otherwise runs a Spark job over the log since the last checkpoint to find them. The pipeline's
Delta source makes a new snapshot of the change log at every micro-batch that finds a new version,
so without checksums each batch paid that job (bench/RESULTS.md, "The change log's version
checksums"). delta-rs writes none, so the sink writes them.

A checksum must hold exactly what the version holds: delta-spark checks it against the table's
state before its own commits (a user's OPTIMIZE through Spark) and stops on a mismatch. So it is
made from the version's own snapshot as delta-rs loaded it, and written only if absent (a
checksum another writer made for that version is left as it is). It is advisory: a reader
without it falls back to the job, so a failed write is logged and the commit stands.
"""

from __future__ import annotations

import json
from typing import Any

import structlog
from deltalake import DeltaTable
from obstore.exceptions import BaseError as ObjectStoreError

from runtime.conditional import ConditionalObject, VersionChanged


def version_checksum(table: DeltaTable) -> dict[str, Any]:
    """The checksum of the version ``table`` is loaded at, as delta-spark's ``VersionChecksum``
    spells it: the live files' count and bytes, the protocol and the metadata."""
    files = table.get_add_actions(flatten=False)
    sizes = [int(size) for size in files.column("size_bytes").to_pylist()] if files.num_rows else []
    metadata, protocol = table.metadata(), table.protocol()
    protocol_action: dict[str, Any] = {
        "minReaderVersion": protocol.min_reader_version,
        "minWriterVersion": protocol.min_writer_version,
    }
    if protocol.reader_features is not None:
        protocol_action["readerFeatures"] = list(protocol.reader_features)
    if protocol.writer_features is not None:
        protocol_action["writerFeatures"] = list(protocol.writer_features)
    return {
        "tableSizeBytes": sum(sizes),
        "numFiles": len(sizes),
        "numMetadata": 1,
        "numProtocol": 1,
        "protocol": protocol_action,
        "metadata": {
            "id": metadata.id,
            "name": metadata.name,
            "description": metadata.description,
            "format": {"provider": "parquet", "options": {}},
            "schemaString": table.schema().to_json(),
            "partitionColumns": list(metadata.partition_columns),
            "configuration": dict(metadata.configuration),
            "createdTime": metadata.created_time,
        },
    }


def write_version_checksum(
    table: DeltaTable, table_uri: str, log: structlog.typing.FilteringBoundLogger
) -> None:
    """Write the checksum of ``table``'s version if none is there."""
    version = table.version()
    name = f"{version:020d}.crc"
    try:
        data = json.dumps(version_checksum(table), separators=(",", ":")).encode()
        ConditionalObject(f"{table_uri.rstrip('/')}/_delta_log", name).create(data)
    except VersionChanged:
        return
    except (OSError, ValueError, ObjectStoreError) as error:
        log.warning("delta_checksum_not_written", delta_version=version, cause=repr(error))
