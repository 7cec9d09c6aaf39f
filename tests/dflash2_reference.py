"""An independent float64 numpy statement of the DFlash2 drafter's math, the parity target of
``tests/test_dflash2_parity.py``.

Written from the published description of ``DFlash2DraftModel`` (the vLLM ``qwen3_dflash2``
port and the checkpoints' tensor layout were read; nothing is imported or copied from them, nor
from ``dflash.core``): per-head RMSNorm'd queries/keys with default RoPE, context K/V injected
in front of the block, non-causal attention limited to a sliding window of absolute positions,
SwiGLU MLP, each sublayer wrapped by the grouped dynamic causal convolution, then the candidate
selector over the soft-capped, scaled head logits. ``drop`` names components to leave out, so a
test can show that each one changes the result.
"""

from __future__ import annotations

import numpy as np

COMPONENTS = ("conv", "selector", "softcap", "multiplier", "window", "embed_scale")


def rmsnorm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x, pos, theta):
    """x [n, heads, d] at integer positions pos [n]; rotate-half convention."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    ang = pos[:, None] * inv[None]                      # [n, d/2]
    cos = np.cos(np.concatenate([ang, ang], -1))[:, None]
    sin = np.sin(np.concatenate([ang, ang], -1))[:, None]
    half = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + half * sin


def conv(x, delta, base, block_len):
    """x [q, H]; delta [q, taps, G]; base [taps, H]: sum over taps within the block."""
    q, h = x.shape
    taps, g = delta.shape[1], delta.shape[2]
    out = np.zeros_like(x)
    for i in range(q):
        for t in range(taps):
            if i % block_len < t:
                continue
            coef = base[t] + np.repeat(delta[i, t], h // g)
            out[i] += coef * x[i - t]
    return out


def silu(x):
    return x / (1.0 + np.exp(-x))


def attention(w, pre, x, ctx, qpos, kpos, cfg, window):
    heads, kvh, d = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    eps, theta = cfg["eps"], cfg["theta"]

    def proj(name, v, n):
        return (v @ w[f"{pre}.{name}.weight"].T).reshape(len(v), n, d)

    q = rope(rmsnorm(proj("q_proj", x, heads), w[f"{pre}.q_norm.weight"], eps), qpos, theta)
    keys_in = np.concatenate([ctx, x])
    k = rope(rmsnorm(proj("k_proj", keys_in, kvh), w[f"{pre}.k_norm.weight"], eps), kpos, theta)
    v = proj("v_proj", keys_in, kvh)
    rep = heads // kvh
    out = np.zeros((len(x), heads, d))
    for hh in range(heads):
        s = q[:, hh] @ k[:, hh // rep].T / np.sqrt(d)
        if window:
            s = np.where(qpos[:, None] - kpos[None] < window, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[:, hh] = (p / p.sum(-1, keepdims=True)) @ v[:, hh // rep]
    return out.reshape(len(x), -1) @ w[f"{pre}.o_proj.weight"].T


def drafter(w, cfg, features, ctx_pos, block_embeds, block_pos, drop=()):
    """Final-normed hidden [q, H] of one block; ``w`` float64 arrays by z-lab name."""
    eps, taps = cfg["eps"], cfg["taps"]
    g = cfg["hidden"] // cfg["group"]
    ctx = rmsnorm(features @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    x = block_embeds * (1.0 if "embed_scale" in drop else cfg["embed_scale"])
    kpos = np.concatenate([ctx_pos, block_pos])
    window = None if "window" in drop else cfg["window"]
    blen = len(x)
    for n in range(cfg["layers"]):
        pre = f"layers.{n}"
        for sub in ("attention", "mlp"):
            norm = "input_layernorm" if sub == "attention" else "post_attention_layernorm"
            u = rmsnorm(x, w[f"{pre}.{norm}.weight"], eps)
            cw = f"{pre}.{sub}_conv"
            coef = (u @ w[f"{cw}.kernel_projection.weight"].T).reshape(len(u), 2, taps, g)
            if "conv" not in drop:
                u = conv(u, coef[:, 0], w[f"{cw}.base_kernel"][0], blen)
            if sub == "attention":
                y = attention(w, f"{pre}.self_attn", u, ctx, block_pos, kpos, cfg, window)
            else:
                m = f"{pre}.mlp"
                y = (silu(u @ w[f"{m}.gate_proj.weight"].T) * (u @ w[f"{m}.up_proj.weight"].T)) \
                    @ w[f"{m}.down_proj.weight"].T
            if "conv" not in drop:
                y = conv(y, coef[:, 1], w[f"{cw}.base_kernel"][1], blen)
            x = x + y
    return rmsnorm(x, w["norm.weight"], eps)


def candidate_values(logits, cfg, drop=()):
    z = logits
    if cfg["softcap"] and "softcap" not in drop:
        z = cfg["softcap"] * np.tanh(z / cfg["softcap"])
    return z if "multiplier" in drop else z * cfg["multiplier"]


def edge_scores(w, cfg, cand, unary, hidden, anchor, drop=()):
    """[L, k, k]: score from slot l - 1's candidate p (the anchor at l = 0) to slot l's c."""
    L, k = cand.shape
    out = np.repeat(unary[:, None, :], k, axis=1).astype(np.float64)
    if "selector" in drop:
        return out
    proj = hidden @ w["candidate_selector.hidden_projection.weight"].T      # [L, r]
    P, S = w["candidate_selector.predecessor_codebook"], w["candidate_selector.successor_codebook"]
    for lvl in range(L):
        for p in range(k):
            prev = anchor if lvl == 0 else cand[lvl - 1, p]
            out[lvl, p] += (S[cand[lvl]] @ (P[prev] * proj[lvl]))
    return out


def greedy_path(scores, cand):
    """Token ids of the best greedy walk from the anchor (first candidate among ties)."""
    prev, path = 0, []
    for lvl in range(scores.shape[0]):
        c = int(np.argmax(scores[lvl, prev]))
        path.append(int(cand[lvl, c]))
        prev = c
    return path
