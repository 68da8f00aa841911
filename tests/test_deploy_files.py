"""Files that cannot run here (no Docker engine, no cluster) checked statically: they parse,
name only files and modules that exist, and use the entry points, ports, paths and environment
variables the code itself defines."""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from ingest.job.config import ENVIRONMENT as INGEST_ENVIRONMENT
from ingest.job.config import JobConfig
from pipeline.config import ENVIRONMENT as PIPELINE_ENVIRONMENT
from pipeline.config import PipelineConfig
from runtime.storage import JARS_VARIABLE

ROOT = Path(__file__).resolve().parent.parent
KNOWN_VARIABLES = {
    *INGEST_ENVIRONMENT.values(),
    *PIPELINE_ENVIRONMENT.values(),
    JARS_VARIABLE,
    "SPANNER_EMULATOR_HOST",  # read by the google-cloud-spanner client itself
    "PYTHONUNBUFFERED",
    "PATH",
}
SERVICE_SOURCE = (ROOT / "ingest" / "service" / "health.py").read_text()
HEALTH_PORT = JobConfig().health_port


def module_exists(argv: list[str]) -> None:
    """Entry points are ``python -m <module> <command>`` (the image's ENTRYPOINT is python -m)."""
    assert importlib.util.find_spec(argv[0]) is not None, argv
    if argv[0] in ("ingest", "pipeline"):
        assert argv[1] in ("run", "tail", "check-state-schema"), argv


def dockerfile_stages(path: Path) -> list[list[str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and line[0] != "#"]
    stages: list[list[str]] = []
    for line in lines:
        if line.upper().startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(line)
    return stages


def instruction(stage: list[str], name: str) -> list[str]:
    return [line[len(name) + 1 :] for line in stage if line.upper().startswith(name + " ")]


def copied_sources(path: Path) -> list[str]:
    sources = []
    for stage in dockerfile_stages(path):
        for copy in instruction(stage, "COPY"):
            if "--from=" in copy:
                continue
            sources += copy.split()[:-1]
    return sources


def test_dockerfile_is_multistage_slim_non_root_with_a_healthcheck() -> None:
    stages = dockerfile_stages(ROOT / "Dockerfile")
    assert len(stages) >= 2
    final = stages[-1]
    assert "slim" in (ROOT / "Dockerfile").read_text().split("PYTHON_IMAGE=")[1].split()[0]
    users = instruction(final, "USER")
    assert users and users[-1] not in ("root", "0")
    installs = " ".join(instruction(final, "RUN"))
    for compiler in ("gcc", "build-essential", "g++", "make ", "-jdk "):
        assert compiler not in installs, compiler
    assert "jre-headless" in installs
    health = " ".join(instruction(final, "HEALTHCHECK"))
    port = "{os.environ.get('INGEST_HEALTH_PORT', '" + str(HEALTH_PORT) + "')}"
    assert f"127.0.0.1:{port}/healthz" in health
    assert '"/healthz"' in SERVICE_SOURCE
    assert instruction(final, "ENTRYPOINT")[0].endswith('"python", "-m"]')
    module_exists(yaml.safe_load(instruction(final, "CMD")[0]))
    build = " ".join(instruction(stages[0], "RUN"))
    assert "pipeline.session fetch" in build, "the Delta jars must be fetched at build time"
    metrics_port = PipelineConfig().metrics_port
    assert instruction(final, "EXPOSE") == [f"{HEALTH_PORT} {metrics_port}"]
    variables = re.findall(r"(\w+)=", " ".join(instruction(final, "ENV")))
    assert set(variables) <= KNOWN_VARIABLES, set(variables) - KNOWN_VARIABLES


def test_dockerfiles_copy_only_what_exists_and_ignore_local_state() -> None:
    for path in (ROOT / "Dockerfile", ROOT / "deploy" / "spark.Dockerfile"):
        for source in copied_sources(path):
            assert (ROOT / source).exists(), (path.name, source)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".jars", ".git"} <= set(ignored)


def test_compose_runs_the_product_on_the_emulator_with_a_shared_volume() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"emulator", "bootstrap", "ingest", "pipeline", "workload"} <= services.keys()
    assert services["emulator"]["image"].startswith("gcr.io/cloud-spanner-emulator/emulator")
    assert services["workload"]["profiles"] == ["workload"]
    assert services["bootstrap"]["restart"] == "no"
    for name, service in services.items():
        for dependency in service.get("depends_on", {}):
            assert dependency in services, (name, dependency)
        if name == "emulator":
            continue
        assert service["build"] == "." and (ROOT / "Dockerfile").exists()
        module_exists(service["command"])
        assert set(service.get("environment", {})) <= KNOWN_VARIABLES, name
    for name in ("ingest", "pipeline"):
        volumes = services[name]["volumes"]
        assert volumes == ["delta:/data"] and "delta" in compose["volumes"]
    ingest_env, pipeline_env = (
        services["ingest"]["environment"],
        services["pipeline"]["environment"],
    )
    assert ingest_env["INGEST_TABLE_URI"] == pipeline_env["PIPELINE_CHANGELOG_URI"]
    assert services["ingest"]["ports"] == [f"{HEALTH_PORT}:{ingest_env['INGEST_HEALTH_PORT']}"]
    assert services["pipeline"]["depends_on"]["ingest"]["condition"] == "service_healthy"


