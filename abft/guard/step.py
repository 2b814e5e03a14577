"""``abft.StepGuard``: act on the checked GEMMs' verdicts once per training step.

    guard = abft.StepGuard(optimizer, decision="rerun", tracker="runs/guard-{rank}.jsonl")
    for batch in data:
        loss = guard.step(lambda: train_step(model, batch))   # forward + backward, no optimizer

``step(closure)`` zeroes the gradients, runs the closure (one replayable unit: forward and
backward of one batch) with every checked GEMM writing its verdict under the guard's scope (step
label set; the per-call policy is forced to ``record``, ``sample_every`` still applies), resolves
the verdicts once, takes one small all-reduce when ``torch.distributed`` is initialised (so every
rank decides the same), then decides:

- ``continue``: log and apply the update;
- ``skip``: do not apply this step's update;
- ``rerun``: replay the closure from the same parameters and RNG state; clean on rerun means a
  transient fault and the rerun's gradients are applied; alarmed again means persistent and
  ``on_persistent`` decides (``halt`` by default, or ``skip``);
- ``halt``: raise ``GuardHalt`` (a ``SystemExit`` with ``exit_code``) naming rank, host, device,
  step, module and phase.

State at rest (``rest=True``, ``abft.RestCheck``): fingerprints of every parameter and its
optimizer state are sealed after each update and verified after the closure, before the next
update reads them; a changed element (a bit flipped in memory) is an alarm of kind ``rest`` like
a GEMM's, and a located one is written back to its sealed bits first, so ``rerun`` replays the
step from the restored state (an element that cannot be located is found again: persistent).
Parameters or state changed outside ``step`` need ``reseal()``; build the guard after DDP has
broadcast the parameters. Parameters changed during forward or backward (an embedding's
``max_norm``, an optimizer stepping inside backward) cannot be checked at rest.

Device ledger (``ledger="runs/job"`` or an ``abft.Ledger``): every alarmed step is a strike
against the device of each rank that alarmed, kept in the job folder across runs (weight 1 when a
rerun came back clean, 2 unconfirmed, 3 persistent); a device whose strikes reach the ledger's
limit within its window is quarantined and every rank halts with ``GuardHalt`` code 44
(``abft.guard.ledger.QUARANTINE_EXIT``: do not requeue on that device), as does a guard started later
on a quarantined device. Every rank must pass the same ``ledger`` setting.

Sampling: ``every=N`` checks one step in N (the others run with abft disabled); after an alarm or
an anomaly (non-finite loss, a loss above ``spike`` x the running median) every step is checked
for ``escalate`` steps. The tracker (JSONL, ``{rank}`` in the path) gets one line per checked
step with that context.
"""
import contextlib
import json
import math
import os
import socket
import statistics
import time

import torch

from abft import policy, settings, weightcache
from abft.context import current_rank, scope

DECISIONS = ("continue", "skip", "rerun", "halt")


class GuardHalt(SystemExit):
    """Raised by the ``halt`` decision; ``code`` is the guard's exit code."""

    def __init__(self, code, message, record):
        super().__init__(code)
        self.message, self.record = message, record

    def __str__(self):
        return self.message


def _dist():
    import torch.distributed as dist
    return dist if dist.is_available() and dist.is_initialized() else None


