"""The state schema rules, checked before Spark starts: allowed evolutions pass, refused ones
stop with a message naming the variable, the field and the rule."""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import struct as struct_module
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import fastavro
import pytest
from google.api_core.datetime_helpers import DatetimeWithNanoseconds
from google.cloud.spanner_v1.data_types import JsonObject
from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark.sql import types as T

from emulator.verify import canonical
from ingest.model.records import ColumnType
from pipeline.config import load as load_pipeline_config
from pipeline.shapes import Interval, merge_shapes
from pipeline.state.avro import avro_schema
from pipeline.state.compatibility import (
    ALLOWED_TYPE_CHANGES,
    Limits,
    Refusal,
    StateSchemaError,
    check_evolution,
)
from pipeline.state.registry import Deployment, SchemaRegistry
from pipeline.state.variables import (
    CHANGE_STATS,
    LAST_APPLIED,
    TOMBSTONE,
    legacy_variables,
    state_schemas,
)
from pipeline.values import spark_value
from runtime.options import ConfigError
from tests.builders import ChangeLog
from tests.pipeline_runs import image_of


def struct(**fields: T.DataType) -> T.StructType:
    return T.StructType([T.StructField(name, kind) for name, kind in fields.items()])


V1 = {
    "a": struct(n=T.IntegerType(), s=T.StringType()),
    "b": struct(x=T.LongType(), tags=T.MapType(T.StringType(), T.LongType())),
}


def history(*deployments: dict[str, T.StructType]) -> list[Deployment]:
    return [Deployment(number, schemas) for number, schemas in enumerate(deployments, 1)]


def refused(new: dict[str, T.StructType], **kwargs: object) -> str:
    with pytest.raises(StateSchemaError) as caught:
        check_evolution(history(V1), new, **kwargs)  # type: ignore[arg-type]
    return str(caught.value)


@pytest.mark.parametrize(
    "new",
    [
        {**V1, "a": struct(n=T.LongType(), s=T.StringType())},
        {**V1, "a": struct(n=T.DoubleType(), s=T.BinaryType())},
        {**V1, "a": struct(n=T.FloatType(), s=T.StringType())},
        {**V1, "a": struct(s=T.StringType(), n=T.IntegerType())},
        {**V1, "a": struct(n=T.IntegerType(), s=T.StringType(), added=T.DateType())},
        {**V1, "a": struct(n=T.IntegerType())},
        {**V1, "c": struct(z=T.StringType())},
        {"a": V1["a"]},
        {**V1, "b": struct(x=T.LongType(), tags=T.MapType(T.StringType(), T.DoubleType()))},
    ],
    ids=[
        "int-long",
        "int-double+string-binary",
        "int-float",
        "reorder",
        "add",
        "remove",
        "add-variable",
        "remove-variable",
        "map-value-widening",
    ],
)
def test_allowed_evolutions_pass(new: dict[str, T.StructType]) -> None:
    evolution = check_evolution(history(V1), new)
    assert evolution.is_change


def test_narrowing_is_refused_with_variable_field_and_rule() -> None:
    message = refused({**V1, "b": struct(x=T.IntegerType(), tags=V1["b"]["tags"].dataType)})
    assert "state variable 'b', field 'x': narrowing: bigint → int" in message


def test_other_type_changes_are_refused() -> None:
    message = refused({**V1, "a": struct(n=T.BooleanType(), s=T.StringType())})
    assert "state variable 'a', field 'n': type change: int → boolean" in message


def test_a_map_key_change_is_refused() -> None:
    message = refused(
        {**V1, "b": struct(x=T.LongType(), tags=T.MapType(T.LongType(), T.LongType()))}
    )
    assert "state variable 'b', field 'tags': map key change: key type string → bigint" in message


