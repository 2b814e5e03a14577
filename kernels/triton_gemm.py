"""The fused checked GEMM: C = A.B (+ bias) with Huang-Abraham checks on the fp32 accumulator.

Design (per output tile of BM x BN, per K step of BK):
- the product: ``acc += tl.dot(a, b)`` (fp32 accumulation; tf32 for fp32 inputs only when the
  user's torch setting allows it);
- the predicted sums, in the same K loop from the tiles already in registers:
  column sums ``pc += sum_k (sum_i a_ik) b_kj`` and row sums ``pr += sum_k a_ik (sum_j b_kj)``;
- the magnitudes of the threshold, exactly (the reference backend can only bound them):
  ``qc += sum_k (sum_i a_ik^2 + s_k^2) b_kj^2`` and ``qr`` likewise, the row keys sum_k a_ik^2
  (repeated rows), and for K <= SMALL_K the exact sum |a||b| of the worst-case cap;
- after the loop, on the accumulator before it is rounded: column and row sums of acc, of acc^2
  and of |acc|, residuals, thresholds (``abft.tolerance``'s model with u_out = 0: a bf16 GEMM is
  checked at fp32 resolution), and one verdict record per tile in ``kernels/layout.py``'s format.

Cost per K step, beside the BM.BN.BK multiply-adds of the dot: the predictions take BK(BM + BN)
multiply-adds, the magnitudes about 3 BK(BM + BN), all on CUDA cores in fp32: 4 (1/BM + 1/BN) of the
dot's work, 6% at 128 x 128, but at CUDA-core rather than tensor-core speed (about 15x slower on
Hopper), so the check costs more than the 3% target there. Bytes: none beyond the tiles the dot
loads, plus BM + BN + 9 floats written per tile. Choosing that (no pre-pass over A or B, no second
read) keeps the kernel one pass; moving the predictions onto tensor cores (rows of s split into
bf16 hi/lo parts appended to the A tile) is the next step and needs a GPU to measure.
Not measured on a GPU yet: no device was lent to the session that wrote it.

In-kernel fault injection (constexpr INJECT: 1 bit flip, 2 add a value, 3 zero) corrupts one
accumulator element after a chosen K step; with INJECT = 0 it is compiled out. CHECK = False
compiles the checks out (same kernel, for the overhead measurement).
"""
import torch
import triton
import triton.language as tl

from abft.kernels import configs as _configs
from abft.kernels import layout as L
from abft.tolerance import LAMBDA, SMALL_K, TF32_UNIT, gamma, low_entropy, rho

INJECT_KINDS = {"bitflip": 1, "add": 2, "zero": 3}


