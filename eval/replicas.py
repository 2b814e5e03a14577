"""Replica pairs of one deterministic training run: a healthy replica (H) and a faulty one (F).

``run_trial`` runs one trial: both replicas start from the same pretrained state, fine-tune on the
same batches with the same optimizer, every GEMM checked (``abft.protect`` plus ``abft.checked``),
each in its own ``abft.scope`` (replica, step, micro_step) with its own ``AlarmLog``; F gets the
trial's fault events; the sync points of ``eval/sync.py`` compare them.

Two ways to pair:
- in one process (``run_trial(..., link=None)``): H's step runs first and queues its tensors at
  each sync point, then F's step replays them;
- two ranks of ``torch.distributed`` (``run_trial(..., link=DistLink(h_rank, group), role=...)``):
  each rank runs its replica and every sync point is a broadcast from H's rank. ``spawn_pairs``
  starts ``2 x pairs`` ranks on this machine (gloo), ``torchrun`` works too (``abft eval``
  notices the environment); several pairs run different trials at once;
- tensor parallel (``train.tp = N``, ``abft eval --tp N``): each replica is an N-rank TP group
  (``eval/tp.py``), each H rank paired with F's rank of the same TP rank; sync points compare
  local shards, at the submodules and at the TP collectives; the faults go to one rank of F's
  group. ``2 x N`` ranks a pair.
"""
import contextlib
import functools
import math
import os
import time

import torch

import abft
from abft.alarms import AlarmLog
from abft.eval import faults as fm
from abft.eval.sync import LocalLink, Sync


def pretrain(cfg):
    """The fault-free pretrained state (the corpus), deterministic in ``cfg.seed``; plain torch."""
    torch.manual_seed(cfg.seed)
    model = cfg.model()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    for _ in range(cfg.pretrain_steps):
        x, y = cfg.task.batch(gen, cfg.batch, "corpus")
        opt.zero_grad(set_to_none=True)
        model(x, y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def batches(cfg, seed, step):
    """The micro-batches of one fine-tuning step (the same for both replicas)."""
    gen = torch.Generator().manual_seed(seed * 100003 + step)
    x, y = cfg.task.batch(gen, cfg.batch)
    n = cfg.batch // cfg.micro_steps
    return [(x[i:i + n], y[i:i + n]) for i in range(0, cfg.batch, n)]


class GradLink(abft.CommCheck):
    """The gradients' all-reduce, checked: a real gloo collective over a one-rank group of this
    process (the replicas are single-rank data-parallel jobs). A ``gradient_comm`` fault corrupts
    its result, as a faulty collective would leave it: after the checksums were taken."""

    def __init__(self, model):
        super().__init__(model)
        import torch.distributed as dist
        self.group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
        self.faults = []        # (event, offset in the bucket, the parameter's shape)

    def reduce(self, params, events):
        """All-reduce the gradients of ``params`` ({name: parameter}) with ``events`` applied to
        the result; returns the alarms."""
        offsets, off = {}, 0
        for n, p in params.items():              # all_reduce_grads' bucket: gradients in order
            if p.grad is not None:
                offsets[n] = (off, p.shape)
                off += p.numel()
        self.faults = [(e, *offsets[e.param]) for e in events if e.param in offsets]
        try:
            return self.all_reduce_grads(params.values(), self.group)
        finally:
            self.faults = []

    def communicate(self, kind, out, inp, group, op):
        super().communicate(kind, out, inp, group, op)
        for ev, off, shape in self.faults:
            n = shape.numel()
            fm.corrupt(ev, out[off:off + n].view(shape))


class Replica:
    """One replica: a protected model, its AdamW, its alarm log and its sync points."""

    def __init__(self, role, cfg, base, sync, tp=None):
        self.role, self.cfg = role, cfg
        self.model = cfg.model()
        self.model.load_state_dict(base)
        if tp is not None:                 # this rank's shard of the pretrained model
            from abft.eval.tp import shard
            shard(self.model, tp.rank, tp.size, tp.group)
        abft.protect(self.model)
        # before the sync's hooks: the rerun is compared with the output the module produced
        self.recompute = abft.RecomputeCheck(self.model, rate=cfg.recompute) \
            if cfg.recompute else None
        self.params = dict(self.model.named_parameters())
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr)
        self.log = AlarmLog()
        self.sync = sync.attach(self.model)
        self.losses, self.dev, self.div = [], [], []
        self.comm = GradLink(self.model) if cfg.comm else None
        self.carry = functools.partial(abft.OutputCheck, model=self.model) if cfg.carry \
            else contextlib.nullcontext
        self.rest = None
        if cfg.rest:
            self.rest = abft.RestCheck(self.opt, names={p: n for n, p in self.params.items()})
            self.rest.seal()

    def step(self, s, micro, events=()):
        self.opt.zero_grad(set_to_none=True)
        sync, total = self.sync, 0.0
        for m, (x, y) in enumerate(micro):
            sync.step, sync.micro_step = s, m
            armed = [fm.Armed(e, self.model, self.opt, self.params) for e in events
                     if (e.micro_step == m or e.every_micro_step) and e.site != "gradient_comm"]
            try:
                with abft.scope(step=s, micro_step=m, replica=self.role, log=self.log), \
                        abft.checked(self.model), self.carry():
                    sync.active = True
                    loss = self.model(x, y) / len(micro)
                    sync.loss(loss)
                    loss.backward()
            finally:
                sync.active = False
                for a in armed:
                    a.disarm()
            total += float(loss.detach())
        comm = [e for e in events if e.site == "gradient_comm"]
        if self.comm is not None:
            with abft.scope(step=s, micro_step=len(micro) - 1, replica=self.role, log=self.log):
                self.comm.reduce(self.params, comm)
        for e in comm if self.comm is None else ():
            fm.Armed(e, self.model, self.opt, self.params).grads(self.params)
        named = list(self.model.named_parameters())
        dev = sync.grads(named)
        if self.rest is not None:       # detection only: the evaluation scores it, restores nothing
            with abft.scope(step=s, micro_step=len(micro) - 1, replica=self.role, log=self.log):
                self.rest.verify()
        self.opt.step()
        div = sync.state(named, self.opt)
        if self.rest is not None:
            self.rest.seal()
        abft.flush()
        self.losses.append(total)
        if dev is not None:
            self.dev.append(dev)
            self.div.append(div)

    def accuracy(self):
        self.model.eval()
        with abft.config(enabled=False):
            acc = self.cfg.task.accuracy(self.model)
        self.model.train()
        return acc


