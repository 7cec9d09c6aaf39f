"""The OpenAI-compatible HTTP API with the real ``openai`` client on loopback.

A real in-process verifier, drafters (the tiny DFlash drafter, and an oracle that knows the
target's greedy continuation of a few sessions) and gateway on tiny random models; the HTTP
front over the gateway's servicer, as ``gateway.server.build`` wires it. Greedy HTTP output
equals gRPC output for the same request (one path); ``metrics.speculative_decoding`` equals
the gRPC AcceptanceStats; every bad parameter is a 400 naming it and the service answers after.
A client that disconnects cancels its verifier stream; HTTPS uses the gRPC port's certificate
and reloads it as that port does (a changed file, SIGHUP; an invalid replacement refused).
"""

from __future__ import annotations

import http.client
import json
import math
import os
import socket
import ssl

import grpc
import openai
import pytest
import torch
from grpc_health.v1 import health_pb2

from dflash.v1 import gateway_pb2

from doubles import ReferenceDrafter
from gateway_doubles import ScriptedVerifier, http_front, request, serve_verifier, sse_events
from helpers import Stack, reference, wait_until

B = 4
N = 20
PROMPT = "Hello"
ORACLE_SESSIONS = ("oracle-http", "oracle-grpc", "oracle-stream")


@pytest.fixture(scope="module")
def served(target_model, tokenizer, make_drafter, tiny_target, hf_target):
    """(stack, HttpServer, openai client): the tiny drafter is the default; ``oracle@1``
    drafts the target's own greedy continuation of PROMPT for ORACLE_SESSIONS."""
    from drafter_svc.engine import DrafterEngine

    stack = Stack(target_model, tokenizer)
    stack.add_drafter(DrafterEngine.from_pretrained(make_drafter(block_size=B), tiny_target),
                      default=True)
    ids = tokenizer.encode(PROMPT)
    ref = ids + reference(hf_target, ids, N + B, ignore_eos=True)
    stack.add_drafter(ReferenceDrafter(target_model, dict.fromkeys(ORACLE_SESSIONS, ref),
                                       block_size=B), label="oracle@1")
    h = http_front(stack.gateway.servicer, serving=lambda: stack.gateway.serving)
    client = openai.OpenAI(base_url=h.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield stack, h, client
    client.close()
    h.stop()
    stack.close()


def grpc_generate(stack, **kw) -> list[gateway_pb2.GenerateResponse]:
    return list(stack.gateway_stub().Generate(gateway_pb2.GenerateRequest(**kw), timeout=120))


def grpc_text(resps) -> str:
    return "".join(r.text for r in resps)


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]


# ---------------------------------------------------------------------------- one path
def test_greedy_completion_equals_grpc_and_metrics_match_acceptance(served):
    stack, _, client = served
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=N, temperature=0,
                                  extra_body={"drafter": "oracle@1", "session_id": "oracle-http"})
    g = grpc_generate(stack, prompt=PROMPT, max_tokens=N, drafter="oracle@1",
                      session_id="oracle-grpc")
    final = g[-1]
    (choice,) = r.choices
    assert choice.text == grpc_text(g) and choice.finish_reason == "length"
    assert r.usage.completion_tokens == final.usage.completion_tokens == N
    assert r.usage.prompt_tokens == final.usage.prompt_tokens == len(PROMPT)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    sd = r.metrics["speculative_decoding"]
    a = final.acceptance
    assert a.drafts > 0 and a.accepted_tokens > 0          # the oracle is accepted
    # Two requests draft alike unless a step fell back (a drafter late under machine load):
    # the field-by-field mapping is exact only then; the figures are consistent always.
    if a.fallback_steps == 0 and sd["num_spec_steps"] == a.drafts:
        assert sd["num_draft_tokens"] == a.draft_tokens
        assert sd["num_accepted_draft_tokens"] == a.accepted_tokens
        assert sd["num_accepted_tokens_per_pos"] == list(a.accepted_per_position)
        assert sd["mean_acceptance_length"] == pytest.approx(a.mean_acceptance_length)
    steps, acc = sd["num_spec_steps"], sd["num_accepted_draft_tokens"]
    assert steps > 0 and acc > 0
    assert sd["mean_acceptance_length"] == pytest.approx(1 + acc / steps)
    assert sd["draft_acceptance_rate"] == pytest.approx(acc / sd["num_draft_tokens"])
    assert sum(sd["num_accepted_tokens_per_pos"]) == acc
    assert sum(sd["acceptance_histogram"]) == steps
    assert sum(j * c for j, c in enumerate(sd["acceptance_histogram"])) == acc
    assert sd["drafter"] == "oracle@1" == final.drafter
    assert choice.metrics == r.metrics                      # one choice: the same figures


