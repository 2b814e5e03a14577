"""The reference backend: the product from torch's own op (bit-identical to the unchecked call),
then blocked Huang-Abraham checksums, on any device.

Two implementations of one check. On the CPU, ``check`` runs it compiled (``compiled.py``: one
C++ call that reads each operand once in its own dtype and accumulates in float64 registers; a
plain shared library through ctypes rather than a torch extension or numba, for the reasons in
its header). ``check_torch`` is the same arithmetic in torch ops: it runs on other devices, under
torch.compile's tracing and wherever the library cannot be built, and it is the oracle the tests
hold the compiled check to (``tests/kernels/test_compiled.py``).

For C = alpha * A.B + addend, with A (..., M, K), B (..., K, N) and tiles of BM x BN:
- column sums: for each block p of BM rows and each column j, sum_i C_ij - sum_i addend_ij
  against alpha * (s_p . B_j) with s_p = sum_{i in p} A_i;
- row sums: for each row i and each block q of BN columns, the same with A and B swapped.
The checks run in float64, on values scaled by powers of two per block and column
(``abft.kernels.stats``); ``abft.kernels.threshold`` gives the thresholds, with the product's
accumulation modelled as recursive (the order any BLAS may use).

Cost beyond the product: two thin GEMMs of (M/BM) x K x N and M x K x (N/BN) in float64, and a
fixed number of elementwise passes and reductions over A, B and C; no host synchronisation.
"""
import math

import torch

from abft.kernels import backends, compiled
from abft.kernels import layout as L
from abft.kernels import threshold as T
from abft.kernels.stats import _CHUNK, _pad_blocks, _rows_per_chunk, _sum_blocks, operand_stats

__all__ = ["check", "check_torch", "weight_stats", "weight_stats_pair", "units_for"]

F64 = torch.float64


_UNITS = {}


def units_for(c):
    """Round-off units of a product torch computed as ``c``: the stored output checked in float64;
    fp32 GEMMs may use tf32 (CUDA: ``allow_tf32``; CPU: a float32 matmul precision below
    "highest"); bf16 GEMMs on CPUs flush subnormal inputs and products to zero. Kept per
    (dtype, device type, tf32): every checked call asks."""
    dev = c.device.type
    tf32 = c.dtype == torch.float32 and backends.tf32_allowed(c.device)
    key = (c.dtype, dev, tf32)
    u = _UNITS.get(key)
    if u is None:
        u = _UNITS[key] = T.units(c.dtype, tf32=tf32, flush=dev == "cpu" and c.dtype == torch.bfloat16)
    return u


def _columns(b):
    """(B's columns as rows, whether ``check`` needs their |B| sums: K within the small-K cap)."""
    return b.mT, b.shape[-2] <= T.SMALL_K


def weight_stats(b, bn):
    """Statistics of the columns of B (K, N) for blocks of ``bn`` columns: what ``check`` needs of
    a B that does not change between calls (a weight), to pass back as ``b_stats``."""
    x, need_abs = _columns(b)
    if compiled.usable(b, b, b, None):
        return compiled.stats(x, bn, need_abs=need_abs)
    return operand_stats(x, bn, need_s=True, need_abs=need_abs)


def weight_stats_pair(w, bn, bn_t):
    """``(weight_stats(w.t(), bn), weight_stats(w, bn_t))``: the statistics of a linear's weight
    (out, in) for its forward (x @ w.T) and for its grad_input (g @ w), in one call where the
    compiled check runs (both sides' blocks on the threads together)."""
    if compiled.usable(w, w, w, None):
        (x, need_abs), (y, need_abs_t) = _columns(w.t()), _columns(w)
        return compiled.stats_pair(x, bn, need_abs, y, bn_t, need_abs_t)
    return weight_stats(w.t(), bn), weight_stats(w, bn_t)


