"""results.json and the returned files of scripts/accel_train.sh, from what its stages left.

Writes into ``--out`` (the device tool returns at most 8 files of < 16 MiB each, at most 2
folders down; everything here is at the top):
  ``drafter.tar.partNN``  the new drafter folder (config, weights, draft vocabulary, card) as a
                          tar cut into 15 MiB pieces: ``cat drafter.tar.part* | tar -x -C DIR``
  ``shards.tar.gz``       the new token shards and the manifest that lists them with the
                          committed ones: ``tar -xzf shards.tar.gz -C data/train``
  ``details.tar.gz``      the trainer's logs (heldout_log.csv, train_log.csv, summaries, loss
                          plot) and both evaluations
  ``results.json``        status, per-stage status and seconds, versions, GGUF parts, data
                          counts, held-out tau before / after, greedy tau of both drafters
``accel.log`` (the whole log) is written by the script itself. Exit status 1 when a returned
file breaks the tool's limits (named on stderr).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import io
import json
import sys
import tarfile
from importlib import metadata
from pathlib import Path

MAX_FILES, MAX_BYTES = 8, 16 << 20


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "gguf", "tokenizers", "numpy"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    try:
        import torch

        out["cuda"] = torch.version.cuda
        out["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except ImportError:
        pass
    return out


def gguf_state(home: Path) -> dict:
    from dflash_app import gguf_parts

    try:
        n, gaps = gguf_parts.missing(home / "parts")
    except gguf_parts.PartError as e:
        return {"error": str(e)}
    return {"parts": n, "missing": gaps, "joined": (home / "target.gguf").is_file()}


def data_counts(work: Path, stages: dict) -> dict:
    """Committed and new shards (new = this run's prompt seed), per source."""
    manifest = _json(work / "data" / "manifest.json")
    seed_file = work / "seed"
    if not manifest or not seed_file.is_file():
        return {}
    seed = int(seed_file.read_text())
    out: dict = {"prompt_seed": seed, "committed": {}, "new": {}, "new_shards": []}
    for s in manifest["shards"]:
        part = "new" if s.get("seed") == seed else "committed"
        t = out[part].setdefault(s["source"], {"shards": 0, "sequences": 0, "tokens": 0, "response_tokens": 0})
        t["shards"] += 1
        for k in ("sequences", "tokens", "response_tokens"):
            t[k] += s[k]
        if part == "new":
            out["new_shards"].append(s["name"])
    gen_s = stages.get("datagen", {}).get("seconds")
    new_resp = sum(t["response_tokens"] for t in out["new"].values())
    if gen_s:
        out["new_response_tokens_per_s"] = round(new_resp / gen_s, 1)   # incl. loading the target
    return out


def train_figures(work: Path) -> dict:
    run = work / "run"
    summary = _json(run / "train_summary.json") or {}
    start = _json(run / "heldout_start.json") or {}
    curve = []
    if (run / "heldout_log.csv").is_file():
        curve = list(csv.DictReader(open(run / "heldout_log.csv")))
    config = (_json(run / "ckpt.json") or {}).get("config", {})
    keep = ("seqs_per_step", "anchors_per_seq", "lr", "kl_weight", "time_budget_min", "init_from",
            "device", "block_size", "num_layers")
    return {"heldout_tau_before": start.get("tau"), "heldout_tau_after": (summary.get("heldout") or {}).get("tau"),
            "heldout_curve": curve, "summary": summary, "config": {k: config.get(k) for k in keep}}


def eval_figures(work: Path) -> dict:
    out = {}
    for which in ("base", "new"):
        res = _json(work / f"eval_{which}.json")
        if res:
            out[which] = res
    return out


def write_card(drafter: Path, res: dict) -> None:
    """A short model card (README.md) for the new drafter, from the figures of this run."""
    tr, ev, data = res["train"], res["eval"], res["data"]
    tau = {w: {s: r["tau"] for s, r in ev.get(w, {}).items()} for w in ("base", "new")}
    new = {src: t["sequences"] for src, t in data.get("new", {}).items()}
    lines = [
        f"# {drafter.name}: DFlash drafter trained on an accelerator",
        "",
        f"Trained by `scripts/accel_train.sh` on {res['versions'].get('gpu') or 'the CPU (dry run)'}, "
        f"{res['date'][:10]}, warm start from `{tr['config'].get('init_from')}`.",
        "",
        f"* data: the committed store plus new answers of prompt seed {data.get('prompt_seed')} "
        f"({json.dumps(new)}), ids answered in bfloat16",
        f"* recipe: {json.dumps(tr['config'])}",
        f"* held-out split, teacher-forced tau: {tr['heldout_tau_before']} before, "
        f"{tr['heldout_tau_after']} after ({(tr['summary'] or {}).get('steps')} steps)",
        f"* greedy tau (dflash.train.evaluate, float32 target), committed drafter: {json.dumps(tau['base'])}; "
        f"this one: {json.dumps(tau['new'])}",
        "",
        "Not benchmarked through the services yet: run `dflash bench` beside the committed version "
        "before releasing it.",
    ]
    (drafter / "README.md").write_text("\n".join(lines) + "\n")


def pack(out: Path, work: Path, new_shards: list[str], piece: int) -> None:
    """The returned files (module docstring); the drafter tar in pieces of ``piece`` bytes."""
    drafter = work / "drafter"
    if (drafter / "model.safetensors").is_file():
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(drafter, arcname="drafter")
        data = buf.getvalue()
        for i in range(0, len(data), piece):
            (out / f"drafter.tar.part{i // piece:02d}").write_bytes(data[i:i + piece])
    store = work / "data"
    if new_shards:
        with tarfile.open(out / "shards.tar.gz", "w:gz") as tar:
            tar.add(store / "manifest.json", arcname="manifest.json")
            for name in new_shards:
                tar.add(store / name, arcname=name)
    details = [p for p in sorted((work / "run").glob("*")) if p.suffix in (".csv", ".json", ".png")
               and not p.name.startswith("ckpt")] + sorted(work.glob("eval_*.json"))
    if details:
        with tarfile.open(out / "details.tar.gz", "w:gz") as tar:
            for p in details:
                tar.add(p, arcname=p.name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--home", required=True, type=Path)
    ap.add_argument("--status", required=True)
    ap.add_argument("--mode", required=True)
    ap.add_argument("--seconds", type=int, required=True)
    ap.add_argument("--budget", type=int, required=True)
    ap.add_argument("--piece-mib", type=float, default=15.0,
                    help="drafter.tar piece size (the tool returns files < 16 MiB)")
    args = ap.parse_args(argv)
    stage_file = args.out / ".stages.jsonl"
    stages = {}
    if stage_file.is_file():
        for line in stage_file.read_text().splitlines():
            s = json.loads(line)
            stages[s.pop("name")] = s
        stage_file.unlink()
    res = {"status": args.status, "mode": args.mode,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "seconds": args.seconds, "budget_s": args.budget, "versions": versions(),
           "stages": stages, "gguf": gguf_state(args.home)}
    if args.status != "waiting for parts":
        res.update(data=data_counts(args.work, stages), train=train_figures(args.work),
                   eval=eval_figures(args.work))
        if (args.work / "drafter" / "model.safetensors").is_file():
            write_card(args.work / "drafter", res)
        pack(args.out, args.work, res["data"].get("new_shards", []), int(args.piece_mib * (1 << 20)))
    files = sorted(p for p in args.out.iterdir() if p.is_file() and p.name != "results.json")
    res["files"] = {p.name: p.stat().st_size for p in files}
    (args.out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    files = [p for p in args.out.iterdir() if p.is_file()]
    bad = [p.name for p in files if p.stat().st_size >= MAX_BYTES]
    if len(files) > MAX_FILES or bad:
        print(f"accel_report: {len(files)} files (max {MAX_FILES}); over 16 MiB: {bad}", file=sys.stderr)
        return 1
    print(f"[accel] {args.status}: stages {json.dumps({k: v['status'] for k, v in stages.items()})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