def test_a_nested_rename_is_confirmed_by_the_path_the_refusal_names() -> None:
    recorded = {"entry_t": struct(change_stats=struct(updates=T.LongType(), deletes=T.LongType()))}
    renamed = {"entry_t": struct(change_stats=struct(edits=T.LongType(), deletes=T.LongType()))}
    with pytest.raises(StateSchemaError) as caught:
        check_evolution(history(recorded), renamed)
    suggestion = str(caught.value).rsplit("confirmed_drops=", 1)[1]
    assert suggestion == "entry_t.change_stats.updates"
    config = load_pipeline_config({"PIPELINE_CONFIRMED_DROPS": f"a.s, {suggestion}"})
    assert config.confirmed_drop_set == {"a.s", suggestion}
    evolution = check_evolution(history(recorded), renamed, config.confirmed_drop_set)
    assert evolution.added_fields == {"entry_t": ("change_stats.edits",)}


@pytest.mark.parametrize("value", ["nodot", "a.", ".b", "a..b", "a.b, c", "a b.c"])
def test_a_confirmed_drop_must_name_a_variable_and_a_field(value: str) -> None:
    with pytest.raises(ConfigError, match=r"expected variable\.field paths"):
        load_pipeline_config({"PIPELINE_CONFIRMED_DROPS": value})


def test_a_rename_must_be_confirmed() -> None:
    renamed = {**V1, "a": struct(n=T.IntegerType(), label=T.StringType())}
    message = refused(renamed)
    assert "state variable 'a', field 's': rename:" in message
    assert "silently drop" in message and "confirmed_drops=a.s" in message
    assert check_evolution(history(V1), renamed, frozenset({"a.s"})).changed_variables == ("a",)


def test_the_evolution_limits_are_spark_s_own() -> None:
    """Spark numbers a variable's value schemas from 0 and refuses number ``threshold``
    (``valueSchemaId + 1 >= threshold``), and refuses schema file ``maxNumStateSchemaFiles + 1``:
    the product refuses exactly what Spark would, one deployment earlier, before Spark starts."""
    versions = [V1]
    for width in (T.LongType(), T.FloatType(), T.DoubleType()):
        versions.append({**V1, "a": struct(n=width, s=T.StringType())})
    past = history(*versions)
    nxt = {**V1, "a": struct(n=T.DoubleType(), s=T.StringType(), extra=T.LongType())}
    with pytest.raises(StateSchemaError) as caught:
        check_evolution(past, nxt, limits=Limits(per_variable=4, per_query=100))
    assert str(caught.value) == (
        "state schema change refused (1): state variable 'a': evolution limit per variable "
        "exceeded: this would be evolution 4 of the variable; with max_evolutions_per_variable=4 "
        "(Spark's spark.sql.streaming.stateStore.valueStateSchemaEvolutionThreshold) Spark "
        "allows 3"
    )
    with pytest.raises(StateSchemaError, match="would be state schema file 5 of the query"):
        check_evolution(past, nxt, limits=Limits(per_variable=100, per_query=4))
    assert check_evolution(past, nxt, limits=Limits(per_variable=5, per_query=5)).is_change


def test_a_variable_added_again_continues_its_evolution_count() -> None:
    """Spark reads every old schema file, so a deleted variable that comes back keeps its
    schema numbers: the count must not restart at the deletion."""
    evolved = {**V1, "a": struct(n=T.LongType(), s=T.StringType())}
    past = [
        Deployment(1, V1),
        Deployment(2, evolved),
        Deployment(3, {"b": V1["b"]}, deleted=("a",)),
    ]
    again = {**V1, "a": struct(n=T.DoubleType(), s=T.StringType())}
    with pytest.raises(StateSchemaError, match="'a': evolution limit per variable exceeded"):
        check_evolution(past, again, limits=Limits(per_variable=2))
    assert check_evolution(past, again, limits=Limits(per_variable=3)).added_variables == ("a",)


def test_the_registry_records_spark_and_avro_schemas(tmp_path: Path) -> None:
    registry = SchemaRegistry(str(tmp_path / "checkpoint"))
    first = registry.record(V1, ())
    assert registry.record(V1, ()) == first
    second = registry.record({"a": V1["a"]}, ("b",))
    reread = SchemaRegistry(str(tmp_path / "checkpoint")).history()
    assert [d.number for d in reread] == [1, 2] and reread[1].deleted == ("b",)
    assert reread[0].schemas == V1 and second.number == 2
    document = json.loads((tmp_path / "checkpoint/_state_schemas/000001.json").read_text())
    avro = document["variables"]["b"]["avro"]
    parsed = fastavro.parse_schema(avro)
    assert isinstance(parsed, dict) and parsed["type"] == "record"
    assert [f["name"] for f in avro["fields"]] == ["x", "tags"]


