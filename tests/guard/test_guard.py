"""abft.StepGuard: continue, skip, rerun (transient and persistent), halt, sampling and
escalation, the tracker, and two DDP ranks over gloo reaching the same decision."""
import json
import os
import re

import pytest
import torch
import torch.multiprocessing as mp

import abft
from abft.eval.replicas import free_port
from ranks import exit_clean
from paths import ROOT  # noqa: E402


def _setup(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    abft.protect(model)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _closure(model, step):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)

    def run():
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss
    return run


def _train(steps, fault_step=None, persistent=False, **kw):
    model, opt = _setup()
    guard = abft.StepGuard(opt, **kw)
    for s in range(steps):
        inj = abft.inject(when=lambda c: c.module == "0" and c.phase == "forward", kind="add",
                          value=50.0, times=None if persistent else 1) if s == fault_step else None
        if inj:
            inj.start()
        try:
            guard.step(_closure(model, s))
        finally:
            if inj:
                inj.stop()
    return model, guard



def test_alarms_resolved_by_a_config_block_inside_the_step_reach_the_guard():
    """A config block in the user's step resolves the verdicts at its exit; its alarms are still
    the step's (they were dropped for the guard before policy.resolve)."""
    model, opt = _setup()
    guard = abft.StepGuard(opt, decision="skip")
    run = _closure(model, 0)

    def step():
        with abft.config(sample_every=1):
            return run()
    with abft.inject(when=lambda c: c.module == "0" and c.phase == "forward", kind="add",
                     value=50.0):
        guard.step(step)
    assert [(r["decision"], r["applied"]) for r in guard.records] == [("skip", False)]


def test_alarms_from_between_steps_are_not_charged_to_the_next_step():
    """An evaluation pass between steps, in its own config block, hits a fault: its alarm is
    logged there, and the next (clean) step is not skipped for it (it was before)."""
    model, opt = _setup()
    guard = abft.StepGuard(opt, decision="skip")
    x = torch.randn(4, 8)
    with abft.config(policy="record"), torch.no_grad():
        with abft.inject(when=lambda c: c.module == "0", kind="add", value=50.0):
            model(x)
    assert len(abft.alarms()) == 1
    guard.step(_closure(model, 0))
    assert [(r["decision"], r["applied"]) for r in guard.records] == [("none", True)]
    # the same, with the guard's own loop API (the Trainer callback's)
    with abft.config(policy="record"), torch.no_grad():
        with abft.inject(when=lambda c: c.module == "0", kind="add", value=50.0):
            model(x)
    guard.begin()
    _closure(model, 1)()
    assert guard.end() is True
    guard.after_update()


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def test_clean_guarded_training_equals_plain():
    model, guard = _train(4)
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for s in range(4):
        opt.zero_grad()
        _closure(plain, s)()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(_params(model), _params(plain)))
    assert all(r["decision"] == "none" for r in guard.records)


