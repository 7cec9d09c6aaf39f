"""The drafter engine's warm-up: one tiny draft so first requests don't pay lazy
initialisation, then the CPU products' tuning (``kernels.skinny_linear``) on the engine's
compute thread, where drafts run."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from dflash.core.proposer import ProposalRequest
from dflash.core.sampling import Sampling
from kernels.skinny_linear import AUTO, tune_max_rows, tune_products, tuning_summary

if TYPE_CHECKING:
    from drafter_svc.engine import DrafterEngine

log = logging.getLogger("dflash.drafter")
SESSION = "__warmup__"


def warmup(engine: DrafterEngine) -> None:
    """One draft of a full block; then, with ``skinny_max_rows`` :data:`kernels.skinny_linear.AUTO`
    on a CPU, the row limit tuned (one session, 64 context rows, blocks of 2 / 4 / 8 / 16 with and
    without the transposed product; ``kernels.skinny_linear.tune_max_rows``); with
    ``packed_linear`` / ``panel_linear`` "auto", a one-row context update and blocks of 4 / 16
    with and without the prepacked / panel product (``kernels.skinny_linear.tune_products``).
    Nothing is tuned in batch-invariant mode (every product is the invariant one)."""
    cfg = engine.cfg

    def req(block: int, rows: int = 2) -> ProposalRequest:
        return ProposalRequest(session_id=SESSION, context_start=0,
                               context=torch.zeros(rows, cfg.context_size, device="cpu"),
                               anchor_token=0, block_size=block, sampling=Sampling())

    engine.propose([req(cfg.block_size)])
    if engine.batch_invariant:
        return
    if engine.skinny_max_rows == AUTO and engine.device.type == "cpu":   # CPU-only product
        rows = tuple(n for n in (2, 4, 8, 16) if n <= cfg.block_size) or (2,)
        # propose() called on the compute thread drafts inline
        engine.skinny_max_rows, timings = engine.on_compute_thread(
            lambda: tune_max_rows(engine.drafter, lambda n: engine.propose([req(n, 64)]),
                                     rows=rows, also=[engine.head]))
        log.info("%s", tuning_summary(engine.skinny_max_rows, timings))
    blocks = tuple(sorted({min(n, cfg.block_size) for n in (1, 4, 16)}))

    def probe(n: int) -> object:    # block 1 = a context update: the products' one-row case
        return engine.propose([req(n, 1 if n == 1 else 64)])

    engine.packed_linear, engine.panel_linear = engine.on_compute_thread(
        lambda: tune_products(engine.drafter, probe, engine.packed_linear, engine.panel_linear,
                                 rows=blocks, also=[engine.head]))
    engine.release([SESSION])
