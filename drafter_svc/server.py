"""Drafter process: load the checkpoint, warm up, serve, drain on SIGTERM."""

from __future__ import annotations

import argparse
import logging
import os

from dflash.core.device import DeviceError, add_device_args
from dflash.learn.flags import add_learn_args, capture_from_args, learner_from_args
from dflash.serving.argtypes import at_least, one_of
from dflash.serving.server import (
    BindError,
    add_common_args,
    add_compute_args,
    add_health_listener,
    create_server,
    run_until_signal,
    server_tls_from_args,
)
from dflash.serving.telemetry import Telemetry, serve_metrics
from dflash.serving.tls import TLSConfigError
from dflash.serving.tracing import server_interceptors
from dflash.v1 import drafter_pb2, drafter_pb2_grpc
from drafter_svc.engine import CONTEXT_SCHED
from drafter_svc.observe import ObservedDrafterServicer

SERVICE = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name
# The role each RPC needs on an mTLS port (dflash/serving/authz.py): the verifiers'.
AUTHZ = {f"/{SERVICE}/Describe": "verifier", f"/{SERVICE}/Draft": "verifier"}


def build(engine, bind: str, *, telemetry: Telemetry | None = None, tls=None):
    """An unstarted server for ``engine`` bound to ``bind`` (tests use "127.0.0.1:0"); TLS when
    ``tls`` (``dflash.serving.tls.ServerTLS``)."""
    servicer = ObservedDrafterServicer(engine, telemetry)
    rt = create_server(bind, lambda s: drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, s),
                       (SERVICE,), tls=tls, authz=AUTHZ,
                       interceptors=server_interceptors(telemetry.tracer_provider if telemetry else None))
    rt.servicer = servicer
    return rt


def parse_args(argv=None) -> argparse.Namespace:
    env = os.environ.get
    # no abbreviations: a new flag must never capture what an older one was spelt as
    p = argparse.ArgumentParser(prog="python -m drafter_svc", description="DFlash drafter service",
                                allow_abbrev=False)
    p.add_argument("--drafter", default=env("DFLASH_DRAFTER"), required=env("DFLASH_DRAFTER") is None,
                   help="z-lab format drafter directory (config.json + model.safetensors) [DFLASH_DRAFTER]")
    p.add_argument("--target", default=env("DFLASH_TARGET"), required=env("DFLASH_TARGET") is None,
                   help="target model directory; only embed_tokens/lm_head are read [DFLASH_TARGET]")
    p.add_argument("--bind", default=env("DFLASH_DRAFTER_BIND", "127.0.0.1:50061"),
                   help="host:port to listen on [DFLASH_DRAFTER_BIND]")
    add_device_args(p, "drafter")
    p.add_argument("--name", default=env("DFLASH_DRAFTER_NAME"), help="override the card name")
    p.add_argument("--version", default=env("DFLASH_DRAFTER_VERSION"), help="override the card version")
    p.add_argument("--draft-vocab-size", type=int, default=int(env("DFLASH_DRAFT_VOCAB_SIZE", "-1")),
                   help="ids the drafter may propose: -1 = the checkpoint's draft_vocab.safetensors "
                        "if present, 0 = full vocabulary, N = its first N ids [DFLASH_DRAFT_VOCAB_SIZE]")
    add_compute_args(p, "drafting thread")
    p.add_argument("--context-threads", type=at_least(0),
                   default=env("DFLASH_CONTEXT_THREADS", "1"),
                   help="torch threads for a call that only carries context features (no block to "
                        "draft): it overlaps the verifier's forward, which it slows less on fewer "
                        "threads; 0 = no separate thread: run them on the drafting thread "
                        "[DFLASH_CONTEXT_THREADS]")
    p.add_argument("--context-sched", type=one_of(CONTEXT_SCHED),
                   default=env("DFLASH_CONTEXT_SCHED", "idle"),
                   help="Linux scheduling policy of the thread running context-only calls: idle "
                        "(SCHED_IDLE: only on a core nothing else wants, i.e. in the verifier's "
                        "gaps) or normal [DFLASH_CONTEXT_SCHED]")
    p.add_argument("--prefix-context-mb", type=at_least(0),
                   default=env("DFLASH_PREFIX_CONTEXT_MB", "512"),
                   help="MiB of finished sessions' context K/V kept as prefixes that later "
                        "requests starting the same way reuse (the verifier's prefix cache "
                        "names them); least recently used go first; 0 = none kept "
                        "[DFLASH_PREFIX_CONTEXT_MB]")
    add_learn_args(p)
    add_common_args(p)
    return p.parse_args(argv)


