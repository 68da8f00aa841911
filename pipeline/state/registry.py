"""The state schemas each deployment ran with, recorded next to the checkpoint."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from pyarrow import fs as pafs
from pyspark.sql import types as T

from pipeline.state.avro import avro_schema
from pipeline.state.variables import STATE_LAYOUT
from runtime.storage import arrow_filesystem


@dataclass(frozen=True, slots=True)
class Deployment:
    """The state schemas one deployment ran with, as recorded."""

    number: int
    schemas: dict[str, T.StructType]
    deleted: tuple[str, ...] = ()
    recorded_at: str = ""
    layout: int = STATE_LAYOUT


def replace_file(filesystem: pafs.FileSystem, path: str, content: bytes) -> None:
    """Write ``path`` whole: a temporary file moved over it (a rename on a local disk, a single
    put on an object store), so a reader never sees half a file."""
    temporary = f"{path}.tmp"
    with filesystem.open_output_stream(temporary) as stream:
        stream.write(content)
    filesystem.move(temporary, path)


@dataclass(slots=True)
class SchemaRegistry:
    """``<checkpoint>/_state_schemas/NNNNNN.json``: a file per deployment that changed schemas."""

    checkpoint_uri: str
    _history: list[Deployment] | None = field(default=None, init=False)

    @property
    def _folder(self) -> tuple[pafs.FileSystem, str]:
        filesystem, root = arrow_filesystem(self.checkpoint_uri)
        return filesystem, f"{root.rstrip('/')}/_state_schemas"

    def history(self) -> list[Deployment]:
        if self._history is None:
            filesystem, folder = self._folder
            selector = pafs.FileSelector(folder, allow_not_found=True)
            infos = filesystem.get_file_info(selector)
            files = sorted(info.path for info in infos if info.path.endswith(".json"))
            self._history = [self._read(filesystem, path) for path in files]
        return self._history

    @staticmethod
    def _read(filesystem: pafs.FileSystem, path: str) -> Deployment:
        with filesystem.open_input_stream(path) as stream:
            document = json.loads(stream.read())
        return Deployment(
            number=document["number"],
            schemas={
                name: T.StructType.fromJson(variable["spark"])
                for name, variable in document["variables"].items()
            },
            deleted=tuple(document.get("deleted", [])),
            recorded_at=document.get("recorded_at", ""),
            layout=document.get("layout", 1),
        )

    def latest(self) -> Deployment | None:
        history = self.history()
        return history[-1] if history else None

    def record(self, schemas: Mapping[str, T.StructType], deleted: tuple[str, ...]) -> Deployment:
        """Record a deployment if its schemas differ from the latest one; return the latest."""
        latest = self.latest()
        if latest is not None and latest.schemas == dict(schemas) and not deleted:
            return latest
        number = 1 if latest is None else latest.number + 1
        deployment = Deployment(
            number=number,
            schemas=dict(schemas),
            deleted=deleted,
            recorded_at=dt.datetime.now(dt.UTC).isoformat(),
        )
        document = {
            "layout": STATE_LAYOUT,
            "number": number,
            "recorded_at": deployment.recorded_at,
            "deleted": list(deleted),
            "variables": {
                name: {"spark": struct.jsonValue(), "avro": avro_schema(struct, name)}
                for name, struct in sorted(schemas.items())
            },
        }
        filesystem, folder = self._folder
        filesystem.create_dir(folder, recursive=True)
        with filesystem.open_output_stream(f"{folder}/{number:06d}.json") as stream:
            stream.write(json.dumps(document, indent=1, sort_keys=True).encode())
        self.history().append(deployment)
        return deployment
