"""abft's ops on DTensor: tensor and sequence parallelism with 2 gloo ranks on the CPU.

Each scenario builds the same model twice, parallelizes both with one plan, protects one, and
compares: outputs, gradients and losses must equal the unprotected parallel model's bit for bit,
every product must be checked on every rank, and a fault on one rank must alarm there only.
"""
import contextlib
import functools
import json
import os

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

import abft
from abft.eval.replicas import free_port
from ranks import run_rank
from paths import ROOT  # noqa: E402


def _mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(16), nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.down(torch.relu(self.up(self.norm(x))))


def _pair(make, mesh, plan):
    """Two copies of one model, both parallelized by ``plan``; the second is protected."""
    from torch.distributed.tensor.parallel import parallelize_module
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(parallelize_module(make(), mesh, plan))
    abft.protect(models[1])
    return models


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _same(a, b):
    return all(torch.equal(_local(x), _local(y)) for x, y in zip(a, b))


def _grads(m):
    return [p.grad for p in m.parameters()]


def _alarms():
    return [[a.rank, a.module, a.phase] for a in abft.flush()]


def _checked(m):
    """Checked calls per module on this rank, from abft.coverage()."""
    return {r["module"]: r["checked"] for r in abft.coverage() if r["checked"]}


def _run(ref, m, x):
    """One forward and backward of each: ``ref`` plain, ``m`` under ``abft.checked``."""
    out = []
    for model in (ref, m):
        with abft.checked(model) if model is m else contextlib.nullcontext():
            y = model(x)
            y.square().sum().backward()
        out.append(y)
    return out


def _tp_mlp(rank, mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    ref, m = _pair(_mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1))
    abft.reset()
    y_ref, y = _run(ref, m, x)
    res = dict(out=_same([y_ref], [y]), grads=_same(_grads(ref), _grads(m)), checked=_checked(m),
               alarms=_alarms())
    # faults on rank 1: the column-parallel layer's forward at (batch 1, row 2, col 3) (its
    # (4, 8) leading dimensions fold into 32 rows), the row-parallel layer's grad_weight at
    # (row 4, col 5), each in rank 1's own shard
    injs = [abft.inject(when=lambda c: c.module == "0" and c.phase == "forward", kind="add",
                        value=50.0, row=8 + 2, col=3),
            abft.inject(when=lambda c: c.module == "2" and c.phase == "grad_weight", kind="add",
                        value=50.0, row=4, col=5)] if rank == 1 else []
    for inj in injs:
        inj.start()
    _run(ref, m, x)
    for inj in injs:
        inj.stop()
    found = abft.flush()
    res["fault_alarms"] = [[a.rank, a.module, a.phase] for a in found]
    res["fault_where"] = [[a.global_index(), a.labels["shard"], a.where()] for a in found]
    return res


def _SP_PLAN():
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel)
    return {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1))}


def _sp_block(rank, mesh):
    ref, m = _pair(_Block, mesh, _SP_PLAN())
    x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(2))
    mine = x[:, 4 * rank:4 * rank + 4]                    # this rank's part of the sequence
    abft.reset()
    y_ref, y = _run(ref, m, mine)
    return dict(out=_same([y_ref], [y]), shape=list(_local(y).shape),
                grads=_same(_grads(ref), _grads(m)), checked=_checked(m), alarms=_alarms())


class _PrepBlock(nn.Module):
    """A sequence-parallel norm, then an MLP whose input ``PrepareModuleInput`` gathers."""

    def __init__(self):
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(16), _mlp()

    def forward(self, x):
        return self.mlp(self.norm(x))


