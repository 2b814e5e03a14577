"""Sampled recompute of the non-GEMM modules: norms, activations, softmax, embedding lookups.

    rc = abft.RecomputeCheck(model, rate=0.1)     # one call in ten of each such module
    ...                                          # train as usual; alarms of kind "recompute"
    rc.remove()

A checksum covers a product; the modules between products (a layer norm, a GELU, a softmax, an
embedding lookup) compute outside it. These modules are deterministic functions of their inputs
on one device, so on a sampled call the check runs the module's ``forward`` again on the same
inputs, without autograd, and compares the two outputs bit for bit: a fault in the first
computation, or in its output before this check reads it (first among the module's hooks),
differs from the rerun. An
alarm names the module, its type and the first differing element; the policy applies as for a
product (``recompute`` and ``correct`` hand the rerun's output on). ``rate`` sets the cost: the
sampled modules run twice in the forward (their backward is not rerun). Sampling is spread
evenly over each module's calls (``rate`` 0.25: calls 3, 7, 11, ...), so the same run samples the
same calls.

Modules with randomness (dropout) or state (batch norm in training) are not rerun, nor modules
that write in place (``inplace=True``, an embedding with ``max_norm``, any forward that changed a
tensor argument or returns its storage: counted in ``skipped``). Under ``torch.compile`` the
check stands aside. Each sampled call compares on the host (one synchronization).
"""
import math
import time

import torch
from torch import nn

TYPES = (nn.LayerNorm, nn.GroupNorm, nn.GELU, nn.SiLU, nn.ReLU, nn.Tanh, nn.Sigmoid,
         nn.Softmax, nn.LogSoftmax, nn.Embedding) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())
_NAMES = ("RMSNorm", "LayerNorm", "SiLUActivation", "GELUActivation", "NewGELUActivation",
          "PytorchGELUTanh", "Softmax", "GELU", "SiLU")   # transformers' and users' own, by name


def _covered(mod):
    if getattr(mod, "inplace", False):           # it overwrote its input: no rerun possible
        return False
    if isinstance(mod, nn.Embedding) and mod.max_norm is not None:   # renormalizes in place
        return False
    return isinstance(mod, TYPES) or type(mod).__name__ in _NAMES or \
        type(mod).__name__.endswith(("RMSNorm", "LayerNorm"))


def _bits(t):
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
        t.element_size()]) if t.is_floating_point() else t


def _shares(a, b):
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):       # no plain storage (DTensor, ...)
        return False


def _tensors(args, kwargs):
    return [a for a in (*args, *kwargs.values()) if torch.is_tensor(a)]


class _Replaced(torch.autograd.Function):
    """``new``'s values, gradients passed to ``old`` (the output autograd knows)."""

    @staticmethod
    def forward(ctx, old, new):
        return new.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class RecomputeCheck:
    """Rerun a sample of ``model``'s non-GEMM leaf modules and compare bit for bit.

    Args:
        model: the module tree; its leaves of a covered type are checked.
        rate: the fraction of each module's calls rerun, in (0, 1].
    """

    def __init__(self, model, *, rate=1.0):
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or \
                not (0 < rate <= 1) or not math.isfinite(rate):
            raise ValueError(f"abft.RecomputeCheck: rate must be in (0, 1], got {rate!r}")
        self.rate, self.calls, self.checked, self.seconds = float(rate), {}, 0, 0.0
        self.handles = []
        self.modules = {}
        self.versions = {}
        self.skipped = 0             # sampled calls not rerun: the forward changed its input
        for name, mod in model.named_modules():
            if not list(mod.children()) and _covered(mod):
                self.modules[id(mod)] = name
                # first among the module's hooks: the output as forward made it, before
                # others (fake-quantize observers, FSDP's reshard) act on it or on the module
                self.handles.append(mod.register_forward_pre_hook(
                    self._pre, with_kwargs=True, prepend=True))
                self.handles.append(mod.register_forward_hook(
                    self._hook, with_kwargs=True, prepend=True))

    def _pre(self, mod, args, kwargs):
        self.versions[id(mod)] = [t._version for t in _tensors(args, kwargs)]
        return None

    def _sampled(self, key):
        n = self.calls.get(key, 0)
        self.calls[key] = n + 1
        return math.floor((n + 1) * self.rate) > math.floor(n * self.rate)

    def _hook(self, mod, args, kwargs, output):
        from abft import settings
        if torch.compiler.is_compiling() or not settings.get().enabled or \
                not torch.is_tensor(output) or not self._sampled(id(mod)):
            return None
        seen = _tensors(args, kwargs)
        if self.versions.pop(id(mod), None) != [t._version for t in seen] or \
                any(_shares(t, output) for t in seen):
            self.skipped += 1        # written in place: a rerun would not see the same input
            return None
        t0 = time.perf_counter()
        with torch.no_grad():
            again = mod.forward(*args, **kwargs)
        self.checked += 1
        a, b = output.detach(), again
        same = a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))
        self.seconds += time.perf_counter() - t0
        if same:
            return None
        return self._alarm(mod, a, b, output)

    def _alarm(self, mod, a, b, output):
        from abft import policy
        from abft.alarms import SilentCorruptionError, recompute_alarm
        from abft.context import current
        action = policy.action("corrected")
        sc = current()
        labels = sc.labels
        row = col = None
        batch = ()
        diff = 0
        if a.shape == b.shape:
            where = (_bits(a) != _bits(b)).nonzero()
            diff = int(where.shape[0])
            if diff:
                first = [int(i) for i in where[0]]
                if len(first) >= 2:
                    *batch, row, col = first
                elif first:
                    col = first[0]
        finite = torch.isfinite(a) & torch.isfinite(b) if a.shape == b.shape else None
        err = float((a.double() - b.double()).abs()[finite].max()) \
            if finite is not None and bool(finite.any()) else float("nan")
        alarm = recompute_alarm(
            op=type(mod).__name__, module=self.modules.get(id(mod)), scope=labels, tensor=a, batch=batch,
            row=row, col=col, error=err, action=action, elements=diff)
        policy.report([alarm], sc.log)
        if action == "raised":
            raise SilentCorruptionError(alarm)
        if action == "corrected":           # the rerun's output, with the first one's autograd
            return _Replaced.apply(output, b) if output.requires_grad else b
        return None

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []
