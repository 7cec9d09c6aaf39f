"""dflash/ by layer: ``core`` (the algorithm) imports no other layer of dflash, ``serving``
only ``core``, and the torch-free client nothing but the generated stubs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

DFLASH = Path(__file__).resolve().parents[1] / "dflash"
ALLOWED = {
    "core": {"core", "v1"},
    "serving": {"core", "serving", "v1"},
    "client": {"client", "v1"},
}


def _dflash_imports(path: Path) -> set[str]:
    """The dflash sub-packages ``path`` imports (``dflash.<layer>...``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for n in names:
            parts = n.split(".")
            if parts[0] == "dflash" and len(parts) > 1:
                out.add(parts[1])
    return out


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_a_layer_imports_only_the_layers_below_it(layer):
    files = sorted((DFLASH / layer).rglob("*.py"))
    assert files, f"dflash/{layer}/ is empty"
    bad = {str(f.relative_to(DFLASH)): sorted(_dflash_imports(f) - ALLOWED[layer]) for f in files}
    assert {f: b for f, b in bad.items() if b} == {}


def test_no_flat_modules_are_left_beside_the_layers():
    assert sorted(p.name for p in DFLASH.glob("*.py")) == ["__init__.py"]
