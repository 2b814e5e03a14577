"""The fused checked GEMM: C = alpha * A.B + beta * D, with Huang-Abraham checks of A.B's fp32
accumulator before it is rounded.

Design (per output tile of BM x BN, per K step of BK):
- before the launch, the operand statistics of ``abft.kernels.stats`` (one pass over A and one
  over B, or the weight's kept statistics): per row and per block of rows the scale exponents,
  the norms the threshold's magnitude bound is built from, the repeated-row multiplicity and the
  low-entropy flags. The reference backend builds its thresholds from the same statistics;
- the K loop: ``acc += tl.dot(a, b)`` (fp32 accumulation; tf32 for fp32 inputs only when the
  user's torch setting allows it), and the predicted sums from the tiles already in registers:
  column sums ``pc += sum_k (sum_i a_ik) b_kj`` and row sums ``pr += sum_k a_ik (sum_j b_kj)``;
  for K <= SMALL_K also the exact sums of |a||b| of the worst-case cap;
- after the loop, on the accumulator before it is rounded: its column and row sums, sums of
  squares and of magnitudes, each side scaled by exact powers of two (2^-(E_p + f_j) for the column
  sums, 2^-(e_i + F_q) for the row sums), the residuals, the thresholds (``threshold.threshold_tl``:
  ``abft.kernels.threshold``'s model, u_out = 0, so a bf16 GEMM is checked at fp32 resolution), and
  one verdict record per tile in ``kernels/layout.py``'s format; then the epilogue
  alpha * acc + beta * D in fp32 (D: linear's bias, addmm's or baddbmm's input, any strides) and one
  rounding to the output dtype.

Cost per K step beside the BM.BN.BK multiply-adds of the dot: the predictions take BK (BM + BN)
multiply-adds on CUDA cores: 2 (1/BM + 1/BN) of the dot's work at CUDA-core speed. The magnitudes
cost nothing in the loop: they come from the statistics, O(MK + KN) once per call. Bytes: the
statistics pass reads A and B once more (a kept weight's, not at all) and writes O(M + N) floats;
the kernel writes BM + BN + 9 floats per tile. Not measured on a GPU yet: no device was lent to the
sessions that wrote it.

The round-off model of the accumulation: under the interpreter, numpy adds a BK-term product to the
accumulator once per K step (``threshold.blocked(K, BK)``); on tensor cores, the accumulator takes
one rounding per MMA of 8 or 16 products, toward zero (``blocked(K, 8, directed=True)``); fp32
without tf32 is an FMA chain (``recursive(K)``).

tf32: a tf32 MMA fed raw fp32 operands (Triton's tl.dot) drops their 13 low mantissa bits, a
relative change in (-2^-10, 0] per input: the threshold adds the random part (variance (2/3) u_tf^2
per product, u_tf = 2^-11) and the bias, 2 u_tf |predicted sum|. The tests emulate both chopping
and rounding in the kernel on the CPU (``tf32=``).

In-kernel fault injection (constexpr INJECT: 1 bit flip, 2 add a value, 3 zero) corrupts one
accumulator element after a chosen K step; with INJECT = 0 it is compiled out. CHECK = False
compiles the checks out (same kernel, for the overhead measurement).

Launch: on a GPU the autotuner picks BK, warps and stages from ``kernels/configs.py`` per
(M, N, K) and kernel variant; the first call of a shape benchmarks (and synchronises), later ones
do not, so warm up before capturing a CUDA graph. The launch is registered with ``triton_op``
and ``wrap_triton``: torch.compile traces the kernel itself. Under the interpreter it is an
opaque custom op (wrap_triton cannot trace an interpreted kernel).
"""
from typing import List, Optional, Tuple

import torch
import triton
import triton.language as tl
from torch.library import custom_op, triton_op, wrap_triton

from abft.kernels import configs as _configs
from abft.kernels import layout as L
from abft.kernels import stats as S
from abft.kernels import threshold as T
from abft.kernels.threshold import pow2_tl, threshold_tl

