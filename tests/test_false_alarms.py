"""Regression tests, one per case an independent test of ordinary training found (issue "Zero false
alarms in real training"): each failed on the code before its fix."""
import pytest
import torch

import abft
from abft.kernels import layout as L

BACKENDS = ["reference", "triton"]


def _verdicts(fn, backend="reference", **config):
    """Run fn() under abft.config(backend=..., **config); return (alarms, stats)."""
    abft.reset()
    with abft.config(backend=backend, **config):
        out = fn()
        alarms = abft.flush()
    return out, alarms, abft.stats()


def test_autocast_weight_checksums_follow_the_parameter():
    """bf16 autocast hands the checked product a fresh copy of the weight each step, at an address
    the allocator reuses: checksums keyed on it were last step's. 13 of 20 steps alarmed."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48)
    abft.protect(torch.nn.Sequential(lin))
    opt = torch.optim.Adam(lin.parameters(), lr=1e-2)
    for step in range(20):
        x = torch.randn(32, 64)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = lin(x)
        loss = y.float().square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert abft.flush() == [], f"step {step}"
    # the cache served the forwards (one entry, kept per version of the parameter)
    assert abft.stats()["checked_calls"] == 20 * 2          # forward and grad_weight


@pytest.mark.parametrize("kind", ["fused", "foreach", "for-loop"])
def test_weight_checksums_follow_a_fused_optimizer(kind):
    """torch's fused AdamW (the Hugging Face Trainer's default, torchtitan's too) updates the
    weights without bumping their version counters: the kept weight checksums were the first
    step's, and every forward after it alarmed on every row (found by the Trainer callback's
    test: 30 alarms a step)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    abft.protect(model)
    flags = {"fused": dict(fused=True), "foreach": dict(foreach=True), "for-loop": dict(foreach=False)}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **flags[kind])
    for step in range(4):
        loss = model(torch.randn(8, 16)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert abft.flush() == [], f"step {step}"


def test_autocast_weight_flip_at_rest_is_still_caught():
    """The cache now keys on the parameter: a bit flipped in it behind autograd's back (no version
    bump) shows in the next forward's row sums, under autocast too."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48)
    abft.protect(torch.nn.Sequential(lin))
    x = torch.randn(32, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lin(x)
        assert abft.flush() == []
        with torch.no_grad():
            lin.weight.data.view(torch.int32)[5, 7] ^= 1 << 30
        lin(x)
    alarms = abft.flush()
    assert alarms and all(a.cols == [] and a.rows for a in alarms)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("exp", [-64, -100, 40, 60, 100])
def test_tiny_and_huge_magnitudes_are_verified_without_alarm(exp, dtype, backend):
    """Scaling B by an exact power of two scales everything the check uses: before, |C| below about
    4e-18 (fp32) alarmed and |C| above about 1e18 was left unverified."""
    torch.manual_seed(0)
    a, b = torch.randn(48, 80), torch.randn(80, 40)
    bs = (b * 2.0 ** exp).to(dtype)
    _, alarms, st = _verdicts(lambda: abft.ops.mm(a.to(dtype), bs), backend)
    assert alarms == [] and st.get("unverified_calls", 0) == 0 and st["checked_calls"] == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_gradient_magnitudes_do_not_alarm(backend):
    """dK, dV of real attention gradients were 1e-22..1e-26: every product of them alarmed."""
    torch.manual_seed(0)
    for scale in (1e-21, 1e-23, 1e-25):
        p, do = torch.softmax(torch.randn(2, 24, 24), -1), torch.randn(2, 24, 32) * scale
        _, alarms, st = _verdicts(lambda: abft.ops.bmm(p.mT, do), backend)
        assert alarms == [] and st.get("unverified_calls", 0) == 0


def test_inf_in_fp16_product_far_from_overflow_alarms():
    """K 4096, |C| <= 4.4e3: the Cauchy-Schwarz bound of the tile reaches fp16's maximum, so an
    injected +Inf was taken for an overflow and left unverified. The column sum without that
    element says its true value, far below the maximum: a fault."""
    torch.manual_seed(0)
    a = (torch.randn(64, 4096) * 4).half()
    b = (torch.randn(4096, 64) * 4).half()
    assert (a.float() @ b.float()).abs().max() < 6e3
    with abft.inject(row=3, col=5, kind="value", value=float("inf")):
        _, alarms, st = _verdicts(lambda: abft.ops.mm(a, b))
    (al,) = alarms
    assert (al.kind, al.row, al.col) == ("nonfinite", 3, 5)


def test_legitimate_fp16_overflow_stays_unverified():
    """The mirror case: a product that really exceeds fp16's range is not a fault."""
    a = torch.full((32, 64), 40.0).half()
    b = torch.full((64, 32), 40.0).half()
    _, alarms, st = _verdicts(lambda: abft.ops.mm(a, b))
    assert alarms == [] and st["unverified_calls"] == 1


@pytest.mark.parametrize("k", [16384, 65536])
def test_low_entropy_shared_constant_at_half_the_positions(k):
    """fp32, half the K positions of A and B carrying one shared constant: the sampled
    low-entropy test saw 9 distinct values in 16 and the sums alarmed (ratio 3.96 at K 65536).
    The check's own float32 arithmetic rounded those terms with one sign; it now runs in float64,
    and the sampler flags a nonzero value repeated at a quarter of the samples."""
    torch.manual_seed(0)
    a, b = torch.randn(64, k), torch.randn(k, 64)
    idx = torch.randperm(k)[:k // 2]
    a[:, idx] = 0.37
    b[idx, :] = 0.61
    _, alarms, st = _verdicts(lambda: abft.ops.mm(a, b), tiles=(64, 64))
    assert alarms == [] and st["checked_calls"] == 1


def test_low_entropy_sampler_flags_a_shared_constant_not_zeros():
    from abft.kernels.stats import low_entropy
    x = torch.randn(3, 4096)
    x[0, ::2] = 0.37          # a shared constant at half the places
    x[1, ::2] = 0.0           # zeros (ReLU): adding them is exact
    assert low_entropy(x).tolist() == [True, False, False]


def test_fp16_outputs_below_the_subnormal_range_round_with_one_sign():
    """fp16 outputs below half its smallest subnormal all round to zero, each error with its
    element's sign: a coherent error the random model took for noise."""
    g = torch.Generator().manual_seed(0)
    a = (torch.rand(64, 128, generator=g) * 0.5 + 0.5) * 2.0 ** -10
    b = (torch.rand(128, 64, generator=g) * 0.5 + 0.5) * 2.0 ** -22
    a, b = a.half(), b.half()
    exact = a.double() @ b.double()
    assert exact.max() < 2.0 ** -25 and exact.min() > 2.0 ** -26     # all round to zero
    _, alarms, st = _verdicts(lambda: abft.ops.mm(a, b), tiles=(64, 64))
    assert alarms == [] and st.get("unverified_calls", 0) == 0


def test_bf16_flushed_subnormal_inputs_do_not_alarm():
    """oneDNN's bf16 GEMM on some CPUs treats subnormal inputs as zero: a product computed that
    way (emulated here: this CPU honours them) is no fault."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 128, generator=g).bfloat16()
    a[:, ::3] = torch.finfo(torch.bfloat16).tiny / 4                 # subnormal inputs
    b = (torch.randn(128, 64, generator=g) * 2.0 ** 100).bfloat16()
    flushed = torch.where(a.abs() < torch.finfo(torch.bfloat16).tiny, 0, a)
    c = flushed @ b
    assert (c.double() - a.double() @ b.double()).abs().max() > 1e-3 * c.double().abs().max()
    from abft.ops import Problem, _check  # noqa: the check exactly as ops runs it
    from abft.hook import CallContext
    pb = Problem("mm", a, b, c)
    ctx = CallContext("mm", "forward", {}, 0, tuple(c.shape), c.dtype)
    with abft.config(tiles=(64, 64)) as s:
        p = _check(pb, ctx, s)
    assert tuple(p.summary)[:2] == (0.0, 0.0)


def test_bf16_products_flushed_to_zero_do_not_alarm():
    """bf16 products below fp32's normal range are flushed to zero by the CPU GEMM (a guard: the
    float64 check sees those products where the old float32 one lost them too)."""
    a = torch.full((32, 64), 2.0 ** -70).bfloat16()
    b = (torch.rand(64, 32) + 1).bfloat16() * 2.0 ** -70
    _, alarms, st = _verdicts(lambda: abft.ops.mm(a, b))
    assert alarms == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_addmm_with_a_1d_input_and_empty_k(dtype):
    """The OpInfo sample addmm(input (10,), (5, 0), (0, 10), beta=0.2, alpha=0.6): C is beta * input
    rounded once; the check rounded beta * input in bf16 first, and alarmed."""
    torch.manual_seed(0)
    i = torch.randn(10).to(dtype)
    m1, m2 = torch.randn(5, 0).to(dtype), torch.randn(0, 10).to(dtype)
    with abft.config(policy="raise"):
        with abft.checked():
            out = torch.addmm(i, m1, m2, beta=0.2, alpha=0.6)
    assert torch.equal(out, torch.addmm(i, m1, m2, beta=0.2, alpha=0.6))


@pytest.mark.parametrize("shapes", [((5, 5, 0), (0, 5)), ((5, 5, 0), (0,)), ((2, 0, 3), (3, 4)),
                                    ((5, 5, 0), (5, 0, 4))])
def test_matmul_with_a_zero_size_operand(shapes):
    """abft.matmul on a (5, 5, 0) operand raised 'cannot reshape tensor of 0 elements'."""
    a = torch.randn(*shapes[0], requires_grad=True)
    b = torch.randn(*shapes[1], requires_grad=True)
    out = abft.matmul(a, b)
    ref = torch.matmul(a.detach(), b.detach())
    assert out.shape == ref.shape and torch.equal(out, ref)
    out.sum().backward()
    assert a.grad.shape == a.shape and b.grad.shape == b.shape
    assert abft.flush() == []


@pytest.mark.parametrize("check", ["check", "check_torch"])
def test_a_bias_accumulated_with_the_products_does_not_alarm(check):
    """A GEMM may start its accumulator at the addend (MKL's float32 addmm of three rows here: its
    elements off by up to 4.5 ulps of a bias 100 times the products), so every one of the K
    additions rounds at the addend's magnitude. The worst-case bound that caps thresholds at
    K <= 64 allowed the addend one rounding and alarmed (ratios 2-3 in 10 of 10 products);
    the product here is summed so, in float32, from the bias."""
    from abft.kernels import reference as R
    g = torch.Generator().manual_seed(0)
    for trial in range(10):
        a, b = torch.randn(3, 15, generator=g), torch.randn(15, 26, generator=g)
        bias = torch.randn(26, generator=g) * 100 * 15 ** 0.5
        c = _in_order(a, b, "recursive", start=bias)
        v = getattr(R, check)(a, b, c, bm=256, bn=256, units=R.units_for(c), addend=bias)[0]
        assert not L.alarmed(v).any(), (trial, v)
        assert (v[..., L.STATUS] == L.OK).all()


def _fuzzed(family, dtype, g):
    """One random product of ``family`` in ``dtype``: (a, b, c, addend, alpha, beta), or None where
    an operand or the product is not finite. "ranges": A's rows near 2^s against B's columns near
    2^-s down to the bottom of the range (products that underflow); "bias": batched addmm with a
    bias the size of the products, alpha and beta 1 or (0.5, 2); "entropy": few distinct values,
    repeated rows, half zeros, near-constant data, with and without a bias; "scaled": addmm with
    alpha and beta that are no powers of two, mostly at small K, a bias or a full addend from a
    thousandth to a thousand times the products, one time in three with B's columns below the
    normal range (A large, so that the products are normal)."""
    import math
    from abft.kernels import threshold as T
    fi = torch.finfo(dtype)
    emin, emax = int(math.log2(fi.smallest_normal)), int(math.log2(fi.max))
    r = lambda lo, hi, shape=(): torch.randint(lo, hi, shape, generator=g).double()
    f64 = dict(generator=g, dtype=torch.float64)
    alpha, beta, addend = 1.0, 1.0, None
    if family == "ranges":
        m, k, n = (int(x) for x in r(1, 40, (3,)))
        s, lo = int(r(emin, emax + 1)), int(r(emin - 30, 0))
        a = torch.randn(m, k, **f64) * torch.exp2(s + r(-10, 11, (m, 1)) + r(-12, 1, (m, k)))
        b = torch.randn(k, n, **f64) * torch.exp2(-s + r(lo, 3, (1, n)) + r(-12, 1, (k, n)))
        a, b = a.to(dtype), b.to(dtype)
        c = a @ b
    elif family == "bias":
        bt, m, k, n = int(r(1, 4)), *(int(x) for x in r(1, 30, (3,)))
        s, lo = int(r(emin // 2, emax // 2)), int(r(emin // 2, 0))
        a = (torch.randn(bt, m, k, **f64) * torch.exp2(s + r(-10, 11, (bt, m, 1)) + r(-12, 1, (bt, m, k)))).to(dtype)
        b = (torch.randn(k, n, **f64) * torch.exp2(-s + r(lo, 3, (1, n)) + r(-12, 1, (k, n)))).to(dtype)
        big = (a.double() @ b.double()).abs().amax()
        addend = (torch.randn(n, **f64) * (big if big > 0 else 1.0)).to(dtype)
        if int(r(0, 2)):
            alpha, beta = 0.5, 2.0
        c = torch.baddbmm(addend.expand(bt, m, n), a, b.expand(bt, k, n), alpha=alpha, beta=beta)
    elif family == "scaled":
        pick = lambda xs: xs[int(r(0, len(xs)))]
        m, n = int(r(1, 40)), int(r(1, 40))
        k = pick([1, 2, 3, 5, 8, 17, 33, 64, 65, 100, 300])
        alpha = pick([0.3, 1 / 3, 0.7, 1.7, 3.3, -0.45, 1 / math.sqrt(80), 1.0])
        beta = pick([0.6, 1 / 3, -1.3, 2.0, 1.0])
        sa = sb = 0
        if int(r(0, 3)) == 0:
            sb = emin - int(r(0, int(-math.log2(T.UNIT[dtype]))))      # into the subnormals
            sa = min(emax - 12, -sb - int(r(0, 20)))
        a = (torch.randn(m, k, **f64) * 2.0 ** sa).to(dtype)
        b = (torch.randn(k, n, **f64) * 2.0 ** sb).to(dtype)
        big = float((a.double() @ b.double()).abs().amax()) * abs(alpha) or 1.0
        addend = (torch.randn(m if int(r(0, 2)) else 1, n, **f64) * big * 10.0 ** r(-3, 4)).to(dtype)
        c = torch.addmm(addend, a, b, alpha=alpha, beta=beta)
    else:
        def draw(shape):
            kind = int(r(0, 6))
            if kind == 0:
                return r(-1, 2, shape)
            if kind == 1:
                return r(0, 2, shape) * 0.5
            if kind == 2:
                return torch.randn(shape[-1], **f64).expand(*shape).clone()
            if kind == 3:
                x = torch.randn(*shape, **f64)
                x[..., ::2] = 0
                return x
            if kind == 4:
                return torch.exp2(r(-3, 4, shape)) * r(-1, 2, shape)
            return torch.randn(*shape, **f64) * 1e-3 + 1.0
        m, n, k = int(r(1, 70)), int(r(1, 70)), int(r(1, 200))
        a, b = draw((m, k)).to(dtype), draw((k, n)).to(dtype)
        if int(r(0, 2)):
            addend = (draw((n,)) * 2.0 ** int(r(-4, 8))).to(dtype)
        c = torch.addmm(addend, a, b) if addend is not None else a @ b
    if not all(bool(torch.isfinite(x).all()) for x in (a, b, c)):
        return None
    return a, b, c, addend, alpha, beta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("family", ["ranges", "bias", "entropy", "scaled"])
def test_fuzzed_clean_products_do_not_alarm(family, dtype):
    """Random clean products (``_fuzzed``; 40 a family and dtype, fixed seeds) checked by the torch
    check and the compiled one: no alarm, no unverified tile. Written with the two fixes it found
    (float64 products that underflow; a bias the GEMM accumulates onto): before them it failed for
    ranges/float64, bias/float32 and bias/float64. "scaled" came with the fixes for alpha and beta
    (their roundings, an operand scaled below the normal range): before them it failed for
    float32 and float64."""
    from abft.kernels import reference as R
    g = torch.Generator().manual_seed(1)
    checked = 0
    for trial in range(40):
        case = _fuzzed(family, dtype, g)
        if case is None:
            continue
        a, b, c, addend, alpha, beta = case
        for check in (R.check_torch, R.check):
            v = check(a, b, c, bm=16, bn=16, units=R.units_for(c), addend=addend, alpha=alpha,
                      beta=beta)[0]
            assert not L.alarmed(v).any(), (trial, check.__name__, v)
            assert (v[..., L.STATUS] == L.OK).all(), (trial, check.__name__, v)
        checked += 1
    assert checked >= 25


def _in_order(a, b, order, start=None):
    """a @ b accumulated in float32 in ``order``, then rounded to a's dtype: "recursive" and
    "pairwise" round each product, then each sum; "fma", "reversed" (K backwards) and "split4" (four
    runs of K, added at the end) add each exact product in float64 and round the sum to float32 (a
    fused multiply-add but for a rare double rounding). Orders a GEMM may take (GPUs' split-K and
    tensor cores among them). ``start``: the accumulator's first value (an addend the GEMM starts
    from: the first run's, the first term pairwise)."""
    A, B = a.float(), b.float()
    k = A.shape[1]
    first = None if start is None else start.float().expand(A.shape[0], B.shape[1]).clone()
    terms = [A[:, i:i + 1] * B[i] for i in range(k)]
    if order == "pairwise":
        terms = terms if first is None else [first] + terms
        while len(terms) > 1:
            terms = [terms[i] + terms[i + 1] if i + 1 < len(terms) else terms[i]
                     for i in range(0, len(terms), 2)]
        return terms[0].to(a.dtype)
    runs = [list(range(k))[::-1]] if order == "reversed" else \
        [r.tolist() for r in torch.arange(k).chunk(4)] if order == "split4" else [list(range(k))]
    parts = []
    for n_run, run in enumerate(runs):
        c = first if first is not None and n_run == 0 else torch.zeros(A.shape[0], B.shape[1])
        for i in run:
            c = (c.double() + A[:, i:i + 1].double() * B[i].double()).float() if order != "recursive" \
                else c + terms[i]
        parts.append(c)
    c = parts[0]
    for p in parts[1:]:
        c = c + p
    return c.to(a.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_a_clean_product_summed_in_any_order_does_not_alarm(dtype):
    """The threshold bounds the product's accumulation whatever the GEMM's order: the same product
    summed recursively, with fused multiply-adds, reversed, pairwise and in four split-K runs
    (Gaussian, positive and offset data, K to 300) alarms in neither check. It can fail: with
    LAMBDA at 0.5 float32 alarms, and with the output's rounding allowance (``out``) halved the
    half types do (their ratios, 0.86-0.93 in a longer run, are that rounding's)."""
    from abft.kernels import reference as R
    g = torch.Generator().manual_seed(2)
    for trial in range(9):
        m, n, k = int(torch.randint(1, 40, (), generator=g)), int(torch.randint(1, 40, (), generator=g)), \
            int(torch.randint(1, 300, (), generator=g))
        a, b = [(torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)),
                (torch.rand(m, k, generator=g), torch.rand(k, n, generator=g)),
                (torch.randn(m, k, generator=g) + 3, torch.randn(k, n, generator=g) * 0.1 + 1)][trial % 3]
        a, b = a.to(dtype), b.to(dtype)
        for order in ("recursive", "fma", "reversed", "pairwise", "split4"):
            c = _in_order(a, b, order)
            for check in (R.check_torch, R.check):
                v = check(a, b, c, bm=16, bn=16, units=R.units_for(c))[0]
                assert not L.alarmed(v).any(), (trial, order, check.__name__)


def _worst(check, a, b, c, addend=None, **kw):
    """The largest |ratio| of any sum of ``check``'s verdict on c = a @ b (+ addend)."""
    from abft.kernels import reference as R
    v, (rr, rc) = check(a, b, c, bm=256, bn=256, units=R.units_for(c), addend=addend, **kw)[:2]
    return max(float(rr.abs().max()), float(rc.abs().max()))


@pytest.mark.parametrize("check", ["check", "check_torch"])
@pytest.mark.parametrize("k", [64, 256, 4096])
@pytest.mark.parametrize("rows", [1, 3])
def test_products_absorbed_by_a_bias_do_not_alarm(rows, k, check):
    """torch's CPU float32 addmm of one to three rows starts its accumulator at the bias (this
    machine's MKL: from four rows on it adds the bias after). Products all positive and below half
    an ulp of a bias near 1 are then lost, every one: an error that grows as K, not as the random
    walk the threshold allows (ratios 3.0-25 at K 64-4096 before the second look, in both checks;
    0.77-0.97 after: the error is the allowance, and a random walk the threshold models)."""
    from abft.kernels import reference as R
    g = torch.Generator().manual_seed(k + rows)
    a = torch.rand(rows, k, generator=g) * 2 ** -12
    b = torch.rand(k, 96, generator=g) * 2 ** -12
    d = 1.0 + torch.rand(96, generator=g)
    assert _worst(getattr(R, check), a, b, torch.addmm(d, a, b), d) < 1


@pytest.mark.parametrize("order", ["fma", "recursive", "split4", "reversed"])
def test_products_near_an_ulp_of_the_running_sum_do_not_alarm(order):
    """Products of one sign near an ulp of the running sum round the same way every step (1.26
    ulps round to one: each loses a quarter of an ulp), from a bias or from one large product
    before them: ratios 0.9-3.4 without an addend, 3.8-33 with one (K 256, 1024) before the second
    look, 0.10-0.87 after, in each order a GEMM may take."""
    from abft.kernels import reference as R
    g = torch.Generator().manual_seed(3)
    for k in (256, 1024):
        b = 1 + 1e-5 * torch.randn(k, 64, generator=g)
        a = torch.full((4, k), 1.5e-7)
        a[:, 0] = a[:, k // 2] = 1.0
        d = 1 + 1e-3 * torch.rand(64, generator=g)
        a2 = torch.full((2, k), 1.5e-7)
        for check in (R.check, R.check_torch):
            assert _worst(check, a, b, _in_order(a, b, order)) < 1, (k, check.__name__)
            assert _worst(check, a2, b, _in_order(a2, b, order, start=d), d) < 1, (k, check.__name__)


@pytest.mark.parametrize("check", ["check", "check_torch"])
def test_addmm_of_k_1_with_a_bias_and_alpha_and_beta_does_not_alarm(check):
    """torch's CPU float32 addmm of K = 1 rounds the product, adds the bias, and rounds alpha, beta
    and their products: the worst-case cap had a product's K steps (one here) and the bias's, no
    more (ratios up to 1.3 with alpha = beta = 1, 2.4 with both scaled)."""
    from abft.kernels import reference as R
    g = torch.Generator().manual_seed(7)
    for alpha, beta in ((1.0, 1.0), (0.3, 1.0), (1.0, 0.6), (0.3, 0.6), (3.3, 1 / 3)):
        for m in (1, 3, 40):
            a, b, d = torch.randn(m, 1, generator=g), torch.randn(1, 70, generator=g), torch.randn(70, generator=g)
            c = torch.addmm(d, a, b, alpha=alpha, beta=beta)
            assert _worst(getattr(R, check), a, b, c, d, alpha=alpha, beta=beta) < 1, (alpha, beta, m)


@pytest.mark.parametrize("check", ["check", "check_torch"])
@pytest.mark.parametrize("dtype,sa,sb", [(torch.float64, 900, -1068), (torch.float32, 120, -146)], ids=str)
def test_addmm_scaling_an_operand_below_the_normal_range_does_not_alarm(dtype, sa, sb, check):
    """torch's CPU GEMM scales one operand by alpha before the product: below the normal range its
    elements lose their last bits (B near 2^-1068 keeps six), an absolute error the threshold had
    no term for (ratios up to 1.5e9 in float64, 8e4 in float32)."""
    from abft.kernels import reference as R
    g = torch.Generator().manual_seed(0)
    for alpha in (0.5, 0.3):
        for side in ("b", "a"):
            a = torch.randn(64, 128, generator=g, dtype=torch.float64) * 2.0 ** sa
            b = torch.randn(128, 48, generator=g, dtype=torch.float64) * 2.0 ** sb
            if side == "a":
                a, b = b.mT.contiguous(), a.mT.contiguous()
            a, b = a.to(dtype), b.to(dtype)
            d = (torch.randn(b.shape[1], generator=g, dtype=torch.float64) * 2.0 ** (sa + sb)).to(dtype)
            c = torch.addmm(d, a, b, alpha=alpha)
            assert _worst(getattr(R, check), a, b, c, d, alpha=alpha) < 1, (alpha, side)


@pytest.mark.parametrize("check", ["check", "check_torch"])
def test_addmm_scaling_b_by_alpha_under_all_positive_rows_does_not_alarm(check):
    """torch's CPU float32 addmm scaled B by alpha element by element (c_ij = sum_k a_ik
    fl(alpha b_kj) + fl(beta d_j), bit for bit): each fl(alpha b_kj) errs the same way for every
    row, so a column sum over an all-positive A (s_k = sum_i a_ik, no cancellation) collects
    sum_k s_k alpha b_kj delta_kj, beyond the allowance for alpha per |pred| where the prediction
    cancels across k (ratios up to 1.83 here; the structured fuzz's seed 14001112 at 1.45)."""
    from abft.kernels import reference as R
    worst = 0.0
    for seed in range(12):
        g = torch.Generator().manual_seed(seed)
        a = torch.rand(253, 4, generator=g) * 2.0 ** 13
        b = torch.tan((torch.rand(4, 182, generator=g) - 0.5) * 3.1)
        d = torch.randn(182, generator=g)
        for alpha in (3.3, -0.7):
            c = torch.addmm(d, a, b, alpha=alpha, beta=-0.5)
            worst = max(worst, _worst(getattr(R, check), a, b, c, d, alpha=alpha, beta=-0.5))
    assert worst < 1


def test_the_structured_fuzz_s_addmm_scaled_by_alpha_does_not_alarm():
    """The case that found it, replayed from ``benchmarks/fuzzcheck.py``'s seed (float32 addmm,
    253 x 4 x 182, all-positive A, heavy-tailed B, alpha 3.3, beta -0.5; made on one thread, as
    the fuzz made it): 1.45 in both checks before."""
    from fuzzcheck import draw
    _assert_replayed_clean(lambda: draw("structured", 14001112)[:4])


@pytest.mark.parametrize("check", ["check", "check_torch"])
def test_addmm_with_alpha_above_1_of_products_below_the_normal_range_does_not_alarm(check):
    """float32 addmm with |alpha| > 1 of products near 2^-133 (A near 2^-63, B near 2^-70, K = 4)
    into one column: torch's CPU GEMM rounds each product below the normal range and multiplies
    the sum by alpha after, so the underflow grows with alpha; the allowance per product term did
    not (ratios up to 3.5 with alpha -7; found by a fuzz, 2026-12-06)."""
    from abft.kernels import reference as R
    g = torch.Generator().manual_seed(1)
    for n in (1, 4):
        for alpha in (3.0, 2.5, -7.0, 1.0, 0.5):
            for sa, sb in ((-63, -70), (-70, -70)):
                a = (torch.randn(84, 4, generator=g, dtype=torch.float64) * 2.0 ** sa).float()
                b = (torch.randn(4, n, generator=g, dtype=torch.float64) * 2.0 ** sb).float()
                c = torch.addmm(torch.zeros(n), a, b, beta=0.0, alpha=alpha)
                v, (rr, rc) = getattr(R, check)(a, b, c, bm=4, bn=32, units=R.units_for(c), alpha=alpha)
                assert max(float(rr.abs().max()), float(rc.abs().max())) < 1, (n, alpha, sa, sb)


@pytest.mark.parametrize("check", ["check", "check_torch"])
def test_an_addend_against_rows_below_the_normal_range_is_no_nonfinite_output(check):
    """float64 rows near 2^-1074 against a bias near 2^40: the check's scaled copies of C overflow
    (2^-(e_i + F) reaches 2^1000 and more), and were counted as non-finite outputs, which the
    finite inputs made a fault: NONFINITE on a clean product. Those sums cannot be formed: their
    tiles are unverified, the rest checked."""
    from abft.kernels import reference as R
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 128, generator=g, dtype=torch.float64)
    a[:8] *= 2.0 ** -1074
    b = torch.randn(128, 64, generator=g, dtype=torch.float64)
    d = torch.randn(64, generator=g, dtype=torch.float64) * 2.0 ** 40
    c = torch.addmm(d, a, b)
    v = getattr(R, check)(a, b, c, bm=32, bn=32, units=R.units_for(c), addend=d)[0]
    assert not L.alarmed(v).any()
    assert v[..., L.STATUS].flatten().tolist() == [L.UNVERIFIED, L.UNVERIFIED, L.OK, L.OK]


def test_fused_kernel_row_near_the_smallest_normal_does_not_alarm():
    """Found by hypothesis (test_kernel_verdict_is_invariant_under_power_of_two_scaling, drawn
    2026-12-06): A (30, 1) scaled by 2^-119 (one row at 2^-125.7) against B (1, 30) scaled by 2^119,
    float32, tiles of 32: that row's sum failed at a ratio of 1.5e23 (residual 7.5e-9 against the
    floor, 4.9e-32 in C's units). The flushed-input term of ``threshold_tl`` formed 2^-ey times the
    block's norm (2^125 x 8: inf) before multiplying by its coefficient, 0 without a flush: NaN,
    and a NaN threshold is clamped to the floor. The reference check passed it."""
    pytest.importorskip("triton")
    from abft.kernels import configs
    from abft.kernels import triton_gemm as TG
    if not configs.interpreting():
        pytest.skip("needs TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(0)
    a = torch.randn(30, 1, generator=g, dtype=torch.float64).float() * 2.0 ** -119
    b = torch.randn(1, 30, generator=g, dtype=torch.float64).float() * 2.0 ** 119
    _, v, _ = TG.checked_gemm(a, b, tiles=(32, 32))
    assert not L.alarmed(v).any(), v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 5, 30])
