"""Train a small residual MLP stack with tensor, sequence and data parallelism, checked by abft.

    torchrun --nproc_per_node 4 examples/train_tp_fsdp.py [--steps 8] [--tp 2] [--fault-step 3]

Tensor parallelism (column-parallel up projection, row-parallel down projection) with sequence-
parallel norms inside each group of ``--tp`` ranks, FSDP2 (``fully_shard``) across the groups.
``abft.protect(model)`` is the one line abft needs: every rank checks the GEMMs it computes, the
forward and both backward products of its own shards, and ``StepGuard``'s all-reduce makes every
rank take the same decision. ``--fault-step`` adds one accumulator fault on the last rank at that
step: the guard reruns the step on every rank and goes on. gloo on the CPU, NCCL on GPUs.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

import abft


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--tp", type=int, default=2, help="ranks per tensor-parallel group")
    ap.add_argument("--fault-step", type=int, default=3)
    ap.add_argument("--tracker", default="runs/tp-fsdp/track-{rank}.jsonl")
    args = ap.parse_args()
    world, dim, seq = int(os.environ.get("WORLD_SIZE", 1)), 32, 16
    if args.tp < 1 or world % args.tp or seq % args.tp:
        print(f"train_tp_fsdp.py: --tp: {args.tp} does not divide the {world} ranks and the "
              f"sequence of {seq}", file=sys.stderr)
        sys.exit(2)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.set_num_threads(1)
    device = "cuda" if cuda else "cpu"
    mesh = init_device_mesh(device, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(dim) for _ in range(2)]).to(device)
    for block in model:
        parallelize_module(block, mesh["tp"], {
            "norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1))})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    abft.protect(model)                                    # the one line
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guard = abft.StepGuard(opt, decision="rerun", tracker=args.tracker)
    dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    gen = torch.Generator().manual_seed(1 + dp)             # each data-parallel group its data
    target = torch.randn(dim, dim, generator=torch.Generator().manual_seed(7))
    part = seq // args.tp
    for step in range(args.steps):
        x = torch.randn(8, seq, dim, generator=gen)
        y = torch.tanh(x @ target)
        x, y = (t[:, tp * part:(tp + 1) * part].to(device) for t in (x, y))   # my sequence part
        fault = step == args.fault_step and rank == world - 1
        inj = abft.inject(when=lambda c: c.phase == "forward", kind="add", value=10.0) if fault else None

        def closure():
            with abft.checked(model):
                loss = (model(x) - y).square().mean()
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            return loss
        if inj:
            inj.start()
        loss = guard.step(closure)
        if inj:
            inj.stop()
        rec = guard.records[-1] if guard.records and guard.records[-1]["step"] == step else None
        verdict = "clean" if rec is None or not any(rec["alarm_counts"]) else (
            f"{rec['decision']} {rec['persistence'] or ''} alarms per rank {rec['alarm_counts']}")
        print(f"rank {rank} (dp {dp}, tp {tp}) step {step:2d} loss {loss.item():.4f} {verdict}",
              flush=True)
    cov = {r["module"]: r["checked"] for r in abft.coverage()}
    print(f"rank {rank} checked calls per module {cov}", flush=True)
    guard.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
