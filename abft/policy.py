"""What happens to a verdict: record | warn | raise | recompute | correct.

Verdicts of ``record`` and ``warn`` calls are queued on their device and resolved lazily (a clean
one whose summary is on the host already, the reference check's, is counted at once): by
``abft.flush()``, ``abft.alarms()``, ``abft.stats()``, the end of an ``abft.config`` block, or when
the queue holds ``max_pending`` calls or ``max_pending_bytes`` (so memory stays flat in long runs).
Resolving moves one small tensor per queued call to the host in a single transfer, and the full
verdict only for calls that alarmed. ``raise``, ``recompute`` and ``correct`` resolve at once.
"""
import collections
import threading
import time
import warnings

import numpy as np
import torch

from abft import coverage
from abft import settings as _config
from abft.alarms import SilentCorruptionError, checksum_alarm, default_log
from abft.kernels import layout as L


class Pending:
    """One checked call's verdict, queued (record, warn) or resolved at once. ``info``: its alarm
    metadata (a dict), built on first read by ``describe`` (None for a verdict whose summary is on
    the host and clean: nothing reads it); ``key`` (op, module) and ``phase`` are what counting a
    clean call needs."""
    __slots__ = ("verdict", "detail", "summary", "log", "key", "phase", "tiles", "_describe", "_info")

    def __init__(self, verdict, detail, summary, describe, log, key, phase, tiles):
        self.verdict, self.detail, self.log = verdict, detail, log
        self.summary = summary    # [alarmed tiles, unverified tiles, tiles, worst ratio]: a tuple
        #                           on the host, else a tensor on the verdict's device
        self.key, self.phase, self.tiles = key, phase, tiles
        self._describe, self._info = describe, None

    @property
    def nbytes(self):
        """The memory the verdict holds while queued."""
        return self.verdict.numel() * 4 + sum(d.numel() * d.element_size() for d in self.detail)

    @property
    def info(self):
        if self._info is None and self._describe is None:
            raise RuntimeError("a clean verdict has no alarm metadata")
        if self._info is None:
            self._info, self._describe = self._describe(), None
        return self._info


_lock = threading.RLock()
_queue = collections.deque()
_queue_bytes = 0
_stats = collections.Counter()
_reported = []          # alarms resolved or found outside a flush(), returned by the next one
_margins = {}                 # (op, module) -> [worst clean ratio, its phase, clean calls]
_before_flush = []            # detectors' deferred work, done first by every flush()


def before_flush(fn):
    """Have every ``flush()`` call ``fn()`` first (a detector that defers its checks to a safe
    point: ``abft.detectors.outputs``)."""
    if fn not in _before_flush:
        _before_flush.append(fn)


def summarize(verdict):
    """(alarmed tiles, unverified tiles, tiles, worst ratio) of a verdict: a tuple of floats on
    the CPU, a tensor on the verdict's device elsewhere (read at the flush, one transfer for all)."""
    return L.summary(verdict)


def clean_on_host(summary):
    """Whether a verdict's summary is on the host already and shows no alarmed tile (the reference
    check's, which passes): counted at once, its alarm metadata never needed."""
    return type(summary) is tuple and not summary[0]


def make_pending(verdict, detail, describe, log, summary=None, *, key, phase, tiles):
    """A checked call's verdict (``describe() -> info``, ``key`` (op, module), ``phase``, ``tiles``
    (bm, bn): ``Pending``'s); ``summary``: ``summarize(verdict)`` where the check gave it already."""
    return Pending(verdict, detail, summarize(verdict) if summary is None else summary, describe, log,
                   key, phase, tiles)


def _count(summary, p):
    alarmed, unverified, tiles, worst = summary        # floats (layout.summary, tolist())
    _stats["checked_calls"] += 1
    _stats["tiles"] += int(tiles)
    if unverified:
        _stats["unverified_calls"] += 1
        _stats["unverified_tiles"] += int(unverified)
        coverage.count(*p.key, "unverified")
    if not alarmed:
        with _lock:
            m = _margins.setdefault(p.key, [0.0, None, 0])
            if worst >= m[0]:
                m[0], m[1] = worst, p.phase
            m[2] += 1
    return alarmed > 0


