"""The stress set for the checksum threshold (seeded) and the tightness report; the worst-case
bound it is gated against is ``abft.kernels.naive``'s.

    python tests/stress.py --report          # docs/check.md's table (threshold / observed round-off)
"""
import argparse
import math
import sys

import torch

from abft.bench.stress import DISTRIBUTIONS, DTYPES, UNIT, cases, operands  # noqa: F401


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
