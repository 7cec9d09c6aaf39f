"""Run the oracle test drafter (tests/doubles.py) as its own process, for kill/restart tests.

    python tests/oracle_server.py --target DIR --refs refs.json --port P [--block-size 8]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.serving.server import run_until_signal  # noqa: E402
from drafter_svc.server import build  # noqa: E402

from doubles import ReferenceDrafter  # noqa: E402


class _TargetShape:
    def __init__(self, target_dir):
        cfg = json.loads((Path(target_dir) / "config.json").read_text())
        self.vocab_size, self.hidden_size = cfg["vocab_size"], cfg["hidden_size"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--refs", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--version", default="1")
    a = p.parse_args()
    refs = json.loads(Path(a.refs).read_text())
    engine = ReferenceDrafter(_TargetShape(a.target), refs, block_size=a.block_size)
    import dataclasses

    engine.card = dataclasses.replace(engine.card, version=a.version)
    rt = build(engine, f"127.0.0.1:{a.port}")
    rt.server.start()
    rt.set_serving(True)
    print("SERVING", flush=True)
    run_until_signal(rt, 1.0)


if __name__ == "__main__":
    main()
