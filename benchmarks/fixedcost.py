"""The reference check's fixed cost (``python benchmarks/fixedcost.py [--compile]``): what a small
checked product costs beyond the plain one, where the check's torch ops (microseconds each,
whatever their size) dominate.

- api: a 64 x 64 x 64 float32 ``abft.matmul`` + ``abft.flush()`` minus ``a @ b``, the median over
  interleaved pairs after a warm-up, one thread;
- check: ``reference.check`` alone on the same product, and the count of torch ops it issues;
- with ``--compile``: the same check through ``torch.compile`` (inductor, one graph), its compile
  time for the shape, its cost per call, and whether its verdicts equal the eager check's.
"""
import argparse
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import abft
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


def _same(x, y):
    return torch.equal(x[0], y[0]) and all(torch.equal(p, q) for p, q in zip(x[1], y[1]))


def main(pairs=2000, warmup=200, size=64, compile=False):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(pairs, warmup, size, compile)
    finally:
        torch.set_num_threads(threads)


def _measure(pairs, warmup, size, compile):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(size, size, generator=g), torch.randn(size, size, generator=g)
    c = a @ b

    def checked():
        abft.matmul(a, b)
        abft.flush()

    with abft.config(backend="reference", policy="record"):
        for _ in range(warmup):
            checked()
            a @ b
        d = []
        for _ in range(pairs):
            t0 = time.perf_counter()
            checked()
            t1 = time.perf_counter()
            a @ b
            t2 = time.perf_counter()
            d.append((t1 - t0) - (t2 - t1))
    api = statistics.median(d) * 1e3
    kw = dict(bm=size, bn=size, units=reference.units_for(c))
    run = lambda: reference.check(a, b, c, **kw)
    eager = _median_ms(run, pairs, warmup)
    with _Count() as n:
        run()
    print(f"{size}x{size}x{size} float32, 1 thread, medians of {pairs} calls after {warmup}:")
    print(f"  api    abft.matmul + flush - plain  {api:7.3f} ms")
    print(f"  check  reference.check (eager)      {eager:7.3f} ms  {n.n} torch ops")
    out = dict(api_ms=api, check_ms=eager, ops=n.n)
    if compile:
        fn = torch.compile(reference.check, fullgraph=True, dynamic=False)
        t0 = time.perf_counter()
        first = fn(a, b, c, **kw)
        secs = time.perf_counter() - t0
        compiled = _median_ms(lambda: fn(a, b, c, **kw), pairs, warmup)
        same = _same(first, run())
        print(f"  check  torch.compile'd              {compiled:7.3f} ms  compile {secs:.1f} s, "
              f"verdicts {'equal' if same else 'DIFFER'}")
        out.update(compiled_ms=compiled, compile_s=secs, equal=same)
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=2000)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--compile", action="store_true")
    args = p.parse_args()
    main(pairs=args.pairs, size=args.size, compile=args.compile)
