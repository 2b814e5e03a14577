"""Compile kernel_31901d1.py for sm_90 as the issue did (bf16, 128 x 128 x 64, 8 warps, 3 stages, no
argument specialisation), CHECK=True and False, into the folder given: old_True.cubin,
old_False.cubin. Run without TRITON_INTERPRET (an interpreted kernel cannot be compiled)."""
import importlib.util
import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

spec = importlib.util.spec_from_file_location(
    "kernel_31901d1", os.path.join(os.path.dirname(__file__), "kernel_31901d1.py"))
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
fn = mod._checked_gemm_kernel
F32 = {"alpha", "beta", "inj_val", "u", "ut", "lam", "rho_k", "tiny", "g_cap", "g_bm", "g_bn"}
for check in (True, False):
    meta = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, HAS_ADD=False, SCALED=False, CHECK=check,
                INJECT=0, DOT_FP32=False, ALLOW_TF32=False, TF32_EMU=0, CAP=False)
    sig = {n: "constexpr" if n in meta else
           ("*bf16" if n in ("a_ptr", "b_ptr", "c_ptr", "d_ptr") else "*fp32") if n.endswith("_ptr")
           else "fp32" if n in F32 else "i32" for n in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, meta), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=8, num_stages=3))
    with open(os.path.join(sys.argv[1], f"old_{check}.cubin"), "wb") as f:
        f.write(k.asm["cubin"])
