"""``with abft.checked():`` check the products of unmodified code.

A TorchFunctionMode that routes the torch functions of the table of checked ops
(``abft.optable``: ``torch.matmul`` and ``torch.linalg.matmul``, ``Tensor.matmul``/``@``,
``torch.mm``, ``torch.bmm``, ``torch.addmm``, ``torch.baddbmm``, ``F.linear``,
``torch._grouped_mm``) and ``torch.einsum`` (where it is a plain product: one contracted index, at
most one free index per operand) through abft. Module labels come from forward hooks it installs (qualified names when ``model`` is given,
class names otherwise). ``F.scaled_dot_product_attention`` is computed as its math decomposition
with both products checked when ``sdpa=True``; otherwise it is counted as unprotected, as are
convolutions, einsum forms that are not products, the products abft has no checked form of
(``_UNPROTECTED``: ``mv``, ``addbmm``, in-place ``addmm_``...) and aten's products called directly
(``abft.coverage()``). ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``, which reads
its weights directly) runs with the mode re-entered, so its projections and attention products are
seen; a mode being active also keeps torch's fused inference paths (``nn.MultiheadAttention``,
``nn.TransformerEncoderLayer``) from being taken.

Torch-function modes are off inside autograd's backward; the backward products are checked because
abft's own ops compute them. einsum is checked in the forward only (torch computes its gradients).
"""
import math
import threading
from types import FunctionType

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from abft import autograd, coverage, ops
from abft.optable import INTERCEPTS
from abft.detectors import attention
from abft.detectors import outputs
from abft.integrations import dtensor

_local = threading.local()


def _stack():
    st = getattr(_local, "modules", None)
    if st is None:
        st = _local.modules = []
    return st


def _state(name):
    """This thread's ``passing`` (an abft block is handling a call) or ``sdpa`` (the innermost
    ``checked`` block's choice)."""
    return getattr(_local, name, False)


def current_module():
    st = _stack()
    return st[-1] if st else None


def _einsum_product(eq, a, b):
    """(permute_a, permute_b, out_order) when ``eq`` is a plain batched product, else None."""
    eq = eq.replace(" ", "")
    if "->" not in eq or "." in eq:
        return None
    ins, out = eq.split("->")
    parts = ins.split(",")
    if len(parts) != 2:
        return None
    x, y = parts
    if len(set(x)) != len(x) or len(set(y)) != len(y) or len(set(out)) != len(out):
        return None
    contracted = [c for c in x if c in y and c not in out]
    batch = [c for c in out if c in x and c in y]
    free_x = [c for c in x if c not in y]
    free_y = [c for c in y if c not in x]
    if len(contracted) != 1 or len(free_x) > 1 or len(free_y) > 1:
        return None
    if set(out) != set(batch + free_x + free_y) or any(c not in out for c in free_x + free_y):
        return None
    k = contracted[0]
    order_x = batch + free_x + [k]
    order_y = batch + [k] + free_y
    prod_order = batch + free_x + free_y
    return ([x.index(c) for c in order_x], [y.index(c) for c in order_y],
            [prod_order.index(c) for c in out], bool(free_x), bool(free_y))


def einsum(eq, a, b, module=None):
    """``torch.einsum`` of a plain product, checked in the forward (values are torch's)."""
    plan = _einsum_product(eq, a, b)
    out = torch.einsum(eq, a, b)
    if plan is None or not ops.enabled():
        coverage.unprotected("einsum", module)
        return out
    pa, pb_, po, has_i, has_j = plan
    a2, b2 = a.permute(pa), b.permute(pb_)
    if not has_i:
        a2 = a2.unsqueeze(-2)
    if not has_j:
        b2 = b2.unsqueeze(-1)
    # out permuted into (batch..., i, j) order, with the missing free dims restored
    c2 = out.permute([po.index(i) for i in range(len(po))]) if po else out
    if not has_j:
        c2 = c2.unsqueeze(-1)
    if not has_i:
        c2 = c2.unsqueeze(-2)
    with torch._C.DisableTorchFunction():
        ops.check_views("einsum", a2.detach(), b2.detach(), c2.detach(), module=module)
    return out


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
         enable_gqa=False, module=None):
    """``F.scaled_dot_product_attention`` as its math decomposition, both products checked and the
    softmax between them by its invariants (``abft/detectors/attention.py``)."""
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        rep = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(rep, -3), value.repeat_interleave(rep, -3)
    s = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = autograd.matmul(query, key.transpose(-2, -1), module=module) * s
    if is_causal:
        L, S = query.shape[-2], key.shape[-2]
        causal = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
            else scores + attn_mask
    p = attention.softmax(scores, module)          # rows summing to 1, forward and backward
    if attn_mask is not None:                      # (a causal mask leaves every row a key)
        dead = torch.isneginf(scores).all(-1, keepdim=True)
        if dead.any():                             # fully masked rows: zeros, as torch's SDPA
            p = p.masked_fill(dead, 0.0)
    if dropout_p > 0:
        p = F.dropout(p, dropout_p)
    return autograd.matmul(p, value, module=module)


