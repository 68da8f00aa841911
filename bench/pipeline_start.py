"""What a pipeline's start costs: the CPU of its whole process tree and the seconds to its query's
start and to its first merged batch, for one or more checkouts of the product, in turns.

``python -m pipeline run`` (``available-now``, ``local[2]``, the product's defaults otherwise,
histories of every table and ``examples.bank:RunningBalance`` beside the mirrors) runs on a change
log landed through the real ingest sink (``--versions`` versions over ``--keys`` accounts), each
time with new mirrors and a new checkpoint, from each ``--trees`` checkout in turn (the
baseline: the same command from a checkout one commit back, ``git worktree add``), ``--runs``
rounds. Every checkout uses this one's jars and class archive. The CPU is that of every process
the start made (its Python, its JVM, the JVM's Python workers), counted by a cgroup of its own
where the machine lets this process make one (cgroup v1's cpuacct), else only what the
processes waited for spent (a JVM that outlives its Python parent is missed; the column says
which).

``--checksums on,off`` runs each checkout on the change log as the sink wrote it and on a copy
without its version checksums (``ingest.delta.version_checksum``: the same versions and files),
where Spark finds each snapshot's protocol and metadata by a job instead.

Usage: python bench/pipeline_start.py [--versions 20] [--keys 2000] [--runs 3] [--trees DIR,...]
       [--checksums on]
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from restart_first_batch import ChangeLogWriter

from emulator.machine import machine_line
from emulator.processes import Process
from runtime.storage import JARS_VARIABLE, jars_dir

HERE = Path(__file__).resolve().parent.parent
CPUACCT = Path("/sys/fs/cgroup/cpuacct")


def start_once(tree: Path, changelog: str, folder: Path) -> dict[str, float | str]:
    """One start from ``tree``: CPU-s, seconds to the query's start and to the first batch."""
    folder.mkdir(parents=True)
    process = Process(
        ["-m", "pipeline", "run"],
        folder / "pipeline.log",
        {
            JARS_VARIABLE: str(jars_dir().resolve()),
            "PIPELINE_CHANGELOG_URI": changelog,
            "PIPELINE_MIRROR_ROOT": str(folder / "mirrors"),
            "PIPELINE_CHECKPOINT_URI": str(folder / "checkpoint"),
            "PIPELINE_HISTORY_TABLES": "*",
            "PIPELINE_HISTORY_ROOT": str(folder / "history"),
            "PIPELINE_PROCESSORS": "examples.bank:RunningBalance",
            "PIPELINE_PROCESSOR_ROOT": str(folder / "processors"),
            "PIPELINE_TRIGGER": "available-now",
            "PIPELINE_MASTER": "local[2]",
            "PIPELINE_METRICS_PORT": "0",
        },
    )
    started = time.time()
    with process.log.open("wb") as output:
        cpu_s, counted = _run_counted(
            lambda join: subprocess.Popen(
                process.command(),
                cwd=tree,
                env=process.env,
                stdout=output,
                stderr=subprocess.STDOUT,
                preexec_fn=join,
            )
        )
    events = {e["event"]: e for e in process.events()}
    if "pipeline_batch" not in events:
        raise SystemExit(f"no batch merged from {tree}: see {process.log}")
    return {
        "cpu_s": cpu_s,
        "counted": counted,
        "query_s": _seconds(events["pipeline_query_started"], started),
        "batch_s": _seconds(events["pipeline_batch"], started),
    }


def _run_counted(
    start: Callable[[Callable[[], None] | None], subprocess.Popen[bytes]],
) -> tuple[float, str]:
    """Run a process to its end; the CPU of it and everything it started."""
    group = _own_group()
    if group is None:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        _wait(start(None))
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        spent = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        return spent, "waited-for only"
    try:
        _wait(start(functools.partial(_join, group)))
        _wait_until_empty(group)
        return int((group / "cpuacct.usage").read_text()) / 1e9, "cgroup"
    finally:
        group.rmdir()


def _own_group() -> Path | None:
    group = CPUACCT / f"pipeline-start-{os.getpid()}"
    try:
        group.mkdir()
    except OSError:
        return None
    return group


def _join(group: Path) -> None:
    """In the child before it runs the pipeline: it and all it starts count in ``group``."""
    (group / "cgroup.procs").write_text(str(os.getpid()))


def _wait(process: subprocess.Popen[bytes]) -> None:
    if process.wait() != 0:
        raise SystemExit(f"the pipeline exited {process.returncode}")


def _wait_until_empty(group: Path) -> None:
    """A JVM outlives the Python process that started it by a moment."""
    for _ in range(600):
        if not (group / "cgroup.procs").read_text().strip():
            return
        time.sleep(0.1)
    raise SystemExit(f"processes of the start still run after a minute: {group}")


def _seconds(event: dict[str, Any], started: float) -> float:
    from ingest.model.timestamps import NANOS_PER_SECOND, parse_rfc3339

    return parse_rfc3339(str(event["timestamp"])) / NANOS_PER_SECOND - started


def without_checksums(changelog: Path) -> Path:
    """A copy of ``changelog`` less its version checksums."""
    copy = changelog.with_name(changelog.name + "-without-checksums")
    shutil.copytree(changelog, copy, ignore=shutil.ignore_patterns("*.crc"))
    return copy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--versions", type=int, default=20)
    parser.add_argument("--keys", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--trees", default=str(HERE), help="checkouts, comma-separated")
    parser.add_argument("--checksums", default="on", help="on, off or both, in turn")
    args = parser.parse_args(argv)
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    folder = Path(tempfile.mkdtemp(prefix="pipeline-start-"))
    writer = ChangeLogWriter(str(folder / "changelog"))
    writer.land(range(args.keys), "INSERT")
    for version in range(1, args.versions):
        writer.land(range(version % 7, args.keys, 7), "UPDATE")
    settings = args.checksums.split(",")
    changelogs = {"on": folder / "changelog"}
    if "off" in settings:
        changelogs["off"] = without_checksums(folder / "changelog")
    print(
        machine_line(
            f"{args.versions} change-log versions over {args.keys} keys; python -m pipeline run "
            "(available-now, local[2], histories of every table, examples.bank:RunningBalance)"
        )
    )
    print("run\ttree\tchecksums\tCPU s\tcounted\tquery started s\tfirst batch s")
    for run in range(args.runs):
        for index, tree in enumerate(trees):
            for checksums in settings:
                where = folder / f"{run}-{index}-{checksums}"
                result = start_once(tree, str(changelogs[checksums]), where)
                print(
                    f"{run}\t{tree.name}\t{checksums}\t{result['cpu_s']:.1f}\t"
                    f"{result['counted']}\t{result['query_s']:.1f}\t{result['batch_s']:.1f}",
                    flush=True,
                )
    print(f'{{"work": "{folder}"}}')
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
