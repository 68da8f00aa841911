"""Users' processors in the mirror job, on real Spark and Delta over change logs landed by the
real ingest sink: the two examples beside the mirrors from one read of the change log, their
output against a plain recomputation from the tables' states, their state kept across a
deployment that evolves it (v2) and a refused one (v3), a column added and a STRING column
turned BYTES (and back) reaching the typed feed."""

from __future__ import annotations

import base64
import datetime as dt
import random
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable
from pyspark.sql import types as T

from ingest.model.records import ColumnType
from ingest.model.timestamps import to_rfc3339
from pipeline.state.compatibility import StateSchemaError
from pipeline.user_processors import Change, ChangeProcessor, State
from pipeline.user_processors.loading import ProcessorInvalid, load_all
from tests.beyond_mirrors import BALANCE_FIELDS, STATUS_FIELDS
from tests.builders import ACCOUNTS, ChangeLog
from tests.pipeline_runs import configure, mirror_rows, run, spark  # noqa: F401
from tests.recompute import Commit, running_balance, status_durations

TRANSFERS = (
    ColumnType("from_account_id", {"code": "INT64"}, True, 1),
    ColumnType("transfer_id", {"code": "STRING"}, True, 2),
    ColumnType("to_account_id", {"code": "INT64"}, False, 3),
    ColumnType("amount", {"code": "INT64"}, False, 4),
)
ALL_TYPES = (
    ColumnType("id", {"code": "INT64"}, True, 1),
    ColumnType("variant", {"code": "STRING"}, True, 2),
    ColumnType("col_string", {"code": "STRING"}, False, 3),
    ColumnType("col_int64", {"code": "INT64"}, False, 4),
)
ALL_TYPES_LATER = (
    *ALL_TYPES[:2],
    ColumnType("col_string", {"code": "BYTES"}, False, 3),
    ALL_TYPES[3],
    ColumnType("col_added", {"code": "INT64"}, False, 5),
)
STATUSES = ("new", "paid", "shipped", "returned")
FEED = "tests.test_user_processors:FeedTypes"
V1 = f"examples.bank:RunningBalance,examples.status:StatusDurations,{FEED}"
V2 = f"examples.bank:RunningBalanceV2,examples.status:StatusDurationsV2,{FEED}"
V3_BANK = f"examples.bank:RunningBalanceV3,examples.status:StatusDurationsV2,{FEED}"
V3_STATUS = f"examples.bank:RunningBalanceV2,examples.status:StatusDurationsV3,{FEED}"


class FeedTypes(ChangeProcessor):
    """What the typed feed hands over: each value's column, its Spark type and Python type."""

    name = "feed_types"
    tables = ("all_types",)
    group_by = {"all_types": ("id",)}
    state = {}
    output = T.StructType(
        [
            T.StructField("commit_timestamp_text", T.StringType()),
            T.StructField("column", T.StringType()),
            T.StructField("spark_type", T.StringType()),
            T.StructField("python_type", T.StringType()),
        ]
    )

    def process(self, group: str | None, changes: Sequence[Change], state: State) -> Iterator[dict]:
        for change in changes:
            for column, value in change.values.items():
                if value is not None:
                    yield {
                        "commit_timestamp_text": change.commit_timestamp_text,
                        "column": column,
                        "spark_type": change.column_types[column].simpleString(),
                        "python_type": type(value).__name__,
                    }


Row = dict[str, Any]


