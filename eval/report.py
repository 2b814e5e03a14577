"""The campaign report: ``report.json``, ``report.md`` and PNG plots in the run folder.

Coverage per site, per bit class and bit position, per node profile; the missed cases and their
causes; the metrics of Ma et al. (2025) from the same runs: mismatch frequency (mismatched /
all elements of a submodule at a step), severity (relative difference of mismatched elements),
worst gradient deviation; and, for free-running trials, parameter divergence, losses and the
final fine-tuning accuracy of both replicas.
"""
import collections
import json
import math
import os

from abft.eval.crosscheck import cases, first_divergence, latency
from abft.eval.faults import SITES

OUTCOMES = ("detected", "missed", "masked", "alarm_no_mismatch", "not_applied")
OUTCOME_NAMES = ("detected", "missed", "masked", "alarm, no mismatch", "not applied")


def _rate(c):
    n = c["detected"] + c["missed"]
    return c["detected"] / n if n else None


def fault_key(trial, case):
    """A distinct fault: the same fault drawn in two sync modes, or firing at several steps, is
    one fault (its profile's fault stream, trial and fault id)."""
    return trial["profile"], trial.get("fault_seed", trial["seed"]), case["fault"]


def summarize(trials):
    """The report as a dict (what report.json holds)."""
    per_site = {s: collections.Counter() for s in SITES}
    faults_site = {s: {} for s in SITES}            # distinct fault -> detected anywhere
    per_profile = collections.defaultdict(collections.Counter)
    per_class = collections.defaultdict(collections.Counter)
    per_bit = collections.defaultdict(collections.Counter)
    per_nbits = collections.defaultdict(collections.Counter)
    per_pattern = collections.defaultdict(collections.Counter)
    causes = collections.defaultdict(collections.Counter)
    by = collections.Counter()
    located = collections.Counter()
    first = {}                                      # distinct fault -> (first event, first alarm)
    false_alarms = {"alarms": 0, "steps": 0, "healthy_replica": 0}
    all_cases = []
    for t in trials:
        if t["mode"] == "none":
            continue                    # free running: differences compound, no attribution
        for c in cases(t):
            c["trial"], c["profile"] = t["id"], t["profile"]
            all_cases.append(c)
            if c["site"] is None:
                if c["outcome"] == "false_alarm":
                    false_alarms["alarms"] += c["alarms"]
                    false_alarms["steps"] += c.get("replica") != "H"
                    false_alarms["healthy_replica"] += c.get("replica") == "H"
                continue
            site, out = c["site"], c["outcome"]
            per_site[site][out] += 1
            key = fault_key(t, c)
            faults_site[site][key] = faults_site[site].get(key, False) or out == "detected"
            per_profile[t["profile"]][out] += 1
            per_pattern[(site, c["pattern"])][out] += 1
            if c.get("bit_class"):
                per_class[(site, c["bit_class"])][out] += 1
                per_nbits[(site, len(c["bits"]))][out] += 1
                if len(c["bits"]) == 1:             # a multi-bit flip is no one bit's figure
                    per_bit[(site, c["bits"][0])][out] += 1
            if out == "missed":
                causes[site][c["cause"]] += 1
            if out == "detected":
                # the check that alarmed first: cached weight checksums, or the alarm's kind
                # (checksum, nonfinite, rest, recompute)
                by[(site, c["by"].split(":")[0] if c["by"].startswith("cached") else
                    c["by"].split(" ")[0])] += 1
                if c.get("located") is not None:
                    located[{True: "yes", "row": "row"}.get(c["located"], "no")] += 1
            if out == "not_applied":
                continue                # the fault starts when it first really fires
            start = (c["step"], c["micro_step"])
            f = first.setdefault(key, [start, None, t.get("micro_steps", 1)])
            f[0] = min(f[0], start)
            if c.get("first_alarm"):
                hit = tuple(c["first_alarm"])
                f[1] = hit if f[1] is None else min(f[1], hit)
    lat = [latency(s0, hit, ms) for s0, hit, ms in first.values() if hit is not None]
    acc_detect = [c for c in all_cases if c.get("site") == "gemm_accumulator"
                  and c["outcome"] in ("detected", "missed")]
    above = [c for c in acc_detect if (c.get("ratio") or 0) > 1 or c["outcome"] == "detected"]
    mism = [m for t in trials if t["mode"] != "none" for m in t["mismatches"]]
    null = [t for t in trials if not t["events"] and not t.get("reseeded")]
    sites = {}
    for site, c in per_site.items():
        d = {o: c.get(o, 0) for o in OUTCOMES}
        d.update(faults=len(faults_site[site]), events=sum(d.values()),
                 faults_detected=sum(faults_site[site].values()), rate=_rate(c))
        sites[site] = d
    return {
        "trials": len(trials),
        "null": {"trials": len(null), "mismatches": sum(len(t["mismatches"]) for t in null),
                 "alarms": sum(len(t["alarms"]) + len(t["alarms_healthy"]) for t in null)},
        "per_site": sites,
        "per_profile": {p: dict(c, rate=_rate(c)) for p, c in per_profile.items()},
        "per_bit_class": {f"{s}/{b}": dict(c, rate=_rate(c)) for (s, b), c in sorted(per_class.items())},
        "per_bit": {f"{s}/{b}": dict(c, rate=_rate(c)) for (s, b), c in sorted(per_bit.items())},
        "per_bit_count": {f"{s}/{n}": dict(c, rate=_rate(c)) for (s, n), c in sorted(per_nbits.items())},
        "per_pattern": {f"{s}/{p}": dict(c, rate=_rate(c)) for (s, p), c in sorted(per_pattern.items())},
        "causes": {s: dict(c) for s, c in causes.items()},
        "detected_by": {f"{s}/{k}": n for (s, k), n in by.items()},
        "accumulator_above_threshold": {"faults": len(above),
                                        "detected": sum(c["outcome"] == "detected" for c in above)},
        "located": dict(located),
        "latency": {"faults_alarmed": len(lat),
                    "steps_max": max((x["steps"] for x in lat), default=None),
                    "micro_steps_max": max((x["micro_steps"] for x in lat), default=None),
                    "micro_steps_median": _median([x["micro_steps"] for x in lat])},
        "false_alarms": false_alarms,
        "mismatch_frequency_max": max((m["frequency"] for m in mism), default=0.0),
        "severity_median": _median([m["severity_max"] for m in mism if math.isfinite(m["severity_max"])]),
        "grad_deviation_max": max((d for t in trials if t["mode"] == "parameter"
                                   for d in t["grad_deviation"] if math.isfinite(d)), default=None),
        "free_running": [{"trial": t["id"], "reseeded": t.get("reseeded", False),
                          "accuracy_healthy": t["accuracy_healthy"],
                          "accuracy_faulty": t["accuracy_faulty"],
                          "param_divergence_final": t["param_divergence"][-1] if t["param_divergence"] else None,
                          "loss_faulty_max": _finite_max(t["loss_faulty"]),
                          "loss_faulty_nonfinite": sum(not math.isfinite(x) for x in t["loss_faulty"]),
                          "loss_gap_max": _finite_max([abs(a - b) / max(abs(b), 1e-12) for a, b in
                                                       zip(t["loss_faulty"], t["loss_healthy"])]),
                          "accuracy_curve_healthy": t.get("accuracy_curve_healthy", []),
                          "accuracy_curve_faulty": t.get("accuracy_curve_faulty", [])}
                         for t in trials if t["mode"] == "none"],
        "accuracy": {t["id"]: [t["accuracy_healthy"], t["accuracy_faulty"]] for t in trials},
        "wall_s": sum(t["wall_s"] for t in trials),
        "submodules": submodule_table(trials),
        "gradient_trend": gradient_trend(trials),
        "first_divergence": {t["id"]: first_divergence(t) for t in trials
                             if t["mode"] != "none" and t["mismatches"]},
        "cases": all_cases,
        "tp": max((t.get("tp", 1) for t in trials), default=1),
    }


