"""Verifier process: load the target, warm up, serve, expire idle sessions, drain on SIGTERM."""

from __future__ import annotations

import logging
import os
import threading
import time

from dflash.core.cards import TargetCard
from dflash.core.device import DeviceError
from dflash.serving.metrics import AdmissionMetrics, BreakerGauges, ModelServerGauges
from dflash.serving.server import (
    BindError,
    add_health_listener,
    create_server,
    run_until_signal,
    server_tls_from_args,
    upstream_tls_from_args,
)
from dflash.serving.telemetry import Telemetry, serve_metrics
from dflash.serving.tls import TLSConfigError
from dflash.serving.tracing import server_interceptors
from dflash.v1 import verifier_pb2, verifier_pb2_grpc
from verifier_svc.breaker import BreakerConfig
from verifier_svc.flags import drafter_aliases, max_streams, parse_args, parse_budgets, rank_devices_of
from verifier_svc.load import load_of
from verifier_svc.observe import ObservedVerifierServicer, VerifierObserver
from verifier_svc.scheduler import Admission
from verifier_svc.servicer import DrafterPool
from verifier_svc.suffix_drafts import AnswerStore

SERVICE = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name
# The role each RPC needs on an mTLS port (dflash/serving/authz.py): every one is the gateway's
# (CheckDrafter dials an address, CloseSession drops a session, Generate feeds drafters).
AUTHZ = {f"/{SERVICE}/Describe": "gateway", f"/{SERVICE}/Generate": "gateway",
         f"/{SERVICE}/Load": "gateway",
         f"/{SERVICE}/CheckDrafter": "gateway", f"/{SERVICE}/CloseSession": "gateway"}
log = logging.getLogger("dflash.verifier")


def build(engine, bind: str, *, draft_timeout_s: float = 2.0, wire_dtype=None,
          telemetry: Telemetry | None = None, streams: int = 0,
          breaker: BreakerConfig = BreakerConfig(), tls=None, upstream_tls=None):
    """An unstarted server for ``engine`` (None while loading) bound to ``bind``; TLS when
    ``tls`` (``dflash.serving.tls.ServerTLS``), to drafters over TLS when ``upstream_tls``
    (``dflash.serving.tls.ClientTLS``).

    ``streams``: Generate streams open at once (``dflash.serving.server.StreamLimit``), 0 = the
    engine's batch and waiting bounds plus ``STREAM_SLACK`` (or 512 while loading).
    """
    telemetry = telemetry or Telemetry(service="verifier")
    pool = (DrafterPool(engine, timeout_s=draft_timeout_s, wire_dtype=wire_dtype, breaker=breaker,
                        tls=upstream_tls) if engine else None)
    observer = VerifierObserver(telemetry)
    servicer = ObservedVerifierServicer(engine, pool, observer)
    if not streams and engine is not None:
        s = engine.scheduler
        streams = max_streams(s.max_batch, s.admission.max_waiting)
    rt = create_server(bind, lambda s: verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, s),
                       (SERVICE,), max_streams=streams or 512, tls=tls, authz=AUTHZ,
                       interceptors=server_interceptors(telemetry.tracer_provider))
    rt.servicer = servicer
    servicer.admission_metrics = admission = AdmissionMetrics(telemetry.registry, lambda: servicer.engine)
    BreakerGauges(telemetry.registry, lambda: servicer.pool.proposers() if servicer.pool else [])
    ModelServerGauges(telemetry.registry,
                      lambda: load_of(servicer.engine) if servicer.engine is not None else None)
    # loaded and NOT_SERVING: SIGTERM's drain (run_until_signal), finishing its own streams
    servicer.draining = lambda: servicer.engine is not None and not rt.serving
    if engine is not None:
        engine.scheduler.queue_wait_listeners.append(admission.observe_queue_wait)
    return rt


def attach(rt, engine, *, draft_timeout_s: float = 2.0, wire_dtype=None,
           breaker: BreakerConfig = BreakerConfig(), upstream_tls=None,
           drafter_aliases: dict[str, str] | None = None) -> None:
    rt.servicer.engine = engine
    rt.servicer.pool = DrafterPool(engine, timeout_s=draft_timeout_s, wire_dtype=wire_dtype,
                                   breaker=breaker, tls=upstream_tls, aliases=drafter_aliases)
    rt.servicer.observer.bind(engine)
    engine.scheduler.queue_wait_listeners.append(rt.servicer.admission_metrics.observe_queue_wait)


