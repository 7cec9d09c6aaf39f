"""The Triton kernels compile for a real GPU target (sm_90, H100/H200) without a GPU.

The interpreter in test_kernels.py checks the numbers but not code generation: this compiles each
kernel through TTIR -> TTGIR -> LLVM -> PTX -> cubin with the ptxas that ships in the triton
wheel, and checks the PTX for what the guarantees depend on: IEEE division and no FMA in the
rejection sampler (bit-exactness), 16-byte loads in the packer when rows are aligned.

Compilation runs in a child process (this file run as a script), never beside test_kernels.py's
interpreter: triton 3.9's interpreter patches ``triton.language`` for the rest of the process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_F32 = ("q_ptr", "p_ptr", "u_ptr", "e_ptr", "r_val_ptr", "p_val_ptr")
_I32 = ("stride_db", "stride_qb", "stride_qk", "stride_pb", "stride_pk", "stride_ub",
        "stride_eb", "stride_ek", "K", "V", "n_splits")
_REJECTION_SIG = ({n: "*fp32" for n in _F32} | {n: "i32" for n in _I32}
                  | {"draft_ptr": "*i64", "accepted_ptr": "*i64", "out_ptr": "*i64",
                     "r_idx_ptr": "*i32", "pos_ptr": "*i32", "p_idx_ptr": "*i32"})
_GREEDY_PARTIAL_SIG = {"part_val_ptr": "*fp32", "part_idx_ptr": "*i32", "stride_b": "i64",
                       "stride_k": "i32", "K1": "i32", "V": "i32", "n_splits": "i32"}
_GREEDY_ACCEPT_SIG = {"draft_ptr": "*i64", "part_val_ptr": "*fp32", "part_idx_ptr": "*i32",
                      "accepted_ptr": "*i64", "out_ptr": "*i64", "stride_db": "i32", "K": "i32",
                      "n_splits": "i32"}
_PACK_DIVISIBLE = ("table_ptr", "base_ptr", "out_ptr", "C")

# case id -> (module, kernel, signature, constexprs, 16-divisible args, compile options)
CASES: dict[str, tuple] = {}
for _logits in ("bf16", "fp32"):
    CASES[f"greedy_partial_{_logits}"] = (
        "kernels.triton_greedy", "_row_argmax_partial_kernel",
        {"logits_ptr": f"*{_logits}"} | _GREEDY_PARTIAL_SIG, {"CHUNK": 4096, "BLOCK_V": 1024},
        ("logits_ptr", "stride_b"), {})
for _b in (1, 16):
    CASES[f"greedy_accept_{_b}"] = ("kernels.triton_greedy", "_greedy_accept_kernel",
                                    _GREEDY_ACCEPT_SIG, {"BLOCK_K1": _b, "BLOCK_S": 64}, (), {})
    CASES[f"rejection_partial_{_b}"] = (
        "kernels.triton_rejection", "_rejection_partial_kernel", _REJECTION_SIG,
        {"BLOCK_K": _b, "CHUNK": 4096, "BLOCK_V": 1024}, (), {"enable_fp_fusion": False})
    CASES[f"rejection_finish_{_b}"] = ("kernels.triton_rejection", "_rejection_finish_kernel",
                                       _REJECTION_SIG, {"BLOCK_K1": 2 * _b, "BLOCK_S": 64}, (), {})
for _dtype, _align in (("bf16", 8), ("bf16", 1), ("fp32", 4), ("fp32", 1)):
    CASES[f"pack_{_dtype}_align{_align}"] = (
        "kernels.triton_pack", "_pack_kernel",
        {"table_ptr": "*i64", "base_ptr": f"*{_dtype}", "out_ptr": f"*{_dtype}", "C": "i32"},
        {"ALIGN": _align, "BLOCK_R": 4, "BLOCK_C": 1024}, _PACK_DIVISIBLE, {})


def compile_all() -> dict[str, dict]:
    """Compile every case; {case: {"ptx": str} or {"error": str}}. Runs in the child process."""

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    results = {}
    for case, (module, name, signature, constexprs, divisible, options) in CASES.items():
        fn = getattr(importlib.import_module(module), name)
        signature = {arg: signature.get(arg, "constexpr") for arg in fn.arg_names}
        # What a launch specialises: 16-byte aligned pointers, integers divisible by 16.
        attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in divisible}
        try:
            kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs),
                                    target=GPUTarget("cuda", 90, 32), options=options)
            assert kernel.asm["cubin"], "no cubin"
            results[case] = {"ptx": kernel.asm["ptx"]}
        except Exception as exc:  # reported per case by the tests
            results[case] = {"error": f"{type(exc).__name__}: {exc}"}
    return results


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    if importlib.util.find_spec("triton") is None:  # not imported here: see the module doc
        pytest.skip("triton is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # today's default, stated to silence a warning
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_compiles_for_sm90(compiled, case):
    assert "error" not in compiled[case], compiled[case].get("error")


@pytest.mark.parametrize("block", [1, 16])
def test_rejection_ptx_is_exact_arithmetic(compiled, block):
    ptx = compiled[f"rejection_partial_{block}"]["ptx"]
    assert "div.rn.f32" in ptx
    assert not re.search(r"\b(fma|div\.full|div\.approx)\.", ptx)


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("pack_")])
def test_pack_uses_16_byte_loads_only_when_aligned(compiled, case):
    ptx = compiled[case]["ptx"]
    loads_16_bytes = re.search(r"ld\.global(\.\w+)*\.v4\.b32", ptx) is not None
    assert loads_16_bytes == (not case.endswith("align1"))


if __name__ == "__main__":
    json.dump(compile_all(), sys.stdout)