def submodule_kind(name):
    """A submodule's place in a block, without the block index ("blocks.3.attn.qkv" ->
    "attn.qkv"), so every layer's copy of it pools."""
    parts = name.split(".")
    return ".".join(parts[2:]) if len(parts) > 2 and parts[0] == "blocks" else name or "(model)"


def submodule_table(trials):
    """Level 1 (Ma et al.): per node profile and submodule, from computation-level sync, the
    mismatch frequency (mismatched / all elements of the submodule's tensor at a step) and
    severity (relative difference of the mismatched elements), early and late in the run."""
    rows = collections.defaultdict(lambda: {"points": 0, "freq": [], "sev": [], "early": [],
                                            "late": []})
    steps = {}
    for t in trials:
        if t["mode"] != "computation":
            continue
        steps[t["profile"]] = steps.get(t["profile"], 0) + t["steps"]
        for m in t["mismatches"]:
            if m["point"] not in ("forward", "backward"):
                continue
            r = rows[(t["profile"], m["point"], submodule_kind(m["module"]))]
            r["points"] += 1
            r["freq"].append(m["frequency"])
            if math.isfinite(m["severity_max"]):
                r["sev"].append(m["severity_max"])
            r["early" if m["step"] < t["steps"] / 2 else "late"].append(m["frequency"])
    out = []
    for (prof, point, kind), r in sorted(rows.items()):
        out.append({"profile": prof, "point": point, "submodule": kind,
                    "mismatched_points": r["points"], "profile_steps": steps[prof],
                    "frequency_median": _median(r["freq"]), "frequency_max": max(r["freq"]),
                    "severity_median": _median(r["sev"]),
                    "frequency_early_mean": _mean(r["early"]), "frequency_late_mean": _mean(r["late"])})
    return out


