"""A banking workload that records exactly what it committed, for checking a reader against.

Transactions: transfers (read two balances, update both, insert a transfer row; the total balance
stays constant), inserts/updates/deletes of rows using every common Spanner type, and deletes of
old transfers. Each committed transaction is recorded with its commit timestamp and its mods as
Python values (the same values ``ingest.model.values.decode_value`` yields from the change stream).

Usage: ``python -m emulator.workload --duration 30 --rate 100 --out committed.jsonl``
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import json
import os
import random
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from google.cloud import spanner
from google.cloud.spanner_v1.data_types import JsonObject
from google.cloud.spanner_v1.database import Database

from ingest.model.timestamps import Nanos, from_datetime, to_datetime, to_rfc3339

ALL_TYPES_COLUMNS = (
    "col_int64",
    "col_float64",
    "col_float32",
    "col_bool",
    "col_string",
    "col_bytes",
    "col_date",
    "col_timestamp",
    "col_numeric",
    "col_json",
    "col_int64_array",
    "col_string_array",
    "col_float64_array",
)


@dataclass(frozen=True, slots=True)
class WrittenMod:
    table: str
    mod_type: str
    keys: dict[str, Any]
    values: dict[str, Any]


@dataclass(frozen=True, slots=True)
class CommittedTransaction:
    commit_timestamp: Nanos
    kind: str
    mods: tuple[WrittenMod, ...]


Mods = tuple[WrittenMod, ...] | None


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    duration_seconds: float = 30.0
    transactions_per_second: float | None = None
    """Target rate; None runs as fast as the database commits."""
    max_transactions: int | None = None
    least_transactions: int = 0
    """The run goes on past ``duration_seconds`` until this many have committed: a loaded
    machine commits fewer than the rate asks."""
    rows_per_transaction: int = 1
    accounts: int = 100
    seed: int = 0
    transfer_weight: float = 0.6
    all_types_weight: float = 0.3
    cleanup_weight: float = 0.1


@dataclass
class _State:
    all_types_keys: list[tuple[int, str]] = field(default_factory=list)
    transfer_keys: list[tuple[int, str]] = field(default_factory=list)
    next_id: int = 0


def _float32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


def random_all_types_values(rng: random.Random) -> dict[str, Any]:
    """Values of every column type, as Python values; a few are NULL."""
    seconds = rng.randint(0, 4_000_000_000)
    nanos = rng.randint(0, 999_999_999)
    values: dict[str, Any] = {
        "col_int64": rng.choice([rng.randint(-(2**63), 2**63 - 1), rng.randint(-1000, 1000)]),
        "col_float64": rng.choice([rng.uniform(-1e12, 1e12), 0.1, -0.0, 1e-300]),
        "col_float32": _float32(rng.uniform(-1e6, 1e6)),
        "col_bool": rng.random() < 0.5,
        "col_string": rng.choice(["plain", "ünïcödé ✓", 'quote"and\\slash', "emoji 🎉", ""]),
        "col_bytes": rng.randbytes(rng.randint(0, 32)),
        "col_date": dt.date(1900, 1, 1) + dt.timedelta(days=rng.randint(0, 80_000)),
        "col_timestamp": seconds * 1_000_000_000 + nanos,
        "col_numeric": Decimal(rng.randint(-(10**29) + 1, 10**29 - 1)).scaleb(-9),
        "col_json": {"n": rng.randint(0, 99), "f": 1.5, "s": "x", "l": [1, "two", None], "o": {}},
        "col_int64_array": [rng.randint(-(2**63), 2**63 - 1) for _ in range(rng.randint(0, 3))],
        "col_string_array": [rng.choice(["a", "β", ""]) for _ in range(rng.randint(0, 3))],
        "col_float64_array": [rng.uniform(-1e3, 1e3) for _ in range(rng.randint(0, 3))],
    }
    for column in ALL_TYPES_COLUMNS:
        if rng.random() < 0.08:
            values[column] = None
    return values


def to_mutation_value(column: str, value: Any) -> Any:
    """The value the Spanner client expects in a mutation for a Python value of the column."""
    if value is None:
        return None
    if column == "col_bytes":
        return base64.b64encode(value)
    if column in ("col_timestamp", "updated_at", "created_at"):
        return to_datetime(value)
    if column == "col_json":
        return JsonObject(value)
    return value


def _now_nanos() -> Nanos:
    return time.time_ns()


NEW_COLUMN_KINDS: list[tuple[str, Any]] = [
    ("STRING(MAX)", "text ü"),
    ("INT64", -(2**63)),
    ("FLOAT64", 2.5),
    ("BOOL", True),
    ("DATE", dt.date(1, 1, 1)),
    ("TIMESTAMP", dt.datetime(2026, 11, 24, 12, 0, 1, tzinfo=dt.UTC)),
    ("NUMERIC", Decimal("12345678901234567890.123456789")),
    ("BYTES(MAX)", base64.b64encode(b"\x00\xff")),
    ("JSON", json.dumps({"a": [1, None]})),
    ("ARRAY<INT64>", [1, None, 3]),
]
"""A column type of each kind Spanner has (for ``ALTER TABLE ... ADD COLUMN``) and a value of
it, as the client takes it: what tests and the soak add to a table while the product runs."""


class Workload:
    def __init__(self, database: Database, config: WorkloadConfig) -> None:
        self._database = database
        self._config = config
        self._rng = random.Random(config.seed)
        self._state = _State(next_id=config.seed * 1_000_000_000)
        self.committed: list[CommittedTransaction] = []
        self.aborted_retries = 0

    def run(self, stop: threading.Event | None = None) -> list[CommittedTransaction]:
        config = self._config
        started = time.monotonic()
        kinds: list[tuple[str, Callable[[], Callable[[Any], Mods] | None]]] = [
            ("transfer", self._transfer),
            ("all_types", self._all_types),
            ("cleanup", self._cleanup),
        ]
        weights = [config.transfer_weight, config.all_types_weight, config.cleanup_weight]
        while (
            time.monotonic() - started < config.duration_seconds
            or len(self.committed) < config.least_transactions
        ):
            if stop is not None and stop.is_set():
                break
            if (
                config.max_transactions is not None
                and len(self.committed) >= config.max_transactions
            ):
                break
            kind, make = self._rng.choices(kinds, weights)[0]
            self._commit(kind, make)
            if config.transactions_per_second:
                due = started + len(self.committed) / config.transactions_per_second
                time.sleep(max(0.0, due - time.monotonic()))
        return self.committed

    def _commit(self, kind: str, make: Callable[[], Callable[[Any], Mods] | None]) -> None:
        apply = make()
        if apply is None:
            return
        attempts: list[Any] = []

        def work(transaction: Any) -> Mods:
            attempts.append(transaction)
            return apply(transaction)

        mods = self._database.run_in_transaction(work, timeout_secs=ABORTED_RETRY_S)
        self.aborted_retries += len(attempts) - 1
        if mods:
            self._after_commit(mods)
            committed = from_datetime(attempts[-1].committed)
            self.committed.append(CommittedTransaction(committed, kind, mods))

    # Each maker returns a function run inside the read-write transaction (retried on ABORTED).

    def _transfer(self) -> Callable[[Any], Mods]:
        source, target = self._rng.sample(range(self._config.accounts), 2)
        fraction = self._rng.random()
        transfer_id = str(uuid.UUID(int=self._rng.getrandbits(128)))

        def apply(transaction: Any) -> tuple[WrittenMod, ...] | None:
            keyset = spanner.KeySet(keys=[[source], [target]])
            balances = dict(transaction.read("accounts", ["account_id", "balance"], keyset))
            amount = int(balances[source] * fraction)
            if amount <= 0:
                return None
            now = _now_nanos()
            new_balances = {source: balances[source] - amount, target: balances[target] + amount}
            transaction.update(
                "accounts",
                ["account_id", "balance", "updated_at"],
                [(k, v, to_mutation_value("updated_at", now)) for k, v in new_balances.items()],
            )
            transaction.insert(
                "transfers",
                ["from_account_id", "transfer_id", "to_account_id", "amount", "created_at"],
                [(source, transfer_id, target, amount, to_mutation_value("created_at", now))],
            )
            return (
                *(
                    WrittenMod(
                        "accounts", "UPDATE", {"account_id": k}, {"balance": v, "updated_at": now}
                    )
                    for k, v in new_balances.items()
                ),
                WrittenMod(
                    "transfers",
                    "INSERT",
                    {"from_account_id": source, "transfer_id": transfer_id},
                    {"to_account_id": target, "amount": amount, "created_at": now},
                ),
            )

        return apply

    def _all_types(self) -> Callable[[Any], Mods]:
        rng, state = self._rng, self._state
        plans: list[tuple[str, tuple[int, str], dict[str, Any]]] = []
        taken: set[tuple[int, str]] = set()
        for _ in range(self._config.rows_per_transaction):
            choice = rng.random()
            existing = [k for k in state.all_types_keys if k not in taken]
            if existing and choice < 0.25:
                key = rng.choice(existing)
                plans.append(("DELETE", key, {}))
            elif existing and choice < 0.6:
                key = rng.choice(existing)
                columns = rng.sample(ALL_TYPES_COLUMNS, rng.randint(1, 4))
                values = random_all_types_values(rng)
                plans.append(("UPDATE", key, {c: values[c] for c in columns}))
            else:
                state.next_id += 1
                key = (state.next_id, rng.choice(["alpha", "beta"]))
                plans.append(("INSERT", key, random_all_types_values(rng)))
            taken.add(key)

        def apply(transaction: Any) -> tuple[WrittenMod, ...]:
            mods = []
            for mod_type, (row_id, variant), values in plans:
                keys = {"id": row_id, "variant": variant}
                if mod_type == "DELETE":
                    transaction.delete("all_types", spanner.KeySet(keys=[[row_id, variant]]))
                else:
                    write = transaction.insert if mod_type == "INSERT" else transaction.update
                    columns = ["id", "variant", *values]
                    row = [row_id, variant, *(to_mutation_value(c, v) for c, v in values.items())]
                    write("all_types", columns, [row])
                mods.append(WrittenMod("all_types", mod_type, keys, values))
            return tuple(mods)

        return apply

    def _cleanup(self) -> Callable[[Any], Mods] | None:
        if not self._state.transfer_keys:
            return None
        key = self._state.transfer_keys[0]

        def apply(transaction: Any) -> tuple[WrittenMod, ...]:
            transaction.delete("transfers", spanner.KeySet(keys=[list(key)]))
            return (
                WrittenMod(
                    "transfers", "DELETE", {"from_account_id": key[0], "transfer_id": key[1]}, {}
                ),
            )

        return apply

    def _after_commit(self, mods: tuple[WrittenMod, ...]) -> None:
        for mod in mods:
            if mod.table == "all_types":
                key = (mod.keys["id"], mod.keys["variant"])
                if mod.mod_type == "INSERT":
                    self._state.all_types_keys.append(key)
                elif mod.mod_type == "DELETE":
                    self._state.all_types_keys.remove(key)
            elif mod.table == "transfers":
                key = (mod.keys["from_account_id"], mod.keys["transfer_id"])
                if mod.mod_type == "INSERT":
                    self._state.transfer_keys.append(key)
                elif mod.mod_type == "DELETE":
                    self._state.transfer_keys.remove(key)


EXISTING_ALL_TYPES_IDS = 1_000_000_000
"""all_types ids of rows written before a job starts; the workload's own ids count up from 1."""
ABORTED_RETRY_S = 120.0
"""How long a transaction is retried on ABORTED (the client's default is 30 s). The emulator runs
one read-write transaction at a time and keeps one open whose call a GOAWAY cancelled: every
other transaction is ABORTED behind it for over 30 s, until the emulator drops it (seen twice
near the 29th minute of a suite run: emulator/NOTES.md)."""


