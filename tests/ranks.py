"""Helpers for the tests' spawned gloo ranks."""
import os
import sys


def exit_clean():
    """End a spawned rank that finished its work (results written, process group destroyed)
    without the interpreter's finalization: there, tensors still held by gloo's worker threads
    can abort the process (SIGABRT, "terminate called without an active exception"; seen twice
    in this suite's clean-clone runs on 2026-12-04, cf. pytorch/pytorch#179291). Only on the
    success path: a rank that raised keeps its traceback and exit code."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_rank(rank, world, port, path, work):
    """A spawned gloo rank of ``world`` on the CPU: ``work(rank)``'s result written as JSON to
    ``path`` formatted with the rank, then the process group torn down and ``exit_clean``."""
    import json

    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        res = work(rank)
        with open(path.format(rank=rank), "w") as f:
            json.dump(res, f)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    exit_clean()
