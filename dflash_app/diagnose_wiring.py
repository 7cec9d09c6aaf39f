"""Silent mis-wirings, each measured: the drafter under its saved config against the same weights
under each alternative a mis-wired checkpoint would need, on the same anchors.

Settings tried (each a config.json edit away from the saved one):

* ``target_layer_ids`` shifted by -2..+2 (every id; shifts leaving the target's range are
  skipped; +-2 on every 2nd anchor), and two controls that are no fix, on every 4th anchor:
  every tap at the last layer, taps reversed. A drafter that reads its taps does much worse
  under both; one that does not is untrained or its features never reach it;
* ``mask_token_id``: the target's special tokens and unused embedding rows, one id per
  distinct embedding row (equal rows are the same input), on every 4th anchor;
* rope: the target's ``rope_theta`` / scaling, when the drafter's differ;
* sliding-window layers: the layer types the config lists but the loader ignores
  (``use_sliding_window: false``), every layer full attention when some slide, the target's
  window on every layer when the target slides and the drafter does not.

A setting is a fix when the drafter fits the target's tokens better under it: the mean paired
difference of the per-anchor cross-entropy (``dflash_app.diagnose_tf``) is below ``-MIN_GAIN``
nats, the paired sign test over anchors or the paired mean (``dflash_app.diagnose_stats``) is
significant at ``ALPHA`` after a Bonferroni correction over both tests and over the settings of
its kind (one question per kind: which taps, which mask token, ...), and the drafter really drafts under it (first-position accuracy
at least ``MIN_P1``). The best fix of each kind found on a subset is scored again on every
anchor. Its tau gain is reported beside it with its own interval: on a small target a layer
off by one may cost little acceptance while the fit says plainly which taps the drafter was
trained on.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import torch

from dflash.core.config import DrafterConfig
from dflash_app.diagnose_stats import Paired, paired
from dflash_app.diagnose_tf import Head, ProbeSeq, Scores, counter, drafter_for, score, walk
from dflash_app.drafter_check import raw_sliding, target_window

ALPHA = 0.01          # error rate of a fix named, per kind of setting (Bonferroni within)
MIN_GAIN = 0.02       # nats per draft position: a smaller fit gain is not worth an edit
MIN_P1 = 0.1          # a "fix" under which the drafter still drafts nothing is no fix
# Settings expected to differ a lot are screened on a subset of the anchors (a fix found there
# is scored again on all of them): ids 2 off, the controls, other mask tokens.
FAR_STRIDE = 2
MASK_STRIDE = CONTROL_STRIDE = 4
MAX_MASK_CANDIDATES = 12


@dataclasses.dataclass(frozen=True)
class Setting:
    """One way to run the drafter's weights."""

    name: str                      # "saved", "shift -1", "control: taps reversed", ...
    kind: str                      # saved | shift | control | mask | rope | sliding
    cfg: DrafterConfig
    edit: dict                     # config.json key (dotted path) -> value; {} = none
    shift: int = 0
    stride: int = 1

    @property
    def is_fix(self) -> bool:
        return self.kind not in ("saved", "control")

    def edit_text(self) -> str:
        return "; ".join(f"set {k} to {json.dumps(v)}" for k, v in self.edit.items())


@dataclasses.dataclass
class Outcome:
    """A setting's scores and its paired comparison with the saved config."""

    setting: Setting
    scores: Scores
    ce: Paired | None = None           # setting - saved, nats per draft position
    ce_sign: Paired | None = None      # share of anchors with lower minus higher cross-entropy
    accepted: Paired | None = None     # setting - saved, accepted drafts per anchor
    tau: float | None = None           # greedy decode walk at block B (stride 1 only)
    significant: bool = False
    screened: "Outcome | None" = None  # the same setting on a subset of anchors, if it was

    def as_dict(self) -> dict:
        s = self.setting
        return {"name": s.name, "kind": s.kind, "edit": s.edit, "shift": s.shift, "stride": s.stride,
                "target_layer_ids": list(s.cfg.target_layer_ids),
                "mask_token_id": s.cfg.mask_token_id, "anchors": int(self.scores.prompt.numel()),
                "cross_entropy": round(self.scores.mean_ce(), 4),
                "position_accuracy": self.scores.position_accuracy(),
                "tau": None if self.tau is None else round(self.tau, 3),
                "vs_saved_cross_entropy": self.ce.as_dict() if self.ce else None,
                "vs_saved_sign": self.ce_sign.as_dict() if self.ce_sign else None,
                "vs_saved_accepted": self.accepted.as_dict() if self.accepted else None,
                "significant": self.significant}


