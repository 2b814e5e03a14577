"""Fuzz the reference check's verdicts (``python benchmarks/fuzzcheck.py [--family F] [--seconds S]
[--seed N] [--against DIR]``): random clean products, each case drawn from its seed alone.

- a clean product (torch computed it) that alarms in either check is a false alarm;
- the compiled check and the torch oracle (``reference.check_torch``) must agree on every tile's
  status and alarm;
- each product again with one element set to another value: how often each check alarms (and, with
  ``--against`` another commit's ``kernels/``, that one's compiled check: caught by one, not the
  other).

Families: ``extreme`` (operands near each dtype's smallest and largest scaled ranges, small
shapes, alpha, beta, a bias), ``structured`` (normal, uniform, heavy-tailed, few-valued,
constant-row, mixed-scale, sparse and integer values; batches and broadcast B; row-major,
column-major and padded layouts; addends), ``kernel`` (the fused kernel, ``checked_gemm``, on
structured values in its dtypes: M, N up to 70 and K up to 300, batches, a bias, tiles 16-64; a
clean product that alarms is a false alarm; then again with a value added to one accumulator
element in the kernel; needs TRITON_INTERPRET=1 or a GPU: about a second a case interpreted),
``grouped`` (``abft.grouped_mm`` through the API on ``--backend``, forward and both gradients:
every form of torch's grouped product, structured values in float32, bfloat16 and float16, up to
five groups of 0 to 33 rows; any alarm of a clean case is a false alarm; then again with a value
added to one group's forward output).
One line per finding (JSON: kind, seed, and what the case was), then a summary line. ``--seed``
starts the seeds; a finding's seed replays it alone (``--seed N --cases 1``).
"""
import argparse
import json
import math
import pathlib
import random
import sys
import time

import torch

from abft.bench import results
from abft.kernels import layout as L
from abft.kernels import reference

FAMILIES = ("extreme", "structured", "kernel", "grouped")
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# the extreme family's operand scales, per dtype (powers of two near its ranges' edges, and 1)
SCALES = {torch.float64: (-511, -520, -530, 500, 508, 511, 0), torch.float32: (60, 62, -63, -70, 0),
          torch.bfloat16: (60, 62, -63, 0), torch.float16: (6, 7, -7, 0)}
# the structured family's powers of two (half the dtype's exponent range, about)
SPAN = {torch.float32: (-35, 30), torch.float64: (-265, 250), torch.bfloat16: (-35, 30), torch.float16: (-6, 3)}
VALUES = ("normal", "upos", "cauchy", "lowent", "const_rows", "mixed_rows", "mixed_cols", "sparse", "ints")
# the kernel family's: also "split", one large column beside tiny positive values of a narrow range
# (checksums near the bottom of their parts' precision that may all round one way; the fused
# kernel's fp16 false alarm of 2026-12-07 was of this shape). Not in VALUES: that would move the
# reference families' cases, which tests/fuzzcases.py replays by seed.
KERNEL_VALUES = VALUES + ("split",)


def _values(rnd, g, shape, dt, kinds=VALUES):
    """Values of one kind drawn from ``kinds`` (a kind not listed above: normal values), in ``dt``."""
    kind = rnd.choice(kinds)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    if kind == "upos":
        x = torch.rand(*shape, generator=g, dtype=torch.float64)
    elif kind == "cauchy":
        x = torch.tan((torch.rand(*shape, generator=g, dtype=torch.float64) - 0.5) * 3.1)
    elif kind == "lowent":
        vals = torch.randn(rnd.randint(1, 4), generator=g, dtype=torch.float64)
        x = vals[torch.randint(len(vals), shape, generator=g)]
    elif kind == "const_rows":
        x = torch.randn(*shape[:-1], 1, generator=g, dtype=torch.float64).expand(*shape).clone()
    elif kind == "mixed_rows":
        x = x * torch.exp2(torch.randint(-20, 21, (*shape[:-1], 1), generator=g).double())
    elif kind == "mixed_cols":
        x = x * torch.exp2(torch.randint(-20, 21, (shape[-1],), generator=g).double())
    elif kind == "sparse":
        x = x * (torch.rand(*shape, generator=g) < 0.1)
    elif kind == "ints":
        x = torch.randint(-3, 4, shape, generator=g).double()
    elif kind == "split":
        x = (1.5 + 0.2 * torch.rand(*shape, generator=g, dtype=torch.float64)) * 2.0 ** rnd.randint(-34, -14)
        x[..., 0] = 2.0 ** rnd.randint(0, 10)
    if rnd.random() < 0.3:
        x = x * 2.0 ** rnd.randint(*SPAN[dt])
    return x.to(dt), kind


