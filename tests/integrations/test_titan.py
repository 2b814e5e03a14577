"""abft.integrations.titan.guard_trainer on a Trainer shaped as torchtitan's: a tiny transformers Llama from a
config (no download), gradient accumulation, clipping, AdamW with a warm-up schedule, several
steps. torchtitan itself is not installed here (its dependencies: datasets, wandb, tensorboard,
tyro, torchdata, ...): ``_Trainer`` keeps the parts of torchtitan's ``Trainer`` the hook uses
(``model_parts``, ``optimizers``, ``lr_schedulers``, ``step``, ``train_step(data_iterator)``) and
its step's order: zero the gradients, take the micro-batches from the iterator, forward and
backward each, clip, step the optimizers, then the schedulers."""
import pytest
import torch

pytest.importorskip("transformers")

import abft  # noqa: E402
from abft.integrations.titan import guard_trainer  # noqa: E402
from llama import tiny_llama  # noqa: E402


class _Trainer:
    def __init__(self, steps=4, accumulation=2, in_place=False):
        torch.manual_seed(0)
        self.in_place = in_place      # shift the inputs in place, as context parallelism shards
        self.model_parts = [tiny_llama()]
        self.optimizers = torch.optim.AdamW(self.model_parts[0].parameters(), lr=1e-3)
        self.lr_schedulers = torch.optim.lr_scheduler.LambdaLR(
            self.optimizers, lambda s: min(1.0, (s + 1) / 3))
        self.steps, self.accumulation, self.step = steps, accumulation, 0
        self.taken, self.after = 0, []

    def batches(self):
        g = torch.Generator().manual_seed(1)
        while True:
            self.taken += 1
            ids = torch.randint(0, 64, (2, 12), generator=g)
            yield {"input": ids}, ids

    def forward_backward_step(self, input_dict, labels):
        if self.in_place:
            input_dict["input"].copy_(input_dict["input"].roll(1, -1))
        loss = self.model_parts[0](input_ids=input_dict["input"], labels=labels).loss
        (loss / self.accumulation).backward()
        return loss

    def train_step(self, data_iterator):
        self.optimizers.zero_grad()
        micro = [next(data_iterator) for _ in range(self.accumulation)]
        for input_dict, labels in micro:
            self.forward_backward_step(input_dict, labels)
        torch.nn.utils.clip_grad_norm_(self.model_parts[0].parameters(), 1.0)
        self.optimizers.step()
        self.lr_schedulers.step()

    def train(self):
        data = self.batches()
        while self.step < self.steps:
            self.step += 1
            self.train_step(data)
            self.after.append([p.detach().clone() for p in self.model_parts[0].parameters()])
        return self


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _fault(step, times=1):
    """A large error in every forward product of ``step``, ``times`` calls (None: every call)."""
    return abft.inject(when=lambda c: c.labels.get("step") == step and c.phase == "forward",
                       kind="add", value=50.0, times=times)


def test_a_guarded_trainer_equals_the_plain_one_and_checks_every_step():
    plain = _Trainer().train()
    t = _Trainer()
    guard = guard_trainer(t)
    t.train()
    assert all(_same(a, b) for a, b in zip(plain.after, t.after))
    assert t.lr_schedulers.last_epoch == plain.lr_schedulers.last_epoch == 4
    assert [r["step"] for r in guard.records] == [1, 2, 3, 4]
    assert all(r["checked"] and not r["alarms"] for r in guard.records)
    rows = abft.coverage()
    assert len({r["module"] for r in rows if r["op"] == "linear" and r["checked"]}) == 15, rows
    assert any(r["op"] == "matmul" and r["checked"] for r in rows), rows


@pytest.mark.parametrize("in_place", [False, True])
def test_a_transient_fault_reruns_the_step_on_the_same_batches(in_place):
    plain = _Trainer(in_place=in_place).train()
    t = _Trainer(in_place=in_place)
    guard = guard_trainer(t, decision="rerun")
    with _fault(2):
        t.train()
    hit = [r for r in guard.records if r["alarms"]]
    assert [(r["step"], r["decision"], r["persistence"], r["applied"]) for r in hit] == \
        [(2, "rerun", "transient", True)]
    # the rerun read the step's two micro-batches again, not the next two: a clean run's result
    assert t.taken == plain.taken == 4 * 2
    assert all(_same(a, b) for a, b in zip(plain.after, t.after))


def test_skip_drops_the_update_and_a_persistent_fault_halts():
    plain = _Trainer().train()
    t = _Trainer()
    guard = guard_trainer(t, decision="skip")
    with _fault(3):
        t.train()
    assert [(r["step"], r["applied"]) for r in guard.records if r["alarms"]] == [(3, False)]
    assert _same(t.after[2], t.after[1]) and _same(t.after[1], plain.after[1])
    assert t.lr_schedulers.last_epoch == 4                  # the schedule stays with the steps
    t = _Trainer()
    guard_trainer(t, decision="rerun")
    with _fault(2, times=None):                              # every call: persistent
        with pytest.raises(abft.GuardHalt) as e:
            t.train()
    assert e.value.code == 43 and "halt at step 2" in str(e.value)
    assert len(t.after) == 1
