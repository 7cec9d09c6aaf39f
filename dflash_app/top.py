"""``dflash top``: a live terminal view of a running stack, read from its Prometheus endpoints.

Scrapes every service's ``/metrics`` (the ``dflash up --prometheus`` / compose layout by
default: gateway :9450, verifier :9451, drafter :9461) once per ``--interval`` and shows, by
drafter version: tau and per-position acceptance (over the last interval, and since start),
accepted tokens by source (the drafter, or the suffix index alone), tokens/s, TTFT and ITL percentiles, running requests, sessions and fallback steps. Rates are
differences between two scrapes (what PromQL's ``rate`` computes), so nothing but the
services is needed. Metric names and their meaning: docs/observability.md.
"""

from __future__ import annotations

import dataclasses
import time
import urllib.request
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # imported where used: `dflash --help` (and the client-only install) stay light
    from rich.console import Console, Group

DEFAULT_ENDPOINTS = ("127.0.0.1:9450", "127.0.0.1:9451", "127.0.0.1:9461")
V = "drafter_version"
NO_DRAFTER = "none"       # dflash.serving.metrics.NO_DRAFTER: speculation off

# {(sample name, ((label, value), ...)): value}, summed over every endpoint
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def command_for(host: str, ports: Iterable[int]) -> str:
    """The ``dflash top`` command line reading every one of ``ports`` on ``host``: the bare
    command for the default layout, one ``--metrics`` per endpoint otherwise (several verifier
    replicas, drafters beyond the first)."""
    endpoints = tuple(f"{host}:{p}" for p in ports)
    if sorted(endpoints) == sorted(DEFAULT_ENDPOINTS):
        return "dflash top"
    return "dflash top " + " ".join(f"--metrics {e}" for e in endpoints)


def scrape(endpoints: Iterable[str], timeout_s: float = 2.0) -> tuple[Samples, list[str]]:
    """Every endpoint's samples added up, and the endpoints that did not answer ("host:port"
    or a URL; ``/metrics`` is appended to a bare address)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Samples = defaultdict(float)
    down = []
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy
    for ep in endpoints:
        url = ep if "://" in ep else f"http://{ep}/metrics"
        try:
            with opener.open(url, timeout=timeout_s) as r:
                text = r.read().decode("utf-8", "replace")
        except OSError:
            down.append(ep)
            continue
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] += s.value
    return dict(out), down


def _by(samples: Samples, name: str, key: Callable[[dict], object] = lambda d: d.get(V)) -> dict:
    """``name``'s samples summed by ``key(labels)``."""
    out: dict = defaultdict(float)
    for (n, labels), v in samples.items():
        if n == name:
            out[key(dict(labels))] += v
    return dict(out)


def quantile(buckets: Mapping[float, float], q: float) -> float | None:
    """The ``q`` quantile of a histogram from its cumulative buckets ``{le: count}``, linear
    within a bucket like PromQL's ``histogram_quantile``; None without observations. The
    ``+Inf`` bucket answers with the largest finite bound."""
    edges = sorted(buckets)
    if not edges or buckets[edges[-1]] <= 0:
        return None
    rank = q * buckets[edges[-1]]
    lo, below = 0.0, 0.0
    for le in edges:
        count = buckets[le]
        if count >= rank:
            if le == float("inf"):
                return lo
            return lo + (le - lo) * ((rank - below) / (count - below) if count > below else 0.0)
        lo, below = le, count
    return lo


@dataclasses.dataclass(frozen=True)
class Row:
    """One drafter version's figures (None: nothing to show yet)."""

    version: str
    tau: float | None                 # since start: 1 + accepted / drafts
    tau_now: float | None             # over the last interval
    per_position: list[float]         # acceptance rate per draft position, since start
    tokens_per_s: float | None        # completion tokens per second, last interval
    ttft: tuple[float | None, float | None]   # p50, p99 (s)
    itl: tuple[float | None, float | None]
    requests: float
    fallbacks: float
    # accepted draft tokens since start by who proposed them ("drafter", "suffix"); empty when
    # the verifier exports no dflash_spec_decode_num_accepted_tokens_by_source
    accepted_by_source: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Frame:
    rows: list[Row]
    running: float                    # requests streaming at the gateway
    sessions: dict[str, float]        # verifier / drafter active sessions
    fallback_reasons: dict[str, float]
    down: list[str]
    interval_s: float | None


