"""Where the mirrors stand in the change log: recorded after each batch's MERGEs, read by a rebase.

``<mirror_root>/_cut.json`` names the first change-log version not wholly in the mirrors, taken
from the batch's end offset in the Spark checkpoint (``offsets/<batch>``, written before the batch
runs). It lives beside the mirrors, not in the checkpoint, so a rebase after the checkpoint is
lost still knows where to start. It is written after the MERGEs, so it never runs ahead of them;
a crash before it is written leaves the previous batch's cut, and the rows in between are read
again: applying a stretch of the change log twice gives the same rows (each change carries its
values, not a difference), and the seed's per-row positions skip what a row already holds.

It never moves backwards: a job paused between its last lease check and this write, and
replaced meanwhile, must not undo its replacement's later cut, so the file is replaced only
against the version its writer read and only by a cut that is not behind it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from deltalake import DeltaTable

from runtime.conditional import ConditionalObject, VersionChanged
from runtime.storage import arrow_filesystem, delta_storage_options

CUT_FILE = "_cut.json"
END_INDEX = 2**63 - 1
"""Delta's offset index once every file of the offset's version is processed."""
BASE_INDEX = -1
"""Delta's offset index before the first file of the offset's version."""


@dataclass(frozen=True, slots=True)
class Cut:
    starting_version: int
    """The first change-log version a new state generation must read."""
    generation: int
    batch_id: int
    changelog_id: str = ""
    """The change log's Delta table id: a rebase refuses another job's mirrors. "" in cuts
    written before it was recorded."""


def next_version(offset: dict[str, object]) -> int:
    """The first change-log version a Delta source end offset does not hold wholly. A version
    read in part is read again whole (see the module's note); so is the initial snapshot of a
    query that started without a starting version, read in part."""
    version = int(str(offset["reservoirVersion"]))
    index = int(str(offset["index"]))
    if offset.get("isStartingVersion") and index != END_INDEX:
        return 0
    if index == END_INDEX:
        return version + 1
    return version


def batch_end_offset(checkpoint_uri: str, batch_id: int) -> dict[str, object] | None:
    """The change log's end offset of a planned batch (Spark's ``offsets/<batch>``: a version
    line, the batch's metadata, then one line per source)."""
    filesystem, root = arrow_filesystem(checkpoint_uri)
    try:
        with filesystem.open_input_stream(f"{root.rstrip('/')}/offsets/{batch_id}") as stream:
            lines = stream.read().decode().splitlines()
    except FileNotFoundError:
        return None
    sources = [line for line in lines[2:] if line.strip() and line.strip() != "-"]
    if not sources:
        return None
    offset: dict[str, object] = json.loads(sources[0])
    return offset


def record(mirror_root: str, cut: Cut) -> bool:
    """Write ``cut`` unless the recorded one is ahead of it or is it; whether this call wrote it."""
    place = ConditionalObject(mirror_root, CUT_FILE)
    data = json.dumps(asdict(cut)).encode()
    while True:
        found = place.read()
        if found is not None and _ahead(Cut(**json.loads(found.data)), cut):
            return False
        try:
            if found is None:
                place.create(data)
            else:
                place.replace(data, found.version)
            return True
        except VersionChanged:
            continue  # another writer, or this one's own write whose answer was lost


def _ahead(recorded: Cut, cut: Cut) -> bool:
    """The recorded cut is further along the same change log: a later version, or the same
    one from a later generation or batch (the writer's own cut counts as ahead: nothing to do)."""
    if recorded.changelog_id and cut.changelog_id and recorded.changelog_id != cut.changelog_id:
        return False
    order = (recorded.starting_version, recorded.generation, recorded.batch_id)
    return order >= (cut.starting_version, cut.generation, cut.batch_id)


def changelog_id(changelog_uri: str) -> str:
    """The change-log table's own id (Delta's metadata id, fixed when the table was made)."""
    options = delta_storage_options(changelog_uri)
    return str(DeltaTable(changelog_uri, storage_options=options).metadata().id)


def read(mirror_root: str) -> Cut | None:
    filesystem, root = arrow_filesystem(mirror_root)
    try:
        with filesystem.open_input_stream(f"{root.rstrip('/')}/{CUT_FILE}") as stream:
            return Cut(**json.loads(stream.read()))
    except FileNotFoundError:
        return None