def _layout(rnd, x):
    r = rnd.random()
    if r < 0.25:
        return x.mT.contiguous().mT                      # column-major
    if r < 0.35:                                         # rows padded (a view of a wider matrix)
        w = torch.zeros(*x.shape[:-1], x.shape[-1] + rnd.randint(1, 9), dtype=x.dtype)
        w[..., :x.shape[-1]] = x
        return w[..., :x.shape[-1]]
    return x


def draw(family, seed):
    """(a, b, c, check kwargs, description) of the case ``seed``, or None (a non-finite operand or
    product: not a clean case)."""
    rnd, g = random.Random(seed), torch.Generator().manual_seed(seed)
    dt = rnd.choice(DTYPES)
    f64 = torch.float64
    if family == "extreme":
        m, k, n = rnd.randint(1, 90), rnd.randint(1, 130), rnd.randint(1, 90)
        bm, bn = rnd.choice((4, 16, 32, 64)), rnd.choice((4, 16, 32, 64))
        batch = ()
        ea, eb = rnd.choice(SCALES[dt]), rnd.choice(SCALES[dt])
        a = (torch.randn(m, k, generator=g, dtype=f64) * 2.0 ** ea).to(dt)
        b = (torch.randn(k, n, generator=g, dtype=f64) * 2.0 ** eb).to(dt)
        what = dict(scales=(ea, eb))
        bias = rnd.random() < 0.3
        shape_d = (n,)
    else:
        m = rnd.choice((rnd.randint(1, 8), rnd.randint(1, 300)))
        k = rnd.choice((rnd.randint(1, 70), rnd.randint(1, 700)))
        n = rnd.randint(1, 200)
        batch = rnd.choice(((), (), (rnd.randint(1, 4),), (2, rnd.randint(1, 3))))
        bm, bn = rnd.choice((1, 3, 16, 32, 64, 256)), rnd.choice((1, 5, 16, 32, 64, 256))
        a, ka = _values(rnd, g, (*batch, m, k), dt)
        b, kb = _values(rnd, g, (k, n) if rnd.random() < 0.4 else (*batch, k, n), dt)
        a, b = _layout(rnd, a), _layout(rnd, b)
        what = dict(values=(ka, kb), batch=batch)
        bias = rnd.random() < 0.35 and not batch
        shape_d = rnd.choice(((n,), (m, n), (1, n)))
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return None
    alpha = rnd.choice((1.0, -1.0, 0.5, 3.0, 3.3, -0.7))
    kw = dict(bm=bm, bn=bn)
    if bias:
        beta = rnd.choice((1.0, 2.0, -0.5, 0.3))
        d = (torch.randn(*shape_d, generator=g, dtype=f64) * 2.0 ** (rnd.choice(SCALES[dt]) if family == "extreme" else 0)).to(dt)
        if not torch.isfinite(d).all():
            return None
        c = torch.addmm(d, a, b, alpha=alpha, beta=beta)
        kw.update(addend=d, alpha=alpha, beta=beta)
    elif alpha != 1.0 and not batch:
        c = torch.addmm(torch.zeros(n, dtype=dt), a, b, beta=0.0, alpha=alpha)
        kw.update(alpha=alpha)
    else:
        c = torch.matmul(a, b)
    if not torch.isfinite(c).all():
        return None
    kw["units"] = reference.units_for(c)
    what.update(dtype=str(dt).replace("torch.", ""), mkn=(m, k, n), tiles=(bm, bn),
                alpha=kw.get("alpha", 1.0), bias=bias)
    return a, b, c, kw, what


