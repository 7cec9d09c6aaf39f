"""Resent answers (gateway.resent): a chat that resends the target's answer as text is tokenized
with the ids the target generated for it, so the verifier's prefix cache covers the whole
history; only at a special-token seam, only for the same tenant, only when the ids decode to
the rendered text, within the memory's bound.

The byte-level test tokenizer re-tokenizes an answer differently when the target emitted bytes
that are not valid UTF-8: ``decode`` shows them as U+FFFD, which encodes to three other bytes
(as SmolLM2's ``"\\n\\n"`` token comes back as two ``"\\n"``). The service tests force such an
answer with ``logit_bias``.
"""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from dflash.serving.telemetry import Telemetry
from dflash.v1 import gateway_pb2
from gateway.resent import ResentAnswers
from verifier_svc.prefix_reuse import new_prefix_cache

from helpers import Stack, assert_same_tokens, reference

INVALID_BYTE = 195            # a UTF-8 lead byte: alone it decodes to U+FFFD
TURN1 = [{"role": "user", "content": "tell me a story"}]
NEXT = {"role": "user", "content": "and then?"}


def _encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _plain(tok, msgs) -> list[int]:
    return list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                        return_dict=False))


def _render(tok, msgs) -> str:
    return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)


def _turn2(answer: str) -> list[dict]:
    return TURN1 + [{"role": "assistant", "content": answer}, NEXT]


def _remember_turn1(memory, tok, tenant="a", answer_ids=(INVALID_BYTE, INVALID_BYTE, 97)):
    """Remember turn 1 answered with ``answer_ids``; returns (prompt ids, answer text)."""
    ids = list(answer_ids)
    text = tok.decode([i for i in ids if i not in tok.all_special_ids],
                      clean_up_tokenization_spaces=False)
    prompt = _plain(tok, TURN1)
    assert memory.remember(tenant, _render(tok, TURN1), prompt, ids, text)
    return prompt, text


@pytest.fixture
def memory(tokenizer):
    return ResentAnswers(tokenizer, 1 << 20)


# ---------------------------------------------------------------------------------- unit
def test_a_resent_answer_is_spliced_as_the_generated_ids_with_one_end_of_turn(memory, tokenizer):
    tok, eos = tokenizer, tokenizer.eos_token_id
    prompt, text = _remember_turn1(memory, tok, answer_ids=(INVALID_BYTE, INVALID_BYTE, 97, eos))
    assert _encode(tok, text) != [INVALID_BYTE, INVALID_BYTE, 97]    # the round trip differs
    msgs = _turn2(text)
    plain, rendered = _plain(tok, msgs), _render(tok, msgs)
    ids = memory.splice("a", msgs, rendered)
    assert ids is not None and memory.spliced == 1
    head = prompt + [INVALID_BYTE, INVALID_BYTE, 97]
    assert ids[:len(head)] == head and plain[:len(head)] != head
    # the target's own <|im_end|> was left out; the template's follows the answer, once
    assert ids[len(head)] == eos and ids.count(eos) == plain.count(eos)
    rest = len(ids) - len(head)       # after the seam: the ids the whole text encodes to
    assert ids[len(head):] == plain[-rest:]
    assert tok.decode(ids) == rendered


def test_another_tenant_never_gets_the_remembered_ids(memory, tokenizer):
    _, text = _remember_turn1(memory, tokenizer, tenant="a")
    msgs = _turn2(text)
    rendered = _render(tokenizer, msgs)
    assert memory.splice("b", msgs, rendered) is None
    assert memory.splice("a", msgs, rendered) is not None


def test_an_edited_answer_or_history_falls_back_to_plain_tokenization(memory, tokenizer):
    _, text = _remember_turn1(memory, tokenizer)
    for msgs in (_turn2(text + "!"),                                   # the answer edited
                 [{"role": "system", "content": "be brief"}] + _turn2(text)):   # history
        assert memory.splice("a", msgs, _render(tokenizer, msgs)) is None
    assert memory.spliced == 0


def test_ids_that_do_not_decode_to_the_text_are_never_used(memory, tokenizer):
    tok = tokenizer
    wrong = _plain(tok, [{"role": "user", "content": "tell me a storm"}])   # same length
    text = tok.decode([INVALID_BYTE, 97], clean_up_tokenization_spaces=False)
    assert memory.remember("a", _render(tok, TURN1), wrong, [INVALID_BYTE, 97], text)
    msgs = _turn2(text)
    assert memory.splice("a", msgs, _render(tok, msgs)) is None


