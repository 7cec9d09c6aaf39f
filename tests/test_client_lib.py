"""The Python client (``dflash.client``): blocking and asyncio, without torch.

A subprocess in which torch, transformers and numpy cannot be imported generates through the
real in-process stack and reports what it imported; the asyncio client answers as the blocking
one; errors are GenerateError (a grpc.RpcError) naming the field; the wheel carries the .proto
sources beside the generated stubs, requires only grpcio and protobuf outside its extras, and
``pip install <wheel>[client]`` into a fresh venv brings nothing else and generates.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import grpc
import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
CLIENT_DISTS = {"grpcio", "protobuf"}

PROBE = """
import importlib.abc, json, sys
BLOCKED = {"torch", "transformers", "numpy", "tokenizers", "safetensors", "cryptography"}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked")
sys.meta_path.insert(0, Block())
from dflash.client import GatewayClient, build_request
with GatewayClient(sys.argv[1]) as c:
    c.wait_ready(30)
    done = c.complete(build_request("Hello", max_tokens=12), timeout=60)
    drafters = [d.name for d in c.list_drafters()]
import dflash.client
print(json.dumps({"text": done.text, "ids": done.token_ids, "finish": done.finish_reason,
                  "tau": done.acceptance.mean_acceptance_length, "drafters": drafters,
                  "heavy": sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED),
                  "file": dflash.client.__file__}))
