"""Acceptance you can see: one trace per request across the three services, Prometheus counters
with vLLM's meaning, and the vLLM log line — all through real gRPC on loopback."""

from __future__ import annotations

import json
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client.parser import text_string_to_metric_families

from dflash.client import build_request
from dflash.core.stats import AcceptanceCounter
from dflash.serving.speclog import FORMAT, SpecDecodingLogger, format_line, parse_line
from dflash.serving.telemetry import Telemetry, serve_metrics
from dflash.serving.tracing import JsonLinesSpanExporter, StepTracing, provider_from_env
from dflash.v1 import verifier_pb2

from doubles import ReferenceDrafter, client_session_id
from helpers import PROMPTS, Stack, generate_ids, reference, wait_until

GW_SPAN = "text_completion dflash"   # GenAI: "{operation} {model}" (build's default model name)
B = 4
STEPS = 3
N = 1 + STEPS * B          # the prefill token, then full blocks only


def spec(addr):
    return verifier_pb2.SpeculationParams(enabled=True, drafter_address=addr)


class Traced:
    """Per-service telemetry (own provider with service.name, own registry), one exporter."""

    def __init__(self, steps: str = "all"):
        self.exporter = InMemorySpanExporter()
        self.by_service: dict[str, list[Telemetry]] = {}
        self.steps = StepTracing.parse(steps)

    def __call__(self, service: str) -> Telemetry:
        p = TracerProvider(resource=Resource.create({"service.name": f"dflash-{service}"}))
        p.add_span_processor(SimpleSpanProcessor(self.exporter))
        t = Telemetry(service=service, tracer_provider=p, trace_steps=self.steps)
        self.by_service.setdefault(service, []).append(t)
        return t

    def spans(self, until=lambda spans: True, timeout_s: float = 5.0):
        """Finished spans, once ``until(spans)`` holds; servers end their spans just after the
        client saw the last message."""
        wait_until(lambda: until(list(self.exporter.get_finished_spans())), timeout_s,
                   lambda: f"the spans (finished: {[s.name for s in self.exporter.get_finished_spans()]})")
        return list(self.exporter.get_finished_spans())


@pytest.fixture
def traced():
    return Traced()


@pytest.fixture
def tstack(target_model, tokenizer, traced):
    s = Stack(target_model, tokenizer, telemetry=traced)
    yield s
    s.close()


def scrape(registry_or_url) -> dict[tuple, float]:
    """{(sample name, ((label, value), ...)): value} from a registry or a /metrics URL."""
    if isinstance(registry_or_url, str):
        text = urllib.request.urlopen(registry_or_url, timeout=5).read().decode()
    else:
        from prometheus_client import generate_latest
        text = generate_latest(registry_or_url).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def spec_counts(m: dict, version: str) -> dict:
    v = (("drafter_version", version),)
    drafts = m[("dflash_spec_decode_num_drafts_total", v)]
    per_pos = {}
    for (name, labels), val in m.items():
        d = dict(labels)
        if name == "dflash_spec_decode_num_accepted_tokens_per_pos_total" and d["drafter_version"] == version:
            per_pos[int(d["position"])] = val
    return {"drafts": drafts, "draft_tokens": m[("dflash_spec_decode_num_draft_tokens_total", v)],
            "accepted": m[("dflash_spec_decode_num_accepted_tokens_total", v)],
            "per_pos": [per_pos[i] for i in sorted(per_pos)]}


