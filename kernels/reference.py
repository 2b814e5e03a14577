"""The reference backend: the product from torch's own op (bit-identical to the unchecked call),
then blocked Huang-Abraham checksums with torch ops, on any device.

For C = alpha * A.B + addend, with A (..., M, K), B (..., K, N) and tiles of BM x BN:
- column sums: for each block p of BM rows and each column j, sum_i C_ij - sum_i addend_ij
  against alpha * (s_p . B_j) with s_p = sum_{i in p} A_i;
- row sums: for each row i and each block q of BN columns, the same with A and B swapped.
Checks run in float32 (float64 for float64 operands); ``abft.tolerance`` gives the thresholds.

Cost beyond the product: two GEMMs of (M/BM) x K x N and M x K x (N/BN), and a fixed number of
elementwise passes and reductions over A, B and C; no host synchronisation.
"""
import torch

from abft.tolerance import SMALL_K, check_dtype, low_entropy, norm_bound, sum_threshold, worst_case
from abft.kernels import layout as L

__all__ = ["check", "block_sum"]


def _counts(n, bs, dim, like):
    nf, r = divmod(n, bs)
    counts = torch.tensor([bs] * nf + ([r] if r else []), dtype=like.dtype, device=like.device)
    shape = [1] * like.dim()
    shape[dim] = counts.numel()
    return counts.view(shape)


