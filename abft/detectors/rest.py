"""Fingerprints of the training state at rest: parameters and optimizer state.

    rest = abft.RestCheck(optimizer)          # every parameter and its optimizer state
    ...
    found = rest.verify()                     # before optimizer.step(): [] or alarms
    rest.restore(found)                       # put located elements back to their sealed bits
    optimizer.step()
    rest.seal()                               # after it: the state the next step must find

A GEMM checksum sees a weight only through the products that read it; a bit flipped in HBM
between steps, in an Adam moment (no GEMM reads it) or in a weight whose checksums were cached
before the flip, is outside every product's check. ``seal`` reads each tensor's bits as integers
and keeps, per block of ``block`` (256) words (16- or 32-bit; a 64-bit element is two words),
three exact sums: the words as signed integers, weighted by their 1-based index k in the block,
and by f(k) = k^2 mod 4093 + 1. ``verify`` recomputes them. The sums are exact, so a change d of
the word at k moves the three by d, d k and d f(k): the word is located, and ``restore`` writes
its sealed bits back and checks the block again. Several changed words in one block are detected
(unless their differences cancel exactly) but not located.

Cost: ``seal`` and ``verify`` each read every tensor once (a parameter and two Adam moments, as
much as the optimizer step itself reads); ``every`` and the guard's sampling spread it.
"""
import time
import warnings

import torch

from abft import weightcache
from abft.kernels import compiled

_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 22          # elements per pass: bounds the float64 temporaries
MAX_ALARMS = 16           # located alarms per tensor; past that, one summary alarm


def _local(t):
    return t.to_local() if type(t).__name__ == "DTensor" else t


def memory_order(t):
    """``t``'s dimensions, outermost first in memory (a dense tensor in another order, transposed
    or channels_last, is read in this order: ``_bits``)."""
    if t.is_contiguous():
        return list(range(t.dim()))
    return sorted(range(t.dim()), key=lambda d: -t.stride(d))


def _bits(t):
    """``t``'s bits as a flat view of signed 16- or 32-bit integers (64-bit elements as two
    32-bit words; no copy)."""
    t = _local(t).detach()
    if not t.is_contiguous():            # dense in another order (channels_last): its memory
        t = t.permute(memory_order(t))
        if not t.is_contiguous():
            raise ValueError("abft.RestCheck: a tensor with gaps or overlaps in memory cannot "
                             "be fingerprinted in place")
    flat = t.reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.element_size() == 1:
        return flat.view(torch.uint8).to(torch.int16)     # a copy; read-only use
    return flat.view(torch.int16 if flat.element_size() == 2 else torch.int32)


_W = {}


def position_weights(block, device):
    """(block, 3) float64: 1, the 1-based index k, and f(k) = k^2 mod 4093 + 1 (kept)."""
    key = (block, str(device))
    if key not in _W:
        k = torch.arange(1, block + 1, dtype=torch.int64, device=device)
        _W[key] = torch.stack([torch.ones_like(k), k, k * k % 4093 + 1], 1).to(torch.float64)
    return _W[key]


def weight_of(k):
    """f(k) of ``position_weights``, for one index."""
    return k * k % 4093 + 1


