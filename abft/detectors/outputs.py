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

GEMM operands (``operands=True``, the default): what a checked product reads was written by
something before it, a norm, an activation, a residual add, a reshape, or autograd for the
incoming gradient; a bit flipped there after it was written and before the product read it is
in the product's checksums too, so they agree. These are fingerprinted where they are made and
verified at their death the same way: the output of every module (a global forward hook), of
every torch function called under ``abft.checked()`` (its mode sees them), and the gradient
arriving at each checked forward product's output (a tensor hook, which autograd calls when that
gradient is complete, before the backward products read it). Only tensors that autograd tracks
(training activations) and that own their memory (not views: a view's base is fingerprinted)
are taken, once per storage. An alarm names the tensor's producer (phase ``forward``) or, for a
gradient, the product it was going to (phase ``grad_output``).

Cost: one read of every product's output when it is made and one when it dies (the same
per-element cost as ``RestCheck``'s seal and verify), and the same for the operands taken. The
policy's ``raise`` cannot raise from the point of death: the alarm is recorded and ``flush()``
returns it (``StepGuard`` acts on it).
"""
import atexit
import collections
import functools
import sys
import threading
import time
import weakref

import numpy as np
import torch

from abft.detectors.rest import fingerprint, located, memory_order

_lock = threading.RLock()      # a death (a callback) may come while a record holds it
_checks = []            # active OutputChecks (the last one records)
_live = {}              # id(entry) -> entry, until the output dies
_storages = {}          # the live entries' storages (data pointers) -> the entry
_waiting = {}           # gradients fingerprinted, by storage, until a backward reads them
_sites = {}             # (module, op) that made operands -> [read by a product?, died unread]
_passed = collections.OrderedDict()   # storages of outputs not taken -> (their site, a weak
                                      # reference: a dead one's memory may hold another tensor)
LEARN = 4               # a site whose outputs died unread this often, none read, is not taken
_operands = False       # the last OutputCheck takes operands (read by abft.checked's mode)
_dead = []              # entries whose output died, to verify at the next safe point
_interrupted = threading.Event()   # a Ctrl-C caught in a death callback, raised by the next drain
_draining = threading.local()


def _unraisable(u, _prior=sys.unraisablehook):
    """Python prints and drops an exception raised in a weakref callback: a Ctrl-C that lands in
    one of this module's death callbacks, wherever in it, is kept for the next drain to raise."""
    if isinstance(u.exc_value, KeyboardInterrupt) and getattr(u.object, "__module__", None) == __name__:
        _interrupted.set()
        return
    _prior(u)


sys.unraisablehook = _unraisable


def active():
    """Whether an OutputCheck is on (outputs are then verified at their death)."""
    return bool(_checks)


def operands():
    """Whether the OutputCheck on takes the operands' producers (``produced``) too."""
    return _operands


def _retake():
    global _operands
    _operands = bool(_checks) and _checks[-1].operands


class OutputCheck:
    """Record and verify the outputs of checked forward products while it is on.

    Args:
        block: words per fingerprint block (at most 256; more: less memory, coarser location).
        operands: also take what the products read where it is made (the module docstring).
        model: optional root module: producers are named by qualified module names (else by
            their class names).
    """

    def __init__(self, *, block=256, operands=True, model=None):
        if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= 256:
            raise ValueError(f"abft.OutputCheck: block must be a whole number in [1, 256], "
                             f"got {block!r}")
        if not isinstance(operands, bool):
            raise ValueError(f"abft.OutputCheck: operands must be True or False, got {operands!r}")
        self.block, self.operands = block, operands
        self.names = {id(m): n for n, m in model.named_modules()} if model is not None else {}
        self.recorded = self.verified = self.skipped = 0
        self.taken = 0                # operands fingerprinted (module and function outputs, gradients)
        self.seconds = 0.0
        self._hook = None
        if operands:
            self._hook = torch.nn.modules.module.register_module_forward_hook(self._module_output)
        with _lock:
            _checks.append(self)
            _retake()

    def _module_output(self, mod, args, out):
        if _operands and _checks[-1] is self:
            produced(out, self.names.get(id(mod)) or type(mod).__name__)

    def remove(self):
        """Stop recording (outputs recorded so far are still verified when they die)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        with _lock:
            if self in _checks:
                _checks.remove(self)
            _retake()
            if not _checks:             # gradients no checked backward read: let them go
                for entry in _waiting.values():
                    _storages.pop(entry["storage"], None)
                    entry["check"].skipped += 1
                _waiting.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()
        drain()
        return False


def record(out, module, op, phase="forward"):
    """Fingerprint ``out``, a checked product's output (called by ``abft.autograd``); with
    operands on, the gradient that will arrive at a forward output is fingerprinted too."""
    _take(out, module, op, phase)
    if _operands and phase == "forward" and type(out) is torch.Tensor and out.requires_grad \
            and not torch.compiler.is_compiling():
        out.register_hook(functools.partial(_gradient, module, op))


def produced(out, module, op=None):
    """Fingerprint ``out``, a tensor some code made that a product may read next (a module's or a
    function's output), unless it is not autograd's (no ``grad_fn``), a view, or its memory is
    taken already."""
    if not _checks or torch.compiler.is_compiling():
        return
    if type(out) is torch.Tensor and out.grad_fn is not None and not out._is_view() and \
            out.is_floating_point() and not out.is_meta:
        op = op or type(out.grad_fn).__name__.removesuffix("Backward0")
        site = _sites.setdefault((module, op), [False, 0])
        if site[0] or site[1] < LEARN:
            _take(out, module, op, "forward", operand=True, site=site)
        else:                    # no product read what this site made: remember it, in case one does
            try:
                _passed[out.untyped_storage().data_ptr()] = (site, weakref.ref(out))
            except (RuntimeError, NotImplementedError):
                return
            if len(_passed) > 4096:
                _passed.popitem(last=False)
    elif type(out) is tuple:
        for t in out:
            if type(t) is torch.Tensor:
                produced(t, module, op)


def read(tensors, module=None):
    """The checked product of ``module`` reads ``tensors`` (called by ``abft.autograd``): an
    alarm on one of them names its readers, and the sites that made them are kept taking. One a
    product read that was not taken (its site had looked unread) is taken from then on; this one
    is not covered."""
    for t in tensors:
        if type(t) is torch.Tensor:
            try:
                where = t.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError):
                continue
            entry = _storages.get(where)
            if entry is not None:
                site = entry.get("site")
            else:                         # passed over, if that output is still alive
                site, ref = _passed.pop(where, (None, None))
                site = site if ref is not None and ref() is not None else None
            if site is not None:
                site[0] = True
            if entry is not None:
                entry["read"] = True
                readers = entry.setdefault("readers", [])
                if module not in readers:
                    readers.append(module)


def _gradient(module, op, grad):
    """A tensor hook: the gradient of a product's output, complete, before its products read it.
    Verified when the product's backward is done with it (``consumed``): autograd owns the
    tensor, so no weak reference is taken to it."""
    if _operands and grad is not None:
        _take(grad, module, op, "grad_output", operand=True, owned=False)


def consumed(grads):
    """A checked product's backward has read ``grads`` (called by ``abft.autograd``): verify the
    fingerprints taken of them as they arrived."""
    if not _waiting:
        return
    for g in grads:
        if type(g) is torch.Tensor:
            try:
                entry = _waiting.pop(g.untyped_storage().data_ptr(), None)
            except (RuntimeError, NotImplementedError):
                continue
            if entry is not None:
                _storages.pop(entry["storage"], None)
                _verify(entry)


def _take(out, module, op, phase, operand=False, owned=True, site=None):
    if not _checks or torch.compiler.is_compiling():
        return False
    if type(out) is not torch.Tensor or not out.is_floating_point() or out.numel() == 0 \
            or out.is_inference():
        return False        # DTensor shards, integer outputs, inference tensors (no versions)
    if owned and out._base is not None and type(out._base) is torch.Tensor:
        out = out._base     # a view (a product's rows unflattened): its base lives as long as
                            # any view of it does; the view itself may die at once
    try:
        where = out.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):   # no plain storage
        return False
    if where in _storages:
        return False        # the same memory is fingerprinted already (a view, an alias)
    from abft.context import current
    drain()
    chk = _checks[-1]
    t0 = time.perf_counter()
    alias = out.detach()                      # shares the storage and the version counter
    try:
        sums = fingerprint(alias, chk.block)
    except ValueError:                        # gaps or overlaps in memory
        return False
    sc = current()
    entry = dict(alias=alias, version=alias._version, sums=sums, module=module, op=op,
                 phase=phase, labels=dict(sc.labels), log=sc.log, check=chk, storage=where,
                 site=site)
    with _lock:
        _storages[where] = entry
        if owned:
            entry["ref"] = weakref.ref(out, lambda _, e=entry: _died(e))
            _live[id(entry)] = entry
        else:
            _waiting[where] = entry
    if operand:
        chk.taken += 1
    else:
        chk.recorded += 1
    chk.seconds += time.perf_counter() - t0
    return True


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
        if _storages.get(entry.get("storage")) is entry:
            del _storages[entry["storage"]]
        if entry.get("site") is not None and not entry.get("read"):
            entry["site"][1] += 1
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
    if not _dead and not _interrupted.is_set():      # (a flush's common case: nothing died)
        return
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
    if not torch.equal(now, entry["sums"]):   # (one comparison on the clean path)
        words = alias.numel() * max(1, alias.element_size() // 4)   # 64-bit: two words each
        changed = located(now, entry["sums"], chk.block, words)
        if changed:
            _report(entry, alias, changed, chk.block)
    chk.seconds += time.perf_counter() - t0


def _report(entry, alias, changed, block):
    from abft import policy, settings
    from abft.alarms import carry_alarm
    pol = settings.get().policy
    labels = entry["labels"]
    found = []
    words_per = max(1, (alias.element_size() // 4))   # 64-bit elements are two words
    for b, index, delta in changed[:16]:
        batch, row, col = (), None, None
        if index is not None:
            idx = _unravel(alias, index // words_per)
            if len(idx) >= 2:
                *batch, row, col = idx
            elif idx:
                row, col = 0, idx[0]
        found.append(carry_alarm(
            op=entry["op"], phase=entry["phase"], module=entry["module"], scope=labels, tensor=alias,
            block=block, index_block=b, batch=batch, row=row, col=col, delta=delta,
            action="warned" if pol == "warn" else "recorded",
            labels={"index": index, "blocks": len(changed), "read_by": entry.get("readers", [])}))
    policy.report(found, entry["log"])


def forget_sites():
    """Forget which sites' outputs products read (``abft.reset()``): every site is taken again
    until its outputs have died unread ``LEARN`` times."""
    with _lock:
        _sites.clear()
        _passed.clear()


def _forget():
    """At exit: drop the weak references, so that no death callback runs while the interpreter
    tears tensors down (an output still alive then, a loss kept in a global, crashed it)."""
    with _lock:
        for entry in _live.values():
            entry.pop("ref", None)
        _live.clear()
        _storages.clear()
        _waiting.clear()
        _passed.clear()


atexit.register(_forget)


def _unravel(t, i):
    """The index of ``t``'s i-th element in memory order (``rest.fingerprint`` reads a dense
    tensor in that order, a transposed one too)."""
    if not t.dim():
        return []
    order = memory_order(t)
    at = np.unravel_index(i, tuple(t.shape[d] for d in order))
    idx = [0] * t.dim()
    for d, v in zip(order, at):
        idx[d] = int(v)
    return idx


def live():
    """How many recorded outputs are alive, and how many died unverified."""
    with _lock:
        return len(_live), len(_dead)


from abft import policy  # noqa: E402  (policy imports nothing of abft.detectors.outputs)

policy.before_flush(drain)