class _Noop:
    """A ``context_fn`` that torch.utils.checkpoint takes for its default (``noop_context_fn``)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self):
        return self.fn()


_reentrant_classes = {}


def _reentrant(base):
    """torch.utils.checkpoint's reentrant Function (``use_reentrant=True``, which takes no
    ``context_fn``) with its recomputation run in the block's recompute context: the function
    it keeps is wrapped, at the forward, in the context checkpoint's default is then."""
    if base not in _reentrant_classes:
        import torch.utils.checkpoint as cp

        class CheckedCheckpointFunction(base):
            @staticmethod
            def forward(ctx, run_function, preserve_rng_state, *args):
                noop = cp.noop_context_fn
                if isinstance(noop, _Noop):
                    run_function = _Recompute(run_function, noop.fn)
                return base.forward(ctx, run_function, preserve_rng_state, *args)

        _reentrant_classes[base] = CheckedCheckpointFunction
    return _reentrant_classes[base]


class _Recompute:
    """A checkpointed function: as it is in the forward, in the recompute context in backward."""

    def __init__(self, fn, context):
        self.fn, self.context = fn, context

    def __call__(self, *args):
        if torch._C._current_graph_task_id() == -1:
            return self.fn(*args)
        _, recompute = self.context()
        with recompute:
            return self.fn(*args)


_UNPROTECTED = {F.conv1d: "conv1d", F.conv2d: "conv2d", F.conv3d: "conv3d",
                F.conv_transpose1d: "conv_transpose1d", F.conv_transpose2d: "conv_transpose2d",
                F.conv_transpose3d: "conv_transpose3d",
                torch.conv1d: "conv1d", torch.conv2d: "conv2d", torch.conv3d: "conv3d",
                torch.conv_transpose1d: "conv_transpose1d", torch.conv_transpose2d: "conv_transpose2d",
                torch.conv_transpose3d: "conv_transpose3d", torch.tensordot: "tensordot",
                # products abft has no checked form of, the in-place ones among them (abft's
                # products return new tensors)
                torch.mv: "mv", torch.Tensor.mv: "mv", torch.addmv: "addmv", torch.Tensor.addmv: "addmv",
                torch.Tensor.addmv_: "addmv_", torch.addbmm: "addbmm", torch.Tensor.addbmm: "addbmm",
                torch.Tensor.addbmm_: "addbmm_", torch.Tensor.addmm_: "addmm_",
                torch.Tensor.baddbmm_: "baddbmm_", torch.dot: "dot", torch.Tensor.dot: "dot",
                torch.vdot: "vdot", torch.Tensor.vdot: "vdot", torch.inner: "inner",
                torch.Tensor.inner: "inner", torch.linalg.multi_dot: "multi_dot",
                torch.chain_matmul: "chain_matmul", torch.matrix_power: "matrix_power",
                torch.Tensor.matrix_power: "matrix_power", torch.linalg.matrix_power: "matrix_power"}

# aten's products called directly (``torch.ops.aten.mm(a, b)``), by the op's name
_ATEN_PRODUCTS = frozenset({"mm", "bmm", "addmm", "addmm_", "baddbmm", "baddbmm_", "addbmm", "addbmm_",
                            "matmul", "linear", "mv", "addmv", "addmv_", "dot", "vdot", "convolution",
                            "_convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
                            "conv_transpose2d", "conv_transpose3d", "_scaled_dot_product_flash_attention",
                            "_scaled_dot_product_efficient_attention", "scaled_dot_product_attention",
                            "tensordot", "einsum", "_grouped_mm"})
_ATEN_TYPES = (torch._ops.OpOverload, torch._ops.OpOverloadPacket)


def _aten_product(func):
    """The name of an aten product called directly (an OpOverload or its packet), else None."""
    if type(func) not in _ATEN_TYPES:
        return None
    packet = func if type(func) is torch._ops.OpOverloadPacket else func.overloadpacket
    name = packet.__name__
    if not packet._qualified_op_name.startswith("aten::") or name not in _ATEN_PRODUCTS:
        return None
    return f"aten.{name}"


