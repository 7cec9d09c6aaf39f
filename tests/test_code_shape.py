"""The services' code shape (issue 41): no file over 400 lines, no function over 60 lines, and no
capability probing (``getattr`` / ``hasattr`` calls, ``__getattr__`` delegation) in
verifier_svc/, drafter_svc/ and gateway/. Capabilities belong in typed Protocols or explicit
fields, so a reader (and mypy) sees what an object offers without running it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
PROBES = {"getattr", "hasattr"}
PACKAGES = ["verifier_svc", "drafter_svc", "gateway"]


def _sources(package: str) -> list[Path]:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"{package}/ has no Python files"
    return files


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def long_files(paths: list[Path]) -> dict[str, int]:
    """Each file over MAX_FILE_LINES, with its line count."""
    counts = {_name(p): len(p.read_text().splitlines()) for p in paths}
    return {name: n for name, n in counts.items() if n > MAX_FILE_LINES}


def long_functions(path: Path) -> dict[str, int]:
    """Each function or method of ``path`` over MAX_FUNCTION_LINES (decorators included)."""
    out = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            length = (node.end_lineno or node.lineno) - first + 1
            if length > MAX_FUNCTION_LINES:
                out[f"{_name(path)}:{node.lineno} {node.name}"] = length
    return out


def probes(path: Path) -> list[str]:
    """Where ``path`` calls getattr/hasattr or defines ``__getattr__``, as ``file:line what``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in PROBES:
            out.append((node.lineno, f"{node.func.id}("))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == "__getattr__":
            out.append((node.lineno, "def __getattr__"))
    return [f"{_name(path)}:{line} {what}" for line, what in sorted(out)]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_file_is_over_the_limit(package):
    assert long_files(_sources(package)) == {}


@pytest.mark.parametrize("package", PACKAGES)
def test_no_function_is_over_the_limit(package):
    found = {}
    for path in _sources(package):
        found |= long_functions(path)
    assert found == {}


@pytest.mark.parametrize("package", PACKAGES)
def test_no_capability_probing(package):
    assert [hit for path in _sources(package) for hit in probes(path)] == []


def test_the_checks_find_what_they_look_for(tmp_path):
    # the checks on a planted file: a pass above would mean nothing if they could not fail
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    planted = tmp_path / "planted.py"
    planted.write_text(
        f"def long():\n{body}\n"
        "def short(o):\n    return getattr(o, 'fork', None) or hasattr(o, 'device')\n"
        "class Proxy:\n    def __getattr__(self, name):\n        return name\n"
        + "\n" * MAX_FILE_LINES
    )
    assert long_functions(planted) == {"planted.py:1 long": MAX_FUNCTION_LINES + 1}
    assert [h.split(" ", 1)[1] for h in probes(planted)] == ["getattr(", "hasattr(", "def __getattr__"]
    assert list(long_files([planted])) == ["planted.py"]
