"""How long idle OpenMP threads of a model service busy-wait: set before torch loads libgomp.

Why: the verifier and the drafter take turns on the same cores at batch 1 (draft, verify,
draft ...), and after each parallel region libgomp's workers spin before they sleep (300,000
iterations by default), taking a core from the other service for milliseconds at every
hand-over. 10,000 spins still bridge the regions inside one forward. Measurements:
``docs/bench/perf-history/README.md`` ("OpenMP spin count").

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
        logging.getLogger("dflash.serving.omp").warning(
            "GOMP_SPINCOUNT set after torch was imported: it applies to child processes only")
    return True
