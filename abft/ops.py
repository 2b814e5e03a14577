"""Checked products with torch's semantics: matmul, mm, bmm, addmm, baddbmm, linear.

Each op puts its product in canonical form (a ``Problem``: c = alpha * a @ b + beta * addend)
and ``run_checked`` checks it on its backend (``abft.kernels.backends``) under the current
``abft.scope`` labels, then ``policy.act`` carries out the ``abft.config`` policy. On a checking
backend (the reference) the torch op computes the result (values, shapes, broadcasting and errors
are torch's) and the check follows; on a computing backend (the fused kernel) the backend computes
and checks it in one call. With the kill switch
(``enabled=False`` or ``ABFT_DISABLE=1``) each op is the plain torch call.
"""
import math
import os
import sys
import threading

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from abft import settings as _config
from abft import context, coverage, decompose, policy
from abft import hook
from abft.decompose import rows2d
from abft.kernels import backends

SUPPORTED = backends.DTYPES[backends.REFERENCE]


def _plain(fn):
    """Run an abft op with torch-function handling off: its own torch calls are not to be
    intercepted again (``abft.checked``) or slowed down by it."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch._C.DisableTorchFunction():
            return fn(*args, **kwargs)
    return wrapper

_sites = {}
_sites_lock = threading.Lock()


@dataclass(eq=False, slots=True)
class Problem:
    """One product in canonical form: c (..., M, N) = alpha * a (..., M, K) @ b (..., K, N)
    + beta * addend, and how to give the op's result and to compute it again.

    ``backend`` names who checks it (``abft.kernels.backends``): a checking backend checks c, which
    the torch op computed; with a computing one c is None until the backend computes and checks it."""
    op: str
    a: torch.Tensor
    b: torch.Tensor
    c: torch.Tensor = None
    alpha: float = 1.0
    addend: torch.Tensor = None        # broadcastable to c (a bias, addmm's input); None: none
    beta: float = 1.0
    flat_rows: tuple = None            # c's rows are these leading dims folded (alarm rows)
    flat_batch: tuple = None           # c's one batch dim is these caller's batch dims folded
    b_stats: object = None             # kept statistics of b (a weight's: ``abft.weightcache``)
    finish: object = None              # c -> the op's result (None: c itself)
    again: object = None               # () -> this product computed afresh (None: it cannot be)
    backend: str = backends.REFERENCE

    def __post_init__(self):
        self.alpha, self.beta = float(self.alpha), float(self.beta)
        if self.beta == 0 and self.addend is not None:
            torch.broadcast_shapes(tuple(self.addend.shape), self.shape)   # torch checks its shape
            self.addend = None         # and ignores its values

    @property
    def shape(self):
        return tuple(self.a.shape[:-1]) + (self.b.shape[-1],) if self.c is None else tuple(self.c.shape)

    @property
    def dtype(self):
        return self.a.dtype if self.c is None else self.c.dtype

    def result(self):
        return self.c if self.finish is None else self.finish(self.c)


def _info(pb, ctx, bm, bn, backend):
    """The alarm metadata of one checked call, as a function that builds it (``policy.Pending``
    calls it on first read; a clean call's never is). It holds values, not pb or ctx: a queued
    verdict must not keep the operands alive."""
    op, phase, labels, call_id, now = pb.op, ctx.phase, ctx.labels, ctx.call_id, policy.now()
    shapes, dtype, flat_rows, flat_batch = (pb.a.shape, pb.b.shape), pb.dtype, pb.flat_rows, pb.flat_batch

    def describe():
        return dict(op=op, phase=phase, labels=labels, call_id=call_id, rank=context.current_rank(),
                    shapes=tuple(tuple(x) for x in shapes),
                    dtype=_DTYPE_NAMES.get(dtype) or str(dtype).replace("torch.", ""), bm=bm, bn=bn,
                    backend=backend, time=now, flat_rows=flat_rows, flat_batch=flat_batch, action="recorded")
    return describe


def _pending(pb, ctx, bm, bn, backend, verdict, detail, summary=None):
    """The pending verdict of one checked call (a clean one known on the host needs no alarm
    metadata: ``policy.Pending``)."""
    clean = policy.clean_on_host(summary)
    return policy.make_pending(verdict, detail, None if clean else _info(pb, ctx, bm, bn, backend),
                               context.current().log, summary, key=(pb.op, ctx.labels.get("module")),
                               phase=ctx.phase, tiles=(bm, bn))


_DTYPE_NAMES = {dt: str(dt).replace("torch.", "") for dt in SUPPORTED}


def _verify_checking(pb, ctx, s):
    """The fault hook on the computed product, then its backend's check."""
    if hook.active():
        hook.apply(pb.c, ctx)
    return _check(pb, ctx, s)


def reference_tiles(m, n, s=None, backend=backends.REFERENCE):
    """(bm, bn) of a checking backend's check of an (m, n) product under the settings ``s`` (the
    current ones by default): the configured tiles, else the backend's, clipped to the product."""
    bm, bn = (s or _config.get()).tiles or backends.get(backend).tiles
    return max(1, min(bm, m)), max(1, min(bn, n))


def _check(pb, ctx, s):
    """pb.c checked by its backend, or by the reference where the backend computed it (a
    correction's second check): a pending verdict."""
    name = pb.backend if not backends.get(pb.backend).computes else backends.REFERENCE
    bm, bn = reference_tiles(pb.c.shape[-2], pb.c.shape[-1], s, name)
    verdict, detail, summary = backends.get(name).entry().check_product(
        pb.a, pb.b, pb.c, bm=bm, bn=bn, alpha=pb.alpha, addend=pb.addend, beta=pb.beta, lam=s.lam,
        b_stats=pb.b_stats)
    return _pending(pb, ctx, bm, bn, name, verdict, detail, summary)


def _verify_computing(pb, ctx, s):
    """The backend computes pb.c and checks it, with the fault hook's element faults put into its
    accumulator (after the first K step)."""
    inject = hook.kernel_injection(ctx) if hook.active() else None
    pb.c, verdict, detail, (bm, bn) = backends.get(pb.backend).entry().checked_product(
        pb.a, pb.b, addend=pb.addend, alpha=pb.alpha, beta=pb.beta, tiles=s.tiles, inject=inject,
        lam=s.lam, b_stats=pb.b_stats)
    return _pending(pb, ctx, bm, bn, pb.backend, verdict, detail)


def _verifier(name):
    return _verify_computing if backends.get(name).computes else _verify_checking


def _require_float(op, *ts):
    for t in ts:
        if t.dtype not in SUPPORTED:
            raise TypeError(f"abft.{op}: checked products support float32, float16, bfloat16 and "
                            f"float64 operands; got {t.dtype} (integer, complex and fp8 are not "
                            f"supported; use torch.{op} for them)")


def _fold(a, c):
    """(..., T, K) with a 2-D right operand: fold the leading dims into rows when that is a view."""
    if a.dim() <= 2:
        return a, c, None
    try:
        rows = math.prod(a.shape[:-1])
        return a.view(rows, a.shape[-1]), c.view(rows, c.shape[-1]), tuple(a.shape[:-1])
    except RuntimeError:
        return a, c, None


_SKIP = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.abspath(torch.__file__)))


