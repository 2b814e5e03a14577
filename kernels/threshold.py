"""The checksum threshold, written once for both backends.

A checked sum adds ``bs`` elements of C = alpha * A.B (+ addend): a column sum over the BM rows of a
tile, or a row sum over its BN columns (the same with A and B swapped; below, x is the side that is
summed over and y the other). Its residual r = sum_i C_ij - alpha * sum_k s_k y_kj (s_k = sum_i x_ik)
collects the round-off of

1. the product: each C_ij is a dot product of length K accumulated in ``steps`` roundings of a
   running sum, each adding a partial sum of ``inner`` products (recursive summation: steps = K,
   inner = 1; a blocked K loop: steps = K / BK, inner = BK). With errors of variance u^2/3 per
   rounding and partial sums that drift linearly to C_ij plus a random walk of variance
   Q_ij = sum_k x_ik^2 y_kj^2, the variance is u^2 (steps (C^2/9 + Q/6) + inner (inner C^2/(9K) + 5Q/18));
2. the rounding of C to its stored dtype (bf16, fp16 outputs of the reference backend): its
   deterministic bound u_out / (1 - u_out) sum |C| (relative to the stored values). Not a random model: elements of nearly equal value (rows
   that nearly repeat, a shared large component) round the same way, and their errors add up;
3. tf32 rounding of the inputs: variance (2/3) u_tf^2 Q;
4. the check's own arithmetic in its unit u_chk (the reference: float64; the kernel: float32): the
   predicted dot product (the same model, magnitude Qs = sum_k s_k^2 y_kj^2; with a directed
   allowance when it runs on the tensor cores), the sum of the bs values of C, and the sums s_k;
   in the fused kernels also eta, the error of their split into parts the tensor cores multiply
   (2^eta_log2 in the block's scaled units, or in natural units when ``eta_absolute``, then
   2^(eta_log2 - E)), bounded deterministically: eta sum_k |y_kj| <= eta sqrt(K y1). Not a
   random model: checksums that are equal (or that fall between the same two points of fp16's
   subnormal grid) round the same way at every k, and their errors add up;
5. underflow, bounded deterministically: eta_acc per product term (half the smallest fp32 subnormal,
   or the smallest normal where products are flushed to zero), eta_out per stored element, and
   subnormal inputs flushed to zero (bf16 on CPUs); in the fused kernels, eta_acc also per product
   of the predicted dot product (``chk_parts`` parts of each checksum times the other operand: a
   row near float32's smallest normal times a checksum of order 1 in its block's units falls
   below the normal range even where the data's products do not).

6. addmm's alpha and beta, rounded to the GEMM's arithmetic and multiplied in it (two roundings of
   one sign on the scaled term: per |pred| and per sum |addend|); an operand scaled by alpha
   element by element (torch's CPU GEMM), each element rounding on its own: one more rounding per
   product across a sum, and in a sum over the other operand's block an error the same for all its
   elements (variance u^2/3 Qs), and below the normal range absolutely (like a flushed input);
   and the products' underflow times |alpha| (rounded up to a power of two) where alpha
   multiplies the rounded sum.

Rows that repeat exactly have identical errors, and so, at each k, do rows of a few-valued block
whose values there are equal (their running sums lie in one binade): the product's variance and
the check's block sums' are scaled by ``nu``, the largest multiplicity of a row in the block or
the number of its low-entropy rows (``stats.operand_stats``). The reference's float64 sums add a
repeated row's equal values in order, each rounding the same way within a binade: they get
(nu - 1) u/2 of their magnitude (sum |C| + sqrt(bs K Q)) besides. Rounding errors average out only
when the summands' low bits vary: sums whose rows and columns take few values
(``stats.low_entropy``) get the bias allowance ((steps + inner)/2 u + ...) times the terms'
magnitude (the larger of sum |C| and sqrt(bs K Q), Cauchy-Schwarz's bound of sum_ik |x_ik y_kj|,
which cancellation does not shrink), plus twice the addend's sum |D| (an accumulator that starts at
the addend rounds at its size at every step); every sum gets 2 sqrt(steps + inner) u |pred|.
Accumulators that round toward zero (tensor cores) get a directed-rounding allowance.

threshold = LAMBDA sqrt(variance) + allowances. LAMBDA = 6 puts a Gaussian false alarm per sum near
2e-9; the stress set in tests/kernels/test_threshold.py decides whether the model holds.

Magnitudes. Q is not computed (that would be another GEMM per side): it is bounded by Hoelder's
inequality, sum_k a_k b_k <= min(|a|_1 |b|_inf, |a|_inf |b|_1), from norms that cost O(MK + KN) and
that both backends compute the same way (``stats.operand_stats``). Every quantity is in units scaled
by exact powers of two taken from the operands (2^-E per block of x, 2^-F per column of y), so the
arithmetic can neither underflow nor overflow for finite products and the verdict does not change
when an operand is scaled by a power of two. In those units the Hoelder bound is at least 1/16 for
any nonzero block and column, so a threshold never collapses to its floor.

For K <= SMALL_K the threshold is capped by the deterministic worst-case bound built from the exact
T = sum_i sum_k |x_ik| |y_kj| (cheap at small K), an addend's magnitudes (a GEMM may start its
accumulator at the addend: every step then rounds at its size), plus the underflow allowance
(term 5) and, in the fused kernels, the checksums' split error (term 4's eta sqrt(K y1)).

Products far below their running sum (a large addend the GEMM starts from, one large product
among tiny ones) are lost with one sign; that is allowed only where a sum has failed, by the
reference check's second look (``reference._second_look``), from the products themselves.

The host computes the scalar coefficients (``coefficients``); ``threshold`` (torch) and
``threshold_tl`` (Triton) evaluate the same expression, term for term, on per-sum tensors.
"""
import math
from dataclasses import dataclass

