"""The drafter service's online-learning flags, and the capture they switch on."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from dflash.learn.capture import Capture
from dflash.learn.store import CaptureStore
from dflash.serving.argtypes import at_least

log = logging.getLogger("dflash.learn")
#: Default byte budget of the capture store (--learn-bytes): ~5.8 kB a token for SmolLM2's
#: five 576-wide bf16 taps, so about 90 k tokens.
DEFAULT_BYTES = 512 << 20


def add_learn_args(p) -> None:
    """``--learn-dir`` (off by default), ``--learn-bytes``, ``--learn-idle-s``, ``--learn-threads``."""
    env = os.environ.get
    p.add_argument("--learn-dir", default=env("DFLASH_LEARN_DIR"),
                   help="capture served conversations (taps + committed tokens) here for online "
                        "learning (docs/learning.md); off when unset [DFLASH_LEARN_DIR]")
    p.add_argument("--learn-bytes", type=at_least(1), default=env("DFLASH_LEARN_BYTES", str(DEFAULT_BYTES)),
                   help="byte budget of the capture store; the oldest conversations go first "
                        "[DFLASH_LEARN_BYTES]")
    p.add_argument("--learn-idle-s", type=float, default=float(env("DFLASH_LEARN_IDLE_S", "0")),
                   help="train in this process when no draft came for this many seconds; 0 = "
                        "capture only (train with `dflash learn`) [DFLASH_LEARN_IDLE_S]")
    p.add_argument("--learn-threads", type=at_least(0), default=env("DFLASH_LEARN_THREADS", "1"),
                   help="torch threads of the in-process learner [DFLASH_LEARN_THREADS]")


def stop_ids(target_dir: str | Path) -> set[int]:
    """The target's end-of-turn ids (``eos_token_id`` of config.json and generation_config.json)."""
    out: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        f = Path(target_dir) / name
        if f.is_file():
            v = json.loads(f.read_text()).get("eos_token_id")
            out.update(v if isinstance(v, list) else [v] if isinstance(v, int) else [])
    return out


def capture_from_args(a, card) -> Capture | None:
    """The capture of ``--learn-dir`` (``<dir>/store``) for a drafter of ``card``, or None.

    Raises ValueError naming ``--learn-bytes`` for a budget below one byte."""
    if not a.learn_dir:
        return None
    root = Path(a.learn_dir)
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)          # the candidates' weights are learned from users' traffic
    store = CaptureStore(root / "store", max_bytes=int(a.learn_bytes),
                         fingerprint=card.target_fingerprint, layer_ids=card.target_layer_ids)
    log.info("capturing served conversations into %s (at most %d bytes)", store.path, store.max_bytes)
    return Capture(store, stop_ids=stop_ids(a.target), served_by=card.label)


def learner_from_args(a, engine, registry=None):
    """The in-process idle learner of ``--learn-idle-s`` > 0 (started), or None."""
    if not (a.learn_dir and a.learn_idle_s > 0):
        return None
    from dflash.learn.idle import IdleLearner
    from dflash.learn.learner import Learner

    learner = Learner(a.learn_dir, a.drafter, a.target)
    log.info("learning in this process after %.1f s without a draft request (%d threads)",
             a.learn_idle_s, max(1, int(a.learn_threads)))
    return IdleLearner(engine, learner, idle_s=a.learn_idle_s, threads=max(1, int(a.learn_threads)),
                       registry=registry).start()
