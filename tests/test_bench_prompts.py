"""Prompt sets of ``dflash bench --prompts``: HumanEval, the held-out chat set, JSONL files."""

from __future__ import annotations

import json

import pytest

from dflash.tools.bench_prompts import CHAT_EVAL, load_jsonl, prompt_set


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
    from dflash.tools.cli import main

    with pytest.raises(SystemExit, match="--prompts"):
        main(["bench", "--prompts", "nope", "--gateway", "127.0.0.1:1"])
