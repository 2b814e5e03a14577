"""torch.matmul's decomposition into dot / mv / mm / bmm (aten _matmul_impl, torch 2.x),
mirrored so that abft's checked matmul computes the same products in the same layout as torch,
and its backward runs torch's derivative formulas for them (bit-identical gradients).

The fold decision depends on whether the operands require grad; inside a custom op they never
do, so the caller passes the flags it saw."""
import math

import torch


def rows2d(t):
    """(..., K) -> (R, K) with R the product of the leading sizes (also when some size is 0, where
    ``reshape(-1, K)`` is ambiguous)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def should_fold(a, b, a_rg, b_rg):
    a_larger = a.dim() >= b.dim()
    t1 = a if a_larger else b.mT
    dim_t2 = b.dim() if a_larger else a.dim()
    if not (t1.dim() >= 3 and dim_t2 <= 2):
        return False
    if (b_rg if a_larger else a_rg):
        return True
    if a.dim() == 2:
        return False
    if t1.numel() == 0:
        return True
    sizes, strides = t1.shape, t1.stride()
    return all(strides[i] == strides[i + 1] * sizes[i + 1] for i in range(t1.dim() - 2))


class Plan:
    """How a (a, b) matmul is computed: ``kind`` in dot | mv | mm1 | mm | fold | bmm."""

    def __init__(self, a, b, a_rg, b_rg):
        da, db = a.dim(), b.dim()
        self.da, self.db = da, db
        self.a_shape, self.b_shape = tuple(a.shape), tuple(b.shape)
        if da == 1 and db == 1:
            self.kind = "dot"
        elif da == 2 and db == 1:
            self.kind = "mv"
        elif da == 1 and db == 2:
            self.kind = "mm1"
        elif da == 2 and db == 2:
            self.kind = "mm"
        elif should_fold(a, b, a_rg, b_rg):
            self.kind = "fold"
            self.transpose = db > da
        else:
            self.kind = "bmm"
            self.squeeze = None
            if da == 3 and db == 3 and a.shape[0] != b.shape[0]:
                if a.shape[0] == 1 and a_rg:
                    self.squeeze = "a"
                elif b.shape[0] == 1 and b_rg:
                    self.squeeze = "b"


def fold_operands(plan, a, b):
    """(t1 folded (R, K), t2 (K, N) or (K,), output shape before the transpose)."""
    t1 = b.mT if plan.transpose else a
    t2 = ((a.t() if plan.da == 2 else a) if plan.transpose else b)
    out_shape = tuple(t1.shape[:-1]) + ((t2.shape[1],) if t2.dim() == 2 else ())
    return rows2d(t1), t2, out_shape


def broadcast(s, t):
    """``torch.broadcast_shapes(s, t)`` of two shapes (torch's, and its error, on a mismatch and
    under torch.compile, whose symbolic sizes want its size-oblivious checks): torch's own runs
    those checks per dimension, about 10 us a call in eager."""
    if torch.compiler.is_compiling():
        return tuple(torch.broadcast_shapes(s, t))
    if s == t:
        return tuple(s)
    n = max(len(s), len(t))
    out = []
    for x, y in zip((1,) * (n - len(s)) + tuple(s), (1,) * (n - len(t)) + tuple(t)):
        if x != y and x != 1 and y != 1:
            return tuple(torch.broadcast_shapes(s, t))
        out.append(y if x == 1 else x)
    return tuple(out)


def bmm_operands(plan, a, b):
    """(a expanded to (B, n, m1), b expanded to (B, m2, p), output shape)."""
    n = a.shape[-2] if a.dim() > 1 else 1
    m1 = a.shape[-1]
    batch_a = a.shape[:max(a.dim() - 2, 0)]
    m2 = b.shape[-2] if b.dim() > 1 else b.shape[0]
    p = b.shape[-1] if b.dim() > 1 else 1
    batch_b = b.shape[:max(b.dim() - 2, 0)]
    batch = broadcast(batch_a, batch_b)
    bp = 1
    for s in batch:
        bp *= s
    ae = a.expand(*batch, n, m1).reshape(bp, n, m1)
    if b.dim() == 1:
        be = b.expand(*batch, m2).reshape(bp, m2).unsqueeze(2)
    else:
        be = b.expand(*batch, m2, p).reshape(bp, m2, p)
    out_shape = tuple(batch) + ((n,) if a.dim() > 1 else ()) + ((p,) if b.dim() > 1 else ())
    return ae, be, out_shape, tuple(batch)
