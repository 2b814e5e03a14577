"""The cross-check: alarms x replica mismatches x fault events, per trial.

Trials run at most one fault event per step, so a step's mismatches and alarms belong to its
event. Each event is a case:
- ``detected``: a mismatch and an alarm;
- ``missed``: a mismatch, no alarm (the detection gap), with its cause;
- ``alarm_no_mismatch``: an alarm on a real corruption that changed nothing the sync compares
  (e.g. a masked attention score in ``parameter`` mode). Not a false alarm: there was a fault;
- ``masked``: neither (the corruption changed nothing that the run computed);
- ``not_applied``: the target never came (an optimizer moment before the first step).
A false alarm is an alarm with no fault at all: at a step without an event, or on the healthy
replica. Without ground truth (a real node pair: ``events`` is None) the cases are the steps
themselves, from mismatches and alarms alone.

Attribution: did an alarm name the event's module, its phase, and (one element) its place.
Latency: from the event (step, micro-step) to the first alarm it causes, in steps and in
micro-steps (``first_alarm``); ``report`` takes each distinct fault from its first event.
"""
import collections
import math

from abft.eval.faults import bit_class

CAUSES = {
    "gemm_operand": "operand corrupted before the GEMM read it (its checksums agree; "
                    "abft.OutputCheck takes operands where they are made)",
    "gemm_output": "corrupted after the check",
    "optimizer_state": "optimizer state: no GEMM reads it",
    "nongemm_op": "outside the protected GEMMs (softmax, norm, activation)",
    "gradient_comm": "gradient corrupted after backward (communication)",
}


def _ratio(ev):
    """The worst residual / threshold of the tiles the fault corrupted (None: not known)."""
    rs = [r["ratio"] for r in ev["applied"] if r.get("ratio") is not None]
    return max(rs) if rs else None


def _changed(ev):
    """Did the corruption change any value? (None counts as yes: a kernel-side fault, unseen.)"""
    return bool(ev["applied"]) and any(r.get("changed", None) is None or r["changed"] > 0
                                       for r in ev["applied"])


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
    ratio = _ratio(ev)
    if ratio is None:
        return "error below the threshold"
    scope = "its tiles'" if all(r.get("ratio_of", "tiles") == "tiles" for r in ev["applied"]) \
        else "the product's worst"
    return f"error below the threshold ({scope} residual/threshold {ratio:.2g})"


def _expected_phase(ev):
    """The phase an alarm names: the corrupted product's for the accumulator and for an output
    carried to its death (a backward product's output is alarmed in that phase)."""
    return ev["phase"] if ev["site"] in ("gemm_accumulator", "gemm_output") else "forward"


def _places(ev):
    """(module, phase) pairs the event corrupted: its own, or for a defective unit firing on
    any GEMM ("*"), those of the calls it hit."""
    if ev["module"] != "*" and ev["phase"] != "*":
        return {(ev["module"], _expected_phase(ev))}
    return {(r.get("module"), r.get("phase")) for r in ev["applied"]}


