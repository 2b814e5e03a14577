"""The detection-coverage evaluation: determinism (the null campaign), each fault site's fate,
the cross-check, campaigns (resume, bad configs), the report and the distributed pairing."""
import json
import os
import pathlib

import pytest
import torch

from abft.cli import main
from abft.eval import campaign, config, crosscheck, report
from abft.eval import faults as fm
from abft.eval.config import TrainConfig
from abft.eval.replicas import pretrain, run_trial
from paths import ROOT  # noqa: E402

TINY = TrainConfig(dim=16, batch=8, micro_steps=2, pretrain_steps=10, steps=4)


@pytest.fixture(scope="module")
def base():
    return pretrain(TINY)


def _trial(base, sites, mode="computation", seed=1, rate=1.0, **kw):
    prof = fm.Profile("p", rate=rate, sites=sites, **kw)
    return run_trial({"id": "t", "profile": prof, "mode": mode, "seed": seed}, TINY, base)


@pytest.mark.parametrize("mode", ["computation", "parameter", "none"])
def test_null_trial_is_bit_identical(base, mode):
    rec = _trial(base, {"gemm_accumulator": 1.0}, mode=mode, rate=0.0)
    assert rec["events"] == [] and rec["mismatches"] == []
    assert rec["alarms"] == [] and rec["alarms_healthy"] == []
    assert rec["loss_healthy"] == rec["loss_faulty"]
    assert all(d == 0.0 for d in rec["grad_deviation"] + rec["param_divergence"])


def test_accumulator_faults_are_detected_located_and_labelled(base):
    rec = _trial(base, {"gemm_accumulator": 1.0}, kinds={"bitflip": 1.0},
                 bits={"exponent_msb": 1.0}, multi_bit=0.0)
    cs = crosscheck.cases(rec)
    assert len(cs) == TINY.steps
    for c in cs:
        assert c["outcome"] == "detected", c
        assert c["module_ok"] and c["phase_ok"]
        assert c["latency"] == {"steps": 0, "micro_steps": 0}
        assert c["located"] in (True, None)
    assert any(c["located"] for c in cs)


@pytest.mark.parametrize("site,cause", [
    ("gemm_operand", "operand corrupted"), ("gemm_output", "after the check"),
    ("nongemm_op", "outside the protected GEMMs"), ("gradient_comm", "after backward")])
def test_sites_outside_the_check_are_missed_with_their_cause(base, site, cause):
    rec = _trial(base, {site: 1.0}, kinds={"scale": 1.0}, scale=(10.0, 100.0))
    cs = crosscheck.cases(rec)
    changed = [c for c in cs if c["outcome"] != "masked"]
    assert changed, cs
    for c in changed:
        assert c["outcome"] == "missed" and cause in c["cause"], c
        assert c["mismatches"] > 0 and c["alarms"] == 0


def test_weight_flip_caught_by_cached_checksums_only_after_the_first_forward(base):
    rec = _trial(base, {"weight_memory": 1.0}, kinds={"bitflip": 1.0},
                 bits={"exponent": 1.0}, multi_bit=0.0, seed=5)
    cs = [c for c in crosscheck.cases(rec) if c["outcome"] != "masked"]
    gemm = [c for c in cs if c["module"] not in ("tok", "pos")]
    assert gemm
    for c in gemm:
        if c["micro_step"] == 0:       # checksums taken fresh from the flipped weight
            assert c["outcome"] == "missed" and "fresh checksums" in c["cause"]
        else:                          # checksums cached by micro-step 0's forward
            assert c["outcome"] == "detected" and c["by"].startswith("cached weight")
    assert {c["micro_step"] for c in gemm} == {0, 1}, "seed 5 should hit both micro-steps"


def test_optimizer_state_fault_shows_in_the_state_sync(base):
    rec = _trial(base, {"optimizer_state": 1.0}, kinds={"bitflip": 1.0},
                 bits={"exponent_msb": 1.0}, multi_bit=0.0)
    cs = crosscheck.cases(rec)
    assert cs[0]["outcome"] == "not_applied"          # no Adam moments before step 0
    later = [c for c in cs[1:] if c["outcome"] != "masked"]
    assert later and all(c["outcome"] == "missed" for c in later)
    assert any(m["point"] == "opt_state" for m in rec["mismatches"])


def test_schedule_is_seeded_and_one_event_per_step():
    tg = {"gemm": {"a": "linear", "b": "matmul"}, "nongemm": ["n"], "weights": {"a.weight": "a"}}
    prof = fm.Profile("x", rate=0.5, sites={s: 1.0 for s in fm.SITES}, timing="intermittent",
                     onset=3, burst=2, quiet=5)
    e1, e2 = fm.schedule(prof, 60, 2, tg, 7), fm.schedule(prof, 60, 2, tg, 7)
    assert [e.to_dict() for e in e1] == [e.to_dict() for e in e2]
    steps = [e.step for e in e1]
    assert len(steps) == len(set(steps)) and min(steps) >= 3
    perm = fm.schedule(fm.Profile("y", timing="permanent", onset=4), 10, 1, tg, 0)
    assert [e.step for e in perm] == list(range(4, 10))
    assert len({(e.module, e.phase, e.urow, e.ucol) for e in perm}) == 1


