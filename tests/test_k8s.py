"""The Kubernetes manifests (deploy/k8s/), checked without a cluster.

1. the committed renders (deploy/k8s/rendered/, scripts/render_k8s.py) are current, and the
   renderer merges as kustomize does;
2. every rendered object validates against the Kubernetes OpenAPI schemas (kubernetes-validate,
   strict: unknown fields refused) of the oldest and newest release we claim, and the pool's
   InferencePool and InferenceObjectives against the Gateway API Inference Extension's
   (tests/fixtures/gie/, jsonschema);
3. every command, flag and DFLASH_* variable in a container exists in the service it runs
   (``parse_args`` run with the container's environment, as tests/test_compose.py does for
   compose), and ports (the gateway's HTTP API's too), probes, Services, NetworkPolicies,
   Prometheus annotations, mounted secrets, GPU requests, the PodDisruptionBudget and the
   expert-parallel ranks agree with what the code reads;
4. the pool (overlays/pool): its pods wire verifier, drafter and gateway on loopback, the
   InferencePool selects those pods on the gateway's HTTP port, the endpoint picker may read the
   verifier's Model Server Protocol gauges, and the HPA scales the pool's Deployment on the
   waiting-requests gauge under the name the Prometheus adapter rule gives it.
"""

from __future__ import annotations

import ast
import copy
import importlib
import importlib.util
import os
import re
import shlex
from pathlib import Path

import pytest
import yaml

from helpers import RecordingEnviron, host_port

kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu", "gpu-ep")        # the base's topology: one verifier
ALL_OVERLAYS = (*OVERLAYS, "pool")         # and N verifier+drafter+gateway pods
# kind -> the GIE schema it validates against (CRDs: not in kubernetes-validate's schemas)
GIE_SCHEMAS = {"InferencePool": "inferencepool-v1.yaml",
               "InferenceObjective": "inferenceobjective-v1alpha2.yaml"}
# grpc probes are GA from 1.27; the pod-index label (EP ranks) from 1.28; the newest schemas in
# the pinned kubernetes-validate wheel
K8S_VERSIONS = ("1.28.0", "1.37.0")
# module run by a container -> (its parse_args, its gRPC service name or None)
MODULES = {"gateway": "gateway.server", "verifier_svc": "verifier_svc.server",
           "drafter_svc": "drafter_svc.server", "verifier_svc.ep_worker": "verifier_svc.ep_worker"}
# Variables the manifests use before the code reads them: each one is a change the lead merges
# (docs/kubernetes.md). Once a name exists in the code the test fails until it leaves this set.
PENDING: set[str] = set()


def _load_renderer():
    spec = importlib.util.spec_from_file_location("render_k8s", ROOT / "scripts" / "render_k8s.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


render_k8s = _load_renderer()


def rendered(overlay: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / "rendered" / f"{overlay}.yaml").read_text()) if d]


def by_kind(docs, kind) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def workloads(docs) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "Job")}


def pod_spec(w: dict) -> dict:
    return w["spec"]["template"]["spec"]


def env_of(container: dict) -> dict[str, str]:
    """Literal env values (downward-API values as a placeholder '0': the pod index)."""
    return {e["name"]: e.get("value", "0") for e in container.get("env", [])}


def _module_file(mod: str) -> Path | None:
    base = ROOT / mod.replace(".", "/")
    for f in (base.with_suffix(".py"), base / "__init__.py"):
        if f.is_file():
            return f
    return None


def env_names_in_source(module: str) -> set[str]:
    """DFLASH_* string constants in ``module``'s package files and the repository modules they
    import, transitively (DFLASH_LOG_LEVEL in main(), DFLASH_METRICS_HOST in dflash/serving/telemetry.py)."""
    names, seen = set(), set()
    todo = list((ROOT / module.split(".")[0]).glob("*.py"))
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


