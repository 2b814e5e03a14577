"""The fused checked GEMM: C = alpha * A.B + beta * D, with Huang-Abraham checks of A.B's fp32
accumulator before it is rounded.

Design: the checksums ride in the tiles, so the K loop is the unchecked GEMM's K loop.
- A pre-pass (``kernels/prepass.py``, one program per block of DM = BM - RA rows of A, and of
  DN = BN - RB columns of B) reads the operand and writes, per block, its checksum
  s_k = sum_i x_ik 2^-E split into R parts that the tensor cores multiply exactly (3 for bf16,
  fp16 and tf32, 1 for fp32), and the statistics the threshold is built from (row exponents,
  norms, multiplicities, low-entropy flags: ``stats.operand_stats``'s quantities). A weight's
  pre-passes (for x W^T and for the backward's G W) are kept between optimizer steps
  (``abft/weightcache.py``).
- The main kernel's A tile is DM data rows and RA checksum rows; its B tile DN data columns and
  RB checksum columns (R, or a vector's width where the operand is contiguous along that side,
  the extra rows zero: ``Layout``). The K loop loads the tiles and calls ``tl.dot``: nothing on
  the CUDA cores. After it, the accumulator holds C's DM x DN block, the predicted column sums in
  rows DM.. (sum_k s_k b_kj, per part) and the predicted row sums in columns DN...
- The epilogue, once per tile, on the fp32 accumulator before rounding: the data's row and column
  sums (and sums of squares and magnitudes) in power-of-two scaled units, the residuals against
  the predictions, the thresholds (``threshold.threshold_tl``: the model of
  ``abft.kernels.threshold`` with u_out = 0, so a bf16 GEMM is checked at fp32 resolution; the
  prediction is accumulated like the product, ``accumulation``), one verdict record per tile in
  ``kernels/layout.py``'s format; then alpha * acc + beta * D in fp32 and one rounding.

Cost, against an unchecked GEMM of BM x BN tiles (``abft bench --static`` compiles and counts):
- FLOPs: a checked tile computes (BM - RA)(BN - RB) elements of C for BM.BN.K multiply-adds:
  about RA/BM + RB/BN more tensor-core work (4.7% at 128 x 128 with 3 parts a side, 12.5% with
  8 and 8), plus the last tile row and column of a size that is no longer a multiple of the tile.
- Bytes: the pre-pass reads its operand twice (the first read finds the exponents that scale
  the checksums and sums; a block is K long, so with many in flight the second read comes from
  HBM) and writes R/DM of it (the parts) and 16 bytes per row; the
  main kernel reads the parts with the tiles, writes 4 BN floats of scratch per tile (the column
  sums come back through L2 in a compact layout: no register spills), the verdict and the ratios.
  A kept weight costs nothing per call. At H200's 989 TFLOP/s over 4.8 TB/s, one more read of a
  K x 4096 bf16 activation is 5% of a 4096-wide GEMM's time.
- Not measured on a GPU yet: no device was lent to the sessions that wrote it.

The round-off model of the accumulation: under the interpreter, numpy adds a BK-term product to the
accumulator once per K step (``threshold.blocked(K, BK)``); on tensor cores, the accumulator takes
one rounding per MMA of 8 or 16 products, toward zero (``blocked(K, 8, directed=True)``); fp32
without tf32 is an FMA chain (``recursive(K)``). The predictions go through the same dot.

tf32: a tf32 MMA fed raw fp32 operands (Triton's tl.dot) drops their 13 low mantissa bits, a
relative change in (-2^-10, 0] per input: the threshold adds the random part (variance (2/3) u_tf^2
per product, u_tf = 2^-11) and the bias, 2 u_tf |predicted sum|. The checksum parts are tf32
numbers, so the tf32 rounding of A is the one the check sees. The tests emulate both chopping and
rounding in the kernel on the CPU (``tf32=``).

In-kernel fault injection (constexpr INJECT: 1 bit flip, 2 add a value, 3 zero) corrupts one
accumulator element after a chosen K step; with INJECT = 0 it is compiled out. CHECK = False
compiles the checks out, and the checksum rows with them (same kernel, for the overhead
measurement).

Launch: on a GPU the autotuner picks BK, warps and stages from ``kernels/configs.py`` per
(M, N, K) and kernel variant; the first call of a shape benchmarks (and synchronises), later ones
do not, so warm up before capturing a CUDA graph. The launches are registered with ``triton_op``
and ``wrap_triton``: torch.compile traces the kernels themselves. Under the interpreter they are
opaque custom ops (wrap_triton cannot trace an interpreted kernel).
"""
from dataclasses import dataclass, fields
from typing import List, Optional, Tuple

import torch
import triton
import triton.language as tl
from torch.library import custom_op, triton_op, wrap_triton

from abft.kernels import backends as _backends
from abft.kernels import configs as _configs
from abft.kernels import layout as L
from abft.kernels import prepass as _prepass
from abft.kernels import threshold as T
from abft.kernels.threshold import pow2_tl, threshold_tl, times_pow2_tl

INJECT_KINDS = L.INJECT_KINDS

# the constants the kernel reads: the layout's fields and status codes, the pre-pass's statistics
# fields, the coefficients' width (taken from their modules, not retyped)
_V = {name: tl.constexpr(getattr(L, name)) for name in
      ("ROW_RATIO", "ROW_FAILS", "ROW", "COL_RATIO", "COL_FAILS", "COL", "RESIDUAL", "THRESHOLD",
       "STATUS", "NFIELDS")}
_OK, _UNVERIFIED, _NONFINITE = (tl.constexpr(x) for x in (L.OK, L.UNVERIFIED, L.NONFINITE))
_F_ROW_RATIO, _F_ROW_FAILS, _F_ROW, _F_COL_RATIO, _F_COL_FAILS, _F_COL, _F_RES, _F_THR, _F_STATUS, \
    _NFIELDS = (_V[k] for k in ("ROW_RATIO", "ROW_FAILS", "ROW", "COL_RATIO", "COL_FAILS", "COL",
                                "RESIDUAL", "THRESHOLD", "STATUS", "NFIELDS"))
