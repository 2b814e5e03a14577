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
import math
import threading

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
    if r == 0:
        return x.unflatten(dim, (nf, bs)).sum(dim)
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


def _multiplicity(key, bs):
    """Largest number of rows with equal keys (their sums of squares) in each block of ``bs``
    rows: (..., R) -> (..., T). Equal rows have equal keys; unequal rows with equal keys only
    make the threshold larger."""
    kb = _pad_blocks(key, -1, bs, float("nan"))
    same = torch.count_nonzero(kb.unsqueeze(-1) == kb.unsqueeze(-2), dim=-1)
    return same.amax(-1).clamp_min(1).to(key.dtype)


_CHUNK = 1 << 19          # elements per chunk on the CPU: 2 MiB of float32, about one L2 (1 MiB a core here)
_local = threading.local()


def _workspace(shape, dtype, device, slot):
    """A reusable buffer on the CPU, where fresh large temporaries cost page faults on every call.
    Elsewhere the caching allocator already reuses memory, and a kept full-size buffer would pin it."""
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    n = math.prod(shape)
    key = (slot, dtype, device)
    pool = getattr(_local, "pool", None)
    if pool is None:
        pool = _local.pool = {}
    buf = pool.get(key)
    if buf is None or buf.numel() < n:
        buf = pool[key] = torch.empty(max(n, 1), dtype=dtype, device=device)
    return buf[:n].view(shape)