def test_a_seam_without_a_special_token_is_not_spliced(tiny_target):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target)
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    memory = ResentAnswers(tok, 1 << 20)
    _, text = _remember_turn1(memory, tok)
    msgs = _turn2(text)
    rendered = _render(tok, msgs)
    assert rendered.startswith(_render(tok, TURN1) + text)    # the text matches: the seam does not
    assert memory.splice("a", msgs, rendered) is None


def test_answers_that_cannot_be_resent_exactly_are_not_remembered(memory, tokenizer):
    tok = tokenizer
    prompt, rendered = _plain(tok, TURN1), _render(tok, TURN1)
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert not memory.remember("a", rendered, prompt, [97, im_start, 98], "ab")  # a control id
    assert not memory.remember("a", rendered, prompt, [97, 98, 99], "ab")        # a cut answer
    assert len(memory) == 0 and memory.nbytes == 0


def test_control_token_text_in_a_message_is_not_rendered_here(memory, tokenizer):
    msgs = [{"role": "user", "content": "hi <|im_end|> there"}]
    assert memory.render(msgs, {}) is None
    assert memory.render(TURN1, {}) == _render(tokenizer, TURN1)


def test_the_bound_evicts_the_least_recently_used(tokenizer):
    tok = tokenizer
    memory = ResentAnswers(tok, 1 << 20)
    _remember_turn1(memory, tok, answer_ids=(INVALID_BYTE, 97))
    one = memory.nbytes
    memory = ResentAnswers(tok, int(one * 3.5))            # room for three such turns
    texts = [_remember_turn1(memory, tok, answer_ids=(INVALID_BYTE, 97 + i))[1] for i in range(3)]
    first = _turn2(texts[0])
    assert memory.splice("a", first, _render(tok, first)) is not None   # used: now the newest
    texts.append(_remember_turn1(memory, tok, answer_ids=(INVALID_BYTE, 100))[1])
    assert memory.evictions == 1 and len(memory) == 3 and memory.nbytes <= memory.max_bytes
    found = [memory.splice("a", _turn2(t), _render(tok, _turn2(t))) is not None for t in texts]
    assert found == [True, False, True, True]               # the second was the oldest used
    with pytest.raises(ValueError, match="max_bytes"):
        ResentAnswers(tok, 0)


def test_without_a_remembered_turn_the_ids_are_the_servicers_own(memory, tokenizer):
    from gateway.registry import DrafterRegistry
    from gateway.servicer import GatewayServicer

    with_memory = GatewayServicer(tokenizer, None, DrafterRegistry(), max_positions=512,
                                  resent=memory)
    without = GatewayServicer(tokenizer, None, DrafterRegistry(), max_positions=512)
    _, text = _remember_turn1(memory, tokenizer, tenant="someone else")
    for msgs in (TURN1, _turn2(text), [{"role": "user", "content": "typed <|im_start|> x"}]):
        req = gateway_pb2.GenerateRequest(max_tokens=4)
        for m in msgs:
            req.chat.messages.add(role=m["role"], content=m["content"])
        ids, rendered = with_memory._tokenized(req, "a", None)
        assert ids == without._prompt_ids(req)
        assert rendered == (None if "<|im_start|>" in msgs[0]["content"] else _render(tokenizer, msgs))
    raw = gateway_pb2.GenerateRequest(prompt="raw", max_tokens=4)
    assert with_memory._tokenized(raw, "a", None) == (without._prompt_ids(raw), None)
    assert memory.spliced == 0


def test_the_flags_switch_and_bound_the_memory(monkeypatch, capsys):
    from gateway.flags import parse_args, resent_answers_bytes

    monkeypatch.delenv("DFLASH_RESENT_ANSWERS", raising=False)
    monkeypatch.delenv("DFLASH_RESENT_ANSWERS_MB", raising=False)
    assert resent_answers_bytes(parse_args(["--target", "t"])) == 0            # off by default
    on = ["--target", "t", "--resent-answers", "on"]
    assert resent_answers_bytes(parse_args(on)) == 64 << 20
    assert resent_answers_bytes(parse_args([*on, "--resent-answers-mb", "0.5"])) == 1 << 19
    monkeypatch.setenv("DFLASH_RESENT_ANSWERS", "on")
    monkeypatch.setenv("DFLASH_RESENT_ANSWERS_MB", "2")
    assert resent_answers_bytes(parse_args(["--target", "t"])) == 2 << 20
    monkeypatch.setenv("DFLASH_RESENT_ANSWERS", "off")
    assert resent_answers_bytes(parse_args(["--target", "t"])) == 0
    for argv, flag in ((["--resent-answers", "maybe"], "--resent-answers"),
                       (["--resent-answers-mb", "0"], "--resent-answers-mb")):
        with pytest.raises(SystemExit) as ei:
            parse_args(["--target", "t", *argv])
        assert ei.value.code == 2 and flag in capsys.readouterr().err


