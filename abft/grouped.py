"""Checked grouped products (``torch._grouped_mm``: a mixture of experts' products in one call).

A grouped product is many 2-D products side by side; ``offs`` (int32, the groups' ends) cuts the
grouped dimension:

    a (T, K)    @ b (G, K, N) -> (T, N)     rows of a in groups, one matrix of b each
    a (M, T)    @ b (T, N)    -> (G, M, N)  the inner dimension in groups (a weight's gradient)
    a (G, M, K) @ b (K, T)    -> (M, T)     columns of b in groups, one matrix of a each
    a (G, M, K) @ b (G, K, N) -> (G, M, N)  no offs: a batch

Each group is checked as its own product (``abft.ops.product_part``): its alarm carries
``labels["group"]`` and ``labels["group_start"]`` (where the group begins in the grouped
dimension), its row and column are the group product's own. On a checking backend torch computes
the whole (its values and its errors) and each group is checked in place; on a computing backend
the backend computes each group. Rows and columns no group covers, which torch leaves
uninitialised, are zeros. The gradients are grouped products of the same kinds, checked alike
(phases ``grad_a``, ``grad_b``). One op of the table of checked ops (``abft.optable``):
``checked()`` routes ``torch._grouped_mm`` here.
"""
from typing import Optional

import torch
from torch import Tensor
from torch.library import custom_op

from abft import autograd, coverage, ops
from abft.detectors import outputs
from abft.optable import CheckedOp, register


def _parts(a, b, ends):
    """The groups as (a part, b part, the part's index in the output, its start)."""
    starts = [0] + ends[:-1]
    spans = list(enumerate(zip(starts, ends)))
    if a.dim() == 3 and b.dim() == 3:
        return [(a[g], b[g], (g,), None) for g in range(a.shape[0])]
    if a.dim() == 2 and b.dim() == 3:
        return [(a[s:e], b[g], (slice(s, e),), s) for g, (s, e) in spans]
    if a.dim() == 2:
        return [(a[:, s:e], b[s:e], (g,), s) for g, (s, e) in spans]
    return [(a[g], b[:, s:e], (slice(None), slice(s, e)), s) for g, (s, e) in spans]


def _uncovered(a, b, out, ends):
    """The part of ``out`` no group writes: rows of a, or columns of b, past the last group."""
    if a.dim() == 2 and b.dim() == 3:
        return out[ends[-1]:]
    if a.dim() == 3 and b.dim() == 2:
        return out[:, ends[-1]:]
    return None


def _out_shape(a, b, offs):
    """The output's shape, with the checks torch makes of the operands' shapes and of offs (the
    kernel's path computes without torch's product, and torch's shape function is CUDA's)."""
    if offs is not None:
        torch._check(offs.dim() == 1, lambda: "offs has to be 1D")
        torch._check(offs.dtype == torch.int32, lambda: "Offsets have to be int32")
    torch._check(a.dim() in (2, 3) and b.dim() in (2, 3), lambda: "grouped products take 2-D or 3-D operands")
    torch._check((offs is None) == (a.dim() == 3 and b.dim() == 3),
                 lambda: "offs is required for a 2-D operand, and refused for two 3-D ones")
    torch._check(a.shape[-1] == b.shape[-2 if b.dim() == 3 else 0] if a.dim() == 2 or b.dim() == 3
                 else a.shape[-1] == b.shape[0], lambda: "the operands' inner dimensions differ")
    if a.dim() == 3 and b.dim() == 3:
        torch._check(a.shape[0] == b.shape[0], lambda: "the groups' counts differ")
        return a.shape[0], a.shape[1], b.shape[2]
    if a.dim() == 2 and b.dim() == 2:
        return offs.shape[0], a.shape[0], b.shape[1]
    torch._check(offs.shape[0] == (b if a.dim() == 2 else a).shape[0], lambda: "the groups' counts differ")
    return (a.shape[0], b.shape[2]) if a.dim() == 2 else (a.shape[1], b.shape[1])


def checked_grouped_mm(a, b, offs=None, *, phase="forward", module=None):
    """``torch._grouped_mm(a, b, offs=offs)`` checked group by group, without autograd
    (``grouped_mm`` adds it)."""
    where = ops.route(a, b)
    if where == "off":
        return torch._grouped_mm(a, b, offs=offs)
    shape = _out_shape(a, b, offs)
    ends = [] if offs is None else offs.tolist()
    if any(e < s for s, e in zip([0] + ends, ends)):
        # torch computes something of it; each group's own product would not be that
        raise ValueError(f"abft.grouped_mm: offs: the groups' ends, non-decreasing from 0, got {ends}")
    if ops.computes(where):
        out = a.new_empty(shape)
    else:
        out = torch._grouped_mm(a, b, offs=offs).contiguous()     # (padded rows on CUDA)
    rest = _uncovered(a, b, out, ends) if ends else None
    if rest is not None:
        rest.zero_()
    for g, (x, y, at, start) in enumerate(_parts(a, b, ends)):
        c = out[at]
        if x.shape[-1] == 0 and c.numel():     # an empty group in the inner dimension
            c.zero_()
        elif c.numel():
            ops.product_part("grouped_mm", x, y, c, where, phase=phase, module=module,
                             labels={"group": g, "group_start": start})
    return out