def _prepare_input(rank, mesh):
    """``PrepareModuleInput`` (sequence shards gathered to a replicated input) before a column-
    and row-parallel pair whose output goes back to sequence shards."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel)
    plan = {"norm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel(output_layouts=Shard(1))}
    ref, m = _pair(_PrepBlock, mesh, plan)
    x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(5))
    mine = x[:, 4 * rank:4 * rank + 4]
    abft.reset()
    y_ref, y = _run(ref, m, mine)
    return dict(out=_same([y_ref], [y]), shape=list(_local(y).shape),
                grads=_same(_grads(ref), _grads(m)), checked=_checked(m), alarms=_alarms(),
                unverified=sum(r["unverified"] + r["unprotected"] for r in abft.coverage()))


def _fsdp_protect(rank, mesh):
    """Protected, then FSDP2 (1-D), trained 3 steps with AdamW: the unsharded weights the
    forward reads are refilled each step without a version bump, so kept checksums must not
    outlive an optimizer step."""
    from torch.distributed.fsdp import fully_shard
    models = []
    for protected in (False, True):
        torch.manual_seed(0)
        m = _mlp()
        if protected:
            abft.protect(m)
        for layer in (m[0], m[2]):
            fully_shard(layer, mesh=mesh)
        models.append(fully_shard(m, mesh=mesh))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    g = torch.Generator().manual_seed(6 + rank)
    abft.reset()
    for step in range(3):
        x = torch.randn(4, 16, generator=g)
        for m, opt in zip(models, opts):
            with abft.scope(step=step):
                m(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
    # another checkpoint loaded (each value 1.5 times): FSDP2 writes the shards, the unsharded
    # weights keep their versions; the checksums kept from the old weights must go
    for m in models:
        with torch.no_grad(), abft.scope(step=3):
            m(x)                                        # an evaluation: checksums kept
        m.load_state_dict({k: v.detach() * 1.5 for k, v in m.state_dict().items()})
        with abft.scope(step=3):
            m(x).square().sum().backward()
    return dict(params=_same(list(models[0].parameters()), list(models[1].parameters())),
                checked=_checked(models[1]), alarms=_alarms())


def _fsdp_rest(rank, mesh, decision="rerun"):
    """StepGuard(rest=True) under FSDP2: a bit flipped at rest in rank 1's shard of a weight
    after the step's forward took its checksums from it; the guard writes the sealed bits back
    and reruns: the rerun is clean (a transient fault), not an alarm against stale checksums."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    m = _mlp()
    abft.protect(m)
    for layer in (m[0], m[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    guard = abft.StepGuard(opt, decision=decision, rest=True,
                           names={p: n for n, p in m.named_parameters()})
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(6 + rank))

    def closure():
        loss = m(x).square().sum()
        if flip[0] and rank == 1:       # after the forward: its checksums saw the clean weight
            flip[0] = False
            w = m[2].weight.to_local()
            w.data.view(torch.int32)[1, 2] ^= 1 << 28
        loss.backward()
        return loss
    flip = [False]
    out = []
    try:
        for step in range(3):
            flip[0] = step == 1
            guard.step(closure)
        out = [[r["step"], r["decision"], r["persistence"]] for r in guard.records if r["alarms"]
               or any(r["alarm_counts"])]
    except abft.GuardHalt as e:
        out = ["halt", str(e)[:200]]
    return dict(records=out)


def _fsdp_rest_skip(rank, mesh):
    """The same with ``skip``: no optimizer step after the repair, so nothing else drops the
    checksums rank 0 kept from the flipped weight before the next step."""
    return _fsdp_rest(rank, mesh, decision="skip")


def _ops(rank, mesh):
    """Each checked op on DTensor operands under batch, row, column and inner-dim sharding."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    g = torch.Generator().manual_seed(3)

    def dt(shape, placement):
        t = torch.randn(*shape, generator=g)
        return distribute_tensor(t, mesh, [placement]).requires_grad_()

    cases = {
        "matmul heads": (torch.matmul, abft.matmul, [((2, 4, 8, 6), Shard(1)), ((2, 4, 6, 8), Shard(1))]),
        "matmul rows": (torch.matmul, abft.matmul, [((2, 8, 6), Shard(1)), ((6, 5), Replicate())]),
        "mm inner": (torch.mm, abft.mm, [((8, 6), Shard(1)), ((6, 5), Shard(0))]),
        "mm columns": (torch.mm, abft.mm, [((8, 6), Replicate()), ((6, 4), Shard(1))]),
        "bmm batch": (torch.bmm, abft.bmm, [((4, 8, 6), Shard(0)), ((4, 6, 5), Shard(0))]),
        "addmm rows": (torch.addmm, abft.addmm,
                       [((8, 5), Shard(0)), ((8, 6), Shard(0)), ((6, 5), Replicate())]),
        "addmm inner": (torch.addmm, abft.addmm,
                        [((5,), Replicate()), ((8, 6), Shard(1)), ((6, 5), Shard(0))]),
        "baddbmm batch": (torch.baddbmm, abft.baddbmm,
                          [((4, 1, 5), Replicate()), ((4, 8, 6), Shard(0)), ((4, 6, 5), Shard(0))]),
    }
    res = {}
    for name, (theirs, ours, specs) in cases.items():
        args = [dt(s, p) for s, p in specs]
        twin = [a.detach().clone().requires_grad_() for a in args]
        abft.reset()
        y, y_ref = ours(*args, module=name), theirs(*twin)
        y.square().sum().backward()
        y_ref.square().sum().backward()
        res[name] = dict(out=torch.equal(y.full_tensor(), y_ref.full_tensor()),
                         placements=str(y.placements),
                         grads=all(torch.equal(a.grad.full_tensor(), b.grad.full_tensor())
                                   for a, b in zip(args, twin)),
                         checked=sum(r["checked"] for r in abft.coverage()),
                         unchecked=sum(r["unverified"] + r["unprotected"] for r in abft.coverage()))
    res["alarms"] = _alarms()
    return res


def _llama(rank, mesh):
    """A transformers Llama with the usual TP plan, trained 3 steps with AdamW (no clipping:
    torch's clip_grad_norm_ refuses the mix of DTensor and plain parameters a TP-only plan
    leaves, protected or not)."""
    import transformers
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   attn_implementation="eager")
    plan = {}
    for i in range(cfg.num_hidden_layers):
        for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                  "mlp.up_proj"):
            plan[f"model.layers.{i}.{p}"] = ColwiseParallel()
        for p in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{p}"] = RowwiseParallel()
    ref, m = _pair(lambda: transformers.LlamaForCausalLM(cfg), mesh, plan)
    opts = [torch.optim.AdamW(x.parameters(), lr=1e-2) for x in (ref, m)]
    g = torch.Generator().manual_seed(4)
    losses, checked = [[], []], None
    abft.reset()
    for step in range(3):
        ids = torch.randint(0, 64, (2, 16), generator=g)
        for i, (model, opt) in enumerate(zip((ref, m), opts)):
            with abft.checked(model) if model is m else contextlib.nullcontext():
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses[i].append(loss.item())
        if step == 0:
            checked = _checked(m)
    return dict(losses=losses, params=_same(list(ref.parameters()), list(m.parameters())),
                checked=checked, alarms=_alarms())


def _fsdp_tp(rank, mesh):
    """FSDP2 over "dp" and TP over "tp" on a 2 x 2 mesh, trained 3 steps (AdamW, clipping)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    models = []
    for _ in range(2):            # sequence parallel norm: every parameter on the 2-D mesh
        torch.manual_seed(0)
        m = parallelize_module(_Block(), mesh["tp"], _SP_PLAN())
        models.append(fully_shard(m, mesh=mesh["dp"]))
    ref, m = models
    abft.protect(m)
    opts = [torch.optim.AdamW(x.parameters(), lr=1e-2) for x in models]
    g = torch.Generator().manual_seed(5 + mesh["dp"].get_local_rank())   # data differs by dp rank
    losses = [[], []]
    abft.reset()
    for step in range(3):
        tp = mesh["tp"].get_local_rank()
        x = torch.randn(4, 8, 16, generator=g)[:, 4 * tp:4 * tp + 4]
        for i, (model, opt) in enumerate(zip(models, opts)):
            with abft.checked(model) if model is m else contextlib.nullcontext():
                loss = model(x).square().mean()
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            losses[i].append(loss.item())
    return dict(losses=losses, params=_same(list(ref.parameters()), list(m.parameters())),
                placements=[str(p.placements) for p in m.parameters()], checked=_checked(m),
                alarms=_alarms())


SCENARIOS = {"tp_mlp": _tp_mlp, "sp_block": _sp_block, "ops": _ops, "llama": _llama,
             "fsdp_tp": _fsdp_tp, "prepare_input": _prepare_input, "fsdp_protect": _fsdp_protect,
             "fsdp_rest": _fsdp_rest, "fsdp_rest_skip": _fsdp_rest_skip}


def _scenario(name, world, rank):
    """Scenario ``name`` on this rank, on a mesh of 2 (or 2 x 2: dp, tp) ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")) if world == 4 \
        else init_device_mesh("cpu", (2,))
    return SCENARIOS[name](rank, mesh)


def _spawn(tmp_path, name, world=2):
    mp.spawn(run_rank, args=(world, free_port(), str(tmp_path / f"{name}-{{rank}}.json"),
                             functools.partial(_scenario, name, world)), nprocs=world, join=True)
    return [json.load(open(tmp_path / f"{name}-{r}.json")) for r in range(world)]


def test_column_and_row_parallel_linears_are_checked_on_every_rank(tmp_path):
    for rank, res in enumerate(_spawn(tmp_path, "tp_mlp")):
        assert res["out"] and res["grads"], res
        # forward and grad_weight in the column-parallel layer (its input needs no gradient),
        # forward, grad_input and grad_weight in the row-parallel one
        assert res["checked"] == {"0": 2, "2": 3}, res
        assert res["alarms"] == []
        if rank == 0:
            assert res["fault_alarms"] == [], res
            continue
        assert sorted(res["fault_alarms"]) == [[1, "0", "forward"], [1, "2", "grad_weight"]], res
        where = {tuple(w[0]): w for w in res["fault_where"]}
        # layer 0 is column-parallel: rank 1 holds output columns 16-31 of (4, 8, 32)
        fwd = where[(1, 2, 16 + 3)]
        assert fwd[1] == {"coordinate": [1], "offset": [0, 0, 16], "partial": False}, fwd
        assert "global (1, 2, 19), rank 1" in fwd[2], fwd[2]
        # layer 2 is row-parallel: its weight (16, 32) is sharded by columns, rank 1 has 16-31
        gw = where[(4, 16 + 5)]
        assert gw[1]["offset"] == [0, 16] and not gw[1]["partial"], gw


def test_sequence_parallel_block_is_checked_and_equal(tmp_path):
    for res in _spawn(tmp_path, "sp_block"):
        assert res["out"] and res["grads"] and res["shape"] == [4, 4, 16], res
        assert res["checked"] == {"up": 3, "down": 3} and res["alarms"] == [], res


def test_prepare_module_input_before_parallel_linears_is_checked_and_equal(tmp_path):
    for res in _spawn(tmp_path, "prepare_input"):
        assert res["out"] and res["grads"] and res["shape"] == [4, 4, 16], res
        assert res["checked"] == {"mlp.0": 3, "mlp.2": 3} and res["unverified"] == 0, res
        assert res["alarms"] == [], res


def test_protected_fsdp2_training_does_not_false_alarm_across_steps(tmp_path):
    for res in _spawn(tmp_path, "fsdp_protect"):
        assert res["alarms"] == [] and res["params"], res
        # forward, grad_input (not the first layer's) and grad_weight, 3 steps, an evaluation
        # forward and a step after loading a checkpoint (it alarmed on both layers before
        # load_state_dict dropped the kept checksums)
        assert res["checked"] == {"0": 9, "2": 13}, res


def test_fsdp2_kept_checksums_follow_a_repair_at_rest(tmp_path):
    """StepGuard's repair of a flip at rest goes into one rank's shard, and from there into
    every rank's unsharded weight at the next all-gather, versions unchanged: the rerun must not
    check against checksums kept from the flipped weight (it halted as persistent before)."""
    for res in _spawn(tmp_path, "fsdp_rest"):
        assert res["records"] == [[1, "rerun", "transient"]], res
    for res in _spawn(tmp_path, "fsdp_rest_skip"):       # and the step after a skip is clean
        assert res["records"] == [[1, "skip", None]], res


def test_every_checked_op_takes_dtensor_operands(tmp_path):
    for res in _spawn(tmp_path, "ops"):
        assert res.pop("alarms") == []
        for name, r in res.items():
            assert r["out"] and r["grads"], (name, r)
            assert r["checked"] == 3 and r["unchecked"] == 0, (name, r)   # forward + 2 grads
        assert "Partial" in res["mm inner"]["placements"]
        assert "Shard(dim=1)" in res["matmul heads"]["placements"]
        assert "Shard(dim=0)" in res["bmm batch"]["placements"]


def test_llama_with_a_tensor_parallel_plan_trains_bit_for_bit(tmp_path):
    pytest.importorskip("transformers")
    for res in _spawn(tmp_path, "llama"):
        assert res["losses"][0] == res["losses"][1] and res["params"], res
        linears = {f"model.layers.{i}.{p}" for i in range(2) for p in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
        assert linears <= set(res["checked"]), res["checked"]
        assert res["alarms"] == []


def test_fsdp2_and_tensor_parallel_on_a_2d_mesh(tmp_path):
    results = _spawn(tmp_path, "fsdp_tp", world=4)
    for res in results:
        assert res["losses"][0] == res["losses"][1] and res["params"], res
        assert all("Shard" in p for p in res["placements"]), res["placements"]
        assert res["checked"] == {"up": 9, "down": 9} and res["alarms"] == [], res
    assert results[0]["losses"] != results[2]["losses"]        # the dp ranks saw other data


def test_the_tp_fsdp_example_runs_under_torchrun_on_4_ranks(tmp_path):
    import re
    import subprocess
    import sys
    root = ROOT
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
                          "--master_port", str(free_port()),
                          os.path.join(root, "examples", "train_tp_fsdp.py"), "--steps", "5",
                          "--fault-step", "2", "--tracker", str(tmp_path / "t-{rank}.jsonl")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(re.findall(r"rank [0-3] \(dp [01], tp [01]\) step +\d", out.stdout)) == 20
    # the fault on rank 3 at step 2: every rank reruns the step alike and goes on
    assert out.stdout.count("rerun transient alarms per rank [0, 0, 0, 1]") == 4
    # 5 steps + 1 rerun, 3 products each (forward, grad_input, grad_weight), on every rank
    assert out.stdout.count("{'0.down': 18, '0.up': 18, '1.down': 18, '1.up': 18}") == 4
