"""Gateway test doubles: a scripted verifier behind real gRPC, the HTTP front over a servicer,
and a plain HTTP client (stdlib). Not a test module.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dflash.v1 import common_pb2, drafter_pb2, verifier_pb2, verifier_pb2_grpc


def fake_logprob(token_id: int) -> common_pb2.TokenLogprob:
    """A TokenLogprob that names its token: logprob -(id + 1) / 1000, top ids id and id + 1."""
    lp = -(token_id + 1) / 1000
    return common_pb2.TokenLogprob(token_id=token_id, logprob=lp, top_ids=[token_id, token_id + 1],
                                   top_logprobs=[lp, lp - 1])


class ScriptedVerifier(verifier_pb2_grpc.VerifierServicer):
    """Streams ``ids`` in chunks of ``sizes`` (cycled), with :func:`fake_logprob` per token when
    the request asks for logprobs; ``accepted`` drafts per chunk of ``drafted``. ``fail``:
    (code, details, retry_after_ms or None) aborts every Generate instead; ``abort_after``: n
    aborts UNAVAILABLE after n tokens. A resumed request (``resumed_tokens``) continues ``ids``
    after those; ``Load`` answers ``report``."""

    def __init__(self, ids: list[int], sizes=(1, 3, 2, 5), *, accepted: int = 0, drafted: int = 0,
                 delay_s: float = 0.0):
        self.ids, self.sizes = list(ids), list(sizes)
        self.accepted, self.drafted = accepted, drafted
        self.delay_s = delay_s          # between chunks
        self.fail = None
        self.abort_after: int | None = None   # tokens sent before it fails UNAVAILABLE (a crash)
        self.report = verifier_pb2.LoadReport()   # what Load answers
        self.requests: list[verifier_pb2.VerifierGenerateRequest] = []
        self.checked: list[str] = []    # drafter addresses CheckDrafter was asked about
        self.completed = 0              # streams that sent their last chunk
        self.cancelled = 0              # streams that ended before it
        self.streamed = 0               # token ids sent, all streams together
        self.lock = threading.Lock()

    def Generate(self, request, context):
        with self.lock:
            self.requests.append(request)
        if self.fail is not None:
            code, details, retry = self.fail
            if retry is not None:
                context.set_trailing_metadata((("retry-after-ms", str(retry)),))
            context.abort(code, details)
        # a resumed request continues the script where the replica it left stopped
        ids = self.ids[request.resumed_tokens:request.resumed_tokens + request.max_tokens]
        done = threading.Event()

        def ended():
            with self.lock:
                if done.is_set():
                    self.completed += 1
                else:
                    self.cancelled += 1
        context.add_callback(ended)
        i = k = 0
        while i < len(ids):
            if self.delay_s and i and not context.is_active():
                return
            if self.delay_s and i:
                time.sleep(self.delay_s)   # the behaviour: a verifier that streams slowly
            if self.abort_after is not None and i >= self.abort_after:
                context.abort(grpc.StatusCode.UNAVAILABLE, "replica crashed")
            part = ids[i:i + self.sizes[k % len(self.sizes)]]
            if self.abort_after is not None:
                part = part[:max(1, self.abort_after - i)]
            i, k = i + len(part), k + 1
            chunk = verifier_pb2.VerifierGenerateChunk(token_ids=part, accepted=self.accepted,
                                                       drafted=self.drafted)
            if request.sampling.logprobs:
                chunk.logprobs.extend(fake_logprob(t) for t in part)
            if i >= len(ids):
                chunk.finish_reason = common_pb2.FINISH_REASON_LENGTH
                chunk.prompt_tokens = len(request.prompt_token_ids)
                chunk.stats.drafts = k if self.drafted else 0
                done.set()
            yield chunk
            with self.lock:
                self.streamed += len(part)


    def Load(self, request, context):
        return self.report

    def CheckDrafter(self, request, context):
        """Accepts any address (recorded in ``checked``), answering the card fake@1."""
        with self.lock:
            self.checked.append(request.address)
        return verifier_pb2.CheckDrafterResponse(card=drafter_pb2.DrafterCard(name="fake", version="1"))


def serve_verifier(servicer) -> tuple[grpc.Server, str, health.HealthServicer]:
    """``servicer`` on a loopback port with a SERVING health service; (server, address, health)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server)
    hs = health.HealthServicer()
    hs.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}", hs


def http_front(servicer, serving=lambda: True, **kw):
    """The OpenAI-compatible app over ``servicer`` on a loopback port, started (an HttpServer;
    ``.front`` is its OpenAIFront). Stop it with ``.stop()``."""
    from gateway.http_server import HttpServer
    from gateway.openai_api import OpenAIFront

    front = OpenAIFront(servicer, model_name=kw.pop("model_name", "tiny"),
                        max_positions=kw.pop("max_positions", servicer.max_positions),
                        serving=serving, **kw)
    h = HttpServer(front.app, "127.0.0.1:0", on_stop=front.close)
    h.front = front
    h.start()
    return h


def request(url: str, method: str = "GET", body=None, headers=None, timeout: float = 60):
    """(status, headers, parsed JSON or raw text) of one HTTP request to ``url``."""
    host_port, _, path = url.removeprefix("http://").partition("/")
    host, _, port = host_port.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    data = json.dumps(body).encode() if body is not None and not isinstance(body, bytes) else body
    conn.request(method, "/" + path, body=data,
                 headers={"content-type": "application/json", **(headers or {})})
    r = conn.getresponse()
    raw = r.read().decode()
    conn.close()
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError:
        parsed = raw
    return r.status, {k.lower(): v for k, v in r.getheaders()}, parsed


def sse_events(text: str) -> list:
    """The JSON objects of a server-sent event stream (``[DONE]`` as the string)."""
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
