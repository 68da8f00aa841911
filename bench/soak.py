"""Soak: the whole product for a long run of what a deployment meets in months (issue 26).

On a fresh emulator and the sample bank (accounts, existing transfers and all_types rows, taken
by the initial snapshot), ``python -m ingest run`` and ``python -m pipeline run`` run with the
product's defaults but for short ingest intervals (``make run``'s, and a 15 s lease) while:

- the workload commits ``--rate`` transactions/s of every kind (transfers, all_types inserts,
  updates and deletes, cleanups of transfers) for ``--minutes``;
- every ``--schema-every`` seconds ``accounts`` gains a column (ten types in turn), then ten
  accounts get a value in it: with Spark's limits every one is an evolution of ``entry_accounts``,
  so the pipeline must rebase to go on;
- every ``--kill-every`` seconds the ingest's process group is killed with SIGKILL (as a
  container is), and half a period later the pipeline's (its JVM with it); each restarts at
  once. Kills stop ``--calm-minutes`` before the end, so the last stretch shows steady memory;
- halfway, ``python -m ingest snapshot-table --table all_types`` (with the control token)
  snapshots a table again while deletes go on.

Then the ingest drains and stops, the pipeline reads the change log to its end, and the run is
checked as a user would check it: ``python -m ingest audit`` over the workload's window (the
change log equal to the stream, transaction for transaction) and every mirror equal to Spanner
read at the change log's W. The script exits 1 if either fails or a process ever stopped on its
own.

Memory is each process's resident set, every ``--sample-s`` (the pipeline with its JVM): the
peak; "across the run", the slope of each life's median (after its first third) against when
it lived, which a leak that survives restarts (growing state, files, a cache) raises; and "last
stretch", the slope within the calm last life after its first two minutes.

Usage: python bench/soak.py [--minutes 30] [--rate 10] [--schema-every 60] [--kill-every 180]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deltalake import DeltaTable
from google.api_core import exceptions as api_exceptions
from google.cloud import spanner
from google.cloud.spanner_v1.database import Database
from tenacity import (
    retry,
    retry_if_exception,
    retry_if_exception_type,
    stop_after_attempt,
    wait_random,
)

from emulator.bootstrap import bootstrap
from emulator.local_run import pipeline_process
from emulator.machine import machine_line
from emulator.processes import Process, kill_tree, process_tree
from emulator.run_report import check_mirrors
from emulator.server import emulator, free_port
from emulator.verify import consistent_past
from emulator.workload import NEW_COLUMN_KINDS, Workload, WorkloadConfig, load_existing_rows
from ingest.model.timestamps import Nanos, from_datetime, to_rfc3339
from pipeline.state import cut

ROOT = Path(__file__).resolve().parent.parent
ACCOUNTS = 50
NAMED_ACCOUNTS = range(10)


@dataclass
class Life:
    """One process's run from its start to its kill (or the end)."""

    kind: str
    process: subprocess.Popen[bytes]
    started: float
    samples: list[tuple[float, float]] = field(default_factory=list)
    """(seconds into the soak, resident MiB)."""


@dataclass
class Product:
    """The two processes, restarted after each kill; every life kept for the figures."""

    ingest: Process
    pipeline: Process
    began: float
    lives: dict[str, list[Life]] = field(default_factory=lambda: {"ingest": [], "pipeline": []})
    stopped: set[str] = field(default_factory=set)

    def start(self, kind: str) -> None:
        process = self.ingest.start() if kind == "ingest" else self.pipeline.start()
        self.lives[kind].append(Life(kind, process, time.monotonic() - self.began))

    def current(self, kind: str) -> subprocess.Popen[bytes]:
        return self.lives[kind][-1].process

    def kill(self, kind: str) -> None:
        process = self.current(kind)
        kill_tree(process)
        process.wait()
        self.start(kind)

    def sample(self) -> None:
        now = time.monotonic() - self.began
        for kind, lives in self.lives.items():
            if kind in self.stopped:
                continue
            process = lives[-1].process
            if process.poll() is not None:
                log = (self.ingest if kind == "ingest" else self.pipeline).log
                tail = log.read_text(errors="replace")[-3000:]
                raise SystemExit(f"the {kind} stopped on its own ({process.returncode}):\n{tail}")
            lives[-1].samples.append((now, tree_rss_mib(process.pid)))

    def stop(self, kind: str, timeout: float) -> int:
        self.stopped.add(kind)
        process = self.current(kind)
        process.send_signal(signal.SIGTERM)
        return process.wait(timeout=timeout)