def invocation(container: dict) -> tuple[str, list[str]]:
    """(module, argv) of the container's ``python -m MODULE ARGS``, the shell's exec line
    included (``$VAR`` expanded from the container's env and the script's exports)."""
    cmd = container["command"]
    if cmd[:2] == ["python", "-m"]:
        return cmd[2], cmd[3:] + container.get("args", [])
    assert cmd[:2] == ["sh", "-c"], cmd
    script = cmd[2].replace("\\\n", " ")
    env = env_of(container)
    for line in script.splitlines():
        m = re.match(r"\s*export (\w+)=(.*)", line)
        if m:
            env[m.group(1)] = "1"  # a rank number: any valid integer will do for parse_args
        if line.strip().startswith("exec python -m "):
            words = shlex.split(re.sub(r"\$(\w+)|\$\{(\w+)\}",
                                       lambda v: env[v.group(1) or v.group(2)], line))
            return words[3], words[4:]
    raise AssertionError(f"no `exec python -m` line in {script!r}")


def parse(monkeypatch, module: str, argv: list[str], env: dict[str, str]):
    """``parse_args(argv)`` of the module's server with exactly ``env`` as the environment.
    Returns (namespace, names read from the environment)."""
    mod = importlib.import_module(MODULES[module])
    rec = RecordingEnviron(env)
    with monkeypatch.context() as m:
        m.setattr(os, "environ", rec)
        ns = mod.parse_args(argv)
    return ns, rec.read


def service_containers(docs):
    """(workload, container, module, argv) of every container that runs a dflash service."""
    for w in workloads(docs).values():
        for c in pod_spec(w)["containers"]:
            module, argv = invocation(c)
            if module in MODULES:
                yield w, c, module, argv


# --- 1. the renders --------------------------------------------------------------------------

def test_committed_renders_are_current(capsys):
    assert render_k8s.main(["--check"]) == 0, capsys.readouterr().err


def test_merge_follows_strategic_merge():
    base = {"spec": {"containers": [{"name": "a", "image": "x:cpu",
                                     "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
                                     "volumeMounts": [{"name": "v", "mountPath": "/m"}],
                                     "args": ["--x"]}]}}
    patch = {"spec": {"containers": [{"name": "a", "env": [{"name": "B", "value": "3"},
                                                           {"name": "C", "value": "4"}],
                                      "volumeMounts": [{"name": "w", "mountPath": "/m"}],
                                      "args": ["--y"]}]}}
    out = render_k8s.merge(base, patch)
    (c,) = out["spec"]["containers"]
    assert c["env"] == [{"name": "A", "value": "1"}, {"name": "B", "value": "3"}, {"name": "C", "value": "4"}]
    assert c["volumeMounts"] == [{"name": "w", "mountPath": "/m"}]  # merged by mountPath
    assert c["args"] == ["--y"] and c["image"] == "x:cpu"            # scalars' lists replaced
    assert base["spec"]["containers"][0]["env"][1]["value"] == "2"  # inputs untouched


def test_renderer_refuses_what_it_does_not_implement(tmp_path):
    (tmp_path / "r.yaml").write_text("apiVersion: v1\nkind: Service\nmetadata: {name: s}\n")
    (tmp_path / "kustomization.yaml").write_text("resources: [r.yaml]\nnamePrefix: x-\n")
    with pytest.raises(ValueError, match="namePrefix"):
        render_k8s.build(tmp_path)
    (tmp_path / "p.yaml").write_text("apiVersion: v1\nkind: Service\nmetadata: {name: other}\n")
    (tmp_path / "kustomization.yaml").write_text("resources: [r.yaml]\npatches: [{path: p.yaml}]\n")
    with pytest.raises(ValueError, match="matches no resource"):
        render_k8s.build(tmp_path)
    (tmp_path / "p.yaml").write_text("apiVersion: v1\nkind: Service\nmetadata: {name: s}\n$patch: delete\n")
    assert render_k8s.build(tmp_path) == []


