"""Expert-parallel (EP) target: one MoE target, its experts sharded across ``ep_size`` ranks.

Rank 0 is the verifier process: it serves gRPC, runs the scheduler and holds a
:class:`DistributedTarget`, which has the :class:`~verifier_svc.target.TargetModel` interface
(``new_cache``, ``forward``, ``forward_batch``, ``crop``, ``keep``, card fields, trees), so the
engine does not know how many ranks run the target. Ranks 1..N-1 are
``python -m verifier_svc.ep_worker`` processes that rank 0 starts. Each target call on rank 0
first broadcasts a small op record (op name, cache ids, tokens, tree parents, length) to the
workers with ``broadcast_object_list``; every rank then runs the same call on its own
:class:`EPShard`, whose forward exchanges expert outputs through collectives. Workers mirror
each session's KV cache by id (created on first use, freed when rank 0's cache object is
garbage collected: the id rides on the next op).

Sharding is transformers' own (``DistributedConfig(ep_size=N, fsdp_size=N)``): each rank keeps
``num_experts / N`` experts (``ep_dispatch_experts``: per MoE layer, an all-to-all sends each
routed token to the rank holding its expert and a second one brings the outputs back). Checked on
CPU/gloo: logits equal the single-rank model within 1e-6. transformers wants ``fsdp_size = N`` for
that (EP must divide ``fsdp_size * tp_size``); replicating the dense weights another way
(``tp_size=N, tp_plan={}``, "no tensor parallel rule" in the DistributedConfig docstring) is
refused by 5.24 (``tp_size=2 was requested, but MixtralForCausalLM has no tp_plan``). So we pass an
``fsdp_plan`` of ``keep_full_weight`` for every dense module: FSDP gathers them once, on the first
forward, and keeps them (no backward ever reshards them); with the default plan each forward
all-gathers every layer's dense weights again, once per layer and step.

Failure: a watchdog polls the worker processes; a failed collective (gloo reports a peer that
closed its sockets at once) or a dead worker marks the target failed: health turns NOT_SERVING
(``on_failure`` listeners), in-flight and new calls raise :class:`TargetUnavailable` (the servicer
maps it to UNAVAILABLE), surviving workers are stopped and the process group is destroyed.
Idle rank 0 broadcasts a heartbeat so workers waiting for the next op stay inside the collective
timeout.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from dflash.core.device import checkpoint_dtype, dtype_name, resolve_dtype
from dflash.core.kv_seq import check_compact
from kernels.skinny_linear import DEFAULT_MAX_ROWS
from verifier_svc.target import TargetModel, TargetUnavailable, check_parents
from verifier_svc.target_layout import num_experts

log = logging.getLogger("dflash.verifier.ep")


def init_group(rank: int, world: int, *, addr: str, port: int, timeout_s: float,
               device: torch.device | str) -> None:
    """torch.distributed with torchrun's env variables (transformers reads them): gloo on CPU,
    NCCL on GPU, where ``device`` (this rank's GPU) becomes the current device first (NCCL's
    collectives and transformers' device mesh use the current device)."""
    device = torch.device(device)
    local = device.index if device.type == "cuda" and device.index is not None else rank
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR=addr, MASTER_PORT=str(port))
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