def test_state_schemas_follow_the_spanner_type_mapping() -> None:
    columns = [
        ColumnType(name, {"code": code}, name == "id", n)
        for n, (name, code) in enumerate(
            [
                ("id", "INT64"),
                ("f", "FLOAT64"),
                ("f32", "FLOAT32"),
                ("b", "BOOL"),
                ("s", "STRING"),
                ("raw", "BYTES"),
                ("d", "DATE"),
                ("ts", "TIMESTAMP"),
                ("num", "NUMERIC"),
                ("doc", "JSON"),
                ("odd", "INTERVAL"),
            ],
            1,
        )
    ]
    columns.append(
        ColumnType("arr", {"code": "ARRAY", "array_element_type": {"code": "INT64"}}, False, 20)
    )
    payload = json.dumps(
        [
            {
                "name": c.name,
                "type": c.type,
                "is_primary_key": c.is_primary_key,
                "ordinal_position": c.ordinal_position,
            }
            for c in columns
        ]
    )
    at = "2026-01-01T00:00:00.000000000Z"
    shapes = merge_shapes([Interval("t", payload, at, at)])
    assert [f.dataType.simpleString() for f in shapes["t"].struct().fields] == [
        "bigint",
        "double",
        "float",
        "boolean",
        "string",
        "binary",
        "date",
        "timestamp",
        "decimal(38,9)",
        "string",
        "string",
        "array<bigint>",
    ]
    schemas = state_schemas(shapes)
    row = image_of(schemas["entry_t"])
    # State layout 2: STRING kept as bytes (STRING↔BYTES never touches state), arrays as JSON
    # text (Spark's Avro state refuses NULL elements); layout 4: TIMESTAMP as epoch microseconds
    # (PySpark reads a timestamp back in local time, which fails near years 1 and 9999).
    assert [f.dataType.simpleString() for f in row.fields] == [
        "bigint",
        "double",
        "float",
        "boolean",
        "binary",
        "binary",
        "date",
        "bigint",
        "decimal(38,9)",
        "string",
        "string",
        "string",
    ]
    # State layout 3: a key's image, position and statistics are one value.
    assert set(schemas) == {"entry_t", "tombstone"}
    assert schemas["entry_t"].fieldNames() == ["image", "last_applied", "change_stats"]
    fastavro.parse_schema(avro_schema(schemas["entry_t"], "entry_t"))


def test_a_layout_2_checkpoint_keeps_its_variables_as_recorded() -> None:
    """Keys not rewritten since are read from them; a later column changes only the entry."""
    recorded = {
        "row_accounts": struct(account_id=T.LongType(), owner=T.BinaryType()),
        "last_applied": LAST_APPLIED,
        "change_stats": CHANGE_STATS,
        "tombstone": TOMBSTONE,
    }
    payload = json.dumps(
        [
            {"name": name, "type": {"code": code}, "is_primary_key": n == 1, "ordinal_position": n}
            for n, (name, code) in enumerate(
                [("account_id", "INT64"), ("owner", "STRING"), ("email", "STRING")], 1
            )
        ]
    )
    at = "2026-11-22T00:00:00.000000000Z"
    shapes = merge_shapes([Interval("accounts", payload, at, at)])
    schemas = state_schemas(shapes, recorded)
    assert set(schemas) == {*recorded, "entry_accounts"}
    assert schemas["row_accounts"] == recorded["row_accounts"]
    assert "email" in image_of(schemas["entry_accounts"]).fieldNames()
    evolution = check_evolution([Deployment(1, recorded, layout=2)], schemas)
    assert evolution.added_variables == ("entry_accounts",)
    assert evolution.removed_variables == ()
    assert legacy_variables(schemas) == {n: s for n, s in recorded.items() if n != "tombstone"}
    assert state_schemas(shapes, state_schemas(shapes)) == state_schemas(shapes)


