"""Prompt sets of ``dflash bench --prompts``: HumanEval, the held-out chat set, JSONL files."""

from __future__ import annotations

import json

import pytest

from dflash.train.eval_sets import CHAT_EVAL
from dflash_app.bench_prompts import load_jsonl, prompt_set


def test_named_sets():
    he = prompt_set("humaneval", 3)
    assert [t for t, _ in he] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert he[0][1][0]["role"] == "user" and "```python" in he[0][1][0]["content"]
    chat = prompt_set("chat")
    assert len(chat) == len(CHAT_EVAL) == len(set(CHAT_EVAL)) >= 30
    assert chat[0] == ("chat/0", [{"role": "user", "content": CHAT_EVAL[0]}])
    with pytest.raises(ValueError, match="--prompts"):
        prompt_set("no-such-set")


def test_jsonl_file(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text(json.dumps({"prompt": "hi"}) + "\n\n" + json.dumps(
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "yo"}]}) + "\n")
    got = prompt_set(str(f))
    assert got == [("mine/0", [{"role": "user", "content": "hi"}]),
                   ("mine/1", [{"role": "system", "content": "be brief"}, {"role": "user", "content": "yo"}])]
    for bad, msg in [('{"prompt": ""}', ":1: needs"), ("[1]", ":1: expected a JSON object"),
                     ("{oops", ":1: not JSON"), ('{"messages": [{"role": "user"}]}', ":1: needs")]:
        f.write_text(bad + "\n")
        with pytest.raises(ValueError, match=msg):
            load_jsonl(f)
    f.write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        load_jsonl(f)


def test_bench_refuses_an_unknown_set_naming_the_flag(capsys):
    from dflash_app.cli import main

    with pytest.raises(SystemExit, match="--prompts"):
        main(["bench", "--prompts", "nope", "--gateway", "127.0.0.1:1"])


def test_the_edit_set_is_committed_and_copy_heavy():
    """data/bench/edit.jsonl (scripts/make_edit_prompts.py): 20+ edit requests, each quoting a
    function of this repository that the answer is asked to rewrite, quote or revise."""
    from pathlib import Path

    sets = load_jsonl(Path(__file__).resolve().parents[1] / "data/bench/edit.jsonl")
    assert len(sets) >= 20
    for messages in sets:
        assert any("def " in m["content"] for m in messages)
    assert any(len(messages) == 3 and messages[1]["role"] == "assistant" for messages in sets)


@pytest.mark.parametrize("argv,kept", [([], False), (["--suffix-answers"], True)])
def test_bench_start_keeps_no_answers_across_modes_unless_asked(argv, kept):
    """Each prompt runs once per mode: with the tenant's recent answers as suffix candidates,
    every mode after a prompt's first would copy the answer an earlier mode gave."""
    from types import SimpleNamespace

    from dflash_app.bench import bench_stack_config

    a = SimpleNamespace(tiny=False, target="target-dir", drafter=["drafter-dir"], drafter_port=50061,
                        gateway_port=50050, verifier_port=50051, dtype="auto", run_dir="runs/x",
                        suffix_answers=bool(argv))
    args = bench_stack_config(a).verifier_args
    assert ("--suffix-answer-tokens" in args and args[args.index("--suffix-answer-tokens") + 1] == "0") != kept


def test_with_answers_kept_each_bench_mode_is_its_own_tenant():
    """``--suffix-answers``: a mode's candidates are its own earlier answers to other prompts,
    never another mode's answer to the same prompt, so each mode calls as its own tenant."""
    from types import SimpleNamespace

    from dflash_app.bench import mode_tenant
    from gateway.inputs import client_identity

    modes = ["spec[tree:15]", "spec[hybrid:15]", "spec[suffix]", "spec[adaptive]", "spec:d@2[suffix]", "off"]
    tenants = [client_identity(SimpleNamespace(invocation_metadata=lambda m=m: mode_tenant(m),
                                               peer=lambda: "ipv4:127.0.0.1:5"))
               for m in modes]
    assert len(set(tenants)) == len(modes)
    assert all(t.startswith("client:bench-") for t in tenants)
