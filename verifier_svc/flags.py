"""The verifier's command line (``python -m verifier_svc``): flags, each with its environment
variable, and what the parsed flags ask for (tree budgets, each rank's device, the stream limit)."""

from __future__ import annotations

import argparse
import os

from dflash.core.device import DeviceError, add_device_args
from dflash.core.speculation import MAX_TREE_BUDGET, MODES, SpecMode
from dflash.serving.argtypes import at_least, in_range, int_list, one_of, positive_float, split_host_port
from dflash.serving.server import add_common_args, add_compute_args, add_upstream_tls_args
from verifier_svc.policy import DEFAULT_TREE_BUDGET, DEFAULT_TREE_BUDGETS, DEFAULT_TREE_MAX_BATCH

# Streams beyond the batch and the waiting queue: ones unwinding or being refused by admission
# (which gives the better retry hint) instead of by the stream limit.
STREAM_SLACK = 32


def max_streams(max_batch: int, max_waiting: int, flag: int = 0) -> int:
    """``--max-streams``, 0 = every admissible request (``max_batch + max_waiting``) plus
    ``STREAM_SLACK``."""
    return flag or max_batch + max_waiting + STREAM_SLACK


def parse_args(argv=None) -> argparse.Namespace:
    """The verifier's flags (``argv``; None: the process's). Exits 2 naming a bad flag."""
    # no abbreviations: a new flag must never capture what an older one was spelt as
    p = argparse.ArgumentParser(prog="python -m verifier_svc", description="DFlash verifier (target) service",
                                allow_abbrev=False)
    _add_target_args(p)
    _add_speculation_args(p)
    _add_suffix_args(p)
    _add_drafter_args(p)
    _add_scheduling_args(p)
    _add_kv_events_args(p)
    p.add_argument("--spec-log-interval", type=float,
                   default=float(os.environ.get("DFLASH_SPEC_LOG_INTERVAL_S", "10")),
                   help="seconds between 'SpecDecoding metrics:' log lines (vLLM's format), 0 = off "
                        "[DFLASH_SPEC_LOG_INTERVAL_S]")
    add_common_args(p)
    add_upstream_tls_args(p, "drafters")
    return p.parse_args(argv)


def _add_target_args(p: argparse.ArgumentParser) -> None:
    """The target, where its ranks run and where the service listens."""
    env = os.environ.get
    p.add_argument("--target", default=env("DFLASH_TARGET"), required=env("DFLASH_TARGET") is None,
                   help="Hugging Face model directory (safetensors) [DFLASH_TARGET]")
    p.add_argument("--bind", default=env("DFLASH_VERIFIER_BIND", "127.0.0.1:50051"),
                   help="host:port to listen on [DFLASH_VERIFIER_BIND]")
    add_device_args(p, "target (every expert-parallel rank: rank r on cuda:r)")
    p.add_argument("--cuda-graphs", action="store_true",
                   default=env("DFLASH_CUDA_GRAPHS", "") not in ("", "0", "false"),
                   help="replay decode and verify forwards from CUDA graphs captured per batch "
                        "shape (verifier_svc/graphs.py); CUDA only, one rank only; off by "
                        "default (docs/gpu.md) [DFLASH_CUDA_GRAPHS]")
    p.add_argument("--ep-size", type=int, default=int(env("DFLASH_EP_SIZE", "1")),
                   help="expert-parallel ranks for a mixture-of-experts target: this process is "
                        "rank 0 and starts the others (torch.distributed: gloo on CPU, NCCL on GPU) "
                        "[DFLASH_EP_SIZE]")
    p.add_argument("--ep-timeout", type=float, default=float(env("DFLASH_EP_TIMEOUT_S", "60")),
                   help="collective timeout between expert-parallel ranks, seconds "
                        "[DFLASH_EP_TIMEOUT_S]")


