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
from abft.hook import inject
from abft.autograd import addmm, baddbmm, bmm, linear, matmul, mm
from abft.grouped import grouped_mm
from abft import nn
from abft.nn import protect, unprotect
from abft.interception import checked
from abft.guard.step import GuardHalt, StepGuard
from abft.detectors.rest import RestCheck
from abft.detectors.recompute import RecomputeCheck
from abft.detectors.comm import CommCheck
from abft.guard.ledger import Ledger
from abft.detectors.outputs import OutputCheck
from abft.detectors import outputs as _outputs
from abft import coverage as _coverage
from abft import policy as _policy
from abft.alarms import default_log as _default_log


def flush():
    """Resolve every pending verdict; returns the alarms found (a list of Alarm)."""
    return _policy.flush()


def alarms():
    """The process's alarm log (after resolving pending verdicts)."""
    _policy.resolve()
    return _default_log()


def stats():
    """Counters: checked_calls, tiles, unverified_calls, unverified_tiles, sampled_out_calls,
    alarms; and ``margins`` (see ``margin()``)."""
    return _policy.stats()


def margin(file=None):
    """How close clean checks came to alarming: per op and module, the largest residual /
    threshold of a clean call (1 would alarm), its phase and the clean calls counted, from the
    closest down. Prints the table (to ``file``, default stdout) and returns the rows.

    A ratio creeping toward 1 on clean data from step to step, or near 1 in a float32 output, is
    worth reporting with the shapes and dtype. Near 1 in a bf16/fp16 output, where one stored
    element carries a sum, is its rounding filling the deterministic part of the threshold
    (docs/check.md, "How close clean checks come"): that part cannot be exceeded."""
    import sys
    _policy.resolve()
    rows = _policy.margins()
    out = file or sys.stdout
    print(f"{'worst':>8}  {'phase':<12} {'calls':>6}  op / module", file=out)
    for r in rows:
        print(f"{r['worst']:8.4f}  {str(r['phase']):<12} {r['calls']:6d}  {r['op']} / {r['module'] or '<top>'}",
              file=out)
    return rows


def coverage():
    """Per op and module: checked, sampled-out and unverified calls, and the GEMM-like ops seen
    that nothing checked (``unprotected``: SDPA, convolutions, einsum forms that are not products)."""
    _policy.resolve()
    return _coverage.report()


def reset():
    """Resolve pending verdicts, then clear the alarm log and the counters."""
    _policy.flush()
    _default_log().clear()
    _policy.reset_stats()
    _coverage.reset()
    _outputs.forget_sites()


__all__ = ["StepGuard", "GuardHalt", "RestCheck", "RecomputeCheck", "CommCheck", "Ledger", "OutputCheck", "matmul", "mm", "bmm", "addmm", "baddbmm", "linear", "grouped_mm", "scope", "config", "inject",
           "flush", "alarms", "stats", "margin", "coverage", "reset", "protect", "unprotect", "checked", "nn", "Alarm", "AlarmLog", "SilentCorruptionError",
           "__version__"]
