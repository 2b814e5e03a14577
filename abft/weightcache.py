"""Weight checksums kept between weight updates, keyed on the parameter they summarise.

The row check of Y = X W^T (+ b) needs statistics of W (``reference.weight_stats``: block sums,
norms, exponents; on the fused kernel its pre-pass), and the row check of the backward's
G W (grad_input) its own, of W's other side. For a protected module each is computed at its
first use after the weight parameter changed (the forward's at the first forward; grad_input's
with them, in the same call, on the reference backend where that forward records its input's
gradient, else at the first backward) and reused until it changes again: optimizer steps bump the parameter's
version counter. That saves a pass over W per call, and makes a change of W at rest (a bit
flip written behind autograd's back, which leaves the version alone) show as failing row sums,
between a forward and its backward too.

The key is the source parameter itself (a weak reference, checked for identity), its version, the
dtype the product sees (autocast computes with a fresh low-precision copy of the weight, version 0,
at an address the allocator may hand out again: never a key), the device and the block width.
Writes through ``.data`` do not bump the version: to the cache they look like corruption at rest.
Call ``forget()`` after changing weights that way on purpose.

Fused optimizers (``torch.optim.AdamW(fused=True)``, the Hugging Face Trainer's default) update
the weights in place without bumping their versions either, and FSDP2 refills a module's unsharded
weight (the parameter its forward reads, which no optimizer holds) from the sharded one without a
version bump, so every torch optimizer's step drops every kept statistic (a global step hook,
registered on import). For the same reason ``load_state_dict`` on a protected module, a repair
of a weight at rest (``RestCheck.restore``) and a guarded step with an alarm on any rank drop
them too; any other write to an FSDP2 shard outside an optimizer needs ``forget()``.
"""
import threading
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

_lock = threading.Lock()
_sources = {}        # id(param) -> weakref(param)
_cache = {}          # (id(param), side) -> (weakref(param), version, dtype, device, bn, stats)


def key(param):
    """The cache key of a parameter (registered for ``getter``; under torch.compile the key only,
    registered by the eager calls and by ``abft.protect``)."""
    k = id(param)
    if torch.compiler.is_compiling():
        return k
    with _lock:
        ref = _sources.get(k)
        if ref is None or ref() is not param:
            _sources[k] = weakref.ref(param)
            _drop({k})
    return k


def _drop(ids):
    """Drop the kept statistics of the parameters ``ids`` (under the lock)."""
    for c in [c for c in _cache if c[0] in ids]:
        del _cache[c]


def keep(w, k, side, bn, stats):
    """Keep ``stats`` of ``w`` (the parameter ``k`` or a cast copy of it, as ``getter`` takes it)
    for the product ``side`` at the parameter's current version: statistics made along with
    another side's."""
    with _lock:
        ref = _sources.get(k)
        src = ref() if ref is not None else None
        if src is not None:
            _cache[(k, side)] = (ref, src._version, w.dtype, w.device, bn, stats)


def getter(w, k, make, side="forward"):
    """``get(bn)`` returning the statistics of ``w`` (the parameter ``k`` or a cast copy of it),
    made by ``make(w, bn)`` when the parameter has changed since they were kept; None when ``w``
    is not derived from that parameter. ``side``: the product they serve (``forward``: x @ w.T,
    ``grad_input``: g @ w), each kept on its own."""
    with _lock:
        ref = _sources.get(k)
    src = ref() if ref is not None else None
    if src is None or tuple(w.shape) != tuple(src.shape) or w.device != src.device:
        return None
    if w.dtype == src.dtype and w.data_ptr() != src.data_ptr():
        return None                       # another tensor of the same shape, not this weight

    def get(bn):
        ver = src._version
        with _lock:
            hit = _cache.get((k, side))
        if hit is not None and hit[0]() is src and hit[1:5] == (ver, w.dtype, w.device, bn):
            return hit[5]
        stats = make(w, bn)
        with _lock:
            _cache[(k, side)] = (ref, ver, w.dtype, w.device, bn, stats)
        return stats

    return get


def forget():
    """Drop every kept statistic (after writing weights through ``.data`` on purpose)."""
    with _lock:
        _cache.clear()


def size():
    with _lock:
        return len(_cache)


def _after_optimizer_step(optimizer, args, kwargs):
    """Drop every kept statistic: the step may have updated weights without a version bump
    (fused kernels), or weights a forward reads through a copy no optimizer holds (FSDP2's
    unsharded parameters, refilled from the updated shards without a bump)."""
    with _lock:
        _cache.clear()


register_optimizer_step_post_hook(_after_optimizer_step)