def run_trial(trial, cfg, base, link=None, role=None):
    """Run one trial (a dict: id, profile (a Profile), mode, seed, modules); returns the trial
    record on F's side (on H's side in distributed mode: None; under tensor parallelism, on F's
    TP rank 0, None on the others).

    ``link=None``: both replicas in this process. Otherwise ``role`` ("H" or "F") is this rank's;
    a link with a ``tp`` (eval/tp.py's ``TP``) makes each replica a tensor-parallel group, this
    rank its TP rank ``tp.rank``, paired with the other replica's rank of the same TP rank; the
    trial's faults go to one rank of F's group (its ``fault_rank``).
    """
    prof, mode, seed = trial["profile"], trial["mode"], trial["seed"]
    local = link is None
    link = link or LocalLink()
    tp = getattr(link, "tp", None)
    roles = ("H", "F") if local else (role,)
    reps = {r: Replica(r, cfg, base, Sync(r, link, mode, trial.get("modules")), tp)
            for r in roles}
    fseed = trial.get("fault_seed", seed)
    events = fm.schedule(prof, cfg.steps, cfg.micro_steps, fm.targets(reps[roles[0]].model), fseed)
    fault_rank = fseed % tp.size if tp is not None else 0
    mine = events if tp is None or tp.rank == fault_rank else []
    t0 = time.perf_counter()
    curve = {r: [] for r in roles}
    with abft.config(policy="record", backend=trial.get("backend", "reference")):
        for s in range(cfg.steps):
            micro = batches(cfg, seed, s)
            for r in roles:
                data = batches(cfg, seed + 7919 * prof.reseed, s) if r == "F" and prof.reseed \
                    else micro               # a reseeded healthy F: other data, the noise floor
                reps[r].step(s, data, [e for e in mine if e.step == s] if r == "F" else ())
                if cfg.eval_every and (s + 1) % cfg.eval_every == 0:
                    curve[r].append([s + 1, reps[r].accuracy()])
            if local and link.queue:
                raise RuntimeError("abft eval: the healthy replica passed sync points the faulty "
                                   "one did not")
    wall = time.perf_counter() - t0
    acc = {r: reps[r].accuracy() for r in roles}      # collective under TP: every rank calls it
    parts = {r: _gather(tp, reps[r], events, fault_rank) for r in roles}
    if tp is not None and tp.rank != 0:
        return None
    if "H" in reps:
        h = parts["H"]
        link.send_json({"loss": reps["H"].losses, "accuracy": acc["H"], "curve": curve["H"],
                        "alarms": h["alarms"]})
    if "F" not in reps:
        return None
    f = parts["F"]
    hs = link.recv_json()
    rec = {
        "id": trial["id"], "profile": prof.name, "mode": mode, "seed": seed,
        "steps": cfg.steps, "micro_steps": cfg.micro_steps, "pairing": "local" if local else "dist",
        "events": f["events"],
        "mismatches": f["mismatches"],
        "alarms": f["alarms"], "alarms_healthy": hs["alarms"],
        "loss_healthy": hs["loss"], "loss_faulty": reps["F"].losses,
        "grad_deviation": f["dev"], "param_divergence": f["div"],
        "accuracy_healthy": hs["accuracy"], "accuracy_faulty": acc["F"],
        "accuracy_curve_healthy": hs["curve"], "accuracy_curve_faulty": curve["F"],
        "reseeded": bool(prof.reseed),
        "wall_s": wall, "rank": int(os.environ.get("RANK", 0)),
        "campaign": trial.get("campaign"), "fault_seed": fseed,
        "env": environment(trial.get("backend", "reference")),
    }
    if tp is not None:
        rec.update(tp=tp.size, fault_rank=fault_rank)
    return rec


