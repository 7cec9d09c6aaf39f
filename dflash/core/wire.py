"""The one place where tensors cross to and from protobuf (``dflash.v1.Tensor``).

Layout: dtype name, shape, elements as little-endian bytes in row-major order. bfloat16 travels
as raw 2-byte words (viewed as int16), so no precision is lost and no conversion is paid.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from dflash.v1 import common_pb2

_TORCH = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
_NAME = {v: k for k, v in _TORCH.items()}
# Same-width integer views used to move bytes for dtypes numpy lacks.
_VIEW = {torch.bfloat16: torch.int16}
_LITTLE = sys.byteorder == "little"


class WireError(ValueError):
    """A Tensor message is malformed (unknown dtype, or bytes not matching the shape)."""


def to_proto(t: torch.Tensor) -> common_pb2.Tensor:
    """torch tensor (any device, contiguous or not) -> ``dflash.v1.Tensor``.

    A CUDA tensor is copied into pinned host memory (torch's caching host allocator: the same
    blocks are reused call after call) and its stream waited for once; the step path's taps are
    already on the host (``verifier_svc.tap_buffer``), as are the drafter's proposals."""
    if t.dtype not in _NAME:
        raise WireError(f"dtype {t.dtype} cannot travel on the wire")
    src = t.detach()
    if src.device.type == "cuda":
        src = src.to("cpu", non_blocking=True)        # pinned destination, see the docstring
        torch.cuda.current_stream(t.device).synchronize()
    src = src.to("cpu").contiguous()
    src = src.view(_VIEW.get(src.dtype, src.dtype))
    arr = src.numpy()
    if not _LITTLE:  # pragma: no cover - big-endian hosts
        arr = arr.byteswap()
    return common_pb2.Tensor(dtype=_NAME[t.dtype], shape=list(t.shape), data=arr.tobytes())


def from_proto(msg: common_pb2.Tensor, field: str = "tensor") -> torch.Tensor:
    """``dflash.v1.Tensor`` -> CPU torch tensor (a fresh, writable copy).

    Raises WireError naming ``field`` when the dtype is unknown or the byte count is wrong.
    """
    if msg.dtype not in _TORCH:
        raise WireError(f"{field}.dtype: unknown dtype {msg.dtype!r}")
    dtype = _TORCH[msg.dtype]
    shape = tuple(int(s) for s in msg.shape)
    if any(s < 0 for s in shape):
        raise WireError(f"{field}.shape: negative dimension in {shape}")
    carrier = _VIEW.get(dtype, dtype)
    itemsize = torch.empty((), dtype=carrier).element_size()
    count = int(np.prod(shape)) if shape else 1
    if len(msg.data) != count * itemsize:
        raise WireError(f"{field}.data: {len(msg.data)} bytes, shape {shape} of {msg.dtype} "
                        f"needs {count * itemsize}")
    np_dtype = torch.empty((), dtype=carrier).numpy().dtype.newbyteorder("<")
    arr = np.frombuffer(msg.data, dtype=np_dtype).reshape(shape)
    out = torch.from_numpy(arr.astype(np_dtype.newbyteorder("="), copy=True))
    return out.view(dtype) if carrier is not dtype else out
