"""The row-checked GEMM (``kernels/rowcheck.py``) under the interpreter: the product, no alarm on
the stress set, faults caught at their row, the verdict invariant under powers of two, non-finite
inputs unverified and non-finite outputs alarmed, both load paths (TMA descriptors, pointers)."""
import pytest
import torch

from abft.bench.stress import DISTRIBUTIONS, operands
from abft.kernels import layout as L
from abft.kernels import rowcheck as R
from abft.kernels import threshold as T

pytestmark = pytest.mark.skipif(not R.interpreting(), reason="runs under TRITON_INTERPRET=1")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _operands(dt, m=40, k=160, n=72, seed=0, layout="rows"):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g, dtype=torch.float64).to(dt)
    b = torch.randn(k, n, generator=g, dtype=torch.float64).to(dt)
    if layout == "weight":            # x W^T: B contiguous along K
        b = b.t().contiguous().t()
    elif layout == "columns":         # A contiguous along M (grad_weight's dY^T)
        a = a.t().contiguous().t()
    elif layout == "strided":         # A strided along K: the pointer path
        a = torch.randn(m, 2 * k, generator=g, dtype=torch.float64).to(dt)[:, ::2]
    return a, b


@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["rows", "weight", "columns", "strided"])
def test_a_clean_product_is_right_and_does_not_alarm(dt, layout):
    a, b = _operands(dt, layout=layout)
    assert R._tma(a, b) == (layout != "strided", layout == "columns", layout == "weight")
    c, v, ratio, sums = R.row_checked_gemm(a, b)
    exact = a.double() @ b.double()
    tol = 2 * T.UNIT[dt] * (a.double().abs() @ b.double().abs()) + 1e-30
    assert c.dtype == dt and ((c.double() - exact).abs() <= tol).all()
    assert not L.alarmed(v).any() and (v[..., L.STATUS] == L.OK).all()
    # the thresholds are not vacuous: the sums' own round-off reaches a visible share of them
    assert 0.005 < ratio.abs().max() < 1
    assert torch.equal(sums["res"].abs() / sums["thr"], ratio.abs().float()) or \
        torch.allclose(sums["res"].abs() / sums["thr"], ratio.abs(), rtol=1e-5)
    c_plain, none, _, _ = R.row_checked_gemm(a, b, check=False)
    assert none is None and torch.allclose(c_plain.double(), c.double(), rtol=0,
                                           atol=float(tol.max()))


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_the_stress_distributions_do_not_alarm(dist):
    for dt in DTYPES:
        for m, k, n in ((48, 200, 40), (33, 7, 20)):
            a, b = operands(dist, m, k, n, dt, 1)
            _, v, ratio, _ = R.row_checked_gemm(a, b)
            assert not L.alarmed(v).any(), (dist, dt, (m, k, n), float(ratio.abs().max()))
            assert (v[..., L.STATUS] != L.NONFINITE).all()


@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("fault", [dict(kind="bitflip", bit=30), dict(kind="bitflip", bit=27),
                                   dict(kind="add", value=0.05), dict(kind="zero")])