import torch

LAMBDA = 6.0
SMALL_K = 64
FLOOR = 2.0 ** -100         # the least threshold, in scaled units (data there is of order 1)

UNIT = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24,
        torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
TF32_UNIT = 2.0 ** -11
# Half the smallest subnormal: the absolute rounding of a result that underflows. float64's half
# (2^-1075) is no double (it rounds to 0, which left float64 without an allowance): the smallest
# subnormal itself bounds it.
_ETA = {torch.float64: 2.0 ** -1074, torch.float32: 2.0 ** -150,
        torch.float16: 2.0 ** -25, torch.bfloat16: 2.0 ** -134}


@dataclass(frozen=True)
class Accumulation:
    """How one dot product of length K is accumulated: ``steps`` roundings of the running sum,
    each adding a partial sum of at most ``inner`` products; ``directed``: the accumulator rounds
    toward zero (tensor cores), so its errors do not average out."""
    steps: int
    inner: int = 1
    directed: bool = False


def recursive(k):
    """One rounding per product: the order every BLAS may use (the reference backend's model)."""
    return Accumulation(max(int(k), 1), 1)


def blocked(k, bk, directed=False):
    """A K loop of BK-wide partial products added to an accumulator."""
    k, bk = max(int(k), 1), max(int(bk), 1)
    return Accumulation(-(-k // bk), min(bk, k), directed)


@dataclass(frozen=True)
class Units:
    acc: float      # unit round-off of the accumulation
    out: float      # rounding of the accumulator to the output dtype (0 when they are the same)
    chk: float      # unit round-off of the check arithmetic
    tf: float = 0.0         # tf32 input rounding (0 unless tf32 is on)
    eta_acc: float = 0.0    # absolute underflow per product term
    eta_out: float = 0.0    # absolute underflow per stored element
    ftz: float = 0.0        # inputs below this are flushed to zero (0: subnormals honoured)
    eta_in: float = 0.0     # absolute rounding of an input element scaled by alpha (addmm)


def units(dtype, *, check=torch.float64, tf32=False, stored=True, flush=False):
    """Round-off units of a product of ``dtype`` operands, accumulated in float32 (float64 for
    float64), checked in ``check``. ``stored``: the check sees the output rounded to ``dtype``
    (the reference backend), not the accumulator (the fused kernel). ``flush``: the GEMM flushes
    subnormal inputs and products to zero (bf16 on CPUs)."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    if dtype == torch.float64:
        check = torch.float64
    return Units(acc=UNIT[acc], out=UNIT[dtype] if stored and dtype != acc else 0.0,
                 chk=UNIT[check], tf=TF32_UNIT if tf32 else 0.0,
                 eta_acc=torch.finfo(acc).tiny if flush else _ETA[acc],
                 eta_out=_ETA[dtype] if stored else 0.0,
                 ftz=torch.finfo(dtype).tiny if flush else 0.0, eta_in=_ETA[dtype] if stored else 0.0)


def gamma(n, unit):
    return n * unit / (1 - n * unit)


@dataclass(frozen=True)
class Coefficients:
    """The scalars of one side's thresholds (see the module docstring for the terms)."""
    lam: float
    k: float            # K
    bs: float           # elements per sum
    p_s2: float         # product variance per sum_i C^2
    p_q: float          # product variance per Q (with tf32)
    p_d2: float         # product variance per sum of addend^2
    c_p2: float         # check variance per pred^2
    c_qs: float         # check variance per Qs
    c_s12: float        # check variance per (sum C)^2
    c_s2: float         # check variance per sum C^2
    c_q: float          # check variance per Q (the sums s_k)
    bias: float         # allowance per |pred|
    lowent: float       # allowance per sum |C| where the data is low-entropy
    rep: float          # allowance per (nu - 1) (sum |C| + sqrt(bs K Q)): the check's sums of repeated rows
    directed: float     # allowance per (|pred|/2 + sqrt(Q/3)) for directed rounding
    directed_chk: float  # the same for the predicted dot product, per (|pred|/2 + sqrt(Qs/3))
    eta_log2: float     # the checksums' split error: log2 of eta (-1000: none)
    eta_absolute: float  # 1: eta is in natural units (scaled by 2^-E per block), 0: scaled units
    out: float          # per sum |C|: u_out / (1 - u_out), the rounding bound relative to the stored value
    out_add: float      # allowance per sum |addend| when beta * addend is rounded on its own
    eta_acc: float      # underflow per product term (times bs K)
    chk_parts: float    # products per k of the predicted dot product that may underflow, eta_acc each
                        # at the summed side's scale 2^-ey (the fused kernels' checksum parts; 0: the
                        # reference check, whose float64 predictions of scaled values do not underflow)
    eta_out: float      # underflow per stored element (times bs)
    ftz: float          # flushed subnormal inputs (smallest normal of the input dtype)
    w_t: float          # worst case per T
    w_sa: float         # worst case per sum |C|
    w_da: float         # worst case per sum |addend| (it may ride the whole accumulation)
    w_scale: float      # the worst case's final factor (a little below the rigorous bound)
    cap: bool           # K <= SMALL_K: cap by the worst case

    @property
    def eta_acc_log2(self):
        """log2 of eta_acc (a power of two; -1000 for none), as the kernels load it: 2^-150 is no
        float32."""
        return math.log2(self.eta_acc) if self.eta_acc > 0 else -1000.0


def _pow2(x):
    """x is +-2^n: scaling by it is exact (in the normal range)."""
    return x != 0 and math.frexp(abs(x))[0] == 0.5


def coefficients(u, *, k, bs, acc, chk=None, lam=None, addend=False, alpha=1.0, beta=1.0, split=(-1000.0, False),
                 parts=0):
    """Coefficients of the thresholds of sums of ``bs`` elements of a length-``k`` product.

    Args:
        u: ``Units``.
        acc: ``Accumulation`` of the product; chk: of the check's predicted dot product
            (default: recursive).
        lam: the multiplier (None: LAMBDA).
        addend: the product has an addend (addmm, a linear's bias).
        alpha, beta: the product's and the addend's scales. torch's CPU GEMM scales one operand
            by alpha before the product (which one is its choice): each scaled element rounds, by
            up to u.eta_in absolutely where it falls below the normal range (an operand near
            2^-1068 in float64 loses its last bits), an error the flushed-input term (``ftz``, per
            element of the other operand, whose norms carry alpha) bounds with
            u.eta_in / min(1, |alpha|). With beta != 1, beta * addend is formed on its own (torch's
            half-precision addmm rounds beta to the dtype and the product once more).
        split: (log2 of eta, absolute): the error of a checksum s_k as the check multiplies it
            (the fused kernel's parts, ``prepass.split_error``); (-1000, False): none.
        parts: how many parts of each checksum the check multiplies in the accumulator's arithmetic
            (the fused kernels: ``prepass.parts_for``), each product of which may underflow; 0:
            the predictions are float64 products of scaled values (the reference check).

    alpha and beta are rounded to the GEMM's arithmetic (float32 for float32, bf16 and fp16
    products; beta to a half type itself) and multiply in it: two roundings of one sign on the
    whole scaled term, allowed per |pred| (alpha) and per sum |addend| (beta, ``out_add``), in the
    worst case too. The worst case (K <= SMALL_K) also counts one more step for a product where an
    addend is added to its sum or starts the accumulator (K steps bound a dot product without a
    fused multiply-add). torch's CPU float32 addmm of K = 1 alarmed without them: 1.3 times the cap
    with alpha = beta = 1, 2.4 times with both scaled.
    """
    k = max(int(k), 0)
    kk = max(k, 1)
    chk = chk or recursive(k)
    ua2, uc2 = u.acc ** 2, u.chk ** 2
    n, m = acc.steps, acc.inner
    nc, mc = chk.steps, chk.inner
    unit_w = 2 * u.acc if acc.directed else u.acc
    # alpha rounded, and its product; below the normal range a scaled element rounds (a power of two
    # of at least 1 is exact)
    ftz = u.ftz
    if alpha not in (0, 1) and u.eta_in and not (_pow2(alpha) and abs(alpha) >= 1):
        ftz = max(ftz, u.eta_in / min(1.0, abs(alpha)))
    by_alpha = 2 * u.acc if alpha != 0 and not _pow2(alpha) else 0.0
    # the operand scaled by alpha rounds element by element: in a sum over the other operand's
    # block (a column sum where B was scaled) each error is the same for every element summed and
    # they add as sum_k s_k alpha y_kj delta_kj (variance u^2/3 Qs), across it (a row sum there) as
    # one more rounding per product (u^2/3 Q); which operand torch scales is its choice: both
    by_scale = ua2 / 3 if by_alpha else 0.0
    # alpha multiplies the accumulated sum, its products' underflow too: by |alpha| rounded up to
    # a power of two (the kernels take eta_acc as one)
    eta_acc = u.eta_acc
    if abs(alpha) > 1 and math.isfinite(alpha):
        eta_acc = eta_acc * 2.0 ** math.ceil(math.log2(abs(alpha)))
    # beta rounded, and its product (half types: both in the dtype, whatever beta)
    by_beta = 2 * max(u.out, u.acc) if addend and beta != 1 and (u.out or not _pow2(beta)) else 0.0
    return Coefficients(
        lam=LAMBDA if lam is None else float(lam), k=float(k), bs=float(bs),
        p_s2=ua2 * (n / 9 + m * m / (9 * kk)),
        p_q=ua2 * (n / 6 + 5 * m / 18) + (2.0 / 3.0) * u.tf ** 2 + by_scale,
        p_d2=ua2 * kk / 3,
        c_p2=uc2 * (nc / 9 + mc * mc / (9 * kk)),
        c_qs=uc2 * (nc / 6 + 5 * mc / 18) + by_scale,
        c_s12=uc2 * bs / 9, c_s2=uc2 * bs / 6, c_q=uc2 * bs / 6,
        bias=2 * math.sqrt(n + m - 1) * u.acc + 2 * math.sqrt(nc + mc - 1) * u.chk + 2 * u.tf + by_alpha,
        lowent=(n + m) / 2 * u.acc + (nc + mc) / 2 * u.chk + bs * u.chk,
        # the reference's float64 sums add in order; the fused kernels' fp32 sums are trees
        rep=u.chk / 2 if u.chk == UNIT[torch.float64] else 0.0,
        directed=2 * u.acc * n if acc.directed else 0.0,
        directed_chk=2 * u.chk * nc if chk.directed else 0.0,
        eta_log2=float(split[0]), eta_absolute=1.0 if split[1] else 0.0,
        out=gamma(1, u.out), out_add=by_beta, eta_acc=eta_acc, chk_parts=float(parts), eta_out=u.eta_out, ftz=ftz,
        w_t=gamma(n + m - 1 + int(addend), unit_w) + gamma(k, u.chk) + gamma(bs, u.chk) + 2 * u.tf + by_alpha,
        # the addend may start the accumulation (MKL's small float32 addmm does): each of its
        # steps rounds at the addend's magnitude too, not one step
        w_sa=gamma(1, u.out) + gamma(bs, u.chk), w_da=gamma(n + m - 1, unit_w) + gamma(bs, u.chk),
        w_scale=1 - 8 * u.chk, cap=k <= SMALL_K)


def holder(x1, xinf, y1, yinf):
    """Upper bound of sum_k x_k y_k for non-negative x, y from their 1- and inf-norms."""
    return torch.minimum(x1 * yinf, xinf * y1)


def threshold(c, *, s1, s2, sa, pred, x1, xinf, xs1, xsinf, y1, yinf, nu, low, ex, ey,
              d2=None, t=None, da=None, nsub=None):
    """Thresholds of checked sums (torch; ``threshold_tl`` is the same arithmetic in Triton).

    Every argument broadcasts to the sums' shape (..., T, S); all are in scaled units (C and the
    addend times 2^-(ex + ey)).

    Args:
        c: ``Coefficients``.
        s1, s2, sa: sum of C, of C^2 and of |C| over each sum's elements.
        pred: the predicted sum (times alpha).
        x1, xinf: 1- and inf-norm over k of sum_i x_ik^2 for the summed block (times alpha^2);
        xs1, xsinf: the same of s_k^2 (times alpha^2); y1, yinf: of y_kj^2 for the other side.
        nu: largest multiplicity of a repeated row in the block, or its low-entropy rows' count.
        low: bool, the sum's rows and columns are low-entropy.
        ex, ey: the block's and the column's scale exponents.
        d2, da: sums of addend^2 and |addend| (reference addmm/linear bias), or None.
        t: sum_i sum_k |alpha x_ik| |y_kj| (K <= SMALL_K), or None.
        nsub: how many of the sum's stored elements are below the output dtype's normal range
            (their rounding is absolute); None: all bs of them.
    """
    q = holder(x1, xinf, y1, yinf)
    qs = holder(xs1, xsinf, y1, yinf)
    prod = c.p_s2 * s2 + c.p_q * q
    if d2 is not None:
        prod = prod + c.p_d2 * d2
    # a corrupted sum may overflow its square: clamped, a huge error stays an alarm, not unverified
    big = torch.finfo(s1.dtype).max
    # the check's own sums over the block (of C, of the block's rows) add repeated rows' equal
    # values nu times over: their roundings repeat too, as the product's do
    check = c.c_p2 * torch.clamp(pred * pred, max=big) + c.c_qs * qs \
        + nu * (c.c_s12 * torch.clamp(s1 * s1, max=big) + c.c_s2 * s2 + c.c_q * q)
    # A term whose coefficient is 0 is skipped (a torch op costs microseconds whatever its size):
    # it adds exactly 0 where its operands are finite, and NaN (0 * inf) where one is not, which
    # 0 * the largest of the skipped terms' operands (all >= 0) still does. (Skipped, eta is
    # 2^-1000: its square is 0.)
    skipped = []
    split = None
    if c.eta_log2 > -1000.0 or c.eta_absolute:
        # the checksums' split error (``prepass.split_error``): at most eta a checksum, of one sign
        # over every k where the checksums are equal, so deterministic: times |y_kj| summed over
        # k, at most sqrt(K y1)
        eta = torch.exp2(torch.clamp(c.eta_log2 - c.eta_absolute * ex, min=-1000.0))
        split = eta * torch.sqrt(c.k * y1)
    else:
        skipped.append(y1)
    apred = pred.abs()
    thr = c.lam * torch.sqrt(nu * prod + check) + c.bias * apred
    if c.directed:
        thr = thr + c.directed * (0.5 * apred + torch.sqrt(q / 3))
    else:
        skipped += [apred, q]
    if c.directed_chk:
        thr = thr + c.directed_chk * (0.5 * apred + torch.sqrt(qs / 3))
    else:
        skipped += [qs] if c.directed else [apred, qs]
    # low entropy: errors of one sign per product term, so in the terms' magnitudes (at most
    # sqrt(bs k Q) by Cauchy-Schwarz), not only |C|'s (which cancellation makes small); an addend
    # that starts the accumulator rounds at its own size at every step
    tq = math.sqrt(c.bs * max(c.k, 1.0)) * torch.sqrt(q)      # (two roots: bs K q may overflow)
    mag = torch.maximum(sa, tq)
    if da is not None:
        mag = mag + 2 * da
    thr = thr + torch.where(low, c.lowent * mag, torch.zeros_like(sa))
    # the check's own sums add a repeated row's (or a few-valued block's) equal values in order:
    # in one binade each addition rounds the same way, up to (nu / 2) u of their magnitude
    if c.rep:                   # (only where rows repeat: elsewhere an overflowing sum is no NaN)
        thr = thr + torch.where(nu > 1, c.rep * (nu - 1) * (sa + tq), torch.zeros_like(sa))
    if c.out:
        thr = thr + c.out * sa
    else:
        skipped.append(sa)
    if skipped:
        largest = skipped[0]
        for z in skipped[1:]:
            largest = torch.maximum(largest, z)
        thr = thr + 0.0 * largest
    if c.out_add and da is not None:
        thr = thr + c.out_add * da
    nout = c.bs if nsub is None else nsub
    uf = _underflow(c, ex, ey, x1, y1, nout, torch.exp2, torch.sqrt)
    thr = thr + uf
    if split is not None:
        thr = thr + split
    if c.cap and t is not None:
        # the worst case holds the underflow and the split error too (a GEMM that flushes its
        # subnormal products to zero is off by all of them, whatever t is)
        w = c.w_t * t + c.w_sa * sa + uf
        if da is not None:
            w = w + (c.w_da + c.out_add) * da
        if split is not None:
            w = w + split
        thr = torch.minimum(thr, w * c.w_scale)
    return torch.clamp(thr, min=FLOOR)


POW2_SPLIT = 1000.0


def pow2_factors(x):
    """(2^min(x, POW2_SPLIT), 2^(x - min(x, POW2_SPLIT))) for x (float64, at most 2000: a sum of
    two exponents clamped to +-1000): 2^x alone overflows past 2^1023 where a value it scales
    does not (float64 operands near 2^-1000 and 2^-60). v * hi * lo is v 2^x exactly wherever that
    is a double. The compiled check splits so too (``pow2_hi``, ``pow2_lo``)."""
    hi = x.clamp(max=POW2_SPLIT)
    return torch.exp2(hi), torch.exp2(x - hi)


def _times_pow2(x, e):
    """x 2^e for a tensor e (at least -1000) in two factors (``pow2_factors``)."""
    hi, lo = pow2_factors(e.clamp(min=-1000.0))
    return x * hi * lo


def _underflow(c, ex, ey, x1, y1, nout, exp2, sqrt):
    """Deterministic underflow allowance in scaled units: eta_acc per product term, eta_out per
    stored element below the normal range, flushed inputs, eta_acc per product of the predicted
    dot product (the fused kernels' checksum parts, in units of 2^ex already: times 2^-ey)."""
    uf = _times_pow2(c.bs * c.k * c.eta_acc + nout * c.eta_out, -(ex + ey))
    if c.ftz:
        uf = uf + c.ftz * (c.bs * exp2(-ex) * sqrt(c.k * y1) + exp2(-ey) * sqrt(c.bs * c.k * x1))
    if c.chk_parts:
        uf = uf + _times_pow2(c.k * c.chk_parts * c.eta_acc, -ey)
    return uf


try:
    import triton
    import triton.language as tl
except ImportError:             # the reference backend needs no triton
    triton = None

COEF_FIELDS = ("lam", "k", "bs", "p_s2", "p_q", "c_p2", "c_qs", "c_s12", "c_s2", "c_q", "bias",
               "lowent", "directed", "eta_acc_log2", "ftz", "w_t", "w_sa", "w_scale", "directed_chk",
               "eta_log2", "eta_absolute", "chk_parts")


def pack(*coefs, device=None):
    """(len(coefs), len(COEF_FIELDS)) float32: the coefficients as ``threshold_tl`` loads them.
    The fused kernels' sums are fp32 trees, not the reference's ordered sums: no ``rep`` term."""
    if any(c.rep for c in coefs):
        raise ValueError("threshold.pack: rep must be 0 for the fused kernels (their checks are float32)")
    return torch.tensor([[float(getattr(c, f)) for f in COEF_FIELDS] for c in coefs],
                        dtype=torch.float32, device=device)


if triton is not None:
    _FLOOR = tl.constexpr(FLOOR)
    _BIG = tl.constexpr(3.4028234663852886e38)     # float32's largest finite value

    @triton.jit
    def pow2_tl(e):
        """2^e, exactly, for float e holding an integer (clamped to the normal float32 range)."""
        ei = tl.minimum(tl.maximum(e, -126.0), 127.0).to(tl.int32)
        return ((ei + 127) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def times_pow2_tl(x, e):
        """x 2^e for float e holding an integer, in two factors (``pow2_tl`` clamps one 2^e to
        float32's normal range): the float32 nearest x 2^e for e in [-252, 254]."""
        h = tl.floor(e * 0.5)
        return (x * pow2_tl(h)) * pow2_tl(e - h)

    @triton.jit
    def holder_tl(x1, xinf, y1, yinf):
        return tl.minimum(x1 * yinf, xinf * y1)

    @triton.jit
    def threshold_tl(coef_ptr, s1, s2, sa, pred, x1, xinf, xs1, xsinf, y1, yinf, nu, low, ex, ey, t,
                     CAP: tl.constexpr):
        """``threshold`` in Triton, term for term, for the fused kernel: no addend (the kernel checks
        the accumulator before its epilogue) and no output rounding (u_out = 0). ``coef_ptr``: one
        row of ``pack`` (the order of COEF_FIELDS)."""
        # holder_tl, inline (a nested call costs milliseconds under the interpreter)
        q = tl.minimum(x1 * yinf, xinf * y1)
        qs = tl.minimum(xs1 * yinf, xsinf * y1)
        return threshold_q_tl(coef_ptr, s1, s2, sa, pred, q, qs, x1, y1, nu, low, ex, ey, t, CAP)

    @triton.jit
    def threshold_q_tl(coef_ptr, s1, s2, sa, pred, q, qs, x1, y1, nu, low, ex, ey, t,
                       CAP: tl.constexpr):
        """``threshold_tl`` given Q = sum_k x_k^2 y_k^2 and Qs = sum_k s_k^2 y_k^2 (or bounds of
        them) instead of the norms Hoelder's inequality bounds them with: the row check
        (``kernels/rowcheck.py``) computes them on the tensor cores."""
        lam = tl.load(coef_ptr + 0)
        k = tl.load(coef_ptr + 1)
        bs = tl.load(coef_ptr + 2)
        p_s2 = tl.load(coef_ptr + 3)
        p_q = tl.load(coef_ptr + 4)
        c_p2 = tl.load(coef_ptr + 5)
        c_qs = tl.load(coef_ptr + 6)
        c_s12 = tl.load(coef_ptr + 7)
        c_s2 = tl.load(coef_ptr + 8)
        c_q = tl.load(coef_ptr + 9)
        bias = tl.load(coef_ptr + 10)
        lowent = tl.load(coef_ptr + 11)
        directed = tl.load(coef_ptr + 12)
        eta_acc_log2 = tl.load(coef_ptr + 13)
        ftz = tl.load(coef_ptr + 14)
        w_t = tl.load(coef_ptr + 15)
        w_sa = tl.load(coef_ptr + 16)
        w_scale = tl.load(coef_ptr + 17)
        directed_chk = tl.load(coef_ptr + 18)
        eta_log2 = tl.load(coef_ptr + 19)
        eta_absolute = tl.load(coef_ptr + 20)
        chk_parts = tl.load(coef_ptr + 21)
        prod = p_s2 * s2 + p_q * q
        # a corrupted sum may overflow its square: clamped, a huge error stays an alarm
        check = c_p2 * tl.minimum(pred * pred, _BIG) + c_qs * qs \
            + nu * (c_s12 * tl.minimum(s1 * s1, _BIG) + c_s2 * s2 + c_q * q)
        # the checksums' split error, deterministic (``threshold``); eta clamped below at 2^-126
        # (bf16's 2^-134, fp32's 2^-150, none's 2^-1000: at most 2^-126 K, below FLOOR)
        split = pow2_tl(eta_log2 - eta_absolute * ex) * tl.sqrt(k * y1)
        thr = lam * tl.sqrt(nu * prod + check) + bias * tl.abs(pred)
        thr = thr + directed * (0.5 * tl.abs(pred) + tl.sqrt(q / 3))
        thr = thr + directed_chk * (0.5 * tl.abs(pred) + tl.sqrt(qs / 3))
        mag = tl.maximum(sa, tl.sqrt(bs * tl.maximum(k, 1.0)) * tl.sqrt(q), propagate_nan=tl.PropagateNan.ALL)
        thr = thr + tl.where(low, lowent * mag, 0.0)
        # eta_acc per product term and per product of the predicted dot product (2^-150 in two
        # factors: one 2^e is clamped at float32's smallest normal)
        uf = times_pow2_tl(bs * k, eta_acc_log2 - (ex + ey)) + times_pow2_tl(k * chk_parts, eta_acc_log2 - ey)
        # ftz into each power of two first: 2^-ey alone times the norm overflows for a row near the
        # smallest normal, and 0 * inf (no flush) made the threshold NaN, then the floor
        uf += (ftz * pow2_tl(-ex)) * bs * tl.sqrt(k * y1) + (ftz * pow2_tl(-ey)) * tl.sqrt(bs * k * x1)
        thr = thr + uf
        thr = thr + split
        if CAP:
            thr = tl.minimum(thr, (w_t * t + w_sa * sa + uf + split) * w_scale)
        return tl.maximum(thr, _FLOOR)
