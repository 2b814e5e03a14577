"""The fused kernel as it was at commit 31901d1 (before "The checked kernel at tensor-core speed"),
kept verbatim for one purpose: the SASS reader's test compiles it for sm_90 and must find the
figures the issue measured (about 3,942 instructions in the HGMMA loop against 601 with
CHECK=False, and about 300 local-memory instructions), so that the reader can fail.
Not imported by the package."""
import triton
import triton.language as tl


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


