"""A stall in a test told apart: the emulator stopped answering, or the product stopped.

When landing stops moving, a fresh client (none of the product's sessions, channels or threads)
asks the emulator directly: a trivial read of the job's database, then the change stream query of
a partition the service reports stuck (its newest ``partition_stuck`` line) from that partition's
resume timestamp, for a few seconds. The emulator answering both means the product stalled: the
test fails with the figures. Either not answering means the emulator stalled: the test fails with
``EmulatorStalled``, and conftest restarts that emulator before the next test (never a silent
rerun).
"""

from __future__ import annotations

import concurrent.futures
import datetime as dt
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from google.cloud import spanner
from google.cloud.spanner_v1 import param_types

from emulator.omissions import returned_by_reread
from emulator.run_report import missing_commits
from emulator.verify import latest_checkpoint
from ingest.changestream.query import detect_dialect
from ingest.model.timestamps import parse_rfc3339, to_datetime, to_rfc3339

ANSWER_WITHIN_S = 30.0
"""How long the emulator gets for each question; the product's own queries wait far longer."""
PARTITION_READ_S = 3
"""The length of the stuck partition's query asked for: it must end, with heartbeats."""


class EmulatorStalled(AssertionError):
    """The emulator, not the product, stopped: what it did not answer."""


def triage(
    service: Any, figures: str, table: str = "", committed: Sequence[Any] = ()
) -> AssertionError:
    """The failure for a landing that stopped: transactions missing behind the change log's W
    (``committed`` and ``table`` given), ``EmulatorStalled``, or the product's stall."""
    database, stream = service_stream(service.env)
    if committed and (gap := missing_behind_w(database, stream, table, committed)):
        return AssertionError(f"{figures}; {gap}")
    stuck = [e for e in service.events() if e["event"] == "partition_stuck"]
    questions: list[tuple[str, Callable[[], object]]] = [
        ("a trivial read", lambda: _rows(database, "SELECT 1", {}, {}))
    ]
    if stuck:
        token, resume = stuck[-1]["partition_token"], stuck[-1]["resume_timestamp"]
        questions.append(
            (
                f"the stuck partition {token[:12]}… from {resume}",
                lambda: _read(database, stream, token, resume),
            )
        )
    if unanswered := _first_unanswered(questions):
        return EmulatorStalled(f"{figures}; the emulator did not answer {unanswered}")
    asked = " and ".join(question for question, _ in questions)
    return AssertionError(f"{figures}; the product stalled (the emulator answered {asked})")


def service_stream(env: Mapping[str, str]) -> tuple[Any, str]:
    """The database and change stream a service's environment names, on a fresh client (none
    of the product's sessions, channels or threads)."""
    client = spanner.Client(project=env.get("SPANNER_PROJECT", "local-project"))
    instance = client.instance(env.get("SPANNER_INSTANCE", "local-instance"))
    stream = env.get("SPANNER_CHANGE_STREAM", "all_changes")
    return instance.database(env["SPANNER_DATABASE"]), stream


def workload_failure(database: Any, error: Exception) -> AssertionError:
    """The failure for a test's own workload whose Spanner call failed (the product holds no
    read-write transaction): ``EmulatorStalled`` when a fresh client's trivial read or trivial
    read-write transaction goes unanswered too (seen under load: every transaction ABORTED
    behind one that a cut read had begun and nobody held), else the workload's own failure."""
    _, project, _, instance, _, database_id = database.name.split("/")
    fresh = spanner.Client(project=project).instance(instance).database(database_id)
    said = f"the test's workload failed: {type(error).__name__}: {str(error)[:200]}"
    questions: list[tuple[str, Callable[[], object]]] = [
        ("a trivial read", lambda: _rows(fresh, "SELECT 1", {}, {})),
        (
            "a trivial read-write transaction",
            lambda: fresh.run_in_transaction(
                lambda t: list(t.execute_sql("SELECT 1")), timeout_secs=ANSWER_WITHIN_S
            ),
        ),
    ]
    if unanswered := _first_unanswered(questions):
        return EmulatorStalled(f"{said}; the emulator did not answer {unanswered}")
    return AssertionError(f"{said}; the emulator answers a trivial read and read-write transaction")


def _first_unanswered(questions: list[tuple[str, Callable[[], object]]]) -> str:
    """ "<question>: <what went wrong>" for the first question the emulator did not answer, asked
    in order; empty when it answered them all."""
    for question, ask in questions:
        failure = _unanswered(ask)
        if failure is not None:
            return f"{question}: {failure}"
    return ""


def _unanswered(ask: Any) -> str | None:
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        pool.submit(ask).result(timeout=ANSWER_WITHIN_S)
    except concurrent.futures.TimeoutError:
        return f"no answer in {ANSWER_WITHIN_S:.0f} s"
    except Exception as error:  # any failure to answer is the finding
        return f"{type(error).__name__}: {str(error)[:200]}"
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return None


def _read(database: Any, stream: str, token: str, resume: str) -> list[Any]:
    start = to_datetime(parse_rfc3339(resume))
    sql = (
        f"SELECT ChangeRecord FROM READ_{stream}(start_timestamp => @start, end_timestamp => "
        "@end, partition_token => @token, heartbeat_milliseconds => 1000)"
    )
    params = {"start": start, "end": start + dt.timedelta(seconds=PARTITION_READ_S), "token": token}
    types = {
        "start": param_types.TIMESTAMP,
        "end": param_types.TIMESTAMP,
        "token": param_types.STRING,
    }
    return _rows(database, sql, params, types)


def _rows(database: Any, sql: str, params: dict[str, Any], types: dict[str, Any]) -> list[Any]:
    with database.snapshot() as snapshot:
        return list(
            snapshot.execute_sql(sql, params=params, param_types=types, timeout=ANSWER_WITHIN_S)
        )


def missing_behind_w(database: Any, stream: str, table: str, committed: Sequence[Any]) -> str:
    """What to say when landing stopped because committed transactions are missing though the
    change log's W passed them (not a stall): their commit timestamps, and whether a fresh
    bounded read of the stream returns them. Returned by it: the service missed what the stream
    holds, or the emulator's live query omitted it (emulator/NOTES.md); not returned: the
    emulator's stream lacks it. Both fail: only the reader's record log could tell the first
    two apart. Empty when nothing is missing behind W."""
    checkpoint = latest_checkpoint(table)
    missing = missing_commits(list(committed), 0, table)
    if not missing or checkpoint is None:
        return ""
    w = checkpoint.resume_point.low_watermark
    if w < parse_rfc3339(missing[-1]):
        return ""
    returned = returned_by_reread(database, stream, detect_dialect(database), missing)
    said = [
        f"{text} ({'returned' if text in returned else 'not returned either'})" for text in missing
    ]
    return (
        f"not a stall: the change log's W {to_rfc3339(w)} is past {len(missing)} committed "
        f"transaction(s) it lacks; a fresh bounded read of the stream at each: {', '.join(said)}"
    )
