"""One thread per process runs torch's multi-threaded (OpenMP) work.

Why: libgomp keeps a thread team per thread that ever ran a parallel region, and once the
process holds more OpenMP threads than CPUs it throttles the busy-wait of every team (to about a
thousand spins; libgomp ``do_spin``), so each of the hundreds of parallel regions in a forward
pays a sleep and a wake-up (a verifier that loaded on the main thread and decoded on its
scheduler thread ran its forwards much slower: ``docs/bench/perf-history/README.md``, "One
OpenMP team").

How: :func:`reserve` (the main thread, at start, before any torch work) sets torch's thread
count to 1, so loading and every other thread run single-threaded and create no team;
:func:`claim` (the one compute thread, when it starts) takes the threads for itself and puts the
default for threads started later back to 1.

torch semantics relied on (``aten/src/ATen/ParallelOpenMP.cpp``): ``torch.set_num_threads`` sets
the calling thread's OpenMP and MKL thread counts and a process-wide default; a thread takes the
default once, at its first ``get_num_threads`` or parallel region, and keeps its own count after.
"""

from __future__ import annotations

import threading

import torch


def reserve(threads: int = 0) -> int:
    """Call on the main thread before any torch work: torch runs single-threaded everywhere
    until :func:`claim`. Returns the thread count to claim later (``threads``, or torch's
    default when 0)."""
    n = threads or torch.get_num_threads()
    torch.set_num_threads(1)
    return n


def claim(threads: int, *, others: int = 1) -> None:
    """Make the calling thread run torch's parallel regions on ``threads`` threads, and every
    thread that has not run torch work yet on ``others`` (default 1: single-threaded).

    Raises:
        ValueError: ``threads`` or ``others`` < 1.
    """
    if threads < 1 or others < 1:
        raise ValueError(f"threads must be >= 1, got {threads} (others {others})")
    torch.set_num_threads(threads)
    torch.get_num_threads()              # this thread takes its count now (lazy init in torch)
    if threads != others:                # the process-wide default back to `others`, from a
        t = threading.Thread(target=torch.set_num_threads, args=(others,), name="threads-reset")
        t.start()                        # thread that exits at once (its own count dies with it)
        t.join()