def test_greedy_chat_equals_grpc_streaming_or_not(served):
    stack, _, client = served
    g = grpc_generate(stack, chat=gateway_pb2.ChatMessages(messages=[
        gateway_pb2.ChatMessage(**m) for m in CHAT]), max_tokens=12)
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == grpc_text(g)
    assert r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == g[-1].usage.completion_tokens
    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == grpc_text(g)
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finish] == [r.choices[0].finish_reason]
    last = chunks[-1]                    # include_usage: the last chunk, no choices
    assert last.choices == [] and last.usage.completion_tokens == g[-1].usage.completion_tokens
    sd = last.metrics["speculative_decoding"]
    assert sd["num_spec_steps"] == g[-1].acceptance.drafts
    assert sd["drafter"] == "tiny-drafter@1"
    assert all(c.usage is None for c in chunks[:-1])
    # without include_usage: no usage chunk
    plain = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12,
                                                temperature=0, stream=True))
    assert all(c.choices and c.usage is None for c in plain)


def test_streamed_completion_with_the_oracle_counts_what_grpc_counts(served):
    stack, _, client = served
    chunks = list(client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=N, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"drafter": "oracle@1", "session_id": "oracle-stream"}))
    g = grpc_generate(stack, prompt=PROMPT, max_tokens=N, drafter="oracle@1", speculation=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == grpc_text(g)
    sd = chunks[-1].metrics["speculative_decoding"]
    assert sd["mean_acceptance_length"] > 1.5           # the oracle's drafts were accepted
    assert chunks[-1].usage.completion_tokens == N


def test_speculation_off_has_no_speculative_metrics(served):
    stack, _, client = served
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                  extra_body={"speculation": False})
    g = grpc_generate(stack, prompt=PROMPT, max_tokens=6, speculation=False)
    assert r.choices[0].text == grpc_text(g)
    assert r.metrics is None or r.metrics.get("speculative_decoding") is None


# ---------------------------------------------------------------------------- parameters
def test_stop_string_and_max_tokens(served):
    _, _, client = served
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=N, temperature=0,
                                     extra_body={"speculation": False}).choices[0].text
    stop = next(full[i:i + 2] for i in range(3, len(full) - 2)
                if "\ufffd" not in full[i:i + 2] and full[i:i + 2].strip())
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=N, temperature=0,
                                  stop=[stop])
    assert r.choices[0].text == full[:full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5, temperature=0)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_seed_reproduces_a_sampled_answer(served):
    _, _, client = served
    # coupled sampling: a seeded answer is the one without speculation, in every mode
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.0)
    a = client.completions.create(seed=7, extra_body={"speculation_mode": "off"}, **kw)
    b = client.completions.create(seed=7, **kw)                               # adaptive
    f = client.completions.create(seed=7, extra_body={"speculation_mode": "fixed"}, **kw)
    c = client.completions.create(seed=8, extra_body={"speculation_mode": "off"}, **kw)
    assert a.choices[0].text == b.choices[0].text == f.choices[0].text
    assert a.choices[0].text != c.choices[0].text


def test_n3_sampled_samples_are_distinct_each_with_its_statistics(served):
    stack, _, client = served
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12,
                                       temperature=1.0, seed=11, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) == 3, texts
    per = [c.metrics["speculative_decoding"] for c in r.choices]
    total = r.metrics["speculative_decoding"]
    assert total["num_spec_steps"] == sum(p["num_spec_steps"] for p in per)
    assert total["num_accepted_draft_tokens"] == sum(p["num_accepted_draft_tokens"] for p in per)
    # sample i is seeded seed + i: it is the answer to the same request with n=1, seed 11 + i
    ones = [client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12,
                                           temperature=1.0, seed=11 + i) for i in range(3)]
    assert [o.choices[0].message.content for o in ones] == texts
    assert r.usage.completion_tokens == sum(o.usage.completion_tokens for o in ones)
    assert r.usage.prompt_tokens == ones[0].usage.prompt_tokens        # counted once
    # greedy: n identical answers
    g = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0, n=3)
    assert len({c.message.content for c in g.choices}) == 1


