"""Shared fixtures: a real Cloud Spanner emulator with fast partition churn, fresh databases."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import os
import threading
from collections import defaultdict
from collections.abc import Callable, Generator, Iterator

import pytest
from _pytest.runner import runtestprotocol
from google.cloud import spanner
from google.cloud.spanner_v1.database import Database

from emulator.bootstrap import bootstrap
from emulator.omissions import (
    REPORT_PROPERTY,
    ChangeLogAudit,
    audit_changelog,
    only_the_emulator_lost,
)
from emulator.server import EmulatorNotFound, RunningEmulator, emulator, find_emulator_binary
from tests import cpu_use
from tests.delta_checks import late_landings
from tests.processes import STARTED_SERVICES, Service
from tests.stalls import EmulatorStalled, service_stream

pytest_plugins = ["tests.pipeline_runs"]
"""The ``spark`` fixture of the pipeline tests (a module that defines its own keeps it)."""

LONGEST_FIRST = (
    "test_spark_source.py",
    "test_bench_smoke_spark.py",
    "test_object_store_end_to_end.py",
    "test_pipeline.py",  # not in the first three: its session waits for the class archive
    "test_source_changes.py",
    "test_long_running.py",
    "test_spark_source_scripted.py",
    "test_maintenance.py",
    "test_pipeline_properties.py",
    "test_image.py",  # not first: ``make test`` builds the image beside the first tests
    "test_history.py",
    "test_ingest_service.py",
    "test_snapshot.py",
    "test_end_to_end.py",
    "test_rebase.py",
    "test_soak_smoke.py",
    "test_column_defaults.py",
    "test_emulator_reader.py",
    "test_bench_smoke.py",
    "test_stalls.py",
    "test_object_store.py",
    "test_core_properties.py",
    "test_wide_rows.py",
    "test_mirror_keys.py",
    "test_wide_streams.py",
    "test_user_processors.py",
    "test_table_snapshot.py",
)
"""Every test file of a minute or more on two cores, longest first (a file's summed durations
in CI's junit file, 2026-11-29 evening: 608 s down to 59 s), but the in-process Spark tests
after the first three files: started first, ``test_pipeline.py``'s session waited 125 s for the
class archive that ``make test`` builds beside the first tests. ``make test`` hands files to its
workers in collection order (``--no-loadscope-reorder``): the longest started first, the workers
end together instead of one running a long file alone at the end (files left off this list come
last, in name order: the maintenance and history tests, 2.5 minutes each, were among them)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Every transaction a failed emulator test's change log lacked, classified (an emulator
    omission runs the test again, any other fails it); the tests that cost the most CPU."""
    _report_cpu(terminalreporter)
    _report_workers(terminalreporter)
    omissions = [
        f"{report.nodeid}: {value}"
        for reports in terminalreporter.stats.values()
        for report in reports
        if isinstance(report, pytest.TestReport) and report.when == "call"
        for name, value in report.user_properties
        if name == REPORT_PROPERTY
    ]
    terminalreporter.write_sep(
        "-", f"transactions missing from a change log this run: {len(omissions)}"
    )
    for line in omissions:
        terminalreporter.write_line(line)


CPU_SAMPLER = pytest.StashKey[cpu_use.CpuSampler]()
CPU_SINCE = pytest.StashKey[dict[cpu_use.Process, float]]()


def pytest_sessionfinish(session: pytest.Session) -> None:
    if CPU_SAMPLER in session.config.stash:
        session.config.stash[CPU_SAMPLER].stop()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """The sampler starts with a process's first test: in a worker, never in xdist's controller,
    whose descendants are every worker's processes and which runs no test."""
    if CPU_SAMPLER not in item.config.stash:
        item.config.stash[CPU_SAMPLER] = cpu_use.CpuSampler().start()
    item.stash[CPU_SINCE] = item.config.stash[CPU_SAMPLER].mark()


