"""The stress set of the checksum threshold: seeded operands of twelve distributions (heavy tails,
outliers, cancellation, repeated rows, LLM-style massive activations) in every dtype. The test
suite's gates (``tests/stress.py``) and ``abft bench --validate`` (on a GPU) draw from here.
"""
import math

import torch

DISTRIBUTIONS = ("gaussian", "uniform", "student_t2", "all_positive", "llm_outliers",
                 "rows_scaled", "cancellation", "constant", "few_values", "duplicate_rows",
                 "near_duplicate_rows", "massive_activations")
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
UNIT = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11,
        torch.bfloat16: 2.0 ** -8}


def operands(dist, m, k, n, dtype, seed):
    """A (m, k) and B (k, n) of one stress case, generated in float64 then cast to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    if dist == "gaussian":
        a, b = r(m, k), r(k, n)
    elif dist == "uniform":
        a = torch.rand(m, k, generator=g, dtype=torch.float64) * 2 - 1
        b = torch.rand(k, n, generator=g, dtype=torch.float64) * 2 - 1
    elif dist == "student_t2":
        t = lambda *s: r(*s) / torch.sqrt(torch.distributions.Chi2(2.0).sample(s).double() / 2)
        torch.manual_seed(seed)
        a, b = t(m, k), t(k, n)
    elif dist == "all_positive":
        a = torch.rand(m, k, generator=g, dtype=torch.float64)
        b = torch.rand(k, n, generator=g, dtype=torch.float64)
    elif dist == "llm_outliers":
        a = r(m, k)
        hot = torch.randperm(k, generator=g)[:max(1, k // 256)]
        a[:, hot] *= 100.0
        b = r(k, n) / math.sqrt(k)
    elif dist == "rows_scaled":
        a = r(m, k) * 10.0 ** (torch.rand(m, 1, generator=g, dtype=torch.float64) * 6 - 3)
        b = r(k, n)
    elif dist == "cancellation":
        h = max(1, k // 2)
        u, v = r(m, h), r(h, n)
        a, b = torch.cat([u, u], 1)[:, :k], torch.cat([v, -v], 0)[:k]
    elif dist == "constant":
        a = torch.full((m, k), 0.1, dtype=torch.float64)
        b = torch.full((k, n), 0.3, dtype=torch.float64)
    elif dist == "few_values":
        a = torch.randint(0, 3, (m, k), generator=g).double() * 0.1 + 0.1
        b = torch.randint(0, 3, (k, n), generator=g).double() * 0.3 + 0.1
    elif dist == "duplicate_rows":
        base = r(max(1, m // 8), k)
        a = base[torch.randint(0, base.shape[0], (m,), generator=g)]
        b = r(k, n)
    elif dist == "near_duplicate_rows":
        # rows that repeat up to 1e-5: their products round alike, so their errors add up
        a = r(1, k) + 1e-5 * r(m, k)
        b = r(k, n)
    elif dist == "massive_activations":
        # a few channels carry one large value shared by every row (LLM "massive activations")
        a = r(m, k)
        hot = torch.randperm(k, generator=g)[:max(1, k // 256)]
        a[:, hot] = 100.0 * r(1, hot.numel())
        b = r(k, n) / math.sqrt(k)
    else:
        raise ValueError(dist)
    if dtype in (torch.float16, torch.bfloat16):
        lim = torch.finfo(dtype).max / 1e3
        a, b = a.clamp(-lim, lim), b.clamp(-lim, lim)
    return a.to(dtype).contiguous(), b.to(dtype).contiguous()


def cases(quick=True):
    """(dist, m, k, n, dtype) of the stress set; quick keeps each case small."""
    ks = (1, 7, 64, 1000, 4096, 16384)
    for dist in DISTRIBUTIONS:
        for k in ks:
            for dt in DTYPES:
                m = n = (96 if k >= 4096 else 160) if quick else 640
                if dt in (torch.float16, torch.bfloat16) and k >= 16384 and quick:
                    m = n = 64
                yield dist, m, k, n, dt
