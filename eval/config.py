"""The campaign config: typed dataclasses read from TOML or JSON that check their own fields on
construction (``Config.from_dict`` checks the tables and profiles against the rest).

``Config`` is the whole campaign: its fields, ``train`` (a ``TrainConfig``) and ``profiles`` (one
``Node`` per ``[[profiles]]`` table: a ``faults.Profile`` and its sync modes). A field left out
takes its dataclass default; ``DEFAULT`` is the default campaign (``abft eval`` without a config).
``Config.from_dict`` refuses an unknown field or a bad value with a ValueError naming it;
``Config.to_dict`` is the resolved config, every default spelled out, that ``config.json`` holds
and the campaign's hash covers.
"""
import functools
import json
import tomllib
from dataclasses import asdict, dataclass, field, fields

import torch

from abft.eval import faults as fm
from abft.eval.models import GPT, GPTConfig, Task
from abft.eval.sync import MODES
from abft.eval.tp import check as check_tp
from abft.kernels import backends

DEFAULT = """
# abft eval default campaign: a healthy node (the null campaign), three unhealthy node profiles
# and a stuck unit run free (no sync) to show what a permanent fault does to the fine-tune.
seed = 0
seeds = 1                 # trials per profile and mode
threads = 1               # torch threads per trial (results depend on it)
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
rest = true               # the detectors beyond the GEMMs (README, "Coverage"):
recompute = 1.0           # the state-at-rest check, the recompute of norms, activations and
comm = true               # softmax, the checksummed all-reduce of the gradients,
carry = true              # GEMM outputs verified until they die
tp = 1                    # > 1: each replica a tensor-parallel group of tp ranks (--tp)

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
name = "defective-unit"   # a permanent defect hit by some GEMM calls, any module and phase:
rate = 1.0                # runs of 4 wrong elements every 32 columns (AEGIS)
timing = "permanent"
onset = 5
per_gemm = 0.02
sites = { gemm_accumulator = 1.0 }
patterns = { periodic = 1.0 }

[[profiles]]
name = "stuck-exponent"   # a permanent fault from step 10: one unit's exponent MSB
rate = 1.0
timing = "permanent"
onset = 10
sites = { gemm_accumulator = 1.0 }
kinds = { bitflip = 1.0 }
bits = { exponent_msb = 1.0 }
multi_bit = 0.0
stuck_at = 1
modes = ["computation", "none"]
"""


@dataclass
class TrainConfig:
    """The training job: model size, pretraining (fault-free, shared by every trial) and the
    fine-tune each trial runs. Validated on construction."""
    digits: int = 4
    dim: int = 32
    layers: int = 2
    heads: int = 4
    batch: int = 32
    micro_steps: int = 2
    lr: float = 5e-3
    pretrain_steps: int = 200
    steps: int = 30
    seed: int = 0
    eval_every: int = 0      # > 0: both replicas' accuracy every so many steps (0: at the end)
    rest: bool = False       # abft.RestCheck on both replicas: the state-at-rest detector
    recompute: float = 0.0   # > 0: abft.RecomputeCheck at this rate (non-GEMM modules)
    comm: bool = False       # gradients through a checksummed all-reduce (abft.CommCheck)
    carry: bool = False      # GEMM outputs verified until they die (abft.OutputCheck)
    tp: int = 1              # > 1: each replica a tensor-parallel group of this many ranks

    def __post_init__(self):
        where = "config.train"
        for k, v in asdict(self).items():
            if k in ("rest", "comm", "carry"):
                if not isinstance(v, bool):
                    raise ValueError(f"{where}.{k}: true or false, got {v!r}")
                continue
            if k == "recompute":
                if not fm.is_number(v) or not 0 <= v <= 1:
                    raise ValueError(f"{where}.recompute: a rate in [0, 1] (0: off), got {v!r}")
                continue
            if k == "lr":
                if not fm.is_number(v) or not v > 0:
                    raise ValueError(f"{where}.lr: a finite number > 0, got {v!r}")
                continue
            low = 0 if k in ("seed", "pretrain_steps", "eval_every") else 1
            if not fm.whole(v) or v < low:
                raise ValueError(f"{where}.{k}: a whole number >= {low}, got {v!r}")
        if self.dim % self.heads:
            raise ValueError(f"{where}.dim: a multiple of heads ({self.heads}), got {self.dim}")
        check_tp(self.heads, self.dim, self.tp, f"{where}.tp")
        if self.batch % self.micro_steps:
            raise ValueError(f"{where}.batch: a multiple of micro_steps ({self.micro_steps})")

    @property
    def task(self):
        return Task(self.digits)

    def model(self):
        t = self.task
        return GPT(GPTConfig(vocab=t.vocab, block=t.block, layers=self.layers, heads=self.heads,
                             dim=self.dim))


