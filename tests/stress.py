"""The stress set for the checksum threshold (seeded), the independent worst-case bound, and the
tightness report.

    python tests/stress.py --report          # the README's table (threshold / observed round-off)
"""
import argparse
import math
import sys

import torch

DISTRIBUTIONS = ("gaussian", "uniform", "student_t2", "all_positive", "llm_outliers",
                 "rows_scaled", "cancellation", "constant", "few_values", "duplicate_rows",
                 "near_duplicate_rows", "massive_activations")
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
UNIT = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11,
        torch.bfloat16: 2.0 ** -8}


def operands(dist, m, k, n, dtype, seed):
    """A (m, k) and B (k, n) of one stress case, generated in float64 then cast to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    if dist == "gaussian":
        a, b = r(m, k), r(k, n)
    elif dist == "uniform":
        a = torch.rand(m, k, generator=g, dtype=torch.float64) * 2 - 1
        b = torch.rand(k, n, generator=g, dtype=torch.float64) * 2 - 1
    elif dist == "student_t2":
        t = lambda *s: r(*s) / torch.sqrt(torch.distributions.Chi2(2.0).sample(s).double() / 2)
        torch.manual_seed(seed)
        a, b = t(m, k), t(k, n)
    elif dist == "all_positive":
        a = torch.rand(m, k, generator=g, dtype=torch.float64)
        b = torch.rand(k, n, generator=g, dtype=torch.float64)
    elif dist == "llm_outliers":
        a = r(m, k)
        hot = torch.randperm(k, generator=g)[:max(1, k // 256)]
        a[:, hot] *= 100.0
        b = r(k, n) / math.sqrt(k)
    elif dist == "rows_scaled":
        a = r(m, k) * 10.0 ** (torch.rand(m, 1, generator=g, dtype=torch.float64) * 6 - 3)
        b = r(k, n)
    elif dist == "cancellation":
        h = max(1, k // 2)
        u, v = r(m, h), r(h, n)
        a, b = torch.cat([u, u], 1)[:, :k], torch.cat([v, -v], 0)[:k]
    elif dist == "constant":
        a = torch.full((m, k), 0.1, dtype=torch.float64)
        b = torch.full((k, n), 0.3, dtype=torch.float64)
    elif dist == "few_values":
        a = torch.randint(0, 3, (m, k), generator=g).double() * 0.1 + 0.1
        b = torch.randint(0, 3, (k, n), generator=g).double() * 0.3 + 0.1
    elif dist == "duplicate_rows":
        base = r(max(1, m // 8), k)
        a = base[torch.randint(0, base.shape[0], (m,), generator=g)]
        b = r(k, n)
    elif dist == "near_duplicate_rows":
        # rows that repeat up to 1e-5: their products round alike, so their errors add up
        a = r(1, k) + 1e-5 * r(m, k)
        b = r(k, n)
    elif dist == "massive_activations":
        # a few channels carry one large value shared by every row (LLM "massive activations")
        a = r(m, k)
        hot = torch.randperm(k, generator=g)[:max(1, k // 256)]
        a[:, hot] = 100.0 * r(1, hot.numel())
        b = r(k, n) / math.sqrt(k)
    else:
        raise ValueError(dist)
    if dtype in (torch.float16, torch.bfloat16):
        lim = torch.finfo(dtype).max / 1e3
        a, b = a.clamp(-lim, lim), b.clamp(-lim, lim)
    return a.to(dtype).contiguous(), b.to(dtype).contiguous()


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


def cases(quick=True):
    """(dist, m, k, n, dtype) of the stress set; quick keeps each case small."""
    ks = (1, 7, 64, 1000, 4096, 16384)
    for dist in DISTRIBUTIONS:
        for k in ks:
            for dt in DTYPES:
                m = n = (96 if k >= 4096 else 160) if quick else 640
                if dt in (torch.float16, torch.bfloat16) and k >= 16384 and quick:
                    m = n = 64
                yield dist, m, k, n, dt


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
