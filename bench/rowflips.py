"""Which accumulator bit flips the row check would catch, against the tile kernel, at a wide N.

    TRITON_INTERPRET=1 python benchmarks/rowflips.py --n 4096 --k 4096 --seeds 2   (the CPU)
    abft bench --validate --device cuda --out DIR                                 (part of)

A row check's sum holds N elements where the tile kernel's row and column sums hold its data
tile's 56 or 61: its threshold grows about as sqrt(N). Per seed, one clean bf16 product (M x K x N)
through each kernel gives every sum's residual and threshold; a flip of bit ``b`` of element
(i, j) of the fp32 accumulator after the last K step moves the element by d (computed from the
fp32 product), and so moves the sums holding it: the row check catches it when
|res_i + d| > thr_i, the tile kernel when either its row sum or its column sum does. Every element
of the product is a placement. 'above rounding': |d| is more than half a bf16 ulp of the element
(the flips that change the stored bf16 output).
"""
import argparse

import torch

from abft.bench import results
from abft.kernels import rowcheck as R
from abft.kernels import triton_gemm as TG


def _flip(c, bit):
    return (c.view(torch.int32) ^ (1 << bit)).view(torch.float32)


def run(m=32, k=4096, n=4096, seeds=2, bits=range(8, 32), device="cpu"):
    totals = {b: [0, 0, 0] for b in bits}          # above rounding, row check, tile kernel
    for seed in range(seeds):
        g = torch.Generator().manual_seed(seed)
        a = torch.randn(m, k, generator=g).to(torch.bfloat16).to(device)
        b = torch.randn(k, n, generator=g).to(torch.bfloat16).to(device)
        _, _, _, rows = R.row_checked_gemm(a, b)
        _, _, _, tiles = TG.checked_gemm(a, b, return_sums=True)
        dm, dn = TG.data_tiles(a, b)
        acc = a.float() @ b.float()
        exact = a.double() @ b.double()
        half_ulp = exact.abs() * 2.0 ** -9
        rr, tr = rows["res"].double()[:, None], rows["thr"].double()[:, None]
        # the tile kernel's sums holding each element: its row sum (tile column j // dn), its
        # column sum (tile row i // dm)
        cols = torch.arange(n, device=device) // dn
        rws = torch.arange(m, device=device) // dm
        t_rr = tiles["res_row"].double()[:, cols]
        t_tr = tiles["thr_row"].double()[:, cols]
        t_rc = tiles["res_col"].double()[rws, :]
        t_tc = tiles["thr_col"].double()[rws, :]
        for bit in bits:
            d = (_flip(acc, bit) - acc).double()
            ok = torch.isfinite(d)
            d = torch.where(ok, d, torch.full_like(d, float("inf")))
            above = (d.abs() > half_ulp)
            row_hit = (rr + d).abs() > tr
            tile_hit = ((t_rr + d).abs() > t_tr) | ((t_rc + d).abs() > t_tc)
            totals[bit][0] += int(above.sum())
            totals[bit][1] += int((above & row_hit).sum())
            totals[bit][2] += int((above & tile_hit).sum())
    return [dict(bit=b, above=v[0], row=v[1], tile=v[2]) for b, v in totals.items()]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=32)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--seeds", type=int, default=2)
    results.add_arguments(ap, "rowflips")
    args = ap.parse_args(argv)
    record = results.start(args, "rowflips", argv)
    rows = run(args.m, args.k, args.n, args.seeds)
    print(f"M = {args.m}, K = {args.k}, N = {args.n}, bf16 gaussians, {args.seeds} seeds")
    print("| accumulator bit | flips above bf16 rounding | row check caught | tile kernel caught |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['bit']} | {r['above']} | {r['row']} | {r['tile']} |", flush=True)
    record.write(dict(m=args.m, k=args.k, n=args.n, seeds=args.seeds, rows=rows))


if __name__ == "__main__":
    main()