def test_fused_kernel_allows_its_checksum_products_below_the_normal_range(dtype, n):
    """The draw beside the one above, at 28 rows: A (28, 1) scaled by 2^-119 against B (1, n) by
    2^119. The data's products stay normal; the row checksums' (a row near 2^-125.7 times B's
    checksum of order 1 in its block's units) fall below float32's normal range and round to its
    subnormal grid, so a row's residual moved (its ratio doubled, from 0.014 to 0.028) while its
    threshold did not: the kernel allowed underflow only at the data products' scale, and its
    2^-150 per term (the interpreter's, subnormals honoured) packed as float32 was 0. Each sum's
    residual may move by its threshold's growth at most: the growth is the underflow allowance."""
    pytest.importorskip("triton")
    from abft.kernels import configs
    from abft.kernels import triton_gemm as TG
    if not configs.interpreting():
        pytest.skip("needs TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(0)
    a = torch.randn(28, 1, generator=g, dtype=torch.float64).to(dtype)
    b = torch.randn(1, n, generator=g, dtype=torch.float64).to(dtype)
    *_, s = TG.checked_gemm(a, b, tiles=(32, 32), return_sums=True)
    *_, v2, _, s2 = TG.checked_gemm(a * 2.0 ** -119, b * 2.0 ** 119, tiles=(32, 32), return_sums=True)
    assert not L.alarmed(v2).any()
    for side in ("row", "col"):
        moved = (s2["res_" + side].double() - s["res_" + side].double()).abs()
        grown = s2["thr_" + side].double() - s["thr_" + side].double()
        assert (moved <= grown).all(), (side, moved.max().item(), grown.min().item())


def test_a_product_with_a_column_slice_of_a_wider_matrix_does_not_alarm():
    """``abft.matmul(a, w[:, :512])`` (B's rows 520 apart) alarmed on every tile on the CPU: the
    compiled check read B's rows as if they were 512 apart."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(160, 300, generator=g)
    w = torch.randn(300, 520, generator=g)
    out = abft.matmul(a, w[:, :512])
    assert torch.equal(out, a @ w[:, :512])
    assert abft.flush() == []


# Found by a fuzz of clean products with structured values (2026-12-06: 17 false alarms in 109,711,
# every one with a constant, few-valued or integer operand; ``tests/fuzzcases.py`` replays its
# draws). Four causes, each mended in the threshold (kernels/threshold.py):
# - repeated rows: the check's own float64 sums add equal values, whose roundings do not average
#   out: the check's block-sum variance is scaled by nu as the product's is, and the sums get an
#   allowance of (nu - 1) u/2 of their magnitude (``rep``: in one binade each addition of an equal
#   value rounds the same way);
# - a few-valued summed block: at each k the rows with equal values share the product's rounding
#   error (its running sums lie in one binade), so nu counts the block's low-entropy rows;
# - few distinct products under cancellation err in one sign per term beyond the low-entropy
#   allowance taken in |C|: it is taken in the terms' magnitudes (sqrt(bs k Q)) too;
# - an addend that starts the accumulator rounds at its own size at each step: the low-entropy
#   allowance counts the addend's magnitudes.
_FOUND = (1009664, 1015727, 1031214, 1043729, 1045679, 1046539, 1055869, 2008560, 2017633, 2019398,
          2024819, 2026363, 2029132, 2029776, 2038801, 2059627, 2060043)


@pytest.mark.parametrize("seed", _FOUND)
def test_the_structured_fuzz_s_false_alarms_do_not_alarm(seed):
    """Each false alarm the fuzz found, replayed from its seed (products made on one thread, as
    the fuzz made them): no sum of either check reaches its threshold."""
    import fuzzcases
    _assert_replayed_clean(lambda: fuzzcases.case(seed))


def _assert_replayed_clean(case):
    """No sum of either check reaches its threshold on ``case()`` -> (a, b, c, check kwargs), its
    product made on one thread, as the fuzzes made theirs."""
    from abft.kernels import reference as R
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b, c, kw = case()
    finally:
        torch.set_num_threads(threads)
    kw = {"units": R.units_for(c), **kw}
    for check in (R.check, R.check_torch):
        v, (rr, rc) = check(a, b, c, **kw)
        assert max(float(rr.abs().max()), float(rc.abs().max())) < 1, check.__name__


@pytest.mark.parametrize("check", ["check", "check_torch"])
def test_float64_rows_against_equal_columns_do_not_alarm(check):
    """float64 A against B (K = 4) whose 190 columns are equal, stored column-major: B's block sums
    add 190 equal values in order, their roundings all of one sign per binade (ratios 1.6-2.0 on
    seeds 1, 5, 7 before ``rep``)."""
    from abft.kernels import reference as R
    for seed in range(8):
        g = torch.Generator().manual_seed(seed)
        a = torch.randn(6, 4, generator=g, dtype=torch.float64)
        b = torch.randn(4, 1, generator=g, dtype=torch.float64).expand(4, 190).mT.contiguous().mT
        assert _worst(getattr(R, check), a, b, a @ b) < 1, seed


@pytest.mark.parametrize("check", ["check", "check_torch"])
def test_float64_heavy_tailed_rows_against_equal_columns_do_not_alarm(check):
    """float64 A with heavy tails (tan of uniforms) against B (K = 4) whose 190 columns are equal,
    stored column-major: B's block sums add 190 equal values (errors of 15-20 units of round-off
    each, 6.3e-12 in a prediction of 1.7e3-sized terms), ratios up to 3 before nu scaled them."""
    from abft.kernels import reference as R
    for seed in range(8):
        g = torch.Generator().manual_seed(seed)
        a = torch.tan((torch.rand(36, 4, generator=g, dtype=torch.float64) - 0.5) * 3.1)
        b = torch.randn(4, 1, generator=g, dtype=torch.float64).expand(4, 190).mT.contiguous().mT
        assert _worst(getattr(R, check), a, b, a @ b) < 1, seed


@pytest.mark.parametrize("check", ["check", "check_torch"])
def test_float32_constant_rows_against_a_few_valued_b_do_not_alarm(check):
    """float32 A whose rows are constant against B of three values, one-column tiles: the GEMM
    accumulates few distinct products, its errors repeat, and under cancellation they exceeded the
    low-entropy allowance taken in |C| (ratio 1.04)."""
    from abft.kernels import reference as R
    g = torch.Generator().manual_seed(17)
    a = torch.randn(253, 1, generator=g).expand(253, 170).contiguous()
    vals = torch.randn(3, generator=g)
    b = vals[torch.randint(3, (170, 95), generator=g)]
    c = a @ b
    v, (rr, rc) = getattr(R, check)(a, b, c, bm=16, bn=1, units=R.units_for(c))
    assert max(float(rr.abs().max()), float(rc.abs().max())) < 1


def test_compiled_check_of_a_one_valued_float64_a_does_not_alarm():
    """float64 A whose 219 x 14 elements are one value: the compiled check's column sums (219 equal
    values added in a row) alarmed (2.17) where the torch oracle's, summed pairwise, did not (0.20)."""
    from abft.kernels import reference as R
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        a = torch.full((219, 14), float(torch.randn(1, generator=g, dtype=torch.float64)), dtype=torch.float64)
        b = torch.randn(14, 33, generator=g, dtype=torch.float64)
        c = a @ b
        for check in (R.check_torch, R.check):
            assert max(float(x.abs().max()) for x in check(a, b, c, bm=256, bn=5, units=R.units_for(c))[1]) < 1, seed


@pytest.mark.parametrize("check", ["check", "check_torch"])
def test_a_float64_product_scaled_by_a_huge_power_of_two_alpha_is_verified(check):
    """float64 addmm with alpha = 2^505 (operands near 2^-300): bs K Q overflows float64 though Q
    does not; its root taken whole made the low-entropy and repeated-row terms inf, and 0 * inf a
    NaN threshold (the tile unverified) where the row repeats nothing. Verified, and a corrupted
    element alarms."""
    from abft.kernels import layout as L
    from abft.kernels import reference as R
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 64, generator=g, dtype=torch.float64) * 2.0 ** -300
    b = torch.randn(64, 64, generator=g, dtype=torch.float64) * 2.0 ** -300
    alpha = 2.0 ** 505
    c = torch.addmm(torch.zeros(64, dtype=torch.float64), a, b, beta=0.0, alpha=alpha)
    kw = dict(bm=64, bn=64, units=R.units_for(c), alpha=alpha)
    v = getattr(R, check)(a, b, c, **kw)[0]
    assert (v[..., L.STATUS] == L.OK).all() and not L.alarmed(v).any()
    c[5, 7] += 1e-6 * c.abs().max()
    assert L.alarmed(getattr(R, check)(a, b, c, **kw)[0]).any()