class StepGuard:
    def __init__(self, optimizer, *, decision="rerun", on_persistent="halt", every=1, escalate=10,
                 spike=3.0, tracker=None, exit_code=43, device=None, rest=False, names=None,
                 ledger=None):
        if decision not in DECISIONS:
            raise ValueError(f"StepGuard: decision must be one of {DECISIONS}, got {decision!r}")
        if on_persistent not in ("halt", "skip"):
            raise ValueError(f"StepGuard: on_persistent must be halt or skip, got {on_persistent!r}")
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"StepGuard: every must be a whole number >= 1, got {every!r}")
        self.opt, self.decision, self.on_persistent = optimizer, decision, on_persistent
        self.every, self.escalate, self.spike, self.exit_code = every, escalate, spike, exit_code
        self.device = device
        self.step_index, self.hot_until, self.losses = 0, -1, []
        self.records = []
        self.tracker = None
        if tracker:
            path = str(tracker).format(rank=current_rank())
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.tracker = open(path, "a", encoding="utf-8")
        self.resolve_s = self.reduce_s = 0.0
        self.rest, self._rest_left = None, []
        self._open, self._check, self._applied = None, True, True
        if rest:
            from abft.detectors.rest import RestCheck
            self.rest = rest if isinstance(rest, RestCheck) else RestCheck(optimizer, names=names)
            self.rest.seal()
        self.ledger = None
        if ledger is not None:
            from abft.guard.ledger import Ledger, this_device
            self.ledger = ledger if isinstance(ledger, Ledger) else Ledger(ledger)
            self.where = this_device(device)
            # a device quarantined by an earlier run: every rank stops before the first step
            flags = self._reduce(int(self.ledger.state(*self.where)["quarantined"]))
            if any(flags):
                self._quarantine(flags, "already quarantined in the ledger")

    # ------------------------------------------------------------------ internals
    def _checks(self, s):
        """Is step ``s`` checked: sampled (``every``), or inside an escalation."""
        return s % self.every == 0 or s <= self.hot_until

    def _params(self):
        return [p for g in self.opt.param_groups for p in g["params"]]

    def _scope(self, check):
        """The step's settings (every call's policy ``record``; abft off on an unsampled step)
        and labels, as a context to close after ``_resolve``. Alarms left from before the step
        (an evaluation pass between steps, kept by a config block's exit for ``flush()``) were
        logged when they were resolved; they are not this step's, so it drops them here."""
        policy.flush()
        stack = contextlib.ExitStack()
        stack.enter_context(settings.config(policy="record",
                                            enabled=check and settings.get().enabled))
        stack.enter_context(scope(step=self.step_index))
        return stack

    def _resolve(self, check):
        """This rank's alarms of the step, inside its scope (the config's exit would flush)."""
        alarms = policy.flush() if check else []
        if check and self.rest is not None and self.rest.sealed:
            found = self.rest.verify()      # the state at rest, before the update reads it
            self._rest_left = self.rest.restore(found)   # located ones back to their bits
            alarms = alarms + found
        return alarms

    def _finish(self, stack, check):
        """Resolve the step's alarms inside its scope, close it, agree across ranks; returns
        (this rank's alarms, every rank's count)."""
        t0 = time.perf_counter()
        try:
            alarms = self._resolve(check)
        finally:
            stack.close()
        t1 = time.perf_counter()
        counts = self._reduce(len(alarms))
        if any(counts):
            # no checksum kept past an alarmed step, on any rank: a weight repaired at rest on
            # one rank reaches every rank's unsharded copy under FSDP2, versions unchanged
            weightcache.forget()
        self.resolve_s += t1 - t0
        self.reduce_s += time.perf_counter() - t1
        return alarms, counts

    def _run(self, closure, check):
        for p in self._params():
            p.grad = None
        with self._scope(check) as stack:
            loss = closure()
            alarms, counts = self._finish(stack, check)
        return loss, alarms, counts

    def _reduce(self, n):
        """Alarm counts of every rank, from one all-reduce of a world-sized vector."""
        dist = _dist()
        if dist is None:
            return [n]
        world, rank = dist.get_world_size(), dist.get_rank()
        backend = dist.get_backend()
        dev = self.device or (torch.device("cuda", torch.cuda.current_device())
                              if backend == "nccl" else torch.device("cpu"))
        v = torch.zeros(world, dtype=torch.int64, device=dev)
        v[rank] = n
        dist.all_reduce(v)
        return [int(x) for x in v.tolist()]

    def _anomaly(self, loss):
        if loss is None or not torch.is_tensor(loss):
            return None
        x = float(loss.detach())
        if not math.isfinite(x):
            return "non-finite loss"
        hist = self.losses[-20:]
        self.losses.append(x)
        if len(hist) >= 5 and x > self.spike * statistics.median(hist):
            return f"loss spike ({x:.4g} vs median {statistics.median(hist):.4g})"
        return None

    def _record(self, **kw):
        dev = self.device or ("cuda:%d" % torch.cuda.current_device() if torch.cuda.is_available()
                              else "cpu")
        rec = dict(time=time.time(), rank=current_rank(), host=socket.gethostname(),
                   device=str(dev), step=self.step_index, **kw)
        self.records.append(rec)
        if self.tracker is not None:
            self.tracker.write(json.dumps(rec, default=str) + "\n")
            self.tracker.flush()
        return rec

    @staticmethod
    def _where(alarms):
        return [{"module": a.module, "phase": a.phase, "op": a.op, "call_id": a.call_id,
                 "row": a.row, "col": a.col} for a in alarms]

    def _strike(self, alarms, counts, persistence, check, anomaly):
        """An alarmed step (on any rank): the ranks that alarmed record a strike against their
        device; all ranks learn whether one is now quarantined and, if so, halt."""
        if self.ledger is None:
            return
        quarantined = False
        if alarms:
            self.ledger.strike(*self.where, persistence=persistence, rank=current_rank(),
                               step=self.step_index, alarms=self._where(alarms)[:4])
            quarantined = self.ledger.judge(*self.where)["quarantined"]
        flags = self._reduce(int(quarantined))
        if any(flags):
            self._quarantine(flags, "reached the strike limit", checked=check,
                             alarms=self._where(alarms), alarm_counts=counts,
                             persistence=persistence, anomaly=anomaly)

    def _quarantine(self, flags, why, **kw):
        from abft.guard.ledger import QUARANTINE_EXIT
        ranks = [r for r, f in enumerate(flags) if f]
        rec = self._record(decision="quarantine", quarantined_ranks=ranks, **kw)
        host, dev = self.where
        me = rec["rank"] if len(flags) > 1 else 0
        mine = f"this is rank {rec['rank']} on {host} ({dev}{', quarantined' if flags[me] else ''})"
        msg = (f"abft StepGuard: quarantine at step {rec['step']}: the device of rank(s) {ranks} "
               f"{why}; {mine}; exit {QUARANTINE_EXIT}: do not requeue on that device "
               f"(`abft ledger {self.ledger.path}` shows the record)")
        raise GuardHalt(QUARANTINE_EXIT, msg, rec)

    def _halt(self, rec):
        a = rec["alarms"][0] if rec["alarms"] else {}
        ranks = [r for r, n in enumerate(rec["alarm_counts"]) if n]
        msg = (f"abft StepGuard: halt at step {rec['step']}: alarms on rank(s) {ranks}; this is rank "
               f"{rec['rank']} on {rec['host']} ({rec['device']}); first alarm here: "
               f"{a.get('module')}/{a.get('phase')} ({rec.get('persistence') or 'unconfirmed'})")
        raise GuardHalt(self.exit_code, msg, rec)

    # ------------------------------------------------------------------ the step
    def _decide(self, check, loss, alarms, counts, rerun=None):
        """Decide a step whose alarms are in; returns (loss, apply). ``rerun()`` replays the step
        and returns what ``_run`` does; None in a loop the guard does not run, where ``rerun``
        can only skip."""
        s = self.step_index
        anomaly = self._anomaly(loss)
        if anomaly:
            self.hot_until = s + self.escalate
        total = sum(counts)
        apply, persistence, action = True, None, "none"
        if total:
            self.hot_until = s + self.escalate
            action = self.decision
            if self.decision == "skip" or (self.decision == "rerun" and rerun is None):
                apply, action = False, "skip"
            elif self.decision == "halt":
                self._strike(alarms, counts, None, check, anomaly)
                self._halt(self._record(checked=check, alarms=self._where(alarms),
                                        alarm_counts=counts, decision="halt", anomaly=anomaly))
            elif self.decision == "rerun":
                loss2, alarms2, counts2 = rerun()
                persistence = "persistent" if sum(counts2) else "transient"
                if persistence == "transient":
                    loss = loss2
                else:
                    alarms, counts = alarms + alarms2, [a + b for a, b in zip(counts, counts2)]
                    self._strike(alarms, counts, persistence, check, anomaly)
                    if self.on_persistent == "halt":
                        self._halt(self._record(checked=check, alarms=self._where(alarms),
                                                alarm_counts=counts, decision="halt",
                                                persistence=persistence, anomaly=anomaly))
                    apply, action = False, "skip"
            if persistence != "persistent":          # (a persistent one was struck above)
                self._strike(alarms, counts, persistence, check, anomaly)
        if check or total or anomaly:
            self._record(checked=check, alarms=self._where(alarms), alarm_counts=counts,
                         decision=action, persistence=persistence, applied=apply, anomaly=anomaly)
        return loss, apply

    def _advance(self, applied):
        self.step_index += 1
        if self.rest is not None:      # seal for the next step, if it is checked
            if self._rest_left and not applied:
                pass                   # not restored, not updated: keep it in view
            elif self._checks(self.step_index):
                self.rest.seal()
            else:
                self.rest.sealed = {}
            self._rest_left = []

    def step(self, closure):
        """Run ``closure`` (forward + backward) under the guard, decide, maybe apply the update.
        Returns the closure's result (the rerun's on a transient fault)."""
        check = self._checks(self.step_index)
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        loss, alarms, counts = self._run(closure, check)

        def rerun():
            torch.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
            return self._run(closure, True)
        loss, apply = self._decide(check, loss, alarms, counts, rerun)
        if apply:
            self.opt.step()
        self._advance(apply)
        return loss

    # ------------------------------------------------ a loop the guard does not run
    def begin(self):
        """Open a step of someone else's loop (the Hugging Face Trainer's: ``abft.integrations.hf``): the
        step's settings and labels, for its forward and backward passes."""
        if self._open is not None:
            raise RuntimeError("StepGuard.begin: the previous step was not ended")
        self._check = self._checks(self.step_index)
        self._open = self._scope(self._check)

    def end(self, loss=None):
        """Close the step before its optimizer update: resolve, agree across ranks, decide.
        Returns True to apply the update, False to skip it (``skip``, and ``rerun``, which
        cannot replay a loop it does not run); ``halt`` raises ``GuardHalt``. Call
        ``after_update()`` once the update is applied or skipped."""
        if self._open is None:
            raise RuntimeError("StepGuard.end: no step begun")
        stack, self._open = self._open, None
        alarms, counts = self._finish(stack, self._check)
        _, self._applied = self._decide(self._check, loss, alarms, counts)
        return self._applied

    def after_update(self):
        """The step is over (its update applied or skipped): count it, seal the state at rest."""
        self._advance(self._applied)

    def reseal(self):
        """Take the state-at-rest fingerprints again: call it after changing parameters or
        optimizer state outside ``step`` (loading a checkpoint, clamping weights)."""
        if self.rest is not None:
            self.rest.seal()

    def close(self):
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None
