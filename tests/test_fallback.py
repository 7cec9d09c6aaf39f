"""A drafter's failure never fails a request: fallback to plain decoding, identical output,
counted, and speculation resumes (with the context resent) when the drafter is back."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from dflash.core.proposer import Proposal
from dflash.serving.server import wait_healthy
from dflash.v1 import verifier_pb2

from doubles import ReferenceDrafter
from helpers import PROMPTS, free_ports, generate_ids, reference, wait_until

B = 8
N_STREAMS = 8
MAX_NEW = 200


def spec(addr):
    return verifier_pb2.SpeculationParams(enabled=True, drafter_address=addr)


def start_oracle(tiny_target, refs_path, port):
    p = subprocess.Popen([sys.executable, str(Path(__file__).parent / "oracle_server.py"),
                          "--target", str(tiny_target), "--refs", str(refs_path), "--port", str(port),
                          "--block-size", str(B)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert wait_healthy(f"127.0.0.1:{port}", 60), "oracle drafter did not start"
    return p


@pytest.mark.slow
def test_kill_drafter_during_8_streams_then_restart(stack, tiny_target, hf_target, tmp_path):
    prompts = [PROMPTS[i % len(PROMPTS)] + [i] for i in range(N_STREAMS)]
    refs = {f"k{i}": p + reference(hf_target, p, MAX_NEW, ignore_eos=True) for i, p in enumerate(prompts)}
    refs.update({f"after{i}": v for i, v in enumerate(refs.values())})
    refs_path = tmp_path / "refs.json"
    refs_path.write_text(json.dumps(refs))
    (port,) = free_ports(1)
    addr = f"127.0.0.1:{port}"
    drafter = start_oracle(tiny_target, refs_path, port)
    v = stack.verifier_stub()
    results: dict[int, tuple] = {}
    errors: list[BaseException] = []
    first_chunk = threading.Barrier(N_STREAMS + 1, timeout=60)

    def stream(i):
        try:
            req = verifier_pb2.VerifierGenerateRequest(
                prompt_token_ids=prompts[i], max_tokens=MAX_NEW, session_id=f"k{i}", ignore_eos=True,
                speculation=spec(addr))
            ids, last, waited = [], None, False
            for chunk in v.Generate(req):
                ids += list(chunk.token_ids)
                last = chunk
                if not waited and last.accepted > 0:
                    waited = True
                    first_chunk.wait()
            results[i] = (ids, last)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(N_STREAMS)]
    for t in threads:
        t.start()
    first_chunk.wait()          # every stream is speculating (has accepted drafts) ...
    drafter.send_signal(signal.SIGKILL)  # ... when the drafter dies
    drafter.wait()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for i in range(N_STREAMS):
        ids, last = results[i]
        assert ids == refs[f"k{i}"][len(prompts[i]):], f"stream {i} differs"
        assert last.finish_reason == 1
        assert last.stats.fallback_steps > 0, f"stream {i} shows no fallback"
        # it did speculate with the drafter before the kill (after it, suffix candidates only)
        assert last.stats.accepted_tokens - last.stats.suffix_accepted_tokens > 0

    # The drafter comes back on the same address: new requests speculate again at full tau.
    drafter = start_oracle(tiny_target, refs_path, port)
    try:
        # The client reconnects after its back-off (0.5 s) once gRPC's channel sees the new
        # process; under load that takes a moment. Probe until a request speculates again.
        def speculated():
            _, probe = generate_ids(v, prompts[0], max_tokens=1 + 2 * B, session_id="after0",
                                    ignore_eos=True, speculation=spec(addr))
            return probe.stats.accepted_tokens > probe.stats.suffix_accepted_tokens

        wait_until(speculated, 30, "speculation to resume after the drafter's restart", interval=0.2)
        for i in range(2):
            n = 1 + 10 * B
            ids, last = generate_ids(v, prompts[i], max_tokens=n, session_id=f"after{i}",
                                     ignore_eos=True, speculation=spec(addr))
            assert ids == refs[f"after{i}"][len(prompts[i]):len(prompts[i]) + n]
            assert last.stats.fallback_steps == 0
            assert last.stats.mean_acceptance_length == pytest.approx(B)
    finally:
        drafter.send_signal(signal.SIGTERM)
        drafter.wait(30)


class _Broken:
    """Answers with a wrong-length block, or an out-of-vocabulary token, every step."""

    def __init__(self, target, mode):
        self.inner = ReferenceDrafter(target, {}, block_size=B)
        self.card = self.inner.card
        self.mode = mode
        self.calls = 0

    def propose(self, requests):
        self.calls += 1
        k = requests[0].block_size - 1
        toks = [1] * (k + 1) if self.mode == "length" else [10 ** 6] * k
        return [Proposal(tokens=torch.tensor(toks))]

    def release(self, ids):
        pass


@pytest.mark.parametrize("mode", ["length", "vocab"])
def test_malformed_block_is_never_trusted(stack, target_model, hf_target, mode):
    bad = _Broken(target_model, mode)
    addr = stack.add_drafter(bad, label=f"broken-{mode}@1")
    p = PROMPTS[0]
    ids, last = generate_ids(stack.verifier_stub(), p, max_tokens=30, speculation=spec(addr))
    assert ids == reference(hf_target, p, 30)
    # nothing of the drafter's is verified: the steps that speculated anyway verified suffix
    # candidates alone (the fallback that keeps speculating)
    assert last.stats.drafts == last.stats.suffix_drafts
    assert last.stats.accepted_tokens == last.stats.suffix_accepted_tokens
    # 29 tokens after the prefill token, one per step plus the accepted suffix candidates; the
    # drafter is called at every step with room for a draft (the last may have none).
    steps = 29 - last.stats.accepted_tokens
    assert last.stats.fallback_steps == bad.calls
    assert steps - 1 <= bad.calls <= steps


def test_unreachable_drafter_does_not_fail_request(stack, hf_target):
    (port,) = free_ports(1)
    p = PROMPTS[1]
    ids, last = generate_ids(stack.verifier_stub(), p, max_tokens=20,
                             speculation=spec(f"127.0.0.1:{port}"))
    assert ids == reference(hf_target, p, 20)
