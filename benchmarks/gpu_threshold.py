"""The bf16 per-bit table under the interpreter, with the fused kernel's threshold as a GPU
would set it: one directed (toward zero) rounding per G products (``--groups``), instead of the
interpreter's own model. On an H200 (BENCHMARKS.md, 2026-12-04) the kernel missed flips of
accumulator bits 11-17 that change the bf16 output; the card's accumulation was measured at 16
products per rounding where the model assumes 8. This asks, without a GPU, what the model's 8
costs in detection and what 16 would give back. The interpreter computes the product more
exactly than the tensor cores, so its clean residuals are smaller: a lead, not the GPU's table.

    TRITON_INTERPRET=1 python benchmarks/gpu_threshold.py --groups 8,16 --bits 10-19 --trials 10
"""
import argparse

from abft.bench import bitflips, results
from abft.kernels import threshold as T
from abft.kernels import triton_gemm as TG


def run(groups, bits, trials, k=4096):
    real = TG.accumulation
    out = {}
    try:
        for g in groups:
            TG.accumulation = lambda kk, dtype, tf32, bk, g=g: T.blocked(kk, g, directed=True)
            out[g] = bitflips.run(k=k, trials=trials, bits=bits)
    finally:
        TG.accumulation = real
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", default="8,16")
    ap.add_argument("--bits", default="10-19")
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--k", type=int, default=4096)
    results.add_arguments(ap, "gpu_threshold")
    args = ap.parse_args(argv)
    record = results.start(args, "gpu_threshold", argv)
    lo, _, hi = args.bits.partition("-")
    bits = range(int(lo), int(hi or lo) + 1)
    groups = [int(g) for g in args.groups.split(",")]
    res = run(groups, bits, args.trials, args.k)
    print("| bit | " + " | ".join(f"G={g}: above rounding, detected" for g in groups) + " |")
    print("|---|" + "---|" * len(groups))
    for i, bit in enumerate(bits):
        print(f"| {bit} | " + " | ".join(f"{res[g][i]['above_detected']}/{res[g][i]['above_rounding']}"
                                         for g in groups) + " |", flush=True)
    for g in groups:
        print(f"G={g}: {sum(r['above_detected'] for r in res[g])} of "
              f"{sum(r['above_rounding'] for r in res[g])} flips above bf16 rounding caught")
    record.write(dict(k=args.k, trials=args.trials, groups={str(g): res[g] for g in groups}))


if __name__ == "__main__":
    main()
