"""Synchronisation of a replica pair: compare, record, overwrite.

Both replicas run the same code and pass the same sync points in the same order; at each point the
healthy replica (H) sends its tensor over a ``Link`` and the faulty one (F) compares its own with
it, bit for bit, records a ``Mismatch`` and, where the mode says so, carries on with H's values.

Modes:
- ``computation``: after each chosen submodule's output (forward) and input gradients
  (backward), after backward the parameter gradients, after the optimizer step the parameters and
  the optimizer state. Every point is overwritten, so a difference is pinned where it arose.
- ``parameter``: only the gradients (deviation ``|g_F - g_H| / |g_H|``, not overwritten) and,
  after the optimizer step, parameters and optimizer state copied from H.
- ``none``: free running; the gradient deviation and parameter divergence are recorded, nothing
  is overwritten.

Links: ``LocalLink`` (one process: H's step runs first and queues its tensors, F's replays them)
and ``DistLink`` (two ranks of ``torch.distributed``: a broadcast from H's rank per point).
"""
import collections
from dataclasses import asdict, dataclass

import torch

from abft.hook import as_bits

MODES = ("computation", "parameter", "none")


@dataclass
class Mismatch:
    """Where F differed from H at one sync point, and by how much."""
    step: int
    micro_step: int
    point: str           # forward | backward | loss | grad | param | opt_state
    module: str
    tensor: str          # output | grad_input[i] | the parameter's or state's name
    numel: int
    mismatched: int
    frequency: float     # mismatched / numel
    severity_max: float  # relative difference |F - H| / |H| of mismatched elements (finite ones)
    severity_median: float
    max_abs: float
    nonfinite: int       # mismatched elements that are NaN/Inf in F
    row: int = None      # the first mismatched element, in the last two dims
    col: int = None
    seq: int = None      # the sync point's number in the run (the same on every TP rank)

    def to_dict(self):
        return asdict(self)


def compare(h, f):
    """Mismatch statistics of f against h (same shape and dtype), or None when bit-identical."""
    diff = as_bits(h) != as_bits(f)         # bit for bit for floats (NaN == NaN, -0 != +0)
    n = int(diff.sum())
    if n == 0:
        return None
    hd, fd = h[diff].double(), f[diff].double()
    nonfinite = int((~torch.isfinite(fd)).sum())
    ok = torch.isfinite(fd) & torch.isfinite(hd)
    ad = (fd - hd).abs()[ok]
    rel = ad / hd.abs()[ok].clamp_min(torch.finfo(torch.float32).tiny)
    idx = diff.nonzero()[0].tolist()
    row, col = (idx[-2], idx[-1]) if len(idx) >= 2 else (0, idx[-1]) if idx else (None, None)
    return dict(numel=diff.numel(), mismatched=n, frequency=n / diff.numel(),
                severity_max=float(rel.max()) if rel.numel() else float("inf"),
                severity_median=float(rel.median()) if rel.numel() else float("inf"),
                max_abs=float(ad.max()) if ad.numel() else float("inf"),
                nonfinite=nonfinite, row=row, col=col)


class LocalLink:
    """One process: H's sends are queued (copies); F's receives pop them in order."""

    def __init__(self):
        self.queue = collections.deque()

    def send(self, t):
        self.queue.append(t.detach().clone())

    def recv(self, like):
        if not self.queue:
            raise RuntimeError("abft eval: the faulty replica passed more sync points than the "
                               "healthy one (the replicas ran different code)")
        h = self.queue.popleft()
        if h.shape != like.shape or h.dtype != like.dtype:
            raise RuntimeError(f"abft eval: sync point out of step: {tuple(h.shape)} {h.dtype} "
                               f"vs {tuple(like.shape)} {like.dtype}")
        return h

    def send_json(self, obj):
        self.queue.append(obj)

    def recv_json(self):
        return self.queue.popleft()


class DistLink:
    """Two ranks of a process group: every point is one broadcast from H's rank."""

    def __init__(self, healthy_rank, group=None):
        self.src, self.group = healthy_rank, group

    def send(self, t):
        import torch.distributed as dist
        dist.broadcast(t.detach().contiguous(), self.src, group=self.group)

    def recv(self, like):
        import torch.distributed as dist
        buf = torch.empty_like(like, memory_format=torch.contiguous_format)
        dist.broadcast(buf, self.src, group=self.group)
        return buf

    def send_json(self, obj, src=None):
        return bcast_json(obj, self.src if src is None else src, self.group)

    def recv_json(self, src=None):
        return bcast_json(None, self.src if src is None else src, self.group)


def bcast_json(obj, src, group):
    """A JSON value broadcast as bytes (no pickling between ranks)."""
    import json

    import torch.distributed as dist
    data = json.dumps(obj).encode() if obj is not None else b""
    n = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(n, src, group=group)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if obj is not None else \
        torch.empty(int(n), dtype=torch.uint8)
    dist.broadcast(buf, src, group=group)
    return json.loads(bytes(buf.tolist()).decode())