@dataclass
class Node:
    """One ``[[profiles]]`` table: a node's fault behaviour and the sync modes it runs under."""
    profile: fm.Profile
    modes: list = None       # None: the campaign's modes

    @classmethod
    def from_dict(cls, p, where, campaign, targets):
        """A ``[[profiles]]`` table ``p``, checked against ``campaign`` (a Config, its other
        fields checked); ``targets()``: the model's fault targets, for a pinned profile."""
        if not isinstance(p, dict):
            raise ValueError(f"{where}: a table")
        names = {f.name for f in fields(fm.Profile)} | {"modes"}
        for k in p:
            if k not in names:
                raise ValueError(f"{where}: unknown field {k!r}; fields are {sorted(names)}")
        name = p.get("name")
        if not isinstance(name, str) or not name or "/" in name or name != name.strip():
            raise ValueError(f"{where}.name: a non-empty string without '/', got {name!r}")
        modes = _modes(p["modes"], f"{where}.modes") if "modes" in p else None
        where = f"{where} ({name})"
        if p.get("reseed") and (modes or campaign.modes) != ["none"]:
            raise ValueError(f"{where}.reseed: runs free only (modes = [\"none\"]): "
                             f"its replicas see different data")
        for k in ("scale", "noise"):
            if k in p and not isinstance(p[k], list):
                raise ValueError(f"{where}.{k}: [low, high], got {p[k]!r}")
        prof = fm.Profile(**{k: tuple(v) if k in ("scale", "noise") else v
                             for k, v in p.items() if k != "modes"}).validate(where)
        prof.check_backend(backends.resolve(campaign.backend, torch.cuda.is_available()), where)
        train = campaign.train
        if prof.pin:
            prof.check_targets(targets(), train.micro_steps, where)
        if prof.rate > 0 and prof.onset >= train.steps:
            raise ValueError(f"{where}.onset: {prof.onset} is not before train.steps "
                             f"({train.steps}): the profile would never fire")
        return cls(prof, modes)

    def to_dict(self):
        d = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self.profile).items()}
        if self.modes is not None:
            d["modes"] = list(self.modes)
        return d


@dataclass
class Config:
    """A campaign: trials are ``profiles x seeds x modes``. Its own fields are checked on
    construction; ``from_dict`` (or ``load``) checks the tables too, profiles against the rest."""
    seed: int = 0            # the campaign's seed: the data and fault streams derive from it
    seeds: int = 1           # trials per profile and mode
    threads: int = 1         # torch threads per trial (results depend on it)
    modes: list = field(default_factory=lambda: ["computation"])   # from sync.MODES
    backend: str = backends.REFERENCE
    train: TrainConfig = field(default_factory=TrainConfig)
    profiles: list = field(default_factory=list)                   # Node (from_dict: at least one)

    def __post_init__(self):
        for k, low in (("seed", 0), ("seeds", 1), ("threads", 1)):
            v = getattr(self, k)
            if not fm.whole(v) or v < low:
                raise ValueError(f"config.{k}: a whole number >= {low}, got {v!r}")
        self.modes = _modes(self.modes, "config.modes")
        if self.backend not in backends.names():
            raise ValueError(f"config.backend: {' | '.join(backends.names())}, got {self.backend!r}")
        if not isinstance(self.train, TrainConfig):
            raise ValueError(f"config.train: a TrainConfig, got {self.train!r}")

    @classmethod
    def from_dict(cls, d):
        """The config from a parsed TOML or JSON table; a bad field raises ValueError naming it."""
        _table(d, tuple(f.name for f in fields(cls)), "config")
        cfg = cls(**{k: v for k, v in d.items() if k not in ("train", "profiles")})
        train = d.get("train", {})
        _table(train, tuple(f.name for f in fields(TrainConfig)), "config.train")
        cfg.train = TrainConfig(**train)
        profiles = d.get("profiles")
        if not isinstance(profiles, list) or not profiles:
            raise ValueError("config.profiles: a list of node profiles ([[profiles]] tables)")
        seen = set()
        targets = functools.cache(lambda: fm.targets(cfg.train.model()))
        for i, p in enumerate(profiles):
            node = Node.from_dict(p, f"config.profiles[{i}]", cfg, targets)
            if node.profile.name in seen:
                raise ValueError(f"config.profiles[{i}].name: {node.profile.name!r} appears twice")
            seen.add(node.profile.name)
            cfg.profiles.append(node)
        return cfg

    def to_dict(self):
        """The resolved config: every field, defaults spelled out (plain JSON values)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        return d | {"modes": list(self.modes), "train": asdict(self.train),
                    "profiles": [n.to_dict() for n in self.profiles]}

    def with_train(self, **changes):
        """The same campaign with ``train`` fields changed, checked again."""
        d = self.to_dict()
        d["train"].update(changes)
        return Config.from_dict(d)


def _table(d, names, where):
    if not isinstance(d, dict):
        raise ValueError(f"{where}: a table of fields {names}, got {d!r}")
    for k in d:
        if k not in names:
            raise ValueError(f"{where}: unknown field {k!r}; fields are {names}")


def _modes(modes, where):
    if not isinstance(modes, list) or not modes or any(m not in MODES for m in modes):
        raise ValueError(f"{where}: a list from {MODES}, got {modes!r}")
    return modes


def loads(text, fmt="toml", path=None):
    """The config a TOML or JSON text holds (``path``: the file it came from, for messages)."""
    try:
        d = json.loads(text) if fmt == "json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"{path}: not valid {fmt.upper()}: {e}") from e
    return Config.from_dict(d)


def load(path=None):
    """The config from a TOML or JSON file (by its ending), or ``DEFAULT``; checked."""
    if path is None:
        return loads(DEFAULT)
    with open(path, encoding="utf-8") as f:
        return loads(f.read(), "json" if str(path).endswith(".json") else "toml", path)
