"""Global settings: ``abft.config(...)`` sets them, and used as a context manager restores them."""
import importlib
import math
import numbers
import operator
import os
from dataclasses import dataclass, fields, replace

from abft.kernels import backends

POLICIES = ("record", "warn", "raise", "recompute", "correct")


@dataclass(frozen=True)
class Settings:
    enabled: bool = True
    policy: str = "record"
    backend: str = "reference"
    sample_every: int = 1
    tiles: tuple = None                # (BM, BN); None: the backend's own (kernels/backends.py; the
                                       # fused kernel's are powers of two holding checksum rows too)
    log_path: str = None               # JSONL sink; may contain {rank}
    on_alarm: object = None            # callable(Alarm)
    max_pending: int = 256             # verdicts queued before they resolve themselves
    max_pending_bytes: int = 64 << 20
    lam: float = None                  # threshold multiplier override (None: abft.kernels.threshold.LAMBDA)


# called when a ``with abft.config(...)`` block exits, before its settings are restored (the
# verdict queue registers its resolve here, so settings need not import the policy module)
on_exit = []

_settings = Settings(enabled=os.environ.get("ABFT_DISABLE", "") not in ("1", "true", "yes"))


def get():
    return _settings


def _validate(s):
    if s.policy not in POLICIES:
        raise ValueError(f"abft.config: policy must be one of {POLICIES}, got {s.policy!r}")
    if s.backend not in backends.names():
        raise ValueError(f"abft.config: backend must be one of {backends.names()}, got {s.backend!r}")
    for b in backends.candidates(s.backend):
        if b.requires:
            try:
                importlib.import_module(b.requires)
            except ImportError as e:
                raise ValueError(f"abft.config: backend {s.backend!r} needs {b.requires} ({e})") from e
    if isinstance(s.sample_every, bool) or not (isinstance(s.sample_every, int) and s.sample_every >= 1):
        raise ValueError(f"abft.config: sample_every must be an int >= 1, got {s.sample_every!r}")
    if s.tiles is not None:
        t = s.tiles
        if not (len(t) == 2 and min(t) >= 1):
            raise ValueError(f"abft.config: tiles must be two positive ints, got {t!r}")
        for b in backends.candidates(s.backend):
            why = b.entry().tiles_error(*t) if b.computes else None
            if why:
                raise ValueError(f"abft.config: tiles: {why}")
    if s.on_alarm is not None and not callable(s.on_alarm):
        raise ValueError("abft.config: on_alarm must be callable")
    if not isinstance(s.enabled, bool):
        raise ValueError(f"abft.config: enabled must be True or False, got {s.enabled!r}")
    for name in ("max_pending", "max_pending_bytes"):
        v = getattr(s, name)
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise ValueError(f"abft.config: {name} must be a positive int, got {v!r}")
    if s.lam is not None and (isinstance(s.lam, bool) or not isinstance(s.lam, numbers.Real)
                              or not math.isfinite(s.lam) or s.lam <= 0):
        raise ValueError(f"abft.config: lam must be a finite number > 0 (the threshold's "
                         f"multiplier), got {s.lam!r}")


class config:
    """Set abft's settings. ``abft.config(policy="raise")`` sets them for the process;
    ``with abft.config(policy="raise"): ...`` sets them for the block and restores them after.

    Keys: enabled, policy (record | warn | raise | recompute | correct), backend (one of
    ``abft.kernels.backends.names()``: reference | triton | auto, triton on CUDA tensors; the fused
    kernel computes matmul, mm, bmm, addmm, baddbmm, linear and each group of grouped_mm, forward
    and backward), sample_every, tiles=(BM, BN), log_path, on_alarm,
    max_pending, max_pending_bytes, lam. The environment variable ABFT_DISABLE=1 starts the
    process with enabled=False.
    """

    def __init__(self, **changes):
        global _settings
        names = {f.name for f in fields(Settings)}
        unknown = set(changes) - names
        if unknown:
            raise TypeError(f"abft.config: unknown setting(s) {sorted(unknown)}; known: {sorted(names)}")
        if changes.get("tiles") is not None:
            t = changes["tiles"]
            try:
                changes["tiles"] = tuple(operator.index(x) for x in t)   # ints (numpy's too), not 1.7
            except TypeError:
                raise ValueError(f"abft.config: tiles must be two positive ints, got {t!r}") from None
        new = replace(_settings, **changes)
        _validate(new)
        if "log_path" in changes:       # opened before anything changes: a bad path changes nothing
            from abft.alarms import default_log
            default_log().set_path(new.log_path)
        self._previous = _settings
        _settings = new

    def __enter__(self):
        return _settings

    def __exit__(self, *exc):
        global _settings
        for fn in on_exit:
            fn()
        changed_path = self._previous.log_path != _settings.log_path
        _settings = self._previous
        if changed_path:
            from abft.alarms import default_log
            default_log().set_path(_settings.log_path)
        return False