@custom_op("abft::grouped_mm", mutates_args=())
def grouped_mm_op(a: Tensor, b: Tensor, offs: Optional[Tensor], module: str, phase: str) -> Tensor:
    return checked_grouped_mm(a, b, offs, phase=phase, module=module or None)


@grouped_mm_op.register_fake
def _(a, b, offs, module, phase):
    return a.new_empty(_out_shape(a, b, offs))


def _setup(ctx, inputs, output):
    a, b, offs, module, phase = inputs
    ctx.save_for_backward(a, b, offs)
    ctx.phase, ctx.module = phase, module


def _backward(ctx, grad):
    """In every form, a's gradient is grad's grouped product with b transposed, b's that of a
    transposed with grad (with the same offs), so both are checked grouped products too."""
    a, b, offs = ctx.saved_tensors
    pa, pb = ("grad_a", "grad_b") if ctx.phase == "forward" else ("double_backward",) * 2
    grad = grad.contiguous()            # torch's grouped product takes no broadcast strides
    ga = _op(grad, b.mT, offs, pa, ctx.module) if ctx.needs_input_grad[0] else None
    gb = _op(a.mT, grad, offs, pb, ctx.module) if ctx.needs_input_grad[1] else None
    return ga, gb, None, None, None


def _op(a, b, offs, phase, module):
    out = autograd.dispatch(torch.ops.abft.grouped_mm, (a, b, offs), (module, phase),
                            autograd.plain_eager((a, b, offs)))
    if outputs.active():                  # an OutputCheck is on: verified at its death
        outputs.record(out, module or None, "grouped_mm", phase)
    return out


def _sharding(a, b, offs, module, phase):
    """DTensor placements, one mesh dimension at a time: everything replicated; the dimension of
    a or b that is not grouped sharded (the output's alike); the inner dimension sharded on both,
    where it is not grouped (a partial sum). ``offs`` stays replicated."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    R = Replicate()
    q = None if offs is None else R
    free_a, free_b, inner, out_a, out_b = {
        (2, 3): (None, 2, (1, 1), None, 1),
        (2, 2): (0, 1, None, 1, 2),
        (3, 2): (1, None, (2, 0), 0, None),
        (3, 3): (1, 2, (2, 1), 1, 2)}[(len(a.shape), len(b.shape))]
    rules = [([R], [R, R, q, None, None])]
    if len(a.shape) == 3 and len(b.shape) == 3:
        rules.append(([Shard(0)], [Shard(0), Shard(0), q, None, None]))
    if free_a is not None:
        rules.append(([Shard(out_a)], [Shard(free_a), R, q, None, None]))
    if free_b is not None:
        rules.append(([Shard(out_b)], [R, Shard(free_b), q, None, None]))
    if inner is not None:
        rules.append(([Partial()], [Shard(inner[0]), Shard(inner[1]), q, None, None]))
    return rules


def grouped_mm(mat_a, mat_b, offs=None, *, module=None):
    """Checked ``torch._grouped_mm(mat_a, mat_b, offs=offs)`` with checked backward (phases
    forward, grad_a, grad_b), each group checked as its own product.

    Example:
        >>> x = torch.randn(12, 8); w = torch.randn(3, 8, 16)       # 3 experts
        >>> y = abft.grouped_mm(x, w, torch.tensor([4, 9, 12], dtype=torch.int32))
    """
    if not ops.enabled():
        return torch._grouped_mm(mat_a, mat_b, offs=offs)
    if autograd.transformed(mat_a, mat_b):
        coverage.unprotected("grouped_mm", module or None)
        return torch._grouped_mm(mat_a, mat_b, offs=offs)
    return autograd.call(torch.ops.abft.grouped_mm, 0, (mat_a, mat_b, offs), module or "", "forward",
                         autocast=False)           # torch's grouped product is not autocast's


def _intercepted(module, input, mat2, offs=None, bias=None, out_dtype=None):
    """What ``checked()`` runs for ``torch._grouped_mm`` (by torch's names): torch's own call,
    unprotected, where it adds a bias or converts the output."""
    if bias is not None or out_dtype not in (None, input.dtype):
        coverage.unprotected("grouped_mm", module)
        return torch._grouped_mm(input, mat2, offs=offs, bias=bias, out_dtype=out_dtype)
    return grouped_mm(input, mat2, offs, module=module)


register(CheckedOp(
    "grouped_mm", "(input, mat2, offs=None, bias=None, out_dtype=None)", ("input", "mat2"),
    _intercepted, intercepts=(torch._grouped_mm,), custom_op=grouped_mm_op, backward=_backward,
    setup=_setup, sharding=_sharding))
