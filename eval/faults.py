"""Fault models for the evaluation: sites, corruptions, spatial patterns, timing, node profiles.

A ``Profile`` is one unhealthy node: how often it corrupts (``rate``), when (``timing``:
``transient`` faults at random steps, ``intermittent`` bursts after long quiet stretches from a
delayed ``onset``, ``permanent`` from ``onset`` on, the same unit every step), where (``sites``),
how (``kinds``, ``bits``, ``multi_bit``) and in what shape (``patterns``; ``periodic``: runs of
four wrong elements repeating along a row, as AEGIS saw on faulty GPUs). ``pin`` fixes any of
site, module, phase, micro-step, row, column and (for ``optimizer_state``) the Adam moment;
``trigger`` makes a GEMM fault fire only on
products with an inner dimension of at least ``min_k`` or an operand value of magnitude at least
``operand_above`` (the load-dependent defects); ``per_gemm`` makes a permanent GEMM fault a
defective unit that fires on each GEMM call (any module and phase, unless pinned) with that
probability, as real defects do (AEGIS: about 2e-9 per GEMM). The default mix of
corruptions follows NVIDIA's gate-level study of GPU SDC (DSN'26): zeroing about half of the
outcomes, bit flips most of the rest, NaN/Inf about 1%, single-bit flips under 40% of flips.

``schedule`` draws a trial's ``FaultEvent`` list from a profile with a seeded RNG: at most one
event per step, so every mismatch and alarm of a step belongs to that step's event. Events of one
fault (a permanent unit firing every step, an intermittent burst) share its ``fault`` id. A
permanent bit fault is stuck, not toggled: its first application flips the bits, every later one
forces them to those values (``stuck``: ``stuck_at`` 0 or 1, or the complement of the first
corrupted element's bits at the first application; every element of the pattern is forced to
that value, so elements already holding it, and later applications, change nothing). ``Armed``
installs one event on the faulty replica for the duration of one micro-step and records what was
really corrupted (``event.applied``), which is the ground truth the cross-check scores against.

Sites (``phase`` in brackets):
- ``gemm_accumulator`` (forward, and both backward GEMMs): through ``abft.inject``, the product
  is corrupted before its check, as a fault in the GEMM's arithmetic would.
- ``gemm_operand`` (forward: the input activation; backward: the incoming gradient, which both
  backward GEMMs read): corrupted in memory (no version bump) after it was made and before the
  GEMM reads it: in the module's first forward pre-hook, or in a hook on the output's gradient
  registered after those already there. Every reader of that memory sees it, autograd's saved
  copy too.
- ``gemm_output`` (forward, grad_input / grad_a, grad_weight): after the check.
- ``weight_memory``: a weight matrix at rest, changed through ``.data`` (no version bump), before
  micro-step ``micro_step``'s forward: at 0 the next forward takes fresh checksums, later ones
  find checksums cached from the step's first forward.
- ``optimizer_state``: an Adam moment at rest, before the step.
- ``nongemm_op``: the output of a softmax, layer norm or GELU.
- ``gradient_comm``: a parameter gradient after backward, as a faulty all-reduce would leave it.
"""
import math
import random
from dataclasses import asdict, dataclass, field

import torch

from abft import hook as _hook
from abft.kernels import backends, layout as L

SITES = ("gemm_accumulator", "gemm_operand", "gemm_output", "weight_memory", "optimizer_state",
         "nongemm_op", "gradient_comm")
GEMM_SITES = SITES[:3]
KINDS = ("zero", "bitflip", "signflip", "nonfinite", "scale", "noise")
# the injection (``abft.hook.KINDS``) that makes each kind of event (``injection``)
HOOK_KIND = {"zero": "zero", "bitflip": "bitflip", "signflip": "bitflip", "nonfinite": "value",
             "scale": "scale", "noise": "scale"}
BIT_CLASSES = ("sign", "exponent_msb", "exponent", "mantissa_high", "mantissa_low")
PATTERNS = _hook.PATTERNS           # the injection patterns, as the hook names them
PINS = ("site", "module", "phase", "micro_step", "row", "col", "state")
STATES = ("exp_avg", "exp_avg_sq")
TRIGGERS = ("min_k", "operand_above")
TIMINGS = ("transient", "intermittent", "permanent")
PHASES = ("forward", "backward")

