"""Packaging: the library metadata (pyproject.toml: ranges), the lock (constraints.txt: exact
pins) and the generated stubs agree, and every third-party import of the code is declared.

1. the grpcio / protobuf floors are the versions the generated stubs check at import
   (GRPC_GENERATED_VERSION in dflash/v1/*_pb2_grpc.py; the gencode version in *_pb2.py, whose
   runtime must have the same major), so an older grpcio cannot pass the install and fail at import;
2. every pin in constraints.txt satisfies pyproject's ranges, and every declared dependency that
   applies here is pinned (what CI and the images run is reproducible);
3. every third-party module the code imports belongs to a declared distribution, and a module
   imports at module level only what the core and the extras that provide it declare
   (MODULE_EXTRAS: dflash.client and the stubs the core alone, the services [serve]);
4. scripts/setup.sh and the Dockerfile install with the constraints and the extras the services
   and the tests use;
5. the core is exactly the client's grpcio and protobuf, ``[client]`` names the same, and it is
   enough for dflash.client (a subprocess in which every other declared distribution is absent;
   tests/test_client_lib.py installs the built wheel into a fresh venv);
6. (slow, opt-in: DFLASH_TEST_FLOORS=1) a fresh venv with the core's floors imports dflash.client,
   and with every floor every module.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
PACKAGES = ("dflash", "dflash_app", "drafter_svc", "verifier_svc", "gateway", "kernels")
SELF = canonicalize_name(PROJECT["name"])
# The extras a module needs beside the core (first matching pattern): what it may import at
# module level. A function-level import may use any declared distribution (bench, train, setup).
MODULE_EXTRAS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("dflash/__init__.py", ()),               # the client's parents and the stubs: the core alone
    ("dflash/client/*.py", ()),
    ("dflash/v1/*.py", ()),
    ("kernels/triton_*.py", ("serve", "kernels")),
    ("*.py", ("serve",)),                     # the services, the launcher, the `dflash` command
)
FLOOR_EXTRAS = ("client", "serve", "bench", "train", "setup")  # the floors venv: all but kernels, dev


def extras_of(rel: str) -> tuple[str, ...]:
    """The extras that provide the module at ``rel`` (a path relative to the repository)."""
    return next(extras for pattern, extras in MODULE_EXTRAS if Path(rel).match(pattern))


def _raw(group: str | None) -> list[Requirement]:
    raw = PROJECT["dependencies"] if group is None else PROJECT["optional-dependencies"][group]
    return [Requirement(r) for r in raw]


def requirements(group: str | None = None) -> list[Requirement]:
    """The core requirements (group None) or one extra's own third-party ones (an extra's
    ``dflash-serve[...]`` entries are in :func:`included`)."""
    return [r for r in _raw(group) if canonicalize_name(r.name) != SELF]


def included(group: str) -> set[str]:
    """The extras ``group`` pulls in by naming this distribution (``all``)."""
    return {e for r in _raw(group) if canonicalize_name(r.name) == SELF for e in r.extras}


def all_groups() -> dict[str | None, list[Requirement]]:
    return {None: requirements(), **{g: requirements(g) for g in PROJECT["optional-dependencies"]}}


def applies(req: Requirement, extra: str | None) -> bool:
    """Whether ``req``'s environment marker holds on this machine (for its extra)."""
    return req.marker is None or req.marker.evaluate({**default_environment(), "extra": extra or ""})


def constraints() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
        assert m, f"constraints.txt: {line!r} is not an exact pin name==version"
        name = canonicalize_name(m.group(1))
        assert name not in pins, f"constraints.txt: {name} pinned twice"
        pins[name] = Version(m.group(2))
    return pins


def floor(req: Requirement) -> Version:
    """The lowest version ``req`` admits: the bound of its >= (or ==) clause."""
    bounds = [Version(s.version) for s in req.specifier if s.operator in (">=", "==")]
    assert bounds, f"{req} has no floor"
    return max(bounds)


# --- 1. floors against the generated stubs ------------------------------------------------------

def stub_versions() -> tuple[set[Version], set[Version]]:
    """(grpc versions the *_pb2_grpc.py stubs require, protobuf gencode versions of *_pb2.py)."""
    grpc_v, proto_v = set(), set()
    for f in sorted((ROOT / "dflash" / "v1").glob("*_pb2_grpc.py")):
        m = re.search(r"^GRPC_GENERATED_VERSION = '([^']+)'", f.read_text(), re.M)
        assert m, f"{f.name}: no GRPC_GENERATED_VERSION"
        grpc_v.add(Version(m.group(1)))
    for f in sorted((ROOT / "dflash" / "v1").glob("*_pb2.py")):
        m = re.search(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*"
                      r"(\d+),\s*(\d+),\s*(\d+),", f.read_text())
        assert m, f"{f.name}: no ValidateProtobufRuntimeVersion"
        proto_v.add(Version(".".join(m.groups())))
    assert grpc_v and proto_v
    return grpc_v, proto_v


