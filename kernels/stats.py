"""Operand statistics the thresholds of both backends are built from.

For the rows of an operand x (..., R, K) (the rows of A, or of B^T: the columns of B) and blocks of
``bs`` rows, in one chunked pass, in float64:

- per row i: the exponent e_i of max_k |x_ik| (x_i = m 2^e_i with m in [0.5, 1)), and the 1- and
  inf-norms over k of (x_ik 2^-e_i)^2; whether the row is finite; whether it is low-entropy;
- per block p: the exponent E_p = max of its rows' e_i, and with x' = x 2^-E_p the 1- and inf-norms
  over k of sum_i x'_ik^2 and of s_k^2 (s_k = sum_i x'_ik); ``nu``, the largest multiplicity of a
  row repeated exactly within the block or the number of its low-entropy rows, whichever is more
  (both share rounding errors across rows); and, on request, the block sums s (..., T, K) (the
  reference backend's predictions) and block sums of |x'| (the worst-case cap at small K).

Scaling by exact powers of two keeps every square in range and makes the statistics, and the
verdicts built from them, the same for x and x 2^j.
"""
import functools
import math
import threading
from dataclasses import dataclass
from typing import Optional

import torch

_CHUNK = 1 << 19          # elements per chunk on the CPU: 4 MiB of float64, about an L2's worth
_local = threading.local()
_EXP_LIMIT = 1000         # |exponents| kept below this, so 2^-e is finite in float64


@dataclass
class OperandStats:
    """Statistics of the rows of one operand (module docstring). Shapes: (..., R) per row and
    (..., T) per block, float64 (``low`` and ``finite``: bool)."""
    bs: int
    e: torch.Tensor
    r1: torch.Tensor
    rinf: torch.Tensor
    finite: torch.Tensor
    low: torch.Tensor
    E: torch.Tensor
    x1: torch.Tensor
    xinf: torch.Tensor
    xs1: torch.Tensor
    xsinf: torch.Tensor
    nu: torch.Tensor
    s: Optional[torch.Tensor] = None
    absum: Optional[torch.Tensor] = None
    times: Optional[torch.Tensor] = None

    def block_low(self):
        """(..., T): the block holds a low-entropy row."""
        return _block_max(self.low.to(self.e.dtype), self.bs) > 0

    def block_finite(self):
        return _block_max((~self.finite).to(self.e.dtype), self.bs) == 0


SAMPLES = 16              # places low_entropy samples per row (the compiled check samples the same)


