"""Checked products with torch's semantics: matmul, mm, bmm, addmm, baddbmm, linear.

Each op computes its result with the torch op itself (so values, shapes, broadcasting and errors
are torch's), then checks it through the backend, under the current ``abft.scope`` labels and
``abft.config`` policy. With the kill switch (``enabled=False`` or ``ABFT_DISABLE=1``) each op is
the plain torch call.
"""
import math
import os
import sys
import threading

import torch
import torch.nn.functional as F

from abft import settings as _config
from abft import context, coverage, decompose, faults, policy
from abft.alarms import SilentCorruptionError
from abft.decompose import rows2d
from abft.kernels import backends, reference
from abft.kernels import threshold as T

SUPPORTED = backends.DTYPES["reference"]


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


class Problem:
    """One product in canonical form: out's view c (..., M, N) = alpha * a (..., M, K) @ b
    + beta * addend."""

    def __init__(self, op, a, b, c, alpha=1.0, addend=None, flat_rows=None, beta=1.0):
        self.op, self.a, self.b, self.c = op, a, b, c
        self.alpha, self.addend, self.flat_rows = alpha, addend, flat_rows
        self.beta = float(beta)
        self.shape, self.dtype = tuple(c.shape), c.dtype

    def verify(self, ctx, s):
        """Apply the fault hook to the computed product, then check it (reference backend)."""
        if faults.active():
            faults.apply(self.c, ctx)
        return _check(self, ctx, s)


class TritonProblem(Problem):
    """A product the fused kernel computes and checks in one launch, c = alpha * a @ b + beta *
    addend: verify() runs it, with the fault hook's element faults injected into the accumulator
    (after the first K step)."""

    def __init__(self, op, a, b, bias=None, flat_rows=None, finish=None, *, addend=None,
                 alpha=1.0, beta=1.0, b_stats=None):
        self.op, self.a, self.b, self.bias, self.flat_rows = op, a, b, bias, flat_rows
        self.b_stats = b_stats
        self.kernel_addend, self.kernel_beta = addend, float(beta)
        self.alpha, self.c = float(alpha), None
        # the addend as the reference re-check (policy "correct") sees it
        self.beta = 1.0 if bias is not None else float(beta)
        self.addend = bias if bias is not None else (addend if beta != 0 else None)
        self.shape = tuple(a.shape[:-1]) + (b.shape[-1],)
        self.dtype = a.dtype
        self._finish = finish or (lambda c: c)

    def again(self):
        return TritonProblem(self.op, self.a, self.b, self.bias, self.flat_rows, self._finish,
                             addend=self.kernel_addend, alpha=self.alpha, beta=self.kernel_beta,
                             b_stats=self.b_stats)

    def verify(self, ctx, s):
        from abft.kernels import triton_gemm
        inject = faults.kernel_injection(ctx) if faults.active() else None
        tiles = s.tiles or triton_gemm.tiles_for(self.shape[-2], self.shape[-1], self.a.shape[-1], self.dtype)
        # the verdict's tiles: the kernel's, less its checksum rows and columns
        bm, bn = triton_gemm.data_tiles(self.a, self.b, tiles)
        self.c, verdict, detail = triton_gemm.checked_gemm(
            self.a, self.b, self.bias, addend=self.kernel_addend, alpha=self.alpha,
            beta=self.kernel_beta, tiles=tiles, inject=inject, lam=s.lam, b_stats=self.b_stats)
        if self.c.dim() == 2:
            verdict, detail = verdict[0], (detail[0][0], detail[1][0])
        info = dict(op=self.op, phase=ctx.phase, labels=ctx.labels, call_id=ctx.call_id,
                    rank=context.current_rank(), shapes=(tuple(self.a.shape), tuple(self.b.shape)),
                    dtype=str(self.dtype).replace("torch.", ""), bm=bm, bn=bn, backend="triton",
                    time=policy.now(), flat_rows=self.flat_rows, action="recorded")
        return policy.make_pending(verdict, detail, info, context.current().log)

    def finish(self):
        return self._finish(self.c)


def _use_triton(*ts):
    """The backend for these operands: triton when configured (auto: on CUDA tensors)."""
    return backends.runs_on_triton(_config.get().backend, *ts)


def _triton(pb, phase="forward", module=None):
    fresh = run_checked(pb, pb.again, phase=phase, module=module)
    return (fresh or pb).finish()


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
    key = (op, phase, labels.get("module"), _call_site())
    with _sites_lock:
        n = _sites.get(key, 0)
        _sites[key] = n + 1
    return n % s.sample_every == 0


