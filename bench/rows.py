"""The row-checked GEMM's cost on a Hopper GPU, from its compiled code (``abft bench --static``).

``kernels/rowcheck.py``'s two launches (the main kernel, checked and with its checks compiled out,
and the verify kernel) are compiled for sm_90a at the LLM shapes, as the fused kernel is in
``bench/static.py``, and read from their SASS (the K loops: ``sass.tensor_loops``). The estimate
adds to the unchecked kernel's roofline time every cost the checked call has beyond it:

- **the slice's tensor cores**: each extra tensor-core instruction of the share loop as issued
  (HGMMA.64xNx16: 64 N 16 multiply-adds for its warpgroup; the slice's are 8 wide), at
  max(multiply-adds at 2,048 per SM and cycle, its shared-memory operands at 128 bytes per SM and
  cycle), not overlapped with the product's;
- **the slice's shared memory**: every LDSM of the share loop (the A tile brought to registers
  for A^2 and for the dots from registers), at 128 bytes per SM and cycle, not overlapped;
- **the slice's CUDA cores**: every extra instruction of the share loop, one issue slot of its
  warp's scheduler (4 per SM), at its share of the K steps (each K step once per row of tiles),
  not overlapped (the issue's rule);
- **the hot loop** (the other K steps): its instructions issue while the step's asynchronous
  wgmma runs (the gate checks every wait leaves wgmma groups in flight), so they cost only past
  the tensor cores' time per step (nothing at these shapes: 81 instructions, 162 issue cycles of
  a 1,024-cycle step);
- **outside the loops**: every extra instruction once per tile (the second loop's prologue, the
  epilogue's row sums, the partials' stores, V's and W's descriptors), not overlapped;
- **HBM bytes**: the partial buffer written and read back, V and W read once (64 KiB per weight;
  they stay in L2 across the row of tiles, as the operands' tiles do in the roofline), the
  verdicts written; for grad_weight, whose B (an activation) has no kept encoding, V and W
  written by the forward's verify (not built yet: counted as if it were);
- **launches**: the verify kernel at max(3 us, its bytes, its instructions: its loop over chunks
  of rows at every trip, its programs in waves of one per SM).

Clock: the roofline's peak over 132 SMs x 4,096 FLOP per cycle (1.83 GHz). What it cannot see:
latencies (the pipeline drains between the two K loops and refills: a TMA load's latency per
tile), L2 misses, clock and power limits.
"""
import collections

import torch

SMS = 132
FMA_PER_CYCLE = 2048        # dense bf16 multiply-adds per SM and cycle (989 TFLOP/s at 1.83 GHz)
SMEM_BYTES_PER_CYCLE = 128
SCHEDULERS = 4
LAUNCH_S = 3e-6             # the least an extra launch costs
GATE_COST = 1.03            # each GEMM, estimated checked / unchecked
GATE_LAYER = 1.02           # a layer's three GEMMs together


def _tensor_cycles(body, sass, warpgroups):
    cyc = 0.0
    for t in body:
        fma, smem = sass.tensor_issue(t)
        if fma:
            cyc += max(fma / FMA_PER_CYCLE, smem / SMEM_BYTES_PER_CYCLE)
    return cyc * warpgroups


def _ldsm_cycles(body, sass, warps):
    return sum(sass.smem_load_bytes(t) for t in body) * warps / SMEM_BYTES_PER_CYCLE


def _async(body, sass):
    waits = [t for t in body if sass.opcode(t).startswith("WARPGROUP.DEPBAR")]
    return bool(waits) and all(int(t.split(",")[-1].strip(), 16) > 0 for t in waits)