def _hist(samples: Samples, name: str, version: str) -> dict[float, float]:
    """``version``'s cumulative buckets ``{le: count}`` of histogram ``name``."""
    b = _by(samples, name + "_bucket", lambda d: float(d["le"]) if d.get(V) == version else None)
    b.pop(None, None)
    return b


def _delta(now: Mapping, before: Mapping | None, key) -> float | None:
    if before is None:
        return None
    return now.get(key, 0.0) - before.get(key, 0.0)


def frame(now: Samples, before: Samples | None = None, interval_s: float | None = None,
          down: list[str] | None = None) -> Frame:
    """The figures of one refresh from the samples of this scrape and the previous one."""
    drafts = _by(now, "dflash_spec_decode_num_drafts_total")
    accepted = _by(now, "dflash_spec_decode_num_accepted_tokens_total")
    tokens = _by(now, "dflash_request_completion_tokens_total")
    requests = _by(now, "dflash_requests_total")
    fallbacks = _by(now, "dflash_spec_decode_fallback_steps_total")
    by_source = _by(now, "dflash_spec_decode_num_accepted_tokens_by_source_total",
                    lambda d: (d.get(V), d.get("source", "")))
    per_pos = _by(now, "dflash_spec_decode_num_accepted_tokens_per_pos_total",
                  lambda d: (d.get(V), int(d.get("position", 0))))
    prev = {k: _by(before, n) if before is not None else None for k, n in (
        ("drafts", "dflash_spec_decode_num_drafts_total"),
        ("accepted", "dflash_spec_decode_num_accepted_tokens_total"),
        ("tokens", "dflash_request_completion_tokens_total"))}
    versions = sorted({v for d in (drafts, tokens, requests) for v in d if v is not None})
    rows = []
    for v in versions:
        d, a = drafts.get(v, 0.0), accepted.get(v, 0.0)
        dd, da = _delta(drafts, prev["drafts"], v), _delta(accepted, prev["accepted"], v)
        dt = _delta(tokens, prev["tokens"], v)
        positions = sorted(p for (ver, p) in per_pos if ver == v)
        ttft = _hist(now, "dflash_request_ttft_seconds", v)
        itl = _hist(now, "dflash_request_inter_token_latency_seconds", v)
        rows.append(Row(
            version=v, tau=1.0 + a / d if d else None,
            tau_now=1.0 + da / dd if dd and da is not None else None,
            per_position=[per_pos[(v, p)] / d if d else 0.0 for p in positions],
            tokens_per_s=dt / interval_s if dt is not None and interval_s else None,
            ttft=(quantile(ttft, 0.5), quantile(ttft, 0.99)),
            itl=(quantile(itl, 0.5), quantile(itl, 0.99)),
            requests=requests.get(v, 0.0), fallbacks=fallbacks.get(v, 0.0),
            accepted_by_source={src: n for (ver, src), n in sorted(by_source.items()) if ver == v}))
    sessions = {svc: sum(_by(now, f"dflash_{svc}_active_sessions", lambda d: 0).values())
                for svc in ("verifier", "drafter")}
    running = sum(_by(now, "dflash_gateway_running_requests", lambda d: 0).values())
    reasons = _by(now, "dflash_spec_decode_fallback_steps_total", lambda d: d.get("reason", ""))
    return Frame(rows=rows, running=running, sessions=sessions,
                 fallback_reasons={r: n for r, n in reasons.items() if n},
                 down=list(down or []), interval_s=interval_s)


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _ms(pair: tuple[float | None, float | None]) -> str:
    return " / ".join(_f(x * 1e3 if x is not None else None, "{:.1f}") for x in pair)


