"""Real-function training prompts (dflash.train.code_prompts): parsed, never imported."""

from __future__ import annotations

import ast

import pytest

from dflash.train.code_prompts import code_prompts, function_stubs
from dflash.train.prompts import make_prompts

SRC = '''
import os

def public(xs: List[int], k: int = 2) -> Optional[int]:
    """Return the k-th item.

    >>> public([1, 2, 3], 1)
    2
    """
    return xs[k]

def _private(x):
    """Hidden helper with a long enough docstring."""

def undocumented(x):
    return x

def no_args():
    """Takes nothing, so it is not HumanEval-shaped."""

class Box:
    def grow(self, by: float) -> "Box":
        """Grow the box by a factor and return it."""

os.system("echo this file must never run")
'''


@pytest.fixture
def root(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(SRC)
    (tmp_path / "pkg" / "broken.py").write_text("def f(:\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text('def skipped(a):\n    """In a test dir: skipped."""\n')
    return tmp_path


def test_stubs_keep_public_documented_functions_with_arguments(root):
    stubs = function_stubs((root,))
    names = sorted(ast.parse(s).body[-1].name for s in stubs)
    assert names == ["grow", "public"]
    pub = next(s for s in stubs if "def public" in s)
    assert pub.startswith("from typing import List, Optional\n\n\ndef public(xs: List[int], k: int=2) -> Optional[int]:\n")
    assert "    >>> public([1, 2, 3], 1)\n    2\n" in pub and pub.endswith('    """\n')
    assert "return xs[k]" not in pub                      # the body is the target's job
    grow = next(s for s in stubs if "def grow" in s)
    assert grow.startswith("def grow(by: float) -> 'Box':")  # self dropped
    for s in stubs:
        ast.parse(s)                                        # every stub is valid Python


def test_code_prompts_sample_is_seeded_and_bounded(root):
    assert code_prompts(2, seed=1, roots=(root,)) == code_prompts(2, seed=1, roots=(root,))
    with pytest.raises(ValueError, match="num_prompts"):
        code_prompts(3, roots=(root,))


def test_make_prompts_mixes_sources(monkeypatch, root):
    import dflash.train.code_prompts as cp

    monkeypatch.setattr(cp, "source_roots", lambda: [root])
    cp.function_stubs.cache_clear()
    out = make_prompts(8, seed=0, code_fraction=0.25)
    assert len(out) == len(set(out)) == 8
    assert sum("def public" in p or "def grow" in p for p in out) == 2
    assert make_prompts(8, seed=0) == make_prompts(8, seed=0, code_fraction=0.0)
    with pytest.raises(ValueError, match="code_fraction"):
        make_prompts(4, code_fraction=1.5)
    cp.function_stubs.cache_clear()
