"""abft's ops on DTensor operands (tensor and sequence parallelism, FSDP2's unsharded compute).

DTensor runs an op on each rank's local shards under placements the op declares. These are the
placements torch's own product takes, one mesh dimension at a time: everything replicated; a
batch or row dimension sharded (the output sharded alike); the output columns sharded (the second
operand, and a bias, sharded by columns); or the inner dimension sharded on both operands (a
partial sum, reduced by DTensor afterwards; a bias becomes partial too). So each rank's checked
GEMM is the product it computes, and checks it on its own shard: the check is local, its alarm
names the rank. The backward products (``abft::grad_product``) take the same rules. ``located``
runs a product so that its alarms carry ``labels["shard"]``: this rank's mesh coordinate, the
output shard's offset in the global tensor, and whether the local product is a partial sum.

Registration costs an import of ``torch.distributed.tensor`` (about 2 s), so it happens on the
first checked call made while that module is loaded: before it, no DTensor can exist. Never
while torch.compile traces (dynamo cannot trace the registration, and it would register on its
first call): ``protect`` and ``checked`` register eagerly, before a compiled model's first call.
"""
import sys

import torch

from abft import context

_done = False
_NONE = object()


def ensure():
    """Register the placements once DTensor is in use (cheap to call on every product)."""
    global _done
    if not _done and "torch.distributed.tensor" in sys.modules and \
            not torch.compiler.is_compiling():
        _done = True
        _register()


def _is_dtensor(t):
    return type(t).__name__ == "DTensor"


def any_dtensor(*ts):
    return "torch.distributed.tensor" in sys.modules and any(map(_is_dtensor, ts))


def located(fn, *args):
    """``fn(*args)``; when an operand is a DTensor, the alarms of the products checked inside
    get ``labels["shard"]``, filled once the output's placement is known: an alarm resolved
    inside the product (the ``raise`` policy, a full queue) finds it still empty."""
    if not any_dtensor(*args):
        return fn(*args)
    labels = context.current().labels      # the current scope's, so call ids run on
    where, saved = {}, labels.get("shard", _NONE)
    labels["shard"] = where
    try:
        out = fn(*args)
    finally:
        if saved is _NONE:
            del labels["shard"]
        else:
            labels["shard"] = saved
    if _is_dtensor(out):
        where.update(shard_of(out))
    return out


