"""Checksums carried beside gradients through their collectives (all-reduce, reduce-scatter).

    check = abft.CommCheck(model)                     # names the parameters in alarms
    ddp.register_comm_hook(check, abft.CommCheck.ddp_hook)   # DDP (or check.attach(ddp))
    check.attach(model)                               # FSDP2: every fully_shard module (HSDP too)
    check.all_reduce_grads(model.parameters(), group) # a hand-written data-parallel step

The checksum of a sum is the sum of the checksums. Before the collective each rank takes, per
block of ``block`` elements of its buffer, four float64 sums (the values, the values weighted by
their 1-based index k in the block and by f(k), their magnitudes) and reduces them beside the
buffer: 32 bytes per block, 0.8% more traffic at 1024 float32 elements. After it, the block sums
of the result must equal the reduced sums up to the collective's own rounding, bounded
deterministically: each element of a sum over p ranks is rounded at most p - 1 times (once more
for an average), so

    |sum_block(y) - S| <= gamma_{p-1+avg}(u) A + gamma_{block+p+2}(2^-53) (A + sum_block |y|)

with A the reduced sum of magnitudes and u the buffer's unit round-off. A larger change (a bit
flipped in a buffer in flight, a corrupting link or switch, a faulty reduction kernel) is an alarm
of kind ``comm`` naming the parameter and, when one element changed, the element (the weighted
sums over the plain one). A block whose inputs were not finite (a GradScaler overflow step), or
whose result overflowed, is unverified, not alarmed.

Sensitivity follows from the bound: for Gaussian gradients in blocks of 1024 it is 1.2e-3 of the
mean reduced element in float32 over 8 ranks; in bfloat16 (2^-8 per add) 82 times it, so only
changes of exponent bits are caught. One rank (the evaluation's
one-process group) leaves only float64's round-off: every change of a float32 mantissa bit of an
element of ordinary size is detected.
"""
import math
import time

import torch
import torch.distributed as dist

from abft import ops, policy
from abft.kernels.threshold import UNIT, gamma
from abft.detectors.rest import weight_of, position_weights

_CHUNK = 1 << 16          # elements per pass: float64 temporaries that stay in cache (4x faster
                          # here than passes of 2^22, whose fresh pages cost more than the sums)
MAX_ALARMS = 16           # alarms per collective; past that, one summary alarm