# outcome mix after the DSN'26 gate-level study (see the module docstring)
DEFAULT_KINDS = {"zero": 0.48, "bitflip": 0.42, "signflip": 0.04, "nonfinite": 0.01,
                 "scale": 0.03, "noise": 0.02}
DEFAULT_BITS = {"sign": 1, "exponent_msb": 1, "exponent": 7, "mantissa_high": 7, "mantissa_low": 16}


def bit_classes(dtype=torch.float32):
    """Bit positions of each class for a floating dtype (fp32: sign 31, exponent MSB 30, exponent
    23-29, high mantissa 16-22, low mantissa 0-15)."""
    width = torch.finfo(dtype).bits
    nmant = {64: 52, 32: 23}.get(width, 10 if dtype == torch.float16 else 7)
    high = max(0, nmant - 7)
    return {"sign": [width - 1], "exponent_msb": [width - 2], "exponent": list(range(nmant, width - 2)),
            "mantissa_high": list(range(high, nmant)), "mantissa_low": list(range(0, high))}


def bit_class(bit, dtype=torch.float32):
    for name, bits in bit_classes(dtype).items():
        if bit in bits:
            return name
    raise ValueError(f"bit {bit} outside {dtype}")


@dataclass
class Profile:
    """One node's fault behaviour. Weights (``sites``, ``kinds``, ...) need not sum to 1."""
    name: str
    rate: float = 0.2
    timing: str = "transient"
    onset: int = 0
    burst: int = 3
    quiet: int = 15
    sites: dict = field(default_factory=lambda: {"gemm_accumulator": 1.0})
    kinds: dict = field(default_factory=lambda: dict(DEFAULT_KINDS))
    bits: dict = field(default_factory=lambda: dict(DEFAULT_BITS))
    multi_bit: float = 0.6
    patterns: dict = field(default_factory=lambda: {"element": 1.0})
    phases: dict = field(default_factory=lambda: {"forward": 1.0, "backward": 1.0})
    scale: tuple = (1e-3, 1e3)
    noise: tuple = (1e-4, 1.0)
    pin: dict = field(default_factory=dict)
    trigger: dict = field(default_factory=dict)
    per_gemm: float = None
    reseed: int = 0          # > 0: no fault; F trains on other data (the healthy noise floor)
    stuck_at: int = None     # permanent bit faults: 0 or 1; None: the complement of the first
                             # value the fault meets, kept

    def validate(self, where="profile"):
        def check(name, weights, allowed):
            if not isinstance(weights, dict) or not weights:
                raise ValueError(f"{where}.{name}: a table of weights over {allowed}")
            for k, v in weights.items():
                if k not in allowed:
                    raise ValueError(f"{where}.{name}: unknown {k!r}; one of {allowed}")
                if not is_number(v) or v < 0:
                    raise ValueError(f"{where}.{name}.{k}: a finite weight >= 0, got {v!r}")
            if sum(weights.values()) <= 0:
                raise ValueError(f"{where}.{name}: the weights sum to 0")
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"{where}.name: a non-empty string")
        if not is_number(self.rate) or not 0 <= self.rate <= 1:
            raise ValueError(f"{where}.rate: a probability in [0, 1], got {self.rate!r}")
        if self.timing not in TIMINGS:
            raise ValueError(f"{where}.timing: one of {TIMINGS}, got {self.timing!r}")
        for name in ("onset", "burst", "quiet"):
            v = getattr(self, name)
            if not whole(v) or v < 0 or (name == "burst" and v < 1):
                raise ValueError(f"{where}.{name}: a whole number >= {int(name == 'burst')}, got {v!r}")
        check("sites", self.sites, SITES)
        check("kinds", self.kinds, KINDS)
        check("bits", self.bits, BIT_CLASSES)
        check("patterns", self.patterns, PATTERNS)
        check("phases", self.phases, PHASES)
        if not is_number(self.multi_bit) or not 0 <= self.multi_bit <= 1:
            raise ValueError(f"{where}.multi_bit: a probability in [0, 1], got {self.multi_bit!r}")
        self._validate_pins(where)
        if not whole(self.reseed) or self.reseed < 0:
            raise ValueError(f"{where}.reseed: a whole number >= 0, got {self.reseed!r}")
        if self.stuck_at not in (None, 0, 1) or isinstance(self.stuck_at, bool):
            raise ValueError(f"{where}.stuck_at: 0 or 1 (unset: the complement of the first value "
                             f"met), got {self.stuck_at!r}")
        if self.reseed and self.rate > 0:
            raise ValueError(f"{where}.reseed: a reseeded healthy replica has no faults (rate = 0)")
        for name in ("scale", "noise"):
            v = getattr(self, name)
            if not isinstance(v, (list, tuple)) or len(v) != 2 or not all(map(is_number, v)) \
                    or not 0 < v[0] <= v[1]:
                raise ValueError(f"{where}.{name}: [low, high], finite, 0 < low <= high, got {v!r}")
        return self


    def _validate_pins(self, where):
        for name, table, keys in (("pin", self.pin, PINS), ("trigger", self.trigger, TRIGGERS)):
            if not isinstance(table, dict):
                raise ValueError(f"{where}.{name}: a table over {keys}")
            for k in table:
                if k not in keys:
                    raise ValueError(f"{where}.{name}: unknown {k!r}; one of {keys}")
        pin = self.pin
        gemm_only = ({pin["site"]} if "site" in pin else set(self.sites)) <= {"gemm_accumulator"}
        if "site" in pin and pin["site"] not in SITES:
            raise ValueError(f"{where}.pin.site: one of {SITES}, got {pin['site']!r}")
        for k in ("micro_step", "row", "col"):
            if k in pin and (not whole(pin[k]) or pin[k] < 0):
                raise ValueError(f"{where}.pin.{k}: a whole number >= 0, got {pin[k]!r}")
        phases = ("forward", "grad_input", "grad_weight", "grad_a", "grad_b", "backward", "rest")
        if "phase" in pin and pin["phase"] not in phases:
            raise ValueError(f"{where}.pin.phase: one of {phases}, got {pin['phase']!r}")
        if "state" in pin and pin["state"] not in STATES:
            raise ValueError(f"{where}.pin.state: one of {STATES}, got {pin['state']!r}")
        if "state" in pin and ({pin["site"]} if "site" in pin else
                               {k for k, w in self.sites.items() if w > 0}) != {"optimizer_state"}:
            raise ValueError(f"{where}.pin.state: optimizer_state faults only (sites)")
        if "module" in pin and not isinstance(pin["module"], str):
            raise ValueError(f"{where}.pin.module: a module name, got {pin['module']!r}")
        t = self.trigger
        if "min_k" in t and (not whole(t["min_k"]) or t["min_k"] < 1):
            raise ValueError(f"{where}.trigger.min_k: a whole number >= 1, got {t['min_k']!r}")
        if "operand_above" in t and (not is_number(t["operand_above"]) or t["operand_above"] <= 0):
            raise ValueError(f"{where}.trigger.operand_above: a number > 0, got {t['operand_above']!r}")
        if t and not gemm_only:
            raise ValueError(f"{where}.trigger: GEMM-accumulator faults only (sites)")
        if self.per_gemm is not None:
            if not is_number(self.per_gemm) or not 0 < self.per_gemm <= 1:
                raise ValueError(f"{where}.per_gemm: a probability in (0, 1], got {self.per_gemm!r}")
            if self.timing != "permanent" or not gemm_only:
                raise ValueError(f"{where}.per_gemm: a permanent (timing) GEMM-accumulator "
                                 f"(sites) defect only")

    def check_backend(self, backend, where="profile"):
        """A backend with ``kernel_faults`` (the fused kernel) corrupts its fp32 accumulator in the
        kernel: one element, one bit flipped or the element zeroed (``abft.hook.kernel_injection``).
        A profile that can draw another accumulator fault there is refused before the run."""
        sites = {self.pin["site"]} if "site" in self.pin else {k for k, w in self.sites.items() if w}
        if not backends.get(backend).kernel_faults or not self.rate or "gemm_accumulator" not in sites:
            return
        drawn = lambda table: sorted(k for k, w in table.items() if w > 0)   # noqa: E731
        if drawn(self.patterns) != ["element"]:
            raise ValueError(f"{where}.patterns: the {backend} backend injects element accumulator "
                             f"faults only, got {drawn(self.patterns)}")
        ok = [k for k in KINDS if HOOK_KIND[k] in L.INJECT_KINDS]
        other = [k for k in drawn(self.kinds) if k not in ok]
        if other:
            raise ValueError(f"{where}.kinds: the {backend} backend injects {', '.join(ok)} "
                             f"accumulator faults only, got {other}")
        flips = {"bitflip", "signflip"} & set(drawn(self.kinds))
        if "bitflip" in flips and self.multi_bit > 0:
            raise ValueError(f"{where}.multi_bit: 0 under the {backend} backend (it flips one bit), "
                             f"got {self.multi_bit!r}")
        if flips and self.timing == "permanent":
            raise ValueError(f"{where}.timing: a permanent bit fault is a stuck bit, which the "
                             f"{backend} backend does not inject; use transient or intermittent")

    def check_targets(self, tg, micro_steps, where="profile"):
        """The pins against a model's targets (``targets(model)``)."""
        pin = self.pin
        if "micro_step" in pin and pin["micro_step"] >= micro_steps:
            raise ValueError(f"{where}.pin.micro_step: below train.micro_steps ({micro_steps}), "
                             f"got {pin['micro_step']}")
        sites = [pin["site"]] if "site" in pin else [k for k, w in self.sites.items() if w > 0]
        for site in sites:               # every site the profile can draw must take the pins
            pool = set(tg["gemm"]) if site in GEMM_SITES else set(tg["nongemm"]) \
                if site == "nongemm_op" else set(tg["weights"].values())
            mods = [pin["module"]] if "module" in pin else sorted(pool)
            if "module" in pin and pin["module"] not in pool:
                raise ValueError(f"{where}.pin.module: {pin['module']!r} is not a target of "
                                 f"{site}; one of {sorted(pool)}")
            if "phase" in pin:
                ok = set.intersection(*(set(_phases(site, tg["gemm"].get(m))) for m in mods))
                if pin["phase"] not in ok:
                    raise ValueError(f"{where}.pin.phase: {pin['phase']!r} is not a phase of "
                                     f"{site} at {pin.get('module', 'every module')}; one of "
                                     f"{sorted(ok)}")


