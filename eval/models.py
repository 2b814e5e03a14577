"""A small GPT-style decoder and the training job the evaluation runs on.

The decoder: pre-norm blocks, multi-head attention whose two products are ``torch.matmul`` calls
in their own submodules (``attn.scores``, ``attn.context``: ``abft.checked()`` checks them and the
evaluation syncs them one by one), softmax and GELU as submodules too (the non-GEMM fault sites),
and ``nn.Linear`` layers (``abft.protect`` swaps them).

The job (``Task``): a seeded synthetic corpus made in code for pretraining (digit strings, each
followed by a separator and either its copy or its reversal, at random) and a fine-tuning task
with an accuracy metric (always the reversal). Pretraining leaves the model guessing between the
two (about half right); the fine-tune teaches it which. Accuracy is exact
match of the whole reversed string under teacher forcing, which equals greedy decoding's: all
argmaxes right means greedy decoding follows the same path.
"""
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


class MatMul(nn.Module):
    """``torch.matmul(a, b)`` as a submodule, so a sync point and a label can sit on it."""

    def forward(self, a, b):
        return torch.matmul(a, b)


class Softmax(nn.Module):
    def forward(self, x):
        return x.softmax(-1)


class GELU(nn.Module):
    def forward(self, x):
        return torch.nn.functional.gelu(x)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.scores, self.softmax, self.context = MatMul(), Softmax(), MatMul()
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.register_buffer("mask", torch.ones(cfg.block, cfg.block, dtype=torch.bool).tril(),
                             persistent=False)
        self.tp_in = self.tp_out = None      # tensor parallel: eval/tp.py's collectives

    def forward(self, x):
        b, t, _ = x.shape
        x = x if self.tp_in is None else self.tp_in(x)
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        att = self.scores(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        att = self.softmax(att.masked_fill(~self.mask[:t, :t], float("-inf")))
        y = self.proj(self.context(att, v).transpose(1, 2).reshape(b, t, -1))
        return y if self.tp_out is None else self.tp_out(y)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc = nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim)
        self.act = GELU()
        self.out = nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim)
        self.tp_in = self.tp_out = None      # tensor parallel: eval/tp.py's collectives

    def forward(self, x):
        x = x if self.tp_in is None else self.tp_in(x)
        y = self.out(self.act(self.fc(x)))
        return y if self.tp_out is None else self.tp_out(y)


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
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                                 ignore_index=IGNORE)


IGNORE = -100


@dataclass
class Task:
    """The corpus (``kind="corpus"``) and the reversal task (``kind="reverse"``) on
    ``digits``-long digit strings.

    A sequence is ``x SEP y``: for the corpus ``y`` is x or x reversed, one or the other at random
    (loss on every next token); for the task ``y`` is x reversed (loss and accuracy on ``y``
    only). Vocabulary: 0..9 and SEP = 10.
    """
    digits: int = 4

    SEP = 10
    vocab = 11

    @property
    def block(self):
        return 2 * self.digits

    def batch(self, gen, size, kind="reverse"):
        """(inputs, targets) for ``size`` sequences drawn from the generator ``gen``."""
        x = torch.randint(0, 10, (size, self.digits), generator=gen)
        if kind == "reverse":
            y = x.flip(1)
        else:
            y = torch.where(torch.rand(size, 1, generator=gen) < 0.5, x.flip(1), x)
        seq = torch.cat([x, torch.full((size, 1), self.SEP), y], 1)
        inp, tgt = seq[:, :-1], seq[:, 1:].clone()
        if kind == "reverse":
            tgt[:, :self.digits] = IGNORE
        return inp, tgt

    def accuracy(self, model, seed=12345, size=512):
        """Exact-match accuracy on ``size`` held-out reversals (no grad)."""
        inp, tgt = self.batch(torch.Generator().manual_seed(seed), size)
        with torch.no_grad():
            pred = model(inp).argmax(-1)
        ok = ((pred == tgt) | (tgt == IGNORE)).all(1)
        return ok.float().mean().item()


def bench_gpt():
    """``abft bench --model abft.eval.models:bench_gpt``: a 2-layer GPT block stack, a batch of
    8 x 64 tokens; returns (model, inputs) where ``model(*inputs)`` is the loss."""
    cfg = GPTConfig(vocab=256, block=64, layers=2, heads=4, dim=256)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab, (8, cfg.block + 1), generator=g)
    return GPT(cfg), (idx[:, :-1], idx[:, 1:])
