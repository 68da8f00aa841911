"""Files that cannot run here (no Docker engine) are checked statically."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_compose_file_parses_and_names_real_modules() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"emulator", "bootstrap", "workload", "tail"} <= services.keys()
    for name, service in services.items():
        command = " ".join(service.get("command", []))
        for module in re.findall(r"python -m ([\w.]+)", command):
            assert importlib.util.find_spec(module) is not None, (name, module)
        for dependency in service.get("depends_on", {}):
            assert dependency in services
    tail_env = services["tail"]["environment"]
    cli_source = (ROOT / "ingest" / "cli.py").read_text()
    for variable in (
        "SPANNER_PROJECT",
        "SPANNER_INSTANCE",
        "SPANNER_DATABASE",
        "SPANNER_CHANGE_STREAM",
    ):
        assert variable in tail_env and f'"{variable}"' in cli_source


def test_ci_runs_the_readme_test_command() -> None:
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    assert "make test" in (ROOT / "README.md").read_text()


def test_readme_configuration_reference_matches_the_code() -> None:
    from ingest.config import reference
    from pipeline.config import reference as pipeline_reference

    readme = (ROOT / "README.md").read_text()
    documented = re.findall(r"^\| `(\w+)` \| `(\w+)` \| `(.*)` \|$", readme, flags=re.M)
    expected = [(n, e, repr(d)) for n, e, d in [*reference(), *pipeline_reference()]]
    assert documented == expected
