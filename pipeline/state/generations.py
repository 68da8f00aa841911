"""State generations: a rebase starts a new state store seeded from the mirrors, with a Spark
checkpoint and a schema registry of its own, so its evolution counts start from zero.

    <checkpoint>/                     the job's lock; generation 0's Spark checkpoint and registry
    <checkpoint>/_generation.json     which generation is current, and how it starts
    <checkpoint>/generation-000N/     generation N's Spark checkpoint, registry and seed

The pointer is written only once the new generation's seed is in place, so a crash at any point
leaves either the old generation current (nothing changed) or the new one ready to start. The
old generation's folders are removed once the new one has committed its first batch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from pyarrow import fs as pafs

from pipeline.state.checkpoint import committed_batches
from pipeline.state.registry import replace_file
from runtime.storage import arrow_filesystem

POINTER = "_generation.json"
SPARK_FOLDERS = ("offsets", "commits", "state", "sources", "metadata", "_state_schemas")
"""What a generation's folder holds besides its seed (generation 0 shares the root with the
lock and the pointer)."""


@dataclass(frozen=True, slots=True)
class Generation:
    number: int
    uri: str
    """Its Spark checkpoint and state schema registry."""
    starting_version: int | None = None
    """The change-log version its stream starts at; None: the change log's first."""
    seed_uri: str | None = None
    """The mirrors' rows its first batch loads as initial state; None: it starts empty."""
    reason: str = ""
    cut: str = ""
    """The change log's low watermark W at the cut: the seed holds everything up to it."""


def root_of(generation: Generation) -> str:
    """The job's checkpoint folder, which holds every generation."""
    return (
        generation.uri if generation.number == 0 else generation.uri.rstrip("/").rsplit("/", 1)[0]
    )


def _root(checkpoint_uri: str) -> tuple[pafs.FileSystem, str]:
    filesystem, root = arrow_filesystem(checkpoint_uri)
    return filesystem, root.rstrip("/")


def generation_uri(checkpoint_uri: str, number: int) -> str:
    return (
        checkpoint_uri if number == 0 else f"{checkpoint_uri.rstrip('/')}/generation-{number:04d}"
    )


def current(checkpoint_uri: str) -> Generation:
    """The generation the job runs: the pointer's, or generation 0 when there is none."""
    filesystem, root = _root(checkpoint_uri)
    try:
        with filesystem.open_input_stream(f"{root}/{POINTER}") as stream:
            document = json.loads(stream.read())
    except FileNotFoundError:
        return Generation(0, checkpoint_uri)
    return Generation(**{**document, "uri": generation_uri(checkpoint_uri, document["number"])})


def make_current(checkpoint_uri: str, generation: Generation) -> None:
    """Point the job at ``generation``: one small file, replaced whole (a rename on a local
    disk, a single put on an object store)."""
    filesystem, root = _root(checkpoint_uri)
    document = {k: v for k, v in asdict(generation).items() if k != "uri"}
    replace_file(filesystem, f"{root}/{POINTER}", json.dumps(document, indent=2).encode())


def retire(checkpoint_uri: str, number: int) -> list[str]:
    """Remove generation ``number``'s Spark checkpoint and registry (its replacement has
    committed); the removed paths."""
    filesystem, root = _root(checkpoint_uri)
    folder = root if number == 0 else f"{root}/generation-{number:04d}"
    removed = []
    for name in SPARK_FOLDERS if number == 0 else ("",):
        path = f"{folder}/{name}".rstrip("/")
        info = filesystem.get_file_info(path)
        if info.type == pafs.FileType.Directory:
            filesystem.delete_dir(path)
            removed.append(path)
        elif info.type == pafs.FileType.File:
            filesystem.delete_file(path)
            removed.append(path)
    return removed


def has_committed(generation: Generation) -> bool:
    """Whether the generation's query has committed a batch (its seed is in its state)."""
    return bool(committed_batches(generation.uri))
