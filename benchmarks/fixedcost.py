"""The reference check's fixed cost (``python benchmarks/fixedcost.py [--compile]``): what a small
checked product costs beyond the plain one, where the check's torch ops (microseconds each,
whatever their size) dominate.

- api: a 64 x 64 x 64 float32 ``abft.matmul`` + ``abft.flush()`` minus ``a @ b``, the median over
  interleaved pairs after a warm-up, one thread;
- check: ``reference.check`` alone on the same product, and the count of torch ops it issues;
  both rows for the compiled check (``kernels/compiled.py``, the default on the CPU) and for the
  torch check (``reference.check_torch``, its oracle), alternated call by call in one process;
- with ``--alone``: this tree's check only (without the torch check alternating, whose ops evict
  the caches between calls: the steady state of a loop of small products);
- with ``--compile``: the torch check through ``torch.compile`` (inductor, one graph), its compile
  time for the shape, its cost per call, and whether its verdicts equal the eager torch check's;
- with ``--against DIR`` (another commit's ``kernels/``, e.g. from ``git archive``): both rows for
  that check too, alternated call by call with this tree's in one process (separate processes on
  a shared machine differ by more than the change), and whether their verdicts are bit-equal, on
  this product and on ``cases()``.
"""
import argparse
import atexit
import importlib
import inspect
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import abft
from abft.bench import results
from abft.kernels import layout as L
from abft.kernels import reference


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _median_ms(fn, reps, warmup):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def bits_equal(p, q):
    """Two tensors equal bit for bit, NaN where NaN (its sign aside)."""
    return torch.equal(torch.nan_to_num(p, 7.0, 8.0, 9.0), torch.nan_to_num(q, 7.0, 8.0, 9.0)) \
        and torch.equal(p.isnan(), q.isnan())


def _same(x, y):
    """Two checks' (verdict, detail) equal bit for bit, NaN where NaN (its sign aside)."""
    return bits_equal(x[0], y[0]) and all(bits_equal(p, q) for p, q in zip(x[1], y[1]))


