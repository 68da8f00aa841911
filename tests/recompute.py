"""What the example processors must output, recomputed in plain Python from a table's history:
its rows after each commit (read from Spanner at each commit timestamp, or from a test's model).
Independent of the processors' code: it works from whole table states, not from changes."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

Key = tuple[Any, ...]
Tables = Mapping[str, Mapping[Key, Mapping[str, Any]]]
WINDOW = dt.timedelta(hours=24)


@dataclass(frozen=True, slots=True)
class Commit:
    """The tables right after one commit."""

    at: dt.datetime
    text: str
    tables: Tables


def running_balance(commits: Iterable[Commit], first_is_snapshot: bool) -> list[dict]:
    """Per account and commit that changed it or a transfer of it: its balance then, and the
    transfers inserted in the 24 hours of commit time up to then (a snapshot's transfers were
    not inserted in its view, so they do not count)."""
    rows: list[dict] = []
    before: Tables = {}
    inserted: list[tuple[dt.datetime, Mapping[str, Any]]] = []
    for number, commit in enumerate(commits):
        accounts, transfers = commit.tables.get("accounts", {}), commit.tables.get("transfers", {})
        old_accounts = before.get("accounts", {})
        old_transfers = before.get("transfers", {})
        touched = {
            k[0]
            for k in set(accounts) | set(old_accounts)
            if accounts.get(k) != old_accounts.get(k)
        }
        new = [transfers[k] for k in transfers if k not in old_transfers]
        gone = [old_transfers[k] for k in old_transfers if k not in transfers]
        snapshot = first_is_snapshot and number == 0
        if not snapshot:
            inserted += [(commit.at, t) for t in new]
        for transfer in new + gone:
            touched |= {transfer["from_account_id"], transfer["to_account_id"]}
        recent = [(at, t) for at, t in inserted if at > commit.at - WINDOW]
        for account in sorted(touched):
            row = accounts.get((account,))
            mine = [t for _, t in recent if account in (t["from_account_id"], t["to_account_id"])]
            rows.append(
                {
                    "account_id": account,
                    "commit_timestamp_text": commit.text,
                    "balance": None if row is None else row["balance"],
                    "transfers_24h": len(mine),
                    "amount_in_24h": sum(
                        t["amount"] for t in mine if t["to_account_id"] == account
                    ),
                    "amount_out_24h": sum(
                        t["amount"] for t in mine if t["from_account_id"] == account
                    ),
                }
            )
        before = commit.tables
    return rows


def status_durations(commits: Iterable[Commit], column: str = "col_string") -> list[dict]:
    """Per ``all_types`` row, each period its status (``column``, text or bytes alike) lasted,
    ended by another status or by the row's delete, with its running total per status and its
    number (counted again after a delete)."""
    rows: list[dict] = []
    open_periods: dict[Key, tuple[str | None, str, dt.datetime]] = {}
    totals: dict[tuple[Key, str], float] = {}
    periods: dict[Key, int] = {}
    for commit in commits:
        table = commit.tables.get("all_types", {})
        for key in sorted(set(open_periods) | set(table), key=repr):
            row = table.get(key)
            status = None if row is None else _text(row.get(column))
            period = open_periods.get(key)
            if period is not None and row is not None and status == period[0]:
                continue
            if period is not None:
                seconds = (commit.at - period[2]).total_seconds()
                total = totals.get((key, str(period[0])), 0.0) + seconds
                totals[(key, str(period[0]))] = total
                periods[key] = periods.get(key, 0) + 1
                rows.append(
                    {
                        "id": key[0],
                        "variant": key[1],
                        "status": period[0],
                        "entered_text": period[1],
                        "left_text": commit.text,
                        "seconds": seconds,
                        "total_seconds_in_status": total,
                        "period": periods[key],
                    }
                )
                del open_periods[key]
            if row is None:
                periods.pop(key, None)
            else:
                open_periods[key] = (status, commit.text, commit.at)
    return rows


def _text(value: Any) -> str | None:
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", errors="replace")
    return value
