"""``dflash learn status|train|release|rollback``: the online learner from the command line
(docs/learning.md)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def add_parser(sub) -> None:
    from dflash.learn.defaults import MIN_DRAFTS

    p = sub.add_parser("learn", help="online learning: status, train, release, rollback")
    lsub = p.add_subparsers(dest="learn_cmd", required=True)

    def common(q, model: bool = False) -> None:
        q.add_argument("--learn-dir", required=True, help="the drafter's --learn-dir")
        if model:
            q.add_argument("--drafter", required=True, help="the serving version's drafter directory")
            q.add_argument("--target", required=True, help="the target directory (its head only)")
            q.add_argument("--threads", type=int, default=1, help="torch threads")

    s = lsub.add_parser("status", help="capture store, training progress, held-out curve, decisions")
    common(s)
    s.add_argument("--json", action="store_true", help="one JSON document")
    s.set_defaults(func=cmd_status)
    t = lsub.add_parser("train", help="train the candidate on the captured conversations")
    common(t, model=True)
    t.add_argument("--steps", type=int, default=100, help="optimizer steps this run")
    t.set_defaults(func=cmd_train)
    r = lsub.add_parser("release", help="gate the candidate; if it passes write name@N+1 and "
                                       "optionally register it as a canary and watch it")
    common(r, model=True)
    r.add_argument("--force", action="store_true", help="release even if the gate refuses (logged)")
    r.add_argument("--admin", help="gateway admin address (host:port) to register the new version")
    r.add_argument("--address", help="address of the drafter process serving the new version")
    r.add_argument("--canary", type=float, default=0.1, help="its share of the traffic (0, 1]")
    r.add_argument("--verifier-metrics", help="verifier /metrics URL: watch the canary and roll "
                                              "it back automatically if its served tau is lower")
    r.add_argument("--min-drafts", type=int, default=MIN_DRAFTS,
                   help="drafted steps per version before the watch decides")
    r.set_defaults(func=cmd_release)
    b = lsub.add_parser("rollback", help="all traffic back to the old version, the new one removed")
    common(b)
    b.add_argument("--admin", required=True, help="gateway admin address (host:port)")
    b.add_argument("--old", required=True, help="name@version to keep")
    b.add_argument("--new", required=True, help="name@version to remove")
    b.set_defaults(func=cmd_rollback)


def status(learn_dir: str | Path) -> dict:
    """What ``dflash learn status`` shows, as a dict."""
    from dflash.learn.release import decisions
    from dflash.learn.store import CaptureStore

    d = Path(learn_dir)
    st = d / "status.json"
    return {"learn_dir": str(d), "store": CaptureStore(d / "store", writer=False).counts(),
            "learner": json.loads(st.read_text()) if st.is_file() else None,
            "decisions": decisions(d)[-10:]}


def cmd_status(a) -> int:
    s = status(a.learn_dir)
    if a.json:
        print(json.dumps(s, indent=1))
        return 0
    c = s["store"]
    print(f"store: {c['train']} training + {c['heldout']} held-out conversations, "
          f"{c['bytes'] / 2**20:.1f} MiB")
    ln = s["learner"]
    if ln:
        print(f"candidate of {ln['base']}: step {ln['step']}/{ln['max_steps']}, "
              f"{ln['train_seconds']:.0f} s trained, loss {ln['loss']}")
        for pt in ln["heldout_curve"]:
            print(f"  held-out tau (teacher-forced) {pt['tau']:.3f} at step {pt['step']} ({pt['conversations']} conversations)")
    else:
        print("learner: not started")
    for dcs in s["decisions"]:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(dcs["time"]))
        rest = {k: v for k, v in dcs.items() if k not in ("time", "decision")}
        print(f"{when} {dcs['decision']}: {json.dumps(rest)}")
    return 0


def _learner(a):
    import torch

    from dflash.learn.learner import Learner

    torch.set_num_threads(a.threads)
    return Learner(a.learn_dir, a.drafter, a.target)


def cmd_train(a) -> int:
    lr = _learner(a)
    n = lr.reload()
    if not n:
        print(f"dflash learn train: no trainable conversations in {lr.store.path}", file=sys.stderr)
        return 1
    t0 = time.time()
    done = lr.run(a.steps)
    point = lr.log_heldout()
    print(f"trained {done} steps on {n} conversations in {time.time() - t0:.0f} s (step "
          f"{lr.step}); held-out tau (teacher-forced) {point['tau']} on {point['conversations']} conversations")
    return 0


def _admin(addr: str):
    import grpc

    from dflash.v1 import gateway_pb2_grpc

    return gateway_pb2_grpc.GatewayAdminStub(grpc.insecure_channel(addr))


def cmd_release(a) -> int:
    from dflash.learn import release as rel

    lr = _learner(a)
    old = lr.base
    try:
        out = rel.release(lr, force=a.force)
    except FileExistsError as e:
        print(f"dflash learn release: {e}", file=sys.stderr)
        return 2
    last = rel.decisions(a.learn_dir)[-1]
    print(json.dumps(last))
    if out is None:
        return 1
    if not (a.admin and a.address):
        print(f"released {out}; serve it (python -m drafter_svc --drafter {out}) and register it "
              "(--admin/--address, or GatewayAdmin/RegisterDrafter)")
        return 0
    admin = _admin(a.admin)
    new = rel.register_canary(admin, a.address, old, a.canary, a.learn_dir)
    print(f"{new}: canary at {a.canary:.0%} of the traffic beside {old}")
    if a.verifier_metrics:
        import urllib.request

        def scrape() -> str:
            return urllib.request.urlopen(a.verifier_metrics, timeout=10).read().decode()

        decision, figures = rel.watch_canary(admin, scrape, old, new, a.learn_dir,
                                             min_drafts=a.min_drafts)
        print(f"{decision}: {json.dumps(figures)}")
    return 0


def cmd_rollback(a) -> int:
    from dflash.learn import release as rel

    rel.rollback(_admin(a.admin), a.old, a.new, a.learn_dir, {"by": "operator"})
    print(f"rolled back: all traffic to {a.old}, {a.new} deregistered")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dflash")
    add_parser(p.add_subparsers(dest="cmd", required=True))
    a = p.parse_args(argv)
    return a.func(a)