def mask_candidates(tokenizer, embed: torch.Tensor, configured: int,
                    limit: int = MAX_MASK_CANDIDATES) -> list[int]:
    """Ids a mask token could be: the tokenizer's special tokens, then the embedding rows past
    its vocabulary, keeping one id per distinct embedding row and none equal to the configured
    id's row (equal rows give the drafter the same input)."""
    ids = sorted({i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
                 | set(tokenizer.all_special_ids))
    ids += list(range(len(tokenizer), embed.shape[0]))
    kept: list[int] = []
    rows = [embed[configured]]
    for i in ids:
        if i == configured or not 0 <= i < embed.shape[0]:
            continue
        if any(_same_row(embed[i], r) for r in rows):
            continue
        kept.append(i)
        rows.append(embed[i])
        if len(kept) >= limit:
            break
    return kept


def _same_row(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Rows equal up to rounding (bf16-trained rows of never-seen tokens differ in the 3rd
    significant digit and give the same drafts)."""
    na, nb = float(a.norm()), float(b.norm())
    if na == 0.0 or nb == 0.0:
        return na == nb
    return abs(na - nb) <= 0.01 * max(na, nb) and float(a @ b) / (na * nb) > 0.9999


def _rope_of(t: dict) -> tuple[float, dict | None]:
    rp = t.get("rope_parameters") or {}
    theta = float(rp.get("rope_theta", t.get("rope_theta", 10000.0)))
    scaling = t.get("rope_scaling") or ({k: v for k, v in rp.items() if k != "rope_theta"}
                                        if rp.get("rope_type", "default") != "default" else None)
    return theta, scaling or None


def settings(cfg: DrafterConfig, drafter_dir, target_cfg: dict, masks: Sequence[int]) -> list[Setting]:
    """Every setting to try for a drafter with config ``cfg`` on a target with ``target_cfg``
    (its config.json, ``text_config`` resolved); ``masks``: :func:`mask_candidates`."""
    n_layers = target_cfg["num_hidden_layers"]
    ids = tuple(cfg.target_layer_ids)
    out = [Setting("saved", "saved", cfg, {})]
    seen = {ids}
    for d in (-1, 1, -2, 2):
        shifted = tuple(i + d for i in ids)
        if all(0 <= i < n_layers for i in shifted) and shifted not in seen:
            seen.add(shifted)
            out.append(Setting(f"shift {d:+d}", "shift",
                               dataclasses.replace(cfg, target_layer_ids=shifted),
                               {"dflash_config.target_layer_ids": list(shifted)}, shift=d,
                               stride=1 if abs(d) == 1 else FAR_STRIDE))
    for name, taps in (("control: every tap at the last layer", (n_layers - 1,) * len(ids)),
                       ("control: taps reversed", ids[::-1])):
        if taps not in seen:
            seen.add(taps)
            out.append(Setting(name, "control", dataclasses.replace(cfg, target_layer_ids=taps), {},
                               stride=CONTROL_STRIDE))
    for m in masks:
        out.append(Setting(f"mask_token_id {m}", "mask", dataclasses.replace(cfg, mask_token_id=m),
                           {"dflash_config.mask_token_id": m}, stride=MASK_STRIDE))
    theta, scaling = _rope_of(target_cfg)
    if abs(theta - cfg.rope_theta) > 1e-6 * theta or (scaling or None) != (cfg.rope_scaling or None):
        edit = {"rope_theta": theta} | ({"rope_scaling": scaling}
                                         if (scaling or None) != (cfg.rope_scaling or None) else {})
        out.append(Setting("the target's rope", "rope",
                           dataclasses.replace(cfg, rope_theta=theta, rope_scaling=scaling), edit))
    out += _sliding_settings(cfg, drafter_dir, target_cfg)
    return out


def _sliding_settings(cfg: DrafterConfig, drafter_dir, target_cfg: dict) -> list[Setting]:
    types, window, use = raw_sliding(drafter_dir)
    n = cfg.num_hidden_layers
    out = []
    if "sliding_attention" in types and not use and window:
        out.append(Setting("sliding layers as listed", "sliding",
                           dataclasses.replace(cfg, layer_types=tuple(types), sliding_window=window),
                           {"use_sliding_window": True}))
    if "sliding_attention" in cfg.layer_types:
        full = ("full_attention",) * n
        out.append(Setting("every layer full attention", "sliding",
                           dataclasses.replace(cfg, layer_types=full, sliding_window=None),
                           {"layer_types": list(full), "use_sliding_window": False}))
    tw = target_window(target_cfg)
    if tw and "sliding_attention" not in cfg.layer_types and not out and tw >= cfg.block_size:
        slide = ("sliding_attention",) * n
        out.append(Setting(f"the target's window {tw} on every layer", "sliding",
                           dataclasses.replace(cfg, layer_types=slide, sliding_window=tw),
                           {"layer_types": list(slide), "sliding_window": tw,
                            "use_sliding_window": True}))
    return out


def _aligned(base: Scores, other: Scores, values: torch.Tensor) -> torch.Tensor:
    """``values`` (per row of ``base``) at the rows of ``other`` (a subset of base's anchors)."""
    at = {(int(p), int(a)): i for i, (p, a) in enumerate(zip(base.prompt, base.anchor))}
    return values[torch.tensor([at[(int(p), int(a))] for p, a in zip(other.prompt, other.anchor)],
                               dtype=torch.int64)]


def run_settings(base_drafter, target_head, head: Head, seqs: Sequence[ProbeSeq],
                 sets: Sequence[Setting], *, seed: int = 0) -> list[Outcome]:
    """Score every setting and compare each with the saved one (the first); a fix found on a
    subset of the anchors is scored again on all of them (its tau, the final test)."""
    outcomes = [_outcome(base_drafter, target_head, head, seqs, s) for s in sets]
    saved = outcomes[0]
    for o in outcomes[1:]:
        _compare(o, saved, seed)
    family: dict[str, int] = {}                     # kind -> settings of that kind tried
    for o in outcomes:
        if o.setting.is_fix:
            family[o.setting.kind] = family.get(o.setting.kind, 0) + 1
    for o in outcomes:
        o.significant = o.setting.kind in family and _significant(o, family[o.setting.kind])
    for best in best_fixes(outcomes):               # its tau and final test on every anchor
        if best.setting.stride > 1:
            i = outcomes.index(best)
            o = outcomes[i] = _outcome(base_drafter, target_head, head, seqs,
                                       dataclasses.replace(best.setting, stride=1))
            o.screened = best
            _compare(o, saved, seed)
            o.significant = _significant(o, family[o.setting.kind])
    return outcomes


def best_fixes(outcomes: Sequence[Outcome]) -> list[Outcome]:
    """The significant setting that fits best of each kind (a shift of +1 beside the right
    one of +2 is a partial fix, not a second finding), best first."""
    best: dict[str, Outcome] = {}
    for o in outcomes:
        k = o.setting.kind
        if o.significant and (k not in best or o.ce.mean < best[k].ce.mean):
            best[k] = o
    return sorted(best.values(), key=lambda o: o.ce.mean)


def equivalents(best: Outcome, outcomes: Sequence[Outcome]) -> list[Outcome]:
    """Other significant settings of ``best``'s kind that fit as well (within ``MIN_GAIN``):
    e.g. mask tokens whose embeddings the drafter cannot tell apart."""
    ref = best.screened or best                 # compared on the same anchors
    return [o for o in outcomes if o is not best and o.significant
            and o.setting.kind == best.setting.kind and o.ce.mean - ref.ce.mean < MIN_GAIN]


def _outcome(base_drafter, target_head, head, seqs, s: Setting) -> Outcome:
    model = drafter_for(base_drafter, s.cfg)
    sc = score(model, target_head, head, seqs, layer_ids=s.cfg.target_layer_ids,
               mask_token_id=s.cfg.mask_token_id, stride=s.stride)
    o = Outcome(s, sc)
    if s.stride == 1:
        o.tau = counter(walk(sc, seqs)["all"]).mean_acceptance_length
    return o


def _compare(o: Outcome, saved: Outcome, seed: int) -> None:
    block = max(1, saved.setting.cfg.block_size // o.setting.stride)
    sc, base = o.scores, saved.scores
    base_ce = _aligned(base, sc, base.anchor_ce)
    o.ce = paired(sc.anchor_ce, base_ce, sc.prompt, block=block, seed=seed)
    o.ce_sign = paired(sc.anchor_ce, base_ce, sc.prompt, block=block, seed=seed + 2, sign=True)
    o.accepted = paired(sc.accepted.double(), _aligned(base, sc, base.accepted.double()),
                        sc.prompt, block=block, seed=seed + 1)


def _significant(o: Outcome, tried: int) -> bool:
    """Two tests of one question (the sign test is the stronger when most anchors gain a
    little, the mean when fewer anchors gain a lot, as with a wrong rope): either may say so
    at half the level (Bonferroni over both and over the ``tried`` settings of the kind)."""
    level = ALPHA / (2 * max(1, tried))
    return (o.ce.mean < -MIN_GAIN and min(o.ce_sign.p_below, o.ce.p_below) < level
            and o.scores.position_accuracy()[0] >= MIN_P1)


def fix_sentence(o: Outcome, saved: Outcome, block_size: int, same: Sequence[Outcome] = ()) -> str:
    """The finding for a significant fix, in the user's terms, with the exact config edit;
    ``same``: settings that fit as well (:func:`equivalents`)."""
    s, ce, acc = o.setting, o.ce, o.accepted
    what = {
        "shift": lambda: (f"target_layer_ids are off by {-s.shift:+d}: the drafter reads best with "
                          f"{list(s.cfg.target_layer_ids)} (the saved ids {s.shift:+d}; id i is the "
                          "output of layer i = hidden_states[i + 1], dflash/core/taps.py)"),
        "mask": lambda: (f"mask_token_id looks wrong: the drafter drafts better with mask token "
                         f"{s.cfg.mask_token_id} than with {saved.setting.cfg.mask_token_id}"),
        "rope": lambda: "rope settings: the drafter drafts better with the target's rope",
        "sliding": lambda: f"attention layout: the drafter drafts better with {s.name}",
    }[s.kind]()
    tau = "" if o.tau is None or saved.tau is None else \
        f"; tau (greedy, block {block_size}) {saved.tau:.2f} -> {o.tau:.2f}"
    sg = o.ce_sign
    return (f"{what}. Cross-entropy of the target's tokens {ce.mean:+.3f} nats per draft position "
            f"(95% CI {ce.lo:+.3f}..{ce.hi:+.3f}, p = {ce.p_below:.1g}); lower at "
            f"{50 * (1 - sg.mean):.0f}% of {sg.anchors} anchors (sign test p = {sg.p_below:.1g}); "
            f"accepted drafts per anchor {acc.mean:+.3f} ({acc.lo:+.3f}..{acc.hi:+.3f}){tau}. "
            f"Fix: in config.json {s.edit_text()}" +
            (f" (as good: {'; '.join(x.setting.edit_text() for x in same)})" if same else ""))


def controls_sentence(outcomes: Sequence[Outcome]) -> tuple[bool, str]:
    """(reads its taps, sentence): whether some control is significantly worse than the saved."""
    ctl = [o for o in outcomes if o.setting.kind == "control"]
    if not ctl:
        return True, ""
    worse = [o for o in ctl if o.ce.p_above < ALPHA and o.ce.mean > MIN_GAIN]
    parts = ", ".join(f"{o.setting.name.split(': ')[1]} {o.ce.mean:+.3f} nats" for o in ctl)
    if worse:
        return True, f"the drafter reads its taps (controls: {parts})"
    return False, (f"the drafter barely depends on its taps (controls: {parts}): untrained, or "
                   "its context features never reach it")


def vocab_coverage(seqs: Sequence[ProbeSeq], draft_vocab: torch.Tensor | None, vocab_size: int,
                   tokenizer=None, top: int = 5) -> dict | None:
    """How much of what the target emitted on the probe prompts the draft vocabulary holds.

    Returns None without a draft vocabulary, else ``{"ids", "coverage", "missing": [[token,
    count], ...]}``: a token outside it can never be drafted, so ``1 - coverage`` bounds the
    share of draft positions it costs."""
    if draft_vocab is None:
        return None
    emitted = torch.cat([s.ids[s.prompt_len:] for s in seqs]) if seqs else torch.zeros(0, dtype=torch.int64)
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[draft_vocab] = True
    ok = inside[emitted]
    counts = torch.bincount(emitted[~ok], minlength=vocab_size)
    order = counts.argsort(descending=True)[:top]
    name = (lambda i: tokenizer.convert_ids_to_tokens(i)) if tokenizer is not None else str
    missing = [[name(int(i)), int(counts[i])] for i in order if counts[i] > 0]
    return {"ids": int(draft_vocab.numel()), "tokens": int(emitted.numel()),
            "coverage": round(float(ok.float().mean()) if emitted.numel() else 1.0, 4),
            "missing": missing}
