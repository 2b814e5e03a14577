"""``abft eval --tp``: replica pairs that are tensor-parallel groups (4 gloo ranks on the CPU)."""
import json
import os

import pytest
import torch
import torch.multiprocessing as mp

import abft
from abft.cli import main
from abft.eval import campaign, config, crosscheck, report
from abft.eval.models import GPT, GPTConfig
from abft.eval.replicas import free_port

from test_eval import TINY_TOML
from ranks import exit_clean

# the tiny campaign of test_eval, each replica a 2-rank TP group, the faults under computation sync
TP_TOML = TINY_TOML.replace("steps = 3\n", "steps = 3\ntp = 2\n", 1) \
    .replace('modes = ["computation", "none"]', "")


def _shard_worker(rank, port, out):
    import torch.distributed as dist

    from abft.eval.tp import shard
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        cfg = GPTConfig(vocab=11, block=8, layers=2, heads=4, dim=16)
        torch.manual_seed(0)
        full = GPT(cfg)
        part = GPT(cfg)
        part.load_state_dict(full.state_dict())
        shard(part, rank, 2, dist.group.WORLD)
        abft.protect(part)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randint(0, 11, (4, 8), generator=g), torch.randint(0, 11, (4, 8), generator=g)
        abft.reset()
        with abft.checked(part):
            loss = part(x, y)
            loss.backward()
        ref = full(x, y)
        ref.backward()
        a, fa = part.blocks[0].attn, full.blocks[0].attn
        rows = torch.cat([torch.arange(j * 16 + 8 * rank, j * 16 + 8 * rank + 8) for j in range(3)])
        err = {
            "qkv": (a.qkv.weight.grad - fa.qkv.weight.grad[rows]).abs().max().item(),
            "proj": (a.proj.weight.grad - fa.proj.weight.grad[:, 8 * rank:8 * rank + 8])
            .abs().max().item(),
            "proj.bias": (a.tp_out.bias.grad - fa.proj.bias.grad).abs().max().item(),
            "fc": (part.blocks[1].mlp.fc.weight.grad
                   - full.blocks[1].mlp.fc.weight.grad[32 * rank:32 * rank + 32]).abs().max().item(),
            "ln": (part.blocks[0].ln1.weight.grad - full.blocks[0].ln1.weight.grad)
            .abs().max().item(),
        }
        res = {"loss": [float(loss), float(ref)], "err": err, "alarms": len(abft.flush()),
               "checked": {r["module"]: r["checked"] for r in abft.coverage()},
               "unverified": sum(r["unverified"] + r["unprotected"] for r in abft.coverage())}
        with open(os.path.join(out, f"{rank}.json"), "w") as f:
            json.dump(res, f)
        dist.barrier()          # no rank tears gloo down while its peer still talks to it
    finally:
        dist.destroy_process_group()
    exit_clean()