def _phases(site, op):
    """The phases a site can take on a module (op: linear | matmul | None)."""
    if site == "gemm_accumulator":
        return ("forward", "grad_input", "grad_weight") if op == "linear" else \
            ("forward", "grad_a", "grad_b")
    if site == "gemm_operand":
        return ("forward", "backward")
    if site == "gemm_output":
        return ("forward", "grad_input", "grad_weight") if op == "linear" else ("forward", "grad_a")
    if site == "nongemm_op":
        return ("forward",)
    if site == "gradient_comm":
        return ("backward",)
    return ("rest",)


@dataclass
class FaultEvent:
    """One fault, as drawn (site, target, corruption) and as applied (``applied``)."""
    id: int
    step: int
    micro_step: int
    site: str
    module: str          # the module (or, at rest, the parameter's module)
    phase: str           # forward | grad_input | grad_weight | grad_a | grad_b | backward | rest
    kind: str
    pattern: str
    bits: list = None
    urow: float = 0.0    # position as fractions of the target's rows and columns
    ucol: float = 0.0
    factor: float = None
    param: str = None    # weight_memory, optimizer_state, gradient_comm, gemm_output/grad_weight
    state: str = None    # optimizer_state: exp_avg | exp_avg_sq
    applied: list = field(default_factory=list)
    fault: int = None    # the distinct fault this event belongs to (its first event's id)
    timing: str = "transient"
    row: int = None      # pinned place (else urow, ucol)
    col: int = None
    trigger: dict = None
    per_gemm: float = None   # a defective unit: fires on each GEMM call with this probability
    every_micro_step: bool = False   # armed in every micro-step (per_gemm, none pinned)
    stream: int = 0      # the trial's fault stream (seeds the per-call and noise draws)
    stuck_at: int = None
    shared: dict = field(default=None, repr=False, compare=False)   # one stuck fault's memory

    @property
    def stuck_bits(self):
        """A permanent bit fault's bits are stuck (set or cleared), not toggled."""
        return self.timing == "permanent" and self.kind in ("bitflip", "signflip")

    def to_dict(self):
        d = asdict(self)
        shared = d.pop("shared") or {}
        if self.stuck_bits:
            d["stuck"] = shared.get("value")
        return d


