"""``dflash bench --workload multiturn|shared-system``: what the prefix cache saves, per turn.

* ``multiturn``: ``--conversations`` conversations of ``--turns`` turns, each turn resending the
  whole history (the ``openai`` SDK's way) with the next user message from the prompt set.
* ``shared-system``: ``--users`` users, each one question from the prompt set after one long
  system prompt (``--system-file``, or the prompt set's texts joined to ``--system-tokens``).

Arms, interleaved (every conversation's turn through every arm before the next, the order
rotated), each arm its own tenants (``x-dflash-client``) so no arm reads another's cache:

* ``off``: every request a new tenant, so the prefix cache never hits: the cache off, but for
  the cost of keeping each finished request (one spill copy) — no verifier restart between arms;
* ``cache``: one tenant per conversation (multiturn) or for all users (shared-system: one app,
  one API key), no ``session_id``: the prefix cache's reuse;
* ``session`` (multiturn only): the ``session_id`` extension, one session per conversation.

Per turn and arm: TTFT (median and max over conversations), decode tokens/s, τ and cached
prompt tokens (mean share of the prompt); greedy outputs of each arm against ``off``. Every
request asks for one speculation mode (``--spec-modes`` naming one, e.g. ``fixed``: no policy
choosing blocks from timings, so τ per turn compares drafts, not the policy's noise); without
it the verifier's default.
Output: ``prefix.json`` and ``prefix.md`` under ``--out``.
"""

from __future__ import annotations

import json
import statistics
import uuid
from pathlib import Path

from gateway.inputs import CLIENT_KEY

WORKLOADS = ("multiturn", "shared-system")


def _row(addr: str, messages: list[dict], *, max_tokens: int, speculation: bool, session_id: str,
         tenant: str, mode: str = "") -> dict:
    """One request as ``tenant`` in speculation ``mode`` (a bench mode name, ``"tree:8"``; ""
    = the verifier's); its figures and its answer's text. The channel connects before the
    request starts, so its handshake is not in the TTFT."""
    from dflash.client import GatewayClient, build_request
    from dflash.core.convert import stats_from_proto
    from dflash_app.bench import split_mode

    spec_mode, budget = split_mode(mode)
    req = build_request(messages=messages, max_tokens=max_tokens, speculation=speculation,
                        session_id=session_id, speculation_mode=spec_mode, tree_budget=budget)
    client = GatewayClient(addr, metadata=[(CLIENT_KEY, tenant)])
    try:
        client.wait_ready()
        c = client.complete(req, timeout=1800)
    finally:
        client.close()
    st = stats_from_proto(c.acceptance)
    n = c.usage.completion_tokens
    return {"text": c.text, "token_ids": c.token_ids, "ttft_s": c.ttft_s, "latency_s": c.latency_s,
            "decode_tok_s": (n - 1) / max(c.latency_s - c.ttft_s, 1e-9), "tokens": n,
            "prompt_tokens": c.usage.prompt_tokens, "cached_tokens": c.usage.cached_prompt_tokens,
            "tau": st.mean_acceptance_length}


def _user(prompt: list[dict]) -> str:
    return next((m["content"] for m in reversed(prompt) if m["role"] == "user"), prompt[-1]["content"])


def system_prompt(prompts, tokens: int, tokenizer=None, text: str = "") -> str:
    """``text`` if given, else the prompt set's user texts joined until about ``tokens`` tokens
    (counted with ``tokenizer`` when given, else at 4 characters a token)."""
    if text:
        return text
    parts, size = [], 0
    i = 0
    while size < tokens and prompts:
        part = _user(prompts[i % len(prompts)][1])
        parts.append(part)
        size += len(tokenizer.encode(part)) if tokenizer is not None else len(part) // 4 + 1
        i += 1
    return "Reference material:\n\n" + "\n\n".join(parts)


