"""Checked products with autograd: the forward product and both gradient products go through
the checked path, labelled ``forward`` / ``grad_input`` / ``grad_weight`` (linear, addmm) and
``forward`` / ``grad_a`` / ``grad_b`` (matmul, mm, bmm, baddbmm).

Each op is a ``torch.library`` custom op with a fake implementation and an autograd rule (the
backward and setup functions here, registered by the op's row in ``abft.optable``), so ``torch.compile(fullgraph=True)`` traces it as one opaque node. Eager calls on plain tensors
skip torch's dispatcher (``_eager``): the op's own function, under a plain ``autograd.Function``
with the same rule where a gradient is recorded. The backward formulas are
torch's own (derivatives.yaml, and matmul's folding into mm for (..., K) @ (K, N)), so gradients
are bit-identical to torch's. Torch-function modes are off inside autograd's backward: the
backward products are checked because these ops call the checked path themselves.
"""
import threading
from typing import Optional

import torch
from torch import Tensor
from torch.library import custom_op

import torch.autograd.forward_ad as fwAD

from abft import coverage, decompose, ops, weightcache
from abft.detectors import outputs
from abft.integrations import dtensor
from abft.decompose import rows2d
from abft.kernels import backends
from abft.kernels import reference
from abft.kernels.reference import weight_stats


_local = threading.local()       # recording: the op runs under its eager autograd Function
_IMPLS, _FUNCTIONS = {}, {}      # torch.ops.abft.<op> -> its own function; that with its rule


def rule(op_def, backward, setup):
    """``op_def.register_autograd(backward, setup_context=setup)`` (``abft.optable.register``
    calls it), and the op's own function kept, bare and under a plain autograd Function with
    the rule, for ``dispatch`` to run where nothing needs the custom op. Once the backward has
    read its incoming gradients, an OutputCheck verifies them (``carry``)."""
    def read(ctx, *grads):
        out = backward(ctx, *grads)
        outputs.consumed(grads)
        return out
    op_def.register_autograd(read, setup_context=setup)
    name, fn = getattr(op_def, "_name", None), getattr(op_def, "_init_fn", None)
    if isinstance(name, str) and callable(fn):    # where a torch version keeps them there
        op = getattr(torch.ops.abft, name.split("::")[-1])
        _IMPLS[op] = fn
        _FUNCTIONS[op] = _function(name.split("::")[-1], fn, read, setup)


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


def _gp_setup(ctx, inputs, output):
    a, b, kind, op, phase, module = inputs
    ctx.save_for_backward(a, b)
    ctx.kind, ctx.op, ctx.module = kind, op, module


def _gp_backward(ctx, grad):
    """The gradient of a backward product (double backward: ``create_graph=True``, gradient
    penalties), itself checked, labelled ``double_backward``."""
    a, b = ctx.saved_tensors
    na, nb = ctx.needs_input_grad[:2]
    ph, m = "double_backward", ctx.module
    if ctx.kind == "matmul":
        ga, gb = matmul_grads(a, b, grad, (na, nb), (na, nb), m, ctx.op, phases=(ph, ph))
    else:
        ga = _g(ctx.kind, grad, b.mT, ctx.op, ph, m) if na else None
        gb = _g(ctx.kind, a.mT, grad, ctx.op, ph, m) if nb else None
    return ga, gb, None, None, None, None



def _g(kind, a, b, op, phase, module):
    out = dispatch(torch.ops.abft.grad_product, (a, b), (kind, op, phase, module), plain_eager((a, b)))
    if outputs.active():                  # an OutputCheck is on: verified at its death
        outputs.record(out, module or None, op, phase)
    return out


# -- linear ------------------------------------------------------------------------------------

def _weight_summary(w, key):
    """What a check of x @ w.T keeps of w: the reference's statistics for blocks of ``key`` columns
    (an int), or the fused kernel's pre-pass for its key (``triton_gemm.Layout.b_key``)."""
    if isinstance(key, int):
        return weight_stats(w.t(), key)
    from abft.kernels import prepass
    return prepass.prepare(w, *key)