def run_checked(pb, recompute, *, phase="forward", module=None):
    """Check ``pb`` under the current policy; ``recompute()`` returns a fresh Problem (None: the
    product cannot be recomputed, and an alarm the policy would recompute is raised).
    Returns None, or the recomputed Problem whose result replaces the caller's."""
    s = _config.get()
    sc = context.current()
    labels = dict(sc.labels)
    if module:
        labels["module"] = module
    if labels.get("phase"):
        phase = labels["phase"]
    elif phase == "forward" and torch._C._current_graph_task_id() != -1:
        phase = "recompute"          # a forward run inside backward: activation checkpointing
    call_id = sc.next_call_id()
    if not _sample(pb.op, phase, labels):
        policy.count("sampled_out_calls")
        coverage.count(pb.op, labels.get("module"), "sampled_out")
        return None
    coverage.count(pb.op, labels.get("module"), "checked")
    ctx = faults.CallContext(pb.op, phase, labels, call_id, pb.shape, pb.dtype,
                             operands=(pb.a, pb.b))
    pend = pb.verify(ctx, s)
    ctx.verdict, ctx.tiles = pend.verdict, (pend.info["bm"], pend.info["bn"])
    if s.policy in ("record", "warn"):
        pend.info["action"] = "recorded" if s.policy == "record" else "warned"
        policy.enqueue(pend)
        return None
    alarms = policy.resolve_now(pend)
    if not alarms:
        return None
    if s.policy == "raise":
        for a in alarms:
            a.action = "raised"
        policy.emit(alarms, sc.log)
        raise SilentCorruptionError(alarms[0])
    if s.policy == "correct":
        with torch.no_grad():
            for a in alarms:
                _repair(pb, a)
        ctx.attempt = 1
        again = policy.resolve_now(_check(pb, ctx, s))
        if not again:
            for a in alarms:
                a.action, a.persistence = "corrected", "transient"
            policy.emit(alarms, sc.log)
            return None
    # recompute (or a correction that did not verify)
    if recompute is None:               # a product given as views: nothing to recompute it from
        for a in alarms:
            a.action = "raised"
        policy.emit(alarms, sc.log)
        raise SilentCorruptionError(alarms[0])
    ctx.attempt = 1
    pb2 = recompute()
    again = policy.resolve_now(pb2.verify(ctx, s))
    persistence = "persistent" if again else "transient"
    for a in alarms:
        a.action, a.persistence = "recomputed", persistence
    policy.emit(alarms, sc.log)
    if again:
        for a in again:
            a.action, a.persistence = "raised", "persistent"
        policy.emit(again, sc.log)
        raise SilentCorruptionError(again[0])
    return pb2


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


def _check(pb, ctx, s):
    bm, bn = s.tiles or backends.REFERENCE_TILES
    m, n = pb.c.shape[-2], pb.c.shape[-1]
    b_stats = getattr(pb, "b_stats", None)
    verdict, detail = reference.check(pb.a, pb.b, pb.c, bm=bm, bn=bn, units=reference.units_for(pb.c),
                                      alpha=pb.alpha, addend=pb.addend, beta=pb.beta, lam=s.lam,
                                      b_stats=None if b_stats is None else b_stats(max(1, min(bn, n))))
    info = dict(op=pb.op, phase=ctx.phase, labels=ctx.labels, call_id=ctx.call_id,
                rank=context.current_rank(),
                shapes=(tuple(pb.a.shape), tuple(pb.b.shape)), dtype=str(pb.c.dtype).replace("torch.", ""),
                bm=max(1, min(bm, m)), bn=max(1, min(bn, n)), backend="reference",
                time=policy.now(), flat_rows=pb.flat_rows, action="recorded")
    return policy.make_pending(verdict, detail, info, context.current().log)


def _finish(op, out, make, phase="forward", module=None):
    """Shared tail of every op: check ``make(out)`` and return the (possibly recomputed) result."""
    pb = make(out)
    fresh = run_checked(pb, lambda: make(pb.recompute()), phase=phase, module=module)
    return out if fresh is None else fresh.result


def enabled():
    return _config.get().enabled