def fingerprint(t, block, first=0, count=None):
    """Exact sums per block of ``block`` (at most 256) elements of ``t``'s bits, a (3, blocks)
    int64 tensor: plain, weighted by the index k (1-based) in the block, weighted by f(k).
    ``first``, ``count``: a range of blocks only.

    Every term and partial sum is an integer below 2^53 (|bits| < 2^31, k <= 256, f(k) <= 4093),
    so float64 sums are exact whatever the order: on the CPU the compiled library's one read of
    the words (``kernels/csrc``), elsewhere (or without it) ``fingerprint_torch``."""
    bits = _bits(t)
    nb = -(-bits.numel() // block)
    count = nb - first if count is None else count
    fast = compiled.fingerprint(bits[first * block:(first + count) * block], block)
    if fast is not None:                          # the compiled pass (CPU): the same sums
        return fast.t()
    return fingerprint_torch(bits, block, first, count)


def fingerprint_torch(bits, block, first, count):
    """``fingerprint``'s sums in torch (any device; the compiled version's oracle)."""
    out = torch.empty(count, 3, dtype=torch.int64, device=bits.device)
    w = position_weights(block, bits.device)
    per = max(1, _CHUNK // block)
    for b0 in range(first, first + count, per):
        b1 = min(first + count, b0 + per)
        x = bits[b0 * block:b1 * block].to(torch.float64)
        short = (b1 - b0) * block - x.numel()
        if short:                                   # the last block: zeros add nothing
            x = torch.cat([x, x.new_zeros(short)])
        with torch._C.DisableTorchFunction():       # not a product of the model's: unchecked
            out[b0 - first:b1 - first] = (x.view(-1, block) @ w).to(torch.int64)
    return out.t()


def located(now, sums, block, words):
    """[(block, word index or None, the plain sum's change)] of every block whose fingerprint
    changed: one changed word at k moves the three sums by d, d k and d f(k), so k = d k / d when
    the third agrees; several changed words (or one past ``words``) are not located."""
    out = []
    for b in (now != sums).any(0).nonzero().flatten().tolist():
        d0, d1, d2 = (int(x) for x in now[:, b] - sums[:, b])
        index = None
        if d0 != 0 and d1 % d0 == 0 and 1 <= d1 // d0 <= block and d2 == d0 * weight_of(d1 // d0):
            index = b * block + d1 // d0 - 1
            if index >= words:
                index = None
        out.append((b, index, d0))
    return out


class RestCheck:
    """Seal and verify fingerprints of ``optimizer``'s parameters and, with ``states``, their
    optimizer state tensors (Adam's moments; scalar ones such as ``step`` are left out).

    Args:
        optimizer: the optimizer whose ``param_groups`` and ``state`` are checked.
        names: optional {parameter: name} for the alarms (``protect``/``named_parameters``).
        states: check the optimizer state tensors too.
        block: elements per fingerprint block (more: less memory, coarser location).
    """

    def __init__(self, optimizer, *, names=None, states=True, block=256):
        if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= 256:
            raise ValueError(f"abft.RestCheck: block must be a whole number in [1, 256], "
                             f"got {block!r}")
        self.opt, self.states, self.block = optimizer, states, block
        self.names = {id(p): n for p, n in (names or {}).items()}
        self.sealed = {}
        self.seal_s = self.verify_s = 0.0

    def tensors(self):
        """(label, kind, tensor) of everything checked: kind "param" or the state's key."""
        out = []
        for gi, group in enumerate(self.opt.param_groups):
            for pi, p in enumerate(group["params"]):
                name = self.names.get(id(p), f"param_groups[{gi}].params[{pi}]")
                out.append((name, "param", p))
                if self.states:
                    for key, v in sorted(self.opt.state.get(p, {}).items()):
                        if torch.is_tensor(v) and key != "step" and _local(v).numel() > 0:
                            out.append((name, key, v))
        return out

    def seal(self):
        """Fingerprint every tensor now (after the optimizer step)."""
        t0 = time.perf_counter()
        self.sealed = {(name, kind): (t, fingerprint(t, self.block))
                       for name, kind, t in self.tensors()}
        self.seal_s += time.perf_counter() - t0

    def verify(self):
        """Alarms (``kind="rest"``) for every block whose fingerprint changed since ``seal``,
        [] before the first seal; they go to the current scope's log and ``abft.alarms()``, as
        a GEMM's do."""
        from abft import policy
        from abft.context import current
        t0 = time.perf_counter()
        found = []
        sc = current()
        labels = sc.labels
        if not self.sealed:
            return []
        live = {(name, kind): t for name, kind, t in self.tensors()}
        if {k: id(t) for k, t in live.items()} != {k: id(e[0]) for k, e in self.sealed.items()}:
            # tensors replaced, added or removed outside the step (a loaded state dict, state
            # made lazily): what was sealed is no longer what will be read; seal it as it is
            warnings.warn("abft.RestCheck: the parameters or optimizer state were replaced since "
                          "the last seal; sealed again without a check (call seal() after "
                          "loading a checkpoint)", RuntimeWarning, stacklevel=2)
            self.seal()
            return []
        for (name, kind), (t, sums) in self.sealed.items():
            now = fingerprint(t, self.block)
            changed = located(now, sums, self.block, _bits(t).numel())
            if not changed:
                continue
            local, words = _local(t), _bits(t).numel()
            if len(changed) > MAX_ALARMS:      # one alarm per block up to here, then a summary
                found.append(self._alarm(name, kind, local, labels, tile=(), row=None, col=None,
                                         residual=float("nan"),
                                         labels={"index": None, "blocks": len(changed)}))
                changed = changed[:MAX_ALARMS]
            for b, index, d0 in changed:
                row = col = None
                if index is not None:
                    elem = index // max(1, words // max(1, local.numel()))
                    row, col = divmod(elem, local.shape[-1]) if local.dim() >= 2 else (0, elem)
                found.append(self._alarm(name, kind, local, labels, tile=(b,), row=row, col=col,
                                         residual=float(d0),
                                         labels={"index": index, "delta_bits": d0}))
        policy.emit(found, sc.log)
        self.verify_s += time.perf_counter() - t0
        return found

    def _alarm(self, name, kind, local, scope, **where):
        """A ``rest`` alarm on tensor ``name`` (``kind``: "param" or a state key), labelled by
        the ``scope`` labels; ``where``: tile, row, col, residual and the alarm's labels."""
        from abft.alarms import rest_alarm
        return rest_alarm(name=name, kind=kind, scope=scope, tensor=local, block=self.block, **where)

    def restore(self, alarms):
        """Write back the sealed bits of every located element in ``alarms``, then check its
        block against the seal; returns the alarms left (unlocated, or the block still wrong:
        the write is undone)."""
        left = []
        for a in alarms:
            index = a.labels.get("index")
            entry = self.sealed.get((a.module, a.phase))
            if a.kind != "rest" or index is None or entry is None:
                left.append(a)
                continue
            t, sums = entry
            bits, b, d = _bits(t), index // self.block, a.labels["delta_bits"]
            if _local(t).element_size() == 1:                  # a copy: nothing to write back
                left.append(a)
                continue
            was = int(bits[index])
            with torch.no_grad():
                bits[index] = was - d                       # the sealed word (signed)
                if not torch.equal(fingerprint(t, self.block, b, 1)[:, 0], sums[:, b]):
                    bits[index] = was
                    left.append(a)
                    continue
            # a repaired weight: checksums kept from its flipped value are stale (under FSDP2 the
            # repair goes to the shard, and the unsharded weight's version never sees it)
            weightcache.forget()
        return left