def _grad_input_summary(w, key):
    """What a check of g @ w (the linear's grad_input) keeps of w: as ``_weight_summary``, of w's
    other side."""
    if isinstance(key, int):
        return weight_stats(w, key)
    from abft.kernels import prepass
    return prepass.prepare(w.t(), *key)


@custom_op("abft::grad_input_kept", mutates_args=())
def grad_input_kept(grad: Tensor, w: Tensor, module: str, wkey: int) -> Tensor:
    """A protected linear's grad_input, grad @ w, checked with w's statistics kept between its
    updates (``abft.weightcache``), as its forward product is."""
    stats = weightcache.getter(w, wkey, _grad_input_summary, side="grad_input")
    return ops.matmul(grad, w, op="linear", phase="grad_input", module=module or None,
                      b_stats=stats)


@grad_input_kept.register_fake
def _(grad, w, module, wkey):
    return torch.matmul(grad, w)


def _gik_setup(ctx, inputs, output):
    grad, w, module, wkey = inputs
    ctx.save_for_backward(grad, w)
    ctx.module = module


def _gik_backward(ctx, gg):
    """Double backward through a protected linear's grad_input (grad @ w)."""
    grad, w = ctx.saved_tensors
    ph = ("double_backward", "double_backward")
    ga, gb = matmul_grads(grad, w, gg, ctx.needs_input_grad[:2], ctx.needs_input_grad[:2],
                          ctx.module, "linear", phases=ph)
    return ga, gb, None, None



def _summaries(wkey, pair):
    """``_weight_summary`` for the parameter ``wkey``; with ``pair`` (the backward will need the
    input's gradient) and on the reference backend, also ``_grad_input_summary`` of it, kept for
    that backward: both sides in one call, from the weight the forward read."""
    def make(w, key):
        if not pair or not isinstance(key, int):
            return _weight_summary(w, key)
        bn_t = ops.reference_tiles(1, w.shape[-1])[1]
        fwd, grad_input = reference.weight_stats_pair(w, key, bn_t)
        weightcache.keep(w, wkey, "grad_input", bn_t, grad_input)
        return fwd
    return make


@custom_op("abft::linear", mutates_args=())
def linear_op(x: Tensor, w: Tensor, b: Optional[Tensor], module: str, wkey: int) -> Tensor:
    pair = x.requires_grad and getattr(_local, "recording", False)
    stats = weightcache.getter(w, wkey, _summaries(wkey, pair)) if wkey else None
    return ops.linear(x, w, b, module=module or None, weight_stats=stats)


@linear_op.register_fake
def _(x, w, b, module, wkey):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def _linear_setup(ctx, inputs, output):
    x, w, b, module, wkey = inputs
    ctx.save_for_backward(x, w)
    ctx.has_bias, ctx.module, ctx.wkey = b is not None, module, wkey


def _linear_backward(ctx, grad):
    x, w = ctx.saved_tensors
    gx = gw = gb = None
    if ctx.needs_input_grad[0]:
        if ctx.wkey and not dtensor.any_dtensor(grad, w):
            gx = dispatch(torch.ops.abft.grad_input_kept, (grad, w), (ctx.module, ctx.wkey),
                           plain_eager((grad, w)))
            if outputs.active():
                outputs.record(gx, ctx.module or None, "linear", "grad_input")
        else:
            gx = _g("matmul", grad, w, "linear", "grad_input", ctx.module)
    g2 = rows2d(grad)
    if ctx.needs_input_grad[1]:
        gw = _g("mm", g2.t(), rows2d(x), "linear", "grad_weight", ctx.module)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        gb = g2.sum(0)
    return gx, gw, gb, None, None



# -- addmm (HF Conv1D, users' own) ---------------------------------------------------------------

@custom_op("abft::addmm", mutates_args=())
def addmm_op(input: Tensor, mat1: Tensor, mat2: Tensor, beta: float, alpha: float, module: str) -> Tensor:
    return ops.addmm(input, mat1, mat2, beta=beta, alpha=alpha, module=module or None)