def _add_speculation_args(p: argparse.ArgumentParser) -> None:
    """The default speculation policy and its draft trees."""
    env = os.environ.get
    p.add_argument("--spec-mode", default=env("DFLASH_SPEC_MODE", SpecMode.ADAPTIVE), type=one_of(MODES),
                   help="default speculation policy: off, fixed (always the block size), adaptive "
                        "(block length or tree budget per step from measured acceptance and "
                        "cost), tree (always a DDTree of --tree-budget nodes), suffix (trees of "
                        "continuations found earlier in the session and the tenant's answers; "
                        "no drafter needed) or hybrid (DDTree plus suffix branches); requests "
                        "may override with speculation.mode [DFLASH_SPEC_MODE]")
    p.add_argument("--tree-budget", type=in_range(1, MAX_TREE_BUDGET),
                   default=env("DFLASH_TREE_BUDGET", str(DEFAULT_TREE_BUDGET)),
                   help="nodes of a draft tree in mode tree when the request names none "
                        "[DFLASH_TREE_BUDGET]")
    p.add_argument("--tree-budgets", type=int_list(1, MAX_TREE_BUDGET), default=env("DFLASH_TREE_BUDGETS", ",".join(map(str, DEFAULT_TREE_BUDGETS))),
                   help="tree budgets (nodes) the adaptive policy may choose besides chains; "
                        f"each <= {MAX_TREE_BUDGET}; empty = chains only [DFLASH_TREE_BUDGETS]")
    p.add_argument("--tree-max-batch", type=in_range(0, 1 << 16),
                   default=env("DFLASH_TREE_MAX_BATCH", str(DEFAULT_TREE_MAX_BATCH)),
                   help="adaptive steps of more sessions than this verify chains only; 0 = any "
                        "batch (on a CPU trees paid at batch 1, not at 8 or 32: docs/trees.md) "
                        "[DFLASH_TREE_MAX_BATCH]")
    p.add_argument("--mode-race", default=env("DFLASH_MODE_RACE", "on"), type=one_of(("on", "off")),
                   help="adaptive races whole modes (off, suffix, hybrid, fixed and its own "
                        "per-step choice) per batch size on measured tokens/s and plays the "
                        "best (docs/batching.md, 'The mode race'); off = the per-step choice "
                        "alone [DFLASH_MODE_RACE]")


def _add_suffix_args(p: argparse.ArgumentParser) -> None:
    """Suffix candidates: the tenants' earlier answers and the operator's corpus (docs/suffix.md)."""
    env = os.environ.get
    p.add_argument("--suffix", default=env("DFLASH_SUFFIX", "on"), type=one_of(("on", "off")),
                   help="suffix candidates (docs/suffix.md): on = modes suffix and hybrid, "
                        "adaptive trees with suffix branches, and suffix trees when a drafter "
                        "fails or is absent; off = none of them (suffix/hybrid then verify "
                        "nothing / plain DDTrees) [DFLASH_SUFFIX]")
    p.add_argument("--suffix-answer-tokens", type=in_range(0, 1 << 24),
                   default=env("DFLASH_SUFFIX_ANSWER_TOKENS", "16384"),
                   help="tokens of recent answers kept per tenant (API key, else client address) "
                        "as suffix candidates for its later requests; 0 = none kept "
                        "[DFLASH_SUFFIX_ANSWER_TOKENS]")
    p.add_argument("--suffix-answer-total", type=in_range(0, 1 << 28),
                   default=env("DFLASH_SUFFIX_ANSWER_TOTAL", "262144"),
                   help="tokens of recent answers kept over all tenants (least recently used "
                        "tenants dropped first) [DFLASH_SUFFIX_ANSWER_TOTAL]")
    p.add_argument("--suffix-corpus", default=env("DFLASH_SUFFIX_CORPUS", ""),
                   help="a folder of token shards (dflash-tokens/1, e.g. data/train) whose answers "
                        "every tenant's suffix lookups read after its own: the target's earlier "
                        "answers; read-only, the operator's (docs/suffix.md) [DFLASH_SUFFIX_CORPUS]")
    p.add_argument("--suffix-corpus-tokens", type=in_range(0, 1 << 26),
                   default=env("DFLASH_SUFFIX_CORPUS_TOKENS", "524288"),
                   help="tokens of --suffix-corpus kept (about 240 bytes each) "
                        "[DFLASH_SUFFIX_CORPUS_TOKENS]")


