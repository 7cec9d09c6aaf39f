"""Tiny random-weight targets and drafters for tests, demos and smoke runs.

The tiny target is a transformers Qwen3 (or Llama) causal LM with a byte-level tokenizer (256
byte tokens + specials), so multi-byte UTF-8 characters really span several tokens. Everything
is written to disk in the same formats real checkpoints use (safetensors, config.json,
tokenizer.json, chat template), so the services load them through their normal code paths.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dflash.core.checkpoint import save_drafter
from dflash.core.config import DrafterConfig

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_byte_tokenizer(path: Path) -> dict[str, int]:
    """Write a byte-level BPE tokenizer without merges (one token per UTF-8 byte) + specials.

    Returns the special-token ids. Vocabulary: 256 bytes then the specials (ids 256..259).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = ByteLevel.alphabet()
    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token=None,
                                   pad_token="<|endoftext|>", unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return {s: fast.convert_tokens_to_ids(s) for s in SPECIALS}


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte -> printable-unicode map (the ByteLevel alphabet).
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def make_tiny_target(path: str | Path, *, arch: str = "qwen3", num_layers: int = 4, hidden: int = 64,
                     vocab: int = 272, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """Write a random-weight target (safetensors + config + byte tokenizer) to ``path``.

    Args:
        arch: "qwen3" or "llama".
        vocab: embedding rows (>= 260: 256 bytes + 4 specials; extra rows are unused ids).
    Returns the directory.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    specials = write_byte_tokenizer(path)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=hidden // 4, max_position_embeddings=1024, tie_word_embeddings=False,
                  eos_token_id=specials["<|im_end|>"], bos_token_id=None,
                  pad_token_id=specials["<|endoftext|>"], rope_parameters={"rope_type": "default",
                                                                           "rope_theta": 10000.0})
    cfg = Qwen3Config(**common) if arch == "qwen3" else LlamaConfig(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    # Larger-than-default init so logits are well separated (fewer float near-ties in tests).
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(str(path))
    return path


def make_tiny_moe_target(path: str | Path, *, num_layers: int = 4, hidden: int = 64,
                         num_experts: int = 8, top_k: int = 2, vocab: int = 272, seed: int = 0,
                         dtype: torch.dtype = torch.float32) -> Path:
    """Write a random-weight sparse mixture-of-experts target (Mixtral, top-``top_k`` of
    ``num_experts``) with the byte tokenizer. Random router weights: routing really matters,
    each token reaches only ``top_k`` experts, so a wrongly sharded expert changes the logits.
    """
    from transformers import AutoModelForCausalLM, MixtralConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    specials = write_byte_tokenizer(path)
    cfg = MixtralConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden,
                        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=hidden // 4, max_position_embeddings=1024, tie_word_embeddings=False,
                        num_local_experts=num_experts, num_experts_per_tok=top_k,
                        eos_token_id=specials["<|im_end|>"], bos_token_id=None,
                        pad_token_id=specials["<|endoftext|>"], sliding_window=None,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
        for layer in model.model.layers:  # a sharper router: top-2 choices well separated
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    model.save_pretrained(str(path))
    return path


def make_tiny_drafter(path: str | Path, target_dir: str | Path, *, block_size: int = 8,
                      num_layers: int = 1, target_layer_ids: list[int] | None = None, seed: int = 1,
                      name: str = "tiny-drafter", version: str = "1", dflash2: bool = False,
                      selector_top_k: int = 8) -> Path:
    """Write a random-weight z-lab format drafter for the target at ``target_dir``;
    ``dflash2``: a ``DFlash2DraftModel`` (2 conv taps in groups of 8 channels, selector rank 16
    over ``selector_top_k`` candidates; every new tensor random too, so each one acts)."""
    from dflash.core.checkpoint import build_drafter, load_target_head, target_fingerprint

    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    hidden = tcfg["hidden_size"]
    ids = target_layer_ids if target_layer_ids is not None else [0, tcfg["num_hidden_layers"] - 2]
    head = load_target_head(target_dir)
    mask_id = tcfg["vocab_size"] - 1 if tcfg["vocab_size"] > 260 else 259
    rope = (tcfg.get("rope_parameters") or {}).get("rope_theta", tcfg.get("rope_theta", 10000.0))
    cfg = DrafterConfig(hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=num_layers,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                        rms_norm_eps=tcfg.get("rms_norm_eps", 1e-6), rope_theta=float(rope),
                        vocab_size=tcfg["vocab_size"], block_size=block_size, mask_token_id=mask_id,
                        target_layer_ids=tuple(ids), num_target_layers=tcfg["num_hidden_layers"],
                        name=name, version=version,
                        target_fingerprint=target_fingerprint(tcfg, head.embed),
                        **(dict(architecture="DFlash2DraftModel", conv_kernel_size=2,
                                conv_group_size=8, selector_rank=16,
                                selector_top_k=selector_top_k) if dflash2 else {}))
    torch.manual_seed(seed)
    model = build_drafter(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
            elif n.endswith("base_kernel"):    # near identity: tap 0 ~ 1, later taps small
                p.normal_(0.0, 0.1)
                p[:, 0] += 1.0
        if dflash2:
            sel = model.candidate_selector
            sel.predecessor_codebook.normal_(0.0, 0.5)
            sel.successor_codebook.normal_(0.0, 0.5)
    save_drafter(model, path)
    return Path(path)
