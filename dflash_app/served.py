"""The target and drafter as the services would serve them, for ``dflash diagnose`` to price.

Each service's own flag parser reads its defaults and ``DFLASH_*`` environment
(``verifier_svc.server.parse_args``, ``drafter_svc.server.parse_args``), and its own functions
load and tune: ``dflash.serving.threads.reserve`` picks the torch thread count,
``verifier_svc.server.load_target`` and ``drafter_svc.server.load_engine`` the dtype and the
linear-layer paths, ``TargetModel.tune_skinny`` and ``DrafterEngine.warmup`` the skinny and
prepacked products on the thread that runs the forwards. Nothing here chooses a setting itself.

One difference, on purpose: the services are two processes, each with one thread running its
forwards; here target and drafter forwards both run on the drafter engine's compute thread
(``DrafterEngine.on_compute_thread``), one OpenMP team of the same thread count, since two
teams in one process would throttle each other's spinning (``dflash.serving.threads``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from drafter_svc.engine import DrafterEngine
    from verifier_svc.target import TargetModel

T = TypeVar("T")


@dataclasses.dataclass
class Served:
    """A loaded, tuned target and drafter engine with the services' settings.

    ``target``: ``verifier_svc.target.TargetModel``; ``drafter``: ``drafter_svc.engine.
    DrafterEngine``; ``threads``: torch threads of the thread running every forward;
    ``tree_budgets``: the verifier's ``--tree-budgets`` (what its adaptive policy may choose);
    ``tree_budget``: its ``--tree-budget`` (mode tree)."""

    target: TargetModel
    drafter: DrafterEngine
    threads: int
    tree_budgets: tuple[int, ...]
    tree_budget: int

    def run(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` on the thread that runs the forwards (the drafter's compute thread)."""
        return self.drafter.on_compute_thread(fn, *args)

    def choices(self) -> dict:
        """What the services' functions chose: threads, dtypes, skinny row limits, packed and
        panel products (``"on"`` / ``"from N rows"`` / ``"off"``)."""
        t, d = self.target, self.drafter
        return {"threads": self.threads,
                "target": {"dtype": str(t.dtype).replace("torch.", ""),
                           "skinny_max_rows": t.skinny_max_rows, "packed_linear": t.packed_linear,
                           "panel_linear": t.panel_linear,
                           "batch_invariant": getattr(t, "batch_invariant", False)},
                "drafter": {"dtype": d.card.dtype, "skinny_max_rows": d.skinny_max_rows,
                            "packed_linear": d.packed_linear,
                            "panel_linear": d.panel_linear,
                            "batch_invariant": d.batch_invariant},
                "tree_budgets": list(self.tree_budgets), "tree_budget": self.tree_budget}

    def close(self) -> None:
        self.drafter.close()
        self.target.close()


def load_served(target_dir: str | Path, drafter_dir: str | Path, *, threads: int = 0,
                dtype: str | None = None) -> Served:
    """Load and tune the pair as ``python -m verifier_svc`` and ``python -m drafter_svc`` would
    with no flags but ``--target`` / ``--drafter`` (their environment applies), and ``--threads``
    / ``--dtype`` when given (0 / None: the services' own).

    Call before this process runs torch work on other threads: :func:`reserve` leaves the
    calling thread single-threaded (as a service's main thread).

    Raises:
        dflash.core.device.DeviceError: a device or dtype the services would refuse.
        OSError: no loadable checkpoint.
    """
    from dflash.core.device import resolve_device
    from dflash.serving.threads import reserve
    from drafter_svc import server as drafter_server
    from verifier_svc import server as verifier_server

    extra = (["--threads", str(threads)] if threads else []) + (["--dtype", dtype] if dtype else [])
    va = verifier_server.parse_args(["--target", str(target_dir), *extra])
    da = drafter_server.parse_args(["--drafter", str(drafter_dir), "--target", str(target_dir),
                                    *extra])
    n = reserve(va.threads)
    target = verifier_server.load_target(va, verifier_server.rank_devices_of(va))
    try:
        engine = drafter_server.load_engine(da, resolve_device(da.device), n)
    except BaseException:
        target.close()
        raise
    engine.on_compute_thread(target.tune_skinny)     # the verifier tunes on its forward thread
    return Served(target, engine, n, verifier_server.parse_budgets(va.tree_budgets),
                  int(va.tree_budget))
