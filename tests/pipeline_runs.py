"""The pipeline run by tests on one Spark session: configuration, runs, mirrors read back."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import types as T

from pipeline.batch_writer import JobStats
from pipeline.columns import mirror_uri
from pipeline.config import PipelineConfig
from pipeline.job import run_pipeline
from pipeline.query import spark_settings
from pipeline.session import build_session
from runtime.logs import null_logger
from tests.background_builds import CLASS_ARCHIVE_BUILD, wait_for_build
from tests.builders import ChangeLog


def build_test_session(app_name: str, **options: Any) -> Any:
    """An in-process session, once the class archive ``make test`` makes beside the tests is
    there: a process's one JVM keeps the options it started with, the archive among them."""
    wait_for_build(CLASS_ARCHIVE_BUILD)
    return build_session(app_name, **options)


@pytest.fixture(scope="module")
def spark():
    session = build_test_session(
        "pipeline-tests", extra=spark_settings(PipelineConfig()), shuffle_partitions=2
    )
    yield session
    session.stop()


def configure(tmp_path: Path, **overrides: object) -> PipelineConfig:
    settings = dict(
        changelog_uri=str(tmp_path / "changelog"),
        mirror_root=str(tmp_path / "mirrors"),
        checkpoint_uri=str(tmp_path / "checkpoint"),
        trigger="available-now",
        max_restarts=3,
    )
    settings.update(overrides)
    return PipelineConfig(**settings)  # type: ignore[arg-type]


def run(spark, config: PipelineConfig) -> JobStats:
    return run_pipeline(config, null_logger(), threading.Event(), lambda: spark)


def mirror_rows(
    spark, config: PipelineConfig, table: str = "accounts", key: str = "account_id"
) -> dict[int, dict]:
    rows = spark.read.format("delta").load(mirror_uri(config.mirror_root, table)).collect()
    return {row[key]: spanner_columns(row.asDict()) for row in rows}


def spanner_columns(row: dict[str, Any]) -> dict[str, Any]:
    """A mirror row without the keys and position the product keeps beside it."""
    return {name: value for name, value in row.items() if not name.startswith("_cdc_")}


def processed_three_ways(
    spark,
    tmp_path: Path,
    stages: list[Callable[[ChangeLog], None]],
    table: str = "accounts",
    key: str = "account_id",
    stopped_after: int = 1,
) -> list[dict[int, dict]]:
    """The mirrors of a job that follows each stage, of one stopped after ``stopped_after``
    stages that meets the rest at once, and of a rebuild from the whole change log: each row
    must apply with its own types. The first two merge on the driver (delta-rs), the rebuild
    through Spark, so both ways must write the same mirror."""
    following = configure(tmp_path / "following")
    changelog = ChangeLog(following.changelog_uri)
    for stage in stages:
        stage(changelog)
        run(spark, following)

    behind = configure(tmp_path / "behind")
    late = ChangeLog(behind.changelog_uri)
    for stage in stages[:stopped_after]:
        stage(late)
    run(spark, behind)
    for stage in stages[stopped_after:]:
        stage(late)
    assert run(spark, behind).restarts <= 1

    rebuilt = configure(
        tmp_path / "following",
        mirror_root=str(tmp_path / "rebuilt"),
        checkpoint_uri=str(tmp_path / "rebuilt-checkpoint"),
        local_merge_max_rows=0,
    )
    assert run(spark, rebuilt).restarts == 0
    return [mirror_rows(spark, config, table, key) for config in (following, behind, rebuilt)]


def image_of(entry: T.StructType) -> T.StructType:
    """The row image struct of an ``entry_<table>`` state schema."""
    image = entry["image"].dataType
    assert isinstance(image, T.StructType)
    return image