def tree_rss_mib(pid: int) -> float:
    """Resident MiB of a process and its live descendants (the pipeline's JVM)."""
    total = 0.0
    for current in process_tree(pid):
        try:
            status = Path(f"/proc/{current}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) / 1024
    return total


class Pausable:
    """The database as the workload sees it: its read-write transactions hold ``lock``. The
    emulator refuses DDL while any read-write transaction runs (Cloud Spanner does not), and at
    10 transactions/s there is seldom a gap, so a schema change takes the lock; so do the blind
    writes that follow it, which the emulator otherwise aborts again and again while a transfer
    waits on the same rows (seen: a 2-minute livelock)."""

    def __init__(self, database: Any) -> None:
        self.database = database
        self.lock = threading.Lock()

    def run_in_transaction(self, work: Any, **options: Any) -> Any:
        with self.lock:
            return self.database.run_in_transaction(work, **options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.database, name)


@retry(
    retry=retry_if_exception(
        lambda e: isinstance(e, api_exceptions.FailedPrecondition) and "concurrent" in str(e)
    ),
    stop=stop_after_attempt(50),
    wait=wait_random(0.05, 0.3),
)
def add_column(database: Any, name: str, kind: str) -> None:
    database.update_ddl([f"ALTER TABLE accounts ADD COLUMN {name} {kind}"]).result(120)


@retry(
    retry=retry_if_exception_type((api_exceptions.Aborted, api_exceptions.NotFound)),
    stop=stop_after_attempt(50),
    wait=wait_random(0.05, 0.5),
)
def fill_column(database: Any, name: str, value: Any) -> Nanos:
    """Blind writes (the emulator aborts one overlapping the workload's transfers)."""
    with database.batch() as batch:
        batch.update("accounts", ["account_id", name], [(i, value) for i in NAMED_ACCOUNTS])
    return from_datetime(batch.committed)


def snapshot_again(port: int, token: Path, table: str, timeout: float) -> str:
    """``python -m ingest snapshot-table`` until a live service accepts it (it may be
    restarting after a kill)."""
    deadline = time.monotonic() + timeout
    while True:
        asked = subprocess.run(
            [
                *(sys.executable, "-m", "ingest", "snapshot-table", "--table", table),
                *("--url", f"http://127.0.0.1:{port}", "--token-file", str(token)),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        if asked.returncode == 0:
            return asked.stdout.strip()
        if time.monotonic() > deadline:
            raise SystemExit(f"snapshot-table was refused: {asked.stderr.strip()}")
        time.sleep(2)


def schedule(args: argparse.Namespace) -> list[tuple[float, str]]:
    """(seconds into the soak, action), in order."""
    seconds = args.minutes * 60
    calm_from = seconds - args.calm_minutes * 60
    events = [(t, "schema") for t in _every(args.schema_every, args.schema_every, seconds)]
    events += [(t, "kill ingest") for t in _every(args.kill_every / 2, args.kill_every, calm_from)]
    events += [(t, "kill pipeline") for t in _every(args.kill_every, args.kill_every, calm_from)]
    events.append((seconds / 2 + 1, "snapshot all_types"))
    return sorted(events)


def _every(first: float, period: float, until: float) -> list[float]:
    times = []
    moment = first
    while moment < until:
        times.append(moment)
        moment += period
    return times


def slope_mib_per_hour(points: list[tuple[float, float]]) -> float | None:
    if len({t for t, _ in points}) < 2:
        return None
    times, values = zip(*points, strict=True)
    return statistics.linear_regression(times, values).slope * 3600


def memory_figures(lives: list[Life], life_s: float) -> dict[str, Any]:
    """Peak; the slope across the run of each life's median resident set (after its first
    third, up to ``life_s``, so lives compare at the same age); the slope within the last."""
    medians = []
    for life in lives:
        kept = [(t, mib) for t, mib in life.samples if life_s / 3 <= t - life.started <= life_s]
        if kept:
            medians.append(
                (statistics.median(t for t, _ in kept), statistics.median(m for _, m in kept))
            )
    last = lives[-1]
    steady = [(t, mib) for t, mib in last.samples if t - last.started >= 120]
    return {
        "peak_mib": max((mib for life in lives for _, mib in life.samples), default=0.0),
        "across_run_mib_per_h": slope_mib_per_hour(medians),
        "last_stretch_mib_per_h": slope_mib_per_hour(steady),
        "last_stretch_s": (steady[-1][0] - steady[0][0]) if len(steady) > 1 else 0.0,
        "lives": len(lives),
    }


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:+.0f}"


def run(args: argparse.Namespace, work: Path) -> int:
    with emulator() as running:
        os.environ["SPANNER_EMULATOR_HOST"] = running.host_port
        client = spanner.Client(project="local-project")
        database = bootstrap(client, database_id=f"soak_{os.getpid() % 10000}", accounts=ACCOUNTS)
        load_existing_rows(database, ACCOUNTS, args.existing_rows, args.existing_rows)
        control = Control(free_port(), work / "control-token")
        control.token.write_text(secrets.token_urlsafe(24) + "\n")
        changelog = work / "changelog"
        product = start_product(args, database.database_id, changelog, control, work)
        stop = threading.Event()
        pausable = Pausable(database)
        workload = Workload(
            cast(Database, pausable),
            WorkloadConfig(
                duration_seconds=args.minutes * 60,
                transactions_per_second=args.rate,
                accounts=ACCOUNTS,
                seed=26,
            ),
        )
        thread = threading.Thread(target=workload.run, args=(stop,))
        workload_began = time.monotonic() - product.began
        thread.start()
        try:
            done = follow_schedule(args, product, pausable, workload, workload_began, control)
            while thread.is_alive():
                product.sample()
                time.sleep(args.sample_s)
            last = max([done.last_own, *(t.commit_timestamp for t in workload.committed)])
            drain(product, changelog, work / "mirrors", last, args)
        finally:
            stop.set()
            thread.join()
            for lives in product.lives.values():
                with_group_killed(lives[-1].process)
        first = min(t.commit_timestamp for t in workload.committed)
        audited = audit(database.database_id, changelog, first)
        mirrors = check_mirrors(database, work)

    return report(
        args, product, workload, done.columns, done.snapshot_reply, audited, mirrors, work
    )


@dataclass(frozen=True, slots=True)
class Control:
    """The ingest service's health port and the token file its control requests need."""

    health_port: int
    token: Path


@dataclass(slots=True)
class Done:
    """What the schedule did: columns added, the newest commit of its own, the last reply to an
    on-demand snapshot request."""

    columns: int = 0
    last_own: Nanos = 0
    snapshot_reply: str = ""


def start_product(
    args: argparse.Namespace, database_id: str, changelog: Path, control: Control, work: Path
) -> Product:
    """The ingest service (with an initial snapshot), then the pipeline once it has started."""
    ingest = Process(
        ["-m", "ingest", "run"],
        work / "ingest.log",
        {
            "SPANNER_DATABASE": database_id,
            "INGEST_TABLE_URI": str(changelog),
            "INGEST_CHECKPOINT_INTERVAL_S": "5",
            "INGEST_FLUSH_LATENCY_MS": "500",
            "INGEST_LEASE_S": "15",
            "INGEST_HEALTH_PORT": str(control.health_port),
            "INGEST_SNAPSHOT_MODE": "initial",
            "INGEST_CONTROL_TOKEN_FILE": str(control.token),
        },
    )
    pipeline = pipeline_process(work, changelog)
    if args.max_evolutions:
        pipeline.env["PIPELINE_MAX_EVOLUTIONS_PER_VARIABLE"] = str(args.max_evolutions)
    product = Product(ingest, pipeline, time.monotonic())
    product.start("ingest")
    ingest.wait_for("ingest_started", 1, timeout=120, process=product.current("ingest"))
    product.start("pipeline")
    return product


def follow_schedule(
    args: argparse.Namespace,
    product: Product,
    pausable: Pausable,
    workload: Workload,
    workload_began: float,
    control: Control,
) -> Done:
    """Each scheduled event at its moment (a column added and filled, a kill, a snapshot
    request), sampling the product and printing progress each minute in between."""
    done = Done()
    next_report = workload_began + 60
    for moment, action in schedule(args):
        while time.monotonic() - product.began < workload_began + moment:
            product.sample()
            if time.monotonic() - product.began >= next_report:
                print(progress(product, workload, done.columns), flush=True)
                next_report += 60
            time.sleep(args.sample_s)
        if action == "schema":
            kind, value = NEW_COLUMN_KINDS[done.columns % len(NEW_COLUMN_KINDS)]
            done.columns += 1
            with pausable.lock:
                add_column(pausable.database, f"soak_c{done.columns}", kind)
                filled = fill_column(pausable.database, f"soak_c{done.columns}", value)
            done.last_own = max(done.last_own, filled)
        elif action in ("kill ingest", "kill pipeline"):
            product.kill(action.removeprefix("kill "))
        else:
            done.snapshot_reply = snapshot_again(
                control.health_port, control.token, "all_types", timeout=120
            )
    return done


def audit(database_id: str, changelog: Path, first: Nanos) -> subprocess.CompletedProcess[str]:
    """``python -m ingest audit`` of the window from the workload's first commit."""
    return subprocess.run(
        [
            *(sys.executable, "-m", "ingest", "audit", "--database", database_id),
            *("--start-timestamp", to_rfc3339(first), "--changelog", str(changelog)),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )


def drain(product: Product, changelog: Path, mirrors: Path, last: Nanos, args: Any) -> None:
    """The change log past the last write, the ingest stopped, the pipeline through the change
    log's last version, then stopped; each must exit 0."""
    deadline = time.monotonic() + args.drain_s
    while not consistent_past(str(changelog), last):
        assert time.monotonic() < deadline, "the change log never passed the last write"
        product.sample()
        time.sleep(args.sample_s)
    assert product.stop("ingest", timeout=120) == 0, "the ingest did not stop cleanly"
    final = DeltaTable(str(changelog)).version()
    while (position := cut.read(str(mirrors))) is None or position.starting_version <= final:
        assert time.monotonic() < deadline, "the pipeline never read the change log's end"
        product.sample()
        time.sleep(args.sample_s)
    assert product.stop("pipeline", timeout=300) == 0, "the pipeline did not stop cleanly"


def with_group_killed(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        kill_tree(process)
        process.wait()


def progress(product: Product, workload: Workload, columns: int) -> str:
    elapsed = time.monotonic() - product.began
    rebases = product.pipeline.count("state_rebased")
    restarts = {kind: len(lives) - 1 for kind, lives in product.lives.items()}
    return (
        f"# {elapsed / 60:.0f} min: {len(workload.committed)} transactions, {columns} columns, "
        f"restarts {restarts}, rebases {rebases}"
    )


def report(
    args: argparse.Namespace,
    product: Product,
    workload: Workload,
    columns: int,
    snapshot_reply: str,
    audited: subprocess.CompletedProcess[str],
    mirrors: Any,
    work: Path,
) -> int:
    pipeline_events = product.pipeline.events()
    rebases = sum(e["event"] == "state_rebased" for e in pipeline_events)
    schema_restarts = sum(
        e["event"] == "pipeline_query_restarting" and e.get("reason") == "SOURCE_SCHEMA_CHANGED"
        for e in pipeline_events
    )
    resnapshots = product.ingest.count("table_snapshot_done")
    resumed = product.ingest.count("table_snapshot_resumed")
    print(
        "minutes\ttransactions\tcolumns added\tingest kills\tpipeline kills\t"
        "schema restarts\trebases\tre-snapshots done (resumed)"
    )
    print(
        f"{args.minutes:g}\t{len(workload.committed)}\t{columns}\t"
        f"{len(product.lives['ingest']) - 1}\t{len(product.lives['pipeline']) - 1}\t"
        f"{schema_restarts}\t{rebases}\t{resnapshots} ({resumed})"
    )
    print("process\tlives\tpeak RSS MiB\tacross the run MiB/h\tlast stretch MiB/h (over s)")
    figures = {}
    for kind, lives in product.lives.items():
        memory = memory_figures(lives, args.kill_every)
        figures[kind] = memory
        print(
            f"{kind}\t{memory['lives']}\t{memory['peak_mib']:.0f}\t"
            f"{_figure(memory['across_run_mib_per_h'])}\t"
            f"{_figure(memory['last_stretch_mib_per_h'])} ({memory['last_stretch_s']:.0f})"
        )
    print(f"re-snapshot request: {snapshot_reply or '-'}")
    audit_line = (audited.stdout.strip().splitlines() or [audited.stderr.strip()])[-1]
    print(f"audit (exit {audited.returncode}): {audit_line}")
    for line in mirrors.lines:
        print(f"#   {line}")
    equal = "yes" if mirrors.passed else "NO"
    print(f"mirrors equal to Spanner at W: {equal}")
    samples = {
        kind: [{"started_s": life.started, "samples": life.samples} for life in lives]
        for kind, lives in product.lives.items()
    }
    (work / "rss_samples.json").write_text(json.dumps(samples))
    print(json.dumps({"work": str(work), "memory": figures}))
    return 0 if mirrors.passed and audited.returncode == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--rate", type=float, default=10.0)
    parser.add_argument("--schema-every", type=float, default=60.0)
    parser.add_argument("--kill-every", type=float, default=180.0)
    parser.add_argument("--calm-minutes", type=float, default=8.0)
    parser.add_argument("--existing-rows", type=int, default=2000)
    parser.add_argument(
        "--max-evolutions",
        type=int,
        default=0,
        help="PIPELINE_MAX_EVOLUTIONS_PER_VARIABLE (0: the product's default)",
    )
    parser.add_argument("--sample-s", type=float, default=2.0)
    parser.add_argument("--drain-s", type=float, default=900.0)
    args = parser.parse_args(argv)
    os.environ.setdefault("GOOGLE_CLOUD_SPANNER_MULTIPLEXED_SESSIONS", "false")
    work = Path(tempfile.mkdtemp(prefix="soak-"))
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    print(
        machine_line(
            f"commit {commit or '?'}: {args.minutes:g} min at {args.rate:g} transactions/s, "
            f"a column every {args.schema_every:g} s, kills every {args.kill_every:g} s, "
            f"work in {work}"
        ),
        flush=True,
    )
    return run(args, work)


if __name__ == "__main__":
    sys.exit(main())