def gradient_trend(trials):
    """Level 2 (Ma et al.): the gradient deviation |g_F - g_H| / |g_H| under parameter-level
    sync, per node profile, over the first and second half of training."""
    out = {}
    for t in trials:
        if t["mode"] != "parameter" or not t["grad_deviation"]:
            continue
        d = [x for x in t["grad_deviation"] if math.isfinite(x)]
        half = len(t["grad_deviation"]) // 2
        first = [x for x in t["grad_deviation"][:half] if math.isfinite(x)]
        second = [x for x in t["grad_deviation"][half:] if math.isfinite(x)]
        o = out.setdefault(t["profile"], {"trials": 0, "max": 0.0, "first_half": [],
                                          "second_half": [], "nonfinite_steps": 0})
        o["trials"] += 1
        o["max"] = max([o["max"]] + d)
        o["first_half"] += first
        o["second_half"] += second
        o["nonfinite_steps"] += len(t["grad_deviation"]) - len(d)
    for o in out.values():
        o["first_half"], o["second_half"] = _mean(o["first_half"]), _mean(o["second_half"])
    return out


def _mean(xs):
    return sum(xs) / len(xs) if xs else None


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def _finite_max(xs):
    f = [x for x in xs if math.isfinite(x)]
    return max(f) if f else None


def _pct(x):
    return "–" if x is None else f"{100 * x:.0f}%"


PLOTS = {
    "mismatches_per_step.png": "mismatch frequency per step, worst submodule, per node "
                               "(computation-level sync)",
    "severity.png": "severity of the faults that changed the run, per site",
    "detection_by_bit.png": "detection rate against the bit flipped (single-bit flips)",
    "gradient_deviation.png": "gradient deviation per step (parameter-level sync)",
    "divergence_and_loss.png": "parameter divergence and both loss curves, free running",
    "accuracy_over_training.png": "both replicas' fine-tune accuracy over training, free running",
}


