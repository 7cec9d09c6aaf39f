"""Streaming text: incremental detokenization of byte-level tokens, and stop strings.

With the tiny target's byte-level tokenizer every UTF-8 byte is one token, so an emoji spans 4
tokens and a CJK character 3: a naive stream would show U+FFFD for partial characters or repeat
them. Unit tests drive ``IncrementalDetokenizer`` directly; the gateway test puts the real
``GatewayServicer`` behind real gRPC in front of a fake Verifier that streams a fixed token
sequence in uneven chunks.
"""

from __future__ import annotations

import random
import threading
from concurrent import futures

import grpc
import pytest

from dflash.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from gateway.detok import IncrementalDetokenizer

FFFD = "\ufffd"
TEXTS = {
    "emoji": "😀🎉👍🏽 ok 🚀🧪",                       # 4-byte characters (and a modifier)
    "cjk": "世界你好，中文字符。日本語のテキスト",         # 3-byte characters
    "mixed": "héllo wörld 😀 — 世界! ASCII, ©, ☃, 𝄞 and back to plain text.",  # 1..4 bytes
}


def chunks(ids: list[int], sizes) -> list[list[int]]:
    out, i = [], 0
    for n in sizes:
        if i >= len(ids):
            break
        out.append(ids[i:i + n])
        i += n
    if i < len(ids):
        out.append(ids[i:])
    return out


