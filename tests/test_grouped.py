"""Grouped products (``abft.grouped_mm``, ``torch._grouped_mm`` under ``checked()``): torch's
values, gradients equal to the groups' own products, every group checked on both backends, a
fault located to its group, and the op through torch.compile and DTensor."""
import json

import pytest
import torch
import torch.multiprocessing as mp

import abft
from abft.eval.replicas import free_port
from ranks import run_rank

OFFS = torch.tensor([3, 3, 8, 12], dtype=torch.int32)       # four groups, the second empty


def _forms(dtype=torch.float32, x=1):
    """(name, a, b, offs) of each form torch's grouped product takes, in four groups, every
    other size times ``x`` (torch takes strides of 16 bytes only)."""
    g = torch.Generator().manual_seed(7)
    r = lambda groups, *s: torch.randn(*groups, *(x * n for n in s), generator=g).to(dtype)  # noqa: E731
    G = (4,)
    return [("2d3d", r((), 12, 8), r(G, 8, 16), OFFS * x), ("2d2d", r((), 8, 12), r((), 12, 16), OFFS * x),
            ("3d2d", r(G, 8, 16), r((), 16, 12), OFFS * x), ("3d3d", r(G, 8, 16), r(G, 16, 8), None)]


def _groups(a, b, offs):
    """The groups' own products, as torch computes each: [(a part, b part)]."""
    if offs is None:
        return [(a[g], b[g]) for g in range(a.shape[0])]
    ends = offs.tolist()
    spans = list(enumerate(zip([0] + ends[:-1], ends)))
    if a.dim() == 2 and b.dim() == 3:
        return [(a[s:e], b[g]) for g, (s, e) in spans]
    if a.dim() == 2:
        return [(a[:, s:e], b[s:e]) for g, (s, e) in spans]
    return [(a[g], b[:, s:e]) for g, (s, e) in spans]


def _pieces(a, b, offs):
    """The groups' products, put together as the grouped product's output."""
    prods = [x @ y for x, y in _groups(a, b, offs)]
    if offs is None or a.dim() == 2 and b.dim() == 2:
        return torch.stack(prods)
    return torch.cat(prods, dim=0 if a.dim() == 2 else 1)


@pytest.mark.parametrize("form", range(4), ids=["2d3d", "2d2d", "3d2d", "3d3d"])
def test_each_form_is_torchs_product_with_the_groups_gradients_and_every_group_checked(form, backend):
    name, a, b, offs = _forms()[form]
    a, b = a.requires_grad_(), b.requires_grad_()
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    y = abft.grouped_mm(a, b, offs, module="experts")
    want = torch._grouped_mm(a.detach(), b.detach(), offs=offs)
    if backend == "reference":
        assert torch.equal(y, want)
    else:                                    # the kernel's own products, checked
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    (y * torch.arange(y.numel()).view(y.shape).sin()).sum().backward()
    (_pieces(a2, b2, offs) * torch.arange(y.numel()).view(y.shape).sin()).sum().backward()
    torch.testing.assert_close(a.grad, a2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.grad, b2.grad, rtol=1e-5, atol=1e-5)
    groups = len(_groups(a, b, offs))
    empty = 1 if offs is not None else 0     # the empty group: nothing to compute or check
    row = {r["op"]: r for r in abft.coverage()}["grouped_mm"]
    # forward and both gradients, each group but the empty one (whose inner dimension is
    # empty in 2d2d's forward: no product; in the others its gradient parts are empty too)
    assert row["checked"] == 3 * (groups - empty), row
    assert row["module"] == "experts" and not abft.alarms()


def test_bfloat16_and_half_groups_are_checked_clean(backend):
    for dtype in (torch.bfloat16, torch.float16):
        for name, a, b, offs in _forms(dtype, x=2):
            y = abft.grouped_mm(a, b, offs)
            assert y.dtype == dtype and y.shape == torch._grouped_mm(a, b, offs=offs).shape
    assert not abft.flush()
    # four forms of four groups (three where one is empty), two dtypes
    assert {r["op"]: r["checked"] for r in abft.coverage()} == {"grouped_mm": 2 * (3 + 3 + 3 + 4)}


