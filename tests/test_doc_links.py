"""No stale pointers: every relative link in the repository's Markdown resolves (the file exists,
and an ``#anchor`` into a Markdown file names one of its headings, slugged as GitHub does), and
every ``some/file.md, "Section"`` reference in a tracked text file names a file with that section
(a heading, or a paragraph led by ``**Section.**``). The unquoted ``README, Section`` form cannot
be checked, so it is refused. Every subject doc (``docs/*.md``) fits in :data:`DOC_LINES` lines:
dated benchmark logs live under ``docs/bench/<run>/README.md``."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEXT = (".md", ".py", ".toml", ".yaml", ".yml", ".sh", ".cfg", ".ini", ".txt")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
SECTION_REF = re.compile(r"`{0,2}((?:[\w.-]+/)*[\w.-]+\.md)`{0,2},\s+\"([^\"\n]+)\"")
BARE_README_REF = re.compile(r"README, [A-Z]")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
BOLD_LEAD = re.compile(r"^\*\*([^*\n]+?)\.?\*\*", re.M)
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
DOC_LINES = 250


def tracked(suffixes: tuple[str, ...]) -> list[Path]:
    """The tracked files with these suffixes (``git ls-files``: what a fresh clone holds)."""
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    return [ROOT / f for f in out if f.endswith(suffixes) and (ROOT / f).is_file()]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading).strip().lower()
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def sections(md: Path) -> tuple[set[str], set[str]]:
    """(anchors, section names) of a Markdown file, code blocks aside."""
    text = FENCE.sub("", md.read_text(encoding="utf-8"))
    anchors: set[str] = set()
    for heading in HEADING.findall(text):
        base, n = slug(heading), 0
        while (anchors_name := base if n == 0 else f"{base}-{n}") in anchors:
            n += 1
        anchors.add(anchors_name)
    names = {re.sub(r"[`*]", "", h).strip() for h in HEADING.findall(text)}
    names |= {b.strip() for b in BOLD_LEAD.findall(text)}
    return anchors, names


def resolve(ref: str, where: Path) -> Path | None:
    """A referenced path from the referring file's folder, else from the repository root."""
    for base in (where.parent, ROOT):
        if (base / ref).exists():
            return base / ref
    return None


def rel(p: Path) -> str:
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else p.name


def link_problems(md: Path) -> list[str]:
    text = FENCE.sub("", md.read_text(encoding="utf-8"))
    problems = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):      # http:, https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        dest = md if not path else resolve(path, md)
        if dest is None:
            problems.append(f"{rel(md)}: link to missing {path}")
        elif anchor and dest.suffix == ".md" and anchor not in sections(dest)[0]:
            problems.append(f"{rel(md)}: no heading #{anchor} in {path or md.name}")
    return problems


def section_problems(f: Path) -> list[str]:
    text = f.read_text(encoding="utf-8", errors="replace")
    problems = []
    for ref, name in SECTION_REF.findall(text):
        dest = resolve(ref, f)
        if dest is None:
            problems.append(f"{rel(f)}: {ref} does not exist")
        elif not any(name == s or s.startswith(name) for s in sections(dest)[1]):
            problems.append(f'{rel(f)}: no section "{name}" in {ref}')
    if BARE_README_REF.search(text):
        problems.append(f"{rel(f)}: 'README, X' (name the doc and quote the section)")
    return problems


def test_every_relative_markdown_link_resolves() -> None:
    problems = [p for md in tracked((".md",)) for p in link_problems(md)]
    assert problems == []


def test_every_section_reference_names_a_section_that_exists() -> None:
    here = Path(__file__).resolve()     # its own examples are planted on purpose
    problems = [p for f in tracked(TEXT) if f.resolve() != here for p in section_problems(f)]
    assert problems == []


def long_docs(docs: list[Path]) -> list[str]:
    """The subject docs over :data:`DOC_LINES` lines, with their counts."""
    counts = {rel(md): len(md.read_text(encoding="utf-8").splitlines()) for md in docs}
    return [f"{name}: {n} lines" for name, n in counts.items() if n > DOC_LINES]


def test_every_subject_doc_fits_its_line_budget() -> None:
    docs = [md for md in tracked((".md",)) if md.parent == ROOT / "docs"]
    assert docs and long_docs(docs) == []


def test_a_doc_over_the_budget_is_found(tmp_path: Path) -> None:
    md = tmp_path / "long.md"
    md.write_text("line\n" * (DOC_LINES + 1), encoding="utf-8")
    assert long_docs([md]) == [f"long.md: {DOC_LINES + 1} lines"]
    md.write_text("line\n" * DOC_LINES, encoding="utf-8")
    assert long_docs([md]) == []


@pytest.mark.parametrize("text, bad", [
    ("see [x](docs/nowhere.md)", "missing docs/nowhere.md"),
    ("see [x](README.md#no-such-heading)", "no heading #no-such-heading"),
    ("see [x](#not-here)\n\n## Here\n", "no heading #not-here"),
])
def test_a_broken_link_is_found(tmp_path: Path, text: str, bad: str) -> None:
    md = tmp_path / "planted.md"
    md.write_text(text, encoding="utf-8")
    assert any(bad in p for p in link_problems(md))
    md.write_text("see [x](README.md#headline-figures) and [y](#here)\n\n## Here\n", encoding="utf-8")
    assert link_problems(md) == []


def test_a_missing_section_and_a_bare_readme_reference_are_found(tmp_path: Path) -> None:
    f = tmp_path / "planted.md"
    f.write_text('(`docs/drafters.md`, "No such part") and (README, Fallback)\n', encoding="utf-8")
    problems = section_problems(f)
    assert any('no section "No such part"' in p for p in problems)
    assert any("'README, X'" in p for p in problems)
    assert section_problems(ROOT / "docs" / "kubernetes.md") == []