def _call_site():
    """(file, line) of the first frame outside abft and torch: the user's call site."""
    f = sys._getframe(2)
    while f is not None and f.f_code.co_filename.startswith(_SKIP):
        f = f.f_back
    return (f.f_code.co_filename, f.f_lineno) if f is not None else None


def _sample(op, phase, labels):
    s = _config.get()
    if s.sample_every == 1:
        return True
    # a grouped product's groups are sampled each on its own count: all checked on the same calls
    key = (op, phase, labels.get("module"), labels.get("group"), _call_site())
    with _sites_lock:
        n = _sites.get(key, 0)
        _sites[key] = n + 1
    return n % s.sample_every == 0


def run_checked(pb, *, phase="forward", module=None, labels=None):
    """Check ``pb`` on its backend under the current labels (and ``labels``: this call's own)
    and policy; returns the op's result (pb's, or its recomputation's under the recompute
    policy)."""
    s = _config.get()
    sc = context.current()
    extra, labels = labels, dict(sc.labels)
    if module:
        labels["module"] = module
    if extra:
        labels.update(extra)
    if labels.get("phase"):
        phase = labels["phase"]
    elif phase == "forward" and torch._C._current_graph_task_id() != -1:
        phase = "recompute"          # a forward run inside backward: activation checkpointing
    call_id = sc.next_call_id()
    verify = _verifier(pb.backend)
    if not _sample(pb.op, phase, labels):
        policy.count("sampled_out_calls")
        coverage.count(pb.op, labels.get("module"), "sampled_out")
        if pb.c is None:                 # a computing backend's product, its checks compiled out
            pb.c = backends.get(pb.backend).entry().unchecked_product(pb.a, pb.b, addend=pb.addend,
                                                                      alpha=pb.alpha, beta=pb.beta)
        return pb.result()
    coverage.count(pb.op, labels.get("module"), "checked")
    ctx = hook.CallContext(pb.op, phase, labels, call_id, pb.shape, pb.dtype,
                             operands=(pb.a, pb.b), batch_shape=pb.flat_batch)
    pend = verify(pb, ctx, s)
    ctx.verdict, ctx.tiles = pend.verdict, pend.tiles
    if s.policy in ("record", "warn"):       # queued or counted: nothing to repair or redo now
        policy.act(pend, s.policy, sc.log, correct=None, again=None)
        return pb.result()

    def correct(alarms):
        with torch.no_grad():
            for a in alarms:
                _repair(pb, a)
        ctx.attempt = 1
        return _check(pb, ctx, s)

    def again():
        ctx.attempt = 1
        pb2 = pb.again()
        return pb2, verify(pb2, ctx, s)

    fresh = policy.act(pend, s.policy, sc.log, correct=correct,
                       again=None if pb.again is None else again)
    return (fresh or pb).result()


