"""What a router scores a verifier replica by: the Model Server Protocol's three gauges.

The Gateway API Inference Extension's endpoint picker (and llm-d's router) read
``vllm:num_requests_waiting``, ``vllm:num_requests_running`` and ``vllm:kv_cache_usage_perc``
from each model server's /metrics; our gateway reads the same figures from the ``Load`` RPC.
One function computes them for both (:func:`load_of`).
"""

from __future__ import annotations

from dflash.v1 import verifier_pb2


def load_of(engine, draining: bool = False) -> verifier_pb2.LoadReport:
    """``engine``'s load now (a ``VerifierEngine``; None while loading: an empty report).

    ``kv_cache_usage`` is the batch's K/V room in use, 0..1: the positions its requests may
    hold (prompt + max_tokens each, what their sequences grow to at most) over ``max_batch``
    rows of the context window. The pool grows with use instead of being allocated up front
    (``dflash.core.kv_pool``), so this is a reservation, as vLLM's fraction of KV blocks is."""
    if engine is None:
        return verifier_pb2.LoadReport(draining=draining)
    s = engine.scheduler
    waiting, running, positions = s.load()
    room = max(1, s.max_batch * engine.target.max_positions)
    return verifier_pb2.LoadReport(waiting=waiting, running=running,
                                   kv_cache_usage=min(1.0, positions / room),
                                   draining=draining, max_batch=s.max_batch)
