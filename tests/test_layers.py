"""dflash/ by layer: ``core`` (the algorithm) imports no other layer of dflash, ``serving``
only ``core``, and the torch-free client nothing but the generated stubs. Across the packages,
the import-linter contracts in pyproject.toml (core <- serving <- services <- application, the
kernels at the bottom; no circle between dflash's sub-packages) hold on the real tree, name
every package, and fail on a planted violation."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DFLASH = ROOT / "dflash"
ROOT_PACKAGES = ("dflash", "dflash_app", "verifier_svc", "drafter_svc", "gateway", "kernels")
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
ALLOWED = {
    "core": {"core", "v1"},
    "serving": {"core", "serving", "v1"},
    "client": {"client", "v1"},
    "recipe": {"core", "recipe"},
    "learn": {"core", "serving", "recipe", "learn", "v1"},
    "train": {"core", "recipe", "train"},
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


def _lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` with the repository's contract over the packages found in ``tree``."""
    if not LINT_IMPORTS.exists():
        pytest.fail(f"{LINT_IMPORTS} missing: import-linter comes with the dev extra (scripts/setup.sh)")
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--config", str(ROOT / "pyproject.toml")],
        cwd=tree, capture_output=True, text=True, timeout=120,
    )


def _copy_packages(dest: Path) -> None:
    """The Python sources of every root package, copied under ``dest`` (nothing else)."""
    def not_source(folder: str, names: list[str]) -> set[str]:
        return {n for n in names if n == "__pycache__" or (Path(folder, n).is_file() and not n.endswith(".py"))}

    for package in ROOT_PACKAGES:
        shutil.copytree(ROOT / package, dest / package, ignore=not_source)


def test_the_tree_keeps_the_layer_contract():
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout


def test_every_package_is_a_layer_once():
    # with every package in exactly one layer (and siblings independent), an import between
    # packages can only run down: no circle, and no package the contract does not see
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c["type"] == "layers"]
    named = [m.strip() for layer in layers for m in layer.replace(":", "|").split("|")]
    subpackages = [f"dflash.{p.name}" for p in sorted(DFLASH.iterdir()) if (p / "__init__.py").is_file()]
    want = [p for p in ROOT_PACKAGES if p != "dflash"] + subpackages
    assert sorted(named) == sorted(want)
    assert not any(":" in layer for layer in layers)       # no layer of mutually importing packages


@pytest.mark.parametrize(
    ("importer", "imported"),
    [
        ("dflash/core/planted.py", "dflash.serving.metrics"),      # core reaching up to serving
        ("dflash/serving/planted.py", "verifier_svc.request"),     # serving reaching into a service
        ("gateway/planted.py", "drafter_svc.engine"),              # one service into another
        ("verifier_svc/planted.py", "dflash_app.cli"),           # a service into the application
        ("dflash/client/planted.py", "dflash.core.errors"),        # the torch-free client into core
        ("dflash/train/planted.py", "dflash_app.bench_prompts"),   # training into the application
        ("kernels/planted.py", "dflash.core.flags"),               # the kernels into dflash
        ("dflash/train/planted.py", "verifier_svc.policy"),        # training into a service
    ],
)
def test_a_planted_upward_import_breaks_the_contract(tmp_path, importer, imported):
    _copy_packages(tmp_path)
    (tmp_path / importer).write_text(f"import {imported}\n")
    result = _lint_imports(tmp_path)
    planted = importer.removesuffix(".py").replace("/", ".")
    assert result.returncode != 0, result.stdout
    assert f"{planted} -> {imported}" in result.stdout


def test_a_planted_circle_between_sub_packages_breaks_the_contract(tmp_path):
    _copy_packages(tmp_path)
    (tmp_path / "dflash/core/planted.py").write_text("import dflash.serving.metrics\n")  # serving imports core
    result = _lint_imports(tmp_path)
    assert result.returncode != 0, result.stdout
    assert "No cycles are allowed in dflash." in result.stdout