class Bank:
    """The sample bank and the edge-case table as Spanner would hold them, commit by commit."""

    def __init__(self, changelog: ChangeLog, rng: random.Random) -> None:
        self.changelog, self.rng = changelog, rng
        self.tables: dict[str, dict[tuple, Row]] = {
            "accounts": {},
            "transfers": {},
            "all_types": {},
        }
        self.commits: list[Commit] = []
        self.bytes_status = False
        self.next_id = 0

    def commit(self, *mods: tuple[str, str, dict, Row]) -> None:
        transaction = self.changelog.commit(*[self.wire(m) for m in mods])
        for table, mod_type, keys, values in mods:
            key = tuple(keys.values())
            if mod_type == "DELETE":
                del self.tables[table][key]
            else:
                self.tables[table][key] = {**self.tables[table].get(key, keys), **values}
        at = dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(
            microseconds=transaction.commit_timestamp // 1000
        )
        snapshot = {
            name: {k: dict(v) for k, v in rows.items()} for name, rows in self.tables.items()
        }
        self.commits.append(Commit(at, to_rfc3339(transaction.commit_timestamp), snapshot))

    def wire(self, mod: tuple[str, str, dict, Row]) -> tuple[str, str, Row, Row, Row]:
        """A mod as the change log carries it; a delete with the row's old values, as
        ``NEW_ROW_AND_OLD_VALUES`` capture sends them."""
        table, mod_type, keys, values = mod
        old = {}
        if mod_type == "DELETE":
            row = self.tables[table][tuple(keys.values())]
            old = {k: v for k, v in row.items() if k not in keys}
        return (
            table,
            mod_type,
            _wire(keys, self.bytes_status),
            _wire(values, self.bytes_status),
            _wire(old, self.bytes_status),
        )

    def open_accounts(self, count: int) -> None:
        self.commit(
            *[
                ("accounts", "INSERT", {"account_id": a}, {"owner": f"o{a}", "balance": 1000})
                for a in range(1, count + 1)
            ]
        )

    def transfer(self) -> None:
        source, target = self.rng.sample(sorted(k[0] for k in self.tables["accounts"]), 2)
        amount = self.rng.randint(1, 50)
        balances = {a: self.tables["accounts"][(a,)]["balance"] for a in (source, target)}
        self.commit(
            ("accounts", "UPDATE", {"account_id": source}, {"balance": balances[source] - amount}),
            ("accounts", "UPDATE", {"account_id": target}, {"balance": balances[target] + amount}),
            (
                "transfers",
                "INSERT",
                {
                    "from_account_id": source,
                    "transfer_id": str(uuid.UUID(int=self.rng.getrandbits(128))),
                },
                {"to_account_id": target, "amount": amount},
            ),
        )

    def transfer_id(self) -> str:
        return str(uuid.UUID(int=self.rng.getrandbits(128)))

    def clean_up(self) -> None:
        if self.tables["transfers"]:
            key = min(self.tables["transfers"])
            self.commit(
                ("transfers", "DELETE", {"from_account_id": key[0], "transfer_id": key[1]}, {})
            )

    def touch_all_types(self, added: bool) -> None:
        rows = sorted(self.tables["all_types"])
        choice = self.rng.random()
        if rows and choice < 0.2:
            key = self.rng.choice(rows)
            self.commit(("all_types", "DELETE", {"id": key[0], "variant": key[1]}, {}))
        elif rows and choice < 0.7:
            key = self.rng.choice(rows)
            values: Row = {"col_string": self.rng.choice(STATUSES)}
            if self.rng.random() < 0.25:
                values = {"col_int64": self.rng.randint(0, 9)}
            self.commit(("all_types", "UPDATE", {"id": key[0], "variant": key[1]}, values))
        else:
            self.next_id += 1
            values = {"col_string": self.rng.choice(STATUSES), "col_int64": 1}
            if added:
                values["col_added"] = self.next_id
            keys = {"id": self.next_id, "variant": self.rng.choice(["alpha", "beta"])}
            self.commit(("all_types", "INSERT", keys, values))


def _wire(values: Row, bytes_status: bool) -> Row:
    """Values as the change log carries them: INT64 as text, BYTES as base64."""
    sent: Row = {}
    for name, value in values.items():
        if name == "col_string" and bytes_status:
            sent[name] = base64.b64encode(value.encode()).decode()
        elif isinstance(value, int):
            sent[name] = str(value)
        else:
            sent[name] = value
    return sent


def written(changelog: ChangeLog, bank: Bank, rounds: int, added: bool) -> None:
    for _ in range(rounds):
        for _ in range(8):
            kind = bank.rng.random()
            if kind < 0.5:
                bank.transfer()
            elif kind < 0.6:
                bank.clean_up()
            else:
                bank.touch_all_types(added)
        changelog.land()


def opened_bank(config: Any, rng: random.Random, rounds: int) -> tuple[ChangeLog, Bank]:
    """Six accounts opened, then ``rounds`` rounds of the bank's traffic, landed."""
    changelog = ChangeLog(
        config.changelog_uri,
        columns={"accounts": ACCOUNTS, "transfers": TRANSFERS, "all_types": ALL_TYPES},
    )
    bank = Bank(changelog, rng)
    bank.open_accounts(6)
    written(changelog, bank, rounds, added=False)
    return changelog, bank


def output_rows(root: Path, name: str, fields: tuple[str, ...]) -> list[Row]:
    rows = DeltaTable(str(root / name)).to_pyarrow_table().to_pylist()
    return sorted(({f: r[f] for f in fields} for r in rows), key=repr)


