"""What the tensor cores' fp32 accumulation does, measured: how many products go into one rounding,
how many bits below the largest term survive the alignment, and which way the result is rounded.
The threshold assumes one directed rounding per 8 products on a GPU
(``triton_gemm.accumulation``); this probe tests that assumption on the card at hand.

The probe is ``tl.dot`` in a K loop with an fp32 accumulator, the main kernel's own pattern, on
crafted rows: every product is exact (one operand is all ones), so the result is a sum of known
terms whose exact value, and the value under each candidate model, is computed in Python's
integers. A model is (g, F, mode): groups of g consecutive products are added to the accumulator
at once; every term of the group and the accumulator is first cut (toward zero) to F bits below
the largest's 24-bit significand (F = None: kept exactly); the group's sum is rounded to fp32
toward zero (rz) or to nearest even (rn). An FMA chain is (1, None, rn). The report lists the
models that agree with every row.

The rows (``big`` = 2^s, ``h`` = half an ulp of big in fp32; s puts every value in the dtype's
normal range): big then h at positions 1 and q (one rounding per group keeps h + h = one ulp only
if 1 and q share a group), h at 0 and 1 then big at P (the h's reach the accumulator first if P
starts a later group), big with one term of x ulps for several x and signs (the rounding's
direction), big + big + x ulps (the sum carries into a new binade, so the group's rounding shows
even where the alignment keeps no extra bits), big followed by n quarter-ulps (how often the small
terms are rounded away).
"""
import itertools
import math
from fractions import Fraction

import torch
import triton
import triton.language as tl

GROUPS = (1, 2, 4, 8, 16, 32, 64)
EXTRA_BITS = (0, 1, 2, 3, None)
MODES = ("rz", "rn")
ASSUMED_GROUP = 8         # triton_gemm.accumulation on a GPU: blocked(K, 8, directed=True)
SCALE = {torch.bfloat16: 0, torch.float16: 10, torch.float32: 0}    # s: big = 2^s


@triton.jit
def _probe_kernel(a_ptr, b_ptr, c_ptr, K, stride_am, stride_bk, stride_cm,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  ALLOW_TF32: tl.constexpr):
    pid = tl.program_id(0)
    rm = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ks in range(0, tl.cdiv(K, BLOCK_K)):
        kk = ks * BLOCK_K + rk
        a = tl.load(a_ptr + rm[:, None] * stride_am + kk[None, :], mask=kk[None, :] < K, other=0.0)
        b = tl.load(b_ptr + kk[:, None] * stride_bk + rn[None, :], mask=kk[:, None] < K, other=0.0)
        acc += tl.dot(a, b, allow_tf32=ALLOW_TF32)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :], acc)


def rows(dtype, k):
    """The probe's rows: a list of (label, [product terms as Fractions]) with every term exact in
    ``dtype`` (and tf32)."""
    s = SCALE[dtype]
    big = Fraction(2) ** s
    ulp = Fraction(2) ** (s - 23)
    h = ulp / 2
    out = []
    for q in range(2, k):
        t = [Fraction(0)] * k
        t[0], t[1], t[q] = big, h, h
        out.append((f"pair q={q}", t))
    for p in range(2, k):
        t = [Fraction(0)] * k
        t[0], t[1], t[p] = h, h, big
        out.append((f"before P={p}", t))
    for x, sb, sx in itertools.product((Fraction(1, 4), Fraction(1, 2), Fraction(3, 4),
                                        Fraction(5, 4), Fraction(3, 2)), (1, -1), (1, -1)):
        t = [Fraction(0)] * k
        t[0], t[1] = sb * big, sx * x * ulp
        out.append((f"direction {'+' if sb > 0 else '-'}big {'+' if sx > 0 else '-'}{x}ulp", t))
    for x, j, sign in itertools.product((1, 3, 5, 7), (2, k - 1), (1, -1)):
        t = [Fraction(0)] * k
        t[0], t[1], t[j] = sign * big, sign * big, sign * x * ulp
        out.append((f"carry {'+' if sign > 0 else '-'}2big {x}ulp at {j}", t))
    for n in range(1, k):
        t = [Fraction(0)] * k
        t[0] = big
        for i in range(1, n + 1):
            t[i] = ulp / 4
        out.append((f"quarters n={n}", t))
    return out