def load_other(kernels_dir):
    """Another commit's ``kernels/`` as a package of its own (its imports of ``abft.kernels``
    rewritten), so that its reference module can stand in for this tree's."""
    root = pathlib.Path(tempfile.mkdtemp(prefix="abft_other_"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    pkg = root / "abft_other"
    pkg.mkdir()
    for f in pathlib.Path(kernels_dir).glob("*.py"):
        (pkg / f.name).write_text(f.read_text().replace("abft.kernels", "abft_other"))
    if (pathlib.Path(kernels_dir) / "csrc").is_dir():
        shutil.copytree(pathlib.Path(kernels_dir) / "csrc", pkg / "csrc")
    for name in [m for m in sys.modules if m == "abft_other" or m.startswith("abft_other.")]:
        del sys.modules[name]                     # an earlier call's
    sys.path.insert(0, str(root))
    try:
        return importlib.import_module("abft_other.reference")
    finally:
        sys.path.remove(str(root))


def cases():
    """(a, b, c, kwargs) of the check's special paths: 4 dtypes, odd tiles, column-major and batched
    B, inf/NaN outputs and inputs, addends with alpha/beta, zeros, several chunks, K = 1 and 0."""
    g = torch.Generator().manual_seed(1)
    r = lambda *shape: torch.randn(*shape, generator=g)
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for m, k, n, bm, bn in ((64, 64, 64, 64, 64), (70, 33, 90, 32, 64), (3, 200, 5, 2, 4),
                                (130, 16, 40, 64, 16)):
            a, b = r(m, k).to(dt), r(k, n).to(dt)
            c = a @ b
            t = dict(bm=bm, bn=bn)
            yield a, b, c, t
            yield a, b.t().contiguous().t(), c, t
            c2 = c.clone()
            c2[m // 2, n // 3] = float("inf")
            yield a, b, c2, t
            c3 = c.clone()
            c3[0, 0] = float("nan")
            c3[-1, -1] += 100
            yield a, b, c3, t
            a2 = a.clone()
            a2[-1, -1] = float("nan")
            yield a2, b, a2 @ b, t
            a4 = a.clone()
            a4[0, -1] = float("inf")
            yield a4, b, a4 @ b, t
            c4 = c.clone()                   # a column's |C| and C^2 sums overflow beside a NaN
            c4[0, 0], c4[-1, 0] = torch.finfo(dt).max, -torch.finfo(dt).max
            c4[-1, -1] = float("nan")
            yield a, b, c4, t
            d = r(n).to(dt)
            yield a, b, torch.addmm(d, a, b, alpha=-1.0), dict(t, alpha=-1.0, addend=d)
            yield a, b, torch.addmm(d, a, b, alpha=0.5, beta=2.0), dict(t, alpha=0.5, addend=d, beta=2.0)
            d2 = d.clone()
            d2[0] = float("inf")
            yield a, b, torch.addmm(d2, a, b), dict(t, addend=d2)
            ab, bb = r(3, m, k).to(dt), r(3, k, n).to(dt)
            cb = ab @ bb
            cb[1, 0, 0] = 6e4
            yield ab, bb, cb, t
            yield a * 0, b, (a * 0) @ b, t
        a, b = r(300, 4096).to(dt), r(4096, 200).to(dt)          # several chunks of rows
        yield a, b, a @ b, dict(bm=64, bn=64)
        yield a, b.t().contiguous().t(), a @ b, dict(bm=64, bn=64)
        a3, b3 = r(2, 3, 40, 24).to(dt), r(2, 3, 50, 24).to(dt).mT
        b2 = r(24, 50).to(dt)
        yield a3, b2, a3 @ b2, dict(bm=16, bn=32)                  # batch against 2-D
        yield a3, b3, a3 @ b3, dict(bm=16, bn=32)
        yield a3[..., :1], b3[..., :1, :], a3[..., :1] @ b3[..., :1, :], dict(bm=16, bn=32)
        yield r(5, 0).to(dt), r(0, 7).to(dt), torch.zeros(5, 7).to(dt), dict(bm=4, bn=4)


def equal_on_cases(other):
    """How many of ``cases()`` give bit-equal verdicts and details with ``other``'s check."""
    same = total = 0
    for a, b, c, kw in cases():
        kw = dict(kw, units=reference.units_for(c))
        same += _same(reference.check(a, b, c, **kw), other.check(a, b, c, **kw))
        total += 1
    return same, total


def main(pairs=2000, warmup=200, size=64, compile=False, against=None, alone=False):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(pairs, warmup, size, compile, against, alone)
    finally:
        torch.set_num_threads(threads)


def _as_ops_calls(check):
    """``check`` as abft's ops call ``reference.check`` (``summary=True``: the verdict's summary
    last), for a check without that argument (the torch check, an older commit's)."""
    if "summary" in inspect.signature(check).parameters:
        return check

    def run(*args, summary=False, **kw):
        out = check(*args, **kw)
        return (*out, L.summary(out[0])) if summary else out
    return run


def _measure(pairs, warmup, size, compile, against, alone):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(size, size, generator=g), torch.randn(size, size, generator=g)
    c = a @ b
    kw = dict(bm=size, bn=size, units=reference.units_for(c))
    # only the check is swapped: abft binds reference.weight_stats at import (a protected layer's
    # weights, which this product has none of)
    arms = {"this tree": reference.check}
    if not alone:         # alternated with the torch check, whose 469 ops evict the caches between
        arms["torch"] = _as_ops_calls(reference.check_torch)
    if against is not None:
        other = load_other(against)
        arms["--against"] = _as_ops_calls(other.check)
        on_cases = equal_on_cases(other)
        print(f"special cases: {on_cases[0]} of {on_cases[1]} bit-equal with --against")

    def use(arm):
        reference.check = arms[arm]

    def checked():
        abft.matmul(a, b)
        abft.flush()

    api = {arm: [] for arm in arms}
    check_t = {arm: [] for arm in arms}
    try:
        with abft.config(backend="reference", policy="record"):
            for _ in range(warmup):
                for arm in arms:
                    use(arm)
                    checked()
                    a @ b
                    reference.check(a, b, c, **kw)
            for _ in range(pairs):
                for arm in arms:
                    use(arm)
                    t0 = time.perf_counter()
                    checked()
                    t1 = time.perf_counter()
                    a @ b
                    t2 = time.perf_counter()
                    reference.check(a, b, c, **kw)
                    t3 = time.perf_counter()
                    api[arm].append((t1 - t0) - (t2 - t1))
                    check_t[arm].append(t3 - t2)
    finally:
        use("this tree")
    print(f"{size}x{size}x{size} float32, 1 thread, medians of {pairs} interleaved calls after {warmup}:")
    out = {}
    for arm in arms:
        with _Count() as n:
            verdict = arms[arm](a, b, c, **kw)
        o = dict(api_ms=statistics.median(api[arm]) * 1e3, check_ms=statistics.median(check_t[arm]) * 1e3,
                 ops=n.n, verdict=verdict)
        print(f"  {arm:10s} api   abft.matmul + flush - plain  {o['api_ms']:7.3f} ms")
        print(f"  {arm:10s} check reference.check (eager)      {o['check_ms']:7.3f} ms  {n.n} torch ops")
        out[arm] = o
    if against is not None:
        t, o = out["this tree"], out["--against"]
        same = _same(t.pop("verdict"), o.pop("verdict"))
        print(f"  this tree / --against: api {t['api_ms'] / o['api_ms']:.3f}, check "
              f"{t['check_ms'] / o['check_ms']:.3f}; verdicts {'equal' if same else 'DIFFER'}")
        out["equal"] = same
        out["cases"] = on_cases
    else:
        out["this tree"].pop("verdict")
    if "torch" in out:
        out["torch"].pop("verdict")
    out.update(out.pop("this tree"))
    run = lambda: reference.check_torch(a, b, c, **kw)
    if compile:                            # the torch check traced (the compiled one is not torch's)
        fn = torch.compile(reference.check_torch, fullgraph=True, dynamic=False)
        t0 = time.perf_counter()
        first = fn(a, b, c, **kw)
        secs = time.perf_counter() - t0
        compiled = _median_ms(lambda: fn(a, b, c, **kw), pairs, warmup)
        same = _same(first, run())
        print(f"  this tree  check torch.compile'd              {compiled:7.3f} ms  compile {secs:.1f} s, "
              f"verdicts {'equal' if same else 'DIFFER'}")
        out.update(compiled_ms=compiled, compile_s=secs, compiled_equal=same)
    return out


def cli(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=2000)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--against", metavar="DIR", help="another commit's kernels/ to alternate with")
    p.add_argument("--alone", action="store_true",
                   help="this tree's check only (warm caches: a training loop's steady state)")
    results.add_arguments(p, "fixedcost")
    args = p.parse_args(argv)
    if args.against is not None and not (pathlib.Path(args.against) / "reference.py").is_file():
        p.error(f"--against: no reference.py in {args.against}")
    record = results.start(args, "fixedcost", argv)
    out = main(pairs=args.pairs, size=args.size, compile=args.compile, against=args.against,
               alone=args.alone)
    record.write(dict(size=args.size, pairs=args.pairs, threads=1, **out))
    return 0


if __name__ == "__main__":
    raise SystemExit(cli())
