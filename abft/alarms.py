"""Alarm records, the alarm log and the exception a ``raise`` policy throws."""
import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field


@dataclass
class Alarm:
    """One alarmed tile of one checked product.

    ``row`` and ``col`` index the product's last two dimensions, ``batch`` its leading ones;
    each is None where the sums could not locate it. ``rows`` and ``cols`` list every failing
    row and column sum of the tile (several corrupted elements). ``residual`` is the error
    estimate of a single located element; ``threshold`` the threshold of that sum.
    """
    op: str
    phase: str
    module: str
    step: object
    micro_step: object
    replica: object
    rank: int
    call_id: int
    shapes: tuple
    dtype: str
    bm: int
    bn: int
    tile: tuple
    batch: tuple
    row: object
    col: object
    residual: float
    threshold: float
    backend: str
    time: float
    kind: str = "checksum"          # checksum | nonfinite
    rows: list = field(default_factory=list)
    cols: list = field(default_factory=list)
    persistence: str = None         # transient | persistent (recompute, correct), else None
    action: str = None              # recorded | warned | raised | recomputed | corrected
    labels: dict = field(default_factory=dict)

    def where(self):
        loc = f"row {self.row}, col {self.col}" if self.row is not None else "unlocated"
        b = f" batch {self.batch}" if self.batch else ""
        return (f"{self.op}/{self.phase} in {self.module or '<top>'} (step {self.step}, call "
                f"{self.call_id}){b} tile {self.tile}: {loc}{self._shard()}")

    def global_index(self):
        """(batch..., row, col) in the global tensor of a DTensor product (``labels["shard"]``
        gives the shard's offset), else None."""
        off = (self.labels.get("shard") or {}).get("offset")
        if off is None or self.row is None or self.col is None:
            return None
        idx = (*self.batch, self.row, self.col)
        if len(idx) != len(off):
            return None
        return tuple(int(i) + int(o) for i, o in zip(idx, off))

    def _shard(self):
        sh = self.labels.get("shard")
        if not sh:
            return ""
        g = self.global_index()
        at = f"global {g}, " if g is not None else ""
        part = ", a partial sum over the inner dimension" if sh.get("partial") else ""
        return f" ({at}rank {self.rank}, mesh coordinate {sh.get('coordinate')}{part})"

    def __str__(self):
        return (f"abft alarm [{self.kind}] {self.where()}; residual {self.residual:.4g} vs "
                f"threshold {self.threshold:.4g}; {len(self.rows)} row(s), {len(self.cols)} col(s) "
                f"failing; {self.dtype} {self.shapes} tiles {self.bm}x{self.bn}, {self.backend}")

    def to_json(self):
        d = asdict(self)
        return json.dumps(d, default=str)


# -- one factory per kind of alarm --------------------------------------------------------------
# Each takes what its detector knows; the fields a GEMM's alarm has and the other kinds do not
# (tiles, the product's shapes) are filled the same way for each of those here.

def _made(kind, *, op, phase, module, scope, shape, dtype, residual, threshold=0.0, action="recorded",
          block=1, tile=(), batch=(), row=None, col=None, call_id=-1, labels=None):
    from abft.context import current_rank
    return Alarm(op=op, phase=phase, module=module, step=scope.get("step"),
                 micro_step=scope.get("micro_step"), replica=scope.get("replica"), rank=current_rank(),
                 call_id=call_id, shapes=(tuple(shape),), dtype=str(dtype).replace("torch.", ""), bm=block,
                 bn=1, tile=tuple(tile), batch=tuple(batch), row=row, col=col, residual=float(residual),
                 threshold=float(threshold), backend=kind, time=time.time(), kind=kind, action=action,
                 labels=labels or {})


def checksum_alarm(info, *, tile, batch, row, col, rows, cols, residual, threshold, nonfinite, action):
    """A checked product's tile that failed (``abft.policy``): ``info`` the call's metadata (op,
    phase, labels, call id, rank, shapes, dtype, tiles, backend, time), ``tile`` its index,
    (batch, row, col) the located element or None, ``rows``/``cols`` every failing sum's index,
    ``nonfinite``: a non-finite output from finite inputs."""
    labels = info["labels"]
    return Alarm(op=info["op"], phase=info["phase"], module=labels.get("module"), step=labels.get("step"),
                 micro_step=labels.get("micro_step"), replica=labels.get("replica"), rank=info["rank"],
                 call_id=info["call_id"], shapes=info["shapes"], dtype=info["dtype"], bm=info["bm"],
                 bn=info["bn"], tile=tuple(tile), batch=tuple(batch), row=row, col=col, residual=float(residual),
                 threshold=float(threshold), backend=info["backend"], time=info["time"],
                 kind="nonfinite" if nonfinite else "checksum", rows=rows, cols=cols, action=action,
                 labels={k: v for k, v in labels.items() if k not in ("module", "step", "micro_step", "replica")})


