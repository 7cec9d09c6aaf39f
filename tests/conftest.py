"""Shared fixtures: tiny random-weight target + drafters, and in-process services on loopback
(``stack``: a :class:`helpers.Stack`). Every service runs its real gRPC server (port 0) in this
process; clients use real stubs. Test modules import helpers, never this module."""

from __future__ import annotations

import os

import pytest
import torch

from helpers import Stack

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One thread: the tiny test models gain nothing from more, and oversubscribed OpenMP threads
# (tests beside other jobs on a 2-core machine) spin and slow everything down several-fold.
torch.set_num_threads(int(os.environ.get("DFLASH_TEST_THREADS", "1")))


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    from dflash_app.testing import make_tiny_target

    return make_tiny_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="session")
def target_model(tiny_target):
    from verifier_svc.target import TargetModel

    return TargetModel(tiny_target)


@pytest.fixture(scope="session")
def hf_target(tiny_target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target).eval()


@pytest.fixture(scope="session")
def tokenizer(tiny_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target)


@pytest.fixture(scope="session")
def make_drafter(tiny_target, tmp_path_factory):
    """make_drafter(block_size=8, **kw) -> drafter directory (cached per arguments)."""
    from dflash_app.testing import make_tiny_drafter

    cache = {}

    def make(**kw):
        key = repr(sorted(kw.items()))
        if key not in cache:
            d = tmp_path_factory.mktemp("drafter")
            cache[key] = make_tiny_drafter(d, tiny_target, **kw)
        return cache[key]

    return make


@pytest.fixture
def stack(target_model, tokenizer):
    s = Stack(target_model, tokenizer)
    yield s
    s.close()
