"""The row-checked GEMM: C = A.B with a one-sided Huang-Abraham check of every row of C, made once
per row of tiles (issue "The checked GEMM at a training step's noise level").

Design (against the tile-riding kernel of ``kernels/triton_gemm.py``):
- **Full data tiles.** No checksum rows or columns ride in the tiles, and no operand is pre-passed
  per call: the K loop is the unchecked loop, plus, on its share of the steps, the slice below.
- **The prediction on the tensor cores, spread over the row of tiles.** The check of row i is
  sum_j C_ij = sum_k A_ik s_k, s_k = sum_j B_kj (one group of columns: all N). s in units of 2^-E
  (E: B's exponent, ``stats.operand_stats``; fp16's 2^S finer, ``prepass.chk_shift``), split into
  parts of the operand's dtype that the tensor cores multiply exactly, is the first columns of V
  (K x 8, kept per weight version like the tile kernel's pre-pass of a weight). The TN CTAs of a row of tiles share the work: CTA n
  multiplies its A tiles by V's slice on its share of the K steps, so A.V is computed once per
  row of tiles, from A tiles already in shared memory, and A is never read again. The share is a
  contiguous run [n S, (n + 1) S) (S = ceil(steps / TN)) that CTA n takes first, in a loop of its
  own, before the other steps (from (n + 1) S, wrapping around): the issue's "k = n (mod TN)"
  needs a branch in the K loop, and any branch there makes ptxas serialise the product's wgmma
  (C7515, "non wgmma instructions defining accumulator registers"; seen in the SASS of a K-major B,
  the layout of x W^T). Each CTA of a row of tiles thus adds its K steps in its own rotated order.
- **The statistics of A on the tensor cores too**, on the same steps: Q_i = sum_k A_ik^2 x_k and
  Qs_i = sum_k A_ik^2 s_k^2 (x_k = sum_j B_kj^2) are linear in A^2, so one more 8-wide dot of
  bf16(A^2) (fp32 for fp32 operands) by W = [x, s^2, 1] (rounded up) gives them and
  y1_i = sum_k A_ik^2: the exact magnitudes the threshold model bounds with Hoelder's inequality
  elsewhere (``threshold.threshold_q_tl``). fp16 operands are squared in bf16 (fp16's range would
  overflow A^2). Both slice dots take A from registers (the A^2 dot needs it there; a wgmma that
  reads an 8-wide B is bound by reading its A from shared memory), 8 columns wide (m64n8k16).
- **The actual sums in the epilogue**, on the fp32 accumulator before rounding: per row, the sum
  and the sum of squares of the tile's BN values; each CTA writes them with its share's
  prediction and statistics to a partial buffer (M, TN, 6). ``row_verify_kernel`` (one more
  launch) adds the TN partials of a row in a fixed order (no atomics), scales them by powers of
  two, and takes the threshold of ``kernels/threshold.py``'s model with bs = N. A row sum holds
  N elements where the tile kernel's hold BN: a single corrupted element has to clear a larger
  threshold (groups of columns, not built yet, narrow it again).
- **Loads** through TMA descriptors where the operands allow (A contiguous along K or M, B along
  K or N, 16-byte aligned): the product's loop is then Triton's Hopper loop (UTMALDG, wgmma in
  flight across steps); else through pointers.

What the threshold assumes beyond the tile kernel's model: the prediction is accumulated in each
CTA's share and then TN partials are added (its accumulation: the product's roundings plus TN);
bf16(A^2) is within 2^-9 of A^2 and the dot rounds toward zero, so Q, Qs and y1 are taken as
(1 + 2^-6) times the computed values, plus K times the smallest normal for squares that underflow;
the low-entropy allowance applies wherever B's group is low-entropy (A's rows are not sampled: as
if every row were low-entropy), with sum |C| bounded by sqrt(N sum C^2); no worst-case cap at
small K (the cap only lowers a threshold).

Not built yet (issue 28): the vectors passed between a layer's GEMMs (r = X.1 for grad_weight), the
column check of grad_weight, groups of columns, localisation by recomputing an alarmed row block,
the batched products, and the policies' use of this kernel: ``abft bench --static`` compiles it for
its cost, and ``tests/kernels/test_rowcheck.py`` checks it under the interpreter. Its cost cannot reach the
issue's 1.02 a layer at 4096 -> 4096 in this form (``benchmarks/rowfloor.py``: the epilogue's sums
and the A tile's second read are not overlapped with the wgmma; Triton 3.9's warp specialisation
on sm_90a is cooperative, a ping-pong schedule would need Gluon; BENCHMARKS.md).
"""
import torch
import triton
import triton.language as tl