def _pred_col(s, b, f):
    """(..., TM, N): s (..., TM, K) @ (B scaled by 2^-f per column), in float64, in K chunks.
    float64 holds the products of other dtypes, so their B is scaled after the GEMM."""
    *batch, tm, k = s.shape
    n = b.shape[-1]
    out = torch.zeros(*batch, tm, n, dtype=F64, device=s.device)
    if k == 0:
        return out
    sc = torch.exp2(-f).unsqueeze(-2)
    pre = b.dtype == F64
    step = max(1, _CHUNK // max(1, n * max(1, math.prod(batch))))
    for k0 in range(0, k, step):
        bk = b[..., k0:k0 + step, :].to(F64)
        out += s[..., k0:k0 + step] @ (bk * sc if pre else bk)
    return out if pre else out * sc


def _pred_row(a, e, sb):
    """(..., M, TN): (A scaled by 2^-e per row) @ sb (..., TN, K)^T, in float64, in row chunks."""
    *batch, m, k = a.shape
    tn = sb.shape[-2]
    out = torch.zeros(*batch, m, tn, dtype=F64, device=a.device)
    if k == 0:
        return out
    pre = a.dtype == F64
    sc = torch.exp2(-e).unsqueeze(-1)
    step = max(1, _CHUNK // max(1, k * max(1, math.prod(batch))))
    for r0 in range(0, m, step):
        xs = a[..., r0:r0 + step, :].to(F64)
        out[..., r0:r0 + step, :] = (xs * sc[..., r0:r0 + step, :] if pre else xs) @ sb.mT
    return out if pre else out * sc


def _elementwise(z, half, masked=True, raw=None):
    """The elementwise arrays the sums are built from: z's finite values, their squares, their
    magnitudes, the non-finite mask and (half types) the mask below the normal range.
    ``masked=False``: z is known to be finite (no masks, no copy). ``raw``: z before its scaling
    (float64), whose non-finite values are counted: a finite one that overflows when scaled stays
    inf in the sums, which leaves the threshold unformed (unverified), not a non-finite output."""
    if masked and raw is not None:
        nf = (raw - raw) != 0
        zf = torch.where(nf, 0.0, z)
    elif masked:
        nf = (z - z) != 0              # inf - inf and NaN - NaN are NaN: 5x faster than ~isfinite
        zf = torch.nan_to_num(z, nan=0.0, posinf=0.0, neginf=0.0)
    else:
        nf, zf = None, z
    mag = zf.abs()
    sub = (mag < torch.finfo(torch.float16 if half == "f16" else torch.bfloat16).tiny) if half else None
    return [zf, (zf * zf).clamp_(max=torch.finfo(z.dtype).max), mag, nf, sub]


def _reduce(arrays, bs, dim):
    """Block sums of each array (bool masks counted, then converted: the sums are small)."""
    return [None if z is None else _count_blocks(z, bs, dim) if z.dtype == torch.bool
            else _sum_blocks(z, bs, dim) for z in arrays]


def _count_blocks(mask, bs, dim):
    """True values in consecutive blocks of ``bs`` along ``dim`` (negative), as float64."""
    nf, r = mask.shape[dim] // bs, mask.shape[dim] % bs     # not divmod: torch.compile traces these
    parts = []
    if nf:
        parts.append(torch.count_nonzero(mask.narrow(dim, 0, nf * bs).unflatten(dim, (nf, bs)), dim=dim))
    if r:
        parts.append(torch.count_nonzero(mask.narrow(dim, nf * bs, r), dim=dim).unsqueeze(dim))
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim)).to(F64)


def _scaled(z, ex):
    """z 2^-ex, exactly where the result is a double (``threshold.pow2_factors``: 2^-ex itself
    overflows for tiny z)."""
    hi, lo = T.pow2_factors(-ex)
    return z * hi * lo


