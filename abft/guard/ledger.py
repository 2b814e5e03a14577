"""A device ledger: strikes against (host, device) kept across steps and runs, and quarantine.

    ledger = abft.Ledger("runs/job")                 # a folder shared by the job's runs
    guard = abft.StepGuard(opt, ledger=ledger)       # strikes on alarmed steps; strike-out
    abft ledger runs/job                             # the record, per host and device

Real SDC devices are permanent but fire rarely: one clean rerun does not show a fault was
transient, so every alarmed step is a strike against the device that alarmed, weighted by what
the guard learned: 1 when a rerun of the step came back clean (transient), 2 when nothing was
rerun (unconfirmed), 3 when the rerun alarmed again (persistent). A device whose strikes within
``window_hours`` add up to ``strikes`` (3) is quarantined: the guard halts every rank with
``QUARANTINE_EXIT`` (44), meant for schedulers not to requeue the job on that device, and a guard
started later on a quarantined device halts at once with the same code. ``release`` (after the
device was repaired or replaced) ends a quarantine and the strikes before it.

Storage: one JSON-lines file per (host, device) under ``DIR/ledger/``, appended by the one
process that uses the device (no locking; shared file systems are fine); reading merges them.
"""
import json
import os
import re
import socket
import time

QUARANTINE_EXIT = 44
WEIGHTS = {"transient": 1, None: 2, "persistent": 3}


def _slug(s):
    return re.sub(r"[^A-Za-z0-9_.-]", "_", str(s))


class Ledger:
    """Strikes and quarantines of the devices of one job folder ``path``.

    Args:
        path: the folder (created on first write).
        strikes: the weighted strikes within the window that quarantine a device.
        window_hours: how far back strikes count.
    """

    def __init__(self, path, *, strikes=3, window_hours=24.0):
        if isinstance(strikes, bool) or not isinstance(strikes, int) or strikes < 1:
            raise ValueError(f"abft.Ledger: strikes must be a whole number >= 1, got {strikes!r}")
        if isinstance(window_hours, bool) or not isinstance(window_hours, (int, float)) \
                or not window_hours > 0:
            raise ValueError(f"abft.Ledger: window_hours must be a number > 0, got {window_hours!r}")
        self.path, self.strikes, self.window_hours = str(path), strikes, float(window_hours)

    def _file(self, host, device):
        return os.path.join(self.path, "ledger", f"{_slug(host)}__{_slug(device)}.jsonl")

    def _append(self, rec):
        f = self._file(rec["host"], rec["device"])
        os.makedirs(os.path.dirname(f), exist_ok=True)
        with open(f, "a", encoding="utf-8") as out:
            out.write(json.dumps(rec, default=str) + "\n")
            out.flush()
            os.fsync(out.fileno())

    def records(self, host=None, device=None):
        """Every record (dicts, oldest first), of one device or all. A torn last line (a crash
        mid-write: no newline) is skipped; any other line that is not a record raises
        ``ValueError`` naming the file and line (a ledger is evidence: not read past damage)."""
        folder = os.path.join(self.path, "ledger")
        if host is not None:
            files = [self._file(host, device)]
        elif os.path.isdir(folder):
            files = [os.path.join(folder, f) for f in sorted(os.listdir(folder)) if f.endswith(".jsonl")]
        else:
            files = []
        out = []
        for f in files:
            if not os.path.exists(f):
                continue
            with open(f, encoding="utf-8", errors="replace") as src:
                lines = src.read().split("\n")
            torn = lines.pop()                  # "" after the last newline, else a torn write
            for n, line in enumerate(lines, 1):
                out.append(_record(line, f, n))
            if torn:
                try:
                    out.append(_record(torn, f, len(lines) + 1))
                except ValueError:
                    pass
        return sorted(out, key=lambda r: r["time"])

    def strike(self, host, device, *, persistence=None, **info):
        """Record an alarmed step against the device; returns the record (with its weight)."""
        rec = dict(time=time.time(), event="strike", host=host, device=str(device),
                   persistence=persistence, weight=WEIGHTS.get(persistence, 2), **info)
        self._append(rec)
        return rec

    def state(self, host, device, now=None):
        """{suspicion, strikes, quarantined, since, reason, last} of one device: the weighted
        strikes since the later of the window's start and the last release."""
        now = time.time() if now is None else now
        recs = self.records(host, str(device))
        start = now - self.window_hours * 3600
        for r in recs:
            if r["event"] == "release":
                start = max(start, r["time"])
        quarantine = None
        for r in recs:
            if r["event"] == "quarantine":
                quarantine = r
            elif r["event"] == "release":
                quarantine = None
        live = [r for r in recs if r["event"] == "strike" and r["time"] >= start]
        return dict(host=host, device=str(device), suspicion=sum(r["weight"] for r in live),
                    strikes=len(live), quarantined=quarantine is not None,
                    since=quarantine["time"] if quarantine else None,
                    reason=quarantine.get("reason") if quarantine else None,
                    last=live[-1]["time"] if live else None)

    def judge(self, host, device):
        """Quarantine the device if its suspicion reached ``strikes``; returns its state."""
        st = self.state(host, device)
        if st["suspicion"] >= self.strikes and not st["quarantined"]:
            reason = (f"{st['suspicion']} strike weight(s) in {st['strikes']} alarmed step(s) "
                      f"within {self.window_hours:g} h (limit {self.strikes})")
            self._append(dict(time=time.time(), event="quarantine", host=host, device=str(device),
                              reason=reason))
            st = self.state(host, device)
        return st

    def release(self, host, device, note=""):
        """End a quarantine (a repaired or replaced device): strikes before now stop counting."""
        self._append(dict(time=time.time(), event="release", host=host, device=str(device),
                          note=note))

    def devices(self):
        """(host, device) of every device on record."""
        seen = []
        for r in self.records():
            key = (r["host"], r["device"])
            if key not in seen:
                seen.append(key)
        return seen