class EPShard(TargetModel):
    """This rank's part of the target: transformers' EP sharding of the experts (process group up)."""

    # FSDP's unshard hooks bump version counters, which inference-mode tensors lack: the shard
    # runs the base class's forwards and keep under no_grad instead of inference_mode.
    _grad_mode = torch.no_grad

    def __init__(self, path: str | Path, *, ep_size: int, dtype: str | torch.dtype = "float32",
                 device: str | torch.device = "cpu", skinny_max_rows: int = DEFAULT_MAX_ROWS):
        self.ep_size = ep_size
        super().__init__(path, dtype=dtype, device=device, skinny_max_rows=skinny_max_rows)

    def _load(self) -> PreTrainedModel:
        from transformers import AutoConfig
        from transformers.distributed import DistributedConfig

        # Dense modules: gathered once, then kept whole on every rank (module docstring).
        dense = type(AutoConfig.from_pretrained(str(self.path))).base_model_fsdp_plan
        plan = {f"model.{name}": "keep_full_weight" for name in dense}
        cfg = DistributedConfig(ep_size=self.ep_size, fsdp_size=self.ep_size, fsdp_plan=plan)
        model = AutoModelForCausalLM.from_pretrained(str(self.path), dtype=self.dtype,
                                                     use_safetensors=True, distributed_config=cfg)
        if not num_experts(model.config):
            raise ValueError(f"{self.path}: not a mixture-of-experts model; expert parallelism "
                             "needs one (dflash convert-moe makes an exact MoE form of a dense target)")
        if next(model.parameters()).device != self.device:   # this rank's GPU (init_group)
            # transformers types .to as functools.wraps(nn.Module.to), whose first parameter is self
            model = model.to(self.device)  # type: ignore[arg-type]
        return model.eval()


class RankCache:
    """Rank 0's handle on one session's KV cache; the workers hold a mirror under ``cid``."""

    def __init__(self, cid: int, local):
        self.cid = cid
        self.local = local

    def get_seq_length(self) -> int:
        return self.local.get_seq_length()


