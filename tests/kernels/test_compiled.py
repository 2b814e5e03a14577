"""The compiled reference check (kernels/csrc/reference.cpp) against its oracle, the torch check
(``reference.check_torch``): the same verdicts on the special cases, the stress set and scaled
data; every threshold coefficient wired (a mutated one shows); the fallback when it cannot build."""
import dataclasses
import pathlib
import platform
import sys

import pytest
import torch

from abft.kernels import compiled, reference
from abft.kernels import layout as L
from abft.kernels import threshold as T
from paths import ROOT  # noqa: E402

sys.path.insert(0, str(pathlib.Path(ROOT) / "benchmarks"))
from fixedcost import bits_equal, cases  # noqa: E402

pytestmark = pytest.mark.skipif(compiled.library() is None, reason="no compiled reference check here")

EXACT = [L.ROW_FAILS, L.ROW, L.COL_FAILS, L.COL, L.STATUS]


def _finite_equal(x, y):
    fx, fy = torch.isfinite(x), torch.isfinite(y)
    return torch.equal(fx, fy) and torch.equal(torch.nan_to_num(x[~fx], 7.0, 8.0, 9.0),
                                               torch.nan_to_num(y[~fy], 7.0, 8.0, 9.0))


def nu_differs(a, b, bm, bn, c):
    """Bool masks of the column sums (TM, N) and row sums (M, TN) whose block's ``nu`` differs
    between the two statistics: rows equal up to order whose sums of squares round alike in one
    summation order and not in the other (2-D operands; None for batched ones)."""
    if a.dim() != 2 or b.dim() != 2:
        return None
    from abft.kernels.stats import operand_stats
    m, n = c.shape
    bm, bn = max(1, min(bm, m)), max(1, min(bn, n))
    na = operand_stats(a, bm, need_s=True).nu != compiled.stats(a, bm, need_abs=False).nu
    nb = operand_stats(b.mT, bn, need_s=True).nu != compiled.stats(b.mT, bn, need_abs=False).nu
    return na.unsqueeze(-1).expand(-1, n), nb.unsqueeze(0).expand(m, -1)


def differences(got, want, f64=False, loose=None):
    """What differs between two checks' (verdict, detail, sums), beyond float64 rounding of the same
    formula: alarms, counts, locations and status exactly; thresholds to 1e-9; ratios to 1e-6
    (their residuals are differences of float64 sums, rounded in another order). Float64 products:
    ratios to 1 (that other order is the product's own rounding, which the threshold bounds).
    ``loose``: the sums whose block's ``nu`` differs (a row repeated up to order, summed in another
    order, may or may not count): their thresholds may differ by sqrt(nu), and the ratios by 1."""
    (v1, d1, s1), (v0, d0, s0) = got, want
    out = []
    if not torch.equal(v1[..., EXACT], v0[..., EXACT]):
        out.append("verdict fields")
    if not torch.equal(L.alarmed(v1), L.alarmed(v0)):
        out.append("alarms")
    tol = 1.0 if f64 else 1e-6
    if loose is not None and (loose[0].any() or loose[1].any()):
        tol = 1.0
    for name, x, y in (("row ratios", d1[0], d0[0]), ("column ratios", d1[1], d0[1]),
                       ("worst row", v1[..., L.ROW_RATIO], v0[..., L.ROW_RATIO]),
                       ("worst column", v1[..., L.COL_RATIO], v0[..., L.COL_RATIO])):
        fin = torch.isfinite(y)
        if not _finite_equal(x, y) or not ((x - y).abs()[fin] <= tol).all():
            out.append(name)
    for i, side in enumerate(("col", "row")):
        t1, t0 = s1[f"thr_{side}"], s0[f"thr_{side}"]
        fin = torch.isfinite(t0)
        rtol = torch.full_like(t0, 1e-9)
        if loose is not None:
            rtol[loose[i]] = 1.0
        if not _finite_equal(t1, t0) or not ((t1 - t0).abs() <= rtol * t0.abs())[fin].all():
            out.append(f"thr_{side}")
        if loose is not None and loose[i].any():
            continue                         # their ratios too
        r1, r0 = s1[f"res_{side}"], s0[f"res_{side}"]
        fin = torch.isfinite(r0) & torch.isfinite(t0)
        if not _finite_equal(r1, r0) or not ((r1 - r0).abs()[fin] <= tol * t0[fin].abs()).all():
            out.append(f"res_{side}")
    return out


def both(a, b, c, **kw):
    kw = dict(kw, units=kw.get("units") or reference.units_for(c), return_sums=True)
    assert compiled.usable(a, b, c, kw.get("addend"))
    return reference.check(a, b, c, **kw), reference.check_torch(a, b, c, **kw), \
        nu_differs(a, b, kw["bm"], kw["bn"], c)


def test_the_special_cases_give_the_oracles_verdicts():
    """4 dtypes, odd tiles, column-major and batched B, inf/NaN outputs and inputs, addends with
    alpha/beta, overflowing sums, several blocks, K = 1 (K = 0 runs on the torch check)."""
    n = 0
    for a, b, c, kw in cases():
        if a.shape[-1] == 0:
            assert not compiled.usable(a, b, c, None)
            continue
        got, want, loose = both(a, b, c, **kw)
        assert differences(got, want, c.dtype == torch.float64, loose) == [], (n, a.dtype, tuple(a.shape), kw.keys())
        n += 1
    assert n >= 200


