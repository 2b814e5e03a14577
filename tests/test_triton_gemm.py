"""The fused checked-GEMM kernel under the Triton interpreter (small shapes)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from stress import DISTRIBUTIONS, operands  # noqa: E402
from abft.kernels import configs, layout as L  # noqa: E402
from abft.kernels import triton_gemm as TG  # noqa: E402

pytestmark = pytest.mark.skipif(not configs.interpreting() and not torch.cuda.is_available(),
                                reason="needs TRITON_INTERPRET=1 or a GPU")
DT = lambda d: str(d).replace("torch.", "")


def _err(c, ref):
    e = (c.double() - ref).abs()
    return e.max().item(), e.square().mean().sqrt().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=DT)
@pytest.mark.parametrize("case", ["odd", "k_ragged", "batched", "transposed", "broadcast", "bias"])
def test_values_within_twice_torch_error(case, dtype):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)
    bias = None
    if case == "odd":
        a, b = r(37, 45), r(45, 29)
    elif case == "k_ragged":
        a, b = r(32, 77), r(77, 32)
    elif case == "batched":
        a, b = r(3, 20, 40), r(3, 40, 18)
    elif case == "transposed":
        a, b = r(45, 37).t(), r(29, 45).t()
    elif case == "broadcast":
        a, b = r(2, 21, 33), r(33, 19)
    else:
        a, b, bias = r(30, 40), r(40, 20), r(20)
    c, v, (rr, rc) = TG.checked_gemm(a, b, bias)
    ref = torch.matmul(a.double(), b.double()) + (0 if bias is None else bias.double())
    mine = _err(c, ref)
    theirs = _err(torch.matmul(a, b) + (0 if bias is None else bias), ref)
    ulp = torch.finfo(dtype).eps * ref.abs().max().item()
    assert mine[0] <= 2 * theirs[0] + ulp and mine[1] <= 2 * theirs[1] + ulp
    assert (v[..., L.STATUS] == L.OK).all()
    assert v[..., L.ROW_RATIO].max() <= 1 and v[..., L.COL_RATIO].max() <= 1


def test_verdict_is_written_by_every_tile(monkeypatch):
    real_empty = torch.empty
    monkeypatch.setattr(TG.torch, "empty", lambda *s, **k: real_empty(*s, **k).fill_(float("nan")))
    a, b = torch.randn(2, 70, 40), torch.randn(2, 40, 65)
    c, v, (rr, rc) = TG.checked_gemm(a, b)
    assert not torch.isnan(v).any() and not torch.isnan(rr).any() and not torch.isnan(rc).any()
    assert not torch.isnan(c).any() and v.shape == (2, 3, 3, L.NFIELDS)


@pytest.mark.parametrize("kind,extra", [("bitflip", dict(bit=30)), ("bitflip", dict(bit=29)), ("bitflip", dict(bit=22)),
                                        ("bitflip", dict(bit=31)), ("add", dict(value=0.5)),
                                        ("zero", {})])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DT)
def test_injected_accumulator_fault_is_located(kind, extra, dtype):
    torch.manual_seed(1)
    a, b = torch.randn(2, 64, 96).to(dtype), torch.randn(2, 96, 64).to(dtype)
    inj = dict(kind=kind, batch=1, row=45, col=12, k_step=1, **extra)
    clean, _, _ = TG.checked_gemm(a, b)
    c, v, (rr, rc) = TG.checked_gemm(a, b, inject=inj)
    alarmed = (v[..., L.ROW_RATIO] > 1) | (v[..., L.COL_RATIO] > 1)
    assert alarmed.nonzero().tolist() == [[1, 1, 0]]
    t = v[1, 1, 0]
    assert (int(t[L.ROW]), int(t[L.COL])) == (45, 12)
    assert not torch.equal(c, clean)


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
@pytest.mark.parametrize("k", [1, 7, 64, 300])
def test_no_false_alarm_on_the_stress_set(dist, k):
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        a, b = operands(dist, 64, k, 64, dt, 0)
        c, v, _ = TG.checked_gemm(a, b)
        worst = max(v[..., L.ROW_RATIO].max().item(), v[..., L.COL_RATIO].max().item())
        assert worst <= 1, f"{dist} K={k} {dt}: {worst}"
        assert (v[..., L.STATUS] == L.OK).all()


def test_every_gpu_config_launches_once():
    a, b = torch.randn(64, 128).to(torch.bfloat16), torch.randn(128, 64).to(torch.bfloat16)
    for dt in (torch.float32, torch.bfloat16):
        for cfg in configs.configs(128, 128, 4096, dt, interpret=False):
            c, v, _ = TG.checked_gemm(a.to(dt), b.to(dt), tiles=(32, 32), block_k=cfg.kwargs["BLOCK_K"])
            assert (v[..., L.STATUS] == L.OK).all()


def test_nonfinite_inputs_are_unverified_and_checks_compile_out():
    a, b = torch.randn(40, 40), torch.randn(40, 40)
    a[3, 3] = float("nan")
    _, v, _ = TG.checked_gemm(a, b)
    assert (v[0, 0, :, L.STATUS] == L.UNVERIFIED).all()
    c, v, d = TG.checked_gemm(b, b, check=False)
    assert v is None and torch.allclose(c, b @ b, atol=1e-4)


def test_triton_backend_through_the_api():
    import abft
    x, w, bias = torch.randn(2, 20, 48), torch.randn(40, 48), torch.randn(40)
    with abft.config(backend="triton"):
        y = abft.linear(x, w, bias)
        torch.testing.assert_close(y, torch.nn.functional.linear(x, w, bias), rtol=1e-5, atol=1e-5)
        with abft.scope(module="fc", step=3):
            with abft.inject(row=25, col=7, kind="bitflip", bit=29):
                abft.linear(x, w, bias)
        (al,) = abft.flush()
        assert (al.backend, al.module, al.batch, al.row, al.col) == ("triton", "fc", (1,), 5, 7)
        with abft.config(policy="recompute"):
            with abft.inject(row=3, col=4, kind="add", value=2.0):
                out = abft.mm(x[0], w.t())
        torch.testing.assert_close(out, x[0] @ w.t(), rtol=1e-5, atol=1e-5)
        assert abft.alarms()[-1].persistence == "transient"
        y.sum().backward() if y.requires_grad else None
        xg = x.clone().requires_grad_()
        abft.linear(xg, w, bias).sum().backward()          # grad_input through the kernel (mm)
        assert abft.flush() == [] and xg.grad is not None