def _report_cpu(terminalreporter: pytest.TerminalReporter, shown: int = 15) -> None:
    """The costliest tests and files by CPU (``tests.cpu_use``), beside ``--durations``' wall
    times, and the tests' CPU by kind of process: where a run's time goes."""
    tests: dict[str, float] = {}
    kinds: defaultdict[str, float] = defaultdict(float)
    for reports in terminalreporter.stats.values():
        for report in reports:
            if not (isinstance(report, pytest.TestReport) and report.when == "teardown"):
                continue
            for name, value in report.user_properties:
                if name == cpu_use.PROPERTY:
                    tests[report.nodeid] = float(str(value))
                elif name == cpu_use.KINDS_PROPERTY and isinstance(value, dict):
                    for kind, cost in value.items():
                        kinds[kind] += cost
    files: defaultdict[str, float] = defaultdict(float)
    for nodeid, cost in tests.items():
        files[nodeid.split("::", 1)[0]] += cost
    total = sum(tests.values())
    terminalreporter.write_sep("-", f"CPU of the tests: {total:.0f} s; by kind of process")
    speed = cpu_use.core_speed()
    terminalreporter.write_line(
        f"(this machine's core: {speed:.1f} M turns of a reference loop a CPU-s)"
    )
    for kind, cost in _costliest(kinds, len(kinds)):
        terminalreporter.write_line(f"{cost:8.1f} s  {kind}")
    for title, costs in (("tests", tests), ("files", files)):
        terminalreporter.write_sep("-", f"the {shown} costliest {title}")
        for nodeid, cost in _costliest(costs, shown):
            terminalreporter.write_line(f"{cost:8.1f} s  {nodeid}")


def _costliest(costs: dict[str, float], shown: int) -> list[tuple[str, float]]:
    return sorted(costs.items(), key=lambda item: item[1], reverse=True)[:shown]


def _report_workers(terminalreporter: pytest.TerminalReporter) -> None:
    """When each xdist worker ran its first test and ended its last, and the seconds it spent
    in tests: a worker that ends long before the others left a core idle at the suite's end."""
    ends: defaultdict[str, list[float]] = defaultdict(list)
    busy: defaultdict[str, float] = defaultdict(float)
    for reports in terminalreporter.stats.values():
        for report in reports:
            node = getattr(report, "node", None)
            if isinstance(report, pytest.TestReport) and node is not None and report.stop:
                ends[node.gateway.id] += [report.start, report.stop]
                busy[node.gateway.id] += report.stop - report.start
    if not ends:
        return
    origin = min(min(times) for times in ends.values())
    terminalreporter.write_sep("-", "the workers: first test, last test's end, seconds in tests")
    for worker, times in sorted(ends.items()):
        first, last = min(times) - origin, max(times) - origin
        terminalreporter.write_line(f"{worker}: {first:7.0f} s {last:7.0f} s {busy[worker]:7.0f} s")


