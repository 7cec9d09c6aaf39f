"""End to end, expert parallel on the real model: the exact-MoE form of SmolLM2 (dflash convert-moe)
served by a verifier with --ep-size 2 gives the same greedy text as the dense SmolLM2 target,
through the whole stack (gateway, drafter, verifier processes), speculation on. Marked e2e."""

from __future__ import annotations

import pytest

from dflash_app.cli import DEFAULT_DRAFTER

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

N_PROMPTS = 2
MAX_TOKENS = 32


def _run(target, drafter, ep_size, run_dir):
    from dflash.client import GatewayClient, build_request
    from dflash_app.humaneval import format_prompt, load_problems
    from dflash_app.launcher import DrafterSpec, LocalStack, StackConfig

    from helpers import free_ports

    gw, ver, dr = free_ports(3)
    cfg = StackConfig(target=str(target), drafters=[DrafterSpec(path=str(drafter), port=dr)],
                      gateway_port=gw, verifier_port=ver, run_dir=str(run_dir),
                      verifier_args=["--ep-size", str(ep_size)] if ep_size > 1 else [])
    out = []
    with LocalStack(cfg) as stack:
        client = GatewayClient(stack.gateway_addr)
        for _, prompt in load_problems(N_PROMPTS):
            c = client.complete(build_request(messages=format_prompt(prompt), max_tokens=MAX_TOKENS),
                                timeout=900)
            out.append((c.token_ids, c.text, c.acceptance.drafts))
        client.close()
    return out


def test_moe_ep2_same_greedy_text_as_dense(tmp_path_factory):
    from dflash_app.moe_convert import convert
    from dflash_app.target_setup import setup_target
    from dflash_app.testing import make_tiny_drafter

    dense = setup_target()
    moe = convert(dense, tmp_path_factory.mktemp("smollm2-moe"), num_experts=8)
    drafter = DEFAULT_DRAFTER if (DEFAULT_DRAFTER / "config.json").is_file() else \
        make_tiny_drafter(tmp_path_factory.mktemp("drafter"), dense, block_size=8)
    want = _run(dense, drafter, 1, tmp_path_factory.mktemp("dense-stack"))
    got = _run(moe, drafter, 2, tmp_path_factory.mktemp("moe-ep2-stack"))
    for (w_ids, w_text, _), (g_ids, g_text, drafts) in zip(want, got):
        assert g_ids == w_ids and g_text == w_text
        assert drafts > 0
