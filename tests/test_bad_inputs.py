"""Bad inputs are refused with the right status and a message naming the field; services stay up.

Gateway: INVALID_ARGUMENT for bad requests (checked at the gateway or passed through from the
verifier). Verifier: INVALID_ARGUMENT for bad prompts; FAILED_PRECONDITION for drafters that do
not fit the target (CheckDrafter, gateway registration, Generate with speculation).
"""

from __future__ import annotations

import dataclasses
import math

import grpc
import pytest

from dflash.core.convert import card_to_proto
from dflash.v1 import common_pb2, gateway_pb2, verifier_pb2

from doubles import ReferenceDrafter
from helpers import Stack, generate_ids

NAN = float("nan")


def _sp(**kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**kw)


def _chat(*msgs) -> gateway_pb2.ChatMessages:
    return gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role=r, content=c) for r, c in msgs])


# (case id, request fields, field the error must name)
GATEWAY_CASES = [
    ("empty-prompt", dict(prompt="", max_tokens=4), "prompt"),
    ("no-input", dict(max_tokens=4), "prompt"),
    ("empty-chat", dict(chat=gateway_pb2.ChatMessages(), max_tokens=4), "chat.messages"),
    ("chat-no-role", dict(chat=_chat(("user", "hi"), ("", "x")), max_tokens=4), "chat.messages[1].role"),
    ("max-tokens-0", dict(prompt="Hi", max_tokens=0), "max_tokens"),
    ("max-tokens-neg", dict(prompt="Hi", max_tokens=-3), "max_tokens"),
    ("temperature-neg", dict(prompt="Hi", max_tokens=4, sampling=_sp(temperature=-0.5)), "temperature"),
    ("temperature-nan", dict(prompt="Hi", max_tokens=4, sampling=_sp(temperature=NAN)), "temperature"),
    ("temperature-inf", dict(prompt="Hi", max_tokens=4, sampling=_sp(temperature=math.inf)), "temperature"),
    ("top-p-above-1", dict(prompt="Hi", max_tokens=4, sampling=_sp(temperature=1.0, top_p=1.5)), "top_p"),
    ("top-p-neg", dict(prompt="Hi", max_tokens=4, sampling=_sp(temperature=1.0, top_p=-0.1)), "top_p"),
    ("top-p-nan", dict(prompt="Hi", max_tokens=4, sampling=_sp(temperature=1.0, top_p=NAN)), "top_p"),
    ("top-k-neg", dict(prompt="Hi", max_tokens=4, sampling=_sp(temperature=1.0, top_k=-1)), "top_k"),
    ("prompt-too-long", dict(prompt="x" * 2000, max_tokens=4), "prompt"),
    ("chat-too-long", dict(chat=_chat(("user", "y" * 2000)), max_tokens=4), "prompt"),
    # Fits alone, not with max_tokens: refused by the verifier, passed through by the gateway.
    ("prompt-plus-max-tokens", dict(prompt="z" * 1000, max_tokens=100), "max_tokens"),
    ("unknown-drafter", dict(prompt="Hi", max_tokens=4, drafter="no-such-drafter"), "drafter"),
    ("unknown-drafter-version", dict(prompt="Hi", max_tokens=4, drafter="tiny-drafter@99"), "drafter"),
    ("block-size-neg", dict(prompt="Hi", max_tokens=4, block_size=-1), "block_size"),
    ("block-size-huge", dict(prompt="Hi", max_tokens=4, block_size=1000), "block_size"),
]


@pytest.fixture(scope="module")
def gw(target_model, tokenizer, make_drafter, tiny_target):
    """One stack for the module (a DFlash drafter registered as default), so every case also
    shows the services survive all the bad requests before it."""
    from drafter_svc.engine import DrafterEngine

    s = Stack(target_model, tokenizer)
    s.add_drafter(DrafterEngine.from_pretrained(make_drafter(block_size=4), tiny_target), default=True)
    yield s
    s.close()


def good_request_works(stack: Stack) -> None:
    resps = list(stack.gateway_stub().Generate(
        gateway_pb2.GenerateRequest(prompt="Hello", max_tokens=6,
                                    sampling=_sp(temperature=0.8, top_p=0.9, seed=5)), timeout=60))
    last = resps[-1]
    assert last.finish_reason in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP)
    assert last.usage.completion_tokens >= 1
    assert last.drafter  # speculation ran: the drafter service is up too
    ids, last = generate_ids(stack.verifier_stub(), [1, 2, 3], max_tokens=3, ignore_eos=True)
    assert len(ids) == 3


def assert_status(err: grpc.RpcError, code: grpc.StatusCode, field: str) -> None:
    assert err.code() == code, f"{err.code()}: {err.details()}"
    assert f"{field}:" in err.details(), f"details {err.details()!r} do not name {field!r}"


@pytest.mark.parametrize("fields,field", [c[1:] for c in GATEWAY_CASES], ids=[c[0] for c in GATEWAY_CASES])
def test_gateway_refuses(gw, fields, field):
    with pytest.raises(grpc.RpcError) as ei:
        list(gw.gateway_stub().Generate(gateway_pb2.GenerateRequest(**fields), timeout=60))
    assert_status(ei.value, grpc.StatusCode.INVALID_ARGUMENT, field)
    good_request_works(gw)