def _sources(by_source: Mapping[str, float]) -> str:
    """``drafter / suffix`` accepted tokens and the suffix share, e.g. ``812 / 40 (5%)``."""
    if not by_source:
        return "-"
    d, s = by_source.get("drafter", 0.0), by_source.get("suffix", 0.0)
    share = f" ({100 * s / (d + s):.0f}%)" if d + s else ""
    return f"{d:.0f} / {s:.0f}{share}"


def render(f: Frame) -> "Group":
    """The rich renderable of one frame: a header line, the table by drafter version."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    t = Table(title="dflash top: by drafter version", title_justify="left", expand=False)
    for col, just in (("drafter", "left"), ("τ", "right"), ("τ now", "right"),
                      ("accepted per position", "left"),
                      ("accepted drafter / suffix", "right"), ("tok/s", "right"),
                      ("TTFT ms p50/p99", "right"), ("ITL ms p50/p99", "right"),
                      ("requests", "right"), ("fallbacks", "right")):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for r in f.rows:
        pos = " ".join(f"{p:.2f}" for p in r.per_position) or "-"
        t.add_row(r.version, _f(r.tau), _f(r.tau_now), pos, _sources(r.accepted_by_source),
                  _f(r.tokens_per_s, "{:.1f}"),
                  _ms(r.ttft), _ms(r.itl), f"{r.requests:.0f}",
                  Text(f"{r.fallbacks:.0f}", style="red" if r.fallbacks else ""))
    head = Text(f"running {f.running:.0f}   sessions: verifier {f.sessions['verifier']:.0f}, "
                f"drafter {f.sessions['drafter']:.0f}")
    if f.fallback_reasons:
        head.append("   fallbacks: " + ", ".join(f"{k} {v:.0f}" for k, v in
                                                 sorted(f.fallback_reasons.items())), style="red")
    parts: list = [head, t]
    if f.down:
        parts.append(Text("not answering: " + ", ".join(f.down), style="yellow"))
    return Group(*parts)


def run(endpoints: list[str], interval_s: float = 1.0, once: bool = False,
        console: "Console | None" = None, frames: int | None = None,
        on_frame: Callable[[Frame], object] | None = None) -> int:
    """Refresh every ``interval_s`` until Ctrl-C (``once``: one frame, printed; ``frames``:
    stop after that many). ``on_frame`` is called with each frame once it is drawn (a
    benchmark times the refreshes with it). Returns 0, or 1 when no endpoint answered a
    one-shot scrape."""
    from rich.console import Console
    from rich.live import Live

    console = console or Console()
    before, t_before = None, None
    if once:
        now, down = scrape(endpoints)
        console.print(render(frame(now, down=down)))
        return 1 if len(down) == len(endpoints) else 0
    n = 0
    with Live(console=console, auto_refresh=False, screen=False) as live:
        try:
            while frames is None or n < frames:
                t = time.monotonic()
                now, down = scrape(endpoints)
                f = frame(now, before, t - t_before if t_before else None, down)
                live.update(render(f), refresh=True)
                if on_frame is not None:
                    on_frame(f)
                before, t_before, n = now, t, n + 1
                if frames is None or n < frames:
                    time.sleep(max(0.0, interval_s - (time.monotonic() - t)))
        except KeyboardInterrupt:
            pass
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("top", help="live terminal view of a running stack from its /metrics")
    p.add_argument("--metrics", action="append", metavar="HOST:PORT",
                   help="a service's metrics address or URL; repeat for each (default: "
                        f"{', '.join(DEFAULT_ENDPOINTS)}, the dflash up --prometheus layout)")
    p.add_argument("--interval", type=float, default=1.0, help="refresh period, seconds")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.set_defaults(func=lambda a: run(a.metrics or list(DEFAULT_ENDPOINTS), a.interval, a.once))