def test_mod_values_become_values_of_the_mapped_spark_type() -> None:
    int_array = {"code": "ARRAY", "array_element_type": {"code": "INT64"}}
    widest = "-99999999999999999999999999999.999999999"
    assert spark_value({"code": "NUMERIC"}, widest) == Decimal(widest)
    assert spark_value({"code": "NUMERIC"}, "0.5") == Decimal("0.500000000")
    assert spark_value({"code": "TIMESTAMP"}, "2026-01-02T03:04:05.123456789Z") == dt.datetime(
        2026, 1, 2, 3, 4, 5, 123456, tzinfo=dt.UTC
    )
    assert spark_value({"code": "BYTES"}, "aGk=") == b"hi"
    assert spark_value(int_array, ["1", None, "3"]) == [1, None, 3]
    assert spark_value({"code": "INT64"}, "9007199254740993") == 9007199254740993
    assert spark_value({"code": "JSON"}, '{"b":1}') == '{"b":1}'
    assert spark_value({"code": "INTERVAL"}, "P1D") == "P1D"


def test_a_spanner_read_and_a_mirror_row_compare_in_one_form() -> None:
    pairs: list[tuple[dict[str, Any], Any, Any]] = [
        ({"code": "BYTES"}, b"aGk=", b"hi"),
        ({"code": "NUMERIC"}, Decimal("1.5"), Decimal("1.500000000")),
        ({"code": "JSON"}, JsonObject({"b": [1, 2], "a": None}), '{"a":null,"b":[1,2]}'),
        (
            {"code": "TIMESTAMP"},
            DatetimeWithNanoseconds(2026, 1, 2, 3, 4, 5, nanosecond=123456789, tzinfo=dt.UTC),
            dt.datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=dt.UTC),
        ),
        ({"code": "FLOAT32"}, 0.1, struct_module.unpack("f", struct_module.pack("f", 0.1))[0]),
        (
            {"code": "ARRAY", "array_element_type": {"code": "BYTES"}},
            [b"aGk=", None],
            [b"hi", None],
        ),
    ]
    for spanner_type, from_spanner, from_mirror in pairs:
        assert canonical(spanner_type, from_spanner, spanner=True) == canonical(
            spanner_type, from_mirror, spanner=False
        ), spanner_type
    assert canonical({"code": "INT64"}, 1, spanner=True) != canonical(
        {"code": "INT64"}, 2, spanner=False
    )
    written = dt.datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=dt.UTC)
    streamed = written.replace(microsecond=0)
    assert canonical({"code": "TIMESTAMP"}, written, True, 0) == canonical(
        {"code": "TIMESTAMP"}, streamed, False, 0
    )
    assert canonical({"code": "TIMESTAMP"}, written, True) != canonical(
        {"code": "TIMESTAMP"}, streamed, False
    )


def test_check_state_schema_command_refuses_before_spark(tmp_path: Path) -> None:
    changelog = ChangeLog(str(tmp_path / "changelog"))
    changelog.commit(("accounts", "INSERT", {"account_id": "1"}, {"owner": "a", "balance": "5"}))
    changelog.land()
    checkpoint = tmp_path / "checkpoint"
    args = [
        sys.executable,
        "-m",
        "pipeline",
        "check-state-schema",
        "--changelog",
        str(tmp_path / "changelog"),
        "--checkpoint",
        str(checkpoint),
    ]
    first = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0 and first.stdout.startswith("ok: added variables"), first.stderr
    recorded = state_schemas(merge_shapes([]))
    recorded["entry_accounts"] = T.StructType(
        [
            T.StructField(
                "image",
                struct(account_id=T.LongType(), owner=T.BinaryType(), balance=T.DoubleType()),
            ),
            T.StructField("last_applied", LAST_APPLIED),
            T.StructField("change_stats", CHANGE_STATS),
        ]
    )
    SchemaRegistry(str(checkpoint)).record(recorded, ())
    second = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert second.returncode == 2
    assert second.stderr.strip().splitlines() == [
        "error: state schema change refused (1): state variable 'entry_accounts', field "
        "'image.balance': narrowing: double → bigint; allowed are int→bigint/float/double, "
        "bigint→float/double, float→double and string↔binary"
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trigger", "sometimes"], "error: PIPELINE_TRIGGER='sometimes': expected one of"),
        (["--confirmed-drops", "nodot"], "error: PIPELINE_CONFIRMED_DROPS='nodot': expected"),
        (["--bogus"], "error: unrecognized arguments: --bogus"),
    ],
)
def test_bad_pipeline_options_get_one_error_line(args: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pipeline", "run", *args], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), result.stderr


def test_a_metrics_port_in_use_gets_one_error_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "pipeline", "run", "--changelog", str(tmp_path / "none")],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PIPELINE_METRICS_PORT": str(port)},
        )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: PIPELINE_METRICS_PORT={port}: cannot serve /metrics: Address already in use"
    ]


