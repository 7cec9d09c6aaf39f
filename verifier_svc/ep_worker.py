"""An expert-parallel worker rank (``python -m verifier_svc.ep_worker``), started by rank 0.

Loads its shard (``verifier_svc.ep.EPShard``), then loops: receive rank 0's op record, run the
same target call on its mirror of that session's cache, discard the output (rank 0 has it).
Exits on the ``exit`` op, when rank 0 goes away (a failed collective, or its pid changes) and on
SIGTERM; ignores SIGINT (a terminal's Ctrl-C reaches the whole process group: rank 0 shuts the
group down in order).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time

from dflash.core.device import add_device_args
from kernels.skinny_linear import DEFAULT_MAX_ROWS


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m verifier_svc.ep_worker")
    p.add_argument("--target", required=True)
    # this rank's own device (rank 0 passes cuda:r; a pod with one GPU: cuda) and the dtype
    # rank 0 resolved
    add_device_args(p, "rank")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--skinny-max-rows", type=int, default=DEFAULT_MAX_ROWS)
    return p.parse_args(argv)


def serve(shard, recv) -> None:
    """Run rank 0's ops on ``shard`` until ``exit``; ``recv()`` returns the next op record."""
    caches: dict[int, object] = {}

    def cache(cid):
        c = caches.get(cid)
        if c is None:
            c = caches[cid] = shard.new_cache()
        return c

    while True:
        op = recv()
        for cid in op.get("free", ()):
            caches.pop(cid, None)
        kind = op["op"]
        if kind == "exit":
            return
        if kind == "forward":
            shard.forward(op["tokens"], cache(op["cid"]), op["layer_ids"],
                          op.get("logits_to_keep", 0), op.get("parents"))
        elif kind == "forward_batch":
            shard.forward_batch(op["blocks"], [cache(c) for c in op["cids"]], op["layer_ids"],
                                op.get("parents"))
        elif kind == "keep":
            shard.keep(cache(op["cid"]), op["start"], op["offsets"])
        elif kind == "own":
            shard.own(cache(op["cid"]))
        elif kind == "crop":
            shard.crop(cache(op["cid"]), op["length"])
        elif kind != "ping":
            raise ValueError(f"unknown op {kind!r}")


def main(argv=None) -> int:
    import torch
    import torch.distributed as dist

    from dflash.core.device import DeviceError, resolve_device
    from verifier_svc.ep import EPShard, init_group

    a = parse_args(argv)
    try:
        device = resolve_device(a.device)
    except DeviceError as e:
        raise SystemExit(f"python -m verifier_svc.ep_worker: error: {e}") from None
    logging.basicConfig(level=os.environ.get("DFLASH_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s %(levelname)s ep-rank{a.rank}: %(message)s")
    log = logging.getLogger("dflash.verifier.ep")
    if a.threads:
        torch.set_num_threads(a.threads)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for rank 0, which stops us in order
    parent = os.getppid()

    def orphan_check():  # rank 0 killed outright: do not linger
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=orphan_check, daemon=True).start()
    init_group(a.rank, a.world_size, addr=a.master_addr, port=a.master_port, timeout_s=a.timeout,
               device=device)
    shard = EPShard(a.target, ep_size=a.world_size, dtype=a.dtype, device=device,
                    skinny_max_rows=a.skinny_max_rows)
    log.info("rank %d of %d ready", a.rank, a.world_size)

    def recv():
        box = [None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    try:
        serve(shard, recv)
    except Exception as e:  # rank 0 gone or the group torn down
        log.warning("leaving: %s", e)
        return 1
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    log.info("rank %d exits", a.rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