def test_overlays_differ_where_they_should():
    cpu, gpu, ep = (workloads(rendered(o)) for o in OVERLAYS)
    image = lambda ws, n: pod_spec(ws[n])["containers"][0]["image"]  # noqa: E731
    assert image(cpu, "verifier") == "dflash-serve/verifier:cpu"
    assert image(gpu, "verifier") == "dflash-serve/verifier:cuda"
    assert image(gpu, "drafter-v2") == "dflash-serve/drafter:cuda"
    assert image(gpu, "gateway") == "dflash-serve/gateway:cpu"  # the gateway needs no GPU
    assert "verifier" not in ep and {"verifier-ep-leader", "verifier-ep-worker"} <= set(ep)


# --- 2. schemas ------------------------------------------------------------------------------

@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", ALL_OVERLAYS)
def test_rendered_objects_validate_against_kubernetes_schemas(overlay, version):
    for doc in rendered(overlay):
        if doc["kind"] not in GIE_SCHEMAS:   # those: test_pool_objects_validate_against_the_gie_schemas
            kubernetes_validate.validate(doc, version, strict=True)


def test_schema_validation_refuses_a_broken_manifest():
    dep = copy.deepcopy(workloads(rendered("cpu"))["verifier"])
    pod_spec(dep)["containers"][0]["readinessProbe"]["grpc"]["port"] = "health"  # grpc wants a number
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSIONS[-1], strict=True)
    dep = copy.deepcopy(workloads(rendered("cpu"))["verifier"])
    pod_spec(dep)["containers"][0]["envFrom"] = {"name": "x"}  # a list in the schema
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSIONS[-1], strict=True)


# --- 3. the manifests against the code --------------------------------------------------------