def invariant_alarm(*, phase, module, scope, shape, batch, row, deviation, bound, action, rows):
    """A softmax invariant broken (``abft.detectors.attention``): row ``row`` of batch ``batch`` of scores of
    ``shape`` deviates by ``deviation`` from its invariant, beyond ``bound``; ``rows`` rows did."""
    return _made("invariant", op="softmax", phase=phase, module=module, scope=scope, shape=shape,
                 dtype="float64", batch=batch, row=row, residual=deviation, threshold=bound, action=action,
                 labels={"rows": rows})


def carry_alarm(*, op, phase, module, scope, tensor, block, index_block, batch, row, col, delta, action,
                labels):
    """A product's output or operand changed in memory after it was fingerprinted
    (``abft.detectors.outputs``): block ``index_block`` of ``block`` words of ``tensor``, the element at
    (batch, row, col) where located, ``delta`` its sums' change."""
    return _made("carry", op=op, phase=phase, module=module, scope=scope, shape=tensor.shape,
                 dtype=tensor.dtype, block=block, tile=(index_block,), batch=batch, row=row, col=col,
                 residual=delta, action=action, labels=labels)


def comm_alarm(*, op, module, scope, shape, dtype, block, index_block, call_id, row, col, residual, bound,
               action, labels):
    """A gradient changed by its collective (``abft.detectors.comm``): block ``index_block`` of ``block``
    elements, of parameter ``module`` (shape ``shape``) where known, off by ``residual`` beyond
    ``bound``."""
    return _made("comm", op=op, phase="grad", module=module, scope=scope, shape=shape, dtype=dtype,
                 block=block, tile=(index_block,), call_id=call_id, row=row, col=col, residual=residual,
                 threshold=bound, action=action, labels=labels)


def recompute_alarm(*, op, module, scope, tensor, batch, row, col, error, action, elements):
    """A module's rerun gave other bits (``abft.detectors.recompute``): the first differing element, the
    largest difference, and how many differ."""
    return _made("recompute", op=op, phase="forward", module=module, scope=scope, shape=tensor.shape,
                 dtype=tensor.dtype, batch=batch, row=row, col=col, residual=error, action=action,
                 labels={"elements": elements})


def rest_alarm(*, name, kind, scope, tensor, block, tile, row=None, col=None, residual, labels):
    """Training state changed at rest (``abft.detectors.rest``): tensor ``name`` (``kind``: "param" or an
    optimizer state's key), block ``tile`` of ``block`` words, the element where located."""
    return _made("rest", op="rest", phase=kind, module=name, scope=scope, shape=tensor.shape,
                 dtype=tensor.dtype, block=block, tile=tile, row=row, col=col, residual=residual,
                 labels=labels)


class SilentCorruptionError(RuntimeError):
    """Raised by the ``raise`` policy (and by ``recompute`` when the fault persists)."""

    def __init__(self, alarm):
        super().__init__(str(alarm))
        self.alarm = alarm


class AlarmLog:
    """Alarms in memory, plus an optional JSONL file (a path that may contain ``{rank}``) to which
    each alarm is written as one whole line and flushed at once."""

    def __init__(self, path=None):
        self._alarms = []
        self._lock = threading.Lock()
        self._file = None
        self.path = None
        self.set_path(path)

    def set_path(self, path):
        """Write alarms to ``path`` (``{rank}`` filled in) from now on; None: to no file. A path
        that cannot be opened raises ValueError and leaves the sink as it was."""
        new, resolved = None, path
        if path:
            from abft.context import current_rank
            try:
                resolved = str(path).format(rank=current_rank())
                os.makedirs(os.path.dirname(os.path.abspath(resolved)), exist_ok=True)
                new = open(resolved, "a", encoding="utf-8")
            except (OSError, KeyError, IndexError, ValueError) as e:
                raise ValueError(f"abft.config: log_path {path!r} cannot be opened for writing "
                                 f"({type(e).__name__}: {e})") from None
        with self._lock:
            if self._file is not None:
                self._file.close()
            self._file, self.path = new, resolved

    def append(self, alarm):
        with self._lock:
            self._alarms.append(alarm)
            if self._file is not None:
                self._file.write(alarm.to_json() + "\n")
                self._file.flush()

    def clear(self):
        with self._lock:
            self._alarms.clear()

    def __len__(self):
        return len(self._alarms)

    def __iter__(self):
        return iter(list(self._alarms))

    def __getitem__(self, i):
        return self._alarms[i]

    def __repr__(self):
        return f"AlarmLog({len(self)} alarms, path={self.path!r})"


_default = AlarmLog()


def default_log():
    return _default
