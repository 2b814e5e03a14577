"""Overhead of checked against plain products, measured as interleaved pairs (what ``abft bench``
and tests/bench share). Timings on a shared CPU drift by 20% between runs, so each repetition
times the plain and the checked call back to back (in alternating order) and the ratio of the
pair is the sample; we report the median ratio and its interquartile range."""
import functools
import statistics
import time

import torch
import torch.nn.functional as F

DEFAULT_SHAPES = "512x512x512,1024x1024x1024,2048x2048x2048,4096x4096x4096,linear:4096x1024x4096"


def parse_shapes(text):
    """'MxKxN,...' or 'linear:TxINxOUT' -> list of (kind, m, k, n); ValueError naming --shapes."""
    out = []
    for item in text.split(","):
        kind, _, dims = item.strip().rpartition(":")
        parts = dims.lower().split("x")
        if kind not in ("", "matmul", "linear") or len(parts) != 3 or \
                not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
            raise ValueError(f"--shapes: each item MxKxN or linear:TOKENSxINxOUT of whole "
                             f"numbers >= 1, got {item!r}")
        m, k, n = (int(x) for x in parts)
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


def detector_step_pair(factory, detector):
    """(plain, with one detector) AdamW training steps of ``factory``; no GEMM is checked in
    either. ``rest``: verify the fingerprints before the update and seal after it, as
    ``StepGuard(rest=True)`` does on a checked step; ``recompute``: rerun every non-GEMM module
    (``RecomputeCheck`` at rate 1, the most it costs); ``comm``: the gradients all-reduced as
    one bucket over a one-rank gloo group, plain in both, with ``CommCheck``'s checksums in one
    (the collective itself is a copy here: the figure is the checksums' compute, not the
    0.8% more bytes on a real link); ``carry``: both protected and checked (the products'
    outputs are what it carries), one under ``OutputCheck``; ``operands``: both under
    ``OutputCheck``, one taking the GEMM operands too (``operands=True``, the default) and
    the other not: what the operands' fingerprints add."""
    import copy
    import abft
    import torch.distributed as dist
    import contextlib
    model, inputs = factory()
    twin = copy.deepcopy(model)
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1) if detector == "comm" else None
    if detector in ("carry", "operands"):
        abft.protect(model)
        abft.protect(twin)

    def plain_all_reduce(params):
        params = [p for p in params if p.grad is not None]
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, group=group)
        off = 0
        for p in params:
            p.grad.copy_(flat[off:off + p.numel()].view_as(p.grad))
            off += p.numel()

    def step(m, on):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        rc = abft.RestCheck(opt) if on and detector == "rest" else None
        if on and detector == "recompute":
            abft.RecomputeCheck(m, rate=1.0)
        cc = abft.CommCheck(m) if on and detector == "comm" else None

        checked = (lambda: abft.checked(m)) if detector in ("carry", "operands") \
            else contextlib.nullcontext
        carried = abft.OutputCheck if on and detector == "carry" else \
            functools.partial(abft.OutputCheck, operands=on) if detector == "operands" else \
            contextlib.nullcontext

        def run():
            with checked(), carried():
                loss = m(*inputs)
                opt.zero_grad(set_to_none=True)
                loss.backward()
            if cc is not None:
                cc.all_reduce_grads(m.parameters(), group, average=False)
            elif group is not None:
                plain_all_reduce(m.parameters())
            if rc is not None and rc.sealed:
                rc.verify()
            opt.step()
            if rc is not None:
                rc.seal()
            return loss
        return run
    return step(model, False), step(twin, True)


