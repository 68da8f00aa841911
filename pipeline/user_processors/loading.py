"""Processors named in the configuration (``module:Class``), imported and checked before Spark
starts; a wrong name or declaration is one clear line and exit 2."""

from __future__ import annotations

import importlib
import re

from pyspark.sql import types as T

from pipeline.user_processors.api import ChangeProcessor, Variable
from runtime.errors import BadInput

NAME = re.compile(r"[a-z][a-z0-9_]{0,62}")


class ProcessorInvalid(BadInput, ValueError):
    """A configured processor cannot be imported or declares something the job cannot run."""


def load_all(specs: str) -> tuple[type[ChangeProcessor], ...]:
    """Each ``module:Class`` of a comma-separated list, checked; names must be distinct."""
    processors = tuple(load(spec.strip()) for spec in specs.split(",") if spec.strip())
    names = [p.name for p in processors]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ProcessorInvalid(f"processors: names {repeated} are used more than once")
    return tuple(sorted(processors, key=lambda p: p.name))


def load(spec: str) -> type[ChangeProcessor]:
    module_name, _, class_name = spec.partition(":")
    if not module_name or not class_name:
        raise ProcessorInvalid(f"processor {spec!r}: expected module:Class")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ProcessorInvalid(
            f"processor {spec!r}: cannot import {module_name}: {error}"
        ) from None
    found = getattr(module, class_name, None)
    if not (isinstance(found, type) and issubclass(found, ChangeProcessor)):
        raise ProcessorInvalid(f"processor {spec!r}: no ChangeProcessor subclass {class_name}")
    check(found, spec)
    return found


def check(processor: type[ChangeProcessor], spec: str) -> None:
    """What the job relies on: a name for its table and state, tables, a group for each,
    struct output and state of the declared kinds."""
    name = getattr(processor, "name", None)
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ProcessorInvalid(
            f"processor {spec!r}: name must be lower-case letters, digits and _ (got {name!r})"
        )
    tables = getattr(processor, "tables", ())
    if not tables or not all(isinstance(t, str) for t in tables):
        raise ProcessorInvalid(f"processor {name!r}: tables must name the tables it reads")
    unknown = set(getattr(processor, "group_by", {})) - set(tables)
    if unknown:
        raise ProcessorInvalid(
            f"processor {name!r}: group_by names tables it does not read: {sorted(unknown)}"
        )
    if not isinstance(getattr(processor, "output", None), T.StructType):
        raise ProcessorInvalid(f"processor {name!r}: output must be a StructType")
    for variable, declared in getattr(processor, "state", {}).items():
        if not isinstance(declared, Variable):
            raise ProcessorInvalid(
                f"processor {name!r}: state variable {variable!r} must be a Value, ListOf or MapOf"
            )