def test_a_fault_alarms_at_its_row(dt, fault):
    a, b = _operands(dt, layout="weight")
    row, col = 29, 50
    c, v, ratio, sums = R.row_checked_gemm(a, b, inject=dict(fault, row=row, col=col, k_step=2))
    assert L.alarmed(v).any()
    rec = v[row // R.VERIFY["ROWS"], 0]
    assert rec[L.ROW] == row and rec[L.ROW_FAILS] == 1 and rec[L.COL] == -1
    others = torch.ones_like(ratio, dtype=torch.bool)
    others[row] = False
    assert (ratio[others].abs() <= 1).all() and ratio[row].abs() > 1
    if fault["kind"] == "add":
        # the residual is the accumulator's corruption, within the threshold
        assert abs(float(sums["res"][row]) - fault["value"]) <= float(sums["thr"][row])


def test_the_verdict_does_not_change_when_an_operand_is_scaled_by_a_power_of_two():
    a, b = _operands(torch.bfloat16, layout="weight")
    _, v, ratio, _ = R.row_checked_gemm(a, b)
    for sa, sb in ((2.0 ** 40, 1.0), (1.0, 2.0 ** -30), (2.0 ** -20, 2.0 ** 12)):
        _, v2, ratio2, _ = R.row_checked_gemm(a * sa, b * sb)
        assert torch.equal(ratio, ratio2), (sa, sb)
        assert torch.equal(v[..., L.ROW_RATIO], v2[..., L.ROW_RATIO])


def test_non_finite_inputs_are_unverified_and_a_non_finite_output_alarms():
    a, b = _operands(torch.float32)
    a[3, 5] = float("nan")
    _, v, ratio, _ = R.row_checked_gemm(a, b)
    assert not L.alarmed(v).any() and v[0, 0, L.STATUS] == L.UNVERIFIED and ratio[3] == 0
    assert (ratio.abs() > 0).sum() > 30        # the other rows are checked
    a, b = _operands(torch.float32)
    _, v, _, _ = R.row_checked_gemm(a, b, inject=dict(kind="add", value=float("inf"), row=4,
                                                      col=9, k_step=0))
    assert v[0, 0, L.STATUS] == L.NONFINITE and L.alarmed(v).all()


def test_the_threshold_is_the_models():
    """Each row's threshold is ``threshold_q_tl`` of the shared model with the sums the partials
    add up to: recomputed here in float64 from the operands (Q, Qs, y1 exact), it agrees within
    the slack the kernel adds to them."""
    a, b = _operands(torch.float32, m=24, k=70, n=40)
    c, v, ratio, sums = R.row_checked_gemm(a, b)
    A, B, C = a.double(), b.double(), c.double()
    enc = R.encode(b)
    E = float(enc.blk[R.BLK_E])
    s = B.sum(1)
    q = (A * A) @ (B * B).sum(1)
    qs = (A * A) @ (s * s)
    y1 = (A * A).sum(1)
    acc, chk = R.accumulation(a.shape[1], a.dtype, R.INTERPRET_CONFIG["BLOCK_K"],
                              -(-b.shape[1] // R.INTERPRET_CONFIG["BLOCK_N"]))
    u = T.units(a.dtype, check=torch.float32, stored=False, flush=False)
    cf = T.coefficients(u, k=a.shape[1], bs=b.shape[1], acc=acc, chk=chk,
                        split=R._prepass.split_error(a.dtype, False))
    e_i = torch.floor(torch.log2(torch.sqrt(y1))) + 1
    sc = torch.exp2(-(E + e_i))
    s1, s2, pred = C.sum(1) * sc, (C * C).sum(1) * sc * sc, (A @ s) * sc
    qq, qqs = q * sc * sc, qs * sc * sc
    yy = y1 * torch.exp2(-2 * e_i)
    prod = cf.p_s2 * s2 + cf.p_q * qq
    check = cf.c_p2 * pred ** 2 + cf.c_qs * qqs + cf.c_s12 * s1 ** 2 + cf.c_s2 * s2 + cf.c_q * qq \
        + 2.0 ** (2 * cf.eta_log2) / 3 * yy
    thr = cf.lam * torch.sqrt(float(enc.blk[R.BLK_NU]) * prod + check) + cf.bias * pred.abs()
    thr = thr + (cf.bs * cf.k * cf.eta_acc) * torch.exp2(-(E + e_i))
    got = sums["thr"].double() * sc
    assert torch.allclose(got, thr, rtol=0.03), (got / thr).tolist()


def test_many_column_tiles_and_several_verdict_records():
    """35 CTAs share each row of tiles (TN > K's steps: some take no share) and the verify
    kernel adds 35 partials a row in chunks; 140 rows make two verdict records."""
    a, b = _operands(torch.bfloat16, m=140, k=64, n=1100, layout="weight")
    c, v, ratio, _ = R.row_checked_gemm(a, b)
    assert v.shape == (2, 1, L.NFIELDS) and not L.alarmed(v).any()
    assert (v[..., L.STATUS] == L.OK).all() and ratio.abs().max() > 0.005
    _, v, ratio, _ = R.row_checked_gemm(a, b, inject=dict(kind="add", value=0.5, row=131,
                                                          col=1000, k_step=1))
    assert not L.alarmed(v[0]).any() and v[1, 0, L.ROW] == 131 and ratio[131] > 1