def load_factory(spec):
    import importlib
    mod, sep, name = spec.partition(":")
    if not sep or not mod or not name:
        raise ValueError("no ':' between the module and the factory")
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
    ap.add_argument("--static", action="store_true",
                    help="no GPU needed: compile every kernel of a checked call for --arch, read "
                         "its SASS, estimate the cost at H200 peaks; writes --out/report.json")
    ap.add_argument("--validate", action="store_true",
                    help="the fused kernel on a GPU in one command: the tensor cores' "
                         "accumulation, the bf16 per-bit table, the stress set (zero false "
                         "alarms), checked / unchecked / cuBLAS timings; --out/validate.json and "
                         "validate.md (--smoke: tiny shapes, the interpreter without a GPU)")
    ap.add_argument("--budget", type=float, default=450.0,
                    help="with --validate: seconds for the whole run (later sections are skipped)")
    ap.add_argument("--arch", default="90", help="with --static: 90 (sm_90a, gated) or 80 (sm_80)")
    ap.add_argument("--out", default=None,
                    help="with --static or --validate: the report's folder (default runs/static, "
                         "runs/validate)")
    ap.add_argument("--model", default=None,
                    help="package.module:factory returning (model, inputs) with model(*inputs) a "
                         "loss: time one training step plain vs protected")
    ap.add_argument("--detector", default="gemm", choices=["gemm", "rest", "recompute", "comm", "carry", "operands"],
                    help="with --model: the checked GEMMs (protect + checked, SGD), the "
                         "state-at-rest check (AdamW, seal and verify every step), the "
                         "recompute of the non-GEMM modules (AdamW, rate 1), the checksummed "
                         "gradient all-reduce (AdamW, one-rank gloo group), the products' "
                         "outputs carried to their death (both arms checked) or what the "
                         "operands' fingerprints add to that (both arms carried)")
    from abft.bench import results
    results.add_arguments(ap, "bench", "; with --model bench_step_DETECTOR.json, --static "
                                       "bench_static.json, --device cuda bench_cuda.json, "
                                       "--validate validate.json")


GPU_SHAPES = "4096x4096x4096,8192x8192x8192,linear:16384x4096x4096,linear:16384x4096x14336"
SMOKE_SHAPES = "64x64x64,linear:48x40x72"


def gemms(kind, m, k, n):
    """The GEMMs of one entry as (name, M, K, N, make(gen, dtype, dev) -> (a, b)). A linear layer
    of T tokens x IN -> OUT has three: the forward x @ W^T, grad_input dY @ W and grad_weight
    dY^T @ x, with the transposed operands as views (no copies), as autograd gives them."""
    r = lambda g, dt, dev, *s: torch.randn(*s, generator=g).to(dtype=dt, device=dev)
    if kind != "linear":
        return [("matmul", m, k, n, lambda g, dt, dev: (r(g, dt, dev, m, k), r(g, dt, dev, k, n)))]
    t, i, o = m, k, n
    return [("forward", t, i, o, lambda g, dt, dev: (r(g, dt, dev, t, i), r(g, dt, dev, o, i).t())),
            ("grad_input", t, o, i, lambda g, dt, dev: (r(g, dt, dev, t, o), r(g, dt, dev, o, i))),
            ("grad_weight", o, t, i, lambda g, dt, dev: (r(g, dt, dev, t, o).t(), r(g, dt, dev, t, i)))]


