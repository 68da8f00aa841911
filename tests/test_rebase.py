"""A rebase on real Spark and Delta: a new state generation seeded from the mirrors, taken
automatically before Spark's evolution limit and on demand after the checkpoint is lost. Later
changes that carry only some columns must find the rest in the seeded state, and nothing is
applied twice or lost across the switch."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable
from pyspark.sql import types as T

from ingest.model.records import ColumnType
from pipeline.columns import KEYS_COLUMN, POSITION_COLUMN, mirror_uri
from pipeline.config import PipelineConfig
from pipeline.rebase import RebaseRefused, rebase_on_demand, starting_version
from pipeline.restarts import PipelineFailed
from pipeline.state import cut, generations
from pipeline.state.registry import SchemaRegistry
from pipeline.user_processors import Change, ChangeProcessor, State, Value
from runtime.errors import BadInput
from runtime.logs import null_logger
from tests.builders import ChangeLog
from tests.pipeline_runs import configure, mirror_rows, run

THRESHOLD = "spark.sql.streaming.stateStore.valueStateSchemaEvolutionThreshold"


def seed_accounts(changelog: ChangeLog) -> None:
    changelog.commit(
        ("accounts", "INSERT", {"account_id": "1"}, {"owner": "ann", "balance": "100"}),
        ("accounts", "INSERT", {"account_id": "2"}, {"owner": "bob", "balance": "50"}),
    )
    changelog.commit(("accounts", "DELETE", {"account_id": "2"}, {}))
    changelog.commit(("accounts", "INSERT", {"account_id": "3"}, {"owner": "cy", "balance": "7"}))
    changelog.land()


def add_column(changelog: ChangeLog, number: int) -> str:
    """A new STRING column, set on key 1 by an update that carries that column alone."""
    name = f"c{number}"
    columns = changelog.columns["accounts"]
    changelog.columns["accounts"] = (
        *columns,
        ColumnType(name, {"code": "STRING"}, False, len(columns) + 1),
    )
    changelog.commit(("accounts", "UPDATE", {"account_id": "1"}, {name: f"v{number}"}))
    changelog.land()
    return name


def test_at_the_evolution_limit_the_job_rebases_and_the_mirrors_stay_right(
    spark, tmp_path: Path
) -> None:
    """Spark allows two evolutions of a variable at threshold 3: six new columns, each in its
    own deployment, take two rebases; each later update carries one column, so every other
    value must come from the seeded state."""
    config = configure(tmp_path, max_evolutions_per_variable=3)
    changelog = ChangeLog(config.changelog_uri)
    seed_accounts(changelog)
    spark.conf.set(THRESHOLD, "3")
    try:
        run(spark, config)
        expected = mirror_rows(spark, config)
        rebases = 0
        for number in range(1, 7):
            name = add_column(changelog, number)
            rebases += run(spark, config).rebases
            for key, row in expected.items():
                row[name] = f"v{number}" if key == 1 else None
            assert mirror_rows(spark, config) == expected, number
        changelog.commit(("accounts", "UPDATE", {"account_id": "3"}, {"owner": "cyd"}))
        changelog.commit(("accounts", "DELETE", {"account_id": "1"}, {}))
        changelog.land()
        run(spark, config)
    finally:
        spark.conf.set(THRESHOLD, PipelineConfig().max_evolutions_per_variable)
    expected[3]["owner"] = "cyd"
    del expected[1]
    assert mirror_rows(spark, config) == expected
    assert rebases == 2
    generation = generations.current(config.checkpoint_uri)
    assert generation.number == 2
    assert len(SchemaRegistry(generation.uri).history()) <= 3, "counts start again"
    root = Path(config.checkpoint_uri)
    assert not (root / "generation-0001").exists() and not (root / "offsets").exists(), (
        "replaced generations are removed once the new one has committed"
    )
    rows = DeltaTable(mirror_uri(config.mirror_root, "accounts")).to_pyarrow_table().to_pylist()
    assert all(json.loads(r[KEYS_COLUMN]) == {"account_id": str(r["account_id"])} for r in rows)
    assert all(r[POSITION_COLUMN]["commit_timestamp_text"] for r in rows)


def test_a_lost_checkpoint_is_rebased_from_the_mirrors_without_replaying_history(
    spark, tmp_path: Path
) -> None:
    config = configure(tmp_path)
    changelog = ChangeLog(config.changelog_uri)
    seed_accounts(changelog)
    add_column(changelog, 1)
    run(spark, config)
    before = mirror_rows(spark, config)
    recorded = cut.read(config.mirror_root)
    assert recorded is not None
    assert recorded.starting_version == DeltaTable(config.changelog_uri).version() + 1

    shutil.rmtree(config.checkpoint_uri)
    generation = rebase_on_demand(config, null_logger(), lambda: spark, "checkpoint lost")
    assert generation.starting_version == recorded.starting_version
    changelog.commit(("accounts", "UPDATE", {"account_id": "1"}, {"balance": "1"}))
    changelog.land()
    stats = run(spark, config)
    assert stats.batches == 1, "only what came after the cut is read"
    before[1]["balance"] = 1
    assert mirror_rows(spark, config) == before


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` with its size and modification time."""
    return {
        str(path.relative_to(root)): (path.stat().st_size, path.stat().st_mtime_ns)
        for path in root.rglob("*")
        if path.is_file()
    }