class checked(TorchFunctionMode):
    """Check every product of the code inside the block.

    Args:
        model: optional root module: alarms are labelled with qualified module names.
        sdpa: compute ``F.scaled_dot_product_attention`` as checked products (math decomposition;
            values then differ from the fused kernel's by round-off).
    """

    _label = None            # a fixed module label (``within``); else the module stack's

    def __init__(self, model=None, *, sdpa=False):
        super().__init__()
        self.names = {id(m): n or type(m).__name__ for n, m in model.named_modules()} if model is not None else None
        self.sdpa = sdpa
        self._hooks = []
        self._model = model
        self._checkpoint = None
        self._saved = []          # (passing, sdpa) of this thread at each entry (``_save``)

    def _recompute_context(self):
        """torch.utils.checkpoint's ``context_fn`` while the block is open: the recomputation
        (during backward, where torch-function modes are off) runs checked too, so it saves the
        tensors the checked forward saved (``use_reentrant=False`` compares them)."""
        import contextlib
        return contextlib.nullcontext(), checked(self._model, sdpa=self.sdpa)

    def _patch_checkpoint(self):
        """Make ``_recompute_context`` checkpoint's default context (its ``noop_context_fn``
        too, which use_reentrant=True requires the default to be), and its reentrant Function
        one that recomputes in it, unless an outer block did."""
        import inspect
        import torch.utils.checkpoint as cp
        if isinstance(cp.noop_context_fn, _Noop):
            return
        fn = self._recompute_context
        kw = inspect.unwrap(cp.checkpoint).__kwdefaults__
        self._checkpoint = (cp.noop_context_fn, kw.get("context_fn"), cp.CheckpointFunction)
        cp.noop_context_fn = _Noop(fn)
        kw["context_fn"] = cp.noop_context_fn
        cp.CheckpointFunction = _reentrant(cp.CheckpointFunction)

    def _unpatch_checkpoint(self):
        if self._checkpoint is not None:
            import inspect
            import torch.utils.checkpoint as cp
            cp.noop_context_fn, inspect.unwrap(cp.checkpoint).__kwdefaults__["context_fn"], \
                cp.CheckpointFunction = self._checkpoint
            self._checkpoint = None

    def _name(self, mod):
        if self.names is not None:
            return self.names.get(id(mod), type(mod).__name__)
        return type(mod).__name__

    def __enter__(self):
        def push(mod, args):
            _stack().append(self._name(mod))

        def pop(mod, args, out):          # a hook that returns something replaces the output
            if _stack():
                _stack().pop()

        dtensor.ensure()          # eagerly: a torch.compile inside the block must not register it
        pre = torch.nn.modules.module.register_module_forward_pre_hook(push)
        post = torch.nn.modules.module.register_module_forward_hook(pop, always_call=True)
        self._hooks = [pre, post]
        self._patch_checkpoint()
        self._save(sdpa=self.sdpa)
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._unpatch_checkpoint()
        self._restore()
        return super().__exit__(*exc)

    def _save(self, sdpa):
        """Entering: this block handles what reaches it (an outer block's pass-through mark is
        cleared until it exits) and sets the SDPA choice of the ``within`` blocks inside it."""
        self._saved.append((_state("passing"), _state("sdpa")))
        _local.passing, _local.sdpa = False, sdpa

    def _restore(self):
        _local.passing, _local.sdpa = self._saved.pop()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in INTERCEPTS and func not in _OWN and not isinstance(func, FunctionType) and \
                type(func) not in _ATEN_TYPES:
            # most calls: torch's own compiled functions, methods and attributes, which abft
            # leaves alone and which call no torch function back (so no pass-through mark)
            if not outputs.operands():
                return func(*args, **kwargs)
            out = func(*args, **kwargs)       # a product may read it next: fingerprinted
            outputs.produced(out, self._label or current_module())
            return out
        if _state("passing"):
            # an inner abft block handles this call: what it runs (torch's own call, abft's
            # check) is its own, so an outer block (protect's ``within`` under ``checked``)
            # neither counts nor checks it again
            return func(*args, **kwargs)
        _local.passing = True
        try:
            return self._handle(func, args, kwargs)
        finally:
            _local.passing = False

    def _handle(self, func, args, kwargs):
        mod = self._label or current_module()
        op = INTERCEPTS.get(func)
        if op is not None:
            return _handler(op)(func, mod, args, kwargs)
        if func is torch.einsum:
            operands = args[1:] if len(args) > 2 else (args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:])
            if len(operands) == 2 and not kwargs:
                return einsum(args[0], operands[0], operands[1], module=mod)
            coverage.unprotected("einsum", mod)
        elif func is F.scaled_dot_product_attention:
            if self.sdpa:
                return sdpa(*args, **kwargs, module=mod)
            coverage.unprotected("scaled_dot_product_attention", mod)
        elif func in _UNPROTECTED:
            coverage.unprotected(_UNPROTECTED[func], mod)
        elif (aten := _aten_product(func)) is not None:     # aten's other ops run below
            coverage.unprotected(aten, mod)
        elif func is F.multi_head_attention_forward:
            # a Python function of torch products: called with this mode popped (as every function
            # a mode handles), it would compute them unseen; run with the mode pushed again (its
            # copy skips its own check, which would hand it back here), each reaches this mode
            TorchFunctionMode.__enter__(self)
            _local.passing = False
            try:
                return _unhandled(func)(*args, **kwargs)
            finally:
                TorchFunctionMode.__exit__(self, None, None, None)
        return func(*args, **kwargs)


