"""The gateway's verifier replicas: where they come from, their health and load, which one a
request goes to, and the stub every other part of the gateway calls.

Sources (:func:`parse_sources`): ``host:port`` (``--verifier``, repeatable), ``dns:///name:port``
(every address the name resolves to: a headless Service's pods, re-resolved every
``resolve_s``) and ``--verifiers-file`` (one ``host:port`` a line, ``# comments``; a line
``host:port drain`` marks it draining; re-read every ``resolve_s``, :data:`RESOLVE_S` by
default: a drain applies within that). Each replica has its own
channel and health watch (:class:`gateway.upstream.VerifierHealthWatch`: gRPC health, then the
verifier's ``Load``); the gateway is SERVING while at least one replica is eligible: healthy
and not draining (the verifier says so while it stops, or the file does). A draining replica
gets no new request and finishes its own streams.

:meth:`ReplicaSet.pick` routes one request (:mod:`gateway.routing`: by score, or round-robin
with ``routing="round-robin"``, ``--routing``); :meth:`ReplicaSet.failed`
takes a replica out at once when a call to it fails (its watch brings it back). As a stub the
set answers ``CheckDrafter`` (every healthy replica checks the drafter: each keeps its own list
of registered drafters), ``CloseSession`` (every healthy replica: a session may have moved)
and ``Describe`` (the first healthy one).
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc

from dflash.serving.server import channel_options
from dflash.serving.tls import ClientTLS, channel as tls_channel
from dflash.serving.tracing import InjectTraceContext
from dflash.v1 import verifier_pb2, verifier_pb2_grpc
from gateway.routing import ROUTINGS, Candidate, Choice, PrefixHistory, choose, round_robin
from gateway.status import UpstreamError
from gateway.upstream import FAST_RECONNECT, VerifierHealthWatch

log = logging.getLogger("dflash.gateway")
DNS = "dns:///"
MAX_STICKY = 1 << 16          # sessions remembered with their replica (least recent dropped)
RESOLVE_S = 1.0               # seconds between re-reads of the DNS names and --verifiers-file


@dataclasses.dataclass(frozen=True)
class Sources:
    """Where the replicas come from: fixed addresses, DNS names, a file."""

    addresses: tuple[str, ...] = ()
    dns: tuple[str, ...] = ()             # "name:port"
    file: str | None = None

    @property
    def dynamic(self) -> bool:
        return bool(self.dns or self.file)


def parse_sources(verifiers: Sequence[str], file: str | None = None) -> Sources:
    """``--verifier`` values (``host:port`` or ``dns:///name:port``; a value may hold several,
    comma separated) and ``--verifiers-file``. Raises ValueError naming ``--verifier`` for a
    value without a port, or when nothing is given."""
    addresses: list[str] = []
    dns: list[str] = []
    for v in verifiers:
        for item in (x.strip() for x in v.split(",")):
            if not item:
                continue
            target = item.removeprefix(DNS)
            host, _, port = target.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"--verifier: {item[:80]!r} is not host:port or dns:///name:port")
            (dns if item.startswith(DNS) else addresses).append(target)
    if not addresses and not dns and not file:
        raise ValueError("--verifier: give at least one verifier (or --verifiers-file)")
    return Sources(tuple(dict.fromkeys(addresses)), tuple(dict.fromkeys(dns)), file)


def read_file(path: str) -> dict[str, bool]:
    """``--verifiers-file``: address -> draining. Raises ValueError naming the file and line."""
    out: dict[str, bool] = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        host, _, port = words[0].rpartition(":")
        if not host or not port.isdigit() or len(words) > 2 or words[1:] not in ([], ["drain"]):
            raise ValueError(f"--verifiers-file: {path}:{n}: want 'host:port [drain]', got "
                             f"{line.strip()[:80]!r}")
        out[words[0]] = len(words) == 2
    return out


def resolve(name_port: str) -> list[str]:
    """Every address ``name:port`` resolves to (IPv6 in brackets), in a stable order; [] when
    it does not resolve (a Service with no ready pod yet)."""
    host, _, port = name_port.rpartition(":")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    out = []
    for family, *_rest, sockaddr in infos:
        ip = sockaddr[0]
        out.append(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    return sorted(dict.fromkeys(out))


class Replica:
    """One verifier: its channel, stub, health watch and this gateway's streams on it."""

    def __init__(self, address: str, raw: grpc.Channel):
        self.address = address
        self.raw = raw
        self.stub = verifier_pb2_grpc.VerifierStub(grpc.intercept_channel(raw, InjectTraceContext()))
        self.watch: VerifierHealthWatch | None = None
        self.drain = False                   # the operator's (--verifiers-file)
        self.open_streams = 0
        self.failures = 0                    # calls that failed on it (resumed or retried elsewhere)
        self.down_at: int | None = None      # the watch's check count when a call failed on it

    @property
    def healthy(self) -> bool:
        w = self.watch
        if w is None or w.healthy is not True:   # not checked yet: only a last resort (pick)
            return False
        # back after a failed call once a health check begun after the failure answered
        return self.down_at is None or w.checks >= self.down_at + 2

    @property
    def maybe_up(self) -> bool:
        """Not known to be down: healthy, or not checked yet (a drafter registered now must
        reach it too: its first SERVING answer may come before the registration)."""
        return self.healthy or self.watch is None or self.watch.healthy is None

    @property
    def draining(self) -> bool:
        load = self.watch.load if self.watch is not None else None
        return self.drain or bool(load is not None and load.draining)

    @property
    def eligible(self) -> bool:
        return self.healthy and not self.draining

    def state(self) -> str:
        """What keeps it out, for an error message ("" = eligible)."""
        if not self.healthy:
            return "unreachable or not SERVING"
        return "draining" if self.draining else ""

    def candidate(self) -> Candidate:
        load = self.watch.load if self.watch is not None else None
        return Candidate(self.address, waiting=load.waiting if load else 0,
                         running=load.running if load else 0,
                         kv_cache_usage=load.kv_cache_usage if load else 0.0,
                         open_streams=self.open_streams)


