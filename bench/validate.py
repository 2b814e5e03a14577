"""``abft bench --validate``: the fused kernel checked on a GPU in one command, one JSON and one
markdown table.

    abft bench --validate --device cuda --out DIR      # a Hopper GPU: minutes
    abft bench --validate --smoke --out DIR            # tiny shapes; the interpreter without a GPU

Sections, each timed and written to DIR/validate.json as soon as it ends (a section that fails
records its error and the rest still run; ``--budget`` seconds bound the whole run, and a section
that would start past it is recorded as skipped):

- ``accumulation``: what the tensor cores' fp32 accumulation does (``bench/accumulation.py``),
  against the threshold's assumption of one directed rounding per 8 products;
- ``bitflips``: the bf16 per-bit table (``bench/bitflips.py``): every flip above bf16's output
  rounding must be caught;
- ``stress``: the stress set (``bench/stress.py``) through the kernel, every dtype (fp32 with and
  without tf32), the backward's operand layouts: zero false alarms, values within twice torch's
  error;
- ``group16``: bitflips (bits 10-19) and the stress set again with the threshold taking the
  measured 16 products per rounding of bf16 and fp16 (``benchmarks/gpu_threshold.py`` emulates
  its detection on the CPU);
- ``timings``: checked / unchecked / torch (cuBLAS) per GEMM of a linear layer at 16384 tokens x
  4096 -> 4096 and -> 14336, and a whole protected ``nn.Linear`` (forward and backward) against a
  plain one;
- ``rows``: the row-checked kernel that is to replace the fused one (``kernels/rowcheck.py``): the
  stress set through it (zero false alarms, values within twice torch's error), the bf16 flips it
  catches against the fused kernel (``bench/rowflips.py``), and its time checked / unchecked /
  torch per GEMM of the same layers, B's encoding made beforehand (kept per weight; grad_weight's
  is to be passed from the forward).
"""
import json
import os
import platform
import time
import traceback

import torch

SHAPES = "linear:16384x4096x4096,linear:16384x4096x14336"
SMOKE_SHAPES = "linear:40x24x48"
STRESS_K = (1, 7, 64, 1000, 4096, 16384)
SMOKE_K = (7, 64)


def _dt(d):
    return str(d).replace("torch.", "")


def env(dev):
    import triton
    out = dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), torch=torch.__version__,
               triton=triton.__version__, python=platform.python_version(), device=dev)
    if dev == "cuda":
        p = torch.cuda.get_device_properties(0)
        out.update(card=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                   memory_gib=round(p.total_memory / 2 ** 30, 1),
                   l2_mib=round(getattr(p, "L2_cache_size", 0) / 2 ** 20, 1),
                   cuda=torch.version.cuda)
    return out


def accumulation(dev, smoke):
    from abft.bench import accumulation as A
    out = []
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        r = A.measure(dt, k=16 if smoke else 64, device=dev)
        out.append(r)
    return out


def bitflips(dev, smoke, bits=None):
    from abft.bench import bitflips as B
    rows = B.run(m=32, k=256 if smoke else 4096, n=32, trials=2 if smoke else 10,
                 bits=bits or ((3, 22, 30) if smoke else range(32)), device=dev)
    missed = sum(r["above_rounding"] - r["above_detected"] for r in rows)
    return dict(rows=rows, above_rounding=sum(r["above_rounding"] for r in rows),
                above_missed=missed)


def _stress_cases(smoke):
    """(dist, k, dtype, tf32, layout): every distribution, K and dtype in A @ B with both row
    major; the backward's layouts (A^T: grad_weight's dY^T, B^T: the forward's W^T) on three."""
    from abft.bench.stress import DISTRIBUTIONS
    ks = SMOKE_K if smoke else STRESS_K
    dists = DISTRIBUTIONS[:2] if smoke else DISTRIBUTIONS
    dtypes = ((torch.bfloat16, False), (torch.float16, False), (torch.float32, True),
              (torch.float32, False))
    # K and dtype outermost: each compiles the kernel once, then every distribution reuses it
    for k in ks:
        for dt, tf in dtypes:
            for dist in dists:
                yield dist, k, dt, tf, "nn"
    for dist in dists[:1] if smoke else ("gaussian", "llm_outliers", "massive_activations"):
        for k in ks[-2:]:
            for dt, tf in dtypes:
                for lay in ("nt", "tn"):
                    yield dist, k, dt, tf, lay