@pytest.mark.parametrize("seed", [0, 1])
def test_the_stress_set_gives_the_oracles_verdicts(seed):
    from abft.bench.stress import cases as stress_cases, operands
    n = 0
    for dist, m, k, nn, dt in stress_cases(quick=True):
        a, b = operands(dist, m, k, nn, dt, seed)
        got, want, loose = both(a, b, a @ b, bm=64, bn=64, units=T.units(dt))
        assert differences(got, want, dt == torch.float64, loose) == [], (dist, m, k, nn, dt)
        assert not L.alarmed(got[0]).any()
        n += 1
    assert n >= 20


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shift", [-120, -20, 0, 20, 100])
def test_scaled_and_strided_operands_give_the_oracles_verdicts(dtype, shift):
    """Data near the ends of each dtype's range (the underflow and flush terms at work), operands in
    every layout, an alarmed element, batched A against 2-D B and broadcast batches."""
    g = torch.Generator().manual_seed(3)
    lim = {torch.float16: 12, torch.bfloat16: 100, torch.float32: 100, torch.float64: 1000}[dtype]
    s = max(-lim, min(lim, shift))
    a = (torch.randn(37, 50, generator=g) * 2.0 ** s).to(dtype)
    b = (torch.randn(50, 29, generator=g) * 2.0 ** -s).to(dtype) if shift >= 0 else \
        (torch.randn(50, 29, generator=g)).to(dtype)
    c = a @ b
    c[5, 7] = c[5, 7] * 3 + 1
    for aa, bb in ((a, b), (a.t().contiguous().t(), b), (a, b.t().contiguous().t())):
        got, want, loose = both(aa, bb, c, bm=16, bn=8)
        assert differences(got, want, dtype == torch.float64, loose) == []
        assert L.alarmed(got[0])[0, 0]
    a3 = (torch.randn(2, 3, 20, 50, generator=g) * 2.0 ** s).to(dtype)
    b3 = torch.randn(3, 50, 29, generator=g).to(dtype)
    got, want, _ = both(a3, b3, a3 @ b3, bm=8, bn=16)
    assert differences(got, want, dtype == torch.float64) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("k", [40, 300])