def _located(ev, alarm, mismatches):
    """One-element faults: does the alarm point at the corrupted element? Ground truth is the
    element the fault changed, in the product's coordinates (``applied``) or as the sync saw it
    in the module's tensor (the first mismatch there), where a linear's rows are unflattened."""
    if ev["pattern"] != "element" or alarm["row"] is None or not ev["applied"]:
        return None
    rec = ev["applied"][0]
    if alarm.get("kind") in ("rest", "recompute", "comm", "carry"):   # these name the element
        return (alarm["row"], alarm["col"]) == (rec.get("row"), rec.get("col"))
    if ev["site"] == "weight_memory":       # W[o, i] wrong: column o of every row is off, and
        return None if alarm["col"] is None else alarm["col"] == rec["row"]   # row sums fail
    if ev["site"] != "gemm_accumulator":
        return None
    truth = {(rec["row"], rec["col"])}
    truth |= {(m["row"], m["col"]) for m in mismatches
              if m["module"] in {p[0] for p in _places(ev)} and m["point"] in ("forward", "backward")}
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
    micro_steps = trial.get("micro_steps", 1)
    for ev in events:
        s = ev["step"]
        m, a = by_step_m.get(s, []), by_step_a.get(s, [])
        if not ev["applied"]:
            outcome = "not_applied"
        elif m and a:
            outcome = "detected"
        elif m:
            outcome = "missed"
        elif a:
            outcome = "alarm_no_mismatch"
        else:
            outcome = "masked"
        sev = [x["severity_max"] for x in m if math.isfinite(x["severity_max"])]
        flip = ev["bits"] and ev["kind"] in ("bitflip", "signflip")
        began = _first(m)
        c = dict(step=s, event=ev["id"], fault=ev.get("fault", ev["id"]), site=ev["site"],
                 module=ev["module"], phase=ev["phase"], kind=ev["kind"], pattern=ev["pattern"],
                 bits=ev["bits"], bit_class=bit_class(max(ev["bits"])) if flip else None,
                 micro_step=ev["micro_step"], outcome=outcome, changed=_changed(ev),
                 mismatches=len(m), alarms=len(a), severity=max(sev) if sev else None,
                 nonfinite=any(x["nonfinite"] for x in m), ratio=_ratio(ev),
                 cause=_cause(ev) if outcome == "missed" else None,
                 first_mismatch=began)
        if a:
            first = a[0]
            c.update(by=f"{first['kind']} {first['module']}/{first['phase']}",
                     module_ok=any(x["module"] in {p[0] for p in _places(ev)} for x in a),
                     phase_ok=any((x["module"], x["phase"]) in _places(ev) for x in a),
                     located=_located(ev, first, m))
            if ev["site"] == "weight_memory" and first["kind"] != "rest":
                c["by"] = "cached weight checksums: " + c["by"]
            after = [x for x in a if x.get("micro_step", 0) >= ev["micro_step"]] or a
            hit = min((x["step"], x.get("micro_step", 0)) for x in after)
        else:
            later = [(x["step"], x.get("micro_step", 0)) for x in trial["alarms"]
                     if x["step"] > s and x["step"] not in steps]
            hit = min(later) if later else None
        c["first_alarm"] = list(hit) if hit else None
        c["latency"] = latency((s, ev["micro_step"]), hit, micro_steps)
        out.append(c)
    for s in sorted(set(by_step_a) - steps):
        out.append(dict(step=s, site=None, outcome="false_alarm", alarms=len(by_step_a[s]),
                        mismatches=len(by_step_m.get(s, [])), cause=None))
    for a in trial.get("alarms_healthy", []):
        out.append(dict(step=a["step"], site=None, outcome="false_alarm", replica="H", alarms=1,
                        mismatches=0, cause=None))
    return out


def _first(mismatches):
    """Where a step's difference began: its first mismatch in sync order (forward submodules,
    then backward, gradients, parameters and state), as "point module tensor"."""
    if not mismatches:
        return None
    m = mismatches[0]
    return f"{m['point']} {m['module'] or '(model)'} {m['tensor']} (micro-step {m['micro_step']})"


def first_divergence(trial):
    """The trial's first difference between H and F (None: bit-identical), with the fault event
    active at that step (its cause) when there is ground truth."""
    if not trial["mismatches"]:
        return None
    m = trial["mismatches"][0]
    ev = next((e for e in trial.get("events") or () if e["step"] == m["step"]), None)
    on = f" on TP rank {trial['fault_rank']}" if trial.get("tp", 1) > 1 else ""
    return {"step": m["step"], "micro_step": m["micro_step"], "point": m["point"],
            "module": m["module"], "tensor": m["tensor"], "tp_rank": m.get("tp_rank"),
            "cause": None if ev is None else f"{ev['site']} {ev['kind']} at {ev['module']}/"
                                             f"{ev['phase']} (step {ev['step']}){on}"}


def latency(start, hit, micro_steps):
    """{"steps", "micro_steps"} from ``start`` to ``hit`` ((step, micro-step) pairs), or None."""
    if hit is None:
        return None
    return {"steps": hit[0] - start[0],
            "micro_steps": (hit[0] - start[0]) * micro_steps + hit[1] - start[1]}
