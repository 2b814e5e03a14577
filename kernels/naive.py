"""What a correct check is, written as plainly as possible in float64: the oracle both backends
are tested against (``tests/kernels/test_threshold.py``, ``tests/kernels/test_triton_gemm.py``), sharing nothing
with the threshold model (``threshold.py``) it bounds.

For C = A·B checked in tiles of bm x bn, each column's sum over a block of bm rows and each row's
sum over a block of bn columns is a checked sum. ``residuals`` are the stored C's errors in those
sums against the float64 product; ``worst_case`` bounds the round-off any of them can carry, so
a sum whose residual passes it holds a fault (``must_alarm``: a correct check alarms there), and
a threshold above it lets such a fault through.
"""
import torch


def unit(dtype):
    """The unit round-off of ``dtype`` (float32 2^-24, bfloat16 2^-8, ...)."""
    return torch.finfo(dtype).eps / 2


def gamma(n, u):
    """n u / (1 - n u): the bound on the relative error of n roundings of unit u."""
    return n * u / (1 - n * u)


def block_sums(x, bs, dim):
    """Sums of blocks of ``bs`` along ``dim`` (0 or 1) in float64; the last block may be shorter."""
    return torch.stack([c.double().sum(dim) for c in x.split(bs, dim)], dim)


def residuals(a, b, c, bm, bn):
    """The stored c's errors in its checked sums: (column sums (TM, N), row sums (M, TN))."""
    e = c.double() - a.double() @ b.double()
    return block_sums(e, bm, 0), block_sums(e, bn, 1)


def worst_case(a, b, c, bm, bn):
    """Deterministic bound of every checked sum's round-off, (column sums (TM, N), row sums
    (M, TN)): the product's, gamma_K sum |a||b| accumulated in float32 (float64 for float64), plus
    C's rounding to its dtype (u/(1 - u) |c|, or half the smallest subnormal below the normal
    range); the check's in float64: gamma_bs for the sums of C and of A (or B), gamma_K for the
    predicted product; plus float32's (float64's) underflow per term."""
    dt = c.dtype
    u_acc = unit(torch.float64 if dt == torch.float64 else torch.float32)
    u_out = 0.0 if dt in (torch.float32, torch.float64) else unit(dt)
    u_chk = unit(torch.float64)
    eta = torch.finfo(torch.float64 if dt == torch.float64 else torch.float32).tiny
    eta_out = {torch.float16: 2.0 ** -25, torch.bfloat16: 2.0 ** -134}.get(dt, 0.0)
    k = a.shape[1]
    A, B, C = a.double().abs(), b.double().abs(), c.double().abs()
    out = []
    for x, y, z, bs in ((A, B, C, bm), (B.t(), A.t(), C.t(), bn)):
        t = block_sums(x, bs, 0) @ y                     # sum_i sum_k |x_ik| |y_kj| per block
        zs = block_sums(z, bs, 0)
        out.append(gamma(k, u_acc) * t + gamma(1, u_out) * zs
                   + gamma(bs, u_chk) * zs + gamma(bs, u_chk) * t + gamma(k, u_chk) * t * (1 + gamma(bs, u_chk))
                   + 4 * (k + bs) * bs * eta + bs * eta_out)
    return out[0], out[1].t()


def must_alarm(a, b, c, bm, bn):
    """(TM, TN) bool: the tiles with a checked sum whose residual passes its worst case."""
    (rc, rr), (wc, wr) = residuals(a, b, c, bm, bn), worst_case(a, b, c, bm, bn)
    return (block_sums((rc.abs() > wc).double(), bn, 1) > 0) | (block_sums((rr.abs() > wr).double(), bm, 0) > 0)