def markdown(s):
    fa = s["false_alarms"]
    lat = s["latency"]
    lines = ["# abft detection coverage", "",
             f"{s['trials']} trials. Null campaign (no faults): {s['null']['trials']} trial(s), "
             f"{s['null']['mismatches']} mismatches, {s['null']['alarms']} alarms.",
             f"False alarms (alarms with no fault at all): {fa['alarms']} alarm(s) at "
             f"{fa['steps']} fault-free step(s) of the faulty replica, {fa['healthy_replica']} on "
             f"the healthy replica.", ""]
    if s.get("tp", 1) > 1:
        lines += [f"Tensor parallel: each replica a group of {s['tp']} ranks, each rank paired "
                  f"with its twin; a trial's faults on one rank of F's group (the fault's TP rank "
                  f"below); mismatches compared per rank, at the submodules and the TP "
                  f"collectives.", ""]
    lines += ["## Coverage per site", "",
              "A fault is one faulty unit (counted once across sync modes and steps); an event is "
              "one firing of it in one trial. Outcomes count events.", "",
              "| site | faults | events | " + " | ".join(OUTCOME_NAMES)
              + " | detection rate | faults detected |",
              "|---|---|---|" + "---|" * len(OUTCOMES) + "---|---|"]
    for site, c in s["per_site"].items():
        lines.append(f"| {site} | {c['faults']} | {c['events']} | "
                     + " | ".join(str(c[o]) for o in OUTCOMES)
                     + f" | {_pct(c['rate'])} | {c['faults_detected']}/{c['faults']} |")
    a = s["accumulator_above_threshold"]
    lines += ["", "Detection rate = detected / (detected + missed): events that changed the run. "
              "\"alarm, no mismatch\": a real corruption alarmed that changed nothing the sync "
              "compares (not a false alarm).", "",
              f"GEMM-accumulator events above the threshold: {a['detected']}/{a['faults']} detected.",
              "", "## Missed, and why", "", "| site | cause | events |", "|---|---|---|"]
    for site, cs in s["causes"].items():
        for cause, n in sorted(cs.items(), key=lambda x: -x[1]):
            lines.append(f"| {site} | {cause} | {n} |")
    lines += ["", "## Detected by", "", "| site / check | events |", "|---|---|"]
    lines += [f"| {k} | {n} |" for k, n in sorted(s["detected_by"].items())]
    lines += ["", f"Located (one-element faults, the alarm's row and column): "
              f"{s['located'].get('yes', 0)} at the element, {s['located'].get('row', 0)} at its row "
              f"only (its column sum stayed under the threshold), {s['located'].get('no', 0)} wrong.",
              "", f"Detection latency, from a fault's first event to its first alarm "
              f"({lat['faults_alarmed']} fault(s) alarmed): worst {_fmt(lat['steps_max'])} step(s) "
              f"({_fmt(lat['micro_steps_max'])} micro-step(s)), median "
              f"{_fmt(lat['micro_steps_median'])} micro-step(s).",
              "", "## What the faults did (Ma et al. 2025 metrics)", "",
              f"- worst mismatch frequency (mismatched / all elements of a submodule at a step): "
              f"{s['mismatch_frequency_max']:.3g}",
              f"- median severity (relative difference of mismatched elements): "
              f"{_fmt(s['severity_median'])}",
              f"- worst gradient deviation |g_F - g_H| / |g_H| under parameter-level sync: "
              f"{_fmt(s['grad_deviation_max'])}"]
    for f in s["free_running"]:
        what = "reseeded healthy (the noise floor)" if f["reseeded"] else "free running"
        lines.append(f"- {what} {f['trial']}: accuracy healthy {_pct(f['accuracy_healthy'])}, "
                     f"{'reseeded' if f['reseeded'] else 'faulty'} {_pct(f['accuracy_faulty'])}; "
                     f"final parameter divergence {_fmt(f['param_divergence_final'])}; worst "
                     f"relative loss gap {_fmt(f['loss_gap_max'])}; non-finite losses "
                     f"{f['loss_faulty_nonfinite']}")
    if s.get("submodules"):
        lines += ["", "## Level 1: mismatch frequency and severity per submodule", "",
                  "Computation-level sync, pooled over layers; frequency = mismatched / all "
                  "elements of the submodule's tensor at a step (medians over the points that "
                  "mismatched; early/late = mean over the first/second half of the steps).", "",
                  "| profile | point | submodule | points | frequency median | max | "
                  "early mean | late mean | severity median |", "|---|---|---|---|---|---|---|---|---|"]
        for r in s["submodules"]:
            lines.append(f"| {r['profile']} | {r['point']} | {r['submodule']} | "
                         f"{r['mismatched_points']} | {_fmt(r['frequency_median'])} | "
                         f"{_fmt(r['frequency_max'])} | {_fmt(r['frequency_early_mean'])} | "
                         f"{_fmt(r['frequency_late_mean'])} | {_fmt(r['severity_median'])} |")
    if s.get("gradient_trend"):
        lines += ["", "## Level 2: gradient deviation under parameter-level sync", "",
                  "| profile | trials | mean, first half | mean, second half | worst | non-finite steps |",
                  "|---|---|---|---|---|---|"]
        for p, o in s["gradient_trend"].items():
            lines.append(f"| {p} | {o['trials']} | {_pctf(o['first_half'])} | "
                         f"{_pctf(o['second_half'])} | {_pctf(o['max'])} | {o['nonfinite_steps']} |")
    if s.get("first_divergence"):
        lines += ["", "## Where each trial first diverged", "",
                  "The first sync point where F differed from H, and the fault active then.", "",
                  "| trial | step | first difference | fault |", "|---|---|---|---|"]
        for tid, d in s["first_divergence"].items():
            where = "" if d.get("tp_rank") is None else f" (TP rank {d['tp_rank']})"
            lines.append(f"| {tid} | {d['step']}.{d['micro_step']} | {d['point']} "
                         f"{d['module'] or '(model)'} {d['tensor']}{where} | {d['cause'] or '–'} |")
    lines += ["", "## Per node profile", "", "| profile | detected | missed | masked | rate |",
              "|---|---|---|---|---|"]
    for p, c in s["per_profile"].items():
        lines.append(f"| {p} | {c.get('detected', 0)} | {c.get('missed', 0)} | {c.get('masked', 0)} "
                     f"| {_pct(c['rate'])} |")
    lines += ["", "## Per bit class, bit count and pattern (a multi-bit flip by its highest bit)", "",
              "| site / bit class | detected | missed | masked | rate |", "|---|---|---|---|---|"]
    for k, c in s["per_bit_class"].items():
        lines.append(f"| {k} | {c.get('detected', 0)} | {c.get('missed', 0)} | {c.get('masked', 0)} "
                     f"| {_pct(c['rate'])} |")
    for title, table in (("site / bits flipped at once", s["per_bit_count"]),
                         ("site / spatial pattern", s["per_pattern"])):
        lines += ["", f"| {title} | detected | missed | masked | rate |", "|---|---|---|---|---|"]
        for k, c in table.items():
            lines.append(f"| {k} | {c.get('detected', 0)} | {c.get('missed', 0)} | "
                         f"{c.get('masked', 0)} | {_pct(c['rate'])} |")
    if s.get("plots"):
        lines += ["", "## Plots", ""]
        lines += [f"- `{n}`: {PLOTS.get(n, '')}" for n in s["plots"]]
    return "\n".join(lines) + "\n"