# ---------------------------------------------------------------------------- verifier, directly
@pytest.mark.parametrize("prompt,field", [
    ([1, 2, 272], "prompt_token_ids"),          # vocab_size = 272 embedding rows
    ([-1, 5], "prompt_token_ids"),
    ([3, 2 ** 40], "prompt_token_ids"),
    ([], "prompt"),
    (list(range(256)) * 4, "prompt"),           # 1024 tokens: no room in a 1024 window
], ids=["id-eq-vocab", "negative-id", "huge-id", "empty", "window"])
def test_verifier_refuses_bad_prompt(gw, prompt, field):
    with pytest.raises(grpc.RpcError) as ei:
        generate_ids(gw.verifier_stub(), prompt, max_tokens=4)
    assert_status(ei.value, grpc.StatusCode.INVALID_ARGUMENT, field)
    good_request_works(gw)


def test_verifier_refuses_speculation_without_address(gw):
    with pytest.raises(grpc.RpcError) as ei:
        generate_ids(gw.verifier_stub(), [1, 2, 3], max_tokens=4,
                     speculation=verifier_pb2.SpeculationParams(enabled=True))
    assert_status(ei.value, grpc.StatusCode.INVALID_ARGUMENT, "speculation.drafter_address")


def _good_card(target_model):
    return ReferenceDrafter(target_model, {}, block_size=4, layer_ids=(0, 2), name="bad").card


BAD_CARDS = [
    ("hidden_size", dict(hidden_size=48)),
    ("vocab_size", dict(vocab_size=300)),
    ("target_layer_ids", dict(target_layer_ids=(0, 4))),   # 4-layer target: valid 0..3
    ("target_layer_ids", dict(target_layer_ids=(-1,))),
    ("target_layer_ids", dict(target_layer_ids=())),
    ("block_size", dict(block_size=0)),
    ("block_size", dict(block_size=65)),
    ("mask_token_id", dict(mask_token_id=272)),
]
BAD_IDS = ["hidden", "vocab", "layer-4", "layer-neg", "no-layers", "block-0", "block-65", "mask"]


def test_check_drafter_accepts_a_fitting_card(gw, target_model):
    card = _good_card(target_model)
    r = gw.verifier_stub().CheckDrafter(verifier_pb2.CheckDrafterRequest(card=card_to_proto(card)))
    assert r.card.hidden_size == target_model.hidden_size


@pytest.mark.parametrize("field,change", BAD_CARDS, ids=BAD_IDS)
def test_check_drafter_refuses_card(gw, target_model, field, change):
    card = dataclasses.replace(_good_card(target_model), **change)
    with pytest.raises(grpc.RpcError) as ei:
        gw.verifier_stub().CheckDrafter(verifier_pb2.CheckDrafterRequest(card=card_to_proto(card)))
    assert_status(ei.value, grpc.StatusCode.FAILED_PRECONDITION, field)


def test_check_drafter_needs_a_card_or_address(gw):
    with pytest.raises(grpc.RpcError) as ei:
        gw.verifier_stub().CheckDrafter(verifier_pb2.CheckDrafterRequest())
    assert_status(ei.value, grpc.StatusCode.INVALID_ARGUMENT, "drafter")


@pytest.fixture(scope="module")
def mismatched_drafters(gw, target_model):
    """field -> address of a drafter service whose card does not fit the target in that field."""
    from drafter_svc.server import build

    out = {}
    for (field, change), name in zip(BAD_CARDS[:3] + BAD_CARDS[5:6], ["hidden", "vocab", "layer", "block"]):
        d = ReferenceDrafter(target_model, {}, block_size=4, layer_ids=(0, 2), name=f"bad-{name}")
        d.card = dataclasses.replace(d.card, **change)
        rt = build(d, "127.0.0.1:0")
        rt.server.start()
        rt.set_serving(True)
        gw.drafters.append(rt)  # stopped with the stack
        out[field] = f"127.0.0.1:{rt.port}"
    return out


@pytest.mark.parametrize("field", ["hidden_size", "vocab_size", "target_layer_ids", "block_size"])
def test_register_mismatched_drafter_fails(gw, mismatched_drafters, field):
    from gateway.server import register_drafter

    servicer = gw.gateway.servicer
    before = servicer.registry.entries()
    with pytest.raises(grpc.RpcError) as ei:
        register_drafter(servicer.registry, servicer.verifier, mismatched_drafters[field], timeout_s=5)
    assert_status(ei.value, grpc.StatusCode.FAILED_PRECONDITION, field)
    assert servicer.registry.entries() == before
    # CheckDrafter by address says the same.
    with pytest.raises(grpc.RpcError) as ei:
        gw.verifier_stub().CheckDrafter(
            verifier_pb2.CheckDrafterRequest(address=mismatched_drafters[field]))
    assert_status(ei.value, grpc.StatusCode.FAILED_PRECONDITION, field)
    good_request_works(gw)


@pytest.mark.parametrize("field", ["hidden_size", "vocab_size", "target_layer_ids", "block_size"])
def test_generate_with_mismatched_drafter_fails(gw, mismatched_drafters, field):
    with pytest.raises(grpc.RpcError) as ei:
        generate_ids(gw.verifier_stub(), [1, 2, 3], max_tokens=4, sampling=_sp(temperature=1.0),
                     speculation=verifier_pb2.SpeculationParams(
                         enabled=True, drafter_address=mismatched_drafters[field]))
    assert_status(ei.value, grpc.StatusCode.FAILED_PRECONDITION, field)
    good_request_works(gw)


def test_check_drafter_unreachable_address(gw):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(grpc.RpcError) as ei:
        gw.verifier_stub().CheckDrafter(verifier_pb2.CheckDrafterRequest(address=f"127.0.0.1:{port}"),
                                        timeout=30)
    assert_status(ei.value, grpc.StatusCode.UNAVAILABLE, "address")