def test_floors_are_the_versions_the_generated_stubs_need():
    grpc_v, proto_v = stub_versions()
    core = {canonicalize_name(r.name): r for r in requirements()}
    serve = {canonicalize_name(r.name): r for r in requirements("serve")}
    need = max(grpc_v)
    for dist, req in (("grpcio", core["grpcio"]), ("grpcio-health-checking", serve["grpcio-health-checking"]),
                      ("grpcio-reflection", serve["grpcio-reflection"])):
        assert floor(req) == need, f"{dist}: floor {floor(req)}, the stubs need {need}"
    (tools,) = [r for r in requirements("dev") if r.name == "grpcio-tools"]
    assert floor(tools) == need, "grpcio-tools older than the stubs would regenerate them differently"
    gencode = max(proto_v)
    spec = core["protobuf"].specifier
    assert floor(core["protobuf"]) == gencode, f"protobuf floor {floor(core['protobuf'])} != gencode {gencode}"
    # protobuf's runtime check: same major as the gencode, not older than it
    assert gencode in spec and Version(f"{gencode.major}.999") in spec
    assert Version(f"{gencode.major + 1}.0.0") not in spec, "the next protobuf major refuses these stubs"


def test_installed_grpc_and_protobuf_satisfy_the_floors():
    # what the stubs would raise at import with an older runtime (the failure the floors prevent)
    for req in requirements():
        if req.name in ("grpcio", "protobuf"):
            assert Version(importlib.metadata.version(req.name)) in req.specifier, req


# --- 2. the constraints against the ranges ---------------------------------------------------------

def test_every_pin_satisfies_pyproject_and_every_requirement_is_pinned():
    pins = constraints()
    for group, reqs in all_groups().items():
        for req in reqs:
            name = canonicalize_name(req.name)
            if not applies(req, group):
                continue
            assert name in pins, f"{req} ([{group or 'core'}]) has no pin in constraints.txt"
            assert req.specifier.contains(pins[name], prereleases=True), \
                f"constraints.txt pins {name}=={pins[name]}, outside [{group or 'core'}] {req}"


def test_library_metadata_has_no_exact_pins():
    for group, reqs in all_groups().items():
        for req in reqs:
            assert not any(s.operator in ("==", "===") for s in req.specifier), \
                f"[{group or 'core'}] {req}: exact pins belong in constraints.txt"


def test_torch_pin_is_the_one_the_images_and_setup_install():
    pins = constraints()
    dockerfile = (ROOT / "Dockerfile").read_text()
    m = re.search(r"^ARG TORCH_VERSION=(\S+)", dockerfile, re.M)
    assert m and Version(m.group(1)) == pins["torch"]
    assert pins["torch"] == Version("2.13.0"), "the CPU build on this machine kind's disk (README)"


# --- 3. imports against the declared distributions -------------------------------------------------

def _imports(path: Path):
    """(top-level module name, at module level?) of every absolute import in ``path``."""
    tree = ast.parse(path.read_text())
    top = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            top.add(id(node))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name.split(".")[0], id(node) in top
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module.split(".")[0], id(node) in top


def test_every_third_party_import_is_declared_by_the_extras_of_its_module():
    dists_of = importlib.metadata.packages_distributions()
    declared = {g: {canonicalize_name(r.name) for r in reqs} for g, reqs in all_groups().items()}
    everything = set().union(*declared.values())
    local = set(PACKAGES)
    problems = []
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            rel = f.relative_to(ROOT).as_posix()
            extras = extras_of(rel)
            provided = declared[None].union(*(declared[e] for e in extras))
            for name, module_level in _imports(f):
                if name in sys.stdlib_module_names or name in local or name == "__future__":
                    continue
                dists = {canonicalize_name(d) for d in dists_of.get(name, ())}
                if not dists & everything:
                    problems.append(f"{rel}: imports {name} ({sorted(dists) or 'not installed'}), declared nowhere")
                elif module_level and not dists & provided:
                    where = sorted(g or "core" for g, d in declared.items() if dists & d)
                    problems.append(f"{rel}: imports {name} at module level, which is in {where}, "
                                    f"not in the core or its extras {list(extras)}")
    assert not problems, "\n".join(problems)


def test_module_extras_name_declared_extras_and_the_client_is_core_only():
    groups = set(PROJECT["optional-dependencies"])
    assert all(set(extras) <= groups for _, extras in MODULE_EXTRAS)
    for rel in ("dflash/__init__.py", "dflash/client/_sync.py", "dflash/v1/gateway_pb2.py"):
        assert extras_of(rel) == (), rel
    for rel in ("dflash_app/cli.py", "gateway/server.py", "verifier_svc/engine.py", "dflash_app/launcher.py"):
        assert extras_of(rel) == ("serve",), rel
    assert extras_of("kernels/triton_greedy.py") == ("serve", "kernels")


# --- 4. setup.sh and the Dockerfile -------------------------------------------------------------------

