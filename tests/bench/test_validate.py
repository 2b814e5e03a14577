"""``abft bench --validate``: the GPU check in one command (its smoke run under the interpreter),
its bad input, and the accumulation probe's models."""
import json
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest
import torch

from abft.bench import accumulation as A
from abft.bench import validate


def _bench(*argv):
    return subprocess.run([sys.executable, "-m", "abft.cli", "bench", *argv], capture_output=True,
                          text=True)


def test_smoke_runs_every_section_and_writes_json_and_markdown(tmp_path):
    r = _bench("--validate", "--smoke", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads((tmp_path / "validate.json").read_text())
    secs = rep["sections"]
    assert list(secs) == list(validate.SECTIONS)
    assert all(s["status"] == "ok" for s in secs.values()), secs
    st = secs["stress"]["result"]
    assert st["cases"] > 0 and st["skipped"] == 0
    assert st["alarmed_tiles"] == 0 and st["not_ok_tiles"] == 0 and st["values_off"] == 0
    assert {row["layout"] for row in st["rows"]} == {"nn", "nt", "tn"}
    bf = secs["bitflips"]["result"]
    assert bf["above_rounding"] > 0 and bf["above_missed"] == 0
    t = secs["timings"]["result"]
    assert [g["gemm"] for g in t["gemms"]] == ["forward", "grad_input", "grad_weight"]
    assert all(g["alarms"] == 0 for g in t["gemms"]) and t["layers"][0]["alarms"] == 0
    assert [a["dtype"] for a in secs["accumulation"]["result"]] == ["bfloat16", "float16",
                                                                   "float32/tf32"]
    rw = secs["rows"]["result"]
    assert rw["stress"]["cases"] > 0 and rw["stress"]["skipped"] == 0
    assert rw["stress"]["alarmed"] == 0 and rw["stress"]["not_ok"] == 0
    assert rw["stress"]["values_off"] == 0
    assert [f["bit"] for f in rw["flips"]] == [14, 15, 30] and rw["flips"][2]["row"] > 0
    assert [g["gemm"] for g in rw["timings"]] == ["forward", "grad_input", "grad_weight"]
    assert all(g["alarms"] == 0 and g["checked_ms"] > 0 for g in rw["timings"])
    md = (tmp_path / "validate.md").read_text()
    assert "| stress | ok |" in md and "| layer (forward + backward) |" in md
    assert "| rows | ok |" in md and "| row check: GEMM |" in md


@pytest.mark.parametrize("argv,needle", [
    (["--validate", "--out", "{tmp}"], "--validate needs a CUDA device"),
    (["--validate", "--smoke", "--out", "{tmp}/file/sub"], "--out"),
    (["--validate", "--smoke", "--budget", "0", "--out", "{tmp}"], "--budget"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, argv, needle):
    if torch.cuda.is_available() and needle.startswith("--validate"):
        pytest.skip("a CUDA device is present")
    (tmp_path / "file").write_text("")
    r = _bench(*[a.format(tmp=tmp_path) for a in argv])
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr
    assert not (tmp_path / "validate.json").exists()


def test_a_failing_section_is_recorded_and_the_others_still_run(tmp_path, monkeypatch):
    monkeypatch.setattr(validate, "bitflips", lambda dev, smoke: 1 / 0)
    monkeypatch.setattr(validate, "SECTIONS", ("bitflips", "accumulation"))
    monkeypatch.setattr(validate, "accumulation", lambda dev, smoke: [])
    rep = validate.run(str(tmp_path), smoke=True, budget=60)
    assert rep["sections"]["bitflips"]["status"] == "error"
    assert "ZeroDivisionError" in rep["sections"]["bitflips"]["error"]
    assert rep["sections"]["accumulation"]["status"] == "ok"
    assert "| bitflips | error |" in (tmp_path / "validate.md").read_text()


def test_the_simulator_is_an_fp32_chain_with_groups_of_one():
    rng = np.random.default_rng(0)
    for _ in range(100):
        x = (rng.standard_normal(40) * 2.0 ** rng.integers(-20, 20, 40)).astype(np.float32)
        acc = np.float32(0)
        for v in x:
            acc = np.float32(acc + v)
        assert A.simulate([Fraction(float(v)) for v in x], 1, None, "rn") == Fraction(float(acc))


def test_a_round_toward_zero_chain_loses_what_round_to_nearest_keeps():
    one, u = Fraction(1), Fraction(1, 2 ** 24)          # u: half an ulp of 1
    terms = [one, Fraction(3, 2) * u]                   # 1 + 0.75 ulp
    assert A.simulate(terms, 1, None, "rn") == 1 + 2 * u
    assert A.simulate(terms, 1, None, "rz") == 1
    assert A.simulate([-t for t in terms], 1, None, "rz") == -1


@pytest.mark.parametrize("truth", [(16, 2, "rz"), (8, 0, "rz"), (4, None, "rn"), (32, 3, "rz")])
def test_the_probe_rows_identify_the_group_and_the_rounding(truth):
    """Results made by one model are fitted by it, and every model that fits has its group and
    rounding (the rows cannot tell apart F >= 2 extra bits, nor groups of 1 and 2)."""
    cases = A.rows(torch.bfloat16, 64)
    observed = [float(A.simulate(t, *truth)) for _, t in cases]
    fits = [f for f in A.fit(observed, cases) if f["mismatches"] == 0]
    assert dict(group=truth[0], extra_bits=truth[1], rounding=truth[2], mismatches=0) in fits
    assert {(f["group"], f["rounding"]) for f in fits} == {truth[::2]}


def test_group16_sets_the_measured_accumulation_and_restores_the_model(monkeypatch):
    from abft.kernels import threshold as T
    from abft.kernels import triton_gemm as TG
    seen = []
    probe = lambda *a, **k: seen.append((TG.accumulation(4096, torch.bfloat16, False, 32),
                                         TG.accumulation(4096, torch.float32, True, 32))) or {}
    monkeypatch.setattr(validate, "bitflips", probe)
    monkeypatch.setattr(validate, "stress", probe)
    real = TG.accumulation
    validate.group16("cpu", True, 0)
    assert TG.accumulation is real
    assert seen[0][0] == T.blocked(4096, 16, directed=True)
    assert seen[0][1] == real(4096, torch.float32, True, 32)          # tf32 keeps the model's