def _rows_per_chunk(x, bs, width):
    if x.device.type != "cpu":
        return x.shape[-2]
    batch = math.prod(x.shape[:-2])
    return bs * max(1, _CHUNK // max(1, bs * width * batch))


def operand_stats(x, bs, cd):
    """One pass over x (..., R, K) in chunks: block sums s (..., T, K) and block sums of squares
    alpha (..., T, K) over blocks of ``bs`` rows, and per row the sum l1 and max inf of x^2."""
    *batch, r, k = x.shape
    t = -(-r // bs)
    s = torch.empty(*batch, t, k, dtype=cd, device=x.device)
    alpha = torch.empty_like(s)
    l1 = torch.empty(*batch, r, dtype=cd, device=x.device)
    inf = torch.empty_like(l1)
    if k == 0:
        for z in (s, alpha, l1, inf):
            z.zero_()
        return s, alpha, l1, inf
    if x.stride(-2) == 1 and x.stride(-1) != 1 and r > 1:
        # Column-major (B of a row-major K x N, seen as N x K): chunk along K instead.
        step = max(1, _CHUNK // max(1, r * math.prod(batch)))
        l1.zero_()
        inf.zero_()
        for k0 in range(0, k, step):
            xt = x[..., :, k0:k0 + step].mT.to(cd)                # (..., kk, R), row-major
            sq = torch.mul(xt, xt, out=_workspace(xt.shape, cd, x.device, 0))
            s[..., k0:k0 + step] = block_sum(xt, -1, bs).mT
            alpha[..., k0:k0 + step] = block_sum(sq, -1, bs).mT
            l1 += sq.sum(-2)
            torch.maximum(inf, _amax(sq, -2), out=inf)
        return s, alpha, l1, inf
    step = _rows_per_chunk(x, bs, k)
    for r0 in range(0, r, step):
        xr = x[..., r0:r0 + step, :].to(cd)
        t0 = r0 // bs
        sq = torch.mul(xr, xr, out=_workspace(xr.shape, cd, x.device, 0))
        s[..., t0:t0 + -(-xr.shape[-2] // bs), :] = block_sum(xr, -2, bs)
        alpha[..., t0:t0 + -(-xr.shape[-2] // bs), :] = block_sum(sq, -2, bs)
        l1[..., r0:r0 + step] = sq.sum(-1)
        inf[..., r0:r0 + step] = _amax(sq, -1)
    return s, alpha, l1, inf


def output_stats(c, bm, bn, cd, need_abs):
    """One pass over c (..., M, N) in chunks of row blocks: for column sums (..., TM, N) and row
    sums (..., M, TN) the sums of c, of c^2 and (if ``need_abs``) of |c|."""
    *batch, m, n = c.shape
    tm, tn = -(-m // bm), -(-n // bn)
    col = [torch.empty(*batch, tm, n, dtype=cd, device=c.device) for _ in range(3 if need_abs else 2)]
    row = [torch.empty(*batch, m, tn, dtype=cd, device=c.device) for _ in range(3 if need_abs else 2)]
    step = _rows_per_chunk(c, bm, n)
    for r0 in range(0, m, step):
        cr = c[..., r0:r0 + step, :].to(cd)
        t0, t1 = r0 // bm, r0 // bm + -(-cr.shape[-2] // bm)
        parts = [cr, torch.mul(cr, cr, out=_workspace(cr.shape, cd, c.device, 1))]
        if need_abs:
            parts.append(torch.abs(cr, out=_workspace(cr.shape, cd, c.device, 2)))
        for z, cz, rz in zip(parts, col, row):
            cz[..., t0:t1, :] = block_sum(z, -2, bm)
            rz[..., r0:r0 + step, :] = block_sum(z, -1, bn)
    return col, row


def _side(x, y, xst, yst, x_low, y_low, out_sums, pred, addend, alpha, bs, u, lam, k, r_len):
    """Residuals and thresholds (..., T, S) of the sums of z = alpha x.y + addend over blocks of
    ``bs`` rows of x, from the operand statistics ``xst`` (rows of x) and ``yst`` (columns of y)."""
    s, xalpha, x_l1, _ = xst
    _, _, y_l1, y_inf = yst
    sums, sq_sums = out_sums[0], out_sums[1]
    if alpha != 1:
        pred = pred * alpha
    res = sums - pred
    addend_sq = None
    if addend is not None:
        res = res - block_sum(addend, -2, bs, r_len)
        addend_sq = block_sum(addend.square(), -2, bs, r_len)
    xs = xalpha + s.square()
    qbound = norm_bound(xs.sum(-1, keepdim=True), _amax(xs, -1).unsqueeze(-1),
                        y_l1.unsqueeze(-2), y_inf.unsqueeze(-2))
    if alpha != 1:
        qbound = qbound * (alpha * alpha)
    nu = _multiplicity(x_l1, bs).unsqueeze(-1)
    low = _block_max(x_low.to(s.dtype), bs).unsqueeze(-1).bool() & y_low.unsqueeze(-2)
    # A corrupted C may overflow C^2 in the check dtype; a legitimate one cannot while the
    # input-derived terms are finite (C_ij^2 <= K Q_ij), so clamping keeps huge errors visible.
    big = torch.finfo(s.dtype).max
    sq_sums = sq_sums.clamp(max=big)
    abs_sums = out_sums[2].clamp(max=big) if len(out_sums) > 2 else (bs * sq_sums).sqrt()
    thr = sum_threshold(u, k=k, bs=bs, sums=sums, sq_sums=sq_sums, pred=pred,
                        qbound=qbound, nu=nu, abs_sums=abs_sums, low_entropy=low,
                        addend_sq=addend_sq, **({} if lam is None else {"lam": lam}))
    if k <= SMALL_K:
        t = block_sum(x.abs().to(s.dtype), -2, bs) @ y.abs().to(s.dtype)
        if alpha != 1:
            t = t * abs(alpha)
        abs_add = None if addend is None else block_sum(addend.abs(), -2, bs, r_len)
        thr = torch.minimum(thr, worst_case(u, k=k, bs=bs, t=t, abs_sums=abs_sums,
                                            abs_addend=abs_add)).clamp_min(u.tiny)
    return res, thr


def _tile_fields(ratio, res, thr, offset_block, dim):
    """ratio/res/thr: tiles with their sums along ``dim`` -> (..., TM, TN) worst ratio, failing
    count, global index, residual and threshold of the worst sum."""
    mag = ratio.abs()
    worst, idx = mag.max(dim)
    fails = torch.count_nonzero(mag > 1, dim=dim).to(ratio.dtype)
    where = idx.to(ratio.dtype) + offset_block
    where = torch.where(fails > 0, where, torch.full_like(where, -1.0))
    pick = idx.unsqueeze(dim)
    return worst, fails, where, res.gather(dim, pick).squeeze(dim), thr.gather(dim, pick).squeeze(dim)


def check(a, b, c, *, bm, bn, units, alpha=1.0, addend=None, lam=None, return_sums=False,
          b_stats=None):
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
        b_stats: ``(operand_stats(b.mT, bn), low_entropy(b.mT))`` kept from an earlier call
            (a weight that has not changed): skips a pass over B, and makes a change of B at
            rest show as a failing row check.
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
    k = a.shape[-1]
    with torch.no_grad():
        if addend is not None:
            addend = addend.to(cd)
            while addend.dim() < c.dim():
                addend = addend.unsqueeze(0)
        # Statistics of the rows of A and of the columns of B (the rows of B^T), one pass each.
        ast = operand_stats(a, bm, cd)
        if b_stats is None:
            bst, b_low = operand_stats(b.mT, bn, cd), low_entropy(b.mT)
        else:
            bst, b_low = b_stats
        a_l1, b_l1 = ast[2], bst[2]
        need_abs = bool(units.out) or k <= SMALL_K
        col_sums, row_sums = output_stats(c, bm, bn, cd, need_abs)
        # The predicted sums: two thin GEMMs, (TM x K)(K x N) and (M x K)(K x TN).
        ac, bc = a.to(cd), b.to(cd)
        pred_col = ast[0] @ bc
        pred_row = (ac @ bst[0].mT).mT
        a_low = low_entropy(a)
        res_c, thr_c = _side(ac, bc, ast, bst, a_low, b_low, col_sums, pred_col,
                             addend, alpha, bm, units, lam, k, m)
        res_r, thr_r = _side(bc.mT, ac.mT, bst, ast, b_low, a_low, [z.mT for z in row_sums],
                             pred_row, None if addend is None else addend.mT, alpha, bn, units,
                             lam, k, n)
        # (..., TN, M) -> (..., M, TN)
        res_r, thr_r = res_r.mT, thr_r.mT
        sums_c, sums_r = col_sums[0], row_sums[0]

        # Status per tile: inputs finite, output finite, thresholds representable.
        inputs_ok = (_block_finite(a_l1, bm).unsqueeze(-1)
                     & _block_finite(b_l1, bn).unsqueeze(-2)).expand(*batch, tm, tn)
        peak = (_block_max(a_l1, bm).sqrt().unsqueeze(-1)
                * _block_max(b_l1, bn).sqrt().unsqueeze(-2) * abs(alpha))
        if addend is not None:
            add_abs = _pad_blocks(addend.abs().expand(*batch, m, n), -2, bm, 0.0).amax(-2)
            add_peak = _block_max(add_abs, bn)                                  # (..., TM, TN)
            inputs_ok = inputs_ok & torch.isfinite(add_peak)
            peak = peak + add_peak
        col_view = lambda t, v: _pad_blocks(t, -1, bn, v)                       # (..., TM, TN, BN)
        row_view = lambda t, v: _pad_blocks(t, -2, bm, v)                       # (..., TM, BM, TN)
        c_bad = ~(torch.isfinite(col_view(sums_c, 0.0)).all(-1)
                  & torch.isfinite(row_view(sums_r, 0.0)).all(-2))
        thr_bad = ~(torch.isfinite(col_view(thr_c, 1.0)).all(-1)
                    & torch.isfinite(row_view(thr_r, 1.0)).all(-2))
        may_overflow = peak >= torch.finfo(c.dtype).max
        status = torch.full(c_bad.shape, L.UNVERIFIED, dtype=torch.float32, device=c.device)
        status = torch.where(inputs_ok & ~thr_bad & ~c_bad, L.OK, status)
        status = torch.where(inputs_ok & c_bad & ~may_overflow, L.NONFINITE, status)
        ok = (status == L.OK).unsqueeze(-1)                     # broadcasts over (..., TM, TN, BN)

        # Ratios: 0 in unverified tiles; a non-finite sum in a NONFINITE tile counts as failing
        # (inf), so the sums locate the non-finite element too.
        zero, inf = res_c.new_zeros(()), float("inf")
        keep = ok | (status == L.NONFINITE).unsqueeze(-1)
        rc = torch.where(keep, col_view(torch.nan_to_num(res_c / thr_c, inf, inf, inf), 0.0), zero)
        rr = torch.where(keep.movedim(-1, -2),                  # (..., TM, 1, TN)
                         row_view(torch.nan_to_num(res_r / thr_r, inf, inf, inf), 0.0), zero)
        q_off = torch.arange(tn, device=c.device, dtype=rc.dtype) * bn
        p_off = (torch.arange(tm, device=c.device, dtype=rc.dtype) * bm).unsqueeze(-1)
        cw_, cf, cidx, cres, cthr = _tile_fields(rc, col_view(res_c, 0.0).expand_as(rc),
                                                 col_view(thr_c, 1.0).expand_as(rc), q_off, -1)
        rw_, rf, ridx, rres, rthr = _tile_fields(rr, row_view(res_r, 0.0).expand_as(rr),
                                                 row_view(thr_r, 1.0).expand_as(rr), p_off, -2)
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
    """(..., TM, BM, TN) -> (..., M, TN)."""
    return rr.flatten(-3, -2)[..., :m, :].float()


def _unblock_cols(rc, n):
    """(..., TM, TN, BN) -> (..., TM, N)."""
    return rc.flatten(-2, -1)[..., :n].float()
