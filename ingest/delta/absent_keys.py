"""Which keys of a table the change log holds alive before T1 but a snapshot at T1 did not find,
and which it deleted after T1.

An on-demand snapshot replaces a table's history from T1 on: rows it reads are newer images, and a
key the change log still holds alive that Spanner no longer has at T1 (deleted while the stream
did not capture the table, or lost to a broken mirror's history) must be deleted at T1 too. The
change log is the mirrors' only source, so the keys alive in it are the keys alive in any mirror
built from it.
"""

from __future__ import annotations

from collections.abc import Iterable

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from ingest.contract.changelog import DELETE, DELETES, SCHEMA_ROW, SNAPSHOT_ROW, in_total_order
from ingest.model.timestamps import Nanos, to_rfc3339

_COLUMNS = [
    "keys",
    "commit_timestamp_text",
    "server_transaction_id",
    "record_sequence",
    "mod_index",
    "mod_type",
]


def absent_keys(
    table: DeltaTable, table_name: str, read_timestamp: Nanos, found: Iterable[str]
) -> list[str]:
    """Keys (as the change log spells them) whose last change before ``read_timestamp`` leaves
    them alive, and that neither the snapshot's landed rows at ``read_timestamp`` nor ``found``
    (its rows not landed yet) hold; sorted.

    Changes at exactly T1 by a transaction are in what the snapshot read, so only changes before
    T1 decide what was alive. Memory: the table's rows in the change log, keys and positions only.
    """
    at = to_rfc3339(read_timestamp)
    rows = table.to_pyarrow_dataset().to_table(
        columns=_COLUMNS,
        filter=(pc.field("table_name") == table_name) & (pc.field("mod_type") != SCHEMA_ROW),
        use_threads=False,
    )
    snapshot_rows = pc.and_(
        pc.equal(rows["commit_timestamp_text"], at), pc.equal(rows["mod_type"], SNAPSHOT_ROW)
    )
    landed = set(rows.filter(snapshot_rows)["keys"].to_pylist())
    before = in_total_order(rows.filter(pc.less(rows["commit_timestamp_text"], at)), ["keys"])
    last = before.group_by("keys", use_threads=False).aggregate([("mod_type", "last")])
    alive = last.filter(pc.invert(pc.is_in(last["mod_type_last"], pa.array(DELETES))))
    present = landed.union(found)
    return sorted(k for k in alive["keys"].to_pylist() if k not in present)


def deleted_after(table: DeltaTable, table_name: str, read_timestamp: Nanos) -> set[str]:
    """Keys the stream deleted after ``read_timestamp`` (a snapshot's T1), as landed so far: a
    resumed snapshot must not land their images at T1 (``TableSnapshots``). Memory: those keys."""
    rows = table.to_pyarrow_dataset().to_table(
        columns=["keys"],
        filter=(pc.field("table_name") == table_name)
        & (pc.field("mod_type") == DELETE)
        & (pc.field("commit_timestamp_text") > to_rfc3339(read_timestamp)),
        use_threads=False,
    )
    return set(rows["keys"].to_pylist())


def holds_rows_before(table: DeltaTable, table_name: str, read_timestamp: Nanos) -> bool:
    """Whether the change log has rows of the table before ``read_timestamp``: an initial
    snapshot then has keys to delete (an earlier job's), and only then pays for finding them."""
    found = table.to_pyarrow_dataset().head(
        1,
        columns=["keys"],
        filter=(pc.field("table_name") == table_name)
        & (pc.field("mod_type") != SCHEMA_ROW)
        & (pc.field("commit_timestamp_text") < to_rfc3339(read_timestamp)),
    )
    return found.num_rows > 0


def keys_of_earlier_jobs(
    table: DeltaTable, table_name: str, read_timestamp: Nanos, found: Iterable[str]
) -> list[str]:
    """What an initial snapshot at T0 must delete: keys alive in the change log before T0 (an
    earlier job's rows, such as a snapshot it abandoned) that it did not find. Free on a change
    log the job started."""
    if not holds_rows_before(table, table_name, read_timestamp):
        return []
    return absent_keys(table, table_name, read_timestamp, found)
