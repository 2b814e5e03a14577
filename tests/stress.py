"""The stress set for the checksum threshold (seeded), the independent worst-case bound, and the
tightness report.

    python tests/stress.py --report          # the README's table (threshold / observed round-off)
"""
import argparse
import math
import sys

import torch

from abft.bench.stress import DISTRIBUTIONS, DTYPES, UNIT, cases, operands  # noqa: F401


def gamma(n, u):
    return n * u / (1 - n * u)


def _blocks(x, bs, dim):
    """Sums of blocks of bs along dim (0 or 1) in float64; the last block may be shorter."""
    return torch.stack([c.sum(dim) for c in x.split(bs, dim)], dim)


def worst_case_bounds(a, b, c, bm, bn):
    """Deterministic worst-case bound of every checked sum's round-off, in float64:
    column sums (TM, N) and row sums (M, TN). The product: gamma_K sum |a||b| plus the rounding of
    C to its dtype (u_out / (1 - u_out) |c| of the stored c, or half the smallest subnormal below the normal range); the check (in
    float64): gamma_bs for the sum of C and for the sums of A (or B), gamma_K for the predicted
    product, plus underflow."""
    dt = c.dtype
    u_acc = UNIT[torch.float64] if dt == torch.float64 else UNIT[torch.float32]
    u_out = 0.0 if dt in (torch.float32, torch.float64) else UNIT[dt]
    u_chk = UNIT[torch.float64]
    eta = torch.finfo(torch.float64 if dt == torch.float64 else torch.float32).tiny
    # Rounding to a half type below its normal range is absolute: half its smallest subnormal.
    eta_out = {torch.float16: 2.0 ** -25, torch.bfloat16: 2.0 ** -134}.get(dt, 0.0)
    k = a.shape[1]
    A, B, C = a.double().abs(), b.double().abs(), c.double().abs()
    out = []
    for x, y, z, bs in ((A, B, C, bm), (B.t(), A.t(), C.t(), bn)):
        xs = _blocks(x, bs, 0)                     # sum_i |x_ik| per block
        t = xs @ y                                 # sum_i sum_k |x||y|
        zs = _blocks(z, bs, 0)
        w = (gamma(k, u_acc) * t + gamma(1, u_out) * zs
             + gamma(bs, u_chk) * zs + gamma(bs, u_chk) * t + gamma(k, u_chk) * t * (1 + gamma(bs, u_chk))
             + 4 * (k + bs) * bs * eta + bs * eta_out)
        out.append(w)
    return out[0], out[1].t()


def residuals(a, b, c, bm, bn):
    """Exact residuals (float64) of the checked sums of the computed c: (TM, N) and (M, TN)."""
    exact = a.double() @ b.double()
    e = c.double() - exact
    return _blocks(e, bm, 0), _blocks(e, bn, 1)


def report(bm=64, bn=64, seed=0):
    """Headroom (threshold / observed residual at the sum that came closest) per case."""
    from abft.kernels.reference import check
    from abft.kernels.threshold import units
    rows = []
    for dist, m, k, n, dt in cases(quick=False):
        a, b = operands(dist, m, k, n, dt, seed)
        c = a @ b
        v, (rr, rc) = check(a, b, c, bm=bm, bn=bn, units=units(dt))
        # ratios are residual / threshold as the check computed them; headroom = 1 / max ratio
        peak = max(rc.abs().max().item(), rr.abs().max().item())
        tiles = v.shape[0] * v.shape[1]
        rows.append((dist, k, str(dt).replace("torch.", ""), tiles, 1 / peak if peak > 0 else math.inf))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.report:
        rows = report(seed=args.seed)
        fin = sorted(r[4] for r in rows if math.isfinite(r[4]))
        print("| distribution | K | dtype | tiles | threshold / worst residual |")
        print("|---|---|---|---|---|")
        for dist, k, dt, tiles, h in rows:
            print(f"| {dist} | {k} | {dt} | {tiles} | {h:.1f} |")
        print(f"\nmedian over {len(fin)} cases with a nonzero residual: {fin[len(fin) // 2]:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
