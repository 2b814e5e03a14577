"""The checksum threshold: a round-off model from the accumulation precision, K, the tile size
and cheap magnitudes of the operands.

For one checked sum (a column sum of C over the BM rows of a tile; row sums are the same with
A and B swapped) the residual r = sum_i C_ij - sum_k s_k B_kj, with s_k = sum_i A_ik, collects:

1. the round-off of the product: each C_ij is a dot product of length K. With rounding errors of
   variance u^2/3 at each addition, and partial sums that drift linearly to C_ij plus a random
   walk of variance Q_ij = sum_k A_ik^2 B_kj^2, the error has variance
   u^2 K (C_ij^2 / 9 + Q_ij / 6) (recursive order: blocked or pairwise orders do better);
2. the rounding of C to its stored dtype (bf16, fp16): variance u_out^2 C_ij^2 / 3, and never
   more than its deterministic bound u_out sum_i |C_ij|;
3. tf32 rounding of the inputs: variance about (2/3) u_tf^2 Q_ij;
4. the round-off of the check itself, done in the check dtype: the sum of BM values of C, the
   sums s_k of BM values of A, and the length-K product s.B: the same model again;
5. underflow: an absolute term per operation.

Errors of different rows are treated as independent, except that rows that repeat exactly
(same squared norm and same maximum) have identical errors: the variance of a block is scaled by
the largest multiplicity ``nu`` of a row in it.

Rounding errors average out only when the summands' low bits are varied. Where a row of A and a
column of B both take few distinct values (constant, few-valued, coarsely quantised data: found
by sampling 16 values along K), the errors add up with one sign, about K/4 u |C| measured here
(MKL sgemv, dgemm): such sums get a bias allowance ((K/2) 2u + BM u) sum |C|.
All other sums get the small allowance 2 sqrt(K) u |predicted sum|.

The magnitude Q_pj = sum_k (sum_i A_ik^2) B_kj^2 is not computed (that would be another GEMM):
it is bounded by Hoelder's inequality from norms that cost O(MK + KN):
Q_pj <= min(||x_p||_1 ||y_j||_inf, ||x_p||_inf ||y_j||_1) with x_p = sum_i A_i^2 + s^2 and y_j = B_j^2.

threshold = LAMBDA * sqrt(variance) + bias + tiny. LAMBDA = 6 puts a Gaussian false alarm per
sum near 2e-9; the stress set in tests/test_tolerance.py decides whether that holds.

For K <= SMALL_K the exact T = sum_i sum_k |A_ik| |B_kj| costs O(MN SMALL_K / BM), and the threshold
is capped by the deterministic worst-case bound built from it (a cap no round-off can exceed):
at small K the probabilistic terms would otherwise pass it for spiky (heavy-tailed) data.
"""
import math
from dataclasses import dataclass

import torch

LAMBDA = 6.0
SMALL_K = 64

_UNIT = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24,
         torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
# Half the smallest subnormal: the absolute rounding of a result that underflows.
_ETA = {torch.float64: 2.0 ** -1075, torch.float32: 2.0 ** -150,
        torch.float16: 2.0 ** -25, torch.bfloat16: 2.0 ** -134}
TF32_UNIT = 2.0 ** -11


@dataclass(frozen=True)
class Units:
    acc: float      # unit round-off of the accumulation
    out: float      # rounding of the accumulator to the output dtype (0 when they are the same)
    chk: float      # unit round-off of the check arithmetic
    tf: float       # tf32 input rounding (0 unless tf32 is on)
    eta_acc: float  # absolute underflow unit of the accumulation
    eta_out: float  # absolute underflow unit of the output dtype
    tiny: float     # a floor that keeps every threshold positive