def test_a_lock_file_cut_short_blocks_only_until_it_is_stale(tmp_path: Path) -> None:
    """A writer killed mid-heartbeat used to leave an empty lock file that no start could pass."""
    from pipeline.state.checkpoint import LOCK_FILE, CheckpointInUse, CheckpointLock

    lock_file = tmp_path / LOCK_FILE
    lock_file.write_text("")
    with pytest.raises(CheckpointInUse, match="unreadable lock file"):
        CheckpointLock(str(tmp_path), 5, "second").acquire()
    os.utime(lock_file, (time.time() - 60, time.time() - 60))
    lock = CheckpointLock(str(tmp_path), 5, "second")
    lock.acquire()
    try:
        assert json.loads(lock_file.read_text())["job"] == "second"
        assert [p.name for p in tmp_path.iterdir()] == [LOCK_FILE]
    finally:
        lock.release()
    assert not lock_file.exists()


def test_a_lock_whose_pid_this_process_now_has_is_taken_at_once(tmp_path: Path) -> None:
    """A container restarted after a kill -9 keeps its host name and, under tini, its pid: the
    dead holder's fresh heartbeat names a pid that answers, as this process. A live holder of
    this host still blocks, and so does one whose lock predates the start field."""
    from pipeline.state.checkpoint import (
        LOCK_FILE,
        CheckpointInUse,
        CheckpointLock,
        process_started,
    )

    me = {"owner": "killed", "host": socket.gethostname(), "pid": os.getpid(), "job": "before"}
    lock_file = tmp_path / LOCK_FILE
    for holder in ({**me, "started": process_started(os.getpid())}, me):
        lock_file.write_text(json.dumps({**holder, "heartbeat": time.time()}))
        with pytest.raises(CheckpointInUse, match="in use by before"):
            CheckpointLock(str(tmp_path), 60, "after").acquire()
    boot, _ = str(process_started(os.getpid())).split(":")
    lock_file.write_text(json.dumps({**me, "started": f"{boot}:1", "heartbeat": time.time()}))
    lock = CheckpointLock(str(tmp_path), 60, "after")
    lock.acquire()
    try:
        assert json.loads(lock_file.read_text())["job"] == "after"
    finally:
        lock.release()


def test_a_layout_1_checkpoint_is_refused_with_one_line_on_how_to_rebuild() -> None:
    old = {"row_t": struct(id=T.LongType(), s=T.StringType())}
    with pytest.raises(StateSchemaError) as caught:
        check_evolution([Deployment(1, old, layout=1)], {"row_t": old["row_t"]})
    assert caught.value.refusals == [
        Refusal(
            "*",
            "",
            "state layout changed",
            "the checkpoint was recorded with state layout 1, this version reads layouts 2 to 4 "
            "(STRING as bytes, arrays as JSON text); rebuild the mirrors from the change log "
            "(docs/operations.md, Replay)",
        )
    ]


ALLOWED_CHANGES = ALLOWED_TYPE_CHANGES
"""Spark's Avro widenings, STRING↔BYTES, and a timestamp read as its epoch microseconds: the
type rule is checked on its own above; these histories test the rules across deployments."""
FIELD_TYPES = [T.IntegerType(), T.LongType(), T.DoubleType(), T.StringType(), T.BinaryType()]
FIELD_TYPES += [T.BooleanType(), T.TimestampType()]


