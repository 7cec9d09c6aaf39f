"""A target and drafter, built by hand, whose acceptance depends on ``target_layer_ids``.

A random drafter has tau ~ 1 whatever it taps, so it cannot show an off-by-one in the taps. Here
every weight is chosen so the answer is known exactly:

Target (transformers Qwen3, H = 32, 4 layers, byte tokenizer). Letters 'a'..'p' (ids 97..112)
embed as one-hot in dims 0..15 plus a constant 1 in dim 16. Attention is off (``o_proj = 0``).
Each layer's SwiGLU MLP is linear (its gate reads only the constant dim: silu(20) ~ 20) and
rotates the one-hot by ``SHIFTS[L]`` (mod 16), so the output of layer L holds letter
``t + C_L`` with ``C_L = SHIFTS[0] + ... + SHIFTS[L]``. The LM head undoes ``C_3``: the greedy
continuation repeats the last letter forever ("aaaa" -> "aaaa...").

Drafter (z-lab layout, one layer, one head). ``fc`` reads the tap of layer j, undoes ``C_j``
and re-applies ``C_3`` (so the target's LM head reads the letter back), and copies a constant
into a flag dim 17 that only context rows have. The block's query (from the constant dim) and
the context keys (from the flag) meet on RoPE's slowest frequency pair, so every block position
attends to the context rows (scores ~51) and never to block rows (score 0); ``v``/``o`` copy the
letter. On prompts repeating one letter it drafts exactly the target's continuation: tau = B.
Given the taps of any other layer i it drafts ``t + C_i - C_j`` (never ``t``: the partial sums
differ mod 16): tau = 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

LETTERS = 16
FIRST = 97                   # 'a'
CONST, FLAG = 16, 17         # residual dims
SHIFTS = (3, 5, 6, 7)        # rotation per layer; partial sums 3, 8, 14, 5 all differ mod 16
H, LAYERS, VOCAB, MASK = 32, 4, 272, 271


def _rotation(k: int) -> torch.Tensor:
    """[16, 16] permutation: one-hot of letter i -> one-hot of letter i + k (mod 16)."""
    p = torch.zeros(LETTERS, LETTERS)
    for i in range(LETTERS):
        p[(i + k) % LETTERS, i] = 1.0
    return p


def make_tap_target(path: str | Path) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3Config

    from dflash_app.testing import write_byte_tokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    specials = write_byte_tokenizer(path)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=H, intermediate_size=2 * H,
                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, max_position_embeddings=1024, tie_word_embeddings=False,
                      eos_token_id=specials["<|im_end|>"], bos_token_id=None,
                      pad_token_id=specials["<|endoftext|>"],
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_() if p.dim() == 2 else p.fill_(1.0)   # matrices 0, norm weights 1
        emb = model.model.embed_tokens.weight
        emb[:, CONST] = 1.0
        emb[FIRST:FIRST + LETTERS, :LETTERS] = torch.eye(LETTERS)
        # Residual h = onehot + e_CONST has rms 0.25, so the MLP sees n = 4h: gate = 5 * 4 = 20,
        # up = 4h, product = silu(20) * 4h ~ 80h; down = (P - I) / 80 adds (P - I)h.
        for layer, k in zip(model.model.layers, SHIFTS):
            layer.mlp.gate_proj.weight[:, CONST] = 5.0
            layer.mlp.up_proj.weight[:LETTERS, :LETTERS] = torch.eye(LETTERS)
            layer.mlp.down_proj.weight[:LETTERS, :LETTERS] = (_rotation(k) - torch.eye(LETTERS)) / 80.0
        head = model.lm_head.weight
        total = sum(SHIFTS)
        for i in range(LETTERS):
            head[FIRST + i, (i + total) % LETTERS] = 5.0
    model.save_pretrained(str(path))
    return path


def make_tap_drafter(path: str | Path, target_dir: str | Path, *, tapped_layer: int,
                     saved_layer_ids: list[int], block_size: int = 8) -> Path:
    """A drafter that reads the output of ``tapped_layer``, saved with ``saved_layer_ids``."""
    from dflash.core.checkpoint import load_target_head, save_drafter, target_fingerprint
    from dflash.core.config import DrafterConfig
    from dflash.core.modeling import DFlashDrafter

    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    cfg = DrafterConfig(hidden_size=H, intermediate_size=2 * H, num_hidden_layers=1,
                        num_attention_heads=1, num_key_value_heads=1, head_dim=H, rope_theta=10000.0,
                        vocab_size=VOCAB, block_size=block_size, mask_token_id=MASK,
                        target_layer_ids=tuple(saved_layer_ids), num_target_layers=LAYERS,
                        name="tap-drafter", version=f"L{tapped_layer}",
                        target_fingerprint=target_fingerprint(tcfg, load_target_head(target_dir).embed))
    model = DFlashDrafter(cfg)
    undo = sum(SHIFTS[:tapped_layer + 1])
    with torch.no_grad():
        for p in model.parameters():
            p.zero_() if p.dim() == 2 else p.fill_(1.0)
        model.fc.weight[:LETTERS, :LETTERS] = _rotation(sum(SHIFTS) - undo)
        model.fc.weight[FLAG, CONST] = 1.0
        attn = model.layers[0].self_attn
        slow = H // 2 - 1                      # RoPE's slowest pair (dims 15 and 31)
        attn.q_proj.weight[slow, CONST] = 1.0
        attn.k_proj.weight[slow, FLAG] = 1.0
        attn.q_norm.weight.fill_(3.0)
        attn.k_norm.weight.fill_(3.0)
        attn.v_proj.weight[:LETTERS, :LETTERS] = torch.eye(LETTERS)
        attn.o_proj.weight[:LETTERS, :LETTERS] = 10.0 * torch.eye(LETTERS)
    save_drafter(model, path)
    return Path(path)


def letter_prompt(letter: str, n: int = 12) -> list[int]:
    return [ord(letter)] * n


# ---------------------------------------------------------------------------------------------
# Drafters whose acceptance depends on the mask token, on RoPE, or on a sliding window, for the
# planted-fault tests of ``dflash diagnose`` (tests/test_diagnose_faults.py).
#
# * mask: the target's MASK row also holds a flag dim (the target never reads it: MASK never
#   occurs in its input). The drafter's fc leaves the letter one step short and its MLP, gated
#   on the flag, rotates it the last step: only blocks whose masks are MASK draft the letter.
# * recent: the block's query and the context keys meet on a fast RoPE pair, so a block
#   position attends to the most recent context rows; under another rope_theta the pair turns
#   at another speed and the attention spreads to older rows.
# * sliding: the drafter's one layer slides (window ``sliding_window``); on a prompt whose
#   older part is another letter, full attention over the whole context drafts that letter.

MASK_FLAG = 18               # residual dim set only in the MASK token's embedding
FAST_PAIR = 5                # RoPE pair of the "recent" drafter (theta 10000: ~0.056 rad/pos)


def make_mask_target(path: str | Path) -> Path:
    """:func:`make_tap_target` with ``MASK_FLAG`` set in the MASK row of the embedding (its
    outputs are the tap target's: no prompt contains MASK)."""
    from safetensors.torch import load_file, save_file

    path = make_tap_target(path)
    f = path / "model.safetensors"
    state = load_file(str(f))
    state["model.embed_tokens.weight"][MASK, MASK_FLAG] = 1.0
    save_file(state, str(f), metadata={"format": "pt"})
    return path


def make_probe_drafter(path: str | Path, target_dir: str | Path, *, tapped_layer: int = 1,
                       saved_layer_ids: list[int] | None = None, block_size: int = 8,
                       mask_gated: bool = False, recent: bool = False,
                       sliding_window: int | None = None) -> Path:
    """:func:`make_tap_drafter`, then rewired to depend on the mask token (``mask_gated``, needs
    :func:`make_mask_target`), on RoPE (``recent``) or on a sliding window of
    ``sliding_window`` positions. Saved with its true config."""
    import dataclasses

    from dflash.core.checkpoint import load_drafter, save_drafter
    from dflash.core.modeling import DFlashDrafter

    make_tap_drafter(path, target_dir, tapped_layer=tapped_layer,
                     saved_layer_ids=saved_layer_ids or [tapped_layer], block_size=block_size)
    base = load_drafter(path)
    cfg = base.cfg
    if sliding_window:
        cfg = dataclasses.replace(cfg, layer_types=("sliding_attention",),
                                  sliding_window=sliding_window)
    model = DFlashDrafter(cfg)
    model.load_state_dict(base.state_dict(), strict=False)
    undo = sum(SHIFTS[:tapped_layer + 1])
    with torch.no_grad():
        layer = model.layers[0]
        if mask_gated:
            # After attention a MASK row holds CONST 1, MASK_FLAG 1 and the letter at 40 (fc ->
            # hidden_norm gives 4, o_proj 10x); post-norm that is 0.141 / 0.141 / 5.65: a gate
            # of 141 * 0.141 = 20 (silu ~ 20) times 5.65 times 0.354 adds 40 (R - I) letter.
            model.fc.weight[:LETTERS, :LETTERS] = _rotation(sum(SHIFTS) - undo - 1)
            layer.mlp.gate_proj.weight[:, MASK_FLAG] = 141.5
            layer.mlp.up_proj.weight[:LETTERS, :LETTERS] = torch.eye(LETTERS)
            layer.mlp.down_proj.weight[:LETTERS, :LETTERS] = 0.354 * (_rotation(1) - torch.eye(LETTERS))
        if recent:
            attn = layer.self_attn
            slow = H // 2 - 1
            attn.q_proj.weight[slow] = 0.0
            attn.k_proj.weight[slow] = 0.0
            attn.q_proj.weight[FAST_PAIR, CONST] = 1.0
            attn.k_proj.weight[FAST_PAIR, FLAG] = 1.0
    save_drafter(model, path)
    return Path(path)


def mixed_prompt(old: str = "b", new: str = "a", n_old: int = 30, n_new: int = 12) -> list[int]:
    """``old`` x n_old then ``new`` x n_new: the target continues ``new``; a drafter that
    attends to the whole context sees mostly ``old``."""
    return [ord(old)] * n_old + [ord(new)] * n_new


def edited_drafter(src, dst, **changes):
    """Copy drafter directory ``src`` to ``dst`` with ``config.json`` edited: ``a__b=v`` sets
    ``cfg["a"]["b"] = v``. Returns ``dst``."""
    import json
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        node = cfg
        *path, last = k.split("__")
        for p in path:
            node = node[p]
        node[last] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst
