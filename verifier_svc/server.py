"""Verifier process: load the target, warm up, serve, expire idle sessions, drain on SIGTERM."""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time

from dflash.core.device import DeviceError, add_device_args
from dflash.core.speculation import MAX_TREE_BUDGET, MODE_ADAPTIVE, MODES
from dflash.serving.argtypes import at_least, in_range, int_list, one_of, positive_float
from dflash.serving.metrics import AdmissionMetrics, BreakerGauges
from dflash.serving.server import (
    BindError,
    add_common_args,
    add_compute_args,
    add_health_listener,
    add_upstream_tls_args,
    create_server,
    run_until_signal,
    server_tls_from_args,
    upstream_tls_from_args,
)
from dflash.serving.telemetry import Telemetry, serve_metrics
from dflash.serving.tls import TLSConfigError
from dflash.serving.tracing import server_interceptors
from dflash.v1 import verifier_pb2, verifier_pb2_grpc
from verifier_svc.drafter_client import BreakerConfig
from verifier_svc.observe import ObservedVerifierServicer, VerifierObserver
from verifier_svc.policy import DEFAULT_TREE_BUDGET, DEFAULT_TREE_BUDGETS, DEFAULT_TREE_MAX_BATCH
from verifier_svc.scheduler import Admission
from verifier_svc.servicer import DrafterPool
from verifier_svc.suffix_drafts import AnswerStore

SERVICE = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name
# The role each RPC needs on an mTLS port (dflash/serving/authz.py): every one is the gateway's
# (CheckDrafter dials an address, CloseSession drops a session, Generate feeds drafters).
AUTHZ = {f"/{SERVICE}/Describe": "gateway", f"/{SERVICE}/Generate": "gateway",
         f"/{SERVICE}/CheckDrafter": "gateway", f"/{SERVICE}/CloseSession": "gateway"}
log = logging.getLogger("dflash.verifier")
# Streams beyond the batch and the waiting queue: ones unwinding or being refused by admission
# (which gives the better retry hint) instead of by the stream limit.
STREAM_SLACK = 32


def max_streams(max_batch: int, max_waiting: int, flag: int = 0) -> int:
    """``--max-streams``, 0 = every admissible request (``max_batch + max_waiting``) plus
    ``STREAM_SLACK``."""
    return flag or max_batch + max_waiting + STREAM_SLACK


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
    if engine is not None:
        engine.scheduler.queue_wait_listeners.append(admission.observe_queue_wait)
    return rt


def attach(rt, engine, *, draft_timeout_s: float = 2.0, wire_dtype=None,
           breaker: BreakerConfig = BreakerConfig(), upstream_tls=None) -> None:
    rt.servicer.engine = engine
    rt.servicer.pool = DrafterPool(engine, timeout_s=draft_timeout_s, wire_dtype=wire_dtype,
                                   breaker=breaker, tls=upstream_tls)
    rt.servicer.observer.bind(engine)
    engine.scheduler.queue_wait_listeners.append(rt.servicer.admission_metrics.observe_queue_wait)


def parse_args(argv=None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="python -m verifier_svc", description="DFlash verifier (target) service")
    p.add_argument("--target", default=env("DFLASH_TARGET"), required=env("DFLASH_TARGET") is None,
                   help="Hugging Face model directory (safetensors) [DFLASH_TARGET]")
    p.add_argument("--bind", default=env("DFLASH_VERIFIER_BIND", "127.0.0.1:50051"),
                   help="host:port to listen on [DFLASH_VERIFIER_BIND]")
    add_device_args(p, "target (every expert-parallel rank: rank r on cuda:r)")
    p.add_argument("--cuda-graphs", action="store_true",
                   default=env("DFLASH_CUDA_GRAPHS", "") not in ("", "0", "false"),
                   help="replay decode and verify forwards from CUDA graphs captured per batch "
                        "shape (verifier_svc/graphs.py); CUDA only, one rank only; off by "
                        "default (docs/gpu.md) [DFLASH_CUDA_GRAPHS]")
    p.add_argument("--draft-timeout", type=float, default=float(env("DFLASH_DRAFT_TIMEOUT_S", "2.0")),
                   help="deadline per draft step, seconds; past it the step runs without "
                        "speculation [DFLASH_DRAFT_TIMEOUT_S]")
    p.add_argument("--wire-dtype", default=env("DFLASH_WIRE_DTYPE", ""),
                   help="dtype of context features sent to drafters (default: the target's, "
                        "so bfloat16 from a bfloat16 target) [DFLASH_WIRE_DTYPE]")
    p.add_argument("--session-ttl", type=float, default=float(env("DFLASH_SESSION_TTL_S", "600")),
                   help="idle session lifetime, seconds [DFLASH_SESSION_TTL_S]")
    p.add_argument("--spec-mode", default=env("DFLASH_SPEC_MODE", MODE_ADAPTIVE), type=one_of(MODES),
                   help="default speculation policy: off, fixed (always the block size), adaptive "
                        "(block length or tree budget per step from measured acceptance and "
                        "cost), tree (always a DDTree of --tree-budget nodes), suffix (trees of "
                        "continuations found earlier in the session and the tenant's answers; "
                        "no drafter needed) or hybrid (DDTree plus suffix branches); requests "
                        "may override with speculation.mode [DFLASH_SPEC_MODE]")
    p.add_argument("--suffix", default=env("DFLASH_SUFFIX", "on"), type=one_of(("on", "off")),
                   help="suffix candidates (docs/suffix.md): on = modes suffix and hybrid, "
                        "adaptive trees with suffix branches, and suffix trees when a drafter "
                        "fails or is absent; off = none of them (suffix/hybrid then verify "
                        "nothing / plain DDTrees) [DFLASH_SUFFIX]")
    p.add_argument("--suffix-answer-tokens", type=in_range(0, 1 << 24),
                   default=env("DFLASH_SUFFIX_ANSWER_TOKENS", "16384"),
                   help="tokens of recent answers kept per tenant (API key, else client address) "
                        "as suffix candidates for its later requests; 0 = none kept "
                        "[DFLASH_SUFFIX_ANSWER_TOKENS]")
    p.add_argument("--suffix-answer-total", type=in_range(0, 1 << 28),
                   default=env("DFLASH_SUFFIX_ANSWER_TOTAL", "262144"),
                   help="tokens of recent answers kept over all tenants (least recently used "
                        "tenants dropped first) [DFLASH_SUFFIX_ANSWER_TOTAL]")
    p.add_argument("--suffix-corpus", default=env("DFLASH_SUFFIX_CORPUS", ""),
                   help="a folder of token shards (dflash-tokens/1, e.g. data/train) whose answers "
                        "every tenant's suffix lookups read after its own: the target's earlier "
                        "answers; read-only, the operator's (docs/suffix.md) [DFLASH_SUFFIX_CORPUS]")
    p.add_argument("--suffix-corpus-tokens", type=in_range(0, 1 << 26),
                   default=env("DFLASH_SUFFIX_CORPUS_TOKENS", "524288"),
                   help="tokens of --suffix-corpus kept (about 240 bytes each) "
                        "[DFLASH_SUFFIX_CORPUS_TOKENS]")
    p.add_argument("--no-learn-tenants", default=env("DFLASH_NO_LEARN_TENANTS", ""),
                   help="comma-separated tenants (API key names) whose sessions a drafter with "
                        "--learn-dir never captures (docs/learning.md) [DFLASH_NO_LEARN_TENANTS]")
    p.add_argument("--tree-budget", type=in_range(1, MAX_TREE_BUDGET),
                   default=env("DFLASH_TREE_BUDGET", str(DEFAULT_TREE_BUDGET)),
                   help="nodes of a draft tree in mode tree when the request names none "
                        "[DFLASH_TREE_BUDGET]")
    p.add_argument("--tree-budgets", type=int_list(1, MAX_TREE_BUDGET), default=env("DFLASH_TREE_BUDGETS", ",".join(map(str, DEFAULT_TREE_BUDGETS))),
                   help="tree budgets (nodes) the adaptive policy may choose besides chains; "
                        f"each <= {MAX_TREE_BUDGET}; empty = chains only [DFLASH_TREE_BUDGETS]")
    p.add_argument("--tree-max-batch", type=in_range(0, 1 << 16),
                   default=env("DFLASH_TREE_MAX_BATCH", str(DEFAULT_TREE_MAX_BATCH)),
                   help="adaptive steps of more sessions than this verify chains only; 0 = any "
                        "batch (on a CPU trees paid at batch 1, not at 8 or 32: docs/trees.md) "
                        "[DFLASH_TREE_MAX_BATCH]")
    p.add_argument("--prefill-chunk", type=int, default=int(env("DFLASH_PREFILL_CHUNK", "256")),
                   help="prompt tokens prefilled between two decode steps of the running batch "
                        "[DFLASH_PREFILL_CHUNK]")
    p.add_argument("--max-batch", type=int, default=int(env("DFLASH_MAX_BATCH", "64")),
                   help="sessions verified together in one target forward [DFLASH_MAX_BATCH]")
    p.add_argument("--max-waiting", type=at_least(0), default=env("DFLASH_MAX_WAITING", "256"),
                   help="requests that may wait for a batch slot; past it a request is refused "
                        "at once with RESOURCE_EXHAUSTED and a retry hint (trailing metadata "
                        "retry-after-ms) [DFLASH_MAX_WAITING]")
    p.add_argument("--max-waiting-tokens", type=at_least(0),
                   default=env("DFLASH_MAX_WAITING_TOKENS", "0"),
                   help="prompt tokens not yet prefilled that may wait over all waiting "
                        "requests, 0 = unbounded; past it RESOURCE_EXHAUSTED "
                        "[DFLASH_MAX_WAITING_TOKENS]")
    p.add_argument("--max-streams", type=at_least(0), default=env("DFLASH_MAX_STREAMS", "0"),
                   help="Generate streams open at once (each holds a server thread; more are "
                        "refused with RESOURCE_EXHAUSTED, and health, Describe and session RPCs "
                        f"keep their own threads), 0 = max-batch + max-waiting + {STREAM_SLACK} "
                        "[DFLASH_MAX_STREAMS]")
    p.add_argument("--allow-unregistered-drafters", action="store_true",
                   default=env("DFLASH_ALLOW_UNREGISTERED_DRAFTERS", "") not in ("", "0", "false"),
                   help="speculate with any drafter address a request names; by default only "
                        "addresses that passed CheckDrafter (the gateway registers its drafters "
                        "so) receive a session's hidden states [DFLASH_ALLOW_UNREGISTERED_DRAFTERS]")
    p.add_argument("--breaker-failures", type=at_least(0),
                   default=env("DFLASH_BREAKER_FAILURES", "3"),
                   help="consecutive missed draft deadlines or failed draft calls that take a "
                        "drafter out of the step path (its sessions run without speculation "
                        "until a background probe is answered in time), 0 = never "
                        "[DFLASH_BREAKER_FAILURES]")
    p.add_argument("--breaker-probe-interval", type=positive_float,
                   default=env("DFLASH_BREAKER_PROBE_INTERVAL_S", "1.0"),
                   help="seconds between probes of a drafter out of the step path "
                        "[DFLASH_BREAKER_PROBE_INTERVAL_S]")
    p.add_argument("--draft-deadline-floor", type=positive_float,
                   default=env("DFLASH_DRAFT_DEADLINE_FLOOR_S", "0.05"),
                   help="seconds a step waits for its drafts at least, however little the cost "
                        "model says speculating is worth (at most --draft-timeout); a reply "
                        "this fast never counts against a drafter [DFLASH_DRAFT_DEADLINE_FLOOR_S]")
    p.add_argument("--context-flush", type=at_least(1), default=env("DFLASH_CONTEXT_FLUSH", "8"),
                   help="on steps without speculation, send a session's new context features to "
                        "its drafter once this many rows are unsent (1 = every step); a draft "
                        "request always carries the rest [DFLASH_CONTEXT_FLUSH]")
    p.add_argument("--max-unread-events", type=at_least(1),
                   default=env("DFLASH_MAX_UNREAD_EVENTS", "4096"),
                   help="events a request's reader may leave unread before the request is "
                        "cancelled with RESOURCE_EXHAUSTED; the decode loop never waits for "
                        "readers [DFLASH_MAX_UNREAD_EVENTS]")
    add_compute_args(p, "decode (scheduler) thread")
    p.add_argument("--spec-log-interval", type=float,
                   default=float(env("DFLASH_SPEC_LOG_INTERVAL_S", "10")),
                   help="seconds between 'SpecDecoding metrics:' log lines (vLLM's format), 0 = off "
                        "[DFLASH_SPEC_LOG_INTERVAL_S]")
    p.add_argument("--ep-size", type=int, default=int(env("DFLASH_EP_SIZE", "1")),
                   help="expert-parallel ranks for a mixture-of-experts target: this process is "
                        "rank 0 and starts the others (torch.distributed: gloo on CPU, NCCL on GPU) "
                        "[DFLASH_EP_SIZE]")
    p.add_argument("--ep-timeout", type=float, default=float(env("DFLASH_EP_TIMEOUT_S", "60")),
                   help="collective timeout between expert-parallel ranks, seconds "
                        "[DFLASH_EP_TIMEOUT_S]")
    add_common_args(p)
    add_upstream_tls_args(p, "drafters")
    return p.parse_args(argv)