_copies = {}


def _unhandled(fn):
    """A copy of torch's Python function ``fn`` whose ``has_torch_function`` checks answer False
    (the same code and module globals otherwise)."""
    if fn not in _copies:
        import types
        g = dict(fn.__globals__)
        for name in ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic"):
            g[name] = lambda *args: False
        copy = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
        copy.__kwdefaults__ = fn.__kwdefaults__
        _copies[fn] = copy
    return _copies[fn]


class within(checked):
    """The products of one module's forward checked under its label (``protect``'s
    ``nn.MultiheadAttention``): a ``checked`` block without the module hooks and checkpoint
    patches, which an outer ``checked`` or a protected module's own recomputation provides."""

    def __init__(self, label):
        super().__init__()
        self._label = label

    def __enter__(self):
        self.sdpa = _state("sdpa")               # an outer checked(sdpa=True) decomposes SDPA here too
        self._save(sdpa=self.sdpa)
        return TorchFunctionMode.__enter__(self)

    def __exit__(self, *exc):
        self._restore()
        return TorchFunctionMode.__exit__(self, *exc)


def _checkable(*ts):
    """Whether abft checks a product of these operands: dense float tensors (the dtypes the
    reference computes) off the meta device. Anything else goes to torch unchanged."""
    return all(isinstance(t, torch.Tensor) and t.dtype in ops.SUPPORTED and not t.is_meta
               and t.layout == torch.strided for t in ts)


def _to_out(func, args, kwargs, out, compute):
    """``out=``: torch's own call where it would refuse or convert (inputs that need grad, another
    dtype); else the checked result written into ``out``, resized as torch resizes it."""
    ts = [t for t in args if isinstance(t, torch.Tensor)] + [v for v in kwargs.values()
                                                               if isinstance(v, torch.Tensor)]
    if (torch.is_grad_enabled() and any(t.requires_grad for t in ts)) or \
            any(t.dtype != out.dtype for t in ts if t is not out):
        return func(*args, **kwargs)
    res = compute()
    with torch.no_grad():
        if out.shape != res.shape:
            out.resize_(res.shape)
        out.copy_(res)
    return out


_handlers = {}


def _handler(op):
    """The handler of the checked op ``op`` (an ``abft.optable`` row), made once: torch's
    signature, ``op.call(mod, **bound)`` where abft checks the tensor arguments (``op.operands``,
    and ``op.optional`` ones where given and not None, by torch's names), torch's own call
    otherwise (counted as unprotected); keywords bound by torch's names, so an argument torch
    does not take raises torch's own error."""
    cached = _handlers.get(op.name)
    if cached is not None and cached[0] is op:       # (a row registered again gets a new one)
        return cached[1]
    sig = _sig(op.signature)
    pos = [p.name for p in sig.parameters.values() if p.kind == p.POSITIONAL_OR_KEYWORD]
    required = sum(sig.parameters[p].default is sig.empty for p in pos)

    def handle(func, mod, args, kwargs):
        try:
            # positional arguments alone (the usual call) bound by hand (Signature.bind: ~3 us)
            bound = dict(zip(pos, args)) if not kwargs and required <= len(args) <= len(pos) \
                else sig.bind(*args, **kwargs).arguments
        except TypeError:
            return func(*args, **kwargs)               # torch's own error (or an overload we lack)
        out = bound.pop("out", None)
        ops_ = [bound[k] for k in op.operands] + \
            [bound[k] for k in op.optional if bound.get(k) is not None]
        if not _checkable(*ops_) or (out is not None and not _checkable(out)):
            coverage.unprotected(op.name, mod)
            return func(*args, **kwargs)
        run = lambda: op.call(mod, **bound)
        return run() if out is None else _to_out(func, args, kwargs, out, run)
    _handlers[op.name] = op, handle
    return handle


def _sig(text):
    """An inspect.Signature from torch's documented signature, e.g. '(input, other, *, out=None)'."""
    import inspect
    ns = {}
    exec(f"def f{text}: pass", ns)
    return inspect.signature(ns["f"])


# every function the mode does something with besides the checked ops' (the rest pass straight
# through)
_OWN = frozenset(_UNPROTECTED) | {torch.einsum, F.scaled_dot_product_attention,
                                  F.multi_head_attention_forward}