def test_a_column_major_a_against_one_block_of_columns_gives_the_oracles_verdicts(dtype, k):
    """A column-major A (a linear's grad_weight: dY^T) whose row predictions meet one block of B's
    columns (N <= bn): the statistics add each row's prediction in their own pass. Signed data, a
    corrupted element, 2-D and batched, K below and above the small-K cap."""
    g = torch.Generator().manual_seed(5)
    a = torch.randn(k, 70, generator=g).to(dtype).t()               # (70, k), column-major
    b = torch.randn(k, 24, generator=g).to(dtype)
    c = a @ b
    c[9, 3] = c[9, 3] * 3 + 1
    got, want, loose = both(a, b, c, bm=32, bn=32)
    assert differences(got, want, dtype == torch.float64, loose) == []
    assert L.alarmed(got[0]).sum() == 1 and L.alarmed(got[0])[0, 0]
    a3 = torch.randn(3, k, 40, generator=g).to(dtype).mT            # (3, 40, k), each column-major
    b3 = torch.randn(3, k, 16, generator=g).to(dtype)
    got, want, _ = both(a3, b3, a3 @ b3, bm=16, bn=16)
    assert differences(got, want, dtype == torch.float64) == []
    assert not L.alarmed(got[0]).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_low_entropy_rows_are_the_oracles(dtype):
    """Each row's low-entropy flag (``stats.low_entropy`` at its sampled places) against torch's,
    for rows whose samples repeat 0 to 16 times, hold +0 beside -0 (equal values, other bits: three
    samples {+0, -0, x} are low), or NaNs with one bit pattern (equal bits, unequal values): the
    compiled check tells "no two samples equal" apart without counting, and must not be fooled by
    either. Rows of K = 1 to 200, contiguous and strided."""
    from abft.kernels.stats import _places, operand_stats
    g = torch.Generator().manual_seed(11)
    nan = torch.tensor(float("nan"))
    for k in (1, 2, 3, 4, 5, 8, 15, 16, 17, 64, 200):
        rows = []
        for distinct in (1, 2, 3, 4, 5, 8, 16, 1000):
            pool = torch.randn(distinct, generator=g)
            rows.append(pool[torch.randint(0, distinct, (k,), generator=g)])
        rows.append(torch.randn(k, generator=g))
        signed = torch.randn(k, generator=g)
        signed[::3], signed[1::3] = 0.0, -0.0
        rows.append(signed)
        rows.append(torch.tensor([0.0, -0.0, 1.5] * k)[:k])
        rows.append(torch.tensor([-0.0, 0.0, 2.5, 3.5] * k)[:k])
        nans = torch.randn(k, generator=g)
        nans[::2] = nan
        rows.append(nans)
        # one value at 4 (low) or 3 (not) sampled places 4 or 8 apart, the rest distinct: what the
        # screen of the halves (AVX2: lanes 0-7 and 8-15, each against its rotations) must see
        places = _places(k, min(k, 16), "cpu")
        for at in ((0, 4, 8, 12), (0, 8, 15)):
            spread = torch.randn(k, generator=g)
            spread[places[[i for i in at if i < len(places)]]] = 2.5
            rows.append(spread)
        if dtype == torch.float64:      # distinct doubles, one float: screened as floats, counted exactly
            rows.append(1.0 + torch.arange(k, dtype=torch.float64) * 2.0 ** -40)
        x = torch.stack([r.to(dtype) for r in rows])
        for op in (x, x.mT.contiguous().mT):
            want = operand_stats(op, 4, need_s=True).low
            got = compiled.stats(op, 4, need_abs=False).low
            assert torch.equal(got, want), (k, op.stride(), got.tolist(), want.tolist())


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="FE_DOWNWARD's value is x86's")
def test_low_entropy_rows_are_the_oracles_when_rounding_downward():
    """A row sampled at three places as {+0, -0, x} is low-entropy (+0 == -0). Made +0 by adding
    0, -0 stays -0 under round-downward and the two zeros looked distinct to the compiled check's
    fast path (found by a review; the check was then stricter than the oracle)."""
    import ctypes
    from abft.kernels.stats import operand_stats
    libm = ctypes.CDLL("libm.so.6")
    x = torch.tensor([[0.0, -0.0, 1.5], [-0.0, 2.0, 0.0], [1.0, 2.0, 3.0]])
    want = operand_stats(x, 4, need_s=True).low
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                # the rounding mode is the calling thread's
    mode = libm.fegetround()
    try:
        assert libm.fesetround(0x400) == 0  # FE_DOWNWARD
        got = compiled.stats(x, 4, need_abs=False).low
    finally:
        libm.fesetround(mode)
        torch.set_num_threads(threads)
    assert want.tolist() == [True, True, False] and torch.equal(got, want), got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_batch_checked_matrix_by_matrix_gives_one_threads_bits(dtype):
    """On two threads a batch of small matrices, each with its own B, is checked one matrix per
    thread (``by_matrix`` in reference.cpp), not stage by stage across the batch as on one
    thread: every output bit for bit the same (verdicts, ratios, residuals and thresholds in C's
    units, the summary), with several tiles a matrix, an addend, non-finite and corrupted outputs
    in different matrices, and A broadcast against the batch; the oracle's verdicts too."""
    g = torch.Generator().manual_seed(12)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)
    a, b = r(8, 40, 24), r(8, 24, 36)
    c = a @ b
    c[1, 3, 5] = float("inf")
    c[6, 39, 35] += 50
    d = r(8, 40, 36)
    a1 = r(40, 24)
    work = [(a, b, c, {}), (a, b.mT.contiguous().mT, a @ b, {}), (a1, b, a1 @ b, {}),
            (a, b, torch.baddbmm(d, a, b, alpha=0.5), dict(alpha=0.5, addend=d))]
    threads, alarms = torch.get_num_threads(), []
    try:
        for x, y, z, kw in work:
            kw = dict(kw, bm=16, bn=16, units=reference.units_for(z), return_sums=True)
            out = []
            for n in (1, 2):
                torch.set_num_threads(n)
                out.append(reference.check(x, y, z, summary=True, **kw))
            (v1, d1, s1, m1), (v2, d2, s2, m2) = out
            assert bits_equal(v1, v2) and all(bits_equal(p, q) for p, q in zip(d1, d2)), tuple(x.shape)
            assert all(bits_equal(s1[k], s2[k]) for k in s1) and m1 == m2
            want = reference.check_torch(x.expand(*y.shape[:-2], *x.shape[-2:]), y, z, **kw)
            assert differences((v2, d2, s2), want, dtype == torch.float64) == []
            alarms.append(int(L.alarmed(v2).sum()))
    finally:
        torch.set_num_threads(threads)
    assert alarms == [2, 0, 0, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_a_weights_two_sides_in_one_call_are_each_sides_own(dtype):
    """``stats_pair`` (a linear's weight for its forward and for its grad_input, both sides' blocks
    on the threads together) gives each side's statistics bit for bit as ``stats`` does alone:
    one block a side and several, K below and above the small-K cap, low-entropy rows."""
    import dataclasses
    g = torch.Generator().manual_seed(13)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for out, inp, bn, bn_t in ((48, 40, 16, 8), (40, 300, 16, 64), (70, 33, 32, 32), (8, 64, 8, 64)):
            w = torch.randn(out, inp, generator=g).to(dtype)
            w[3] = 1.0                                     # a constant row, a low-entropy one
            got = compiled.stats_pair(w, bn, inp <= T.SMALL_K, w.mT, bn_t, out <= T.SMALL_K)
            want = (compiled.stats(w, bn, need_abs=inp <= T.SMALL_K),
                    compiled.stats(w.mT, bn_t, need_abs=out <= T.SMALL_K))
            for x, y in zip(got, want):
                for f in dataclasses.fields(x):
                    u, v = getattr(x, f.name), getattr(y, f.name)
                    assert (bits_equal(u.double(), v.double()) if isinstance(u, torch.Tensor) else u == v), \
                        (out, inp, f.name)
            assert want[0].low[3] and got[0].low[3]
    finally:
        torch.set_num_threads(threads)


def test_kept_weight_statistics_give_the_oracles_verdicts():
    """b_stats from ``weight_stats`` (compiled) and from the torch statistics serve either check."""
    from abft.kernels.stats import operand_stats
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(70, 96, generator=g), torch.randn(40, 96, generator=g)
    c = x @ w.t()
    c[3, 4] += 1.0
    kept_c = reference.weight_stats(w.t(), 16)
    kept_t = operand_stats(w, 16, need_s=True, need_abs=False)
    kw = dict(bm=32, bn=16, units=reference.units_for(c), return_sums=True)
    want = reference.check_torch(x, w.t(), c, **kw)
    for kept in (kept_c, kept_t):
        got = reference.check(x, w.t(), c, b_stats=kept, **kw)
        assert differences(got, want) == []
    assert L.alarmed(want[0]).sum() == 1


def _sensitive_cases():
    """Cases in which every term of the threshold matters somewhere: small K (the worst-case cap),
    half types (output rounding, flushed inputs on the CPU), data near underflow, addends with
    beta != 1, low-entropy rows."""
    g = torch.Generator().manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=g)
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        # (K = 2: where the worst case is below the statistical threshold, with an addend too)
        for k, s in ((2, 0), (8, 0), (200, 0), (8, -60 if dt != torch.float16 else -6),
                     (200, -60 if dt != torch.float16 else -6)):
            a, b = (r(40, k) * 2.0 ** s).to(dt), (r(k, 24) * 2.0 ** s).to(dt)
            yield a, b, a @ b, dict(bm=16, bn=8)
            d = r(24).to(dt)
            yield a, b, torch.addmm(d, a, b, alpha=0.5, beta=2.0), dict(bm=16, bn=8, alpha=0.5, addend=d, beta=2.0)
        a = torch.ones(40, 100).to(dt)
        b = torch.randint(-2, 3, (100, 24), generator=g).to(dt)
        yield a, b, a @ b, dict(bm=16, bn=8)
        # rows near the smallest normal: the predicted dot product's underflow (chk_parts)
        if dt != torch.float16:
            a = (r(40, 200) * 2.0 ** (-1000 if dt == torch.float64 else -120)).to(dt)
            b = r(200, 24).to(dt)
            yield a, b, a @ b, dict(bm=16, bn=8)