@addmm_op.register_fake
def _(input, mat1, mat2, beta, alpha, module):
    return torch.addmm(input, mat1, mat2, beta=beta, alpha=alpha)


def _add_setup(ctx, inputs, output):  # addmm, baddbmm: (input, x, y, beta, alpha, module)
    input, x, y, beta, alpha, module = inputs
    ctx.save_for_backward(x, y)
    ctx.input_shape, ctx.beta, ctx.alpha, ctx.module = input.shape, beta, alpha, module


def _scale(t, s):
    return t if s == 1 else t * s


def _mm_grads(ctx, grad, a, b, op, names):
    pa, pb = ("grad_input", "grad_weight") if op == "addmm" else ("grad_a", "grad_b")
    ga = _mm_mat1_backward(grad, b, a, op, pa, ctx.module) if ctx.needs_input_grad[names[0]] else None
    gb = _mm_mat2_backward(grad, a, b, op, pb, ctx.module) if ctx.needs_input_grad[names[1]] else None
    return ga, gb


def _addmm_backward(ctx, grad):
    mat1, mat2 = ctx.saved_tensors
    gi = None
    if ctx.needs_input_grad[0]:
        gi = _scale(grad, ctx.beta).sum_to_size(ctx.input_shape)
    g1, g2 = _mm_grads(ctx, grad, mat1, mat2, "addmm", (1, 2))
    return gi, _scale(g1, ctx.alpha) if g1 is not None else None, \
        _scale(g2, ctx.alpha) if g2 is not None else None, None, None, None



# -- matmul, mm, bmm, baddbmm --------------------------------------------------------------------

@custom_op("abft::matmul", mutates_args=())
def matmul_op(a: Tensor, b: Tensor, a_rg: bool, b_rg: bool, module: str) -> Tensor:
    return ops.matmul(a, b, module=module or None, a_rg=a_rg, b_rg=b_rg)


@matmul_op.register_fake
def _(a, b, a_rg, b_rg, module):
    return torch.matmul(a, b)


def _matmul_setup(ctx, inputs, output):
    a, b, a_rg, b_rg, module = inputs
    ctx.save_for_backward(a, b)
    ctx.flags, ctx.module = (a_rg, b_rg), module


def _colmajor(t):
    return t.stride(0) == 1 and t.stride(1) == t.shape[0]


def _mm_mat1_backward(grad, mat2, mat1, op, phase, m):
    """torch's mm_mat1_backward: the gradient of mat1 in mm(mat1, mat2)."""
    if _colmajor(mat1):
        return _g("mm", mat2, grad.t(), op, phase, m).t()
    return _g("mm", grad, mat2.t(), op, phase, m)


def _mm_mat2_backward(grad, mat1, mat2, op, phase, m):
    """torch's mm_mat2_backward: the gradient of mat2 in mm(mat1, mat2)."""
    if _colmajor(mat2):
        return _g("mm", grad.t(), mat1, op, phase, m).t()
    return _g("mm", mat1.t(), grad, op, phase, m)


