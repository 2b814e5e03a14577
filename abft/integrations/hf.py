"""abft in the Hugging Face ``Trainer``: one callback.

    from abft.integrations.hf import GuardCallback
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[GuardCallback(decision="skip", ledger="runs/job")])

At the start of training the model is protected (``abft.protect``: its linear layers checked) and
a ``StepGuard`` is built on the Trainer's optimizer. Each optimizer step (all its
gradient-accumulation micro-batches) runs under the guard's step label, with ``abft.checked``
around the forward and backward passes (the functional products: attention's matmuls, a tied
``lm_head``); before the optimizer step the guard resolves the verdicts, agrees across ranks and
decides: ``continue`` applies the update, ``skip`` drops it (the gradients are cleared, so
the optimizer leaves parameters and moments as they were; the learning-rate schedule still
advances), ``halt`` raises ``GuardHalt`` out of ``trainer.train()`` (exit code 43, or 44 for a
device the ledger quarantines). ``rerun`` needs a loop the guard runs itself (``StepGuard.step``):
the Trainer's cannot replay a step. Logs gain ``abft_alarms`` and ``abft_skipped`` (totals).
"""
from transformers import TrainerCallback

import abft

DECISIONS = ("continue", "skip", "halt")


class GuardCallback(TrainerCallback):
    """Args: ``decision`` (continue | skip | halt), ``checked`` (``abft.checked`` around each
    step's passes), ``sdpa`` (with it: attention through checked products), and any other
    ``StepGuard`` keyword (``every``, ``ledger``, ``tracker``, ``exit_code``, ``rest``: sealed
    after each optimizer step in ``on_step_end``, verified before the next one)."""

    def __init__(self, *, decision="skip", checked=True, sdpa=False, **guard):
        if decision not in DECISIONS:
            raise ValueError(f"GuardCallback: decision must be one of {DECISIONS} (the Trainer "
                             f"cannot replay a step for rerun), got {decision!r}")
        self.decision, self.checked, self.sdpa, self.kw = decision, checked, sdpa, guard
        self.guard, self.mode, self.model = None, None, None
        self.alarms = self.skipped = 0

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kw):
        abft.protect(model)
        self.model = model
        kw = dict(self.kw)
        if kw.get("rest") and "names" not in kw:          # alarms name the parameters
            kw["names"] = {p: n for n, p in model.named_parameters()}
        self.guard = abft.StepGuard(optimizer, decision=self.decision, **kw)
        self.guard.step_index = state.global_step

    def on_step_begin(self, args, state, control, **kw):
        self.guard.begin()
        if self.checked:
            self.mode = abft.checked(self.model, sdpa=self.sdpa)
            self.mode.__enter__()

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kw):
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.mode = None
        n = len(self.guard.records)
        apply = self.guard.end()
        self.alarms += sum(len(r["alarms"]) for r in self.guard.records[n:])
        if not apply:
            self.skipped += 1
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None

    def on_step_end(self, args, state, control, **kw):
        self.guard.after_update()

    def on_log(self, args, state, control, logs=None, **kw):
        mine = {"abft_alarms": self.alarms, "abft_skipped": self.skipped}
        if logs is not None:                  # what the loggers after this callback print
            logs.update(mine)
        if state.log_history:                 # the Trainer kept its copy before the callbacks
            state.log_history[-1].update(mine)

    def on_train_end(self, args, state, control, **kw):
        if self.mode is not None:             # training stopped inside a step
            self.mode.__exit__(None, None, None)
            self.mode = None
        if self.guard is not None:
            self.guard.close()
