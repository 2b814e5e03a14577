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

from abft.eval.crosscheck import cases
from abft.eval.faults import SITES

OUTCOMES = ("detected", "missed", "masked", "false_alarm", "not_applied")


def _rate(c):
    n = c["detected"] + c["missed"]
    return c["detected"] / n if n else None


def summarize(trials):
    """The report as a dict (what report.json holds)."""
    per_site = {s: collections.Counter() for s in SITES}
    per_profile = collections.defaultdict(collections.Counter)
    per_class = collections.defaultdict(collections.Counter)
    per_bit = collections.defaultdict(collections.Counter)
    causes = collections.defaultdict(collections.Counter)
    by = collections.Counter()
    located = collections.Counter()
    latency = []
    false_alarms = 0
    all_cases = []
    for t in trials:
        if t["mode"] == "none":
            continue                    # free running: differences compound, no attribution
        for c in cases(t):
            c["trial"], c["profile"] = t["id"], t["profile"]
            all_cases.append(c)
            if c["site"] is None:
                false_alarms += c["outcome"] == "false_alarm"
                continue
            per_site[c["site"]][c["outcome"]] += 1
            per_profile[t["profile"]][c["outcome"]] += 1
            if c.get("bit_class"):
                per_class[(c["site"], c["bit_class"])][c["outcome"]] += 1
                for b in c["bits"]:
                    per_bit[(c["site"], b)][c["outcome"]] += 1
            if c["outcome"] == "missed":
                causes[c["site"]][c["cause"]] += 1
            if c["outcome"] == "detected":
                by[(c["site"], c["by"].split(":")[0] if c["site"] == "weight_memory" else "checksum")] += 1
                if c.get("located") is not None:
                    located[{True: "yes", "row": "row"}.get(c["located"], "no")] += 1
                latency.append(c["latency"])
    acc_detect = [c for c in all_cases if c.get("site") == "gemm_accumulator"
                  and c["outcome"] in ("detected", "missed")]
    above = [c for c in acc_detect if (c.get("ratio") or 0) > 1 or c["outcome"] == "detected"]
    mism = [m for t in trials if t["mode"] != "none" for m in t["mismatches"]]
    null = [t for t in trials if not t["events"]]
    return {
        "trials": len(trials),
        "null": {"trials": len(null), "mismatches": sum(len(t["mismatches"]) for t in null),
                 "alarms": sum(len(t["alarms"]) + len(t["alarms_healthy"]) for t in null)},
        "per_site": {s: dict(c, rate=_rate(c)) for s, c in per_site.items() if c},
        "per_profile": {p: dict(c, rate=_rate(c)) for p, c in per_profile.items()},
        "per_bit_class": {f"{s}/{b}": dict(c, rate=_rate(c)) for (s, b), c in sorted(per_class.items())},
        "per_bit": {f"{s}/{b}": dict(c, rate=_rate(c)) for (s, b), c in sorted(per_bit.items())},
        "causes": {s: dict(c) for s, c in causes.items()},
        "detected_by": {f"{s}/{k}": n for (s, k), n in by.items()},
        "accumulator_above_threshold": {"faults": len(above),
                                        "detected": sum(c["outcome"] == "detected" for c in above)},
        "located": dict(located),
        "latency_steps_max": max(latency) if latency else None,
        "false_alarms": false_alarms,
        "mismatch_frequency_max": max((m["frequency"] for m in mism), default=0.0),
        "severity_median": _median([m["severity_max"] for m in mism if math.isfinite(m["severity_max"])]),
        "grad_deviation_max": max((d for t in trials for d in t["grad_deviation"]
                                   if math.isfinite(d)), default=0.0),
        "free_running": [{"trial": t["id"], "accuracy_healthy": t["accuracy_healthy"],
                          "accuracy_faulty": t["accuracy_faulty"],
                          "param_divergence_final": t["param_divergence"][-1] if t["param_divergence"] else None,
                          "loss_faulty_max": _finite_max(t["loss_faulty"]),
                          "loss_faulty_nonfinite": sum(not math.isfinite(x) for x in t["loss_faulty"])}
                         for t in trials if t["mode"] == "none"],
        "accuracy": {t["id"]: [t["accuracy_healthy"], t["accuracy_faulty"]] for t in trials},
        "wall_s": sum(t["wall_s"] for t in trials),
        "cases": all_cases,
    }


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def _finite_max(xs):
    f = [x for x in xs if math.isfinite(x)]
    return max(f) if f else None


def _pct(x):
    return "–" if x is None else f"{100 * x:.0f}%"