def rotation(nbytes, l2_bytes, cap=64):
    """How many copies of a GEMM's operands to cycle through so that consecutive timed calls
    find none of theirs in L2: together at least twice the L2, and at least two."""
    return max(2, min(cap, -(-2 * l2_bytes // max(nbytes, 1))))


def ms_timer(dev):
    """``timer(fn) -> ms``: Triton's ``do_bench`` on CUDA (CUDA events, L2 flushed between
    runs), one interleaved pair elsewhere (the interpreter: a smoke run, not a timing)."""
    if dev == "cuda":
        import triton.testing
        return triton.testing.do_bench
    return lambda f: interleaved(f, f, 1)["plain_ms"]


def l2_bytes(dev):
    return torch.cuda.get_device_properties(0).L2_cache_size if dev == "cuda" else 1 << 20


def operand_sets(make, g, dtype, dev, first, l2):
    """The operands a timing cycles through: ``first`` and fresh ones from ``make``, enough that
    no call finds its operands in L2 (``rotation``)."""
    a, b = first
    copies = rotation((a.numel() + b.numel()) * a.element_size(), l2)
    return [first] + [make(g, dtype, dev) for _ in range(copies - 1)]


def time_each(fns, sets, timer):
    """{label: ms} of each fn(a, b) over the cycled operand ``sets``."""
    import itertools
    out = {}
    for label, fn in fns.items():
        it = itertools.cycle(sets)
        out[label] = timer(lambda: fn(*next(it)))
    return out


def kernel_rows(spec, dtype, dev):
    """Yields, per GEMM of ``spec``: torch (cuBLAS), the fused kernel with checks compiled out, checked,
    and checked with the weight's pre-pass kept (forward and grad_input), in ms (``do_bench``
    medians on a GPU, inputs rotated beyond L2), the alarms of a clean call and the largest error
    against float64 over torch's."""
    from abft.kernels import layout as L
    from abft.kernels import prepass
    from abft.kernels import triton_gemm as TG
    checked_gemm = TG.checked_gemm
    l2 = l2_bytes(dev)
    timer = ms_timer(dev)
    g = torch.Generator().manual_seed(0)
    for kind, m0, k0, n0 in parse_shapes(spec):
        for gemm, m, k, n, make in gemms(kind, m0, k0, n0):
            a, b = make(g, dtype, dev)
            c, v, _ = checked_gemm(a, b)
            ref = a.double() @ b.double()
            torch_err = (torch.matmul(a, b).double() - ref).abs().max().item()
            err = (c.double() - ref).abs().max().item() / max(torch_err, 1e-30)
            alarms = int(L.alarmed(v).sum())
            del ref, c, v
            sets = operand_sets(make, g, dtype, dev, (a, b), l2)
            fns = {"torch": torch.matmul, "unchecked": lambda x, y: checked_gemm(x, y, check=False),
                   "checked": checked_gemm}
            if gemm in ("forward", "grad_input"):
                # b is the layer's weight: its pre-pass is kept between optimizer steps
                kept = {id(y): prepass.prepare(y.mT, *TG.Layout(x[None], y[None], dtype, False)
                                               .b_key(TG.tiles_for(m, n, k, dtype)[1]))
                        for x, y in sets}
                fns["kept"] = lambda x, y: checked_gemm(x, y, b_stats=kept[id(y)])
            t = time_each(fns, sets, timer)
            t.setdefault("kept", float("nan"))
            del sets
            yield (dict(label=f"{kind} {m0}x{k0}x{n0}" if kind == "linear" else f"{m}x{k}x{n}",
                             gemm=gemm, m=m, k=k, n=n, torch_ms=t["torch"],
                             unchecked_ms=t["unchecked"], checked_ms=t["checked"],
                             kept_ms=t["kept"], err_over_torch=err, alarms=alarms))


def kernel_bench(args):
    """The fused kernel on CUDA: checked, checks compiled out, torch.matmul (cuBLAS), plus a
    correctness pass against float64. ``--smoke``: tiny shapes; without a GPU it runs on the
    CPU through the Triton interpreter (TRITON_INTERPRET=1 must be set before triton loads)."""
    import os
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        raise SystemExit("abft bench --device cuda: no CUDA device here (--smoke runs the path "
                         "on the CPU through the Triton interpreter)")
    if args.smoke and not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    dev = "cuda" if cuda else "cpu"
    dtype = getattr(torch, "bfloat16" if args.dtype == "float32" and not args.smoke else args.dtype)
    if args.smoke:
        spec = SMOKE_SHAPES
    else:
        spec = args.shapes if args.shapes != DEFAULT_SHAPES else GPU_SHAPES
    l2 = torch.cuda.get_device_properties(0).L2_cache_size if cuda else 1 << 20
    name = torch.cuda.get_device_name(0) if cuda else "cpu (interpreter)"
    print(f"{name}, {str(dtype).replace('torch.', '')}, L2 {l2 >> 20} MiB; ms are medians; "
          f"inputs rotated beyond L2")
    print("| shape | GEMM | torch ms | unchecked ms | checked ms | checked, weight kept ms | "
          "checked / unchecked | unchecked / torch | checked / torch | checked TFLOP/s | "
          "max err / torch's | alarms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    from abft.bench import results
    record = results.start(args, args.name, args.argv, "abft")
    rows = []
    for r in kernel_rows(spec, dtype, dev):
        rows.append(r)
        tflops = 2 * r["m"] * r["k"] * r["n"] / (r["checked_ms"] * 1e-3) / 1e12
        print(f"| {r['label']} | {r['gemm']} {r['m']}x{r['k']}x{r['n']} | {r['torch_ms']:.3f} | "
              f"{r['unchecked_ms']:.3f} | {r['checked_ms']:.3f} | {r['kept_ms']:.3f} | "
              f"{r['checked_ms'] / r['unchecked_ms']:.3f} | "
              f"{r['unchecked_ms'] / r['torch_ms']:.3f} | {r['checked_ms'] / r['torch_ms']:.3f} | "
              f"{tflops:.1f} | {r['err_over_torch']:.2f} | {r['alarms']} |", flush=True)
    record.write(dict(dtype=str(dtype).replace("torch.", ""), device=name, l2_mib=l2 >> 20,
                      rows=rows))
    return 0


def writable(out):
    """None if ``out`` can be made and written, else why not."""
    import os
    try:
        os.makedirs(out, exist_ok=True)
        probe = os.path.join(out, ".write-test")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        return e.strerror or str(e)
    return None


def static_bench(args):
    """``--static``: bad input gets one line naming the option and exit 2, before any compile."""
    import os
    import sys
    from abft.bench import results, static
    if args.arch not in tuple(str(a) for a in static.ARCHS):
        print(f"abft bench: --arch must be one of {', '.join(str(a) for a in static.ARCHS)}, "
              f"got {args.arch!r}", file=sys.stderr)
        return 2
    why = writable(args.out)
    if why:
        print(f"abft bench: --out {args.out!r} is not writable ({why})", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):
        # an interpreted kernel cannot be compiled: run once more without the interpreter
        import subprocess
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        more = [] if args.json is None else ["--json", args.json, "--note", args.note]
        return subprocess.run([sys.executable, "-m", "abft.cli", "bench", "--static", "--arch",
                               args.arch, "--out", args.out, *more], env=env).returncode
    record = results.start(args, args.name, args.argv, "abft")
    record.write(static.run(args.out, int(args.arch)))
    return 0


def _bad_input(args):
    """Why the arguments cannot run (one line naming the option), or None."""
    if args.reps < 0:
        return f"--reps must be a whole number >= 0, got {args.reps}"
    try:
        parse_shapes(args.shapes)
    except ValueError as e:
        return str(e)
    if args.model:
        try:
            load_factory(args.model)
        except (ImportError, AttributeError, ValueError) as e:
            return f"--model must be package.module:factory, got {args.model!r} ({e})"
    return None


def main(args):
    """``abft bench`` but ``--validate`` (``validate.main``)."""
    import sys
    from abft.bench import results
    args.name = "bench_static" if args.static else "bench_cuda" if args.device.startswith("cuda") \
        else f"bench_step_{args.detector}" if args.model else "bench"
    if args.json == str(results.DATA / "bench.json"):       # --json without FILE: by mode
        args.json = str(results.DATA / f"{args.name}.json")
    why = _bad_input(args)
    if why:
        print(f"abft bench: {why}", file=sys.stderr)
        return 2
    if args.out is None:
        args.out = "runs/static"
    if args.static:
        return static_bench(args)
    if args.device.startswith("cuda"):
        return kernel_bench(args)
    record = results.start(args, args.name, args.argv, "abft")
    dtype = getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    print("| shape | plain ms | checked ms | checked / plain (median) | IQR |")
    print("|---|---|---|---|---|")
    if args.model:
        factory = load_factory(args.model)
        plain, checked = train_step_pair(factory) if args.detector == "gemm" else \
            detector_step_pair(factory, args.detector)
        r = interleaved(plain, checked, args.reps or 11, sync)
        print(f"| train step {args.model} ({args.detector}) | {r['plain_ms']:.1f} | "
              f"{r['checked_ms']:.1f} | {r['ratio']:.3f} | {r['q1']:.3f}-{r['q3']:.3f} |",
              flush=True)
        record.write(dict(model=args.model, detector=args.detector, reps=args.reps or 11,
                          threads=torch.get_num_threads(), rows=[dict(r, shape="train step")]))
        return 0
    rows = []
    for kind, m, k, n in parse_shapes(args.shapes):
        plain, checked = make_pair(kind, m, k, n, dtype, args.device)
        reps = args.reps or max(5, min(41, int(4e10 / (2 * m * k * n))))
        r = interleaved(plain, checked, reps, sync)
        name = f"{kind} {m}x{k}x{n}"
        print(f"| {name} | {r['plain_ms']:.1f} | {r['checked_ms']:.1f} | {r['ratio']:.3f} | "
              f"{r['q1']:.3f}-{r['q3']:.3f} |", flush=True)
        rows.append(dict(r, shape=name, reps=reps))
    record.write(dict(dtype=args.dtype, device=args.device, threads=torch.get_num_threads(),
                      rows=rows))
    return 0