def workload_mode(spec_modes: str) -> tuple[bool, str]:
    """``--spec-modes`` for ``--workload``: (speculation, mode) of every request. Its default
    (a list, for the on/off comparison) means the verifier's mode; else it names one mode
    (``off``: no speculation). Raises ValueError naming ``--spec-modes`` for several."""
    from dflash_app.bench import DEFAULT_SPEC_MODES

    if spec_modes == DEFAULT_SPEC_MODES:
        return True, ""
    modes = [m for m in spec_modes.split(",") if m]
    if len(modes) != 1:
        raise ValueError(f"--spec-modes: --workload runs one speculation mode, got {spec_modes!r}")
    return (False, "") if modes[0] == "off" else (True, modes[0])


def run_workload(addr: str, prompts, *, workload: str, max_tokens: int, speculation: bool,
                 conversations: int = 8, turns: int = 6, users: int = 16, system: str = "",
                 progress=None, arms: list[str] | None = None, mode: str = "") -> dict:
    """Run ``workload`` against the gateway at ``addr``; returns ``{"arms", "turns", "rows"}``:
    per arm a list (one per turn) of the per-conversation rows (:func:`_row` plus ``conv``).
    ``arms``: a subset of the workload's (module docstring; None: all of them), e.g.
    ``["cache"]`` for the cached share alone (``scripts/bench_replicas.py``). ``mode``: every
    request's speculation mode (``"fixed"``, ``"tree:8"``; "" = the verifier's).

    Raises:
        ValueError: naming ``workload`` when it is not one of :data:`WORKLOADS`, ``prompts``
            when there are none, or ``arms`` when one is not the workload's.
    """
    if workload not in WORKLOADS:
        raise ValueError(f"workload: one of {', '.join(WORKLOADS)}, got {workload!r}")
    if not prompts:
        raise ValueError("prompts: the workload needs at least one prompt")
    every = ["off", "cache", "session"] if workload == "multiturn" else ["off", "cache"]
    if arms is not None and (not arms or set(arms) - set(every)):
        raise ValueError(f"arms: a subset of {', '.join(every)}, got {arms!r}")
    arms = [a for a in every if arms is None or a in arms]
    run_id = uuid.uuid4().hex[:8]
    if workload == "multiturn":
        n_conv, n_turns = conversations, turns
    else:
        n_conv, n_turns = 1, users          # one conversation per user: its "turn" is the user
    history = {(arm, c): ([{"role": "system", "content": system}] if system else [])
               for arm in arms for c in range(n_conv)}
    rows: dict[str, list[list[dict]]] = {arm: [] for arm in arms}
    for t in range(n_turns):
        for arm in arms:
            rows[arm].append([])
        for c in range(n_conv):
            user = _user(prompts[(c * n_turns + t) % len(prompts)][1])
            order = arms[(t + c) % len(arms):] + arms[:(t + c) % len(arms)]
            for arm in order:
                msgs = history[(arm, c)] + [{"role": "user", "content": user}]
                tenant = {"off": f"bench-off-{run_id}-{arm}-{c}-{t}",
                          "cache": f"bench-cache-{run_id}-{c if workload == 'multiturn' else 0}",
                          "session": f"bench-session-{run_id}-{c}"}[arm]
                sid = f"bench-{run_id}-{c}" if arm == "session" else ""
                r = _row(addr, msgs, max_tokens=max_tokens, speculation=speculation,
                         session_id=sid, tenant=tenant, mode=mode)
                rows[arm][t].append({**r, "conv": c})
                if workload == "multiturn":
                    history[(arm, c)] = msgs + [{"role": "assistant", "content": r["text"]}]
                if progress is not None:
                    progress()
    return {"workload": workload, "arms": arms, "turns": n_turns, "rows": rows,
            "speculation_mode": (mode or "verifier default") if speculation else "off"}


