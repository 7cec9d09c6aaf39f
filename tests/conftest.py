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


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (./test.sh runs two workers), the e2e and slow tests first: a worker
    that starts a long one last would leave the other idle at the end of the run."""
    if getattr(config.option, "numprocesses", None):
        items.sort(key=lambda item: not any(item.iter_markers(m) for m in ("e2e", "slow")))


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a module's tests (``pytestmark = usefixtures(...)``): tiny
    matmuls in training loops, no OpenMP oversubscription of cores shared with the other worker."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def smollm2_target():
    """The real SmolLM2 target directory (``dflash.train.target_setup.setup_target``), built once
    per machine; the lock keeps two test workers from building it at once."""
    import fcntl

    from dflash.train.target_setup import setup_target, target_dir

    lock_path = target_dir().parent / ".setup.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return setup_target()


@pytest.fixture(scope="session")
def smollm2_stack(smollm2_target, tmp_path_factory):
    """``dflash_app.launcher.LocalStack``: the SmolLM2 target and the committed drafter as
    separate processes (default flags), one per session. Tests that use it carry
    ``pytest.mark.xdist_group("smollm2")`` so that they share one worker, and one stack."""
    from dflash_app.launcher import DrafterSpec, LocalStack, StackConfig
    from dflash_app.stack import DEFAULT_DRAFTER

    from helpers import free_ports

    gw, ver, dr = free_ports(3)
    cfg = StackConfig(target=str(smollm2_target),
                      drafters=[DrafterSpec(path=str(DEFAULT_DRAFTER), port=dr)],
                      gateway_port=gw, verifier_port=ver,
                      run_dir=str(tmp_path_factory.mktemp("smollm2-stack")))
    with LocalStack(cfg) as stack:
        yield stack


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
