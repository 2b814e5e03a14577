"""The plots and the headline table of benchmarks/data/*.json (``python benchmarks/plot.py``, or
``make plots``): one PNG per file that has something to plot, in benchmarks/plots/;
``--table`` prints the headline of every file as a Markdown table instead (benchmarks/README.md's).

A file is what a script wrote with ``--json`` (``abft.bench.results``: name, command, date,
machine, figures), or an ``abft bench --validate`` report (validate_*.json)."""
import argparse
import json
import pathlib
import shlex
import sys

HERE = pathlib.Path(__file__).resolve().parent


def _ratio_bars(ax, labels, series, ylabel="checked / plain", ref=1.0):
    """Grouped bars: ``series`` {name: [(median, q1, q3) or value per label]}; a dashed line
    at ``ref`` (None: none)."""
    width = 0.8 / len(series)
    for i, (name, vals) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(labels))]
        mid = [v[0] if isinstance(v, (list, tuple)) else v for v in vals]
        err = None
        if all(isinstance(v, (list, tuple)) for v in vals):
            err = [[m - v[1] for m, v in zip(mid, vals)], [v[2] - m for m, v in zip(mid, vals)]]
        ax.bar(xs, mid, width, yerr=err, label=name, capsize=3)
    if ref is not None:
        ax.axhline(ref, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    if len(series) > 1:
        ax.legend(fontsize=7)


def _iqr(r):
    return (r["ratio"], r["q1"], r["q3"])


def plot_bench(doc, ax):
    rows = doc["figures"]["rows"]
    _ratio_bars(ax, [r["shape"] for r in rows], {"checked / plain (IQR)": [_iqr(r) for r in rows]})


def plot_attnbench(doc, ax):
    rows = doc["figures"]["rows"]
    _ratio_bars(ax, [r["shape"] for r in rows],
                {"torch attention": [_iqr(r["torch_attention"]) for r in rows],
                 "checked sdpa": [_iqr(r["checked_sdpa"]) for r in rows]},
                "with invariants / without")


def plot_steps(doc, ax):
    over = doc["figures"]["over_plain"]
    _ratio_bars(ax, list(over), {"step / plain step": list(over.values())}, "x plain step")


def plot_fixedcost(doc, ax):
    f = doc["figures"]
    arms = {"compiled check": f, "torch check": f.get("torch")}
    arms = {k: v for k, v in arms.items() if v}
    _ratio_bars(ax, list(arms), {"api: abft.matmul + flush - plain": [v["api_ms"] for v in arms.values()],
                                 "check alone": [v["check_ms"] for v in arms.values()]}, "ms", None)
    ax.set_yscale("log")


def plot_rowfloor(doc, ax):
    gemms = doc["figures"]["gemms"]
    labels = list(dict.fromkeys(g["shape"] for g in gemms))
    kinds = list(dict.fromkeys(g["label"] for g in gemms))
    by = {(g["shape"], g["label"]): g["estimated_ratio"] for g in gemms}
    _ratio_bars(ax, [s.rsplit(" ", 1)[0] for s in labels],
                {k: [by[(s, k)] for s in labels] for k in kinds}, "estimated checked / unchecked")
    ax.set_ylim(0.95, max(by.values()) * 1.02)


def plot_static(doc, ax):
    f = doc["figures"]
    tile = f["cost"]
    series = {"tile kernel": [c["estimated_ratio"] for c in tile]}
    rows = f.get("rows", {}).get("cost", [])
    if len(rows) == len(tile):
        series["row check"] = [c["estimated_ratio"] for c in rows]
    _ratio_bars(ax, [c["shape"].rsplit(" ", 1)[0] for c in tile], series,
                "estimated checked / unchecked")
    ax.set_ylim(0.95, max(max(v) for v in series.values()) * 1.02)


def _per_bit(ax, rows, series):
    for name, key in series.items():
        ax.plot([r["bit"] for r in rows], [key(r) for r in rows], marker="o", ms=3, label=name)
    ax.set_xlabel("flipped accumulator bit")
    ax.set_ylabel("detected")
    ax.legend(fontsize=8)


def _share(n, d):
    return n / d if d else float("nan")


def plot_bitflips(doc, ax):
    rows = doc["figures"]["rows"] if "figures" in doc else doc
    _per_bit(ax, rows, {"fused kernel": lambda r: r["fused"], "reference": lambda r: r["reference"],
                        "fused, of flips above bf16 rounding":
                            lambda r: _share(r["above_detected"], r["above_rounding"])})


def plot_rowflips(doc, ax):
    _per_bit(ax, doc["figures"]["rows"],
             {"row check": lambda r: _share(r["row"], r["above"]),
              "tile kernel": lambda r: _share(r["tile"], r["above"])})
    ax.set_ylabel("detected, of flips above bf16 rounding")


def plot_gpu_threshold(doc, ax):
    groups = doc["figures"]["groups"]
    _per_bit(ax, next(iter(groups.values())),
             {f"G={g}": (lambda r, g=g: _share(r["above_detected"], r["above_rounding"]))
              for g in groups})


def plot_validate(doc, ax):
    sec = validate_report(doc)["sections"]
    if sec.get("bitflips", {}).get("status") == "ok":
        plot_bitflips(sec["bitflips"]["result"]["rows"], ax)


PLOTS = {"bench": plot_bench, "attnbench": plot_attnbench, "guardbench": plot_steps,
         "pairbench": plot_steps, "fixedcost": plot_fixedcost, "rowfloor": plot_rowfloor,
         "bitflips": plot_bitflips, "bench_static": plot_static, "rowflips": plot_rowflips, "gpu_threshold": plot_gpu_threshold}


def kind(doc):
    """The script that wrote ``doc`` (``abft bench``'s training steps read as its products)."""
    if "sections" in doc:
        return "validate"
    return "bench" if doc["name"].startswith("bench_step_") else doc["name"]


def validate_report(doc):
    """An ``abft bench --validate`` report: the file itself (--out/validate.json), or the
    figures of one written with --json."""
    return doc if "sections" in doc else doc["figures"]


def where(doc):
    """The file's machine and date, briefly."""
    if "sections" in doc:
        return f"{doc['env']['card']}, {doc['env']['date'][:10]}"
    m = doc["machine"]
    return f"{m['gpu'] or m['cpu']} ({m['cores']} cores), {doc['date'][:10]}"


def plot_all(data, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for path in sorted(pathlib.Path(data).glob("*.json")):
        doc = json.loads(path.read_text())
        fn = plot_validate if kind(doc) == "validate" else PLOTS.get(kind(doc))
        if fn is None:
            continue
        fig, ax = plt.subplots(figsize=(7, 3.6), dpi=80)
        fn(doc, ax)
        ax.set_title(f"{path.stem}: {where(doc)}", fontsize=9)
        fig.tight_layout()
        png = out / f"{path.stem}.png"
        fig.savefig(png)
        plt.close(fig)
        written.append(png)
    return written


def headline(doc):
    """One line of what a file says, from its figures."""
    k = kind(doc)
    if k == "validate":
        s = validate_report(doc)["sections"]
        b, st = s["bitflips"]["result"], s["stress"]["result"]
        t = s["timings"]["result"]
        per = [g["checked_ms"] / g["unchecked_ms"] for g in t["gemms"]]
        lay = ", ".join(f"{r['shape']} {r['ratio']:.1f}x" for r in t["layers"])
        return (f"fused kernel checked / unchecked per GEMM {min(per):.2f}-{max(per):.2f}; bf16 "
                f"flips above rounding missed: {b['above_missed']} of {b['above_rounding']}; "
                f"stress: {st['alarmed_tiles']} false alarms in {st['cases']} cases; "
                f"a protected nn.Linear step against a plain one: {lay}")
    f = doc["figures"]
    if k == "bench":
        return "checked / plain: " + ", ".join(f"{r['shape']} {r['ratio']:.3f}" for r in f["rows"])
    if k == "attnbench":
        return "torch attention with invariants / without: " + ", ".join(
            f"{r['shape']} {r['torch_attention']['ratio']:.3f}" for r in f["rows"])
    if k in ("guardbench", "pairbench"):
        return "x plain step: " + ", ".join(f"{n} {v:.2f}" for n, v in f["over_plain"].items()
                                            if n != "plain")
    if k == "fixedcost":
        return (f"{f['size']}^3 float32: api {f['api_ms']:.3f} ms, check {f['check_ms']:.3f} ms "
                f"({f['ops']} torch ops)" + (f"; torch check {f['torch']['check_ms']:.3f} ms"
                                             if "torch" in f else ""))
    if k == "fuzzcheck":
        return (f"{f['family']}, seeds {f['seeds'][0]}-{f['seeds'][1]}: {f['clean']} clean, "
                f"{f['false_alarms']} false alarms, {f.get('differ', 0)} differing; corrupted "
                f"caught {f.get('caught_compiled', f.get('caught'))} of {f['corrupted']}")
    if k == "operandcost":
        return "operands / GEMMs on paper: " + ", ".join(
            f"{r['shape']} {r['over_gemms']:.3f} (traffic {r['traffic_over_gemms']:.3f})" for r in f["rows"])
    if k == "rowfloor":
        return "layer, estimated checked / unchecked: " + ", ".join(
            f"{r['layer']} {r['label']} {r['ratio']:.4f}" for r in f["layers"]
            if r["label"] in ("as built", "floor"))
    if k == "rowflips":
        return (f"flips above bf16 rounding caught: row check {sum(r['row'] for r in f['rows'])}, "
                f"tile kernel {sum(r['tile'] for r in f['rows'])}, of "
                f"{sum(r['above'] for r in f['rows'])}")
    if k in ("bitflips", "gpu_threshold"):
        rows = f["rows"] if k != "gpu_threshold" else [r for g in f["groups"].values() for r in g]
        above = sum(r["above_rounding"] for r in rows)
        caught = sum(r["above_detected"] for r in rows)
        return f"flips above bf16 rounding caught: {caught} of {above}"
    if k == "sensitivity":
        return f"{len(f['rows'])} cases, S from {min(r['S'] for r in f['rows']):.1f} to " \
               f"{max(r['S'] for r in f['rows']):.1f}"
    if k == "bench_static":
        est = [c["estimated_ratio"] for c in f["cost"]]
        line = f"tile kernel, estimated checked / unchecked per GEMM: {min(est):.3f}-{max(est):.3f}"
        if "rows" in f:
            est = [c["estimated_ratio"] for c in f["rows"]["cost"]]
            line += (f"; row check {min(est):.4f}-{max(est):.4f}, a layer " +
                     ", ".join(f"{r['estimated_ratio']:.4f}" for r in f["rows"]["layers"]))
        return line
    return ""


def command(doc):
    """The command line without its --note (the file keeps both)."""
    if "command" not in doc:
        return "abft bench --validate"
    words = shlex.split(doc["command"])
    if "--note" in words:
        i = words.index("--note")
        del words[i:i + 2]
    return shlex.join(words)


def load(doc):
    """The load average when the run started and ended (a validate report has none)."""
    if "machine" not in doc:
        return "-"
    return f"{doc['load_at_start'][0]:.1f}, {doc['machine']['load_average'][0]:.1f}"


def table(data):
    lines = ["| file | command | machine, date | load average (start, end) | headline |",
             "|---|---|---|---|---|"]
    for path in sorted(pathlib.Path(data).glob("*.json")):
        doc = json.loads(path.read_text())
        lines.append(f"| `{path.name}` | `{command(doc)}` | {where(doc)} | {load(doc)} | "
                     f"{headline(doc)} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=str(HERE / "data"))
    ap.add_argument("--out", default=str(HERE / "plots"))
    ap.add_argument("--table", action="store_true", help="print the headline table, no plots")
    args = ap.parse_args(argv)
    if args.table:
        print(table(args.data))
        return 0
    for png in plot_all(args.data, args.out):
        print(png, file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
