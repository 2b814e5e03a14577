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
    assert torch.allclose(sums["res"].abs() / sums["thr"], ratio.abs(), rtol=1e-5)
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
            assert (v[..., L.STATUS] == L.OK).all(), (dist, dt, (m, k, n))


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
    _, v, ratio, sums = R.row_checked_gemm(a, b)
    assert not L.alarmed(v).any() and v[0, 0, L.STATUS] == L.UNVERIFIED and ratio[3] == 0
    # the other rows are checked: finite residuals (some exactly 0: the interpreter's float32
    # sums are numpy's, whose order depends on the CPU; 10 of 40 here on 2026-12-05)
    others = torch.arange(len(ratio)) != 3
    assert torch.isnan(sums["res"][3]) and torch.isfinite(sums["res"][others]).all()
    assert (ratio[others].abs() > 0).sum() > 20
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
                        split=R._prepass.split_error(a.dtype, False, enc.shift), parts=enc.nparts)
    e_i = torch.floor(torch.log2(torch.sqrt(y1))) + 1
    sc = torch.exp2(-(E + e_i))
    s1, s2, pred = C.sum(1) * sc, (C * C).sum(1) * sc * sc, (A @ s) * sc
    qq, qqs = q * sc * sc, qs * sc * sc
    yy = y1 * torch.exp2(-2 * e_i)
    prod = cf.p_s2 * s2 + cf.p_q * qq
    check = cf.c_p2 * pred ** 2 + cf.c_qs * qqs + cf.c_s12 * s1 ** 2 + cf.c_s2 * s2 + cf.c_q * qq
    thr = cf.lam * torch.sqrt(float(enc.blk[R.BLK_NU]) * prod + check) + cf.bias * pred.abs()
    thr = thr + (cf.bs * cf.k * cf.eta_acc) * torch.exp2(-(E + e_i)) \
        + (cf.k * cf.chk_parts * cf.eta_acc) * torch.exp2(-e_i) + 2.0 ** cf.eta_log2 * torch.sqrt(cf.k * yy)
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


@pytest.mark.parametrize("sa, sb", [(-40, -100), (-45, -95), (60, 40), (40, 40), (-20, -100)])
def test_extreme_scales_never_alarm(sa, sb):
    """Products near float32's limits: checked as at scale 1, or unverified (a row whose units
    2^-(E + e_i) float32 cannot hold, or whose sum of squares overflows), never alarmed (the
    underflow allowance's 2^-(E + e_i) was clamped at 2^127: ratios of 500 at (-40, -100))."""
    g = torch.Generator().manual_seed(1)
    a = torch.randn(40, 200, generator=g, dtype=torch.float64).float() * 2.0 ** sa
    b = torch.randn(200, 40, generator=g, dtype=torch.float64).float() * 2.0 ** sb
    _, v, ratio, _ = R.row_checked_gemm(a, b)
    assert not L.alarmed(v).any() and ratio.abs().max() <= 1, float(ratio.abs().max())


def test_a_row_sum_past_float32_is_not_a_non_finite_output():
    """Every C_ij = 2^125 is finite, their row sum is not: unverified, not NONFINITE (the bound
    that told them apart held for one element, not for N of them)."""
    a = torch.full((4, 4), 2.0 ** 24)
    b = torch.full((4, 8), 2.0 ** 99)
    c, v, _, _ = R.row_checked_gemm(a, b)
    assert torch.isfinite(c).all() and not L.alarmed(v).any()
    assert v[0, 0, L.STATUS] == L.UNVERIFIED


@pytest.mark.parametrize("shape", [(4, 1, 8), (1, 7, 8), (8, 8, 1), (1, 1, 1), (5, 0, 4), (5, 4, 0),
                                   (0, 4, 5)])
def test_thin_and_empty_shapes(shape):
    """Strides TMA cannot take go through pointers; an empty product (or K = 0) is all OK."""
    m, k, n = shape
    g = torch.Generator().manual_seed(2)
    a = torch.randn(m, k, generator=g).to(torch.bfloat16)
    b = torch.randn(k, n, generator=g).to(torch.bfloat16)
    c, v, ratio, _ = R.row_checked_gemm(a, b)
    assert torch.allclose(c.float(), a.float() @ b.float(), rtol=2 ** -7, atol=1e-6)
    assert c.shape == (m, n) and ratio.shape == (m,) and not L.alarmed(v).any()


def test_a_wide_weight_is_encoded_without_comparing_every_pair_of_columns():
    """``encode`` of a 100,000-column B: its repeated-column count sorts (it compared all
    N x N pairs: 10 GB of booleans here), and agrees with the pairwise count on narrow blocks.
    (nu is also at least the number of low-entropy columns: 8 bf16 values often repeat one.)"""
    g = torch.Generator().manual_seed(3)
    b = torch.randn(8, 100_000, generator=g).to(torch.bfloat16)
    b[:, 5] = b[:, 7] = b[:, 99_999]
    enc = R.encode(b)
    low = int(R._stats.low_entropy(b.mT).sum())
    assert 3 < low < 100_000 and enc.blk[R.BLK_NU] == low
    b = torch.randn(8, 100_000, generator=g)              # float32: no value repeats by chance
    b[:, 5] = b[:, 7] = b[:, 99_999]
    assert int(R._stats.low_entropy(b.mT).sum()) == 0
    assert R.encode(b).blk[R.BLK_NU] == 3
    e = torch.randint(0, 3, (2, 600), generator=g).double()
    key = torch.randint(0, 4, (2, 600), generator=g).double()
    key[0, ::7] = float("nan")
    wide = R._stats._multiplicity(e, key, 600)[:, 0]
    assert wide.tolist() == [_most(e[0], key[0]), _most(e[1], key[1])]
    narrow = R._stats._multiplicity(e, key, 60)
    assert narrow[0].tolist() == [_most(e[0, i:i + 60], key[0, i:i + 60]) for i in range(0, 600, 60)]


def _most(e, key):
    best = 1
    for i in range(len(key)):
        if key[i] == key[i]:
            best = max(best, int(((key == key[i]) & (e == e[i])).sum()))
    return best
