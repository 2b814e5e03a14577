"""abft.integrations.hf.GuardCallback in a real Hugging Face Trainer: a tiny Llama from a config (no
download), gradient accumulation, clipping, AdamW, several steps."""
import pytest
import torch

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

import abft  # noqa: E402
from abft.integrations.hf import GuardCallback  # noqa: E402
from llama import tiny_llama  # noqa: E402


class _Data(torch.utils.data.Dataset):
    def __init__(self, n=32, length=12):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class _Params(transformers.TrainerCallback):
    """The parameters after every optimizer step."""

    def __init__(self):
        self.after = []

    def on_step_end(self, args, state, control, model=None, **kw):
        self.after.append([p.detach().clone() for p in model.parameters()])


def _train(tmp_path, callbacks, steps=4):
    torch.manual_seed(0)
    model = tiny_llama()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, learning_rate=1e-3, max_grad_norm=1.0, logging_steps=1,
        report_to="none", save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
        dataloader_num_workers=0)
    params = _Params()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Data(),
                                   callbacks=[*callbacks, params])
    trainer.train()
    return trainer, params.after


def test_a_guarded_trainer_equals_the_plain_one_and_checks_every_step(tmp_path):
    _, plain = _train(tmp_path / "plain", [])
    cb = GuardCallback(decision="skip")
    trainer, guarded = _train(tmp_path / "guarded", [cb])
    assert all(torch.equal(a, b) for s, t in zip(plain, guarded) for a, b in zip(s, t))
    assert [r["step"] for r in cb.guard.records] == [0, 1, 2, 3]
    assert all(r["checked"] and not r["alarms"] for r in cb.guard.records)
    rows = abft.coverage()
    # q, k, v, o, gate, up, down in 2 layers and the lm_head; eager attention's two matmuls
    assert len({r["module"] for r in rows if r["op"] == "linear" and r["checked"]}) == 15, rows
    assert any(r["op"] == "matmul" and r["checked"] for r in rows), rows
    assert trainer.state.log_history[0]["abft_alarms"] == 0


def test_a_fault_skips_that_update_only(tmp_path):
    _, plain = _train(tmp_path / "plain", [])
    cb = GuardCallback(decision="skip")
    fault = abft.inject(when=lambda c: c.labels.get("step") == 2 and c.phase == "forward",
                        kind="add", value=50.0, times=1)
    with fault:
        trainer, guarded = _train(tmp_path / "guarded", [cb])
    hit = [r for r in cb.guard.records if r["alarms"]]
    assert [(r["step"], r["decision"], r["applied"]) for r in hit] == [(2, "skip", False)]
    # step 2's update was not applied: the parameters after it are those after step 1
    assert all(torch.equal(a, b) for a, b in zip(guarded[2], guarded[1]))
    assert all(torch.equal(a, b) for a, b in zip(guarded[1], plain[1]))
    assert not all(torch.equal(a, b) for a, b in zip(guarded[3], plain[3]))
    logs = trainer.state.log_history
    assert logs[1]["abft_alarms"] == 0 and logs[2]["abft_alarms"] >= 1 and logs[2]["abft_skipped"] == 1


def test_halt_stops_the_trainer_and_the_ledger_quarantines(tmp_path):
    fault = abft.inject(when=lambda c: c.phase == "forward", kind="add", value=50.0, times=None)
    cb = GuardCallback(decision="halt", ledger=str(tmp_path / "job"))
    with fault, pytest.raises(abft.GuardHalt) as e:
        _train(tmp_path / "run", [cb])
    # the step's alarms are unconfirmed (weight 2) under the limit of 3: the plain halt
    assert e.value.code == 43 and e.value.record["step"] == 0
    cb = GuardCallback(decision="halt", ledger=abft.Ledger(tmp_path / "job", strikes=2))
    with pytest.raises(abft.GuardHalt) as e:     # with a limit of 2, the next alarmed step
    # strikes the device out (the earlier run's 2 and this one's 2): quarantine, exit 44
        with fault:
            _train(tmp_path / "run2", [cb])
    assert e.value.code == 44


def test_rerun_is_refused_in_one_line():
    with pytest.raises(ValueError, match="decision"):
        GuardCallback(decision="rerun")


class _FlipAfterStep(transformers.TrainerCallback):
    """A bit of one weight flipped in memory after step 1's update (and after the seal)."""

    def on_step_end(self, args, state, control, model=None, **kw):
        if state.global_step == 2:
            w = model.model.layers[1].mlp.up_proj.weight
            w.data.view(-1).view(torch.int32)[5 * w.shape[1] + 7] ^= 1 << 29


def test_state_at_rest_is_sealed_after_each_update_and_a_flip_restored(tmp_path):
    cb, flip = GuardCallback(decision="skip", rest=True), _FlipAfterStep()
    trainer, after = _train(tmp_path, [cb, flip])
    hit = [r for r in cb.guard.records if r["alarms"]]
    assert [(r["step"], r["decision"]) for r in hit] == [(2, "skip")], cb.guard.records
    rest = [a for a in hit[0]["alarms"] if a["op"] == "rest"]
    assert rest == [{"module": "model.layers.1.mlp.up_proj.weight", "phase": "param", "op": "rest",
                     "call_id": -1, "row": 5, "col": 7}], hit[0]["alarms"]
    # written back before the skipped update: step 3 finds the state as sealed (a flip left in
    # place would alarm again there)
    assert [r["step"] for r in cb.guard.records] == [0, 1, 2, 3]
