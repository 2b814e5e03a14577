"""``abft bench --static``: what the fused kernel costs on a GPU this machine does not have.

Every kernel a checked call launches (the pre-pass of each operand, the main kernel) and the main
kernel with its checks compiled out are compiled for sm_90a (or sm_80) with the argument
specialisations a real launch at the LLM shapes gets (strides of 1 as constants, sizes and strides
divisible by 16 marked so), from the same launch plans the kernels run with (``launch`` in
``kernels/triton_gemm.py`` and ``kernels/prepass.py``, on "meta" tensors). Each cubin is read with
``cuobjdump`` (``bench/sass.py``): registers, spills, the main loop's instructions by opcode.

The cost model is a roofline, and says so: each launch takes max(FLOPs / peak, bytes / bandwidth)
at H200 peaks (989 TFLOP/s dense bf16, 4.8 TB/s HBM), launches add up, nothing overlaps. FLOPs are
the tensor cores' work on whole tiles (a checked tile of BM x BN computes BM - RA rows and BN - RB
columns of C); bytes are each operand read once from HBM (a GEMM's tiles share them through L2),
the pre-pass's two reads of its operand (its blocks are larger than L2's share), and every
output written. What it cannot see: latencies, the epilogue's time per tile, L2 misses, clocks.
"""
import json
import os
import sys

import torch

ARCHS = (90, 80)
PEAK_FLOPS = 989e12         # H200 SXM, dense bf16 tensor-core FLOP/s
PEAK_BYTES = 4.8e12         # H200 HBM3e bytes/s
CONFIG = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
PREPASS_CONFIG = dict(BLOCK_K=64, num_warps=8, num_stages=1)
SHAPES = ((16384, 4096, 4096), (16384, 4096, 14336))      # tokens x in -> out
DTYPE = torch.bfloat16
GATE_LOOP = 1.10            # checked loop instructions / unchecked
GATE_COST = 1.05            # estimated checked / unchecked time


def gemms(t, i, o):
    """The three GEMMs of a linear layer of t tokens, i -> o, as autograd hands them to the
    kernel: (name, a, b, weight) with a, b "meta" tensors of their real strides; ``weight``: b is
    the layer's weight (its pre-pass may be kept between calls)."""
    e = lambda *s: torch.empty(*s, dtype=DTYPE, device="meta")
    x, w, dy = e(t, i), e(o, i), e(t, o)
    return (("forward", x, w.t(), True), ("grad_input", dy, w, True),
            ("grad_weight", dy.t(), x, False))


def _signature(fn, args, meta):
    """(signature, constexprs, attrs) of a launch, specialised as the launcher would."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    names = [n for n in fn.arg_names if n not in meta]
    sig, consts, attrs = {}, dict(meta), {}
    for name, val in zip(names, args):
        if isinstance(val, torch.Tensor):
            ty = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}[val.dtype]
            spec = "D"                        # allocations are 16-byte aligned
        else:
            ty, spec = native_specialize_impl(BaseBackend, val, False, True, True)
        if ty == "constexpr":
            consts[name] = spec
            continue
        sig[name] = ty
        if spec == "D":
            attrs[(fn.arg_names.index(name),)] = [["tt.divisibility", 16]]
    for name in meta:
        sig[name] = "constexpr"
    for name in consts:
        sig[name] = "constexpr"
    return {n: sig[n] for n in fn.arg_names}, consts, attrs


def compile_kernel(fn, args, meta, arch, options, path):
    """Compile one launch for ``arch`` (90: sm_90a, 80: sm_80) and write its cubin to ``path``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig, consts, attrs = _signature(fn, args, meta)
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", arch, 32),
                       options=dict(options))
    with open(path, "wb") as f:
        f.write(k.asm["cubin"])
    return path


def _nbytes(*ts):
    return sum(t.numel() * t.element_size() for t in ts)


def plans(t, i, o):
    """For each GEMM of the layer: the launches of a checked call and of an unchecked one, as
    (role, variant, fn, args, meta, options, flops, bytes, per_call)."""
    from abft.kernels import prepass as P
    from abft.kernels import threshold as T
    from abft.kernels import triton_gemm as TG
    bm, bn = CONFIG["BLOCK_M"], CONFIG["BLOCK_N"]
    out = []
    for name, a, b, weight in gemms(t, i, o):
        m, k = a.shape
        n = b.shape[1]
        a3, b3 = a.unsqueeze(0), b.unsqueeze(0)
        launches = []
        for check in (True, False):
            lay = TG.Layout(a3, b3, DTYPE, False, check)
            if check:
                key = lay.b_key(bn)
                pre = []
                for role, x, dm, r, k_major, per_call in (
                        ("prepass_a", a3, bm - lay.ra, lay.ra, lay.a_k_major, True),
                        ("prepass_b", b3.mT, key[0], lay.rb, lay.b_k_major, not weight)):
                    outs, grid, args, meta = P.launch(x, dm, lay.nparts, r, k_major, False,
                                                      PREPASS_CONFIG["BLOCK_K"])
                    nbytes = 2 * _nbytes(x) + _nbytes(*outs)       # two reads
                    launches.append((role, "checked", P.prepass_kernel, args, meta,
                                     dict(num_warps=PREPASS_CONFIG["num_warps"],
                                          num_stages=PREPASS_CONFIG["num_stages"]),
                                     0.0, nbytes, per_call))
                    pre.append(outs)
                (ar, ab, pa), (br, bb, pb) = pre
                coef = torch.empty(2, len(T.COEF_FIELDS), device="meta")
            else:
                pa = pb = ar = ab = br = bb = coef = torch.empty(1, 1, 1, device="meta")
            plan = TG.LaunchPlan(bm, bn, lay.ra, lay.rb, lay.a_k_major, lay.b_k_major, check,
                                 tf32=False)
            outs, grid, args, meta = TG.launch(a3, b3, None, pa, pb, ar, ab, br, bb, coef, plan)
            meta = dict(meta, BLOCK_K=CONFIG["BLOCK_K"], DOT_FP32=False, ROUND_OUT=False)
            tiles = grid[0] * grid[1]
            flops = 2.0 * tiles * bm * bn * k
            nbytes = _nbytes(a3, b3, *outs) + (_nbytes(pa, pb, ar, ab, br, bb, args[6]) if check else 0)
            launches.append(("main", "checked" if check else "unchecked", TG.checked_gemm_kernel,
                             args, meta, dict(num_warps=CONFIG["num_warps"],
                                              num_stages=CONFIG["num_stages"]),
                             flops, nbytes, True))
        out.append((name, (m, k, n), launches))
    return out