from abft.kernels import layout as L
from abft.kernels import prepass as _prepass
from abft.kernels import stats as _stats
from abft.kernels import threshold as T
from abft.kernels.configs import interpreting
from abft.kernels.prepass import exponent_tl
from abft.kernels.threshold import pow2_tl, threshold_q_tl
from abft.kernels.triton_gemm import accumulation as _product_accumulation
from abft.kernels.triton_gemm import inject_tl, store_out_tl

VW = 8                    # the width of V and W: the narrowest wgmma (m64n8k16)
NF = 6                    # partial fields: sum C, sum C^2, prediction, Q, Qs, y1
F_S1, F_S2, F_P, F_Q, F_QS, F_Y1 = range(NF)
W_X, W_S2, W_ONE = 0, 1, 2          # W's columns
STAT_SLACK = 2.0 ** -6              # Q, Qs, y1 as computed from bf16(A^2), made upper bounds
BLK_E, BLK_X1, BLK_NU, BLK_LOW, BLK_FINITE = range(5)
BLOCK_FIELDS = 5
_NF = tl.constexpr(NF)
_VW = tl.constexpr(VW)
_FS1, _FS2, _FP, _FQ, _FQS, _FY1 = (tl.constexpr(x) for x in range(NF))
_BE, _BX1, _BNU, _BLOW, _BFIN = (tl.constexpr(x) for x in range(BLOCK_FIELDS))
_F_ROW_RATIO, _F_ROW_FAILS, _F_ROW, _F_COL, _F_RES, _F_THR, _F_STATUS, _NFIELDS = (
    tl.constexpr(getattr(L, n)) for n in
    ("ROW_RATIO", "ROW_FAILS", "ROW", "COL", "RESIDUAL", "THRESHOLD", "STATUS", "NFIELDS"))
_OK, _UNVERIFIED, _NONFINITE = (tl.constexpr(x) for x in (L.OK, L.UNVERIFIED, L.NONFINITE))


@triton.jit
def _step(a_src, b_src, ks, acc, off_m, off_n, rm, rn, rk, m_ok, n_ok, K, stride_ak, stride_bk,
          inj_m, inj_n, inj_k, inj_bit, inj_val, BLOCK_K: tl.constexpr, TMA: tl.constexpr,
          A_MMAJOR: tl.constexpr, B_KMAJOR: tl.constexpr, INJECT: tl.constexpr,
          DOT_FP32: tl.constexpr):
    """K step ``ks`` of the product: load the tiles (through tensor descriptors with TMA, else
    from the pointers of step 0), multiply-accumulate (fault injection after step ``inj_k``);
    returns the accumulator and the A tile."""
    if TMA:
        if A_MMAJOR:
            a = a_src.load([ks * BLOCK_K, off_m]).T
        else:
            a = a_src.load([off_m, ks * BLOCK_K])
        if B_KMAJOR:
            b = b_src.load([off_n, ks * BLOCK_K]).T
        else:
            b = b_src.load([ks * BLOCK_K, off_n])
    else:
        k_ok = rk < K - ks * BLOCK_K
        kb = tl.cast(ks, tl.int64) * BLOCK_K
        a = tl.load(a_src + kb * stride_ak, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_src + kb * stride_bk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
    if DOT_FP32:
        # the interpreter's bf16 tl.dot is wrong; bf16 products are exact in fp32
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, allow_tf32=False)
    elif a.dtype == tl.float32:
        acc = tl.dot(a, b, acc, allow_tf32=False)
    else:
        acc = tl.dot(a, b, acc)
    if INJECT != 0:
        hit = (rm[:, None] == inj_m) & (rn[None, :] == inj_n) & (ks == inj_k)
        acc = inject_tl(acc, hit, inj_bit, inj_val, INJECT)
    return acc, a