def _add_drafter_args(p: argparse.ArgumentParser) -> None:
    """The drafters: what crosses the wire, which ones may be used, how long a step waits for
    them and when the breaker takes one out of the step path."""
    env = os.environ.get
    p.add_argument("--draft-timeout", type=float, default=float(env("DFLASH_DRAFT_TIMEOUT_S", "2.0")),
                   help="deadline per draft step, seconds; past it the step runs without "
                        "speculation [DFLASH_DRAFT_TIMEOUT_S]")
    p.add_argument("--wire-dtype", default=env("DFLASH_WIRE_DTYPE", ""),
                   help="dtype of context features sent to drafters (default: the target's, "
                        "so bfloat16 from a bfloat16 target) [DFLASH_WIRE_DTYPE]")
    p.add_argument("--no-learn-tenants", default=env("DFLASH_NO_LEARN_TENANTS", ""),
                   help="comma-separated tenants (API key names) whose sessions a drafter with "
                        "--learn-dir never captures (docs/learning.md) [DFLASH_NO_LEARN_TENANTS]")
    p.add_argument("--allow-unregistered-drafters", action="store_true",
                   default=env("DFLASH_ALLOW_UNREGISTERED_DRAFTERS", "") not in ("", "0", "false"),
                   help="speculate with any drafter address a request names; by default only "
                        "addresses that passed CheckDrafter (the gateway registers its drafters "
                        "so) receive a session's hidden states [DFLASH_ALLOW_UNREGISTERED_DRAFTERS]")
    p.add_argument("--drafter-alias", action="append", type=_alias,
                   default=[_alias(s) for s in env("DFLASH_DRAFTER_ALIASES", "").split(",") if s],
                   help="NAMED=DIALED, both host:port: dial DIALED whenever CheckDrafter or a "
                        "request names the drafter NAMED (replicas on one host, each with its own "
                        "drafter, behind a gateway that names one address: dflash up --verifiers); "
                        "repeat for several [DFLASH_DRAFTER_ALIASES, comma separated]")
    p.add_argument("--breaker-failures", type=at_least(0),
                   default=env("DFLASH_BREAKER_FAILURES", "3"),
                   help="consecutive missed draft deadlines or failed draft calls that take a "
                        "drafter out of the step path (its sessions run without speculation "
                        "until a background probe is answered in time), 0 = never "
                        "[DFLASH_BREAKER_FAILURES]")
    p.add_argument("--breaker-probe-interval", type=positive_float,
                   default=env("DFLASH_BREAKER_PROBE_INTERVAL_S", "1.0"),
                   help="seconds between probes of a drafter out of the step path "
                        "[DFLASH_BREAKER_PROBE_INTERVAL_S]")
    p.add_argument("--draft-deadline-floor", type=positive_float,
                   default=env("DFLASH_DRAFT_DEADLINE_FLOOR_S", "0.05"),
                   help="seconds a step waits for its drafts at least, however little the cost "
                        "model says speculating is worth (at most --draft-timeout); a reply "
                        "this fast never counts against a drafter [DFLASH_DRAFT_DEADLINE_FLOOR_S]")
    p.add_argument("--context-flush", type=at_least(1), default=env("DFLASH_CONTEXT_FLUSH", "8"),
                   help="on steps without speculation, send a session's new context features to "
                        "its drafter once this many rows are unsent (1 = every step); a draft "
                        "request always carries the rest [DFLASH_CONTEXT_FLUSH]")