def load_existing_rows(
    database: Database,
    accounts: int,
    transfers: int,
    all_types: int,
    seed: int = 0,
    rows_per_commit: int = 2_000,
) -> int:
    """Rows a database already holds when a job starts (the initial snapshot's input): transfers
    between the first ``accounts`` accounts and all_types rows of every type, a few NULL.
    Returns the rows written. Its random stream is not the workload's of the same seed, whose
    first transfer ids would be these rows' keys."""
    rng = random.Random(f"existing rows {seed}")
    moment = time.time_ns()
    transfer_rows = [
        (
            rng.randrange(accounts),
            str(uuid.UUID(int=rng.getrandbits(128))),
            rng.randrange(accounts),
            rng.randint(1, 1000),
            to_mutation_value("created_at", moment - rng.randint(0, 10**15)),
        )
        for _ in range(transfers)
    ]
    columns = ["id", "variant", *ALL_TYPES_COLUMNS]
    typed_rows: list[list[Any]] = []
    for number in range(all_types):
        values = random_all_types_values(rng)
        key = [EXISTING_ALL_TYPES_IDS + number, rng.choice(["alpha", "beta"])]
        typed_rows.append([*key, *(to_mutation_value(c, values[c]) for c in ALL_TYPES_COLUMNS)])
    for start in range(0, max(transfers, all_types), rows_per_commit):
        with database.batch() as batch:
            if chunk := transfer_rows[start : start + rows_per_commit]:
                batch.insert(
                    "transfers",
                    ["from_account_id", "transfer_id", "to_account_id", "amount", "created_at"],
                    chunk,
                )
            if typed_chunk := typed_rows[start : start + rows_per_commit]:
                batch.insert("all_types", columns, typed_chunk)
    return transfers + all_types


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"$bytes": base64.b64encode(value).decode()}
    if isinstance(value, Decimal):
        return {"$numeric": str(value)}
    if isinstance(value, dt.date):
        return {"$date": value.isoformat()}
    raise TypeError(f"cannot encode {value!r}")


