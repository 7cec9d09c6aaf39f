"""Hostile but well-formed HTTP bodies against the documented secure setup (the certificates of
``dflash certs``, mTLS on every link, HTTPS with client certificates, an API key, the tiny
target behind a real verifier): each is a 400 in OpenAI's error shape naming the parameter,
never a 5xx, and the service is healthy after every one (gateway/openai_body.py for the parse
limits, gateway/openai_models.py for the strict types and ranges)."""

from __future__ import annotations

import http.client
import json
import ssl

import pytest

from dflash.serving.tls import ClientTLS, ServerTLS, TLSFiles, make_dev_certs
from gateway.openai_body import MAX_JSON_DEPTH, BodyError, check_value, parse_body

KEY = "hostile-test-key-0123456789"
CHAT = '"messages": [{"role": "user", "content": "hi"}]'


def _deep(n: int) -> str:
    return "[" * n + "]" * n


def _kwargs_deep(n: int) -> str:
    return '{"a": ' * n + "1" + "}" * n


# (endpoint, the raw JSON members after "model", the parameter the 400 names)
HOSTILE = [
    # the five
    ("completions", r'"prompt": "\ud800"', "prompt"),
    ("completions", f'"prompt": "x", "user": {_deep(100_000)}', "user"),
    ("chat", f'{CHAT}, "chat_template_kwargs": {_kwargs_deep(500)}', "chat_template_kwargs"),
    ("completions", '"prompt": "x", "temperature": 1e9', "temperature"),
    ("completions", '"prompt": "x", "stream": true, "stream_options": {"include_usage": "yes"}',
     "stream_options.include_usage"),
    # encodings
    ("chat", r'"messages": [{"role": "user", "content": "a\udc00b"}]', "messages[0].content"),
    ("chat", r'"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]',
     "messages[0].content[0].text"),
    ("completions", r'"prompt": "x", "stop": ["ok", "\udfff"]', "stop[1]"),
    ("chat", CHAT + r', "chat_template_kwargs": {"\ud800": 1}', "chat_template_kwargs.?"),
    ("completions", '"prompt": "\xff\xfe"', "prompt"),            # bytes that are not UTF-8
    # depth
    ("completions", f'"prompt": "x", "user": {_deep(MAX_JSON_DEPTH + 2)}', "user"),
    ("chat", f'{CHAT}, "tools": {_deep(200)}', "tools"),
    ("completions", f'"prompt": {_deep(5_000)}', "prompt"),
    ("chat", f'{CHAT}, "chat_template_kwargs": {{"k": {_deep(40)}}}', "chat_template_kwargs"),
    # numbers that are not JSON's, or too long
    ("completions", '"prompt": "x", "temperature": NaN', "temperature"),
    ("completions", '"prompt": "x", "top_p": Infinity', "top_p"),
    ("completions", '"prompt": "x", "presence_penalty": -Infinity', "presence_penalty"),
    ("completions", '"prompt": "x", "max_tokens": ' + "9" * 5000, "max_tokens"),
    ("completions", '"prompt": "x", "temperature": 1e400', "temperature"),
    # OpenAI's ranges
    ("completions", '"prompt": "x", "temperature": 2.5', "temperature"),
    ("completions", '"prompt": "x", "top_p": 1.01', "top_p"),
    ("completions", '"prompt": "x", "top_p": -0.1', "top_p"),
    ("chat", CHAT + ', "presence_penalty": 2.5', "presence_penalty"),
    ("chat", CHAT + ', "frequency_penalty": -3', "frequency_penalty"),
    ("completions", '"prompt": "x", "min_p": 1.5', "min_p"),
    ("completions", '"prompt": "x", "logit_bias": {"5": 1e9}', "logit_bias"),
    ("completions", '"prompt": "x", "max_tokens": 1099511627776', "max_tokens"),
    ("completions", '"prompt": "x", "seed": 1180591620717411303424', "seed"),
    # strict types
    ("completions", '"prompt": "x", "temperature": "0.5"', "temperature"),
    ("completions", '"prompt": "x", "temperature": true', "temperature"),
    ("completions", '"prompt": "x", "stream": "true"', "stream"),
    ("completions", '"prompt": "x", "stream": 1', "stream"),
    ("completions", '"prompt": "x", "speculation": "no"', "speculation"),
    ("chat", CHAT + ', "logprobs": "yes"', "logprobs"),
    ("completions", '"prompt": "x", "echo": 0', "echo"),
    ("chat", CHAT + ', "store": "false"', "store"),
    ("completions", '"prompt": "x", "logit_bias": {"5": "high"}', "logit_bias.5"),
    ("completions", '"prompt": "x", "top_k": 1.5', "top_k"),
    ("chat", '"messages": [{"role": 7, "content": "x"}]', "messages[0].role"),
    ("completions", '"prompt": {"text": "x"}', "prompt"),
]


