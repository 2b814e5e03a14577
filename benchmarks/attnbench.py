"""What the softmax invariants of checked attention cost (``python benchmarks/attnbench.py``).

Two comparisons per shape (batch, heads, queries = keys, head width), the median ratio of
back-to-back pairs (``overhead.interleaved``) and its quartiles: torch's own attention (QK^T, softmax, PV, forward and backward) with ``torch.softmax``
against the same with ``abft.detectors.attention.softmax``; and ``F.scaled_dot_product_attention`` under
``abft.checked(sdpa=True)`` (both products checked) with the plain softmax against the invariants.
"""
import argparse

import torch
import torch.nn.functional as F


def main(argv=None):
    import abft
    from abft.detectors import attention
    from abft import interception
    from abft.bench import results
    from abft.bench.overhead import interleaved
    ap = argparse.ArgumentParser(prog="python benchmarks/attnbench.py")
    ap.add_argument("--shapes", default="8x4x128x64,8x4x256x64,4x8x512x64")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    results.add_arguments(ap, "attnbench")
    args = ap.parse_args(argv)
    record = results.start(args, "attnbench", argv)
    torch.set_num_threads(args.threads)
    plain = lambda s, module=None: torch.softmax(s, -1)
    checked = attention.softmax
    print("| shape | torch attention ms | with invariants ms | ratio (IQR) | checked sdpa ms | "
          "with invariants ms | ratio (IQR) |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for spec in args.shapes.split(","):
        b, h, n, d = (int(x) for x in spec.split("x"))
        q, k, v = (torch.randn(b, h, n, d, requires_grad=True) for _ in range(3))
        do = torch.randn(b, h, n, d)

        def torch_step(sm):
            def run():
                out = sm(q @ k.transpose(-2, -1) / d ** 0.5) @ v
                out.backward(do)
            return run

        def sdpa_step(sm):
            def run():
                interception.attention.softmax = sm
                try:
                    with abft.checked(sdpa=True):
                        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                    out.backward(do)
                    abft.flush()
                finally:
                    interception.attention.softmax = checked
            return run
        a = interleaved(torch_step(plain), torch_step(checked), args.reps)
        c = interleaved(sdpa_step(plain), sdpa_step(checked), max(3, args.reps // 3))
        row = [f"{r['plain_ms']:.1f} | {r['checked_ms']:.1f} | {r['ratio']:.3f} "
               f"({r['q1']:.3f}-{r['q3']:.3f})" for r in (a, c)]
        print(f"| {spec} | {row[0]} | {row[1]} |")
        rows.append(dict(shape=spec, torch_attention=a, checked_sdpa=c))
    record.write(dict(threads=args.threads, reps=args.reps, rows=rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