class _Take(torch.autograd.Function):
    """Forward: H's values in place of F's; backward: the gradient unchanged (F's graph stays)."""

    @staticmethod
    def forward(ctx, f, h):
        return h.clone()

    @staticmethod
    def backward(ctx, g):
        return g, None


class Sync:
    """The sync points of one replica. ``role`` is "H" or "F"; ``labels`` (step, micro_step) are
    set by the runner before each micro-step."""

    def __init__(self, role, link, mode="computation", modules=None):
        if mode not in MODES:
            raise ValueError(f"sync mode: one of {MODES}, got {mode!r}")
        self.role, self.link, self.mode = role, link, mode
        self.modules = modules
        self.mismatches = []
        self.step = self.micro_step = 0
        self.seq = 0            # sync points passed: orders the mismatches of TP ranks
        self.active = False
        self.handles = []

    # -- one point
    def point(self, kind, module, name, t, overwrite):
        self.seq += 1
        if self.role == "H":
            self.link.send(t)
            return t
        h = self.link.recv(t)
        m = compare(h, t)
        if m is None:
            return t
        self.mismatches.append(Mismatch(self.step, self.micro_step, kind, module, name, **m,
                                        seq=self.seq))
        return h if overwrite else t

    # -- submodule hooks
    def attach(self, model):
        """Hooks on the submodules named in ``modules`` (default: every leaf that computes)."""
        names = self.modules if self.modules is not None else default_points(model)
        mods = dict(model.named_modules())
        for n in names:
            if n not in mods:
                raise ValueError(f"sync.modules: no submodule {n!r} in the model")
            self.handles.append(mods[n].register_forward_hook(self._fwd(n)))
            if not isinstance(mods[n], torch.nn.Embedding):     # its input is indices
                self.handles.append(mods[n].register_full_backward_hook(self._bwd(n)))
        return self

    def detach(self):
        for h in self.handles:
            h.remove()
        self.handles = []

    def _fwd(self, name):
        def hook(mod, args, out):
            if not self.active or self.mode != "computation":
                return None
            mine = out.detach()
            new = self.point("forward", name, "output", mine, True)
            return _Take.apply(out, new) if new is not mine else None
        return hook

    def _bwd(self, name):
        def hook(mod, grad_input, grad_output):
            if not self.active or self.mode != "computation":
                return None
            out, changed = [], False
            for i, g in enumerate(grad_input):
                if g is None:
                    out.append(g)
                    continue
                new = self.point("backward", name, f"grad_input[{i}]", g, True)
                changed |= new is not g
                out.append(new)
            return tuple(out) if changed else None
        return hook

    # -- whole-model points
    def loss(self, loss):
        self.point("loss", "", "loss", loss.detach().reshape(1), False)

    def grads(self, named_params):
        """Gradients after backward: overwritten in ``computation`` mode; returns F's deviation
        |g_F - g_H| / |g_H| over all of them (None on H)."""
        num = den = 0.0
        for name, p in named_params:
            if p.grad is None:
                continue
            self.seq += 1
            if self.role == "H":
                self.link.send(p.grad)
                continue
            h = self.link.recv(p.grad)
            m = compare(h, p.grad)
            num += float((p.grad.double() - h.double()).pow(2).sum())
            den += float(h.double().pow(2).sum())
            if m is not None and self.mode != "none":
                self.mismatches.append(Mismatch(self.step, self.micro_step, "grad",
                                                name.rpartition(".")[0], name, **m,
                                                seq=self.seq))
                if self.mode == "computation":
                    p.grad.copy_(h)
        if self.role == "H":
            return None
        return (num ** 0.5) / (den ** 0.5) if den > 0 else (0.0 if num == 0 else float("inf"))

    def state(self, named_params, optimizer):
        """Parameters and optimizer state after the step: compared and overwritten in
        ``computation`` and ``parameter`` modes; returns F's divergence |θ_F - θ_H| / |θ_H|."""
        num = den = 0.0
        copy = self.mode != "none"
        for name, p in named_params:
            tensors = [("param", name, p.data)]
            st = optimizer.state.get(p, {})
            tensors += [("opt_state", f"{name}:{k}", v) for k, v in sorted(st.items())
                        if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0]
            for kind, label, t in tensors:
                self.seq += 1
                if self.role == "H":
                    self.link.send(t)
                    continue
                h = self.link.recv(t)
                if kind == "param":
                    num += float((t.double() - h.double()).pow(2).sum())
                    den += float(h.double().pow(2).sum())
                m = compare(h, t)
                if m is not None:
                    if self.mode == "computation":
                        self.mismatches.append(Mismatch(self.step, self.micro_step, kind,
                                                        name.rpartition(".")[0], label, **m,
                                                        seq=self.seq))
                    if copy:
                        t.copy_(h)          # through .data: no version bump, as a restore would
        if self.role == "H":
            return None
        return (num ** 0.5) / (den ** 0.5) if den > 0 else 0.0


def default_points(model):
    """Every leaf submodule with a computation: linears, attention products, softmax, norms,
    GELU, embeddings."""
    return [n for n, m in model.named_modules() if n and not list(m.children())]
