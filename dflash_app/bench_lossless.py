"""Greedy outputs against speculation off, counted: how many are identical and, where one is
not, the logit gap at its first difference (``dflash bench``; docs/benchmarks.md, "Reading the
identical-to-off counts").

Lossless speculation emits, greedy, the tokens of speculation off. Where a speculative run's
tokens differ, the first difference is where the two runs still share their prefix, so the
target's speculation-off distribution at that position says whether the flip is a tie the two
forwards round differently or a bug: the gap is off's logprob of its own token minus off's
logprob of the token the speculative run emitted there. Both come from one log-softmax, so the
gap equals the difference of the two tokens' raw logits. The distribution is taken from a
probe: one more off request for the prompt, with logprobs, up to the last position needed (so
the timed off run itself carries no logprob work).

Verdicts: ``tie`` (gap exactly 0.0), ``near-tie (gap g)`` (0 < g <= the near-tie bound),
``DIFFERS: gap g`` (beyond it: a bug). A spec token outside off's top alternatives gives a
lower bound, ``DIFFERS: gap > g``. A run that stopped where the other went on is
``unmeasured``: a stop token is not returned, nor its logprob.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

#: The largest logit gap a near-tie may have. One bf16 ulp is 0.0625 for logits in [8, 16) and
#: 0.125 in [16, 32); tests/test_bf16_cpu.py bounds a bf16 block-vs-decode logit difference by
#: the same 0.125. Float32 rounding is about 1e-5: any gap near the bound there is worth a look.
NEAR_TIE_GAP = 0.125
#: Alternatives the probe asks for (the verifier's and OpenAI's largest ``top_logprobs``).
PROBE_TOP = 20

TIE, NEAR_TIE, DIFFERS, UNMEASURED = "tie", "near-tie", "differs", "unmeasured"


class TokenLogprob(Protocol):
    """``dflash.v1.TokenLogprob`` as the probe returns it (one emitted token)."""

    token_id: int
    logprob: float
    top_ids: Sequence[int]
    top_logprobs: Sequence[float]


#: probe(task_id, n) -> (token ids, one TokenLogprob per token) of speculation off for the
#: prompt ``task_id``, greedy, at most ``n`` tokens.
Probe = Callable[[str, int], tuple[list[int], Sequence[TokenLogprob]]]


def first_difference(got: Sequence[int], want: Sequence[int]) -> int | None:
    """The first position where ``got`` and ``want`` differ (the shorter one's length when
    one is a prefix of the other), or None when they are equal."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def logit_gap(lp: TokenLogprob, token: int) -> tuple[float, bool]:
    """Off's logprob of its own token minus its logprob of ``token`` at one position (nats,
    = the two tokens' logit difference) -> (gap, exact). ``exact`` is False when ``token`` is
    not among the probe's top alternatives: the gap is then a lower bound (own logprob minus
    the smallest alternative's)."""
    for tid, v in zip(lp.top_ids, lp.top_logprobs):
        if tid == token:
            return lp.logprob - v, True
    return lp.logprob - min(lp.top_logprobs, default=lp.logprob), False


def verdict(gap: float, exact: bool, near_tie: float = NEAR_TIE_GAP) -> tuple[str, str]:
    """(kind, the words a report shows) for a first difference's gap: tie, near-tie or
    differs (see the module docstring)."""
    if exact and gap == 0.0:
        return TIE, "tie"
    if exact and abs(gap) <= near_tie:
        return NEAR_TIE, f"near-tie (gap {gap:.4g})"
    return DIFFERS, f"DIFFERS: gap {'' if exact else '> '}{gap:.4g}"


