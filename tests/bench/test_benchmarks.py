"""Smoke tests of the one-off scripts in benchmarks/ (their figures are in BENCHMARKS.md): each
runs one round end to end and prints its table."""

import json
import os
import pathlib
import sys

import pytest
import torch
from paths import ROOT, compiling_env  # noqa: E402


def test_pairbench_runs_one_round(capsys):
    import pairbench
    pairbench.main(rounds=1)
    out = capsys.readouterr().out
    assert "median of 1 interleaved rounds" in out


def test_guardbench_runs_one_round(capsys):
    import guardbench
    guardbench.main(rounds=1)
    out = capsys.readouterr().out
    assert "x plain" in out and "guard all-reduce" in out


def test_fixedcost_measures_the_api_and_the_check(capsys):
    import fixedcost
    out = fixedcost.main(pairs=20, warmup=5)
    text = capsys.readouterr().out
    assert "abft.matmul + flush - plain" in text and "torch ops" in text
    assert out["api_ms"] > 0 and out["check_ms"] > 0 and 0 < out["ops"] < 2000
    assert out["torch"]["check_ms"] > 0 and 100 < out["torch"]["ops"] < 2000
    alone = fixedcost.main(pairs=10, warmup=3, alone=True)
    assert "torch" not in alone and alone["api_ms"] > 0 and alone["ops"] == out["ops"]


def test_fixedcost_alternates_with_another_kernels_tree(capsys):
    """--against: the same kernels/ loaded a second time, under another package name: both arms
    timed, the same op count, equal verdicts."""
    import pathlib
    import fixedcost
    here = pathlib.Path(ROOT) / "kernels"
    out = fixedcost.main(pairs=10, warmup=3, against=here)
    assert out["equal"] and out["--against"]["ops"] == out["ops"] and out["--against"]["api_ms"] > 0
    same, total = out["cases"]
    assert same == total >= 100
    assert "this tree / --against" in capsys.readouterr().out


@pytest.mark.parametrize("family", ["extreme", "structured"])
def test_fuzzcheck_finds_no_false_alarm_on_its_first_seeds(family, capsys):
    """40 seeds of each family: clean products that neither check alarms on, the two checks
    agreeing, corrupted ones counted; a finding's seed replays it alone."""
    import fuzzcheck
    s = fuzzcheck.run(family, cases=40, seed=0)
    assert s["seeds"] == [0, 40] and 20 <= s["clean"] <= 40
    assert s["false_alarms"] == 0 and s["differ"] == 0
    assert 0 < s["corrupted"] <= s["clean"] and s["caught_compiled"] == s["caught_torch"] <= s["corrupted"]
    one = fuzzcheck.run(family, cases=1, seed=7)
    assert one["seeds"] == [7, 8] and '"kind": "summary"' in capsys.readouterr().out


def test_fuzzcheck_kernel_family_runs_the_fused_kernel(capsys, monkeypatch):
    """A few seeds of the fused kernel (interpreted): clean products that do not alarm, corrupted
    ones caught; with the thresholds shrunk (LAMBDA 0.02) the same clean seeds alarm: the count can
    fail."""
    import fuzzcheck
    from abft.kernels import configs
    from abft.kernels import threshold as T
    if not (configs.interpreting() or torch.cuda.is_available()):
        pytest.skip("needs TRITON_INTERPRET=1 or a GPU")
    s = fuzzcheck.run_kernel(cases=6, seed=0)
    assert s["seeds"] == [0, 6] and 3 <= s["clean"] <= 6 and s["false_alarms"] == 0
    assert 0 < s["corrupted"] == s["clean"] and s["caught"] >= s["corrupted"] - 1
    monkeypatch.setattr(T, "LAMBDA", 0.02)
    assert fuzzcheck.run_kernel(cases=6, seed=0)["false_alarms"] > 0
    assert capsys.readouterr().out.count('"kind": "summary"') == 2


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_fuzzcheck_grouped_family_checks_grouped_products_through_the_api(backend, capsys):
    """Seeds of every form of grouped product, forward and both gradients, through abft.grouped_mm:
    no false alarm, the corrupted groups caught; with the threshold shrunk (lam 0.02) clean seeds
    alarm: the count can fail."""
    import abft
    import fuzzcheck
    from abft.kernels import configs
    if backend == "triton" and not (configs.interpreting() or torch.cuda.is_available()):
        pytest.skip("needs TRITON_INTERPRET=1 or a GPU")
    cases = 20 if backend == "reference" else 4
    s = fuzzcheck.run_grouped(cases=cases, seed=0, backend=backend)
    assert s["seeds"] == [0, cases] and s["clean"] >= cases - 2 and s["false_alarms"] == 0
    assert s["products"] > 3 * s["clean"] and 0 < s["corrupted"] == s["caught"]
    if backend == "reference":
        with abft.config(lam=0.02):
            assert fuzzcheck.run_grouped(cases=10, seed=0)["false_alarms"] > 0
    assert '"kind": "summary"' in capsys.readouterr().out