def test_n2_streams_interleave_with_indices(served):
    _, _, client = served
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10,
                                            temperature=1.0, seed=3, n=2, stream=True,
                                            stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    finished = []
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason:
                finished.append(ch.index)
    assert sorted(finished) == [0, 1]
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10,
                                      temperature=1.0, seed=3, n=2)
    assert [c.text for c in whole.choices] == [texts[0], texts[1]]
    assert chunks[-1].usage.completion_tokens == 20


def _target_logprobs(hf_target, prompt_ids, out_ids):
    with torch.no_grad():
        logits = hf_target(torch.tensor([prompt_ids + out_ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return lp[len(prompt_ids) - 1:len(prompt_ids) - 1 + len(out_ids)]


def _verifier_sends_logprobs(stack) -> bool:
    from dflash.v1 import common_pb2

    from helpers import generate_ids

    _, last = generate_ids(stack.verifier_stub(), [72, 105], max_tokens=1,
                           sampling=common_pb2.SamplingParams(logprobs=True))
    return len(last.logprobs) == 1


def test_logprobs_are_the_targets(served, tokenizer, hf_target):
    """What comes out of the HTTP API against the target's own log_softmax (the verifier sends
    logprobs from the verification logits: verifier_svc/commit.py)."""
    stack, _, client = served
    assert _verifier_sends_logprobs(stack), "the verifier sent no logprobs for logprobs=True"
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    prompt_ids = list(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True,
                                                    tokenize=True, return_dict=False))
    for e in content:
        # greedy: the token is its own best alternative
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].bytes == e.bytes
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)
    g = grpc_generate(stack, chat=gateway_pb2.ChatMessages(messages=[
        gateway_pb2.ChatMessage(**m) for m in CHAT]), max_tokens=8)
    out_ids = [t for m in g for t in m.token_ids]
    # each token's bytes are its own (a byte-level token may hold part of a character)
    assert [bytes(e.bytes) for e in content] == [
        bytes(tokenizer.convert_tokens_to_ids(c) for c in tokenizer.convert_ids_to_tokens(t))
        if t < 256 else tokenizer.decode([t]).encode() for t in out_ids]
    want = _target_logprobs(hf_target, prompt_ids, out_ids)
    for k, e in enumerate(content):
        assert e.logprob == pytest.approx(float(want[k, out_ids[k]]), abs=1e-4)
        top = want[k].topk(3)
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
    # completions: logprobs=k gives tokens, token_logprobs, top_logprobs dicts, text offsets
    c = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                  logprobs=2).choices[0].logprobs
    assert len(c.tokens) == len(c.token_logprobs) == len(c.top_logprobs) == 6
    assert all(len(t) <= 2 and math.isfinite(v) for t, v in zip(c.top_logprobs, c.token_logprobs))
    assert c.text_offset[0] == 0 and c.text_offset == sorted(c.text_offset)


