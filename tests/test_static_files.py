"""The README and docs/ against the code and CI (deployment files: tests/test_deploy_files.py)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command() -> None:
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    assert "make test" in (ROOT / "README.md").read_text()


def test_the_configuration_reference_matches_the_code() -> None:
    from ingest.job.config import reference
    from ingest.sparksource.run import spark_reference
    from pipeline.config import reference as pipeline_reference

    pages = [(ROOT / "docs" / page).read_text() for page in ("ingest.md", "pipeline.md")]
    documented = re.findall(r"^\| `(\w+)` \| `(\w+)` \| `(.*)` \|$", "".join(pages), flags=re.M)
    references = [*reference(), *spark_reference(), *pipeline_reference()]
    expected = [(n, e, repr(d)) for n, e, d in references]
    assert documented == expected