def block_sums(x, block):
    """(blocks, 4) float64 of ``x`` flattened: per block of ``block`` elements the sum, the sums
    weighted by the 1-based index k in the block and by f(k), the sum of magnitudes (a short last
    block is padded with zeros)."""
    flat = x.detach().reshape(-1)
    nb = -(-flat.numel() // block)
    out = torch.empty(nb, 4, dtype=torch.float64, device=flat.device)
    w = position_weights(block, flat.device)[:, 1:]        # RestCheck's k and f(k), kept per block size
    per = max(1, _CHUNK // block)
    for b0 in range(0, nb, per):
        b1 = min(nb, b0 + per)
        v = flat[b0 * block:b1 * block].to(torch.float64)
        if v.numel() < (b1 - b0) * block:
            v = torch.cat([v, v.new_zeros((b1 - b0) * block - v.numel())])
        v = v.view(-1, block)
        out[b0:b1, 0] = v.sum(1)
        with torch._C.DisableTorchFunction():        # under abft.checked: not a product to check
            out[b0:b1, 1:3] = v @ w
        out[b0:b1, 3] = v.abs().sum(1)
    return out


def compare(out, sums, *, ranks, average, block, extra=0):
    """Check the collective's result ``out`` against the reduced ``sums`` (the inputs' block
    sums). Returns (bad, unverified, residual, bound, index) per block: index is the located
    element's 0-based position in the block, -1 where not located.

    ``extra``: roundings of each element before the collective that ``sums`` do not include
    (FSDP2's HSDP adds the previous micro-batches' partial reduction to the buffer).

    Detection is the deterministic bound. Location: one changed element at k moves the three
    sums by d, d k and d f(k); the position k' = round(ratio of the first two) is kept when both
    weighted residuals agree with it to half the plain one (a wrong k' misses the f(k) one by
    |f(k') - f(k)| d, at least d)."""
    got = block_sums(out, block)
    if average:
        sums = sums / ranks
    a = sums[:, 3]
    u = UNIT[out.dtype]
    bound = gamma(ranks - 1 + int(average) + extra, u) * a + \
        gamma(block + ranks + 2, 2.0 ** -53) * (a + got[:, 3].nan_to_num(0.0, 0.0, 0.0))
    # flushed subnormals (a device that flushes them in its reduction) and slack for A's own
    # rounding: negligible against any change a bit flip makes
    bound = bound * (1 + 2.0 ** -40) + block * ranks * torch.finfo(out.dtype).tiny
    d = got - sums
    res = d[:, 0]
    # inputs not finite, or a non-finite result that an overflow of the sum may explain (a
    # finite result had no overflow on the way: inf does not come back)
    unverified = ~torch.isfinite(a) | (~torch.isfinite(got[:, 0]) & (a >= torch.finfo(out.dtype).max))
    bad = ~unverified & ~(res.abs() <= bound)            # a NaN residual fails
    k = (d[:, 1] / res).round().clamp(0, block + 1)
    fk = weight_of(k)
    located = bad & torch.isfinite(res) & (k >= 1) & (k <= block) \
        & ((d[:, 1] - k * res).abs() < 0.5 * res.abs()) & ((d[:, 2] - fk * res).abs() < 0.5 * res.abs())
    index = torch.where(located, k - 1, torch.full_like(k, -1.0)).to(torch.int64)
    # a non-finite result from finite inputs: the first non-finite element of the block
    for b in (bad & ~torch.isfinite(got[:, 0])).nonzero().flatten().tolist():
        seg = out.detach().reshape(-1)[b * block:(b + 1) * block]
        index[b] = int((~torch.isfinite(seg)).nonzero()[0])
    return bad, unverified, res, bound, index


def _op_kind(op):
    """"sum", "avg" or None (an op the checksums cannot follow: PREMUL_SUM, MAX, ...)."""
    for name in ("SUM", "AVG"):
        try:
            if op == getattr(dist.ReduceOp, name):
                return name.lower()
        except Exception:          # a PREMUL_SUM object does not compare with the enum
            pass
    return None


class CommCheck:
    """Checksummed gradient collectives (see the module's docstring).

    Args:
        model: optional module whose ``named_parameters`` name the alarms (or ``names``:
            {parameter: name}).
        block: elements per checksum block (more: less traffic, a looser bound, coarser
            location).
    """

    def __init__(self, model=None, *, names=None, block=1024):
        if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= 1 << 16:
            raise ValueError(f"abft.CommCheck: block must be a whole number in [1, 65536], "
                             f"got {block!r}")
        self.block = block
        named = dict(names or {})
        if model is not None:
            named.update({p: n for n, p in model.named_parameters()})
        self.names = {id(p): n for p, n in named.items()}
        self.calls = self.checked = self.unverified = 0     # collectives; blocks
        self.seconds = 0.0

    # -- the collective itself: a subclass may override it (the evaluation corrupts here) --

    def communicate(self, kind, out, inp, group, op):
        """Run the collective on the data: ``kind`` "all_reduce" (in place on ``out``) or
        "reduce_scatter" (``inp`` into ``out``)."""
        if kind == "all_reduce":
            dist.all_reduce(out, op=op, group=group)
        else:
            _reduce_scatter(out, inp, op=op, group=group)

    # -- public collectives --

    def all_reduce(self, tensor, group=None, op=dist.ReduceOp.SUM, *, spans=None):
        """All-reduce ``tensor`` in place with checksums; returns the alarms. ``spans``: list of
        (offset, numel, name, shape) naming the parameters laid out in ``tensor``."""
        kind, ranks = _op_kind(op), _size(group)
        if not ops.enabled():           # abft.config(enabled=False), the guard's unsampled steps
            self.communicate("all_reduce", tensor, None, group, op)
            return []
        if kind is None or tensor.dtype not in UNIT:
            self.communicate("all_reduce", tensor, None, group, op)
            return self._unchecked("all_reduce", tensor)
        t0 = time.perf_counter()
        sums = block_sums(tensor, self.block)
        self.seconds += time.perf_counter() - t0
        dist.all_reduce(sums, group=group)
        self.communicate("all_reduce", tensor, None, group, op)
        return self._verify("all_reduce", tensor, sums, ranks, kind == "avg", spans)

    def reduce_scatter(self, output, input, group=None, op=dist.ReduceOp.SUM, *, spans=None):
        """Reduce-scatter ``input`` (this rank's full buffer, ranks x output's size) into
        ``output`` with checksums; returns the alarms. ``spans`` name ``output``'s layout."""
        kind, ranks = _op_kind(op), _size(group)
        if not ops.enabled():
            self.communicate("reduce_scatter", output, input, group, op)
            return []
        if kind is None or output.dtype not in UNIT or input.numel() != ranks * output.numel():
            self.communicate("reduce_scatter", output, input, group, op)
            return self._unchecked("reduce_scatter", output)
        t0 = time.perf_counter()
        parts = torch.stack([block_sums(c, self.block) for c in input.reshape(ranks, -1)])
        self.seconds += time.perf_counter() - t0
        sums = torch.empty_like(parts[0])
        _reduce_scatter(sums.view(-1), parts.view(-1), group=group)
        self.communicate("reduce_scatter", output, input, group, op)
        return self._verify("reduce_scatter", output, sums, ranks, kind == "avg", spans)

    def all_reduce_grads(self, params, group=None, *, average=True):
        """All-reduce the gradients of ``params`` (those that have one) as one flat bucket, with
        checksums, and write the result back (averaged over the ranks unless ``average=False``);
        returns the alarms."""
        params = [p for p in params if p.grad is not None]
        if not params:
            return []
        flat = torch.cat([p.grad.detach().reshape(-1) for p in params])
        ranks = _size(group)
        if average and ranks > 1:
            flat.div_(ranks)
        found = self.all_reduce(flat, group, spans=self._spans(params))
        with torch.no_grad():
            off = 0
            for p in params:
                n = p.grad.numel()
                p.grad.copy_(flat[off:off + n].view_as(p.grad))
                off += n
        return found

    # -- DDP and FSDP2 --

    @staticmethod
    def ddp_hook(state, bucket):
        """A DDP communication hook (``ddp.register_comm_hook(check, CommCheck.ddp_hook)``):
        DDP's default average, with checksums."""
        group = getattr(state, "_group", None)
        buf = bucket.buffer()
        ranks = _size(group)
        buf.div_(ranks)
        state.all_reduce(buf, group, spans=state._spans(bucket.parameters()))
        fut = torch.futures.Future()
        fut.set_result(buf)
        return fut

    def attach(self, module, group=None):
        """Route ``module``'s gradient collectives through the checks: a DDP module gets the
        communication hook; every FSDP2 (``fully_shard``) module in the tree its reduce-scatter
        and, under HSDP, its all-reduce across replicas (through FSDP's all-reduce hook, which
        this replaces). Returns self."""
        from torch.nn.parallel import DistributedDataParallel
        if isinstance(module, DistributedDataParallel):
            self._group = group if group is not None else module.process_group
            if not self.names:
                self.names = {id(p): n for n, p in module.module.named_parameters()}
            module.register_comm_hook(self, CommCheck.ddp_hook)
            return self
        if not self.names:
            self.names = {id(p): n for n, p in module.named_parameters()}
        found = 0
        for m in module.modules():
            if hasattr(m, "set_custom_reduce_scatter") and hasattr(m, "_get_fsdp_state"):
                rs = _FSDPReduceScatter(self, m)
                m.set_custom_reduce_scatter(rs)
                if rs.hsdp() is not None:       # HSDP: the all-reduce across replicas too
                    m.set_all_reduce_hook(rs.after_all_reduce)
                found += 1
        if not found:
            raise ValueError("abft.CommCheck.attach: neither a DistributedDataParallel module "
                             "nor one with fully_shard submodules")
        return self

    # -- internals --

    def _spans(self, params):
        out, off = [], 0
        for p in params:
            out.append((off, p.numel(), self.names.get(id(p), f"param@{off}"), tuple(p.shape)))
            off += p.numel()
        return out

    def _unchecked(self, op, tensor):
        from abft.coverage import count
        self.calls += 1
        count(op, "gradients", "unverified")
        return []

    def _verify(self, op, out, sums, ranks, average, spans, extra=0):
        from abft.context import current
        from abft.coverage import count
        t0 = time.perf_counter()
        bad, unver, res, bound, index = compare(out, sums, ranks=ranks, average=average,
                                                block=self.block, extra=extra)
        nb = bad.numel()
        n_unver = int(unver.sum())
        self.calls += 1
        self.checked += nb - n_unver
        self.unverified += n_unver
        count(op, "gradients", "unverified" if n_unver else "checked")
        found = []
        blocks = bad.nonzero().flatten().tolist()
        sc = current()
        if blocks:
            res, bound, index = res.cpu(), bound.cpu(), index.cpu()
            for b in blocks[:MAX_ALARMS]:
                i = int(index[b])
                at = None if i < 0 else b * self.block + i
                found.append(self._alarm(op, sc, out, ranks, spans, b, at,
                                         float(res[b]), float(bound[b])))
            if len(blocks) > MAX_ALARMS:
                a = self._alarm(op, sc, out, ranks, spans, blocks[MAX_ALARMS], None,
                                float("nan"), 0.0)
                a.labels["blocks"] = len(blocks)
                found.append(a)
            policy.report(found, sc.log)
        self.seconds += time.perf_counter() - t0
        if found and policy.action() == "raised":
            from abft.alarms import SilentCorruptionError
            raise SilentCorruptionError(found[0])
        return found

    def _alarm(self, op, sc, out, ranks, spans, block, at, residual, bound):
        """A ``comm`` alarm for ``block`` of ``out``; ``at``: the located flat offset or None."""
        from abft.alarms import comm_alarm
        labels = sc.labels
        first = block * self.block
        name, shape, index = None, (out.numel(),), None
        for off, n, nm, shp in spans or ():
            if off <= (at if at is not None else first) < off + n:
                name, shape = nm, shp
                index = None if at is None else at - off
                break
        row = col = None
        if index is not None:
            row, col = divmod(index, shape[-1]) if len(shape) >= 2 else (0, index)
        return comm_alarm(
            op=op, module=name, scope=labels, shape=shape, dtype=out.dtype, block=self.block,
            index_block=block, call_id=self.calls - 1, row=row, col=col, residual=residual, bound=bound,
            action=policy.action(),
            labels={"index": index, "offset": at if at is not None else first, "ranks": ranks})


def _reduce_scatter(out, inp, **kw):
    """torch's single-tensor reduce-scatter (``reduce_scatter_tensor`` before 2.x renamed it)."""
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    rs(out, inp, **kw)


def _size(group):
    if group is not None:
        return group.size()
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class _FSDPReduceScatter:
    """FSDP2's reduce-scatter with checksums (``set_custom_reduce_scatter``) and, under HSDP,
    the all-reduce across replicas after it; the output's layout (each parameter's padded shard,
    in order) names the alarms."""

    def __init__(self, check, module):
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
        self.check, self.module = check, module
        self._default = DefaultReduceScatter()
        self.pending = None        # HSDP: the sums of the all-reduce about to run

    def allocate(self, size, *, dtype, device):
        return self._default.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        spans = self._spans(output_tensor.numel())
        self.check.reduce_scatter(output_tensor, input_tensor, group, op, spans=spans)
        self._before_all_reduce(output_tensor, group, spans)
        return None

    def hsdp(self):
        """The module's parameter group when it is HSDP (FSDP2 on a 2-D mesh: reduce-scatter
        within a replica, then all-reduce across replicas), else None."""
        try:
            groups = self.module._get_fsdp_state()._fsdp_param_groups
        except AttributeError:
            return None
        return groups[0] if len(groups) == 1 and getattr(groups[0], "_is_hsdp", False) else None

    def _before_all_reduce(self, out, group, spans):
        """HSDP: the block sums of the buffer FSDP is about to all-reduce across replicas (this
        reduce-scatter's result plus the partial one of earlier micro-batches), reduced beside
        it; ``after_all_reduce`` checks the result against them."""
        self.pending = None
        pg = self.hsdp()
        if pg is None or not pg.all_reduce_grads or not ops.enabled():
            return
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            _get_gradient_divide_factors)
        ar = pg._all_reduce_process_group
        op = _get_gradient_divide_factors(group, ar, out.dtype, out.device.type,
                                          pg.gradient_divide_factor,
                                          pg.force_sum_reduction_for_comms)[3]
        kind, partial = _op_kind(op), pg._partial_reduce_output
        if kind is None or out.dtype not in UNIT:
            self.pending = "unchecked"
            return
        t0 = time.perf_counter()
        sums = block_sums(out, self.check.block)
        if partial is not None:
            sums += block_sums(partial, self.check.block)
        self.check.seconds += time.perf_counter() - t0
        dist.all_reduce(sums, group=ar)
        self.pending = (sums, _size(ar), kind == "avg", int(partial is not None), spans)

    def after_all_reduce(self, out):
        """FSDP2's all-reduce hook: runs after HSDP's all-reduce, on its result."""
        pending, self.pending = self.pending, None
        if pending == "unchecked" or (pending is None and ops.enabled()):
            # an op the sums cannot follow, or no reduce-scatter before it (a shard group of
            # one rank: FSDP copies the gradients instead): counted, unverified
            self.check._unchecked("all_reduce", out)
        elif pending is not None:
            sums, ranks, average, extra, spans = pending
            self.check._verify("all_reduce", out, sums, ranks, average, spans, extra)

    def _spans(self, numel):
        """Where each parameter's gradient shard lies in the reduce-scatter's output of
        ``numel`` elements. FSDP reduces only the parameters that have a gradient: frozen ones
        (a LoRA base weight) are left out; when parameters that need one got none in this
        backward (unused), the sizes do not add up and alarms stay unnamed rather than wrong."""
        out, off = [], 0
        try:
            params = [fp for g in self.module._get_fsdp_state()._fsdp_param_groups
                      for fp in g.fsdp_params if fp.sharded_param.requires_grad]
        except AttributeError:       # another torch's internals: alarms stay unnamed
            return None
        for fp in params:
            n = math.prod(fp.padded_sharded_param_size)
            out.append((off, n, fp._param_fqn or self.check.names.get(id(fp.sharded_param)),
                        tuple(fp.padded_sharded_param_size)))
            off += n
        return out if off == numel else None