def test_setup_and_dockerfile_install_with_the_constraints():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    installs = [line.strip() for line in setup.splitlines() if line.strip().startswith("pip_install ")]
    assert installs and all("-c constraints.txt" in line or "--upgrade pip" in line for line in installs)
    (editable,) = [line for line in installs if " -e " in line]
    extras = set(re.search(r'"\.\[([^\]]+)\]"', editable).group(1).split(","))
    # the services serve; the tests dev; demo/bench (run.sh) bench; the e2e target setup-target's
    # setup; the kernel tests kernels
    assert {"dev", "serve", "bench", "train", "setup", "kernels"} <= extras, extras
    assert extras <= set(PROJECT["optional-dependencies"])
    dockerfile = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    # the runtime image installs the core and [serve] (the core alone has no torch)
    (runtime,) = [line for line in dockerfile.splitlines() if "> /tmp/requirements.txt" in line
                  and "['dependencies']" in line]
    assert "['optional-dependencies']['serve']" in runtime, runtime
    pip_lines = [line for line in dockerfile.splitlines() if "pip install" in line]
    for line in pip_lines:
        for cmd in re.findall(r"pip install[^;&|]*", line):
            assert "-c constraints.txt" in cmd or "--no-deps" in cmd, cmd
    assert re.search(r"^COPY pyproject\.toml constraints\.txt ", dockerfile, re.M)


# --- 5. the core is the client ----------------------------------------------------------------------

def test_the_core_is_grpcio_and_protobuf_and_client_names_it():
    core = {canonicalize_name(r.name): r.specifier for r in requirements()}
    assert set(core) == {"grpcio", "protobuf"}, "pip adds the core to every extra: [client] would pull it"
    assert {canonicalize_name(r.name): r.specifier for r in requirements("client")} == core
    assert not any(r.marker for r in requirements())


def test_all_is_every_extra_but_kernels_and_dev():
    groups = set(PROJECT["optional-dependencies"])
    assert included("all") == groups - {"all", "client", "kernels", "dev"}
    assert requirements("all") == []        # only names extras: their lists stay the one source
    assert all(not included(g) for g in groups - {"all"})

CLIENT_PROBE = """
import importlib.abc, sys
BLOCKED = set(sys.argv[1].split(","))
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not in the client extra")
sys.meta_path.insert(0, Block())
import dflash.client
print("ok")
"""


def test_the_core_is_enough_for_dflash_client():
    dists_of = importlib.metadata.packages_distributions()
    core = {canonicalize_name(r.name) for r in requirements()}
    extras = {canonicalize_name(r.name) for g, reqs in all_groups().items() if g for r in reqs} - core
    blocked = sorted(mod for mod, dists in dists_of.items()
                     if {canonicalize_name(d) for d in dists} & extras
                     and not {canonicalize_name(d) for d in dists} & core)
    assert {"torch", "transformers", "grpc_health", "fastapi", "numpy"} <= set(blocked)
    r = subprocess.run([sys.executable, "-c", CLIENT_PROBE, ",".join(blocked)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


# --- 6. a fresh venv with the floors (slow, opt-in) ----------------------------------------------------

def module_files() -> list[tuple[str, str]]:
    """(dotted module name, path relative to the repository) of every module of the packages."""
    mods = []
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = f.relative_to(ROOT).with_suffix("").parts
            mods.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts),
                         f.relative_to(ROOT).as_posix()))
    return mods


def floors_of(groups) -> list[str]:
    """``name==floor`` of every requirement of ``groups`` (None: the core) that applies here."""
    return sorted({f"{r.name}=={floor(r)}" for g in groups for r in requirements(g) if applies(r, g)})


def import_all(py: Path, modules: list[str]) -> subprocess.CompletedProcess:
    """Import each of ``modules`` with the interpreter ``py`` (the repository on its path)."""
    probe = ("import importlib, sys\nbad = []\nfor m in sys.argv[1:]:\n    try:\n"
             "        importlib.import_module(m)\n    except Exception as e:\n"
             "        bad.append(f'{m}: {e!r}')\nprint('\\n'.join(bad)); sys.exit(1 if bad else 0)\n")
    return subprocess.run([str(py), "-c", probe, *modules], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=900)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("DFLASH_TEST_FLOORS") != "1",
                    reason="set DFLASH_TEST_FLOORS=1: installs every floor into a fresh venv, which "
                           "needs PyPI (the floors are not in this machine's local wheel index) and "
                           "several minutes")
def test_fresh_venv_with_the_floors_imports_every_module(tmp_path):
    venv = tmp_path / "floors"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"

    def install(reqs: list[str]) -> None:
        r = subprocess.run([str(py), "-m", "pip", "install", "-q", *reqs],
                           capture_output=True, text=True, timeout=1800)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    # the core's floors alone: every module of the core-only patterns (the client) imports
    install(floors_of([None]))
    core_only = [m for m, rel in module_files() if extras_of(rel) == ()]
    assert "dflash.client" in core_only and "dflash.v1.gateway_pb2_grpc" in core_only
    r = import_all(py, core_only)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    # then every floor but [kernels] (torch's is the CPU build on this machine: an unpinned or
    # CUDA torch is never pulled); a __main__ module runs its service when imported
    install(floors_of([None, *FLOOR_EXTRAS]))
    skip = {m for m, rel in module_files() if "kernels" in extras_of(rel) or m.endswith("__main__")}
    r = import_all(py, [m for m, _ in module_files() if m not in skip])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
