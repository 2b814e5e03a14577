"""Outputs of checked products, verified until they die: ``abft.OutputCheck``.

    with abft.OutputCheck():                  # or check = abft.OutputCheck() ... check.remove()
        loss = model(x)                        # protected / checked products record their outputs
        loss.backward()

A product's check verifies its output as the accumulator is rounded; a bit flipped in that output
afterwards, in memory while it waits for its readers (the next layer, a residual add, the sync of
a tensor-parallel group, the next backward step, the gradient's accumulation), is outside it.
With an ``OutputCheck`` on, every checked product, forward and backward, fingerprints its output (``rest.fingerprint``: exact sums of its bits per block of 256 words, so
a changed element is located) and verifies it again when the output dies (its last reader is
done: usually within the same forward, or in the backward for what autograd saved; the check
runs at the next safe point: the next recorded product, ``flush()``, the check's exit). A change
without a version bump (a flip, a write through ``.data``) is an alarm of kind ``carry`` naming
the producing module and the element; an output changed in place by the program (``relu_``,
``masked_fill_``: the version moves) is not verified (``skipped``).

Cost: one read of every product's output when it is made and one when it dies (the same
per-element cost as ``RestCheck``'s seal and verify). The policy's ``raise`` cannot raise from
the point of death: the alarm is recorded and ``flush()`` returns it (``StepGuard`` acts on it).
"""
import threading
import time
import weakref

import numpy as np
import torch

from abft.rest import fingerprint, located

_lock = threading.RLock()      # a death (a callback) may come while a record holds it
_checks = []            # active OutputChecks (the last one records)
_live = {}              # id(entry) -> entry, until the output dies
_dead = []              # entries whose output died, to verify at the next safe point
_interrupted = threading.Event()   # a Ctrl-C caught in a death callback, raised by the next drain
_draining = threading.local()


def active():
    """Whether an OutputCheck is on (outputs are then verified at their death)."""
    return bool(_checks)


class OutputCheck:
    """Record and verify the outputs of checked forward products while it is on.

    Args:
        block: words per fingerprint block (at most 256; more: less memory, coarser location).
    """

    def __init__(self, *, block=256):
        if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= 256:
            raise ValueError(f"abft.OutputCheck: block must be a whole number in [1, 256], "
                             f"got {block!r}")
        self.block = block
        self.recorded = self.verified = self.skipped = 0
        self.seconds = 0.0
        with _lock:
            _checks.append(self)

    def remove(self):
        """Stop recording (outputs recorded so far are still verified when they die)."""
        with _lock:
            if self in _checks:
                _checks.remove(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()
        drain()
        return False


def record(out, module, op, phase="forward"):
    """Fingerprint ``out``, a checked product's output (called by ``abft.autograd``)."""
    if not _checks or torch.compiler.is_compiling():
        return
    if type(out) is not torch.Tensor or not out.is_floating_point() or out.numel() == 0 \
            or out.is_inference():
        return              # DTensor shards, integer outputs, inference tensors (no versions)
    from abft.context import current
    drain()
    chk = _checks[-1]
    t0 = time.perf_counter()
    alias = out.detach()                      # shares the storage and the version counter
    try:
        sums = fingerprint(alias, chk.block)
    except ValueError:                        # gaps or overlaps in memory
        return
    sc = current()
    entry = dict(alias=alias, version=alias._version, sums=sums, module=module, op=op,
                 phase=phase, labels=dict(sc.labels), log=sc.log, check=chk)
    entry["ref"] = weakref.ref(out, lambda _, e=entry: _died(e))
    with _lock:
        _live[id(entry)] = entry
    chk.recorded += 1
    chk.seconds += time.perf_counter() - t0


def _died(entry):
    """The output is gone (a weakref callback, maybe inside the garbage collector): read it now
    (its storage may live on, a grad_weight output as ``param.grad``, which GradScaler's
    ``unscale_`` rewrites without a version bump), and queue the verdict for the next safe point
    (the next record, ``flush()``, the check's exit)."""
    interrupted = False
    try:
        _read(entry)
    except KeyboardInterrupt:
        interrupted = True
    except Exception:        # read at the drain instead
        pass
    with _lock:
        _live.pop(id(entry), None)
        _dead.append(entry)
    if interrupted:
        # Python prints and drops an exception raised in a weakref callback (and one signalled
        # again from inside it arrives inside it too): the next drain raises it instead
        _interrupted.set()


def _read(entry):
    """The output's fingerprint as it is now (None: changed in place by the program), once."""
    if "now" in entry:
        return
    chk, alias = entry["check"], entry["alias"]
    t0 = time.perf_counter()
    entry["now"] = None if alias._version != entry["version"] else fingerprint(alias, chk.block)
    chk.seconds += time.perf_counter() - t0


def drain():
    """Verify every output that died since the last drain (not reentrant); first, a Ctrl-C that
    arrived inside an output's death callback."""
    if _interrupted.is_set():
        _interrupted.clear()
        raise KeyboardInterrupt
    if getattr(_draining, "on", False):
        return
    _draining.on = True
    try:
        while True:
            with _lock:
                if not _dead:
                    return
                entry = _dead.pop(0)
            _verify(entry)
    finally:
        _draining.on = False


def _verify(entry):
    """What the output held against its fingerprint; then let it go."""
    _read(entry)
    chk, alias, now = entry["check"], entry.pop("alias"), entry["now"]
    if now is None:                           # changed in place by the program: not ours
        chk.skipped += 1
        return
    t0 = time.perf_counter()
    chk.verified += 1
    words = alias.numel() * max(1, alias.element_size() // 4)   # 64-bit: two words each
    changed = located(now, entry["sums"], chk.block, words)
    if changed:
        _report(entry, alias, changed, chk.block)
    chk.seconds += time.perf_counter() - t0


def _report(entry, alias, changed, block):
    from abft import policy, settings
    from abft.alarms import Alarm
    from abft.context import current_rank
    pol = settings.get().policy
    labels = entry["labels"]
    found = []
    words_per = max(1, (alias.element_size() // 4))   # 64-bit elements are two words
    for b, index, delta in changed[:16]:
        batch, row, col = (), None, None
        if index is not None:
            idx = np.unravel_index(index // words_per, tuple(alias.shape)) if alias.dim() else ()
            idx = [int(i) for i in idx]
            if len(idx) >= 2:
                *batch, row, col = idx
            elif idx:
                row, col = 0, idx[0]
        found.append(Alarm(
            op=entry["op"], phase=entry["phase"], module=entry["module"], step=labels.get("step"),
            micro_step=labels.get("micro_step"), replica=labels.get("replica"),
            rank=current_rank(), call_id=-1, shapes=(tuple(alias.shape),),
            dtype=str(alias.dtype).replace("torch.", ""), bm=block, bn=1, tile=(b,),
            batch=tuple(batch), row=row, col=col, residual=float(delta), threshold=0.0,
            backend="carry", time=time.time(), kind="carry",
            action="warned" if pol == "warn" else "recorded",
            labels={"index": index, "blocks": len(changed)}))
    policy.report(found, entry["log"])


def live():
    """How many recorded outputs are alive, and how many died unverified."""
    with _lock:
        return len(_live), len(_dead)


from abft import policy  # noqa: E402  (policy imports nothing of abft.carry)

policy.before_flush(drain)