@pytest.mark.parametrize("field", compiled.COEF_NAMES.split(","))
def test_a_changed_threshold_term_changes_the_verdicts(field, monkeypatch):
    """Mutation test: the compiled threshold reads every coefficient. Both checks get the split
    error term and the predicted product's underflow switched on (eta 2^-50 and three parts: the
    fused kernel's, off in the reference), so that they are compared too; then each coefficient changed in turn in the compiled check only (x 1.5; 0 set
    to 0.5; ``cap`` flipped) makes some sum's threshold differ from the oracle's."""
    i = compiled.COEF_NAMES.split(",").index(field)
    coefficients = T.coefficients
    monkeypatch.setattr(T, "coefficients", lambda *a, **kw: dataclasses.replace(coefficients(*a, **kw), eta_log2=-50.0, chk_parts=3.0))
    monkeypatch.setattr(compiled, "_plans", {})
    packed = compiled._packed

    def mutated(*args):
        p = packed(*args).clone()
        v = p[..., i]                   # both sides' coefficient
        p[..., i] = torch.where(v == 0, 0.5, v * 1.5) if field != "cap" else 1.0 - v
        return p

    monkeypatch.setattr(compiled, "_packed", mutated)
    seen = False
    for a, b, c, kw in _sensitive_cases():
        got, want, loose = both(a, b, c, **kw)
        if any(d.startswith("thr") for d in differences(got, want, loose=loose)):
            seen = True
            break
    assert seen, f"changing {field} changed no threshold"


def test_the_sensitive_cases_agree_with_every_term_on(monkeypatch):
    """The cases the mutation test uses, with the split error and the predicted product's
    underflow on in both checks: no difference
    before any mutation (else a mutation's difference would prove nothing)."""
    coefficients = T.coefficients
    monkeypatch.setattr(T, "coefficients", lambda *a, **kw: dataclasses.replace(coefficients(*a, **kw), eta_log2=-50.0, chk_parts=3.0))
    monkeypatch.setattr(compiled, "_plans", {})
    for a, b, c, kw in _sensitive_cases():
        got, want, loose = both(a, b, c, **kw)
        assert differences(got, want, c.dtype == torch.float64, loose) == [], (a.dtype, tuple(a.shape))


def test_the_compiled_check_issues_few_torch_ops():
    """Its fixed cost: the three outputs' allocations only (the torch check issues 469), four
    more with the sums; the summary comes from the call."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    a, b = torch.randn(64, 64), torch.randn(64, 64)
    c = a @ b
    kw = dict(bm=64, bn=64, units=T.units(torch.float32))
    reference.check(a, b, c, **kw)
    with Count():
        reference.check(a, b, c, summary=True, **kw)
    assert Count.n == 3, Count.n
    with Count():
        reference.check(a, b, c, return_sums=True, **kw)
    assert Count.n == 3 + 7, Count.n


def test_without_a_compiler_the_torch_check_runs_with_one_warning(monkeypatch, tmp_path):
    monkeypatch.setattr(compiled, "_lib", None)
    monkeypatch.setattr(compiled, "_tried", False)
    monkeypatch.setenv("ABFT_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    a, b = torch.randn(20, 30), torch.randn(30, 10)
    with pytest.warns(RuntimeWarning, match="the torch check runs instead"):
        assert not compiled.usable(a, b, a @ b, None)
    v, _ = reference.check(a, b, a @ b, bm=8, bn=8, units=T.units(torch.float32))
    assert not L.alarmed(v).any()
    assert compiled.library() is None            # tried once: no second warning, no second build


def test_ABFT_COMPILED_0_runs_the_torch_check(monkeypatch):
    monkeypatch.setenv("ABFT_COMPILED", "0")
    a, b = torch.randn(20, 30), torch.randn(30, 10)
    assert not compiled.usable(a, b, a @ b, None)


def test_a_fresh_cache_builds_once_with_a_progress_line(monkeypatch, tmp_path, capfd):
    monkeypatch.setattr(compiled, "_lib", None)
    monkeypatch.setattr(compiled, "_tried", False)
    monkeypatch.setenv("ABFT_CACHE", str(tmp_path))
    assert compiled.library() is not None
    assert "compiling the reference check" in capfd.readouterr().err
    assert len(list(tmp_path.glob("reference-*.so"))) == 1 and not list(tmp_path.glob("*.so.tmp*"))


@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3"])
def test_the_library_builds_for_cpus_without_avx512_or_avx(march, monkeypatch, tmp_path):
    """-march=native on a user's older x86 CPU: the source builds without AVX-512 (x86-64-v3: AVX2)
    and without AVX (x86-64: SSE2 only), and the build checks a product clean and a fault caught
    (loading a build for a lesser x86 target runs on this one)."""
    import platform
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 targets")
    monkeypatch.setenv("ABFT_CACHE", str(tmp_path))
    monkeypatch.setenv("ABFT_CXXFLAGS", f"-march={march} -O1")
    lib = compiled._build()
    monkeypatch.setattr(compiled, "_lib", lib)
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        a, b = torch.randn(70, 90, generator=g).to(dtype), torch.randn(90, 130, generator=g).to(dtype)
        c = a @ b
        kw = dict(bm=32, bn=64, units=reference.units_for(c))
        assert not L.alarmed(reference.check(a, b, c, **kw)[0]).any(), dtype
        c[40, 100] += 4 * c.abs().max()
        hit = L.alarmed(reference.check(a, b, c, **kw)[0])
        assert hit[1, 1] and hit.sum() == 1, dtype


def test_the_coefficient_order_is_the_dataclass_fields():
    """The packed order is compiled.py's list, checked against the library at load; every field of
    ``threshold.Coefficients`` is in it."""
    names = set(compiled.COEF_NAMES.split(","))
    assert names == {f.name for f in dataclasses.fields(T.Coefficients)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_b_with_padded_rows_gives_the_oracles_verdicts(dtype):
    """B a view of a wider matrix's columns (``w[:, :n]``: rows contiguous, further apart than its
    width): the column predictions read B's row k at k N instead of k * stride, and 102 of 600
    layouts of A, B, C and an addend differed from the oracle, every one of them with B so, in
    every dtype (alarms on clean products)."""
    g = torch.Generator().manual_seed(10)
    for m, k, n, pad in ((70, 48, 40, 5), (96, 300, 520, 8), (64, 20, 8, 24)):
        a = torch.randn(m, k, generator=g).to(dtype)
        b = torch.randn(k, n + pad, generator=g).to(dtype)[:, :n]
        assert b.stride() == (n + pad, 1)
        d = torch.randn(n, generator=g).to(dtype)
        for c, kw in ((a @ b, dict()), (torch.addmm(d, a, b, alpha=0.5, beta=2.0), dict(addend=d, alpha=0.5, beta=2.0))):
            got, want, loose = both(a, b, c, bm=32, bn=16, **kw)
            assert differences(got, want, dtype == torch.float64, loose) == [], (m, k, n)
            assert not L.alarmed(got[0]).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_b_with_rows_4kb_apart_from_memory_gives_the_oracles_verdicts(dtype):
    """A B of 8 MB or more whose rows are a multiple of 4 KB apart, against four or more blocks of
    A's rows: the column predictions copy each chunk of B's rows to rows a line further apart
    first (``thin_t``); the same sums as the oracle's, a corrupted element found."""
    g = torch.Generator().manual_seed(9)
    k, n = {torch.float32: (2048, 1024), torch.bfloat16: (2048, 2048), torch.float64: (1024, 1024)}[dtype]
    a = torch.randn(160, k, generator=g).to(dtype)
    b = torch.randn(k, n, generator=g).to(dtype)
    assert k * n * b.element_size() >= 8 << 20 and n * b.element_size() % 4096 == 0
    c = a @ b
    got, want, loose = both(a, b, c, bm=32, bn=256)
    assert differences(got, want, dtype == torch.float64, loose) == []
    c[77, 600] += 1000.0
    got, want, loose = both(a, b, c, bm=32, bn=256)
    assert differences(got, want, dtype == torch.float64, loose) == []
    assert L.alarmed(got[0]).sum() == 1