@triton.jit
def row_check_kernel(
    a_ptr, b_ptr, c_ptr, v_ptr, w_ptr, part_ptr,
    M, N, K, TM, TN,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_vk, stride_vc,
    inj_m, inj_n, inj_k, inj_bit, inj_val,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    CHECK: tl.constexpr, TMA: tl.constexpr, A_MMAJOR: tl.constexpr, B_KMAJOR: tl.constexpr,
    INJECT: tl.constexpr,
    DOT_FP32: tl.constexpr, ROUND_OUT: tl.constexpr,
):
    pid = tl.program_id(0)
    width = GROUP_M * TN
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(TM - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    rm = off_m + tl.arange(0, BLOCK_M)
    rn = off_n + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rv = tl.arange(0, _VW)
    m_ok = rm < M
    n_ok = rn < N
    if TMA:
        # A K- or M-contiguous (dY^T of grad_weight), B K-contiguous (x W^T: W's rows) or
        # N-contiguous; zero past the edges
        if A_MMAJOR:
            a_src = tl.make_tensor_descriptor(a_ptr, shape=[K, M], strides=[stride_ak, 1],
                                              block_shape=[BLOCK_K, BLOCK_M])
        else:
            a_src = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1],
                                              block_shape=[BLOCK_M, BLOCK_K])
        if B_KMAJOR:
            b_src = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[stride_bn, 1],
                                              block_shape=[BLOCK_N, BLOCK_K])
        else:
            b_src = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[stride_bk, 1],
                                              block_shape=[BLOCK_K, BLOCK_N])
    else:
        a_src = a_ptr + rm[:, None].to(tl.int64) * stride_am + rk[None, :] * stride_ak
        b_src = b_ptr + rk[:, None] * stride_bk + rn[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    pv = tl.zeros((BLOCK_M, _VW), dtype=tl.float32)
    pw = tl.zeros((BLOCK_M, _VW), dtype=tl.float32)
    steps = tl.cdiv(K, BLOCK_K)
    if CHECK:
        # CTA n of the row of tiles takes the K steps [n S, (n + 1) S) first, with the slice, then
        # the others from (n + 1) S on, wrapping around: two loops without a branch in either
        # (a branch in the K loop makes ptxas serialise the wgmma of the product)
        share = tl.cdiv(steps, TN)
        k0 = tl.minimum(pid_n * share, steps)
        n_share = tl.minimum(steps - k0, share)
        vw_ptrs = (k0 * BLOCK_K + rk)[:, None] * stride_vk + rv[None, :] * stride_vc
        if TMA:
            # V and W through TMA too: a cp.async write read by the wgmma needs a proxy fence,
            # which the compiler then puts in the hot loop as well
            v_src = tl.make_tensor_descriptor(v_ptr, shape=[K, _VW], strides=[stride_vk, 1],
                                              block_shape=[BLOCK_K, _VW])
            w_src = tl.make_tensor_descriptor(w_ptr, shape=[K, _VW], strides=[stride_vk, 1],
                                              block_shape=[BLOCK_K, _VW])
        for j in range(0, n_share):
            ks = k0 + j
            acc, a = _step(a_src, b_src, ks, acc, off_m, off_n, rm, rn, rk, m_ok, n_ok, K,
                           stride_ak, stride_bk, inj_m, inj_n, inj_k, inj_bit, inj_val, BLOCK_K,
                           TMA, A_MMAJOR, B_KMAJOR, INJECT, DOT_FP32)
            if TMA:
                v = v_src.load([ks * BLOCK_K, 0])
                w = w_src.load([ks * BLOCK_K, 0])
            else:
                vw_ok = (rk < K - ks * BLOCK_K)[:, None]
                v = tl.load(v_ptr + vw_ptrs, mask=vw_ok, other=0.0)
                w = tl.load(w_ptr + vw_ptrs, mask=vw_ok, other=0.0)
            af = a.to(tl.float32)
            if DOT_FP32:
                pv = tl.dot(af, v.to(tl.float32), pv, allow_tf32=False)
                sq = (af * af).to(w.dtype).to(tl.float32)
                pw = tl.dot(sq, w.to(tl.float32), pw, allow_tf32=False)
            elif a.dtype == tl.float32:
                pv = tl.dot(a, v, pv, allow_tf32=False)
                pw = tl.dot(af * af, w, pw, allow_tf32=False)
            else:
                # both from registers (the A^2 dot needs A there anyway): a wgmma reading an 8-wide
                # B is bound by its shared-memory read of A (16 cycles against 4 of multiply-adds)
                a_reg = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [a], dtype=a.dtype,
                                                  is_pure=True, pack=2)
                pv = tl.dot(a_reg, v, pv)
                pw = tl.dot((af * af).to(w.dtype), w, pw)
            vw_ptrs += BLOCK_K * stride_vk
        # the rest, from k0 + n_share on; past the last step, back to the first
        for j in range(n_share, steps):
            ks = k0 + j
            ks = tl.where(ks >= steps, ks - steps, ks)
            acc, a = _step(a_src, b_src, ks, acc, off_m, off_n, rm, rn, rk, m_ok, n_ok, K,
                           stride_ak, stride_bk, inj_m, inj_n, inj_k, inj_bit, inj_val, BLOCK_K,
                           TMA, A_MMAJOR, B_KMAJOR, INJECT, DOT_FP32)
    else:
        for ks in range(0, steps):
            acc, a = _step(a_src, b_src, ks, acc, off_m, off_n, rm, rn, rk, m_ok, n_ok, K,
                           stride_ak, stride_bk, inj_m, inj_n, inj_k, inj_bit, inj_val, BLOCK_K,
                           TMA, A_MMAJOR, B_KMAJOR, INJECT, DOT_FP32)
    if CHECK:
        # the row sums of the fp32 accumulator (squares of a corrupted one may overflow: clamped,
        # a huge error stays an alarm); the prediction's parts added (columns 0..2 of V, the rest 0)
        s1 = tl.sum(acc, 1)
        s2 = tl.minimum(tl.sum(acc * acc, 1), 3.4028234663852886e38)
        p = tl.sum(pv, 1)
        is_w = rv[None, :]
        q = tl.sum(tl.where(is_w == 0, pw, 0.0), 1)
        qs = tl.sum(tl.where(is_w == 1, pw, 0.0), 1)
        y1 = tl.sum(tl.where(is_w == 2, pw, 0.0), 1)
        out = part_ptr + (rm.to(tl.int64) * TN + pid_n) * _NF
        tl.store(out + _FS1, s1, mask=m_ok)
        tl.store(out + _FS2, s2, mask=m_ok)
        tl.store(out + _FP, p, mask=m_ok)
        tl.store(out + _FQ, q, mask=m_ok)
        tl.store(out + _FQS, qs, mask=m_ok)
        tl.store(out + _FY1, y1, mask=m_ok)
    store_out_tl(acc, c_ptr, c_ptr, 0, rm.to(tl.int64), rn, m_ok, n_ok, 1.0, 0.0, 0, stride_cm,
                 stride_cn, 0, 0, 0, False, False, ROUND_OUT)


