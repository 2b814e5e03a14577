"""``abft.nn.Linear`` and ``abft.protect(model)``.

``protect`` swaps the class of every ``nn.Linear`` (and of Hugging Face's GPT-2 ``Conv1D``, an
addmm) in place for a checked subclass: the parameters, buffers, hooks and ``state_dict`` stay
exactly what they were, the optimizer keeps its references, and ``unprotect`` swaps the class back.
Alarms are labelled with the module's qualified name.

Weight checksums (``cache_weight_checksums=True``, the default for protected modules): the row
check of Y = X W^T + b needs statistics of W (its row block sums, squared norms and maxima). They
are kept from the last time W changed (its version counter tells: optimizer steps bump it), which
saves one pass over W per forward, and makes a change of W at rest (an HBM bit flip between two
optimizer steps, written behind autograd's back) show as failing row sums at the next forward,
where a fresh check would see a consistent, wrongly-weighted product. Cost: (out/BN) x in + 2 out
floats per weight. What it does not see: a change that bumps the version counter (a real update),
and changes of the input X or of the bias.
"""
import threading

from torch import nn

from abft import autograd
from abft.kernels.reference import operand_stats
from abft.tolerance import check_dtype, low_entropy

_cache_lock = threading.Lock()
_cache = {}          # (module name, data_ptr, shape, dtype, device) -> (version, bn, stats)
_cache_enabled = set()


def weight_stats_for(w, module):
    """The cached statistics getter for a protected module's weight, or None."""
    if not module or module not in _cache_enabled:
        return None

    def get(bn):
        key = (module, w.data_ptr(), tuple(w.shape), w.dtype, w.device)
        ver = w._version
        with _cache_lock:
            hit = _cache.get(key)
        if hit is not None and hit[0] == ver and hit[1] == bn:
            return hit[2]
        b = w.t()
        cd = check_dtype(w.dtype)
        stats = (operand_stats(b.mT, bn, cd), low_entropy(b.mT))
        with _cache_lock:
            _cache[key] = (ver, bn, stats)
        return stats

    return get


class _Checked:
    """Mixin whose ``forward`` runs the checked op; ``_abft_name`` labels the alarms."""
    _abft_name = ""
    _abft_kind = "linear"

    def forward(self, x):
        if self._abft_kind == "conv1d":          # transformers.pytorch_utils.Conv1D
            shape = x.size()[:-1] + (self.nf,)
            y = autograd.addmm(self.bias, x.view(-1, x.size(-1)), self.weight, module=self._abft_name)
            return y.view(shape)
        return autograd.linear(x, self.weight, self.bias, module=self._abft_name)


_classes = {}


def _checked_class(cls, kind):
    if issubclass(cls, _Checked):
        return cls
    if cls not in _classes:
        _classes[cls] = type(f"Checked{cls.__name__}", (_Checked, cls), {"_abft_kind": kind,
                                                                         "_abft_base": cls})
    return _classes[cls]


class Linear(_Checked, nn.Linear):
    """``nn.Linear`` whose forward and both backward GEMMs are checked.

    Same constructor, parameters and state_dict as ``nn.Linear``.

    Args:
        in_features, out_features, bias, device, dtype: as ``nn.Linear``.
        name: the label its alarms carry (``protect`` sets the qualified name).
        cache_weight_checksums: keep the weight's checksums between its changes (module docstring).
    """
    _abft_base = nn.Linear

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, *, name="linear",
                 cache_weight_checksums=True):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        _label(self, name, cache_weight_checksums)


def _label(mod, name, cache):
    mod._abft_name = name
    if cache:
        _cache_enabled.add(name)
    else:
        _cache_enabled.discard(name)


def _kind(mod):
    if isinstance(mod, nn.Linear):
        return "linear"
    if type(mod).__name__ == "Conv1D" and hasattr(mod, "nf") and getattr(mod, "weight", None) is not None:
        return "conv1d"
    return None


def protect(model, *, cache_weight_checksums=True, prefix=""):
    """Swap every ``nn.Linear`` and HF ``Conv1D`` of ``model`` for its checked version, in place.

    Returns:
        dict with ``linear`` and ``conv1d`` (qualified names swapped), ``already`` (protected
        before) and ``not_covered`` (modules with GEMMs this cannot reach, e.g.
        ``nn.MultiheadAttention``, which uses its weights directly: use ``abft.checked()``).
    """
    summary = {"linear": [], "conv1d": [], "already": [], "not_covered": []}
    for name, mod in model.named_modules():
        qual = prefix + name if name else (prefix.rstrip(".") or type(model).__name__)
        if isinstance(mod, _Checked):
            summary["already"].append(qual)
            continue
        kind = _kind(mod)
        if kind is not None:
            mod.__class__ = _checked_class(type(mod), kind)
            _label(mod, qual, cache_weight_checksums)
            summary[kind].append(qual)
        elif isinstance(mod, nn.MultiheadAttention):
            summary["not_covered"].append(qual)
    return summary


def unprotect(model):
    """Restore the plain classes swapped by ``protect``; returns the names restored."""
    names = []
    for name, mod in model.named_modules():
        if isinstance(mod, _Checked):
            base = type(mod)._abft_base
            _cache_enabled.discard(mod._abft_name)
            mod.__class__ = base
            names.append(name)
    return names
