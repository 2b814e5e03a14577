"""abft: checked GEMMs against silent data corruption.

    import abft
    c = abft.matmul(a, b)                  # torch.matmul's values, checked tile by tile
    with abft.scope(step=3, module="mlp"):
        y = abft.linear(x, w, b)
    abft.flush()                           # resolve queued verdicts -> new alarms
    abft.alarms()                          # every alarm so far (an AlarmLog)
    abft.config(policy="raise")            # record | warn | raise | recompute | correct
"""
from abft._version import __version__
from abft.alarms import Alarm, AlarmLog, SilentCorruptionError
from abft.settings import config
from abft.context import scope
from abft.faults import inject
from abft.autograd import addmm, baddbmm, bmm, linear, matmul, mm
from abft import nn
from abft.nn import protect, unprotect
from abft.mode import checked
from abft.guard import GuardHalt, StepGuard
from abft import coverage as _coverage
from abft import policy as _policy
from abft.alarms import default_log as _default_log


def flush():
    """Resolve every pending verdict; returns the alarms found (a list of Alarm)."""
    return _policy.flush()


def alarms():
    """The process's alarm log (after resolving pending verdicts)."""
    _policy.flush()
    return _default_log()


def stats():
    """Counters: checked_calls, tiles, unverified_calls, unverified_tiles, sampled_out_calls, alarms."""
    return _policy.stats()


def coverage():
    """Per op and module: checked, sampled-out and unverified calls, and the GEMM-like ops seen
    that nothing checked (``unprotected``: SDPA, convolutions, einsum forms that are not products)."""
    _policy.flush()
    return _coverage.report()


def reset():
    """Resolve pending verdicts, then clear the alarm log and the counters."""
    _policy.flush()
    _default_log().clear()
    _policy.reset_stats()
    _coverage.reset()


__all__ = ["StepGuard", "GuardHalt", "matmul", "mm", "bmm", "addmm", "baddbmm", "linear", "scope", "config", "inject",
           "flush", "alarms", "stats", "coverage", "reset", "protect", "unprotect", "checked", "nn", "Alarm", "AlarmLog", "SilentCorruptionError",
           "__version__"]