def matmul_grads(a, b, grad, flags, needs, m, op="matmul", phases=("grad_a", "grad_b")):
    """Gradients of torch.matmul(a, b) by torch's decomposition and derivative formulas; the
    products labelled ``phases`` (of a's gradient, of b's)."""
    pa_, pb_ = phases
    plan = decompose.Plan(a, b, *flags)
    na, nb = needs
    ga = gb = None
    k = plan.kind
    if k == "bmm" and plan.squeeze:
        if plan.squeeze == "a":
            ga, gb = matmul_grads(a.squeeze(0), b, grad, flags, needs, m, op, phases)
            return (ga.unsqueeze(0) if ga is not None else None), gb
        ga, gb = matmul_grads(a, b.squeeze(0), grad, flags, needs, m, op, phases)
        return ga, (gb.unsqueeze(0) if gb is not None else None)
    if k == "dot":
        return (grad * b if na else None), (grad * a if nb else None)
    if k == "mv":
        return (torch.outer(grad, b) if na else None), \
            (_g("matmul", a.t(), grad, op, pb_, m) if nb else None)
    if k == "mm1":
        mat1, g2 = a.unsqueeze(0), grad.unsqueeze(0)
        return (_mm_mat1_backward(g2, b, mat1, op, pa_, m).squeeze(0) if na else None), \
            (_mm_mat2_backward(g2, mat1, b, op, pb_, m) if nb else None)
    if k == "mm":
        return (_mm_mat1_backward(grad, b, a, op, pa_, m) if na else None), \
            (_mm_mat2_backward(grad, a, b, op, pb_, m) if nb else None)
    if k == "fold":
        t1f, t2, shape = decompose.fold_operands(plan, a, b)
        if t2.dim() == 2:       # the output was transposed back only when t2 is a matrix
            g_ = grad.mT if plan.transpose else grad
            go = g_.reshape(t1f.shape[0], g_.shape[-1])
        else:
            go = grad.reshape(-1)
        # the operand names: t1 is b^T when transposed, else a
        n1, n2 = (nb, na) if plan.transpose else (na, nb)
        p1, p2 = (pb_, pa_) if plan.transpose else (pa_, pb_)
        if t2.dim() == 2:
            g1 = _mm_mat1_backward(go, t2, t1f, op, p1, m) if n1 else None
            g2 = _mm_mat2_backward(go, t1f, t2, op, p2, m) if n2 else None
        else:
            g1 = torch.outer(go, t2) if n1 else None
            g2 = _g("matmul", t1f.t(), go, op, p2, m) if n2 else None
        t1_shape = (b.mT if plan.transpose else a).shape
        g1 = g1.reshape(t1_shape) if g1 is not None else None
        if plan.transpose:
            gb = g1.mT if g1 is not None else None
            ga = (g2.t() if plan.da == 2 else g2) if g2 is not None else None
            return ga, gb
        return g1, g2
    ae, be, shape, batch = decompose.bmm_operands(plan, a, b)
    go = grad.reshape(ae.shape[0], ae.shape[1], be.shape[2])
    if na:
        n = a.shape[-2] if a.dim() > 1 else 1
        ga = _g("bmm", go, be.transpose(1, 2), op, pa_, m).reshape(*batch, n, a.shape[-1])
        ga = ga.sum_to_size(a.shape if a.dim() > 1 else (1, a.shape[0]))
        ga = ga.view(a.shape)
    if nb:
        gbe = _g("bmm", ae.transpose(1, 2), go, op, pb_, m)
        if b.dim() == 1:
            gb = gbe.squeeze(2).reshape(*batch, b.shape[0]).sum_to_size(b.shape)
        else:
            gb = gbe.reshape(*batch, *b.shape[-2:]).sum_to_size(b.shape)
    return ga, gb


def _matmul_backward(ctx, grad):
    a, b = ctx.saved_tensors
    ga, gb = matmul_grads(a, b, grad, ctx.flags, ctx.needs_input_grad[:2], ctx.module)
    return ga, gb, None, None, None



def _ab_setup(ctx, inputs, output):  # mm, bmm
    a, b = inputs[0], inputs[1]
    ctx.save_for_backward(a, b)
    ctx.module = inputs[-1]


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



@custom_op("abft::baddbmm", mutates_args=())
def baddbmm_op(input: Tensor, b1: Tensor, b2: Tensor, beta: float, alpha: float, module: str) -> Tensor:
    return ops.baddbmm(input, b1, b2, beta=beta, alpha=alpha, module=module or None)


@baddbmm_op.register_fake
def _(input, b1, b2, beta, alpha, module):
    return torch.baddbmm(input, b1, b2, beta=beta, alpha=alpha)


def _baddbmm_backward(ctx, grad):
    b1, b2 = ctx.saved_tensors
    gi = _scale(grad, ctx.beta).sum_to_size(ctx.input_shape) if ctx.needs_input_grad[0] else None
    g1 = _scale(_g("bmm", grad, b2.mT, "baddbmm", "grad_a", ctx.module), ctx.alpha) \
        if ctx.needs_input_grad[1] else None
    g2 = _scale(_g("bmm", b1.mT, grad, "baddbmm", "grad_b", ctx.module), ctx.alpha) \
        if ctx.needs_input_grad[2] else None
    return gi, g1, g2, None, None, None