def random_chunks(ids: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return chunks(ids, [rng.randint(1, 7) for _ in range(len(ids))])


def stream(tokenizer, parts: list[list[int]], stop=()) -> tuple[list[str], list[int], IncrementalDetokenizer]:
    """Push ``parts``; returns (text deltas incl. finish, reported ids, the detokenizer)."""
    d = IncrementalDetokenizer(tokenizer, list(stop))
    deltas, ids = [], []
    for p in parts:
        delta = d.push(p)
        deltas.append(delta.text)
        ids += delta.token_ids
        # What is out so far never has to be taken back.
        assert "".join(deltas) == d.emitted
    end = d.finish()
    deltas.append(end.text)
    ids += end.token_ids
    return deltas, ids, d


def assert_clean(deltas: list[str]):
    for t in deltas:
        assert FFFD not in t, f"partial character in delta {t!r}"


# ---------------------------------------------------------------------------- detokenizer
@pytest.mark.parametrize("name", TEXTS)
def test_one_token_at_a_time(tokenizer, name):
    text = TEXTS[name]
    ids = tokenizer.encode(text)
    assert len(ids) == len(text.encode())  # byte-level: 1 token per byte
    deltas, got_ids, _ = stream(tokenizer, [[t] for t in ids])
    assert_clean(deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert got_ids == ids
    # Every character comes out exactly once, as soon as its last byte arrives.
    nonempty = [t for t in deltas if t]
    assert nonempty == list(text)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("name", TEXTS)
def test_random_chunks(tokenizer, name, seed):
    text = TEXTS[name]
    ids = tokenizer.encode(text)
    deltas, got_ids, _ = stream(tokenizer, random_chunks(ids, seed))
    assert_clean(deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert got_ids == ids
    assert sorted("".join(deltas)) == sorted(text)


def test_text_is_released_when_its_character_completes(tokenizer):
    d = IncrementalDetokenizer(tokenizer)
    emoji = tokenizer.encode("😀")
    assert d.push([ord("a")]).text == "a"
    for b in emoji[:-1]:
        delta = d.push([b])
        assert delta.text == "" and delta.token_ids == []
    delta = d.push([emoji[-1]])
    assert delta.text == "😀"
    assert delta.token_ids == emoji  # the ids whose text completed in this delta


def test_eos_is_not_text(tokenizer):
    ids = tokenizer.encode("世界") + [tokenizer.eos_token_id]
    deltas, got_ids, _ = stream(tokenizer, [ids[:2], ids[2:]])
    assert "".join(deltas) == "世界"
    assert got_ids == ids


def test_incomplete_character_at_the_very_end(tokenizer):
    # Documented: finish() flushes an unfinished character as U+FFFD (nothing is lost silently).
    ids = tokenizer.encode("ok😀")[:-2]
    deltas, _, _ = stream(tokenizer, [[t] for t in ids])
    assert deltas[:-1] and FFFD not in "".join(deltas[:-1])
    assert "".join(deltas) == "ok" + FFFD


# ---------------------------------------------------------------------------- stop strings
STOP_CASES = [
    # (text, stop strings, expected output)
    ("Hello world. STOP and more text", ["STOP"], "Hello world. "),
    ("emoji 😀🎉 then 世界 end", ["🎉 th"], "emoji 😀"),       # stop spans multi-byte tokens
    ("中文字符。日本語", ["字符。"], "中文"),
    ("abc END xyz END", ["END"], "abc "),                     # first occurrence wins
    ("one two three", ["three", "two"], "one "),               # earliest of several stops
    ("STOP right away", ["STOP"], ""),
    ("partial 😀", ["😀"], "partial "),
]


@pytest.mark.parametrize("text,stop,want", STOP_CASES)
@pytest.mark.parametrize("split", ["tokens", "chunks", "whole"])
def test_stop_string(tokenizer, text, stop, want, split):
    ids = tokenizer.encode(text)
    parts = {"tokens": [[t] for t in ids], "chunks": random_chunks(ids, len(text)),
             "whole": [ids]}[split]
    deltas, got_ids, d = stream(tokenizer, parts, stop)
    assert_clean(deltas)
    assert "".join(deltas) == want
    assert d.stopped
    # Consumed exactly up to the token that completed the (first completed) stop string.
    end, start = min((text.find(s) + len(s), text.find(s)) for s in stop if s in text)
    assert want == text[:start]
    n = len(text[:end].encode())
    assert d.num_tokens == n
    assert got_ids == ids[:n]
    # After the stop nothing more comes out, whatever is pushed.
    assert d.push(tokenizer.encode(" more")).text == ""
    assert d.finish().text == ""


def test_stop_prefix_that_is_not_a_stop_is_emitted_later(tokenizer):
    d = IncrementalDetokenizer(tokenizer, ["STOP"])
    out = d.push(tokenizer.encode("go STO")).text
    assert out == "go "                           # "STO" might still become "STOP": held
    assert d.push(tokenizer.encode("R")).text == "STOR"  # it did not: released
    assert d.push(tokenizer.encode("M ST")).text == "M "
    assert d.push(tokenizer.encode("OP!")).text == ""
    assert d.stopped and d.emitted == "go STORM "


def test_multibyte_stop_prefix_released_at_the_end(tokenizer):
    text = "a 世 b 世"
    deltas, _, d = stream(tokenizer, [[t] for t in tokenizer.encode(text)], ["世界"])
    assert_clean(deltas)
    assert not d.stopped
    assert "".join(deltas) == text
    assert deltas[-1] == "世"  # held until finish(): it could still have become "世界"


# ---------------------------------------------------------------------------- through the gateway
STREAM_TEXT = "Streaming 😀🎉 世界你好 mixed ©☃ text 𝄞 — STOP here 👍 and never this"
CHUNK_SIZES = [1, 3, 2, 5, 1, 1, 7, 4, 2, 6, 3, 1, 9]


class FakeVerifier(verifier_pb2_grpc.VerifierServicer):
    """Streams the byte tokens of STREAM_TEXT in uneven chunks. With ``hold_s`` it then keeps the
    stream open, as if still generating, until the caller cancels (or ``hold_s`` passes)."""

    def __init__(self, tokenizer):
        self.ids = tokenizer.encode(STREAM_TEXT)
        self.requests: list[verifier_pb2.VerifierGenerateRequest] = []
        self.ended = threading.Event()       # set when the RPC ends, whichever way
        self.completed = False               # the whole stream went out
        self.hold_s = 0.0

    def Generate(self, request, context):
        self.requests.append(request)
        context.add_callback(self.ended.set)
        parts = chunks(self.ids, CHUNK_SIZES * 10)
        for p in parts[:-1]:
            yield verifier_pb2.VerifierGenerateChunk(token_ids=p)
        if self.hold_s:
            self.ended.wait(self.hold_s)
        last = verifier_pb2.VerifierGenerateChunk(
            token_ids=parts[-1], finish_reason=common_pb2.FINISH_REASON_LENGTH,
            prompt_tokens=len(request.prompt_token_ids))
        last.stats.drafts = 0
        yield last
        self.completed = True


@pytest.fixture
def fake_gateway(tokenizer):
    from gateway.server import build

    fake = FakeVerifier(tokenizer)
    vserver = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    verifier_pb2_grpc.add_VerifierServicer_to_server(fake, vserver)
    vport = vserver.add_insecure_port("127.0.0.1:0")
    vserver.start()
    gw = build(tokenizer, f"127.0.0.1:{vport}", "127.0.0.1:0", max_positions=1024)
    gw.server.start()
    gw.set_serving(True)
    ch = grpc.insecure_channel(f"127.0.0.1:{gw.port}")
    yield gateway_pb2_grpc.GatewayStub(ch), fake
    ch.close()
    gw.server.stop(0)
    vserver.stop(0)


def _generate(stub, **kw):
    resps = list(stub.Generate(gateway_pb2.GenerateRequest(prompt="Hi", **kw), timeout=30))
    return resps, "".join(r.text for r in resps)


def test_gateway_streams_multibyte_text(fake_gateway, tokenizer):
    stub, fake = fake_gateway
    resps, text = _generate(stub, max_tokens=len(fake.ids))
    assert text == STREAM_TEXT
    assert len([r for r in resps if r.text]) > 5  # really streamed, in pieces
    for r in resps:
        assert FFFD not in r.text
        if r.token_ids:  # the ids of a delta decode to exactly its text
            assert tokenizer.decode(list(r.token_ids)) == r.text
    assert [t for r in resps for t in r.token_ids] == fake.ids
    last = resps[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert last.usage.completion_tokens == len(fake.ids)
    assert last.usage.prompt_tokens == 2
    assert list(fake.requests[0].prompt_token_ids) == tokenizer.encode("Hi")
    assert fake.ended.wait(5) and fake.completed


@pytest.mark.parametrize("stop", ["STOP", "🎉 世", "界你", "☃ text"])
def test_gateway_stop_string(fake_gateway, tokenizer, stop):
    stub, fake = fake_gateway
    fake.hold_s = 10.0
    resps, text = _generate(stub, max_tokens=len(fake.ids), stop=[stop])
    assert text == STREAM_TEXT[:STREAM_TEXT.index(stop)]
    assert all(FFFD not in r.text for r in resps)
    last = resps[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_STOP
    n = len(STREAM_TEXT[:STREAM_TEXT.index(stop) + len(stop)].encode())
    assert last.usage.completion_tokens == n  # counted up to the token completing the stop
    # The gateway cancelled the verifier stream at the stop: it ended long before the fake's
    # 10 s hold, without the rest of the stream.
    assert fake.ended.wait(5)
    assert not fake.completed