def whole(v):
    """A whole number (bool is not one)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v):
    """A finite int or float (bool is not a number here)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _pick(rng, weights):
    keys = [k for k, w in weights.items() if w > 0]
    return rng.choices(keys, [weights[k] for k in keys])[0]


def _loguniform(rng, lo, hi):
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def targets(model):
    """What each site can hit in ``model``: GEMM modules (name -> linear | matmul), non-GEMM
    modules, and weight matrices (parameter name -> module name)."""
    from abft.eval.models import GELU, MatMul, Softmax
    gemm, other = {}, []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            gemm[name] = "linear"
        elif isinstance(mod, MatMul):
            gemm[name] = "matmul"
        elif isinstance(mod, (Softmax, GELU, torch.nn.LayerNorm)):
            other.append(name)
    weights = {n: n.rpartition(".")[0] for n, p in model.named_parameters() if p.dim() == 2}
    return {"gemm": gemm, "nongemm": other, "weights": weights}


def _draw(profile, rng, tg, micro_steps):
    """One fault's site, target and corruption (without step), pins applied."""
    pin = profile.pin
    site = _pick(rng, profile.sites)
    site = pin.get("site", site)
    ev = dict(site=site, micro_step=rng.randrange(micro_steps), param=None, state=None)
    if site in GEMM_SITES:
        module = rng.choice(sorted(tg["gemm"]))
        module = pin.get("module", module)
        op = tg["gemm"][module]
        fwd = _pick(rng, profile.phases) == "forward"
        if site == "gemm_accumulator":
            phase = "forward" if fwd else rng.choice(
                ("grad_input", "grad_weight") if op == "linear" else ("grad_a", "grad_b"))
        elif site == "gemm_operand":
            phase = "forward" if fwd else "backward"
        else:
            phase = "forward" if fwd else rng.choice(
                ("grad_input", "grad_weight") if op == "linear" else ("grad_a",))
            if phase == "grad_weight":
                ev["param"] = module + ".weight"
        ev.update(module=module, phase=phase)
    elif site == "nongemm_op":
        ev.update(module=pin.get("module", rng.choice(sorted(tg["nongemm"]))), phase="forward")
    else:
        param = rng.choice(sorted(tg["weights"]))
        if "module" in pin:
            param = next(p for p, m in sorted(tg["weights"].items()) if m == pin["module"])
        ev.update(module=tg["weights"][param], param=param, phase="rest")
        if site == "optimizer_state":
            ev.update(state=pin.get("state", rng.choice(STATES)), micro_step=0)
        elif site == "gradient_comm":
            ev.update(phase="backward", micro_step=micro_steps - 1)
    kind = _pick(rng, profile.kinds)
    ev.update(kind=kind, pattern=_pick(rng, profile.patterns), urow=rng.random(), ucol=rng.random())
    if kind == "bitflip":
        pool = bit_classes()[_pick(rng, {k: v for k, v in profile.bits.items() if bit_classes()[k]})]
        n = rng.choice((2, 3)) if rng.random() < profile.multi_bit and len(pool) > 1 else 1
        ev["bits"] = sorted(rng.sample(pool, min(n, len(pool))))
    elif kind == "signflip":
        ev["bits"] = bit_classes()["sign"]
    elif kind == "nonfinite":
        ev["factor"] = rng.choice((math.nan, math.inf, -math.inf))
    elif kind == "scale":
        ev["factor"] = _loguniform(rng, *profile.scale) * rng.choice((1, -1))
    elif kind == "noise":
        ev["factor"] = _loguniform(rng, *profile.noise)
    for k in ("phase", "micro_step"):
        if k in pin:
            ev[k] = pin[k]
    if site == "gemm_output":
        ev["param"] = ev["module"] + ".weight" if ev["phase"] == "grad_weight" else None
    ev.update(row=pin.get("row"), col=pin.get("col"), trigger=dict(profile.trigger) or None,
              per_gemm=profile.per_gemm, stuck_at=profile.stuck_at)
    if profile.per_gemm is not None:        # any GEMM call, any micro-step, unless pinned
        ev.update(module=pin.get("module", "*"), phase=pin.get("phase", "*"),
                  micro_step=pin.get("micro_step", 0), every_micro_step="micro_step" not in pin)
    return ev