def test_no_ground_truth_cases_come_from_mismatches_and_alarms():
    trial = {"events": None, "mismatches": [{"step": 1}, {"step": 2}], "alarms": [{"step": 2}, {"step": 3}]}
    out = {c["step"]: c["outcome"] for c in crosscheck.cases(trial)}
    assert out == {1: "missed", 2: "detected", 3: "false_alarm"}


@pytest.mark.parametrize("text,field", [
    ('seeds = 0\n[[profiles]]\nname="a"', "config.seeds"),
    ('[[profiles]]\nname="a"\nsites={bogus=1.0}', "sites"),
    ('[[profiles]]\nname="a"\nrate=2', "rate"),
    ('[train]\nsteps=0\n[[profiles]]\nname="a"', "config.train.steps"),
    ('[train]\nwidth=3\n[[profiles]]\nname="a"', "width"),
    ('modes=["sideways"]\n[[profiles]]\nname="a"', "config.modes"),
    ('colour = 1\n[[profiles]]\nname="a"', "colour"),
    ('[[profiles]]\nname="a"\ntiming="sometimes"', "timing"),
])
def test_bad_config_names_the_field(tmp_path, text, field, capsys):
    p = tmp_path / "c.toml"
    p.write_text(text)
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        config.load(str(p))
    assert main(["eval", str(p), "--out", str(tmp_path / "r")]) == 2
    assert field.split(".")[-1] in capsys.readouterr().err


def test_default_config_is_valid():
    cfg = config.load()
    assert len(campaign.trials(cfg)) >= 5


TINY_TOML = """
seed = 0
[train]
dim = 16
batch = 8
pretrain_steps = 10
steps = 3
[[profiles]]
name = "healthy"
rate = 0.0
[[profiles]]
name = "alu"
rate = 1.0
sites = { gemm_accumulator = 1.0 }
kinds = { bitflip = 1.0 }
bits = { exponent_msb = 1.0 }
multi_bit = 0.0
modes = ["computation", "none"]
"""


def test_abft_eval_runs_resumes_and_reports(tmp_path, capsys):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY_TOML)
    out = tmp_path / "run"
    assert main(["eval", str(cfg), "--out", str(out), "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "| gemm_accumulator | 3 | 3 | 3 | 0 |" in text
    assert "Null campaign (no faults): 1 trial(s), 0 mismatches, 0 alarms" in text
    assert "## What the faults did" in text and "parameter divergence" in text
    files = sorted(os.listdir(out))
    assert all(f.rsplit(".", 1)[-1] in ("json", "jsonl", "md", "png", "toml") for f in files
               if f != "pretrain.bin")
    assert len([f for f in files if f.endswith(".png")]) == 5
    s = json.loads((out / "report.json").read_text())
    assert s["accumulator_above_threshold"] == {"faults": 3, "detected": 3}
    lines = (out / "trials.jsonl").read_text().splitlines()
    assert len(lines) == 3
    # an interrupted campaign: drop the last trial, cut a line in half, resume
    (out / "trials.jsonl").write_text("\n".join(lines[:1]) + "\n" + lines[1][:50] + "\n")
    assert main(["eval", str(cfg), "--out", str(out)]) == 2          # refuses without --resume
    assert main(["eval", str(cfg), "--out", str(out), "--resume", "--quiet"]) == 0
    ids = [json.loads(x)["id"] for x in (out / "trials.jsonl").read_text().splitlines()
           if x.startswith("{") and x.endswith("}")]
    assert sorted(set(ids)) == sorted(t["id"] for t in campaign.trials(config.load(str(cfg))))
    capsys.readouterr()
    assert main(["report", str(out)]) == 0
    assert "Coverage per site" in capsys.readouterr().out


def test_distributed_pair_with_gloo_matches_the_local_run(tmp_path):
    cfg = config.loads(TINY_TOML.replace('modes = ["computation", "none"]',
                                         'modes = ["computation"]'))
    recs = {r["id"]: r for r in campaign.run(cfg, str(tmp_path / "d"), pairs=1, progress=False)}
    assert {r["pairing"] for r in recs.values()} == {"dist"}
    local = {r["id"]: r for r in campaign.run(cfg, str(tmp_path / "l"), progress=False)}
    same = ("loss_healthy", "loss_faulty", "mismatches", "alarms", "alarms_healthy", "events",
            "grad_deviation", "param_divergence", "accuracy_healthy", "accuracy_faulty")
    for i, r in recs.items():          # bit for bit: the same thread count on every path
        assert {k: r[k] for k in same} == {k: local[i][k] for k in same}, i
    null, alu = recs["healthy/computation/0"], recs["alu/computation/0"]
    assert null["mismatches"] == [] and null["alarms"] == []
    assert null["loss_healthy"] == null["loss_faulty"]
    assert [c["outcome"] for c in crosscheck.cases(alu)] == ["detected"] * 3
    s = report.summarize(list(recs.values()))
    assert s["per_site"]["gemm_accumulator"]["rate"] == 1.0


EXPERIMENTS = pathlib.Path(ROOT) / "experiments"


@pytest.mark.parametrize("name", sorted(p.name for p in EXPERIMENTS.glob("*.toml")))
def test_every_experiment_config_in_the_repository_validates(name):
    """The campaigns EXPERIMENTS.md and BENCHMARKS.md cite run as written (a typo in a key or a
    site would otherwise surface only when someone runs them)."""
    cfg = config.load(str(EXPERIMENTS / name))
    assert cfg.profiles and cfg.train.steps >= 1
