"""Alarm records, the alarm log and the exception a ``raise`` policy throws."""
import json
import os
import threading
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
