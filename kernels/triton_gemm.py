"""The fused checked GEMM: C = alpha * A.B + beta * D, with Huang-Abraham checks of A.B's fp32
accumulator before it is rounded.

Design (per output tile of BM x BN, per K step of BK):
- the product: ``acc += tl.dot(a, b)`` (fp32 accumulation; tf32 for fp32 inputs only when the
  user's torch setting allows it);
- the predicted sums, in the same K loop from the tiles already in registers:
  column sums ``pc += sum_k (sum_i a_ik) b_kj`` and row sums ``pr += sum_k a_ik (sum_j b_kj)``;
- the magnitudes of the threshold, exactly (the reference backend can only bound them):
  ``qc += sum_k (sum_i a_ik^2 + s_k^2) b_kj^2`` and ``qr`` likewise, the row keys sum_k a_ik^2
  (repeated rows), and for K <= SMALL_K the exact sum |a||b| of the worst-case cap;
- before the loop, the low-entropy flags of the tile's rows of A and columns of B (16 samples
  along K each, ``abft.tolerance.low_entropy``), so a checked call is one launch, no side kernels;
- after the loop, on the accumulator before it is rounded: column and row sums of acc, of acc^2
  and of |acc|, residuals, thresholds (``abft.tolerance``'s model with u_out = 0: a bf16 GEMM is
  checked at fp32 resolution), and one verdict record per tile in ``kernels/layout.py``'s format;
  then the epilogue alpha * acc + beta * D in fp32 (D: linear's bias, addmm's or baddbmm's input,
  any strides) and one rounding to the output dtype.

Why predictions in the K loop: no pre-pass over A or B (it would read both operands once more,
M.K + K.N elements, as many as the GEMM's compulsory reads, in a second launch), no cached weight
checksums to keep coherent with optimizer steps, and the check sees exactly the tiles the dot
used. Cost per K step, beside the BM.BN.BK multiply-adds of the dot: the predictions take
BK(BM + BN) multiply-adds, the magnitudes about 3 BK(BM + BN), all on CUDA cores in fp32:
4 (1/BM + 1/BN) of the dot's work, 6% at 128 x 128, but at CUDA-core rather than tensor-core
speed (about 15x slower on Hopper), so on paper the check costs more than the 3% target there.
Bytes: none beyond the tiles the dot loads, plus 2 x 16 x (BM + BN) sampled elements per tile and
BM + BN + 9 floats written per tile. Moving the predictions onto tensor cores (s split into bf16
hi/lo rows appended to the A tile) is the next step and needs a GPU to measure.
Not measured on a GPU yet: no device was lent to the sessions that wrote it.

tf32: a tf32 MMA fed raw fp32 operands (Triton's tl.dot) drops their 13 low mantissa bits, a
relative change in (-2^-10, 0] per input, i.e. -2^-11 +- 2^-11: the threshold adds the random part
(variance (2/3) u_tf^2 per product, u_tf = 2^-11) and the bias, 2 u_tf |predicted sum|. The
tests emulate both chopping and rounding in the kernel on the CPU (``tf32=``).

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
from abft.tolerance import LAMBDA, SMALL_K, TF32_UNIT, gamma, rho

INJECT_KINDS = {"bitflip": 1, "add": 2, "zero": 3}


@triton.jit
def _low_entropy(base, stride_r, stride_k, r, r_ok, K, SAMPLES: tl.constexpr):
    """Per row r of a (R, K) operand: does it take at most SAMPLES/4 distinct values at SAMPLES
    evenly spaced places along K? (``abft.tolerance.low_entropy``, inside the kernel so the check
    needs no side launches.)"""
    n = tl.minimum(K, SAMPLES)
    s = tl.arange(0, SAMPLES)
    s_ok = s < n
    at = (s * (K - 1) + (n - 1) // 2) // tl.maximum(n - 1, 1)
    v = tl.load(base + r[:, None] * stride_r + at[None, :] * stride_k,
                mask=r_ok[:, None] & s_ok[None, :], other=0.0).to(tl.float32)
    same = tl.sum(tl.where((v[:, :, None] == v[:, None, :]) & s_ok[None, None, :], 1.0, 0.0), 2)
    distinct = tl.sum(tl.where(s_ok[None, :], 1.0 / tl.maximum(same, 1.0), 0.0), 1)
    return (distinct <= tl.maximum(2, n // 4) + 0.5) & r_ok


@triton.jit
def _checked_gemm_kernel(
    # operands, output, addend (bias: strides 0, 0, 1)
    a_ptr, b_ptr, c_ptr, d_ptr,
    # verdict (B, TM, TN, 9), row ratios (B, M, TN), column ratios (B, TM, N), low-entropy flags
    v_ptr, rr_ptr, rc_ptr,
    # sizes
    M, N, K, TM, TN,
    # strides
    stride_ab, stride_am, stride_ak,
    stride_bb, stride_bk, stride_bn,
    stride_cb, stride_cm, stride_cn,
    stride_db, stride_dm, stride_dn,
    # epilogue: out = alpha * acc + beta * addend
    alpha, beta,
    # threshold constants (ut: tf32 input unit, 0 without tf32)
    u, ut, lam, rho_k, tiny, g_cap, g_bm, g_bn,
    # fault injection: batch, row, column, K step, bit, value
    inj_b, inj_m, inj_n, inj_k, inj_bit, inj_val,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_ADD: tl.constexpr, SCALED: tl.constexpr, CHECK: tl.constexpr, INJECT: tl.constexpr,
    DOT_FP32: tl.constexpr, ALLOW_TF32: tl.constexpr, TF32_EMU: tl.constexpr, CAP: tl.constexpr,
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

    if CHECK:
        # constant, few-valued or coarsely quantised rows of A (columns of B): their errors
        # correlate, so the sums of a tile of them get a worst-case allowance. Found before the
        # K loop, while few registers are live (a (BM, 16, 16) comparison)
        alow = _low_entropy(a_base, stride_am, stride_ak, rm, m_ok, K, 16)
        blow = _low_entropy(b_base, stride_bn, stride_bk, rn, n_ok, K, 16)
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
        low_m = tl.max(alow.to(tl.int32), 0) > 0
        low_n = tl.max(blow.to(tl.int32), 0) > 0
        bmf = BLOCK_M * 1.0
        bnf = BLOCK_N * 1.0
        u2 = u * u
        ut2 = ut * ut
        # column sums (over the tile's BM rows)
        # the small units multiply first: a clamped (huge) square must not overflow the sum
        var_c = nu_m * ((u2 * kf) * (colsq / 9 + qc / 6) + (2.0 / 3.0) * ut2 * qc) \
            + (u2 * kf) * (pc * pc / 9 + qc / 6) + (u2 * bmf) * (colsum2 / 9 + colsq / 6 + qc / 6)
        # tf32 chops each input: a bias of up to ut per operand, so 2 ut of the predicted sum
        thr_c = lam * tl.sqrt(var_c) + (rho_k * 2 * u + 2 * ut) * tl.abs(pc) + tiny
        thr_c += tl.where(low_m & blow, ((kf / 2) * 2 * u + bmf * u) * colabs, 0.0)
        # row sums (over the tile's BN columns)
        var_r = nu_n * ((u2 * kf) * (rowsq / 9 + qr / 6) + (2.0 / 3.0) * ut2 * qr) \
            + (u2 * kf) * (pr * pr / 9 + qr / 6) + (u2 * bnf) * (rowsum2 / 9 + rowsq / 6 + qr / 6)
        thr_r = lam * tl.sqrt(var_r) + (rho_k * 2 * u + 2 * ut) * tl.abs(pr) + tiny
        thr_r += tl.where(low_n & alow, ((kf / 2) * 2 * u + bnf * u) * rowabs, 0.0)
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
    if SCALED:
        out = alpha * out
    if HAS_ADD:
        d = tl.load(d_ptr + pid_b * stride_db + rm[:, None] * stride_dm + rn[None, :] * stride_dn,
                    mask=m_ok[:, None] & n_ok[None, :], other=0.0)
        out += beta * d.to(tl.float32)
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


def _launch_impl(a3: torch.Tensor, b3: torch.Tensor, addend: Optional[torch.Tensor],
                 alpha: float, beta: float, bm: int, bn: int, check: bool, tf32: bool,
                 tf32_emulation: int, inject_kind: int, inject_at: List[int], inject_value: float,
                 block_k: int, num_warps: int, num_stages: int,
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One launch over a (B, M, K) x (B, K, N) batch; block_k = 0 lets the autotuner choose (on a
    GPU) or takes the factory's one config (under the interpreter)."""
    bt, m, k = a3.shape
    n = b3.shape[2]
    tm, tn = triton.cdiv(m, bm), triton.cdiv(n, bn)
    dev = a3.device
    c = torch.empty(bt, m, n, dtype=a3.dtype, device=dev)
    verdict = torch.empty(bt, tm, tn, L.NFIELDS, dtype=torch.float32, device=dev)
    rr = torch.empty(bt, m, tn, dtype=torch.float32, device=dev)
    rc = torch.empty(bt, tm, n, dtype=torch.float32, device=dev)
    if bt * tm * tn == 0:
        return c, verdict, rr, rc
    # without an addend, a3 stands in for it (never read): no output may alias another argument
    d = addend if addend is not None else a3
    u = 2.0 ** -24
    ut = TF32_UNIT if (tf32 or tf32_emulation) else 0.0
    meta = dict(BLOCK_M=bm, BLOCK_N=bn, HAS_ADD=addend is not None, SCALED=alpha != 1.0,
                CHECK=check, INJECT=inject_kind,
                DOT_FP32=_configs.interpreting() and a3.dtype == torch.bfloat16,
                ALLOW_TF32=tf32, TF32_EMU=tf32_emulation, CAP=check and k <= SMALL_K)
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
    wrap_triton(kernel)[(tm * tn, bt)](
        a3, b3, c, d,
        verdict, rr, rc,
        m, n, k, tm, tn,
        a3.stride(0), a3.stride(1), a3.stride(2),
        b3.stride(0), b3.stride(1), b3.stride(2),
        c.stride(0), c.stride(1), c.stride(2),
        d.stride(0), d.stride(1), d.stride(2),
        alpha, beta,
        u, ut, LAMBDA, rho(max(k, 1)), torch.finfo(torch.float32).tiny,
        2 * gamma(k, u) + gamma(bm, u), gamma(bm, u), gamma(bn, u),
        ib, im, jn, ik, ibit, inject_value,
        **meta,
    )
    return c, verdict, rr, rc