def _alarmed(v):
    return bool(L.alarmed(v).any())


def draw_kernel(seed):
    """(a, b, checked_gemm kwargs, description) of the kernel family's case ``seed``, or None."""
    rnd, g = random.Random(seed), torch.Generator().manual_seed(seed)
    dt = rnd.choice((torch.float32, torch.bfloat16, torch.float16))
    m, k, n = rnd.randint(1, 70), rnd.choice((rnd.randint(1, 40), rnd.randint(1, 300))), rnd.randint(1, 70)
    batch = rnd.choice(((), (), (rnd.randint(1, 3),)))
    a, ka = _values(rnd, g, (*batch, m, k), dt, KERNEL_VALUES)
    b, kb = _values(rnd, g, (k, n) if rnd.random() < 0.5 else (*batch, k, n), dt, KERNEL_VALUES)
    a, b = _layout(rnd, a), _layout(rnd, b)
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return None
    kw = dict(tiles=rnd.choice((None, (32, 32), (16, 64), (64, 16))))
    if rnd.random() < 0.3 and not batch:
        kw["bias"] = _values(rnd, g, (n,), dt)[0]
        if not torch.isfinite(kw["bias"]).all():
            return None
    return a, b, kw, dict(values=(ka, kb), batch=batch, dtype=str(dt).replace("torch.", ""), mkn=(m, k, n),
                          tiles=kw["tiles"], bias="bias" in kw)


def run_kernel(seconds=60.0, seed=0, cases=None, out=None):
    """The kernel family (``run``'s arguments and summary)."""
    from abft.kernels import triton_gemm
    out = out or sys.stdout
    s = dict(family="kernel", seeds=[seed, seed], clean=0, false_alarms=0, corrupted=0, caught=0)
    t0, seed0 = time.time(), seed
    while (time.time() - t0 < seconds) if cases is None else (seed - seed0 < cases):
        case = draw_kernel(seed)
        seed += 1
        if case is None:
            continue
        a, b, kw, what = case
        c, v, _ = triton_gemm.checked_gemm(a, b, **kw)
        if not torch.isfinite(c).all():
            continue
        s["clean"] += 1
        if _alarmed(v):
            s["false_alarms"] += 1
            print(json.dumps(dict(kind="false_alarm", seed=seed - 1,
                                  worst=float(torch.maximum(v[..., L.ROW_RATIO], v[..., L.COL_RATIO]).max()),
                                  **what)), file=out, flush=True)
        rnd = random.Random(seed - 1 + 10 ** 9)
        value = rnd.choice((80.0, 1e4, -3.0, 1e-3)) * float(c.abs().max().clamp_min(1))
        hit = dict(kind="add", batch=rnd.randrange(c.shape[0]) if c.dim() == 3 else 0,
                   row=rnd.randrange(c.shape[-2]), col=rnd.randrange(c.shape[-1]), k_step=0, value=value)
        s["corrupted"] += 1
        s["caught"] += _alarmed(triton_gemm.checked_gemm(a, b, **kw, inject=hit)[1])
    s["seeds"][1] = seed
    print(json.dumps(dict(kind="summary", **s)), file=out, flush=True)
    return s