# -- the public functions: autocast rules, then the custom op ---------------------------------------

def _autocast(device_type, *ts):
    """Apply autocast's lower-precision rule (float32 operands -> the autocast dtype) and return
    the tensors plus whether autocast was on (the op then runs with autocast off)."""
    if not torch.is_autocast_enabled(device_type):
        return ts, False
    dt = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dt) if t is not None and t.is_floating_point() and t.dtype != torch.float64
                 else t for t in ts), True


def transformed(*ts):
    """Operands that abft's custom ops cannot serve: inside a ``torch.func`` transform (jvp,
    vmap, grad, jacfwd) or carrying a forward-mode tangent (``torch.autograd.forward_ad``). The ops
    have no forward-mode or batching rules, and autograd would drop the tangent silently.
    (Not asked while torch.compile traces: dynamo cannot trace the question.)"""
    if torch.compiler.is_compiling():
        return False
    for t in ts:
        if t is None:
            continue
        if torch._C._functorch.is_functorch_wrapped_tensor(t):
            return True
        if fwAD._current_level >= 0 and fwAD.unpack_dual(t).tangent is not None:
            return True
    return False


def _plain(op, module, fn, *args, **kwargs):
    """torch's own product, counted as unprotected (``abft.coverage()``)."""
    coverage.unprotected(op, module or None)
    return fn(*args, **kwargs)


def _eager(tensors, plain):
    """How a call can skip torch's dispatcher, which then only adds its cost (tens of µs a call,
    more with autograd): "direct" (the custom op's own function: eager, no gradient to record),
    "function" (eager with a gradient to record: the op's own function under a plain
    ``autograd.Function`` with the op's autograd rule), or None (the custom op). Only plain
    dense tensors and parameters in eager (``plain``: ``plain_eager``) skip it: torch.compile,
    DTensor, fake and meta tensors, and dispatch modes that count ops (selective checkpointing
    too) get the custom op."""
    if not plain or torch._C._len_torch_dispatch_stack():
        return None
    grad = torch.is_grad_enabled()
    record = False
    for t in tensors:
        if t is None:
            continue
        if t.is_meta:
            return None
        record = record or grad and t.requires_grad
    return "function" if record else "direct"


def plain_eager(tensors):
    """Whether every tensor is a plain tensor or parameter (None aside), outside torch.compile."""
    if torch.compiler.is_compiling():
        return False
    for t in tensors:
        if t is not None and type(t) not in backends.PLAIN:
            return False
    return True


def dispatch(fn, tensors, rest, plain):
    """``fn(*tensors, *rest)``: the custom op ``fn``, or its own function (with its autograd rule)
    where ``_eager`` allows."""
    impl = _IMPLS.get(fn)
    how = None if impl is None else _eager(tensors, plain)
    if how == "direct":
        return impl(*tensors, *rest)
    if how == "function":
        before, _local.recording = getattr(_local, "recording", False), True   # (linear_op reads it)
        try:
            return _FUNCTIONS[fn].apply(*tensors, *rest)
        finally:
            _local.recording = before
    return dtensor.located(fn, *tensors, *rest)


def call(fn, device_of, tensors, *rest, autocast=True):
    """The custom op ``fn`` on ``tensors`` (its device: tensors[device_of]'s) and ``rest``, under
    autocast's rule (``autocast=False``: an op autocast leaves alone, as torch's grouped product). Plain tensors in eager go with torch-function handling off: a mode
    (``abft.checked``) would otherwise see every attribute read on the way as a call of its own
    (microseconds each); the op's own function runs with it off anyway."""
    dtensor.ensure()
    if plain_eager(tensors):
        with torch._C.DisableTorchFunction():
            return _autocast_call(fn, device_of, tensors, rest, True, autocast)
    return _autocast_call(fn, device_of, tensors, rest, False, autocast)


