"""The cross-check: alarms x replica mismatches x fault events, per trial.

Trials run at most one fault event per step, so a step's mismatches and alarms belong to its
event. Each event is a case:
- ``detected``: a mismatch and an alarm;
- ``missed``: a mismatch, no alarm (the detection gap), with its cause;
- ``false_alarm``: an alarm, no mismatch (for a fault event: the corruption was real but changed
  nothing the sync compares, e.g. a masked attention score in ``parameter`` mode);
- ``masked``: neither (the corruption changed nothing that the run computed);
- ``not_applied``: the target never came (an optimizer moment before the first step).
Alarms at steps without an event, and any alarm of the healthy replica, are false alarms.
Without ground truth (a real node pair: ``events`` is None) the cases are the steps themselves,
from mismatches and alarms alone.

Attribution: did an alarm name the event's module, its phase, and (one element) its place.
Latency: steps from the event to its first alarm (0: the same step).
"""
import collections
import math

from abft.eval.faults import bit_class

CAUSES = {
    "gemm_operand": "operand corrupted before the GEMM read it (its checksums agree)",
    "gemm_output": "corrupted after the check",
    "optimizer_state": "optimizer state: no GEMM reads it",
    "nongemm_op": "outside the protected GEMMs (softmax, norm, activation)",
    "gradient_comm": "gradient corrupted after backward (communication)",
}


def _cause(ev):
    site = ev["site"]
    if site in CAUSES:
        return CAUSES[site]
    if site == "weight_memory":
        if ev["module"].split(".")[-1] in ("tok", "pos"):
            return "embedding weight: not a GEMM operand"
        if ev["micro_step"] == 0:
            return "weight changed before the step's first forward took fresh checksums"
        if max((r.get("max_abs_error", 0.0) for r in ev["applied"]), default=0.0) > 1e30:
            return "a huge weight (above 1e30): the product is unverified, not alarmed"
        return "error below the threshold of the cached-checksum row check"
    ratio = max((a.get("ratio", 0.0) for a in ev["applied"]), default=0.0)
    return f"error below the threshold (residual/threshold {ratio:.2g})"


def _expected_phase(ev):
    return ev["phase"] if ev["site"] == "gemm_accumulator" else "forward"


def _located(ev, alarm, mismatches):
    """One-element faults: does the alarm point at the corrupted element? Ground truth is the
    element the fault changed, in the product's coordinates (``applied``) or as the sync saw it
    in the module's tensor (the first mismatch there), where a linear's rows are unflattened."""
    if ev["pattern"] != "element" or alarm["row"] is None or not ev["applied"]:
        return None
    rec = ev["applied"][0]
    if ev["site"] == "weight_memory":       # W[o, i] wrong: column o of every row is off, and
        return None if alarm["col"] is None else alarm["col"] == rec["row"]   # row sums fail
    if ev["site"] != "gemm_accumulator":
        return None
    truth = {(rec["row"], rec["col"])}
    truth |= {(m["row"], m["col"]) for m in mismatches
              if m["module"] == ev["module"] and m["point"] in ("forward", "backward")}
    if len(truth) == 1 and alarm.get("batch") and len(rec["shape"]) == 2:
        return None                          # a flattened product, no module tensor to map it
    if alarm["col"] is None:                 # only the row sums failed: the row is located
        return "row" if any(alarm["row"] in t for t in truth) else False
    where = (alarm["row"], alarm["col"])
    return where in truth or where[::-1] in truth


def cases(trial):
    """The cases of one trial (see the module docstring), each a dict."""
    by_step_m, by_step_a = collections.defaultdict(list), collections.defaultdict(list)
    for m in trial["mismatches"]:
        by_step_m[m["step"]].append(m)
    for a in trial["alarms"]:
        by_step_a[a["step"]].append(a)
    out = []
    events = trial.get("events")
    if events is None:                      # no ground truth
        for s in sorted(set(by_step_m) | set(by_step_a)):
            m, a = by_step_m.get(s, []), by_step_a.get(s, [])
            out.append(dict(step=s, site=None, outcome="detected" if m and a else
                            "missed" if m else "false_alarm", cause=None if a or not m else
                            "unknown (no ground truth)", mismatches=len(m), alarms=len(a)))
        return out
    steps = {e["step"] for e in events}
    for ev in events:
        s = ev["step"]
        m, a = by_step_m.get(s, []), by_step_a.get(s, [])
        applied = bool(ev["applied"]) and (ev["site"] == "gemm_accumulator" or
                                           any(r.get("changed", 0) for r in ev["applied"]))
        if not ev["applied"]:
            outcome = "not_applied"
        elif m and a:
            outcome = "detected"
        elif m:
            outcome = "missed"
        elif a:
            outcome = "false_alarm"
        else:
            outcome = "masked"
        sev = [x["severity_max"] for x in m if math.isfinite(x["severity_max"])]
        c = dict(step=s, event=ev["id"], site=ev["site"], module=ev["module"], phase=ev["phase"],
                 kind=ev["kind"], pattern=ev["pattern"], bits=ev["bits"],
                 bit_class=bit_class(ev["bits"][0]) if ev["bits"] and ev["kind"] == "bitflip"
                 else None, micro_step=ev["micro_step"], outcome=outcome, changed=applied,
                 mismatches=len(m), alarms=len(a), severity=max(sev) if sev else None,
                 nonfinite=any(x["nonfinite"] for x in m),
                 ratio=max((r.get("ratio", 0.0) for r in ev["applied"]), default=None),
                 cause=_cause(ev) if outcome == "missed" else None)
        if a:
            first = a[0]
            c.update(by=f"{first['kind']} {first['module']}/{first['phase']}",
                     module_ok=any(x["module"] == ev["module"] for x in a),
                     phase_ok=any(x["module"] == ev["module"] and x["phase"] == _expected_phase(ev)
                                  for x in a),
                     located=_located(ev, first, m), latency=0)
            if ev["site"] == "weight_memory":
                c["by"] = "cached weight checksums: " + c["by"]
        else:
            later = [x["step"] for x in trial["alarms"] if x["step"] > s and x["step"] not in steps]
            c["latency"] = (min(later) - s) if later else None
        out.append(c)
    for s in sorted(set(by_step_a) - steps):
        out.append(dict(step=s, site=None, outcome="false_alarm", alarms=len(by_step_a[s]),
                        mismatches=len(by_step_m.get(s, [])), cause=None))
    for a in trial.get("alarms_healthy", []):
        out.append(dict(step=a["step"], site=None, outcome="false_alarm", replica="H", alarms=1,
                        mismatches=0, cause=None))
    return out