def _gather(tp, rep, events, fault_rank):
    """A replica's alarms, mismatches, gradient deviations, parameter divergences and fault events
    (with what they did); under TP, those of every rank of its group: alarms and mismatches
    tagged with their ``tp_rank`` and merged in sync-point order, the deviations the worst rank's
    at each step, the events as the fault rank applied them."""
    mine = {"alarms": [_alarm(a) for a in rep.log],
            "mismatches": [m.to_dict() for m in rep.sync.mismatches],
            "dev": rep.dev, "div": rep.div, "events": [e.to_dict() for e in events]}
    if tp is None:
        return mine
    from abft.eval.tp import gather
    ranks = gather(tp, mine)
    out = {"alarms": [], "mismatches": [], "events": ranks[fault_rank]["events"]}
    for r, part in enumerate(ranks):
        out["alarms"] += [a | {"tp_rank": r} for a in part["alarms"]]
        out["mismatches"] += [m | {"tp_rank": r} for m in part["mismatches"]]
    out["mismatches"].sort(key=lambda m: (m["seq"], m["tp_rank"]))
    out["alarms"].sort(key=lambda a: (-1 if a["step"] is None else a["step"],
                                      -1 if a["micro_step"] is None else a["micro_step"],
                                      a["tp_rank"]))
    for k in ("dev", "div"):
        out[k] = [math.nan if any(x != x for x in xs) else max(xs)
                  for xs in zip(*(p[k] for p in ranks))]
    return out


def environment(backend):
    """What a record's figures depend on: torch, its thread count, the backend, the host."""
    import platform
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "backend": backend,
            "host": platform.node(), "python": platform.python_version()}


def _alarm(a):
    keys = ("op", "phase", "module", "step", "micro_step", "replica", "call_id", "row", "col",
            "residual", "threshold", "kind", "tile", "batch")
    d = {k: getattr(a, k) for k in keys}
    d["residual"] = float(d["residual"]) if d["residual"] == d["residual"] else None
    d["n_rows"], d["n_cols"] = len(a.rows), len(a.cols)
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}


# ------------------------------------------------------------------ distributed pairs

def pair_of(rank, tp=1):
    """(pair index, role, TP rank) of a global rank. A pair holds 2 x tp consecutive ranks; in
    it, H's TP rank r is rank 2r and F's is 2r + 1, so each H rank and its F twin are neighbours
    (with tp = 1: pairs (0, 1), (2, 3), ...)."""
    pair, i = divmod(rank, 2 * tp)
    return pair, ("H" if i % 2 == 0 else "F"), i // 2


def dist_worker(rank, world, port, run, threads=1, parent=None, tp=1):
    """Entry of one spawned rank: join the gloo group on loopback and call ``run(rank, link)``."""
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    die_with_parent(parent)
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        run(rank, make_link(rank, world, tp))
    finally:
        dist.destroy_process_group()


def die_with_parent(parent=None):
    """Have the kernel kill this process when its parent dies (Linux), so a killed ``abft eval``
    leaves no rank running on (and writing into) its run folder."""
    import ctypes
    import signal
    import sys
    if not sys.platform.startswith("linux"):
        return
    parent = parent or os.getppid()     # the spawner's pid, passed in: it may be dead already
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:      # PR_SET_PDEATHSIG
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:            # the parent died before the call took effect
        os._exit(1)


def make_link(rank, world, tp=1):
    """The DistLink of this rank and its twin in the other replica (every rank creates every
    group, as gloo needs); with ``tp > 1`` it carries the rank's ``TP`` group as ``link.tp``."""
    import torch.distributed as dist
    from abft.eval.sync import DistLink
    if world % (2 * tp):
        raise ValueError(f"abft eval: replica pairs of {tp}-rank tensor-parallel groups need a "
                         f"multiple of {2 * tp} ranks, got {world}")
    twins = [dist.new_group([2 * p, 2 * p + 1]) for p in range(world // 2)]
    link = DistLink(rank - rank % 2, twins[rank // 2])
    if tp > 1:
        from abft.eval.tp import TP
        pair, role, r = pair_of(rank, tp)
        for p in range(world // (2 * tp)):
            for side in (0, 1):          # H's group, then F's
                ranks = tuple(p * 2 * tp + 2 * i + side for i in range(tp))
                g = dist.new_group(list(ranks))
                if rank in ranks:
                    link.tp = TP(rank=r, size=tp, group=g, ranks=ranks)
    return link


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_pairs(pairs, run, threads=1, tp=1):
    """Run ``run(rank, link)`` on ``2 x tp x pairs`` local ranks (gloo on loopback)."""
    import torch.multiprocessing as mp
    mp.spawn(dist_worker, args=(2 * tp * pairs, free_port(), run, threads, os.getpid(), tp),
             nprocs=2 * tp * pairs, join=True)