def read_kernel(path, sass, warps):
    """Per K loop (by address): instructions, tensor cycles, LDSM cycles, opcodes; instructions
    outside the loops, and by opcode; registers and spills."""
    ins = sass.disassemble(path)
    info = sass.summary(path)
    loops = []
    inside = 0
    in_loops = set()
    for lo, hi, body in sass.tensor_loops(ins):
        inside += len(body)
        in_loops.update(a for a, _ in ins if lo <= a <= hi)
        loops.append(dict(
            instructions=len(body), tensor_cycles=_tensor_cycles(body, sass, warps // 4),
            ldsm_cycles=_ldsm_cycles(body, sass, warps),
            tensor_core_instructions=sum(sass.opcode(t).startswith(sass.TENSOR_CORE) for t in body),
            # every wait in the loop leaves wgmma groups in flight: the tensor cores never drain
            async_wgmma=_async(body, sass),
            by_opcode=dict(collections.Counter(sass.opcode(t).split(".")[0] for t in body).most_common())))
    # loops without tensor-core instructions (the verify kernel's chunks of rows): their bodies
    other = [sum(1 for a, _ in ins if lo <= a <= hi) for lo, hi in sass.loops(ins)
             if lo < hi and not any(sass.opcode(t) == "EXIT" or sass.opcode(t).startswith(
                 sass.TENSOR_CORE) for a, t in ins if lo <= a <= hi)]
    outside_ops = collections.Counter(sass.opcode(t).split(".")[0] for a, t in ins if a not in in_loops)
    return dict(regs=info["regs"], stack=info["stack"], spills=info["spills"],
                instructions=len(ins), outside=len(ins) - inside, loops=loops, other_loops=other,
                outside_by_opcode=dict(outside_ops.most_common()))


def estimate(shape, name, weight, k_main, k_plain, k_verify, cfg, verify_programs, verify_warps,
             verify_trips, roofline, peak_flops):
    """The cost of one GEMM (module docstring); times in seconds."""
    m, k, n = shape
    bm, bn, bk, warps = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"]
    from abft.kernels import rowcheck as R
    clock = peak_flops / (SMS * 2 * FMA_PER_CYCLE)
    sec = lambda cycles: cycles / (SMS * clock)
    tm, tn, steps = -(-m // bm), -(-n // bn), -(-k // bk)
    tiles = tm * tn
    plain_loop = k_plain["loops"][0]
    share_loop, rest_loop = sorted(k_main["loops"], key=lambda lp: -lp["tensor_core_instructions"])
    share_steps = tm * steps                       # every K step once per row of tiles
    rest_steps = tiles * steps - share_steps
    issue = warps / SCHEDULERS
    plain_step = max(plain_loop["tensor_cycles"], issue * plain_loop["instructions"])
    # the share loop's extra work, none of it overlapped with the product's (the issue's rule)
    extra_tensor = share_steps * (share_loop["tensor_cycles"] - plain_loop["tensor_cycles"])
    extra_smem = share_steps * share_loop["ldsm_cycles"]
    extra_share = share_steps * issue * (share_loop["instructions"] - plain_loop["instructions"])
    # the hot loop: its instructions issue while the step's asynchronous wgmma runs (the SASS
    # waits on the wgmma of an earlier step), so they cost only past the tensor cores' time
    extra_hot = rest_steps * max(0.0, max(rest_loop["tensor_cycles"],
                                          issue * rest_loop["instructions"],
                                          rest_loop["ldsm_cycles"]) - plain_step)
    extra_outside = tiles * issue * (k_main["outside"] - k_plain["outside"])
    partial = m * tn * R.NF * 4
    enc = 2 * k * R.VW * 2
    verdicts = m * 12 + -(-m // R.VERIFY["ROWS"]) * 9 * 4
    main_bytes = partial + enc + (0 if weight else enc)     # written by the forward's verify
    verify_bytes = partial + verdicts
    # the verify kernel: its chunks' loop runs ROWS / BLOCK_R times; programs share the SMs
    verify_ins = k_verify["instructions"] + (verify_trips - 1) * sum(k_verify["other_loops"])
    waves = -(-verify_programs // SMS)
    verify_s = max(LAUNCH_S, roofline(0.0, verify_bytes),
                   waves * verify_ins * verify_warps / SCHEDULERS / clock)
    flops = 2.0 * tiles * bm * bn * steps * bk
    plain_bytes = (m * k + k * n + m * n) * 2
    unchecked_s = roofline(flops, plain_bytes)
    parts = dict(tensor_s=sec(extra_tensor), smem_s=sec(extra_smem), share_s=sec(extra_share),
                 hot_s=sec(extra_hot), outside_s=sec(extra_outside),
                 bytes_s=roofline(0.0, main_bytes), verify_s=verify_s)
    checked_s = unchecked_s + sum(parts.values())
    return dict(shape=f"{name} {m}x{k}x{n}", unchecked_s=unchecked_s, checked_s=checked_s,
                extra_bytes=main_bytes + verify_bytes, share_steps=share_steps,
                rest_steps=rest_steps, tiles=tiles, **parts,
                estimated_ratio=checked_s / unchecked_s)


def launches(R, a, b, cfg):
    """The launches of a checked and an unchecked row-checked A.B on "meta" operands, as
    (role, variant, kernel, grid, args, meta, options): checked main and verify, unchecked main.
    ``R``: the row check's module (``kernels/rowcheck.py``, or an edit of it)."""
    k = a.shape[1]
    e = lambda *s, dt=a.dtype: torch.empty(*s, dtype=dt, device="meta")
    enc = R.Encoding(e(k, R.VW), e(k, R.VW), e(R.BLOCK_FIELDS, dt=torch.float32), 3)
    for check in (True, False):
        run = R.launch(a, b, enc, check, config=cfg)
        for role in ("main", "verify") if check else ("main",):
            grid, args, meta, kopts = run[role]
            fn = R.row_check_kernel if role == "main" else R.row_verify_kernel
            yield role, "checked" if check else "unchecked", fn, grid, args, meta, kopts


def gemm_cost(read, shape, name, weight, cfg, roofline, peak_flops, main=None, verify=None):
    """``estimate`` of one GEMM from its launches as read: ``read[(role, variant)]`` = (info, grid,
    meta, options) of the checked main and verify kernels and the unchecked main kernel;
    ``main``, ``verify``: other read fields to cost in place of the checked ones."""
    vinfo, vgrid, vmeta, vopts = read[("verify", "checked")]
    return estimate(shape, name, weight, main or read[("main", "checked")][0],
                    read[("main", "unchecked")][0], verify or vinfo, cfg, vgrid[0],
                    vopts["num_warps"], -(-vmeta["ROWS"] // vmeta["BLOCK_R"]), roofline, peak_flops)


def run(out_dir, shapes, gemms, compile_once, roofline, peak_flops, arch=90):
    """Compile the row-checked GEMM's launches for ``arch`` at ``shapes`` (``static.compile_once``);
    the report's "rows" section: kernels, per-GEMM costs, per-layer costs."""
    from abft.bench import sass
    from abft.kernels import rowcheck as R
    cfg = R.GPU_CONFIG
    opts = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    kernels, cost, layers, seen = [], [], [], {}
    for t, i, o in shapes:
        layer = []
        for name, a, b, weight in gemms(t, i, o):
            m, k = a.shape
            n = b.shape[1]
            read = {}
            for role, variant, fn, grid, args, meta, kopts in launches(R, a, b, cfg):
                info = compile_once(seen, kernels, fn, args, meta, kopts, role, variant, arch,
                                    out_dir, f"{t}x{i}->{o} {name}",
                                    lambda path: read_kernel(path, sass, kopts["num_warps"]),
                                    prefix="rows_")
                read[(role, variant)] = (info, grid, meta, kopts)
            c = gemm_cost(read, (m, k, n), f"{t}x{i}->{o} {name}", weight, dict(cfg, **opts),
                          roofline, peak_flops)
            cost.append(c)
            layer.append(c)
        layers.append(dict(layer=f"{t}x{i}->{o}",
                           checked_s=sum(c["checked_s"] for c in layer),
                           unchecked_s=sum(c["unchecked_s"] for c in layer),
                           estimated_ratio=sum(c["checked_s"] for c in layer)
                           / sum(c["unchecked_s"] for c in layer)))
    return dict(kernels=kernels, cost=cost, layers=layers, config=dict(cfg),
                model=dict(sms=SMS, fma_per_cycle=FMA_PER_CYCLE,
                           smem_bytes_per_cycle=SMEM_BYTES_PER_CYCLE, schedulers=SCHEDULERS,
                           launch_s=LAUNCH_S, gate_cost=GATE_COST, gate_layer=GATE_LAYER))


def cost_cells(c):
    """One GEMM's ``estimate`` as table cells: each extra cost in % of the unchecked GEMM (slice:
    tensor, LDSM, CUDA cores; hot loop; outside the loops; HBM; verify launch), then the ratio."""
    pct = lambda key: f"{100 * c[key] / c['unchecked_s']:.2f}%"
    return " | ".join([pct(k) for k in ("tensor_s", "smem_s", "share_s", "hot_s", "outside_s",
                                        "bytes_s", "verify_s")] + [f"{c['estimated_ratio']:.4f}"])


def print_report(rows, p):
    cfg = rows["config"]
    p(f"row check ({cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} tiles, "
      f"{cfg['num_warps']} warps, {cfg['num_stages']} stages): each extra cost in % of the "
      f"unchecked GEMM; only the hot loop's overlapped with its wgmma")
    p("| kernel | variant | regs | spills | K loops: instructions (tensor-core) | outside loops |")
    p("|---|---|---|---|---|---|")
    for k in rows["kernels"]:
        lps = ", ".join(f"{lp['instructions']} ({lp['tensor_core_instructions']})" for lp in k["loops"])
        p(f"| {k['cubin']} | {k['variant']} | {k['regs']} | {k['spills']} | {lps or '-'} | "
          f"{k['outside']} |")
    p("")
    p("| GEMM | slice: tensor | slice: LDSM | slice: CUDA cores | hot loop | outside the loops "
      "| HBM | verify launch | estimated checked / unchecked |")
    p("|---|---|---|---|---|---|---|---|---|")
    for c in rows["cost"]:
        p(f"| {c['shape']} | {cost_cells(c)} |")
    for lay in rows["layers"]:
        p(f"| layer {lay['layer']}, three GEMMs | | | | | | | | {lay['estimated_ratio']:.4f} |")