def schedule(profile, steps, micro_steps, tg, seed):
    """The trial's fault events, at most one per step, drawn from ``profile`` with ``seed``."""
    rng = random.Random(seed)
    if profile.rate <= 0:
        return []
    if profile.timing == "transient":
        on = [s for s in range(profile.onset, steps) if rng.random() < profile.rate]
    elif profile.timing == "permanent":
        on = list(range(profile.onset, steps))
    else:
        on, s = [], profile.onset
        while s < steps:
            on += [t for t in range(s, min(s + profile.burst, steps)) if rng.random() < profile.rate]
            s += profile.burst + max(1, round(rng.expovariate(1 / max(profile.quiet, 1))))
    events, fixed, shared = [], None, {}
    for i, s in enumerate(on):
        fault = i
        if profile.timing == "permanent":
            fixed = fixed or _draw(profile, rng, tg, micro_steps)     # one stuck unit
            ev, fault = dict(fixed), 0
        elif profile.timing == "intermittent" and events and s - events[-1].step == 1:
            ev = dict(_draw(profile, rng, tg, micro_steps))           # a burst: same unit,
            last = events[-1]                                         # a new corruption
            ev.update(site=last.site, module=last.module, phase=last.phase, param=last.param,
                      state=last.state, micro_step=last.micro_step)
            fault = last.fault
        else:
            ev = _draw(profile, rng, tg, micro_steps)
        events.append(FaultEvent(id=i, step=s, fault=fault, timing=profile.timing, stream=seed,
                                 shared=shared if profile.timing == "permanent" else {}, **ev))
    return events