INJECT_KINDS = {"bitflip": 1, "add": 2, "zero": 3}
# per-row statistics (..., R, ROW_FIELDS) and per-block (..., T, BLOCK_FIELDS), float32
ROW_E, ROW_R1, ROW_RINF, ROW_LOW = range(4)
ROW_FIELDS = 4
BLK_E, BLK_X1, BLK_XINF, BLK_XS1, BLK_XSINF, BLK_NU, BLK_LOW, BLK_FINITE = range(8)
BLOCK_FIELDS = 8

# the constants the kernel reads: the layout's fields and status codes, the statistics' fields,
# the coefficients' width (taken from their modules, not retyped)
_V = {name: tl.constexpr(getattr(L, name)) for name in
      ("ROW_RATIO", "ROW_FAILS", "ROW", "COL_RATIO", "COL_FAILS", "COL", "RESIDUAL", "THRESHOLD",
       "STATUS", "NFIELDS")}
_OK, _UNVERIFIED, _NONFINITE = (tl.constexpr(x) for x in (L.OK, L.UNVERIFIED, L.NONFINITE))
_F_ROW_RATIO, _F_ROW_FAILS, _F_ROW, _F_COL_RATIO, _F_COL_FAILS, _F_COL, _F_RES, _F_THR, _F_STATUS, \
    _NFIELDS = (_V[k] for k in ("ROW_RATIO", "ROW_FAILS", "ROW", "COL_RATIO", "COL_FAILS", "COL",
                                "RESIDUAL", "THRESHOLD", "STATUS", "NFIELDS"))
_RF, _BF, _NCOEF = tl.constexpr(ROW_FIELDS), tl.constexpr(BLOCK_FIELDS), tl.constexpr(len(T.COEF_FIELDS))
_RE, _RR1, _RRINF, _RLOW = (tl.constexpr(x) for x in (ROW_E, ROW_R1, ROW_RINF, ROW_LOW))
_BE, _BX1, _BXINF, _BXS1, _BXSINF, _BNU, _BLOW, _BFIN = (tl.constexpr(x) for x in (
    BLK_E, BLK_X1, BLK_XINF, BLK_XS1, BLK_XSINF, BLK_NU, BLK_LOW, BLK_FINITE))


