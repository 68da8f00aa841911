"""The deployment gate: what one start of the query runs with. The tables' shapes from the change
log, the state schemas they and the users' processors need, checked against the recorded ones
(a refusal stops the job here, before Spark starts) and recorded; the fields a deployment added,
whose first writes are read back (the open-source bug guard)."""

from __future__ import annotations

from dataclasses import dataclass

from pyspark.sql import types as T

from pipeline.catalog import discover_shapes
from pipeline.config import PipelineConfig
from pipeline.history import Histories
from pipeline.shapes import TableShape
from pipeline.state.compatibility import (
    Evolution,
    Limits,
    StateSchemaError,
    check_evolution,
    fields_added,
)
from pipeline.state.registry import Deployment, SchemaRegistry
from pipeline.state.variables import state_schemas
from pipeline.user_processors.api import ChangeProcessor
from pipeline.user_processors.host import state_schemas as processor_state_schemas
from pipeline.user_processors.loading import load_all
from runtime.logs import Logger


@dataclass(frozen=True, slots=True)
class Plan:
    """What one start of the query runs with."""

    shapes: dict[str, TableShape]
    deployment: Deployment
    deleted_variables: tuple[str, ...]
    guarded_fields: dict[str, tuple[str, ...]]
    histories: Histories | None = None
    processors: tuple[type[ChangeProcessor], ...] = ()

    @property
    def kept(self) -> frozenset[str]:
        """The tables that keep a history."""
        return frozenset() if self.histories is None else self.histories.of(self.shapes)


def checked_state_schemas(
    config: PipelineConfig,
    shapes: dict[str, TableShape],
    registry: SchemaRegistry,
    processors: tuple[type[ChangeProcessor], ...] = (),
) -> tuple[dict[str, T.StructType], Evolution]:
    """The state schemas the tables and the users' processors need, and how they evolve the
    recorded ones.

    Raises StateSchemaError when a rule is broken; run by every start and by
    ``check-state-schema``.
    """
    history = registry.history()
    schemas = state_schemas(shapes, history[-1].schemas if history else None)
    schemas.update(processor_state_schemas(processors))
    evolution = check_evolution(history, schemas, config.confirmed_drop_set, limits(config))
    return schemas, evolution


def limits(config: PipelineConfig) -> Limits:
    return Limits(config.max_evolutions_per_variable, config.max_evolutions_per_query)


def only_limits(refused: StateSchemaError) -> bool:
    """Whether a refusal is only Spark's evolution limits: what a rebase resolves."""
    return all(r.rule.startswith("evolution limit") for r in refused.refusals)


def plan_deployment(config: PipelineConfig, log: Logger) -> Plan:
    """Shapes, checked and recorded state schemas; StateSchemaError when a rule is broken."""
    shapes = discover_shapes(config.changelog_uri)
    if not shapes:
        return Plan({}, Deployment(0, {}, ()), (), {})
    processors = load_all(config.processors)
    registry = SchemaRegistry(config.checkpoint_uri)
    schemas, evolution = checked_state_schemas(config, shapes, registry, processors)
    deployment = registry.record(schemas, evolution.removed_variables)
    if evolution.is_change:
        log.info(
            "state_schema_evolved",
            deployment=deployment.number,
            added_variables=list(evolution.added_variables),
            removed_variables=list(evolution.removed_variables),
            changed_variables=list(evolution.changed_variables),
        )
    history = registry.history()
    guarded = {}
    if len(history) > 1:
        before, after = history[-2].schemas, history[-1].schemas
        for name, struct in after.items():
            if name in before and (added := fields_added(before[name], struct)):
                guarded[name] = added
    histories = Histories(config.history_root, config.history_table_set)
    return Plan(shapes, deployment, deployment.deleted, guarded, histories, processors)