def summarize(results: dict) -> dict:
    """Per arm and turn: ``ttft_median_s``, ``ttft_max_s``, ``decode_tok_s``, ``tau``,
    ``cached_share`` (cached / prompt tokens, mean), ``prompt_tokens`` (mean); per arm
    ``identical_to_off`` (rows whose greedy ids equal the ``off`` arm's; None without one)."""
    out: dict = {}
    off = results["rows"].get("off")
    for arm, turns in results["rows"].items():
        per_turn = []
        for rs in turns:
            per_turn.append({
                "ttft_median_s": statistics.median(r["ttft_s"] for r in rs),
                "ttft_max_s": max(r["ttft_s"] for r in rs),
                "decode_tok_s": statistics.mean(r["decode_tok_s"] for r in rs),
                "tau": statistics.mean(r["tau"] for r in rs),
                "cached_share": statistics.mean(r["cached_tokens"] / max(r["prompt_tokens"], 1)
                                                for r in rs),
                "prompt_tokens": statistics.mean(r["prompt_tokens"] for r in rs)})
        same = None if off is None else sum(a["token_ids"] == b["token_ids"]
                                            for ta, tb in zip(turns, off) for a, b in zip(ta, tb))
        out[arm] = {"turns": per_turn, "identical_to_off": same,
                    "rows": sum(len(rs) for rs in turns)}
    return out


def markdown(results: dict, summary: dict) -> str:
    label = "user" if results["workload"] == "shared-system" else "turn"
    arms = results["arms"]
    lines = [f"## prefix cache: {results['workload']}", "",
             f"speculation: {results.get('speculation_mode', 'verifier default')}", "",
             f"| {label} | " + " | ".join(f"{a} TTFT s (med / max) | {a} cached | {a} τ" for a in arms)
             + " |", "|---|" + "---|---|---|" * len(arms)]
    for t in range(results["turns"]):
        cells = []
        for a in arms:
            x = summary[a]["turns"][t]
            cells += [f"{x['ttft_median_s']:.3f} / {x['ttft_max_s']:.3f}",
                      f"{100 * x['cached_share']:.0f}%", f"{x['tau']:.2f}"]
        lines.append(f"| {t + 1} | " + " | ".join(cells) + " |")
    if "off" in arms:
        lines += ["", "greedy outputs identical to off: " + ", ".join(
            f"{a} {summary[a]['identical_to_off']}/{summary[a]['rows']}" for a in arms if a != "off")]
        lines += [f"τ per {label}, {a} / off: " + ", ".join(
            f"{x['tau'] / o['tau']:.3f}" if o["tau"] else "-"
            for x, o in zip(summary[a]["turns"], summary["off"]["turns"])) for a in arms if a != "off"]
    lines.append("")
    return "\n".join(lines)


def cmd_workload(a, prompts, out: Path) -> int:
    """``--workload``: run it against ``a.gateway`` and write ``prefix.json`` / ``prefix.md``.
    Raises ValueError naming ``--spec-modes`` when it names several modes."""
    from tqdm import tqdm

    system = ""
    if a.workload == "shared-system":
        text = Path(a.system_file).read_text() if a.system_file else ""
        system = system_prompt(prompts, a.system_tokens, text=text)
    arms = 3 if a.workload == "multiturn" else 2
    total = arms * (a.conversations * a.turns if a.workload == "multiturn" else a.users)
    speculation, mode = workload_mode(a.spec_modes)
    with tqdm(total=total, desc=a.workload) as bar:
        results = run_workload(a.gateway, prompts, workload=a.workload, max_tokens=a.max_tokens,
                               speculation=speculation and not a.no_speculation,
                               conversations=a.conversations, turns=a.turns, users=a.users,
                               system=system, progress=lambda: bar.update(1), mode=mode)
    summary = summarize(results)
    (out / "prefix.json").write_text(json.dumps({**results, "summary": summary}, indent=1))
    md = markdown(results, summary)
    (out / "prefix.md").write_text(md)
    print(md)
    print(f"wrote {out}/prefix.json, prefix.md")
    return 0