def _flat_row(alarm, pb):
    """The row index in pb.c's own (possibly folded) rows."""
    if pb.flat_rows is None or len(pb.flat_rows) <= 1:
        return alarm.row
    import numpy as np
    return int(np.ravel_multi_index(tuple(alarm.batch) + (alarm.row,), pb.flat_rows))


def _at(t, batch):
    """t's (..., R, C) matrix at the product's batch index (size-1 dims broadcast)."""
    lead = t.dim() - 2
    idx = batch[len(batch) - lead:] if lead else ()
    return t[tuple(0 if t.shape[d] == 1 else i for d, i in enumerate(idx))]


def _repair(pb, alarm):
    """Recompute, in float64, what an alarm points at, in place in pb.c: the element where one
    row sum and one column sum fail (its dot product: never the residual subtracted, which is
    wrong for a huge error and for errors that cancel in some sums), else the whole tile."""
    batch, (tp, tq) = tuple(alarm.tile[:-2]), alarm.tile[-2:]
    c = pb.c[batch] if batch else pb.c
    if (alarm.kind == "checksum" and alarm.row is not None and alarm.col is not None
            and len(alarm.rows) == 1 and len(alarm.cols) == 1):
        i = _flat_row(alarm, pb)
        rows, cols = slice(i, i + 1), slice(alarm.col, alarm.col + 1)
    else:
        rows = slice(tp * alarm.bm, (tp + 1) * alarm.bm)
        cols = slice(tq * alarm.bn, (tq + 1) * alarm.bn)
    a, b = _at(pb.a, batch)[rows].double(), _at(pb.b, batch)[:, cols].double()
    val = pb.alpha * (a @ b)
    if pb.addend is not None:
        add = pb.addend
        while add.dim() < pb.c.dim():
            add = add.unsqueeze(0)
        add = _at(add.expand(*add.shape[:-2], *pb.c.shape[-2:]), batch)[rows, cols]
        val = val + pb.beta * add.double()
    c[rows, cols] = val.to(c.dtype)


def enabled():
    return _config.get().enabled


def route(*ts, shape_ok=True):
    """Where a product of ``ts`` runs: "off" (checks disabled: the torch op), or the name of the backend that
    checks it (``backends.route``; a computing backend only where it takes the shape)."""
    if not enabled():
        return "off"
    name = backends.route(_config.get().backend, *ts)
    return name if shape_ok or not computes(name) else backends.REFERENCE


def computes(name):
    return name != "off" and backends.get(name).computes


# A Problem's again() builds a new Problem without referring to the old one: a reference cycle
# would keep the product alive until the garbage collector runs, and detectors that verify an
# output at its death (abft.detectors.outputs) would see it late.

def _computed(op, a, b, compute, **kw):
    """A reference Problem of the product ``compute()`` returns (again: computed afresh)."""
    return Problem(op, a, b, compute(), again=lambda: _computed(op, a, b, compute, **kw), **kw)


def _kernel(backend, op, a, b, **kw):
    """A Problem a computing backend computes (again: launched afresh)."""
    return Problem(op, a, b, backend=backend, again=lambda: _kernel(backend, op, a, b, **kw), **kw)