# ---------------------------------------------------------------------------- errors
BAD = [  # (endpoint, body fields, the parameter the 400 names)
    ("completions", {"temperature": -1}, "temperature"),
    ("completions", {"top_p": 2}, "top_p"),
    ("completions", {"top_k": -1}, "top_k"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"max_tokens": 5000}, "max_tokens"),          # past the context window
    ("completions", {"n": 0}, "n"),
    ("completions", {"n": 999}, "n"),
    ("completions", {"seed": -1}, "seed"),
    ("completions", {"seed": True}, "seed"),                      # JSON integers only
    ("completions", {"seed": "5"}, "seed"),
    ("completions", {"seed": 1.0}, "seed"),
    ("completions", {"seed": 1e20}, "seed"),
    ("completions", {"max_tokens": "8"}, "max_tokens"),
    ("chat", {"n": True}, "n"),
    ("completions", {"stop": [""]}, "stop[0]"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"presence_penalty": 3}, "presence_penalty"),
    ("completions", {"frequency_penalty": -2.5}, "frequency_penalty"),
    ("completions", {"repetition_penalty": -1}, "repetition_penalty"),
    ("completions", {"min_p": 2}, "min_p"),
    ("completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"99999": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"5": 500}}, "logit_bias"),
    ("completions", {"best_of": 2}, "best_of"),
    ("completions", {"echo": True}, "echo"),
    ("completions", {"suffix": "x"}, "suffix"),
    ("completions", {"prompt": [1, 2, 3]}, "prompt"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"foo": 1}, "foo"),
    ("completions", {"drafter": "nope"}, "drafter"),
    ("completions", {"speculation_mode": "weird"}, "speculation_mode"),
    ("completions", {"tree_budget": -1}, "tree_budget"),
    ("completions", {"block_size": -1}, "block_size"),
    ("completions", {"session_id": "bad id!"}, "session_id"),
    ("completions", {"session_id": "s1", "n": 2}, "n"),
    ("completions", {"stop_token_ids": [999999]}, "stop_token_ids[0]"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"stream": True, "stream_options": {"x": 1}}, "stream_options.x"),
    ("completions", {"temperature": "hot"}, "temperature"),
    ("chat", {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"max_completion_tokens": -5}, "max_completion_tokens"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat", {"tool_choice": "auto"}, "tool_choice"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("chat", {"store": True}, "store"),
    ("chat", {"functions": [{"name": "f"}]}, "functions"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].type"),
    ("chat", {"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages[0].name"),
    ("chat", {"messages": [{"content": "x"}]}, "messages[0].role"),
    ("chat", {"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs.tokenize"),
    ("chat", {"chat_template_kwargs": {"not a name": 1}}, "chat_template_kwargs"),
]


def _body(kind: str, extra: dict) -> dict:
    base = ({"model": "tiny", "prompt": PROMPT, "max_tokens": 4} if kind == "completions" else
            {"model": "tiny", "messages": CHAT, "max_tokens": 4})
    return {**base, **extra}


def _url(h, kind):
    return h.url + ("/v1/completions" if kind == "completions" else "/v1/chat/completions")


def test_every_bad_parameter_is_a_400_naming_it_and_the_service_answers_after(served):
    stack, h, client = served
    for kind, extra, param in BAD:
        status, headers, body = request(_url(h, kind), "POST", _body(kind, extra))
        assert status == 400, (kind, extra, status, body)
        err = body["error"]
        assert err["param"] == param, (extra, err)
        assert err["message"].startswith(param) and err["type"] == "invalid_request_error", err
        assert request(h.url + "/health")[0] == 200
    with pytest.raises(openai.BadRequestError) as e:     # the openai client sees the same
        client.completions.create(model="tiny", prompt=PROMPT, temperature=-1)
    assert e.value.body["param"] == "temperature"
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3
    assert stack.gateway.servicer._sessions.get("s1") is None   # a refused request claims nothing


def test_malformed_bodies_unknown_model_and_routes(served):
    _, h, _ = served
    status, _, body = request(h.url + "/v1/completions", "POST", b"{not json")
    assert status == 400 and "JSON" in body["error"]["message"]
    status, _, body = request(h.url + "/v1/completions", "POST", [1, 2])
    assert status == 400
    status, _, body = request(h.url + "/v1/completions", "POST", {"model": "gpt-4", "prompt": "x"})
    assert status == 404 and body["error"]["param"] == "model"
    assert body["error"]["code"] == "model_not_found"
    status, _, body = request(h.url + "/v1/nothing")
    assert status == 404 and body["error"]["type"] == "not_found_error"
    status, _, body = request(h.url + "/v1/completions")            # GET on a POST route
    assert status == 405 and "error" in body
    big = {"model": "tiny", "prompt": "x" * (9 << 20)}
    status, _, body = request(h.url + "/v1/completions", "POST", big)
    assert status == 413


def test_models_lists_the_target_and_its_drafters(served, target_model):
    _, h, client = served
    (m,) = client.models.list().data
    assert m.id == "tiny" and m.owned_by == "dflash-serve"
    assert m.max_model_len == target_model.max_positions
    labels = {d["label"]: d for d in m.drafters}
    assert set(labels) == {"tiny-drafter@1", "oracle@1"}
    assert labels["tiny-drafter@1"]["is_default"] and not labels["oracle@1"]["is_default"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


def test_health_reflects_the_gateways_grpc_health(served):
    stack, h, _ = served
    status, _, body = request(h.url + "/health")
    assert (status, body) == (200, {"status": "ok"})
    stack.gateway.set_upstream(False)           # what VerifierHealthWatch does
    try:
        status, _, body = request(h.url + "/health")
        assert status == 503 and body["status"] == "not serving"
    finally:
        stack.gateway.set_upstream(True)
    assert request(h.url + "/health")[0] == 200


def test_response_shapes_are_openais(served):
    """Our models' fields are OpenAI's (plus the documented extensions), and real responses
    parse as openai.types with validation."""
    from openai.types import Completion, CompletionChoice, Model, completion_create_params as completion_params
    from openai.types.chat import ChatCompletion, ChatCompletionChunk, completion_create_params as chat_params
    from openai.types.chat.chat_completion import Choice as ChatChoice
    from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice

    from gateway import openai_models as ours

    pairs = [(ours.Completion, Completion), (ours.CompletionChoice, CompletionChoice),
             (ours.ChatCompletion, ChatCompletion), (ours.ChatChoice, ChatChoice),
             (ours.ChatCompletionChunk, ChatCompletionChunk), (ours.ChunkChoice, ChunkChoice),
             (ours.ModelCard, Model)]
    for mine, theirs in pairs:
        ext = ours.EXTENSIONS.get(mine.__name__, set())
        assert set(mine.model_fields) - ext <= set(theirs.model_fields), mine.__name__
        required = {k for k, f in theirs.model_fields.items() if f.is_required()}
        assert required <= set(mine.model_fields), (mine.__name__, required - set(mine.model_fields))
    for mine, theirs in ((ours.CompletionRequest, completion_params.CompletionCreateParamsBase),
                         (ours.ChatRequest, chat_params.CompletionCreateParamsBase)):
        ext = ours.EXTENSIONS[mine.__name__]
        allowed = set(theirs.__annotations__) | {"stream"}
        assert set(mine.model_fields) - ext <= allowed, set(mine.model_fields) - ext - allowed

    _, h, _ = served
    status, _, body = request(_url(h, "completions"), "POST", _body("completions", {"logprobs": 1}))
    assert status == 200
    Completion.model_validate(body)
    status, _, body = request(_url(h, "chat"), "POST", _body("chat", {"n": 2}))
    ChatCompletion.model_validate(body)
    status, _, text = request(_url(h, "chat"), "POST", _body("chat", {
        "stream": True, "stream_options": {"include_usage": True}}))
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    for e in events[:-1]:
        ChatCompletionChunk.model_validate(e)


# ---------------------------------------------------------------------------- through build()
@pytest.fixture
def built(tokenizer, tmp_path):
    """gateway.server.build with http_bind, API keys (one rate-limited), a scripted verifier."""
    from gateway.auth import ClientAuth, load_api_keys
    from gateway.server import build

    fake = ScriptedVerifier(tokenizer.encode("scripted output"))
    vserver, vaddr, vhealth = serve_verifier(fake)
    keys_file = tmp_path / "keys"
    keys_file.write_text("alice-key-0123456789 alice\nslow-key-01234567890 slow 0 1\n")
    rt = build(tokenizer, vaddr, "127.0.0.1:0", max_positions=1024, http_bind="127.0.0.1:0",
               api_keys=ClientAuth(load_api_keys(keys_file)), model_name="tiny")
    rt.server.start()
    rt.set_serving(True)
    yield rt, fake, vhealth
    rt.server.stop(0)
    vserver.stop(0)


def test_build_serves_http_with_api_keys_health_and_the_verifiers_refusals(built):
    rt, fake, vhealth = built
    url = rt.http.url
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 32, "temperature": 0}
    status, _, err = request(url + "/v1/completions", "POST", body)
    assert status == 401 and err["error"]["type"] == "authentication_error"
    status, _, _ = request(url + "/v1/completions", "POST", body,
                           {"authorization": "Bearer wrong-key-0123456789"})
    assert status == 401
    assert request(url + "/v1/models")[0] == 401
    assert request(url + "/health")[0] in (200, 503)           # no key needed
    alice = openai.OpenAI(base_url=url + "/v1", api_key="alice-key-0123456789", max_retries=0)
    r = alice.completions.create(model="tiny", prompt="Hi", max_tokens=32, temperature=0)
    assert r.choices[0].text == "scripted output"
    assert r.metrics is None         # no drafter registered: speculation off
    # the key's rate (1 request/s, a burst of one): the second at once is a 429 with a hint
    slow = {"authorization": "Bearer slow-key-01234567890"}
    assert request(url + "/v1/completions", "POST", body, slow)[0] == 200
    status, headers, err = request(url + "/v1/completions", "POST", body, slow)
    assert status == 429 and int(headers["retry-after-ms"]) > 0 and "retry-after" in headers
    # the verifier's admission refusal: 429 with its hint; the verifier down: 503
    fake.fail = (grpc.StatusCode.RESOURCE_EXHAUSTED, "admission: max_waiting", 250)
    status, headers, err = request(url + "/v1/completions", "POST", body,
                                   {"authorization": "Bearer alice-key-0123456789"})
    assert status == 429 and headers["retry-after-ms"] == "250"
    assert err["error"]["type"] == "rate_limit_error" and "max_waiting" in err["error"]["message"]
    fake.fail = (grpc.StatusCode.UNAVAILABLE, "draining", None)
    status, _, err = request(url + "/v1/chat/completions", "POST",
                             {"model": "tiny", "messages": CHAT, "stream": True},
                             {"authorization": "Bearer alice-key-0123456789"})
    assert status == 503 and err["error"]["type"] == "service_unavailable_error"
    # the verifier's own INVALID_ARGUMENT names its field, as the gateway's request calls it
    fake.fail = (grpc.StatusCode.INVALID_ARGUMENT, "speculation.mode: 'x' not one of off", None)
    status, _, err = request(url + "/v1/completions", "POST", body,
                             {"authorization": "Bearer alice-key-0123456789"})
    assert status == 400 and err["error"]["param"] == "speculation_mode"
    fake.fail = None
    # /health is the gRPC health: the verifier NOT_SERVING makes both NOT_SERVING
    wait_until(lambda: request(url + "/health")[0] == 200, 5, "/health to answer 200")
    vhealth.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    wait_until(lambda: request(url + "/health")[0] == 503, 5,
               "/health to answer 503 after the verifier went NOT_SERVING")
    assert not rt.serving


def test_logprobs_follow_their_tokens_and_are_cut_at_the_stop_string(built, tokenizer):
    """Scripted verifier: each token's logprob names it; deltas group tokens and a stop string
    cuts the stream; the logprobs must be exactly those of the ids reported, in order."""
    from gateway_doubles import fake_logprob

    rt, fake, _ = built
    auth = {"authorization": "Bearer alice-key-0123456789"}
    ids = tokenizer.encode("scripted output")
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 32, "logprobs": True,
            "top_logprobs": 2, "stop": ["ted"], "stream": True}
    status, _, text = request(rt.http.url + "/v1/chat/completions", "POST", body, auth)
    assert status == 200
    events = sse_events(text)
    content, lps = "", []
    for e in events[:-1]:
        for ch in e["choices"]:
            content += ch["delta"].get("content") or ""
            lps += (ch.get("logprobs") or {}).get("content") or []
    assert content == "scrip"
    n = len(tokenizer.encode("scripted"))       # up to the token completing the stop string
    assert [lp["logprob"] for lp in lps] == pytest.approx(
        [fake_logprob(t).logprob for t in ids[:n]])
    assert [lp["token"] for lp in lps] == [tokenizer.decode([t]) for t in ids[:n]]
    assert all([t["logprob"] for t in lp["top_logprobs"]] ==
               pytest.approx([lp["logprob"], lp["logprob"] - 1]) for lp in lps)
    # the verifier was asked for them
    assert fake.requests[-1].sampling.logprobs and fake.requests[-1].sampling.top_logprobs == 2


# ---------------------------------------------------------------------------- a client that leaves
@pytest.fixture
def slow_gateway(tokenizer):
    """gateway.server.build over a scripted verifier that streams 600 tokens, one per 20 ms."""
    from gateway.server import build

    fake = ScriptedVerifier(list(range(10, 610)), sizes=(1,), delay_s=0.02)
    vserver, vaddr, _ = serve_verifier(fake)
    rt = build(tokenizer, vaddr, "127.0.0.1:0", max_positions=1024, http_bind="127.0.0.1:0",
               model_name="tiny")
    rt.server.start()
    rt.set_serving(True)
    yield rt, fake
    rt.server.stop(0)
    vserver.stop(0)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_disconnects_cancels_its_generation(slow_gateway, stream):
    """The verifier's stream of a request whose client closed the connection is cancelled, and
    its slot freed, long before the 12 s the whole answer takes (JSON: nothing was sent yet)."""
    rt, fake = slow_gateway
    front = rt.http.front
    status, _, done = request(rt.http.url + "/v1/completions", "POST",
                              {"model": "tiny", "prompt": "Hi", "max_tokens": 3, "temperature": 0})
    assert status == 200 and done["choices"][0]["finish_reason"] == "length"
    wait_until(lambda: fake.completed == 1 and front.open == 0, 5, "the first request to end")
    body = json.dumps({"model": "tiny", "prompt": "Hi", "max_tokens": 600, "temperature": 0,
                       "stream": stream}).encode()
    host, port = rt.http.host, rt.http.port
    sock = socket.create_connection((host, port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n" % (host.encode(), len(body)) + body)
    wait_until(lambda: fake.streamed >= 3 + 5 and front.open == 1, 5,  # generating
               "the second request's first tokens")
    sock.close()
    wait_until(lambda: fake.cancelled == 1 and front.open == 0, 5, "the verifier stream's cancel")
    assert fake.completed == 1
    # and the server answers the next request
    status, _, _ = request(rt.http.url + "/v1/completions", "POST",
                           {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert status == 200


# ---------------------------------------------------------------------------- HTTPS
TLS_HOSTS = ["localhost", "127.0.0.1"]


def _serial(issued) -> int:
    from cryptography import x509

    return x509.load_pem_x509_certificate(issued.cert).serial_number


def issue_of(d, stem: str):
    """The Issued pair written as ``<stem>.pem`` / ``<stem>-key.pem`` under ``d``."""
    from dflash.serving.tls import Issued

    return Issued(cert=(d / f"{stem}.pem").read_bytes(), key=(d / f"{stem}-key.pem").read_bytes())


def https_get(port: int, path: str, ca, client_files=None) -> tuple[int, int]:
    """(status, serial of the certificate the server presented) of GET ``path`` over a fresh
    HTTPS connection verified against ``ca`` (an Issued), presenting ``client_files``
    ((cert path, key path)) when given. Raises ssl.SSLError or OSError when refused."""
    from cryptography import x509

    ctx = ssl.create_default_context(cadata=ca.cert.decode())
    if client_files:
        ctx.load_cert_chain(*map(str, client_files))
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=10)
    try:
        conn.request("GET", path)
        status = conn.getresponse().status
        return status, x509.load_der_x509_certificate(conn.sock.getpeercert(binary_form=True)).serial_number
    finally:
        conn.close()


def grpc_health(port: int, ca, client_files=None):
    """The gateway's gRPC health over a fresh TLS channel verified against ``ca``."""
    from grpc_health.v1 import health_pb2_grpc

    from dflash.serving.tls import ClientTLS, channel

    cert, key = (p.read_bytes() for p in client_files) if client_files else (None, None)
    with channel(f"127.0.0.1:{port}", ClientTLS(ca=ca.cert, cert=cert, key=key)) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status


@pytest.fixture
def tls_gateway(tokenizer, tmp_path, request):
    """(rt, ServerTLS, CA, cert dir): gateway.server.build with one ServerTLS for the gRPC port
    and the HTTP API, as ``python -m gateway --tls-cert --tls-key [--tls-ca]`` wires it;
    ``request.param`` True: client certificates required (mTLS)."""
    from dflash.serving.tls import ServerTLS, TLSFiles, issue, new_ca, write_pair
    from gateway.server import build

    ca = new_ca()
    cert, key = write_pair(tmp_path, "gateway", issue(ca, "gateway", TLS_HOSTS))
    ca_path = tmp_path / "ca.pem"
    ca_path.write_bytes(ca.cert)
    mtls = getattr(request, "param", False)
    tls = ServerTLS(TLSFiles(str(cert), str(key), str(ca_path) if mtls else None))
    fake = ScriptedVerifier(tokenizer.encode("ok"))
    vserver, vaddr, _ = serve_verifier(fake)
    rt = build(tokenizer, vaddr, "127.0.0.1:0", max_positions=1024, http_bind="127.0.0.1:0",
               model_name="tiny", tls=tls)
    rt.server.start()
    rt.set_serving(True)
    yield rt, tls, ca, tmp_path
    rt.server.stop(0)
    vserver.stop(0)


def test_https_serves_the_grpc_ports_certificate_and_both_reload_a_renewed_one(tls_gateway):
    from dflash.serving.tls import issue, new_ca, write_pair

    rt, tls, ca, d = tls_gateway
    assert rt.http.url.startswith("https://")
    status, serial = https_get(rt.http.port, "/v1/models", ca)
    assert status == 200 and serial == _serial(issue_of(d, "gateway"))
    # renewed by another CA while serving: the next HTTPS connection gets it, then the next gRPC
    # one (each port notices the change itself: neither consumes the other's reload)
    ca2 = new_ca("renewed CA")
    renewed = issue(ca2, "gateway", TLS_HOSTS)
    write_pair(d, "gateway", renewed)
    assert https_get(rt.http.port, "/v1/models", ca2) == (200, _serial(renewed))
    assert grpc_health(rt.port, ca2) == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises((ssl.SSLError, OSError)):
        https_get(rt.http.port, "/health", ca)        # the old CA no longer verifies it
    assert rt.http.tls.reloads == 1 and tls.reloads == 1


def _write_in_place(path, data: bytes, size: int) -> None:
    # Same inode, size and mtime: only a forced reload (SIGHUP) can notice the change.
    st = os.stat(path)
    with open(path, "r+b") as fh:
        fh.write(data.ljust(size, b"\n"))
        fh.truncate()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_sighup_reloads_https_as_it_reloads_grpc(tls_gateway):
    from dflash.serving.tls import issue, new_ca

    rt, tls, ca, d = tls_gateway
    size = 2048
    for stem in ("gateway", "gateway-key"):   # padded, so the replacement keeps the size
        p = d / f"{stem}.pem"
        p.write_bytes(p.read_bytes().ljust(size, b"\n"))
    tls.request_reload()
    assert https_get(rt.http.port, "/health", ca)[1] == _serial(issue_of(d, "gateway"))
    ca2 = new_ca("renewed CA")
    renewed = issue(ca2, "gateway", TLS_HOSTS)
    _write_in_place(d / "gateway-key.pem", renewed.key, size)
    _write_in_place(d / "gateway.pem", renewed.cert, size)
    reloads = rt.http.tls.reloads
    assert https_get(rt.http.port, "/health", ca)[1] != _serial(renewed)   # looks unchanged
    tls.request_reload()                                                   # what SIGHUP does
    assert https_get(rt.http.port, "/health", ca2)[1] == _serial(renewed)
    assert grpc_health(rt.port, ca2) == health_pb2.HealthCheckResponse.SERVING
    assert rt.http.tls.reloads == reloads + 1


def test_an_invalid_replacement_keeps_the_https_certificate(tls_gateway, caplog):
    from dflash.serving.tls import issue, write_pair

    rt, tls, ca, d = tls_gateway
    first = _serial(issue_of(d, "gateway"))
    (d / "gateway.pem").write_bytes(b"-----BEGIN CERTIFICATE-----\nMIIB")   # half written
    assert https_get(rt.http.port, "/health", ca)[1] == first
    other = issue(ca, "gateway", TLS_HOSTS)
    (d / "gateway.pem").write_bytes(other.cert)     # the certificate without its key yet
    assert https_get(rt.http.port, "/health", ca)[1] == first
    assert rt.http.tls.reloads == 0
    assert "HTTPS certificate reload refused" in caplog.text and "--tls-key" in caplog.text
    write_pair(d, "gateway", other)                 # and the key: now it loads
    assert https_get(rt.http.port, "/health", ca)[1] == _serial(other)
    assert rt.http.tls.reloads == 1


@pytest.mark.parametrize("tls_gateway", [True], indirect=True)
def test_https_requires_a_client_certificate_with_tls_ca_also_after_a_reload(tls_gateway):
    from dflash.serving.tls import issue, write_pair

    rt, tls, ca, d = tls_gateway
    mine = write_pair(d, "client", issue(ca, "client", TLS_HOSTS))
    for renewed in (None, issue(ca, "gateway", TLS_HOSTS)):
        if renewed is not None:
            write_pair(d, "gateway", renewed)
        with pytest.raises((ssl.SSLError, OSError)):
            https_get(rt.http.port, "/health", ca)              # no client certificate
        status, serial = https_get(rt.http.port, "/v1/models", ca, mine)
        assert status == 200
        if renewed is not None:
            assert serial == _serial(renewed) and rt.http.tls.reloads == 1


def test_an_http_port_in_use_or_a_malformed_address_is_refused_naming_the_flag():
    from gateway.http_server import HttpServer

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        with pytest.raises(RuntimeError, match=r"^--http-port: cannot bind 127\.0\.0\.1:\d+: "):
            HttpServer(lambda scope, receive, send: None, f"127.0.0.1:{taken.getsockname()[1]}")
    finally:
        taken.close()
    with pytest.raises(ValueError, match="^--http-host: expected host:port"):
        HttpServer(lambda scope, receive, send: None, "127.0.0.1")