def _stress_inputs(dev, smoke, deadline, skipped, tf32=True):
    """The stress cases' (dist, k, dtype, tf32, layout, a, b) on ``dev`` (32 or 256 square), the
    backward's layouts made as views; a case past the deadline counts in ``skipped[0]``."""
    from abft.bench.stress import operands
    m = n = 32 if smoke else 256
    for dist, k, dt, tf, lay in _stress_cases(smoke):
        if tf and not tf32:
            continue
        if time.time() > deadline:
            skipped[0] += 1
            continue
        a, b = operands(dist, m, k, n, dt, 0)
        if lay == "tn":
            a = a.t().contiguous().t()
        if lay == "nt":
            b = b.t().contiguous().t()
        yield dist, k, dt, tf, lay, a.to(dev), b.to(dev)


def _against_torch(a, b, c, dt, tf=False):
    """(c's largest error against float64, torch.matmul's (tf32 as ``tf``), whether c's is within
    twice torch's plus an ulp of the largest value)."""
    ref = a.double() @ b.double()
    if dt == torch.float32:
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = tf
        theirs = (torch.matmul(a, b).double() - ref).abs().max().item()
        torch.backends.cuda.matmul.allow_tf32 = prev
    else:
        theirs = (torch.matmul(a, b).double() - ref).abs().max().item()
    mine = (c.double() - ref).abs().max().item()
    return mine, theirs, mine <= 2 * theirs + torch.finfo(dt).eps * ref.abs().max().item()


def stress(dev, smoke, deadline):
    """Zero false alarms: every tile OK (verified, ratio <= 1), values within twice torch's
    error (plus an ulp of the largest)."""
    import triton
    from abft.kernels import layout as L
    from abft.kernels import triton_gemm as TG
    rows, alarms, not_ok, skipped = [], 0, 0, [0]
    for dist, k, dt, tf, lay, a, b in _stress_inputs(dev, smoke, deadline, skipped):
        cfg = None if smoke else triton.Config({"BLOCK_K": 32 if dt == torch.float32 else 64},
                                              num_warps=8, num_stages=3)
        c, v, _ = TG.checked_gemm(a, b, tf32=tf if dt == torch.float32 else None, config=cfg)
        worst = max(v[..., L.ROW_RATIO].max().item(), v[..., L.COL_RATIO].max().item())
        n_alarm = int(L.alarmed(v).sum())
        n_bad = int((v[..., L.STATUS] != L.OK).sum())
        mine, theirs, ok = _against_torch(a, b, c, dt, tf)
        alarms += n_alarm
        not_ok += n_bad
        rows.append(dict(dist=dist, k=k, dtype=_dt(dt) + ("/tf32" if tf else ""), layout=lay,
                         worst_ratio=worst, alarmed_tiles=n_alarm, not_ok_tiles=n_bad,
                         err=mine, torch_err=theirs, values_ok=ok))
    return dict(cases=len(rows), skipped=skipped[0], alarmed_tiles=alarms, not_ok_tiles=not_ok,
                worst_ratio=max((r["worst_ratio"] for r in rows), default=None),
                values_off=sum(not r["values_ok"] for r in rows), rows=rows)


def _layer(dev, dtype, t, i, o, timer, g):
    """A whole nn.Linear step (forward and backward), plain against protected; the verdicts
    flushed every call (a training step flushes once)."""
    import copy
    import abft
    plain = torch.nn.Linear(i, o, bias=False).to(device=dev, dtype=dtype)
    prot = copy.deepcopy(plain)
    abft.protect(prot)
    x = torch.randn(t, i, generator=g).to(device=dev, dtype=dtype).requires_grad_(True)
    gy = torch.randn(t, o, generator=g).to(device=dev, dtype=dtype)

    def step(layer, flush):
        def run():
            x.grad = None
            layer.weight.grad = None
            layer(x).backward(gy)
            if flush:
                abft.flush()
        return run
    out = dict(plain_ms=timer(step(plain, False)), checked_ms=timer(step(prot, True)))
    out["ratio"] = out["checked_ms"] / out["plain_ms"]
    out["alarms"] = len(abft.alarms())
    return out