def test_a_rebase_without_this_change_logs_cut_is_refused_and_changes_nothing(
    spark, tmp_path: Path
) -> None:
    """A rebase pointed at a missing or empty mirror root, or at another job's mirrors, once
    succeeded with no keys and a new generation whose job then missed every row."""
    config = configure(tmp_path / "ours")
    seed_accounts(ChangeLog(config.changelog_uri))
    other = configure(tmp_path / "theirs")
    seed_accounts(ChangeLog(other.changelog_uri))
    run(spark, config)
    run(spark, other)
    shutil.rmtree(config.checkpoint_uri)
    (tmp_path / "empty").mkdir()
    before = tree(tmp_path)
    roots = {
        "missing": str(tmp_path / "missing"),
        "empty": str(tmp_path / "empty"),
        "another job's": other.mirror_root,
    }
    for case, root in roots.items():
        wrong = replace(config, mirror_root=root)
        with pytest.raises(RebaseRefused, match="nothing was changed") as refused:
            rebase_on_demand(wrong, null_logger(), lambda: spark, "checkpoint lost")
        assert "\n" not in str(refused.value), case
        assert tree(tmp_path) == before, case
    assert not (tmp_path / "missing").exists()
    assert not Path(config.checkpoint_uri).exists()
    rebase_on_demand(config, null_logger(), lambda: spark, "checkpoint lost")