@pytest.mark.parametrize("argv,field", [(["--family", "wild"], "--family"), (["--seconds", "0"], "--seconds"),
                                        (["--cases", "0"], "--cases"), (["--against", "/nonexistent"], "--against"),
                                        (["--family", "kernel", "--against", "kernels"], "--against"),
                                        (["--family", "grouped", "--backend", "cuda"], "--backend")])
def test_fuzzcheck_refuses_bad_input_naming_the_field(argv, field, capsys):
    import fuzzcheck
    with pytest.raises(SystemExit) as e:
        fuzzcheck.main(argv)
    assert e.value.code == 2 and field in capsys.readouterr().err


def test_fuzzcheck_against_another_tree_runs_as_a_script():
    """``--against`` run as a script under PYTHONSAFEPATH=1, from the repository root: it
    imported fixedcost from a path that is not searched then."""
    import subprocess
    root = pathlib.Path(ROOT)
    out = subprocess.run([sys.executable, "benchmarks/fuzzcheck.py", "--cases", "2", "--against", "kernels"],
                         cwd=root, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONSAFEPATH": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["clean"] == 2 and summary["false_alarms"] == summary["false_alarms_against"] == 0


@pytest.mark.slow
def test_fixedcost_compiles_the_check_to_the_same_verdicts(capsys):
    import fixedcost
    out = fixedcost.main(pairs=20, warmup=5, compile=True)
    assert out["compiled_equal"] and out["compile_s"] > 0 and out["compiled_ms"] > 0


def test_rowflips_counts_the_flips_each_kernel_catches(capsys):
    """Small shapes (the interpreter): the table's rows, and a sign it counts: the high bits are
    all above bf16 rounding and all caught by both kernels."""
    import rowflips
    from abft.kernels.configs import interpreting
    if not interpreting():
        pytest.skip("the kernels run under TRITON_INTERPRET=1 here")
    rows = rowflips.run(m=8, k=64, n=96, seeds=1, bits=(12, 30))
    assert [r["bit"] for r in rows] == [12, 30]
    top = rows[1]
    assert top["above"] == 8 * 96 and top["row"] == top["tile"] == top["above"]
    assert rows[0]["row"] <= rows[0]["above"] and rows[0]["tile"] <= rows[0]["above"]
    rowflips.main(["--m", "8", "--k", "64", "--n", "64", "--seeds", "1"])
    assert "| 31 |" in capsys.readouterr().out


@pytest.mark.slow
def test_rowfloor_decomposes_the_row_checks_cost(tmp_path):
    """benchmarks/rowfloor.py compiles its variants of the row check (edits of its source: they
    must still apply) and prints each part's share, a floor below every estimate as built, and
    what BENCHMARKS.md says of warp specialisation on sm_90a (pinned: a change there is news)."""
    import os
    import re
    import subprocess
    import sys
    env = compiling_env()
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "rowfloor.py"),
                          "--out", str(tmp_path)], env=env, capture_output=True, text=True,
                         check=True).stdout
    for v in ("as built", "host descriptors", "two loops, no slice", "one loop + epilogue"):
        assert f"| {v} |" in out
    parts = re.search(r"the epilogue (\d+) .*, the second loop (-?\d+) .*, V, W and the slice's "
                      r"sums (-?\d+) ", out)
    assert parts and all(int(x) > 0 for x in parts.groups()), out
    assert int(re.search(r"the epilogue's arithmetic: (\d+) instructions", out).group(1)) > 0
    est = {}
    for line in out.splitlines():
        m = re.match(r"\| (\S+ \w+ \S+) \| (as built|floor \(share loop \+ (\d+)\)) \|"
                     r".* (\d\.\d{4}) \|$", line)
        if m:
            assert m.group(3) is None or int(m.group(3)) > 0
            est.setdefault(m.group(1), {})[m.group(2).split(" (")[0]] = float(m.group(4))
    assert len(est) == 6, out
    assert all(1.0 < e["floor"] < e["as built"] for e in est.values()), est
    ws = {(int(w), f == "True"): int(n) for w, f, n in re.findall(
        r"(\d) warps, warp_specialize=True flatten=(\w+): USETMAXREG (\d+)", out)}
    assert ws[(8, False)] == 0 and ws[(4, False)] > 0, ws
    assert int(re.search(r"Gluon gl.warp_specialize, two partitions: USETMAXREG (\d+)",
                         out).group(1)) > 0


def test_operandcost_prices_a_small_layer(capsys):
    """The operands' paper cost on a GPU: a small Llama layer counted at 8 and 16 tokens; taking
    operands adds fingerprints, their elements grow with the tokens, and a one-read kernel's
    traffic is below torch's (which writes and reads a float64 copy)."""
    pytest.importorskip("transformers")
    import operandcost
    assert operandcost.main(["--shapes", "64x128x4x2", "--tokens", "8"]) == 0
    row = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| 64 x 128")][0]
    cells = [c.strip() for c in row.strip("|").split("|")]
    fingerprints, per_token = float(cells[1]), float(cells[2])
    traffic_ratio = float(cells[7].split()[1].strip("()"))
    one_read = float(cells[8])
    assert fingerprints > 0 and per_token > 0 and 0 < one_read < traffic_ratio


