"""Checked products with torch's semantics: matmul, mm, bmm, addmm, baddbmm, linear.

Each op computes its result with the torch op itself (so values, shapes, broadcasting and errors
are torch's), then checks it through the backend, under the current ``abft.scope`` labels and
``abft.config`` policy. With the kill switch (``enabled=False`` or ``ABFT_DISABLE=1``) each op is
the plain torch call.
"""
import sys
import threading

import torch
import torch.nn.functional as F

from abft import settings as _config
from abft import context, faults, policy
from abft.alarms import SilentCorruptionError
from abft.kernels import reference
from abft.tolerance import units as _units
from abft.kernels import layout as L

SUPPORTED = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

_sites = {}
_sites_lock = threading.Lock()


class Problem:
    """One product in canonical form: out's view c (..., M, N) = alpha * a (..., M, K) @ b + addend."""

    def __init__(self, op, a, b, c, alpha=1.0, addend=None, flat_rows=None):
        self.op, self.a, self.b, self.c = op, a, b, c
        self.alpha, self.addend, self.flat_rows = alpha, addend, flat_rows


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
        return a.view(-1, a.shape[-1]), c.view(-1, c.shape[-1]), tuple(a.shape[:-1])
    except RuntimeError:
        return a, c, None


def _tf32(t):
    if t.dtype != torch.float32:
        return False
    if t.device.type == "cuda":
        return torch.backends.cuda.matmul.allow_tf32
    return torch.get_float32_matmul_precision() != "highest"


def _sample(op, phase, labels, depth):
    s = _config.get()
    if s.sample_every == 1:
        return True
    f = sys._getframe(depth)
    key = (op, phase, labels.get("module"), f.f_code.co_filename, f.f_lineno)
    with _sites_lock:
        n = _sites.get(key, 0)
        _sites[key] = n + 1
    return n % s.sample_every == 0


def run_checked(pb, recompute, *, phase="forward", depth=3):
    """Check ``pb`` under the current policy; ``recompute()`` returns a fresh Problem.
    Returns the result tensor to hand to the caller (pb.c's base, possibly recomputed)."""
    s = _config.get()
    sc = context.current()
    labels = dict(sc.labels)
    if labels.get("phase"):
        phase = labels["phase"]
    call_id = sc.next_call_id()
    if not _sample(pb.op, phase, labels, depth):
        policy.count("sampled_out_calls")
        return None
    ctx = faults.CallContext(pb.op, phase, labels, call_id, tuple(pb.c.shape), pb.c.dtype)
    if faults.active():
        faults.apply(pb.c, ctx)
    pend = _check(pb, ctx, s)
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
    if s.policy == "correct" and _correctable(alarms):
        with torch.no_grad():
            for a in alarms:
                target = pb.c[tuple(a.tile[:-2])] if a.tile[:-2] else pb.c
                target[_flat_row(a, pb), a.col] -= a.residual
        ctx.attempt = 1
        again = policy.resolve_now(_check(pb, ctx, s))
        if not again:
            for a in alarms:
                a.action, a.persistence = "corrected", "transient"
            policy.emit(alarms, sc.log)
            return None
    # recompute (or a correction that did not verify)
    ctx.attempt = 1
    pb2 = recompute()
    if faults.active():
        faults.apply(pb2.c, ctx)
    again = policy.resolve_now(_check(pb2, ctx, s))
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


def _correctable(alarms):
    return all(a.kind == "checksum" and a.row is not None and a.col is not None
               and len(a.rows) == 1 and len(a.cols) == 1 for a in alarms)


def _check(pb, ctx, s):
    bm, bn = s.tiles
    u = _units(pb.c.dtype, tf32=_tf32(pb.a))
    verdict, detail = reference.check(pb.a, pb.b, pb.c, bm=bm, bn=bn, units=u, alpha=pb.alpha,
                                      addend=pb.addend, lam=s.lam)
    m, n = pb.c.shape[-2], pb.c.shape[-1]
    info = dict(op=pb.op, phase=ctx.phase, labels=ctx.labels, call_id=ctx.call_id,
                rank=context.current_rank(),
                shapes=(tuple(pb.a.shape), tuple(pb.b.shape)), dtype=str(pb.c.dtype).replace("torch.", ""),
                bm=max(1, min(bm, m)), bn=max(1, min(bn, n)), backend="reference",
                time=policy.now(), flat_rows=pb.flat_rows, action="recorded")
    return policy.make_pending(verdict, detail, info, context.current().log)