# ---------------------------------------------------------------------- traces
def test_one_trace_across_gateway_verifier_drafter(tstack, traced, target_model, tokenizer, hf_target):
    prompt_text = "hello"
    ids = list(tokenizer.encode(prompt_text))
    refs = {"t0": ids + reference(hf_target, ids, N)}
    addr = tstack.add_drafter(ReferenceDrafter(target_model, refs, block_size=B), label="oracle@4")
    req = build_request(prompt_text, max_tokens=N, session_id="t0", temperature=0.0)
    out = list(tstack.gateway_stub().Generate(req))
    assert out[-1].acceptance.mean_acceptance_length == pytest.approx(B)

    spans = traced.spans(until=lambda s: any(x.name == GW_SPAN for x in s))
    by_name = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    (gw,) = by_name[GW_SPAN]
    (gw_rpc,) = by_name["/dflash.v1.Gateway/Generate"]     # the gRPC instrumentation's
    (ver,) = by_name["/dflash.v1.Verifier/Generate"]
    (prefill,) = by_name["verifier.prefill"]
    (decode,) = by_name["verifier.decode"]
    steps, drafts = by_name["verifier.step"], by_name["drafter.draft"]
    # one trace per request (the drafter's registration RPCs are traces of their own)
    request = [s for s in spans if s.name not in ("/dflash.v1.Verifier/CheckDrafter",
                                                  "/dflash.v1.Drafter/Describe")]
    assert {s.context.trace_id for s in request} == {gw.context.trace_id}, "one trace per request"
    service = lambda s: s.resource.attributes["service.name"]  # noqa: E731
    assert (service(gw), service(ver), service(drafts[0])) == ("dflash-gateway", "dflash-verifier",
                                                              "dflash-drafter")
    # parent/child links: gateway RPC -> its GenAI span -> verifier RPC -> prefill/decode ->
    # steps -> drafter items
    assert gw_rpc.parent is None and gw_rpc.kind == SpanKind.SERVER
    assert gw.parent.span_id == gw_rpc.context.span_id and gw.kind == SpanKind.INTERNAL
    assert ver.parent.span_id == gw.context.span_id and ver.kind == SpanKind.SERVER
    assert ver.attributes["rpc.method"] == "Generate" and ver.attributes["rpc.grpc.status_code"] == 0
    assert prefill.parent.span_id == ver.context.span_id
    assert prefill.attributes["gen_ai.usage.input_tokens"] == len(ids)
    assert decode.parent.span_id == ver.context.span_id
    assert len(steps) == STEPS and all(s.parent.span_id == decode.context.span_id for s in steps)
    assert sorted(d.parent.span_id for d in drafts) == sorted(s.context.span_id for s in steps)
    # attributes
    a = gw.attributes
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.request.model"] == "dflash"
    assert a["gen_ai.response.model"] == "dflash" and len(a["gen_ai.response.id"]) == 32
    assert a["gen_ai.request.max_tokens"] == N and a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.usage.input_tokens"] == len(ids) and a["gen_ai.usage.output_tokens"] == N
    assert 0 < a["gen_ai.response.time_to_first_chunk"] <= a["dflash.e2e_seconds"]
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    # the old names, kept one release (dflash.serving.semconv.ALIASES)
    assert a["gen_ai.usage.prompt_tokens"] == len(ids) and a["gen_ai.usage.completion_tokens"] == N
    assert a["gen_ai.latency.time_to_first_token"] == a["gen_ai.response.time_to_first_chunk"]
    assert ver.attributes["gen_ai.usage.input_tokens"] == len(ids)
    assert a["dflash.drafter_version"] == "oracle@4" and a["dflash.mean_acceptance_length"] == B
    assert decode.attributes["dflash.mean_acceptance_length"] == B
    assert decode.attributes["dflash.accepted_per_position"] == (STEPS,) * (B - 1)
    for s in steps:
        sa = s.attributes
        assert (sa["dflash.block_size"], sa["dflash.drafted"], sa["dflash.accepted"]) == (B, B - 1, B - 1)
        assert sa["dflash.drafter_version"] == "oracle@1"  # the card's name@version (gateway: its label)
        assert sa["dflash.context_bytes"] > 0
        assert sa["dflash.verify_seconds"] > 0 and sa["dflash.draft_seconds"] >= 0
        assert sa["dflash.wire_seconds"] >= 0
    # the drafter sees the verifier's id of the client's session: the owner's prefix, then "t0"
    (sid,) = {d.attributes["dflash.session_id"] for d in drafts}
    assert client_session_id(sid) == "t0" and sid != "t0"
    assert all(s.status.status_code != StatusCode.ERROR for s in spans)

    # health RPCs are not traced
    before = len(traced.exporter.get_finished_spans())
    for a in (tstack.gateway_addr, tstack.verifier_addr, addr):
        with grpc.insecure_channel(a) as ch:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert len(traced.exporter.get_finished_spans()) == before


