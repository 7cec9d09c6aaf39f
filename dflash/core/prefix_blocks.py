"""The prefix cache's keys: chain hashes of a prompt's full blocks of token ids, salted by tenant.

One definition for everyone who keys prefixes: the verifier's prefix cache
(``verifier_svc.prefix_cache``) indexes its entries by them and publishes them in its KV events;
the gateway's router (``gateway.routing``) remembers which replica served which of them. Hashes
are Python's ``hash`` of tuples, so they are stable within one process only. The KV events
(``verifier_svc.kv_events``) carry :func:`stable_block_hashes` instead: the same chain over the
same tenant salt and token ids, as 64-bit BLAKE2b digests that any process can recompute
(docs/kv-events.md, "Hashes", gives the recipe).
"""

from __future__ import annotations

import hashlib
import struct
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


_ROOT_PERSON = b"dflash-kv-root"      # BLAKE2b personalisations: these digests are never
_BLOCK_PERSON = b"dflash-kv-block"    # confused with another use of BLAKE2b on the same bytes


def stable_root(tenant: str) -> bytes:
    """The 8-byte chain root of ``tenant``: BLAKE2b-64 of its UTF-8 bytes, personalised
    ``dflash-kv-root``."""
    return hashlib.blake2b(tenant.encode("utf-8"), digest_size=8, person=_ROOT_PERSON).digest()


def stable_block_hashes(tenant: str, tokens: Sequence[int], block: int = BLOCK, *,
                        upto: int | None = None) -> list[int]:
    """The chain hashes of ``tokens``' full blocks under ``tenant``'s salt, stable across
    processes and machines: hash i is BLAKE2b-64 (personalised ``dflash-kv-block``) of hash
    i - 1's 8 big-endian bytes (:func:`stable_root` for i = 0) followed by block i's ids as
    8-byte little-endian signed integers, read as an unsigned big-endian int (0 <= h < 2**64).
    A partial last block has none; ``upto``: only the first ``upto`` blocks.

    Raises:
        struct.error: a token id outside the signed 64-bit range.
    """
    n = len(tokens) // block if upto is None else min(upto, len(tokens) // block)
    prev, out = stable_root(tenant), []
    for i in range(n):
        ids = struct.pack(f"<{block}q", *tokens[i * block:(i + 1) * block])
        prev = hashlib.blake2b(prev + ids, digest_size=8, person=_BLOCK_PERSON).digest()
        out.append(int.from_bytes(prev, "big"))
    return out