def test_a_truncated_state_file_stops_the_job_with_one_line_naming_the_way_out(
    spark, tmp_path: Path
) -> None:
    """A corrupt RocksDB snapshot once ended the job with "Py4JJavaError: An error occurred
    while calling o183.collectToPython."; the rebase it names then brings the mirrors back."""
    config = configure(tmp_path)
    changelog = ChangeLog(config.changelog_uri)
    seed_accounts(changelog)
    run(spark, config)
    snapshots = sorted(Path(config.checkpoint_uri).rglob("state/0/*/*.zip"))
    assert snapshots
    for snapshot in snapshots:
        snapshot.write_bytes(snapshot.read_bytes()[: snapshot.stat().st_size // 2])
    changelog.commit(("accounts", "UPDATE", {"account_id": "1"}, {"balance": "1"}))
    changelog.land()
    with pytest.raises(PipelineFailed) as failed:
        run(spark, config)
    line = str(failed.value)
    assert "\n" not in line
    assert line.startswith("CANNOT_LOAD_STATE_STORE: the pipeline checkpoint ")
    assert config.checkpoint_uri in line and "python -m pipeline rebase" in line

    rebase_on_demand(config, null_logger(), lambda: spark, "state unreadable")
    run(spark, config)
    assert mirror_rows(spark, config) == {
        1: {"account_id": 1, "owner": "ann", "balance": 1},
        3: {"account_id": 3, "owner": "cy", "balance": 7},
    }


def test_a_generation_that_never_committed_a_batch_is_rebased_from_where_it_started(
    tmp_path: Path,
) -> None:
    """A job killed before its first batch, then stopped by Spark's limit, holds no cut and no
    committed batch: the next generation starts where the running one did (the change log's
    start for the first), never refused (the soak's smoke run met it)."""
    config = configure(tmp_path)
    first = generations.current(config.checkpoint_uri)
    assert starting_version(config, first) == 0
    rebased = generations.Generation(3, f"{config.checkpoint_uri}/generation-0003", 7)
    assert starting_version(config, rebased) == 7
    cut.record(config.mirror_root, cut.Cut(11, 3, 0))
    assert starting_version(config, rebased) == 11


def test_a_late_cut_never_moves_the_recorded_one_backwards(tmp_path: Path) -> None:
    """A job paused past its lease between its last check and the cut's write finishes that
    write after its replacement has gone further: the replacement's cut stays; another change
    log's cut is replaced (a new change log starts over)."""
    root = str(tmp_path / "mirrors")
    assert cut.record(root, cut.Cut(5, 0, 1, "log-a"))
    assert cut.record(root, cut.Cut(9, 0, 3, "log-a"))
    assert not cut.record(root, cut.Cut(5, 0, 1, "log-a")), "a late cut went backwards"
    assert not cut.record(root, cut.Cut(9, 0, 3, "log-a")), "the same cut written twice"
    assert cut.read(root) == cut.Cut(9, 0, 3, "log-a")
    assert cut.record(root, cut.Cut(9, 1, 0, "log-a")), "a later generation at the same version"
    assert cut.record(root, cut.Cut(2, 0, 0, "log-b"))
    assert cut.read(root) == cut.Cut(2, 0, 0, "log-b")


class ChangeCount(ChangeProcessor):
    """Changes seen per account: state a rebase from the mirrors could not rebuild."""

    name = "change_count"
    tables = ("accounts",)
    group_by = {"accounts": ("account_id",)}
    state = {"seen": Value(T.StructType([T.StructField("changes", T.LongType())]))}
    output = T.StructType(
        [T.StructField("account_id", T.StringType()), T.StructField("changes", T.LongType())]
    )

    def process(
        self, group: str | None, changes: Sequence[Change], state: State
    ) -> Iterator[dict[str, Any]]:
        seen = state.value("seen").get() or {"changes": 0}
        seen["changes"] += len(changes)
        state.value("seen").set(seen)
        yield {"account_id": group, "changes": seen["changes"]}


def test_with_processors_the_job_stops_at_the_evolution_limit_and_a_rebase_is_refused(
    spark, tmp_path: Path
) -> None:
    """A rebase seeds state from the mirrors only, so with processors configured it would start
    their state over: the job stops at Spark's limit, the processors' output and state as they
    were, and ``python -m pipeline rebase`` refuses."""
    processors = tmp_path / "processors"
    config = configure(
        tmp_path,
        max_evolutions_per_variable=3,
        processors="tests.test_rebase:ChangeCount",
        processor_root=str(processors),
    )
    changelog = ChangeLog(config.changelog_uri)
    seed_accounts(changelog)
    output = processors / "change_count"
    spark.conf.set(THRESHOLD, "3")
    try:
        run(spark, config)
        landed = DeltaTable(str(output)).to_pyarrow_table().to_pylist()
        with pytest.raises(PipelineFailed) as stopped:
            for number in range(1, 7):
                add_column(changelog, number)
                run(spark, config)
                landed = DeltaTable(str(output)).to_pyarrow_table().to_pylist()
        assert number <= 3, "Spark allows two evolutions of a variable at threshold 3"
    finally:
        spark.conf.set(THRESHOLD, PipelineConfig().max_evolutions_per_variable)
    assert "a rebase would start the processors' state over" in str(stopped.value)
    assert "max_evolutions_per_variable" in str(stopped.value)
    assert generations.current(config.checkpoint_uri).number == 0, "no rebase was taken"
    assert DeltaTable(str(output)).to_pyarrow_table().to_pylist() == landed
    assert max(r["changes"] for r in landed if r["account_id"] == "1") == number, (
        "the count kept across deployments: one insert and every column's update but the last"
    )
    with pytest.raises(BadInput, match="rebase: the job runs user processors"):
        rebase_on_demand(config, null_logger(), lambda: spark, "asked")
    assert generations.current(config.checkpoint_uri).number == 0
