"""The product as users get it: the repository's image (``make image``), its three long-running
commands started from it as its non-root user against the emulator with the sample workload.

The ingest service (snapshot at start), the pipeline, a kill -9 of the pipeline's container and
a new one, a hand-over to ``spark-run`` (local master) and back, each stop through tini: every
committed transaction once in the change log, the mirrors equal to Spanner at W, the probes and
the HEALTHCHECK as Kubernetes and the image expect them, and every line the containers wrote
one JSON object with a level.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from emulator.processes import kill_tree
from emulator.server import free_port
from emulator.verify import changelog_watermark
from emulator.workload import load_existing_rows
from tests.background_builds import IMAGE_BUILD, wait_for_build
from tests.checks import assert_mirrors_equal, compare_at_watermark, crash_seed
from tests.compose import services, start_order
from tests.containers import IMAGE, Container, not_json, status
from tests.delta_checks import assert_change_log_invariants
from tests.processes import background_workload, wait_until, wait_until_landed

pytestmark = pytest.mark.emulator
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def containers(tmp_path: Path) -> Iterator[Callable[..., Container]]:
    made: list[Container] = []

    def make(name: str, **env: str) -> Container:
        container = Container(
            f"cdc-{name}-{os.getpid()}-{len(made)}", volume, tmp_path / f"{name}.log", env
        )
        made.append(container)
        return container

    volume = tmp_path / "data"
    volume.mkdir()
    volume.chmod(0o777)  # the image's user (uid 10001) writes the tables there
    wait_for_build(IMAGE_BUILD)
    if subprocess.run(["buildah", "inspect", IMAGE], capture_output=True).returncode != 0:
        pytest.fail(f"no image {IMAGE}: `make image` builds it (make test does)")
    yield make
    for container in made:
        container.remove()


def probes() -> dict[str, str]:
    """The ingest Deployment's probe paths by kind (deploy/kubernetes/ingest.yaml)."""
    documents = list(yaml.safe_load_all((ROOT / "deploy/kubernetes/ingest.yaml").read_text()))
    deployment = next(d for d in documents if d and d.get("kind") == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return {
        kind: container[kind]["httpGet"]["path"]
        for kind in ("livenessProbe", "readinessProbe")
        if kind in container
    }


def test_the_image_runs_the_product_and_every_line_is_json(
    spanner_client: Any, containers: Callable[..., Container], tmp_path: Path
) -> None:
    began = time.time()
    seed, rng = crash_seed()
    compose = services(ROOT / "docker-compose.yml")
    assert start_order(compose) == ["emulator", "bootstrap", "ingest", "pipeline"]
    health, metrics = free_port(), free_port()
    name = f"image{os.getpid() % 10000}"
    addresses = {  # what the harness assigns: its emulator, a database and ports of its own
        "SPANNER_EMULATOR_HOST": os.environ["SPANNER_EMULATOR_HOST"],
        "SPANNER_DATABASE": name,
        "INGEST_HEALTH_PORT": str(health),
        "PIPELINE_METRICS_PORT": str(metrics),
    }

    def from_compose(service: str, **settings: str) -> tuple[Container, list[str]]:
        """A container of the compose service: its command and environment, the harness's
        addresses where the file names its own."""
        found = compose[service]
        assert found.built and found.volumes == ["delta:/data"], found
        env = {
            **found.environment,
            **{k: v for k, v in addresses.items() if k in found.environment},
        }
        return containers(service, **env, TINI_SUBREAPER="1", **settings), found.command

    bootstrap, bootstrap_command = from_compose("bootstrap")
    assert bootstrap.run(*bootstrap_command).wait(timeout=300) == 0, bootstrap.lines()[-20:]
    database = spanner_client.instance("local-instance").database(name)
    load_existing_rows(database, accounts=100, transfers=300, all_types=50, seed=seed)
    ingest, ingest_command = from_compose("ingest")
    # after the kill -9, the next container starts once the lock is this old (exit 2 before)
    pipeline, pipeline_command = from_compose("pipeline", PIPELINE_LOCK_STALE_S="5")
    spanner = {k: v for k, v in ingest.env.items() if k.startswith("SPANNER_")}
    source = containers(
        "spark-run",
        **spanner,
        TINI_SUBREAPER="1",
        INGEST_SPARK_MASTER="local[2]",
        INGEST_SPARK_CHECKPOINT_URI="/data/spark-checkpoint",
    )
    url = f"http://127.0.0.1:{health}"
    running: list[subprocess.Popen[bytes]] = []
    stop_workload = threading.Event()
    try:
        started = ingest.run(*ingest_command)
        running.append(started)
        ready = probes()["readinessProbe"]
        ready_s = wait_until(lambda: status(f"{url}{ready}") == 200, 300, "/readyz", started)
        workload, stop_workload, committed = background_workload(database, 600, 10, seed)
        assert status(f"{url}{probes()['livenessProbe']}") == 200
        assert status(f"{url}/metrics") == 200
        assert ingest.healthcheck() == 0, "HEALTHCHECK fails on a healthy service"
        assert compose["pipeline"].depends_on == {"ingest": "service_healthy"}
        job = pipeline.run(*pipeline_command)
        running.append(job)
        first_batch_s = wait_until(
            lambda: pipeline.count("pipeline_batch") >= 1, 600, "first batch", job
        )
        print(f"seed {seed}: /readyz after {ready_s:.1f} s, first batch {first_batch_s:.1f} s")
        time.sleep(rng.uniform(0, 3))
        pipeline.kill(job)
        time.sleep(6)  # the killed job's lock goes stale (PIPELINE_LOCK_STALE_S)
        job = pipeline.run(*pipeline_command)
        running.append(job)

        ingest.signal(started, signal.SIGTERM)
        assert started.wait(timeout=90) == 0, ingest.lines()[-20:]
        assert ingest.healthcheck() != 0, "HEALTHCHECK passes with no service"
        driver = source.run("ingest", "spark-run")
        running.append(driver)
        wait_until(lambda: source.count("spark_batch") >= 3, 600, "spark-run batches", driver)
        source.signal(driver, signal.SIGTERM)
        assert driver.wait(timeout=120) == 0, source.lines()[-20:]

        started = ingest.run(*ingest_command)
        running.append(started)
        wait_until(lambda: status(f"{url}{ready}") == 200, 300, "/readyz again", started)
        stop_workload.set()
        workload.join()
        wait_until_landed(  # a stop names the missing transactions and who lost them
            tmp_path / "data" / "changelog", len(committed), 300, ingest, committed
        )
        ingest.signal(started, signal.SIGTERM)
        assert started.wait(timeout=90) == 0, ingest.lines()[-20:]
        pipeline.signal(job, signal.SIGUSR1)  # drain: what the change log holds, then exit
        assert job.wait(timeout=600) == 0, pipeline.lines()[-20:]
    finally:
        stop_workload.set()
        for process in running:
            if process.poll() is None:
                kill_tree(process)

    changelog = tmp_path / "data" / "changelog"
    assert changelog_watermark(str(changelog)) is not None
    assert_change_log_invariants(changelog, committed)
    _, comparisons = compare_at_watermark(database, str(changelog), str(tmp_path / "data/mirrors"))
    assert_mirrors_equal(comparisons, f"seed {seed}")
    assert all(c.mirror_rows > 0 for c in comparisons), comparisons
    for container in (ingest, source, pipeline):
        assert not_json(container.lines()) == [], container.log
        assert container.count("class_archive_unused") == 0, "the image's class archive is stale"
        # the Kubernetes manifests run both with a read-only root and /tmp an emptyDir
        assert container.written(began, ("/tmp", "/data")) == [], container.log