def low_entropy(x, samples=SAMPLES):
    """(..., R, K) -> (..., R) bool: rows that, sampled at ``samples`` fixed places along K, take
    at most samples/4 distinct values, or repeat one nonzero value at samples/4 places or more
    (constant, few-valued, coarsely quantised data, or a shared constant at many positions: their
    rounding errors do not average out). Zeros do not count: adding them is exact."""
    k = x.shape[-1]
    if k == 0:
        return torch.ones(x.shape[:-1], dtype=torch.bool, device=x.device)
    n = min(k, samples)
    idx = _sample_places(k, n, x.device)
    if x.stride(-1) != 1 and x.dim() >= 2:
        v = x.mT.index_select(-2, idx).mT.contiguous()   # gather whole rows of the stored layout
    else:
        v = x.index_select(-1, idx)
    eq = v.unsqueeze(-1) == v.unsqueeze(-2)
    same = torch.count_nonzero(eq, dim=-1)
    distinct = (1.0 / same).sum(-1)
    repeated = torch.where(v != 0, same, torch.zeros_like(same)).amax(-1)
    quarter = max(2, n // 4)
    return (distinct <= quarter + 0.5) | (repeated >= quarter)


def _sample_places(k, n, device):
    """The ``n`` places low_entropy samples along ``k``, kept between calls (made afresh, they cost
    more than the test), except where torch.compile traces (constants in its graph) or a CUDA graph
    is being captured (a tensor made there holds its values only once the graph is replayed)."""
    if torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return _places(k, n, device)
    return _kept_places(k, n, device)


def _places(k, n, device):
    return torch.linspace(0, k - 1, n, device=device).round().long()


@functools.lru_cache(maxsize=256)
def _kept_places(k, n, device):
    with torch.inference_mode(False):      # made under inference_mode, it could not serve autograd
        return _places(k, n, device)


def exponents(amax, ok=None):
    """Exponents e (float64) with amax = m 2^e, m in [0.5, 1), for amax >= 0 (float64); 0 for zero
    or non-finite values (``ok``: the mask of the others, if the caller has it). Read from the bits
    (biased exponent - 1022): frexp's int32 exponent is slower, and torch.compile cannot vectorise
    it. Subnormals give -1022, clamped as frexp's are."""
    biased = (amax.view(torch.int64) >> 52) & 0x7FF
    e = (biased - 1022).to(torch.float64).clamp_(-_EXP_LIMIT, _EXP_LIMIT)
    return torch.where((amax > 0) & (biased < 0x7FF) if ok is None else ok, e, 0.0)


def operand_stats(x, bs, *, need_s=False, need_abs=False, rhs=None):
    """Statistics of the rows of ``x`` (..., R, K) for blocks of ``bs`` rows (``OperandStats``).
    With ``rhs`` (..., S, K), also ``times``: (x 2^-e) @ rhs^T (..., R, S) in float64, from the
    same pass over x (the reference's row predictions)."""
    *batch, r, k = x.shape
    f64 = dict(dtype=torch.float64, device=x.device)
    t = -(-r // bs)
    # max |x| per row, as max(max x, -min x): no |x| temporary, and fast on strided rows too
    amax = (torch.maximum(x.amax(-1), -x.amin(-1)).to(torch.float64) if k
            else torch.zeros(*batch, r, **f64))
    finite = torch.isfinite(amax)
    scaled = finite & (amax > 0)
    e = exponents(amax, scaled)
    # zero rows (and non-finite ones) do not set their block's scale; an all-zero block has E = 0
    E = _block_max(torch.where(scaled, e, -float("inf")), bs, fill=-float("inf"))
    E = torch.where(torch.isfinite(E), E, torch.zeros_like(E))
    # float64 holds the squares of any float32, bf16 or fp16 value: those operands are summed as
    # they are and their sums scaled after, exactly. float64 operands are scaled before squaring.
    prescale = x.dtype == torch.float64
    # x 2^-E = (x 2^-e) 2^(e - E), e - E <= 0 (float64 operands only)
    row_to_block = (e - E.repeat_interleave(bs, -1)[..., :r]) if prescale else None

    def row_sums(xr, er, rtb):
        """Rows xr (..., rows, K) of x (whole blocks), with their e and row_to_block: the sums of
        r1, times, s, sqsum and absum over them."""
        xs = xr.to(torch.float64)
        if prescale:
            xs = xs * torch.exp2(-er).unsqueeze(-1)
        sq = _square(xs)
        if prescale:
            fb = torch.exp2(rtb).unsqueeze(-1)
            xb, sqb = xs * fb, sq * (fb * fb)
        else:
            xb, sqb = xs, sq
        return (sq.sum(-1), None if rhs is None else xs @ rhs.mT, _sum_blocks(xb, bs, -2),
                _sum_blocks(sqb, bs, -2), _sum_blocks(xb.abs(), bs, -2) if need_abs else None)

    zeros = lambda *shape: torch.zeros(*batch, *shape, **f64)
    rows_major = not (x.stride(-2) == 1 and x.stride(-1) != 1 and r > 1)
    step = _rows_per_chunk(x, bs, k) if rows_major else max(1, _CHUNK // max(1, r * math.prod(batch)))
    if k and r and rows_major and step >= r:
        # one chunk: its sums are the results, with no buffers to copy them into
        r1, times, s, sqsum, absum = row_sums(x, e, row_to_block)
    else:
        r1, sqsum, s = zeros(r), zeros(t, k), zeros(t, k)
        absum = zeros(t, k) if need_abs else None
        times = None if rhs is None else zeros(r, rhs.shape[-2])
        if k and r and not rows_major:
            # column-major (B^T of a row-major B): chunk along K, rows of the chunk transposed
            sc = torch.exp2(-e).unsqueeze(-1)
            fb = torch.exp2(row_to_block).unsqueeze(-1) if prescale else None
            for k0 in range(0, k, step):
                xs = x[..., :, k0:k0 + step].to(torch.float64)               # (..., R, kk)
                if prescale:
                    xs = xs * sc
                if rhs is not None:
                    times += xs @ rhs[..., k0:k0 + step].mT
                sq = _square(xs)
                r1 += sq.sum(-1)
                xb = xs * fb if prescale else xs
                s[..., k0:k0 + step] = _sum_blocks(xb, bs, -2)
                sqsum[..., k0:k0 + step] = _sum_blocks(sq * (fb * fb) if prescale else sq, bs, -2)
                if need_abs:
                    absum[..., k0:k0 + step] = _sum_blocks(xb.abs(), bs, -2)
        elif k and r:
            for r0 in range(0, r, step):
                rows, blocks = slice(r0, r0 + step), slice(r0 // bs, r0 // bs + -(-min(step, r - r0) // bs))
                parts = row_sums(x[..., rows, :], e[..., rows],
                                 None if row_to_block is None else row_to_block[..., rows])
                r1[..., rows] = parts[0]
                if rhs is not None:
                    times[..., rows, :] = parts[1]
                s[..., blocks, :], sqsum[..., blocks, :] = parts[2], parts[3]
                if need_abs:
                    absum[..., blocks, :] = parts[4]
    rinf = (amax * torch.exp2(-e)) ** 2                       # max_k of the scaled squares
    if not prescale:
        row, blk = torch.exp2(-e), torch.exp2(-E).unsqueeze(-1)
        r1 = r1 * (row * row)
        times = None if times is None else times * row.unsqueeze(-1)
        s, sqsum = s * blk, sqsum * (blk * blk)
        absum = absum * blk if need_abs else None
    s2 = s * s
    key_nan = torch.where(finite, r1, torch.full_like(r1, float("nan")))
    low = low_entropy(x)
    return OperandStats(
        bs=bs, e=e, r1=r1, rinf=rinf, finite=finite, low=low, E=E,
        x1=sqsum.sum(-1), xinf=_amax(sqsum, -1), xs1=s2.sum(-1), xsinf=_amax(s2, -1),
        nu=torch.maximum(_multiplicity(e, key_nan, bs), _block_count(low, bs)), s=s if need_s else None,
        absum=absum, times=times)


def _sum_blocks(x, bs, dim):
    """Sums of consecutive blocks of ``bs`` along ``dim`` (negative); the last may be shorter."""
    nf, r = x.shape[dim] // bs, x.shape[dim] % bs
    if r == 0:
        return x.unflatten(dim, (nf, bs)).sum(dim)
    parts = []
    if nf:
        parts.append(x.narrow(dim, 0, nf * bs).unflatten(dim, (nf, bs)).sum(dim))
    parts.append(x.narrow(dim, nf * bs, r).sum(dim, keepdim=True))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _pad_blocks(x, bs, value):
    """View ``x`` (..., n) as (..., ceil(n/bs), bs), padding with ``value``."""
    n = x.shape[-1]
    t = -(-n // bs)
    if t * bs != n:
        x = torch.cat([x, x.new_full((*x.shape[:-1], t * bs - n), value)], -1)
    return x.unflatten(-1, (t, bs))


def _block_count(flags, bs):
    """(..., R) bool -> (..., T) float64: how many of each block's rows are flagged."""
    if flags.shape[-1] == 0:
        return flags.new_zeros(*flags.shape[:-1], 0, dtype=torch.float64)
    return _pad_blocks(flags.to(torch.float64), bs, 0.0).sum(-1)


def _block_max(x, bs, fill=0.0):
    """(..., R) -> (..., T): the maximum of each block (NaN propagates)."""
    if x.shape[-1] == 0:
        return x.new_zeros(*x.shape[:-1], 0)
    return _pad_blocks(x, bs, fill).amax(-1)


def _amax(x, dim):
    if x.shape[dim] == 0:
        return x.sum(dim)
    return x.amax(dim)


_PAIRWISE = 256           # blocks up to this wide compare every pair of rows (fast when small)


def _multiplicity(e, key, bs):
    """Largest number of rows with equal (exponent, scaled sum of squares) in each block: equal rows
    have equal keys; unequal rows with equal keys only make the threshold larger."""
    kb = _pad_blocks(key, bs, float("nan"))
    eb = _pad_blocks(e, bs, float("nan"))
    if bs <= _PAIRWISE:
        same = torch.count_nonzero((kb.unsqueeze(-1) == kb.unsqueeze(-2))
                                   & (eb.unsqueeze(-1) == eb.unsqueeze(-2)), dim=-1)
        return same.amax(-1).clamp_min(1).to(torch.float64)
    # wide blocks (a row check's whole N): sorted, the longest run of equal pairs (NaN keys
    # never equal), in O(bs log bs) instead of bs^2 comparisons
    shape = kb.shape[:-1]
    kb, eb = kb.reshape(-1, bs), eb.reshape(-1, bs)
    order = torch.argsort(kb, dim=-1, stable=True)
    kb, eb = kb.gather(-1, order), eb.gather(-1, order)
    order = torch.argsort(eb, dim=-1, stable=True)
    kb, eb = kb.gather(-1, order), eb.gather(-1, order)
    new = torch.ones_like(kb, dtype=torch.bool)
    new[:, 1:] = (kb[:, 1:] != kb[:, :-1]) | (eb[:, 1:] != eb[:, :-1])
    run = torch.cumsum(new.to(torch.int64), -1) - 1
    counts = torch.zeros_like(run).scatter_add_(-1, run, torch.ones_like(run))
    return counts.amax(-1).clamp_min(1).to(torch.float64).reshape(shape)


def _square(x):
    """x * x, into a reusable buffer on the CPU when x is contiguous (eager only)."""
    if x.device.type != "cpu" or not x.is_contiguous() or torch.compiler.is_compiling():
        return x * x
    return torch.mul(x, x, out=_workspace(x.shape, 0, x.device))


def _workspace(shape, slot, device):
    """A reusable float64 buffer on the CPU, where fresh large temporaries cost page faults on every
    call. Elsewhere the caching allocator already reuses memory, and a kept buffer would pin it."""
    if device.type != "cpu":
        return torch.empty(shape, dtype=torch.float64, device=device)
    n = math.prod(shape)
    pool = getattr(_local, "pool", None)
    if pool is None:
        pool = _local.pool = {}
    buf = pool.get(slot)
    if buf is None or buf.numel() < n:
        with torch.inference_mode(False):  # an inference tensor could not be written outside it
            buf = pool[slot] = torch.empty(max(n, 1), dtype=torch.float64)
    return buf[:n].view(shape)


def _rows_per_chunk(x, bs, width):
    """Rows per chunk: whole blocks, about _CHUNK elements (the whole operand off the CPU)."""
    if x.device.type != "cpu":
        return max(x.shape[-2], 1)
    batch = math.prod(x.shape[:-2])
    return bs * max(1, _CHUNK // max(1, bs * width * batch))
