"""The fused kernel's pre-pass: an operand's checksums and statistics, one program per block.

For the rows of x (..., R, K) (the rows of A, or of B^T: the columns of B) and blocks of ``dm`` rows
(a tile's data rows), one program per block reads the block along K and writes:

- the checksum of the block, s_k = sum_i x_ik 2^-E in fp32 (in the block's scale, so its parts
  fit fp16's range and keep their precision at any scale; fp16's times 2^S, ``chk_shift``), split
  into ``parts`` values in the operand's dtype (hi, mid, lo: bf16 keeps 8 bits a part and fp16
  11, so three parts carry fp32's 24; fp16's last part may be subnormal, ``split_error``), which
  the main kernel's tensor cores multiply exactly; one fp32 part for fp32 operands (the dot is in
  fp32), three tf32 parts for tf32; ``pad`` - ``parts`` rows of zeros after them where the main
  kernel needs a whole vector, stored K-contiguous or not;
- the statistics of ``stats.operand_stats``, the same quantities in float32 (the reference computes
  them in float64): per row the exponent e_i of max_k |x_ik|, the 1- and inf-norms of (x 2^-e_i)^2,
  the low-entropy flag; per block the exponent E, the norms of sum_i (x 2^-E)^2 and of (s 2^-E)^2,
  the multiplicity of a repeated row, any low-entropy row, all rows finite.

Two reads of the block: the first finds each row's exponent and the block's, the second sums in
units scaled by those powers of two (so no square overflows, and the checksum's parts are exact
to the same relative precision at any scale: the verdict is invariant when an operand is scaled
by a power of two). A block is DM x K: with many in flight, the second read comes from HBM, as
``abft bench --static`` counts it. (A one-read variant that rescales as the exponents grow lost
that invariance: its unscaled checksums' parts go subnormal below 2^-110.)
"""
import math
from typing import Tuple

import torch
import triton
import triton.language as tl
from torch.library import custom_op, triton_op, wrap_triton

from abft.kernels.configs import interpreting
from abft.kernels.threshold import pow2_tl

ROW_E, ROW_R1, ROW_RINF, ROW_LOW = range(4)
ROW_FIELDS = 4
BLK_E, BLK_X1, BLK_XINF, BLK_XS1, BLK_XSINF, BLK_NU, BLK_LOW, BLK_FINITE = range(8)
BLOCK_FIELDS = 8
SAMPLES = 16                        # low-entropy samples per row, as stats.low_entropy
_SAMPLES = tl.constexpr(SAMPLES)

_RE, _RR1, _RRINF, _RLOW = (tl.constexpr(x) for x in (ROW_E, ROW_R1, ROW_RINF, ROW_LOW))
_BE, _BX1, _BXINF, _BXS1, _BXSINF, _BNU, _BLOW, _BFIN = (tl.constexpr(x) for x in (
    BLK_E, BLK_X1, BLK_XINF, BLK_XS1, BLK_XSINF, BLK_NU, BLK_LOW, BLK_FINITE))
_RF, _BF = tl.constexpr(ROW_FIELDS), tl.constexpr(BLOCK_FIELDS)


def chk_shift(dtype, dm):
    """S: fp16 checksums of blocks of ``dm`` rows are split in units of 2^(E - S), not 2^E. In
    the block's units a checksum is below dm (every scaled value is below 1), so dm 2^S <= 2^15
    keeps its parts in fp16's range, and the last part's subnormal grid (its floor of precision,
    ``split_error``) is 2^S finer than in the block's units (S < 0 past 2^15 rows: coarser, in
    range); the main kernels divide the prediction by 2^S. 0 for the other dtypes (bf16's range
    needs no shift; fp32 and tf32 parts are not subnormal)."""
    if dtype != torch.float16:
        return 0
    return 15 - math.ceil(math.log2(max(int(dm), 1)))


def split_error(dtype, tf32=False, shift=0):
    """(log2 of eta, absolute): how far the parts may be from the checksum they split, in the
    block's units (the checksum times 2^-E): half the last part's subnormal grid, 2^-134 (bf16),
    2^-(25 + shift) (fp16 split ``shift`` binades above the block's units, ``chk_shift``),
    2^-150 (tf32 and fp32). At most eta a checksum, of one sign where the checksums are equal
    (``threshold``: deterministic). Scaled units: the verdict stays invariant when an operand is
    scaled by a power of two."""
    if dtype == torch.float16:
        return -25.0 - shift, False
    if dtype == torch.bfloat16:
        return -134.0, False
    return -150.0, False