def compare(rows: Mapping[str, list[dict]], off: str, probe: Probe | None, *,
            near_tie: float = NEAR_TIE_GAP) -> dict[str, dict]:
    """Every mode of ``rows`` (mode -> rows with ``task_id`` and ``token_ids``) against mode
    ``off``, prompt by prompt.

    Returns mode -> ``{"identical": n, "total": m, "ties": .., "near_ties": .., "differs": ..,
    "unmeasured": .., "differences": [...]}``, one difference per prompt whose tokens differ:
    ``task_id``, ``position`` (0-based, into the completion), ``off_token`` and ``spec_token``
    (None where that run had stopped), ``gap`` (None if unmeasured), ``exact``, ``kind`` and
    ``verdict``. ``probe`` is called at most once per prompt (None: no gaps, every difference
    unmeasured). Raises KeyError if a mode has a prompt that ``off`` lacks.
    """
    want = {r["task_id"]: r["token_ids"] for r in rows[off]}
    firsts: dict[str, list[tuple[dict, int]]] = {}
    need: dict[str, int] = {}
    for mode, rs in rows.items():
        if mode == off:
            continue
        firsts[mode] = []
        for r in rs:
            pos = first_difference(r["token_ids"], want[r["task_id"]])
            if pos is not None:
                firsts[mode].append((r, pos))
                if pos < min(len(r["token_ids"]), len(want[r["task_id"]])):
                    need[r["task_id"]] = max(need.get(r["task_id"], 0), pos + 1)
    probed = {t: probe(t, n) for t, n in need.items()} if probe else {}
    out = {}
    for mode, diffs in firsts.items():
        entries = [_difference(r, pos, want[r["task_id"]], probed.get(r["task_id"]), near_tie)
                   for r, pos in diffs]
        kinds = [e["kind"] for e in entries]
        out[mode] = {"identical": len(rows[mode]) - len(entries), "total": len(rows[mode]),
                     "ties": kinds.count(TIE), "near_ties": kinds.count(NEAR_TIE),
                     "differs": kinds.count(DIFFERS), "unmeasured": kinds.count(UNMEASURED),
                     "differences": entries}
    return out


def _difference(row: dict, pos: int, want: Sequence[int], probed, near_tie: float) -> dict:
    got = row["token_ids"]
    e: dict = {"task_id": row["task_id"], "position": pos,
               "off_token": want[pos] if pos < len(want) else None,
               "spec_token": got[pos] if pos < len(got) else None,
               "gap": None, "exact": False}
    if e["off_token"] is None or e["spec_token"] is None:
        who = "off" if e["off_token"] is None else "the speculative run"
        return {**e, "kind": UNMEASURED,
                "verdict": f"unmeasured: {who} stopped here (a stop token has no logprob)"}
    if probed is None:
        return {**e, "kind": UNMEASURED, "verdict": "unmeasured: no probe"}
    ids, lps = probed
    if list(ids[:pos + 1]) != list(want[:pos + 1]) or len(lps) <= pos:
        at = first_difference(ids[:pos + 1], want[:pos + 1])
        return {**e, "kind": UNMEASURED,
                "verdict": f"unmeasured: off not reproduced (its probe differs at {at})"}
    gap, exact = logit_gap(lps[pos], e["spec_token"])
    kind, words = verdict(gap, exact, near_tie)
    return {**e, "gap": gap, "exact": exact, "kind": kind, "verdict": words}


def summary_line(counts: Mapping[str, dict]) -> str:
    """One line: each mode's identical count and, where some differ, how they split."""
    parts = []
    for mode, c in counts.items():
        s = f"{mode} {c['identical']}/{c['total']}"
        split = [f"{c[k]} {w}" for k, w in (("ties", "tie"), ("near_ties", "near-tie"),
                                              ("differs", "DIFFERS"), ("unmeasured", "unmeasured"))
                 if c[k]]
        parts.append(s + (f" ({', '.join(split)})" if split else ""))
    return ", ".join(parts)


def difference_lines(counts: Mapping[str, dict]) -> list[str]:
    """One markdown bullet per differing prompt: mode, prompt, position, both tokens, verdict."""
    return [f"- {mode} {d['task_id']}: first difference at token {d['position']}: off "
            f"{d['off_token']}, speculation {d['spec_token']}: {d['verdict']}"
            for mode, c in counts.items() for d in c["differences"]]