def test_the_examples_run_beside_the_mirrors_evolve_and_a_breaking_change_is_refused(
    spark,  # noqa: F811
    tmp_path: Path,
) -> None:
    processors = tmp_path / "processors"
    config = configure(tmp_path, processors=V1, processor_root=str(processors))
    changelog, bank = opened_bank(config, random.Random(3030), rounds=4)
    assert run(spark, config).batches >= 1

    changelog.columns["all_types"] = ALL_TYPES_LATER
    bank.bytes_status = True
    altered_at = len(bank.commits) - 1
    written(changelog, bank, 4, added=True)
    evolved = configure(tmp_path, processors=V2, processor_root=str(processors))
    run(spark, evolved)

    expected = running_balance(bank.commits, first_is_snapshot=False)
    periods = status_durations(bank.commits)
    assert len(expected) >= 40 and len(periods) >= 5, (len(expected), len(periods))
    assert output_rows(processors, "running_balance", BALANCE_FIELDS) == sorted(expected, key=repr)
    assert output_rows(processors, "status_durations", STATUS_FIELDS) == sorted(periods, key=repr)
    counted = [
        r for r in DeltaTable(str(processors / "running_balance")).to_pyarrow_table().to_pylist()
    ]
    v2_rows = [r for r in counted if r["changes"] is not None]
    assert v2_rows, "v2 counts changes"
    assert all(r["changes"] is None for r in counted if r not in v2_rows)

    altered = bank.commits[altered_at].text
    seen = DeltaTable(str(processors / "feed_types")).to_pyarrow_table().to_pylist()
    kinds = {
        (r["column"], r["commit_timestamp_text"] > altered, r["spark_type"], r["python_type"])
        for r in seen
    }
    assert ("col_string", False, "string", "str") in kinds
    assert ("col_string", True, "binary", "bytes") in kinds
    assert ("col_added", True, "bigint", "int") in kinds
    assert not any(column == "col_added" and not after for column, after, _, _ in kinds)

    mirrored = mirror_rows(spark, config, "accounts")
    assert {k: v["balance"] for k, v in mirrored.items()} == {
        k[0]: v["balance"] for k, v in bank.tables["accounts"].items()
    }

    # A processor removed (its state deleted), then added again (starting afresh), while the
    # BYTES column goes back to STRING: the job goes on, the running balance stays equal to its
    # recomputation and the feed hands the column over as text again.
    changelog.columns["all_types"] = (*ALL_TYPES, ALL_TYPES_LATER[-1])
    bank.bytes_status = False
    reverted = bank.commits[-1].text
    without_status = f"examples.bank:RunningBalanceV2,{FEED}"
    for step, processors_now in enumerate((without_status, V2)):
        written(changelog, bank, 1, added=True)
        now = configure(tmp_path, processors=processors_now, processor_root=str(processors))
        assert run(spark, now).batches >= 1, step
    expected = running_balance(bank.commits, first_is_snapshot=False)
    assert output_rows(processors, "running_balance", BALANCE_FIELDS) == sorted(expected, key=repr)
    seen = DeltaTable(str(processors / "feed_types")).to_pyarrow_table().to_pylist()
    after = {
        (r["spark_type"], r["python_type"])
        for r in seen
        if r["column"] == "col_string" and r["commit_timestamp_text"] > reverted
    }
    assert after == {("string", "str")}, after

    for breaking, variable, field, rule in (
        (V3_BANK, "running_balance.account", "balance", "rename"),
        (V3_STATUS, "status_durations.totals", "entries", "map key change"),
    ):
        refused = configure(tmp_path, processors=breaking, processor_root=str(processors))
        with pytest.raises(StateSchemaError) as caught:
            run(spark, refused)
        line = str(caught.value)
        assert "\n" not in line
        assert f"state variable {variable!r}, field {field!r}: {rule}" in line, line


def test_a_processor_named_wrong_is_one_line() -> None:
    with pytest.raises(ProcessorInvalid, match="expected module:Class"):
        load_all("examples.bank")
    with pytest.raises(ProcessorInvalid, match="no ChangeProcessor subclass Nothing"):
        load_all("examples.bank:Nothing")
    with pytest.raises(ProcessorInvalid, match="used more than once"):
        load_all("examples.bank:RunningBalance,examples.bank:RunningBalanceV2")


def landed_outputs(config: Any, processors: Path) -> dict[str, Any]:
    """Every table the job writes, row for row, with its Delta version."""
    tables = {
        "mirror": Path(config.mirror_root) / "accounts",
        "history": Path(config.history_root) / "accounts",
        "running_balance": processors / "running_balance",
        "status_durations": processors / "status_durations",
    }
    landed = {}
    for name, uri in tables.items():
        table = DeltaTable(str(uri))
        rows = sorted(table.to_pyarrow_table().to_pylist(), key=repr)
        landed[name] = (table.version(), rows)
    return landed


def test_a_batch_replayed_after_its_outputs_landed_changes_no_output(
    spark,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A kill -9 after a batch wrote its outputs and before Spark committed it: the restart
    replays the batch from its offsets and state, and every table's Delta application
    transaction skips it, so no mirror, history or processor row changes or doubles."""
    processors = tmp_path / "processors"
    config = configure(
        tmp_path,
        processors=V1,
        processor_root=str(processors),
        history_tables="*",
        history_root=str(tmp_path / "history"),
    )
    changelog, bank = opened_bank(config, random.Random(3131), rounds=3)
    assert run(spark, config).batches >= 1
    before = landed_outputs(config, processors)

    commits = Path(config.checkpoint_uri) / "commits"
    last = max(int(p.name) for p in commits.iterdir() if p.name.isdigit())
    for name in (str(last), f".{last}.crc"):
        (commits / name).unlink(missing_ok=True)
    replayed = run(spark, config)
    assert replayed.batches == 1, "the batch without its commit runs again"
    assert landed_outputs(config, processors) == before

    written(changelog, bank, 2, added=False)
    run(spark, config)
    expected = running_balance(bank.commits, first_is_snapshot=False)
    assert output_rows(processors, "running_balance", BALANCE_FIELDS) == sorted(expected, key=repr)
    periods = status_durations(bank.commits)
    assert output_rows(processors, "status_durations", STATUS_FIELDS) == sorted(periods, key=repr)