_NEEDS = {"strike": ("weight",), "quarantine": (), "release": ()}


def _record(line, path, n):
    """One ledger line as a dict, or ValueError naming the file and line."""
    try:
        r = json.loads(line)
    except json.JSONDecodeError:
        r = None
    if not isinstance(r, dict) or r.get("event") not in _NEEDS or \
            not all(k in r for k in ("time", "host", "device", *_NEEDS[r["event"]])) or \
            not isinstance(r["time"], (int, float)):
        raise ValueError(f"abft.Ledger: {path}:{n}: not a ledger record (a damaged ledger: move the "
                         f"file aside after reading it)")
    return r


def this_device(device=None):
    """(host, device) of this process: ``device`` or the current CUDA device, else "cpu:RANK"."""
    import torch
    from abft.context import current_rank
    if device is None:
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() \
            else f"cpu:{current_rank()}"
    return socket.gethostname(), str(device)


def table(ledger, file=None):
    """Print the ledger's devices: state, strikes, suspicion; returns the rows."""
    import sys
    out = file or sys.stdout
    rows = [ledger.state(h, d) for h, d in ledger.devices()]
    print(f"{'host':<20} {'device':<10} {'state':<12} {'strikes':>7} {'suspicion':>9}  last strike / "
          f"reason (window {ledger.window_hours:g} h, quarantine at {ledger.strikes})", file=out)
    for r in rows:
        last = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r["last"])) + " UTC" if r["last"] else "-"
        state = "QUARANTINED" if r["quarantined"] else "ok"
        note = r["reason"] if r["quarantined"] else last
        print(f"{r['host']:<20} {r['device']:<10} {state:<12} {r['strikes']:>7} {r['suspicion']:>9}  {note}",
              file=out)
    if not rows:
        print("(no device on record)", file=out)
    return rows
