"""Detection rate per bit of a flipped accumulator element, bf16 GEMMs: the fused kernel (checks on
the fp32 accumulator) against the reference backend (checks of the stored bf16 output).

    TRITON_INTERPRET=1 python benchmarks/bitflips.py --k 4096 --trials 12    (the CPU)
    abft bench --validate --device cuda --out DIR                           (part of, on a GPU)

Each trial: a fresh seeded bf16 product (M x K x N), one element, one K step, one bit of its fp32
accumulator flipped in the kernel. The reference sees the same corruption as the kernel's own
output C (which carries the flip, rounded to bf16), checked after the fact. 'above rounding': the
flip moved the element by more than the bf16 rounding of that element (half an ulp).
"""
import argparse

import torch
import triton

from abft.bench import results
from abft.kernels import layout as L
from abft.kernels import triton_gemm as TG
from abft.kernels.reference import check
from abft.kernels.threshold import units


def _alarmed(v):
    return bool(L.alarmed(v).any())


def run(m=32, k=4096, n=32, trials=12, bits=range(32), seed=0, device="cpu"):
    rows = []
    u = units(torch.bfloat16)
    bk128 = triton.Config({"BLOCK_K": 128}, num_warps=4, num_stages=1)      # K steps of 128
    for bit in bits:
        fused = ref = above = above_fused = 0
        for t in range(trials):
            g = torch.Generator().manual_seed(seed * 100003 + bit * 1009 + t)
            a = torch.randn(m, k, generator=g).to(torch.bfloat16).to(device)
            b = torch.randn(k, n, generator=g).to(torch.bfloat16).to(device)
            i, j = (int(x) for x in torch.randint(0, m, (2,), generator=g))
            ks = int(torch.randint(0, k // 128, (1,), generator=g))
            clean, _, _ = TG.checked_gemm(a, b, config=bk128)
            c, v, _ = TG.checked_gemm(a, b, config=bk128,
                                      inject=dict(kind="bitflip", row=i, col=j, k_step=ks, bit=bit))
            hit_fused = _alarmed(v)
            v_ref, _ = check(a, b, c, bm=32, bn=32, units=u)
            hit_ref = _alarmed(v_ref)
            exact = (a.double() @ b.double())[i, j].item()
            moved = abs(c[i, j].double().item() - clean[i, j].double().item())
            half_ulp = abs(exact) * 2.0 ** -9 if exact else 0.0
            big = (moved > half_ulp) or not torch.isfinite(c[i, j])
            fused += hit_fused
            ref += hit_ref
            above += big
            above_fused += big and hit_fused
        rows.append(dict(bit=bit, fused=fused / trials, reference=ref / trials,
                         above_rounding=above, above_detected=above_fused, trials=trials))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=32)
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--trials", type=int, default=12)
    results.add_arguments(ap, "bitflips")
    args = ap.parse_args(argv)
    record = results.start(args, "bitflips", argv)
    rows = run(args.m, args.k, args.n, args.trials)
    print("| accumulator bit | fused (fp32 acc) | reference (bf16 C) | flips above bf16 rounding | of those, fused detected |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['bit']} | {r['fused']:.0%} | {r['reference']:.0%} | {r['above_rounding']}/{r['trials']} | "
              f"{r['above_detected']}/{r['above_rounding']} |", flush=True)
    record.write(dict(m=args.m, k=args.k, n=args.n, trials=args.trials, rows=rows))


if __name__ == "__main__":
    main()
