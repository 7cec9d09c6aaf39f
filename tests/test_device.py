"""``--device`` / ``--dtype`` (dflash/core/device.py) on every model process: spelling, resolution,
refusal at start naming the flag, expert-parallel ranks, and the env variables.

No GPU here: where a GPU must seem present, ``torch.cuda.is_available`` / ``device_count`` are
replaced; nothing then touches a real CUDA device.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from dflash.core import device as dev
from dflash.core.device import DeviceError


@pytest.fixture
def gpus(monkeypatch):
    """gpus(n): torch sees ``n`` CUDA devices (0 = none)."""
    def see(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return see


def test_auto_resolves_to_the_gpu_when_there_is_one_else_the_cpu(gpus):
    gpus(0)
    assert dev.resolve_device("auto") == torch.device("cpu")
    assert dev.resolve_device("cpu") == torch.device("cpu")
    gpus(2)
    assert dev.resolve_device("auto") == torch.device("cuda", 0)
    assert dev.resolve_device("cuda") == torch.device("cuda", 0)
    assert dev.resolve_device("cuda:1") == torch.device("cuda", 1)
    assert dev.resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("flag,seen,words", [
    ("cuda", 0, "no CUDA device"), ("cuda:0", 0, "no CUDA device"),
    ("cuda:2", 2, "only 2 CUDA device(s)"), ("gpu", 1, "use one of"), ("cuda:x", 1, "use one of"),
])
def test_a_device_that_is_not_there_is_refused_naming_the_flag(gpus, flag, seen, words):
    gpus(seen)
    with pytest.raises(DeviceError) as e:
        dev.resolve_device(flag)
    assert e.value.field == "--device" and str(e.value).startswith("--device: ")
    assert words in str(e.value)


def test_dtype_auto_is_the_checkpoints_on_a_gpu_and_float32_on_a_cpu(tmp_path):
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)   # devices are only compared
    assert dev.resolve_dtype("auto", "bfloat16", cpu) == torch.float32
    assert dev.resolve_dtype("auto", "bfloat16", gpu) == torch.bfloat16
    assert dev.resolve_dtype("auto", "float16", gpu) == torch.float16
    assert dev.resolve_dtype("auto", None, gpu) == torch.float32
    assert dev.resolve_dtype("bfloat16", "float32", cpu) == torch.bfloat16   # explicit wins
    assert dev.resolve_dtype("float32", "bfloat16", gpu) == torch.float32

    with pytest.raises(DeviceError) as e:
        dev.resolve_dtype("int8", None, cpu)
    assert e.value.field == "--dtype"
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text(json.dumps({"text_config": {"dtype": "float16"}}))
    assert dev.checkpoint_dtype(tmp_path / "a") == "bfloat16"
    assert dev.checkpoint_dtype(tmp_path / "b") == "float16"
    assert dev.checkpoint_dtype(tmp_path) is None


def test_expert_parallel_rank_r_runs_on_cuda_r(gpus):
    gpus(4)
    assert dev.rank_devices(torch.device("cuda", 0), 2) == [torch.device("cuda", 0),
                                                              torch.device("cuda", 1)]
    assert dev.rank_devices(torch.device("cuda", 2), 2)[1] == torch.device("cuda", 3)
    assert dev.rank_devices(torch.device("cpu"), 3) == [torch.device("cpu")] * 3
    with pytest.raises(DeviceError) as e:
        dev.rank_devices(torch.device("cuda", 1), 4)
    assert e.value.field == "--ep-size" and "cuda:1..cuda:4" in str(e.value)


# --- the services' flags ----------------------------------------------------------------------

def _parse(monkeypatch, module, argv, env=None):
    import importlib

    server = importlib.import_module(module)
    with monkeypatch.context() as m:
        for k in ("DFLASH_DEVICE", "DFLASH_DTYPE", "DFLASH_CUDA_GRAPHS"):
            m.delenv(k, raising=False)
        for k, v in (env or {}).items():
            m.setenv(k, v)
        return server.parse_args(argv)


SERVICES = [("verifier_svc.server", ["--target", "t"]),
            ("drafter_svc.server", ["--drafter", "d", "--target", "t"]),
            ("verifier_svc.ep_worker", ["--target", "t", "--rank", "1", "--world-size", "2",
                                        "--master-port", "1"])]


@pytest.mark.parametrize("module,argv", SERVICES)
def test_every_model_process_takes_device_and_dtype_flags_and_env(monkeypatch, module, argv):
    a = _parse(monkeypatch, module, argv)
    assert (a.device, a.dtype) == ("auto", "auto")
    a = _parse(monkeypatch, module, argv + ["--device", "cuda:1", "--dtype", "bfloat16"])
    assert (a.device, a.dtype) == ("cuda:1", "bfloat16")
    a = _parse(monkeypatch, module, argv, {"DFLASH_DEVICE": "cpu", "DFLASH_DTYPE": "float16"})
    assert (a.device, a.dtype) == ("cpu", "float16")


@pytest.mark.parametrize("module,argv", SERVICES)
@pytest.mark.parametrize("flag,value", [("--device", "tpu"), ("--dtype", "int8")])
def test_a_misspelt_device_or_dtype_is_a_usage_error_naming_the_flag(monkeypatch, capsys, module,
                                                                     argv, flag, value):
    with pytest.raises(SystemExit) as e:
        _parse(monkeypatch, module, argv + [flag, value])
    assert e.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


@pytest.mark.parametrize("main,argv", [
    ("verifier_svc.server", ["--target", "/nonexistent", "--bind", "127.0.0.1:0"]),
    ("drafter_svc.server", ["--drafter", "/nonexistent", "--target", "/nonexistent",
                            "--bind", "127.0.0.1:0"]),
    ("verifier_svc.ep_worker", ["--target", "/nonexistent", "--rank", "1", "--world-size", "2",
                                "--master-port", "1"]),
])
def test_a_gpu_that_is_not_there_stops_the_service_at_start_naming_the_flag(gpus, monkeypatch,
                                                                            main, argv):
    """Before a port is bound or a weight read (the paths do not exist: loading would fail
    with another error)."""
    import importlib

    gpus(0)
    mod = importlib.import_module(main)
    monkeypatch.delenv("DFLASH_DEVICE", raising=False)
    with pytest.raises(SystemExit) as e:
        mod.main(argv + ["--device", "cuda"])
    assert "--device: cuda: no CUDA device" in str(e.value.code)


def test_cuda_graphs_need_cuda_and_one_rank(gpus, monkeypatch):
    from verifier_svc import server

    gpus(0)
    a = _parse(monkeypatch, "verifier_svc.server", ["--target", "t", "--cuda-graphs"])
    assert a.cuda_graphs
    with pytest.raises(DeviceError) as e:
        server.rank_devices_of(a)
    assert e.value.field == "--cuda-graphs"
    a = _parse(monkeypatch, "verifier_svc.server", ["--target", "t"], {"DFLASH_CUDA_GRAPHS": "1"})
    assert a.cuda_graphs
    gpus(2)
    a = _parse(monkeypatch, "verifier_svc.server",
               ["--target", "t", "--cuda-graphs", "--ep-size", "2", "--device", "cuda"])
    with pytest.raises(DeviceError):
        server.rank_devices_of(a)
    a = _parse(monkeypatch, "verifier_svc.server", ["--target", "t", "--device", "cuda:1",
                                                    "--ep-size", "2"])
    with pytest.raises(DeviceError) as e:
        server.rank_devices_of(a)                     # ranks on cuda:1 and cuda:2, only two GPUs
    assert e.value.field == "--ep-size"


def test_models_refuse_a_missing_gpu_and_graphs_on_the_cpu(gpus, tiny_target, make_drafter):
    from drafter_svc.engine import DrafterEngine
    from verifier_svc.target import TargetModel

    gpus(0)
    with pytest.raises(DeviceError, match="--device"):
        TargetModel(tiny_target, device="cuda")
    with pytest.raises(DeviceError, match="--device"):
        DrafterEngine.from_pretrained(make_drafter(), tiny_target, device="cuda:0")
    with pytest.raises(DeviceError, match="--cuda-graphs"):
        TargetModel(tiny_target, device="cpu", cuda_graphs=True)
    t = TargetModel(tiny_target, device="auto", dtype="auto")   # no GPU: the CPU, float32
    assert t.device == torch.device("cpu") and t.dtype == torch.float32
    assert os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA") == "1"      # the CPU's SDPA switch


@pytest.mark.parametrize("native", [True, False])
def test_drafter_auto_dtype_on_a_cpu_follows_its_bf16_instructions(monkeypatch, native):
    """A drafter's ``auto`` on a CPU is bfloat16 only where the CPU multiplies bf16 natively;
    the target's stays float32, and an explicit dtype always wins."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(dev, "cpu_native_bf16", lambda: native)
    want = torch.bfloat16 if native else torch.float32
    assert dev.resolve_dtype("auto", "bfloat16", cpu, cpu_bf16=True) == want
    assert dev.resolve_dtype("auto", "bfloat16", cpu) == torch.float32
    assert dev.resolve_dtype("float32", None, cpu, cpu_bf16=True) == torch.float32


def test_cpu_native_bf16_reads_the_cpu_flags(monkeypatch, tmp_path):
    real = dev.Path
    for flags, want in (("fpu avx512f avx512_bf16 sse", True), ("fpu amx_bf16", True),
                        ("fpu avx2 avx512f", False)):
        f = tmp_path / "cpuinfo"
        f.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        monkeypatch.setattr(dev, "Path", lambda p, f=f: f if p == "/proc/cpuinfo" else real(p))
        assert dev.cpu_native_bf16() is want
    monkeypatch.setattr(dev, "Path", lambda p: tmp_path / "absent")
    assert dev.cpu_native_bf16() is False
