"""The fault hook: corrupt the product of a chosen call before its check, the way a compute fault
inside the GEMM would, so tests and the evaluation exercise the path a real fault takes.

    >>> with abft.inject(call_id=0, pattern="element", row=3, col=5, kind="bitflip", bit=30):
    ...     c = abft.matmul(a, b)          # C[3, 5] has bit 30 flipped before the check

Patterns: ``element`` (row, col), ``row``, ``column``, ``tile`` (bm x bn from row, col),
``strided`` (row, every ``stride``-th column from col: a warp-aligned repeat), ``periodic``
(row, runs of ``size[1]`` consecutive columns every ``stride`` from col: the repeating groups
of wrong elements seen on faulty GPUs).
Kinds: ``bitflip`` (bit of the stored dtype, or a tuple of bits), ``stuck`` (those bits forced:
``value`` is the int mask of the ones among them, the rest cleared; ``None`` decides at the first
application, as the complement of the first corrupted element's bits, and keeps it; every element
of the pattern is forced to that value, so elements already holding it do not change), ``value``
(set), ``add``, ``scale``, ``zero``. ``ctx.changed`` counts the elements the corruption changed.
Choose the call by ``call_id`` and/or ``when(ctx)``, a predicate on a ``CallContext``
(op, phase, labels, call_id, shape, attempt). ``batch`` indexes the product's leading dims
(default: the first element of a batched product).
``times`` limits how many calls it corrupts (default 1; None: every matching call).
By default the fault does not repeat on a recompute of the same call (a transient fault);
``persistent=True`` makes it hit the recompute too.
"""
import operator
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from abft.kernels import layout as L

PATTERNS = ("element", "row", "column", "tile", "strided", "periodic")
KINDS = ("bitflip", "stuck", "value", "add", "scale", "zero")

_INT_VIEW = {torch.float64: torch.int64, torch.float32: torch.int32,
             torch.float16: torch.int16, torch.bfloat16: torch.int16}


def as_bits(t):
    """A float tensor's elements as integers of the same width (a view: any strides, writes go
    through), for bit-exact compares (NaN == NaN, -0 != +0) and flips; other dtypes as they are."""
    return t.view(_INT_VIEW[t.dtype]) if t.dtype in _INT_VIEW else t


@dataclass(slots=True)
class CallContext:
    op: str
    phase: str
    labels: dict
    call_id: int
    shape: tuple
    dtype: torch.dtype
    attempt: int = 0
    verdict: object = None      # set after the check: the verdict tensor (for the evaluation)
    changed: int = None         # set by the injection: elements whose bits it changed
    tiles: tuple = None         # set after the check: the verdict's (rows, cols) per tile
    operands: tuple = None      # (a, b) as the GEMM reads them, for value- or size-triggered faults
    batch_shape: tuple = None   # the caller's batch dims, where the product folds them into one

    @property
    def module(self):
        return self.labels.get("module")


def _index(x):
    """Whether ``x`` is an int >= 0 (numpy's and torch's integers too; not a bool or a float)."""
    if isinstance(x, bool):
        return False
    try:
        return operator.index(x) >= 0
    except TypeError:
        return False


