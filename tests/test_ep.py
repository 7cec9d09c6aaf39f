"""Expert parallel (EP) on the sparse tiny MoE, gloo, 2 ranks on CPU: DistributedTarget's logits
equal one rank's; a real verifier process started with ``--ep-size 2`` gives greedy output with
speculation token-identical to one rank; a dead rank makes requests fail fast with UNAVAILABLE."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2

from dflash.serving.server import wait_healthy
from dflash.v1 import verifier_pb2, verifier_pb2_grpc

from helpers import free_ports, generate_ids, health, wait_until

PROMPTS = [[72, 101, 108, 108, 111], [3, 250, 17, 99, 42, 8, 199, 64, 10, 11, 12],
           [200, 201, 7, 7, 7, 31, 90, 114, 115, 116, 117, 118, 5, 6, 240, 241, 30, 33]]
MAX_NEW = 32
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def moe_target(tmp_path_factory):
    from dflash_app.testing import make_tiny_moe_target

    return make_tiny_moe_target(tmp_path_factory.mktemp("moe"))


@pytest.fixture(scope="module")
def moe_hf(moe_target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(moe_target).eval()


# ---------------------------------------------------------------- EP=2 target, logits
@pytest.mark.slow
def test_ep2_logits_match_one_rank(moe_target):
    """DistributedTarget (2 ranks) vs TargetModel: prefill, steps with crops, batched forward."""
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "ep_check.py"), str(moe_target)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["max_logit_diff"] < 1e-5, res
    assert res["max_tap_diff"] < 1e-5, res
    assert res["same_argmax"], res
    assert res["worker_exit_codes"] == [0], res
    (args,) = res["worker_args"]                   # every rank gets the verifier's skinny limit
    assert args[args.index("--skinny-max-rows") + 1] == "8" and res["rank0_skinny_rows"] == [8]


# ---------------------------------------------------------------- the real verifier process
class Verifier:
    """``python -m verifier_svc --ep-size N`` as a subprocess."""

    def __init__(self, target, log_path: Path, ep_size: int = 2):
        (self.port,) = free_ports(1)
        self.addr = f"127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {**os.environ, "PYTHONPATH": str(ROOT), "DFLASH_SPEC_LOG_INTERVAL_S": "0"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "verifier_svc", "--target", str(target), "--bind", self.addr,
             "--ep-size", str(ep_size), "--threads", "1", "--grace", "2", "--ep-timeout", "30"],
            stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        deadline = time.monotonic() + 240
        while not wait_healthy(self.addr, 1.0):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"verifier --ep-size {ep_size} did not come up:\n{self.log()}")
        self.channel = grpc.insecure_channel(self.addr)
        self.stub = verifier_pb2_grpc.VerifierStub(self.channel)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def workers(self) -> list[int]:
        kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        return [int(k) for k in kids]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def ep_verifier(moe_target, tmp_path_factory):
    v = Verifier(moe_target, tmp_path_factory.mktemp("ep") / "verifier.log")
    yield v
    v.channel.close()
    code = v.stop()
    assert code == 0, v.log()


@pytest.fixture(scope="module")
def moe_drafter_addr(moe_target, tmp_path_factory):
    from dflash_app.testing import make_tiny_drafter
    from drafter_svc.engine import DrafterEngine
    from drafter_svc.server import build

    d = make_tiny_drafter(tmp_path_factory.mktemp("moe-drafter"), moe_target, block_size=8)
    rt = build(DrafterEngine.from_pretrained(d, moe_target), "127.0.0.1:0")
    rt.server.start()
    rt.set_serving(True)
    yield f"127.0.0.1:{rt.port}"
    rt.server.stop(0)


@pytest.mark.slow
def test_ep2_verifier_greedy_identical_to_one_rank(ep_verifier, moe_drafter_addr, moe_hf):
    # registered as the gateway does: the verifier speculates only with checked drafters
    ep_verifier.stub.CheckDrafter(verifier_pb2.CheckDrafterRequest(address=moe_drafter_addr))
    spec = verifier_pb2.SpeculationParams(enabled=True, drafter_address=moe_drafter_addr)
    drafts = 0
    for prompt in PROMPTS:
        want = moe_hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False,
                               eos_token_id=moe_hf.config.vocab_size + 1)[0, len(prompt):].tolist()
        got, last = generate_ids(ep_verifier.stub, prompt, max_tokens=MAX_NEW, ignore_eos=True,
                                 speculation=spec)
        assert got == want, f"EP=2 with speculation diverged from one rank on {prompt}"
        drafts += last.stats.drafts
        off, _ = generate_ids(ep_verifier.stub, prompt, max_tokens=MAX_NEW, ignore_eos=True)
        assert off == want
    assert drafts > 0
    # a multi-turn session: the workers mirror the cached prefix (crop + reuse)
    p = PROMPTS[1]
    first, _ = generate_ids(ep_verifier.stub, p, max_tokens=8, session_id="s1", ignore_eos=True,
                            speculation=spec)
    again, last = generate_ids(ep_verifier.stub, p + first + [10, 11], max_tokens=8, session_id="s1",
                               ignore_eos=True, speculation=spec)
    assert last.cached_prompt_tokens > 0
    want = moe_hf.generate(torch.tensor([p + first + [10, 11]]), max_new_tokens=8, do_sample=False,
                           eos_token_id=moe_hf.config.vocab_size + 1)[0, len(p + first) + 2:].tolist()
    assert again == want


@pytest.mark.slow
def test_rank_death_fails_fast_with_unavailable(moe_target, tmp_path):
    v = Verifier(moe_target, tmp_path / "verifier.log")
    try:
        (worker,) = v.workers()
        errors, chunks = [], []

        def long_request():
            req = verifier_pb2.VerifierGenerateRequest(prompt_token_ids=PROMPTS[0], max_tokens=1000,
                                                       ignore_eos=True)
            try:
                for chunk in v.stub.Generate(req, timeout=120):
                    chunks.append(chunk)
            except grpc.RpcError as e:
                errors.append((e.code(), time.monotonic()))

        t = threading.Thread(target=long_request)
        t.start()
        wait_until(lambda: len(chunks) >= 3, 60, v.log)   # well into its decode steps
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        t.join(30)
        assert not t.is_alive(), "in-flight request hung after a rank died"
        assert errors and errors[0][0] == grpc.StatusCode.UNAVAILABLE, (errors, v.log())
        print(f"UNAVAILABLE {errors[0][1] - killed:.2f}s after SIGKILL of rank 1")
        assert errors[0][1] - killed < 10.0
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            generate_ids(v.stub, PROMPTS[1], max_tokens=4)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "rank 1" in e.value.details() or "failed" in e.value.details()
        assert time.monotonic() - t0 < 5.0
        assert health(v.addr, "dflash.v1.Verifier") == health_pb2.HealthCheckResponse.NOT_SERVING
        assert v.proc.poll() is None  # rank 0 stays up, NOT_SERVING, for the orchestrator
        assert "expert-parallel target failed" in v.log()
    finally:
        v.channel.close()
        code = v.stop()
    assert code == 0, v.log()