def compile_once(seen, kernels, fn, args, meta, options, role, variant, arch, out_dir, use, read,
                 prefix=""):
    """Compile a launch unless one of the same signature and options was (``seen``: key ->
    (cubin, info)); a new one goes to ``kernels`` with ``read(cubin path)``'s fields; ``use``
    joins its "used_by". Returns the info."""
    sig = _signature(fn, args, meta)
    key = (fn.__name__, repr(sorted(sig[0].items())), repr(sorted(sig[1].items())),
           repr(sorted(sig[2].items())), repr(sorted(options.items())))
    if key not in seen:
        fname = f"{prefix}{len(seen):02d}_{role}_{variant}_sm{arch}.cubin"
        path = os.path.join(out_dir, fname)
        compile_kernel(fn, args, meta, arch, options, path)
        seen[key] = (fname, read(path))
        kernels.append(dict(
            name=fn.__name__, role=role, variant=variant, arch=f"sm_{arch}",
            config=dict({k: v for k, v in meta.items() if k.isupper()}, **options),
            cubin=fname, used_by=[], **seen[key][1]))
    fname, info = seen[key]
    next(kk for kk in kernels if kk["cubin"] == fname)["used_by"].append(use)
    return info


def roofline(flops, nbytes):
    return max(flops / PEAK_FLOPS, nbytes / PEAK_BYTES)


def run(out_dir, arch=90, shapes=SHAPES, stream=sys.stdout):
    """Compile, read, estimate; write ``out_dir/report.json`` and the cubins; return the report."""
    from abft.bench import sass
    os.makedirs(out_dir, exist_ok=True)
    kernels, cost, seen = [], [], {}
    for t, i, o in shapes:
        for name, (m, k, n), launches in plans(t, i, o):
            times = {"checked": 0.0, "unchecked": 0.0}
            extra_flops = extra_bytes = 0.0
            for role, variant, fn, args, meta, options, flops, nbytes, per_call in launches:
                if per_call:
                    sec = roofline(flops, nbytes)
                    times[variant] += sec
                    sign = 1 if variant == "checked" else -1
                    extra_flops += sign * flops
                    extra_bytes += sign * nbytes
                compile_once(seen, kernels, fn, args, meta, options, role, variant, arch, out_dir,
                             f"{t}x{i}->{o} {name}", sass.summary)
            cost.append(dict(shape=f"{t}x{i}->{o} {name} {m}x{k}x{n}", extra_flops=extra_flops,
                             extra_bytes=extra_bytes, checked_s=times["checked"],
                             unchecked_s=times["unchecked"],
                             estimated_ratio=times["checked"] / times["unchecked"]))
    report = dict(kernels=kernels, cost=cost, arch=f"sm_{arch}", dtype="bfloat16",
                  model=dict(kind="roofline: max(FLOPs / peak, bytes / bandwidth) per launch, "
                                  "launches added", peak_flops=PEAK_FLOPS, peak_bytes=PEAK_BYTES,
                             config=CONFIG, prepass_config=PREPASS_CONFIG))
    if arch == 90:
        from abft.bench import rows
        report["rows"] = rows.run(out_dir, shapes, gemms, compile_once, roofline, PEAK_FLOPS, arch)
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    _print(report, stream)
    if "rows" in report:
        from abft.bench import rows
        print("", file=stream)
        rows.print_report(report["rows"], lambda s: print(s, file=stream, flush=True))
    return report


def _print(report, stream):
    p = lambda s: print(s, file=stream, flush=True)
    p(f"{report['arch']}, bf16, 128x128x64 tiles, 8 warps, 3 stages (roofline at H200 peaks)")
    p("| kernel | role | variant | regs | spills | loop instr | loop tensor-core | used by |")
    p("|---|---|---|---|---|---|---|---|")
    for k in report["kernels"]:
        p(f"| {k['cubin']} | {k['role']} | {k['variant']} | {k['regs']} | {k['spills']} | "
          f"{k['loop_instructions']} | {k['loop_tensor_core_instructions']} | "
          f"{', '.join(sorted(set(u.split()[-1] for u in k['used_by'])))} |")
    p("")
    p("| GEMM | extra GFLOP | extra MB | checked us | unchecked us | estimated checked / unchecked |")
    p("|---|---|---|---|---|---|")
    for c in report["cost"]:
        p(f"| {c['shape']} | {c['extra_flops'] / 1e9:.1f} | {c['extra_bytes'] / 1e6:.1f} | "
          f"{c['checked_s'] * 1e6:.1f} | {c['unchecked_s'] * 1e6:.1f} | {c['estimated_ratio']:.3f} |")