def test_a_sharded_gpt_computes_the_full_models_loss_and_gradients(tmp_path):
    mp.spawn(_shard_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        r = json.loads((tmp_path / f"{rank}.json").read_text())
        assert r["loss"][0] == pytest.approx(r["loss"][1], rel=1e-6), rank
        assert max(r["err"].values()) < 1e-6, (rank, r["err"])
        assert r["alarms"] == 0 and r["unverified"] == 0
        # every product, forward and both backward GEMMs, checked on this rank's shard
        assert len(r["checked"]) == 13 and set(r["checked"].values()) == {3}, r["checked"]


def test_eval_pairs_of_tensor_parallel_groups_detect_and_place_the_fault(tmp_path):
    cfg = config.loads(TP_TOML)
    recs = {r["id"]: r for r in campaign.run(cfg, str(tmp_path / "tp"), progress=False)}
    assert {(r["pairing"], r["tp"]) for r in recs.values()} == {("dist", 2)}
    null, alu = recs["healthy/computation/0"], recs["alu/computation/0"]
    assert null["mismatches"] == [] and null["alarms"] == [] and null["alarms_healthy"] == []
    assert null["loss_healthy"] == null["loss_faulty"]
    assert [c["outcome"] for c in crosscheck.cases(alu)] == ["detected"] * 3
    fr = alu["fault_rank"]
    assert {a["tp_rank"] for a in alu["alarms"]} == {fr}       # only the faulty rank alarms
    assert alu["mismatches"][0]["tp_rank"] == fr
    d = crosscheck.first_divergence(alu)
    assert d["tp_rank"] == fr and d["cause"].endswith(f"on TP rank {fr}")
    text = report.markdown(report.summarize(list(recs.values())))
    assert "each replica a group of 2 ranks" in text and f"(TP rank {fr})" in text
    # the same job as without tensor parallelism, to round-off
    cfg1 = config.loads(TP_TOML.replace("tp = 2", "tp = 1"))
    one = {r["id"]: r for r in campaign.run(cfg1, str(tmp_path / "one"), progress=False)}
    assert null["loss_healthy"] == pytest.approx(one["healthy/computation/0"]["loss_healthy"],
                                                 rel=1e-5)


def test_tp_that_does_not_divide_the_heads_or_the_width_is_refused(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text(TP_TOML.replace("tp = 2", ""))
    for tp, field in (("3", "train.heads = 4"), ("0", "whole number"), ("8", "train.heads")):
        out = tmp_path / f"out{tp}"
        assert main(["eval", str(cfg), "--tp", tp, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("abft eval: --tp:") and field in err[0], err
        assert not out.exists()
    with pytest.raises(ValueError, match=r"config.train.tp: 4 does not divide the attention heads"):
        config.loads(TP_TOML.replace("tp = 2", "heads = 2\ntp = 4"))
    from abft.eval.tp import check         # the width follows from the heads in a config
    with pytest.raises(ValueError, match=r"--tp: 4 does not divide the model width"):
        check(4, 18, 4, "--tp")


def test_torchrun_with_a_world_that_does_not_hold_whole_tp_pairs_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = config.loads(TP_TOML)
    with pytest.raises(ValueError, match=r"torchrun: 2 ranks; .* train.tp = 2 need a multiple of 4"):
        campaign.run(cfg, str(tmp_path / "x"), progress=False)
    assert not (tmp_path / "x").exists()


OPERAND_TOML = TP_TOML.replace("steps = 3\n", "steps = 3\ncarry = true\n", 1) \
    .replace("""sites = { gemm_accumulator = 1.0 }
kinds = { bitflip = 1.0 }
bits = { exponent_msb = 1.0 }
multi_bit = 0.0""", "sites = { gemm_operand = 1.0 }\nkinds = { scale = 1.0 }\nscale = [10.0, 100.0]")


def test_an_operand_changed_on_one_tensor_parallel_rank_is_caught_there(tmp_path):
    """A sharded activation or incoming gradient changed in memory before its GEMM read it, on
    the faulty rank of the group: ``OutputCheck`` (``train.carry``) alarms there, in its step."""
    assert "gemm_operand" in OPERAND_TOML and "carry = true" in OPERAND_TOML
    cfg = config.loads(OPERAND_TOML)
    recs = {r["id"]: r for r in campaign.run(cfg, str(tmp_path / "tp"), progress=False)}
    null, op = recs["healthy/computation/0"], recs["alu/computation/0"]
    assert null["alarms"] == [] and null["alarms_healthy"] == [] and null["mismatches"] == []
    cs = [c for c in crosscheck.cases(op) if c["outcome"] != "masked"]
    assert cs and all(c["outcome"] in ("detected", "alarm_no_mismatch") for c in cs), cs
    assert {a["kind"] for a in op["alarms"]} == {"carry"}
    assert {a["tp_rank"] for a in op["alarms"]} == {op["fault_rank"]}