# ---------------------------------------------------------------- applying one event

def injection(ev, shape, dtype):
    """The ``abft.hook.Injection`` that makes ``ev``'s corruption on a (..., M, N) tensor."""
    m, n = (shape[-2], shape[-1]) if len(shape) >= 2 else (1, shape[-1])
    row = min(int(ev.urow * m) if ev.row is None else ev.row, m - 1)
    col = min(int(ev.ucol * n) if ev.col is None else ev.col, n - 1)
    kw = dict(pattern=ev.pattern, row=row, col=col, size=(min(16, m - row), min(16, n - col)),
              stride=32)
    if ev.pattern == "periodic":            # 4 consecutive elements every 32 columns
        kw["size"] = (1, 4)
    if ev.pattern in ("row", "strided"):
        kw["col"] = col if ev.pattern == "strided" else 0
    if ev.pattern == "column":
        kw["row"] = 0
    if ev.kind in ("bitflip", "signflip"):
        bits = tuple(ev.bits)
        if ev.kind == "signflip":
            bits = (torch.finfo(dtype).bits - 1,)
        if ev.stuck_bits:          # stuck_at, or decided at the first application and kept
            value = (ev.shared or {}).get("value") if ev.stuck_at is None else \
                _hook.flip_mask(bits, torch.finfo(dtype).bits, dtype) * ev.stuck_at
            return _hook.Injection(kind="stuck", bit=bits, value=value, **kw)
        return _hook.Injection(kind="bitflip", bit=bits, **kw)
    if ev.kind == "zero":
        return _hook.Injection(kind="zero", **kw)
    if ev.kind == "nonfinite":
        return _hook.Injection(kind="value", value=ev.factor, **kw)
    if ev.kind == "scale":
        return _hook.Injection(kind="scale", value=ev.factor, **kw)
    z = random.Random(f"{ev.stream}/{ev.id}/{ev.step}").gauss(0.0, 1.0)
    return _hook.Injection(kind="scale", value=1.0 + ev.factor * z, **kw)


