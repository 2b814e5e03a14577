"""The draws of the structured-values fuzz of 2026-12-06 (clean products of constant, few-valued,
integer, sparse, heavy-tailed and mixed-scale operands, in odd layouts and tiles, with addends),
so that a case it found replays from its seed: ``case(seed)`` -> (a, b, c, check kwargs) or None
where the fuzz skipped the seed. Its values are ``benchmarks/fuzzcheck.py``'s (on the path in
tests), the fuzz kept for new searches, with one more kind; its shapes and addends its own."""
import random

import torch
from fuzzcheck import DTYPES, VALUES, _layout, _values

# its kinds of values: fuzzcheck's, and one more that draws normal values (then maybe scaled, as
# every kind may be)
KINDS = VALUES + ("scaled",)


def case(seed):
    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    dt = rnd.choice(DTYPES)
    m = rnd.choice([rnd.randint(1, 8), rnd.randint(1, 300)])
    k = rnd.choice([rnd.randint(1, 70), rnd.randint(1, 700)])
    n = rnd.randint(1, 200)
    batch = rnd.choice([(), (), (rnd.randint(1, 4),), (2, rnd.randint(1, 3))])
    bm, bn = rnd.choice([1, 3, 16, 32, 64, 256]), rnd.choice([1, 5, 16, 32, 64, 256])
    a = _values(rnd, g, (*batch, m, k), dt, KINDS)[0]
    b = _values(rnd, g, (k, n) if rnd.random() < 0.4 else (*batch, k, n), dt, KINDS)[0]
    a, b = _layout(rnd, a), _layout(rnd, b)
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return None
    kw = dict(bm=bm, bn=bn)
    if rnd.random() < 0.35 and not batch:
        alpha = rnd.choice([1.0, -1.0, 0.5, 2.0, 3.3, -0.7])
        beta = rnd.choice([1.0, 0.0, 2.0, -0.5, 0.3])
        shape = rnd.choice(["vec", "mat", "row"])
        d = _values(rnd, g, (n,) if shape == "vec" else (m, n) if shape == "mat" else (1, n), dt, KINDS)[0]
        if not torch.isfinite(d).all():
            return None
        c = torch.addmm(d, a, b, alpha=alpha, beta=beta)
        kw.update(addend=d if beta != 0 else None, alpha=alpha, beta=beta if beta != 0 else 1.0)
        if beta == 0 and alpha == 1.0:
            kw.pop("alpha")
    else:
        c = torch.matmul(a, b)
    if not torch.isfinite(c).all():
        return None
    return a, b, c, kw
