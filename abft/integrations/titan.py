"""abft in torchtitan: one call on the Trainer, each training step a replayable unit.

    from abft.integrations.titan import guard_trainer
    trainer = Trainer(config)                  # torchtitan's
    guard_trainer(trainer, decision="rerun", ledger="runs/job")
    trainer.train()

torchtitan's ``Trainer.train_step(data_iterator)`` is one optimizer step: it zeroes the
gradients, takes the step's micro-batches from the iterator, runs forward and backward on each,
clips the gradient norm, then steps ``trainer.optimizers`` and ``trainer.lr_schedulers``.
``guard_trainer`` protects every model part (``abft.protect``) and replaces ``train_step`` on
this trainer with the same step run by a ``StepGuard``:

- the micro-batches the step takes are kept, so a replay reads the same ones, from the same
  parameters and RNG state;
- the optimizers' step waits for the guard's decision: applied on ``continue`` and after a clean
  rerun, dropped on ``skip`` and after a persistent fault with ``on_persistent="skip"``;
  ``halt`` raises ``GuardHalt`` (exit code 43, 44 for a device the ledger quarantines) out of
  ``trainer.train()``. The schedulers step once per training step whatever the decision, as
  ``trainer.step`` counts on;
- forward and backward run under ``abft.checked`` of each model part (the functional products:
  attention's matmuls, ``sdpa=True`` for SDPA through checked products).

It uses only ``model_parts``, ``optimizers`` (an optimizer: ``step``, ``zero_grad``,
``param_groups``), ``lr_schedulers.step()``, ``step`` and ``train_step``, as torchtitan's
Trainer has them (read at torchtitan b5bcd76, August 2026). The step's batches are kept as copies
(a step may change its inputs in place: context parallelism shards them), one more copy of a
step's token ids. A replayed step runs ``train_step`` again, so its metrics are logged again.
An optimizer that steps inside backward (an optimizer-in-backward setup) updates before the guard
decides: the hook holds back ``trainer.optimizers.step()`` only, so use it without one.
"""
import contextlib

import torch

import abft


def _copy(batch):
    """The batch with its tensors cloned: a step may change its inputs in place (torchtitan's
    context parallelism shards inputs and labels in place), and a replay needs them as taken. A
    tensor met twice (inputs that are the labels) stays one tensor."""
    from torch.utils._pytree import tree_map
    memo = {}

    def one(t):
        if not isinstance(t, torch.Tensor):
            return t
        if id(t) not in memo:
            memo[id(t)] = t.clone()
        return memo[id(t)]
    return tree_map(one, batch)


class _Replay:
    """The step's data: the batches already taken first (a replay), then the source's; each
    kept as taken and handed out as a fresh copy."""

    def __init__(self, taken, source):
        self.taken, self.source, self.i = taken, source, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.i == len(self.taken):
            self.taken.append(_copy(next(self.source)))
        self.i += 1
        return _copy(self.taken[self.i - 1])


@contextlib.contextmanager
def _held(*objs):
    """``obj.step()`` does nothing for the duration (the guard applies the update itself)."""
    own = [o.__dict__.get("step") for o in objs]     # an LR scheduler wraps optimizer.step
    for o in objs:
        o.step = lambda *a, **k: None
    try:
        yield
    finally:
        for o, fn in zip(objs, own):
            if fn is None:
                del o.step
            else:
                o.step = fn


def guard_trainer(trainer, *, decision="rerun", checked=True, sdpa=False, **guard):
    """Guard every step of torchtitan's ``trainer`` (see the module's docstring); returns the
    ``StepGuard``. ``guard``: any other ``StepGuard`` keyword (``on_persistent``, ``every``,
    ``ledger``, ``tracker``, ``exit_code``, ``rest``)."""
    parts = list(trainer.model_parts)
    for m in parts:
        abft.protect(m)
    if guard.get("rest") and "names" not in guard:       # alarms name the parameters
        guard["names"] = {p: n for m in parts for n, p in m.named_parameters()}
    g = abft.StepGuard(trainer.optimizers, decision=decision, **guard)
    g.step_index = trainer.step
    inner, scheds = trainer.train_step, trainer.lr_schedulers

    def train_step(data_iterator):
        g.step_index = trainer.step
        taken, source = [], iter(data_iterator)

        def closure():
            with _held(trainer.optimizers, scheds), contextlib.ExitStack() as stack:
                if checked:
                    for m in parts:
                        stack.enter_context(abft.checked(m, sdpa=sdpa))
                return inner(_Replay(taken, source))
        loss = g.step(closure)
        scheds.step()
        return loss

    trainer.train_step = train_step
    return g