def main(argv=None) -> None:
    from dflash.core.checkpoint import torch_dtype
    from dflash.serving.threads import reserve
    from verifier_svc.engine import VerifierEngine

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
    target = load_target(a, devices, on_failure=lambda reason: rt.set_serving(False))
    engine = VerifierEngine(target, session_ttl_s=a.session_ttl, spec_mode=a.spec_mode,
                            prefill_chunk=a.prefill_chunk, max_batch=a.max_batch,
                            context_flush=a.context_flush, max_unread=a.max_unread_events,
                            threads=threads, tree_budget=a.tree_budget,
                            tree_budgets=parse_budgets(a.tree_budgets), tree_max_batch=a.tree_max_batch,
                            suffix=a.suffix == "on",
                            answers=AnswerStore(a.suffix_answer_tokens, a.suffix_answer_total,
                                                corpus=corpus_of(a, target)),
                            admission=Admission(max_waiting=a.max_waiting,
                                                max_waiting_tokens=a.max_waiting_tokens))
    _warmup(engine)
    breaker = BreakerConfig(a.breaker_failures, a.breaker_probe_interval, a.draft_deadline_floor)
    attach(rt, engine, draft_timeout_s=a.draft_timeout,
           wire_dtype=torch_dtype(a.wire_dtype) if a.wire_dtype else None, breaker=breaker,
           upstream_tls=upstream_tls)
    rt.servicer.require_registered = not a.allow_unregistered_drafters
    rt.servicer.no_learn_tenants = frozenset(t for t in a.no_learn_tenants.split(",") if t)
    stop = threading.Event()

    def sweeper():
        while not stop.wait(min(30.0, a.session_ttl / 2)):
            n = engine.expire_sessions()
            if n:
                log.info("expired %d idle sessions", n)

    threading.Thread(target=sweeper, daemon=True, name="session-sweeper").start()
    stop_log = rt.servicer.observer.speclog.start(a.spec_log_interval)
    rt.set_serving(True)
    log.info("SERVING %s on port %d", a.target, rt.port)
    close = target.close   # expert parallel: stop the other ranks
    def on_stop() -> None:
        stop.set()
        stop_log.set()
        close()
        telemetry.shutdown()

    run_until_signal(rt, a.grace, on_stop=on_stop)


