"""`dflash bench`'s identical-to-off counts and the logit gap at a first difference
(dflash_app.bench_lossless, dflash_app.bench): units on made-up logprobs, then through an
in-process stack, each gap checked against the target's own logits."""

from __future__ import annotations

import types

import pytest
import torch

from dflash_app import bench, bench_lossless
from dflash_app.bench_lossless import compare, first_difference, logit_gap, verdict

PROMPTS = {"p0": [{"role": "user", "content": "def add(a, b):"}],
           "p1": [{"role": "user", "content": "Tell me about trains."}]}
MAX_TOKENS = 8


def lp(token, logprob, top):
    """A TokenLogprob stand-in: ``top`` = [(id, logprob), ...], most likely first."""
    return types.SimpleNamespace(token_id=token, logprob=logprob, top_ids=[t for t, _ in top],
                                 top_logprobs=[v for _, v in top])


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 9, 3], [1, 2, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2 and first_difference([1, 2, 3], [1, 2]) == 2
    assert first_difference([], []) is None


def test_gap_and_verdict():
    x = lp(5, -0.5, [(5, -0.5), (7, -0.5), (9, -0.55), (3, -4.0)])
    assert logit_gap(x, 7) == (0.0, True)
    assert logit_gap(x, 9) == (pytest.approx(0.05), True)
    assert logit_gap(x, 3) == (pytest.approx(3.5), True)
    assert logit_gap(x, 42) == (pytest.approx(3.5), False)      # not in the top: a lower bound
    assert verdict(0.0, True) == ("tie", "tie")
    assert verdict(0.05, True) == ("near-tie", "near-tie (gap 0.05)")
    assert verdict(0.125, True)[0] == "near-tie" and verdict(0.126, True)[0] == "differs"
    assert verdict(3.5, True) == ("differs", "DIFFERS: gap 3.5")
    assert verdict(0.05, False) == ("differs", "DIFFERS: gap > 0.05")
    assert verdict(0.5, True, near_tie=1.0)[0] == "near-tie"


def test_compare_probes_once_per_differing_prompt_and_never_when_identical():
    off = {"a": [1, 2, 3, 4], "b": [5, 6, 7], "c": [8, 9]}
    calls = []

    def probe(task_id, n):
        calls.append((task_id, n))
        ids = off[task_id][:n]
        return ids, [lp(t, -0.1, [(t, -0.1), (t + 100, -0.1), (t + 200, -2.1)]) for t in ids]

    rows = {"off": [{"task_id": t, "token_ids": ids} for t, ids in off.items()],
            "x": [{"task_id": "a", "token_ids": [1, 2, 3, 4]}, {"task_id": "b", "token_ids": [5, 6, 7]},
                  {"task_id": "c", "token_ids": [8, 9]}]}
    got = compare(rows, "off", probe)
    assert got["x"]["identical"] == 3 and got["x"]["total"] == 3 and not got["x"]["differences"]
    assert calls == []
    rows["x"] = [{"task_id": "a", "token_ids": [1, 102, 3, 4]},      # exact tie at position 1
                 {"task_id": "b", "token_ids": [5, 6, 207]},          # gap 2.0 at position 2
                 {"task_id": "c", "token_ids": [8]}]                  # stopped early: no logprob
    rows["y"] = [{"task_id": "a", "token_ids": [1, 2, 3, 104]}, *rows["off"][1:]]
    got = compare(rows, "off", probe)
    assert sorted(calls) == [("a", 4), ("b", 3)]                      # a: x needs 2, y needs 4
    x = got["x"]
    assert (x["identical"], x["ties"], x["near_ties"], x["differs"], x["unmeasured"]) == (0, 1, 0, 1, 1)
    a, b, c = x["differences"]
    assert (a["position"], a["off_token"], a["spec_token"], a["gap"], a["verdict"]) == (1, 2, 102, 0.0, "tie")
    assert (b["position"], b["spec_token"], b["kind"]) == (2, 207, "differs")
    assert b["gap"] == pytest.approx(2.0) and b["verdict"] == "DIFFERS: gap 2"
    assert (c["position"], c["off_token"], c["spec_token"], c["gap"], c["kind"]) == (1, 9, None, None, "unmeasured")
    assert got["y"]["identical"] == 2 and got["y"]["differences"][0]["position"] == 3
    line = bench_lossless.summary_line(got)
    assert line == "x 0/3 (1 tie, 1 DIFFERS, 1 unmeasured), y 2/3 (1 tie)"
    assert "- x b: first difference at token 2: off 7, speculation 207: DIFFERS: gap 2" in \
        bench_lossless.difference_lines(got)


def test_a_probe_that_does_not_reproduce_off_is_unmeasured():
    rows = {"off": [{"task_id": "a", "token_ids": [1, 2, 3]}],
            "x": [{"task_id": "a", "token_ids": [1, 2, 9]}]}
    probe = lambda t, n: ([1, 4, 3], [lp(i, 0.0, [(i, 0.0)]) for i in (1, 4, 3)])  # noqa: E731
    d = compare(rows, "off", probe)["x"]["differences"][0]
    assert d["kind"] == "unmeasured" and d["verdict"] == "unmeasured: off not reproduced (its probe differs at 1)"


@pytest.fixture
def spec_stack(stack, make_drafter, tiny_target):
    from drafter_svc.engine import DrafterEngine

    stack.add_drafter(DrafterEngine.from_pretrained(make_drafter(block_size=4), tiny_target), default=True)
    return stack


def _rows(stack):
    from dflash.client import GatewayClient

    client = GatewayClient(stack.gateway_addr)
    try:
        return {m: [bench.gateway_row(client, t, msgs, max_tokens=MAX_TOKENS, speculation=m != "off")
                    for t, msgs in PROMPTS.items()] for m in ("spec", "off")}
    finally:
        client.close()


def _target_logits(hf_target, tokenizer, messages, answer):
    """The target's raw logits float32 [len(answer), V] at each answer position, teacher-forced
    in one forward of prompt + answer."""
    from dflash.train.eval_sets import encode_messages

    ids = encode_messages(tokenizer, messages)
    with torch.inference_mode():
        out = hf_target(torch.tensor([ids + answer])).logits[0].float()
    return out[len(ids) - 1:len(ids) - 1 + len(answer)]


def _results(rows, same):
    return {"config": {"near_tie_gap": bench_lossless.NEAR_TIE_GAP}, "rows": rows,
            "aggregate": {m: bench.aggregate(r) for m, r in rows.items()}, "identical_to_off": same}


def test_identical_outputs_report_n_of_n(spec_stack):
    rows = _rows(spec_stack)
    assert all(r["drafts"] > 0 for r in rows["spec"])           # speculation ran
    same = bench.compare_to_off(rows, spec_stack.gateway_addr, PROMPTS)
    assert same == {"spec": {"identical": 2, "total": 2, "ties": 0, "near_ties": 0, "differs": 0,
                             "unmeasured": 0, "differences": []}}
    md = bench.markdown(_results(rows, same))
    assert "| 2/2 |" in md and "greedy outputs identical to speculation-off: spec 2/2 (" in md


def test_a_forced_difference_reports_its_position_and_the_targets_gap(spec_stack, hf_target, tokenizer):
    """The speculative output doctored at one position to another token: the report names the
    position, both tokens, and the gap from off's logprobs, which equals the target's own top
    logit minus that token's logit at that prefix (float32: equal to well within 1e-3)."""
    rows = _rows(spec_stack)
    off = rows["off"][0]["token_ids"]
    logits = _target_logits(hf_target, tokenizer, PROMPTS["p0"], off)
    assert logits.argmax(-1).tolist() == off                    # the direct computation is off's
    pos = 2
    order = logits[pos].argsort(descending=True).tolist()
    gaps = {t: float(logits[pos, order[0]] - logits[pos, t]) for t in order}
    alt = next(t for t in order[1:bench_lossless.PROBE_TOP] if gaps[t] > 0.5)   # clearly a bug
    far = order[-1]                                             # outside the probe's top 20
    rows["spec"][0]["token_ids"] = off[:pos] + [alt] + off[pos + 1:]
    same = bench.compare_to_off(rows, spec_stack.gateway_addr, PROMPTS)["spec"]
    assert (same["identical"], same["total"], same["differs"]) == (1, 2, 1)
    (d,) = same["differences"]
    assert (d["task_id"], d["position"], d["off_token"], d["spec_token"]) == ("p0", pos, off[pos], alt)
    assert d["exact"] and d["gap"] == pytest.approx(gaps[alt], abs=1e-3)
    assert d["verdict"] == f"DIFFERS: gap {d['gap']:.4g}"
    # the same flip under a wider near-tie bound: called a near-tie, with its gap
    wide = bench.compare_to_off(rows, spec_stack.gateway_addr, PROMPTS, near_tie=gaps[alt] + 0.01)
    assert wide["spec"]["differences"][0]["kind"] == "near-tie"
    md = bench.markdown(_results(rows, {"spec": same}))
    assert "| 1/2 |" in md and "spec 1/2 (1 DIFFERS)" in md
    assert f"- spec p0: first difference at token {pos}: off {off[pos]}, speculation {alt}: DIFFERS: gap" in md
    # a token beyond the probe's alternatives: a lower bound, never above the true gap
    rows["spec"][0]["token_ids"] = off[:pos] + [far] + off[pos + 1:]
    (d,) = bench.compare_to_off(rows, spec_stack.gateway_addr, PROMPTS)["spec"]["differences"]
    assert not d["exact"] and d["verdict"].startswith("DIFFERS: gap > ")
    assert gaps[order[bench_lossless.PROBE_TOP - 1]] - 1e-3 <= d["gap"] <= gaps[far] + 1e-3
