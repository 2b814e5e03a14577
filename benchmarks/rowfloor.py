"""Where the row check's estimated cost comes from, and the least this design can cost by
``bench/rows.py``'s model (BENCHMARKS.md, "The row check's floor on paper"). No GPU needed.

    python benchmarks/rowfloor.py [--out DIR]

The forward GEMM of 16384 tokens x 4096 -> 4096 (K = 4096: the shape furthest from the gate) is
compiled for sm_90a in variants of ``kernels/rowcheck.py``'s main kernel, each a source edit of it
loaded as a module of its own (nothing in the tree changes):

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
dots, the A tile's load to registers and its square (HGMMA, LDSM, HMUL2), the code outside the
loops cut to the unchecked kernel's plus the epilogue's arithmetic (FADD, FFMA, FMUL, SHFL of the
row sums and sums of squares, from the ``one loop + epilogue`` variant), and the verify kernel's
instructions taken away (its launch at max(the least a launch costs, its bytes)); the tensor
cores', the shared memory's and the HBM's shares as the model counts them. Once more without the
verify launch, and once more with the epilogue's arithmetic overlapped too (as a ping-pong
schedule would hide it behind another tile's wgmma). Every instruction this removes is counted as
if it could go, some that any version needs among them: the cost is at least this. Last, whether
this Triton can overlap a tile's epilogue with another's loop on sm_90a: a persistent GEMM with a
row-sum epilogue compiled with ``warp_specialize`` and ``flatten`` at 4 and 8 warps, and a Gluon
kernel of two partitions (``gl.warp_specialize``, what a ping-pong kernel would be written with);
register reallocation between warp groups (USETMAXREG) marks a warp-specialised Hopper kernel.
"""
import argparse
import importlib.util
import os
import tempfile

import torch
import triton
import triton.language as tl