@_plain
def matmul(a, b, *, op="matmul", phase="forward", module=None, a_rg=False, b_rg=False,
           b_stats=None):
    """Checked ``torch.matmul(a, b)`` without autograd (``abft.matmul`` adds it). The product is
    computed by torch's own decomposition (``abft.decompose``); ``a_rg``/``b_rg`` say whether the
    caller's operands require grad, which steers that decomposition as it steers torch's.
    ``b_stats``: statistics of a 2-D ``b`` kept between calls (a weight's, ``abft.weightcache``),
    used when the decomposition multiplies by ``b`` as given."""
    where = route(a, b)
    if where == "off":
        return torch.matmul(a, b)
    _require_float(op, a, b)
    if a.dim() == 2 and b.dim() == 2:         # mm, the common case: no decomposition to plan
        kind, (x, y, flat, fin, compute, batch) = "mm", (a, b, None, None, lambda: a.mm(b), None)
    else:
        plan = decompose.Plan(a, b, a_rg, b_rg)
        if plan.kind == "bmm" and plan.squeeze:
            if plan.squeeze == "a":
                return matmul(a.squeeze(0), b, op=op, phase=phase, module=module, a_rg=a_rg, b_rg=b_rg)
            return matmul(a, b.squeeze(0), op=op, phase=phase, module=module, a_rg=a_rg, b_rg=b_rg)
        kind, (x, y, flat, fin, compute, batch) = plan.kind, _canonical(plan, a, b)
    kw = dict(flat_rows=flat, finish=fin, b_stats=_kept(y, b, b_stats))
    if kind == "bmm":
        kw["flat_batch"] = batch if len(batch) != 1 else None
    pb = _kernel(where, op, x, y, **kw) if computes(where) else _computed(op, x, y, compute, **kw, backend=where)
    return run_checked(pb, phase=phase, module=module)


def _kept(y, b, b_stats):
    """``b_stats`` (kept statistics of ``b``) when the product's right operand ``y`` is ``b`` as
    given (not a transposed or batched form of it), else None."""
    same = y is b or y.dim() == 2 and y.shape == b.shape and y.stride() == b.stride() and \
        y.data_ptr() == b.data_ptr()
    return b_stats if same else None


def _canonical(plan, a, b):
    """One matmul other than mm (``matmul`` takes that before planning) as a canonical product
    c (..., M, N) = x @ y: (x, y, flat_rows, finish(c) -> torch.matmul's result, compute() -> c
    by the torch op torch.matmul itself calls, the batch shape a bmm folds (None for the other
    kinds))."""
    k, flat = plan.kind, None
    if k == "dot":
        return (a.unsqueeze(0), b.unsqueeze(-1), None, lambda c: c.view(()),
                lambda: a.dot(b).view(1, 1), None)
    if k == "mv":
        return a, b.unsqueeze(-1), None, lambda c: c.squeeze(-1), lambda: a.mv(b).unsqueeze(-1), None
    if k == "mm1":
        x = a.unsqueeze(0)
        return x, b, None, lambda c: c.squeeze(0), lambda: x.mm(b), None
    if k == "fold":
        x, t2, shape = decompose.fold_operands(plan, a, b)
        flat = None if plan.transpose else tuple(shape[:-1] if t2.dim() == 2 else shape)
        if t2.dim() == 2:
            fin = (lambda c: c.view(shape).mT.contiguous()) if plan.transpose else (lambda c: c.view(shape))
            return x, t2, flat, fin, lambda: x.mm(t2), None
        return x, t2.unsqueeze(-1), flat, lambda c: c.view(shape), lambda: x.mv(t2).unsqueeze(-1), None
    x, y, shape, batch = decompose.bmm_operands(plan, a, b)
    fin = (lambda c: c.squeeze(-1).view(shape)) if b.dim() == 1 else (lambda c: c.view(shape))
    return x, y, flat, fin, lambda: x.bmm(y), batch


def _torch_op(op, a, b, compute, ts, shape_ok, *, phase="forward", module=None, **kw):
    """A product torch computes as ``compute()`` (mm, bmm, addmm, baddbmm), checked: the plain
    call with checks off, the fused kernel where it takes the operands ``ts``, else the torch op
    then the reference check."""
    where = route(*ts, shape_ok=shape_ok)
    if where == "off":
        return compute()
    if computes(where):
        return run_checked(_kernel(where, op, a, b, **kw), phase=phase, module=module)
    pb = _computed(op, a, b, compute, **kw, backend=where)
    _require_float(op, *ts)
    return run_checked(pb, phase=phase, module=module)


@_plain
def mm(a, b, *, op="mm", phase="forward", module=None):
    """Checked ``torch.mm``: (M, K) @ (K, N)."""
    return _torch_op(op, a, b, lambda: torch.mm(a, b), (a, b), a.dim() == 2 and b.dim() == 2,
                     phase=phase, module=module)