def _small_runs():
    """(script, its entry point's name, arguments of a small case, what it needs)."""
    return [("attnbench", "main", ["--shapes", "2x2x32x16", "--reps", "3"], None),
            ("guardbench", "cli", ["--rounds", "1"], None),
            ("pairbench", "cli", ["--rounds", "1"], None),
            ("fixedcost", "cli", ["--pairs", "10"], None),
            ("fuzzcheck", "main", ["--cases", "3"], None),
            ("operandcost", "main", ["--shapes", "64x128x4x2", "--tokens", "8"], "transformers"),
            ("sensitivity", "main", ["--k", "64", "--trials", "2", "--backends", "reference",
                                     "--dists", "gaussian", "--dtypes", "float32"], None),
            ("gpu_threshold", "main", ["--groups", "8", "--bits", "30", "--trials", "1",
                                       "--k", "128"], "interpreter"),
            ("rowflips", "main", ["--m", "8", "--k", "64", "--n", "64", "--seeds", "1"],
             "interpreter")]


def _well_formed(path, name):
    doc = json.loads(pathlib.Path(path).read_text())
    assert doc["name"] == name and doc["command"].startswith(f"python benchmarks/{name}.py")
    assert doc["date"][:2] == "20" and doc["seconds"] >= 0 and doc["note"] == "test"
    m = doc["machine"]
    assert m["cores"] >= 1 and m["torch"] == torch.__version__ and len(m["load_average"]) == 3
    assert {"cpu", "triton", "gpu", "interpreter"} <= set(m)
    assert doc["figures"]
    return doc


@pytest.mark.parametrize("name,entry,argv,needs", _small_runs(), ids=[r[0] for r in _small_runs()])
def test_each_script_writes_its_data_file(name, entry, argv, needs, tmp_path, capsys):
    """``--json FILE``: the machine, the date, the command line and the figures, in one file."""
    import importlib
    from abft.kernels.configs import interpreting
    if needs == "transformers":
        pytest.importorskip("transformers")
    if needs == "interpreter" and not interpreting():
        pytest.skip("the kernels run under TRITON_INTERPRET=1 here")
    out = tmp_path / f"{name}.json"
    getattr(importlib.import_module(name), entry)(argv + ["--json", str(out), "--note", "test"])
    doc = _well_formed(out, name)
    assert doc["command"].endswith(f"--json {out} --note test")
    assert capsys.readouterr().out          # the printed table stays


def test_json_without_a_file_names_benchmarks_data():
    import argparse
    from abft.bench import results
    ap = argparse.ArgumentParser()
    results.add_arguments(ap, "fixedcost")
    assert ap.parse_args(["--json"]).json == os.path.join("benchmarks", "data", "fixedcost.json")
    assert ap.parse_args([]).json is None


def test_abft_bench_writes_its_data_file(tmp_path, capsys):
    from abft import cli
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--shapes", "64x64x64,linear:8x16x24", "--reps", "3",
                     "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["name"] == "bench" and doc["command"].split()[1] == "bench"
    rows = doc["figures"]["rows"]
    assert [r["shape"] for r in rows] == ["matmul 64x64x64", "linear 8x16x24"]
    assert all(r["ratio"] > 0 and r["q1"] <= r["q3"] and r["reps"] == 3 for r in rows)


def _committed_data():
    return sorted((pathlib.Path(ROOT) / "benchmarks" / "data").glob("*.json"))


def test_plot_draws_the_committed_data(tmp_path):
    """benchmarks/plot.py on benchmarks/data: a PNG for every file it has a plot for, and the
    headline table a row per file."""
    import plot
    files = _committed_data()
    assert any(f.name.startswith("validate_") for f in files) and len(files) >= 8
    assert plot.main(["--out", str(tmp_path)]) == 0
    pngs = {p.stem for p in tmp_path.glob("*.png")}
    want = {f.stem for f in files if plot.kind(json.loads(f.read_text())) in
            set(plot.PLOTS) | {"validate"}}
    assert pngs == want and all((tmp_path / f"{p}.png").stat().st_size > 5000 for p in pngs)
    rows = plot.table(pathlib.Path(ROOT) / "benchmarks" / "data").splitlines()[2:]
    assert [r.split("`")[1] for r in rows] == [f.name for f in files]
    assert all(r.rstrip(" |").split("|")[-1].strip() for r in rows)   # a headline each


def test_benchmarks_readme_shows_the_current_table():
    """benchmarks/README.md's table is ``plot.py --table`` of the committed data."""
    import plot
    readme = (pathlib.Path(ROOT) / "benchmarks" / "README.md").read_text()
    assert plot.table(pathlib.Path(ROOT) / "benchmarks" / "data") in readme


def test_committed_data_files_are_well_formed():
    for f in _committed_data():
        doc = json.loads(f.read_text())
        if "sections" in doc:               # an abft bench --validate report
            assert doc["env"]["card"] and doc["sections"]
            continue
        assert doc["command"] and doc["date"] and doc["machine"]["cpu"] and doc["figures"], f
        assert f.stem == doc["name"], f