FIX = 96         # terms are held as integers in units of 2^-FIX: every probe value is exact there


def _round24(x, mode):
    """The integer x rounded to a 24-bit significand (fp32 without range limits): rz or rn (ties
    to even)."""
    shift = abs(x).bit_length() - 24
    if shift <= 0:
        return x
    n, rest = divmod(abs(x), 1 << shift)
    if mode == "rn" and (2 * rest > (1 << shift) or (2 * rest == (1 << shift) and n % 2)):
        n += 1
    return (n << shift) if x > 0 else -(n << shift)


def _cut(x, shift):
    """x cut toward zero to a multiple of 2^shift."""
    return (abs(x) >> shift << shift) * (1 if x >= 0 else -1)


def simulate(terms, g, extra, mode):
    """The fp32 result of adding ``terms`` (Fractions) under model (g, extra, mode) (module
    docstring), as a Fraction."""
    ints = [int(t * (1 << FIX)) for t in terms]
    acc = 0
    for i in range(0, len(ints), g):
        group = [acc] + ints[i:i + g]
        top = max(abs(t).bit_length() for t in group)
        if top == 0:
            continue
        if extra is not None:
            shift = top - 24 - extra
            if shift > 0:
                group = [_cut(t, shift) for t in group]
        acc = _round24(sum(group), mode)
    return Fraction(acc, 1 << FIX)


def models():
    return list(itertools.product(GROUPS, EXTRA_BITS, MODES))


def fit(observed, cases):
    """Every model (g, F, mode) with the number of rows ``cases[i]`` whose result differs from
    ``observed[i]``, fewest first."""
    out = []
    for g, f, mode in models():
        miss = sum(Fraction(float(o)) != simulate(t, g, f, mode) for o, (_, t) in zip(observed, cases))
        out.append(dict(group=g, extra_bits=f, rounding=mode, mismatches=miss))
    return sorted(out, key=lambda r: r["mismatches"])


def measure(dtype=torch.bfloat16, k=64, block_k=None, device="cuda"):
    """Run the probe on ``device`` and return its report: the rows' results as multiples of an
    ulp of big, and the models consistent with all of them."""
    cases = rows(dtype, k)
    m = len(cases)
    bm, bn = 64, 16
    mp = -(-m // bm) * bm
    a = torch.zeros(mp, k, dtype=torch.float64)
    for i, (_, t) in enumerate(cases):
        a[i] = torch.tensor([float(x) for x in t], dtype=torch.float64)
    run_dtype = torch.float32 if dtype == torch.float32 else dtype
    a = a.to(run_dtype).to(device)
    b = torch.ones(k, bn, dtype=run_dtype, device=device)
    c = torch.empty(mp, bn, dtype=torch.float32, device=device)
    bk = block_k or (64 if k >= 64 else 16)
    _probe_kernel[(mp // bm,)](a, b, c, k, a.stride(0), b.stride(0), c.stride(0),
                               BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                               ALLOW_TF32=dtype == torch.float32)
    observed = c[:m, 0].double().cpu().tolist()
    s = SCALE[dtype]
    ulp = 2.0 ** (s - 23)
    ranked = fit(observed, cases)
    found = [r for r in ranked if r["mismatches"] == 0]
    return dict(dtype=str(dtype).replace("torch.", "") + ("/tf32" if dtype == torch.float32 else ""),
                k=k, block_k=bk, rows=len(cases),
                results={label: (o - float(sum(t))) / ulp for o, (label, t) in zip(observed, cases)},
                consistent=found, nearest=ranked[:3],
                # the threshold's model: one directed rounding per ASSUMED_GROUP products; it
                # counts no fewer roundings than the card makes if every consistent model
                # groups at least as many products
                assumed_group=ASSUMED_GROUP,
                no_more_roundings_than_assumed=(all(f["group"] >= ASSUMED_GROUP for f in found)
                                                if found else None))