@_plain
def bmm(a, b, *, op="bmm", phase="forward", module=None):
    """Checked ``torch.bmm``: (B, M, K) @ (B, K, N)."""
    return _torch_op(op, a, b, lambda: torch.bmm(a, b), (a, b),
                     a.dim() == 3 and b.dim() == 3 and a.shape[0] == b.shape[0],
                     phase=phase, module=module)


@_plain
def addmm(input, mat1, mat2, *, beta=1, alpha=1, module=None):
    """Checked ``torch.addmm``: beta * input + alpha * (mat1 @ mat2)."""
    return _torch_op("addmm", mat1, mat2,
                     lambda: torch.addmm(input, mat1, mat2, beta=beta, alpha=alpha),
                     (input, mat1, mat2), mat1.dim() == 2 and mat2.dim() == 2, module=module,
                     addend=input, alpha=alpha, beta=beta)


@_plain
def baddbmm(input, batch1, batch2, *, beta=1, alpha=1, module=None):
    """Checked ``torch.baddbmm``: beta * input + alpha * (batch1 @ batch2)."""
    return _torch_op("baddbmm", batch1, batch2,
                     lambda: torch.baddbmm(input, batch1, batch2, beta=beta, alpha=alpha),
                     (input, batch1, batch2),
                     batch1.dim() == 3 and batch2.dim() == 3 and batch1.shape[0] == batch2.shape[0],
                     module=module, addend=input, alpha=alpha, beta=beta)


@_plain
def linear(input, weight, bias=None, *, module=None, weight_stats=None):
    """Checked ``F.linear``: input (..., in) @ weight.T (out, in) + bias (out,)."""
    where = route(input, weight, shape_ok=input.dim() >= 2 and (bias is None or bias.dim() == 1))
    if where == "off":
        return F.linear(input, weight, bias)
    if computes(where):
        lead = tuple(input.shape[:-1])
        pb = _kernel(where, "linear", rows2d(input), weight.t(), addend=bias, b_stats=weight_stats,
                     flat_rows=lead if len(lead) > 1 else None,
                     finish=lambda c: c.view(*lead, c.shape[-1]))
        return run_checked(pb, module=module)
    out = F.linear(input, weight, bias)
    _require_float("linear", input, weight, *(() if bias is None else (bias,)))
    return run_checked(_linear_problem(input, weight, bias, weight_stats, out, where), module=module)


def _linear_problem(input, weight, bias, weight_stats, out, backend):
    """The reference Problem of ``out = F.linear(input, weight, bias)``: c is out's canonical view
    (leading dims folded into rows), repaired in place; again() computes out afresh. A module
    function: a nested one naming itself would be a cycle holding the operands until the
    garbage collector runs."""
    x = input.unsqueeze(0) if input.dim() == 1 else input
    a, c, flat = _fold(x, out.view(*x.shape[:-1], out.shape[-1]))
    return Problem("linear", a, weight.t(), c, addend=bias, flat_rows=flat, b_stats=weight_stats,
                   finish=lambda _: out, backend=backend,
                   again=lambda: _linear_problem(input, weight, bias, weight_stats,
                                                 F.linear(input, weight, bias), backend))


@_plain
def product_part(op, a, b, c, backend, *, phase="forward", module=None, labels=None):
    """One 2-D product a @ b of an op computed in parts (a grouped product's groups), checked on
    ``backend`` (``route``'s answer, not "off"): ``c``, a view of the op's output, holds the part
    torch computed, or receives the part a computing backend computes. Returns c, repaired or
    recomputed in place as the policy says."""
    if computes(backend):
        out = run_checked(_kernel(backend, op, a, b), phase=phase, module=module, labels=labels)
    else:
        pb = Problem(op, a, b, c, backend=backend,
                     again=lambda: _computed(op, a, b, lambda: a.mm(b), backend=backend))
        out = run_checked(pb, phase=phase, module=module, labels=labels)
    if out is not c:
        c.copy_(out)
    return c


@_plain
def check_views(op, a, b, c, *, module=None, phase="forward"):
    """Check an already computed product c (..., M, N) == a (..., M, K) @ b (..., K, N), given as
    views (einsum): no recompute is possible, so a recompute policy raises on an alarm (logged,
    action "raised"); a correct policy repairs c in place."""
    if not enabled():
        return
    _require_float(op, a, b)
    name = route(a, b)
    run_checked(Problem(op, a, b, c, backend=backends.REFERENCE if computes(name) else name), phase=phase,
                module=module)