def test_forty_hostile_bodies():
    assert len(HOSTILE) == 40 and len({h[1] for h in HOSTILE}) == 40


# ------------------------------------------------------------------ the parser alone
def test_parse_body_names_the_parameter_without_recursing():
    with pytest.raises(BodyError) as e:
        parse_body(b'{"a": {"b": ' + _deep(200_000).encode() + b"}}")
    assert e.value.param == "a" and "nested deeper than" in str(e.value)
    check_value({"a": [[[[1]]]]}, max_depth=5)
    with pytest.raises(BodyError, match="^a: nested"):
        check_value({"a": [[[[1]]]]}, max_depth=4)
    assert parse_body(b'\xef\xbb\xbf{"prompt": "caf\xc3\xa9 \\ud83d\\ude00"}') == {
        "prompt": "caf\u00e9 \U0001F600"}                 # a BOM, a surrogate pair: fine
    with pytest.raises(BodyError, match="the body must be a JSON object"):
        parse_body(b"[1]")


# ------------------------------------------------------------------ the secure tiny stack
@pytest.fixture(scope="module")
def secure(tmp_path_factory, target_model, tokenizer):
    """verifier <-mTLS- gateway (HTTPS requiring client certificates, an API key)."""
    from gateway.auth import ClientAuth, load_api_keys
    from gateway.server import build as build_gateway
    from verifier_svc.engine import VerifierEngine
    from verifier_svc.server import build as build_verifier

    d = tmp_path_factory.mktemp("hostile")
    paths = make_dev_certs(d / "certs", ["localhost", "127.0.0.1"])
    ca = str(paths["ca"][0])

    def files(role):
        return TLSFiles(str(paths[role][0]), str(paths[role][1]), ca)

    keys = d / "keys"
    keys.write_text(f"{KEY} tester\n")
    engine = VerifierEngine(target_model)
    verifier = build_verifier(engine, "127.0.0.1:0", tls=ServerTLS(files("verifier")))
    verifier.server.start()
    verifier.set_serving(True)
    gateway = build_gateway(tokenizer, f"localhost:{verifier.port}", "127.0.0.1:0",
                            max_positions=target_model.max_positions, http_bind="127.0.0.1:0",
                            model_name="tiny", tls=ServerTLS(files("gateway")),
                            upstream_tls=ClientTLS.from_files(files("gateway")),
                            api_keys=ClientAuth(load_api_keys(keys)))
    gateway.server.start()
    gateway.set_serving(True)
    ctx = ssl.create_default_context(cafile=ca)
    ctx.load_cert_chain(str(paths["client"][0]), str(paths["client"][1]))
    yield gateway, ctx
    gateway.server.stop(0)
    verifier.server.stop(0)
    engine.close()


def _call(gateway, ctx, method: str, path: str, body: bytes | None = None):
    conn = http.client.HTTPSConnection("127.0.0.1", gateway.http.port, context=ctx, timeout=60)
    try:
        conn.request(method, path, body=body, headers={"content-type": "application/json",
                                                       "authorization": f"Bearer {KEY}"})
        r = conn.getresponse()
        raw = r.read()
    finally:
        conn.close()
    try:
        return r.status, json.loads(raw)
    except ValueError:
        return r.status, raw


def _raw(kind: str, members: str) -> bytes:
    text = '{"model": "tiny", "max_tokens": 2, ' + members + "}"
    # "\xff\xfe" above stands for two bytes that are not UTF-8: latin-1 writes them as such
    return text.encode("latin-1") if "\xff" in text else text.encode()


@pytest.mark.parametrize("kind, members, param", HOSTILE, ids=[h[2] for h in HOSTILE])
def test_a_hostile_body_is_a_400_naming_the_parameter_and_the_service_stays_healthy(
        secure, kind, members, param):
    gateway, ctx = secure
    path = "/v1/completions" if kind == "completions" else "/v1/chat/completions"
    status, body = _call(gateway, ctx, "POST", path, _raw(kind, members))
    assert status == 400, (status, body)
    err = body["error"]
    assert err["param"] == param, err
    assert err["message"].startswith(param) and err["type"] == "invalid_request_error", err
    assert _call(gateway, ctx, "GET", "/health") == (200, {"status": "ok"})


def test_an_ordinary_request_still_works_after_them(secure):
    gateway, ctx = secure
    status, body = _call(gateway, ctx, "POST", "/v1/completions", _raw(
        "completions", '"prompt": "Hi", "temperature": 2, "top_p": 1, "presence_penalty": -2, '
                       '"stream": false, "speculation": false, "logit_bias": {"5": -100}'))
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 2
