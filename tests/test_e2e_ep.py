"""End to end, expert parallel on the real model: the exact-MoE form of SmolLM2 (dflash convert-moe)
served by a verifier with --ep-size 2 gives the same greedy text as the dense SmolLM2 target,
through the whole stack (gateway, drafter, verifier processes), speculation on. Marked e2e."""

from __future__ import annotations

import pytest

from dflash_app.stack import DEFAULT_DRAFTER

# the dense reference is the session's SmolLM2 stack (conftest.py), shared with
# test_e2e_smollm2.py: the same worker
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.xdist_group("smollm2")]

N_PROMPTS = 2
MAX_TOKENS = 32


def _complete(gateway_addr):
    """(token ids, text, drafts) of the first N_PROMPTS HumanEval prompts, greedy, speculation on."""
    from dflash.client import GatewayClient, build_request
    from dflash.train.eval_sets import format_prompt, load_problems

    out = []
    client = GatewayClient(gateway_addr)
    for _, prompt in load_problems(N_PROMPTS):
        c = client.complete(build_request(messages=format_prompt(prompt), max_tokens=MAX_TOKENS),
                            timeout=900)
        out.append((c.token_ids, c.text, c.acceptance.drafts))
    client.close()
    return out


def test_moe_ep2_same_greedy_text_as_dense(smollm2_target, smollm2_stack, tmp_path_factory):
    from dflash_app.launcher import DrafterSpec, LocalStack, StackConfig
    from dflash_app.moe_convert import convert

    from helpers import free_ports

    moe = convert(smollm2_target, tmp_path_factory.mktemp("smollm2-moe"), num_experts=8)
    want = _complete(smollm2_stack.gateway_addr)   # the dense target, the same drafter
    gw, ver, dr = free_ports(3)
    cfg = StackConfig(target=str(moe), drafters=[DrafterSpec(path=str(DEFAULT_DRAFTER), port=dr)],
                      gateway_port=gw, verifier_port=ver,
                      run_dir=str(tmp_path_factory.mktemp("moe-ep2-stack")),
                      verifier_args=["--ep-size", "2"])
    with LocalStack(cfg) as stack:
        got = _complete(stack.gateway_addr)
    for (w_ids, w_text, _), (g_ids, g_text, drafts) in zip(want, got, strict=True):
        assert g_ids == w_ids and g_text == w_text
        assert drafts > 0