@pytest.mark.parametrize("overlay", ALL_OVERLAYS)
def test_every_flag_and_variable_exists_in_the_service(overlay, monkeypatch):
    missing = set()
    for w, c, module, argv in service_containers(rendered(overlay)):
        env = env_of(c)
        _, read = parse(monkeypatch, module, argv, env)  # an unknown flag or bad value exits
        known = read | env_names_in_source(module)
        for name in env:
            if name.startswith("DFLASH_") and name not in known:
                missing.add(name)
                assert name in PENDING, f"{w['metadata']['name']}/{c['name']}: {module} reads no {name}"
    landed = PENDING - missing
    # PENDING names the variables this overlay uses; one the code now reads must leave the set
    used = {n for _, c, _, _ in service_containers(rendered(overlay)) for n in env_of(c)}
    assert not (landed & used), f"{sorted(landed & used)} exist now: remove them from PENDING"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ports_probes_and_scrape_annotations_match_the_service(overlay, monkeypatch):
    docs = rendered(overlay)
    for w, c, module, argv in service_containers(docs):
        name = f"{w['metadata']['name']}/{c['name']}"
        ns, _ = parse(monkeypatch, module, argv, env_of(c))
        ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        if module == "verifier_svc.ep_worker":
            assert ports == {"collectives": ns.master_port}, name
            assert not any(k in c for k in ("readinessProbe", "livenessProbe")), name
            continue
        service = importlib.import_module(MODULES[module]).SERVICE
        bind_host, bind_port = host_port(ns.bind)
        assert bind_host == "0.0.0.0" and ports["grpc"] == bind_port, name
        assert ports["metrics"] == ns.metrics_port, name
        ann = w["spec"]["template"]["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and int(ann["prometheus.io/port"]) == ns.metrics_port
        assert env_of(c)["DFLASH_METRICS_HOST"] == "0.0.0.0", f"{name}: scraped on the pod IP"
        _, health_port = host_port(env_of(c)["DFLASH_HEALTH_BIND"])
        assert ports["health"] == health_port, name
        if module == "gateway":   # the OpenAI-compatible HTTP API, on the pod IP
            from gateway.server import http_bind

            assert http_bind(ns) is not None, f"{name}: the HTTP API is off"
            http_host, http_port = host_port(http_bind_of(ns))
            assert http_host == "0.0.0.0" and ports["http"] == http_port, name
        else:
            assert "http" not in ports, name
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            p = c[probe]
            if "grpc" in p:
                assert p["grpc"] == {"port": health_port, "service": service}, f"{name} {probe}"
            else:  # the gateway's liveness: listening (its health follows the verifier's)
                assert module == "gateway" and probe == "livenessProbe", f"{name} {probe}"
                assert p["tcpSocket"]["port"] == "health"
        assert c["readinessProbe"].get("grpc"), f"{name}: readiness is grpc.health.v1"


def _pods_selected(docs, selector: dict) -> list[tuple[dict, dict]]:
    return [(w, c) for w in workloads(docs).values() for c in pod_spec(w)["containers"]
            if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_and_addresses_reach_the_right_pods(overlay, monkeypatch):
    docs = rendered(overlay)
    services = by_kind(docs, "Service")
    for s in services.values():
        pods = _pods_selected(docs, s["spec"]["selector"])
        assert pods, f"Service {s['metadata']['name']} selects no pod"
        for p in s["spec"]["ports"]:
            for _, c in pods:
                names = {cp["name"]: cp["containerPort"] for cp in c.get("ports", [])}
                assert p["targetPort"] in names or p["targetPort"] in names.values(), (s["metadata"], p)

    def serves(addr: str, module: str) -> None:
        host, port = host_port(addr)
        svc = services[host]
        (sp,) = [p for p in svc["spec"]["ports"] if p["port"] == port]
        for _, c in _pods_selected(docs, svc["spec"]["selector"]):
            mod, argv = invocation(c)
            assert mod == module, f"{addr} reaches {mod}"
            ns, _ = parse(monkeypatch, mod, argv, env_of(c))
            assert host_port(ns.bind)[1] == {cp["name"]: cp["containerPort"] for cp in c["ports"]}[sp["targetPort"]]

    (gw,) = [c for _, c, m, _ in service_containers(docs) if m == "gateway"]
    ns, _ = parse(monkeypatch, "gateway", [], env_of(gw))
    for addr in ns.verifier:                  # --verifier is a list (replicas)
        serves(addr, "verifier_svc")
    drafters = env_of(gw)["DFLASH_DRAFTERS"].split(",")
    for addr in drafters:
        serves(addr, "drafter_svc")
    # the allowlist admits exactly the drafters the gateway starts with
    assert sorted(env_of(gw)["DFLASH_DRAFTER_ALLOW"].split(",")) == sorted(drafters)
    # every drafter version is its own Deployment, so each rolls on its own
    versions = {}
    for w, c, m, argv in service_containers(docs):
        if m == "drafter_svc":
            ns, _ = parse(monkeypatch, m, argv, env_of(c))
            assert w["kind"] == "Deployment" and ns.version not in versions.values()
            versions[w["metadata"]["name"]] = ns.version
    assert versions == {"drafter-v1": "1", "drafter-v2": "2"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_service_and_network_policy_admit_grpc_and_http(overlay, monkeypatch):
    """Clients reach the gateway's gRPC and HTTP ports through its Service, and its
    NetworkPolicy admits exactly those (and the kubelet's health port) from anywhere."""
    from gateway.server import http_bind

    docs = rendered(overlay)
    (gw,) = [c for _, c, m, _ in service_containers(docs) if m == "gateway"]
    ns, _ = parse(monkeypatch, "gateway", [], env_of(gw))
    grpc_port, http_port = host_port(ns.bind)[1], host_port(http_bind(ns))[1]
    svc = by_kind(docs, "Service")["gateway"]
    by_name = {p["name"]: p for p in svc["spec"]["ports"]}
    assert set(by_name) == {"grpc", "http"}
    assert (by_name["grpc"]["port"], by_name["grpc"]["appProtocol"]) == (grpc_port, "grpc")
    # with --tls-cert the HTTP API is HTTPS with the gRPC port's certificate
    assert (by_name["http"]["port"], by_name["http"]["targetPort"]) == (http_port, "http")
    assert by_name["http"]["appProtocol"] == ("https" if ns.tls_cert else "http")
    policy = by_kind(docs, "NetworkPolicy")["dflash-gateway"]
    open_ports = {p["port"] for rule in policy["spec"]["ingress"] if "from" not in rule
                  for p in rule["ports"]}
    assert open_ports == {grpc_port, http_port, host_port(env_of(gw)["DFLASH_HEALTH_BIND"])[1]}


@pytest.mark.parametrize("overlay", ALL_OVERLAYS)
def test_secrets_are_mounted_files_and_admin_stays_off_the_network(overlay, monkeypatch):
    docs = rendered(overlay)
    for w in workloads(docs).values():
        spec = pod_spec(w)
        name = w["metadata"]["name"]
        assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["runAsUser"] == 10001
        assert spec.get("automountServiceAccountToken") is False and not spec.get("hostNetwork")
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
            mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
            for var, value in env_of(c).items():
                if not (var.endswith(("_FILE", "_CERT", "_KEY", "_CA"))):
                    continue
                path = Path(value)
                mount = mounts.get(str(path.parent))
                assert mount and mount.get("readOnly"), f"{name}: {var}={value} is not on a read-only mount"
                secret = volumes[mount["name"]].get("secret")
                assert secret, f"{name}: {var} comes from a Secret"
                items = secret.get("items")
                assert items is None or path.name in {i["path"] for i in items}, f"{name}: {var}"
                assert (secret["defaultMode"] & 0o007) == 0, f"{name}: {var} readable by others"
    for _, c, module, argv in service_containers(docs):
        if module == "gateway":
            ns, _ = parse(monkeypatch, module, argv, env_of(c))
            admin_host, admin_port = host_port(ns.admin_bind)
            assert admin_host == "127.0.0.1", "GatewayAdmin must stay on the pod's loopback"
            assert ns.api_keys_file and ns.admin_token_file and ns.tls_cert and ns.tls_key
            exposed = {p["port"] for s in by_kind(docs, "Service").values() for p in s["spec"]["ports"]}
            assert admin_port not in exposed and ns.metrics_port not in exposed


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gpu_requests_and_disruption_budget(overlay):
    docs = rendered(overlay)
    for w in workloads(docs).values():
        for c in pod_spec(w)["containers"]:
            res = c["resources"]
            gpus = res.get("limits", {}).get("nvidia.com/gpu")
            model_pod = "drafter" in w["metadata"]["name"] or "verifier" in w["metadata"]["name"]
            if overlay.startswith("gpu") and model_pod:
                assert gpus == 1 == res["requests"]["nvidia.com/gpu"], w["metadata"]["name"]
                assert c["image"].endswith(":cuda")
                assert any(t["key"] == "nvidia.com/gpu" for t in pod_spec(w)["tolerations"])
            else:
                assert gpus is None, w["metadata"]["name"]
            assert res["requests"]["memory"] and res["limits"]["memory"]
    (pdb,) = by_kind(docs, "PodDisruptionBudget").values()
    selected = [w for w in workloads(docs).values()
                if pdb["spec"]["selector"]["matchLabels"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
    assert [w["metadata"]["name"] for w in selected] == ["gateway"]
    assert pdb["spec"]["minAvailable"] < selected[0]["spec"]["replicas"], "the budget would block every drain"


@pytest.mark.parametrize("overlay", ALL_OVERLAYS)
def test_gpu_overlays_run_the_models_on_the_pods_gpu_in_bf16(overlay, monkeypatch):
    """Every model container of a GPU overlay parses to ``--device cuda`` (the pod's one GPU)
    and bfloat16, an expert-parallel worker rank included; the CPU overlay's stay on the CPU
    (auto: the CPU image has no GPU) in float32."""
    seen = 0
    for w, c, module, argv in service_containers(rendered(overlay)):
        if module == "gateway":
            continue
        ns, read = parse(monkeypatch, module, argv, env_of(c))
        seen += 1
        if overlay.startswith("gpu"):
            assert (ns.device, ns.dtype) == ("cuda", "bfloat16"), w["metadata"]["name"]
        else:
            assert ns.device in ("auto", "cpu") and ns.dtype == "float32", w["metadata"]["name"]
    assert seen >= 2      # a verifier and a drafter at least


def test_expert_parallel_ranks_agree(monkeypatch):
    docs = rendered("gpu-ep")
    ws = workloads(docs)
    leader, worker = ws["verifier-ep-leader"], ws["verifier-ep-worker"]
    (lc,), (wc,) = pod_spec(leader)["containers"], pod_spec(worker)["containers"]
    le, we = env_of(lc), env_of(wc)
    ns, _ = parse(monkeypatch, *invocation(lc), le)
    wns, _ = parse(monkeypatch, *invocation(wc), we)
    world = leader["spec"]["replicas"] + worker["spec"]["replicas"]
    assert leader["spec"]["replicas"] == 1
    assert ns.ep_size == world == int(le["WORLD_SIZE"]) == int(we["WORLD_SIZE"]) == wns.world_size
    assert le["MASTER_ADDR"] == we["MASTER_ADDR"] == f"{leader['metadata']['name']}-0.{leader['spec']['serviceName']}"
    assert le["MASTER_PORT"] == we["MASTER_PORT"] == str(wns.master_port)
    assert wns.target == ns.target == le["DFLASH_TARGET"] and wns.dtype == ns.dtype
    assert wns.device == ns.device == "cuda"    # each rank on its own pod's GPU
    headless = by_kind(docs, "Service")[leader["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"]
    assert worker["spec"]["serviceName"] == leader["spec"]["serviceName"]
    for sts in (leader, worker):
        labels = sts["spec"]["template"]["metadata"]["labels"]
        assert headless["spec"]["selector"].items() <= labels.items()
        env = {e["name"]: e for e in pod_spec(sts)["containers"][0]["env"]}
        assert env["POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == \
            "metadata.labels['apps.kubernetes.io/pod-index']"
    # ranks: leader pod 0 -> RANK 0, worker pod i -> RANK i + 1
    assert 'export RANK="$POD_INDEX"' in lc["command"][2]
    assert "export RANK=$((POD_INDEX + 1))" in wc["command"][2]
    # the verifier Service reaches rank 0 only (the workers serve no gRPC)
    sel = by_kind(docs, "Service")["verifier"]["spec"]["selector"]
    assert [w["metadata"]["name"] for w, _ in _pods_selected(docs, sel)] == ["verifier-ep-leader"]


# --- 4. the pool ------------------------------------------------------------------------------

GIE = ROOT / "tests" / "fixtures" / "gie"


def gie_validator(kind: str):
    import jsonschema

    schema = yaml.safe_load((GIE / GIE_SCHEMAS[kind]).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def pool_parts(monkeypatch):
    """(docs, the pool Deployment, {container name: (container, parsed namespace)})."""
    docs = rendered("pool")
    (dep,) = [w for w in workloads(docs).values() if w["kind"] == "Deployment"]
    parsed = {c["name"]: (c, parse(monkeypatch, m, argv, env_of(c))[0])
              for w, c, m, argv in service_containers(docs) if w is dep}
    return docs, dep, parsed


def http_bind_of(ns) -> str:
    from gateway.server import http_bind

    return http_bind(ns)


def test_pool_objects_validate_against_the_gie_schemas():
    docs = rendered("pool")
    kinds = [d["kind"] for d in docs if d["kind"] in GIE_SCHEMAS]
    assert sorted(set(kinds)) == sorted(GIE_SCHEMAS) and "InferencePool" not in rendered("cpu")
    for doc in docs:
        if doc["kind"] in GIE_SCHEMAS:
            gie_validator(doc["kind"]).validate(doc)


def test_gie_schemas_refuse_a_broken_pool():
    pool = by_kind(rendered("pool"), "InferencePool")["dflash-pool"]
    v = gie_validator("InferencePool")

    def broken(change) -> list[str]:
        doc = copy.deepcopy(pool)
        change(doc["spec"])
        return [e.message for e in v.iter_errors(doc)]

    assert broken(lambda s: s["targetPorts"].append(dict(s["targetPorts"][0])))  # CEL: unique ports
    assert broken(lambda s: s["endpointPickerRef"].pop("port"))              # CEL: a Service needs one
    assert not broken(lambda s: (s["endpointPickerRef"].pop("port"),
                                 s["endpointPickerRef"].update(kind="Other")))
    assert broken(lambda s: s.update(targetPort=8000))                       # unknown field
    assert broken(lambda s: s.pop("endpointPickerRef"))                      # required in v1.5.0
    assert broken(lambda s: s["endpointPickerRef"].update(failureMode="Open"))
    assert broken(lambda s: s.update(appProtocol="https"))                   # http or h2c only
    assert broken(lambda s: s["selector"].update(matchLabels={}))
    objective = by_kind(rendered("pool"), "InferenceObjective")["dflash-interactive"]
    doc = copy.deepcopy(objective)
    doc["spec"]["priority"] = "high"
    assert list(gie_validator("InferenceObjective").iter_errors(doc))


def test_the_pool_selects_its_pods_on_the_gateways_http_port(monkeypatch):
    docs, dep, parsed = pool_parts(monkeypatch)
    pool = by_kind(docs, "InferencePool")["dflash-pool"]
    selector = pool["spec"]["selector"]["matchLabels"]
    # the pool's pods and no other workload's
    assert {w["metadata"]["name"] for w, _ in _pods_selected(docs, selector)} == {dep["metadata"]["name"]}
    gw, ns = parsed["gateway"]
    http_host, http_port = host_port(http_bind_of(ns))
    assert http_host == "0.0.0.0"
    assert pool["spec"]["targetPorts"] == [{"number": http_port}]
    assert {p["name"]: p["containerPort"] for p in gw["ports"]}["http"] == http_port
    # the picker's Service as the GIE chart names it for a release called like the pool
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["name"] == f"{pool['metadata']['name']}-epp" and ref["port"] == {"number": 9002}
    for o in by_kind(docs, "InferenceObjective").values():
        assert o["spec"]["poolRef"] == {"group": "inference.networking.k8s.io",
                                        "kind": "InferencePool", "name": pool["metadata"]["name"]}


def test_a_pool_pod_wires_verifier_drafter_and_gateway_on_its_loopback(monkeypatch):
    docs, dep, parsed = pool_parts(monkeypatch)
    assert set(parsed) == {"gateway", "verifier", "drafter"}
    (_, gw), (_, ver), (_, dft) = parsed["gateway"], parsed["verifier"], parsed["drafter"]
    assert gw.verifier == [ver.bind] and host_port(ver.bind)[0] == "127.0.0.1"
    assert gw.drafter == [dft.bind] and host_port(dft.bind)[0] == "127.0.0.1"
    assert gw.drafter_allow.allows(dft.bind) and not gw.drafter_allow.allows("10.0.0.1:50061")
    assert host_port(gw.bind)[0] == "0.0.0.0"          # only the gateway serves the pod IP
    # one network namespace: every listener of the pod on a port of its own
    listeners = []
    for c, ns in parsed.values():
        env = env_of(c)
        listeners += [host_port(ns.bind)[1], host_port(env["DFLASH_HEALTH_BIND"])[1], ns.metrics_port]
    listeners += [host_port(gw.admin_bind)[1], host_port(http_bind_of(gw))[1]]
    assert len(listeners) == len(set(listeners)), sorted(listeners)
    names = [p["name"] for c, _ in parsed.values() for p in c.get("ports", [])]
    assert len(names) == len(set(names)) and all(len(n) <= 15 for n in names)  # IANA_SVC_NAME
    for name, (c, ns) in parsed.items():
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        health = host_port(env_of(c)["DFLASH_HEALTH_BIND"])
        assert health[0] == "0.0.0.0" and health[1] in ports.values(), name    # the kubelet's
        assert ns.metrics_port in ports.values() and env_of(c)["DFLASH_METRICS_HOST"] == "0.0.0.0"
        assert host_port(ns.bind)[1] in ports.values() or name != "gateway"
        service = importlib.import_module(MODULES[invocation(c)[0]]).SERVICE
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe not in c:    # a drafter down turns speculation off: the pod stays in routing
                assert (name, probe) == ("drafter", "readinessProbe")
            elif "grpc" in c[probe]:
                assert c[probe]["grpc"] == {"port": health[1], "service": service}, (name, probe)
            else:
                assert (name, probe) == ("gateway", "livenessProbe")
    # the verifier's /metrics is the pod's scrape target: the Model Server Protocol gauges
    ann = dep["spec"]["template"]["metadata"]["annotations"]
    assert int(ann["prometheus.io/port"]) == ver.metrics_port
    assert ver.threads == 2 and dft.threads == 1       # the cores each container requests


def test_the_hpa_scales_the_pool_on_the_waiting_requests_gauge(monkeypatch):
    from dflash.serving.metrics import MODEL_SERVER_GAUGES

    docs, dep, _ = pool_parts(monkeypatch)
    (hpa,) = by_kind(docs, "HorizontalPodAutoscaler").values()
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": dep["apiVersion"], "kind": dep["kind"],
                                             "name": dep["metadata"]["name"]}
    assert "replicas" not in dep["spec"], "the HPA owns the count: an apply would reset it"
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
    # the adapter rule renames the verifier's gauge to the HPA's metric name
    values = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    (rule,) = values["rules"]["custom"]
    series = re.match(r"'?([a-z_:]+)\{", rule["seriesQuery"]).group(1)
    assert series == "vllm:num_requests_waiting" and series in MODEL_SERVER_GAUGES
    renamed = re.sub(rule["name"]["matches"], re.sub(r"\$\{(\d+)\}", r"\\\1", rule["name"]["as"]), series)
    assert renamed == metric["pods"]["metric"]["name"]
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
    # drains take one pod at a time, never every one
    (pdb,) = by_kind(docs, "PodDisruptionBudget").values()
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    assert pdb["spec"]["maxUnavailable"] == 1 < hpa["spec"]["minReplicas"]


def test_the_pool_network_policy_opens_the_gateway_and_the_gauges_only(monkeypatch):
    docs, dep, parsed = pool_parts(monkeypatch)
    (policy,) = by_kind(docs, "NetworkPolicy").values()
    assert policy["spec"]["podSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    rules = policy["spec"]["ingress"]
    open_ports = {p["port"] for r in rules if "from" not in r for p in r["ports"]}
    (_, gw), (_, ver), (_, dft) = parsed["gateway"], parsed["verifier"], parsed["drafter"]
    health = {host_port(env_of(c)["DFLASH_HEALTH_BIND"])[1] for c, _ in parsed.values()}
    assert open_ports == {host_port(gw.bind)[1], host_port(http_bind_of(gw))[1]} | health
    readers: dict[int, list[dict]] = {}
    for r in rules:
        for p in r["ports"]:
            readers.setdefault(p["port"], []).extend(r.get("from", []))
    epp = by_kind(docs, "InferencePool")["dflash-pool"]["spec"]["endpointPickerRef"]["name"]
    picker = {"podSelector": {"matchLabels": {"inferencepool": epp}}}
    assert picker in readers[ver.metrics_port]          # the endpoint picker scrapes the gauges
    assert picker not in readers[gw.metrics_port] + readers[dft.metrics_port]
    # the verifier and the drafter serve loopback only: no rule names their gRPC ports
    assert not {host_port(ver.bind)[1], host_port(dft.bind)[1]} & set(readers)
