"""The online-learning bench's stdlib domain (scripts/bench_learn.py): fresh prompts name only
modules the served prompts never do, so a gain on them is not a memorised answer."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench_learn():
    spec = importlib.util.spec_from_file_location("bench_learn", ROOT / "scripts" / "bench_learn.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _named(prompts) -> list[str]:
    return [re.search(r"`([^`]+)`", p[0]["content"]).group(1) for p in prompts]


def test_fresh_modules_are_never_served(bench_learn):
    served, fresh = bench_learn.stdlib_prompts(400, 40)
    assert len(served) == 400 and len(fresh) == 40
    s_names, f_names = _named(served), _named(fresh)
    assert len(set(s_names)) == 400 and len(set(f_names)) == 40     # no question repeats
    # a callable's module is its name less the last part ("os.path.join()" -> "os.path")
    s_mods = {n.rsplit(".", 1)[0] for n in s_names}
    f_mods = {n.rsplit(".", 1)[0] for n in f_names}
    assert s_mods and f_mods and not s_mods & f_mods
    assert s_mods | f_mods <= set(bench_learn.STDLIB_MODULES)


def test_prompts_are_deterministic_and_prefix_free_of_private_names(bench_learn):
    a = bench_learn.stdlib_prompts(50, 10, seed=3)
    assert a == bench_learn.stdlib_prompts(50, 10, seed=3)
    assert a != bench_learn.stdlib_prompts(50, 10, seed=4)
    assert not any(n.rsplit(".", 1)[1].startswith("_") for n in _named(a[0] + a[1]))


def test_too_many_fresh_prompts_names_the_flag(bench_learn):
    with pytest.raises(ValueError, match="--fresh"):
        bench_learn.stdlib_prompts(10, 100_000)
