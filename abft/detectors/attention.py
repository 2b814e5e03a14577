"""The softmax invariants of attention, checked in ``abft.checked(sdpa=True)``.

Between the two checked products of attention (S = Q K^T, O = P V) lies P = softmax(S), which
neither product's checksums see: a fault in the softmax, or in P while it waits for the backward,
is a consistent product of a wrong P. Two invariants cover it at the cost of a few row sums:

- forward: every row of P sums to 1, so |P 1 - 1| <= 2 gamma_{2S+8}(u) + 2 u_out per row (S
  columns; u the float32 unit of the softmax's arithmetic, u_out P's own rounding when it is
  stored in half precision; the exponentials' argument rounding adds at most S u / e);
- backward: dS = P * (dP - rowsum(dP * P)) sums to 0 over each row where P's does to 1, so
  |dS 1| <= |c| |P 1 - 1| + 2 gamma_{2S+8}(u) (sum |P dP| + |c| sum P) + u_out sum |dS| with
  c = rowsum(dP * P); the saved P's row sums are checked again there (a change at rest).

Rows that are not finite (fully masked, or non-finite scores) are not checked. An alarm (kind
``invariant``) names the module, the batch and head, and the row; the column is not located.
Values and gradients are torch's (``torch.softmax`` and its own backward).
"""

import torch

from abft import ops, policy
from abft.kernels.threshold import UNIT, gamma

F64 = torch.float64


def _units(p):
    """(u, u_out, u_chk): the softmax's arithmetic (float32, float64 for float64), P's own
    rounding when stored in half precision, and the check's float32 sums (its own dtype's)."""
    u = UNIT[F64] if p.dtype == F64 else UNIT[torch.float32]
    out = UNIT[p.dtype] if p.dtype in (torch.float16, torch.bfloat16) else 0.0
    return u, out, u


def forward_bound(p):
    """The row-sum bound of P (a float): the softmax's rounding, P's, and the check's sum."""
    u, out, chk = _units(p)
    s = p.shape[-1]
    return 2 * gamma(2 * s + 8, u) + 2 * out + gamma(s, chk) * (1 + 4 * out)


def _acc(t):
    return t.dtype if t.dtype in (torch.float32, F64) else torch.float32


def check_forward(p):
    """(bad rows, |row sum - 1|, bound, P's row sums): ``bad`` bool (..., L). One pass over P,
    summed in float32 (float64 for float64)."""
    rs = p.sum(-1, dtype=_acc(p))
    dev = (rs - 1).abs()
    bound = forward_bound(p)
    bad = torch.isfinite(rs) & ~(dev <= bound)
    return bad, dev, bound, rs


def check_backward(p, dp, ds, rs):
    """(bad rows, |row sum of dS|, bound per row), given P's row sums ``rs``: four more
    reductions (P . dP, max and min of dP, the row sums of dS), and for half precision dS its
    magnitudes."""
    acc = _acc(ds)
    u, out, chk = _units(ds)
    s = p.shape[-1]
    c = torch.linalg.vecdot(p.to(acc), dp.to(acc))
    # max |dP|, so that sum |P dP| <= max|dP| sum P (amax and amin: 15x faster than aminmax here)
    big = torch.maximum(dp.amax(-1), -dp.amin(-1)).to(acc)
    total = ds.sum(-1, dtype=acc)
    g = 2 * gamma(2 * s + 8, u) + 2 * gamma(s, chk)
    bound = c.abs() * (rs - 1).abs() + g * (big * rs.abs() + c.abs() * rs.abs()) * 2
    if out:
        bound = bound + (out + gamma(s, chk)) * ds.abs().sum(-1, dtype=acc)
    bound = bound * (1 + 2.0 ** -10) + torch.finfo(torch.float32).tiny * s
    ok_in = torch.isfinite(rs) & torch.isfinite(c) & torch.isfinite(bound)
    bad = ok_in & ~(total.abs() <= bound)
    return bad, total.abs(), bound


def _report(bad, dev, bound, module, phase):
    """Alarms for the first rows of ``bad`` (at most 16; the count in labels)."""
    from abft.alarms import SilentCorruptionError, invariant_alarm
    from abft.context import current
    rows = bad.nonzero().tolist()
    if not rows:
        return []
    action = policy.action()
    sc = current()
    labels = sc.labels
    dev, bound = dev.detach().cpu(), bound.detach().cpu()
    found = []
    for idx in rows[:16]:
        *batch, row = idx
        thr = float(bound[tuple(idx)])
        found.append(invariant_alarm(phase=phase, module=module, scope=labels, shape=bad.shape, batch=batch,
                                     row=row, deviation=dev[tuple(idx)], bound=thr, action=action,
                                     rows=len(rows)))
    policy.report(found, sc.log)
    if action == "raised":
        raise SilentCorruptionError(found[0])
    return found


class Softmax(torch.autograd.Function):
    """``torch.softmax(scores, -1)`` with the invariants checked, forward and backward."""

    @staticmethod
    def forward(ctx, scores, module):
        p = torch.softmax(scores, -1)
        ctx.save_for_backward(p)
        ctx.module = module
        if ops.enabled():
            from abft.coverage import count
            bad, dev, bound, _ = check_forward(p)
            count("softmax", module, "checked")
            if bool(bad.any()):
                _report(bad, dev, torch.full_like(dev, bound), module, "forward")
        return p

    @staticmethod
    def backward(ctx, dp):
        p, = ctx.saved_tensors
        ds = torch._softmax_backward_data(dp, p, -1, p.dtype)
        if ops.enabled():
            bad, dev, bound, rs = check_forward(p)            # P at rest since the forward
            if bool(bad.any()):
                _report(bad, dev, torch.full_like(dev, bound), ctx.module, "saved")
            bad, dev, bound = check_backward(p, dp, ds, rs)
            if bool(bad.any()):
                _report(bad, dev, bound, ctx.module, "backward")
        return ds, None


def softmax(scores, module=None):
    return Softmax.apply(scores, module)