_NCOEF = tl.constexpr(len(T.COEF_FIELDS))
_RF, _BF = tl.constexpr(_prepass.ROW_FIELDS), tl.constexpr(_prepass.BLOCK_FIELDS)
_RE, _RR1, _RRINF, _RLOW = (tl.constexpr(getattr(_prepass, f)) for f in (
    "ROW_E", "ROW_R1", "ROW_RINF", "ROW_LOW"))
_BE, _BX1, _BXINF, _BXS1, _BXSINF, _BNU, _BLOW, _BFIN = (tl.constexpr(getattr(_prepass, f)) for f in (
    "BLK_E", "BLK_X1", "BLK_XINF", "BLK_XS1", "BLK_XSINF", "BLK_NU", "BLK_LOW", "BLK_FINITE"))
_BIG = tl.constexpr(3.4028234663852886e38)        # float32's largest finite value


@triton.jit
def inject_tl(acc, hit, bit, value, INJECT: tl.constexpr):
    """The accumulator with the elements where ``hit`` corrupted (``INJECT_KINDS``: 1 flips
    ``bit``, 2 adds ``value``, 3 zeroes)."""
    if INJECT == 1:
        flipped = (acc.to(tl.int32, bitcast=True) ^ (1 << bit)).to(tl.float32, bitcast=True)
        acc = tl.where(hit, flipped, acc)
    elif INJECT == 2:
        acc = tl.where(hit, acc + value, acc)
    else:
        acc = tl.where(hit, 0.0, acc)
    return acc


@triton.jit
def store_out_tl(acc, c_ptr, d_ptr, pid_b, rm, rn, m_ok, n_ok, alpha, beta,
                 stride_cb, stride_cm, stride_cn, stride_db, stride_dm, stride_dn,
                 HAS_ADD: tl.constexpr, SCALED: tl.constexpr, ROUND_OUT: tl.constexpr):
    """The epilogue: alpha * acc + beta * addend in fp32, one rounding to C's dtype."""
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