@triton.jit
def row_verify_kernel(
    part_ptr, blk_ptr, coef_ptr, ratio_ptr, sums_ptr, verdict_ptr,
    M, TN, slack, tiny_q, tiny_qs, tiny_y, p_down,
    BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, ROWS: tl.constexpr,
):
    """One program per ROWS rows (a verdict record), in chunks of BLOCK_R rows: the TN partials of
    each row added in a fixed order, the threshold, the ratio."""
    pid = tl.program_id(0)
    e_b = tl.load(blk_ptr + _BE)
    x1 = tl.load(blk_ptr + _BX1)
    nu = tl.load(blk_ptr + _BNU)
    low = tl.load(blk_ptr + _BLOW) > 0
    b_fin = tl.load(blk_ptr + _BFIN)
    bs = tl.load(coef_ptr + 2)
    big = 3.4028234663852886e38
    t = tl.arange(0, BLOCK_T)
    t_ok = t < TN
    worst = 0.0
    fails = 0.0
    at = -1.0
    res_w = 0.0
    thr_w = 0.0
    status = 0.0
    for r0 in range(0, ROWS, BLOCK_R):
        r = pid * ROWS + r0 + tl.arange(0, BLOCK_R)
        r_ok = (r < M) & (r0 + tl.arange(0, BLOCK_R) < ROWS)
        base = part_ptr + (r.to(tl.int64)[:, None] * TN + t[None, :]) * _NF
        ok2 = r_ok[:, None] & t_ok[None, :]
        s1 = tl.sum(tl.load(base + _FS1, mask=ok2, other=0.0), 1)
        s2 = tl.sum(tl.load(base + _FS2, mask=ok2, other=0.0), 1)
        p = tl.sum(tl.load(base + _FP, mask=ok2, other=0.0), 1)
        q = tl.sum(tl.load(base + _FQ, mask=ok2, other=0.0), 1) * slack + tiny_q
        qs = tl.sum(tl.load(base + _FQS, mask=ok2, other=0.0), 1) * slack + tiny_qs
        y1 = tl.sum(tl.load(base + _FY1, mask=ok2, other=0.0), 1) * slack + tiny_y
        # units: 2^-(E + e_i), e_i the exponent of sqrt(y1) (any power of two does: the verdict
        # does not change when A or B is scaled by one); Q, Qs carry B's 2^-2E already
        e_i = exponent_tl(tl.sqrt(y1))
        up = pow2_tl(-e_i)
        down = pow2_tl(-e_b)
        s1s = s1 * down * up
        s2s = tl.minimum((s2 * (down * up)) * (down * up), big)
        ps = p * p_down * up                # V's shift undone (2^-S, exact)
        qq = q * up * up
        qqs = qs * up * up
        yy = y1 * up * up
        sa = tl.sqrt(bs * s2s)
        thr = threshold_q_tl(coef_ptr, s1s, s2s, sa, ps, qq, qqs, x1, yy, nu, low, e_b, e_i,
                             0.0, False)
        res = s1s - ps
        # and scales whose powers of two float32 holds (the units' 2^-(E + e_i) included), and
        # sums of squares that did not reach float32's largest (a clamped partial: |C| >= 2^64)
        fin_in = ((y1 * 0.0 + b_fin) > 0) & (y1 < float("inf")) & (q < float("inf")) \
            & (qs < float("inf"))
        scales_ok = (tl.abs(e_i) <= 100) & (tl.abs(e_i * 0.0 + e_b) <= 100) \
            & (tl.abs(e_i + e_b) <= 120) & (s2 < big)
        acc_ok = tl.abs(s1) < float("inf")
        row_status = tl.where(fin_in & scales_ok & acc_ok & (thr < float("inf"))
                              & (tl.abs(p) < float("inf")),
                              _OK, _UNVERIFIED)
        # |sum_j C_ij| <= sum_j |a_i| |b_j| <= sqrt(y1) sqrt(N x1) 2^E: below float32's largest,
        # neither an element nor the row's sum can overflow
        may_overflow = tl.sqrt(y1) * tl.sqrt(bs * x1) * pow2_tl(e_b) >= big
        row_status = tl.where(fin_in & (acc_ok == 0) & (may_overflow == 0), _NONFINITE, row_status)
        rat = tl.where(row_status == _UNVERIFIED, 0.0, res / thr)
        rat = tl.where(rat == rat, rat, float("inf"))
        rat = tl.where(r_ok, rat, 0.0)
        unit = pow2_tl(e_b) / up
        tl.store(ratio_ptr + r, rat, mask=r_ok)
        tl.store(sums_ptr + r * 2, res * unit, mask=r_ok)
        tl.store(sums_ptr + r * 2 + 1, thr * unit, mask=r_ok)
        mag = tl.abs(rat)
        cw = tl.max(mag, 0)
        ci = tl.argmax(mag, 0)
        sel = tl.arange(0, BLOCK_R) == ci
        nf = tl.sum((mag > 1).to(tl.float32), 0)
        if cw > worst:
            worst = cw
            res_w = tl.sum(tl.where(sel, res * unit, 0.0), 0)
            thr_w = tl.sum(tl.where(sel, thr * unit, 0.0), 0)
            at = tl.where(nf > 0, (pid * ROWS + r0 + ci).to(tl.float32), -1.0)
        fails += nf
        st = tl.max(tl.where(r_ok, row_status, _OK), 0)
        status = tl.maximum(status, st)
    f = tl.arange(0, 16)
    rec = tl.where(f == _F_ROW_RATIO, worst, tl.where(f == _F_ROW_FAILS, fails, tl.where(
        f == _F_ROW, at, tl.where(f == _F_RES, res_w, tl.where(
            f == _F_THR, thr_w, tl.where(f == _F_STATUS, status, tl.where(
                f == _F_COL, -1.0, 0.0)))))))
    tl.store(verdict_ptr + pid * _NFIELDS + f, rec, mask=f < _NFIELDS)


