"""The gateway's link to its verifier: drafters registered through the verifier's check
(:func:`register_drafter`, again after a verifier restart: :func:`reregister_drafters`), and
honest health that follows the verifier's (:class:`VerifierHealthWatch`)."""

from __future__ import annotations

import logging
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dflash.v1 import verifier_pb2, verifier_pb2_grpc
from gateway.registry import DrafterAllowlist, DrafterEntry, DrafterRegistry, parse_spec

log = logging.getLogger("dflash.gateway")


def register_drafter(registry: DrafterRegistry, verifier, spec: str, *, name: str | None = None,
                     version: str | None = None, weight: float = 0.0, default: bool = False,
                     timeout_s: float = 60.0, allow: DrafterAllowlist | None = None) -> DrafterEntry:
    """Check ``spec`` ("[name@version=]host:port") with the verifier and register it.

    The verifier's CheckDrafter calls the drafter's Describe and applies the same checks it
    applies before speculating; the verifier then accepts this address in Generate requests.
    Raises gateway.registry.NotAllowed("address") when ``allow`` is given and the address is
    not in it (checked first: nothing contacts a refused address), grpc.RpcError:
    FAILED_PRECONDITION (does not fit the target, the message names the field) or UNAVAILABLE
    (not reachable within ``timeout_s``).
    """
    label, address = parse_spec(spec)
    if allow is not None:
        allow.check(address)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            card = verifier.CheckDrafter(verifier_pb2.CheckDrafterRequest(address=address), timeout=10).card
            break
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    if label:
        lname, _, lversion = label.partition("@")
        name, version = name or lname, version or lversion or card.version
    entry = DrafterEntry(name=name or card.name, version=version or card.version, address=address,
                         weight=weight)
    registry.register(entry, default=default)
    log.info("registered drafter %s at %s (weight %g%s)", entry.label, address, weight,
             ", default" if default else "")
    return entry


def reregister_drafters(registry: DrafterRegistry, verifier) -> int:
    """CheckDrafter every registered address again (a restarted verifier forgot them and
    would refuse their Generate requests); returns how many the verifier accepted. A drafter
    it refuses now stays registered here: its requests fall back to no speculation."""
    ok = 0
    for e, _ in registry.entries():
        try:
            verifier.CheckDrafter(verifier_pb2.CheckDrafterRequest(address=e.address), timeout=5)
            ok += 1
        except grpc.RpcError as err:
            log.warning("re-registering drafter %s at %s: %s", e.label, e.address, err.details())
    return ok


# The verifier's channel retries a lost connection at least every 200 ms (gRPC's default
# back-off grows to minutes), so a restarted verifier is used again within the watch's 0.5 s.
FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                  ("grpc.max_reconnect_backoff_ms", 200)]


class VerifierHealthWatch:
    """Honest health: the gateway reports SERVING only while its verifier does.

    A background thread checks the verifier's ``grpc.health.v1`` (overall status) every
    ``interval_s`` over the channel requests use, each check bounded by ``timeout_s``, and sets
    ``rt.set_upstream`` (or calls ``on_change(ok)`` instead, when given: one replica of several,
    ``gateway.replicas``): NOT_SERVING while the verifier is unreachable, slow to answer or not
    SERVING, SERVING again on the first good answer; ``on_check()`` runs after every check.
    After a good answer it reads the verifier's ``Load`` (``load``: the last ``LoadReport``, None when it has none: an older
    verifier). No request waits for it. The thread ends when the gateway's server stops
    (``wait_for_termination``). ``on_serving`` runs (on the thread) each time the verifier is
    SERVING after it was not, its first SERVING answer included: a replica that joins after
    the drafters were registered (a new pod behind ``dns:///``) must learn them too.
    """

    def __init__(self, rt, channel: grpc.Channel, *, interval_s: float = 0.1,
                 timeout_s: float = 0.5, on_serving=None, on_change=None, on_check=None,
                 name: str = "verifier"):
        self.rt, self.interval_s, self.timeout_s = rt, interval_s, timeout_s
        self.on_serving = on_serving
        self.on_change = on_change or rt.set_upstream
        self.on_check = on_check      # after every check (a replica's load may change its routing)
        self.name = name
        self._stub = health_pb2_grpc.HealthStub(channel)
        self._verifier = verifier_pb2_grpc.VerifierStub(channel)
        self.healthy: bool | None = None      # None until the first check
        self.load: verifier_pb2.LoadReport | None = None
        self.checks = 0
        self.stopped = threading.Event()      # set: this replica left the set, the thread ends
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"{name}-health")
        self._thread.start()

    def check(self) -> bool:
        try:
            r = self._stub.Check(health_pb2.HealthCheckRequest(), timeout=self.timeout_s)
            ok = r.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False
        if ok:
            try:
                self.load = self._verifier.Load(verifier_pb2.LoadRequest(), timeout=self.timeout_s)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNIMPLEMENTED:   # an older verifier: no load
                    return False
        return ok

    def _run(self) -> None:
        while True:
            ok = self.check()
            self.checks += 1
            if ok != self.healthy:
                if self.healthy is not None or not ok:
                    log.warning("%s %s", self.name, "SERVING" if ok else "not SERVING")
                if ok and self.on_serving is not None:
                    self.on_serving()    # before SERVING: a new or restarted verifier knows the drafters
                self.healthy = ok
                self.on_change(ok)
            if self.on_check is not None:
                self.on_check()
            if self.stopped.is_set() or not self.rt.server.wait_for_termination(self.interval_s):
                return   # left the set, or the gateway's server stopped