"""


@pytest.fixture
def served(stack, make_drafter, tiny_target):
    from drafter_svc.engine import DrafterEngine

    stack.add_drafter(DrafterEngine.from_pretrained(make_drafter(block_size=4), tiny_target),
                      default=True)
    return stack


def test_a_process_without_torch_generates_through_the_client(served):
    from dflash.v1 import gateway_pb2

    want = list(served.gateway_stub().Generate(gateway_pb2.GenerateRequest(prompt="Hello",
                                                                           max_tokens=12)))
    r = subprocess.run([sys.executable, "-c", PROBE, served.gateway_addr], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    assert got["heavy"] == []
    assert got["text"] == "".join(m.text for m in want)
    assert got["ids"] == [t for m in want for t in m.token_ids]
    assert got["finish"] == "length" and got["drafters"] == ["tiny-drafter"]
    assert got["tau"] == pytest.approx(want[-1].acceptance.mean_acceptance_length)


def test_asyncio_client_equals_the_blocking_one(served):
    from dflash.client import AsyncGatewayClient, GatewayClient, build_request

    req = build_request(messages=[{"role": "user", "content": "Hi"}], max_tokens=10)
    with GatewayClient(served.gateway_addr) as c:
        sync = c.complete(req, timeout=60)
        many = c.complete_all(build_request("Hi", max_tokens=6, temperature=1.0, seed=3, n=2),
                              timeout=60)

    async def run():
        async with AsyncGatewayClient(served.gateway_addr) as c:
            await c.wait_ready(30)
            one = await c.complete(req, timeout=60)
            deltas = [r async for r in c.stream(req, timeout=60)]
            return one, deltas, await c.list_drafters()

    one, deltas, drafters = asyncio.run(run())
    assert (one.text, one.token_ids, one.finish_reason) == (sync.text, sync.token_ids,
                                                            sync.finish_reason)
    assert "".join(r.text for r in deltas) == sync.text
    assert [d.name for d in drafters] == ["tiny-drafter"]
    assert [m.index for m in many] == [0, 1]
    assert all(m.usage.completion_tokens == 6 for m in many)


def test_errors_are_rpc_errors_that_name_the_field(served):
    from dflash.client import AsyncGatewayClient, GatewayClient, GenerateError, build_request

    bad = build_request("Hi", max_tokens=0)
    with GatewayClient(served.gateway_addr) as c:
        with pytest.raises(GenerateError) as e:
            c.complete(bad, timeout=30)
        with pytest.raises(ValueError, match="n"):
            c.complete(build_request("Hi", n=2))
    assert isinstance(e.value, grpc.RpcError)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("max_tokens")

    async def run():
        async with AsyncGatewayClient(served.gateway_addr) as c:
            await c.complete(bad, timeout=30)

    with pytest.raises(GenerateError) as e:
        asyncio.run(run())
    assert e.value.details().startswith("max_tokens")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The project's wheel, built from a copy of the tracked sources (the working tree stays
    clean)."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    src = tmp_path / "src"
    for f in files:
        if f.split("/")[0] in ("dflash", "dflash_app", "drafter_svc", "verifier_svc", "gateway", "kernels",
                               "proto") or f in ("pyproject.toml", "README.md"):
            dst = src / f
            dst.parent.mkdir(parents=True, exist_ok=True)
            p = ROOT / f
            if p.is_symlink():
                dst.symlink_to(p.readlink())
            elif p.is_file():
                dst.write_bytes(p.read_bytes())
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "-q", str(src), "-w", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (built,) = (tmp_path / "out").glob("*.whl")
    return built


def test_the_wheel_carries_the_proto_files_and_stubs(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for proto in sorted((ROOT / "proto" / "dflash" / "v1").glob("*.proto")):
        inside = f"dflash/v1/{proto.name}"
        assert inside in names
        assert zipfile.ZipFile(wheel).read(inside) == proto.read_bytes()
        assert f"dflash/v1/{proto.stem}_pb2.py" in names
    assert {"dflash/client/__init__.py", "dflash/client/_aio.py", "dflash/client/_sync.py"} <= names


def _metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        return Parser().parsestr(z.read(name).decode())


def _requires(meta, extra: str) -> set[str]:
    """The distributions the wheel requires with ``extra`` requested ("" = none), here."""
    env = {**default_environment(), "extra": extra}
    return {canonicalize_name(r.name) for r in map(Requirement, meta.get_all("Requires-Dist") or ())
            if r.marker is None or r.marker.evaluate(env)}


def test_the_wheels_core_and_client_extra_require_only_grpcio_and_protobuf(wheel):
    meta = _metadata(wheel)
    reqs = [Requirement(r) for r in meta.get_all("Requires-Dist")]
    unmarked = {canonicalize_name(r.name) for r in reqs if r.marker is None}
    assert unmarked == CLIENT_DISTS
    assert _requires(meta, "") == _requires(meta, "client") == CLIENT_DISTS
    assert {"client", "serve", "all"} <= set(meta.get_all("Provides-Extra"))
    # the services' stack sits behind [serve], and [all] reaches it through that extra
    assert {"torch", "transformers", "fastapi", "grpcio-health-checking"} <= _requires(meta, "serve")
    (self_ref,) = [r for r in reqs if canonicalize_name(r.name) == "dflash-serve"]
    assert "serve" in self_ref.extras and self_ref.marker.evaluate({**default_environment(), "extra": "all"})


INSTALLED = """
import importlib.metadata as md, json
print(json.dumps({d.metadata["Name"]: [str(r) for r in (d.requires or [])] for d in md.distributions()}))
"""


def test_pip_install_the_wheel_with_client_into_a_fresh_venv_generates(wheel, served, tmp_path):
    """What a user runs: ``pip install dflash-serve[client]`` (the built wheel, at the
    constraints' versions) into an empty venv brings dflash-serve, grpcio, protobuf and their
    own requirements, nothing of the server's stack, and that venv generates through the
    stack (the repository is not on its path)."""
    from dflash.v1 import gateway_pb2

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
                        "--no-compile", "-c", str(ROOT / "constraints.txt"), f"{wheel}[client]"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    r = subprocess.run([str(py), "-I", "-c", INSTALLED], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    installed = {canonicalize_name(n): [Requirement(x) for x in reqs]
                 for n, reqs in json.loads(r.stdout).items()}
    # grpcio's and protobuf's own requirements are theirs to choose; nothing else may come
    theirs = {canonicalize_name(x.name) for d in CLIENT_DISTS for x in installed[d]
              if x.marker is None or x.marker.evaluate({**default_environment(), "extra": ""})}
    assert set(installed) == {"dflash-serve"} | CLIENT_DISTS | theirs, sorted(installed)
    assert not {"torch", "numpy", "transformers", "fastapi"} & set(installed)
    r = subprocess.run([str(py), "-I", "-c", PROBE, served.gateway_addr], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    assert Path(got["file"]).is_relative_to(venv), got["file"]
    assert got["heavy"] == [] and got["finish"] == "length" and got["drafters"] == ["tiny-drafter"]
    want = served.gateway_stub().Generate(gateway_pb2.GenerateRequest(prompt="Hello", max_tokens=12))
    assert got["ids"] == [t for m in want for t in m.token_ids]


CLI_PROBE = """
import importlib.abc, sys
BLOCKED = {"torch", "transformers", "numpy", "tokenizers", "safetensors", "cryptography",
           "grpc_health", "grpc_reflection", "fastapi", "uvicorn", "opentelemetry",
           "prometheus_client"}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
from dflash_app.cli import main
rc = main(sys.argv[2:])
print("RC", rc, sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED))
"""


def test_the_cli_generates_with_the_client_alone_and_names_the_extra_otherwise(served):
    """``pip install dflash-serve[client]`` gives a working ``dflash generate``; a command that
    needs the server stack says which extra to install instead of a traceback."""
    r = subprocess.run([sys.executable, "-c", CLI_PROBE, "x", "generate", "--gateway",
                        served.gateway_addr, "--raw", "--max-tokens", "6", "Hello"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("RC 0 []")
    assert "tau" in r.stderr                       # the summary line
    r = subprocess.run([sys.executable, "-c", CLI_PROBE, "x", "up", "--tiny"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "RC 2" in r.stdout
    assert "dflash up: needs the server stack" in r.stderr and "dflash-serve[serve]" in r.stderr
    r = subprocess.run([sys.executable, "-c", CLI_PROBE, "x", "generate", "--gateway",
                        "127.0.0.1:1", "Hello"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "RC 1" in r.stdout and "dflash generate: UNAVAILABLE" in r.stderr
    assert "Traceback" not in r.stderr