def test_rows_no_group_covers_are_zeros_and_the_rest_torchs(backend):
    a, b = torch.randn(12, 8), torch.randn(2, 8, 8)
    offs = torch.tensor([4, 9], dtype=torch.int32)
    y = abft.grouped_mm(a, b, offs)
    assert torch.equal(y[9:], torch.zeros(3, 8))
    torch.testing.assert_close(y[:9], torch.cat([a[:4] @ b[0], a[4:9] @ b[1]]))


@pytest.mark.parametrize("phase", ["forward", "grad_a", "grad_b"])
def test_a_fault_in_one_group_alarms_that_group_at_its_own_row_and_column(phase, backend):
    a, b = torch.randn(12, 8, requires_grad=True), torch.randn(4, 8, 16, requires_grad=True)
    # the third group's product: rows 3..7 of a (forward, grad_a: its rows; grad_b: b's third
    # matrix, 8 x 16)
    inj = abft.inject(when=lambda c: c.op == "grouped_mm" and c.phase == phase
                      and c.labels["group"] == 2, kind="add", value=100.0, row=1, col=2)
    with inj:
        abft.grouped_mm(a, b, OFFS, module="moe").sum().backward()
    found = abft.flush()
    assert len(found) == 1, found
    al = found[0]
    assert (al.op, al.phase, al.module, al.labels["group"]) == ("grouped_mm", phase, "moe", 2)
    assert al.labels["group_start"] == 3 and (al.row, al.col) == (1, 2)


def test_the_correct_policy_repairs_the_group_in_the_output():
    a, b = torch.randn(12, 8), torch.randn(4, 8, 16)
    want = torch._grouped_mm(a, b, offs=OFFS)
    with abft.config(policy="correct"), \
            abft.inject(when=lambda c: c.labels.get("group") == 3, kind="add", value=1e4, row=0, col=5):
        y = abft.grouped_mm(a, b, OFFS)
    torch.testing.assert_close(y, want)
    assert [a.labels["group"] for a in abft.alarms()] == [3]


def test_checked_intercepts_torchs_grouped_product_and_leaves_a_bias_to_torch():
    a, b = torch.randn(12, 8), torch.randn(4, 8, 16)
    with abft.checked():
        y = torch._grouped_mm(a, b, offs=OFFS)
        for kw in (dict(input=a, mat2=b, offs=OFFS), dict(mat2=b, offs=OFFS)):   # torch's names
            args = () if "input" in kw else (a,)
            assert torch.equal(torch._grouped_mm(*args, **kw), y)
        with pytest.raises(RuntimeError, match="Bias not supported"):      # torch's own answer
            torch._grouped_mm(a, b, OFFS, bias=torch.randn(4, 16))
    assert torch.equal(y, torch._grouped_mm(a, b, offs=OFFS))
    rows = {r["op"]: r for r in abft.coverage()}
    assert rows["grouped_mm"]["checked"] == 3 * 3 and rows["grouped_mm"]["unprotected"] == 1