def test_rerun_of_a_transient_fault_matches_the_fault_free_run(tmp_path):
    clean, _ = _train(4)
    model, guard = _train(4, fault_step=2, decision="rerun", tracker=str(tmp_path / "t-{rank}.jsonl"))
    assert all(torch.equal(a, b) for a, b in zip(_params(model), _params(clean)))
    hit = [r for r in guard.records if r["alarms"]]
    assert len(hit) == 1 and hit[0]["step"] == 2 and hit[0]["persistence"] == "transient"
    assert hit[0]["alarms"][0]["module"] == "0" and hit[0]["alarms"][0]["phase"] == "forward"
    guard.close()
    lines = [json.loads(x) for x in (tmp_path / "t-0.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2, 3] and lines[2]["applied"]


def test_skip_leaves_the_parameters_of_that_step():
    clean, _ = _train(2)          # the state after steps 0 and 1
    model, guard = _train(3, fault_step=2, decision="skip")
    assert all(torch.equal(a, b) for a, b in zip(_params(model), _params(clean)))
    assert guard.records[-1]["decision"] == "skip" and not guard.records[-1]["applied"]


def test_continue_applies_the_corrupted_update():
    clean, _ = _train(3)
    model, guard = _train(3, fault_step=2, decision="continue")
    assert not all(torch.equal(a, b) for a, b in zip(_params(model), _params(clean)))
    assert guard.records[-1]["decision"] == "continue"


@pytest.mark.parametrize("decision,persistent", [("halt", False), ("rerun", True)])
def test_halt_exits_with_its_code_and_names_the_place(decision, persistent):
    before, _ = _train(2)
    with pytest.raises(SystemExit) as e:
        _train(3, fault_step=2, persistent=persistent, decision=decision, exit_code=43)
    assert e.value.code == 43
    msg = str(e.value)
    assert "step 2" in msg and "rank(s) [0]" in msg and "0/forward" in msg
    if persistent:
        assert "persistent" in msg


def test_sampling_and_escalation():
    model, opt = _setup()
    guard = abft.StepGuard(opt, every=4, escalate=2, decision="continue")
    checked = []
    for s in range(10):
        inj = abft.inject(when=lambda c: c.phase == "forward", kind="add", value=50.0) if s == 4 else None
        if inj:
            inj.start()
        guard.step(_closure(model, s))
        if inj:
            inj.stop()
        checked.append(bool(guard.records and guard.records[-1]["step"] == s and guard.records[-1]["checked"]))
    # steps 0, 4, 8 by sampling; 5 and 6 by escalation after step 4's alarm
    assert [s for s, c in enumerate(checked) if c] == [0, 4, 5, 6, 8]


def _ddp_worker(rank, port, out, fault):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model, opt = _setup()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    guard = abft.StepGuard(opt, decision="rerun", tracker=os.path.join(out, "track-{rank}.jsonl"))
    for s in range(3):
        inj = abft.inject(when=lambda c: c.phase == "forward", kind="add", value=50.0) \
            if fault and rank == 1 and s == 1 else None
        if inj:
            inj.start()
        g = torch.Generator().manual_seed(10 * s + rank)
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)

        def run():
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            return loss
        guard.step(run)
        if inj:
            inj.stop()
    guard.close()
    torch.save([p.detach() for p in model.parameters()], os.path.join(out, f"p{rank}.pt"))
    dist.barrier()              # no rank tears gloo down while its peer still talks to it
    dist.destroy_process_group()
    exit_clean()


def _ddp(tmp, fault):
    os.makedirs(tmp, exist_ok=True)
    mp.spawn(_ddp_worker, args=(free_port(), tmp, fault), nprocs=2, join=True)
    return [torch.load(os.path.join(tmp, f"p{r}.pt")) for r in (0, 1)]


def test_ddp_two_ranks_agree_and_a_transient_rerun_matches_fault_free(tmp_path):
    clean = _ddp(str(tmp_path / "clean"), False)
    faulty = _ddp(str(tmp_path / "faulty"), True)
    for r in (0, 1):
        assert all(torch.equal(a, b) for a, b in zip(clean[r], faulty[r]))
    tracks = [[json.loads(x) for x in open(tmp_path / "faulty" / f"track-{r}.jsonl")] for r in (0, 1)]
    for t in tracks:                           # both ranks took the same decision at step 1
        rec = [x for x in t if x["step"] == 1][0]
        assert rec["alarm_counts"][1] > 0 and rec["alarm_counts"][0] == 0
        assert rec["decision"] == "rerun" and rec["persistence"] == "transient"
    assert tracks[1][1]["alarms"] and not tracks[0][1]["alarms"]


def _torchrun_example(folder):
    import subprocess
    import sys
    root = ROOT
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(free_port()),
                           os.path.join(root, "examples", "train_guarded.py"), "--steps", "4",
                           "--fault-step", "2", "--tracker", str(folder / "t-{rank}.jsonl")],
                          capture_output=True, text=True, timeout=300)


def _why(out):
    """What a failed torchrun printed that says why: the ranks' own error lines, then the tail."""
    keys = ("terminate called", "what():", "Error", "error:", "Signal", "exitcode")
    lines = [x for x in out.stderr.splitlines() if any(k in x for k in keys)]
    return "\n".join(lines[:40]) + "\n--- tail ---\n" + out.stderr[-1500:]


def test_example_runs_under_torchrun(tmp_path):
    out = _torchrun_example(tmp_path / "first")
    if out.returncode != 0 and "SIGABRT" in out.stderr:
        # rank 0 aborted once in CI (SIGABRT; the log kept only torchrun's summary, so the cause,
        # likely gloo's TCP transport as in pytorch/gloo#514, is not known); not reproduced in 20
        # runs here. One retry; what the ranks printed goes into the warning for the next time.
        import warnings
        warnings.warn("torchrun example aborted (SIGABRT), retried once:\n" + _why(out))
        out = _torchrun_example(tmp_path / "retry")
    assert out.returncode == 0, _why(out)
    # the two ranks share stdout, so a line may hold both: count the records, not the lines
    assert len(re.findall(r"rank [01] step +\d", out.stdout)) == 8
    assert out.stdout.count("rerun transient alarms per rank [0, 1]") == 2


def test_an_anomaly_on_a_checked_step_escalates_too():
    model, opt = _setup()
    guard = abft.StepGuard(opt, every=4, escalate=2, decision="continue")
    for s in range(9):
        run = _closure(model, s)
        guard.step((lambda: run() * float("nan")) if s == 4 else run)
    checked = [r["step"] for r in guard.records if r["checked"]]
    assert checked == [0, 4, 5, 6, 8]
    assert guard.records[1]["anomaly"] == "non-finite loss" and guard.records[1]["alarms"] == []
