"""Nothing in the step path assumes CPU tensors.

1. The whole decode (prefill, drafts, the target's batched forward, verification, commit, taps)
   runs with torch's default device set to ``meta`` on the threads that run it, while the models
   live on the CPU given explicitly. A tensor created without a device would be a meta tensor,
   and the first operation mixing it with the model's tensors (or copying it to the host) fails;
   the output must equal the run without the meta default, token for token. So every tensor of
   the step names its device: the model's, or the host's on purpose.
2. Every host round trip (``.tolist()``, ``.item()``, ``.numpy()``, ``.cpu()``, ``.to("cpu")``) in
   the step-path modules is listed below with why it is there: a host tensor already (the wire,
   a drafter reply), the load, or the step's own synchronisation. A new one fails until it is
   reviewed and listed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from dflash.core.sampling import Sampling
from drafter_svc.engine import DrafterEngine
from verifier_svc.engine import Request, VerifierEngine

ROOT = Path(__file__).resolve().parents[1]


def _on_thread(pool_submit, device):
    pool_submit(lambda: torch.set_default_device(device))


def _decode(engine, drafter, sampling, mode, prompt, n=24):
    req = Request(request_id="r", prompt=prompt, max_tokens=n, ignore_eos=True, proposer=drafter,
                  sampling=sampling, spec_mode=mode)
    tokens, drafted, nodes = [], 0, 0
    for ev in engine.generate(req):
        tokens += ev.tokens
        drafted += ev.drafted
        nodes += ev.tree_nodes
    return tokens, drafted, nodes


@pytest.mark.parametrize("mode,sampling", [
    ("fixed", Sampling()),
    ("fixed", Sampling(temperature=0.9, seed=7)),
    ("tree", Sampling()),
])
def test_the_decode_creates_no_tensor_on_an_implicit_device(target_model, make_drafter,
                                                           tiny_target, mode, sampling):
    drafter = DrafterEngine.from_pretrained(make_drafter(block_size=8), tiny_target,
                                            device="cpu", context_threads=0)
    engine = VerifierEngine(target_model, spec_mode=mode)
    prompt = list(range(20, 37))
    try:
        want = _decode(engine, drafter, sampling, mode, prompt)
        assert want[1] > 0 and (want[2] > 0) == (mode == "tree")   # it did speculate (trees)
        threads = [lambda f: engine.run_on_loop(f),
                   lambda f: drafter._compute.submit(f).result()]
        for run in threads:
            _on_thread(run, "meta")
        try:
            got = _decode(engine, drafter, sampling, mode, prompt)
        finally:
            for run in threads:
                _on_thread(run, None)
        assert got == want
    finally:
        engine.close()
        drafter.close()


def test_the_meta_default_does_catch_an_implicit_device():
    """The detector itself: a tensor made without a device under the meta default cannot meet
    a CPU tensor."""
    torch.set_default_device("meta")
    try:
        implicit = torch.arange(3)
        with pytest.raises((NotImplementedError, RuntimeError)):
            (implicit + torch.ones(3, device="cpu")).tolist()
    finally:
        torch.set_default_device(None)


# --- 2. host round trips, site by site --------------------------------------------------------

STEP_PATH = ["verifier_svc/engine.py", "verifier_svc/prefill.py", "verifier_svc/core.py", "verifier_svc/verification.py", "verifier_svc/tree.py",
             "verifier_svc/target.py", "verifier_svc/graphs.py", "verifier_svc/drafter_sync.py", "verifier_svc/draft_checks.py",
             "verifier_svc/tap_buffer.py", "verifier_svc/commit.py",
             "verifier_svc/proposals.py", "verifier_svc/target_layout.py", "verifier_svc/draft_wire.py",
             "drafter_svc/engine.py", "drafter_svc/forward.py",
             "drafter_svc/drafts.py", "dflash/core/kv_pool.py",
             "dflash/core/wire.py", "dflash/core/sampling.py", "kernels/__init__.py",
             "kernels/reference.py", "dflash/core/logits_processors.py"]
HOST = ("tolist", "item", "numpy", "cpu")
# (file, enclosing function) -> why its round trips are there. On CUDA each is a wait for the
# device unless the tensor is on the host already.
SITES = {
    ("verifier_svc/verification.py", "verify_batch"):
        "the step's synchronisation: accepted lengths and tokens of each group (docs/gpu.md: "
        "one sync per step is one .tolist() of both, concatenated)",
    ("verifier_svc/tree.py", "_usable_tops"):
        "host tensors: the drafter's top-k reply, from the wire",
    ("verifier_svc/target.py", "__init__"): "load time: the embedding's fingerprint",
    ("verifier_svc/engine.py", "decode_step"):
        "host tensors: the drafter's reply, made the block the target forwards (a list)",
    ("drafter_svc/drafts.py", "to_host"): "the drafter's one synchronisation per call",
    ("dflash/core/wire.py", "to_proto"): "the wire: bytes are host memory",
    ("dflash/core/wire.py", "from_proto"): "a dtype's numpy spelling (no tensor data)",
    ("kernels/reference.py", "unpack_features"): "offsets, once per call (docstring)",
    ("dflash/core/logits_processors.py", "token_logprobs"):
        "log-probabilities asked for by the request (sampling.logprobs)",
}


def _host_sites(path: Path) -> list[tuple[str, int, str]]:
    """(enclosing function, line, call) of every host round trip in the file ``path``."""
    if not path.is_file():
        return []
    tree = ast.parse(path.read_text())
    out = []

    def visit(node, func):
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute):
                attr = child.func.attr
                to_cpu = attr == "to" and any(isinstance(a, ast.Constant) and a.value == "cpu"
                                              for a in child.args)
                if attr in HOST or to_cpu:
                    out.append((name, child.lineno, attr))
            visit(child, name)

    visit(tree, "<module>")
    return out


def test_every_host_round_trip_of_the_step_path_is_listed():
    unlisted = [f"{rel}:{line} {func}(): .{call}()" for rel in STEP_PATH
                for func, line, call in _host_sites(ROOT / rel) if (rel, func) not in SITES]
    assert not unlisted, ("host round trips not reviewed (on CUDA each waits for the device): "
                          + "; ".join(unlisted) + ". Keep the tensor on its device, or add the "
                          "site to SITES in tests/test_device_agnostic.py saying why it is there")


def test_the_inventory_sees_each_kind_of_round_trip(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f(x):\n    return x.sum().item() + len(x.cpu().tolist())\n\n\n"
                 "class C:\n    def g(self, x):\n        return x.to('cpu').numpy()\n")
    assert sorted(_host_sites(f)) == [("f", 2, "cpu"), ("f", 2, "item"), ("f", 2, "tolist"),
                                      ("g", 7, "numpy"), ("g", 7, "to")]