def _finish(op, out, make, phase="forward"):
    """Shared tail of every op: check ``make(out)`` and return the (possibly recomputed) result."""
    pb = make(out)
    fresh = run_checked(pb, lambda: make(pb.recompute()), phase=phase, depth=4)
    return out if fresh is None else fresh.result


def _enabled():
    return _config.get().enabled


def matmul(a, b):
    """Checked ``torch.matmul(a, b)``: 1-D, 2-D, batched and broadcast operands.

    Args:
        a: (..., M, K) or (K,).
        b: (..., K, N) or (K,).
    Returns:
        torch.matmul(a, b), bit for bit (reference backend), checked tile by tile.
    """
    out = torch.matmul(a, b)
    if not _enabled():
        return out
    _require_float("matmul", a, b)
    return _finish("matmul", out, lambda o: _matmul_problem(a, b, o))


def _matmul_problem(a, b, out):
    if a.dim() == 1 and b.dim() == 1:
        pb = Problem("matmul", a.unsqueeze(0), b.unsqueeze(-1), out.view(1, 1))
    elif b.dim() == 1:
        a2, c2, flat = _fold(a, out.unsqueeze(-1))
        pb = Problem("matmul", a2, b.unsqueeze(-1), c2, flat_rows=flat)
    elif a.dim() == 1:
        pb = Problem("matmul", a.unsqueeze(0), b, out.unsqueeze(-2))
    elif b.dim() == 2:
        a2, c2, flat = _fold(a, out)
        pb = Problem("matmul", a2, b, c2, flat_rows=flat)
    else:
        pb = Problem("matmul", a, b, out)
    pb.result = out
    pb.recompute = lambda: torch.matmul(a, b)
    return pb


def mm(a, b):
    """Checked ``torch.mm``: (M, K) @ (K, N)."""
    out = torch.mm(a, b)
    if not _enabled():
        return out
    _require_float("mm", a, b)
    return _finish("mm", out, lambda o: _simple("mm", a, b, o, lambda: torch.mm(a, b)))


def bmm(a, b):
    """Checked ``torch.bmm``: (B, M, K) @ (B, K, N)."""
    out = torch.bmm(a, b)
    if not _enabled():
        return out
    _require_float("bmm", a, b)
    return _finish("bmm", out, lambda o: _simple("bmm", a, b, o, lambda: torch.bmm(a, b)))


def _simple(op, a, b, out, again, alpha=1.0, addend=None):
    pb = Problem(op, a, b, out, alpha=alpha, addend=addend)
    pb.result, pb.recompute = out, again
    return pb


def addmm(input, mat1, mat2, *, beta=1, alpha=1):
    """Checked ``torch.addmm``: beta * input + alpha * (mat1 @ mat2)."""
    out = torch.addmm(input, mat1, mat2, beta=beta, alpha=alpha)
    if not _enabled():
        return out
    _require_float("addmm", input, mat1, mat2)
    addend = None if beta == 0 else (input if beta == 1 else input * beta)
    return _finish("addmm", out, lambda o: _simple(
        "addmm", mat1, mat2, o, lambda: torch.addmm(input, mat1, mat2, beta=beta, alpha=alpha),
        alpha=float(alpha), addend=addend))


def baddbmm(input, batch1, batch2, *, beta=1, alpha=1):
    """Checked ``torch.baddbmm``: beta * input + alpha * (batch1 @ batch2)."""
    out = torch.baddbmm(input, batch1, batch2, beta=beta, alpha=alpha)
    if not _enabled():
        return out
    _require_float("baddbmm", input, batch1, batch2)
    addend = None if beta == 0 else (input if beta == 1 else input * beta)
    return _finish("baddbmm", out, lambda o: _simple(
        "baddbmm", batch1, batch2, o,
        lambda: torch.baddbmm(input, batch1, batch2, beta=beta, alpha=alpha),
        alpha=float(alpha), addend=addend))


def linear(input, weight, bias=None):
    """Checked ``F.linear``: input (..., in) @ weight.T (out, in) + bias (out,)."""
    out = F.linear(input, weight, bias)
    if not _enabled():
        return out
    _require_float("linear", input, weight, *(() if bias is None else (bias,)))
    return _finish("linear", out, lambda o: _linear_problem(input, weight, bias, o))


def _linear_problem(x, w, bias, out):
    if x.dim() == 1:
        a, c, flat = x.unsqueeze(0), out.unsqueeze(0), None
    else:
        a, c, flat = _fold(x, out)
    pb = Problem("linear", a, w.t(), c, addend=bias, flat_rows=flat)
    pb.result, pb.recompute = out, lambda: F.linear(x, w, bias)
    return pb
