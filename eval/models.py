"""A small GPT-style decoder: pre-norm blocks, multi-head attention through ``torch.matmul``
(so ``abft.checked()`` sees its products) and an MLP through ``nn.Linear`` (so ``abft.protect``
swaps it)."""
import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class GPTConfig:
    vocab: int = 64
    block: int = 32
    layers: int = 2
    heads: int = 4
    dim: int = 64
    mlp_ratio: int = 4


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.register_buffer("mask", torch.ones(cfg.block, cfg.block, dtype=torch.bool).tril(),
                             persistent=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(-1)
        y = torch.matmul(att, v).transpose(1, 2).reshape(b, t, d)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc = nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim)
        self.out = nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim)

    def forward(self, x):
        return self.out(torch.nn.functional.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.attn, self.mlp = Attention(cfg), MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg=GPTConfig()):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.block, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        if targets is None:
            return logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def bench_gpt():
    """``abft bench --model abft.eval.models:bench_gpt``: a 2-layer GPT block stack, a batch of
    8 x 64 tokens; returns (model, inputs) where ``model(*inputs)`` is the loss."""
    cfg = GPTConfig(vocab=256, block=64, layers=2, heads=4, dim=256)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab, (8, cfg.block + 1), generator=g)
    return GPT(cfg), (idx[:, :-1], idx[:, 1:])
