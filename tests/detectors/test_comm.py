"""abft.CommCheck: checksums carried through gradient collectives (all-reduce, reduce-scatter).

The bound is tested against simulated reductions (every rank count, dtype and summation order a
collective may use) for false alarms; the collectives themselves with a one-rank gloo group here
and with 2 gloo ranks spawned from pytest (DDP's hook, FSDP2's reduce-scatter, a corrupted
bucket on one rank)."""
import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import abft
from abft.detectors.comm import CommCheck, block_sums, compare
from abft.eval.replicas import free_port
from ranks import run_rank


def _flip(t, index, bit):
    """Flip ``bit`` of element ``index`` of a float32 tensor in place."""
    v = t.view(-1).view(torch.int32)
    v[index] ^= (1 << bit) if bit < 31 else -(1 << 31)


def _values(g, n, kind, dtype):
    x = torch.randn(n, generator=g, dtype=torch.float64)
    if kind == "heavy":
        e = 6 if dtype == torch.float16 else 30             # magnitudes 2^-e .. 2^e, finite
        x = x * torch.exp2(torch.randint(-e, e, (n,), generator=g).double())
    elif kind == "cancel":                  # ranks nearly cancel: the sum is round-off
        x = x * 1e3
    elif kind == "tiny":                    # near and below the smallest normal
        x = x * torch.finfo(dtype).tiny * 4
    return x.to(dtype)


def _reduce(xs, order, dtype, average):
    """A collective's result: the ranks' values added one at a time in ``dtype`` in the given
    rank order (per element, as ring and tree algorithms do), then averaged."""
    acc = xs[order[0]].clone()
    for r in order[1:]:
        acc = acc + xs[r]
    return acc / len(xs) if average else acc


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("kind", ["normal", "heavy", "cancel", "tiny"])
def test_no_false_alarm_for_any_rank_count_and_summation_order(dtype, kind):
    g = torch.Generator().manual_seed(hash((str(dtype), kind)) % 2 ** 31)
    block = 64
    for ranks in (1, 2, 3, 8, 16):
        xs = [_values(g, 1000, kind, dtype) for _ in range(ranks)]
        if kind == "cancel" and ranks > 1:
            xs[-1] = (-sum(x.double() for x in xs[:-1]) + xs[-1].double() * 1e-6).to(dtype)
        sums = sum(block_sums(x, block) for x in xs)
        for average in (False, True):
            for _ in range(3):
                order = torch.randperm(ranks, generator=g).tolist()
                out = _reduce(xs, order, dtype, average)
                bad, unver, res, bound, _ = compare(out, sums, ranks=ranks, average=average,
                                                    block=block)
                assert not bool(bad.any()), (ranks, average, (res.abs() / bound).max())
                assert not bool(unver.any())