LONG = ("Level 1", "Where each trial first diverged", "Per bit class", "Plots")


def terminal(text):
    """The report for a terminal: every section but the long tables (in report.md)."""
    parts = text.split("\n## ")
    keep = [parts[0]] + [p for p in parts[1:] if not p.startswith(LONG)]
    left = [p.split("\n", 1)[0] for p in parts[1:] if p.startswith(LONG)]
    out = "\n## ".join(keep).rstrip("\n") + "\n"
    return out + (f"\n(in report.md: {'; '.join(left)})\n" if left else "")


def _pctf(x):
    return "–" if x is None else f"{100 * x:.3g}%"


def _fmt(x):
    return "–" if x is None else f"{x:.3g}"


def plots(trials, s, out):
    """The PNG plots; returns their file names."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(os.path.join(out, name), dpi=110)
        plt.close(fig)
        names.append(name)

    comp = [t for t in trials if t["mode"] == "computation"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ys = []
    for t in comp:
        worst = collections.defaultdict(float)
        for m in t["mismatches"]:
            if m["point"] in ("forward", "backward"):
                worst[m["step"]] = max(worst[m["step"]], m["frequency"])
        y = [worst.get(i, 0.0) for i in range(t["steps"])]
        ys += y
        ax.plot(range(t["steps"]), y, marker=".", label=t["profile"])
    _zero_log(ax, ys)
    ax.set(xlabel="step", ylabel="mismatch frequency (worst submodule)",
           title="Mismatch frequency per step, per node (computation-level sync)")
    if ax.lines:
        ax.legend(fontsize=7)
    save(fig, "mismatches_per_step.png")

    fig, ax = plt.subplots(figsize=(7, 3.6))
    by_site = collections.defaultdict(list)
    for c in s["cases"]:
        if c.get("site") and c.get("severity"):
            by_site[c["site"]].append(math.log10(max(c["severity"], 1e-12)))
    if by_site:
        ax.hist(list(by_site.values()), bins=20, label=list(by_site), stacked=True)
        ax.legend(fontsize=7)
    ax.set(xlabel="log10 relative severity (worst mismatched element)", ylabel="faults",
           title="Severity of the faults that changed the run")
    save(fig, "severity.png")

    fig, ax = plt.subplots(figsize=(7, 3.6))
    sites = sorted({k.split("/")[0] for k in s["per_bit"]})
    for site in sites:
        pts = sorted((int(k.split("/")[1]), c["rate"]) for k, c in s["per_bit"].items()
                     if k.startswith(site + "/") and c["rate"] is not None)
        if pts:
            ax.plot(*zip(*pts), marker="o", linestyle="-", label=site)
    ax.set(xlabel="bit position (fp32: 31 sign, 30-23 exponent, 22-0 mantissa)",
           ylabel="detection rate", ylim=(-0.05, 1.05), title="Detection rate against bit flipped")
    if sites:
        ax.legend(fontsize=7)
    save(fig, "detection_by_bit.png")

    fig, ax = plt.subplots(figsize=(7, 3.6))
    ys = []
    for t in trials:
        if t["mode"] == "parameter":
            ys += t["grad_deviation"]
            ax.plot([_plottable(d) for d in t["grad_deviation"]], marker=".", label=t["profile"])
    _zero_log(ax, ys)
    ax.set(xlabel="step", ylabel="|g_F - g_H| / |g_H|",
           title="Gradient deviation (parameter-level sync)")
    if ax.lines:
        ax.legend(fontsize=7)
    save(fig, "gradient_deviation.png")

    free = [t for t in trials if t["mode"] == "none"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6))
    ys = []
    for t in free:
        ys += t["param_divergence"]
        line, = a1.plot([_plottable(d) for d in t["param_divergence"]], label=t["profile"])
        bad = [i for i, d in enumerate(t["param_divergence"]) if not math.isfinite(d)]
        if bad:
            a1.axvline(bad[0], color=line.get_color(), linestyle=":",
                       label=f"{t['profile']}: F non-finite from step {bad[0]}")
        a2.plot(t["loss_healthy"], label=f"{t['profile']} healthy", linestyle="--")
        a2.plot([x if math.isfinite(x) else float("nan") for x in t["loss_faulty"]],
                label=f"{t['profile']} faulty")
    _zero_log(a1, ys)
    a1.set(xlabel="step", ylabel="|θ_F - θ_H| / |θ_H|", title="Parameter divergence")
    a2.set(xlabel="step", ylabel="loss", yscale="log", title="Loss, free running")
    if free:
        a1.legend(fontsize=7)
        a2.legend(fontsize=7)
    save(fig, "divergence_and_loss.png")

    curves = [t for t in free if t.get("accuracy_curve_faulty")]
    if curves:
        fig, ax = plt.subplots(figsize=(7, 3.6))
        for t in curves:
            hx, hy = zip(*t["accuracy_curve_healthy"])
            fx, fy = zip(*t["accuracy_curve_faulty"])
            line, = ax.plot(fx, fy, marker=".", label=f"{t['profile']}"
                            + (" (reseeded healthy)" if t.get("reseeded") else " faulty"))
            ax.plot(hx, hy, linestyle="--", color=line.get_color(), alpha=0.6,
                    label=f"{t['profile']} healthy")
        ax.set(xlabel="step", ylabel="fine-tune accuracy", ylim=(-0.05, 1.05),
               title="Accuracy over training, free running")
        ax.legend(fontsize=7)
        save(fig, "accuracy_over_training.png")
    return names


def _plottable(x):
    return x if math.isfinite(x) else float("nan")


def _zero_log(ax, ys):
    """A log axis that draws an exact 0 as 0 (symlog, linear below the smallest nonzero value),
    never as a made-up small number."""
    pos = [abs(y) for y in ys if math.isfinite(y) and y != 0]
    ax.set_yscale("symlog", linthresh=min(pos) if pos else 1.0)


def build(out, trials=None):
    """Write report.json, report.md and the plots into the run folder; returns the summary."""
    from abft.eval.campaign import read_trials
    trials = read_trials(out) if trials is None else trials
    if not trials:
        raise FileNotFoundError(f"{out}: no trials*.jsonl with finished trials")
    s = summarize(trials)
    s["plots"] = plots(trials, s, out)
    with open(os.path.join(out, "report.json"), "w", encoding="utf-8") as f:
        json.dump(s, f, indent=1, default=str)
    with open(os.path.join(out, "report.md"), "w", encoding="utf-8") as f:
        f.write(markdown(s))
    return s
