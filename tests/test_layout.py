"""Dependencies point one way along the data flow (docs/design.md): every import of the product's
packages is read from the source and checked against the allowed stages."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

ALLOWED = {
    "ingest.model": ("ingest.model",),
    "ingest.rules": ("ingest.model", "ingest.rules"),
    "ingest.changestream": ("ingest.model", "ingest.rules", "ingest.changestream"),
    "ingest.delta": ("ingest.model", "ingest.rules", "ingest.delta"),
    "ingest.snapshot": ("ingest.model", "ingest.snapshot"),
    "ingest.service": ("ingest",),
    "ingest": ("ingest",),
    "pipeline": ("pipeline", "ingest.model", "ingest.delta.changelog"),
}
"""Stage → the product modules it may import (prefixes). Anything not listed is refused."""
PRODUCT = ("ingest", "pipeline", "emulator", "tests", "bench")


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


def wrong_way_imports() -> list[str]:
    wrong = []
    for package in ("ingest", "pipeline"):
        for path in sorted((ROOT / package).rglob("*.py")):
            module = module_name(path)
            allowed = ALLOWED[stage_of(module)]
            for imported in sorted(product_imports(path)):
                if not any(imported == a or imported.startswith(a + ".") for a in allowed):
                    wrong.append(f"{module} imports {imported}")
    return wrong


def test_every_import_points_down_the_flow() -> None:
    assert wrong_way_imports() == []


def test_the_check_sees_a_wrong_way_import() -> None:
    probe = ROOT / "ingest" / "rules" / "_layout_probe.py"
    probe.write_text("from ingest.delta.sink import DeltaChangeLogSink\n")
    try:
        assert wrong_way_imports() == ["ingest.rules._layout_probe imports ingest.delta.sink"]
    finally:
        probe.unlink()


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