def alarms_of(p, action):
    """The Alarm records of a pending check whose summary says it alarmed."""
    v = p.verdict.detach().float().cpu()
    rr, rc = (d.detach().cpu() for d in p.detail)
    info = p.info
    bm, bn = info["bm"], info["bn"]
    bad = L.alarmed(v)
    out = []
    for idx in bad.nonzero().tolist():
        *b, tp, tq = idx
        rec = v[tuple(idx)]
        nonfinite = rec[L.STATUS].item() == L.NONFINITE
        rows = (torch.nonzero(rr[tuple(b)][tp * bm:(tp + 1) * bm, tq].abs() > 1).flatten() + tp * bm).tolist()
        cols = (torch.nonzero(rc[tuple(b)][tp, tq * bn:(tq + 1) * bn].abs() > 1).flatten() + tq * bn).tolist()
        row = int(rec[L.ROW].item()) if rec[L.ROW_FAILS] > 0 else None
        col = int(rec[L.COL].item()) if rec[L.COL_FAILS] > 0 else None
        batch = tuple(b)
        if info.get("flat_batch"):          # the caller's batch coordinates, not the folded index
            batch = tuple(int(x) for x in np.unravel_index(batch[0], info["flat_batch"]))
        flat = info.get("flat_rows")
        if flat is not None and len(flat) > 1:
            # Rows of a folded (..., T, K) operand: report (batch..., row).
            unravel = lambda r: tuple(int(x) for x in np.unravel_index(r, flat))
            if row is not None:
                *bb, row = unravel(row)
                batch = tuple(bb)
            rows = [unravel(r)[-1] for r in rows]
        out.append(checksum_alarm(info, tile=idx, batch=batch, row=row, col=col, rows=rows, cols=cols,
                                  residual=rec[L.RESIDUAL], threshold=rec[L.THRESHOLD], nonfinite=nonfinite,
                                  action=action))
    return out


def emit(alarms, log):
    s = _config.get()
    logs = [log] if log is not None else []
    if log is not default_log():
        logs.append(default_log())
    for a in alarms:
        _stats["alarms"] += 1
        for lg in logs:
            lg.append(a)
    # the user's side (warnings, which may be errors, and the callback) after every alarm is
    # logged; each alarm still reaches it when an earlier one raised, and the first error is raised
    error = None
    for a in alarms:
        try:
            if a.action == "warned":
                warnings.warn(str(a), RuntimeWarning, stacklevel=3)
            if s.on_alarm is not None:
                s.on_alarm(a)
        except Exception as e:
            error = error or e
    if error is not None:
        raise error


def enqueue(p):
    global _queue_bytes
    s = _config.get()
    with _lock:
        _queue.append(p)
        _queue_bytes += p.nbytes
        full = len(_queue) >= s.max_pending or _queue_bytes >= s.max_pending_bytes
    if full:            # resolved early: the next flush() still returns these alarms
        early = flush()
        with _lock:
            _reported.extend(early)


def action(other="recorded"):
    """What a detector outside the GEMMs does under the current policy: ``recorded``,
    ``warned``, ``raised``; ``other`` for recompute and correct (its own remedy, or none)."""
    return {"record": "recorded", "warn": "warned", "raise": "raised"}.get(_config.get().policy,
                                                                            other)


def report(alarms, log):
    """Emit the alarms of a detector outside the GEMMs (``abft.RecomputeCheck``) now; the next
    ``flush()`` returns them with the GEMMs' (so ``StepGuard`` counts them)."""
    emit(alarms, log)
    with _lock:
        _reported.extend(alarms)


def resolve():
    """Resolve every queued verdict and keep the new alarms for the next ``flush()``, which
    returns them: for the readers that need the verdicts in (``coverage()``, the log, a config's
    exit) without taking the alarms from whoever calls ``flush()`` next."""
    new = flush()
    if new:
        with _lock:
            _reported[:0] = new


