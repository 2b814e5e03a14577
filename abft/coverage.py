"""What the checksums saw: per op and module, checked, sampled-out and unverified calls, and the
GEMM-like ops that nothing checked (``abft.coverage()``)."""
import collections
import threading

_lock = threading.Lock()
_counts = collections.defaultdict(collections.Counter)     # (op, module) -> Counter


def count(op, module, what, n=1):
    with _lock:
        _counts[(op, module)][what] += n


def unprotected(op, module):
    count(op, module, "unprotected")


def report():
    """Rows of {op, module, checked, sampled_out, unverified, unprotected}, sorted by module."""
    with _lock:
        rows = [dict(op=op, module=module, checked=c["checked"], sampled_out=c["sampled_out"],
                     unverified=c["unverified"], unprotected=c["unprotected"])
                for (op, module), c in _counts.items()]
    return sorted(rows, key=lambda r: (str(r["module"]), r["op"]))


def reset():
    with _lock:
        _counts.clear()