def test_the_grouped_op_compiles_as_one_node():
    a, b = torch.randn(12, 8, requires_grad=True), torch.randn(4, 8, 16, requires_grad=True)
    graphs = []

    def backend(gm, inputs):             # dynamo's graph, then aot_eager's compilation of it
        graphs.append(gm)
        from torch._dynamo.backends.debugging import aot_eager
        return aot_eager(gm, inputs)

    fn = torch.compile(lambda a, b: abft.grouped_mm(a, b, OFFS).square().sum(), fullgraph=True,
                       backend=backend)
    fn(a, b).backward()
    nodes = [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert len(graphs) == 1 and nodes.count(torch.ops.abft.grouped_mm) == 1, nodes
    want_a = a.grad.clone()
    a.grad = None
    abft.grouped_mm(a, b, OFFS).square().sum().backward()
    torch.testing.assert_close(a.grad, want_a)
    assert {r["op"]: r for r in abft.coverage()}["grouped_mm"]["checked"] == 2 * 3 * 3
    assert not abft.flush()


def test_off_and_under_torch_func_it_is_torchs_call():
    a, b = torch.randn(12, 8), torch.randn(4, 8, 16)
    with abft.config(enabled=False):
        assert torch.equal(abft.grouped_mm(a, b, OFFS), torch._grouped_mm(a, b, offs=OFFS))
    assert not abft.coverage()
    torch.func.grad(lambda a: abft.grouped_mm(a, b, OFFS).square().sum())(a)
    assert {r["op"]: r for r in abft.coverage()}["grouped_mm"]["unprotected"] == 1


def _sharded(rank):
    """Rank ``rank`` of 2: the grouped product of experts' weights sharded by output columns (a
    column-parallel layer) and by the inner dimension (row-parallel: a partial sum), against the
    plain product; then a fault on rank 1's shard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(12, 8, generator=g), torch.randn(4, 8, 16, generator=g)
    res = {}
    for name, (px, pw) in {"columns": (Replicate(), Shard(2)),
                           "inner": (Shard(1), Shard(1))}.items():
        dx = distribute_tensor(x, mesh, [px]).requires_grad_()
        dw = distribute_tensor(w, mesh, [pw]).requires_grad_()
        do = distribute_tensor(OFFS, mesh, [Replicate()])
        abft.reset()
        y = abft.grouped_mm(dx, dw, do, module=name)
        y.square().sum().backward()
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        yr = _pieces(xr, wr, OFFS)
        yr.square().sum().backward()
        res[name] = dict(out=torch.allclose(y.full_tensor(), yr, atol=1e-5),
                         grads=torch.allclose(dx.grad.full_tensor(), xr.grad, atol=1e-4)
                         and torch.allclose(dw.grad.full_tensor(), wr.grad, atol=1e-4),
                         placements=str(y.placements),
                         checked=sum(r["checked"] for r in abft.coverage()),
                         alarms=len(abft.flush()))
    abft.reset()
    dx = distribute_tensor(x, mesh, [Replicate()])
    dw = distribute_tensor(w, mesh, [Shard(2)])
    with abft.inject(when=lambda c: rank == 1 and c.labels.get("group") == 0, kind="add",
                     value=100.0, row=0, col=1):
        abft.grouped_mm(dx, dw, distribute_tensor(OFFS, mesh, [Replicate()]))
    res["fault"] = [[a.rank, a.labels["group"], a.labels["shard"]["offset"]] for a in abft.flush()]
    return res


def test_dtensor_experts_sharded_by_columns_and_inner_dimension_are_checked_per_rank(tmp_path):
    mp.spawn(run_rank, args=(2, free_port(), str(tmp_path / "{rank}.json"), _sharded), nprocs=2, join=True)
    for rank in range(2):
        res = json.load(open(tmp_path / f"{rank}.json"))
        assert res["columns"] == dict(out=True, grads=True, placements="(Shard(dim=1),)", checked=9, alarms=0)
        assert res["inner"] == dict(out=True, grads=True, placements="(Partial(sum),)", checked=9, alarms=0)
        # rank 1 holds columns 8..15 of every group's output
        assert res["fault"] == ([[1, 0, [0, 8]]] if rank == 1 else [])


def test_atens_grouped_product_called_directly_is_counted_unprotected():
    a, b = torch.randn(12, 8), torch.randn(4, 8, 16)
    with abft.checked():
        torch.ops.aten._grouped_mm(a, b, OFFS)
    assert [(r["op"], r["unprotected"]) for r in abft.coverage()] == [("aten._grouped_mm", 1)]


def test_autocast_leaves_the_grouped_product_alone_as_it_does_torchs():
    a, b = torch.randn(12, 8), torch.randn(4, 8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, want = abft.grouped_mm(a, b, OFFS), torch._grouped_mm(a, b, offs=OFFS)
    assert y.dtype == want.dtype == torch.float32 and torch.equal(y, want)


def test_a_mixtral_with_grouped_experts_trains_bit_for_bit_under_checked_and_a_fault_is_located():
    """transformers' Mixtral (from a config) with ``experts_implementation="grouped_mm"``:
    its experts call ``F.grouped_mm`` (torch._grouped_mm); three AdamW steps with clipping under
    ``abft.checked(model)`` equal the plain run's, every expert's product checked."""
    import copy
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="grouped_mm")
    ref, x = copy.deepcopy(model), torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))

    def train(m, checked):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        for _ in range(3):
            with abft.checked(m) if checked else torch.enable_grad():
                m(x, labels=x).loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            opt.zero_grad()

    train(ref, False)
    train(model, True)
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), model.parameters()))
    rows = {r["module"]: r["checked"] for r in abft.coverage() if r["op"] == "grouped_mm"}
    # 3 steps x 2 grouped products (up, down) x (forward + 2 gradients) x 4 experts
    assert rows == {"model.layers.0.mlp.experts": 72, "model.layers.1.mlp.experts": 72}
    assert not abft.flush()
    with abft.inject(when=lambda c: c.module == "model.layers.1.mlp.experts" and c.phase == "grad_b"
                     and c.labels["group"] == 2, kind="add", value=10.0, row=3, col=1):
        with abft.checked(model):
            model(x, labels=x).loss.backward()
    assert [(a.module, a.phase, a.labels["group"], a.row, a.col) for a in abft.flush()] == \
        [("model.layers.1.mlp.experts", "grad_b", 2, 3, 1)]


def test_every_group_is_sampled_on_the_same_calls():
    """With sample_every=2 each group keeps its own count: every other call checks all of them
    (one count for the call site would check groups 0 and 2 on every call, 1 and 3 never)."""
    a, b, offs = torch.randn(12, 8), torch.randn(4, 8, 16), torch.tensor([3, 5, 8, 12], dtype=torch.int32)
    with abft.config(sample_every=2), abft.inject(when=lambda c: c.labels["group"] == 3, kind="add",
                                                  value=100.0, row=0, col=0, times=None):
        for _ in range(4):
            abft.grouped_mm(a, b, offs)
    row = {r["op"]: r for r in abft.coverage()}["grouped_mm"]
    assert (row["checked"], row["sampled_out"]) == (2 * 4, 2 * 4)
    assert [al.labels["group"] for al in abft.flush()] == [3, 3]


@pytest.mark.parametrize("offs, error, match", [
    (torch.tensor([5, 3, 8, 12], dtype=torch.int32), ValueError, r"offs: the groups' ends, non-decreasing"),
    (torch.tensor([3, 3, 8, 12]), RuntimeError, "Offsets have to be int32"),
    (torch.tensor([[3, 3, 8, 12]], dtype=torch.int32), RuntimeError, "offs has to be 1D")])
def test_bad_offs_are_refused_before_anything_is_checked(offs, error, match, backend):
    a, b = torch.randn(12, 8), torch.randn(4, 8, 16)
    with pytest.raises(error, match=match):
        abft.grouped_mm(a, b, offs)
    assert not abft.coverage() and not abft.flush()


def test_output_check_names_the_grouped_products_module_forward_and_backward():
    a, b = torch.randn(12, 8, requires_grad=True), torch.randn(4, 8, 16, requires_grad=True)
    with abft.OutputCheck() as chk:
        y = abft.grouped_mm(a, b, OFFS, module="experts")
        y.data.view(-1).view(torch.int32)[5] ^= 1 << 28          # a flip after its check
        y.sum().backward()
        del y
    found = [(al.kind, al.module, al.phase) for al in abft.flush()]
    assert found == [("carry", "experts", "forward")], found
    assert chk.recorded == 3              # the output and both gradients