def flush():
    """Resolve every queued verdict; returns the new alarms (and those ``report``ed since)."""
    global _queue_bytes
    for fn in list(_before_flush):
        fn()
    if not _queue and not _reported:        # (nothing queued: a CPU run's common case)
        return []
    with _lock:
        items = list(_queue)
        _queue.clear()
        _queue_bytes = 0
        reported = list(_reported)
        _reported.clear()
    if not items:
        return reported
    # One transfer per device for all the queued summaries (the CPU's are tuples already).
    summaries = [p.summary for p in items]
    if not all(isinstance(x, tuple) for x in summaries):
        by_device = collections.defaultdict(list)
        for i, x in enumerate(summaries):
            if not isinstance(x, tuple):
                by_device[x.device].append(i)
        for idxs in by_device.values():
            for i, row in zip(idxs, torch.stack([items[i].summary for i in idxs]).cpu().tolist()):
                summaries[i] = row
    new = reported
    error = None
    for p, summary in zip(items, summaries):
        if _count(summary, p):
            alarms = alarms_of(p, p.info["action"])
            new.extend(alarms)
            try:
                emit(alarms, p.log)
            except Exception as e:          # a raising callback: resolve the rest first
                error = error or e
    if error is not None:
        with _lock:                         # the next flush() returns what this one could not
            _reported[:0] = new
        raise error
    return new


def resolve_now(p):
    """Resolve one check at once (raise, recompute, correct); returns its alarms."""
    if _count(p.summary if isinstance(p.summary, tuple) else p.summary.tolist(), p):
        return alarms_of(p, None)
    return []


def act(p, policy, log, *, correct, again):
    """Carry out ``policy`` on one checked call's pending verdict ``p``.

    record, warn: queue it (resolved lazily). Otherwise resolve it now and, if it alarmed:
    raise: raise. correct: ``correct(alarms)`` repairs what they point at and returns the
    re-check's pending verdict; a repair that verifies ends there ("corrected"). recompute (or
    a correction that did not verify): ``again()`` returns (the fresh computation, its pending
    verdict); a clean one replaces the result ("recomputed", transient), an alarmed one raises
    (persistent). ``again`` None: nothing to recompute from, the alarm is raised.
    Returns None, or the fresh computation whose result the caller returns."""
    if policy in ("record", "warn"):
        if clean_on_host(p.summary):
            _count(p.summary, p)    # nothing to resolve later
            return None
        p.info["action"] = "recorded" if policy == "record" else "warned"
        enqueue(p)
        return None
    alarms = resolve_now(p)
    if not alarms:
        return None
    if policy == "correct":
        if not resolve_now(correct(alarms)):
            _mark(alarms, "corrected", "transient")
            emit(alarms, log)
            return None
    if policy == "raise" or again is None:
        _mark(alarms, "raised")
        emit(alarms, log)
        raise SilentCorruptionError(alarms[0])
    fresh, p2 = again()
    still = resolve_now(p2)
    _mark(alarms, "recomputed", "persistent" if still else "transient")
    emit(alarms, log)
    if still:
        _mark(still, "raised", "persistent")
        emit(still, log)
        raise SilentCorruptionError(still[0])
    return fresh


def _mark(alarms, action, persistence=None):
    for a in alarms:
        a.action = action
        if persistence is not None:
            a.persistence = persistence


def pending():
    return len(_queue)


def stats():
    resolve()                    # the counters in; the alarms stay for the next flush()
    out = dict(_stats)
    out["margins"] = margins()
    return out


def margins():
    """Per op and module, the largest residual / threshold of a clean (unalarmed) call, the
    phase it was seen in and how many clean calls: rows sorted from the closest to alarming."""
    with _lock:
        rows = [dict(op=op, module=module, worst=w, phase=phase, calls=n)
                for (op, module), (w, phase, n) in _margins.items()]
    return sorted(rows, key=lambda r: -r["worst"])


def count(key, n=1):
    _stats[key] += n


def reset_stats():
    _stats.clear()
    with _lock:
        _margins.clear()


def now():
    return time.time()


_config.on_exit.append(resolve)   # a config block's verdicts resolve under its settings