@_plain
def matmul(a, b, *, op="matmul", phase="forward", module=None, a_rg=False, b_rg=False,
           b_stats=None):
    """Checked ``torch.matmul(a, b)`` without autograd (``abft.matmul`` adds it). The product is
    computed by torch's own decomposition (``abft.decompose``); ``a_rg``/``b_rg`` say whether the
    caller's operands require grad, which steers that decomposition as it steers torch's.
    ``b_stats``: statistics of a 2-D ``b`` kept between calls (a weight's, ``abft.weightcache``),
    used when the decomposition multiplies by ``b`` as given."""
    if not enabled():
        return torch.matmul(a, b)
    _require_float(op, a, b)
    plan = decompose.Plan(a, b, a_rg, b_rg)
    if plan.kind == "bmm" and plan.squeeze:
        if plan.squeeze == "a":
            return matmul(a.squeeze(0), b, op=op, phase=phase, module=module, a_rg=a_rg, b_rg=b_rg)
        return matmul(a, b.squeeze(0), op=op, phase=phase, module=module, a_rg=a_rg, b_rg=b_rg)
    if _use_triton(a, b):
        return _triton(_triton_matmul(plan, a, b, op, b_stats), phase, module)
    pb = _matmul_problem(plan, a, b, op, b_stats)
    fresh = run_checked(pb, lambda: _matmul_problem(plan, a, b, op, b_stats), phase=phase,
                        module=module)
    return (fresh or pb).finish()


def _kept(y, b, b_stats):
    """``b_stats`` (kept statistics of ``b``) when the product's right operand ``y`` is ``b`` as
    given (not a transposed or batched form of it), else None."""
    same = y.dim() == 2 and y.shape == b.shape and y.stride() == b.stride() and \
        y.data_ptr() == b.data_ptr()
    return b_stats if same else None


def _triton_matmul(plan, a, b, op, b_stats=None):
    """torch.matmul's decomposition with the product on the fused kernel."""
    x, y, flat, fin, _ = _canonical(plan, a, b)
    return TritonProblem(op, x, y, flat_rows=flat, finish=fin, b_stats=_kept(y, b, b_stats))


def _matmul_problem(plan, a, b, op, b_stats=None):
    """Compute the product the way torch.matmul does and return it as a checkable Problem whose
    ``finish()`` gives torch.matmul's result."""
    x, y, flat, fin, compute = _canonical(plan, a, b)
    c = compute()
    pb = Problem(op, x, y, c, flat_rows=flat)
    pb.b_stats = _kept(y, b, b_stats)
    pb.finish = lambda: fin(c)
    return pb


def _canonical(plan, a, b):
    """One matmul as a canonical product c (..., M, N) = x @ y: (x, y, flat_rows, finish(c) ->
    torch.matmul's result, compute() -> c by the torch op torch.matmul itself calls)."""
    k, flat = plan.kind, None
    if k == "dot":
        return (a.unsqueeze(0), b.unsqueeze(-1), None, lambda c: c.view(()),
                lambda: a.dot(b).view(1, 1))
    if k == "mv":
        return a, b.unsqueeze(-1), None, lambda c: c.squeeze(-1), lambda: a.mv(b).unsqueeze(-1)
    if k == "mm1":
        x = a.unsqueeze(0)
        return x, b, None, lambda c: c.squeeze(0), lambda: x.mm(b)
    if k == "mm":
        return a, b, None, lambda c: c, lambda: a.mm(b)
    if k == "fold":
        x, t2, shape = decompose.fold_operands(plan, a, b)
        flat = None if plan.transpose else tuple(shape[:-1] if t2.dim() == 2 else shape)
        if t2.dim() == 2:
            fin = (lambda c: c.view(shape).mT.contiguous()) if plan.transpose else (lambda c: c.view(shape))
            return x, t2, flat, fin, lambda: x.mm(t2)
        return x, t2.unsqueeze(-1), flat, lambda c: c.view(shape), lambda: x.mv(t2).unsqueeze(-1)
    x, y, shape, _ = decompose.bmm_operands(plan, a, b)
    fin = (lambda c: c.squeeze(-1).view(shape)) if b.dim() == 1 else (lambda c: c.view(shape))
    return x, y, flat, fin, lambda: x.bmm(y)


@_plain
def mm(a, b, *, op="mm", phase="forward", module=None):
    """Checked ``torch.mm``: (M, K) @ (K, N)."""
    if enabled() and _use_triton(a, b) and a.dim() == 2 and b.dim() == 2:
        return _triton(TritonProblem(op, a, b), phase, module)
    out = torch.mm(a, b)
    if not enabled():
        return out
    _require_float(op, a, b)
    return _finish(op, out, lambda o: _simple(op, a, b, o, lambda: torch.mm(a, b)), phase, module)