def markdown(s):
    lines = ["# abft detection coverage", "",
             f"{s['trials']} trials. Null campaign (no faults): {s['null']['trials']} trial(s), "
             f"{s['null']['mismatches']} mismatches, {s['null']['alarms']} alarms. "
             f"False alarms in all trials: {s['false_alarms']}.", "",
             "## Coverage per site", "",
             "| site | faults | detected | missed | masked | false alarm | not applied | detection rate |",
             "|---|---|---|---|---|---|---|---|"]
    for site, c in s["per_site"].items():
        n = sum(c.get(o, 0) for o in OUTCOMES)
        lines.append(f"| {site} | {n} | " + " | ".join(str(c.get(o, 0)) for o in OUTCOMES)
                     + f" | {_pct(c['rate'])} |")
    a = s["accumulator_above_threshold"]
    lines += ["", f"GEMM-accumulator faults above the threshold: {a['detected']}/{a['faults']} detected. "
              f"Detection rate = detected / (detected + missed): faults that changed the run.", "",
              "## Missed, and why", "", "| site | cause | cases |", "|---|---|---|"]
    for site, cs in s["causes"].items():
        for cause, n in sorted(cs.items(), key=lambda x: -x[1]):
            lines.append(f"| {site} | {cause} | {n} |")
    lines += ["", "## Detected by", "", "| site / check | cases |", "|---|---|"]
    lines += [f"| {k} | {n} |" for k, n in sorted(s["detected_by"].items())]
    lines += ["", f"Located (one-element faults, the alarm's row and column): "
              f"{s['located'].get('yes', 0)} at the element, {s['located'].get('row', 0)} at its row "
              f"only (its column sum stayed under the threshold), {s['located'].get('no', 0)} wrong. "
              f"Worst detection latency: {s['latency_steps_max']} steps.",
              "", "## Per bit class (bit flips)", "",
              "| site / bit class | detected | missed | masked | rate |", "|---|---|---|---|---|"]
    for k, c in s["per_bit_class"].items():
        lines.append(f"| {k} | {c.get('detected', 0)} | {c.get('missed', 0)} | {c.get('masked', 0)} "
                     f"| {_pct(c['rate'])} |")
    lines += ["", "## Per node profile", "", "| profile | detected | missed | masked | rate |",
              "|---|---|---|---|---|"]
    for p, c in s["per_profile"].items():
        lines.append(f"| {p} | {c.get('detected', 0)} | {c.get('missed', 0)} | {c.get('masked', 0)} "
                     f"| {_pct(c['rate'])} |")
    lines += ["", "## What the faults did (Ma et al. 2025 metrics)", "",
              f"- worst mismatch frequency (mismatched / all elements of a submodule at a step): "
              f"{s['mismatch_frequency_max']:.3g}",
              f"- median severity (relative difference of mismatched elements): "
              f"{_fmt(s['severity_median'])}",
              f"- worst gradient deviation |g_F - g_H| / |g_H|: {s['grad_deviation_max']:.3g}"]
    for f in s["free_running"]:
        lines.append(f"- free running {f['trial']}: accuracy healthy {_pct(f['accuracy_healthy'])}, "
                     f"faulty {_pct(f['accuracy_faulty'])}; final parameter divergence "
                     f"{_fmt(f['param_divergence_final'])}; non-finite faulty losses "
                     f"{f['loss_faulty_nonfinite']}")
    return "\n".join(lines) + "\n"


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
    for t in comp:
        counts = collections.Counter()
        for m in t["mismatches"]:
            counts[m["step"]] += m["mismatched"]
        ax.plot(range(t["steps"]), [counts.get(i, 0) for i in range(t["steps"])], marker=".",
                label=t["profile"])
    ax.set(xlabel="step", ylabel="mismatched elements (all sync points)", yscale="symlog",
           title="Mismatches per step, per node (computation-level sync)")
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
    for t in trials:
        if t["mode"] == "parameter":
            ax.plot([max(d, 1e-12) for d in t["grad_deviation"]], marker=".", label=t["profile"])
    ax.set(xlabel="step", ylabel="|g_F - g_H| / |g_H|", yscale="log",
           title="Gradient deviation (parameter-level sync)")
    if ax.lines:
        ax.legend(fontsize=7)
    save(fig, "gradient_deviation.png")

    free = [t for t in trials if t["mode"] == "none"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6))
    for t in free:
        line, = a1.plot([max(d, 1e-12) for d in t["param_divergence"]], label=t["profile"])
        bad = [i for i, d in enumerate(t["param_divergence"]) if not math.isfinite(d)]
        if bad:
            a1.axvline(bad[0], color=line.get_color(), linestyle=":",
                       label=f"{t['profile']}: F non-finite from step {bad[0]}")
        a2.plot(t["loss_healthy"], label=f"{t['profile']} healthy", linestyle="--")
        a2.plot([x if math.isfinite(x) else float("nan") for x in t["loss_faulty"]],
                label=f"{t['profile']} faulty")
    a1.set(xlabel="step", ylabel="|θ_F - θ_H| / |θ_H|", yscale="log", title="Parameter divergence")
    a2.set(xlabel="step", ylabel="loss", yscale="log", title="Loss, free running")
    if free:
        a1.legend(fontsize=7)
        a2.legend(fontsize=7)
    save(fig, "divergence_and_loss.png")
    return names


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