def draw_grouped(seed):
    """(a, b, offs, description) of the grouped family's case ``seed``, or None: sizes in
    multiples of 16 bytes, as torch's grouped product takes them."""
    rnd, g = random.Random(seed), torch.Generator().manual_seed(seed)
    dt = rnd.choice((torch.float32, torch.bfloat16, torch.float16))
    q = 16 // dt.itemsize
    sizes = [rnd.choice((0, 1, 2, 3, 7, 16, 33)) for _ in range(rnd.randint(1, 5))]
    t = q * max(1, -(-sum(sizes) // q) + rnd.randint(0, 1))       # rows past the groups too
    m, k, n = (q * rnd.randint(1, 6) for _ in range(3))
    form = rnd.choice(("2d3d", "2d2d", "3d2d", "3d3d"))
    shapes = {"2d3d": ((t, k), (len(sizes), k, n)), "2d2d": ((m, t), (t, n)),
              "3d2d": ((len(sizes), m, k), (k, t)), "3d3d": ((len(sizes), m, k), (len(sizes), k, n))}[form]
    (a, ka), (b, kb) = (_values(rnd, g, s, dt) for s in shapes)
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return None
    offs = None if form == "3d3d" else torch.tensor(sizes).cumsum(0).to(torch.int32)
    return a, b, offs, dict(form=form, values=(ka, kb), dtype=str(dt).replace("torch.", ""),
                            groups=sizes, shapes=shapes)


def run_grouped(seconds=60.0, seed=0, cases=None, backend="reference", out=None):
    """The grouped family (``run``'s arguments, and the backend; the summary)."""
    import abft
    out = out or sys.stdout
    s = dict(family="grouped", backend=backend, seeds=[seed, seed], clean=0, false_alarms=0,
             products=0, corrupted=0, caught=0)
    t0, seed0 = time.time(), seed
    with abft.config(backend=backend):
        while (time.time() - t0 < seconds) if cases is None else (seed - seed0 < cases):
            case = draw_grouped(seed)
            seed += 1
            if case is None:
                continue
            a, b, offs, what = case
            abft.reset()
            a.requires_grad_(), b.requires_grad_()
            y = abft.grouped_mm(a, b, offs)
            if not torch.isfinite(y).all():
                continue
            (y.float() * torch.randn(y.shape, generator=torch.Generator().manual_seed(seed))).sum().backward()
            found = abft.flush()
            s["clean"] += 1
            s["products"] += abft.stats().get("checked_calls", 0)
            if found:
                s["false_alarms"] += 1
                print(json.dumps(dict(kind="false_alarm", seed=seed - 1, alarms=len(found),
                                      phase=found[0].phase, group=found[0].labels.get("group"),
                                      worst=max((abs(al.residual) / al.threshold for al in found if al.threshold),
                                                 default=None), **what)), file=out, flush=True)
            rnd = random.Random(seed - 1 + 10 ** 9)
            value = rnd.choice((80.0, 1e4, -3.0)) * float(y.detach().abs().max().clamp_min(1))
            fault = abft.inject(when=lambda c: c.phase == "forward", kind="add", value=value, row=0, col=0)
            with fault:
                abft.grouped_mm(a.detach(), b.detach(), offs)
            if fault.hits:                    # (no group computed anything: nothing to corrupt)
                s["corrupted"] += 1
                s["caught"] += bool(abft.flush())
    s["seeds"][1] = seed
    print(json.dumps(dict(kind="summary", **s)), file=out, flush=True)
    return s


def run(family="structured", seconds=60.0, seed=0, cases=None, against=None, out=None):
    """Fuzz from ``seed`` for ``seconds`` (or ``cases`` cases), its lines to ``out`` (stdout);
    returns the summary (a dict)."""
    out = out or sys.stdout
    other = None
    if against is not None:
        here = str(pathlib.Path(__file__).resolve().parent)
        if here not in sys.path:            # run as a script under PYTHONSAFEPATH=1: not on the path
            sys.path.insert(0, here)
        import fixedcost
        other = fixedcost.load_other(against)
    s = dict(family=family, seeds=[seed, seed], clean=0, false_alarms=0, differ=0, corrupted=0,
             caught_compiled=0, caught_torch=0, unverified_compiled=0)
    if other is not None:
        s.update(false_alarms_against=0, caught_against=0, only_this=0, only_against=0)
    t0, seed0 = time.time(), seed
    while (time.time() - t0 < seconds) if cases is None else (seed - seed0 < cases):
        case = draw(family, seed)
        seed += 1
        if case is None:
            continue
        a, b, c, kw, what = case
        vc, vt = reference.check(a, b, c, **kw)[0], reference.check_torch(a, b, c, **kw)[0]
        s["clean"] += 1
        if _alarmed(vc) or _alarmed(vt):
            s["false_alarms"] += 1
            print(json.dumps(dict(kind="false_alarm", seed=seed - 1, compiled=_alarmed(vc), torch=_alarmed(vt),
                                  worst=float(torch.maximum(vc[..., L.ROW_RATIO], vc[..., L.COL_RATIO]).max()),
                                  **what)), file=out, flush=True)
        if not (torch.equal(vc[..., L.STATUS], vt[..., L.STATUS]) and torch.equal(L.alarmed(vc), L.alarmed(vt))):
            s["differ"] += 1
            print(json.dumps(dict(kind="differ", seed=seed - 1, **what)), file=out, flush=True)
        if other is not None and _alarmed(other.check(a, b, c, **kw)[0]):
            s["false_alarms_against"] += 1
        # one element of the first matrix set to another value (from the case's own stream)
        rnd = random.Random(seed - 1 + 10 ** 9)
        c2 = c.clone()
        flat = c2.view(-1, c2.shape[-2], c2.shape[-1])[0]
        i, j = rnd.randrange(c.shape[-2]), rnd.randrange(c.shape[-1])
        flat[i, j] = rnd.choice((80.0, 1e4, float(torch.finfo(c.dtype).max) / 4, -3.0, 1e-3))
        if torch.equal(c2, c):
            continue
        s["corrupted"] += 1
        v1, v2 = reference.check(a, b, c2, **kw)[0], reference.check_torch(a, b, c2, **kw)[0]
        s["caught_compiled"] += _alarmed(v1)
        s["caught_torch"] += _alarmed(v2)
        s["unverified_compiled"] += bool((v1[..., L.STATUS] == L.UNVERIFIED).any())
        if other is not None:
            v3 = other.check(a, b, c2, **kw)[0]
            s["caught_against"] += _alarmed(v3)
            s["only_this"] += _alarmed(v1) and not _alarmed(v3)
            s["only_against"] += _alarmed(v3) and not _alarmed(v1)
    s["seeds"][1] = seed
    print(json.dumps(dict(kind="summary", **s)), file=out, flush=True)
    return s


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="structured", help=f"one of {', '.join(FAMILIES)}")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--cases", type=int, default=None, help="this many seeds instead of --seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--against", metavar="DIR", help="another commit's kernels/ to compare with")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--backend", default="reference", help="the grouped family's: reference | triton")
    results.add_arguments(p, "fuzzcheck")
    args = p.parse_args(argv)
    if args.family not in FAMILIES:
        p.error(f"--family: {args.family!r} is not one of {', '.join(FAMILIES)}")
    if not (args.seconds > 0 and math.isfinite(args.seconds)):
        p.error(f"--seconds: must be a positive number, got {args.seconds}")
    if args.cases is not None and args.cases < 1:
        p.error(f"--cases: must be at least 1, got {args.cases}")
    if args.threads < 1:
        p.error(f"--threads: must be at least 1, got {args.threads}")
    if args.against is not None and not (pathlib.Path(args.against) / "reference.py").is_file():
        p.error(f"--against: no reference.py in {args.against}")
    if args.family in ("kernel", "grouped") and args.against is not None:
        p.error(f"--against: compares reference checks; the {args.family} family has none")
    if args.backend not in ("reference", "triton"):
        p.error(f"--backend: reference or triton, got {args.backend!r}")
    if args.family == "kernel" or args.family == "grouped" and args.backend == "triton":
        from abft.kernels import configs
        if not (configs.interpreting() or torch.cuda.is_available()):
            p.error(f"--family: {args.family} on the fused kernel needs TRITON_INTERPRET=1 or a GPU")
    torch.set_num_threads(args.threads)
    record = results.start(args, "fuzzcheck", argv)
    if args.family == "kernel":
        s = run_kernel(args.seconds, args.seed, args.cases)
    elif args.family == "grouped":
        s = run_grouped(args.seconds, args.seed, args.cases, args.backend)
    else:
        s = run(args.family, args.seconds, args.seed, args.cases, args.against)
    record.write(dict(s, threads=args.threads))
    return s


if __name__ == "__main__":
    main()
