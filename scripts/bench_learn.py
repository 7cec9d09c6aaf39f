"""Online learning, round by round: served τ on fresh prompts of one domain, per version.

The stack runs in this process with real gRPC (a verifier service over the target, one
drafter service per version; suffix drafts off, so τ is the drafter's). The domain: passage
instructions ("summarise", "explain", "list the key points", ...) over paragraphs of this
repository's docs/*.md, text that is not in data/train. Paragraphs are split once: the
served pool (captured, trained on) and the fresh pool (never served with capture on, never
trained on) share no paragraph.

``--domain stdlib`` asks instead about Python standard-library callables ("What does
`json.dumps()` do?"), one topic family with a steady answer shape; the fresh prompts name only
modules the served ones never do.

Per round: serve the round's share of the served pool with capture on (``--concurrency``
streams at once); measure served τ on the fresh prompts with capture off (tokens compared with
speculation off: greedy must be identical); then, the stack idle, train the candidate
(``dflash.learn.learner``) and gate it; a release starts a drafter service on the new version
and the next round serves it. Before round 0, throughput with capture on vs off, each prompt
both ways, the order alternating. Writes ``report.json`` and ``report.md`` to ``--out``.

Usage:
  python scripts/bench_learn.py --out docs/bench/learn-passages          # the lead's run
  python scripts/bench_learn.py --domain stdlib --concurrency 4 --rounds 3 --fresh 32 \
      --steps 400 --out docs/bench/learn-stdlib                          # docs/learning.md
  python scripts/bench_learn.py --tiny --out /tmp/bench_learn            # smoke test
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

INSTRUCTIONS = ("Summarise this passage in two sentences:", "Explain this passage simply:",
                "List the key points of this passage:", "Rewrite this passage in plain words:",
                "What problem does this passage describe, and what is the fix?",
                "Write a short email to a colleague about this:")


def paragraphs(root: Path) -> list[str]:
    """Prose paragraphs (no code, tables, headings, lists) of ``root``/docs/*.md, 200-900 chars."""
    out = []
    for f in sorted((root / "docs").glob("*.md")):
        text = re.sub(r"```.*?```", "", f.read_text(), flags=re.S)
        for para in text.split("\n\n"):
            p = " ".join(x.strip() for x in para.splitlines())
            if 200 <= len(p) <= 900 and not p.startswith(("#", "|", "*", "-", "1.", ">")):
                out.append(p)
    return out


# Python standard-library help: one topic family with a steady answer shape (what it does, an
# example). Not in data/train (its ``code`` source completes function stubs, it asks no questions).
STDLIB_MODULES = (
    "argparse array asyncio base64 binascii bisect calendar cmath codecs collections "
    "configparser contextlib copy csv dataclasses datetime decimal difflib email.utils enum "
    "fnmatch fractions functools getpass gettext glob gzip hashlib heapq hmac html "
    "http.client inspect io itertools json locale logging math mimetypes numbers operator os "
    "os.path pathlib platform pprint queue random re sched secrets shlex shutil socket sqlite3 "
    "stat statistics string struct subprocess sys tarfile tempfile textwrap threading time "
    "tomllib traceback types typing unicodedata urllib.parse urllib.request uuid warnings "
    "weakref xml.etree.ElementTree zipfile zlib zoneinfo").split()
STDLIB_QUESTIONS = ("What does `{q}` do in Python? Show a short example.",
                    "Explain Python's `{q}` to a beginner, with an example.",
                    "How do I use `{q}`? Give a short code example.",
                    "When would I use `{q}` in Python? Keep it brief.",
                    "Write a small example program that uses `{q}` and explain what it prints.")


def stdlib_callables(module: str) -> list[str]:
    """Public callables defined by ``module`` (or its C accelerator), as ``module.name`` with
    ``()`` after functions; sorted, so the set is fixed for one Python version."""
    import importlib

    mod = importlib.import_module(module)
    top = module.split(".")[0]
    out = []
    for name in sorted(dir(mod)):
        obj = getattr(mod, name, None)
        owner = str(getattr(obj, "__module__", "") or "").lstrip("_").split(".")[0]
        if name.startswith("_") or not callable(obj) or owner not in (top, "posixpath", "builtins"):
            continue
        out.append(f"{module}.{name}" + ("" if isinstance(obj, type) else "()"))
    return out


def stdlib_prompts(n_served: int, n_fresh: int, seed: int = 0) -> tuple[list, list]:
    """(served, fresh) questions about standard-library callables; a fifth of the modules are
    fresh only, so no fresh question names a module the served ones do. ValueError if short."""
    mods = sorted(STDLIB_MODULES)
    random.Random(seed).shuffle(mods)
    k = len(mods) // 5
    rng = random.Random(seed + 1)

    def make(pool: list[str], n: int, field: str) -> list:
        names = [c for m in pool for c in stdlib_callables(m)]
        if len(names) < n:
            raise ValueError(f"{field}: only {len(names)} standard-library callables, asked for {n}")
        rng.shuffle(names)
        return [[{"role": "user", "content": rng.choice(STDLIB_QUESTIONS).format(q=q)}] for q in names[:n]]

    return make(mods[k:], n_served, "--prompts"), make(mods[:k], n_fresh, "--fresh")


def domain_prompts(root: Path, n_served: int, n_fresh: int, seed: int = 0,
                   max_chars: int = 900) -> tuple[list, list]:
    """(served, fresh) chat prompts over disjoint paragraphs (cut at ``max_chars``);
    ValueError if too few paragraphs."""
    paras = paragraphs(root)
    random.Random(seed).shuffle(paras)
    k = max(1, len(paras) // 5)                     # a fifth of the paragraphs: fresh only
    fresh_p, served_p = paras[:k], paras[k:]
    if not served_p:
        raise ValueError(f"--prompts: only {len(paras)} paragraphs in {root / 'docs'}")
    rng = random.Random(seed + 1)

    def make(pool: list[str], n: int) -> list:
        return [[{"role": "user", "content": f"{rng.choice(INSTRUCTIONS)}\n\n{pool[i % len(pool)][:max_chars]}"}]
                for i in range(n)]

    return make(served_p, n_served), make(fresh_p, n_fresh)


class Bench:
    def __init__(self, a):
        from transformers import AutoTokenizer

        from verifier_svc.engine import VerifierEngine
        from verifier_svc.server import build as build_verifier
        from verifier_svc.target import TargetModel

        self.a = a
        self.tok = AutoTokenizer.from_pretrained(a.target)
        self.engine = VerifierEngine(TargetModel(a.target), threads=a.threads, suffix=False)
        self.verifier = build_verifier(self.engine, "127.0.0.1:0")
        self.verifier.server.start()
        self.verifier.set_serving(True)
        self.servers: list = []
        import grpc

        from dflash.v1 import verifier_pb2_grpc

        self.stub = verifier_pb2_grpc.VerifierStub(grpc.insecure_channel(f"127.0.0.1:{self.verifier.port}"))

    def start_drafter(self, path: str):
        """(engine, address) of a drafter service on ``path`` with capture into --learn-dir."""
        from argparse import Namespace

        from dflash.learn.flags import capture_from_args
        from drafter_svc.engine import DrafterEngine
        from drafter_svc.server import build as build_drafter

        eng = DrafterEngine.from_pretrained(path, self.a.target, threads=self.a.threads)
        eng.warmup()
        eng.capture = capture_from_args(Namespace(learn_dir=self.a.learn_dir, learn_bytes=self.a.learn_bytes,
                                                  target=self.a.target), eng.card)
        rt = build_drafter(eng, "127.0.0.1:0")
        rt.server.start()
        rt.set_serving(True)
        self.servers.append(rt)
        return eng, f"127.0.0.1:{rt.port}"

    def generate(self, messages, addr: str | None, sid: str) -> dict:
        from dflash.train.eval_sets import encode_messages
        from dflash.v1 import verifier_pb2

        ids = encode_messages(self.tok, messages)
        spec = verifier_pb2.SpeculationParams(enabled=addr is not None, drafter_address=addr or "")
        t0 = time.perf_counter()
        out, last = [], None
        req = verifier_pb2.VerifierGenerateRequest(prompt_token_ids=ids, max_tokens=self.a.max_tokens,
                                                   session_id=sid, speculation=spec)
        for chunk in self.stub.Generate(req):
            out += list(chunk.token_ids)
            last = chunk
        self.stub.CloseSession(verifier_pb2.CloseSessionRequest(session_id=sid))
        st = last.stats if last is not None else None
        return {"tokens": out, "seconds": time.perf_counter() - t0,
                "drafts": st.drafts if st else 0, "accepted": st.accepted_tokens if st else 0}

    def close(self):
        for rt in self.servers + [self.verifier]:
            rt.server.stop(0)
        self.engine.close()


def served_tau(results: list[dict]) -> float:
    d = sum(r["drafts"] for r in results)
    return round(1 + sum(r["accepted"] for r in results) / d, 4) if d else 0.0


def throughput(b: Bench, eng, addr: str, prompts: list) -> dict:
    """Tokens/s with capture on and off over the same prompts: each prompt runs both ways, the
    order alternating (on then off, then off then on), so neither side gets the easier answers
    or the warmer machine."""
    cap = eng.capture
    rows: dict[str, list[dict]] = {"on": [], "off": []}
    for i, m in enumerate(prompts):
        for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):
            eng.capture = cap if mode == "on" else None
            rows[mode].append(b.generate(m, addr, f"tp{mode}{i}"))
    eng.capture = cap
    rate = {k: sum(len(r["tokens"]) for r in v) / max(1e-9, sum(r["seconds"] for r in v))
            for k, v in rows.items()}
    return {"tokens_per_s_capture": round(rate["on"], 2), "tokens_per_s_plain": round(rate["off"], 2),
            "ratio": round(rate["on"] / max(1e-9, rate["off"]), 4), "prompts": len(prompts)}


def run(a) -> dict:
    from dflash.learn import release as rel
    from dflash.learn.learner import LearnConfig, Learner

    if a.domain == "stdlib":
        served, fresh = stdlib_prompts(a.prompts, a.fresh)
    else:
        served, fresh = domain_prompts(Path(a.repo), a.prompts, a.fresh, max_chars=120 if a.tiny else 900)
    b = Bench(a)
    report: dict = {"args": vars(a), "rounds": [], "gates": []}
    try:
        eng, addr = b.start_drafter(a.drafter)
        version, t_start = a.drafter, time.time()
        refs = [b.generate(m, None, f"ref{i}")["tokens"] for i, m in enumerate(fresh)]
        report["throughput"] = throughput(b, eng, addr, served[:a.throughput_prompts])
        write_report(report, Path(a.out))           # a run stopped early keeps what it measured
        per_round = max(1, (len(served) - a.throughput_prompts) // max(1, a.rounds))
        for r in range(a.rounds + 1):
            eng.capture, cap = None, eng.capture                # fresh prompts: never captured
            res = [b.generate(m, addr, f"f{r}-{i}") for i, m in enumerate(fresh)]
            eng.capture = cap
            same = sum(x["tokens"] == y for x, y in zip(res, refs))
            report["rounds"].append({"round": r, "version": eng.card.label, "fresh_tau": served_tau(res),
                                     "identical": f"{same}/{len(res)}",
                                     "captured": eng.capture.store.counts() if eng.capture else None})
            print(json.dumps(report["rounds"][-1]), flush=True)
            if r == a.rounds:
                break
            lo = a.throughput_prompts + r * per_round
            with ThreadPoolExecutor(a.concurrency) as pool:     # captured traffic: batched
                chunk = served[lo:lo + per_round]
                list(pool.map(b.generate, chunk, [addr] * len(chunk),
                              [f"s{r}-{i}" for i in range(len(chunk))]))
            eng.capture.flush_idle()
            time.sleep(eng.capture.idle_s + 1.0)                 # the writer catches up
            lr = Learner(a.learn_dir, version, a.target,
                         cfg=LearnConfig(lr=a.lr, gamma=a.gamma, max_steps=a.steps,
                                         margin=a.margin))
            t0 = time.time()
            lr.run(a.steps)
            out = rel.release(lr)
            gate = dict(rel.decisions(a.learn_dir)[-1], train_s=round(time.time() - t0, 1), round=r)
            report["gates"].append(gate)
            write_report(report, Path(a.out))
            if out is not None:
                report.setdefault("first_release_s", round(time.time() - t_start, 1))
                eng.capture.close()
                version = str(out)
                eng, addr = b.start_drafter(version)
    finally:
        b.close()
    return report


def write_report(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = ["| round | version | served τ, fresh prompts | identical to no speculation |",
             "|---|---|---|---|"]
    lines += [f"| {r['round']} | {r['version']} | {r['fresh_tau']} | {r['identical']} |" for r in report["rounds"]]
    t = report["throughput"]
    lines += ["", f"Throughput with capture {t['tokens_per_s_capture']} tokens/s, without "
              f"{t['tokens_per_s_plain']} ({t['ratio']}x, {t['prompts']} prompts, each both ways).",
              f"First release after {report.get('first_release_s', 'none')} s.", "",
              "| round | decision | τ serving | τ candidate | gain | lower bound |", "|---|---|---|---|---|---|"]
    lines += [f"| {g['round']} | {g['decision']} | {g['tau_serving']} | {g['tau_candidate']} | "
              f"{g['gain']} | {g['gain_lower']} |" for g in report["gates"]]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None) -> int:
    from dflash.learn.learner import LearnConfig

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", help="target directory (default: the converted SmolLM2)")
    p.add_argument("--drafter", default="models/smollm2-dflash-b16", help="the starting version")
    p.add_argument("--out", required=True, help="report directory")
    p.add_argument("--learn-dir", help="capture + learner directory (default <out>/learn)")
    p.add_argument("--learn-bytes", type=int, default=1 << 30)
    p.add_argument("--domain", choices=("passages", "stdlib"), default="passages",
                   help="passages: instructions over docs/*.md paragraphs; stdlib: questions about "
                        "Python standard-library callables, fresh prompts from modules never served")
    p.add_argument("--concurrency", type=int, default=1,
                   help="streams at once while serving a round's captured prompts (fresh prompts: one)")
    p.add_argument("--prompts", type=int, default=400, help="served prompts in all")
    p.add_argument("--fresh", type=int, default=40, help="fresh prompts measured each round")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=300, help="optimizer steps between rounds")
    p.add_argument("--lr", type=float, default=LearnConfig.lr)
    p.add_argument("--gamma", type=float, default=LearnConfig.gamma, help="the loss's position decay")
    p.add_argument("--margin", type=float, default=0.02)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--throughput-prompts", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repo", default=str(Path(__file__).resolve().parents[1]))
    p.add_argument("--tiny", action="store_true", help="tiny random models, a few prompts (smoke test)")
    a = p.parse_args(argv)
    out = Path(a.out)
    a.learn_dir = a.learn_dir or str(out / "learn")
    if a.tiny:
        from dflash_app.testing import make_tiny_drafter, make_tiny_target

        a.target = str(make_tiny_target(out / "tiny" / "target"))
        a.drafter = str(make_tiny_drafter(out / "tiny" / "drafter", a.target, block_size=4))
        a.prompts, a.fresh, a.rounds, a.steps = min(a.prompts, 12), min(a.fresh, 3), min(a.rounds, 2), min(a.steps, 20)
        a.max_tokens, a.throughput_prompts, a.threads, a.lr = min(a.max_tokens, 16), 4, 1, 3e-3
    elif not a.target:
        from dflash.train.target_setup import target_dir

        a.target = str(target_dir())
    write_report(run(a), out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