@triton.jit
def _checked_gemm_kernel(
    # operands, output, addend (bias: strides 0, 0, 1)
    a_ptr, b_ptr, c_ptr, d_ptr,
    # verdict (B, TM, TN, 9), row ratios (B, M, TN), column ratios (B, TM, N); with SUMS, the
    # residual and threshold of every row sum (B, M, TN, 2) and column sum (B, TM, N, 2)
    v_ptr, rr_ptr, rc_ptr, sr_ptr, sc_ptr,
    # statistics: rows of A (B, M, 4), blocks of A (B, TM, 8), columns of B (B, N, 4), blocks of B
    # (B, TN, 8); threshold coefficients (2, len(COEF_FIELDS)): column sums, row sums
    ar_ptr, ab_ptr, br_ptr, bb_ptr, coef_ptr,
    # sizes
    M, N, K, TM, TN,
    # strides
    stride_ab, stride_am, stride_ak,
    stride_bb, stride_bk, stride_bn,
    stride_cb, stride_cm, stride_cn,
    stride_db, stride_dm, stride_dn,
    stride_arb, stride_abb, stride_brb, stride_bbb,
    # epilogue: out = alpha * acc + beta * addend
    alpha, beta,
    # fault injection: batch, row, column, K step, bit, value
    inj_b, inj_m, inj_n, inj_k, inj_bit, inj_val,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_ADD: tl.constexpr, SCALED: tl.constexpr, CHECK: tl.constexpr, INJECT: tl.constexpr,
    DOT_FP32: tl.constexpr, ALLOW_TF32: tl.constexpr, TF32_EMU: tl.constexpr, CAP: tl.constexpr,
    SUMS: tl.constexpr, ROUND_OUT: tl.constexpr,
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
        elif TF32_EMU != 0:
            # tf32 inputs emulated for the tests: 1 chops the 13 low mantissa bits (what a tf32
            # MMA does with raw fp32 operands), 2 rounds them to nearest (cvt.rna); the checks
            # below still predict from the unrounded tiles, as on the GPU
            ai = a.to(tl.int32, bitcast=True)
            bi = b.to(tl.int32, bitcast=True)
            if TF32_EMU == 2:
                ai += 4096
                bi += 4096
            at = (ai & -8192).to(tl.float32, bitcast=True)
            bt = (bi & -8192).to(tl.float32, bitcast=True)
            acc += tl.dot(at, bt, allow_tf32=False)
        else:
            acc += tl.dot(a, b, allow_tf32=ALLOW_TF32)
        if CHECK:
            af = a.to(tl.float32)
            bf = b.to(tl.float32)
            pc += tl.sum(tl.sum(af, 0)[:, None] * bf, 0)
            pr += tl.sum(af * tl.sum(bf, 1)[None, :], 1)
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
        # statistics of this tile's rows of A and columns of B, and of their blocks
        ar = ar_ptr + pid_b * stride_arb + rm * _RF
        br = br_ptr + pid_b * stride_brb + rn * _RF
        ab = ab_ptr + pid_b * stride_abb + pid_m * _BF
        bb = bb_ptr + pid_b * stride_bbb + pid_n * _BF
        e_i = tl.load(ar + _RE, mask=m_ok, other=0.0)
        r1_i = tl.load(ar + _RR1, mask=m_ok, other=1.0)
        rinf_i = tl.load(ar + _RRINF, mask=m_ok, other=1.0)
        low_i = tl.load(ar + _RLOW, mask=m_ok, other=0.0) > 0
        f_j = tl.load(br + _RE, mask=n_ok, other=0.0)
        r1_j = tl.load(br + _RR1, mask=n_ok, other=1.0)
        rinf_j = tl.load(br + _RRINF, mask=n_ok, other=1.0)
        low_j = tl.load(br + _RLOW, mask=n_ok, other=0.0) > 0
        e_p = tl.load(ab + _BE)
        f_q = tl.load(bb + _BE)
        # scale each side's sums by 2^-(block exponent + row or column exponent), exactly
        col_scale = pow2_tl(-(e_p + f_j))
        row_scale = pow2_tl(-(e_i + f_q))
        big = 3.4028234663852886e38
        zc = acc * col_scale[None, :]
        zr = acc * row_scale[:, None]
        s1_c = tl.sum(zc, 0)
        s1_r = tl.sum(zr, 1)
        # squares of a corrupted accumulator may overflow; clamped, a huge error stays an alarm
        s2_c = tl.minimum(tl.sum(zc * zc, 0), big)
        s2_r = tl.minimum(tl.sum(zr * zr, 1), big)
        p_c = pc * col_scale
        p_r = pr * row_scale
        thr_c = threshold_tl(coef_ptr, s1_c, s2_c, tl.sum(tl.abs(zc), 0), p_c,
                             tl.load(ab + _BX1), tl.load(ab + _BXINF), tl.load(ab + _BXS1),
                             tl.load(ab + _BXSINF), r1_j, rinf_j, tl.load(ab + _BNU),
                             tl.where(low_j, tl.load(ab + _BLOW), 0.0) > 0, e_p, f_j,
                             tc * col_scale, CAP)
        thr_r = threshold_tl(coef_ptr + _NCOEF, s1_r, s2_r, tl.sum(tl.abs(zr), 1), p_r,
                             tl.load(bb + _BX1), tl.load(bb + _BXINF), tl.load(bb + _BXS1),
                             tl.load(bb + _BXSINF), r1_i, rinf_i, tl.load(bb + _BNU),
                             tl.where(low_i, tl.load(bb + _BLOW), 0.0) > 0, f_q, e_i,
                             tr * row_scale, CAP)
        res_c = s1_c - p_c
        res_r = s1_r - p_r
        # status: inputs finite (statistics), accumulator finite, thresholds finite; a
        # non-finite accumulator from finite inputs is an alarm unless the product may overflow
        inputs_ok = (tl.load(ab + _BFIN) > 0) & (tl.load(bb + _BFIN) > 0)
        acc_ok = tl.sum(tl.abs(s1_c), 0) < float("inf")
        thr_ok = (tl.sum(thr_c, 0) + tl.sum(thr_r, 0)) < float("inf")
        norm_a = tl.max(tl.where(m_ok, tl.sqrt(r1_i) * pow2_tl(e_i), 0.0), 0)
        norm_b = tl.max(tl.where(n_ok, tl.sqrt(r1_j) * pow2_tl(f_j), 0.0), 0)
        may_overflow = norm_a * norm_b >= big
        status = tl.where(inputs_ok & thr_ok & acc_ok, _OK, _UNVERIFIED)
        status = tl.where(inputs_ok & (acc_ok == 0) & (may_overflow == 0), _NONFINITE, status)
        unverified = status == _UNVERIFIED
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
        # residuals and thresholds in C's units: undo the scaling, apply alpha
        unit_c = pow2_tl(e_p) * pow2_tl(f_j) * tl.abs(alpha)
        unit_r = pow2_tl(e_i) * pow2_tl(f_q) * tl.abs(alpha)
        sgn = tl.where(alpha < 0, -1.0, 1.0)
        sel_c = tl.arange(0, BLOCK_N) == ci
        sel_r = tl.arange(0, BLOCK_M) == ri
        res_w = tl.where(cf > 0, tl.sum(tl.where(sel_c, res_c * unit_c, 0.0), 0),
                         tl.sum(tl.where(sel_r, res_r * unit_r, 0.0), 0)) * sgn
        thr_w = tl.where(cf > 0, tl.sum(tl.where(sel_c, thr_c * unit_c, 0.0), 0),
                         tl.sum(tl.where(sel_r, thr_r * unit_r, 0.0), 0))
        f = tl.arange(0, 16)
        rec = tl.where(f == _F_ROW_RATIO, rw, tl.where(f == _F_ROW_FAILS, rf, tl.where(
            f == _F_ROW, row_at, tl.where(f == _F_COL_RATIO, cw, tl.where(
                f == _F_COL_FAILS, cf, tl.where(f == _F_COL, col_at, tl.where(
                    f == _F_RES, res_w, tl.where(f == _F_THR, thr_w, status))))))))
        v_off = ((pid_b * TM + pid_m) * TN + pid_n) * _NFIELDS
        tl.store(v_ptr + v_off + f, rec, mask=f < _NFIELDS)
        tl.store(rr_ptr + (pid_b * M + rm) * TN + pid_n, rat_r, mask=m_ok)
        tl.store(rc_ptr + (pid_b * TM + pid_m) * N + rn, rat_c, mask=n_ok)
        if SUMS:
            o_r = ((pid_b * M + rm) * TN + pid_n) * 2
            o_c = ((pid_b * TM + pid_m) * N + rn) * 2
            tl.store(sr_ptr + o_r, res_r * unit_r * sgn, mask=m_ok)
            tl.store(sr_ptr + o_r + 1, thr_r * unit_r, mask=m_ok)
            tl.store(sc_ptr + o_c, res_c * unit_c * sgn, mask=n_ok)
            tl.store(sc_ptr + o_c + 1, thr_c * unit_c, mask=n_ok)

    out = acc
    if SCALED:
        out = alpha * out
    if HAS_ADD:
        d = tl.load(d_ptr + pid_b * stride_db + rm[:, None] * stride_dm + rn[None, :] * stride_dn,
                    mask=m_ok[:, None] & n_ok[None, :], other=0.0)
        out += beta * d.to(tl.float32)
    if ROUND_OUT:
        # the interpreter's fp32 -> bf16 cast truncates; a GPU rounds to nearest even: do that here
        bits = out.to(tl.int32, bitcast=True)
        bits += 0x7FFF + ((bits >> 16) & 1)
        out = (bits & -65536).to(tl.float32, bitcast=True)
    c_base = c_ptr + pid_b * stride_cb
    tl.store(c_base + rm[:, None] * stride_cm + rn[None, :] * stride_cn,
             out.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _as3(t):
    return t if t.dim() == 3 else t.unsqueeze(0)


_TF32_EMU = {"truncate": 1, "nearest": 2}
_tuned = {}


def _autotuned(bm, bn, dtype):
    """The autotuner for one tile and dtype over the factory's configs; it tunes again for each
    (M, N, K) and each variant of the kernel (checked or not, epilogue, injection, tf32)."""
    key = (bm, bn, dtype)
    if key not in _tuned:
        _tuned[key] = triton.autotune(
            configs=_configs.configs(bm, bn, dtype, interpret=False),
            key=["M", "N", "K", "CHECK", "CAP", "HAS_ADD", "SCALED", "INJECT", "ALLOW_TF32"],
        )(_checked_gemm_kernel)
    return _tuned[key]


def packed_stats(st):
    """``stats.OperandStats`` -> (rows (..., R, ROW_FIELDS), blocks (..., T, BLOCK_FIELDS)), float32."""
    rows = torch.stack([st.e, st.r1, st.rinf, st.low.to(torch.float64)], -1)
    blocks = torch.stack([st.E, st.x1, st.xinf, st.xs1, st.xsinf, st.nu,
                          st.block_low().to(torch.float64), st.block_finite().to(torch.float64)], -1)
    return rows.float(), blocks.float()


def accumulation(k, dtype, tf32, bk):
    """The round-off model of this kernel's accumulation (module docstring)."""
    if _configs.interpreting():
        return T.blocked(k, bk)
    if dtype in (torch.float16, torch.bfloat16) or tf32:
        return T.blocked(k, 8, directed=True)
    return T.recursive(k)


def _launch_impl(a3: torch.Tensor, b3: torch.Tensor, addend: Optional[torch.Tensor],
                 ar: torch.Tensor, ab: torch.Tensor, br: torch.Tensor, bb: torch.Tensor,
                 coef: torch.Tensor,
                 alpha: float, beta: float, bm: int, bn: int, check: bool, tf32: bool,
                 tf32_emulation: int, inject_kind: int, inject_at: List[int], inject_value: float,
                 block_k: int, num_warps: int, num_stages: int, sums: bool,
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                            torch.Tensor]:
    """One launch over a (B, M, K) x (B, K, N) batch; block_k = 0 lets the autotuner choose (on a
    GPU) or takes the factory's one config (under the interpreter)."""
    bt, m, k = a3.shape
    n = b3.shape[2]
    tm, tn = triton.cdiv(m, bm), triton.cdiv(n, bn)
    dev = a3.device
    f32 = dict(dtype=torch.float32, device=dev)
    c = torch.empty(bt, m, n, dtype=a3.dtype, device=dev)
    verdict = torch.empty(bt, tm, tn, L.NFIELDS, **f32)
    rr = torch.empty(bt, m, tn, **f32)
    rc = torch.empty(bt, tm, n, **f32)
    sr = torch.empty(bt, m, tn, 2, **f32) if sums else torch.empty(0, **f32)
    sc = torch.empty(bt, tm, n, 2, **f32) if sums else torch.empty(0, **f32)
    if bt * tm * tn == 0:
        return c, verdict, rr, rc, sr, sc
    # without an addend, a3 stands in for it (never read): no output may alias another argument
    d = addend if addend is not None else a3
    meta = dict(BLOCK_M=bm, BLOCK_N=bn, HAS_ADD=addend is not None, SCALED=alpha != 1.0,
                CHECK=check, INJECT=inject_kind,
                DOT_FP32=_configs.interpreting() and a3.dtype == torch.bfloat16,
                ALLOW_TF32=tf32, TF32_EMU=tf32_emulation, CAP=check and k <= T.SMALL_K,
                SUMS=sums, ROUND_OUT=_configs.interpreting() and a3.dtype == torch.bfloat16)
    if block_k:
        kernel = _checked_gemm_kernel
        meta.update(BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    elif _configs.interpreting():
        kernel = _checked_gemm_kernel
        cfg = _configs.configs(bm, bn, a3.dtype)[0]
        meta.update(cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    else:
        kernel = _autotuned(bm, bn, a3.dtype)
    ib, im, jn, ik, ibit = inject_at
    bstride = lambda t: t.stride(0) if t.shape[0] > 1 else 0
    wrap_triton(kernel)[(tm * tn, bt)](
        a3, b3, c, d,
        verdict, rr, rc, sr, sc,
        ar, ab, br, bb, coef,
        m, n, k, tm, tn,
        a3.stride(0), a3.stride(1), a3.stride(2),
        b3.stride(0), b3.stride(1), b3.stride(2),
        c.stride(0), c.stride(1), c.stride(2),
        d.stride(0), d.stride(1), d.stride(2),
        bstride(ar), bstride(ab), bstride(br), bstride(bb),
        alpha, beta,
        ib, im, jn, ik, ibit, inject_value,
        **meta,
    )
    return c, verdict, rr, rc, sr, sc


def _launch_fake(a3, b3, addend, ar, ab, br, bb, coef, alpha, beta, bm, bn, check, tf32,
                 tf32_emulation, inject_kind, inject_at, inject_value, block_k, num_warps,
                 num_stages, sums):
    bt, m, _ = a3.shape
    n = b3.shape[2]
    tm, tn = -(-m // bm), -(-n // bn)
    f32 = dict(dtype=torch.float32, device=a3.device)
    return (a3.new_empty(bt, m, n), a3.new_empty(bt, tm, tn, L.NFIELDS, **f32),
            a3.new_empty(bt, m, tn, **f32), a3.new_empty(bt, tm, n, **f32),
            a3.new_empty(bt, m, tn, 2, **f32) if sums else a3.new_empty(0, **f32),
            a3.new_empty(bt, tm, n, 2, **f32) if sums else a3.new_empty(0, **f32))


if _configs.interpreting():
    # wrap_triton hands an interpreted kernel back untraced, so torch.compile cannot see into it:
    # under the interpreter the launch is an opaque custom op with a fake implementation
    _launch = custom_op("abft::checked_gemm", mutates_args=())(_launch_impl)
    _launch.register_fake(_launch_fake)
else:
    # triton_op: torch.compile traces the kernel itself (a triton_kernel_wrapper_functional node
    # that inductor schedules and CUDA graphs), not an opaque call
    _launch = triton_op("abft::checked_gemm", mutates_args=())(_launch_impl)


def checked_gemm(a, b, bias=None, *, addend=None, alpha=1.0, beta=1.0, tiles=None, check=True,
                 inject=None, tf32=None, config=None, b_stats=None, lam=None, return_sums=False):
    """C = alpha * (a @ b) + beta * addend with in-kernel checks of a @ b's fp32 accumulator.

    Args:
        a: (M, K) or (B, M, K), any strides (a batch stride of 0 broadcasts).
        b: (K, N) or (B, K, N), any strides.
        bias: (N,) or None: the addend of ``linear``.
        addend: a tensor broadcastable to C (addmm's and baddbmm's input), or None; added in
            fp32 before C is rounded, as cuBLAS does.
        tiles: (BM, BN) or None (``configs.tile``).
        check: False compiles the checks out.
        inject: dict(kind=bitflip|add|zero, batch=0, row=, col=, k_step=0, bit=, value=) or None.
        tf32: None follows torch (``torch.backends.cuda.matmul.allow_tf32`` for fp32 on CUDA);
            "truncate" or "nearest" emulate tf32 inputs in the kernel (tests on the CPU).
        config: a ``triton.Config`` to launch instead of the autotuner's choice.
        b_stats: ``stats.operand_stats(b.mT, BN)`` kept from an earlier call (a weight), or None.
        lam: threshold multiplier (None: ``threshold.LAMBDA``).
        return_sums: also return the residual and threshold of every sum, in C's units:
            dict(res_row, thr_row (B, M, TN), res_col, thr_col (B, TM, N)).

    Returns:
        c: (M, N) or (B, M, N) in a's dtype; verdict (B, TM, TN, 9) float32 in
        ``kernels/layout.py``'s format (None when ``check`` is False); detail
        (row ratios (B, M, TN), column ratios (B, TM, N)).

    Example::

        c, verdict, _ = checked_gemm(x, w.t(), bias)
        alarmed = (verdict[..., L.ROW_RATIO] > 1) | (verdict[..., L.COL_RATIO] > 1)
    """
    if a.dtype not in (torch.float32, torch.float16, torch.bfloat16) or b.dtype != a.dtype:
        raise TypeError(f"checked_gemm: float32/float16/bfloat16 operands of one dtype, got {a.dtype}, {b.dtype}")
    if bias is not None and addend is not None:
        raise TypeError("checked_gemm: give bias or addend, not both")
    squeeze = a.dim() == 2 and b.dim() == 2
    a3, b3 = _as3(a), _as3(b)
    bt = max(a3.shape[0], b3.shape[0])
    _, m, k = a3.shape
    n = b3.shape[2]
    if b3.shape[1] != k or a3.shape[0] not in (1, bt) or b3.shape[0] not in (1, bt):
        raise RuntimeError(f"checked_gemm: shapes {tuple(a.shape)} and {tuple(b.shape)} cannot be multiplied")
    add = bias if bias is not None else addend
    if add is not None and beta == 0:
        add = None                                   # torch ignores input when beta is 0
    if add is not None:
        add = add.expand(bt, m, n) if add.dim() <= 3 else add.reshape(-1, m, n)
    bm, bn = tiles or _configs.tile(m, n, k, a.dtype)
    if tf32 in ("truncate", "nearest"):
        emu, tf = _TF32_EMU[tf32], False
    else:
        emu = 0
        tf = (a.dtype == torch.float32 and a.device.type == "cuda"
              and (torch.backends.cuda.matmul.allow_tf32 if tf32 is None else bool(tf32)))
    if config is not None:
        bk = config.kwargs["BLOCK_K"]
    else:
        bk = min(cf.kwargs["BLOCK_K"] for cf in _configs.configs(bm, bn, a.dtype))
    if check:
        # statistics of the unexpanded operands: a broadcast batch is read once
        ar, ab = packed_stats(S.operand_stats(a3, bm))
        if b_stats is None:
            b_stats = S.operand_stats(b3.mT, bn)
        elif b_stats.bs != bn:
            raise ValueError(f"checked_gemm: b_stats were made for blocks of {b_stats.bs} columns, not {bn}")
        br, bb = packed_stats(b_stats)
        ar, ab, br, bb = (t if t.dim() == 3 else t.unsqueeze(0) for t in (ar, ab, br, bb))
        u = T.units(a.dtype, check=torch.float32, tf32=bool(tf or emu), stored=False,
                    flush=a.device.type == "cuda")
        acc = accumulation(k, a.dtype, tf or emu, bk)
        chk = T.blocked(k, bk)
        coef = T.pack(T.coefficients(u, k=k, bs=bm, acc=acc, chk=chk, lam=lam),
                      T.coefficients(u, k=k, bs=bn, acc=acc, chk=chk, lam=lam), device=a.device)
    else:
        ar = ab = br = bb = coef = torch.empty(1, 1, 1, dtype=torch.float32, device=a.device)
    a3 = a3.expand(bt, m, k)
    b3 = b3.expand(bt, k, n)
    inj = inject or {}
    where = [int(inj.get("batch", 0)), int(inj.get("row", -1)), int(inj.get("col", -1)),
             int(inj.get("k_step", 0)), int(inj.get("bit", 0))]
    cfg = (config.kwargs["BLOCK_K"], config.num_warps, config.num_stages) if config else (0, 0, 0)
    c, verdict, rr, rc, sr, sc = _launch(
        a3, b3, add, ar, ab, br, bb, coef, float(alpha), float(beta), bm, bn, bool(check), tf, emu,
        INJECT_KINDS[inj["kind"]] if inject else 0, where, float(inj.get("value", 0.0)), *cfg,
        bool(return_sums and check))
    if squeeze:
        c = c[0]
    if not check:
        return c, None, None
    if return_sums:
        return c, verdict, (rr, rc), dict(res_row=sr[..., 0], thr_row=sr[..., 1],
                                          res_col=sc[..., 0], thr_col=sc[..., 1])
    return c, verdict, (rr, rc)


def tiles_for(m, n, k, dtype):
    return _configs.tile(m, n, k, dtype)


__all__ = ["checked_gemm", "tiles_for", "INJECT_KINDS", "packed_stats", "accumulation"]
