"""``abft.nn.Linear`` and ``abft.protect(model)``.

``protect`` swaps the class of every ``nn.Linear`` (and of Hugging Face's GPT-2 ``Conv1D``, an
addmm) in place for a checked subclass: the parameters, buffers, hooks and ``state_dict`` stay
exactly what they were, the optimizer keeps its references, and ``unprotect`` swaps the class back.
Alarms are labelled with the module's qualified name. An ``nn.Linear`` subclass with a forward
of its own (routers that return tuples, quantized and adapter layers) is left as it is, since the
checked forward would replace its own: its products are checked where they reach torch's
functions under ``abft.checked()`` (``protect`` lists it under ``own_forward``).

``nn.MultiheadAttention`` computes its products from its weights inside
``F.multi_head_attention_forward`` (its ``out_proj``'s forward is never called): ``protect`` swaps
it for a subclass whose forward runs inside ``abft.interception.within`` (its label), so its projections and
attention products are checked (SDPA is torch's, counted as unprotected, unless an outer
``checked(sdpa=True)`` decomposes it), and ``out_proj`` is left plain. ``nn.TransformerEncoderLayer``
and ``nn.TransformerEncoder`` take fused inference paths (eval, no grad) that call none of their
submodules' forwards: they get the same wrapper, whose active mode turns those paths off.

Weight checksums (``cache_weight_checksums=True``, the default for protected modules): the
statistics of W the row check needs are kept from the last time the weight parameter changed
(``abft.weightcache``): one pass over W saved per forward, and a change of W at rest (a bit flip
written behind autograd's back) shows as failing row sums at the next forward, where a fresh
check would see a consistent, wrongly-weighted product. Under autocast the statistics are those of
the low-precision copy, kept per version of the parameter. Cost: (out/BN) x in + a few x out floats
per weight. What it does not see: a change that bumps the version counter (a real update), and
changes of the input X or of the bias.
"""
import math

from torch import nn

from abft import autograd, weightcache
from abft.integrations import dtensor
from abft import interception


class _Checked:
    """What every protected module has: ``_abft_name`` labels the alarms; pickled as its plain class
    swapped again."""
    _abft_name = ""
    _abft_kind = "linear"
    _abft_cache = True

    def __reduce_ex__(self, protocol):
        if type(self) not in _classes.values():       # a class of its own (abft.nn.Linear)
            return super().__reduce_ex__(protocol)
        return _rebuild, (type(self)._abft_base, self._abft_kind), self.__getstate__()


class _CheckedProduct(_Checked):
    """Mixin whose ``forward`` runs the checked op (``nn.Linear``, HF ``Conv1D``)."""

    def forward(self, x):
        if self._abft_kind == "conv1d":          # transformers.pytorch_utils.Conv1D
            shape = x.size()[:-1] + (self.nf,)
            y = autograd.addmm(self.bias, x.reshape(math.prod(x.shape[:-1]), x.shape[-1]), self.weight,
                                module=self._abft_name)
            return y.view(shape)
        return autograd.linear(x, self.weight, self.bias, module=self._abft_name,
                               cache=self._abft_cache)


class _CheckedWithin(_Checked):
    """Mixin whose ``forward`` is the module's own, run inside ``abft.interception.within`` (module
    docstring): ``nn.MultiheadAttention`` and the transformer encoder's fused paths."""

    def forward(self, *args, **kwargs):
        with interception.within(self._abft_name):
            return super().forward(*args, **kwargs)


_MIXINS = {"linear": _CheckedProduct, "conv1d": _CheckedProduct, "attention": _CheckedWithin,
           "fast_path": _CheckedWithin}


_classes = {}


def _rebuild(base, kind):
    """Unpickling a protected module: its checked class made again from the plain one (the
    checked classes are made at run time, so pickle cannot find them by name)."""
    cls = _checked_class(base, kind)
    return cls.__new__(cls)


def _checked_class(cls, kind):
    if issubclass(cls, _Checked):
        return cls
    if cls not in _classes:
        _classes[cls] = type(f"Checked{cls.__name__}", (_MIXINS[kind], cls),
                             {"_abft_kind": kind, "_abft_base": cls})
    return _classes[cls]