from abft.bench import results
from abft.bench import rows as RW
from abft.bench import sass
from abft.bench import static as S

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
        assert launch in src, "the launch's TMA line moved"
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
    """A variant's source as a module of its own."""
    path = os.path.join(tmp, f"rowcheck_variant{i}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(f"rowcheck_variant{i}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def compile_gemm(R, a, b, out_dir, tag, roles=("main", "verify")):
    """Compile the row check ``R``'s launches of A.B for sm_90a: {(role, variant): (read fields,
    grid, meta, options)} (``bench/rows.read_kernel``'s fields, with the cubin's path)."""
    read = {}
    for role, variant, fn, grid, args, meta, kopts in RW.launches(R, a, b, R.GPU_CONFIG):
        if role in roles:
            path = os.path.join(out_dir, f"{tag}_{role}_{variant}.cubin")
            S.compile_kernel(fn, args, meta, 90, kopts, path)
            read[(role, variant)] = (dict(RW.read_kernel(path, sass, kopts["num_warps"]), path=path),
                                     grid, meta, kopts)
    return read


def floor_kernels(read, epilogue_ins):
    """The checked main kernel cut to its floor, and the verify kernel's instructions taken away
    (its launch then costs max(the least a launch costs, its bytes))."""
    built = read[("main", "checked")][0]
    plain = read[("main", "unchecked")][0]
    share = max(built["loops"], key=lambda lp: lp["tensor_core_instructions"])
    plain_loop = plain["loops"][0]
    slice_ins = sum(share["by_opcode"].get(op, 0) - plain_loop["by_opcode"].get(op, 0)
                    for op in SLICE_OPS)
    main = dict(built, outside=plain["outside"] + epilogue_ins,
                loops=[dict(share, instructions=plain_loop["instructions"] + slice_ins)]
                + [lp for lp in built["loops"] if lp is not share])
    verify = dict(read[("verify", "checked")][0], instructions=0, other_loops=[])
    return main, verify, slice_ins


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


def _setmaxreg(path):
    """USETMAXREG instructions (register hand-over between warp groups) in a cubin."""
    return sum(sass.opcode(t).startswith("USETMAXREG") for _, t in sass.disassemble(path))


def warp_specialisation(out_dir):
    """{(warps, warp_specialize, flatten): (USETMAXREG count, K loops' instruction counts)}."""
    m = n = k = 4096
    e = lambda *s: torch.empty(*s, dtype=torch.bfloat16, device="meta")
    res = {}
    for warps in (4, 8):
        for ws in (False, True):
            for flat in (False, True):
                path = os.path.join(out_dir, f"persistent_w{warps}_ws{int(ws)}_flat{int(flat)}.cubin")
                S.compile_kernel(_persistent, (e(m, k), e(n, k), e(m * n + m), m, n, k),
                                 dict(BM=128, BN=256, BK=64, SMS=132, WS=ws, FLAT=flat), 90,
                                 dict(num_warps=warps, num_stages=3), path)
                loops = [(len(b), sum(sass.opcode(t).startswith(sass.TENSOR_CORE) for t in b))
                         for _, _, b in sass.tensor_loops(sass.disassemble(path))]
                res[(warps, ws, flat)] = (_setmaxreg(path), loops)
    return res


def gluon_warp_specialisation(out_dir):
    """USETMAXREG instructions in a Gluon kernel of two partitions (``gl.warp_specialize``: four
    warps and one, 24 registers for the one) compiled for sm_90a: what a ping-pong kernel would be
    written with; None where this Triton has no Gluon."""
    try:
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon._runtime import GluonASTSource
    except ImportError:
        return None
    from triton.backends.compiler import GPUTarget

    @gluon.jit
    def _default(out, n):
        lay: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        offs = gl.arange(0, 128, layout=lay)
        x = gl.load(out + offs)
        for _ in range(n):
            x = x * 1.5 + 1.0
        gl.store(out + offs, x)

    @gluon.jit
    def _worker(out, n):
        lay: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        gl.store(out + 128 + gl.arange(0, 32, layout=lay), gl.full([32], 2.0, gl.float32, lay))

    @gluon.jit
    def _two_partitions(out, n):
        gl.warp_specialize([(_default, (out, n)), (_worker, (out, n))], [1], [24])

    k = triton.compile(GluonASTSource(_two_partitions, {"out": "*fp32", "n": "i32"}, {}),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    path = os.path.join(out_dir, "gluon_two_partitions.cubin")
    with open(path, "wb") as f:
        f.write(k.asm["cubin"])
    return _setmaxreg(path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for the cubins (default: a temporary one)")
    results.add_arguments(ap, "rowfloor")
    args = ap.parse_args(argv)
    record = results.start(args, "rowfloor", argv)
    figures = dict(variants=[], gemms=[], layers=[])
    out_dir = args.out or tempfile.mkdtemp(prefix="rowfloor_")
    os.makedirs(out_dir, exist_ok=True)
    import abft.kernels.rowcheck as R
    with open(R.__file__) as f:
        src = f.read()
    cfg = R.GPU_CONFIG
    kw = dict(cfg=cfg, roofline=S.roofline, peak_flops=S.PEAK_FLOPS)
    t, i, o = S.SHAPES[0]
    name, a, b, weight = S.gemms(t, i, o)[0]
    (m, k), n = a.shape, b.shape[1]
    fwd = (m, k, n), f"{t}x{i}->{o} {name}", weight
    got = {v: compile_gemm(_load(_edit(src, v), out_dir, j), a, b, out_dir, f"v{j}",
                           roles=("main", "verify") if j == 0 else ("main",))
           for j, v in enumerate(VARIANTS)}
    built = got["as built"]
    issue = cfg["num_warps"] / RW.SCHEDULERS
    tile_cycles = -(-k // cfg["BLOCK_K"]) * built[("main", "unchecked")][0]["loops"][0]["tensor_cycles"]
    pct = lambda ins: 100 * ins * issue / tile_cycles           # once per tile, in % of the GEMM
    extra = {}
    print(f"forward {m}x{k}x{n}, sm_90a, {cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} tiles, "
          f"{cfg['num_warps']} warps: a tile's K loops take {tile_cycles:.0f} tensor-core cycles")
    print("| variant | K loops: instructions (tensor-core) | outside the loops, checked | "
          "unchecked | extra | extra, % of the GEMM | estimate |")
    print("|---|---|---|---|---|---|---|")
    for v in VARIANTS:
        c, u = got[v][("main", "checked")][0], got[v][("main", "unchecked")][0]
        lps = ", ".join(f"{lp['instructions']} ({lp['tensor_core_instructions']})" for lp in c["loops"])
        extra[v] = c["outside"] - u["outside"]
        # an estimate where the variant has the slice (its share loop's dots)
        has_slice = max(lp["tensor_core_instructions"] for lp in c["loops"]) > \
            max(lp["tensor_core_instructions"] for lp in u["loops"])
        est = RW.gemm_cost({**built, **got[v]}, *fwd, **kw)["estimated_ratio"] if has_slice else None
        print(f"| {v} | {lps} | {c['outside']} | {u['outside']} | {extra[v]} | "
              f"{pct(extra[v]):.2f}% | {'-' if est is None else f'{est:.4f}'} |")
        figures["variants"].append(dict(variant=v, loops=c["loops"], outside_checked=c["outside"],
                                        outside_unchecked=u["outside"], extra=extra[v],
                                        extra_pct=pct(extra[v]), estimate=est))
    epi = extra["one loop + epilogue"]
    loop2 = extra["two loops, no slice"] - epi
    rest = extra["as built"] - extra["two loops, no slice"]
    print(f"\noutside the loops, by part: the epilogue {epi} ({pct(epi):.2f}%), the second loop "
          f"{loop2} ({pct(loop2):.2f}%), V, W and the slice's sums {rest} ({pct(rest):.2f}%)")
    ep = got["one loop + epilogue"]
    diff = {op: ep[("main", "checked")][0]["outside_by_opcode"].get(op, 0)
            - ep[("main", "unchecked")][0]["outside_by_opcode"].get(op, 0) for op in EPILOGUE_OPS}
    epilogue_ins = sum(diff.values())
    print(f"the epilogue's arithmetic: {epilogue_ins} instructions "
          f"({', '.join(f'{op} {v}' for op, v in diff.items())})")
    figures.update(tile_cycles=tile_cycles, parts=dict(epilogue=epi, second_loop=loop2, slice=rest),
                   epilogue_arithmetic=diff)
    print("\n| GEMM | estimate | slice: tensor | slice: LDSM | slice: CUDA cores | hot loop | "
          "outside the loops | HBM | verify launch | checked / unchecked |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    layers = {}
    for shape in S.SHAPES:
        for gname, a, b, weight in S.gemms(*shape):
            (m, k), n = a.shape, b.shape[1]
            # the first layer's forward is the "as built" variant, compiled above
            read = built if (shape, gname) == (S.SHAPES[0], name) else \
                compile_gemm(R, a, b, out_dir, f"{gname}_{m}x{k}x{n}")
            where = ((m, k, n), f"{shape[0]}x{shape[1]}->{shape[2]} {gname}", weight)
            now = RW.gemm_cost(read, *where, **kw)
            main_f, verify_f, slice_ins = floor_kernels(read, epilogue_ins)
            floor = RW.gemm_cost(read, *where, **kw, main=main_f, verify=verify_f)
            free = dict(floor, checked_s=floor["checked_s"] - floor["verify_s"], verify_s=0.0)
            # and the epilogue overlapped with another tile's wgmma (a ping-pong schedule)
            hidden = dict(free, checked_s=free["checked_s"] - free["outside_s"], outside_s=0.0)
            for c in (free, hidden):
                c["estimated_ratio"] = c["checked_s"] / c["unchecked_s"]
            for label, c in (("as built", now), (f"floor (share loop + {slice_ins})", floor),
                             ("floor, no verify launch", free),
                             ("floor, no verify launch, epilogue overlapped", hidden)):
                print(f"| {c['shape']} | {label} | {RW.cost_cells(c)} |")
                figures["gemms"].append(dict(c, label=label))
                lay = layers.setdefault((shape, label.split(" (")[0]), [0.0, 0.0])
                lay[0] += c["checked_s"]
                lay[1] += c["unchecked_s"]
    for (shape, label), (chk, unc) in layers.items():
        print(f"| layer {shape[0]}x{shape[1]}->{shape[2]}, three GEMMs | {label} | | | | | | | | "
              f"{chk / unc:.4f} |")
        figures["layers"].append(dict(layer=f"{shape[0]}x{shape[1]}->{shape[2]}", label=label,
                                      ratio=chk / unc))
    print(f"\nwarp specialisation of a persistent GEMM on sm_90a by this Triton ({triton.__version__}):")
    figures["warp_specialisation"] = []
    for (warps, ws, flat), (setmax, lps) in warp_specialisation(out_dir).items():
        print(f"  {warps} warps, warp_specialize={ws} flatten={flat}: USETMAXREG {setmax}, "
              f"K loops: instructions (tensor-core) {lps}")
        figures["warp_specialisation"].append(dict(warps=warps, warp_specialize=ws, flatten=flat,
                                                   usetmaxreg=setmax, loops=lps))
    g = gluon_warp_specialisation(out_dir)
    print("  Gluon gl.warp_specialize, two partitions: " +
          ("no Gluon in this Triton" if g is None else f"USETMAXREG {g}"))
    figures["gluon_usetmaxreg"] = g
    record.write(figures)


if __name__ == "__main__":
    main()
