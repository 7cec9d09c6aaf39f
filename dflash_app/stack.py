"""The local stack a command starts: its flags (:func:`add_stack_args`) and the
:class:`~dflash_app.launcher.StackConfig` they ask for (:func:`stack_config`), shared by
``dflash up`` / ``demo`` and the benchmarks that start their own stack."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from dflash.core.flags import DTYPE_FLAGS

if TYPE_CHECKING:   # imported where used: `dflash --help` stays light
    from dflash_app.launcher import StackConfig

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DRAFTER = REPO / "models" / "smollm2-dflash-b16"


def default_target() -> str:
    """The SmolLM2 target directory, set up on first use (:mod:`dflash.train.target_setup`)."""
    from dflash.train.target_setup import setup_target

    return str(setup_target())


def tiny_models() -> tuple[str, str]:
    """Random-weight tiny target + drafter under the cache dir (quick smoke runs). Built under
    an exclusive lock: two `--tiny` runs at once (parallel tests) never read a half-written one."""
    import fcntl

    from dflash.train.target_setup import default_cache_dir
    from dflash_app.testing import make_tiny_drafter, make_tiny_target

    root = default_cache_dir() / "tiny"
    t, d = root / "target", root / "drafter"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (t / "config.json").exists():
            make_tiny_target(t)
        if not (d / "config.json").exists():
            make_tiny_drafter(d, t, block_size=8)
    return str(t), str(d)


def stack_config(a: argparse.Namespace) -> StackConfig:
    """The local stack the parsed stack flags (:func:`add_stack_args`) ask for: ``--tiny``'s
    models, else ``--target`` / ``--drafter`` (then ``$DFLASH_TARGET`` / ``$DFLASH_DRAFTER``,
    then the defaults); the flags only some commands have (``--ep-size``, ``--http-port``,
    ``--tls``, ``--verifiers``, ``--suffix-corpus``) at their defaults where absent."""
    from dflash_app.launcher import DrafterSpec, StackConfig

    if a.tiny:
        target, drafter = tiny_models()
        drafters = [drafter]
    else:
        target = a.target or os.environ.get("DFLASH_TARGET") or default_target()
        drafters = a.drafter or [os.environ.get("DFLASH_DRAFTER") or str(DEFAULT_DRAFTER)]
    specs = [DrafterSpec(path=p, port=a.drafter_port + i) for i, p in enumerate(drafters)]
    ep = getattr(a, "ep_size", 1) or 1
    return StackConfig(target=target, drafters=specs, gateway_port=a.gateway_port,
                       http_port=getattr(a, "http_port", 0),
                       verifier_port=a.verifier_port, dtype=a.dtype, run_dir=a.run_dir,
                       verifier_args=(["--ep-size", str(ep)] if ep > 1 else [])
                       + (["--suffix-corpus", a.suffix_corpus] if getattr(a, "suffix_corpus", "") else []),
                       tls=getattr(a, "tls", False), verifiers=getattr(a, "verifiers", 1))


def add_stack_args(p: argparse.ArgumentParser) -> None:
    """The flags that say which stack to start (``dflash up``, ``demo``, ``bench --start``)."""
    p.add_argument("--target", help="target model dir (default: SmolLM2-135M-Instruct, set up on demand)")
    p.add_argument("--drafter", action="append", help="drafter dir; repeat for several versions "
                   f"(default: {DEFAULT_DRAFTER.relative_to(REPO)})")
    p.add_argument("--tiny", action="store_true", help="use tiny random-weight models (smoke test)")
    p.add_argument("--gateway-port", type=int, default=50050)
    p.add_argument("--verifier-port", type=int, default=50051)
    p.add_argument("--drafter-port", type=int, default=50061, help="first drafter's port (+1 each)")
    p.add_argument("--dtype", choices=DTYPE_FLAGS, default="auto",
                   help="every model service's --dtype: auto (float32 on a CPU, but bfloat16 for "
                        "drafters where the CPU has bf16 instructions; the checkpoint's on a GPU), "
                        "bfloat16, float16 or float32")
    p.add_argument("--run-dir", default="runs/up", help="where service logs go")
    p.add_argument("--suffix-corpus", default="",
                   help="the verifier's --suffix-corpus: token shards (e.g. data/train, the "
                        "default drafter's training data) whose answers are suffix candidates "
                        "for every tenant (docs/suffix.md)")
    p.add_argument("--ep-size", type=int, default=1,
                   help="expert-parallel ranks for the verifier (a mixture-of-experts target; "
                        "dflash convert-moe makes one from a dense target)")
