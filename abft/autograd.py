"""Checked products with autograd: the forward product and both gradient products go through
the checked path, labelled ``forward`` / ``grad_input`` / ``grad_weight`` (linear, addmm) and
``forward`` / ``grad_a`` / ``grad_b`` (matmul, mm, bmm, baddbmm).

Each op is a ``torch.library`` custom op with ``register_autograd`` and a fake implementation,
so ``torch.compile(fullgraph=True)`` traces it as one opaque node. The backward formulas are
torch's own (derivatives.yaml, and matmul's folding into mm for (..., K) @ (K, N)), so gradients
are bit-identical to torch's. Torch-function modes are off inside autograd's backward: the
backward products are checked because these ops call the checked path themselves.
"""
from typing import Optional

import torch
from torch import Tensor
from torch.library import custom_op

from abft import ops


def _product(kind, a, b, op, phase, module):
    fn = {"mm": ops.mm, "bmm": ops.bmm, "matmul": ops.matmul}[kind]
    return fn(a, b, op=op, phase=phase, module=module or None)


# -- the gradient product: one custom op for every backward GEMM -------------------------------

@custom_op("abft::grad_product", mutates_args=())
def grad_product(a: Tensor, b: Tensor, kind: str, op: str, phase: str, module: str) -> Tensor:
    return _product(kind, a, b, op, phase, module)


@grad_product.register_fake
def _(a, b, kind, op, phase, module):
    return {"mm": torch.mm, "bmm": torch.bmm, "matmul": torch.matmul}[kind](a, b)


def _g(kind, a, b, op, phase, module):
    return torch.ops.abft.grad_product(a, b, kind, op, phase, module)


# -- linear ------------------------------------------------------------------------------------

@custom_op("abft::linear", mutates_args=())
def linear_op(x: Tensor, w: Tensor, b: Optional[Tensor], module: str) -> Tensor:
    from abft import nn as _nn
    return ops.linear(x, w, b, module=module or None, weight_stats=_nn.weight_stats_for(w, module))


@linear_op.register_fake
def _(x, w, b, module):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def _linear_setup(ctx, inputs, output):
    x, w, b, module = inputs
    ctx.save_for_backward(x, w)
    ctx.has_bias, ctx.module = b is not None, module


def _linear_backward(ctx, grad):
    x, w = ctx.saved_tensors
    gx = gw = gb = None
    if ctx.needs_input_grad[0]:
        gx = _g("matmul", grad, w, "linear", "grad_input", ctx.module)
    g2 = grad.reshape(-1, grad.shape[-1])
    if ctx.needs_input_grad[1]:
        gw = _g("mm", g2.t(), x.reshape(-1, x.shape[-1]), "linear", "grad_weight", ctx.module)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        gb = g2.sum(0)
    return gx, gw, gb, None


linear_op.register_autograd(_linear_backward, setup_context=_linear_setup)


# -- addmm (HF Conv1D, users' own) ---------------------------------------------------------------

@custom_op("abft::addmm", mutates_args=())
def addmm_op(input: Tensor, mat1: Tensor, mat2: Tensor, beta: float, alpha: float, module: str) -> Tensor:
    return ops.addmm(input, mat1, mat2, beta=beta, alpha=alpha, module=module or None)


@addmm_op.register_fake
def _(input, mat1, mat2, beta, alpha, module):
    return torch.addmm(input, mat1, mat2, beta=beta, alpha=alpha)


def _addmm_setup(ctx, inputs, output):
    input, mat1, mat2, beta, alpha, module = inputs
    ctx.save_for_backward(mat1, mat2)
    ctx.input_shape, ctx.beta, ctx.alpha, ctx.module = input.shape, beta, alpha, module


def _scale(t, s):
    return t if s == 1 else t * s


def _mm_grads(ctx, grad, a, b, op, names):
    ga = gb = None
    if ctx.needs_input_grad[names[0]]:
        ga = _g("mm", grad, b.t(), op, "grad_input" if op in ("addmm",) else "grad_a", ctx.module)
    if ctx.needs_input_grad[names[1]]:
        gb = _g("mm", a.t(), grad, op, "grad_weight" if op in ("addmm",) else "grad_b", ctx.module)
    return ga, gb


def _addmm_backward(ctx, grad):
    mat1, mat2 = ctx.saved_tensors
    gi = None
    if ctx.needs_input_grad[0]:
        gi = _scale(grad, ctx.beta).sum_to_size(ctx.input_shape)
    g1, g2 = _mm_grads(ctx, grad, mat1, mat2, "addmm", (1, 2))
    return gi, _scale(g1, ctx.alpha) if g1 is not None else None, \
        _scale(g2, ctx.alpha) if g2 is not None else None, None, None, None


addmm_op.register_autograd(_addmm_backward, setup_context=_addmm_setup)