def check_dtype(dtype):
    """The dtype the checks run in: float64 for float64, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def units(dtype, *, accumulator=None, tf32=False):
    """Round-off units of a product of ``dtype`` operands accumulated in ``accumulator``
    (float32 for the half types and float32, float64 for float64)."""
    acc = accumulator or check_dtype(dtype)
    chk = check_dtype(dtype)
    return Units(acc=_UNIT[acc], out=_UNIT[dtype] if dtype != acc else 0.0, chk=_UNIT[chk],
                 tf=TF32_UNIT if tf32 else 0.0, eta_acc=_ETA[acc], eta_out=_ETA[dtype],
                 tiny=torch.finfo(chk).tiny)


def rho(k):
    """Bias allowance for varied data: min(K, 2 sqrt K)."""
    return min(float(k), 2.0 * math.sqrt(k))


def low_entropy(x, samples=16):
    """(..., R, K) -> (..., R) bool: rows whose values, sampled at ``samples`` fixed places along K,
    take at most samples/4 distinct values (constant, few-valued or coarsely quantised data)."""
    k = x.shape[-1]
    if k == 0:
        return torch.ones(x.shape[:-1], dtype=torch.bool, device=x.device)
    n = min(k, samples)
    idx = torch.linspace(0, k - 1, n, device=x.device).round().long()
    if x.stride(-1) != 1 and x.dim() >= 2:
        v = x.mT.index_select(-2, idx).mT.contiguous()   # gather whole rows of the stored layout
    else:
        v = x.index_select(-1, idx)
    # distinct values = sum over samples of 1 / (how many samples equal it)
    same = torch.count_nonzero(v.unsqueeze(-1) == v.unsqueeze(-2), dim=-1)
    distinct = (1.0 / same).sum(-1)
    return distinct <= max(2, n // 4) + 0.5


def norm_bound(x_l1, x_linf, y_l1, y_linf):
    """Upper bound of sum_k x_k y_k for non-negative x, y from their 1- and inf-norms
    (broadcast: x norms of shape (..., T, 1), y norms of shape (..., 1, S))."""
    return torch.minimum(x_l1 * y_linf, x_linf * y_l1)


def sum_threshold(u, *, k, bs, sums, sq_sums, pred, qbound, nu, abs_sums=None, low_entropy=None,
                  addend_sq=None, lam=LAMBDA):
    """Threshold of each checked sum.

    Args:
        u: ``Units`` of the product.
        k: the reduction length K.
        bs: how many elements each sum adds (BM for column sums, BN for row sums).
        sums: (..., T, S) the checked sums of C.
        sq_sums: (..., T, S) the sums of C^2 over the same elements.
        abs_sums: (..., T, S) the sums of |C|.
        pred: (..., T, S) the predicted sums.
        qbound: (..., T, S) the bound of sum_i Q_ij (see the module docstring).
        nu: (..., T, 1) the largest multiplicity of a repeated row in each block.
        low_entropy: (..., T, S) bool, sums whose terms may round with one sign, or None.
        addend_sq: (..., T, S) sums of the squared addend (addmm, linear bias) or None.
    """
    ua2, uc2 = u.acc ** 2, u.chk ** 2
    prod = (ua2 * k) * (sq_sums / 9 + qbound / 6)
    if u.tf:
        prod = prod + (2 * u.tf ** 2 / 3) * qbound
    if addend_sq is not None:
        prod = prod + (ua2 * k / 3) * addend_sq
    prod = prod + bs * k * u.eta_acc ** 2 / 3
    # a corrupted sum may overflow its square; a legitimate one cannot while the inputs' terms are
    # finite, so the clamp keeps a huge error an alarm rather than an unverified tile
    sums_sq = sums.square().clamp(max=torch.finfo(sums.dtype).max)
    # the small units multiply first: a clamped (huge) square must not overflow the sum
    check = (uc2 * k) * (pred.square() / 9 + qbound / 6) + (uc2 * bs) * (sums_sq / 9 + sq_sums / 6
                                                                        + qbound / 6)
    var = nu * prod + check
    thr = lam * var.sqrt() + rho(max(k, 1)) * (u.acc + u.chk) * pred.abs() + u.tiny
    if u.out:
        # Rounding of C to its dtype: at most u_out |C| per element (its deterministic bound).
        rounding = lam * (nu * (u.out ** 2 * sq_sums + bs * u.eta_out ** 2) / 3).sqrt()
        thr = thr + torch.minimum(rounding, u.out * abs_sums + bs * u.eta_out)
    if low_entropy is not None:
        systematic = ((k / 2) * (u.acc + u.chk) + bs * u.chk) * abs_sums
        thr = thr + torch.where(low_entropy, systematic, torch.zeros((), dtype=thr.dtype, device=thr.device))
    return thr


def gamma(n, unit):
    return n * unit / (1 - n * unit)


def worst_case(u, *, k, bs, t, abs_sums, abs_addend=None):
    """Deterministic bound of a checked sum's round-off, a little below the rigorous one.

    Args:
        t: (..., T, S) sum_i sum_k |alpha A_ik| |B_kj| over the sum's elements.
        abs_sums: (..., T, S) sum_i |C_ij|.
        abs_addend: (..., T, S) sum_i |addend_ij| or None.
    """
    w = (gamma(k, u.acc) + gamma(k, u.chk) + gamma(bs, u.chk)) * t \
        + (u.out + gamma(bs, u.chk)) * abs_sums + bs * u.eta_out
    if abs_addend is not None:
        w = w + (u.acc + gamma(bs, u.chk)) * abs_addend
    return w * (1 - 8 * u.chk)