def timings(dev, smoke, dtype, progress):
    """``progress(result)`` is called after every row, so a run cut short keeps what it timed."""
    from abft.bench import overhead
    spec = SMOKE_SHAPES if smoke else SHAPES
    rows, layers = [], []
    result = dict(gemms=rows, layers=layers)
    for row in overhead.kernel_rows(spec, dtype, dev):
        rows.append(row)
        progress(result)
    g = torch.Generator().manual_seed(1)
    timer = overhead.ms_timer(dev)
    for kind, t, i, o in overhead.parse_shapes(spec):
        r = _layer(dev, dtype, t, i, o, timer, g)
        r.update(shape=f"{t}x{i}->{o}")
        layers.append(r)
        progress(result)
    from abft.kernels import triton_gemm as TG
    result["autotuned"] = {str(key): {str(k): str(c) for k, c in getattr(tuner, "cache", {}).items()}
                           for key, tuner in getattr(TG, "_tuned", {}).items()}
    return result


def group16(dev, smoke, deadline):
    """The threshold with the accumulation measured on an H200 (one rounding toward zero per 16
    products for bf16 and fp16, ``bench/accumulation.py``) in place of the model's 8: the bf16
    bits where the model's 8 missed flips, and the stress set (zero false alarms needed before
    the model takes 16). The coefficients are launch arguments: nothing recompiles."""
    from abft.kernels import threshold as T
    from abft.kernels import triton_gemm as TG
    real = TG.accumulation

    def measured(k, dtype, tf32, bk):
        if dtype in (torch.float16, torch.bfloat16) and not tf32:
            return T.blocked(k, 16, directed=True)
        return real(k, dtype, tf32, bk)
    TG.accumulation = measured
    try:
        flips = bitflips(dev, smoke, bits=(3, 14) if smoke else range(10, 20))
        st = stress(dev, smoke, deadline)
    finally:
        TG.accumulation = real
    return dict(bitflips=flips, stress=st)


def rows(dev, smoke, deadline):
    """``rows`` (the module docstring): zero false alarms and right values on the stress set, the
    flips caught, the times."""
    from abft.bench import overhead, rowflips
    from abft.kernels import layout as L
    from abft.kernels import rowcheck as R
    cases, alarms, not_ok, values_off, skipped, worst = 0, 0, 0, 0, [0], 0.0
    # fp32 without tf32 only: the row kernel's fp32 dot is exact
    for dist, k, dt, tf, lay, a, b in _stress_inputs(dev, smoke, deadline, skipped, tf32=False):
        c, v, ratio, _ = R.row_checked_gemm(a, b)
        cases += 1
        alarms += int(L.alarmed(v).sum())
        not_ok += int((v[..., L.STATUS] != L.OK).sum())
        values_off += not _against_torch(a, b, c, dt)[2]
        worst = max(worst, ratio.abs().max().item())
    flips = rowflips.run(m=8 if smoke else 32, k=64 if smoke else 4096, n=96 if smoke else 4096,
                         seeds=1 if smoke else 2, bits=(14, 15, 30) if smoke else range(14, 32),
                         device=dev)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    timer = overhead.ms_timer(dev)
    g = torch.Generator().manual_seed(0)
    times = []
    for kind, t, i, o in overhead.parse_shapes(SMOKE_SHAPES if smoke else SHAPES):
        for gemm, mm, kk, nn, make in overhead.gemms(kind, t, i, o):
            if time.time() > deadline:
                break
            sets = overhead.operand_sets(make, g, dtype, dev, make(g, dtype, dev),
                                         overhead.l2_bytes(dev))
            enc = {id(y): R.encode(y) for _, y in sets}
            _, v, _, _ = R.row_checked_gemm(*sets[0], enc=enc[id(sets[0][1])])
            fns = {"torch": torch.matmul,
                   "unchecked": lambda x, y: R.row_checked_gemm(x, y, check=False),
                   "checked": lambda x, y: R.row_checked_gemm(x, y, enc=enc[id(y)])}
            ms = overhead.time_each(fns, sets, timer)
            times.append(dict(shape=f"{t}x{i}->{o}", gemm=gemm, m=mm, k=kk, n=nn,
                              alarms=int(L.alarmed(v).sum()), **{f"{x}_ms": y for x, y in ms.items()}))
    return dict(stress=dict(cases=cases, skipped=skipped[0], alarmed=alarms, not_ok=not_ok,
                            values_off=values_off, worst_ratio=worst),
                flips=flips, timings=times)


SECTIONS = ("accumulation", "bitflips", "stress", "group16", "timings", "rows")


