"""What ``abft.OutputCheck``'s operand fingerprints would cost on a GPU, on paper
(``python benchmarks/operandcost.py``).

A training step (forward and backward) of one Llama decoder layer built from a config
(transformers, no download; SDPA attention, bf16 autocast) runs on the CPU under
``abft.checked`` and ``abft.OutputCheck``, with its operands taken and without, after the steps
that teach the check which sites no product reads; every fingerprint the check takes or
verifies in that step is counted with its bytes and its kernel launches. Those counts are
what this implementation would issue on a GPU as well (the check is torch code), so they are
priced there against the step's GEMMs (what taking the operands adds, with the products'
outputs carried in both arms):

- the GEMMs: 6 x (the layer's linear weights) FLOPs per token (forward and both backward
  products), attention's two products left out, at the card's dense bf16 peak (the GEMMs as
  fast as they can be: the pessimistic side for the ratio);
- a fingerprint of n elements of b bytes: ``rest.fingerprint``'s passes, b bytes read, 8 written
  (its float64 copy) and 8 read again (the product with the block weights) per element, at the
  card's HBM bandwidth, and each of its launches at ``--launch-us``; a verification is another
  fingerprint plus the comparison, whose result the host reads (a wait, ``--sync-us``); and,
  for comparison, a fingerprint kernel that reads each element once (b bytes; not built for the
  GPU: the compiled one is the CPU's).

The elements taken scale with the tokens, as the GEMMs do (SDPA keeps no T x T scores), so the
traffic's share does not depend on ``--tokens``; the launches' does: the counts of a
step are priced at ``--step-tokens`` on the line through two token counts. Nothing here ran on a
GPU.
"""
import argparse

import torch

from abft.bench import results

CARDS = {"h100": dict(flops=989e12, bw=3.35e12), "h200": dict(flops=989e12, bw=4.8e12)}


def inventory(width, ffn, heads, kv_heads, tokens, operands):
    """(fingerprints, bytes read by them, launches) of one training step, and the GEMM FLOPs."""
    import transformers
    import abft
    from abft.detectors import outputs
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=width, intermediate_size=ffn,
                                   num_hidden_layers=1, num_attention_heads=heads,
                                   num_key_value_heads=kv_heads, max_position_embeddings=tokens,
                                   attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg)
    layer = model.model.layers[0]
    abft.protect(model)
    counts = dict(calls=0, elements=0, bytes=0)
    real = outputs.fingerprint

    def counted(t, block, *a, **k):
        counts["calls"] += 1
        counts["elements"] += t.numel()
        counts["bytes"] += t.numel() * t.element_size()
        return real(t, block, *a, **k)
    outputs.fingerprint = counted
    x = torch.randint(0, 256, (1, tokens))

    def step():
        with abft.checked(model), abft.OutputCheck(model=model, operands=operands) as chk, \
                torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=x, labels=x).loss.backward()
        abft.flush()
        return chk
    abft.reset()
    try:
        for _ in range(outputs.LEARN + 2):  # until the sites no product reads are passed over
            step()                        # (an output may die a step late)
        counts.update(calls=0, elements=0, bytes=0)
        chk = step()
    finally:
        outputs.fingerprint = real
    weights = sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))
    return dict(counts, recorded=chk.recorded, taken=chk.taken, flops=6 * weights * tokens)


def extra(w, f, h, kv, tokens):
    """What taking the operands adds at ``tokens``: {calls, elements, bytes} (on minus off)."""
    on = inventory(w, f, h, kv, tokens, operands=True)
    off = inventory(w, f, h, kv, tokens, operands=False)
    return {k: on[k] - off[k] for k in ("calls", "elements", "bytes")}, on["flops"] / tokens


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python benchmarks/operandcost.py")
    ap.add_argument("--shapes", default="2048x5632x16x4",
                    help="width x ffn x heads x kv_heads, comma-separated (4096x11008x32x8, "
                         "Llama-7B-like, ran here for over 20 minutes)")
    ap.add_argument("--tokens", type=int, default=32,
                    help="tokens run here (one sequence), and twice that: a line through the two")
    ap.add_argument("--step-tokens", type=int, default=8192, help="tokens of the priced step")
    ap.add_argument("--card", default="h100", choices=sorted(CARDS))
    ap.add_argument("--launch-us", type=float, default=5.0, help="per kernel launch (assumed)")
    ap.add_argument("--sync-us", type=float, default=20.0, help="per device wait (assumed)")
    ap.add_argument("--launches", type=int, default=6, help="kernels per fingerprint (assumed)")
    results.add_arguments(ap, "operandcost")
    args = ap.parse_args(argv)
    record = results.start(args, "operandcost", argv)
    c = CARDS[args.card]
    rows = []
    print("| layer (width x ffn) | operands fingerprinted a step | their elements per token | "
          "per token and layer, GEMM FLOPs | GEMMs us | operands' traffic us | launches + "
          "waits us | operands / GEMMs (traffic alone) | traffic of a one-read kernel / GEMMs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for spec in args.shapes.split(","):
        w, f, h, kv = (int(v) for v in spec.split("x"))
        t1, t2 = args.tokens, 2 * args.tokens
        e1, flops = extra(w, f, h, kv, t1)
        e2, _ = extra(w, f, h, kv, t2)
        at = {k: e1[k] + (e2[k] - e1[k]) * (args.step_tokens - t1) / (t2 - t1) for k in e1}
        at["calls"] = e2["calls"]     # as many tensors at any length; their sizes grow
        gemm = flops * args.step_tokens / c["flops"]
        traffic = (at["bytes"] + 16 * at["elements"]) / c["bw"]
        fixed = at["calls"] * (args.launches * args.launch_us + args.sync_us / 2) * 1e-6
        print(f"| {w} x {f} | {at['calls']:.0f} | {(e2['elements'] - e1['elements']) / (t2 - t1):.0f} | "
              f"{flops:.3g} | {gemm * 1e6:.0f} | {traffic * 1e6:.0f} | {fixed * 1e6:.0f} | "
              f"{(traffic + fixed) / gemm:.3f} ({traffic / gemm:.3f}) | "
              f"{at['bytes'] / c['bw'] / gemm:.3f} |")
        rows.append(dict(shape=spec, fingerprints=at["calls"],
                         elements_per_token=(e2["elements"] - e1["elements"]) / (t2 - t1),
                         flops_per_token=flops, gemm_us=gemm * 1e6, traffic_us=traffic * 1e6,
                         fixed_us=fixed * 1e6, over_gemms=(traffic + fixed) / gemm,
                         traffic_over_gemms=traffic / gemm,
                         one_read_over_gemms=at["bytes"] / c["bw"] / gemm))
    print(f"\nCounted at {args.tokens} and {2 * args.tokens} tokens, priced at {args.step_tokens} "
          f"on a line through the two; one layer (and the head, whose operands count, not its "
          f"FLOPs), bf16 autocast, {args.card}: {c['flops'] / 1e12:.0f} TFLOPS, "
          f"{c['bw'] / 1e12:.2f} TB/s; {args.launches} launches of {args.launch_us} us a "
          f"fingerprint, a wait of {args.sync_us} us a verification (assumed).")
    record.write(dict(card=args.card, tokens=args.tokens, step_tokens=args.step_tokens,
                      launch_us=args.launch_us, sync_us=args.sync_us, launches=args.launches,
                      rows=rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