class DistributedTarget:
    """The TargetModel interface over ``ep_size`` ranks (this process is rank 0).

    Args:
        path: MoE target directory.
        ep_size: ranks (>= 2); starts ``ep_size - 1`` worker processes.
        dtype: every rank's (``dflash.core.device.resolve_dtype`` on rank 0's device; the workers
            get the resolved name).
        devices: rank r's device (``dflash.core.device.rank_devices``: ``cuda:r`` on a GPU host,
            NCCL; the CPU for every rank otherwise, gloo); None = every rank on the CPU.
        threads: torch threads per worker (0 = torch default).
        skinny_max_rows: every rank's ``TargetModel`` option (``kernels.skinny_linear``).
        timeout_s: collective timeout (gloo/NCCL); bounds a hung (not dead) rank.
        heartbeat_s: idle rank 0 pings the workers this often (< timeout_s).
    Attributes: the card fields of TargetModel (rank 0's shard's), ``failure``
    (None while healthy, else the reason), ``on_failure`` (callables taking the reason).
    """

    def __init__(self, path: str | Path, *, ep_size: int, dtype: str | torch.dtype = "float32",
                 devices: list[torch.device] | None = None, threads: int = 0,
                 timeout_s: float = 60.0, heartbeat_s: float = 5.0,
                 master_addr: str = "127.0.0.1", skinny_max_rows: int = DEFAULT_MAX_ROWS):
        if ep_size < 2:
            raise ValueError("ep_size must be >= 2 (use TargetModel for one rank)")
        devices = devices or [torch.device("cpu")] * ep_size
        if len(devices) != ep_size:
            raise ValueError(f"devices: one per rank expected ({ep_size}), got {len(devices)}")
        dtype = dtype_name(resolve_dtype(dtype, checkpoint_dtype(path), devices[0]))
        self.ep_size = ep_size
        self.failure: str | None = None
        self.on_failure: list = []
        self._ids = itertools.count(1)
        self._freed: list[int] = []
        self._last_op = time.monotonic()
        self._closing = False
        self._torn_down = threading.Event()
        port = _free_port(master_addr)
        worker_args = ["--target", str(path), "--dtype", dtype,
                       "--world-size", str(ep_size), "--master-addr", master_addr,
                       "--master-port", str(port), "--timeout", str(timeout_s),
                       "--threads", str(threads), "--skinny-max-rows", str(skinny_max_rows)]
        self.workers = [self._spawn(r, [*worker_args, "--device", str(devices[r])])
                        for r in range(1, ep_size)]
        try:
            init_group(0, ep_size, addr=master_addr, port=port, timeout_s=timeout_s,
                       device=devices[0])
            self.shard = EPShard(path, ep_size=ep_size, dtype=dtype, device=devices[0],
                                 skinny_max_rows=skinny_max_rows)
        except BaseException:
            self._stop_workers()
            raise
        # The card and what the engine reads of a target: rank 0's shard's (every rank loads the
        # same checkpoint). Copied, not delegated: a TargetModel method not mirrored below would
        # run on rank 0 alone.
        sh = self.shard
        self.path, self.device, self.dtype, self.config = sh.path, sh.device, sh.dtype, sh.config
        self.hidden_size, self.num_layers, self.vocab_size = sh.hidden_size, sh.num_layers, sh.vocab_size
        self.max_positions, self.rope_theta = sh.max_positions, sh.rope_theta
        self.eos_token_ids, self.fingerprint = sh.eos_token_ids, sh.fingerprint
        # Every op is one broadcast plus collectives: ops must never interleave. Re-entrant, so
        # the engine may hold it around a forward (as with TargetModel) or not.
        self.lock = threading.RLock()
        self._stop = threading.Event()
        threading.Thread(target=self._watchdog, daemon=True, name="ep-watchdog").start()
        threading.Thread(target=self._heartbeat, args=(heartbeat_s,), daemon=True,
                         name="ep-heartbeat").start()
        log.info("expert parallel target up: %d ranks, worker pids %s", ep_size,
                 [p.pid for p in self.workers])

    # ------------------------------------------------------------------ TargetModel interface
    # Trees pass through: the mask and position ids act only in attention, which every rank
    # runs whole on its own cache mirror (only the experts are sharded), so a tree forward and
    # a keep are ops like any other. Arguments are validated here, before the broadcast: an
    # error raised inside an op would leave the ranks out of step and fail the group.
    supports_trees = True
    # Shared prompt prefill would copy one session's cache into another on every rank: not an
    # op yet, so every sample of a prefix group prefills (``Target.fork``).
    supports_fork = False

    def fork(self, src: RankCache, dst: RankCache, length: int) -> None:
        raise NotImplementedError("expert parallel targets do not fork caches (supports_fork)")

    def new_cache(self) -> RankCache:
        c = RankCache(next(self._ids), self.shard.new_cache())
        weakref.finalize(c, self._freed.append, c.cid)  # workers drop the mirror on the next op
        return c

    def forward(self, tokens: list[int], cache: RankCache, layer_ids, logits_to_keep: int = 0,
                parents=None):
        """``TargetModel.forward`` on every rank. Raises ValueError (no op sent) for bad
        ``parents``."""
        trees = check_parents(parents, [tokens])
        return self._call("forward", {"tokens": list(tokens), "cid": cache.cid, "layer_ids": layer_ids,
                                      "logits_to_keep": logits_to_keep, "parents": trees},
                          lambda: self.shard.forward(tokens, cache.local, layer_ids, logits_to_keep,
                                                     trees))

    def forward_batch(self, blocks, caches, layer_ids, parents=None):
        """``TargetModel.forward_batch`` on every rank. Raises ValueError (no op sent) for bad
        ``parents``."""
        trees = check_parents(parents, blocks)
        op = {"blocks": [list(b) for b in blocks], "cids": [c.cid for c in caches],
              "layer_ids": list(layer_ids), "parents": trees}
        return self._call("forward_batch", op, lambda: self.shard.forward_batch(
            blocks, [c.local for c in caches], layer_ids, trees))

    def keep(self, cache: RankCache, start: int, offsets: list[int]) -> None:
        """``TargetModel.keep`` on every rank. Raises ValueError (no op sent) for bad
        ``start`` / ``offsets``."""
        offsets = check_compact(cache.get_seq_length(), start, offsets)
        self._call("keep", {"cid": cache.cid, "start": int(start), "offsets": offsets},
                   lambda: self.shard.keep(cache.local, start, offsets))

    def tune_skinny(self) -> int:
        """Every rank keeps the row limit it was started with (no tuning across ranks)."""
        return self.shard.skinny_max_rows

    def own(self, cache: RankCache) -> None:
        self._call("own", {"cid": cache.cid}, lambda: self.shard.own(cache.local))

    def crop(self, cache: RankCache, length: int) -> None:
        if cache.get_seq_length() <= length:
            return  # nothing to drop on any rank: no op
        self._call("crop", {"cid": cache.cid, "length": length},
                   lambda: self.shard.crop(cache.local, length))

    # ------------------------------------------------------------------ ops
    def _call(self, name: str, op: dict, local):
        """Broadcast ``op`` to the workers, then run ``local()`` (the same op on rank 0)."""
        import torch.distributed as dist

        with self.lock:
            if self.failure:
                raise TargetUnavailable(f"expert-parallel target failed: {self.failure}")
            op["op"] = name
            op["free"] = [self._freed.pop() for _ in range(len(self._freed))]
            try:
                dist.broadcast_object_list([op], src=0)
                return local()
            except Exception as e:  # the ranks may be out of step now: the group is done
                self.fail(f"{name} failed on rank 0: {e}")
                raise TargetUnavailable(f"expert-parallel target failed: {self.failure}") from e
            finally:
                self._last_op = time.monotonic()

    def _heartbeat(self, every_s: float) -> None:
        import torch.distributed as dist

        while not self._stop.wait(every_s / 2):
            if time.monotonic() - self._last_op < every_s or not self.lock.acquire(blocking=False):
                continue
            try:
                if not self.failure and not self._closing:
                    dist.broadcast_object_list([{"op": "ping", "free": []}], src=0)
                    self._last_op = time.monotonic()
            except Exception as e:
                self.fail(f"heartbeat failed: {e}")
            finally:
                self.lock.release()

    # ------------------------------------------------------------------ failure and shutdown
    def _watchdog(self) -> None:
        while not self._stop.wait(0.2):
            for r, p in enumerate(self.workers, start=1):
                if p.poll() is not None and not self._closing:
                    self.fail(f"rank {r} (pid {p.pid}) exited with code {p.returncode}")
                    return

    def fail(self, reason: str) -> None:
        """Mark the target failed (once): listeners, stop the workers, destroy the group."""
        if self.failure or self._closing:
            return
        self.failure = reason
        log.error("expert-parallel target failed: %s; NOT_SERVING, requests get UNAVAILABLE", reason)
        for listener in self.on_failure:
            try:
                listener(reason)
            except Exception:
                log.exception("failure listener")
        threading.Thread(target=self._teardown, daemon=True, name="ep-teardown").start()

    def _teardown(self) -> None:
        self._stop.set()
        self._stop_workers()  # closes their sockets: a collective in flight on rank 0 errors out
        got = self.lock.acquire(timeout=30.0)
        try:
            _destroy_group()
        finally:
            if got:
                self.lock.release()
            self._torn_down.set()

    def close(self, timeout_s: float = 10.0) -> None:
        """Orderly shutdown: workers leave their loop, the group is destroyed."""
        import torch.distributed as dist

        if self.failure:
            self._torn_down.wait(timeout_s)
            return
        self._closing = True
        self._stop.set()
        with self.lock:
            try:
                dist.broadcast_object_list([{"op": "exit", "free": []}], src=0)
            except Exception:
                log.warning("exit broadcast failed", exc_info=True)
            _destroy_group()
        self._stop_workers(timeout_s)

    @staticmethod
    def _spawn(rank: int, worker_args: list[str]) -> subprocess.Popen:
        """Start rank ``rank``'s ``verifier_svc.ep_worker`` with the options every rank shares."""
        root = str(Path(__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        args = [sys.executable, "-m", "verifier_svc.ep_worker", "--rank", str(rank), *worker_args]
        return subprocess.Popen(args, env=env)  # logs go to the verifier's stdout/stderr

    def _stop_workers(self, timeout_s: float = 5.0) -> None:
        for p in self.workers:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + timeout_s
        for p in self.workers:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _destroy_group() -> None:
    import torch.distributed as dist

    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        log.warning("destroy_process_group failed", exc_info=True)


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]