class NoReplica(UpstreamError):
    """No eligible replica is left for a request: UNAVAILABLE naming each and why."""

    def __init__(self, why: dict[str, str]):
        names = "; ".join(f"{a} ({w})" for a, w in why.items()) or "none configured"
        super().__init__(grpc.StatusCode.UNAVAILABLE, f"verifier: no replica available: {names}")
        self.why = why


class ReplicaSet:
    """The replicas of ``sources`` (module docstring). Call :meth:`start` once the gateway's
    ``rt`` exists; ``on_serving(replica)`` runs each time a replica is SERVING again after it
    was not (re-register the drafters there). ``routing``: one of
    :data:`gateway.routing.ROUTINGS`. Raises ValueError naming ``routing`` for another, or for
    an unreadable file."""

    def __init__(self, sources: Sources, *, upstream_tls: ClientTLS | None = None,
                 interval_s: float = 0.1, timeout_s: float = 0.5, resolve_s: float = RESOLVE_S,
                 history: PrefixHistory | None = None, routing: str = "score"):
        if routing not in ROUTINGS:
            raise ValueError(f"routing: one of {', '.join(ROUTINGS)}, got {routing!r}")
        self.sources, self.upstream_tls, self.routing = sources, upstream_tls, routing
        self.interval_s, self.timeout_s, self.resolve_s = interval_s, timeout_s, resolve_s
        self.history = history or PrefixHistory()
        self.replicas: dict[str, Replica] = {}
        self.routed: dict[str, int] = {}                  # address -> requests routed there
        self._sticky: OrderedDict[str, str] = OrderedDict()   # session key -> address
        self._lock = threading.Lock()
        self._turn = 0
        self._rt = None
        self.on_serving: Callable[[Replica], object] | None = None
        self._thread: threading.Thread | None = None
        self._published: bool | None = None
        self.refresh()                                   # the fixed ones now, a bad file fails here

    # ------------------------------------------------------------------ membership
    def _wanted(self) -> dict[str, bool]:
        """address -> drained by the operator, from every source now."""
        want = {a: False for a in self.sources.addresses}
        for name in self.sources.dns:
            for a in resolve(name):
                want.setdefault(a, False)
        if self.sources.file:
            for a, drain in read_file(self.sources.file).items():
                want[a] = want.get(a, False) or drain
        return want

    def refresh(self) -> None:
        """Re-read the sources: replicas join and leave, the file's drains apply. Raises
        ValueError for an unreadable file line, OSError for an unreadable file."""
        want = self._wanted()
        with self._lock:
            gone = [r for a, r in self.replicas.items() if a not in want]
            for r in gone:
                del self.replicas[r.address]
            for a, drain in want.items():
                known = self.replicas.get(a)
                if known is None:
                    known = self.replicas[a] = Replica(a, tls_channel(
                        a, self.upstream_tls, options=channel_options() + FAST_RECONNECT))
                    if self._rt is not None:
                        self._watch(known)
                if known.drain != drain:
                    log.warning("verifier %s: %s by --verifiers-file", a,
                                "draining" if drain else "no longer draining")
                known.drain = drain
        for r in gone:
            log.warning("verifier %s left the replica set", r.address)
            if r.watch is not None:
                r.watch.stopped.set()
            self.history.forget(r.address)
        if gone or self._rt is not None:
            self._publish()

    def _watch(self, r: Replica) -> None:
        def changed(ok: bool) -> None:
            if not ok:
                self.history.forget(r.address)   # a restart loses its cache
            self._publish()

        def serving() -> None:
            if self.on_serving is not None:
                self.on_serving(r)

        r.watch = VerifierHealthWatch(self._rt, r.raw, interval_s=self.interval_s,
                                      timeout_s=self.timeout_s, on_change=changed,
                                      on_check=self._publish,
                                      on_serving=serving, name=f"verifier {r.address}")

    def start(self, rt, on_serving: Callable[[Replica], object] | None = None) -> None:
        """Watch every replica for ``rt`` (its ``set_upstream``: SERVING while one is eligible;
        the watches end with its server)."""
        self._rt, self.on_serving = rt, on_serving
        with self._lock:
            for r in self.replicas.values():
                self._watch(r)
        self._publish()
        self._thread = threading.Thread(target=self._resolve_loop, daemon=True,
                                        name="verifier-replicas")
        self._thread.start()

    def _resolve_loop(self) -> None:
        assert self._rt is not None
        while self._rt.server.wait_for_termination(self.resolve_s):   # True: still running
            if self.sources.dynamic:
                try:
                    self.refresh()
                except (OSError, ValueError) as e:
                    log.warning("verifier replicas: %s (keeping the last set)", e)
            self._publish()       # a draining replica's reports change eligibility too

    def _publish(self) -> None:
        """The gateway's health: SERVING while a replica is eligible (set only on a change)."""
        if self._rt is not None:
            with self._lock:
                ok = any(r.eligible for r in self.replicas.values())
                changed, self._published = ok != self._published, ok
            if changed:
                self._rt.set_upstream(ok)

    # ------------------------------------------------------------------ routing
    def pick(self, tenant: str, prompt: Sequence[int], session: str = "",
             exclude: frozenset[str] = frozenset()) -> tuple[Replica, Choice]:
        """The replica for one request (or its retry: ``exclude`` the ones that failed it), its
        stream counted open there until :meth:`release`: an eligible one, else (none is) one
        not draining that health calls down (it may answer: a verifier without the health
        service; a dead one fails at once). Raises NoReplica naming every replica and why it is
        out."""
        rr = self.routing == "round-robin"     # no prefix, no session: nothing to look up
        hashes = [] if rr else self.history.hashes(tenant, prompt)
        matched = self.history.matched(hashes)
        with self._lock:
            pool = [r for a, r in self.replicas.items() if a not in exclude and r.eligible]
            if not pool:    # last resort, never a draining one: a dead channel fails at once
                pool = [r for a, r in self.replicas.items()
                        if a not in exclude and not r.draining]
            if not pool:
                raise NoReplica({a: "failed this request" if a in exclude else r.state() or "?"
                                 for a, r in self.replicas.items()})
            sticky = self._sticky.get(session) if session and not rr else None
            self._turn += 1
            c = round_robin([r.candidate() for r in pool], self._turn) if rr else choose(
                [r.candidate() for r in pool], matched, len(hashes), turn=self._turn, sticky=sticky)
            r = self.replicas[c.address]
            r.open_streams += 1
            self.routed[r.address] = self.routed.get(r.address, 0) + 1
            if session and not rr:
                self._sticky[session] = r.address
                self._sticky.move_to_end(session)
                while len(self._sticky) > MAX_STICKY:
                    self._sticky.popitem(last=False)
        if not rr:
            self.history.record(hashes, r.address)
        return r, c

    def served(self, r: Replica, tenant: str, ids: Sequence[int]) -> None:
        """``r`` finished a request whose prompt and output are ``ids``: the verifier's prefix
        cache now holds the output's blocks too, so the conversation's next turn (which resends
        them) matches beyond the prompt routed here (score routing only)."""
        if self.routing != "round-robin":
            self.history.record(self.history.hashes(tenant, ids), r.address)

    def routed_counts(self) -> dict[str, int]:
        """address -> requests routed there since start (each retry and resume counts once
        more, on the replica it went to)."""
        with self._lock:
            return dict(self.routed)

    def release(self, r: Replica) -> None:
        with self._lock:
            r.open_streams = max(0, r.open_streams - 1)

    def failed(self, r: Replica) -> None:
        """A call to ``r`` failed: out of routing until its health watch sees it SERVING."""
        with self._lock:
            r.failures += 1
            r.down_at = r.watch.checks if r.watch is not None else 0
        self.history.forget(r.address)
        self._publish()

    def forget_session(self, session: str) -> None:
        with self._lock:
            self._sticky.pop(session, None)

    def healthy(self) -> list[Replica]:
        with self._lock:
            return [r for r in self.replicas.values() if r.healthy]

    def maybe_up(self) -> list[Replica]:
        """The replicas not known to be down (:attr:`Replica.maybe_up`)."""
        with self._lock:
            return [r for r in self.replicas.values() if r.maybe_up]

    def __len__(self) -> int:
        return len(self.replicas)

    # ------------------------------------------------------------------ the stub
    def CheckDrafter(self, request, timeout=None):
        """Every replica not known to be down checks the drafter (the first answer is
        returned); with none, the first replica's (UNAVAILABLE while it is down). Raises the
        first replica's grpc.RpcError when every one refuses."""
        targets = self.maybe_up() or list(self.replicas.values())[:1]
        first: grpc.RpcError | None = None
        out = None
        for r in targets:
            try:
                res = r.stub.CheckDrafter(request, timeout=timeout)
                out = out or res
            except grpc.RpcError as e:
                first = first or e
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    raise                # the drafter does not fit the target: the same everywhere
                log.warning("verifier %s: CheckDrafter: %s", r.address, e.details())
        if out is None:
            assert first is not None
            raise first
        return out

    def CloseSession(self, request, timeout=None):
        existed = False
        for r in self.maybe_up():
            try:
                existed = r.stub.CloseSession(request, timeout=timeout).existed or existed
            except grpc.RpcError:
                log.warning("verifier %s: CloseSession failed", r.address)
        self.forget_session(request.session_id)
        return verifier_pb2.CloseSessionResponse(existed=existed)

    def Describe(self, request, timeout=None):
        targets = self.healthy() or list(self.replicas.values())[:1]
        return targets[0].stub.Describe(request, timeout=timeout)


__all__ = ["NoReplica", "Replica", "ReplicaSet", "Sources", "parse_sources", "read_file", "resolve"]