def _output_sums(c, addend, ast, bst, bm, bn):
    """One pass over C (and the addend) in row chunks, for column sums (..., TM, N) in units of
    2^(E_p + f_j) and row sums (..., M, TN) in units of 2^(e_i + F_q). Returns per side the sums of
    C, C^2, |C|, the non-finite count (None on the CPU when every element is finite) and the count
    of elements below the normal range (half types, else None), then (with an addend) the same of
    the addend.
    float64 holds the squares of the other dtypes: they are summed as they are and scaled after;
    float64 products are scaled before squaring."""
    *batch, m, n = c.shape
    tm, tn = -(-m // bm), -(-n // bn)
    half = {torch.float16: "f16", torch.bfloat16: "bf16"}.get(c.dtype)
    nz = 5 * (2 if addend is not None else 1)
    col = [None] * nz
    row = [None] * nz
    E_rows = ast.E.repeat_interleave(bm, -1)[..., :m]
    F_cols = bst.E.repeat_interleave(bn, -1)[..., :n]
    pre = c.dtype == F64
    step = _rows_per_chunk(c, bm, n)
    for r0 in range(0, m, step):
        cr = c[..., r0:r0 + step, :].to(F64)
        rows = cr.shape[-2]
        t0, t1 = r0 // bm, r0 // bm + -(-rows // bm)
        chunks = [cr]
        if addend is not None:
            d = addend[..., r0:r0 + step, :] if addend.shape[-2] != 1 else addend
            chunks.append(d.to(F64).expand(*cr.shape))
        parts_c, parts_r = [], []
        for i, z in enumerate(chunks):
            h = half if i == 0 else None
            if pre:
                zc = _scaled(z, E_rows[..., r0:r0 + step].unsqueeze(-1) + bst.e.unsqueeze(-2))
                zr = _scaled(z, ast.e[..., r0:r0 + step].unsqueeze(-1) + F_cols.unsqueeze(-2))
                parts_c += _reduce(_elementwise(zc, h, raw=z), bm, -2)
                parts_r += _reduce(_elementwise(zr, h, raw=z), bn, -1)
            else:
                # on the CPU, where ops are synchronous anyway, the non-finite bookkeeping runs only
                # for a chunk that holds a non-finite value (its sums say so)
                cpu = z.device.type == "cpu" and not torch.compiler.is_compiling()
                arrays = _elementwise(z, h, masked=not cpu)
                pc, pr = _reduce(arrays, bm, -2), _reduce(arrays, bn, -1)
                if cpu and not bool(torch.isfinite(pc[0]).all() and torch.isfinite(pc[1]).all()):
                    arrays = _elementwise(z, h)
                    pc, pr = _reduce(arrays, bm, -2), _reduce(arrays, bn, -1)
                elif cpu:
                    pc[3] = pr[3] = None           # no count: every element is finite
                parts_c += pc
                parts_r += pr
        for side, parts, sl in ((col, parts_c, (slice(t0, t1), slice(None))),
                                (row, parts_r, (slice(r0, r0 + rows), slice(None)))):
            for i, p in enumerate(parts):
                if p is None:
                    continue
                if side[i] is None:
                    side[i] = torch.zeros(*batch, *((tm, n) if side is col else (m, tn)), dtype=F64, device=c.device)
                side[i][(..., *sl)] = p
    if not pre:
        sc = torch.exp2(-(ast.E.unsqueeze(-1) + bst.e.unsqueeze(-2)))      # (..., TM, N)
        sr = torch.exp2(-(ast.e.unsqueeze(-1) + bst.E.unsqueeze(-2)))      # (..., M, TN)
        for side, f in ((col, sc), (row, sr)):
            for base in range(0, nz, 5):
                side[base] = side[base] * f
                side[base + 1] = side[base + 1] * (f * f)
                side[base + 2] = side[base + 2] * f
    return col, row


def _side(coef, sums, pred, xst, yst, alpha, t):
    """Residuals and thresholds (..., T, S) of one side's sums: x is the summed operand (blocks
    along T), y the other (rows along S)."""
    s1, s2, sa, nf, nsub = sums[:5]
    d1, d2, da = sums[5:8] if len(sums) > 5 else (None, None, None)
    # alpha == 1 (every product but addmm/baddbmm's): its multiplications skipped, exactly
    a2 = alpha * alpha
    col = lambda v: v.unsqueeze(-1) if a2 == 1 else v.unsqueeze(-1) * a2     # x's norms, times alpha^2
    row = lambda v: v.unsqueeze(-2)
    if alpha != 1:
        pred = alpha * pred
        t = None if t is None else t * abs(alpha)
    res = s1 - pred if d1 is None else s1 - pred - d1
    low = xst.block_low().unsqueeze(-1) & row(yst.low)
    thr = T.threshold(coef, s1=s1, s2=s2, sa=sa, pred=pred,
                      x1=col(xst.x1), xinf=col(xst.xinf), xs1=col(xst.xs1), xsinf=col(xst.xsinf),
                      y1=row(yst.r1), yinf=row(yst.rinf), nu=xst.nu.unsqueeze(-1), low=low,
                      ex=xst.E.unsqueeze(-1), ey=row(yst.e), d2=d2, da=da, t=t, nsub=nsub)
    return res, thr, nf


def check(a, b, c, *, bm, bn, units, acc=None, chk=None, alpha=1.0, addend=None, beta=1.0, lam=None,
          return_sums=False, b_stats=None, summary=False):
    """Verify ``c == alpha * a @ b + addend`` tile by tile: the compiled check where it can run
    (``compiled.usable``), else ``check_torch`` (the same arguments and results). With
    ``summary``, the results end with ``layout.summary`` of the verdict (on the CPU: a tuple)."""
    fast = compiled.usable(a, b, c, addend)
    if fast:                # (the common path without the look's closures: microseconds a call)
        out = compiled.check(a, b, c, bm=bm, bn=bn, units=units, acc=acc, chk=chk, alpha=alpha, addend=addend,
                             beta=beta, lam=lam, return_sums=return_sums, b_stats=b_stats, summary=True)
        if not out[-1][0]:
            return out if summary else out[:-1]
    kw = dict(bm=bm, bn=bn, units=units, acc=acc, chk=chk, alpha=alpha, addend=addend, beta=beta, lam=lam,
              b_stats=b_stats)
    if fast:
        run = lambda sums: compiled.check(a, b, c, **kw, return_sums=sums, summary=True)
    else:
        run = lambda sums: _summarised(_check_torch(a, b, c, **kw, return_sums=sums), summary)
        out = run(return_sums)
    out = _second_look(out, run, a, b, c, kw, return_sums)
    return out if summary else out[:-1]


def check_product(a, b, c, *, bm, bn, alpha, addend, beta, lam, b_stats):
    """The checking backend's entry point (``backends``): ``check`` in c's own units, with the
    summary; ``b_stats``: None or a function of bn giving b's kept statistics."""
    return check(a, b, c, bm=bm, bn=bn, units=units_for(c), alpha=alpha, addend=addend, beta=beta, lam=lam,
                 b_stats=None if b_stats is None else b_stats(bn), summary=True)


def check_torch(a, b, c, *, bm, bn, units, acc=None, chk=None, alpha=1.0, addend=None, beta=1.0, lam=None,
                return_sums=False, b_stats=None):
    """Verify ``c == alpha * a @ b + addend`` tile by tile, with torch ops (on any device; the
    compiled check's oracle).

    Args:
        a: (..., M, K) operand.
        b: (..., K, N) operand.
        c: (..., M, N) the product as computed (batch dims: the broadcast of a's and b's).
        bm, bn: tile rows and columns.
        units: ``threshold.Units`` of the product.
        acc: ``threshold.Accumulation`` of the product (default: recursive); chk: of the check's
            predicted sums (default: recursive).
        alpha: the product's scale (addmm, baddbmm).
        addend: tensor broadcastable to ``c``, or None; beta: its scale.
        lam: threshold multiplier (None: ``threshold.LAMBDA``).
        b_stats: ``weight_stats(b, bn)`` kept from an earlier call (a weight that has not changed):
            skips a pass over B, and makes a change of B at rest show as a failing row check.
        return_sums: also return a dict of the residuals and thresholds of every sum, in C's units
            (``res_col``, ``thr_col`` (..., TM, N), ``res_row``, ``thr_row`` (..., M, TN)).

    Returns:
        verdict: float32 (..., TM, TN, NFIELDS) in ``layout``'s format.
        detail: (row ratios (..., M, TN), column ratios (..., TM, N)), signed residual /
            threshold of every checked sum, 0 where unverified.

    A sum that fails gets a second look (``_second_look``) where the verdict is on the host.
    """
    kw = dict(bm=bm, bn=bn, units=units, acc=acc, chk=chk, alpha=alpha, addend=addend, beta=beta, lam=lam,
              b_stats=b_stats)
    run = lambda sums: _summarised(_check_torch(a, b, c, **kw, return_sums=sums), False)
    return _second_look(run(return_sums), run, a, b, c, kw, return_sums)[:-1]


def _check_torch(a, b, c, *, bm, bn, units, acc=None, chk=None, alpha=1.0, addend=None, beta=1.0, lam=None,
                 return_sums=False, b_stats=None):
    """``check_torch`` without its second look (the same arguments and results)."""
    m, n = c.shape[-2], c.shape[-1]
    batch = c.shape[:-2]
    bm, bn = max(1, min(bm, m)), max(1, min(bn, n))
    tm, tn = -(-m // bm), -(-n // bn)
    if m == 0 or n == 0:
        v = torch.zeros(*batch, tm, tn, L.NFIELDS, dtype=torch.float32, device=c.device)
        out = (v, (torch.zeros(*batch, m, tn, device=c.device), torch.zeros(*batch, tm, n, device=c.device)))
        return (*out, {}) if return_sums else out
    k = a.shape[-1]
    acc = acc or T.recursive(k)
    alpha = float(alpha)
    with torch.no_grad():
        if addend is not None:
            addend = addend.to(F64) if beta == 1 else addend.to(F64) * float(beta)
            while addend.dim() < c.dim():
                addend = addend.unsqueeze(0)
            if addend.shape[-1] != n:
                addend = addend.expand(*addend.shape[:-1], n)
        bst = b_stats if b_stats is not None else weight_stats(b, bn)
        if bst.bs != bn:
            raise ValueError(f"b_stats were made for blocks of {bst.bs} columns, not {bn}")
        # one pass over A for its statistics and the row predictions, one over B for the columns'
        ast = operand_stats(a, bm, need_s=True, need_abs=k <= T.SMALL_K, rhs=bst.s)
        pred_row = ast.times                                     # (..., M, TN)
        pred_col = _pred_col(ast.s, b, bst.e)                    # (..., TM, N)
        cs, rs = _output_sums(c, addend, ast, bst, bm, bn)
        t_col = t_row = None
        if k <= T.SMALL_K:
            t_col = _pred_col(ast.absum, b.abs(), bst.e)
            t_row = _pred_row(a.abs(), ast.e, bst.absum)
        terms = dict(acc=acc, chk=chk, lam=lam, addend=addend is not None, alpha=alpha, beta=float(beta))
        coef_c = T.coefficients(units, k=k, bs=bm, **terms)
        coef_r = T.coefficients(units, k=k, bs=bn, **terms)
        res_c, thr_c, nf_c = _side(coef_c, cs, pred_col, ast, bst, alpha, t_col)
        res_r, thr_r, nf_r = _side(coef_r, [None if z is None else z.mT for z in rs], pred_row.mT, bst, ast, alpha,
                                   None if t_row is None else t_row.mT)
        res_r, thr_r = res_r.mT, thr_r.mT                        # (..., M, TN)
        nf_r = None if nf_r is None else nf_r.mT
        ex_c = ast.E.unsqueeze(-1) + bst.e.unsqueeze(-2)          # scale exponents of the sums
        ex_r = ast.e.unsqueeze(-1) + bst.E.unsqueeze(-2)

        # Status per tile: inputs finite; output finite (or, where not, provably a fault);
        # thresholds representable.
        inputs_ok = (ast.block_finite().unsqueeze(-1) & bst.block_finite().unsqueeze(-2)).expand(*batch, tm, tn)
        col_view = lambda z, v: _col_view(z, bn, v)
        row_view = lambda z, v: _row_view(z, bm, v)
        if addend is not None and cs[8] is not None:
            inputs_ok = inputs_ok & _tile_all(col_view(cs[8] == 0, True))
        thr_ok = _tile_all(col_view(torch.isfinite(thr_c), True)) \
            & _tile_all(row_view(torch.isfinite(thr_r), True))
        status = torch.where(inputs_ok & thr_ok, L.OK, L.UNVERIFIED)
        peak = None                          # _peak, made where a proof below needs it (once)
        if nf_c is not None:                 # C may hold non-finite values (known finite: skipped)
            peak = _peak(ast, bst, alpha, addend, bm, bn)
            c_bad = _tile_any(col_view(nf_c > 0, False)) | _tile_any(row_view(nf_r > 0, False))
            fault = _proves_fault(res_c, thr_c, nf_c, ex_c, c.dtype, col_view) \
                | _proves_fault(res_r, thr_r, nf_r, ex_r, c.dtype, row_view) \
                | (peak < torch.finfo(c.dtype).max)
            status = torch.where(c_bad, L.UNVERIFIED, status)
            status = torch.where(inputs_ok & c_bad & fault, L.NONFINITE, status)
        # thresholds that overflow over a finite C: checked after all where the operands bound C
        # far below that and a sum of |C| exceeds the bound (a fault, its sums fail)
        unformed = inputs_ok & ~thr_ok if nf_c is None else inputs_ok & ~thr_ok & ~c_bad
        if torch.compiler.is_compiling() or bool(unformed.any()):     # (no branch on data when traced)
            peak = _peak(ast, bst, alpha, addend, bm, bn) if peak is None else peak
            beyond = _tile_any(col_view(_beyond(cs[2], peak.repeat_interleave(bn, -1)[..., :n], bm, ex_c), False)) \
                | _tile_any(row_view(_beyond(rs[2], peak.repeat_interleave(bm, -2)[..., :m, :], bn, ex_r), False))
            status = torch.where(unformed & beyond, L.OK, status)

        # Ratios: 0 in unverified tiles; a sum over a non-finite element of a NONFINITE tile fails
        # (inf), so the sums locate it.
        inf = float("inf")
        keep = ((status == L.OK) | (status == L.NONFINITE)).unsqueeze(-1)
        rat_c, rat_r = res_c / thr_c, res_r / thr_r
        if nf_c is not None:
            rat_c = torch.where(nf_c > 0, inf, rat_c)
            rat_r = torch.where(nf_r > 0, inf, rat_r)
        rat_c = torch.nan_to_num(rat_c, inf, inf, -inf)
        rat_r = torch.nan_to_num(rat_r, inf, inf, -inf)
        zero = rat_c.new_zeros(())
        rc = torch.where(keep, col_view(rat_c, 0.0), zero)                       # (..., TM, TN, BN)
        rr = torch.where(keep, row_view(rat_r, 0.0), zero)                       # (..., TM, TN, BM)
        sc_c, sc_r = torch.exp2(ex_c), torch.exp2(ex_r)
        sums = dict(res_col=res_c * sc_c, thr_col=thr_c * sc_c, res_row=res_r * sc_r, thr_row=thr_r * sc_r)
        verdict = _records(rc, rr, sums, status, bm, bn)
        detail = (rr.transpose(-2, -1).flatten(-3, -2)[..., :m, :].float(),  # (..., M, TN)
                  rc.flatten(-2, -1)[..., :n].float())                        # (..., TM, N)
        if return_sums:
            return verdict, detail, sums
    return verdict, detail


def _col_view(z, bn, v):
    """Column sums (..., TM, N) as tiles (..., TM, TN, BN), padded with ``v``."""
    return _pad_blocks(z, bn, v)


def _row_view(z, bm, v):
    """Row sums (..., M, TN) as tiles (..., TM, TN, BM), padded with ``v``."""
    return _pad_blocks(z.mT, bm, v).transpose(-3, -2)


def _records(rc, rr, sums, status, bm, bn):
    """The tile records (..., TM, TN, NFIELDS), float32, from the sums' ratios as tiles (``rc``
    (..., TM, TN, BN), ``rr`` (..., TM, TN, BM)), their residuals and thresholds in C's units
    (``sums``, as ``return_sums`` gives them) and the tiles' status."""
    tm, tn = rc.shape[-3], rc.shape[-2]
    q_off = torch.arange(tn, device=rc.device, dtype=F64) * bn
    p_off = (torch.arange(tm, device=rc.device, dtype=F64) * bm).unsqueeze(-1)
    cw, cf, cidx, cres, cthr = _tile_fields(rc, _col_view(sums["res_col"], bn, 0.0),
                                            _col_view(sums["thr_col"], bn, 1.0), q_off)
    rw, rf, ridx, rres, rthr = _tile_fields(rr, _row_view(sums["res_row"], bm, 0.0),
                                            _row_view(sums["thr_row"], bm, 1.0), p_off)
    use_col = cf > 0
    return torch.stack([rw, rf, ridx, cw, cf, cidx, torch.where(use_col, cres, rres),
                        torch.where(use_col, cthr, rthr), status.to(F64)], -1).float()


# The second look: products lost below the accumulator's last bit.
#
# A GEMM that adds its products to a running sum much larger than they are loses each one below
# half an ulp of it and rounds those near an ulp the same way each time; products of one sign then
# err as their count, not as the random walk the threshold allows. It happens where the accumulator
# starts at a large addend (torch's CPU float32 addmm of one to three rows starts at the bias) or
# at one large product among many tiny ones. Allowed in every sum, it would loosen a linear's
# thresholds 14-59-fold (its bound is K u |running sum| an element); so it is allowed only in a sum
# that has failed. The products of each element of the failing sums are recomputed in float64:
#     p_k = alpha a_ik b_kj,   S_ij = |addend_ij| + 2 max_k |p_1 + ... + p_k|,
# S bounds every running sum of an order that adds runs of consecutive k (sequential, blocked,
# split, reversed, pairwise) from the addend. A step errs by at most min(|p_k|, u S) (the running sum
# itself is a neighbour of the exact value, and rounding is to half an ulp). The small products,
# |p_k| < 4 u S_ij (two ulps of the largest running sum), are the ones whose rounding may take one
# direction; they are grouped in bands of a factor of two in |p_k| / (4 u S_ij), and the sum's
# threshold grows by what the bands' losses L_b = sum over the sum's elements and the band's products
# of sign(p_k) min(|p_k|, u S_ij) hold beyond a random walk of their terms (which the threshold
# models): max(0, sum over bands of |L_b| - 2 sqrt(sum of the terms' squares)). Where the small
# products have one sign that is nearly all of their loss (at most twice the worst-case bound, S
# being at most |addend| + 2 sum |p|); where signs are mixed, next to nothing. Larger products round
# at their running sum's scale, as the threshold's random walk models. The allowance comes from the
# operands alone, so a fault in C cannot move it.
# It runs where the verdict is on the host (the CPU; elsewhere, finding the failing sums would
# synchronise), within LOOK_BUDGET products: a fault that fails more sums stays alarmed.
LOOK_BUDGET = 2 ** 27
_LOOK_CHUNK = 2 ** 22           # products per step
_BANDS = 32                     # bands of |p| / (4 u S), a factor of two each (the last: all below)
_RANDOM = 2.0                   # the terms' random walk, in its standard deviations, left to the threshold


def _looks(verdict):
    return verdict.device.type == "cpu" and not torch.compiler.is_compiling()


def _summarised(out, summary):
    """``out`` with ``layout.summary`` of its verdict last where it is asked for or the second look
    runs (else None)."""
    return (*out, L.summary(out[0]) if summary or _looks(out[0]) else None)


def _second_look(out, run, a, b, c, kw, return_sums):
    """``out`` (a check's results, its summary last) with the failing sums' thresholds grown by the
    allowance above, and their tiles' records, ratios and summary made again; ``run(True)`` gives
    the check's results with its sums, which the look needs."""
    verdict, (det_r, det_c) = out[0], out[1]
    if not _looks(verdict) or not out[-1][0]:
        return out                                  # (or no tile alarmed)
    m, n, k = c.shape[-2], c.shape[-1], a.shape[-1]
    bm, bn = max(1, min(kw["bm"], m)), max(1, min(kw["bn"], n))
    batch = c.shape[:-2]
    tm, tn = verdict.shape[-3], verdict.shape[-2]
    per_col = lambda t: t.repeat_interleave(bn, -1)[..., :n]         # (..., T, TN) -> (..., T, N)
    per_row = lambda t: t.repeat_interleave(bm, -2)[..., :m, :]      # (..., TM, T) -> (..., M, T)
    status = verdict[..., L.STATUS]
    ok = status == L.OK
    fail_c = (det_c.abs() > 1) & per_col(ok)                                         # (..., TM, N)
    fail_r = (det_r.abs() > 1) & per_row(ok)                                         # (..., M, TN)
    f = (per_row(fail_c) | per_col(fail_r)).flatten().nonzero().squeeze(-1)         # the elements
    if len(f) == 0 or len(f) * max(k, 1) > LOOK_BUDGET:
        return out
    sums = (out if return_sums else run(True))[2]
    bi, i, j = f // (m * n), f // n % m, f % n
    lead = torch.unravel_index(bi, batch) if batch else ()
    bands = _absorbed(a, b, kw["addend"], kw["beta"], kw["alpha"], lead, i, j, c.shape, kw["units"].acc)

    def grow(key, size):
        z = torch.zeros(size, 2 * _BANDS, dtype=F64).index_add_(0, key, bands)
        lost, sq = z[:, :_BANDS], z[:, _BANDS:]
        return (lost.abs().sum(-1) - _RANDOM * sq.sum(-1).sqrt()).clamp_(min=0)
    nb = math.prod(batch)
    thr_c = sums["thr_col"] + grow((bi * tm + i // bm) * n + j, nb * tm * n).view(sums["thr_col"].shape)
    thr_r = sums["thr_row"] + grow((bi * m + i) * tn + j // bn, nb * m * tn).view(sums["thr_row"].shape)
    rat_c, rat_r = sums["res_col"] / thr_c, sums["res_row"] / thr_r
    # the tiles looked at: each holds a failing sum, and every sum of it a usable ratio
    good = lambda thr, rat: torch.isfinite(thr) & (thr > 0) & torch.isfinite(rat)
    looked = ok & (_tile_any(_col_view(fail_c, bn, False)) | _tile_any(_row_view(fail_r, bm, False))) \
        & _tile_all(_col_view(good(thr_c, rat_c), bn, True)) & _tile_all(_row_view(good(thr_r, rat_r), bm, True))
    grown = dict(sums, thr_col=thr_c, thr_row=thr_r)
    again = _records(_col_view(rat_c, bn, 0.0), _row_view(rat_r, bm, 0.0), grown, status, bm, bn)
    verdict = torch.where(looked.unsqueeze(-1), again, verdict)
    det_c = torch.where(per_col(looked), rat_c.float(), det_c)
    det_r = torch.where(per_row(looked), rat_r.float(), det_r)
    res = (verdict, (det_r, det_c))
    if return_sums:
        res += (dict(sums, thr_col=torch.where(per_col(looked), thr_c, sums["thr_col"]),
                     thr_row=torch.where(per_row(looked), thr_r, sums["thr_row"])),)
    return (*res, L.summary(verdict))


def _absorbed(a, b, addend, beta, alpha, lead, i, j, shape, unit):
    """(len(i), 2 _BANDS) float64: per element (``lead`` (its batch indices), ``i``, ``j``) of a
    product of ``shape``, the sums of its small products' losses (above) by band of
    |p_k| / (4 u S), then the sums of their squares."""
    *batch, m, n = shape
    k = a.shape[-1]
    ae = a.expand(*batch, m, k)
    bt = b.expand(*batch, k, n).mT
    d = None
    if addend is not None:
        d = torch.broadcast_to(addend.to(F64) * float(beta), shape)
    out = torch.zeros(len(i), 2 * _BANDS, dtype=F64)
    step = max(1, _LOOK_CHUNK // max(k, 1))
    for r0 in range(0, len(i), step):
        part = slice(r0, r0 + step)
        ld, ip, jp = tuple(x[part] for x in lead), i[part], j[part]
        p = ae[(*ld, ip)].to(F64) * bt[(*ld, jp)].to(F64) * float(alpha)
        s = 2 * p.cumsum(-1).abs().amax(-1) if k else p.new_zeros(len(ip))
        if d is not None:
            s = s + d[(*ld, ip, jp)].abs()
        rel = p.abs() / (4 * unit * s).unsqueeze(-1)
        band = (-torch.frexp(rel)[1]).clamp_(0, _BANDS - 1)        # rel in [2^-b-1, 2^-b): band b
        # a step errs by at most min(|p_k|, u |running sum|): the sum itself is a neighbour of the
        # exact value, and it rounds to half an ulp
        lost = torch.minimum(p.abs(), (unit * s).unsqueeze(-1)).copysign(p)
        lost = torch.where(rel < 1, lost, 0.0)
        out[part, :_BANDS].scatter_add_(1, band, lost)
        out[part, _BANDS:].scatter_add_(1, band, lost * lost)
    return out


def _tile_all(z):
    return z.all(-1)


def _tile_any(z):
    return z.any(-1)


def _proves_fault(res, thr, nf, ex, dtype, view):
    """(..., TM, TN) bool: a sum over exactly one non-finite element whose true value, the sum's
    residual without it (its estimate, up to the threshold), is finite in ``dtype``: a fault, not
    an overflow."""
    limit = torch.finfo(dtype).max * torch.exp2(-ex)
    est = (-res).abs() + thr
    return _tile_any(view((nf == 1) & (est < limit), False))


def _beyond(sa, peak, count, ex):
    """Sums of |C| (in units of 2^ex) above twice what ``count`` elements of at most ``peak``
    each (C's units) can add up to, that bound finite: an element beyond the operands' bound."""
    bound = 2.0 * count * peak * torch.exp2(-ex)
    return torch.isfinite(bound) & ~(sa <= bound)


def _peak(ast, bst, alpha, addend, bm, bn):
    """(..., TM, TN): a bound of |alpha a_i . b_j + addend_ij| over the tile (Cauchy-Schwarz, in
    C's units): below the dtype's maximum, no element can overflow."""
    ra = torch.sqrt(ast.r1) * torch.exp2(ast.e)
    rb = torch.sqrt(bst.r1) * torch.exp2(bst.e)
    peak = _pad_blocks(ra, bm, 0.0).amax(-1).unsqueeze(-1) * \
        _pad_blocks(rb, bn, 0.0).amax(-1).unsqueeze(-2) * abs(alpha)
    if addend is not None:
        m, n = ra.shape[-1], rb.shape[-1]
        d = addend.abs().expand(*addend.shape[:-2], m, n)
        d = _pad_blocks(d.mT, bm, 0.0).amax(-1).mT                  # (..., TM, N)
        peak = peak + _pad_blocks(d, bn, 0.0).amax(-1)
    return peak


def _tile_fields(ratio, res, thr, offset):
    """ratio/res/thr: (..., TM, TN, B) sums of each tile -> worst ratio, failing count, global
    index, residual and threshold of the worst sum, each (..., TM, TN)."""
    mag = ratio.abs()
    worst, idx = mag.max(-1)
    fails = torch.count_nonzero(mag > 1, dim=-1).to(ratio.dtype)
    where = idx.to(ratio.dtype) + offset
    where = torch.where(fails > 0, where, -1.0)
    pick = idx.unsqueeze(-1)
    return worst, fails, where, res.gather(-1, pick).squeeze(-1), thr.gather(-1, pick).squeeze(-1)