def committed_to_json(transaction: CommittedTransaction) -> str:
    return json.dumps(
        {
            "commit_timestamp": to_rfc3339(transaction.commit_timestamp),
            "kind": transaction.kind,
            "mods": [
                {"table": m.table, "mod_type": m.mod_type, "keys": m.keys, "values": m.values}
                for m in transaction.mods
            ],
        },
        default=_json_default,
        sort_keys=True,
    )


def run_in_subprocess(database_id: str, seconds: float, rate: float, seed: int = 0) -> int:
    """Run the workload in a process of its own (so it does not share a measured process's GIL);
    returns how many transactions it committed."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "emulator.workload",
            "--database",
            database_id,
            "--duration",
            str(seconds),
            "--rate",
            str(rate),
            "--seed",
            str(seed),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(result.stderr.split("committed ")[1].split()[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m emulator.workload", description=__doc__)
    parser.add_argument("--project", default=os.environ.get("SPANNER_PROJECT", "local-project"))
    parser.add_argument("--instance", default=os.environ.get("SPANNER_INSTANCE", "local-instance"))
    parser.add_argument("--database", default=os.environ.get("SPANNER_DATABASE", "bank"))
    parser.add_argument("--duration", type=float, default=30.0, help="seconds")
    parser.add_argument("--rate", type=float, default=None, help="transactions per second")
    parser.add_argument("--max-transactions", type=int, default=None)
    parser.add_argument("--rows-per-transaction", type=int, default=1)
    parser.add_argument("--accounts", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON lines file of committed transactions")
    args = parser.parse_args(argv)
    database = spanner.Client(project=args.project).instance(args.instance).database(args.database)
    workload = Workload(
        database,
        WorkloadConfig(
            duration_seconds=args.duration,
            transactions_per_second=args.rate,
            max_transactions=args.max_transactions,
            rows_per_transaction=args.rows_per_transaction,
            accounts=args.accounts,
            seed=args.seed,
        ),
    )
    committed = workload.run()
    if args.out:
        with open(args.out, "w") as out:
            out.writelines(committed_to_json(t) + "\n" for t in committed)
    print(
        f"committed {len(committed)} transactions ({workload.aborted_retries} aborted retries)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
