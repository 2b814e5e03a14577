"""Campaigns: many trials over node profiles, seeds and sync modes, from a plain config file.

A config is TOML or JSON (see ``DEFAULT``, the embedded default, for every field). Trials are
``profiles x seeds x modes`` (a profile may name its own ``modes``). Each finished trial is
appended to ``trials.jsonl`` in the run folder at once (``trials-pair{p}.jsonl`` when several
distributed pairs write), so an interrupted campaign loses nothing and ``resume`` skips the trials
already there. The run folder holds JSON, JSONL, TOML, Markdown and PNG only.
"""
import glob
import json
import os
import sys
import time
import tomllib

from abft.eval.faults import Profile
from abft.eval.replicas import TrainConfig, pretrain, run_trial
from abft.eval.sync import MODES

DEFAULT = """
# abft eval default campaign: a healthy node (the null campaign), three unhealthy node profiles
# and a stuck unit run free (no sync) to show what a permanent fault does to the fine-tune.
seed = 0
seeds = 1                 # trials per profile and mode
modes = ["computation"]   # computation | parameter | none
backend = "reference"

[train]
digits = 4
dim = 32
layers = 2
heads = 4
batch = 32
micro_steps = 2
lr = 0.005
pretrain_steps = 200
steps = 30

[[profiles]]
name = "healthy"
rate = 0.0

[[profiles]]
name = "flaky-alu"        # transient compute faults inside the GEMMs
rate = 0.5
sites = { gemm_accumulator = 1.0 }
modes = ["computation", "parameter"]

[[profiles]]
name = "bad-hbm"          # bit flips at rest: weights and optimizer state
rate = 0.5
sites = { weight_memory = 3.0, optimizer_state = 1.0 }
kinds = { bitflip = 1.0 }

[[profiles]]
name = "datapath"         # intermittent bursts outside the accumulator
rate = 0.8
timing = "intermittent"
onset = 2
burst = 3
quiet = 4
sites = { gemm_operand = 1.0, gemm_output = 1.0, nongemm_op = 1.0, gradient_comm = 1.0 }

[[profiles]]
name = "stuck-exponent"   # a permanent fault from step 10: one unit's exponent MSB
rate = 1.0
timing = "permanent"
onset = 10
sites = { gemm_accumulator = 1.0 }
kinds = { bitflip = 1.0 }
bits = { exponent_msb = 1.0 }
multi_bit = 0.0
modes = ["computation", "none"]
"""

TOP = ("seed", "seeds", "modes", "backend", "train", "profiles")


def parse(text, fmt="toml"):
    return json.loads(text) if fmt == "json" else tomllib.loads(text)


def load(path=None):
    """The config (a dict) from a TOML or JSON file, or the default; validated."""
    if path is None:
        text, fmt = DEFAULT, "toml"
    else:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        fmt = "json" if str(path).endswith(".json") else "toml"
    try:
        cfg = parse(text, fmt)
    except (ValueError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"{path}: not valid {fmt.upper()}: {e}") from e
    return validate(cfg)


def validate(cfg):
    """Check every field; a bad one raises ValueError naming it."""
    for k in cfg:
        if k not in TOP:
            raise ValueError(f"config: unknown field {k!r}; fields are {TOP}")
    for k in ("seed", "seeds"):
        v = cfg.setdefault(k, 0 if k == "seed" else 1)
        if not isinstance(v, int) or v < (0 if k == "seed" else 1):
            raise ValueError(f"config.{k}: a whole number, got {v!r}")
    modes = cfg.setdefault("modes", ["computation"])
    _modes(modes, "config.modes")
    if cfg.setdefault("backend", "reference") not in ("reference", "triton", "auto"):
        raise ValueError(f"config.backend: reference | triton | auto, got {cfg['backend']!r}")
    train = cfg.setdefault("train", {})
    fields = TrainConfig.__dataclass_fields__
    for k in train:
        if k not in fields:
            raise ValueError(f"config.train: unknown field {k!r}; fields are {tuple(fields)}")
    TrainConfig(**train).validate("config.train")
    profiles = cfg.get("profiles")
    if not isinstance(profiles, list) or not profiles:
        raise ValueError("config.profiles: a list of node profiles ([[profiles]] tables)")
    names = set()
    pfields = set(Profile.__dataclass_fields__) | {"modes"}
    for i, p in enumerate(profiles):
        where = f"config.profiles[{i}]"
        if not isinstance(p, dict):
            raise ValueError(f"{where}: a table")
        for k in p:
            if k not in pfields:
                raise ValueError(f"{where}: unknown field {k!r}; fields are {sorted(pfields)}")
        if "modes" in p:
            _modes(p["modes"], f"{where}.modes")
        profile(p).validate(f"{where} ({p.get('name')})")
        if p["name"] in names:
            raise ValueError(f"{where}.name: {p['name']!r} appears twice")
        names.add(p["name"])
    return cfg


