"""Overhead of checked against plain products, measured as interleaved pairs (what ``abft bench``
and tests/bench share). Timings on a shared CPU drift by 20% between runs, so each repetition
times the plain and the checked call back to back (in alternating order) and the ratio of the
pair is the sample; we report the median ratio and its interquartile range."""
import statistics
import time

import torch
import torch.nn.functional as F

DEFAULT_SHAPES = "512x512x512,1024x1024x1024,2048x2048x2048,4096x4096x4096,linear:4096x1024x4096"


def parse_shapes(text):
    """'MxKxN,...' or 'linear:TxINxOUT' -> list of (kind, m, k, n)."""
    out = []
    for item in text.split(","):
        kind, _, dims = item.rpartition(":")
        m, k, n = (int(x) for x in dims.lower().split("x"))
        out.append((kind or "matmul", m, k, n))
    return out


def make_pair(kind, m, k, n, dtype=torch.float32, device="cpu"):
    """(plain, checked) zero-argument callables for one shape."""
    import abft
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(m, k, generator=g).to(dtype=dtype, device=device)
    if kind == "linear":
        w = torch.randn(n, k, generator=g).to(dtype=dtype, device=device)
        bias = torch.randn(n, generator=g).to(dtype=dtype, device=device)
        return (lambda: F.linear(x, w, bias)), (lambda: abft.linear(x, w, bias))
    b = torch.randn(k, n, generator=g).to(dtype=dtype, device=device)
    return (lambda: torch.matmul(x, b)), (lambda: abft.matmul(x, b))


def train_step_pair(factory):
    """(plain, checked) training steps of ``factory() -> (model, inputs)``: forward, backward and
    an SGD step; checked = a deep copy under ``abft.protect`` and ``abft.checked``."""
    import copy
    import abft
    model, inputs = factory()
    prot = copy.deepcopy(model)
    abft.protect(prot)

    def step(m, ctx):
        opt = torch.optim.SGD(m.parameters(), lr=1e-4)

        def run():
            with ctx():
                loss = m(*inputs)
                opt.zero_grad(set_to_none=True)
                loss.backward()
            opt.step()
            return loss
        return run
    import contextlib
    return step(model, contextlib.nullcontext), step(prot, lambda: abft.checked(prot))


def load_factory(spec):
    import importlib
    mod, _, name = spec.partition(":")
    return getattr(importlib.import_module(mod), name)


def _time(fn, sync):
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def interleaved(plain, checked, reps, sync=lambda: None):
    """Median and quartiles of checked/plain over ``reps`` back-to-back pairs."""
    import abft
    for _ in range(2):
        plain(), checked()
    abft.flush()
    ratios, tp, tc = [], [], []
    for i in range(reps):
        if i % 2:
            c = _time(checked, sync)
            p = _time(plain, sync)
        else:
            p = _time(plain, sync)
            c = _time(checked, sync)
        abft.flush()
        ratios.append(c / p)
        tp.append(p)
        tc.append(c)
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    return dict(ratio=statistics.median(ratios), q1=q[0], q3=q[2],
                plain_ms=statistics.median(tp) * 1e3, checked_ms=statistics.median(tc) * 1e3)


def add_arguments(ap):
    ap.add_argument("--shapes", default=DEFAULT_SHAPES,
                    help="comma-separated MxKxN or linear:TOKENSxINxOUT (default: %(default)s)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16", "float64"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=0, help="pairs per shape (0: by size)")
    ap.add_argument("--smoke", action="store_true",
                    help="with --device cuda: run the kernel path on a tiny shape (under "
                         "TRITON_INTERPRET=1 when no GPU is present)")
    ap.add_argument("--model", default=None,
                    help="package.module:factory returning (model, inputs) with model(*inputs) a "
                         "loss: time one training step plain vs protected")


GPU_SHAPES = "4096x4096x4096,8192x8192x8192,16384x4096x4096,16384x4096x14336"


def kernel_bench(args):
    """The fused kernel on CUDA: checked, checks compiled out, torch.matmul (cuBLAS), plus a
    correctness pass against float64. ``--smoke``: one tiny shape; without a GPU it runs on the
    CPU through the Triton interpreter (TRITON_INTERPRET=1 must be set before triton loads)."""
    import os
    if args.smoke and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from abft.kernels.triton_gemm import checked_gemm
    from abft.kernels import layout as L
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, "bfloat16" if args.dtype == "float32" and not args.smoke else args.dtype)
    shapes = parse_shapes("64x64x64" if args.smoke else (args.shapes if args.shapes != DEFAULT_SHAPES else GPU_SHAPES))
    print(f"| shape ({str(dtype).replace('torch.', '')}, {dev}) | torch ms | unchecked ms | checked ms | "
          f"checked / unchecked | unchecked / torch | max err / torch's | alarms |")
    print("|---|---|---|---|---|---|---|---|")
    for kind, m, k, n in shapes:
        g = torch.Generator().manual_seed(0)
        a = torch.randn(m, k, generator=g).to(dtype=dtype, device=dev)
        b = torch.randn(k, n, generator=g).to(dtype=dtype, device=dev)
        c, v, _ = checked_gemm(a, b)
        ref = a.double() @ b.double()
        err = (c.double() - ref).abs().max().item() / max((torch.matmul(a, b).double() - ref).abs().max().item(), 1e-30)
        alarms = int(((v[..., L.ROW_RATIO] > 1) | (v[..., L.COL_RATIO] > 1)).sum())
        fns = {"torch": lambda: torch.matmul(a, b), "unchecked": lambda: checked_gemm(a, b, check=False),
               "checked": lambda: checked_gemm(a, b)}
        if dev == "cuda":
            import triton
            t = {name: triton.testing.do_bench(f) for name, f in fns.items()}
        else:
            t = {name: interleaved(f, f, 1)["plain_ms"] for name, f in fns.items()}
        print(f"| {m}x{k}x{n} | {t['torch']:.3f} | {t['unchecked']:.3f} | {t['checked']:.3f} | "
              f"{t['checked'] / t['unchecked']:.3f} | {t['unchecked'] / t['torch']:.3f} | {err:.2f} | {alarms} |",
              flush=True)
    return 0


def main(args):
    if args.device.startswith("cuda"):
        return kernel_bench(args)
    dtype = getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    print("| shape | plain ms | checked ms | checked / plain (median) | IQR |")
    print("|---|---|---|---|---|")
    if args.model:
        plain, checked = train_step_pair(load_factory(args.model))
        r = interleaved(plain, checked, args.reps or 11, sync)
        print(f"| train step {args.model} | {r['plain_ms']:.1f} | {r['checked_ms']:.1f} | "
              f"{r['ratio']:.3f} | {r['q1']:.3f}-{r['q3']:.3f} |", flush=True)
        return 0
    for kind, m, k, n in parse_shapes(args.shapes):
        plain, checked = make_pair(kind, m, k, n, dtype, args.device)
        reps = args.reps or max(5, min(41, int(4e10 / (2 * m * k * n))))
        r = interleaved(plain, checked, reps, sync)
        name = f"{kind} {m}x{k}x{n}"
        print(f"| {name} | {r['plain_ms']:.1f} | {r['checked_ms']:.1f} | {r['ratio']:.3f} | "
              f"{r['q1']:.3f}-{r['q3']:.3f} |", flush=True)
    return 0
