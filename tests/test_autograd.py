"""Gradients through the checked ops are torch's, bit for bit, and the backward products are
checked with their phase labels."""
import pytest
import torch
import torch.nn.functional as F

import abft

DT = lambda d: str(d).replace("torch.", "")


def _grads(fn, *inputs):
    ins = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*ins)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    out.backward(g)
    return out, [t.grad for t in ins]


def _same(fn_abft, fn_torch, *inputs):
    o1, g1 = _grads(fn_abft, *inputs)
    o2, g2 = _grads(fn_torch, *inputs)
    assert torch.equal(o1, o2)
    for a, b in zip(g1, g2):
        assert (a is None and b is None) or torch.equal(a, b)


MATMUL = [((7,), (7,)), ((50, 70), (70,)), ((70,), (70, 30)), ((65, 123), (123, 77)),
          ((4, 33, 70), (70, 40)), ((2, 3, 17, 40), (2, 3, 40, 9)), ((2, 1, 5, 7), (3, 7, 4)),
          ((70,), (3, 70, 5)), ((30, 70), (3, 70, 5)), ((4, 33, 70), (70,))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=DT)
@pytest.mark.parametrize("sa,sb", MATMUL, ids=lambda s: "x".join(map(str, s)))
def test_matmul_gradients_bit_identical(sa, sb, dtype):
    a, b = torch.randn(sa).to(dtype), torch.randn(sb).to(dtype)
    _same(abft.matmul, torch.matmul, a, b)
    assert abft.flush() == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DT)
@pytest.mark.parametrize("xs", [(37, 96), (3, 50, 96), (2, 3, 7, 96)], ids=str)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_gradients_bit_identical(xs, bias, dtype):
    x, w = torch.randn(xs).to(dtype), torch.randn(130, 96).to(dtype)
    b = torch.randn(130).to(dtype) if bias else None
    if bias:
        _same(abft.linear, F.linear, x, w, b)
    else:
        _same(lambda x, w: abft.linear(x, w), lambda x, w: F.linear(x, w), x, w)
    assert abft.flush() == []


def test_other_ops_gradients_bit_identical():
    a, b, c = torch.randn(40, 30), torch.randn(30, 50), torch.randn(40, 50)
    _same(abft.mm, torch.mm, a, b)
    _same(lambda i, x, y: abft.addmm(i, x, y, beta=0.5, alpha=2.0),
          lambda i, x, y: torch.addmm(i, x, y, beta=0.5, alpha=2.0), c, a, b)
    _same(lambda i, x, y: abft.addmm(i, x, y), lambda i, x, y: torch.addmm(i, x, y), torch.randn(50), a, b)
    x, y, z = torch.randn(3, 20, 30), torch.randn(3, 30, 10), torch.randn(3, 20, 10)
    _same(abft.bmm, torch.bmm, x, y)
    _same(lambda i, x, y: abft.baddbmm(i, x, y, beta=2.0, alpha=0.5),
          lambda i, x, y: torch.baddbmm(i, x, y, beta=2.0, alpha=0.5), z, x, y)
    assert abft.flush() == []


def test_gradcheck_float64():
    a = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(3, dtype=torch.float64, requires_grad=True)
    x3 = torch.randn(2, 6, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(abft.matmul, (a, b))
    assert torch.autograd.gradcheck(abft.matmul, (x3, b))
    assert torch.autograd.gradcheck(abft.linear, (x3, w, bias))
    assert torch.autograd.gradcheck(lambda i, x, y: abft.baddbmm(i, x, y, beta=0.3, alpha=1.7),
                                    (torch.randn(2, 6, 4, dtype=torch.float64, requires_grad=True),
                                     x3, torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)))
    assert abft.flush() == []


@pytest.mark.parametrize("op,phase,inject_shape", [
    ("linear", "forward", None), ("linear", "grad_input", None), ("linear", "grad_weight", None),
    ("matmul", "forward", None), ("matmul", "grad_a", None), ("matmul", "grad_b", None)])
def test_fault_in_each_phase_is_detected_and_labelled(op, phase, inject_shape):
    x = torch.randn(2, 20, 16, requires_grad=True)
    w = torch.randn(24, 16, requires_grad=True)
    with abft.inject(when=lambda ctx: ctx.phase == phase, row=1, col=2, kind="add", value=50.0) as h:
        with abft.scope(module="blk.mlp", step=5):
            y = abft.linear(x, w) if op == "linear" else abft.matmul(x, w.t())
            y.square().sum().backward()
    alarms = abft.flush()
    assert len(h.hits) == 1 and len(alarms) == 1
    al = alarms[0]
    assert (al.op, al.phase, al.module, al.step) == (op, phase, "blk.mlp", 5)
    assert (al.row, al.col) == (1, 2)


def test_calls_with_nothing_to_record_skip_the_dispatcher(monkeypatch):
    """An eager call with no gradient to record runs the custom op's own function (torch's
    dispatcher costs tens of µs a call); autograd, and a dispatch mode that watches ops, get the
    custom op. Backward products run without grad mode, so they go direct too."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from abft import autograd
    direct = []

    def spy(op, fn):
        return lambda *args: direct.append(str(op).split(".")[-1]) or fn(*args)
    monkeypatch.setattr(autograd, "_IMPLS", {op: spy(op, fn) for op, fn in autograd._IMPLS.items()})

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    a, b = torch.randn(5, 4), torch.randn(4, 3)
    want = a @ b
    assert torch.equal(abft.matmul(a, b), want) and direct == ["matmul"]
    direct.clear()
    with Seen() as seen:
        assert torch.equal(abft.matmul(a, b), want)
    assert direct == [] and "abft.matmul.default" in seen.ops
    x = a.clone().requires_grad_()
    abft.matmul(x, b).sum().backward()
    assert direct == ["grad_product"] and torch.equal(x.grad, torch.ones(5, 3) @ b.T)
    assert not abft.flush() and abft.stats()["checked_calls"] == 4


def test_eager_autograd_calls_skip_the_dispatcher():
    """With a gradient to record, an eager call runs the op's own function under a plain
    autograd Function with the op's rule (the custom op's autograd wrapper costs about 50 µs a
    call more); a dispatch mode that watches ops still gets the custom op. The gradients are
    torch's either way, and double backward goes through the same rule."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x, w = torch.randn(6, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    want = _grads(F.linear, x, w)
    for mode, name in ((None, "Checked_linear"), (Seen, "GeneratedBackwardFor_abft_linear")):
        xi, wi = x.clone().requires_grad_(), torch.nn.Parameter(w.clone())
        if mode is None:
            y = abft.linear(xi, wi)
        else:
            with mode():
                y = abft.linear(xi, wi)
        assert type(y.grad_fn).__name__.startswith(name)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.dtype))
        assert torch.equal(xi.grad, want[1][0]) and torch.equal(wi.grad, want[1][1])
    a = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(abft.matmul, (a, b))
    assert not abft.flush()


def test_abft_calls_do_not_show_their_attribute_reads_to_torch_function_modes():
    """A torch-function mode around an eager checked call (``abft.checked`` is one) sees none of
    the attribute reads on the way to the check: each would be a Python call of the mode's."""
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    x = torch.randn(6, 5, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(4, 5))
    wt = w.detach().t()
    with Count() as seen:
        y = abft.linear(x, w)
        z = abft.matmul(x, wt)
    assert seen.calls == [], seen.calls
    (y.sum() + z.sum()).backward()
    assert not abft.flush()
