"""The Model Server Protocol's gauges under vLLM's names (what the Gateway API Inference
Extension's endpoint picker and llm-d's router score a pod by), and the verifier's Load RPC
that our gateway scores replicas by: one computation (verifier_svc.load) for both."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from dflash.serving.metrics import MODEL_SERVER_GAUGES, ModelServerGauges
from dflash.v1 import verifier_pb2

# GIE proposal 003 (Model Server Protocol) names vLLM's gauges; the EPP reads them by name.
PINNED = {"vllm:num_requests_waiting": "waiting", "vllm:num_requests_running": "running",
          "vllm:kv_cache_usage_perc": "kv_cache_usage"}


def scrape(registry) -> dict[str, float]:
    out = {}
    for line in generate_latest(registry).decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_gauge_names_are_vllms():
    assert {k: v[0] for k, v in MODEL_SERVER_GAUGES.items()} == PINNED
    reg = CollectorRegistry()
    report = verifier_pb2.LoadReport(waiting=3, running=5, kv_cache_usage=0.25)
    ModelServerGauges(reg, lambda: report)
    assert scrape(reg) == {"vllm:num_requests_waiting": 3.0, "vllm:num_requests_running": 5.0,
                           "vllm:kv_cache_usage_perc": 0.25}
    loading = CollectorRegistry()
    ModelServerGauges(loading, lambda: None)
    assert scrape(loading) == {}                    # no series while the target loads


def test_load_counts_the_scheduler_queues_and_the_batchs_reserved_positions():
    """Two requests admitted, one prefilled into the batch: 1 waiting, 1 running, the running
    one's prompt + max_tokens over max_batch rows of the window as KV use."""
    from types import SimpleNamespace

    from verifier_svc.engine import Request
    from verifier_svc.load import load_of
    from verifier_svc.scheduler import Job, Scheduler

    s = Scheduler(max_batch=4)
    engine = SimpleNamespace(scheduler=s, target=SimpleNamespace(max_positions=1000))
    jobs = [Job(Request(request_id=str(i), prompt=[1] * (10 + i), max_tokens=90), None,
                lambda: False) for i in range(2)]
    with s.cv:
        for j in jobs:
            assert s.admit(j)
    assert (load_of(engine).waiting, load_of(engine).running) == (2, 0)
    with s.cv:
        s.take_incoming()
    s.prefilled(jobs[1], joins=True)
    r = load_of(engine)
    assert (r.waiting, r.running, r.max_batch) == (1, 1, 4)
    assert r.kv_cache_usage == (11 + 90) / (4 * 1000)
    assert load_of(None) == verifier_pb2.LoadReport()          # loading: nothing to report


def test_the_verifier_serves_its_load_on_metrics_and_rpc(target_model):
    """Over gRPC (the gateway's health watch calls Load) and on /metrics; SIGTERM's drain
    (NOT_SERVING, streams finishing) says draining."""
    import grpc

    from dflash.serving.telemetry import Telemetry
    from dflash.v1 import verifier_pb2_grpc
    from verifier_svc.engine import VerifierEngine
    from verifier_svc.server import build

    engine = VerifierEngine(target_model, max_batch=4)
    telemetry = Telemetry(service="verifier")
    rt = build(engine, "127.0.0.1:0", telemetry=telemetry)
    rt.server.start()
    rt.set_serving(True)
    ch = grpc.insecure_channel(f"127.0.0.1:{rt.port}")
    try:
        stub = verifier_pb2_grpc.VerifierStub(ch)
        r = stub.Load(verifier_pb2.LoadRequest(), timeout=5)
        assert (r.waiting, r.running, r.kv_cache_usage, r.draining, r.max_batch) == (0, 0, 0.0, False, 4)
        m = scrape(telemetry.registry)
        assert {k: m[k] for k in PINNED} == dict.fromkeys(PINNED, 0.0)
        rt.set_serving(False)
        assert stub.Load(verifier_pb2.LoadRequest(), timeout=5).draining
    finally:
        ch.close()
        rt.server.stop(0)
        engine.close()