def expected_refusals(
    accepted: list[dict[str, T.StructField]], new: dict[str, T.StructField], confirmed: set[str]
) -> set[tuple[str, str]]:
    """Seed 004's rules over a whole history, written out flat: (field, rule) pairs."""
    last = accepted[-1]
    ever = {name for schema in accepted for name in schema}
    refusals = set()
    for name, field in new.items():
        before = last.get(name)
        if before is not None:
            pair = (before.dataType.simpleString(), field.dataType.simpleString())
            if pair[0] != pair[1] and pair not in ALLOWED_CHANGES:
                narrowing = pair[::-1] in ALLOWED_CHANGES and pair[1] != "timestamp"
                rule = "narrowing" if narrowing else "type change"
                refusals.add((name, rule))
            continue
        if not field.nullable:
            refusals.add((name, "added field without a default"))
        if name in ever and name not in confirmed:
            refusals.add((name, "re-added after removal"))
    added_types = {f.dataType for n, f in new.items() if n not in last}
    for name, field in last.items():
        if name not in new and field.dataType in added_types and name not in confirmed:
            refusals.add((name, "rename"))
    return refusals


deployment_fields = st.dictionaries(
    st.sampled_from(["p", "q", "r", "s"]),
    st.tuples(st.sampled_from(FIELD_TYPES), st.booleans() | st.just(True)),
    min_size=1,
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(deployment_fields, min_size=3, max_size=6),
    st.sets(st.sampled_from(["p", "q", "r", "s"])),
)
def test_the_gate_over_deployment_histories_follows_seed_004(
    deployments: list[dict[str, tuple[T.DataType, bool]]], confirmed: set[str]
) -> None:
    """Remove, re-add, rename, retype and nullability over three or more deployments: each
    deployment is refused exactly when a rule is broken against every deployment recorded
    before it, with a line naming the variable, the field and the rule."""
    as_fields = [
        {name: T.StructField(name, kind, nullable) for name, (kind, nullable) in d.items()}
        for d in deployments
    ]
    recorded = [as_fields[0]]
    past = [Deployment(1, {"v": T.StructType(list(as_fields[0].values()))})]
    for fields in as_fields[1:]:
        new = {"v": T.StructType(list(fields.values()))}
        expected = expected_refusals(recorded, fields, confirmed)
        drops = frozenset(f"v.{name}" for name in confirmed)
        try:
            check_evolution(past, new, drops)
        except StateSchemaError as error:
            found = {(r.field, r.rule) for r in error.refusals}
            assert found == expected
            assert "\n" not in str(error)
            for field, rule in expected:
                assert f"state variable 'v', field '{field}': {rule}" in str(error)
            continue
        assert expected == set()
        recorded.append(fields)
        past.append(Deployment(len(past) + 1, new))


def test_a_field_removed_then_added_back_is_refused_unless_confirmed() -> None:
    """Seed 004's lost update: keys written while the field was gone would read None, the
    others their old value."""
    with_email = {"v": struct(n=T.LongType(), email=T.StringType())}
    without = {"v": struct(n=T.LongType())}
    past = history(with_email, without)
    with pytest.raises(StateSchemaError) as caught:
        check_evolution(past, with_email)
    assert "state variable 'v', field 'email': re-added after removal" in str(caught.value)
    assert "confirmed_drops=v.email" in str(caught.value)
    assert check_evolution(past, with_email, frozenset({"v.email"})).added_fields == {
        "v": ("email",)
    }


def test_an_added_field_that_is_not_nullable_is_refused() -> None:
    strict = T.StructType(
        [T.StructField("n", T.LongType()), T.StructField("m", T.LongType(), False)]
    )
    with pytest.raises(StateSchemaError) as caught:
        check_evolution(history({"v": struct(n=T.LongType())}), {"v": strict})
    assert "state variable 'v', field 'm': added field without a default" in str(caught.value)


def test_each_pipeline_command_lists_only_the_options_it_reads(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``as-of --help`` once listed every option of ``run`` (--trigger, --master, ...)."""
    from pipeline.cli import COMMANDS, OPTION_FLAGS, build_parser

    for name, (_, flags) in COMMANDS.items():
        with pytest.raises(SystemExit):
            build_parser().parse_args([name, "--help"])
        shown = capsys.readouterr().out
        listed = {flag for flag in OPTION_FLAGS if f"--{flag.replace('_', '-')} " in shown}
        assert listed == set(flags), name
    assert "trigger" not in COMMANDS["as-of"][1] and "mirrors" in COMMANDS["as-of"][1]