def manifests(name: str) -> dict[str, dict[str, Any]]:
    documents = yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / name).read_text())
    return {document["kind"]: document for document in documents if document}


def assert_read_only_root_with_tmp(pod: dict[str, Any]) -> None:
    """Read-only root, /tmp an emptyDir: what tests/test_image.py checks the processes allow."""
    (container,) = pod["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    (mount,) = (m for m in container["volumeMounts"] if m["mountPath"] == "/tmp")
    (volume,) = (v for v in pod["volumes"] if v["name"] == mount["name"])
    assert "emptyDir" in volume, volume


def test_ingest_deployment_is_one_recreated_replica_with_probes_limits_and_config() -> None:
    objects = manifests("ingest.yaml")
    deployment, config = objects["Deployment"], objects["ConfigMap"]
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"
    pod = spec["template"]["spec"]
    assert pod["serviceAccountName"] == objects["ServiceAccount"]["metadata"]["name"]
    assert "iam.gke.io/gcp-service-account" in objects["ServiceAccount"]["metadata"]["annotations"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert_read_only_root_with_tmp(pod)
    (container,) = pod["containers"]
    module_exists(container["args"])
    assert container["envFrom"] == [{"configMapRef": {"name": config["metadata"]["name"]}}]
    assert set(config["data"]) <= KNOWN_VARIABLES, set(config["data"]) - KNOWN_VARIABLES
    port = int(config["data"]["INGEST_HEALTH_PORT"])
    assert container["ports"][0]["containerPort"] == port
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        assert container[probe]["httpGet"]["path"] == path and f'"{path}"' in SERVICE_SOURCE
        assert container[probe]["httpGet"]["port"] == container["ports"][0]["name"]
    assert {"cpu", "memory"} <= container["resources"]["requests"].keys()
    assert {"cpu", "memory"} <= container["resources"]["limits"].keys()
    token_file = Path(config["data"]["INGEST_CONTROL_TOKEN_FILE"])
    (mount,) = (m for m in container["volumeMounts"] if m["mountPath"] == str(token_file.parent))
    (volume,) = (v for v in pod["volumes"] if v["name"] == mount["name"])
    assert mount["readOnly"] and volume["secret"]["secretName"], "the control token is a secret"
    text = (ROOT / "deploy" / "kubernetes" / "ingest.yaml").read_text()
    assert "private_key" not in text and "GOOGLE_APPLICATION_CREDENTIALS:" not in text


def test_pipeline_manifests_run_one_job_with_state_on_object_storage() -> None:
    objects = manifests("pipeline.yaml")
    spec = objects["Deployment"]["spec"]
    assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"
    (container,) = spec["template"]["spec"]["containers"]
    module_exists(container["args"])
    assert spec["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    assert_read_only_root_with_tmp(spec["template"]["spec"])
    data = objects["ConfigMap"]["data"]
    assert set(data) <= KNOWN_VARIABLES, set(data) - KNOWN_VARIABLES
    for option in ("PIPELINE_CHANGELOG_URI", "PIPELINE_MIRROR_ROOT", "PIPELINE_CHECKPOINT_URI"):
        assert data[option].startswith("gs://"), option
    application = manifests("pipeline-sparkapplication.yaml")["SparkApplication"]["spec"]
    assert application["type"] == "Python" and application["arguments"] == ["run"]
    main_file = application["mainApplicationFile"].removeprefix("local://")
    spark_dockerfile = (ROOT / "deploy" / "spark.Dockerfile").read_text()
    assert f"cp pipeline/__main__.py {main_file}" in spark_dockerfile
    env = {e["name"]: e["value"] for e in application["driver"]["env"]}
    assert set(env) <= KNOWN_VARIABLES and env["PIPELINE_MASTER"] == ""
    assert all(env[o].startswith("gs://") for o in env if o.endswith("_URI") or "ROOT" in o)
    assert application["sparkVersion"].startswith("4.2")


def exported_metric_names() -> set[str]:
    """Every sample name the two processes' ``/metrics`` can show, from real renders with every
    source set (a reader that has not run, a landed watermark, a snapshot; a batch landed)."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from ingest.changestream.config import ReaderConfig
    from ingest.changestream.reader import ChangeStreamReader
    from ingest.job.metrics import IngestMetrics
    from ingest.model.snapshot import SnapshotProgress
    from pipeline.metrics import PipelineMetrics
    from runtime.logs import null_logger

    metrics = IngestMetrics()
    metrics.sources.reader = ChangeStreamReader(
        object(),  # type: ignore[arg-type]
        ReaderConfig(start_timestamp=1),
        null_logger(),
    )
    metrics.sources.landed_watermark = 1
    metrics.sources.snapshot = lambda: SnapshotProgress.begin(1, ["t"])
    metrics.committed([], 1)
    pipeline = PipelineMetrics()
    pipeline.batch_landed({"t": 1}, "2026-11-24T00:00:00Z")
    names: set[str] = set()
    for text in (metrics.render(), generate_latest(pipeline.registry)):
        families = list(text_string_to_metric_families(text.decode()))
        names |= {sample.name for family in families for sample in family.samples}
        # a labelled counter with no sample yet (no retry so far) is still declared
        names |= {f"{f.name}_total" for f in families if f.type == "counter"}
        names |= {family.name for family in families}
    return names


def promql_metric_names(expression: str) -> set[str]:
    return set(re.findall(r"\b((?:ingest|pipeline)_[a-z_]+)\b", expression))


def test_dashboards_and_alerts_name_only_exported_metrics() -> None:
    exported = exported_metric_names()
    assert {"ingest_commit_latency_seconds_bucket", "pipeline_freshness_lag_seconds"} <= exported
    monitoring = ROOT / "deploy" / "monitoring"
    dashboard = json.loads((monitoring / "dashboard.json").read_text())
    expressions = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    rules = yaml.safe_load((monitoring / "alerts.yaml").read_text())
    assert rules["kind"] == "PrometheusRule"
    expressions += [r["expr"] for g in rules["spec"]["groups"] for r in g["rules"]]
    named = set().union(*(promql_metric_names(e) for e in expressions))
    assert named and named <= exported, named - exported
    assert {
        "ingest_watermark_lag_seconds",
        "ingest_partitions",
        "pipeline_freshness_lag_seconds",
        "pipeline_batch_duration_seconds_bucket",
        "pipeline_query_restarts_total",
    } <= named
    ports = {"ingest": str(HEALTH_PORT), "pipeline": str(PipelineConfig().metrics_port)}
    for process, port in ports.items():
        service, monitor = yaml.safe_load_all(
            (monitoring / f"{process}-servicemonitor.yaml").read_text()
        )
        assert service["metadata"]["annotations"]["prometheus.io/port"] == port
        assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
        monitored = service["spec"]["selector"]["app.kubernetes.io/name"]
        pods = [manifests(f"{process}.yaml")["Deployment"]["spec"]["template"]["metadata"]]
        if process == "pipeline":
            pods.append(
                manifests("pipeline-sparkapplication.yaml")["SparkApplication"]["spec"]["driver"]
            )
        for pod in pods:
            assert pod["labels"]["app.kubernetes.io/name"] == monitored, process
    assert '"/metrics"' in SERVICE_SOURCE


def test_the_kubernetes_manifests_pass_the_kubernetes_schemas() -> None:
    """Every resource of the Deployments' files, strictly (no field the schema lacks), against
    the schemas kubernetes-validate ships. The SparkApplication is the operator's own kind: the
    next test."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kubernetes_validate",
            "--strict",
            str(ROOT / "deploy/kubernetes/ingest.yaml"),
            str(ROOT / "deploy/kubernetes/pipeline.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    passed = [line for line in result.stdout.splitlines() if " passed for resource " in line]
    assert len(passed) == 6, result.stdout


def test_the_sparkapplication_passes_the_spark_operator_s_crd_schema() -> None:
    """Against the operator's CRD schema kept in deploy/schemas (its source named there),
    strictly: a field the schema does not name fails, as Kubernetes would prune it."""
    packed = ROOT / "deploy/schemas/sparkapplication-v1beta2.schema.json.gz"
    schema = _strict(json.loads(gzip.decompress(packed.read_bytes())))
    manifest = yaml.safe_load(
        (ROOT / "deploy/kubernetes/pipeline-sparkapplication.yaml").read_text()
    )
    validator = jsonschema.Draft7Validator(schema)
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(manifest)]
    assert errors == []
    wrong = {**manifest, "spec": {**manifest["spec"], "drivr": {"cores": 1}}}
    assert not validator.is_valid(wrong), "the strict schema lets an unknown field through"


def _strict(schema: Any) -> Any:
    """The schema with every object that lists its properties closed to others (unless it keeps
    unknown fields, as Kubernetes does for x-kubernetes-preserve-unknown-fields)."""
    if isinstance(schema, list):
        return [_strict(part) for part in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {key: _strict(value) for key, value in schema.items()}
    if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        strict.setdefault("additionalProperties", False)
    return strict


def test_the_dockerfiles_pass_hadolint() -> None:
    """hadolint with the repository's .hadolint.yaml (what it ignores, and why)."""
    hadolint = Path(sys.executable).parent / "hadolint"
    result = subprocess.run(
        [str(hadolint), "Dockerfile", "deploy/spark.Dockerfile"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