def _autocast_call(fn, device_of, tensors, rest, plain, autocast):
    carried = outputs.active()            # an OutputCheck is on: the output is verified at its death
    module = (next((r for r in rest if isinstance(r, str)), "") or None) if carried else None
    if carried and outputs.operands():    # and it takes operands: these were read
        outputs.read(tensors, module)
    tensors, cast = _autocast(tensors[device_of].device.type, *tensors) if autocast else (tensors, False)
    if cast:
        with torch.autocast(tensors[device_of].device.type, enabled=False):
            out = dispatch(fn, tensors, rest, plain)
    else:
        out = dispatch(fn, tensors, rest, plain)
    if carried:
        outputs.record(out, module, fn._qualified_op_name.split("::")[-1])
    return out


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
    if not ops.enabled():
        return torch.matmul(a, b)
    if transformed(a, b):
        return _plain("matmul", module, torch.matmul, a, b)
    with torch._C.DisableTorchFunction():       # the flags' reads, unseen by torch-function modes
        flags = a.requires_grad, b.requires_grad
    return call(torch.ops.abft.matmul, 0, (a, b), *flags, module or "")


def mm(a, b, *, module=None):
    """Checked ``torch.mm`` (M, K) @ (K, N), with checked backward."""
    if not ops.enabled():
        return torch.mm(a, b)
    if transformed(a, b):
        return _plain("mm", module, torch.mm, a, b)
    return call(torch.ops.abft.mm, 0, (a, b), module or "")


def bmm(a, b, *, module=None):
    """Checked ``torch.bmm`` (B, M, K) @ (B, K, N), with checked backward."""
    if not ops.enabled():
        return torch.bmm(a, b)
    if transformed(a, b):
        return _plain("bmm", module, torch.bmm, a, b)
    return call(torch.ops.abft.bmm, 0, (a, b), module or "")


def addmm(input, mat1, mat2, *, beta=1, alpha=1, module=None):
    """Checked ``torch.addmm``: beta * input + alpha * (mat1 @ mat2), with checked backward."""
    if not ops.enabled():
        return torch.addmm(input, mat1, mat2, beta=beta, alpha=alpha)
    if transformed(input, mat1, mat2):
        return _plain("addmm", module, torch.addmm, input, mat1, mat2, beta=beta, alpha=alpha)
    return call(torch.ops.abft.addmm, 1, (input, mat1, mat2), float(beta),
                 float(alpha), module or "")


def baddbmm(input, batch1, batch2, *, beta=1, alpha=1, module=None):
    """Checked ``torch.baddbmm``: beta * input + alpha * (batch1 @ batch2), with checked backward."""
    if not ops.enabled():
        return torch.baddbmm(input, batch1, batch2, beta=beta, alpha=alpha)
    if transformed(input, batch1, batch2):
        return _plain("baddbmm", module, torch.baddbmm, input, batch1, batch2, beta=beta,
                      alpha=alpha)
    return call(torch.ops.abft.baddbmm, 1, (input, batch1, batch2), float(beta),
                 float(alpha), module or "")


def linear(input, weight, bias=None, *, module=None, cache=False):
    """Checked ``F.linear`` with checked backward (phases forward, grad_input, grad_weight).

    Args:
        input: (..., in).
        weight: (out, in).
        bias: (out,) or None.
        cache: keep the weight's checksums between its updates (``abft.weightcache``).
    """
    if not ops.enabled():
        return torch.nn.functional.linear(input, weight, bias)
    if transformed(input, weight, bias):
        return _plain("linear", module, torch.nn.functional.linear, input, weight, bias)
    wkey = weightcache.key(weight) if cache else 0
    return call(torch.ops.abft.linear, 0, (input, weight, bias), module or "", wkey)


def _function(name, impl, backward, setup):
    """A plain autograd Function computing ``impl`` with the autograd rule (backward, setup) a
    custom op was registered with: what the custom op's own autograd wrapper does, without the
    dispatcher around it (forward runs without grad mode, inputs as given to setup)."""
    def forward(ctx, *args):
        out = impl(*args)
        setup(ctx, args, out)
        return out
    return type(f"Checked_{name}", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)})