def _launch_fake(a3, b3, addend, alpha, beta, bm, bn, check, tf32, tf32_emulation, inject_kind,
                 inject_at, inject_value, block_k, num_warps, num_stages):
    bt, m, _ = a3.shape
    n = b3.shape[2]
    tm, tn = -(-m // bm), -(-n // bn)
    f32 = dict(dtype=torch.float32, device=a3.device)
    return (a3.new_empty(bt, m, n), a3.new_empty(bt, tm, tn, L.NFIELDS, **f32),
            a3.new_empty(bt, m, tn, **f32), a3.new_empty(bt, tm, n, **f32))


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
                 inject=None, tf32=None, config=None):
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
    if a3.shape[0] != bt:
        a3 = a3.expand(bt, *a3.shape[1:])
    if b3.shape[0] != bt:
        b3 = b3.expand(bt, *b3.shape[1:])
    _, m, k = a3.shape
    n = b3.shape[2]
    if b3.shape[1] != k:
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
    inj = inject or {}
    where = [int(inj.get("batch", 0)), int(inj.get("row", -1)), int(inj.get("col", -1)),
             int(inj.get("k_step", 0)), int(inj.get("bit", 0))]
    cfg = (config.kwargs["BLOCK_K"], config.num_warps, config.num_stages) if config else (0, 0, 0)
    c, verdict, rr, rc = _launch(a3, b3, add, float(alpha), float(beta), bm, bn, bool(check), tf,
                                 emu, INJECT_KINDS[inj["kind"]] if inject else 0, where,
                                 float(inj.get("value", 0.0)), *cfg)
    if squeeze:
        c = c[0]
    if not check:
        return c, None, None
    return c, verdict, (rr, rc)


def tiles_for(m, n, k, dtype):
    return _configs.tile(m, n, k, dtype)


__all__ = ["checked_gemm", "tiles_for", "INJECT_KINDS"]
