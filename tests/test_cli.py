import subprocess
import sys

import pytest
import torch

import abft
from abft import cli
from abft.bench import overhead


def test_version():
    out = subprocess.run([sys.executable, "-m", "abft.cli", "--version"], capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == f"abft {abft.__version__}"


def test_demo_locates_the_fault(capsys):
    assert cli.main(["demo", "--size", "96", "--bit", "24"]) == 0
    out = capsys.readouterr().out
    assert "located at the injected element: True" in out and "bit-identical to torch.matmul: True" in out


def test_bench_runs_on_small_shapes(capsys):
    assert cli.main(["bench", "--shapes", "64x32x48,linear:16x8x4", "--reps", "3"]) == 0
    out = capsys.readouterr().out
    assert "matmul 64x32x48" in out and "linear 16x8x4" in out


def test_interleaved_reports_the_median_ratio_of_its_pairs(monkeypatch):
    """interleaved() times checked and plain back to back, alternating their order: with timings
    of 2, 3, 4, 5, 11 ms against 1 ms its ratio is the median 4 (not the mean 5), its quartiles 2.5
    and 8."""
    plain, checked = overhead.make_pair("matmul", 32, 32, 32)
    times = iter([1e-3, 2e-3, 3e-3, 1e-3, 1e-3, 4e-3, 5e-3, 1e-3, 1e-3, 11e-3])
    calls = []
    monkeypatch.setattr(overhead, "_time", lambda fn, sync: (calls.append(fn), next(times))[1])
    r = overhead.interleaved(plain, checked, 5)
    assert calls == [plain, checked, checked, plain, plain, checked, checked, plain, plain, checked]
    assert (r["ratio"], r["q1"], r["q3"]) == (4.0, 2.5, 8.0)
    assert (r["plain_ms"], r["checked_ms"]) == (1.0, 4.0)
    assert overhead.parse_shapes("4x5x6,linear:1x2x3") == [("matmul", 4, 5, 6), ("linear", 1, 2, 3)]


def test_bench_a_model_training_step(capsys):
    assert cli.main(["bench", "--model", "abft.eval.models:bench_gpt", "--reps", "2"]) == 0
    assert "train step abft.eval.models:bench_gpt" in capsys.readouterr().out


def test_bench_cuda_smoke_runs_the_kernel_path(capsys):
    assert cli.main(["bench", "--device", "cuda", "--smoke"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "ms" not in line]
    assert [r.split(" | ")[1] for r in rows] == ["matmul 64x64x64", "forward 48x40x72",
                                                "grad_input 48x72x40", "grad_weight 72x48x40"]
    assert all(r.endswith("| 0 |") for r in rows)            # no false alarm
    assert all(float(r.split(" | ")[-2]) <= 2 for r in rows)  # within twice torch's error


def test_bench_rotation_covers_twice_the_l2():
    from abft.bench.overhead import rotation
    assert rotation(64 << 20, 50 << 20) == 2 and rotation(1 << 20, 50 << 20) == 64
    assert rotation(10 << 20, 50 << 20) * (10 << 20) >= 2 * (50 << 20)


@pytest.mark.parametrize("detector", ["rest", "recompute", "comm", "carry", "operands"])
def test_bench_a_detector_on_a_training_step(capsys, detector):
    plain, on = overhead.detector_step_pair(overhead.load_factory("abft.eval.models:bench_gpt"),
                                            detector)
    for _ in range(2):
        a, b = plain(), on()
        assert torch.equal(a, b)                    # the check reads, it never changes the run
    assert cli.main(["bench", "--model", "abft.eval.models:bench_gpt", "--detector", detector,
                     "--reps", "2"]) == 0
    assert f"train step abft.eval.models:bench_gpt ({detector})" in capsys.readouterr().out
    assert abft.flush() == []
