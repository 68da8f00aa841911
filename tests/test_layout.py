"""Dependencies point one way along the data flow (docs/design.md): every import of the product's
packages is read from the source and checked against the allowed stages."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SHARED_INGEST = (
    "runtime",
    "ingest.model",
    "ingest.contract",
    "ingest.rules",
    "ingest.changestream",
    "ingest.delta",
    "ingest.snapshot",
)
"""What the job layer and the two runtimes on it stand on."""
ALLOWED = {
    "runtime": ("runtime",),
    "ingest.model": ("ingest.model",),
    "ingest.contract": ("runtime", "ingest.model", "ingest.contract"),
    "ingest.rules": ("runtime", "ingest.model", "ingest.rules"),
    "ingest.changestream": (
        "runtime",
        "ingest.model",
        "ingest.rules",
        "ingest.changestream",
    ),
    "ingest.delta": ("runtime", "ingest.model", "ingest.contract", "ingest.delta"),
    "ingest.snapshot": (
        "runtime",
        "ingest.model",
        "ingest.contract",
        "ingest.rules",
        "ingest.changestream.retries",
        "ingest.snapshot",
    ),
    "ingest.job": (*SHARED_INGEST, "ingest.job"),
    "ingest.service": (*SHARED_INGEST, "ingest.job", "ingest.service"),
    "ingest.sparksource": (*SHARED_INGEST, "ingest.job", "ingest.sparksource"),
    "ingest": ("runtime", "ingest"),
    "pipeline": ("pipeline", "runtime", "ingest.model", "ingest.contract"),
    "examples": ("pipeline.user_processors",),
}
"""Stage → the product modules it may import (prefixes). Anything not listed is refused."""
PRODUCT = ("runtime", "ingest", "pipeline", "emulator", "tests", "bench", "examples")


def stage_of(module: str) -> str:
    parts = module.split(".")
    nested = ".".join(parts[:2])
    return nested if nested in ALLOWED else parts[0]


def product_imports(path: Path) -> set[str]:
    """Modules of the product this file imports, at any depth (function-level imports too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            found |= {node.module} | {n for n in names if (ROOT / n.replace(".", "/")).exists()}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {m for m in found if m.split(".")[0] in PRODUCT}


def module_name(path: Path) -> str:
    relative = path.relative_to(ROOT).with_suffix("")
    parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
    return ".".join(parts)


def wrong_way_imports_of(module: str, path: Path) -> list[str]:
    allowed = ALLOWED[stage_of(module)]
    return [
        f"{module} imports {imported}"
        for imported in sorted(product_imports(path))
        if not any(imported == a or imported.startswith(a + ".") for a in allowed)
    ]


def wrong_way_imports() -> list[str]:
    return [
        wrong
        for package in ("runtime", "ingest", "pipeline", "examples")
        for path in sorted((ROOT / package).rglob("*.py"))
        for wrong in wrong_way_imports_of(module_name(path), path)
    ]


def test_every_import_points_down_the_flow() -> None:
    assert wrong_way_imports() == []


@pytest.mark.parametrize(
    ("module", "source", "wrong"),
    [
        (
            "ingest.rules.probe",
            "from ingest.delta.sink import DeltaChangeLogSink",
            "ingest.delta.sink",
        ),
        (
            "ingest.delta.probe",
            "from ingest.rules.partitions import watermark_after",
            "ingest.rules.partitions",
        ),
        (
            "ingest.contract.probe",
            "from ingest.delta.changelog import to_arrow",
            "ingest.delta.changelog",
        ),
        ("pipeline.probe", "from ingest.delta.changelog import to_arrow", "ingest.delta.changelog"),
        ("pipeline.probe", "import ingest.rules.turns", "ingest.rules.turns"),
    ],
)
def test_the_check_sees_a_wrong_way_import(
    module: str, source: str, wrong: str, tmp_path: Path
) -> None:
    """A probe outside the tree, read as if it were ``module``."""
    probe = tmp_path / "probe.py"
    probe.write_text(source + "\n")
    assert wrong_way_imports_of(module, probe) == [f"{module} imports {wrong}"]


PIPELINE_LAYERS = (
    ("pipeline", "pipeline.config", "pipeline.metrics", "pipeline.session", "pipeline.types"),
    ("pipeline.columns", "pipeline.user_processors.api", "pipeline.shapes", "pipeline.values"),
    ("pipeline.catalog", "pipeline.merges", "pipeline.state"),
    ("pipeline.processor", "pipeline.user_processors"),
    ("pipeline.mirror", "pipeline.history", "pipeline.batch_log", "pipeline.foreign_commits"),
    ("pipeline.landing", "pipeline.as_of", "pipeline.user_processors.outputs"),
    (
        "pipeline.deployment",
        "pipeline.rebase",
        "pipeline.batch_writer",
        "pipeline.stream_start",
        "pipeline.query",
        "pipeline.restarts",
        "pipeline.job",
    ),
    ("pipeline.cli", "pipeline.__main__"),
)
"""The pipeline's stages, lowest first (docs/design.md): names and shapes, the state, the
stateful step, the tables it writes, their landing and reads, the job, its command line. A
module imports its own layer or lower ones; a prefix names a package and what it holds, the
longest one decides."""


def pipeline_layer(module: str) -> int:
    matches = [
        (len(prefix), number)
        for number, layer in enumerate(PIPELINE_LAYERS)
        for prefix in layer
        if module == prefix or module.startswith(prefix + ".")
    ]
    return max(matches)[1]


def upward_imports_of(module: str, path: Path) -> list[str]:
    return [
        f"{module} imports {imported}"
        for imported in sorted(product_imports(path))
        if imported.startswith("pipeline") and pipeline_layer(imported) > pipeline_layer(module)
    ]


def test_no_pipeline_module_imports_a_later_stage() -> None:
    upward = [
        wrong
        for path in sorted((ROOT / "pipeline").rglob("*.py"))
        for wrong in upward_imports_of(module_name(path), path)
    ]
    assert upward == []


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("from pipeline.mirror import ensure_mirror\n")
    assert upward_imports_of("pipeline.state.seed", probe) == [
        "pipeline.state.seed imports pipeline.mirror"
    ]


def test_the_pipeline_never_loads_the_spanner_client() -> None:
    modules = sorted(
        module_name(p) for p in (ROOT / "pipeline").rglob("*.py") if p.name != "__main__.py"
    )
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(sorted(m for m in sys.modules if m.startswith('google.cloud.spanner')))\n"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout.strip()
    assert loaded == "[]"


def documented_layout() -> dict[str, str]:
    """docs/design.md's folder tree: each folder (or top-level file list) → its description."""
    design = (ROOT / "docs" / "design.md").read_text()
    block = design.split("## Layout", 1)[1].split("```\n", 2)[1]
    entries: dict[str, str] = {}
    top = ""
    current = ""
    for line in block.splitlines():
        name, _, description = line.strip().partition("  ")
        if not line.startswith(" " * 4):
            if not line.startswith(" "):
                top = current = name
            else:
                current = top + name
            entries[current] = entries.get(current, "") + " " + description
        else:
            entries[current] += " " + line.strip()
    return entries


def test_the_layout_in_the_design_is_the_tree() -> None:
    """Every package and module of the product is in docs/design.md's tree, and every folder
    named there exists: the layout is described once, and true."""
    documented = documented_layout()
    named_files = {
        top + file.strip()
        for entry in documented
        for top in [entry.split("/")[0] + "/"]
        for file in entry.split("/", 1)[1].split(",")
        if file.strip().endswith(".py")
    }
    folders = {entry for entry in documented if entry.endswith("/")}
    missing = []
    for package in ("runtime", "ingest", "pipeline", "emulator"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name in ("__init__.py", "__main__.py"):
                continue
            relative = path.relative_to(ROOT).as_posix()
            folder = relative.rsplit("/", 1)[0] + "/"
            if relative in named_files:
                continue
            words = set(re.findall(r"\w+", documented.get(folder, "")))
            if folder not in folders or path.stem not in words:
                missing.append(relative)
    assert missing == [], "not in docs/design.md's layout"
    assert [f for f in sorted(folders) if not (ROOT / f).is_dir()] == []


LONGEST_FUNCTION = 60
"""Lines a product function may take (docstring included): longer ones are read in two passes."""


def test_no_product_function_is_longer_than_sixty_lines() -> None:
    long = [
        f"{path.relative_to(ROOT)}::{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for folder in ("runtime", "ingest", "pipeline")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > LONGEST_FUNCTION
    ]
    assert long == []