def _alias(text: str) -> tuple[str, str]:
    """argparse ``type`` of --drafter-alias: ``NAMED=DIALED`` -> (NAMED, DIALED), refused naming
    the flag unless both sides are host:port."""
    named, sep, dialed = text.partition("=")
    try:
        if not sep:
            raise ValueError(f"{text!r} is not NAMED=DIALED")
        for side in (named, dialed):
            split_host_port(side.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return named.strip(), dialed.strip()


def drafter_aliases(a: argparse.Namespace) -> dict[str, str]:
    """--drafter-alias as named address -> dialed address (the last given for a name wins)."""
    return dict(a.drafter_alias)


def _add_scheduling_args(p: argparse.ArgumentParser) -> None:
    """Sessions, the batch, admission and the decode thread's compute."""
    env = os.environ.get
    p.add_argument("--session-ttl", type=float, default=float(env("DFLASH_SESSION_TTL_S", "600")),
                   help="idle session lifetime, seconds [DFLASH_SESSION_TTL_S]")
    p.add_argument("--prefix-cache", default=env("DFLASH_PREFIX_CACHE", "on"),
                   type=one_of(("on", "off")),
                   help="keep finished requests' K/V for later prompts of the same tenant that "
                        "start the same way (a resent conversation, a shared system prompt): "
                        "they prefill only the rest (docs/prefix-cache.md) [DFLASH_PREFIX_CACHE]")
    p.add_argument("--prefix-cache-mb", type=positive_float,
                   default=env("DFLASH_PREFIX_CACHE_MB", "2048"),
                   help="MiB of cached prefixes not in use (K/V and taps); past it the least "
                        "recently used go first; sessions' pinned K/V between turns is bounded "
                        "by --max-sessions instead [DFLASH_PREFIX_CACHE_MB]")
    p.add_argument("--prefix-cache-shared", default=env("DFLASH_PREFIX_CACHE_SHARED", ""),
                   help="a JSON file of token-id lists (e.g. a system prompt's ids) every "
                        "tenant's requests may reuse from the prefix cache; the operator's, "
                        "never a tenant's secret [DFLASH_PREFIX_CACHE_SHARED]")
    p.add_argument("--prefill-chunk", type=int, default=int(env("DFLASH_PREFILL_CHUNK", "256")),
                   help="prompt tokens prefilled between two decode steps of the running batch "
                        "[DFLASH_PREFILL_CHUNK]")
    p.add_argument("--max-batch", type=int, default=int(env("DFLASH_MAX_BATCH", "64")),
                   help="sessions verified together in one target forward [DFLASH_MAX_BATCH]")
    p.add_argument("--max-waiting", type=at_least(0), default=env("DFLASH_MAX_WAITING", "256"),
                   help="requests that may wait for a batch slot; past it a request is refused "
                        "at once with RESOURCE_EXHAUSTED and a retry hint (trailing metadata "
                        "retry-after-ms) [DFLASH_MAX_WAITING]")
    p.add_argument("--max-waiting-tokens", type=at_least(0),
                   default=env("DFLASH_MAX_WAITING_TOKENS", "0"),
                   help="prompt tokens not yet prefilled that may wait over all waiting "
                        "requests, 0 = unbounded; past it RESOURCE_EXHAUSTED "
                        "[DFLASH_MAX_WAITING_TOKENS]")
    p.add_argument("--max-streams", type=at_least(0), default=env("DFLASH_MAX_STREAMS", "0"),
                   help="Generate streams open at once (each holds a server thread; more are "
                        "refused with RESOURCE_EXHAUSTED, and health, Describe and session RPCs "
                        f"keep their own threads), 0 = max-batch + max-waiting + {STREAM_SLACK} "
                        "[DFLASH_MAX_STREAMS]")
    p.add_argument("--max-unread-events", type=at_least(1),
                   default=env("DFLASH_MAX_UNREAD_EVENTS", "4096"),
                   help="events a request's reader may leave unread before the request is "
                        "cancelled with RESOURCE_EXHAUSTED; the decode loop never waits for "
                        "readers [DFLASH_MAX_UNREAD_EVENTS]")
    add_compute_args(p, "decode (scheduler) thread")


def zmq_endpoints(text: str) -> str:
    """argparse ``type`` for ``--kv-events-*`` endpoints: comma-separated ``tcp://HOST:PORT``,
    ``ipc://PATH`` or a bare ``PORT`` (= ``tcp://127.0.0.1:PORT``: loopback); returns them
    normalised ("" = none)."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        if item.isdigit() and 0 < int(item) <= 65535:
            item = f"tcp://127.0.0.1:{item}"
        elif not item.startswith(("tcp://", "ipc://")) or len(item) <= len("tcp://"):
            raise argparse.ArgumentTypeError(
                f"{item!r} is not tcp://HOST:PORT, ipc://PATH or a port 1-65535")
        out.append(item)
    return ",".join(out)


def _add_kv_events_args(p: argparse.ArgumentParser) -> None:
    """KV events of the prefix cache for KV-aware routers (vLLM's format; docs/kv-events.md)."""
    env = os.environ.get
    p.add_argument("--kv-events-endpoint", type=zmq_endpoints,
                   default=env("DFLASH_KV_EVENTS_ENDPOINT", ""),
                   help="publish the prefix cache's KV events (BlockStored, BlockRemoved, "
                        "AllBlocksCleared in vLLM's ZeroMQ/msgpack format, for llm-d's precise "
                        "prefix scorer or Dynamo's KV router) on these ZeroMQ endpoints, bound: "
                        "tcp://HOST:PORT, ipc://PATH or a bare PORT (= tcp://127.0.0.1:PORT); "
                        "they carry tenants' token ids: an operator-side address, never a "
                        "client port; empty = off [DFLASH_KV_EVENTS_ENDPOINT]")
    p.add_argument("--kv-events-connect", type=zmq_endpoints,
                   default=env("DFLASH_KV_EVENTS_CONNECT", ""),
                   help="connect the publisher to these endpoints instead of (or as well as) "
                        "binding: a consumer that binds, as llm-d's KV-cache indexer does "
                        "[DFLASH_KV_EVENTS_CONNECT]")
    p.add_argument("--kv-events-topic", default=env("DFLASH_KV_EVENTS_TOPIC", ""),
                   help="the events' ZeroMQ topic (llm-d reads kv@<pod>@<model>) "
                        "[DFLASH_KV_EVENTS_TOPIC]")
    p.add_argument("--kv-events-replay-endpoint", type=zmq_endpoints,
                   default=env("DFLASH_KV_EVENTS_REPLAY_ENDPOINT", ""),
                   help="one endpoint (bound) answering replay requests for recent batches by "
                        "sequence number, vLLM's protocol; empty = none "
                        "[DFLASH_KV_EVENTS_REPLAY_ENDPOINT]")
    p.add_argument("--kv-events-encoding", type=one_of(("array", "map")),
                   default=env("DFLASH_KV_EVENTS_ENCODING", "array"),
                   help="events as tagged arrays (vLLM's first encoding, which llm-d and Dynamo "
                        "read) or tagged maps (vLLM's since it dropped array_like) "
                        "[DFLASH_KV_EVENTS_ENCODING]")
    p.add_argument("--kv-events-queue", type=at_least(1),
                   default=env("DFLASH_KV_EVENTS_QUEUE", "10000"),
                   help="event batches queued for the publisher thread; past it a batch is "
                        "dropped and counted, and a snapshot follows; the cache never waits "
                        "[DFLASH_KV_EVENTS_QUEUE]")


def parse_budgets(text: str) -> tuple[int, ...]:
    """``--tree-budgets`` (already checked by ``int_list``) as a tuple; "" = chains only."""
    return tuple(int(x) for x in text.split(",") if x)


def rank_devices_of(a) -> list:
    """Each rank's device from ``--device`` and ``--ep-size`` (``dflash.core.device.rank_devices``).

    Raises:
        DeviceError: naming ``--device`` (not there), ``--ep-size`` (fewer GPUs than ranks) or
            ``--cuda-graphs`` (no CUDA, or expert parallel).
    """
    from dflash.core.device import rank_devices, resolve_device

    devices = rank_devices(resolve_device(a.device), max(a.ep_size, 1))
    if a.cuda_graphs and (devices[0].type != "cuda" or a.ep_size > 1):
        raise DeviceError("--cuda-graphs", "needs a CUDA device and one rank "
                                           f"(--device {a.device}, --ep-size {a.ep_size})")
    return devices