@pytest.mark.parametrize("policy,traced_steps", [("every:2", [0, 2]), ("summary", [])])
def test_step_span_policy(target_model, tokenizer, hf_target, policy, traced_steps):
    traced = Traced(policy)
    s = Stack(target_model, tokenizer, telemetry=traced)
    try:
        p = PROMPTS[0]
        refs = {"p0": p + reference(hf_target, p, N)}
        addr = s.add_drafter(ReferenceDrafter(target_model, refs, block_size=B))
        generate_ids(s.verifier_stub(), p, max_tokens=N, session_id="p0", ignore_eos=True,
                     speculation=spec(addr))
        spans = traced.spans(until=lambda x: any(y.name == "verifier.decode" for y in x))
    finally:
        s.close()
    steps = [x for x in spans if x.name == "verifier.step"]
    assert sorted(x.attributes["dflash.step"] for x in steps) == traced_steps
    assert len([x for x in spans if x.name == "drafter.draft"]) == len(traced_steps)
    (decode,) = [x for x in spans if x.name == "verifier.decode"]
    events = [e for e in decode.events if e.name == "spec_step"]
    assert len(events) == (STEPS if policy == "summary" else 0)


def test_http_request_span_is_the_genai_server_span(tstack, traced):
    from gateway_doubles import http_front, request

    h = http_front(tstack.gateway.servicer, model_name="dflash")   # the gateway's served name
    try:
        trace_id, parent = "ab" * 16, "cd" * 8
        status, _, body = request(h.url + "/v1/chat/completions", "POST", {
            "model": "dflash", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "hi"}]},
            headers={"traceparent": f"00-{trace_id}-{parent}-01"})
        assert status == 200, body
    finally:
        h.stop()
    spans = traced.spans(until=lambda x: any(y.name == "chat dflash" for y in x))
    (gw,) = [x for x in spans if x.name == "chat dflash"]
    assert gw.kind == SpanKind.SERVER and f"{gw.context.trace_id:032x}" == trace_id
    assert f"{gw.parent.span_id:016x}" == parent                   # the client's span
    a = gw.attributes
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.response.id"] == body["id"]
    assert a["gen_ai.request.stream"] is False
    assert a["gen_ai.usage.output_tokens"] == body["usage"]["completion_tokens"]
    (ver,) = [x for x in spans if x.name == "/dflash.v1.Verifier/Generate"]
    assert ver.parent.span_id == gw.context.span_id


