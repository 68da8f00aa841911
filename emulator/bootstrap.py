"""Create the sample instance, database, tables and change streams on the emulator (idempotent).

Usage: ``SPANNER_EMULATOR_HOST=127.0.0.1:9010 python -m emulator.bootstrap --dialect googlesql``
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable
from importlib import resources

from google.api_core import exceptions as api_exceptions
from google.cloud import spanner
from google.cloud.spanner_admin_database_v1.types import DatabaseDialect
from google.cloud.spanner_v1.database import Database

DEFAULT_PROJECT = "local-project"
DEFAULT_INSTANCE = "local-instance"
DEFAULT_DATABASE = "bank"
EMULATOR_CONFIG = "emulator-config"
DIALECTS = ("googlesql", "postgresql")


def load_ddl(dialect: str) -> list[str]:
    """The statements of the dialect's schema file, comments removed."""
    text = resources.files("emulator").joinpath(f"schema_{dialect}.sql").read_text()
    lines = [line for line in text.splitlines() if not line.strip().startswith("--")]
    return [stmt.strip() for stmt in "\n".join(lines).split(";") if stmt.strip()]


def bootstrap(
    client: spanner.Client,
    instance_id: str = DEFAULT_INSTANCE,
    database_id: str = DEFAULT_DATABASE,
    dialect: str = "googlesql",
    accounts: int = 100,
    initial_balance: int = 1000,
    existing: Callable[[Database], object] | None = None,
) -> Database:
    """``existing`` writes the rows the database holds before its change streams are created,
    as in a database a user starts capturing: the emulator then keeps no change records of
    them, which cost it about 90 CPU-s and 90 s per 100,000 rows (emulator/NOTES.md)."""
    instance = client.instance(
        instance_id,
        configuration_name=f"projects/{client.project}/instanceConfigs/{EMULATOR_CONFIG}",
        node_count=1,
    )
    with contextlib.suppress(api_exceptions.AlreadyExists):
        instance.create().result(timeout=60)
    ddl = load_ddl(dialect)
    streams = [s for s in ddl if _is_stream(s)] if existing is not None else []
    ddl = [s for s in ddl if s not in streams]
    if dialect == "postgresql":
        database = instance.database(database_id, database_dialect=DatabaseDialect.POSTGRESQL)
        created = _create(database)
        if created:
            database.update_ddl(ddl).result(timeout=120)
    else:
        database = instance.database(database_id, ddl_statements=ddl)
        created = _create(database)
    seed_accounts(database, accounts, initial_balance)
    if existing is not None and created:
        existing(database)
        database.update_ddl(streams).result(timeout=120)
    return database


def _is_stream(statement: str) -> bool:
    return statement.upper().startswith("CREATE CHANGE STREAM")


def _create(database: Database) -> bool:
    try:
        database.create().result(timeout=120)
    except api_exceptions.AlreadyExists:
        return False
    return True


def seed_accounts(database: Database, accounts: int, initial_balance: int) -> None:
    with database.snapshot() as snapshot:
        existing = next(iter(snapshot.execute_sql("SELECT COUNT(*) FROM accounts")))[0]
    if existing or not accounts:
        return
    # In commits of 2,000 rows: the emulator's time per commit grows faster than its size
    # (20,000 accounts in one commit took 82 s here).
    for first in range(0, accounts, 2_000):
        with database.batch() as batch:
            batch.insert(
                "accounts",
                ["account_id", "owner", "balance"],
                [
                    (account_id, f"owner-{account_id}", initial_balance)
                    for account_id in range(first, min(first + 2_000, accounts))
                ],
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m emulator.bootstrap", description=__doc__)
    parser.add_argument("--project", default=os.environ.get("SPANNER_PROJECT", DEFAULT_PROJECT))
    parser.add_argument("--instance", default=os.environ.get("SPANNER_INSTANCE", DEFAULT_INSTANCE))
    parser.add_argument("--database", default=os.environ.get("SPANNER_DATABASE", DEFAULT_DATABASE))
    parser.add_argument("--dialect", choices=DIALECTS, default="googlesql")
    parser.add_argument("--accounts", type=int, default=100)
    parser.add_argument("--initial-balance", type=int, default=1000)
    args = parser.parse_args(argv)
    if not os.environ.get("SPANNER_EMULATOR_HOST"):
        print(
            "error: SPANNER_EMULATOR_HOST is not set; bootstrap only targets the emulator",
            file=sys.stderr,
        )
        return 2
    database = bootstrap(
        spanner.Client(project=args.project),
        args.instance,
        args.database,
        args.dialect,
        args.accounts,
        args.initial_balance,
    )
    print(f"ready: {database.name} ({args.dialect})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
