"""Labels that alarms carry: ``with abft.scope(step=..., micro_step=..., replica=..., module=...)``.

Scopes nest (inner labels override outer ones). Each checked call takes a call id from the
innermost scope's counter, so two replicas running the same code in their own scopes give their
calls the same ids, and a fault, an alarm and a mismatch join on
(replica, step, micro_step, module, phase, call id). A scope may carry its own AlarmLog.
"""
import contextvars
import os

LABELS = ("step", "micro_step", "replica", "module", "phase")


class Scope:
    def __init__(self, labels, log=None, parent=None):
        base = dict(parent.labels) if parent is not None else {k: None for k in LABELS}
        base.update(labels)
        self.labels = base
        self.log = log if log is not None else (parent.log if parent is not None else None)
        self.calls = 0

    def next_call_id(self):
        cid = self.calls
        self.calls += 1
        return cid


_root = Scope({})
_current = contextvars.ContextVar("abft_scope", default=_root)


def current():
    return _current.get()


class scope:
    """Set labels (and optionally an ``AlarmLog``) for the checked calls inside the block.

    Example:
        >>> with abft.scope(step=3, replica="faulty", log=AlarmLog()):
        ...     y = abft.matmul(x, w)
    """

    def __init__(self, log=None, **labels):
        self._labels = labels
        self._log = log
        self._token = None
        self.scope = None

    def __enter__(self):
        self.scope = Scope(self._labels, self._log, parent=current())
        self._token = _current.set(self.scope)
        return self.scope

    def __exit__(self, *exc):
        _current.reset(self._token)
        return False


def current_rank():
    if _dist is not None and _dist.is_initialized():
        return _dist.get_rank()
    return int(os.environ.get("RANK", 0))


try:
    import torch.distributed as _dist
    if not _dist.is_available():
        _dist = None
except Exception:  # pragma: no cover - a broken distributed install is not our concern here
    _dist = None
