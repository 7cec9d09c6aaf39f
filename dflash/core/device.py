"""Where a service computes and in which dtype: ``--device`` and ``--dtype``, resolved once.

Every model process (the verifier, a drafter, each expert-parallel rank) takes

* ``--device`` ``auto`` | ``cpu`` | ``cuda`` | ``cuda:N`` (env ``DFLASH_DEVICE``): ``auto`` is
  ``cuda:0`` when torch sees a GPU, else ``cpu``; ``cuda`` is ``cuda:0``;
* ``--dtype`` ``auto`` | ``bfloat16`` | ``float16`` | ``float32`` (env ``DFLASH_DTYPE``):
  ``auto`` is the checkpoint's own dtype (config.json ``dtype`` / ``torch_dtype``) on a GPU and
  float32 on a CPU (bf16 matrix products on a CPU without bf16 instructions are slow, and the
  target's greedy output is compared in float32), except a drafter's on a CPU with bf16
  dot-product instructions (:func:`cpu_native_bf16`), which is bfloat16: a drafter's dtype
  changes only how often its drafts are accepted, never the output, and there its block costs
  about half (docs/bench/trees-history/README.md, "Row counts and the drafter's dtype").

A device that is not there is refused when the service starts, naming the flag
(:class:`DeviceError`, a ``FieldError``), before any weight is read. :func:`to_device` is the
one host-to-device copy of the step path: pinned and asynchronous on CUDA, so building a mask
or a token tensor on the host never waits for the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

import torch

from dflash.core.errors import FieldError
from dflash.core.flags import DEVICE_FLAGS, DTYPE_FLAGS

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


class DeviceError(FieldError):
    """``--device`` / ``--dtype`` (``field``) names a device or dtype this process cannot use."""


def device_flag(text: str) -> str:
    """argparse ``type`` of ``--device``: the spelling only (whether the GPU exists is checked
    by :func:`resolve_device` at start, so ``--help`` and config tests run anywhere)."""
    text = text.strip()
    if not _DEVICE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r}: use one of {', '.join(DEVICE_FLAGS)}")
    return text


def dtype_flag(text: str) -> str:
    """argparse ``type`` of ``--dtype``."""
    text = text.strip().replace("torch.", "")
    if text not in DTYPE_FLAGS:
        raise argparse.ArgumentTypeError(f"{text!r}: use one of {', '.join(DTYPE_FLAGS)}")
    return text


def add_device_args(p: argparse.ArgumentParser, what: str) -> None:
    """``--device`` [DFLASH_DEVICE] and ``--dtype`` [DFLASH_DTYPE] (module docstring); both
    default to ``auto``."""
    env = os.environ.get
    p.add_argument("--device", type=device_flag, default=env("DFLASH_DEVICE", "auto"),
                   help=f"where the {what} runs: auto (cuda:0 when a GPU is visible, else cpu), "
                        "cpu, cuda (= cuda:0) or cuda:N; a GPU that is not there is refused at "
                        "start [DFLASH_DEVICE]")
    p.add_argument("--dtype", type=dtype_flag, default=env("DFLASH_DTYPE", "auto"),
                   help="weights and compute dtype: auto (the checkpoint's dtype on a GPU; "
                        "on a CPU float32, or bfloat16 for a drafter where the CPU has bf16 "
                        "instructions), bfloat16, float16 or float32 [DFLASH_DTYPE]")


def resolve_device(flag: str | torch.device, *, field: str = "--device") -> torch.device:
    """``--device`` -> the device this process uses (module docstring).

    Raises:
        DeviceError: naming ``field``, for a malformed value, ``cuda`` / ``cuda:N`` when torch
            sees no GPU, or ``N >= torch.cuda.device_count()``.
    """
    if isinstance(flag, torch.device):
        flag = str(flag)
    text = flag.strip()
    if not _DEVICE.fullmatch(text):
        raise DeviceError(field, f"{flag!r}: use one of {', '.join(DEVICE_FLAGS)}")
    if text == "cpu":
        return torch.device("cpu")
    available = torch.cuda.is_available()
    if text == "auto":
        return torch.device("cuda", 0) if available else torch.device("cpu")
    if not available:
        raise DeviceError(field, f"{text}: no CUDA device is visible to torch "
                                 f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); "
                                 "use --device cpu or auto")
    index = int(text.partition(":")[2] or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(field, f"{text}: only {count} CUDA device(s) visible "
                                 f"(cuda:0..cuda:{count - 1})")
    return torch.device("cuda", index)


def checkpoint_dtype(path: str | Path) -> str | None:
    """The dtype a checkpoint directory declares (config.json ``dtype``, else ``torch_dtype``,
    also inside ``text_config``), or None when it declares none."""
    f = Path(path) / "config.json"
    if not f.is_file():
        return None
    cfg = json.loads(f.read_text())
    for c in (cfg, cfg.get("text_config") or {}):
        name = c.get("dtype") or c.get("torch_dtype")
        if isinstance(name, str):
            return name.replace("torch.", "")
    return None


def cpu_native_bf16() -> bool:
    """Whether this CPU has bfloat16 dot-product instructions: ``avx512_bf16`` or ``amx_bf16``
    among the flags of ``/proc/cpuinfo`` (False where there is no such file). Without them torch
    emulates bf16 products, slower than float32."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(flag: str | torch.dtype, checkpoint: str | None, device: torch.device, *,
                  field: str = "--dtype", cpu_bf16: bool = False) -> torch.dtype:
    """``--dtype`` -> the dtype of the weights and the compute (module docstring).

    ``checkpoint``: the checkpoint's declared dtype (:func:`checkpoint_dtype`); ``auto`` on a
    GPU takes it (float32 when it declares none or one outside bfloat16 / float16 / float32).
    ``cpu_bf16``: ``auto`` on a CPU is bfloat16 when the CPU has bf16 instructions
    (:func:`cpu_native_bf16`; a drafter), else float32.

    Raises:
        DeviceError: naming ``field`` for a dtype outside :data:`DTYPE_FLAGS`.
    """
    if isinstance(flag, torch.dtype):
        return flag
    name = flag.strip().replace("torch.", "")
    if name == "auto":
        if device.type == "cpu":
            return torch.bfloat16 if cpu_bf16 and cpu_native_bf16() else torch.float32
        return _DTYPES.get((checkpoint or "").replace("torch.", ""), torch.float32)
    if name not in _DTYPES:
        raise DeviceError(field, f"{flag!r}: use one of {', '.join(DTYPE_FLAGS)}")
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16"."""
    return str(dtype).replace("torch.", "")


def rank_devices(device: torch.device, ranks: int, *, field: str = "--ep-size"
                 ) -> list[torch.device]:
    """The device of each expert-parallel rank: on CUDA rank r runs on ``cuda:(i + r)`` for a
    resolved ``cuda:i`` (``cuda:r`` for the default ``cuda:0``), on a CPU every rank on the CPU.

    Raises:
        DeviceError: naming ``field`` when fewer GPUs are visible than the ranks need.
    """
    if device.type != "cuda":
        return [device] * ranks
    first = device.index or 0
    count = torch.cuda.device_count()
    if first + ranks > count:
        raise DeviceError(field, f"{ranks} ranks from {device} need cuda:{first}..cuda:"
                                 f"{first + ranks - 1}; {count} CUDA device(s) visible")
    return [torch.device("cuda", first + r) for r in range(ranks)]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``. On CUDA through pinned memory without blocking the host:
    a pageable copy would wait for every kernel queued before it (a synchronisation per mask
    and token tensor of every step); pinned blocks come from torch's caching host allocator,
    which keeps each one until its copy has run."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (timings); a no-op on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
