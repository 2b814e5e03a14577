"""Torch's own test machinery as the gate of drop-in behaviour: OpInfo's samples
(``op_db``) for every function ``checked()`` intercepts and every ``abft`` op: values bit for bit
with all their keywords, ``out=``, gradcheck and gradgradcheck, forward-mode AD (``jvp``),
``torch.func.grad`` and ``vmap``."""
import pytest
import torch

import abft

pytest.importorskip("expecttest")
from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402

NAMES = ("matmul", "mm", "bmm", "addmm", "baddbmm", "nn.functional.linear", "__rmatmul__")
OPS = [o for o in op_db if o.name in NAMES and o.variant_test_name in ("", "decomposed")]
DIRECT = {"matmul": abft.matmul, "mm": abft.mm, "bmm": abft.bmm, "addmm": abft.addmm,
          "baddbmm": abft.baddbmm, "nn.functional.linear": abft.linear}
IDS = [o.name + ("." + o.variant_test_name if o.variant_test_name else "") for o in OPS]


def _samples(op, dtype, requires_grad=False, most=None):
    out = list(op.sample_inputs("cpu", dtype, requires_grad=requires_grad))
    return out[:most] if most else out


def _call(fn, s):
    return fn(s.input, *s.args, **s.kwargs)


def _same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.nan_to_num(7), b.nan_to_num(7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("op", OPS, ids=IDS)
def test_values_with_every_keyword(op, dtype):
    for s in _samples(op, dtype):
        want = _call(op.op, s)
        with abft.checked():
            got = _call(op.op, s)
        assert _same(got, want), (op.name, s)
        if op.name in DIRECT:
            assert _same(_call(DIRECT[op.name], s), want), (op.name, s)
    assert not abft.flush()
    assert sum(r["checked"] for r in abft.coverage()) > 0


@pytest.mark.parametrize("op", [o for o in OPS if o.supports_out], ids=[i for o, i in zip(OPS, IDS) if o.supports_out])
def test_out(op):
    for s in _samples(op, torch.float32):
        want = _call(op.op, s)
        out = torch.full_like(want, float("nan"))
        with abft.checked():
            ret = op.op(s.input, *s.args, **s.kwargs, out=out)
        assert ret is out and _same(out, want), (op.name, s)
    assert sum(r["checked"] for r in abft.coverage()) > 0 and not abft.flush()


@pytest.mark.parametrize("fast", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["fast_mode", "full"])
@pytest.mark.parametrize("op", OPS, ids=IDS)
def test_gradcheck_and_gradgradcheck(op, fast):
    for s in _samples(op, torch.float64, requires_grad=True, most=4):
        inputs = [t for t in (s.input, *s.args) if isinstance(t, torch.Tensor) and t.requires_grad]

        def fn(*ts):
            it = iter(ts)
            args = [next(it) if isinstance(t, torch.Tensor) and t.requires_grad else t
                    for t in (s.input, *s.args)]
            with abft.checked():
                return op.op(*args, **s.kwargs)
        assert torch.autograd.gradcheck(fn, inputs, fast_mode=fast)
        assert torch.autograd.gradgradcheck(fn, inputs, fast_mode=fast)
        if op.name in DIRECT:
            def direct(*ts):
                it = iter(ts)
                args = [next(it) if isinstance(t, torch.Tensor) and t.requires_grad else t
                        for t in (s.input, *s.args)]
                return DIRECT[op.name](*args, **s.kwargs)
            assert torch.autograd.gradcheck(direct, inputs, fast_mode=fast)
            assert torch.autograd.gradgradcheck(direct, inputs, fast_mode=fast)


@pytest.mark.parametrize("op", OPS, ids=IDS)
def test_forward_mode_ad_grad_and_vmap(op):
    for s in _samples(op, torch.float64, most=4):
        x = s.input
        f = lambda t: op.op(t, *s.args, **s.kwargs)
        tangent = torch.ones_like(x)
        want = torch.func.jvp(f, (x,), (tangent,))
        with abft.checked():
            got = torch.func.jvp(f, (x,), (tangent,))
        assert _same(got[0], want[0]) and _same(got[1], want[1]), (op.name, s)
        g = lambda t: f(t).sum()
        want = torch.func.grad(g)(x)
        with abft.checked():
            got = torch.func.grad(g)(x)
        assert _same(got, want), (op.name, s)
        xs = torch.stack([x, x * 2])
        want = torch.func.vmap(f)(xs)
        with abft.checked():
            got = torch.func.vmap(f)(xs)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        if op.name in DIRECT:
            d = lambda t: DIRECT[op.name](t, *s.args, **s.kwargs)
            got = torch.func.jvp(d, (x,), (tangent,))
            want = torch.func.jvp(f, (x,), (tangent,))
            assert _same(got[1], want[1]), (op.name, s)
            assert _same(torch.func.vmap(d)(xs), torch.func.vmap(f)(xs))