def _record(ev, shape, inj, before=None, after=None):
    rec = {"shape": list(shape), "row": inj.row, "col": inj.col, "pattern": inj.pattern,
           "size": list(inj.size)}
    if before is not None:
        d = (after.double() - before.double()).abs()
        changed = _hook.as_bits(after) != _hook.as_bits(before)
        rec["changed"] = int(changed.sum())
        finite = d[torch.isfinite(d)]
        rec["max_abs_error"] = float(finite.max()) if finite.numel() else 0.0
        rec["nonfinite"] = int((~torch.isfinite(after)).sum() - (~torch.isfinite(before)).sum())
    ev.applied.append(rec)


def corrupt(ev, t):
    """Corrupt ``t`` in place with ``ev``'s corruption (its first batch element for >2-D)."""
    view = t.view(1, -1) if t.dim() == 1 else t
    inj = injection(ev, view.shape, t.dtype)
    before = t.detach().clone()
    with torch.no_grad():
        inj.apply(view, None)
    _remember(ev, inj)
    _record(ev, t.shape, inj, before, t.detach())
    return t


def _remember(ev, inj):
    """A stuck fault keeps the values its first application forced."""
    if ev.stuck_bits and inj.value is not None and ev.shared is not None:
        ev.shared.setdefault("value", int(inj.value))


class _Replace(torch.autograd.Function):
    """Forward: a corrupted copy of x; backward: the gradient unchanged (the fault is in the
    value, not in the graph)."""

    @staticmethod
    def forward(ctx, x, fn):
        return fn(x.detach().clone())

    @staticmethod
    def backward(ctx, g):
        return g, None


