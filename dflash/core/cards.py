"""Does a drafter fit this target? The card check every drafter passes before it is used."""

from __future__ import annotations

from typing import Protocol

from dflash.core.errors import PreconditionError
from dflash.core.proposer import MAX_BLOCK_SIZE, DrafterCard


class TargetCard(Protocol):
    hidden_size: int
    vocab_size: int
    num_layers: int
    fingerprint: str
    rope_theta: float


def check_drafter_card(card: DrafterCard, target: TargetCard) -> list[str]:
    """Refuse a drafter that does not fit ``target``; return warnings for soft mismatches.

    Raises PreconditionError naming the field (hidden_size, vocab_size, target_layer_ids,
    block_size, mask_token_id).
    """
    if card.hidden_size != target.hidden_size:
        raise PreconditionError("hidden_size", f"drafter has {card.hidden_size}, target has "
                                f"{target.hidden_size}")
    if card.vocab_size != target.vocab_size:
        raise PreconditionError("vocab_size", f"drafter has {card.vocab_size}, target has "
                                f"{target.vocab_size}")
    if not card.target_layer_ids:
        raise PreconditionError("target_layer_ids", "empty")
    for i in card.target_layer_ids:
        if not 0 <= i < target.num_layers:
            raise PreconditionError("target_layer_ids", f"layer id {i} out of range for a "
                                    f"{target.num_layers}-layer target (valid 0..{target.num_layers - 1})")
    if not 1 <= card.block_size <= MAX_BLOCK_SIZE:
        raise PreconditionError("block_size", f"{card.block_size} not in [1, {MAX_BLOCK_SIZE}]")
    if not 0 <= card.mask_token_id < target.vocab_size:
        raise PreconditionError("mask_token_id", f"{card.mask_token_id} outside the vocabulary")
    warnings = []
    if card.target_fingerprint and card.target_fingerprint != target.fingerprint:
        warnings.append(f"target_fingerprint: drafter was built for {card.target_fingerprint}, "
                        f"this target is {target.fingerprint}")
    if card.rope_theta and target.rope_theta and card.rope_theta != target.rope_theta:
        warnings.append(f"rope_theta: drafter {card.rope_theta}, target {target.rope_theta}")
    return warnings