def main(argv=None) -> None:
    from dflash.serving.threads import reserve

    logging.basicConfig(level=os.environ.get("DFLASH_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    a = parse_args(argv)
    try:
        tls, upstream_tls = server_tls_from_args(a), upstream_tls_from_args(a)
        devices = rank_devices_of(a)      # a GPU that is not there: refused before anything loads
    except (TLSConfigError, DeviceError) as e:
        raise SystemExit(f"python -m verifier_svc: error: {e}") from None
    threads = reserve(a.threads)   # loading runs single-threaded; the scheduler claims these
    telemetry = Telemetry.from_env("verifier")
    rt = _listen_while_loading(a, telemetry, tls)
    target = load_target(a, devices, on_failure=lambda reason: rt.set_serving(False))
    engine = _engine_of(a, target, threads)
    events = start_kv_events(a, engine.prefix_cache, "GPU" if target.device.type == "cuda" else "CPU",
                             telemetry.registry)
    _warmup(engine)
    _attach_drafters(rt, engine, a, upstream_tls)
    stop = _start_sweeper(engine, a.session_ttl)
    stop_log = rt.servicer.observer.speclog.start(a.spec_log_interval)
    rt.set_serving(True)
    log.info("SERVING %s on port %d", a.target, rt.port)
    close = target.close   # expert parallel: stop the other ranks
    def on_stop() -> None:
        stop.set()
        stop_log.set()
        close()
        if events is not None:
            events.close()
        telemetry.shutdown()

    run_until_signal(rt, a.grace, on_stop=on_stop)


def _listen_while_loading(a, telemetry: Telemetry, tls):
    """The server of the flags ``a``, started NOT_SERVING so health answers while the target
    loads, with its health listener and metrics endpoint; a port it cannot bind exits naming
    it."""
    rt = build(None, a.bind, telemetry=telemetry,
               streams=max_streams(a.max_batch, a.max_waiting, a.max_streams), tls=tls)
    try:
        add_health_listener(rt, a.health_bind)
    except BindError as e:          # the port: taken, out of range, unparsable
        raise SystemExit(f"python -m verifier_svc: error: {e}") from None
    rt.server.start()
    if a.metrics_port:
        serve_metrics(telemetry.registry, a.metrics_port, a.metrics_host)
    log.info("listening on port %d (NOT_SERVING while loading)", rt.port)
    return rt


def _engine_of(a, target, threads: int):
    """The engine over ``target`` with the session, speculation, suffix and batch flags of
    ``a``; its scheduler thread claims ``threads`` compute threads."""
    from verifier_svc.engine import VerifierEngine
    from verifier_svc.prefix_reuse import new_prefix_cache, read_shared

    cache = None
    if a.prefix_cache == "on" and target.supports_fork:
        try:
            shared = read_shared(a.prefix_cache_shared, target.vocab_size) \
                if a.prefix_cache_shared else []
        except ValueError as e:
            raise SystemExit(f"python -m verifier_svc: error: {e}") from None
        cache = new_prefix_cache(target.pool, a.prefix_cache_mb, shared)
    return VerifierEngine(target, session_ttl_s=a.session_ttl, spec_mode=a.spec_mode,
                          prefill_chunk=a.prefill_chunk, max_batch=a.max_batch,
                          context_flush=a.context_flush, max_unread=a.max_unread_events,
                          threads=threads, tree_budget=a.tree_budget,
                          tree_budgets=parse_budgets(a.tree_budgets), tree_max_batch=a.tree_max_batch,
                          mode_race=a.mode_race == "on", suffix=a.suffix == "on",
                          answers=AnswerStore(a.suffix_answer_tokens, a.suffix_answer_total,
                                              corpus=corpus_of(a, target)),
                          admission=Admission(max_waiting=a.max_waiting,
                                              max_waiting_tokens=a.max_waiting_tokens),
                          prefix_cache=cache)


def start_kv_events(a, cache, medium: str, registry=None):
    """The KV-events publisher of the flags ``a`` (``--kv-events-*``) attached to ``cache``, its
    counters on ``registry``; None with the flags off (no socket opened) or without a cache.
    ``medium``: "GPU" or "CPU", where the cached K/V lives. An endpoint on one of this
    verifier's own ports, or one that cannot be bound or connected, exits naming the flag."""
    if not (a.kv_events_endpoint or a.kv_events_connect):
        return None
    if cache is None:
        log.warning("--kv-events-endpoint: no prefix cache (--prefix-cache off, or an "
                    "expert-parallel target): no KV events")
        return None
    from verifier_svc.kv_events import KVEventPublisher, KVEventsConfig, KVEventsError, KVEventsMetrics

    own = {int(p) for p in (x.rpartition(":")[2] for x in (a.bind, a.health_bind)) if p.isdigit()}
    own.add(a.metrics_port)
    for flag, text in (("--kv-events-endpoint", a.kv_events_endpoint),
                       ("--kv-events-replay-endpoint", a.kv_events_replay_endpoint)):
        for ep in filter(None, text.split(",")):
            port = ep.rpartition(":")[2]
            if ep.startswith("tcp://") and port.isdigit() and int(port) in own - {0}:
                raise SystemExit(f"python -m verifier_svc: error: {flag}: {ep} is one of this "
                                 "verifier's own ports (gRPC, health or metrics)")
    config = KVEventsConfig(endpoint=a.kv_events_endpoint, connect=a.kv_events_connect,
                            topic=a.kv_events_topic, replay_endpoint=a.kv_events_replay_endpoint,
                            encoding=a.kv_events_encoding, max_queue_size=a.kv_events_queue)
    try:
        publisher = KVEventPublisher(config, block=cache.block, medium=medium)
    except KVEventsError as e:
        raise SystemExit(f"python -m verifier_svc: error: {e}") from None
    cache.attach_events(publisher)
    if registry is not None:
        KVEventsMetrics(registry, publisher)
    log.info("KV events on %s", ", ".join(publisher.endpoints))
    return publisher


def _attach_drafters(rt, engine, a, upstream_tls) -> None:
    """Hand ``engine`` to the started server ``rt`` with a drafter pool and the drafter flags
    of ``a`` (deadlines, breaker, wire dtype, registration, tenants never learned from)."""
    from dflash.core.checkpoint import torch_dtype

    breaker = BreakerConfig(a.breaker_failures, a.breaker_probe_interval, a.draft_deadline_floor)
    attach(rt, engine, draft_timeout_s=a.draft_timeout,
           wire_dtype=torch_dtype(a.wire_dtype) if a.wire_dtype else None, breaker=breaker,
           upstream_tls=upstream_tls, drafter_aliases=drafter_aliases(a))
    for named, dialed in drafter_aliases(a).items():
        log.info("drafter %s is dialed at %s (--drafter-alias)", named, dialed)
    rt.servicer.require_registered = not a.allow_unregistered_drafters
    rt.servicer.no_learn_tenants = frozenset(t for t in a.no_learn_tenants.split(",") if t)


def _start_sweeper(engine, session_ttl_s: float) -> threading.Event:
    """Expire ``engine``'s idle sessions on a background thread, every half ``session_ttl_s``
    (at most 30 s apart), until the returned event is set."""
    stop = threading.Event()

    def sweeper():
        while not stop.wait(min(30.0, session_ttl_s / 2)):
            n = engine.expire_sessions()
            if n:
                log.info("expired %d idle sessions", n)

    threading.Thread(target=sweeper, daemon=True, name="session-sweeper").start()
    return stop


def corpus_of(a, target: TargetCard):
    """The ``--suffix-corpus`` index (None without one or with ``--suffix off``), checked against
    ``target``'s fingerprint; a bad folder exits naming the flag."""
    if not a.suffix_corpus or a.suffix != "on":
        return None
    from dflash.core.token_shards import DataError
    from verifier_svc.suffix_corpus import load_corpus

    t0 = time.perf_counter()
    try:
        index = load_corpus(a.suffix_corpus, max_tokens=a.suffix_corpus_tokens,
                            fingerprint=target.fingerprint)
    except DataError as e:
        raise SystemExit(f"python -m verifier_svc: error: {e}") from None
    log.info("suffix corpus: %d tokens from %s in %.1f s (%.0f MB)", len(index), a.suffix_corpus,
             time.perf_counter() - t0, index.nbytes / 2**20)
    return index


def load_target(a, devices, *, on_failure=None):
    """One rank (TargetModel) or ``--ep-size`` ranks (verifier_svc.ep.DistributedTarget) on
    ``devices`` (:func:`rank_devices_of`), with the dtype and linear-layer paths of the flags
    ``a`` (:func:`parse_args`); the kernels are tuned later, on the thread that runs the
    forwards (``TargetModel.tune_skinny``). ``dflash diagnose`` loads what it prices with this
    function. ``on_failure(reason)``: called when an expert-parallel rank dies."""
    from kernels.invariant import resolve as resolve_invariant
    from verifier_svc.target import TargetModel

    if a.ep_size <= 1:
        from dflash.core.device import checkpoint_dtype, resolve_device, resolve_dtype

        dev = resolve_device(devices[0])
        invariant = resolve_invariant(a.batch_invariant, dev,
                                      resolve_dtype(a.dtype, checkpoint_dtype(a.target), dev))
        target = TargetModel(a.target, dtype=a.dtype, device=devices[0],
                             skinny_max_rows=a.skinny_max_rows, cuda_graphs=a.cuda_graphs,
                             packed_linear=a.packed_linear, panel_linear=a.panel_linear,
                             batch_invariant=invariant)
        log.info("target on %s in %s%s%s", target.device, target.dtype,
                 ", CUDA graphs" if a.cuda_graphs else "",
                 ", batch-invariant kernels" if invariant else "")
        return target
    if a.batch_invariant == "on":
        from dflash.core.device import DeviceError

        raise DeviceError("--batch-invariant", "not with --ep-size > 1 (the expert-parallel "
                          "ranks keep their own kernels)")
    from verifier_svc.ep import DistributedTarget

    shards = DistributedTarget(a.target, ep_size=a.ep_size, dtype=a.dtype, devices=devices,
                               threads=a.threads, timeout_s=a.ep_timeout,
                               skinny_max_rows=a.skinny_max_rows)
    if on_failure is not None:
        shards.on_failure.append(on_failure)
    return shards


def _warmup(engine) -> None:
    """Tune the skinny-product row limit and the prepacked product on the scheduler thread
    (``TargetModel.tune_skinny``; expert-parallel targets keep theirs), then one tiny request."""
    from verifier_svc.engine import Request

    engine.run_on_loop(engine.target.tune_skinny)

    for _ in engine.generate(Request(request_id="warmup", prompt=[0, 1, 2], max_tokens=2,
                                     ignore_eos=True)):
        pass
