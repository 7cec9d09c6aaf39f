"""Project rules that a grep can check: weights come from safetensors only, nothing unpickles,
no remote code. Scans every Python file the project ships (not tests, not the venv)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ["dflash", "dflash_app", "drafter_svc", "verifier_svc", "gateway", "kernels", "scripts"]
FORBIDDEN = {
    "torch.load": re.compile(r"\btorch\.load\s*\("),
    "pickle": re.compile(r"^\s*(import|from)\s+(c?pickle|dill|joblib)\b", re.M),
    "trust_remote_code=True": re.compile(r"trust_remote_code\s*=\s*True"),
    "use_safetensors=False": re.compile(r"use_safetensors\s*=\s*False"),
}


def shipped_files() -> list[Path]:
    files = [p for d in SHIPPED for p in (ROOT / d).rglob("*.py") if "/v1/" not in p.as_posix()]
    assert len(files) > 50, "the scan found too few files: wrong root?"
    return files


def test_no_unpickling_or_remote_code_in_shipped_code():
    hits = []
    for p in shipped_files():
        text = p.read_text()
        code = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
        for what, rx in FORBIDDEN.items():
            for m in rx.finditer(code):
                line = code[:m.start()].count("\n") + 1
                if "``" not in code.splitlines()[line - 1]:      # docstrings quoting the rule
                    hits.append(f"{p.relative_to(ROOT)}:{line}: {what}")
    assert not hits, "\n".join(hits)


def test_the_scan_catches_a_violation(tmp_path):
    bad = "import pickle\nstate = torch.load(path)\nm = f(trust_remote_code=True)\n"
    found = [what for what, rx in FORBIDDEN.items() if rx.search(bad)]
    assert found == ["torch.load", "pickle", "trust_remote_code=True"]
