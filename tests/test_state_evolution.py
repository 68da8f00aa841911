"""Every allowed state evolution on real Spark (RocksDB, Avro): run v1, stop, restart on the same
checkpoint with v2, read what v2 finds. One variable per evolution, all in one restart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pyspark.sql import Row
from pyspark.sql import types as T
from pyspark.sql.streaming.stateful_processor import StatefulProcessor, StatefulProcessorHandle

from pipeline.state.compatibility import check_evolution
from pipeline.state.registry import Deployment
from tests.pipeline_runs import build_test_session


def struct(**fields: T.DataType) -> T.StructType:
    return T.StructType([T.StructField(name, kind) for name, kind in fields.items()])


V1 = {
    "int_to_long": (struct(v=T.IntegerType()), (7,)),
    "long_to_double": (struct(v=T.LongType()), (2**40,)),
    "float_to_double": (struct(v=T.FloatType()), (1.5,)),
    "string_to_bytes": (struct(v=T.StringType()), ("héllo",)),
    "bytes_to_string": (struct(v=T.BinaryType()), (b"abc",)),
    "add_field": (struct(a=T.LongType()), (1,)),
    "remove_field": (struct(a=T.LongType(), b=T.StringType()), (2, "gone")),
    "reorder": (struct(a=T.LongType(), b=T.StringType()), (3, "three")),
    "removed_variable": (struct(a=T.LongType()), (4,)),
    "add_nested_field": (
        struct(image=struct(a=T.LongType()), position=struct(p=T.StringType())),
        ((5,), ("five",)),
    ),
}
V2 = {
    "int_to_long": struct(v=T.LongType()),
    "long_to_double": struct(v=T.DoubleType()),
    "float_to_double": struct(v=T.DoubleType()),
    "string_to_bytes": struct(v=T.BinaryType()),
    "bytes_to_string": struct(v=T.StringType()),
    "add_field": struct(a=T.LongType(), b=T.StringType()),
    "remove_field": struct(a=T.LongType()),
    "reorder": struct(b=T.StringType(), a=T.LongType()),
    "added_variable": struct(a=T.LongType()),
    "add_nested_field": struct(
        image=struct(a=T.LongType(), b=T.BinaryType()), position=struct(p=T.StringType())
    ),
}
OUTPUT = struct(k=T.StringType(), seen=T.StringType())


class Writer(StatefulProcessor):
    """v1: writes the known values."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.states = {n: handle.getValueState(n, schema) for n, (schema, _) in V1.items()}

    def handleInputRows(self, key, rows, timerValues):
        for _ in rows:
            pass
        for name, (_, value) in V1.items():
            self.states[name].update(value)
        yield Row(k=key[0], seen="{}")

    def close(self) -> None:
        pass


class Reader(StatefulProcessor):
    """v2: reads what the evolved schemas carry, with deleteIfExists for the removed variable."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        handle.deleteIfExists("removed_variable")
        self.states = {n: handle.getValueState(n, schema) for n, schema in V2.items()}

    def handleInputRows(self, key, rows, timerValues):
        for _ in rows:
            pass
        seen = {}
        for name, schema in V2.items():
            state = self.states[name]
            if state.exists():
                values = dict(zip(schema.fieldNames(), state.get(), strict=True))
                seen[name] = {
                    k: v.hex() if isinstance(v, bytes | bytearray) else [type(v).__name__, v]
                    for k, v in values.items()
                }
            else:
                seen[name] = None
        yield Row(k=key[0], seen=json.dumps(seen))

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def spark():
    session = build_test_session("state-evolution", shuffle_partitions=2)
    yield session
    session.stop()


def run(spark, source: str, checkpoint: str, processor: StatefulProcessor) -> list[dict]:
    seen: list[dict] = []
    query = (
        spark.readStream.format("delta")
        .load(source)
        .groupBy("k")
        .transformWithState(processor, OUTPUT, "Update", "None")
        .writeStream.foreachBatch(lambda batch, _: seen.extend(r.asDict() for r in batch.collect()))
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    return seen


def test_each_allowed_evolution_carries_state_across_a_restart(spark, tmp_path: Path) -> None:
    v1 = {name: schema for name, (schema, _) in V1.items()}
    evolution = check_evolution([Deployment(1, v1)], V2)
    assert evolution.removed_variables == ("removed_variable",)
    assert evolution.added_variables == ("added_variable",)

    source, checkpoint = str(tmp_path / "source"), str(tmp_path / "checkpoint")
    spark.createDataFrame([("key",)], "k string").write.format("delta").save(source)
    run(spark, source, checkpoint, Writer())
    spark.createDataFrame([("key",)], "k string").write.format("delta").mode("append").save(source)
    [row] = run(spark, source, checkpoint, Reader())
    seen = json.loads(row["seen"])
    assert seen["int_to_long"] == {"v": ["int", 7]}
    assert seen["long_to_double"] == {"v": ["float", float(2**40)]}
    assert seen["float_to_double"] == {"v": ["float", 1.5]}
    assert seen["string_to_bytes"] == {"v": "héllo".encode().hex()}
    assert seen["bytes_to_string"] == {"v": ["str", "abc"]}
    assert seen["add_field"] == {"a": ["int", 1], "b": ["NoneType", None]}
    assert seen["remove_field"] == {"a": ["int", 2]}
    assert seen["reorder"] == {"b": ["str", "three"], "a": ["int", 3]}
    assert seen["added_variable"] is None
    assert seen["add_nested_field"] == {"image": ["Row", [5, None]], "position": ["Row", ["five"]]}