def parse_budgets(text: str) -> tuple[int, ...]:
    """``--tree-budgets`` (already checked by ``int_list``) as a tuple; "" = chains only."""
    return tuple(int(x) for x in text.split(",") if x)


def rank_devices_of(a) -> list:
    """Each rank's device from ``--device`` and ``--ep-size`` (``dflash.core.device.rank_devices``).

    Raises:
        DeviceError: naming ``--device`` (not there), ``--ep-size`` (fewer GPUs than ranks) or
            ``--cuda-graphs`` (no CUDA, or expert parallel).
    """
    from dflash.core.device import rank_devices, resolve_device

    devices = rank_devices(resolve_device(a.device), max(a.ep_size, 1))
    if a.cuda_graphs and (devices[0].type != "cuda" or a.ep_size > 1):
        raise DeviceError("--cuda-graphs", "needs a CUDA device and one rank "
                                           f"(--device {a.device}, --ep-size {a.ep_size})")
    return devices


def corpus_of(a, target):
    """The ``--suffix-corpus`` index (None without one or with ``--suffix off``), checked against
    ``target``'s fingerprint; a bad folder exits naming the flag."""
    if not a.suffix_corpus or a.suffix != "on":
        return None
    from dflash.core.token_shards import DataError
    from verifier_svc.suffix_corpus import load_corpus

    t0 = time.perf_counter()
    try:
        index = load_corpus(a.suffix_corpus, max_tokens=a.suffix_corpus_tokens,
                            fingerprint=getattr(target, "fingerprint", None))
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
    from verifier_svc.target import TargetModel

    if a.ep_size <= 1:
        target = TargetModel(a.target, dtype=a.dtype, device=devices[0],
                             skinny_max_rows=a.skinny_max_rows, cuda_graphs=a.cuda_graphs,
                             packed_linear=a.packed_linear, panel_linear=a.panel_linear)
        log.info("target on %s in %s%s", target.device, target.dtype,
                 ", CUDA graphs" if a.cuda_graphs else "")
        return target
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
