"""How long idle OpenMP threads of a model service busy-wait: set before torch loads libgomp.

Why: the verifier and the drafter take turns on the same cores at batch 1 (draft, then
verify, then draft ...). After each parallel region libgomp's workers spin before they sleep,
by default 300,000 iterations: measured on this project's 2-core machine (AMD EPYC, torch
2.13 CPU) a worker burnt ~9 ms of CPU after each region, 3.8 ms with ``GOMP_SPINCOUNT=100000``,
1.7 ms with 10,000 and 0.1 ms with 1,000 (``time.process_time`` across a 50 ms sleep after a
512x512 product). So each hand-over gave the other process one core less for ~9 ms: through
the SmolLM2 stack a block-16 draft took 16.9 ms against 11.6 ms alone (13.2 ms round trip),
and the verify after it 64.9 ms against ~62 ms in process. With 10,000 spins, same bench in
the same session (6 HumanEval prompts x 64 tokens, batch 1): fixed 24.6 -> 27.9 tokens/s,
adaptive 43.7 -> 53.6, speculation off 37.5 / 36.6 (unchanged). Inside a forward the
regions follow each other within microseconds, so 10,000 spins still bridge them: in process,
forwards of 1 / 4 / 16 tokens took 26.4 / 27.9 / 63.8 ms at the default and 26.7 / 26.8 /
62.0 ms at 10,000 (3,000: 27.1 / 28.5 / 65.4). Sleeping at every barrier (``OMP_WAIT_POLICY=
PASSIVE``) is far slower (session 12: 10.9 vs 14.5 tokens/s).

libgomp reads its environment once, when it is loaded (by ``import torch``), so the services'
entry points call :func:`default_spin_count` first. The user's own ``GOMP_SPINCOUNT`` or
``OMP_WAIT_POLICY`` wins. This module must not import torch.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping

SPIN_COUNT = "10000"


def default_spin_count(env: MutableMapping[str, str] | None = None) -> bool:
    """Set ``GOMP_SPINCOUNT`` to :data:`SPIN_COUNT` in ``env`` (default ``os.environ``) unless
    the user set it or ``OMP_WAIT_POLICY``. Returns True when it set the value.

    With ``os.environ`` after torch was already imported the value would only reach child
    processes: it logs a warning then (libgomp of this process keeps its setting)."""
    target = os.environ if env is None else env
    if "GOMP_SPINCOUNT" in target or "OMP_WAIT_POLICY" in target:
        return False
    target["GOMP_SPINCOUNT"] = SPIN_COUNT
    if env is None and "torch" in sys.modules:
        logging.getLogger("dflash.omp").warning(
            "GOMP_SPINCOUNT set after torch was imported: it applies to child processes only")
    return True