@triton.jit
def _checked_gemm_kernel(
    # operands, output, bias
    a_ptr, b_ptr, c_ptr, bias_ptr,
    # verdict (B, TM, TN, 9), row ratios (B, M, TN), column ratios (B, TM, N), low-entropy flags
    v_ptr, rr_ptr, rc_ptr, alow_ptr, blow_ptr,
    # sizes
    M, N, K, TM, TN,
    # strides
    stride_ab, stride_am, stride_ak,
    stride_bb, stride_bk, stride_bn,
    stride_cb, stride_cm, stride_cn,
    # threshold constants
    u, ut2, lam, rho_k, tiny, g_cap, g_bm, g_bn,
    # fault injection: batch, row, column, K step, bit, value
    inj_b, inj_m, inj_n, inj_k, inj_bit, inj_val,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, CHECK: tl.constexpr, INJECT: tl.constexpr,
    DOT_FP32: tl.constexpr, ALLOW_TF32: tl.constexpr, CAP: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    pid_b = tl.program_id(1).to(tl.int64)
    pid_m = pid // TN
    pid_n = pid % TN
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    a_base = a_ptr + pid_b * stride_ab
    b_base = b_ptr + pid_b * stride_bb

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    pc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    pr = tl.zeros((BLOCK_M,), dtype=tl.float32)
    qc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    qr = tl.zeros((BLOCK_M,), dtype=tl.float32)
    ka = tl.zeros((BLOCK_M,), dtype=tl.float32)       # row keys: sum_k a^2
    kb = tl.zeros((BLOCK_N,), dtype=tl.float32)       # column keys: sum_k b^2
    tc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    tr = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for ks in range(0, tl.cdiv(K, BLOCK_K)):
        kk = ks * BLOCK_K + rk
        k_ok = kk < K
        a = tl.load(a_base + rm[:, None] * stride_am + kk[None, :] * stride_ak,
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_base + kk[:, None] * stride_bk + rn[None, :] * stride_bn,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if DOT_FP32:
            # the interpreter's bf16 tl.dot is wrong; bf16 products are exact in fp32
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), allow_tf32=False)
        else:
            acc += tl.dot(a, b, allow_tf32=ALLOW_TF32)
        if CHECK:
            af = a.to(tl.float32)
            bf = b.to(tl.float32)
            sa = tl.sum(af, 0)
            sb = tl.sum(bf, 1)
            pc += tl.sum(sa[:, None] * bf, 0)
            pr += tl.sum(af * sb[None, :], 1)
            a2 = af * af
            b2 = bf * bf
            ca2 = tl.sum(a2, 0)
            rb2 = tl.sum(b2, 1)
            qc += tl.sum((ca2 + sa * sa)[:, None] * b2, 0)
            qr += tl.sum(a2 * (rb2 + sb * sb)[None, :], 1)
            ka += tl.sum(a2, 1)
            kb += tl.sum(b2, 0)
            if CAP:
                tc += tl.sum(tl.sum(tl.abs(af), 0)[:, None] * tl.abs(bf), 0)
                tr += tl.sum(tl.abs(af) * tl.sum(tl.abs(bf), 1)[None, :], 1)
        if INJECT != 0:
            hit = (rm[:, None] == inj_m) & (rn[None, :] == inj_n) & (pid_b == inj_b) & (ks == inj_k)
            if INJECT == 1:
                flipped = (acc.to(tl.int32, bitcast=True) ^ (1 << inj_bit)).to(tl.float32, bitcast=True)
                acc = tl.where(hit, flipped, acc)
            elif INJECT == 2:
                acc = tl.where(hit, acc + inj_val, acc)
            else:
                acc = tl.where(hit, 0.0, acc)

    if CHECK:
        kf = K * 1.0
        colsum = tl.sum(acc, 0)
        rowsum = tl.sum(acc, 1)
        # squares of a corrupted accumulator may overflow; clamped, a huge error stays an alarm
        big = 3.4028234663852886e38
        colsq = tl.minimum(tl.sum(acc * acc, 0), big)
        rowsq = tl.minimum(tl.sum(acc * acc, 1), big)
        colsum2 = tl.minimum(colsum * colsum, big)
        rowsum2 = tl.minimum(rowsum * rowsum, big)
        colabs = tl.sum(tl.abs(acc), 0)
        rowabs = tl.sum(tl.abs(acc), 1)
        # repeated rows (columns) within the tile have identical errors
        ka = tl.where(m_ok, ka, -1.0 - tl.arange(0, BLOCK_M).to(tl.float32))
        kb = tl.where(n_ok, kb, -1.0 - tl.arange(0, BLOCK_N).to(tl.float32))
        nu_m = tl.max(tl.sum((ka[:, None] == ka[None, :]).to(tl.float32), 1), 0)
        nu_n = tl.max(tl.sum((kb[:, None] == kb[None, :]).to(tl.float32), 1), 0)
        alow = tl.load(alow_ptr + rm, mask=m_ok, other=0)
        blow = tl.load(blow_ptr + rn, mask=n_ok, other=0)
        low_m = tl.max(alow, 0) > 0
        low_n = tl.max(blow, 0) > 0
        bmf = BLOCK_M * 1.0
        bnf = BLOCK_N * 1.0
        u2 = u * u
        # column sums (over the tile's BM rows)
        # the small units multiply first: a clamped (huge) square must not overflow the sum
        var_c = nu_m * ((u2 * kf) * (colsq / 9 + qc / 6) + (2.0 / 3.0) * ut2 * qc) \
            + (u2 * kf) * (pc * pc / 9 + qc / 6) + (u2 * bmf) * (colsum2 / 9 + colsq / 6 + qc / 6)
        thr_c = lam * tl.sqrt(var_c) + rho_k * 2 * u * tl.abs(pc) + tiny
        thr_c += tl.where(low_m & (blow > 0), ((kf / 2) * 2 * u + bmf * u) * colabs, 0.0)
        # row sums (over the tile's BN columns)
        var_r = nu_n * ((u2 * kf) * (rowsq / 9 + qr / 6) + (2.0 / 3.0) * ut2 * qr) \
            + (u2 * kf) * (pr * pr / 9 + qr / 6) + (u2 * bnf) * (rowsum2 / 9 + rowsq / 6 + qr / 6)
        thr_r = lam * tl.sqrt(var_r) + rho_k * 2 * u * tl.abs(pr) + tiny
        thr_r += tl.where(low_n & (alow > 0), ((kf / 2) * 2 * u + bnf * u) * rowabs, 0.0)
        if CAP:
            thr_c = tl.maximum(tl.minimum(thr_c, (g_cap * tc + g_bm * colabs) * (1 - 8 * u)), tiny)
            thr_r = tl.maximum(tl.minimum(thr_r, (g_cap * tr + g_bn * rowabs) * (1 - 8 * u)), tiny)
        res_c = colsum - pc
        res_r = rowsum - pr
        inputs_ok = (tl.sum(qc, 0) + tl.sum(qr, 0)) < float("inf")
        acc_ok = tl.sum(tl.abs(colsum), 0) < float("inf")
        thr_ok = (tl.sum(thr_c, 0) + tl.sum(thr_r, 0)) < float("inf")
        status = tl.where(inputs_ok & thr_ok & acc_ok, 0.0, 1.0)
        status = tl.where(inputs_ok & (acc_ok == 0), 2.0, status)
        unverified = status == 1.0
        rat_c = tl.where(unverified, 0.0, tl.where(n_ok, res_c / thr_c, 0.0))
        rat_r = tl.where(unverified, 0.0, tl.where(m_ok, res_r / thr_r, 0.0))
        rat_c = tl.where(rat_c == rat_c, rat_c, float("inf"))          # NaN -> failing
        rat_r = tl.where(rat_r == rat_r, rat_r, float("inf"))
        mag_c = tl.abs(rat_c)
        mag_r = tl.abs(rat_r)
        cw = tl.max(mag_c, 0)
        rw = tl.max(mag_r, 0)
        ci = tl.argmax(mag_c, 0)
        ri = tl.argmax(mag_r, 0)
        cf = tl.sum((mag_c > 1).to(tl.float32), 0)
        rf = tl.sum((mag_r > 1).to(tl.float32), 0)
        col_at = tl.where(cf > 0, (pid_n * BLOCK_N + ci).to(tl.float32), -1.0)
        row_at = tl.where(rf > 0, (pid_m * BLOCK_M + ri).to(tl.float32), -1.0)
        sel_c = tl.arange(0, BLOCK_N) == ci
        sel_r = tl.arange(0, BLOCK_M) == ri
        res_w = tl.where(cf > 0, tl.sum(tl.where(sel_c, res_c, 0.0), 0), tl.sum(tl.where(sel_r, res_r, 0.0), 0))
        thr_w = tl.where(cf > 0, tl.sum(tl.where(sel_c, thr_c, 0.0), 0), tl.sum(tl.where(sel_r, thr_r, 0.0), 0))
        f = tl.arange(0, 16)
        rec = tl.where(f == 0, rw, tl.where(f == 1, rf, tl.where(f == 2, row_at, tl.where(
            f == 3, cw, tl.where(f == 4, cf, tl.where(f == 5, col_at, tl.where(
                f == 6, res_w, tl.where(f == 7, thr_w, status))))))))
        v_off = ((pid_b * TM + pid_m) * TN + pid_n) * 9
        tl.store(v_ptr + v_off + f, rec, mask=f < 9)
        tl.store(rr_ptr + (pid_b * M + rm) * TN + pid_n, rat_r, mask=m_ok)
        tl.store(rc_ptr + (pid_b * TM + pid_m) * N + rn, rat_c, mask=n_ok)

    out = acc
    if HAS_BIAS:
        out += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c_base = c_ptr + pid_b * stride_cb
    tl.store(c_base + rm[:, None] * stride_cm + rn[None, :] * stride_cn,
             out.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _as3(t):
    return t if t.dim() == 3 else t.unsqueeze(0)


def checked_gemm(a, b, bias=None, *, tiles=None, check=True, inject=None, block_k=None):
    """C = a @ b (+ bias) with in-kernel checks.

    Args:
        a: (M, K) or (B, M, K), any strides (a batch stride of 0 broadcasts).
        b: (K, N) or (B, K, N), any strides.
        bias: (N,) or None.
        tiles: (BM, BN) or None (``configs.tile``).
        check: False compiles the checks out.
        inject: dict(kind=bitflip|add|zero, batch=0, row=, col=, k_step=0, bit=, value=) or None.
        block_k: BK (default: the config's).

    Returns:
        c: (M, N) or (B, M, N) in a's dtype; verdict (B, TM, TN, 9) float32 in
        ``kernels/layout.py``'s format (None when ``check`` is False); detail
        (row ratios (B, M, TN), column ratios (B, TM, N)).
    """
    if a.dtype not in (torch.float32, torch.float16, torch.bfloat16) or b.dtype != a.dtype:
        raise TypeError(f"checked_gemm: float32/float16/bfloat16 operands of one dtype, got {a.dtype}, {b.dtype}")
    squeeze = a.dim() == 2 and b.dim() == 2
    a3, b3 = _as3(a), _as3(b)
    bt = max(a3.shape[0], b3.shape[0])
    if a3.shape[0] != bt:
        a3 = a3.expand(bt, *a3.shape[1:])
    if b3.shape[0] != bt:
        b3 = b3.expand(bt, *b3.shape[1:])
    _, m, k = a3.shape
    n = b3.shape[2]
    if b3.shape[1] != k:
        raise RuntimeError(f"checked_gemm: shapes {tuple(a.shape)} and {tuple(b.shape)} cannot be multiplied")
    bm, bn = tiles or _configs.tile(m, n, k, a.dtype)
    bk = block_k or _configs.configs(bm, bn, k, a.dtype)[0].kwargs["BLOCK_K"]
    tm, tn = triton.cdiv(m, bm), triton.cdiv(n, bn)
    dev = a.device
    c = torch.empty(bt, m, n, dtype=a.dtype, device=dev)
    verdict = torch.empty(bt, tm, tn, L.NFIELDS, dtype=torch.float32, device=dev)
    rr = torch.empty(bt, m, tn, dtype=torch.float32, device=dev)
    rc = torch.empty(bt, tm, n, dtype=torch.float32, device=dev)
    if check:
        alow = low_entropy(a3).any(0).to(torch.int8).contiguous()
        blow = low_entropy(b3.mT).any(0).to(torch.int8).contiguous()
    else:
        alow = torch.zeros(m, dtype=torch.int8, device=dev)
        blow = torch.zeros(n, dtype=torch.int8, device=dev)
    tf32 = a.dtype == torch.float32 and dev.type == "cuda" and torch.backends.cuda.matmul.allow_tf32
    u = 2.0 ** -24
    inj = inject or {}
    kind = INJECT_KINDS[inj["kind"]] if inject else 0
    bit = int(inj.get("bit", 0))
    grid = (tm * tn, bt)
    _checked_gemm_kernel[grid](
        a3, b3, c, bias if bias is not None else c,
        verdict, rr, rc, alow, blow,
        m, n, k, tm, tn,
        a3.stride(0), a3.stride(1), a3.stride(2),
        b3.stride(0), b3.stride(1), b3.stride(2),
        c.stride(0), c.stride(1), c.stride(2),
        u, (TF32_UNIT ** 2) if tf32 else 0.0, LAMBDA, rho(max(k, 1)), torch.finfo(torch.float32).tiny,
        2 * gamma(k, u) + gamma(bm, u), gamma(bm, u), gamma(bn, u),
        int(inj.get("batch", 0)), int(inj.get("row", -1)), int(inj.get("col", -1)),
        int(inj.get("k_step", 0)), bit, float(inj.get("value", 0.0)),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, HAS_BIAS=bias is not None, CHECK=check, INJECT=kind,
        DOT_FP32=_configs.interpreting() and a.dtype == torch.bfloat16, ALLOW_TF32=tf32,
        CAP=check and k <= SMALL_K,
    )
    if squeeze:
        c = c[0]
    if not check:
        return c, None, None
    return c, verdict, (rr, rc)


def tiles_for(m, n, k, dtype):
    return _configs.tile(m, n, k, dtype)


__all__ = ["checked_gemm", "tiles_for", "INJECT_KINDS"]