def _stats_fields(s):
    return {f.name: getattr(s, f.name) for f in dataclasses.fields(s) if isinstance(getattr(s, f.name), torch.Tensor)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [1100, 40])
def test_an_operand_from_memory_has_each_blocks_statistics_as_alone(dtype, k):
    """Operands of 8 MB or more (PF_BYTES) are read otherwise: a column-block operand's blocks
    COLS_G at a time, COLS_K rows a turn; a row-block operand's rows with prefetches ahead. Each
    block's statistics are the bits that block has alone (a slice under 8 MB: the plain path):
    a block count and a K that are not multiples of those, a short last block, infinities, and
    K within the small-K cap (the |x| sums)."""
    g = torch.Generator().manual_seed(17)
    n = -(-(9 << 20) // (k * torch.tensor([], dtype=dtype).element_size()))
    n = n // 256 * 256 + 152                           # a short last block
    x = torch.randn(k, n, generator=g).to(dtype)      # B (k, n): its columns, a block at a time
    x[k // 3, 700] = float("inf")
    x[k - 1, n - 1] = float("-inf")
    need_abs = k <= T.SMALL_K
    for rows in (x.mT, x.mT.contiguous()):             # columns strided (COLS), then rows (ROWS)
        assert rows.numel() * rows.element_size() >= 8 << 20 and (n // 256 + 1) % 4 != 0
        whole = _stats_fields(compiled.stats(rows, 256, need_abs=need_abs))
        for j0 in list(range(0, n, 256))[:6] + [n // 256 * 256]:
            part = rows[j0:j0 + 256]
            assert part.numel() * part.element_size() < 8 << 20
            alone = _stats_fields(compiled.stats(part, 256, need_abs=need_abs))
            t = j0 // 256
            for name, v in alone.items():
                w = whole[name][j0:j0 + 256] if v.shape[0] == part.shape[0] and name not in ("s", "absum") \
                    else whole[name][t:t + 1]
                assert _finite_equal(w, v), (name, j0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_of_operands_from_memory_give_the_oracles_verdicts(dtype):
    """A and B of 8 MB or more (the statistics' prefetched and grouped reads) with a block count
    that is not a multiple of COLS_G: the oracle's verdicts, clean and with a corrupted element."""
    g = torch.Generator().manual_seed(23)
    m, k, n = (2000, 1100, 2200) if dtype == torch.float32 else (3900, 1100, 4400)
    a = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(k, n, generator=g).to(dtype)
    assert a.numel() * a.element_size() >= 8 << 20 and b.numel() * b.element_size() >= 8 << 20
    c = a @ b
    got, want, loose = both(a, b, c, bm=256, bn=256)
    assert differences(got, want, False, loose) == []
    assert not L.alarmed(got[0]).any()
    c[1234, 2100] += 50.0
    got, want, loose = both(a, b, c, bm=256, bn=256)
    assert differences(got, want, False, loose) == []
    assert L.alarmed(got[0]).sum() == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_column_major_outputs_and_full_addends_give_the_oracles_verdicts(dtype):
    """C stored column-major (a transposed product's canonical view), a full (M, N) addend, a
    broadcast batched addend (baddbmm's), alpha and beta: the layouts the special cases lack."""
    g = torch.Generator().manual_seed(6)
    a, b = torch.randn(45, 70, generator=g).to(dtype), torch.randn(70, 33, generator=g).to(dtype)
    c = (b.t() @ a.t()).t()                       # strides (1, 45)
    assert c.stride(0) == 1
    got, want, loose = both(a, b, c, bm=16, bn=8)
    assert differences(got, want, dtype == torch.float64, loose) == []
    d = torch.randn(45, 33, generator=g).to(dtype)
    cd = torch.addmm(d, a, b, alpha=2.0, beta=0.5)
    cd[44, 32] += 8.0
    got, want, loose = both(a, b, cd, bm=16, bn=8, alpha=2.0, addend=d, beta=0.5)
    assert differences(got, want, dtype == torch.float64, loose) == []
    assert L.alarmed(got[0])[2, 4]
    a3, b3 = torch.randn(3, 20, 70, generator=g).to(dtype), torch.randn(3, 70, 33, generator=g).to(dtype)
    d3 = torch.randn(3, 1, 33, generator=g).to(dtype)
    c3 = torch.baddbmm(d3, a3, b3, alpha=0.5)
    got, want, _ = both(a3, b3, c3, bm=8, bn=16, alpha=0.5, addend=d3)
    assert differences(got, want, dtype == torch.float64) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_a_bias_gives_the_oracles_verdicts(dtype):
    """A bias (an addend repeated down the rows, summed once per tile by the compiled check):
    clean, with a fault in C (located), with a NaN in one of its columns (summed element by
    element), and repeated down a batch."""
    g = torch.Generator().manual_seed(8)
    a, b = torch.randn(50, 40, generator=g).to(dtype), torch.randn(40, 36, generator=g).to(dtype)
    d = torch.randn(36, generator=g).to(dtype)
    c = torch.addmm(d, a, b)
    got, want, loose = both(a, b, c, bm=16, bn=8, addend=d)
    assert differences(got, want, dtype == torch.float64, loose) == []
    assert not L.alarmed(got[0]).any()
    c[37, 21] += 64.0
    got, want, loose = both(a, b, c, bm=16, bn=8, addend=d)
    assert differences(got, want, dtype == torch.float64, loose) == []
    assert L.alarmed(got[0]).nonzero().tolist() == [[2, 2]]
    dn = d.clone()
    dn[5] = float("nan")
    cn = torch.addmm(dn, a, b, beta=2.0)
    got, want, loose = both(a, b, cn, bm=16, bn=8, addend=dn, beta=2.0)
    assert differences(got, want, dtype == torch.float64, loose) == []
    a3 = torch.randn(2, 50, 40, generator=g).to(dtype)
    c3 = torch.matmul(a3, b) + d
    got, want, _ = both(a3, b, c3, bm=16, bn=8, addend=d)
    assert differences(got, want, dtype == torch.float64) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("k", [37, 150])
def test_eight_or_more_blocks_a_side_give_the_oracles_verdicts(dtype, k):
    """The register-tiled thin products (reference.cpp's rows_times, thin_tile): A's row
    predictions against 9 and 11 column blocks of B, and the column predictions of a column-major
    B (a linear's weight) with 9 row blocks; K within one chunk and across three (a partial one),
    K <= SMALL_K (the worst-case products of |A| and |B|) and beyond; clean, a located fault, a
    batch with B broadcast."""
    g = torch.Generator().manual_seed(11)
    for m, n, bm, bn in ((45, 70, 16, 8), (71, 43, 8, 4)):
        a = torch.randn(m, k, generator=g).to(dtype)
        for b in (torch.randn(k, n, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype).t()):
            c = a @ b
            got, want, loose = both(a, b, c, bm=bm, bn=bn)
            assert differences(got, want, dtype == torch.float64, loose) == [], (m, n, b.stride())
            assert not L.alarmed(got[0]).any()
            c[m - 3, n - 2] += 64.0
            got, want, loose = both(a, b, c, bm=bm, bn=bn)
            assert differences(got, want, dtype == torch.float64, loose) == []
            assert L.alarmed(got[0]).nonzero().tolist() == [[(m - 3) // bm, (n - 2) // bn]]
    a3 = torch.randn(3, 45, k, generator=g).to(dtype)
    b = torch.randn(70, k, generator=g).to(dtype).t()
    got, want, loose = both(a3, b, a3 @ b, bm=16, bn=8)
    assert differences(got, want, dtype == torch.float64, loose) == []


def test_the_summary_counted_in_the_call_is_the_verdicts():
    """The compiled check's summary (tiles alarmed, unverified, all, the worst ratio) is
    ``layout.summary`` of its own verdict, on every special case (alarms, NONFINITE and unverified
    tiles, batches of more than 16 tiles); without the sums its verdict and detail are the same."""
    n = alarmed = unverified = 0
    for a, b, c, kw in cases():
        if not compiled.usable(a, b, c, kw.get("addend")):
            continue
        kw = dict(kw, units=reference.units_for(c))
        v, d, s = reference.check(a, b, c, summary=True, **kw)
        assert s == L.summary(v), (n, a.dtype, tuple(a.shape))
        v2, d2, _, s2 = reference.check(a, b, c, summary=True, return_sums=True, **kw)
        assert bits_equal(v, v2) and all(bits_equal(x, y) for x, y in zip(d, d2)) and s == s2
        alarmed += s[0] > 0
        unverified += s[1] > 0
        n += 1
    assert n >= 200 and alarmed >= 20 and unverified >= 20
    # one tile whose column sums alone fail (a row's two errors cancel), one whose row sums alone do
    a, b = torch.randn(8, 70, 40), torch.randn(8, 40, 90)
    c = a @ b
    c[5, 3, 7] += 1.0
    c[5, 3, 9] -= 1.0
    c[6, 40, 70] += 1.0
    c[6, 42, 70] -= 1.0
    v, _, s = reference.check(a, b, c, bm=32, bn=32, units=reference.units_for(c), summary=True)
    rows, cols = v[..., L.ROW_RATIO] > 1, v[..., L.COL_RATIO] > 1
    assert cols[5, 0, 0] and not rows[5, 0, 0] and rows[6, 1, 2] and not cols[6, 1, 2]
    assert s == L.summary(v) and s[:3] == (2.0, 0.0, 72.0) and s[3] > 1


def test_buffers_kept_between_calls_carry_nothing_over():
    """A small product's check reuses its thread's buffers: after larger checks with non-finite
    values, faults and kept statistics on this thread, a check gives bit for bit what it gives
    on a fresh thread."""
    import threading

    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(3, 40, 24, generator=g), torch.randn(3, 24, 56, generator=g)
    c = a @ b
    c[1, 5, 7] += 0.5
    kw = dict(bm=16, bn=32, units=reference.units_for(c), summary=True)
    both = lambda: (reference.check(a, b, c, return_sums=True, **kw), reference.check(a, b, c, **kw))
    fresh = []
    t = threading.Thread(target=lambda: fresh.append(both()))
    t.start()
    t.join()
    for x, y, z, kw2 in cases():                 # larger, non-finite, kept-statistics checks first
        if compiled.usable(x, y, z, kw2.get("addend")):
            reference.check(x, y, z, **dict(kw2, units=reference.units_for(z)))
    big = torch.randn(4, 300, 200, generator=g)
    reference.check(big, big.mT, big @ big.mT, bm=64, bn=64, units=reference.units_for(big))
    (v0, d0, s0, m0), (w0, e0, n0) = fresh[0]
    (v1, d1, s1, m1), (w1, e1, n1) = both()
    for x, y in ((v0, v1), (w0, w1), (v0, w1), *zip(d0, d1), *zip(e0, e1), *zip(s0.values(), s1.values())):
        assert bits_equal(x, y)
    assert m0 == m1 == n0 == n1 and m0[0] == 1.0


def test_a_copy_of_kept_statistics_reads_its_own_tensors():
    """Kept statistics (a weight's) copied, then the original changed in place: a check with the
    copy reads the copy's values, not the original's memory (a pointer kept on the statistics
    would survive the copy)."""
    import copy
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(48, 40, generator=g), torch.randn(30, 40, generator=g)
    c = x @ w.t()
    u = reference.units_for(c)
    kw = dict(bm=16, bn=16, units=u, return_sums=True)
    st = reference.weight_stats(w.t(), 16)
    want = reference.check(x, w.t(), c, b_stats=st, **kw)
    kept = copy.deepcopy(st)
    for t in (st.r1, st.rinf, st.x1, st.xinf, st.xs1, st.xsinf, st.s):
        t.mul_(4.0)
    got = reference.check(x, w.t(), c, b_stats=kept, **kw)
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(got[2][k], want[2][k]) for k in want[2])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_an_output_in_either_layout_gives_the_same_bits(dtype):
    """The pass over C takes four clean rows at a time straight from a row-major C and a
    column-major one row by row through a float64 copy: the same sums, bit for bit, in every dtype,
    with rows left over, tiles narrower than the sums' lanes, a non-finite row, values below a
    half type's normal range and an alarm."""
    g = torch.Generator().manual_seed(4)
    for m, k, n in ((64, 129, 72), (45, 70, 150), (130, 33, 260)):
        a = torch.randn(m, k, generator=g, dtype=torch.float64)
        b = torch.randn(k, n, generator=g, dtype=torch.float64)
        if dtype == torch.float64:
            a = a * 2.0 ** torch.randint(-40, 40, (m, 1), generator=g).double()
        a, b = a.to(dtype), b.to(dtype)
        c = a @ b
        c[m // 3, n // 2] += 4.0
        c[m // 2, n // 5] = float("nan")
        c[m - 1, :5] = 0.0
        kw = dict(bm=32, bn=64, units=reference.units_for(c), return_sums=True)
        got = reference.check(a, b, c.mT.contiguous().mT, **kw)
        want = reference.check(a, b, c, **kw)
        assert bits_equal(got[0], want[0]) and all(bits_equal(x, y) for x, y in zip(got[1], want[1]))
        assert all(bits_equal(got[2][q], want[2][q]) for q in want[2]), (m, k, n)


def test_float64_operands_out_of_the_unscaled_range_give_the_same_bits_as_in_it():
    """Float64 blocks are summed unscaled where their rows' exponents lie within +-400, and from
    copies scaled first where not (stats_block): both in the same loops, so A 2^j against B 2^-j
    gives the bits of A against B on each side of the limit (where no value, product or sum falls
    below the normal range: there they may differ below 2^-1022), in each operand layout (rows
    contiguous, strided, K strided), with a non-finite row (scaled first at any exponent)."""
    g = torch.Generator().manual_seed(8)
    m, k, n = 70, 90, 80
    a0 = torch.randn(m, 2 * k, generator=g, dtype=torch.float64)
    a0[5, 14] = float("nan")
    b0 = torch.randn(k, n, generator=g, dtype=torch.float64)
    forms = {"rows": lambda x: x[:, :k].contiguous(), "columns": lambda x: x[:, :k].mT.contiguous().mT,
             "strided": lambda x: x[:, ::2]}
    kw = dict(bm=32, bn=32, return_sums=True)
    n_cases = 0
    for a_form in forms:
        for b_form in ("rows", "columns"):
            for nan in (False, True):
                def operands(j):
                    a = forms[a_form]((a0 if nan else torch.where(a0.isnan(), 1.0, a0)) * 2.0 ** j)
                    b = (b0 if b_form == "rows" else b0.mT.contiguous().mT) * 2.0 ** -j
                    assert a.stride() == forms[a_form](a0).stride()
                    return a, b
                a, b = operands(0)
                c = a @ b
                c[m // 3, n // 2] += 1e-3
                kw["units"] = reference.units_for(c)
                want = reference.check(a, b, c, **kw)
                for j in (398, 402, -402, 650, -650):
                    got = reference.check(*operands(j), c, **kw)
                    assert bits_equal(got[0], want[0]), (a_form, b_form, nan, j)
                    assert all(bits_equal(x, y) for x, y in zip(got[1], want[1])), (a_form, b_form, nan, j)
                    assert all(bits_equal(got[2][q], want[2][q]) for q in want[2]), (a_form, b_form, nan, j, q)
                    n_cases += 1
    assert n_cases == 60


@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_float64_products_that_underflow_do_not_alarm(layout):
    """A float64 product whose terms fall below the normal range (A near 2^-1000 against B's
    columns of 2^-80 to 2^60) is rounded by up to the smallest subnormal a term: the underflow
    allowance covers it in units of 2^(e_A + e_B) below 2^-1023 (the scale 2^-(e_A + e_B), past
    2^1023, applied in two factors in both checks), and neither check alarms nor leaves a sum
    unverified. Before: float64's allowance was 0 (2^-1075 is no double), the torch check alarmed
    (ratios up to 1e10) and the compiled one overflowed its scale (unverified, or NONFINITE)."""
    g = torch.Generator().manual_seed(3)
    for trial in range(40):
        m, k, n = (int(x) for x in torch.randint(1, 40, (3,), generator=g))
        a = torch.randn(m, k, generator=g, dtype=torch.float64) * 2.0 ** -1000
        b = torch.randn(k, n, generator=g, dtype=torch.float64) \
            * torch.exp2(torch.randint(-60, 61, (1, n), generator=g).double()
                         + torch.randint(-20, 1, (k, n), generator=g).double())
        if layout == "columns":
            a = a.mT.contiguous().mT
        c = a @ b
        kw = dict(bm=16, bn=16, units=reference.units_for(c), return_sums=True)
        want = reference.check_torch(a, b, c, **kw)
        got = reference.check(a, b, c, **kw)
        for v in (want[0], got[0]):
            assert not L.alarmed(v).any(), (trial, v)
            assert (v[..., L.STATUS] == L.OK).all(), (trial, v)
        assert differences(got, want, f64=True) == [], trial


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_second_look_gives_the_oracles_verdicts(dtype):
    """Alarmed sums get the same second look in both checks: products absorbed by a bias (three
    rows, float32's accumulator starting at it), and faults in batched products with an addend,
    among ordinary and absorbed rows, located alike."""
    g = torch.Generator().manual_seed(11)
    a = (torch.rand(3, 700, generator=g) * 2 ** -12).to(dtype)
    b = (torch.rand(700, 40, generator=g) * 2 ** -12).to(dtype)
    d = (1 + torch.rand(40, generator=g)).to(dtype)
    c = torch.addmm(d, a, b)
    c[2, 3] += 0.1 if dtype == torch.bfloat16 else 1e-3
    got, want, loose = both(a, b, c, bm=2, bn=16, addend=d)
    assert differences(got, want, dtype == torch.float64, loose) == []
    assert L.alarmed(got[0]).any() and not L.alarmed(got[0]).all()
    a = torch.randn(3, 37, 300, generator=g).to(dtype)
    a[1, :5] *= 2 ** -30
    b = torch.randn(300, 29, generator=g).to(dtype)
    d = torch.randn(29, generator=g).to(dtype)
    c = torch.baddbmm(d, a, b.expand(3, 300, 29), alpha=0.5)
    f = 3.0 if dtype == torch.bfloat16 else 0.01
    c[0, 4, 7] += f
    c[1, 2, 20] -= f
    c[2, 30, 0] = c[2, 30, 0] * (1 + f) + f
    got, want, loose = both(a, b, c, bm=8, bn=8, addend=d, alpha=0.5)
    assert differences(got, want, dtype == torch.float64, loose) == []
    assert L.alarmed(got[0]).sum() == 3


def test_an_element_corrupted_past_the_scaled_range_of_a_float64_product_near_the_smallest_normal_alarms():
    """Float64 operands near 3e-155 put the products near the smallest normal, so the check's
    units are about 2^1020. An exponent flip that turns an element of about 1e-307 into 80 makes
    the tile's scaled sums overflow; the operands bound every element far below 80, so it is a
    fault: both checks alarm there (they left the tile unverified until 2026-12-06; a corruption
    to 1.0 alarmed)."""
    g = torch.Generator().manual_seed(0)
    s = (torch.finfo(torch.float64).tiny * 8) ** 0.5 * 0.25
    a = torch.randn(64, 100, generator=g, dtype=torch.float64) * s
    b = torch.randn(100, 64, generator=g, dtype=torch.float64) * s
    c = a @ b
    clean = c.clone()
    c[32, 21] = 80.0
    kw = dict(bm=32, bn=32, units=reference.units_for(c))
    for check in (reference.check, reference.check_torch):
        verdict, (det_r, det_c) = check(a, b, c, **kw)
        assert L.alarmed(verdict).nonzero().tolist() == [[1, 0]], check.__name__
        assert det_r[32, 0] > 1 and det_c[1, 21] > 1, check.__name__          # located
        assert not L.alarmed(check(a, b, clean, **kw)[0]).any(), check.__name__


def test_asking_whether_the_compiled_check_is_usable_traces_under_torch_compile():
    """Inside torch.compile the compiled check stands aside, and the question must not break a
    fullgraph trace (dynamo cannot trace ``Tensor.is_neg``: asked before ``is_compiling`` it broke
    the compile of the torch check, ``test_fixedcost_compiles_the_check_to_the_same_verdicts``)."""
    a = torch.randn(8, 8)
    f = torch.compile(lambda x: x * 2 if compiled.usable(x, x, x, None) else x + 1, fullgraph=True)
    assert torch.equal(f(a), a + 1)


def _positive_rows_at_small_k(check):
    """Alarms of ``check`` over 400 clean float64 products of uniform positive A (64-256 rows, one
    block) against normal B at K 5-64, and the worst ratio."""
    g = torch.Generator().manual_seed(0)
    alarms, worst = 0, 0.0
    for t in range(400):
        m, k = (64, 188, 256)[t % 3], (5, 7, 16, 64)[t % 4]
        a = torch.rand(m, k, generator=g, dtype=torch.float64)
        b = torch.randn(k, 92, generator=g, dtype=torch.float64)
        c = a @ b
        _, (rr, rc) = check(a, b, c, bm=256, bn=16, units=reference.units_for(c))
        w = max(rr.abs().max().item(), rc.abs().max().item())
        alarms, worst = alarms + (w > 1), max(worst, w)
    return alarms, worst


def test_float64_positive_rows_at_small_k_are_clean_in_the_torch_check():
    alarms, worst = _positive_rows_at_small_k(reference.check_torch)
    assert alarms == 0, (alarms, worst)


def test_float64_positive_rows_at_small_k_are_clean_in_the_compiled_check():
    """Found by fuzzcheck (structured, seeds 24004173 and 24004609): 19 of these 400 alarmed (worst
    ratio 1.5), the compiled check's plain float64 block sums of A erring by up to six units in
    their last place, beyond the threshold's allowance for the check's own arithmetic; its float64
    block sums are compensated now."""
    alarms, worst = _positive_rows_at_small_k(reference.check)
    assert alarms == 0, (alarms, worst)