@_plain
def bmm(a, b, *, op="bmm", phase="forward", module=None):
    """Checked ``torch.bmm``: (B, M, K) @ (B, K, N)."""
    if enabled() and _use_triton(a, b) and a.dim() == 3 and b.dim() == 3 and a.shape[0] == b.shape[0]:
        return _triton(TritonProblem(op, a, b), phase, module)
    out = torch.bmm(a, b)
    if not enabled():
        return out
    _require_float(op, a, b)
    return _finish(op, out, lambda o: _simple(op, a, b, o, lambda: torch.bmm(a, b)), phase, module)


def _simple(op, a, b, out, again, alpha=1.0, addend=None, beta=1.0):
    pb = Problem(op, a, b, out, alpha=alpha, addend=addend, beta=beta)
    pb.result, pb.recompute = out, again
    return pb


@_plain
def addmm(input, mat1, mat2, *, beta=1, alpha=1, module=None):
    """Checked ``torch.addmm``: beta * input + alpha * (mat1 @ mat2)."""
    if enabled() and _use_triton(input, mat1, mat2) and mat1.dim() == 2 and mat2.dim() == 2:
        return _triton(TritonProblem("addmm", mat1, mat2, addend=input, alpha=alpha, beta=beta),
                       module=module)
    out = torch.addmm(input, mat1, mat2, beta=beta, alpha=alpha)
    if not enabled():
        return out
    _require_float("addmm", input, mat1, mat2)
    return _finish("addmm", out, lambda o: _simple(
        "addmm", mat1, mat2, o, lambda: torch.addmm(input, mat1, mat2, beta=beta, alpha=alpha),
        alpha=float(alpha), addend=None if beta == 0 else input, beta=beta), module=module)


@_plain
def baddbmm(input, batch1, batch2, *, beta=1, alpha=1, module=None):
    """Checked ``torch.baddbmm``: beta * input + alpha * (batch1 @ batch2)."""
    if (enabled() and _use_triton(input, batch1, batch2) and batch1.dim() == 3 and batch2.dim() == 3
            and batch1.shape[0] == batch2.shape[0]):
        return _triton(TritonProblem("baddbmm", batch1, batch2, addend=input, alpha=alpha, beta=beta),
                       module=module)
    out = torch.baddbmm(input, batch1, batch2, beta=beta, alpha=alpha)
    if not enabled():
        return out
    _require_float("baddbmm", input, batch1, batch2)
    return _finish("baddbmm", out, lambda o: _simple(
        "baddbmm", batch1, batch2, o,
        lambda: torch.baddbmm(input, batch1, batch2, beta=beta, alpha=alpha),
        alpha=float(alpha), addend=None if beta == 0 else input, beta=beta), module=module)


@_plain
def linear(input, weight, bias=None, *, module=None, weight_stats=None):
    """Checked ``F.linear``: input (..., in) @ weight.T (out, in) + bias (out,)."""
    if enabled() and _use_triton(input, weight) and input.dim() >= 2 and (bias is None or bias.dim() == 1):
        x2 = rows2d(input)
        lead = tuple(input.shape[:-1])
        return _triton(TritonProblem("linear", x2, weight.t(), bias, lead if len(lead) > 1 else None,
                                     lambda c: c.view(*lead, c.shape[-1]), b_stats=weight_stats),
                       "forward", module)
    out = F.linear(input, weight, bias)
    if not enabled():
        return out
    _require_float("linear", input, weight, *(() if bias is None else (bias,)))
    return _finish("linear", out, lambda o: _linear_problem(input, weight, bias, o, weight_stats),
                   module=module)


def _linear_problem(x, w, bias, out, weight_stats=None):
    if x.dim() == 1:
        a, c, flat = x.unsqueeze(0), out.unsqueeze(0), None
    else:
        a, c, flat = _fold(x, out)
    pb = Problem("linear", a, w.t(), c, addend=bias, flat_rows=flat)
    pb.b_stats = weight_stats
    pb.result, pb.recompute = out, lambda: F.linear(x, w, bias)
    return pb


@_plain
def check_views(op, a, b, c, *, module=None, phase="forward"):
    """Check an already computed product c (..., M, N) == a (..., M, K) @ b (..., K, N), given as
    views (einsum): no recompute is possible, so a recompute policy raises on an alarm (logged,
    action "raised"); a correct policy repairs c in place."""
    if not enabled():
        return
    _require_float(op, a, b)
    run_checked(Problem(op, a, b, c), None, phase=phase, module=module)