# -- matmul, mm, bmm, baddbmm --------------------------------------------------------------------

@custom_op("abft::matmul", mutates_args=())
def matmul_op(a: Tensor, b: Tensor, module: str) -> Tensor:
    return ops.matmul(a, b, module=module or None)


@matmul_op.register_fake
def _(a, b, module):
    return torch.matmul(a, b)


def _ab_setup(ctx, inputs, output):
    a, b = inputs[0], inputs[1]
    ctx.save_for_backward(a, b)
    ctx.module = inputs[-1]


def _matmul_backward(ctx, grad):
    a, b = ctx.saved_tensors
    m = ctx.module
    need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    ga = gb = None
    da, db = a.dim(), b.dim()
    if da == 1 and db == 1:                        # dot
        ga = grad * b if need_a else None
        gb = grad * a if need_b else None
    elif da == 2 and db == 1:                      # mv
        ga = _g("matmul", grad.unsqueeze(-1), b.unsqueeze(0), "matmul", "grad_a", m) if need_a else None
        gb = _g("matmul", a.t(), grad, "matmul", "grad_b", m) if need_b else None
    elif da == 1 and db == 2:                      # a.unsqueeze(0).mm(b)
        g2 = grad.unsqueeze(0)
        ga = _g("mm", g2, b.t(), "matmul", "grad_a", m).squeeze(0) if need_a else None
        gb = _g("mm", a.unsqueeze(0).t(), g2, "matmul", "grad_b", m) if need_b else None
    elif db <= 2 and da >= 3 and _foldable(a):    # fold (..., M, K) into rows
        a2 = a.reshape(-1, a.shape[-1])
        if db == 1:
            g2 = grad.reshape(-1)
            ga = _g("matmul", g2.unsqueeze(-1), b.unsqueeze(0), "matmul", "grad_a", m).view(a.shape) if need_a else None
            gb = _g("matmul", a2.t(), g2, "matmul", "grad_b", m) if need_b else None
        else:
            g2 = grad.reshape(-1, grad.shape[-1])
            ga = _g("mm", g2, b.t(), "matmul", "grad_a", m).view(a.shape) if need_a else None
            gb = _g("mm", a2.t(), g2, "matmul", "grad_b", m) if need_b else None
    else:                                          # broadcast to a common batch, then bmm
        a3 = a.unsqueeze(0) if da == 1 else a
        b3 = b.unsqueeze(-1) if db == 1 else b
        batch = torch.broadcast_shapes(a3.shape[:-2], b3.shape[:-2])
        ae = a3.expand(*batch, *a3.shape[-2:]).reshape(-1, *a3.shape[-2:])
        be = b3.expand(*batch, *b3.shape[-2:]).reshape(-1, *b3.shape[-2:])
        g3 = grad.reshape(-1, ae.shape[-2], be.shape[-1])
        if need_a:
            ga = _g("bmm", g3, be.mT, "matmul", "grad_a", m).view(*batch, *a3.shape[-2:])
            ga = ga.sum_to_size(a3.shape).view(a.shape)
        if need_b:
            gb = _g("bmm", ae.mT, g3, "matmul", "grad_b", m).view(*batch, *b3.shape[-2:])
            gb = gb.sum_to_size(b3.shape).view(b.shape)
    return ga, gb, None


def _foldable(t):
    """Can the batch dims of t fold into its rows without a copy (torch's own test)?"""
    sizes, strides = t.shape, t.stride()
    return all(strides[i] == strides[i + 1] * sizes[i + 1] for i in range(t.dim() - 2))


matmul_op.register_autograd(_matmul_backward, setup_context=_ab_setup)


@custom_op("abft::mm", mutates_args=())
def mm_op(a: Tensor, b: Tensor, module: str) -> Tensor:
    return ops.mm(a, b, module=module or None)


@mm_op.register_fake
def _(a, b, module):
    return torch.mm(a, b)


def _mm_backward(ctx, grad):
    a, b = ctx.saved_tensors
    ga, gb = _mm_grads(ctx, grad, a, b, "mm", (0, 1))
    return ga, gb, None


mm_op.register_autograd(_mm_backward, setup_context=_ab_setup)


@custom_op("abft::bmm", mutates_args=())
def bmm_op(a: Tensor, b: Tensor, module: str) -> Tensor:
    return ops.bmm(a, b, module=module or None)


@bmm_op.register_fake
def _(a, b, module):
    return torch.bmm(a, b)


def _bmm_backward(ctx, grad):
    a, b = ctx.saved_tensors
    ga = _g("bmm", grad, b.mT, "bmm", "grad_a", ctx.module) if ctx.needs_input_grad[0] else None
    gb = _g("bmm", a.mT, grad, "bmm", "grad_b", ctx.module) if ctx.needs_input_grad[1] else None
    return ga, gb, None


