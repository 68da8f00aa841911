"""Per account of the sample bank: its running balance, and the transfers it made or received in
the last 24 hours of commit time. One output row per commit that touched the account.

Three deployments of one processor (its ``name`` stays): ``RunningBalance`` first;
``RunningBalanceV2`` adds a count of the account's changes, a field added to its state (read
as None in state written before) and to its output; ``RunningBalanceV3`` renames the state's
``balance``, which the job refuses before Spark starts: Spark would drop the old values.

Run: ``PIPELINE_PROCESSORS=examples.bank:RunningBalance python -m pipeline run``.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator, Sequence
from itertools import groupby
from typing import Any

from pyspark.sql import types as T

from pipeline.user_processors import (
    INSERT,
    Change,
    ChangeProcessor,
    ListOf,
    State,
    Value,
)

WINDOW = dt.timedelta(hours=24)
TRANSFER = T.StructType(
    [
        T.StructField("committed_at", T.TimestampType()),
        T.StructField("amount", T.LongType()),
        T.StructField("outgoing", T.BooleanType()),
    ]
)


def account_struct(*extra: T.StructField) -> T.StructType:
    return T.StructType([T.StructField("balance", T.LongType()), *extra])


def output_struct(*extra: T.StructField) -> T.StructType:
    return T.StructType(
        [
            T.StructField("account_id", T.LongType()),
            T.StructField("commit_timestamp", T.TimestampType()),
            T.StructField("commit_timestamp_text", T.StringType()),
            T.StructField("balance", T.LongType()),
            T.StructField("transfers_24h", T.LongType()),
            T.StructField("amount_in_24h", T.LongType()),
            T.StructField("amount_out_24h", T.LongType()),
            *extra,
        ]
    )


class RunningBalance(ChangeProcessor):
    name = "running_balance"
    tables = ("accounts", "transfers")
    group_by = {"accounts": ("account_id",), "transfers": ("from_account_id", "to_account_id")}
    state = {"account": Value(account_struct()), "recent": ListOf(TRANSFER)}
    output = output_struct()

    def process(
        self, group: str | None, changes: Sequence[Change], state: State
    ) -> Iterator[dict[str, Any]]:
        if group is None:
            return
        account_id = int(group)
        account = state.value("account").get() or {"balance": None}
        recent = state.list("recent").get()
        for _, commit in groupby(changes, key=lambda c: c.commit_timestamp_text):
            applied = list(commit)
            for change in applied:
                self.apply(account_id, change, account, recent)
            when = applied[0].commit_timestamp
            recent = [t for t in recent if t["committed_at"] > when - WINDOW]
            yield self.row(account_id, applied[0], account, recent)
        state.value("account").set(account)
        state.list("recent").put(recent)

    def apply(
        self, account_id: int, change: Change, account: dict[str, Any], recent: list[dict]
    ) -> None:
        if change.table == "accounts":
            if change.is_delete:
                account["balance"] = None
            elif "balance" in change.values:
                account["balance"] = change.values["balance"]
        elif change.kind == INSERT:
            outgoing = change.get("from_account_id") == account_id
            recent.append(
                {
                    "committed_at": change.commit_timestamp,
                    "amount": change.get("amount"),
                    "outgoing": outgoing,
                }
            )

    def row(
        self, account_id: int, change: Change, account: dict[str, Any], recent: list[dict]
    ) -> dict[str, Any]:
        return {
            "account_id": account_id,
            "commit_timestamp": change.commit_timestamp,
            "commit_timestamp_text": change.commit_timestamp_text,
            "balance": account["balance"],
            "transfers_24h": len(recent),
            "amount_in_24h": sum(t["amount"] for t in recent if not t["outgoing"]),
            "amount_out_24h": sum(t["amount"] for t in recent if t["outgoing"]),
        }


class RunningBalanceV2(RunningBalance):
    """Counts the account's changes: a field added to state and output."""

    state = {
        "account": Value(account_struct(T.StructField("changes", T.LongType()))),
        "recent": ListOf(TRANSFER),
    }
    output = output_struct(T.StructField("changes", T.LongType()))

    def apply(
        self, account_id: int, change: Change, account: dict[str, Any], recent: list[dict]
    ) -> None:
        super().apply(account_id, change, account, recent)
        if change.table == "accounts":
            account["changes"] = (account.get("changes") or 0) + 1

    def row(
        self, account_id: int, change: Change, account: dict[str, Any], recent: list[dict]
    ) -> dict[str, Any]:
        return {**super().row(account_id, change, account, recent), "changes": account["changes"]}


class RunningBalanceV3(RunningBalanceV2):
    """Renames the state's ``balance`` to ``current_balance``: refused (a rename)."""

    state = {
        "account": Value(
            T.StructType(
                [
                    T.StructField("current_balance", T.LongType()),
                    T.StructField("changes", T.LongType()),
                ]
            )
        ),
        "recent": ListOf(TRANSFER),
    }