def load_engine(a, device, threads: int):
    """The drafter engine of the flags ``a`` (:func:`parse_args`) on ``device``, its compute
    thread on ``threads`` torch threads (``dflash.serving.threads.reserve``), warmed up with its
    kernels tuned there (``DrafterEngine.warmup``). ``dflash diagnose`` loads what it prices
    with this function."""
    from dflash.core.device import checkpoint_dtype, resolve_device, resolve_dtype
    from drafter_svc.engine import DrafterEngine
    from kernels.invariant import resolve as resolve_invariant

    dev = resolve_device(device)

    engine = DrafterEngine.from_pretrained(a.drafter, a.target, dtype=a.dtype, device=device,
                                           name=a.name,
                                           version=a.version, draft_vocab_size=a.draft_vocab_size,
                                           skinny_max_rows=a.skinny_max_rows,
                                           packed_linear=a.packed_linear, threads=threads,
                                           panel_linear=a.panel_linear,
                                           context_threads=a.context_threads,
                                           context_sched=a.context_sched,
                                           prefix_mb=a.prefix_context_mb,
                                           batch_invariant=resolve_invariant(
                                               a.batch_invariant, dev, resolve_dtype(
                                                   a.dtype, checkpoint_dtype(a.drafter), dev,
                                                   cpu_bf16=True)))
    engine.warmup()
    return engine


def main(argv=None) -> None:
    from dflash.core.device import resolve_device
    from dflash.serving.threads import reserve

    logging.basicConfig(level=os.environ.get("DFLASH_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    a = parse_args(argv)
    try:
        tls = server_tls_from_args(a)
        device = resolve_device(a.device)     # a GPU that is not there: refused before loading
    except (TLSConfigError, DeviceError) as e:
        raise SystemExit(f"python -m drafter_svc: error: {e}") from None
    threads = reserve(a.threads)   # loading runs single-threaded; the compute thread claims these
    telemetry = Telemetry.from_env("drafter")
    rt = build(None, a.bind, telemetry=telemetry, tls=tls)  # health answers NOT_SERVING while weights load
    try:
        add_health_listener(rt, a.health_bind)
    except BindError as e:          # the port: taken, out of range, unparsable
        raise SystemExit(f"python -m drafter_svc: error: {e}") from None
    rt.server.start()
    if a.metrics_port:
        serve_metrics(telemetry.registry, a.metrics_port, a.metrics_host)
    logging.getLogger("dflash.drafter").info("listening on port %d (NOT_SERVING while loading)", rt.port)
    engine = load_engine(a, device, threads)
    engine.capture = capture_from_args(a, engine.card)   # after warmup: its draft is not kept
    learner = learner_from_args(a, engine, telemetry.registry)
    n = engine.draft_vocab.numel() if engine.draft_vocab is not None else engine.cfg.vocab_size
    logging.getLogger("dflash.drafter").info("draft vocabulary: %d of %d ids; %s, %s", n,
                                             engine.cfg.vocab_size, engine.device, engine.card.dtype)
    rt.servicer.engine = engine
    rt.set_serving(True)
    logging.getLogger("dflash.drafter").info("SERVING %s on port %d", engine.card.label, rt.port)
    def on_stop() -> None:
        if learner is not None:
            learner.close()
        engine.close()
        telemetry.shutdown()

    run_until_signal(rt, a.grace, on_stop=on_stop)
