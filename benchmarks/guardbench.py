"""Whole-step cost of ``abft.StepGuard`` (``python benchmarks/guardbench.py``): a GPT training step
plain, guarded with every GEMM checked, and guarded with 1-in-10 sampling, as medians of
interleaved rounds in one run; plus the guard's own cost (the per-step resolve, timed inside
the guard) and one guard all-reduce over gloo between 2 local ranks, timed directly."""
import copy
import os
import statistics
import tempfile
import time

import torch

import abft
from abft.bench import results
from abft.eval.models import bench_gpt


def _allreduce_us(rank, port, out, n=200):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    v = torch.zeros(2, dtype=torch.int64)
    for _ in range(20):
        dist.all_reduce(v)
    t0 = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(v)
    dt = (time.perf_counter() - t0) / n
    if rank == 0:
        with open(out, "w") as f:
            f.write(str(dt * 1e6))
    dist.destroy_process_group()


def main(rounds=12):
    """Print the table; returns its figures (ms, ratios to plain, the guard's own costs)."""
    model, (x, y) = bench_gpt()
    plain = copy.deepcopy(model)
    full, sampled = copy.deepcopy(model), copy.deepcopy(model)
    abft.protect(full)
    abft.protect(sampled)
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in
            (("plain", plain), ("every", full), ("1-in-10", sampled))}
    guards = {"every": abft.StepGuard(opts["every"], decision="continue"),
              "1-in-10": abft.StepGuard(opts["1-in-10"], decision="continue", every=10)}
    mods = {"plain": plain, "every": full, "1-in-10": sampled}

    def closure(m):
        def run():
            with abft.checked(m):
                loss = m(x, y)
                loss.backward()
            return loss
        return run
    times = {k: [] for k in mods}
    for _ in range(rounds):
        for k, m in mods.items():
            t0 = time.perf_counter()
            if k == "plain":
                opts[k].zero_grad(set_to_none=True)
                m(x, y).backward()
                opts[k].step()
            else:
                for _ in range(1 if k == "every" else 10):
                    guards[k].step(closure(m))
            dt = time.perf_counter() - t0
            times[k].append(dt if k != "1-in-10" else dt / 10)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"bench_gpt training step, medians of {rounds} interleaved rounds "
          f"(1-in-10: mean over 10 guarded steps per round), {torch.get_num_threads()} threads")
    for k, v in med.items():
        print(f"  {k:8s} {v:8.1f} ms  {v / med['plain']:5.2f}x plain")
    g = guards["every"]
    resolve_ms = g.resolve_s / g.step_index * 1e3
    print(f"  guard resolve (flush of the step's verdicts, inside the checked step): {resolve_ms:.3f} ms "
          f"per step = {100 * resolve_ms / med['every']:.2f}% of a guarded step")
    import torch.multiprocessing as mp

    from abft.eval.replicas import free_port
    out = os.path.join(tempfile.mkdtemp(), "ar.txt")
    mp.spawn(_allreduce_us, args=(free_port(), out), nprocs=2, join=True)
    us = float(open(out).read())
    print(f"  guard all-reduce (int64[2], gloo, 2 local ranks): {us:.1f} us = "
          f"{100 * us / 1e3 / med['every']:.3f}% of a guarded step")
    return dict(rounds=rounds, threads=torch.get_num_threads(), step_ms=med,
                over_plain={k: v / med["plain"] for k, v in med.items()},
                resolve_ms=resolve_ms, allreduce_us=us)


def cli(argv=None):
    return results.run_rounds("guardbench", main, 12, argv)


if __name__ == "__main__":
    raise SystemExit(cli())