# ---------------------------------------------------------------------------------- service
@pytest.fixture
def resent_stack(target_model, tokenizer):
    registries = {}

    def telemetry(service):
        registries[service] = CollectorRegistry()
        return Telemetry(service=service, registry=registries[service])

    s = Stack(target_model, tokenizer, telemetry=telemetry,
              gateway_kw={"resent_answers_bytes": 1 << 20},
              prefix_cache=new_prefix_cache(target_model.pool, 64))
    s.registries = registries
    yield s
    s.close()


def _chat(gw, tenant: str, msgs, *, session_id="", bias=None, max_tokens=8):
    r = gateway_pb2.GenerateRequest(max_tokens=max_tokens, session_id=session_id)
    for m in msgs:
        r.chat.messages.add(role=m["role"], content=m["content"])
    for tid, v in (bias or {}).items():
        r.sampling.logit_bias[tid] = v
    resps = list(gw.Generate(r, metadata=[("x-dflash-client", tenant)], timeout=60))
    text = "".join(x.text for x in resps[:-1])
    return [t for x in resps[:-1] for t in x.token_ids], text, resps[-1]


def _conversation(gw, tenant: str, session_id=""):
    """Turn 1 (forced to invalid UTF-8, finishing by length) and turn 2, greedy."""
    ids1, text1, final1 = _chat(gw, tenant, TURN1, session_id=session_id, max_tokens=6,
                                bias={INVALID_BYTE: 100.0})
    assert ids1 == [INVALID_BYTE] * 6 and text1 == "\ufffd" * 6
    ids2, _, final2 = _chat(gw, tenant, _turn2(text1), session_id=session_id)
    return final1, ids2, final2


def test_turn_two_caches_the_whole_history_and_decodes_as_the_target_would(
        resent_stack, tokenizer, hf_target):
    gw, tok = resent_stack.gateway_stub(), tokenizer
    servicer = resent_stack.gateway.servicer
    memory, servicer.resent = servicer.resent, None               # the feature off
    f1_off, ids_off, f2_off = _conversation(gw, "off")
    servicer.resent = memory
    f1_on, ids_on, f2_on = _conversation(gw, "on")
    _, ids_session, f2_session = _conversation(gw, "session", session_id="conv")
    p1, c1 = f1_on.usage.prompt_tokens, f1_on.usage.completion_tokens
    assert f1_off.usage.prompt_tokens == p1
    # off: the resent answer re-encodes to other bytes, so only turn 1's prompt matches
    assert f2_off.usage.cached_prompt_tokens == p1
    # on: the prompt and the answer (but its last id, whose K/V never ran), as with session_id
    assert f2_on.usage.cached_prompt_tokens == f2_session.usage.cached_prompt_tokens == p1 + c1 - 1
    text1 = "\ufffd" * 6
    spliced = (_plain(tok, TURN1) + [INVALID_BYTE] * 6
               + _encode(tok, _render(tok, _turn2(text1))[len(_render(tok, TURN1) + text1):]))
    assert f2_on.usage.prompt_tokens == len(spliced) != f2_off.usage.prompt_tokens
    # what the target sees is the ids it generated: its own continuation of them
    assert_same_tokens(hf_target, spliced, ids_on, reference(hf_target, spliced, n=8))
    assert ids_session == ids_on
    assert_same_tokens(hf_target, _plain(tok, _turn2(text1)), ids_off,
                       reference(hf_target, _plain(tok, _turn2(text1)), n=8))
    assert memory.spliced == 2
    assert resent_stack.registries["gateway"].get_sample_value(
        "dflash_gateway_resent_answers_spliced_total") == 2


def test_raw_prompts_are_never_spliced(resent_stack, tokenizer):
    gw = resent_stack.gateway_stub()
    first = gateway_pb2.GenerateRequest(prompt="once upon a time", max_tokens=6)
    first.sampling.logit_bias[INVALID_BYTE] = 100.0
    resps = list(gw.Generate(first, metadata=[("x-dflash-client", "raw")], timeout=60))
    text = "once upon a time" + "".join(r.text for r in resps[:-1]) + " the end"
    again = list(gw.Generate(gateway_pb2.GenerateRequest(prompt=text, max_tokens=2),
                             metadata=[("x-dflash-client", "raw")], timeout=60))
    assert again[-1].usage.prompt_tokens == len(tokenizer.encode(text))
    assert len(resent_stack.gateway.servicer.resent) == 0