def fault_tiles(verdict, rec, tiles):
    """The verdict records of the tiles the fault ``rec`` (an ``applied`` record) corrupted: the
    first batch element's, rows and columns from the fault's pattern; None where the verdict's
    tiling cannot be mapped onto the product's shape."""
    v = verdict.reshape(-1, *verdict.shape[-3:])[0]
    if tiles is None:
        return None
    bm, bn = tiles
    m, n = rec["shape"][-2] if len(rec["shape"]) >= 2 else 1, rec["shape"][-1]
    if tuple(v.shape[:2]) != (-(-m // bm), -(-n // bn)):
        return None          # the check saw another layout (a split or folded product)
    pattern, size = rec.get("pattern", "element"), rec.get("size") or (1, 1)
    r0, c0 = rec["row"], rec["col"]
    rows = (0, m) if pattern == "column" else (r0, r0 + (size[0] if pattern == "tile" else 1))
    cols = (0, n) if pattern == "row" else (c0, n) if pattern in ("strided", "periodic") else \
        (c0, c0 + (size[1] if pattern == "tile" else 1))
    return v[rows[0] // bm:(rows[1] - 1) // bm + 1, cols[0] // bn:(cols[1] - 1) // bn + 1]


def triggered(trigger, ctx):
    """Does a triggered fault fire on this GEMM call? (no trigger: yes)"""
    if not trigger:
        return True
    a, b = ctx.operands or (None, None)
    if a is None:
        return False
    if a.shape[-1] < trigger.get("min_k", 0):
        return False
    if "operand_above" in trigger:
        big = max(float(a.detach().abs().max()), float(b.detach().abs().max()))
        return big >= trigger["operand_above"]
    return True


class Armed:
    """Installs ``ev`` on the faulty replica for one micro-step; ``disarm()`` removes it."""

    def __init__(self, ev, model, optimizer, params):
        self.ev, self.handles, self.hook = ev, [], None
        mod = dict(model.named_modules()).get(ev.module)
        site, phase = ev.site, ev.phase
        self.calls, self.first = 0, len(ev.applied)     # this arming's records start there
        if site == "gemm_accumulator":
            times = None if ev.per_gemm is not None else 1
            self.hook = _hook.inject(when=self._match, kind="zero", times=times).start()
        elif site == "gemm_operand" and phase == "forward":
            self.handles.append(mod.register_forward_pre_hook(self._operand, prepend=True))
        elif site == "gemm_operand":
            self.handles.append(mod.register_forward_hook(self._arm_grad_output, prepend=True))
        elif site == "gemm_output" and phase == "forward":
            self.handles.append(mod.register_forward_hook(self._output_in_place, prepend=True))
        elif site == "nongemm_op":
            self.handles.append(mod.register_forward_hook(self._output, prepend=True))
        elif site == "gemm_output" and phase in ("grad_input", "grad_a"):
            self.handles.append(mod.register_full_backward_hook(self._grad_input_in_place,
                                                                prepend=True))
        elif site == "gemm_output":
            self.handles.append(params[ev.param].register_hook(self._in_place))
        elif site == "weight_memory":
            corrupt(ev, params[ev.param].data)
        elif site == "optimizer_state":
            state = optimizer.state.get(params[ev.param], {})
            if ev.state in state:                     # no moments before the first step
                corrupt(ev, state[ev.state].data)

    def _match(self, ctx):
        ev = self.ev
        if ctx.attempt or ctx.labels.get("replica") != "F":
            return False
        if ev.module != "*" and ctx.module != ev.module or ev.phase != "*" and ctx.phase != ev.phase:
            return False
        if not triggered(ev.trigger, ctx):
            return False
        if ev.per_gemm is not None:         # a defective unit: each call, with its probability
            self.calls += 1
            draw = random.Random(f"{ev.stream}/{ev.step}/{ctx.labels.get('micro_step')}/"
                                 f"{self.calls}")
            if draw.random() >= ev.per_gemm:
                return False
        slot = self.hook.injection
        if slot.kind == "stuck":
            _remember(self.ev, slot)          # decided by an earlier call of this micro-step
        inj = injection(self.ev, ctx.shape, ctx.dtype)
        slot.retarget(inj)
        _record(self.ev, ctx.shape, inj)
        a = (ctx.operands or (None,))[0]
        self.ev.applied[-1].update(module=ctx.module, phase=ctx.phase,
                                   k=None if a is None else int(a.shape[-1]))
        return True

    def _operand(self, mod, args):
        """The input activation changed in memory (no version bump) after its producer wrote
        it, as the module is about to read it: every reader of that memory sees it (autograd's
        saved copy for the backward too), as with a flip in HBM or a buffer on the way."""
        corrupt(self.ev, args[0].data)

    def _arm_grad_output(self, mod, args, out):
        """The incoming gradient changed in memory once autograd has made it, before the
        module's backward products read it: a hook on the output's gradient, after those
        already there."""
        if torch.is_tensor(out) and out.requires_grad:
            self.handles.append(out.register_hook(self._grad_output))

    def _grad_output(self, grad):
        corrupt(self.ev, grad.data)

    def _output(self, mod, args, out):
        return _Replace.apply(out, lambda x: corrupt(self.ev, x))

    def _output_in_place(self, mod, args, out):
        """A GEMM's stored output changed after its check, in memory (no version bump): every
        reader sees it, as with a flip in HBM."""
        corrupt(self.ev, out.data)

    def _grad_input_in_place(self, mod, grad_input, grad_output):
        """A GEMM's stored gradient output changed after its check (as ``_output_in_place``)."""
        if grad_input[0] is not None:
            corrupt(self.ev, grad_input[0].data)

    def _in_place(self, g):
        corrupt(self.ev, g.data)

    def grads(self, params):
        """The ``gradient_comm`` corruption, after backward."""
        if self.ev.site == "gradient_comm" and params[self.ev.param].grad is not None:
            corrupt(self.ev, params[self.ev.param].grad.data)

    def disarm(self):
        for h in self.handles:
            h.remove()
        self.handles = []
        if self.hook is not None:
            self.hook.stop()
            if self.hook.injection.kind == "stuck":
                _remember(self.ev, self.hook.injection)
            for ctx, rec in zip(self.hook.hits, self.ev.applied[self.first:]):
                rec["changed"] = ctx.changed          # None: the kernel corrupted it, unseen
                v = ctx.verdict
                if v is not None:   # the worst residual / threshold of the tiles it corrupted
                    mine = fault_tiles(v, rec, ctx.tiles)
                    rec["ratio_of"] = "product" if mine is None else "tiles"
                    v = v if mine is None else mine
                    rec["ratio"] = float(torch.maximum(v[..., L.ROW_RATIO], v[..., L.COL_RATIO]).max())
                    rec["status"] = float(v[..., L.STATUS].max())
            self.hook = None