def test_a_change_above_the_bound_is_detected_and_located():
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(5000, generator=g) for _ in range(4)]
    sums = sum(block_sums(x, 256) for x in xs)
    out = _reduce(xs, [0, 1, 2, 3], torch.float32, False)
    _flip(out, 1234, 29)                     # an exponent bit: a large change
    bad, _, _, _, index = compare(out, sums, ranks=4, average=False, block=256)
    assert bad.nonzero().flatten().tolist() == [1234 // 256]
    assert int(index[1234 // 256]) == 1234 % 256
    out = _reduce(xs, [0, 1, 2, 3], torch.float32, False)
    out[77] = float("nan")                   # a non-finite result from finite inputs
    bad, _, _, _, index = compare(out, sums, ranks=4, average=False, block=256)
    assert bad.nonzero().flatten().tolist() == [0] and int(index[0]) == 77


def test_non_finite_inputs_are_unverified_not_alarmed():
    x = torch.randn(600)
    x[5] = float("inf")                      # a GradScaler overflow step
    sums = block_sums(x, 256)
    bad, unver, *_ = compare(x.clone(), sums, ranks=1, average=False, block=256)
    assert not bool(bad.any()) and unver.tolist() == [True, False, False]


def _pg():
    return dist.ProcessGroupGloo(dist.HashStore(), 0, 1)


class _Corrupting(CommCheck):
    """A collective whose result comes back with one bit flipped on this rank."""

    def __init__(self, *args, at=None, bit=29, **kw):
        super().__init__(*args, **kw)
        self.at, self.bit = at, bit

    def communicate(self, kind, out, inp, group, op):
        super().communicate(kind, out, inp, group, op)
        if self.at is not None:
            _flip(out, self.at, self.bit)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_all_reduce_grads_names_the_parameter_and_element():
    m = _model()
    m(torch.randn(5, 8)).square().sum().backward()
    before = [p.grad.clone() for p in m.parameters()]
    # layout: 0.weight (16, 8) at 0, 0.bias (16) at 128, 2.weight (4, 16) at 144
    check = _Corrupting(m, at=144 + 2 * 16 + 7, bit=27, block=64)
    with abft.scope(step=3):
        found = check.all_reduce_grads(m.parameters(), _pg())
    assert len(found) == 1, found
    a = found[0]
    assert (a.kind, a.op, a.module, a.row, a.col, a.step) == ("comm", "all_reduce", "2.weight", 2, 7, 3)
    assert a.labels["index"] == 2 * 16 + 7 and a.labels["offset"] == 144 + 39
    assert abs(a.residual) > a.threshold > 0
    assert a in abft.flush()                 # reported: the guard sees it
    after = [p.grad for p in m.parameters()]
    assert torch.equal(after[0], before[0]) and not torch.equal(after[2], before[2])


def test_a_low_mantissa_bit_is_detected_on_one_rank():
    """One rank: only float64's round-off is left, so the last mantissa bit of a float32
    gradient of ordinary size alarms (located or not)."""
    m = _model()
    m(torch.randn(5, 8)).square().sum().backward()
    check = _Corrupting(m, at=50, bit=0, block=64)
    found = check.all_reduce_grads(m.parameters(), _pg())
    abft.flush()
    assert [a.module for a in found] == ["0.weight"]


def test_clean_collectives_do_not_alarm_and_are_counted():
    m = _model()
    check = CommCheck(m, block=64)
    for _ in range(5):
        m.zero_grad()
        m(torch.randn(5, 8) * 1e3).square().sum().backward()
        assert check.all_reduce_grads(m.parameters(), _pg()) == []
    # 212 elements: 4 blocks of 64 per call
    assert check.calls == 5 and check.checked == 5 * 4 and check.unverified == 0
    rows = [r for r in abft.coverage() if r["op"] == "all_reduce"]
    assert rows and rows[0]["checked"] >= 5


def test_raise_policy_raises():
    m = _model()
    m(torch.randn(5, 8)).square().sum().backward()
    with abft.config(policy="raise"), pytest.raises(abft.SilentCorruptionError):
        _Corrupting(m, at=3).all_reduce_grads(m.parameters(), _pg())
    abft.flush()


def test_bad_block_is_one_line_naming_it():
    with pytest.raises(ValueError, match="block"):
        CommCheck(block=0)
    with pytest.raises(ValueError, match="attach"):
        CommCheck().attach(_model())


# -- 2 gloo ranks: DDP's hook and FSDP2's reduce-scatter ------------------------------------------

def _train(model, steps=3):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(10 + dist.get_rank())
    for s in range(steps):
        with abft.scope(step=s):
            opt.zero_grad()
            model(torch.randn(6, 8, generator=g)).square().mean().backward()
            opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _backward(model):
    g = torch.Generator().manual_seed(10 + dist.get_rank())
    with abft.scope(step=0):
        model(torch.randn(6, 8, generator=g)).square().mean().backward()
    return {n: _local(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None}


def _differs(grads, clean):
    """[name, row, col] of every element that differs from the clean gradients."""
    out = []
    for n, g in grads.items():
        for idx in (g != clean[n]).nonzero().tolist():
            out.append([n.replace("module.", ""), *(idx if len(idx) == 2 else [0, idx[0]])])
    return out


def _ddp(rank):
    from torch.nn.parallel import DistributedDataParallel as DDP
    plain = _train(DDP(_model()))
    checked_model = DDP(_model())
    check = CommCheck(block=64).attach(checked_model)
    checked = _train(checked_model)
    clean = abft.flush()
    reference = _backward(DDP(_model()))
    # rank 1's result of the first bucket comes back with an exponent bit flipped
    bad = DDP(_model())
    _Corrupting(block=64, at=5 if rank == 1 else None).attach(bad)
    grads = _backward(bad)
    found = abft.flush()
    return dict(equal=all(torch.equal(a, b) for a, b in zip(plain, checked)),
                clean=[str(a) for a in clean], calls=check.calls, checked=check.checked,
                found=[[a.rank, a.op, a.module, a.row, a.col, a.step] for a in found],
                differs=_differs(grads, reference))


def _fsdp(rank):
    from torch.distributed.fsdp import fully_shard

    def make():
        m = _model()
        for layer in (m[0], m[2]):
            fully_shard(layer)
        return fully_shard(m)
    plain = _train(make())
    checked_model = make()
    check = CommCheck(block=16).attach(checked_model)
    checked = _train(checked_model)
    clean = abft.flush()
    reference = _backward(make())
    bad = make()
    _Corrupting(block=16, at=3 if rank == 0 else None).attach(bad)
    grads = _backward(bad)
    found = abft.flush()
    # the first layer's weight frozen (a LoRA base weight): FSDP reduces its bias alone
    frozen = []
    for at in (None, 3 if rank == 0 else None):
        torch.manual_seed(0)
        m = _model()
        m[0].weight.requires_grad_(False)
        for layer in (m[0], m[2]):
            fully_shard(layer)
        _Corrupting(block=16, at=at).attach(fully_shard(m))
        frozen.append(_backward(m))
    frozen_found = abft.flush()
    return dict(equal=all(torch.equal(_local(a), _local(b)) for a, b in zip(plain, checked)),
                clean=[str(a) for a in clean], calls=check.calls, checked=check.checked,
                found=[[a.rank, a.op, a.module, a.row, a.col, a.step] for a in found],
                differs=_differs(grads, reference),
                frozen_found=[[a.module, a.row, a.col] for a in frozen_found],
                frozen_differs=_differs(frozen[1], frozen[0]))


class _Once(_Corrupting):
    """Corrupts the first collective only: a transient fault."""

    def communicate(self, kind, out, inp, group, op):
        super().communicate(kind, out, inp, group, op)
        self.at = None


def _guarded(rank):
    """StepGuard over DDP with the hook: a bucket corrupted once on rank 1 is found on rank 1,
    both ranks rerun the step, and the model ends equal to a clean run's."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    out = []
    for at in (None, 7 if rank == 1 else None):
        model = DDP(_model())
        _Once(block=64, at=at).attach(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        guard = abft.StepGuard(opt, decision="rerun")
        g = torch.Generator().manual_seed(10 + rank)
        for _ in range(2):
            x = torch.randn(6, 8, generator=g)
            guard.step(lambda: model(x).square().mean().backward())
        out.append(([p.detach().clone() for p in model.parameters()],
                    [[r["decision"], r["persistence"]] for r in guard.records]))
    (clean, _), (params, records) = out
    return dict(equal=all(torch.equal(a, b) for a, b in zip(clean, params)), records=records)


def _comm(rank):
    return {"ddp": _ddp(rank), "fsdp": _fsdp(rank), "guard": _guarded(rank)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("comm")
    mp.spawn(run_rank, args=(2, free_port(), str(out / "comm-{rank}.json"), _comm), nprocs=2, join=True)
    return [json.load(open(out / f"comm-{r}.json")) for r in range(2)]


# -- 4 gloo ranks: FSDP2's HSDP (reduce-scatter in a replica, all-reduce across replicas) -------

class _FlipAllReduce:
    """torch.distributed as FSDP's collectives see it, with their float32 all-reduce (HSDP's
    across replicas) coming back with element ``at`` flipped on this rank."""

    def __init__(self, at):
        self.at = at

    def __getattr__(self, name):
        return getattr(dist, name)

    def all_reduce(self, tensor, *args, **kw):
        work = dist.all_reduce(tensor, *args, **kw)
        if tensor.dtype == torch.float32 and self.at is not None:
            _flip(tensor, self.at, 29)
        return work


def _hsdp(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import _fully_shard, fully_shard
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def make():
        m = _model()
        for layer in (m[0], m[2]):
            fully_shard(layer, mesh=mesh)
        return fully_shard(m, mesh=mesh)
    plain = _train(make())
    checked_model = make()
    check = CommCheck(block=16).attach(checked_model)
    checked = _train(checked_model)
    clean = abft.flush()
    cov = {r["op"]: r["checked"] for r in abft.coverage() if r["module"] == "gradients"}
    # two micro-batches, the first without the all-reduce (HSDP's gradient accumulation): the
    # second all-reduces its reduce-scatter plus the first's partial sum
    acc = make()
    acc_check = CommCheck(block=16).attach(acc)
    g = torch.Generator().manual_seed(20 + rank)
    for micro in range(2):
        acc.set_requires_all_reduce(micro == 1)
        with abft.scope(step=micro):
            acc(torch.randn(6, 8, generator=g)).square().mean().backward()
    accumulated = abft.flush()
    reference = _backward(make())
    bad = make()
    CommCheck(block=16).attach(bad)
    real = _fully_shard._fsdp_collectives.dist
    _fully_shard._fsdp_collectives.dist = _FlipAllReduce(3 if rank == 3 else None)
    try:
        grads = _backward(bad)
    finally:
        _fully_shard._fsdp_collectives.dist = real
    found = abft.flush()
    # replicas of one rank each (a (4, 1) mesh): FSDP copies instead of reduce-scattering, so the
    # all-reduce has no sums beside it: counted as unverified, never passed as checked
    abft.reset()
    flat = init_device_mesh("cpu", (4, 1), mesh_dim_names=("replicate", "shard"))
    one = _model()
    for layer in (one[0], one[2]):
        fully_shard(layer, mesh=flat)
    one_check = CommCheck(block=16).attach(fully_shard(one, mesh=flat))
    _backward(one)
    one_cov = {r["op"]: r["unverified"] for r in abft.coverage() if r["module"] == "gradients"}
    return dict(equal=all(torch.equal(_local(a), _local(b)) for a, b in zip(plain, checked)),
                one=[one_check.calls, one_check.checked, one_cov],
                clean=[str(a) for a in clean], calls=check.calls, checked=check.checked, cov=cov,
                accumulated=[str(a) for a in accumulated],
                acc=[acc_check.calls, acc_check.checked, acc_check.unverified],
                found=[[a.rank, a.op, a.module, a.row, a.col, a.step] for a in found],
                differs=_differs(grads, reference))


def test_hsdp_all_reduce_across_replicas_is_checked_and_locates_a_corrupted_element(tmp_path):
    mp.spawn(run_rank, args=(4, free_port(), str(tmp_path / "hsdp-{rank}.json"), _hsdp), nprocs=4, join=True)
    for rank in range(4):
        d = json.load(open(tmp_path / f"hsdp-{rank}.json"))
        assert d["equal"] and d["clean"] == [] and d["accumulated"] == [], d
        # accumulation: 2 micro-batches x 2 layers reduce-scatters, one all-reduce per layer
        assert d["acc"] == [2 * 2 + 2, 3 * 8, 0], d
        # per step and fully_shard layer one reduce-scatter and one all-reduce, each checked
        assert d["calls"] == 3 * 2 * 2 and d["checked"] == 2 * 3 * 8, d
        assert d["cov"] == {"reduce_scatter": 6, "all_reduce": 6}, d
        assert d["one"] == [2, 0, {"all_reduce": 2}], d
        if rank != 3:
            assert d["found"] == [] and d["differs"] == [], d
            continue
        # each layer's all-reduce came back with element 3 of rank 3's shard flipped
        assert len(d["differs"]) == 2, d
        assert sorted(d["found"]) == sorted([3, "all_reduce", *x, 0] for x in d["differs"]), d


def test_ddp_hook_is_exact_checked_and_locates_a_corrupted_bucket(two_ranks):
    for rank, res in enumerate(two_ranks):
        d = res["ddp"]
        assert d["equal"] and d["clean"] == [], d
        assert d["calls"] == 3 and d["checked"] == 3 * 4, d       # one bucket of 212 per step
        if rank == 0:
            assert d["found"] == [] and d["differs"] == [], d
            continue
        # the alarm names the one element whose reduced gradient differs
        assert len(d["differs"]) == 1, d
        assert d["found"] == [[1, "all_reduce", *d["differs"][0], 0]], d


def test_fsdp_reduce_scatter_is_exact_checked_and_locates_a_corrupted_shard(two_ranks):
    for rank, res in enumerate(two_ranks):
        d = res["fsdp"]
        assert d["equal"] and d["clean"] == [], d
        # per step one reduce-scatter per fully_shard layer (the root holds no parameters): shards
        # of 72 and 34 elements, 5 and 3 blocks of 16
        assert d["calls"] == 3 * 2 and d["checked"] == 3 * 8, d
        if rank == 1:
            assert d["found"] == [] and d["differs"] == [], d
            continue
        # each layer's reduce-scatter came back with element 3 of rank 0's shard flipped: the
        # alarms name the elements that differ (row and column in the local shard)
        assert len(d["differs"]) == 2, d
        assert sorted(d["found"]) == sorted([0, "reduce_scatter", *x, 0] for x in d["differs"]), d
        # with a frozen weight the alarms still name the parameter and element that changed
        # (they named the frozen weight before: its span was counted in the output)
        assert len(d["frozen_differs"]) == 2 and "0.bias" in str(d["frozen_differs"]), d
        assert sorted(d["frozen_found"]) == sorted(d["frozen_differs"]), d


def test_guard_reruns_a_step_whose_bucket_was_corrupted_on_one_rank(two_ranks):
    for res in two_ranks:
        g = res["guard"]
        assert g["records"] == [["rerun", "transient"], ["none", None]], g
        assert g["equal"], g


def test_disabled_abft_passes_the_collective_through_unchecked():
    """abft.config(enabled=False) (the guard's unsampled steps): the collective runs, no checksum
    is taken, nothing is counted or reported."""
    m = _model()
    m(torch.randn(5, 8)).square().sum().backward()
    check = _Corrupting(m, at=3)
    with abft.config(enabled=False):
        assert check.all_reduce_grads(m.parameters(), _pg()) == []
    assert check.calls == 0 and abft.flush() == []