def run(out, smoke=False, budget=450.0, only=None):
    """Run the sections into ``out`` (validate.json, validate.md); returns the report."""
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    t0 = time.time()
    deadline = t0 + budget
    report = dict(env=env(dev), smoke=smoke, budget_s=budget, sections={})
    share = dict(stress=0.45, group16=0.3)     # of the budget left when the section starts
    for name in SECTIONS:
        if only and name not in only:
            continue
        sec = report["sections"][name] = {}
        if time.time() > deadline:
            sec.update(status="skipped", why="past the budget")
            continue
        s0 = time.time()
        print(f"validate: {name} ...", flush=True)
        try:
            if name == "accumulation":
                sec["result"] = accumulation(dev, smoke)
            elif name == "bitflips":
                sec["result"] = bitflips(dev, smoke)
            elif name == "stress":
                sec["result"] = stress(dev, smoke, s0 + share["stress"] * (deadline - s0))
            elif name == "group16":
                sec["result"] = group16(dev, smoke, s0 + share["group16"] * (deadline - s0))
            elif name == "rows":
                sec["result"] = rows(dev, smoke, deadline)
            else:
                def progress(result):
                    sec.update(result=result, status="running")
                    _write(out, report)
                sec["result"] = timings(dev, smoke, torch.bfloat16 if cuda else torch.float32,
                                        progress)
            sec["status"] = "ok"
        except Exception as e:          # recorded; the other sections still run
            sec.update(status="error", error=f"{type(e).__name__}: {e}",
                       traceback=traceback.format_exc()[-4000:])
            print(sec["traceback"], flush=True)
        sec["seconds"] = round(time.time() - s0, 1)
        print(f"validate: {name} {sec['status']} in {sec['seconds']} s", flush=True)
        _write(out, report)
    report["seconds"] = round(time.time() - t0, 1)
    _write(out, report)
    return report


def _write(out, report):
    """validate.json and validate.md, each replaced whole (a run cut short leaves no half file)."""
    for name, text in (("validate.json", json.dumps(report, indent=1, default=str)),
                       ("validate.md", markdown(report))):
        path = os.path.join(out, name)
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)


