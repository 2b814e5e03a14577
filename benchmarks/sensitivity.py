"""Sensitivity of the checks in V-ABFT's terms, for both backends and every dtype.

    TRITON_INTERPRET=1 python benchmarks/sensitivity.py [--k 256 4096] [--trials 20]

Per case (backend, dtype, distribution of the stress set, K; M = N = 64, seed 0; the reference's
tiles 32 x 32, the kernel's 64 x 64, its sums over its data tiles):
- S: the threshold over the checksum's actual round-off, 1 / RMS(residual / threshold) over every
  row and column sum of the clean product (a model exactly as large as the round-off's standard
  deviation would give LAMBDA = 6; V-ABFT reports 7-20 for fp32);
- headroom: 1 / max |residual / threshold|, how far the closest sum was from alarming;
- e95: the smallest error e, relative to the RMS of C, such that adding +-e to any one element is
  detected for 95% of the (element, sign) placements. An error at (i, j) moves one column sum and
  one row sum by e, so it is detected when |res + e| > thr for either: e95 is computed from the clean
  product's residuals and thresholds over every placement, then confirmed by injecting 1.25 e95 at
  ``trials`` random places (in the accumulator for the fused kernel, in the stored C for the
  reference) and counting the alarms ("confirmed").
"""
import argparse
import os
import sys

import torch

from abft.bench import results
from abft.kernels import backends
from abft.kernels import layout as L
from abft.kernels import reference

_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
DISTRIBUTIONS = ("gaussian", "llm_outliers", "all_positive", "rows_scaled", "massive_activations")


def _operands(dist, m, k, n, dtype, seed):
    if _TESTS not in sys.path:
        sys.path.insert(0, _TESTS)
    from stress import operands          # the stress set lives beside the tests
    return operands(dist, m, k, n, dtype, seed)


def _alarmed(v):
    return bool(L.alarmed(v).any())


class _Reference:
    name = "reference"
    bm = bn = 32

    def __init__(self, a, b):
        self.a, self.b = a, b
        self.c = a @ b
        self.u = reference.units_for(self.c)

    def sums(self):
        _, _, s = reference.check(self.a, self.b, self.c, bm=32, bn=32, units=self.u, return_sums=True)
        return s

    def detects(self, i, j, e, g):
        c = self.c.clone()
        c[i, j] = (c[i, j].double() + e).to(c.dtype)
        v, _ = reference.check(self.a, self.b, c, bm=32, bn=32, units=self.u)
        return _alarmed(v)


class _Kernel:
    name = "triton"

    tiles = (64, 64)        # the kernel's; its sums run over its data tiles (``data_tiles``)

    def __init__(self, a, b):
        from abft.kernels import triton_gemm as TG
        self.tg, self.a, self.b = TG, a, b
        self.c, _, _ = TG.checked_gemm(a, b, tiles=self.tiles)
        self.bm, self.bn = TG.data_tiles(a, b, self.tiles)

    def sums(self):
        return self.tg.checked_gemm(self.a, self.b, tiles=self.tiles, return_sums=True)[3]

    def detects(self, i, j, e, g):
        steps = max(1, -(-self.a.shape[-1] // 32))
        ks = int(torch.randint(0, steps, (1,), generator=g))
        _, v, _ = self.tg.checked_gemm(self.a, self.b, tiles=self.tiles,
                                       inject=dict(kind="add", row=i, col=j, k_step=ks, value=e))
        return _alarmed(v)


def _ratios(s):
    r = torch.cat([(s["res_col"] / s["thr_col"]).flatten(), (s["res_row"] / s["thr_row"]).flatten()])
    return r.double()


def _e95(s, m, n, bm=32, bn=32):
    """95th percentile over every (element, sign) of the least |e| that fails its column or row sum."""
    rc, tc = s["res_col"].double().reshape(-1, n), s["thr_col"].double().reshape(-1, n)   # (TM, N)
    rr, tr = s["res_row"].double().reshape(m, -1), s["thr_row"].double().reshape(m, -1)   # (M, TN)
    rc, tc = rc.repeat_interleave(bm, 0)[:m], tc.repeat_interleave(bm, 0)[:m]             # per element
    rr, tr = rr.repeat_interleave(bn, 1)[:, :n], tr.repeat_interleave(bn, 1)[:, :n]
    need = torch.cat([torch.minimum(tc - rc, tr - rr).flatten(), torch.minimum(tc + rc, tr + rr).flatten()])
    return torch.quantile(need.clamp_min(0), 0.95).item()


def case(backend, dtype, dist, k, trials=20, seed=0, m=64, n=64):
    a, b = _operands(dist, m, k, n, dtype, seed)
    run = (_Reference if backend == "reference" else _Kernel)(a, b)
    sums = run.sums()
    r = _ratios(sums)
    rms_c = run.c.double().square().mean().sqrt().item()
    e95 = _e95(sums, m, n, run.bm, run.bn)
    g = torch.Generator().manual_seed(seed + 7)
    hits = 0
    for _ in range(trials):
        i, j = int(torch.randint(0, m, (1,), generator=g)), int(torch.randint(0, n, (1,), generator=g))
        sign = 1.0 if torch.rand(1, generator=g).item() < 0.5 else -1.0
        hits += run.detects(i, j, sign * 1.25 * e95, g)
    return dict(backend=backend, dtype=str(dtype).replace("torch.", ""), dist=dist, k=k,
                S=1 / r.square().mean().sqrt().item(), headroom=1 / r.abs().max().item(),
                e95=e95 / rms_c, confirmed=hits / trials)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, nargs="+", default=[256, 4096])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--backends", nargs="+", default=["reference", "triton"])
    ap.add_argument("--dists", nargs="+", default=list(DISTRIBUTIONS))
    ap.add_argument("--dtypes", nargs="+", default=None, help="e.g. bfloat16 float32")
    ap.add_argument("--tiles", type=int, nargs=2, default=list(_Kernel.tiles),
                    help="the fused kernel's tile (its sums run over the data tiles inside it)")
    results.add_arguments(ap, "sensitivity")
    args = ap.parse_args(argv)
    record = results.start(args, "sensitivity", argv)
    rows = []
    _Kernel.tiles = tuple(args.tiles)
    dtypes = backends.DTYPES
    torch.set_num_threads(1)
    print("| backend | dtype | distribution | K | S = thr / round-off (RMS) | headroom | e95 / RMS(C) | confirmed |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    for backend in args.backends:
        for dt in dtypes[backend]:
            if args.dtypes and str(dt).replace("torch.", "") not in args.dtypes:
                continue
            for dist in args.dists:
                for k in args.k:
                    r = case(backend, dt, dist, k, args.trials)
                    print(f"| {backend} | {r['dtype']} | {dist} | {k} | {r['S']:.1f} | {r['headroom']:.1f} | "
                          f"{r['e95']:.1e} | {r['confirmed']:.0%} |", flush=True)
                    rows.append(r)
    record.write(dict(trials=args.trials, tiles=args.tiles, rows=rows))


if __name__ == "__main__":
    main()
