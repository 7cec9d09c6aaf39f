"""tests/README.md indexes every module of the services, dflash/core and dflash/serving to its
test files: each module has a row, each row names a module that exists, and every test file it
names exists (so the index cannot drift from the tree). Shared stack fixtures live in
tests/helpers.py: no module imports conftest (pytest loads it; importing it again runs it twice
under two names)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
INDEXED = ("verifier_svc", "drafter_svc", "gateway", "dflash/core", "dflash/serving")
NOT_MODULES = {"__init__.py", "__main__.py"}     # package markers and entry points: no behaviour
ROW = re.compile(r"^\| `([\w/]+\.py)` \| (.+) \|$")
TEST_FILE = re.compile(r"`(test_\w+\.py)`")


def index(text: str) -> dict[str, list[str]]:
    """The README's rows: module path -> the test files it names, in order.

    Raises AssertionError for a module given two rows or a row naming no test file."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = ROW.match(line)
        if m is None:
            continue
        module, tests = m.group(1), TEST_FILE.findall(m.group(2))
        assert module not in rows, f"tests/README.md: {module} has two rows"
        assert tests, f"tests/README.md: {module} names no test file"
        rows[module] = tests
    return rows


def modules() -> set[str]:
    """The modules the index must cover, as repository paths."""
    return {str(p.relative_to(ROOT)) for package in INDEXED for p in (ROOT / package).rglob("*.py")
            if p.name not in NOT_MODULES}


def test_every_module_has_a_row_and_every_row_a_module():
    rows = index((TESTS / "README.md").read_text())
    assert sorted(modules() - set(rows)) == [], "modules missing from tests/README.md"
    assert sorted(set(rows) - modules()) == [], "tests/README.md rows naming no module"


def test_every_test_file_named_exists():
    rows = index((TESTS / "README.md").read_text())
    missing = {m: [t for t in tests if not (TESTS / t).is_file()] for m, tests in rows.items()}
    assert {m: t for m, t in missing.items() if t} == {}


def test_the_index_parser_reads_rows_and_only_rows():
    # the parser on a known text: a vacuous parse would make both checks above pass
    text = ("| module | tests |\n|---|---|\n"
            "| `gateway/auth.py` | `test_api_keys.py`, `test_authz.py` |\n"
            "prose naming `gateway/x.py` and `test_y.py`\n")
    assert index(text) == {"gateway/auth.py": ["test_api_keys.py", "test_authz.py"]}


def imports_conftest(source: str) -> bool:
    """Whether ``source`` imports the conftest module anywhere (also inside a function)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(a.name == "conftest" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "conftest":
            return True
    return False


def test_no_module_imports_conftest():
    assert imports_conftest("def f():\n    from conftest import Stack\n")  # the check can fail
    found = sorted(p.name for p in TESTS.glob("*.py") if p.name != "conftest.py"
                   and imports_conftest(p.read_text()))
    assert found == [], "import from helpers instead"

