"""A user processor's state against what its earlier deployments recorded: the rules the mirror
job's own state follows (``pipeline.state.compatibility``: added fields, widening; refused
renames, narrowing, map key changes; Spark's evolution limits), before Spark starts.

Each processor is recorded on its own, in ``<checkpoint>/_state_schemas/processors/<name>/``,
one file per deployment that changed its schemas. A refusal names the variable as
``<processor>.<variable>``, and so does a confirmed drop (``running_balance.balance.amount``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pyspark.sql import types as T

from pipeline.state.compatibility import (
    Evolution,
    Limits,
    StateSchemaError,
    check_evolution,
)
from pipeline.state.registry import Deployment, SchemaRegistry
from pipeline.user_processors.api import ChangeProcessor


@dataclass(frozen=True, slots=True)
class Gated:
    """A processor cleared to run: its recorded deployment and what it deletes."""

    processor: type[ChangeProcessor]
    deployment: Deployment
    evolution: Evolution


def state_schemas(processor: type[ChangeProcessor]) -> dict[str, T.StructType]:
    return {name: v.recorded_schema() for name, v in sorted(processor.state.items())}


def registry(checkpoint_uri: str, processor: type[ChangeProcessor]) -> SchemaRegistry:
    return SchemaRegistry(checkpoint_uri, f"_state_schemas/processors/{processor.name}")


def check(
    checkpoint_uri: str,
    processor: type[ChangeProcessor],
    confirmed_drops: frozenset[str],
    limits: Limits,
) -> Evolution:
    """How the processor's state evolves; StateSchemaError naming ``<processor>.<variable>``."""
    prefix = f"{processor.name}."
    mine = frozenset(d.removeprefix(prefix) for d in confirmed_drops if d.startswith(prefix))
    try:
        return check_evolution(
            registry(checkpoint_uri, processor).history(),
            state_schemas(processor),
            mine,
            limits,
        )
    except StateSchemaError as refused:
        raise StateSchemaError(
            [replace(r, variable=f"{prefix}{r.variable}") for r in refused.refusals]
        ) from None


def record(
    checkpoint_uri: str,
    processor: type[ChangeProcessor],
    confirmed_drops: frozenset[str],
    limits: Limits,
) -> Gated:
    """Check, then record the processor's deployment (once per change)."""
    evolution = check(checkpoint_uri, processor, confirmed_drops, limits)
    deployment = registry(checkpoint_uri, processor).record(
        state_schemas(processor), evolution.removed_variables
    )
    return Gated(processor, deployment, evolution)
