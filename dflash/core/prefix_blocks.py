"""The prefix cache's keys: chain hashes of a prompt's full blocks of token ids, salted by tenant.

One definition for everyone who keys prefixes: the verifier's prefix cache
(``verifier_svc.prefix_cache``) indexes its entries by them and publishes them in its KV events;
the gateway's router (``gateway.routing``) remembers which replica served which of them. Hashes
are Python's ``hash`` of tuples, so they are stable within one process only (a consumer in
another process matches them by the events' token ids, or within the stream it reads).
"""

from __future__ import annotations

from collections.abc import Sequence

BLOCK = 16            # tokens per hashed block (the lookup's granularity before the exact match)


def _root(tenant: str) -> int:
    return hash(("prefix-cache", tenant))


def block_hashes(tenant: str, tokens: Sequence[int], block: int = BLOCK) -> list[int]:
    """The chain hashes (Python ints) of ``tokens``' full blocks under ``tenant``'s salt: hash i
    covers tokens ``[0, (i + 1) * block)``; a partial last block has none."""
    h, out = _root(tenant), []
    for i in range(len(tokens) // block):
        h = hash((h, tuple(tokens[i * block:(i + 1) * block])))
        out.append(h)
    return out
