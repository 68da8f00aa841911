"""A processor's output table, ``<processor_root>/<name>``: its rows of each micro-batch appended
once (the batch's ``txn``, as the mirrors; a replayed batch appends nothing). A small batch is
appended by delta-rs on the driver, a large one by Spark. Fields a later deployment adds to the
output are added to the table; any other change of the output schema is refused at start."""

from __future__ import annotations

import json
from collections.abc import Mapping

import pyarrow as pa
from pyspark.sql import DataFrame
from pyspark.sql import types as T

from pipeline.merges import (
    commit_once,
    commit_properties,
    holds_batch,
    table_version,
    utc_timestamps,
)
from pipeline.mirror import create_mirror
from runtime.errors import BadInput
from runtime.logs import Logger
from runtime.storage import delta_storage_options


class OutputSchemaChanged(BadInput, ValueError):
    """A processor's output changed other than by added fields."""


def output_uri(root: str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}"


def ensure_output(uri: str, schema: T.StructType, name: str, log: Logger) -> None:
    """Create the output table, or add the fields the processor's output gained."""
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    options = delta_storage_options(uri)
    try:
        table = DeltaTable(uri, storage_options=options)
    except TableNotFoundError:
        create_mirror(uri, schema)
        log.info("processor_output_created", processor=name, uri=uri)
        return
    existing = T.StructType.fromJson(json.loads(table.schema().to_json()))
    have = {f.name: f.dataType for f in existing.fields}
    changed = [f.name for f in schema.fields if f.name in have and have[f.name] != f.dataType]
    if changed:
        raise OutputSchemaChanged(
            f"processor {name!r}: output fields {changed} changed type; only added fields are "
            "allowed (write to a new processor name for another shape)"
        )
    added = [f for f in schema.fields if f.name not in have]
    if added:
        from deltalake import Schema

        table.alter.add_columns(list(Schema.from_json(T.StructType(added).json()).fields))
        log.info("processor_output_fields_added", processor=name, fields=[f.name for f in added])


def append_batch(
    rows: DataFrame,
    uri: str,
    app_id: str,
    batch_id: int,
    max_rows_on_driver: int,
    log: Logger,
    metadata: Mapping[str, str] | None = None,
) -> tuple[int, int]:
    """Append one batch's output rows once: the table's version holding them, and how many
    this call appended (none when the table held the batch already, a lost answer included)."""
    return commit_once(
        f"output {uri.rstrip('/').rsplit('/', 1)[-1]}",
        lambda: _append(rows, uri, app_id, batch_id, max_rows_on_driver, metadata),
        batch_id,
        log,
    )


def _append(
    rows: DataFrame,
    uri: str,
    app_id: str,
    batch_id: int,
    max_rows_on_driver: int,
    metadata: Mapping[str, str] | None,
) -> tuple[int, int]:
    from deltalake import DeltaTable, write_deltalake

    options = delta_storage_options(uri)
    table = DeltaTable(uri, storage_options=options)
    if holds_batch(table, app_id, batch_id):
        return table.version(), 0
    count = rows.count()
    if count <= max_rows_on_driver:
        arrow = rows.toArrow()
        arrow = arrow.cast(
            pa.schema([pa.field(f.name, utc_timestamps(f.type)) for f in arrow.schema])
        )
        write_deltalake(
            table,
            arrow,
            mode="append",
            commit_properties=commit_properties(app_id, batch_id, metadata),
        )
        return DeltaTable(uri, storage_options=options).version(), count
    writer = (
        rows.write.format("delta")
        .mode("append")
        .option("txnAppId", app_id)
        .option("txnVersion", batch_id)
    )
    if metadata:
        writer = writer.option("userMetadata", json.dumps(dict(metadata), sort_keys=True))
    writer.save(uri)
    return table_version(uri), count