class Encoding:
    """What a row check needs of B (K, N), kept per weight version: V (K, VW) in B's dtype (the
    parts of s 2^(S - E), S = ``shift``), W (K, VW) (x 2^-2E, s^2 2^-2E, 1, rounded up), and B's
    statistics (``BLOCK_FIELDS``: E, x1, nu, low, finite), from ``stats.operand_stats`` in float64."""

    def __init__(self, v, w, blk, nparts, shift=0):
        self.v, self.w, self.blk, self.nparts = v, w, blk, nparts
        self.shift = shift                  # V holds s 2^(S - E) (``prepass.chk_shift``)


def _round_up(x, dtype):
    """x (float64, >= 0, finite) in ``dtype``, no smaller: rounded to nearest, then one ulp up
    where that fell below (subnormals included)."""
    w = x.to(dtype)
    low = w.to(torch.float64) < x
    bits = w.view(torch.int16 if dtype.itemsize == 2 else torch.int32)
    return torch.where(low, (bits + 1).view(dtype), w)


def encode(b):
    """The ``Encoding`` of B (K, N) for row checks of A.B."""
    k, n = b.shape
    st = _stats.operand_stats(b.mT, n, need_s=True)
    E = float(st.E[0])
    nparts = _prepass.parts_for(b.dtype, False)
    s = st.s[0]                                              # sum_j b_kj 2^-E, float64
    shift = _prepass.chk_shift(b.dtype, n)
    pdt = b.dtype
    v = torch.zeros(k, VW, dtype=pdt, device=b.device)
    rest = s * 2.0 ** shift                                  # exact
    for i in range(nparts):
        part = rest.to(pdt)
        v[:, i] = part
        rest = rest - part.to(torch.float64)
    bf = b.to(torch.float64) * 2.0 ** -E
    bf = torch.where(torch.isfinite(bf), bf, torch.zeros_like(bf))
    wdt = torch.float32 if b.dtype == torch.float32 else torch.bfloat16
    w = torch.zeros(k, VW, dtype=wdt, device=b.device)
    w[:, W_X] = _round_up((bf * bf).sum(1), wdt)
    w[:, W_S2] = _round_up(s * s, wdt)
    w[:, W_ONE] = 1.0
    blk = torch.tensor([E, float(st.x1[0]), float(st.nu[0]), float(st.block_low()[0]),
                        float(st.block_finite()[0])], dtype=torch.float32, device=b.device)
    return Encoding(v, w, blk, nparts, shift)


