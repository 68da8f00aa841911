"""Users' own stateful processors over the typed change feed (``pipeline.user_processors.api``;
docs/processors.md is the guide)."""

from pipeline.user_processors.api import (
    DELETE,
    FIRST_IMAGE,
    FIRST_IMAGE_DELETE,
    INSERT,
    UPDATE,
    Change,
    ChangeProcessor,
    ListOf,
    MapOf,
    SchemaChange,
    State,
    Value,
)

__all__ = [
    "DELETE",
    "FIRST_IMAGE",
    "FIRST_IMAGE_DELETE",
    "INSERT",
    "UPDATE",
    "Change",
    "ChangeProcessor",
    "ListOf",
    "MapOf",
    "SchemaChange",
    "State",
    "Value",
]