bmm_op.register_autograd(_bmm_backward, setup_context=_ab_setup)


@custom_op("abft::baddbmm", mutates_args=())
def baddbmm_op(input: Tensor, b1: Tensor, b2: Tensor, beta: float, alpha: float, module: str) -> Tensor:
    return ops.baddbmm(input, b1, b2, beta=beta, alpha=alpha, module=module or None)


@baddbmm_op.register_fake
def _(input, b1, b2, beta, alpha, module):
    return torch.baddbmm(input, b1, b2, beta=beta, alpha=alpha)


def _baddbmm_setup(ctx, inputs, output):
    input, b1, b2, beta, alpha, module = inputs
    ctx.save_for_backward(b1, b2)
    ctx.input_shape, ctx.beta, ctx.alpha, ctx.module = input.shape, beta, alpha, module


def _baddbmm_backward(ctx, grad):
    b1, b2 = ctx.saved_tensors
    gi = _scale(grad, ctx.beta).sum_to_size(ctx.input_shape) if ctx.needs_input_grad[0] else None
    g1 = _scale(_g("bmm", grad, b2.mT, "baddbmm", "grad_a", ctx.module), ctx.alpha) \
        if ctx.needs_input_grad[1] else None
    g2 = _scale(_g("bmm", b1.mT, grad, "baddbmm", "grad_b", ctx.module), ctx.alpha) \
        if ctx.needs_input_grad[2] else None
    return gi, g1, g2, None, None, None


baddbmm_op.register_autograd(_baddbmm_backward, setup_context=_baddbmm_setup)


# -- the public functions: autocast rules, then the custom op ---------------------------------------

def _autocast(device_type, *ts):
    """Apply autocast's lower-precision rule (float32 operands -> the autocast dtype) and return
    the tensors plus whether autocast was on (the op then runs with autocast off)."""
    if not torch.is_autocast_enabled(device_type):
        return ts, False
    dt = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dt) if t is not None and t.is_floating_point() and t.dtype != torch.float64
                 else t for t in ts), True


def _call(fn, device_type, tensors, *rest):
    tensors, cast = _autocast(device_type, *tensors)
    if cast:
        with torch.autocast(device_type, enabled=False):
            return fn(*tensors, *rest)
    return fn(*tensors, *rest)


def matmul(a, b, *, module=None):
    """Checked ``torch.matmul`` with checked backward (phases forward, grad_a, grad_b).

    Args:
        a: (..., M, K) or (K,).
        b: (..., K, N) or (K,).
    Returns:
        torch.matmul(a, b), bit for bit, checked tile by tile.

    Example:
        >>> c = abft.matmul(torch.randn(8, 5), torch.randn(5, 3))
    """
    if not ops._enabled():
        return torch.matmul(a, b)
    return _call(torch.ops.abft.matmul, a.device.type, (a, b), module or "")


def mm(a, b, *, module=None):
    """Checked ``torch.mm`` (M, K) @ (K, N), with checked backward."""
    if not ops._enabled():
        return torch.mm(a, b)
    return _call(torch.ops.abft.mm, a.device.type, (a, b), module or "")


def bmm(a, b, *, module=None):
    """Checked ``torch.bmm`` (B, M, K) @ (B, K, N), with checked backward."""
    if not ops._enabled():
        return torch.bmm(a, b)
    return _call(torch.ops.abft.bmm, a.device.type, (a, b), module or "")


def addmm(input, mat1, mat2, *, beta=1, alpha=1, module=None):
    """Checked ``torch.addmm``: beta * input + alpha * (mat1 @ mat2), with checked backward."""
    if not ops._enabled():
        return torch.addmm(input, mat1, mat2, beta=beta, alpha=alpha)
    return _call(torch.ops.abft.addmm, mat1.device.type, (input, mat1, mat2), float(beta),
                 float(alpha), module or "")


def baddbmm(input, batch1, batch2, *, beta=1, alpha=1, module=None):
    """Checked ``torch.baddbmm``: beta * input + alpha * (batch1 @ batch2), with checked backward."""
    if not ops._enabled():
        return torch.baddbmm(input, batch1, batch2, beta=beta, alpha=alpha)
    return _call(torch.ops.abft.baddbmm, batch1.device.type, (input, batch1, batch2), float(beta),
                 float(alpha), module or "")


def linear(input, weight, bias=None, *, module=None):
    """Checked ``F.linear`` with checked backward (phases forward, grad_input, grad_weight).

    Args:
        input: (..., in).
        weight: (out, in).
        bias: (out,) or None.
    """
    if not ops._enabled():
        return torch.nn.functional.linear(input, weight, bias)
    return _call(torch.ops.abft.linear, input.device.type, (input, weight, bias), module or "")