def parts_for(dtype, tf32):
    """How many parts a checksum is split into for the tensor cores: 3 for bf16, fp16 and tf32,
    1 for fp32 (an fp32 dot)."""
    return 3 if dtype in (torch.bfloat16, torch.float16) or tf32 else 1


@triton.jit
def exponent_tl(v):
    """e with v = m 2^e, m in [0.5, 1), for v >= 0 (``stats.exponents``): 0 for 0 and non-finite
    values; subnormals count as the smallest normal's exponent."""
    bits = v.to(tl.int32, bitcast=True)
    field = (bits >> 23) & 255
    e = tl.maximum(field, 1) - 126
    return tl.where((v > 0) & (field < 255), e, 0).to(tl.float32)


@triton.jit
def _low_entropy(base, stride_r, stride_k, r, r_ok, K, SAMPLES: tl.constexpr):
    """``stats.low_entropy`` per row: at most SAMPLES/4 distinct values at SAMPLES evenly spaced
    places along K, or one nonzero value at SAMPLES/4 of them or more."""
    n = tl.minimum(K, SAMPLES)
    s = tl.arange(0, SAMPLES)
    s_ok = s < n
    at = (s * (K - 1) + (n - 1) // 2) // tl.maximum(n - 1, 1)
    v = tl.load(base + r[:, None] * stride_r + at[None, :] * stride_k,
                mask=r_ok[:, None] & s_ok[None, :], other=0.0).to(tl.float32)
    eq = (v[:, :, None] == v[:, None, :]) & s_ok[None, None, :]
    same = tl.sum(tl.where(eq, 1.0, 0.0), 2)
    distinct = tl.sum(tl.where(s_ok[None, :], 1.0 / tl.maximum(same, 1.0), 0.0), 1)
    repeated = tl.max(tl.where(s_ok[None, :] & (v != 0), same, 0.0), 1)
    quarter = tl.maximum(2, n // 4)
    return ((distinct <= quarter + 0.5) | (repeated >= quarter)) & r_ok


@triton.jit
def prepass_kernel(
    x_ptr, rows_ptr, blocks_ptr, parts_ptr,
    R, K,
    stride_xb, stride_xr, stride_xk,
    stride_rowb, stride_blkb, stride_pb, stride_pr, stride_pk,
    DM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PARTS: tl.constexpr,
    PAD: tl.constexpr, TF32: tl.constexpr, CHK_SCALE: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    pid_b = tl.program_id(1).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    g = pid * DM + r
    r_ok = (r < DM) & (g < R)
    base = x_ptr + pid_b * stride_xb
    rk = tl.arange(0, BLOCK_K)
    # first read: each row's largest magnitude (its exponent) and whether it is finite
    amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
    bad = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for ks in range(0, tl.cdiv(K, BLOCK_K)):
        kk = ks * BLOCK_K + rk
        x = tl.load(base + g[:, None] * stride_xr + kk[None, :] * stride_xk,
                    mask=r_ok[:, None] & (kk < K)[None, :], other=0.0).to(tl.float32)
        ax = tl.abs(x)
        fin = ax < float("inf")                       # false for inf and NaN
        bad += tl.sum(tl.where(fin, 0.0, 1.0), 1)
        amax = tl.maximum(amax, tl.max(tl.where(fin, ax, 0.0), 1))
    e_i = tl.where(bad > 0, 0.0, exponent_tl(amax))
    # zero and non-finite rows do not set the block's scale; an all-zero block has E = 0
    big_e = tl.max(tl.where(r_ok & (amax > 0) & (bad == 0), e_i, -1000.0), 0)
    big_e = tl.where(big_e > -1000.0, big_e, 0.0)
    # 2^-e as two factors 2^-h 2^-(e-h), each in float32's normal range for any e of a finite
    # value (-149 to 128); inline (a nested call costs milliseconds a step under the interpreter)
    h_i = tl.floor(-e_i * 0.5)
    row_a = ((tl.minimum(tl.maximum(h_i, -126.0), 127.0).to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    row_b = ((tl.minimum(tl.maximum(-e_i - h_i, -126.0), 127.0).to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    h_b = tl.floor(-big_e * 0.5)
    blk_a = ((tl.minimum(tl.maximum(h_b, -126.0), 127.0).to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    blk_b = ((tl.minimum(tl.maximum(-big_e - h_b, -126.0), 127.0).to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    # the (second) read: sums in scaled units, and the split checksums
    r1 = tl.zeros((BLOCK_R,), dtype=tl.float32)
    x1 = 0.0
    xinf = 0.0
    xs1 = 0.0
    xsinf = 0.0
    for ks in range(0, tl.cdiv(K, BLOCK_K)):
        kk = ks * BLOCK_K + rk
        k_ok = kk < K
        x = tl.load(base + g[:, None] * stride_xr + kk[None, :] * stride_xk,
                    mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        fin = tl.abs(x) < float("inf")
        xf = tl.where(fin, x, 0.0)
        xs = xf * row_a[:, None] * row_b[:, None]
        r1 += tl.sum(xs * xs, 1)
        xb = xf * blk_a * blk_b
        sqsum = tl.sum(xb * xb, 0)
        x1 += tl.sum(sqsum, 0)
        xinf = tl.maximum(xinf, tl.max(sqsum, 0))
        s = tl.sum(x * blk_a * blk_b, 0)        # the checksum in units of 2^E (NaN, inf propagate)
        sf = tl.sum(xb, 0)
        xs1 += tl.sum(sf * sf, 0)
        xsinf = tl.maximum(xsinf, tl.max(sf * sf, 0))
        # split the checksum into parts the main kernel's dot multiplies exactly; rows PARTS to
        # PAD - 1 are zero (padding that keeps the main kernel's loads vectorised)
        prow = parts_ptr + pid_b * stride_pb + (pid * PAD) * stride_pr + kk * stride_pk
        if PARTS == 1:
            tl.store(prow, s, mask=k_ok)
        else:
            if TF32:
                hi = (s.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
                rest = s - hi
                mid = (rest.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
                lo = rest - mid
                lo = (lo.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
            else:
                s = s * CHK_SCALE                   # 2^S (``chk_shift``): exact
                hi = s.to(parts_ptr.dtype.element_ty).to(tl.float32)
                rest = s - hi
                mid = rest.to(parts_ptr.dtype.element_ty).to(tl.float32)
                lo = rest - mid
            tl.store(prow, hi.to(parts_ptr.dtype.element_ty), mask=k_ok)
            tl.store(prow + stride_pr, mid.to(parts_ptr.dtype.element_ty), mask=k_ok)
            tl.store(prow + 2 * stride_pr, lo.to(parts_ptr.dtype.element_ty), mask=k_ok)
        for p in tl.static_range(PARTS, PAD):
            tl.store(prow + p * stride_pr, tl.zeros_like(s).to(parts_ptr.dtype.element_ty), mask=k_ok)
    sc = amax * row_a * row_b
    rinf = sc * sc
    low = _low_entropy(base, stride_xr, stride_xk, g, r_ok, K, _SAMPLES)
    # the largest multiplicity of a row repeated exactly (equal exponents and sums of squares), or
    # the number of low-entropy rows (stats.operand_stats)
    key = tl.where(r_ok & (bad == 0), r1, -1.0 - r.to(tl.float32))
    same = (key[:, None] == key[None, :]) & (e_i[:, None] == e_i[None, :])
    nu = tl.maximum(tl.max(tl.sum(same.to(tl.float32), 1), 0), tl.sum(tl.where(r_ok & low, 1.0, 0.0), 0))
    finite = tl.max(tl.where(r_ok, bad, 0.0), 0) == 0
    ro = rows_ptr + pid_b * stride_rowb + g * _RF
    tl.store(ro + _RE, e_i, mask=r_ok)
    tl.store(ro + _RR1, r1, mask=r_ok)
    tl.store(ro + _RRINF, rinf, mask=r_ok)
    tl.store(ro + _RLOW, low.to(tl.float32), mask=r_ok)
    bo = blocks_ptr + pid_b * stride_blkb + pid * _BF
    f8 = tl.arange(0, 8)
    rec = tl.where(f8 == _BE, big_e, tl.where(f8 == _BX1, x1, tl.where(f8 == _BXINF, xinf, tl.where(
        f8 == _BXS1, xs1, tl.where(f8 == _BXSINF, xsinf, tl.where(f8 == _BNU, nu, tl.where(
            f8 == _BLOW, tl.max(low.to(tl.float32), 0), tl.where(finite, 1.0, 0.0))))))))
    tl.store(bo + f8, rec)


class Prepared:
    """The pre-pass's output for one operand: per-row and per-block statistics and the split
    checksums, ``pad`` rows per block of ``dm`` data rows (``nparts`` of them nonzero), stored
    contiguous along K (``k_major``) or along the blocks' rows."""

    def __init__(self, rows, blocks, parts, dm, nparts, pad, k_major):
        self.rows, self.blocks, self.parts = rows, blocks, parts
        self.dm, self.nparts, self.pad, self.k_major = dm, nparts, pad, k_major

    @property
    def key(self):
        return self.dm, self.nparts, self.pad, self.k_major


def launch(x, dm, nparts, pad, k_major, tf32, block_k):
    """The pre-pass's outputs, grid, positional arguments and meta-parameters for x (B, R, K)."""
    bt, r, k = x.shape
    t = -(-r // dm)
    dev = x.device
    rows = torch.empty(bt, r, ROW_FIELDS, dtype=torch.float32, device=dev)
    blocks = torch.empty(bt, t, BLOCK_FIELDS, dtype=torch.float32, device=dev)
    pdt = torch.float32 if x.dtype == torch.float32 else x.dtype
    if k_major:
        parts = torch.empty(bt, t * pad, k, dtype=pdt, device=dev)
    else:
        parts = torch.empty(bt, k, t * pad, dtype=pdt, device=dev).transpose(1, 2)
    args = (x, rows, blocks, parts, r, k,
            x.stride(0), x.stride(1), x.stride(2),
            rows.stride(0), blocks.stride(0), parts.stride(0), parts.stride(1), parts.stride(2))
    meta = dict(DM=dm, BLOCK_R=triton.next_power_of_2(dm), BLOCK_K=block_k, PARTS=nparts, PAD=pad,
                TF32=tf32, CHK_SCALE=2.0 ** chk_shift(x.dtype, dm))
    return (rows, blocks, parts), (t, bt), args, meta


def _impl(x: torch.Tensor, dm: int, nparts: int, pad: int, k_major: bool, tf32: bool,
          block_k: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    outs, grid, args, meta = launch(x, dm, nparts, pad, k_major, tf32, block_k)
    if grid[0] * grid[1]:
        wrap_triton(prepass_kernel)[grid](*args, **meta)
    return outs


def _fake(x, dm, nparts, pad, k_major, tf32, block_k):
    bt, r, k = x.shape
    t = -(-r // dm)
    pdt = torch.float32 if x.dtype == torch.float32 else x.dtype
    parts = (x.new_empty(bt, t * pad, k, dtype=pdt) if k_major
             else x.new_empty(bt, k, t * pad, dtype=pdt).transpose(1, 2))
    return (x.new_empty(bt, r, ROW_FIELDS, dtype=torch.float32),
            x.new_empty(bt, t, BLOCK_FIELDS, dtype=torch.float32), parts)


if interpreting():
    _launch = custom_op("abft::prepass", mutates_args=())(_impl)
    _launch.register_fake(_fake)
else:
    _launch = triton_op("abft::prepass", mutates_args=())(_impl)


def prepare(x, dm, nparts, pad=None, k_major=True, tf32=False, block_k=None):
    """Run the pre-pass on the rows of x (R, K) or (B, R, K), any strides: a ``Prepared`` with
    ``pad`` (default ``nparts``) checksum rows per block, stored K-contiguous or not."""
    x3 = x if x.dim() == 3 else x.unsqueeze(0)
    bk = block_k or (128 if interpreting() else 64)      # the interpreter: fewer, wider steps
    nparts = max(int(nparts), 1)
    pad = max(int(pad or nparts), nparts)
    rows, blocks, parts = _launch(x3, int(dm), nparts, pad, bool(k_major), bool(tf32), int(bk))
    return Prepared(rows, blocks, parts, int(dm), nparts, pad, bool(k_major))


__all__ = ["prepare", "launch", "Prepared", "parts_for", "split_error", "chk_shift", "ROW_FIELDS",
           "BLOCK_FIELDS"]
