"""Train a small GPT with abft.StepGuard; every rank prints its verdicts.

    torchrun --nproc_per_node 2 examples/train_guarded.py [--steps 20] [--fault-step 5]

On CPU the ranks use gloo (NCCL on GPUs). ``--fault-step`` injects one accumulator fault on the
last rank at that step: the guard reruns the step on every rank, finds it transient and goes on.
Also runs as a single process (``python examples/train_guarded.py``).
"""
import argparse
import os

import torch
import torch.distributed as dist

import abft
from abft.eval.models import GPT, GPTConfig, Task


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--fault-step", type=int, default=5)
    ap.add_argument("--every", type=int, default=1, help="check one step in N")
    ap.add_argument("--tracker", default="runs/guard/track-{rank}.jsonl")
    args = ap.parse_args()
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        torch.set_num_threads(1)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    task = Task(4)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=task.vocab, block=task.block, layers=2, heads=4, dim=32))
    abft.protect(model)
    net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    guard = abft.StepGuard(opt, decision="rerun", every=args.every, tracker=args.tracker)
    gen = torch.Generator().manual_seed(1 + rank)
    for step in range(args.steps):
        x, y = task.batch(gen, 16, "corpus")
        fault = step == args.fault_step and rank == world - 1
        inj = abft.inject(when=lambda c: c.phase == "forward", kind="add", value=10.0) if fault else None

        def closure():
            with abft.checked(model):
                loss = net(x, y)
                loss.backward()
            return loss
        if inj:
            inj.start()
        loss = guard.step(closure)
        if inj:
            inj.stop()
        rec = guard.records[-1] if guard.records and guard.records[-1]["step"] == step else None
        verdict = "unchecked" if rec is None else (
            f"{rec['decision']} {rec['persistence'] or ''} alarms per rank {rec['alarm_counts']}"
            if any(rec["alarm_counts"]) else "clean")
        print(f"rank {rank} step {step:3d} loss {loss.item():.4f} {verdict}", flush=True)
    guard.close()
    if dist.is_initialized():
        dist.barrier()              # no rank tears its connections down while another still reads
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
