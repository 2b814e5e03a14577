"""Where the row check's estimated cost comes from, and the least this design can cost by
``bench/rows.py``'s model (BENCHMARKS.md, "The row check's floor on paper"). No GPU needed.

    python benchmarks/rowfloor.py [--out DIR]

The forward GEMM of 16384 tokens x 4096 -> 4096 (K = 4096: the shape furthest from the gate) is
compiled for sm_90a in variants of ``kernels/rowcheck.py``'s main kernel, each a source edit
of it loaded in place of the module (nothing in the tree changes):

- ``as built``: the kernel as it is;
- ``host descriptors``: A, B, V and W as TMA descriptors made on the host (kernel arguments), not
  on the device;
- ``two loops, no slice``: the share loop and the rest, but no V or W and no slice dots;
- ``one loop + epilogue``: the unchecked K loop followed by the checked epilogue (row sums, sums
  of squares, the partials' stores).

The differences between their instructions outside the K loops give what each part costs there,
in the model's arithmetic (each instruction an issue slot of its warp, 8 warps on 4 schedulers,
once per tile, against the tile's tensor-core cycles). Then, for every GEMM of both layers, the
floor: ``bench/rows.py``'s estimate with the share loop cut to the unchecked loop plus its slice's
dots, the A tile's load to registers and its square (HGMMA, LDSM, HMUL2), and the code outside the
loops cut to the unchecked kernel's plus the epilogue's arithmetic (FADD, FFMA, FMUL, SHFL of the
row sums and sums of squares, from the ``one loop + epilogue`` variant); the tensor cores', the
shared memory's, the HBM's and the verify launch's shares as the model counts them; once more
without the verify launch, and once more with the epilogue's arithmetic overlapped too (as a
ping-pong schedule would hide it behind another tile's wgmma). Every instruction this removes
is counted as if it could go: a floor, not a plan. Last, whether this Triton warp-specialises a
persistent Hopper kernel (so that a tile's epilogue could overlap the next tile's loop): a plain
persistent GEMM compiled with ``warp_specialize`` and with ``flatten``; register reallocation
between warp groups (USETMAXREG) is what a warp-specialised Hopper kernel has.
"""
import argparse
import collections
import importlib.util
import os
import sys
import tempfile

import torch
import triton
import triton.language as tl

from abft.bench import rows as RW
from abft.bench import sass
from abft.bench import static as S

SHAPE = (16384, 4096, 4096)          # tokens, in, out: the forward GEMM is 16384 x 4096 x 4096
SHAPES = ((16384, 4096, 4096), (16384, 4096, 14336))
SLICE_OPS = ("HGMMA", "HMUL2", "LDSM")       # the slice's dots, A to registers, A^2
EPILOGUE_OPS = ("FADD", "FFMA", "FMUL", "SHFL")   # the row sums and sums of squares


def _edit(src, name):
    """The kernel module's source as variant ``name``."""
    if name == "as built":
        return src
    if name == "host descriptors":
        a = src.index("    if TMA:\n        # A K- or M-contiguous")
        b = src.index("    else:\n        a_src = a_ptr + rm[:, None]")
        src = src[:a] + "    if TMA:\n        a_src = a_ptr\n        b_src = b_ptr\n" + src[b:]
        a = src.index("            v_src = tl.make_tensor_descriptor(v_ptr")
        b = src.index("        for j in range(0, n_share):")
        src = src[:a] + "            v_src = v_ptr\n            w_src = w_ptr\n" + src[b:]
        launch = "    tma, a_mmajor, b_kmajor = _tma(a, b)\n"
        return src.replace(launch, launch + """    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor as TD
        ad = (TD(a, [k, m], [a.stride(1), 1], [bk, bm]) if a_mmajor
              else TD(a, [m, k], [a.stride(0), 1], [bm, bk]))
        bd = (TD(b, [n, k], [b.stride(1), 1], [bn, bk]) if b_kmajor
              else TD(b, [k, n], [b.stride(0), 1], [bk, bn]))
        vd = TD(enc.v, [k, VW], [enc.v.stride(0), 1], [bk, VW]) if check else enc.v
        wd = TD(enc.w, [k, VW], [enc.w.stride(0), 1], [bk, VW]) if check else enc.w
        main_args = (ad, bd, c, vd, wd) + main_args[5:]
""")
    if name == "two loops, no slice":
        a = src.index("            if TMA:\n                v = v_src.load([ks * BLOCK_K, 0])")
        b = src.index("            vw_ptrs += BLOCK_K * stride_vk\n")
        return src[:a] + "            pv += 1.0\n" + src[b:]
    if name == "one loop + epilogue":
        a = src.index("    if CHECK:\n        # CTA n of the row of tiles takes")
        b = src.index("    else:\n        for ks in range(0, steps):")
        return src[:a] + "    if False:\n        pass\n" + src[b:]
    raise ValueError(name)


VARIANTS = ("as built", "host descriptors", "two loops, no slice", "one loop + epilogue")


def _load(src, tmp, i):
    """Variant source as a module, standing in for abft.kernels.rowcheck while it is read."""
    path = os.path.join(tmp, f"rowcheck_variant{i}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("abft.kernels.rowcheck", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _outside_by_opcode(path):
    ins = sass.disassemble(path)
    inside = {a for lo, hi, _ in sass.tensor_loops(ins) for a, _t in ins if lo <= a <= hi}
    return collections.Counter(sass.opcode(t).split(".")[0] for a, t in ins if a not in inside)


def compile_variant(mod, out_dir, tag):
    """The forward main kernel, checked and unchecked: bench/rows.read_kernel's fields each."""
    import abft.kernels
    import abft.kernels.rowcheck as saved
    t, i, o = SHAPE
    _, a, b, _w = S.gemms(t, i, o)[0]
    cfg = mod.GPU_CONFIG
    sys.modules["abft.kernels.rowcheck"], abft.kernels.rowcheck = mod, mod
    try:
        out = {}
        for role, variant, fn, _g, args, meta, kopts in RW.launches(mod, a, b, cfg):
            if role == "main":
                path = os.path.join(out_dir, f"{tag}_{variant}.cubin")
                S.compile_kernel(fn, args, meta, 90, kopts, path)
                out[variant == "checked"] = dict(RW.read_kernel(path, sass, kopts["num_warps"]),
                                                 path=path)
    finally:
        sys.modules["abft.kernels.rowcheck"], abft.kernels.rowcheck = saved, saved
    return out, cfg


@triton.jit
def _persistent(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr, SMS: tl.constexpr, WS: tl.constexpr, FLAT: tl.constexpr):
    """A persistent TMA GEMM with a row-sum epilogue (the probe of warp specialisation)."""
    tm = tl.cdiv(M, BM)
    tn = tl.cdiv(N, BN)
    a_d = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    b_d = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    c_d = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    for tile in tl.range(tl.program_id(0), tm * tn, SMS, flatten=FLAT, warp_specialize=WS):
        pm = tile // tn
        pn = tile % tn
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(tl.cdiv(K, BK)):
            acc = tl.dot(a_d.load([pm * BM, k * BK]), b_d.load([pn * BN, k * BK]).T, acc)
        tl.store(c_ptr + M * N + pm * BM + tl.arange(0, BM), tl.sum(acc, 1) + tl.sum(acc * acc, 1))
        c_d.store([pm * BM, pn * BN], acc.to(tl.bfloat16))


def warp_specialisation(out_dir):
    """{(warp_specialize, flatten): (USETMAXREG count, K loops' instruction counts)}."""
    m = n = k = 4096
    e = lambda *s: torch.empty(*s, dtype=torch.bfloat16, device="meta")
    res = {}
    for ws in (False, True):
        for flat in (False, True):
            path = os.path.join(out_dir, f"persistent_ws{int(ws)}_flat{int(flat)}.cubin")
            S.compile_kernel(_persistent, (e(m, k), e(n, k), e(m * n + m), m, n, k),
                             dict(BM=128, BN=256, BK=64, SMS=132, WS=ws, FLAT=flat), 90,
                             dict(num_warps=8, num_stages=3), path)
            ins = sass.disassemble(path)
            setmax = sum(sass.opcode(t).startswith("USETMAXREG") for _, t in ins)
            res[(ws, flat)] = (setmax, [len(b) for _, _, b in sass.tensor_loops(ins)])
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for the cubins (default: a temporary one)")
    args = ap.parse_args(argv)
    out_dir = args.out or tempfile.mkdtemp(prefix="rowfloor_")
    os.makedirs(out_dir, exist_ok=True)
    import abft.kernels.rowcheck as R
    with open(R.__file__) as f:
        src = f.read()
    t, i, o = SHAPE
    m, k, n = t, i, o
    got = {}
    for idx, name in enumerate(VARIANTS):
        got[name], cfg = compile_variant(_load(_edit(src, name), out_dir, idx), out_dir, f"v{idx}")
    warps, bk = cfg["num_warps"], cfg["BLOCK_K"]
    issue = warps / RW.SCHEDULERS
    plain = got["as built"][False]
    step_cycles = plain["loops"][0]["tensor_cycles"]
    tile_cycles = -(-k // bk) * step_cycles
    pct = lambda ins: 100 * ins * issue / tile_cycles           # once per tile, in % of the GEMM
    print(f"forward {m}x{k}x{n}, sm_90a, {cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{bk} tiles, {warps} "
          f"warps: a tile's K loops take {tile_cycles:.0f} tensor-core cycles")
    print("| variant | K loops: instructions (tensor-core) | outside the loops, checked | "
          "unchecked | extra | extra, % of the GEMM |")
    print("|---|---|---|---|---|---|")
    for name in VARIANTS:
        c, u = got[name][True], got[name][False]
        lps = ", ".join(f"{lp['instructions']} ({lp['tensor_core_instructions']})" for lp in c["loops"])
        extra = c["outside"] - u["outside"]
        print(f"| {name} | {lps} | {c['outside']} | {u['outside']} | {extra} | {pct(extra):.2f}% |")
    built = got["as built"][True]
    epi = got["one loop + epilogue"]
    epi_extra = epi[True]["outside"] - epi[False]["outside"]
    two = got["two loops, no slice"]
    loop_extra = (two[True]["outside"] - two[False]["outside"]) - epi_extra
    slice_extra = (built["outside"] - plain["outside"]) - epi_extra - loop_extra
    print(f"\noutside the loops, by part: the epilogue {epi_extra} ({pct(epi_extra):.2f}%), the "
          f"second loop {loop_extra} ({pct(loop_extra):.2f}%), V, W and the slice's sums "
          f"{slice_extra} ({pct(slice_extra):.2f}%)")
    fp = sum(v for op, v in (_outside_by_opcode(epi[True]["path"])
                             - _outside_by_opcode(epi[False]["path"])).items() if op in EPILOGUE_OPS)
    print(f"the epilogue's arithmetic ({'/'.join(EPILOGUE_OPS)}): {fp} instructions")
    print("\n| GEMM | estimate | slice: tensor | slice: LDSM | slice: CUDA cores | outside the loops "
          "| HBM | verify launch | checked / unchecked |")
    print("|---|---|---|---|---|---|---|---|---|")
    import abft.kernels.rowcheck as RR
    layers = {}
    for shape in SHAPES:
        for gname, a, b, w in S.gemms(*shape):
            m, k = a.shape
            n = b.shape[1]
            read = {}
            for role, variant, fn, grid, kargs, meta, kopts in RW.launches(RR, a, b, cfg):
                path = os.path.join(out_dir, f"{gname}_{m}x{k}x{n}_{role}_{variant}.cubin")
                S.compile_kernel(fn, kargs, meta, 90, kopts, path)
                read[(role, variant == "checked")] = (RW.read_kernel(path, sass, kopts["num_warps"]),
                                                      grid, meta, kopts)
            built, plain = read[("main", True)][0], read[("main", False)][0]
            vinfo, vgrid, vmeta, vopts = read[("verify", True)]
            # the floor: the share loop its slice's arithmetic alone, outside the loops the
            # epilogue's arithmetic alone
            share = max(built["loops"], key=lambda lp: lp["tensor_core_instructions"])
            plain_loop = plain["loops"][0]
            slice_ins = sum(share["by_opcode"].get(op, 0) - plain_loop["by_opcode"].get(op, 0)
                            for op in SLICE_OPS)
            floor_main = dict(built, outside=plain["outside"] + fp, loops=[
                dict(share, instructions=plain_loop["instructions"] + slice_ins)]
                + [lp for lp in built["loops"] if lp is not share])
            est = lambda main_k: RW.estimate((m, k, n), gname, w, main_k, plain, vinfo,
                                             dict(cfg, num_warps=warps), vgrid[0], vopts["num_warps"],
                                             -(-vmeta["ROWS"] // vmeta["BLOCK_R"]), S.roofline,
                                             S.PEAK_FLOPS)
            now, floor = est(built), est(floor_main)
            free = dict(floor, checked_s=floor["checked_s"] - floor["verify_s"], verify_s=0.0)
            free["estimated_ratio"] = free["checked_s"] / free["unchecked_s"]
            # and the epilogue overlapped with another tile's wgmma (a ping-pong schedule)
            hidden = dict(free, checked_s=free["checked_s"] - free["outside_s"], outside_s=0.0)
            hidden["estimated_ratio"] = hidden["checked_s"] / hidden["unchecked_s"]
            for label, c in (("as built", now), (f"floor (share loop + {slice_ins})", floor),
                             ("floor, no verify launch", free),
                             ("floor, no verify launch, epilogue overlapped", hidden)):
                pc = lambda key: f"{100 * c[key] / c['unchecked_s']:.2f}%"
                print(f"| {shape[0]}x{shape[1]}->{shape[2]} {gname} | {label} | {pc('tensor_s')} | "
                      f"{pc('smem_s')} | {pc('share_s')} | {pc('outside_s')} | {pc('bytes_s')} | "
                      f"{pc('verify_s')} | {c['estimated_ratio']:.4f} |")
                lay = layers.setdefault((shape, label), [0.0, 0.0])
                lay[0] += c["checked_s"]
                lay[1] += c["unchecked_s"]
    for (shape, label), (chk, unc) in layers.items():
        print(f"| layer {shape[0]}x{shape[1]}->{shape[2]}, three GEMMs | {label} | | | | | | | "
              f"{chk / unc:.4f} |")
    print("\nwarp specialisation of a persistent GEMM on sm_90a by this Triton "
          f"({triton.__version__}):")
    for (ws, flat), (setmax, lps) in warp_specialisation(out_dir).items():
        print(f"  warp_specialize={ws} flatten={flat}: USETMAXREG {setmax}, K loops {lps}")


if __name__ == "__main__":
    main()