def markdown(report):
    e = report["env"]
    lines = [f"# abft bench --validate ({e.get('card', e['device'])}, {e['date']}, torch "
             f"{e['torch']}, triton {e['triton']}{', smoke' if report['smoke'] else ''})", ""]
    secs = report["sections"]
    lines += ["| section | status | seconds | result |", "|---|---|---|---|"]
    for name, sec in secs.items():
        r = sec.get("result")
        what = sec.get("error") or sec.get("why") or ""
        if r is not None and name == "accumulation":
            what = "; ".join(
                f"{x['dtype']}: " + (", ".join(f"g={f['group']} F={f['extra_bits']} {f['rounding']}"
                                               for f in x["consistent"][:4]) or "no model fits; "
                                     f"nearest g={x['nearest'][0]['group']} "
                                     f"F={x['nearest'][0]['extra_bits']} "
                                     f"{x['nearest'][0]['rounding']} "
                                     f"({x['nearest'][0]['mismatches']} of {x['rows']} rows off)")
                for x in r)
        elif r is not None and name == "bitflips":
            what = (f"{r['above_rounding'] - r['above_missed']} of {r['above_rounding']} flips "
                    f"above bf16 rounding caught")
        elif r is not None and name == "stress":
            what = (f"{r['cases']} cases ({r['skipped']} skipped): {r['alarmed_tiles']} alarmed "
                    f"tiles, {r['not_ok_tiles']} not OK, worst ratio {r['worst_ratio']}, "
                    f"{r['values_off']} with values off")
        elif r is not None and name == "group16":
            b, st = r["bitflips"], r["stress"]
            what = (f"{b['above_rounding'] - b['above_missed']} of {b['above_rounding']} flips "
                    f"above bf16 rounding caught; stress {st['cases']} cases "
                    f"({st['skipped']} skipped): {st['alarmed_tiles']} alarmed tiles, worst ratio "
                    f"{st['worst_ratio']}")
        elif r is not None and name == "timings":
            what = f"{len(r['gemms'])} GEMMs, {len(r['layers'])} layers (below)"
        elif r is not None and name == "rows":
            st = r["stress"]
            above = sum(f["above"] for f in r["flips"])
            what = (f"stress {st['cases']} cases ({st['skipped']} skipped): {st['alarmed']} "
                    f"alarmed, {st['not_ok']} not OK, worst ratio {st['worst_ratio']:.3f}, "
                    f"{st['values_off']} with values off; flips above bf16 rounding caught: "
                    f"{sum(f['row'] for f in r['flips'])} of {above} (fused "
                    f"{sum(f['tile'] for f in r['flips'])}); {len(r['timings'])} GEMMs (below)")
        lines.append(f"| {name} | {sec['status']} | {sec.get('seconds', '')} | {what} |")
    t = secs.get("timings", {}).get("result")
    if t:
        lines += ["", "| GEMM | M x K x N | torch ms | unchecked ms | checked ms | checked, weight "
                  "kept ms | checked / unchecked | unchecked / torch | checked / torch | alarms |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for g in t["gemms"]:
            lines.append(f"| {g['label']} {g['gemm']} | {g['m']}x{g['k']}x{g['n']} | "
                         f"{g['torch_ms']:.3f} | {g['unchecked_ms']:.3f} | {g['checked_ms']:.3f} | "
                         f"{g['kept_ms']:.3f} | {g['checked_ms'] / g['unchecked_ms']:.3f} | "
                         f"{g['unchecked_ms'] / g['torch_ms']:.3f} | "
                         f"{g['checked_ms'] / g['torch_ms']:.3f} | {g['alarms']} |")
        lines += ["", "| layer (forward + backward) | plain ms | protected ms | ratio | alarms |",
                  "|---|---|---|---|---|"]
        for r in t["layers"]:
            lines.append(f"| {r['shape']} | {r['plain_ms']:.3f} | {r['checked_ms']:.3f} | "
                         f"{r['ratio']:.3f} | {r['alarms']} |")
    r = secs.get("rows", {}).get("result")
    if r and r["timings"]:
        lines += ["", "| row check: GEMM | M x K x N | torch ms | unchecked ms | checked ms | "
                  "checked / unchecked | unchecked / torch | alarms |", "|---|---|---|---|---|---|---|---|"]
        for g in r["timings"]:
            lines.append(f"| {g['shape']} {g['gemm']} | {g['m']}x{g['k']}x{g['n']} | "
                         f"{g['torch_ms']:.3f} | {g['unchecked_ms']:.3f} | {g['checked_ms']:.3f} | "
                         f"{g['checked_ms'] / g['unchecked_ms']:.3f} | "
                         f"{g['unchecked_ms'] / g['torch_ms']:.3f} | {g['alarms']} |")
    return "\n".join(lines) + "\n"


def main(args):
    """``--validate``: bad input gets one line naming it and exit 2, before anything runs."""
    import sys
    from abft.bench import overhead
    if args.out is None:
        args.out = "runs/validate"
    cuda = torch.cuda.is_available()
    if not args.smoke and not cuda:
        print("abft bench: --validate needs a CUDA device (none here); --smoke runs it on tiny "
              "shapes under the Triton interpreter", file=sys.stderr)
        return 2
    if args.budget <= 0:
        print(f"abft bench: --budget must be positive seconds, got {args.budget}", file=sys.stderr)
        return 2
    why = overhead.writable(args.out)
    if why:
        print(f"abft bench: --out {args.out!r} is not writable ({why})", file=sys.stderr)
        return 2
    if not cuda and os.environ.get("TRITON_INTERPRET", "") in ("", "0") \
            and "triton" in sys.modules:
        # triton read the variable when it loaded: run once more under the interpreter
        import subprocess
        env = dict(os.environ, TRITON_INTERPRET="1")
        more = [] if args.json is None else ["--json", args.json, "--note", args.note]
        return subprocess.run([sys.executable, "-m", "abft.cli", "bench", "--validate", "--smoke",
                               "--out", args.out, "--budget", str(args.budget), *more],
                              env=env).returncode
    os.environ.setdefault("TRITON_INTERPRET", "0" if cuda else "1")
    from abft.bench import results
    if args.json == str(results.DATA / "bench.json"):       # --json without FILE
        args.json = str(results.DATA / "validate.json")
    record = results.start(args, "validate", args.argv, "abft")
    report = run(args.out, smoke=args.smoke, budget=args.budget)
    record.write(report)
    print(markdown(report))
    bad = [n for n, s in report["sections"].items() if s["status"] == "error"]
    return 1 if bad else 0
