"""The checksum threshold: a round-off model from the accumulation precision, K, the tile size
and cheap magnitudes of the operands.

For one checked sum (a column sum of C over the BM rows of a tile; row sums are the same with
A and B swapped) the residual r = sum_i C_ij - sum_k s_k B_kj, with s_k = sum_i A_ik, collects:

1. the round-off of the product: each C_ij is a dot product of length K. With rounding errors of
   variance u^2/3 at each addition, and partial sums that drift linearly to C_ij plus a random
   walk of variance Q_ij = sum_k A_ik^2 B_kj^2, the error has variance
   u^2 K (C_ij^2 / 9 + Q_ij / 6) (recursive order: blocked or pairwise orders do better);
2. the rounding of C to its stored dtype (bf16, fp16): variance u_out^2 C_ij^2 / 3;
3. tf32 rounding of the inputs: variance about (2/3) u_tf^2 Q_ij;
4. the round-off of the check itself, done in the check dtype: the sum of BM values of C, the
   sums s_k of BM values of A, and the length-K product s.B: the same model again;
5. underflow: an absolute term per operation.

Errors of different rows are treated as independent, except that rows that repeat exactly
(same squared norm and same maximum) have identical errors: the variance of a block is scaled by
the largest multiplicity ``nu`` of a row in it. Systematic rounding (constant or few-valued data,
where rounding errors do not average out) adds a bias term rho(K) u |predicted sum|, with
rho = min(K, 2 sqrt K).

The magnitude Q_pj = sum_k (sum_i A_ik^2) B_kj^2 is not computed (that would be another GEMM):
it is bounded by Hoelder's inequality from norms that cost O(MK + KN):
Q_pj <= min(||x_p||_1 ||y_j||_inf, ||x_p||_inf ||y_j||_1) with x_p = sum_i A_i^2 + s^2 and y_j = B_j^2.

threshold = LAMBDA * sqrt(variance) + bias + tiny. LAMBDA = 6 puts a Gaussian false alarm per
sum near 2e-9; the stress set in tests/test_tolerance.py decides whether that holds.
"""
import math
from dataclasses import dataclass

import torch

LAMBDA = 6.0

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
    """Growth of systematic (non-cancelling) rounding with K: min(K, 2 sqrt K)."""
    return min(float(k), 2.0 * math.sqrt(k))


def norm_bound(x_l1, x_linf, y_l1, y_linf):
    """Upper bound of sum_k x_k y_k for non-negative x, y from their 1- and inf-norms
    (broadcast: x norms of shape (..., T, 1), y norms of shape (..., 1, S))."""
    return torch.minimum(x_l1 * y_linf, x_linf * y_l1)


def sum_threshold(u, *, k, bs, sums, sq_sums, pred, qbound, nu, addend_sq=None, lam=LAMBDA):
    """Threshold of each checked sum.

    Args:
        u: ``Units`` of the product.
        k: the reduction length K.
        bs: how many elements each sum adds (BM for column sums, BN for row sums).
        sums: (..., T, S) the checked sums of C.
        sq_sums: (..., T, S) the sums of C^2 over the same elements.
        pred: (..., T, S) the predicted sums.
        qbound: (..., T, S) the bound of sum_i Q_ij (see the module docstring).
        nu: (..., T, 1) the largest multiplicity of a repeated row in each block.
        addend_sq: (..., T, S) sums of the squared addend (addmm, linear bias) or None.
    """
    ua2, uc2 = u.acc ** 2, u.chk ** 2
    prod = ua2 * k * (sq_sums / 9 + qbound / 6)
    if u.out:
        prod = prod + (u.out ** 2 / 3) * sq_sums
    if u.tf:
        prod = prod + (2 * u.tf ** 2 / 3) * qbound
    if addend_sq is not None:
        prod = prod + (ua2 * k / 3) * addend_sq
    prod = prod + bs * (k * u.eta_acc ** 2 + u.eta_out ** 2) / 3
    check = uc2 * (k * (pred.square() / 9 + qbound / 6) + bs * (sums.square() / 9 + sq_sums / 6)
                   + bs * qbound / 6)
    var = nu * prod + check
    r = rho(max(k, 1))
    return lam * var.sqrt() + r * (u.acc + u.chk) * pred.abs() + u.tiny