@triton.jit
def tile_tl(TM, TN, GROUP_M: tl.constexpr):
    """This program's tile (row, column): tiles in groups of GROUP_M tile rows, so that the A and
    B tiles in flight stay in L2."""
    pid = tl.program_id(0)
    width = GROUP_M * TN
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(TM - first_m, GROUP_M)
    pid_m = (first_m + (pid % width) % size_m).to(tl.int64)
    pid_n = ((pid % width) // size_m).to(tl.int64)
    return pid_m, pid_n


@triton.jit
def dot_tl(acc, a, b, DOT_FP32: tl.constexpr, ALLOW_TF32: tl.constexpr, TF32_EMU: tl.constexpr):
    """acc + a.b, as the launch asks."""
    if DOT_FP32:
        # the interpreter's bf16 tl.dot is wrong; bf16 products are exact in fp32
        acc += tl.dot(a.to(tl.float32), b.to(tl.float32), allow_tf32=False)
    elif TF32_EMU != 0:
        # tf32 inputs emulated for the tests: 1 chops the 13 low mantissa bits (what a tf32
        # MMA does with raw fp32 operands), 2 rounds them to nearest (cvt.rna); the checksum
        # parts are tf32 numbers already, so they pass unchanged, as on the GPU
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
    return acc


@triton.jit
def line_stats_tl(ptr, ok):
    """The pre-pass's statistics of rows of A (columns of B) at ``ptr``: exponent, r1, rinf,
    low-entropy flag (masked: 0, 1, 1, False)."""
    e = tl.load(ptr + _RE, mask=ok, other=0.0)
    r1 = tl.load(ptr + _RR1, mask=ok, other=1.0)
    rinf = tl.load(ptr + _RRINF, mask=ok, other=1.0)
    low = tl.load(ptr + _RLOW, mask=ok, other=0.0) > 0
    return e, r1, rinf, low


@triton.jit
def column_sums_tl(acc, ws, d_ok, ck_m, s_t, f_q, SHIFT_A: tl.constexpr, BLOCK_N: tl.constexpr):
    """Writes the tile's column sums to the scratch ``ws`` (4 x BLOCK_N): sums, of squares
    (clamped), of magnitudes in units s_t, and the predictions, one at a time (the barriers keep
    their partial sums from being live together)."""
    j = tl.arange(0, BLOCK_N)
    tl.store(ws + 3 * BLOCK_N + j,
             times_pow2_tl(tl.sum(tl.where(ck_m[:, None], acc, 0.0), 0), -f_q - SHIFT_A))
    tl.debug_barrier()
    tl.store(ws + j, tl.sum(tl.where(d_ok, acc * s_t, 0.0), 0))
    tl.debug_barrier()
    z1 = tl.where(d_ok, acc * (s_t * 0.5), 0.0)
    tl.store(ws + BLOCK_N + j, tl.minimum(tl.sum(z1 * z1, 0), _BIG / 4) * 4)
    tl.debug_barrier()
    tl.store(ws + 2 * BLOCK_N + j, tl.sum(tl.where(d_ok, tl.abs(acc) * (s_t * 0.25), 0.0), 0) * 4)
    tl.debug_barrier()


@triton.jit
def row_sums_tl(acc, d_ok, ck_n, s_t, up_r, e_p, SHIFT_B: tl.constexpr):
    """The tile's row sums in each row's units (s_t up_r): sum, of squares (clamped), of
    magnitudes, and the prediction."""
    s1 = tl.sum(tl.where(d_ok, acc * (s_t * 0.125), 0.0), 1) * 8 * up_r
    z4 = tl.where(d_ok, acc * (s_t * 0.0625), 0.0)
    s2 = tl.minimum(tl.minimum(tl.sum(z4 * z4, 1), _BIG / 256) * 256 * up_r * up_r, _BIG)
    sa = tl.sum(tl.where(d_ok, tl.abs(acc) * (s_t * 0.03125), 0.0), 1) * 32 * up_r
    p = times_pow2_tl(tl.sum(tl.where(ck_n[None, :], acc, 0.0), 1), -e_p - SHIFT_B) * up_r
    return s1, s2, sa, p


@triton.jit
def column_sums_back_tl(ws, up_c, BLOCK_N: tl.constexpr):
    """``column_sums_tl``'s sums read back one column per thread, in each column's units
    (s_t up_c)."""
    jc = tl.arange(0, BLOCK_N)
    s1 = tl.load(ws + jc) * up_c
    s2 = tl.minimum(tl.load(ws + BLOCK_N + jc) * up_c * up_c, _BIG)
    sa = tl.load(ws + 2 * BLOCK_N + jc) * up_c
    p = tl.load(ws + 3 * BLOCK_N + jc) * up_c
    return s1, s2, sa, p


@triton.jit
def cap_sums_tl(a_base, b_base, rm, rc_n, m_ok, nc_ok, stride_am, stride_ak, stride_bk,
                stride_bn, K, e_p, f_q, up_r, up_c, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """For K <= SMALL_K: the exact sums of |a||b| of the worst-case cap, after the K loop, of
    |a| 2^-E_p and |b| 2^-F_q (in natural units a row of B near 2^124 summed past float32's
    range: the cap went to inf, and the verdict changed with the scale); per column and per row,
    in their units."""
    rk = tl.arange(0, BLOCK_K)
    tc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    tr = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for ks in range(0, tl.cdiv(K, BLOCK_K)):
        kk = ks * BLOCK_K + rk
        k_ok = kk < K
        af = tl.abs(tl.load(a_base + rm[:, None] * stride_am + kk[None, :] * stride_ak,
                            mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32))
        bf = tl.abs(tl.load(b_base + kk[:, None] * stride_bk + rc_n[None, :] * stride_bn,
                            mask=k_ok[:, None] & nc_ok[None, :], other=0.0).to(tl.float32))
        af = times_pow2_tl(af, -e_p)
        bf = times_pow2_tl(bf, -f_q)
        tc += tl.sum(tl.sum(af, 0)[:, None] * bf, 0)
        tr += tl.sum(af * tl.sum(bf, 1)[None, :], 1)
    return tc * up_c, tr * up_r


@triton.jit
def side_threshold_tl(coef_ptr, s1, s2, sa, p, blk, y1, yinf, low, ex, ey, cap, CAP: tl.constexpr):
    """``threshold_tl`` of one side's sums: ``blk`` the summed operand's block statistics; y1,
    yinf, low, ey the other operand's, per sum; ex the block's exponent."""
    return threshold_tl(coef_ptr, s1, s2, sa, p, tl.load(blk + _BX1), tl.load(blk + _BXINF),
                        tl.load(blk + _BXS1), tl.load(blk + _BXSINF), y1, yinf,
                        tl.load(blk + _BNU), tl.where(low, tl.load(blk + _BLOW), 0.0) > 0, ex, ey,
                        cap, CAP)


@triton.jit
def status_tl(ab, bb, s1_c, p_c, thr_c, nc_ok, r1_j, f_j, p_r, thr_r, m_ok, r1_i, e_i,
              scales_ok):
    """The tile's status: inputs finite (statistics), accumulator finite, thresholds finite; a
    non-finite accumulator from finite inputs is an alarm unless the product may overflow."""
    inputs_ok = (tl.load(ab + _BFIN) > 0) & (tl.load(bb + _BFIN) > 0)
    acc_ok = tl.sum(tl.where(nc_ok, tl.abs(s1_c), 0.0), 0) < float("inf")
    thr_ok = (tl.sum(tl.where(nc_ok, thr_c, 0.0), 0)
              + tl.sum(tl.where(m_ok, thr_r, 0.0), 0)) < float("inf")
    norm_a = tl.max(tl.where(m_ok, tl.sqrt(r1_i) * pow2_tl(e_i), 0.0), 0)
    norm_b = tl.max(tl.where(nc_ok, tl.sqrt(r1_j) * pow2_tl(f_j), 0.0), 0)
    may_overflow = norm_a * norm_b >= _BIG
    # the checksum rows (columns) are in their block's units: near float32's largest values
    # their products with the other operand may overflow where the data's do not
    pred_ok = (tl.min(tl.where(nc_ok, (tl.abs(p_c) < float("inf")).to(tl.int32), 1), 0)
               * tl.min(tl.where(m_ok, (tl.abs(p_r) < float("inf")).to(tl.int32), 1), 0)) > 0
    status = tl.where(inputs_ok & thr_ok & acc_ok & scales_ok & pred_ok, _OK, _UNVERIFIED)
    return tl.where(inputs_ok & (acc_ok == 0) & (may_overflow == 0), _NONFINITE, status)


@triton.jit
def ratios_tl(res, thr, ok, unverified):
    """residual / threshold per sum: 0 where masked or the tile is unverified, NaN failing."""
    rat = tl.where(unverified, 0.0, tl.where(ok, res / thr, 0.0))
    return tl.where(rat == rat, rat, float("inf"))


@triton.jit
def units_tl(alpha, s_t, up):
    """The factor that takes a sum's residual and threshold to C's units: undoes the scaling
    s_t up, applies |alpha|."""
    return tl.abs(alpha) / s_t / up


@triton.jit
def verdict_tl(v_ptr, tile, status, rat_r, res_r, thr_r, up_r, first_r, rat_c, res_c, thr_c, up_c,
               first_c, s_t, alpha, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Writes the record of the ``tile``-th tile to the verdict ``v_ptr`` (``kernels/layout.py``):
    per side the largest |ratio|, how many fail (> 1) and where the largest is (-1: none fails);
    the residual and threshold, in C's units, of the largest column's where a column fails, else
    the largest row's."""
    mag_c = tl.abs(rat_c)
    mag_r = tl.abs(rat_r)
    cw = tl.max(mag_c, 0)
    rw = tl.max(mag_r, 0)
    ci = tl.argmax(mag_c, 0)
    ri = tl.argmax(mag_r, 0)
    cf = tl.sum((mag_c > 1).to(tl.float32), 0)
    rf = tl.sum((mag_r > 1).to(tl.float32), 0)
    col_at = tl.where(cf > 0, (first_c + ci).to(tl.float32), -1.0)
    row_at = tl.where(rf > 0, (first_r + ri).to(tl.float32), -1.0)
    unit_c = units_tl(alpha, s_t, up_c)
    unit_r = units_tl(alpha, s_t, up_r)
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
    tl.store(v_ptr + tile * _NFIELDS + f, rec, mask=f < _NFIELDS)


@triton.jit
def side_out_tl(r_ptr, s_ptr, base, at, rat, res, thr, ok, up, s_t, alpha, SUMS: tl.constexpr):
    """One side's ratios at ``r_ptr + base + at``; with SUMS, its residuals and thresholds in C's
    units, in pairs at ``s_ptr + 2 (base + at)``."""
    tl.store(r_ptr + base + at, rat, mask=ok)
    if SUMS:
        unit = units_tl(alpha, s_t, up)
        off = (base + at) * 2
        tl.store(s_ptr + off, res * unit * tl.where(alpha < 0, -1.0, 1.0), mask=ok)
        tl.store(s_ptr + off + 1, thr * unit, mask=ok)


@triton.jit
def checked_gemm_kernel(
    # operands, output, addend (bias: strides 0, 0, 1)
    a_ptr, b_ptr, c_ptr, d_ptr,
    # the pre-pass's checksum parts: of A's blocks of DM rows (B, TM * RA, K), of B's blocks of DN
    # columns (B, TN * RB, K), any strides; the epilogue's scratch (B * TM * TN, 4, BLOCK_N)
    pa_ptr, pb_ptr, ws_ptr,
    # verdict (B, TM, TN, 9), row ratios (B, M, TN), column ratios (B, TM, N); with SUMS, the
    # residual and threshold of every row sum (B, M, TN, 2) and column sum (B, TM, N, 2)
    v_ptr, rr_ptr, rc_ptr, sr_ptr, sc_ptr,
    # statistics: rows of A (B, M, 4), blocks of A (B, TM, 8), columns of B (B, N, 4), blocks of B
    # (B, TN, 8); threshold coefficients (2, len(COEF_FIELDS)): column sums, row sums
    ar_ptr, ab_ptr, br_ptr, bb_ptr, coef_ptr,
    # sizes (TM, TN: tiles of DM x DN data)
    M, N, K, TM, TN,
    # strides
    stride_ab, stride_am, stride_ak,
    stride_bb, stride_bk, stride_bn,
    stride_cb, stride_cm, stride_cn,
    stride_db, stride_dm, stride_dn,
    stride_pab, stride_par, stride_pak,
    stride_pbb, stride_pbr, stride_pbk,
    stride_arb, stride_abb, stride_brb, stride_bbb,
    # epilogue: out = alpha * acc + beta * addend
    alpha, beta,
    # fault injection: batch, row, column, K step, bit, value
    inj_b, inj_m, inj_n, inj_k, inj_bit, inj_val,
    # meta-parameters: RA checksum rows and RB checksum columns per tile (0: checks compiled out)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, RA: tl.constexpr,
    RB: tl.constexpr,
    GROUP_M: tl.constexpr, A_VEC: tl.constexpr, B_VEC: tl.constexpr,
    HAS_ADD: tl.constexpr, SCALED: tl.constexpr, CHECK: tl.constexpr, INJECT: tl.constexpr,
    DOT_FP32: tl.constexpr, ALLOW_TF32: tl.constexpr, TF32_EMU: tl.constexpr, CAP: tl.constexpr,
    SUMS: tl.constexpr, ROUND_OUT: tl.constexpr, SHIFT_A: tl.constexpr, SHIFT_B: tl.constexpr,
):
    DM: tl.constexpr = BLOCK_M - RA
    DN: tl.constexpr = BLOCK_N - RB
    pid_b = tl.program_id(1).to(tl.int64)
    pid_m, pid_n = tile_tl(TM, TN, GROUP_M)
    i = tl.arange(0, BLOCK_M)
    j = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rm = pid_m * DM + i                     # global rows of the data rows i < DM
    rn = pid_n * DN + j
    m_ok = (i < DM) & (rm < M)
    n_ok = (j < DN) & (rn < N)
    # the A tile: DM data rows, then the R parts of their checksum; the B tile likewise by columns
    a_ptrs = a_ptr + pid_b * stride_ab + rm[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + pid_b * stride_bb + rk[:, None] * stride_bk + rn[None, :] * stride_bn
    a_rows = m_ok
    b_cols = n_ok
    a_step = BLOCK_K * stride_ak
    b_step = BLOCK_K * stride_bk
    if CHECK:
        ck_m = i >= DM
        ck_n = j >= DN
        pa = pa_ptr + pid_b * stride_pab + (pid_m * RA + i - DM)[:, None] * stride_par \
            + rk[None, :] * stride_pak
        pb = pb_ptr + pid_b * stride_pbb + (pid_n * RB + j - DN)[None, :] * stride_pbr \
            + rk[:, None] * stride_pbk
        a_ptrs = tl.where(ck_m[:, None], pa, a_ptrs)
        b_ptrs = tl.where(ck_n[None, :], pb, b_ptrs)
        a_rows = m_ok | ck_m
        b_cols = n_ok | ck_n
        a_step = tl.where(ck_m, BLOCK_K * stride_pak, BLOCK_K * stride_ak)[:, None]
        b_step = tl.where(ck_n, BLOCK_K * stride_pbk, BLOCK_K * stride_bk)[None, :]
        # an operand contiguous along the data/checksum boundary: RA (RB) is a vector's width and
        # the host checked the alignment, so every aligned vector is all data or all checksum
        if A_VEC > 1:
            a_rows = tl.max_constancy(a_rows, [A_VEC])
            a_step = tl.max_constancy(tl.multiple_of(a_step, [A_VEC, 1]), [A_VEC, 1])
        if B_VEC > 1:
            b_cols = tl.max_constancy(b_cols, [B_VEC])
            b_step = tl.max_constancy(tl.multiple_of(b_step, [1, B_VEC]), [1, B_VEC])

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ks in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = rk < K - ks * BLOCK_K
        a_at = a_ptrs
        b_at = b_ptrs
        if A_VEC > 1:
            a_at = tl.max_contiguous(tl.multiple_of(a_ptrs, [16, 1]), [A_VEC, 1])
        if B_VEC > 1:
            b_at = tl.max_contiguous(tl.multiple_of(b_ptrs, [1, 16]), [1, B_VEC])
        a = tl.load(a_at, mask=a_rows[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_at, mask=k_ok[:, None] & b_cols[None, :], other=0.0)
        acc = dot_tl(acc, a, b, DOT_FP32, ALLOW_TF32, TF32_EMU)
        if INJECT != 0:
            hit = (rm[:, None] == inj_m) & (rn[None, :] == inj_n) & m_ok[:, None] & n_ok[None, :] \
                & (pid_b == inj_b) & (ks == inj_k)
            acc = inject_tl(acc, hit, inj_bit, inj_val, INJECT)
        a_ptrs += a_step
        b_ptrs += b_step

    if CHECK:
        # statistics of this tile's rows of A and columns of B, and of their blocks
        ck_m = i >= DM
        ck_n = j >= DN
        ab = ab_ptr + pid_b * stride_abb + pid_m * _BF
        bb = bb_ptr + pid_b * stride_bbb + pid_n * _BF
        e_i, r1_i, rinf_i, low_i = line_stats_tl(ar_ptr + pid_b * stride_arb + rm * _RF, m_ok)
        e_p = tl.load(ab + _BE)
        f_q = tl.load(bb + _BE)
        # Every sum in one scale for the tile, s_t = 2^-(E_p + F_q) (a scalar: no per-column vector
        # lives in the accumulator's layout, at 32 registers per thread each), times its own power
        # of two 2^-t, undone after the sum, so that the compiler keeps no scaled copy of the
        # accumulator for all six sums. Each row and column is then brought to its own scale,
        # 2^-(e_i + F_q) = s_t 2^(E_p - e_i) and 2^-(E_p + f_j) = s_t 2^(F_q - f_j), by exact
        # powers of two: the same numbers as scaling each element, while E_p + F_q is within
        # float32's exponents and no row or column is more than 2^60 below its block's largest
        # (else the tile is left unverified, below). The predictions are the tensor cores' products
        # of the checksum parts, in units of 2^(E_p - SHIFT_A) and 2^(F_q - SHIFT_B).
        # the data elements (the accumulator is 0 in rows past M and columns past N: loads of 0)
        d_ok = (i < DM)[:, None] & (j < DN)[None, :]
        s_t = pow2_tl(-(e_p + f_q))
        # the parts are the checksums in units of 2^(E_p - SHIFT_A) (2^(F_q - SHIFT_B): fp16's are
        # shifted, ``prepass.chk_shift``): to the column's (row's) units by 2^-(F_q + SHIFT_A)
        # (2^-(E_p + SHIFT_B)), as two factors that stay in float32's range for any finite
        # operand (times_pow2_tl)
        # the column sums go through the scratch (L2) and come back one column per thread. Squares
        # of a corrupted accumulator may overflow: clamped, a huge error stays an alarm.
        ws = ws_ptr + ((pid_b * TM + pid_m) * TN + pid_n) * (4 * BLOCK_N)
        column_sums_tl(acc, ws, d_ok, ck_m, s_t, f_q, SHIFT_A, BLOCK_N)
        up_r = pow2_tl(e_p - e_i)
        s1_r, s2_r, sa_r, p_r = row_sums_tl(acc, d_ok, ck_n, s_t, up_r, e_p, SHIFT_B)
        jc = tl.arange(0, BLOCK_N)
        rc_n = pid_n * DN + jc
        nc_ok = (jc < DN) & (rc_n < N)
        f_j, r1_j, rinf_j, low_j = line_stats_tl(br_ptr + pid_b * stride_brb + rc_n * _RF, nc_ok)
        up_c = pow2_tl(f_q - f_j)
        s1_c, s2_c, sa_c, p_c = column_sums_back_tl(ws, up_c, BLOCK_N)
        # the spread of the rows' and columns' scales (zero rows and columns aside)
        spread_r = tl.max(tl.where(m_ok & (r1_i > 0), e_p - e_i, 0.0), 0)
        spread_c = tl.max(tl.where(nc_ok & (r1_j > 0), f_q - f_j, 0.0), 0)
        scales_ok = (spread_r <= 60) & (spread_c <= 60) & (tl.abs(e_p + f_q) <= 126)
        tc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        tr = tl.zeros((BLOCK_M,), dtype=tl.float32)
        if CAP:
            tc, tr = cap_sums_tl(a_ptr + pid_b * stride_ab, b_ptr + pid_b * stride_bb, rm, rc_n,
                                 m_ok, nc_ok, stride_am, stride_ak, stride_bk, stride_bn, K, e_p,
                                 f_q, up_r, up_c, BLOCK_M, BLOCK_N, BLOCK_K)
        thr_c = side_threshold_tl(coef_ptr, s1_c, s2_c, sa_c, p_c, ab, r1_j, rinf_j, low_j, e_p,
                                  f_j, tc, CAP)
        thr_r = side_threshold_tl(coef_ptr + _NCOEF, s1_r, s2_r, sa_r, p_r, bb, r1_i, rinf_i,
                                  low_i, f_q, e_i, tr, CAP)
        res_c = s1_c - p_c
        res_r = s1_r - p_r
        status = status_tl(ab, bb, s1_c, p_c, thr_c, nc_ok, r1_j, f_j, p_r, thr_r, m_ok, r1_i, e_i,
                           scales_ok)
        unverified = status == _UNVERIFIED
        rat_c = ratios_tl(res_c, thr_c, nc_ok, unverified)
        rat_r = ratios_tl(res_r, thr_r, m_ok, unverified)
        verdict_tl(v_ptr, (pid_b * TM + pid_m) * TN + pid_n, status,
                   rat_r, res_r, thr_r, up_r, pid_m * DM, rat_c, res_c, thr_c, up_c, pid_n * DN,
                   s_t, alpha, BLOCK_M, BLOCK_N)
        side_out_tl(rr_ptr, sr_ptr, (pid_b * M + rm) * TN, pid_n, rat_r, res_r, thr_r, m_ok, up_r,
                    s_t, alpha, SUMS)
        side_out_tl(rc_ptr, sc_ptr, (pid_b * TM + pid_m) * N, rc_n, rat_c, res_c, thr_c, nc_ok,
                    up_c, s_t, alpha, SUMS)
    store_out_tl(acc, c_ptr, d_ptr, pid_b, rm, rn, m_ok, n_ok, alpha, beta, stride_cb, stride_cm,
                 stride_cn, stride_db, stride_dm, stride_dn, HAS_ADD, SCALED, ROUND_OUT)


def _as3(t):
    return t if t.dim() == 3 else t.unsqueeze(0)


_TF32_EMU = {"truncate": 1, "nearest": 2}
_tuned = {}
GROUP_M = 8


def _autotuned(bm, bn, dtype):
    """The autotuner for one tile and dtype over the factory's configs; it tunes again for each
    (M, N, K) and each variant of the kernel (checked or not, epilogue, injection, tf32)."""
    key = (bm, bn, dtype)
    if key not in _tuned:
        _tuned[key] = triton.autotune(
            configs=_configs.configs(bm, bn, dtype, interpret=False),
            key=["M", "N", "K", "RA", "RB", "A_VEC", "B_VEC", "CHECK", "CAP", "HAS_ADD", "SCALED", "INJECT", "ALLOW_TF32"],
        )(checked_gemm_kernel)
    return _tuned[key]


def accumulation(k, dtype, tf32, bk):
    """The round-off model of this kernel's accumulation (module docstring): of the product and,
    the same dot, of the predictions."""
    if _configs.interpreting():
        return T.blocked(k, bk)
    if dtype in (torch.float16, torch.bfloat16) or tf32:
        return T.blocked(k, 8, directed=True)
    return T.recursive(k)


VECTOR_BYTES = 16       # a vectorised load: 8 bf16/fp16 values, 4 fp32


def _vector(t, dim, other, check):
    """The vector width the kernel may assume along t's ``dim`` (A's rows, B's columns), where that
    side holds a vector's width of checksum rows: sizes, strides and base in whole vectors."""
    vec = VECTOR_BYTES // t.element_size()
    ok = (check and t.data_ptr() % VECTOR_BYTES == 0 and t.shape[dim] % vec == 0
          and all(t.stride(d) * t.element_size() % VECTOR_BYTES == 0 for d in (0, other)
                  if t.shape[d] > 1))
    return vec if ok else 1


class Layout:
    """Where the checksums go in a kernel tile of BM x BN for these operands.

    ``nparts`` parts per checksum (``prepass.parts_for``); RA checksum rows in the A tile and RB
    columns in the B tile: ``nparts``, or a vector's width where the operand is contiguous along
    the tile's data/checksum boundary (A along M, B along N), so that no vector straddles it (the
    extra rows are zero). ``a_k_major``/``b_k_major``: the parts are stored contiguous along K."""

    def __init__(self, a3, b3, dtype, tf32, check=True):
        self.nparts = _prepass.parts_for(dtype, tf32) if check else 0
        vec = VECTOR_BYTES // (4 if dtype == torch.float32 else 2)
        pad = max(self.nparts, vec)
        self.a_k_major = not (a3.stride(1) == 1 and a3.stride(2) != 1 and a3.shape[1] > 1)
        self.b_k_major = not (b3.stride(2) == 1 and b3.stride(1) != 1 and b3.shape[2] > 1)
        self.ra = self.nparts if self.a_k_major or not check else pad
        self.rb = self.nparts if self.b_k_major or not check else pad
        self.tf32 = bool(tf32)

    def data_tiles(self, bm, bn):
        return bm - self.ra, bn - self.rb

    def b_key(self, bn):
        """What the pre-pass of B's columns depends on beyond B (a weight's cache key)."""
        return bn - self.rb, self.nparts, self.rb, self.b_k_major, self.tf32


def data_tiles(a, b, tiles=None, tf32=None, check=True):
    """The verdict's tiles (DM, DN) of ``checked_gemm(a, b, tiles=tiles, tf32=tf32)``."""
    a3, b3 = _as3(a), _as3(b)
    bm, bn = tiles or _configs.tile(a3.shape[1], b3.shape[2], a3.shape[2], a.dtype)
    tf, emu = _tf32(a, tf32)
    return Layout(a3, b3, a.dtype, bool(tf or emu), check).data_tiles(bm, bn)


def _tf32(a, tf32):
    """(tf32 on the GPU, emulation code)."""
    if tf32 in ("truncate", "nearest"):
        return False, _TF32_EMU[tf32]
    # the kernel runs tf32 only on a GPU, where torch allows it (or the caller says so)
    return (a.dtype == torch.float32 and a.device.type == "cuda"
            and (_backends.tf32_allowed(a.device) if tf32 is None else bool(tf32))), 0


@dataclass(frozen=True)
class LaunchPlan:
    """One launch of ``checked_gemm_kernel``, beyond its tensors: ``launch`` makes the kernel's
    arguments from it. It crosses the custom op (whose schema takes tensors and scalars) as two
    lists, ``pack`` and ``unpack``."""
    bm: int                     # the kernel's tile, BM x BN
    bn: int
    ra: int                     # checksum rows of the A tile, columns of the B tile (``Layout``)
    rb: int
    a_k_major: bool             # the parts are stored contiguous along K (``Layout``)
    b_k_major: bool
    check: bool                 # False: the checks compiled out (ra = rb = 0)
    tf32: bool                  # fp32 operands on tf32 tensor cores
    tf32_emulation: int = 0     # tf32 inputs emulated in the kernel (``_TF32_EMU``), 0: not
    sums: bool = False          # also write every sum's residual and threshold
    alpha: float = 1.0          # C = alpha * A.B + beta * addend
    beta: float = 1.0
    inject_kind: int = 0        # ``INJECT_KINDS``' code, 0: no fault
    inject_batch: int = 0       # the fault's element and K step, the bit flipped, the value added
    inject_row: int = -1
    inject_col: int = -1
    inject_step: int = 0
    inject_bit: int = 0
    inject_value: float = 0.0
    block_k: int = 0            # with warps and stages, a config; 0: the autotuner's (on a GPU)
    num_warps: int = 0          # or the factory's one config (under the interpreter)
    num_stages: int = 0

    def pack(self) -> Tuple[List[int], List[float]]:
        """The fields in order: (the int and bool ones as ints, the float ones)."""
        ints = [int(getattr(self, f.name)) for f in fields(self) if _kind(f) is not float]
        return ints, [float(getattr(self, f.name)) for f in fields(self) if _kind(f) is float]

    @classmethod
    def unpack(cls, ints, floats):
        ints, floats = iter(ints), iter(floats)
        return cls(**{f.name: _kind(f)(next(floats if _kind(f) is float else ints))
                      for f in fields(cls)})

    def tile_grid(self, m, n):
        """(TM, TN): the data tiles over an M x N product."""
        return -(-m // (self.bm - self.ra)), -(-n // (self.bn - self.rb))


def _kind(f):
    """A LaunchPlan field's type (bool, int or float), also where annotations are strings."""
    return {"bool": bool, "int": int, "float": float}.get(f.type, f.type)


def _outputs(a3, b3, plan):
    """The launch's outputs, empty: C, the verdict, the row and column ratios, and the residuals
    and thresholds of every row and column sum (empty without ``plan.sums``)."""
    bt, m, _ = a3.shape
    n = b3.shape[2]
    tm, tn = plan.tile_grid(m, n)
    f32 = dict(dtype=torch.float32, device=a3.device)
    return (torch.empty(bt, m, n, dtype=a3.dtype, device=a3.device),
            torch.empty(bt, tm, tn, L.NFIELDS, **f32),
            torch.empty(bt, m, tn, **f32), torch.empty(bt, tm, n, **f32),
            torch.empty(bt, m, tn, 2, **f32) if plan.sums else torch.empty(0, **f32),
            torch.empty(bt, tm, n, 2, **f32) if plan.sums else torch.empty(0, **f32))


def launch(a3, b3, addend, pa, pb, ar, ab, br, bb, coef, plan):
    """The launch's outputs, grid, positional arguments and meta-parameters (without BLOCK_K,
    warps and stages) for ``plan``: what ``_launch_impl`` passes to the kernel and ``abft bench
    --static`` compiles (on "meta" tensors, which allocate nothing)."""
    bt, m, k = a3.shape
    n = b3.shape[2]
    tm, tn = plan.tile_grid(m, n)
    outs = c, verdict, rr, rc, sr, sc = _outputs(a3, b3, plan)
    ws = torch.empty(bt * tm * tn * 4 * plan.bn if plan.check else 1, dtype=torch.float32,
                     device=a3.device)
    # without an addend, a3 stands in for it (never read): no output may alias another argument
    d = addend if addend is not None else a3
    bstride = lambda t: t.stride(0) if t.shape[0] > 1 else 0
    args = (a3, b3, c, d, pa, pb, ws,
            verdict, rr, rc, sr, sc,
            ar, ab, br, bb, coef,
            m, n, k, tm, tn,
            a3.stride(0), a3.stride(1), a3.stride(2),
            b3.stride(0), b3.stride(1), b3.stride(2),
            c.stride(0), c.stride(1), c.stride(2),
            d.stride(0), d.stride(1), d.stride(2),
            bstride(pa), pa.stride(1), pa.stride(2),
            bstride(pb), pb.stride(1), pb.stride(2),
            bstride(ar), bstride(ab), bstride(br), bstride(bb),
            plan.alpha, plan.beta,
            plan.inject_batch, plan.inject_row, plan.inject_col, plan.inject_step, plan.inject_bit,
            plan.inject_value)
    check, bf16_interpreted = plan.check, _configs.interpreting() and a3.dtype == torch.bfloat16
    meta = dict(BLOCK_M=plan.bm, BLOCK_N=plan.bn, RA=plan.ra, RB=plan.rb, GROUP_M=GROUP_M,
                A_VEC=1 if plan.a_k_major else _vector(a3, 1, 2, check),
                B_VEC=1 if plan.b_k_major else _vector(b3, 2, 1, check),
                HAS_ADD=addend is not None, SCALED=plan.alpha != 1.0, CHECK=check,
                INJECT=plan.inject_kind, DOT_FP32=bf16_interpreted, ALLOW_TF32=plan.tf32,
                TF32_EMU=plan.tf32_emulation, CAP=check and k <= T.SMALL_K, SUMS=plan.sums,
                ROUND_OUT=bf16_interpreted,
                SHIFT_A=_prepass.chk_shift(a3.dtype, plan.bm - plan.ra) if check else 0,
                SHIFT_B=_prepass.chk_shift(a3.dtype, plan.bn - plan.rb) if check else 0)
    return outs, (tm * tn, bt), args, meta


def _launch_impl(a3: torch.Tensor, b3: torch.Tensor, addend: Optional[torch.Tensor],
                 pa: torch.Tensor, pb: torch.Tensor,
                 ar: torch.Tensor, ab: torch.Tensor, br: torch.Tensor, bb: torch.Tensor,
                 coef: torch.Tensor, ints: List[int], floats: List[float],
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                            torch.Tensor]:
    """One launch over a (B, M, K) x (B, K, N) batch of the plan ``LaunchPlan.pack`` made."""
    plan = LaunchPlan.unpack(ints, floats)
    outs, grid, args, meta = launch(a3, b3, addend, pa, pb, ar, ab, br, bb, coef, plan)
    if grid[0] * grid[1] == 0:
        return outs
    if plan.block_k:
        kernel = checked_gemm_kernel
        meta.update(BLOCK_K=plan.block_k, num_warps=plan.num_warps, num_stages=plan.num_stages)
    elif _configs.interpreting():
        kernel = checked_gemm_kernel
        cfg = _configs.configs(plan.bm, plan.bn, a3.dtype)[0]
        meta.update(cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    else:
        kernel = _autotuned(plan.bm, plan.bn, a3.dtype)
    wrap_triton(kernel)[grid](*args, **meta)
    return outs


def _launch_fake(a3, b3, addend, pa, pb, ar, ab, br, bb, coef, ints, floats):
    return _outputs(a3, b3, LaunchPlan.unpack(ints, floats))


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
        tiles: the kernel's tile (BM, BN), powers of two, or None (``configs.tile``). Checked,
            a tile holds RA checksum rows and RB checksum columns (``Layout``): the verdict's
            tiles are ``data_tiles(a, b, tiles)`` = (BM - RA, BN - RB).
        check: False compiles the checks out (and the checksum rows: tiles of BM x BN data).
        inject: dict(kind=bitflip|add|zero, batch=0, row=, col=, k_step=0, bit=, value=) or None.
        tf32: None follows torch (``torch.backends.cuda.matmul.allow_tf32`` for fp32 on CUDA);
            "truncate" or "nearest" emulate tf32 inputs in the kernel (tests on the CPU).
        config: a ``triton.Config`` to launch instead of the autotuner's choice.
        b_stats: the pre-pass of b's columns kept from an earlier call (a weight): a
            ``prepass.Prepared``, or a function of ``Layout.b_key`` returning one
            (``prepass.prepare(b.mT, *key)``); or None.
        lam: threshold multiplier (None: ``threshold.LAMBDA``).
        return_sums: also return the residual and threshold of every sum, in C's units:
            dict(res_row, thr_row ([B,] M, TN), res_col, thr_col ([B,] TM, N)).

    Returns:
        c: (M, N) or (B, M, N) in a's dtype; verdict ([B,] TM, TN, 9) float32 in
        ``kernels/layout.py``'s format (None when ``check`` is False); detail
        (row ratios ([B,] M, TN), column ratios ([B,] TM, N)); B only where an operand is 3-D,
        as ``reference.check`` returns them.

    Example::

        c, verdict, _ = checked_gemm(x, w.t(), bias)
        alarmed = L.alarmed(verdict)
    """
    if a.dtype not in _backends.DTYPES["triton"] or b.dtype != a.dtype:
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
    if add is not None and beta == 0:               # torch ignores its values, not its shape
        torch.broadcast_shapes(tuple(add.shape), (m, n) if squeeze else (bt, m, n))
        add = None
    if add is not None:
        add = add.expand(bt, m, n) if add.dim() <= 3 else add.reshape(-1, m, n)
    bm, bn = tiles or _configs.tile(m, n, k, a.dtype)
    tf, emu = _tf32(a, tf32)
    if config is not None:
        bk = config.kwargs["BLOCK_K"]
    else:
        bk = min(cf.kwargs["BLOCK_K"] for cf in _configs.configs(bm, bn, a.dtype))
    lay = Layout(a3, b3, a.dtype, bool(tf or emu), check)
    why = _configs.tiles_error(bm, bn)
    if why or min(bm - lay.ra, bn - lay.rb) < 8:
        raise ValueError(f"checked_gemm: {why or f'tiles hold at least 8 data rows and columns, got {(bm, bn)}'}")
    if check:
        # the pre-pass over the unexpanded operands: a broadcast batch is read once
        key = lay.b_key(bn)
        pre_a = _prepass.prepare(a3, bm - lay.ra, lay.nparts, lay.ra, lay.a_k_major, lay.tf32)
        pre_b = b_stats(key) if callable(b_stats) else b_stats
        if pre_b is None:
            pre_b = _prepass.prepare(b3.mT, *key)
        elif pre_b.key != key[:4]:
            raise ValueError(f"checked_gemm: b_stats were made for {pre_b.key}, not {key[:4]} "
                             f"(data columns, parts, rows per block, K-contiguous)")
        u = T.units(a.dtype, check=torch.float32, tf32=lay.tf32, stored=False,
                    flush=a.device.type == "cuda")
        acc = accumulation(k, a.dtype, lay.tf32, bk)
        kw = dict(k=k, acc=acc, chk=acc, lam=lam, parts=lay.nparts)
        # each side's sums with its own checksums' split error (blocks of its data rows)
        coef = T.pack(*(T.coefficients(u, bs=dm, split=_prepass.split_error(
            a.dtype, lay.tf32, _prepass.chk_shift(a.dtype, dm)), **kw) for dm in (bm - lay.ra, bn - lay.rb)),
            device=a.device)
        pa, pb = pre_a.parts, pre_b.parts
        ar, ab, br, bb = pre_a.rows, pre_a.blocks, pre_b.rows, pre_b.blocks
    else:
        pa = pb = ar = ab = br = bb = coef = torch.empty(1, 1, 1, dtype=torch.float32, device=a.device)
    a3 = a3.expand(bt, m, k)
    b3 = b3.expand(bt, k, n)
    inj = inject or {}
    cfg = (dict(block_k=config.kwargs["BLOCK_K"], num_warps=config.num_warps,
                num_stages=config.num_stages) if config else {})
    plan = LaunchPlan(
        bm, bn, lay.ra, lay.rb, lay.a_k_major, lay.b_k_major, bool(check), tf, emu,
        sums=bool(return_sums and check), alpha=float(alpha), beta=float(beta),
        inject_kind=INJECT_KINDS[inj["kind"]] if inject else 0,
        inject_batch=int(inj.get("batch", 0)), inject_row=int(inj.get("row", -1)),
        inject_col=int(inj.get("col", -1)), inject_step=int(inj.get("k_step", 0)),
        inject_bit=int(inj.get("bit", 0)), inject_value=float(inj.get("value", 0.0)), **cfg)
    c, verdict, rr, rc, sr, sc = _launch(a3, b3, add, pa, pb, ar, ab, br, bb, coef, *plan.pack())
    if squeeze:                     # 2-D operands: no batch dim, as the reference check returns
        c = c[0]
        if check:
            verdict, rr, rc = verdict[0], rr[0], rc[0]
            if return_sums:
                sr, sc = sr[0], sc[0]
    if not check:
        return c, None, None
    if return_sums:
        return c, verdict, (rr, rc), dict(res_row=sr[..., 0], thr_row=sr[..., 1],
                                          res_col=sc[..., 0], thr_col=sc[..., 1])
    return c, verdict, (rr, rc)


def tiles_for(m, n, k, dtype):
    return _configs.tile(m, n, k, dtype)


__all__ = ["checked_gemm", "tiles_for", "data_tiles", "Layout", "INJECT_KINDS",
           "accumulation"]


# -- the computing backend's entry points (``backends``) ------------------------------------------

tiles_error = _configs.tiles_error


def checked_product(a, b, *, addend, alpha, beta, tiles, inject, lam, b_stats):
    """``checked_gemm`` in the configured tiles, or the shape's; returns (c, verdict, detail,
    (bm, bn)), bm x bn the verdict's tiles (the kernel's, less its checksum rows and columns)."""
    tiles = tiles or tiles_for(a.shape[-2], b.shape[-1], a.shape[-1], a.dtype)
    c, verdict, detail = checked_gemm(a, b, addend=addend, alpha=alpha, beta=beta, tiles=tiles, inject=inject,
                                      lam=lam, b_stats=b_stats)
    return c, verdict, detail, data_tiles(a, b, tiles)


def unchecked_product(a, b, *, addend, alpha, beta):
    """The kernel's product with its checks compiled out (a call sampled out)."""
    return checked_gemm(a, b, addend=addend, alpha=alpha, beta=beta, check=False)[0]