def test_errors_set_span_status(tstack, traced, target_model):
    with pytest.raises(grpc.RpcError) as e:
        list(tstack.gateway_stub().Generate(build_request("hi", max_tokens=0)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    spans = traced.spans(until=lambda x: any(y.name == GW_SPAN for y in x))
    (gw,) = [x for x in spans if x.name == GW_SPAN]
    assert gw.status.status_code == StatusCode.ERROR and "INVALID_ARGUMENT" in gw.status.description

    # A drafter error: the step falls back, its span says so, the fallback counter counts it.
    broken = ReferenceDrafter(target_model, {}, block_size=B, name="broken")  # knows no session
    addr = tstack.add_drafter(broken)
    traced.exporter.clear()
    generate_ids(tstack.verifier_stub(), PROMPTS[0], max_tokens=5, speculation=spec(addr))
    spans = traced.spans(until=lambda x: any(y.name == "verifier.decode" for y in x))
    steps = [x for x in spans if x.name == "verifier.step" and "dflash.fallback" in x.attributes]
    assert steps and all(x.status.status_code == StatusCode.ERROR for x in steps)
    assert all(x.attributes["dflash.fallback"] == "no_context" for x in steps)
    m = scrape(traced.by_service["verifier"][0].registry)
    key = ("dflash_spec_decode_fallback_steps_total",
           (("drafter_version", "broken@1"), ("reason", "no_context")))
    assert m[key] == len(steps)


def test_step_tracing_setting_and_trace_file(tmp_path):
    assert StepTracing.parse("all").span_for(7)
    every = StepTracing.parse("every:4")
    assert [every.span_for(i) for i in range(5)] == [True, False, False, False, True]
    assert StepTracing.parse("summary").events and not StepTracing.parse("summary").span_for(0)
    for bad in ("every:0", "sometimes", "every:x"):
        with pytest.raises(ValueError, match="DFLASH_TRACE_STEPS"):
            StepTracing.parse(bad)
    assert provider_from_env("verifier", {}) is None          # nothing configured: tracing off
    path = tmp_path / "spans.jsonl"
    t = Telemetry.from_env("verifier", {"DFLASH_TRACE_FILE": str(path), "DFLASH_TRACE_STEPS": "every:3"})
    assert t.tracing and t.trace_steps == StepTracing("every", 3)
    with t.tracer.start_as_current_span("outer"):
        t.tracer.start_span("inner").end()
    t.shutdown()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["name"] for x in lines] == ["inner", "outer"]
    assert lines[0]["resource"]["attributes"]["service.name"] == "dflash-verifier"
    assert isinstance(JsonLinesSpanExporter(str(path)), JsonLinesSpanExporter)


# ---------------------------------------------------------------------- metrics
def test_metrics_oracle_tau_is_block_size_adversarial_tau_is_one(tstack, traced, target_model, hf_target):
    refs = {f"m{i}": p + reference(hf_target, p, N) for i, p in enumerate(PROMPTS)}
    oracle = tstack.add_drafter(ReferenceDrafter(target_model, refs, block_size=B), label="oracle@1")
    adv = tstack.add_drafter(ReferenceDrafter(target_model, refs, block_size=B, adversarial=True,
                                              name="adversarial"), label="adversarial@1")
    registry = traced.by_service["verifier"][0].registry
    server = serve_metrics(registry, 0, addr="127.0.0.1")
    try:
        v = tstack.verifier_stub()
        for i, p in enumerate(PROMPTS):
            generate_ids(v, p, max_tokens=N, session_id=f"m{i}", ignore_eos=True, speculation=spec(oracle))
        for i, p in enumerate(PROMPTS):
            generate_ids(v, p, max_tokens=N, session_id=f"m{i}", ignore_eos=True, speculation=spec(adv))
        m = scrape(f"http://127.0.0.1:{server.server_port}/metrics")
    finally:
        server.shutdown()
        server.server_close()
    o = spec_counts(m, "oracle@1")
    assert o["drafts"] == STEPS * len(PROMPTS)
    assert o["per_pos"] == [o["drafts"]] * (B - 1), "every position accepted at every draft"
    assert 1 + o["accepted"] / o["drafts"] == B                      # tau = block size
    a = spec_counts(m, "adversarial@1")
    assert a["drafts"] > 0 and a["accepted"] == 0 and a["per_pos"] == [0] * (B - 1)
    assert 1 + a["accepted"] / a["drafts"] == 1                      # tau = 1
    bucket = lambda le: m[("dflash_spec_decode_acceptance_length_bucket",  # noqa: E731
                           (("drafter_version", "oracle@1"), ("le", le)))]
    assert bucket("3.0") == 0 and bucket("4.0") == o["drafts"]    # every step committed B tokens
    for name in ("dflash_spec_decode_draft_seconds_count", "dflash_spec_decode_wire_seconds_count",
                 "dflash_spec_decode_verify_seconds_count", "dflash_spec_decode_context_bytes_count"):
        assert m[(name, (("drafter_version", "oracle@1"),))] == o["drafts"]
    assert m[("dflash_verifier_active_sessions", ())] == len(PROMPTS)  # kept (session ids)
    assert m[("dflash_verifier_cached_tokens", ())] > 0


def test_stop_inside_accepted_block_ends_the_count(tstack, traced, target_model, hf_target):
    p = PROMPTS[2]
    ref = reference(hf_target, p, 4 * B)
    # A token first generated at index i inside step 2, at draft position r + 1 (not the bonus).
    i = next(i for i in range(1 + B, 1 + 2 * B - 1) if ref[i] not in ref[:i])
    r = (i - 1) % B
    addr = tstack.add_drafter(ReferenceDrafter(target_model, {"s": p + ref}, block_size=B, name="stop"))
    got, last = generate_ids(tstack.verifier_stub(), p, max_tokens=4 * B, session_id="s",
                             stop_token_ids=[ref[i]], ignore_eos=True, speculation=spec(addr))
    assert got == ref[:i + 1]
    c = spec_counts(scrape(traced.by_service["verifier"][0].registry), "stop@1")
    assert c["drafts"] == 2
    assert c["accepted"] == (B - 1) + (r + 1) == last.stats.accepted_tokens   # nothing after the stop
    assert c["per_pos"] == [2] * (r + 1) + [1] * (B - 2 - r)


def test_gateway_latency_metrics(tstack, traced, target_model, tokenizer, hf_target):
    ids = list(tokenizer.encode("abc"))
    refs = {"g": ids + reference(hf_target, ids, N)}
    tstack.add_drafter(ReferenceDrafter(target_model, refs, block_size=B), label="oracle@g")
    list(tstack.gateway_stub().Generate(build_request("abc", max_tokens=N, session_id="g")))
    traced.spans(until=lambda x: any(y.name == GW_SPAN for y in x))
    m = scrape(traced.by_service["gateway"][0].registry)
    v = (("drafter_version", "oracle@g"),)
    assert m[("dflash_requests_total", v + (("finish_reason", "length"),))] == 1
    assert m[("dflash_request_ttft_seconds_count", v)] == 1
    assert m[("dflash_request_e2e_seconds_count", v)] == 1
    assert m[("dflash_request_inter_token_latency_seconds_count", v)] > 0
    assert m[("dflash_request_acceptance_length_sum", v)] == B
    assert m[("dflash_request_completion_tokens_total", v)] == N
    d = scrape(traced.by_service["drafter"][0].registry)
    card = (("drafter_version", "oracle@1"),)   # verifier and drafter label by the drafter's card
    assert d[("dflash_drafter_items_total", card)] == STEPS
    assert ("dflash_drafter_active_sessions", card) in d and ("dflash_drafter_cached_tokens", card) in d


# ---------------------------------------------------------------------- the log line
def test_log_line_is_vllms_format():
    c = AcceptanceCounter()
    for acc in (3, 1, 0, 3):
        c.record(3, acc)
    assert format_line(c, 2.0) == (
        "SpecDecoding metrics: Mean acceptance length: 2.75, Accepted throughput: 3.50 tokens/s, "
        "Drafted throughput: 6.00 tokens/s, Accepted: 7 tokens, Drafted: 12 tokens, "
        "Per-position acceptance rate: 0.750, 0.500, 0.500, Avg Draft acceptance rate: 58.3%")
    clock = iter([0.0, 10.0, 20.0]).__next__
    log = SpecDecodingLogger(clock=clock)
    log.record(3, 2)
    assert parse_line(log.emit())["drafted_throughput"] == pytest.approx(0.3)
    assert log.emit() is None                    # an empty window logs nothing (as vLLM)


def test_log_line_parses_back_to_the_counters(tstack, traced, target_model, hf_target, caplog):
    refs = {f"l{i}": p + reference(hf_target, p, 24) for i, p in enumerate(PROMPTS)}
    good = tstack.add_drafter(ReferenceDrafter(target_model, refs, block_size=B), label="oracle@l")
    v = tstack.verifier_stub()
    for i, p in enumerate(PROMPTS):   # uneven lengths: partial last blocks, varied acceptance
        generate_ids(v, p, max_tokens=7 + 5 * i, session_id=f"l{i}", speculation=spec(good))
    observer = tstack.verifier.servicer.observer
    with caplog.at_level("INFO", logger="dflash.verifier"):
        line = observer.speclog.emit()
    assert line in caplog.text
    got = parse_line(line)
    c = spec_counts(scrape(traced.by_service["verifier"][0].registry), "oracle@1")
    assert got["accepted"] == c["accepted"] and got["drafted"] == c["draft_tokens"]
    assert got["mean_acceptance_length"] == pytest.approx(1 + c["accepted"] / c["drafts"], abs=0.005)
    assert got["per_position"] == pytest.approx([x / c["drafts"] for x in c["per_pos"]], abs=0.0005)
    assert got["draft_acceptance_rate"] == pytest.approx(100 * c["accepted"] / c["draft_tokens"], abs=0.05)
    assert line == FORMAT % (got["mean_acceptance_length"], got["accepted_throughput"],
                             got["drafted_throughput"], got["accepted"], got["drafted"],
                             ", ".join(f"{x:.3f}" for x in got["per_position"]),
                             got["draft_acceptance_rate"])


# ---------------------------------------------------------------------- the dashboard
def test_dashboard_queries_only_metrics_the_services_export():
    import re
    from pathlib import Path

    from prometheus_client import CollectorRegistry

    from dflash.serving.metrics import DrafterMetrics, GatewayMetrics, SessionGauges, VerifierMetrics

    r = CollectorRegistry()
    VerifierMetrics(r), GatewayMetrics(r), DrafterMetrics(r)
    engine = type("E", (), {"num_sessions": 1, "cached_tokens": 2, "card": None})()
    SessionGauges(r, "dflash_verifier", lambda: engine)
    SessionGauges(r, "dflash_drafter", lambda: engine, label=lambda e: "d@1")
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    known = {f.name + s for f in r.collect() for s in suffixes[f.type]}
    dash = json.loads((Path(__file__).parents[1] / "deploy/grafana/dashboards/dflash.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"dflash_[a-z0-9_]+", e)}
    assert used and used <= known, f"unknown metrics: {sorted(used - known)}"
    titles = " ".join(p["title"] for p in dash["panels"])
    for words in ("tau", "Per-position", "draft / wire / verify", "Fallback"):
        assert words in titles