def accumulation(k, dtype, bk, tn):
    """The round-off model of the product (as the tile kernel's) and of the prediction: each
    CTA's share in the same dot, then TN partials added in fp32."""
    acc = _product_accumulation(k, dtype, False, bk)
    return acc, T.Accumulation(acc.steps + tn, acc.inner, acc.directed)


def _tma(a, b):
    """(load through TMA descriptors, A M-contiguous, B K-contiguous): each operand contiguous
    along one side, with a 16-byte aligned base and other stride (TMA's rules)."""
    def side(t):
        """0 or 1: the dimension t is contiguous along (with TMA's alignment), else None."""
        for d in (1, 0):
            other = t.stride(1 - d)
            if t.stride(d) == 1 and (other * t.element_size()) % 16 == 0 \
                    and t.data_ptr() % 16 == 0 and t.shape[d] > 1:
                return d
        return None
    da, db = side(a), side(b)
    return da is not None and db is not None, da == 0, db == 0


INTERPRET_CONFIG = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=1)
GPU_CONFIG = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3)
GROUP_M = 8
VERIFY = dict(BLOCK_R=64, ROWS=128, CELLS=1024)   # CELLS: rows x partials a chunk loads


def launch(a, b, enc, check, inject_kind=0, inject_at=(-1, -1, 0, 0), inject_value=0.0, config=None):
    """Outputs, grids, arguments and meta-parameters of the two launches of a row-checked C = A.B
    (2-D, any strides): what ``row_checked_gemm`` runs and ``abft bench --static`` compiles."""
    cfg = dict(config or (INTERPRET_CONFIG if interpreting() else GPU_CONFIG))
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    m, k = a.shape
    n = b.shape[1]
    tm, tn = triton.cdiv(m, bm), triton.cdiv(n, bn)
    dev = a.device
    f32 = dict(dtype=torch.float32, device=dev)
    c = torch.empty(m, n, dtype=a.dtype, device=dev)
    part = torch.empty(m * tn * NF if check else 1, **f32)
    im, jn, ik, ibit = inject_at
    main_args = (a, b, c, enc.v, enc.w, part, m, n, k, tm, tn,
                 a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
                 enc.v.stride(0), enc.v.stride(1),
                 im, jn, ik, ibit, inject_value)
    tma, a_mmajor, b_kmajor = _tma(a, b)
    main_meta = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=GROUP_M, CHECK=check,
                     TMA=tma, A_MMAJOR=a_mmajor, B_KMAJOR=b_kmajor,
                     INJECT=inject_kind, DOT_FP32=interpreting() and a.dtype != torch.float32,
                     ROUND_OUT=interpreting() and a.dtype == torch.bfloat16)
    main_opts = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    rows = VERIFY["ROWS"]
    nv = triton.cdiv(m, rows)
    ratio = torch.empty(m, **f32)
    sums = torch.empty(m, 2, **f32)
    verdict = torch.empty(nv, 1, L.NFIELDS, **f32)
    acc, chk = accumulation(k, a.dtype, bk, tn)
    u = T.units(a.dtype, check=torch.float32, stored=False, flush=dev.type == "cuda")
    coef = T.pack(T.coefficients(u, k=k, bs=n, acc=acc, chk=chk,
                                 split=_prepass.split_error(a.dtype, False, enc.shift), parts=enc.nparts),
                    device=dev)
    # a square below float32's normal range may be lost (flushed) from each of the K products:
    # at most the smallest normal times W's largest entry (x <= N, s^2 <= N^2 in B's units)
    tiny = k * torch.finfo(torch.float32).tiny
    verify_args = (part, enc.blk, coef, ratio, sums, verdict, m, tn, 1.0 + STAT_SLACK,
                   tiny * n, tiny * n * n, tiny, 2.0 ** -enc.shift)
    bt = triton.next_power_of_2(tn)
    verify_meta = dict(BLOCK_R=max(1, min(VERIFY["BLOCK_R"], rows, VERIFY["CELLS"] // bt)),
                       BLOCK_T=bt, ROWS=rows)
    return dict(c=c, ratio=ratio, sums=sums, verdict=verdict,
                main=((tm * tn,), main_args, main_meta, main_opts),
                verify=((nv,), verify_args, verify_meta, dict(num_warps=4, num_stages=1)))


INJECT_KINDS = L.INJECT_KINDS


def _scratch(size, alignment, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu")


def row_checked_gemm(a, b, *, enc=None, check=True, inject=None, config=None):
    """C = A.B (2-D) with every row of C checked against A.(B.1).

    Returns (c, verdict (TM, 1, 9) in ``kernels/layout.py``'s format with records of 128 rows,
    ratios (M,), sums dict(res, thr) (M,) in C's units); verdict, ratios and sums are None
    unchecked. ``enc``: B's ``Encoding`` kept from an earlier call (a weight), or None.
    ``inject``: dict(kind=bitflip|add|zero, row=, col=, k_step=0, bit=, value=) corrupts one
    accumulator element after a K step."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise RuntimeError(f"row_checked_gemm: 2-D operands that multiply, got {tuple(a.shape)} "
                           f"and {tuple(b.shape)}")
    if a.dtype != b.dtype or a.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"row_checked_gemm: float32/float16/bfloat16 operands of one dtype, got "
                        f"{a.dtype}, {b.dtype}")
    m, k = a.shape
    n = b.shape[1]
    if not (m and n and k):
        # an empty product (or K = 0: zeros) has nothing to check: every record OK
        c = torch.zeros(m, n, dtype=a.dtype, device=a.device)
        if not check:
            return c, None, None, None
        f32 = dict(dtype=torch.float32, device=a.device)
        verdict = torch.zeros(-(-m // VERIFY["ROWS"]), 1, L.NFIELDS, **f32)
        verdict[..., L.ROW] = verdict[..., L.COL] = -1.0
        return c, verdict, torch.zeros(m, **f32), dict(res=torch.zeros(m, **f32),
                                                        thr=torch.zeros(m, **f32))
    if check and enc is None:
        enc = encode(b)
    if not check:
        z = torch.zeros(1, VW, dtype=a.dtype, device=a.device)
        enc = Encoding(z, z, None, 0)
    inj = inject or {}
    where = (int(inj.get("row", -1)), int(inj.get("col", -1)), int(inj.get("k_step", 0)),
             int(inj.get("bit", 0)))
    run = launch(a, b, enc, bool(check), INJECT_KINDS[inj["kind"]] if inject else 0, where,
                 float(inj.get("value", 0.0)), config)
    grid, args, meta, opts = run["main"]
    if meta["TMA"]:
        # the kernel builds its TMA descriptors on the device, in scratch from this allocator
        triton.set_allocator(_scratch)
    row_check_kernel[grid](*args, **meta, **opts)
    if not check:
        return run["c"], None, None, None
    grid, args, meta, opts = run["verify"]
    row_verify_kernel[grid](*args, **meta, **opts)
    sums = run["sums"]
    return run["c"], run["verdict"], run["ratio"], dict(res=sums[:, 0], thr=sums[:, 1])


__all__ = ["row_checked_gemm", "encode", "Encoding", "launch", "row_check_kernel",
           "row_verify_kernel"]