def _modes(modes, where):
    if not isinstance(modes, list) or not modes or any(m not in MODES for m in modes):
        raise ValueError(f"{where}: a list from {MODES}, got {modes!r}")


def profile(p):
    kw = {k: v for k, v in p.items() if k != "modes"}
    for k in ("scale", "noise"):
        if k in kw:
            kw[k] = tuple(kw[k])
    return Profile(**kw)


def trials(cfg):
    """Every trial of the campaign, in a fixed order, each with a stable id."""
    out = []
    for p in cfg["profiles"]:
        for mode in p.get("modes", cfg["modes"]):
            for k in range(cfg["seeds"]):
                seed = cfg["seed"] * 1000 + k
                out.append({"id": f"{p['name']}/{mode}/{seed}", "profile": profile(p), "mode": mode,
                            "seed": seed, "backend": cfg["backend"]})
    return out


def done_ids(out):
    ids = set()
    for path in glob.glob(os.path.join(out, "trials*.jsonl")):
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        ids.add(json.loads(line)["id"])
                    except (ValueError, KeyError):
                        pass          # a line cut by an interruption: that trial runs again
    return ids


def read_trials(out):
    recs = {}
    for path in sorted(glob.glob(os.path.join(out, "trials*.jsonl"))):
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                    recs[rec["id"]] = rec
                except (ValueError, KeyError):
                    pass
    return list(recs.values())


def append(path, rec):
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


class Progress:
    """A one-line progress bar on stderr: done/total, elapsed and the estimate left."""

    def __init__(self, total, stream=sys.stderr):
        self.total, self.done, self.t0, self.stream = total, 0, time.perf_counter(), stream

    def tick(self, label=""):
        self.done += 1
        el = time.perf_counter() - self.t0
        left = el / self.done * (self.total - self.done)
        bar = "#" * int(20 * self.done / max(self.total, 1))
        self.stream.write(f"\r[{bar:<20}] {self.done}/{self.total} trials, {el:.0f}s, "
                          f"~{left:.0f}s left  {label[:40]:<40}")
        if self.done == self.total:
            self.stream.write("\n")
        self.stream.flush()


def write_config(cfg, out):
    """The campaign's config, as JSON, in the run folder."""
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=1)


def run(cfg, out, resume=False, pairs=0, progress=True):
    """Run the campaign into the run folder ``out``; returns the trial records.

    ``pairs=0``: replica pairs in this process; ``pairs=N``: N distributed pairs (2N gloo ranks
    spawned on this machine, trials dealt round robin); under torchrun, the launched ranks.
    """
    os.makedirs(out, exist_ok=True)
    if not resume and glob.glob(os.path.join(out, "trials*.jsonl")):
        raise FileExistsError(f"{out} holds trials already: pass --resume, or another --out")
    write_config(cfg, out)
    todo = [t for t in trials(cfg) if t["id"] not in done_ids(out)]
    train = TrainConfig(**cfg["train"])
    if todo and pairs:
        from abft.eval import replicas
        replicas.spawn_pairs(pairs, _DistRun(train, todo, out))
    elif todo and os.environ.get("WORLD_SIZE") and int(os.environ["WORLD_SIZE"]) > 1:
        _torchrun(train, todo, out)
    elif todo:
        base = pretrain(train)
        bar = Progress(len(todo)) if progress else None
        for t in todo:
            append(os.path.join(out, "trials.jsonl"), run_trial(t, train, base))
            if bar:
                bar.tick(t["id"])
    return read_trials(out)


class _DistRun:
    """What each spawned rank runs: its pair's share of the trials (picklable for spawn)."""

    def __init__(self, train, todo, out):
        self.train, self.todo, self.out = train, todo, out

    def __call__(self, rank, link):
        import torch.distributed as dist
        from abft.eval.replicas import pair_of
        pair, role, _ = pair_of(rank)
        npairs = dist.get_world_size() // 2
        base = pretrain(self.train)
        # both ranks of a pair start from H's pretrained state, bit for bit
        for v in base.values():
            if role == "H":
                link.send(v)
            else:
                v.copy_(link.recv(v))
        for t in self.todo[pair::npairs]:
            rec = run_trial(t, self.train, base, link=link, role=role)
            if rec is not None:
                append(os.path.join(self.out, f"trials-pair{pair}.jsonl"), rec)
        dist.barrier()          # every F rank has written before rank 0 reads the trials


def _torchrun(train, todo, out):
    import torch.distributed as dist

    from abft.eval.replicas import make_link
    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        _DistRun(train, todo, out)(rank, make_link(rank, world))
    finally:
        dist.destroy_process_group()