def shard_of(t):
    """Where this rank's part of DTensor ``t`` lies: mesh coordinate, global offset of its first
    element (None for strided shards, which are not one block), partial sum or not."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    strided = any(type(p).__name__ == "_StridedShard" for p in t.placements)
    offset = None if strided else [int(o) for o in compute_local_shape_and_global_offset(
        t.shape, t.device_mesh, t.placements)[1]]
    coord = t.device_mesh.get_coordinate()          # None on a rank outside the mesh
    return {"coordinate": None if coord is None else [int(c) for c in coord], "offset": offset,
            "partial": any(p.is_partial() for p in t.placements)}


def _offered(placements, dim):
    """The shardings of tensor dimension ``dim`` to offer: plain, plus each strided one
    (``_StridedShard``, what DTensor makes of a flattened sharded view) the operand holds."""
    from torch.distributed.tensor import Shard
    out = [Shard(dim)]
    for p in placements:     # by type too: in some torch versions a strided shard equals a plain one
        if type(p).__name__ == "_StridedShard" and p.dim == dim and \
                not any(type(q) is type(p) and q == p for q in out):
            out.append(p)
    return out


def _moved(p, dim):
    """The same kind of sharding as ``p`` (plain or strided) on tensor dimension ``dim``."""
    from torch.distributed.tensor import Shard
    return Shard(dim) if type(p) is Shard else type(p)(dim, split_factor=p.split_factor)


def _sharded(p):
    return type(p).__name__ in ("Shard", "_StridedShard")


def product_rules(a, b, pa=(), pb=()):
    """(output, a, b) placements of ``torch.matmul(a, b)`` for one mesh dimension, from the
    operand shapes ``a``, ``b`` and the placements they hold (``pa``, ``pb``); 1-D operands are
    replicated only."""
    from torch.distributed.tensor import Partial, Replicate
    R = Replicate()
    rules = [(R, R, R)]
    na, nb = len(a), len(b)
    if na < 2 or nb < 2:
        return rules
    out_nd = max(na, nb)
    for d in range(out_nd - 2):                 # batch dimensions, aligned from the right
        ia, ib = d - (out_nd - na), d - (out_nd - nb)
        size = max(a[ia] if ia >= 0 else 1, b[ib] if ib >= 0 else 1)
        has_a, has_b = ia >= 0 and a[ia] == size, ib >= 0 and b[ib] == size
        if size > 1:
            for p in _offered(pa, ia) if has_a else _offered(pb, ib):
                rules.append((_moved(p, d), _moved(p, ia) if has_a else R,
                              _moved(p, ib) if has_b else R))
    rules += [(_moved(p, out_nd - 2), p, R) for p in _offered(pa, na - 2)]      # rows of a
    rules += [(_moved(p, out_nd - 1), R, p) for p in _offered(pb, nb - 1)]      # columns of b
    inner = _offered(pa, na - 1) + [_moved(p, na - 1) for p in _offered(pb, nb - 2)]
    for p in dict.fromkeys(inner):              # the inner dimension: a partial sum
        rules.append((Partial(), p, _moved(p, nb - 2)))
    return rules


def _bias(p, bias, out):
    """The placement of an added (broadcast) ``bias`` beside an output placed ``p``."""
    from torch.distributed.tensor import Partial, Replicate
    if bias is None:
        return None
    if isinstance(p, Partial):
        return Partial()
    if _sharded(p):
        i = p.dim - (len(out) - len(bias))      # the bias dimension under the output's
        if i >= 0 and bias[i] == out[p.dim]:
            return _moved(p, i)
    return Replicate()


def linear_rules(x, w, b, px=(), pw=()):
    """(output, x, w, b) placements of ``F.linear(x, w, b)``: x (..., K), w (N, K), b (N,)."""
    out = (*x[:-1], w[0])
    flip = lambda p: _moved(p, 1 - p.dim) if _sharded(p) else p     # noqa: E731  (w = b^T)
    rules = []
    for o, qx, qw in product_rules(x, (w[1], w[0]), px, [flip(p) for p in pw]):
        rules.append((o, qx, flip(qw), _bias(o, b, out)))
    return rules


def _shape(spec):
    return None if spec is None else tuple(spec.shape)


def _held(spec):
    return () if spec is None else tuple(spec.placements)


def product_sharding(extra):
    """The sharding rule of a custom op taking (a, b, then ``extra`` arguments that are not
    tensors): torch.matmul's placements (``product_rules``)."""
    def rules(a, b, *rest):
        return [([o], [qa, qb, *([None] * extra)]) for o, qa, qb in
                product_rules(_shape(a), _shape(b), _held(a), _held(b))]
    return rules


def linear_sharding(x, w, b, module, wkey):
    """abft::linear's rule: F.linear's placements (``linear_rules``)."""
    return [([o], [qx, qw, qb, None, None]) for o, qx, qw, qb in
            linear_rules(_shape(x), _shape(w), _shape(b), _held(x), _held(w))]


def addmm_sharding(input, m1, m2, beta, alpha, module):
    """abft::addmm's and abft::baddbmm's rule: the product's placements, the added input
    placed as a bias beside the output (``_bias``)."""
    out = (*_shape(m1)[:-1], _shape(m2)[-1])
    return [([o], [_bias(o, _shape(input), out), qa, qb, None, None, None])
            for o, qa, qb in product_rules(_shape(m1), _shape(m2), _held(m1), _held(m2))]


_RULES = []          # (custom op, its sharding rule), registered once DTensor is in use


def rule(op_def, fn):
    """Give the custom op ``op_def`` the sharding rule ``fn`` (``abft.optable.register`` calls
    it): at once where the rules are registered already, else with them."""
    _RULES.append((op_def, fn))
    if _done:
        _register_one(op_def, fn)


def _register_one(op_def, fn):
    from torch.distributed.tensor.experimental import register_sharding
    register_sharding(getattr(torch.ops.abft, op_def._name.split("::")[-1]).default)(fn)


def _register():
    for op_def, fn in _RULES:
        _register_one(op_def, fn)