class Linear(_CheckedProduct, nn.Linear):
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
    mod._abft_cache = bool(cache)
    if cache and getattr(mod, "weight", None) is not None:
        weightcache.key(mod.weight)
        if "_abft_load_hook" not in mod.__dict__:
            mod._abft_load_hook = mod.register_load_state_dict_post_hook(_loaded)


def _loaded(mod, incompatible_keys):
    """After ``load_state_dict``: the kept checksums may describe the old weights (under FSDP2 the
    load writes the shards, and the unsharded weight a forward reads keeps its version)."""
    weightcache.forget()


def _own_forward(cls):
    """Whether an ``nn.Linear`` subclass defines its own forward (a router returning a tuple, a
    quantized or adapter layer): swapping it for the checked forward would change what it does."""
    return cls.forward is not nn.Linear.forward


def _kind(mod):
    if isinstance(mod, nn.MultiheadAttention):
        return "attention"
    if isinstance(mod, (nn.TransformerEncoderLayer, nn.TransformerEncoder)):
        return "fast_path"
    if isinstance(mod, nn.Linear):
        return "linear"
    if type(mod).__name__ == "Conv1D" and hasattr(mod, "nf") and getattr(mod, "weight", None) is not None:
        return "conv1d"
    return None


def protect(model, *, cache_weight_checksums=True, prefix=""):
    """Swap every ``nn.Linear`` and HF ``Conv1D`` of ``model`` for its checked version, in place
    (and ``nn.MultiheadAttention`` and the transformer encoder's modules: module docstring).

    Returns:
        dict with ``linear`` and ``conv1d`` (qualified names swapped), ``attention``
        (``nn.MultiheadAttention``), ``fast_path`` (``nn.TransformerEncoderLayer`` and
        ``nn.TransformerEncoder``, swapped so their fused inference paths are not taken),
        ``already`` (protected before), ``own_forward`` (``nn.Linear`` subclasses with a forward
        of their own, left as they are: their products are checked under ``abft.checked()``) and
        ``not_covered`` (modules with products this cannot reach; none of torch's so far).
    """
    dtensor.ensure()          # eagerly: a torch.compile of the model must not register it
    summary = {"linear": [], "conv1d": [], "attention": [], "fast_path": [], "already": [],
               "own_forward": [], "not_covered": []}
    unused = set()            # nn.MultiheadAttention's out_proj: its forward is never called
    for name, mod in model.named_modules():
        qual = prefix + name if name else (prefix.rstrip(".") or type(model).__name__)
        if isinstance(mod, nn.MultiheadAttention):
            unused.add(id(mod.out_proj))
        if isinstance(mod, _Checked):
            summary["already"].append(qual)
            continue
        if id(mod) in unused:
            continue
        kind = _kind(mod)
        if kind == "linear" and _own_forward(type(mod)):
            summary["own_forward"].append(qual)       # kept as it is (module docstring)
        elif kind is not None:
            mod.__class__ = _checked_class(type(mod), kind)
            _label(mod, qual, cache_weight_checksums and kind in ("linear", "conv1d"))
            summary[kind].append(qual)
    return summary


def _unchecked_class(cls):
    """The plain class of a protected module's class. A parametrization registered after
    ``protect`` (``weight_norm``) made a subclass of the checked class that holds the
    parametrized attributes: the same subclass is made of the plain class."""
    if cls in _classes.values() or cls is Linear:
        return cls._abft_base
    base = _unchecked_class(cls.__bases__[0])
    body = {k: v for k, v in cls.__dict__.items() if k not in ("__dict__", "__weakref__")}
    return type(cls.__name__.replace("Checked", "", 1), (base,), body)


def unprotect(model):
    """Restore the plain classes swapped by ``protect``; returns the names restored."""
    names = []
    for name, mod in model.named_modules():
        if isinstance(mod, _Checked):
            mod.__class__ = _unchecked_class(type(mod))
            hook = mod.__dict__.pop("_abft_load_hook", None)
            if hook is not None:
                hook.remove()
            for attr in ("_abft_name", "_abft_cache"):
                mod.__dict__.pop(attr, None)
            names.append(name)
    return names