@dataclass
class Injection:
    call_id: int = None
    when: object = None
    pattern: str = "element"
    kind: str = "bitflip"
    row: int = 0
    col: int = 0
    batch: tuple = ()
    bit: int = None
    value: float = 0.0
    size: tuple = (16, 16)
    stride: int = 32
    times: object = 1
    persistent: bool = False
    hits: list = field(default_factory=list)

    def __post_init__(self):
        """Every Injection is validated, however it is built (``inject``, the evaluation's fault
        builder, ``retarget``): one line naming the field."""
        if self.pattern not in PATTERNS:
            raise ValueError(f"abft.inject: pattern must be one of {PATTERNS}, got {self.pattern!r}")
        if self.kind not in KINDS:
            raise ValueError(f"abft.inject: kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind in ("bitflip", "stuck") and self.bit is None:
            raise ValueError(f"abft.inject: kind={self.kind!r} needs bit=")
        if self.bit is not None:
            bits = tuple(self.bit) if isinstance(self.bit, (list, tuple)) else (self.bit,)
            if not bits or not all(_index(b) for b in bits):
                raise ValueError(f"abft.inject: bit must be an int or a non-empty tuple of ints, "
                                 f"got {self.bit!r}")
            self.bit = bits if isinstance(self.bit, (list, tuple)) else int(self.bit)
        for name in ("row", "col"):
            if not _index(getattr(self, name)):
                raise ValueError(f"abft.inject: {name} must be an int >= 0, got {getattr(self, name)!r}")
        if not isinstance(self.size, (list, tuple)) or len(self.size) != 2 or \
                not all(_index(x) and x >= 1 for x in self.size):
            raise ValueError(f"abft.inject: size must be two ints >= 1, got {self.size!r}")
        if not _index(self.stride) or self.stride < 1:
            raise ValueError(f"abft.inject: stride must be an int >= 1, got {self.stride!r}")
        if self.times is not None and (not _index(self.times) or self.times < 1):
            raise ValueError(f"abft.inject: times must be None or an int >= 1, got {self.times!r}")
        if self.call_id is not None and not _index(self.call_id):
            raise ValueError(f"abft.inject: call_id must be None or an int >= 0, got {self.call_id!r}")
        batch = self.batch if isinstance(self.batch, (list, tuple)) else (self.batch,)
        if not all(_index(b) for b in batch):
            raise ValueError(f"abft.inject: batch must be a tuple of ints >= 0, got {self.batch!r}")
        self.batch, self.size, self.stride = tuple(batch), tuple(self.size), int(self.stride)

    def retarget(self, other):
        """Take ``other``'s target and corruption (pattern, kind, place, bits, value), keeping this
        one's trigger and hits: an installed injection aimed anew from inside its ``when``."""
        for name in ("pattern", "kind", "row", "col", "batch", "bit", "value", "size", "stride"):
            setattr(self, name, getattr(other, name))

    def matches(self, ctx):
        if ctx.attempt > 0 and not self.persistent:
            return False
        if self.times is not None and len(self.hits) >= self.times and not (
                ctx.attempt > 0 and self.persistent):
            return False
        if self.call_id is not None and ctx.call_id != self.call_id:
            return False
        return self.when is None or bool(self.when(ctx))

    def index(self, c):
        """The (row slice, col slice) this injection corrupts in a (M, N) matrix."""
        m, n = c.shape[-2], c.shape[-1]
        if self.pattern == "element":
            return slice(self.row, self.row + 1), slice(self.col, self.col + 1)
        if self.pattern == "row":
            return slice(self.row, self.row + 1), slice(0, n)
        if self.pattern == "column":
            return slice(0, m), slice(self.col, self.col + 1)
        if self.pattern == "strided":
            return slice(self.row, self.row + 1), slice(self.col, n, self.stride)
        return slice(self.row, self.row + self.size[0]), slice(self.col, self.col + self.size[1])

    def folded(self, ctx):
        """``batch`` as an index of the product's own batch dims: the caller's coordinates
        (``batch=(1, 2)`` of a 4-D matmul) folded as the product folds them."""
        shape = ctx.batch_shape if ctx is not None else None
        if shape and len(self.batch) == len(shape):
            if not all(0 <= b < s for b, s in zip(self.batch, shape)):
                raise IndexError(f"abft.inject: batch {self.batch} is outside the product's batch "
                                 f"shape {tuple(shape)}")
            return (int(np.ravel_multi_index(self.batch, shape)),)
        return tuple(self.batch)

    def apply(self, c, ctx):
        """Corrupt ``c`` (..., M, N) in place."""
        batch = self.folded(ctx) or (0,) * (c.dim() - 2)       # default: the first batch element
        target = c[batch] if batch else c
        if self.pattern == "periodic":
            n, changed = target.shape[-1], 0
            for start in range(self.col, n, max(1, self.stride)):
                run = Injection(**{**self.__dict__, "pattern": "tile", "col": start, "hits": [],
                                   "batch": (), "size": (1, min(self.size[1], n - start))})
                run.apply(target, ctx)
                self.value = run.value              # a stuck value decided by the first run
                changed += ctx.changed if ctx is not None else 0
            if ctx is not None:
                ctx.changed = changed
            self.hits.append(ctx)
            return
        rs, cs = self.index(target)
        view = target[..., rs, cs]
        if view.numel() == 0:
            raise IndexError(f"abft.inject: {self.pattern} at row {self.row}, col {self.col} is "
                             f"outside the product of shape {tuple(c.shape)}")
        before = view.clone()
        with torch.no_grad():
            if self.kind in ("bitflip", "stuck"):
                width = torch.finfo(c.dtype).bits
                bits = as_bits(view)
                mask = flip_mask(self.bit, width, c.dtype)
                if self.kind == "bitflip":
                    bits ^= mask
                else:
                    if self.value is None:                 # stuck at the first value it changes
                        self.value = int(~bits.reshape(-1)[0] & mask)
                    bits &= ~mask
                    bits |= int(self.value) & mask
            elif self.kind == "value":
                view.fill_(self.value)
            elif self.kind == "add":
                view.add_(self.value)
            elif self.kind == "scale":
                view.mul_(self.value)
            else:
                view.zero_()
        if ctx is not None:
            ctx.changed = int((as_bits(before) != as_bits(view)).sum())
        self.hits.append(ctx)


def flip_mask(bit, width, dtype=None):
    """The signed-integer XOR mask of ``bit`` (an int or a tuple of ints) in a ``width``-bit word."""
    mask = 0
    for b in (bit,) if isinstance(bit, int) else tuple(bit):
        if not 0 <= b < width:
            raise ValueError(f"abft.inject: bit {b} outside 0..{width - 1} for {dtype}")
        mask |= 1 << b
    if mask >= 1 << (width - 1):
        mask -= 1 << width                      # the sign bit as a signed int
    return mask


_lock = threading.Lock()
_active = []


class inject:
    """Context manager (or, with ``.start()``/``.stop()``, a handle) that installs an injection.
    ``.hits`` lists the CallContext of every corrupted call."""

    def __init__(self, call_id=None, when=None, *, pattern="element", kind="bitflip", row=0, col=0,
                 batch=(), bit=None, value=0.0, size=(16, 16), stride=32, times=1,
                 persistent=False):
        self.injection = Injection(call_id, when, pattern, kind, row, col, batch, bit,
                                   value, size, stride, times, persistent)

    @property
    def hits(self):
        return self.injection.hits

    def start(self):
        with _lock:
            _active.append(self.injection)
        return self

    def stop(self):
        with _lock:
            if self.injection in _active:
                _active.remove(self.injection)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False


def active():
    return bool(_active)


def apply(c, ctx):
    """Apply every installed injection that matches ``ctx`` to ``c``; returns how many did."""
    n = 0
    for inj in list(_active):
        if inj.matches(ctx):
            inj.apply(c, ctx)
            n += 1
    return n


def kernel_injection(ctx):
    """The in-kernel injection (for the fused kernel) of the first matching element fault:
    bitflip, add or zero of one accumulator element after the first K step."""
    for inj in list(_active):
        if inj.matches(ctx):
            if inj.pattern != "element" or inj.kind not in L.INJECT_KINDS:
                raise NotImplementedError(f"abft.inject: the triton backend injects element "
                                          f"faults of kinds {tuple(L.INJECT_KINDS)} only")
            m, n = ctx.shape[-2], ctx.shape[-1]
            if not (0 <= inj.row < m and 0 <= inj.col < n):   # as the reference hook says
                raise IndexError(f"abft.inject: {inj.pattern} at row {inj.row}, col {inj.col} is "
                                 f"outside the product of shape {tuple(ctx.shape)}")
            bit = inj.bit or 0
            if isinstance(bit, tuple):
                if len(bit) != 1:
                    raise NotImplementedError("abft.inject: the triton backend flips one bit")
                bit = bit[0]
            inj.hits.append(ctx)
            folded = inj.folded(ctx)
            batch = folded[0] if folded else 0
            return dict(kind=inj.kind, batch=batch, row=inj.row, col=inj.col, k_step=0,
                        bit=bit, value=inj.value)
    return None
