"""Which caller owns each session of an internal service, so that only it may act on it.

The owner is the identity on the client certificate of the call that first named the session
(``dflash.serving.authz.caller_identity``: its SAN URI): on the verifier the gateway whose
Generate opened it (Generate and CloseSession from another identity are refused), on a drafter
the verifier whose Draft stream sent it (items and releases from another are refused). Several
replicas sharing one identity share their sessions; replicas with identities of their own
(``--tls-peer-ids gateway=A,gateway=B``) cannot touch each other's. A call without a client
certificate (no mTLS: local development) is never checked.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import ClassVar

from dflash.core.errors import PreconditionError

# Far above any --max-sessions: the least recently named sessions (long expired in the engines,
# whose TTL and LRU bounds drop them) are forgotten first.
MAX_OWNERS = 16384


class NotOwner(PreconditionError):
    """A session named by a caller other than its owner: PERMISSION_DENIED naming session_id."""

    status: ClassVar[str] = "PERMISSION_DENIED"


class SessionOwners:
    """session id -> owner identity, bounded (least recently named forgotten first)."""

    def __init__(self, max_entries: int = MAX_OWNERS):
        self.max_entries = max_entries
        self._owners: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._owners)

    def claim(self, session_id: str, caller: str | None) -> None:
        """Record ``caller`` as the owner of ``session_id`` unless it has another. Raises
        NotOwner when another identity owns it; no-op for ``caller`` None or a one-shot
        request (empty ``session_id``)."""
        if caller is None or not session_id:
            return
        with self._lock:
            owner = self._owners.get(session_id)
            if owner is not None and owner != caller:
                raise NotOwner("session_id", "belongs to another caller of this service")
            self._owners[session_id] = caller
            self._owners.move_to_end(session_id)
            while len(self._owners) > self.max_entries:
                self._owners.popitem(last=False)

    def check(self, session_id: str, caller: str | None) -> None:
        """Raises NotOwner when an identity other than ``caller`` owns ``session_id``."""
        if caller is None:
            return
        with self._lock:
            owner = self._owners.get(session_id)
        if owner is not None and owner != caller:
            raise NotOwner("session_id", "belongs to another caller of this service")

    def forget(self, session_id: str) -> None:
        with self._lock:
            self._owners.pop(session_id, None)

    def release(self, session_ids, caller: str | None) -> list[str]:
        """The ids of ``session_ids`` that no other identity than ``caller`` owns, forgotten
        (what ``caller`` may release); every id for ``caller`` None."""
        out = []
        with self._lock:
            for sid in session_ids:
                owner = self._owners.get(sid)
                if caller is None or owner is None or owner == caller:
                    self._owners.pop(sid, None)
                    out.append(sid)
        return out