def block_sum(x, dim, bs, n=None):
    """Sums of consecutive blocks of ``bs`` elements along ``dim`` (-1 or -2); the last block may
    be shorter. A size-1 ``dim`` stands for a broadcast of length ``n``."""
    if n is not None and x.shape[dim] == 1 and n != 1:
        return x * _counts(n, bs, x.dim() + dim, x)
    size = x.shape[dim]
    nf, r = divmod(size, bs)
    parts = []
    if nf:
        parts.append(x.narrow(dim, 0, nf * bs).unflatten(dim, (nf, bs)).sum(dim))
    if r:
        parts.append(x.narrow(dim, nf * bs, r).sum(dim, keepdim=True))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _pad_blocks(x, dim, bs, value):
    """View ``x`` (..., n, ...) as (..., ceil(n/bs), bs, ...) along ``dim``, padding with ``value``."""
    n = x.shape[dim]
    t = -(-n // bs)
    if t * bs != n:
        pad = list(x.shape)
        pad[dim] = t * bs - n
        x = torch.cat([x, x.new_full(pad, value)], dim)
    return x.unflatten(dim, (t, bs))


def _amax(x, dim):
    if x.shape[dim] == 0:
        return x.sum(dim)
    return x.amax(dim)


def _multiplicity(key1, key2, bs):
    """Largest number of rows with equal keys in each block of ``bs`` rows: (..., R) -> (..., T)."""
    k1 = _pad_blocks(key1, -1, bs, float("nan"))
    k2 = _pad_blocks(key2, -1, bs, float("nan"))
    eq = (k1.unsqueeze(-1) == k1.unsqueeze(-2)) & (k2.unsqueeze(-1) == k2.unsqueeze(-2))
    return eq.sum(-1).amax(-1).clamp_min(1).to(key1.dtype)


def _side(x, y, z, z2, z_abs, x2, x_l1, x_inf, y_l1, y_inf, x_low, y_low, addend, alpha, bs, u,
          lam):
    """Checks of the sums of z = alpha x.y + addend over blocks of ``bs`` rows.
    Returns residuals and thresholds (..., T, S)."""
    k = x.shape[-1]
    r_len = z.shape[-2]
    s = block_sum(x, -2, bs)
    pred = s @ y
    if alpha != 1:
        pred = pred * alpha
    sums = block_sum(z, -2, bs)
    res = sums - pred
    addend_sq = None
    if addend is not None:
        res = res - block_sum(addend, -2, bs, r_len)
        addend_sq = block_sum(addend.square(), -2, bs, r_len)
    xs = block_sum(x2, -2, bs) + s.square()
    qbound = norm_bound(xs.sum(-1, keepdim=True), _amax(xs, -1).unsqueeze(-1),
                        y_l1.unsqueeze(-2), y_inf.unsqueeze(-2))
    if alpha != 1:
        qbound = qbound * (alpha * alpha)
    nu = _multiplicity(x_l1, x_inf, bs).unsqueeze(-1)
    low = _block_max(x_low.to(x.dtype), bs).unsqueeze(-1).bool() & y_low.unsqueeze(-2)
    # A corrupted C may overflow C^2 in the check dtype; a legitimate one cannot while the
    # input-derived terms are finite (C_ij^2 <= K Q_ij), so clamping keeps huge errors visible.
    big = torch.finfo(z.dtype).max
    abs_sums = block_sum(z_abs, -2, bs).clamp(max=big)
    sq_sums = block_sum(z2, -2, bs).clamp(max=big)
    thr = sum_threshold(u, k=k, bs=bs, sums=sums, sq_sums=sq_sums, pred=pred,
                        qbound=qbound, nu=nu, abs_sums=abs_sums, low_entropy=low,
                        addend_sq=addend_sq,
                        **({} if lam is None else {"lam": lam}))
    if k <= SMALL_K:
        t = block_sum(x.abs(), -2, bs) @ y.abs()
        if alpha != 1:
            t = t * abs(alpha)
        abs_add = None if addend is None else block_sum(addend.abs(), -2, bs, r_len)
        thr = torch.minimum(thr, worst_case(u, k=k, bs=bs, t=t, abs_sums=abs_sums,
                                            abs_addend=abs_add))
    return res, thr, sums


def _tile_fields(ratio, res, thr, offset_block):
    """ratio/res/thr: (..., TM, TN, bs) -> worst ratio, fails, global index, residual, threshold."""
    mag = ratio.abs()
    worst, idx = mag.max(-1)
    fails = (mag > 1).sum(-1).to(ratio.dtype)
    where = idx.to(ratio.dtype) + offset_block
    where = torch.where(fails > 0, where, torch.full_like(where, -1.0))
    pick = idx.unsqueeze(-1)
    return worst, fails, where, res.gather(-1, pick).squeeze(-1), thr.gather(-1, pick).squeeze(-1)


def check(a, b, c, *, bm, bn, units, alpha=1.0, addend=None, lam=None, return_sums=False):
    """Verify ``c == alpha * a @ b + addend`` tile by tile.

    Args:
        a: (..., M, K) operand.
        b: (..., K, N) operand.
        c: (..., M, N) the product as computed (batch dims: the broadcast of a's and b's).
        bm, bn: tile rows and columns.
        units: ``abft.tolerance.Units`` of the product.
        alpha: the product's scale (addmm, baddbmm).
        addend: tensor broadcastable to ``c`` (already scaled by beta), or None.
        lam: threshold multiplier (None: ``abft.tolerance.LAMBDA``).
        return_sums: also return a dict of the residuals and thresholds of every sum
            (``res_col``, ``thr_col`` (..., TM, N), ``res_row``, ``thr_row`` (..., M, TN)).

    Returns:
        verdict: float32 (..., TM, TN, NFIELDS) in ``layout``'s format.
        detail: (row ratios (..., M, TN), column ratios (..., TM, N)), signed residual /
            threshold of every checked sum, 0 where unverified.
    """
    m, n = c.shape[-2], c.shape[-1]
    batch = c.shape[:-2]
    bm, bn = max(1, min(bm, m)), max(1, min(bn, n))
    tm, tn = -(-m // bm), -(-n // bn)
    if m == 0 or n == 0:
        v = torch.zeros(*batch, tm, tn, L.NFIELDS, dtype=torch.float32, device=c.device)
        return v, (torch.zeros(*batch, m, tn, device=c.device), torch.zeros(*batch, tm, n, device=c.device))
    cd = check_dtype(c.dtype)
    with torch.no_grad():
        a, b, cw = a.to(cd), b.to(cd), c.to(cd)
        if addend is not None:
            addend = addend.to(cd)
            while addend.dim() < c.dim():
                addend = addend.unsqueeze(0)
        a2, b2, c2, c_abs = a.square(), b.square(), cw.square(), cw.abs()
        a_l1, a_inf = a2.sum(-1), _amax(a2, -1)
        b_l1, b_inf = b2.sum(-2), _amax(b2, -2)
        a_low, b_low = low_entropy(a), low_entropy(b.mT)
        res_c, thr_c, sums_c = _side(a, b, cw, c2, c_abs, a2, a_l1, a_inf, b_l1, b_inf, a_low, b_low,
                                     addend, alpha, bm, units, lam)
        res_r, thr_r, sums_r = _side(b.mT, a.mT, cw.mT, c2.mT, c_abs.mT, b2.mT, b_l1, b_inf, a_l1, a_inf,
                                     b_low, a_low, None if addend is None else addend.mT,
                                     alpha, bn, units, lam)
        # (..., TN, M) -> (..., M, TN)
        res_r, thr_r, sums_r = res_r.mT, thr_r.mT, sums_r.mT

        # Status per tile: inputs finite, output finite, thresholds representable.
        inputs_ok = (_block_finite(a_inf, bm).unsqueeze(-1)
                     & _block_finite(b_inf, bn).unsqueeze(-2)).expand(*batch, tm, tn)
        peak = (_block_max(a_l1, bm).sqrt().unsqueeze(-1)
                * _block_max(b_l1, bn).sqrt().unsqueeze(-2) * abs(alpha))
        if addend is not None:
            add_abs = _pad_blocks(addend.abs().expand(*batch, m, n), -2, bm, 0.0).amax(-2)
            add_peak = _block_max(add_abs, bn)                                  # (..., TM, TN)
            inputs_ok = inputs_ok & torch.isfinite(add_peak)
            peak = peak + add_peak
        col_view = lambda t, v: _pad_blocks(t, -1, bn, v)                       # (..., TM, TN, BN)
        row_view = lambda t, v: _pad_blocks(t, -2, bm, v).movedim(-2, -1)      # (..., TM, TN, BM)
        c_bad = ~(torch.isfinite(col_view(sums_c, 0.0)).all(-1)
                  & torch.isfinite(row_view(sums_r, 0.0)).all(-1))
        thr_bad = ~(torch.isfinite(col_view(thr_c, 1.0)).all(-1)
                    & torch.isfinite(row_view(thr_r, 1.0)).all(-1))
        may_overflow = peak >= torch.finfo(c.dtype).max
        status = torch.full(c_bad.shape, L.UNVERIFIED, dtype=torch.float32, device=c.device)
        status = torch.where(inputs_ok & ~thr_bad & ~c_bad, L.OK, status)
        status = torch.where(inputs_ok & c_bad & ~may_overflow, L.NONFINITE, status)
        ok = (status == L.OK).unsqueeze(-1)

        # Ratios: 0 in unverified tiles; a non-finite sum in a NONFINITE tile counts as failing
        # (inf), so the sums locate the non-finite element too.
        zero, inf = res_c.new_zeros(()), float("inf")
        keep = ok | (status == L.NONFINITE).unsqueeze(-1)
        rc = torch.where(keep, col_view(torch.nan_to_num(res_c / thr_c, inf, inf, inf), 0.0), zero)
        rr = torch.where(keep, row_view(torch.nan_to_num(res_r / thr_r, inf, inf, inf), 0.0), zero)
        q_off = torch.arange(tn, device=c.device, dtype=rc.dtype) * bn
        p_off = (torch.arange(tm, device=c.device, dtype=rc.dtype) * bm).unsqueeze(-1)
        cw_, cf, cidx, cres, cthr = _tile_fields(rc, col_view(res_c, 0.0).expand_as(rc),
                                                 col_view(thr_c, 1.0).expand_as(rc), q_off)
        rw_, rf, ridx, rres, rthr = _tile_fields(rr, row_view(res_r, 0.0).expand_as(rr),
                                                 row_view(thr_r, 1.0).expand_as(rr), p_off)
        use_col = cf > 0
        verdict = torch.stack([rw_, rf, ridx, cw_, cf, cidx,
                               torch.where(use_col, cres, rres), torch.where(use_col, cthr, rthr),
                               status], -1).float()
        detail = (_unblock_rows(rr, m), _unblock_cols(rc, n))
    if return_sums:
        return verdict, detail, dict(res_col=res_c, thr_col=thr_c, res_row=res_r, thr_row=thr_r)
    return verdict, detail


def _block_max(x, bs):
    """(..., R) -> (..., T): the maximum of each block (NaN propagates)."""
    return _pad_blocks(x, -1, bs, 0.0).amax(-1)


def _block_finite(norms, bs):
    return torch.isfinite(_block_max(norms, bs))


def _unblock_rows(rr, m):
    """(..., TM, TN, BM) -> (..., M, TN)."""
    return rr.movedim(-1, -2).flatten(-3, -2)[..., :m, :].float()


def _unblock_cols(rc, n):
    """(..., TM, TN, BN) -> (..., TM, N)."""
    return rc.flatten(-2, -1)[..., :n].float()
