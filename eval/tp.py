"""Tensor parallelism for the evaluation's GPT: Megatron-style, with the collectives as submodules.

``shard(model, rank, size, group)`` turns a full ``GPT`` (loaded with the pretrained state) into
TP rank ``rank`` of ``size``: in each block the attention's fused ``qkv`` and the MLP's ``fc`` keep
their rows of this rank (column parallel: for ``qkv`` the rows of its heads in q, k and v, so the
local output is ``[q_r | k_r | v_r]`` and ``attn.heads`` becomes heads / size), ``proj`` and
``out`` keep their input columns (row parallel, no bias), and two collectives sit around each:

- ``tp_in`` (``Copy``): identity forward; backward, the all-reduce of the input gradient;
- ``tp_out`` (``Reduce``): forward, the all-reduce of the partial products, then the bias once
  (as Megatron's row-parallel linear adds it after the reduction); backward identity.

They are submodules so the evaluation's sync points sit on the TP collectives (forward: the
reduced output; backward: the reduced input gradient) as well as on the GEMMs around them.
Embeddings, norms and the head are replicated. The products keep their module names, so the
fault sites and targets are those of the unsharded model. The tensors are plain local shards
(no DTensor): every detector and fault injection works on them unchanged; abft's DTensor
support is tested on its own (tests/integrations/test_dtensor.py).
"""
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class TP:
    """This rank's place in its replica's tensor-parallel group."""
    rank: int
    size: int
    group: object          # the process group of the replica's TP ranks
    ranks: tuple           # their global ranks, by TP rank


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, g):
        return g, None


class _CopyIn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        import torch.distributed as dist
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class Copy(nn.Module):
    """Input of a column-parallel product: identity; its gradient all-reduced over the group."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, x):
        return _CopyIn.apply(x, self.group)


class Reduce(nn.Module):
    """Output of a row-parallel product: the partial sums all-reduced, then the bias."""

    def __init__(self, group, bias):
        super().__init__()
        self.group = group
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())

    def forward(self, x):
        y = _AllReduce.apply(x, self.group)
        return y if self.bias is None else y + self.bias


def _linear(weight, bias):
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        lin.weight.copy_(weight)
        if bias is not None:
            lin.bias.copy_(bias)
    return lin


def _column(lin, rows):
    """The rows ``rows`` (an index tensor) of a linear: its column-parallel shard."""
    return _linear(lin.weight[rows], None if lin.bias is None else lin.bias[rows])


def _row(lin, rank, size):
    """This rank's input columns of a linear, without its bias: its row-parallel shard."""
    n = lin.in_features // size
    return _linear(lin.weight[:, rank * n:(rank + 1) * n], None)


def check(heads, dim, size, where="tp"):
    """ValueError naming ``where`` unless ``size`` TP ranks divide the heads and the width."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{where}: a whole number >= 1, got {size!r}")
    if heads % size:
        raise ValueError(f"{where}: {size} does not divide the attention heads "
                         f"(train.heads = {heads})")
    if dim % size:
        raise ValueError(f"{where}: {size} does not divide the model width (train.dim = {dim})")


def shard(model, rank, size, group):
    """Make the full ``GPT`` ``model`` TP rank ``rank`` of ``size`` in place; returns it."""
    check(model.cfg.heads, model.cfg.dim, size)
    for blk in model.blocks:
        a, m = blk.attn, blk.mlp
        d = a.qkv.in_features
        n = d // size
        rows = torch.cat([torch.arange(j * d + rank * n, j * d + (rank + 1) * n) for j in range(3)])
        a.qkv = _column(a.qkv, rows)
        a.heads //= size
        a.tp_in, a.tp_out = Copy(group), Reduce(group, a.proj.bias)
        a.proj = _row(a.proj, rank, size)
        h = m.fc.out_features // size
        m.fc = _column(m.fc, torch.arange(rank * h, (rank + 1) * h))
        m.tp_in, m.tp_out = Copy(group), Reduce(group, m.out.bias)
        m.out = _row(m.out, rank, size)
    return model


def gather(tp, obj):
    """``obj`` (JSON) of every rank of the TP group, by TP rank; ``[obj]`` without TP."""
    if tp is None:
        return [obj]
    from abft.eval.sync import bcast_json
    return [bcast_json(obj if r == tp.rank else None, src, tp.group)
            for r, src in enumerate(tp.ranks)]