@pytest.fixture
def no_emulator(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """For tests on the scripted server: the client prefers SPANNER_EMULATOR_HOST to any
    endpoint it is given."""
    monkeypatch.delenv("SPANNER_EMULATOR_HOST", raising=False)
    yield


TOKEN_ALIVE_SECONDS = 5
"""Partition tokens live 5 to 10 s on the worker's emulator, as in ``make run``: every end-to-end
test still meets splits, moves and merges. At 1 s the emulator's live queries omit a committed
transaction about once in 2,000 (emulator/NOTES.md), which failed one end-to-end test in two runs
of the suite; the tests of churn itself run on ``fast_churn_database``."""
FAST_CHURN_TOKEN_ALIVE_SECONDS = 1
"""Tokens living 1 to 2 s: at 2 (2 to 4 s) a loaded 2-core machine churned too slowly for 5
split/merge cycles in a 55 s run; faster churn is the harder test."""


@pytest.fixture(scope="session")
def spanner_emulator() -> Iterator[str]:
    """SPANNER_EMULATOR_HOST when set, else a fresh emulator on a free loopback port."""
    existing = os.environ.get("SPANNER_EMULATOR_HOST")
    if existing:
        yield existing
        return
    try:
        find_emulator_binary()
    except EmulatorNotFound as error:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI needs the Spanner emulator: {error}")
        pytest.skip(f"SPANNER EMULATOR MISSING, emulator tests skipped: {error}")
    with emulator(token_alive_seconds=TOKEN_ALIVE_SECONDS) as running:
        os.environ["SPANNER_EMULATOR_HOST"] = running.host_port
        _STARTED.append(running)
        try:
            yield running.host_port
        finally:
            _STARTED.remove(running)
            del os.environ["SPANNER_EMULATOR_HOST"]


_STARTED: list[RunningEmulator] = []
"""The emulator this worker started, for a restart after it stalled."""


@pytest.fixture
def started_emulator(spanner_emulator: str) -> RunningEmulator:
    """The emulator this worker started, for a test that stops and resumes it."""
    found = [running for running in _STARTED if running.host_port == spanner_emulator]
    if not found:
        pytest.skip("the emulator was not started by this run (SPANNER_EMULATOR_HOST is set)")
    return found[0]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A test that failed because the emulator stalled (``tests.stalls``) restarts it, so the
    next tests meet a working one; the failure stands and says so. A failed emulator test's
    change logs are audited (``_audit_services``). The teardown's report carries the test's
    CPU seconds."""
    if call.when == "teardown" and CPU_SINCE in item.stash:
        by_kind = item.config.stash[CPU_SAMPLER].spent(item.stash[CPU_SINCE])
        item.user_properties.append((cpu_use.PROPERTY, round(sum(by_kind.values()), 1)))
        rounded = {kind: round(cpu, 1) for kind, cpu in by_kind.items() if round(cpu, 1)}
        item.user_properties.append((cpu_use.KINDS_PROPERTY, rounded))
    report = yield
    if call.excinfo is not None and isinstance(call.excinfo.value, EmulatorStalled):
        for running in _STARTED:
            running.restart()
        restarted = [r.host_port for r in _STARTED]
        report.sections.append(("emulator", f"restarted the emulator at {restarted}"))
    elif call.when == "call" and report.failed and item.get_closest_marker("emulator"):
        _audit_services(item, report)
    return report


OMITTED_BY_EMULATOR = pytest.StashKey[bool]()
"""Set on a test whose failed attempt lost nothing but what the emulator's live query omitted."""
AUDIT_WITHIN_S = 300
"""How long the re-read of one change log's window may take (about 2,000 rows/s here): an
emulator that stopped answering must not hang the worker."""


def _audit_services(item: pytest.Item, report: pytest.TestReport) -> None:
    """Each change log the failed test's services wrote, read against a fresh bounded read of
    its window (``emulator.omissions.audit_changelog``): a committed transaction missing behind
    W is named, with whether the reader ever received it. When the emulator's live query alone
    explains every loss, the test runs once more (``pytest_runtest_protocol``); a loss the
    product made, or one the record log cannot explain, fails it."""
    audits = [_audit(service) for service in STARTED_SERVICES]
    for service, audit in zip(STARTED_SERVICES, audits, strict=True):
        report.sections.append(("change log audit", f"{service.log.name}: {audit}"))
        if isinstance(audit, ChangeLogAudit):
            for omission in audit.omissions:
                report.user_properties.append((REPORT_PROPERTY, str(omission)))
    if only_the_emulator_lost(audits):
        item.stash[OMITTED_BY_EMULATOR] = True


def _audit(service: Service) -> ChangeLogAudit | str:
    """The audit of one service's change log, or why it could not be taken."""
    database, stream = service_stream(service.env)
    stop = threading.Event()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    changelog = service.env["INGEST_TABLE_URI"]
    asked = pool.submit(_audited, database, stream, changelog, service, stop)
    try:
        audit = asked.result(timeout=AUDIT_WITHIN_S)
    except concurrent.futures.TimeoutError:
        return f"not audited: the re-read took over {AUDIT_WITHIN_S} s"
    except Exception as error:  # the failure stands; the audit only explains it
        return f"not audited: {type(error).__name__}: {str(error)[:300]}"
    finally:
        stop.set()
        pool.shutdown(wait=False, cancel_futures=True)
    return audit if audit is not None else "not audited: no checkpoint with a job start yet"


def _audited(
    database: Database, stream: str, changelog: str, service: Service, stop: threading.Event
) -> ChangeLogAudit | None:
    """The change log against the stream, and each transaction it landed only after an earlier
    version's W had passed it (the product's: a job reading that cut missed it)."""
    audit = audit_changelog(database, stream, changelog, service.events(), stop)
    late = tuple(late_landings(changelog))
    if audit is None or not late:
        return audit
    return dataclasses.replace(audit, other_differences=audit.other_differences + late)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    """An emulator test runs once more only when its failed attempt lost nothing but what the
    emulator's live query omitted (emulator/NOTES.md: about 1 committed transaction in 3,000 to
    30,000); that attempt is reported as a rerun, its omissions in the suite's summary."""
    if item.get_closest_marker("emulator") is None:
        return None
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for attempt in (1, 2):
        STARTED_SERVICES[:] = [service for service in STARTED_SERVICES if service.running]
        reports = runtestprotocol(item, nextitem=nextitem, log=False)
        rerun = attempt == 1 and OMITTED_BY_EMULATOR in item.stash
        for report in reports:
            if rerun and report.failed:
                report.outcome = "rerun"  # type: ignore[assignment]
            item.ihook.pytest_runtest_logreport(report=report)
        if not rerun:
            break
        del item.stash[OMITTED_BY_EMULATOR]
        item.user_properties = []  # the first attempt's reports keep theirs
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def pytest_report_teststatus(report: pytest.TestReport) -> tuple[str, str, str] | None:
    if report.outcome == "rerun":
        return "rerun", "R", "RERUN"
    return None


@pytest.fixture(scope="module")
def fast_churn_emulator(spanner_emulator: str) -> Iterator[str]:
    """An emulator of the module's own whose partitions churn every 1 to 2 s; restarted with
    the worker's after a stall, like it."""
    with emulator(token_alive_seconds=FAST_CHURN_TOKEN_ALIVE_SECONDS) as running:
        _STARTED.append(running)
        try:
            yield running.host_port
        finally:
            _STARTED.remove(running)


@pytest.fixture
def fast_churn_database(
    fast_churn_emulator: str, monkeypatch: pytest.MonkeyPatch
) -> Callable[..., Database]:
    """``new_database`` on the fast-churn emulator: for the test's length every client and
    process it starts talks to that emulator."""
    monkeypatch.setenv("SPANNER_EMULATOR_HOST", fast_churn_emulator)
    return _database_maker(spanner.Client(project="local-project"))


@pytest.fixture(scope="session")
def spanner_client(spanner_emulator: str) -> spanner.Client:
    return spanner.Client(project="local-project")


_database_numbers = itertools.count()


@pytest.fixture
def new_database(spanner_client: spanner.Client) -> Callable[..., Database]:
    """Create a bootstrapped sample database with a name of its own (nothing is shared)."""
    return _database_maker(spanner_client)


def _database_maker(client: spanner.Client) -> Callable[..., Database]:
    """Bootstrapped sample databases on ``client``'s emulator, each with a name of its own."""

    def create(
        dialect: str = "googlesql",
        accounts: int = 100,
        existing: Callable[[Database], object] | None = None,
    ) -> Database:
        """``existing``: rows written before the change streams exist (``bootstrap``)."""
        database_id = f"db{next(_database_numbers)}_{dialect[:2]}_{os.getpid() % 10000}"
        return bootstrap(
            client, database_id=database_id, dialect=dialect, accounts=accounts, existing=existing
        )

    return create
