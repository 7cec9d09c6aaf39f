"""Building this project's C++ CPU kernels (``kernels/csrc``) once per machine and source.

Each extension is compiled on first use with the system's C++ compiler
(``torch.utils.cpp_extension.load``) into a folder under torch's extensions root named by a hash
of the source, torch's version and the flags: every checkout of the same source shares one
build, and a changed source builds anew. Where that fails (no compiler, no AVX-512) the loader
returns None and every caller keeps its other path.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("dflash.kernels.build")

#: The kernels' source folder.
CSRC = Path(__file__).with_name("csrc")
#: Flags of every AVX-512 extension (ATen's AVX512 capability implies F, BW, VL and DQ).
AVX512_CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-fopenmp"]


def build_directory(source: Path, cflags: list[str], stem: str) -> tuple[str, Path]:
    """The extension's module name and build folder: ``<stem>_<hash>`` under torch's
    extensions root (``TORCH_EXTENSIONS_DIR``), the hash over the source, torch's version and
    ``cflags``."""
    from torch.utils.cpp_extension import get_default_build_root

    tag = hashlib.sha256("\n".join([source.read_text(), torch.__version__, *cflags]).encode())
    name = f"{stem}_{tag.hexdigest()[:12]}"
    return name, Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / name


def load_avx512(source: Path, stem: str, cflags: list[str] | None = None) -> ModuleType | None:
    """The compiled extension of ``source``, or None where this CPU is not AVX-512 or the
    toolchain cannot build it (logged once as a warning).

    Built in :func:`build_directory` from a copy of the source kept there, under an exclusive
    ``flock`` that the kernel releases when its holder dies; torch's own lock file found under
    it is stale and removed (a build killed half-way would otherwise leave a lock every later
    start waits on forever)."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return None
    flags = AVX512_CFLAGS if cflags is None else cflags
    try:
        import fcntl

        from torch.utils.cpp_extension import load

        src = source.read_text()
        name, build = build_directory(source, flags, stem)
        build.mkdir(parents=True, exist_ok=True)
        with open(build.parent / f"{name}.flock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            (build / "lock").unlink(missing_ok=True)
            copy = build / source.name
            if not copy.exists() or copy.read_text() != src:
                copy.write_text(src)
            return load(name=name, sources=[str(copy)], build_directory=str(build),
                        extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:    # no compiler, headers or ninja: the other paths stay
        log.warning("%s unavailable: the extension did not build (%s)", stem, str(e)[:300])
        return None
