"""The fused kernel's compiled Hopper code, read without a GPU (``abft bench --static``): the SASS
reader is tested on the kernel before "The checked kernel at tensor-core speed" (the figures that
issue measured), then the gates hold for every checked main kernel at the LLM shapes."""
import json
import os
import subprocess
import sys

import pytest

from abft.bench import rows, sass, static
from paths import DATA, compiling_env  # noqa: E402



def test_the_sass_reader_reproduces_the_figures_of_the_kernel_before(tmp_path):
    """Compiled as the issue compiled it (bf16, 128 x 128 x 64, 8 warps, 3 stages, no argument
    specialisation): about 3,942 instructions in the HGMMA loop against 601 with CHECK=False,
    about 1,000 shuffles and 1,100 FADDs, about 300 local-memory instructions per K step."""
    subprocess.run([sys.executable, os.path.join(DATA, "compile_31901d1.py"), str(tmp_path)],
                   check=True, env=compiling_env(), capture_output=True)
    checked, plain = (sass.summary(str(tmp_path / f"old_{c}.cubin")) for c in (True, False))
    assert 3800 <= checked["loop_instructions"] <= 4100, checked["loop_instructions"]
    assert 560 <= plain["loop_instructions"] <= 640, plain["loop_instructions"]
    assert 250 <= checked["loop_local"] <= 350 and plain["loop_local"] == 0
    assert 900 <= checked["loop_by_opcode"]["SHFL"] <= 1150
    assert 1000 <= checked["loop_by_opcode"]["FADD"] <= 1200
    assert checked["loop_tensor_core_instructions"] == plain["loop_tensor_core_instructions"] == 4


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("static")
    r = subprocess.run([sys.executable, "-m", "abft.cli", "bench", "--static", "--out", str(out)],
                       env=compiling_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "estimated checked / unchecked" in r.stdout
    return out, json.loads((out / "report.json").read_text())


def test_the_report_has_every_kernel_and_its_cubin(report):
    out, rep = report
    fields = {"name", "role", "variant", "arch", "config", "cubin", "regs", "spills",
              "loop_instructions", "loop_tensor_core_instructions", "loop_by_opcode"}
    for k in rep["kernels"]:
        assert fields <= set(k), fields - set(k)
        assert (out / k["cubin"]).stat().st_size > 0 and k["arch"] == "sm_90"
    roles = {(k["role"], k["variant"]) for k in rep["kernels"]}
    assert roles == {("prepass_a", "checked"), ("prepass_b", "checked"), ("main", "checked"),
                     ("main", "unchecked")}
    for c in rep["cost"]:
        assert {"shape", "extra_flops", "extra_bytes", "estimated_ratio"} <= set(c)
    assert len(rep["cost"]) == 6            # two layers x forward, grad_input, grad_weight


def _pairs(rep):
    """(checked, unchecked) main kernels of each GEMM."""
    out = {}
    for k in rep["kernels"]:
        if k["role"] == "main":
            for use in k["used_by"]:
                out.setdefault(use, {})[k["variant"]] = k
    return out


def test_every_checked_main_kernel_has_a_lean_loop_and_no_spills(report):
    """Tensor-core instructions in the main loop, no local memory anywhere in the kernel, and a
    loop of at most 1.10 times the unchecked kernel's instructions (its K loop is the unchecked
    loop: loads and the dot; the checksums ride in the tiles)."""
    _, rep = report
    for use, p in _pairs(rep).items():
        c, u = p["checked"], p["unchecked"]
        assert c["loop_tensor_core_instructions"] > 0, use
        assert c["spills"] == 0 and c["stack"] == 0, (use, c["spills"], c["stack"])
        assert c["loop_instructions"] <= static.GATE_LOOP * u["loop_instructions"], \
            (use, c["loop_instructions"], u["loop_instructions"])


@pytest.mark.xfail(strict=True, reason="not met: the pre-pass reads each activation once more "
                   "(5% of a 4096-wide GEMM at H200's ratio of FLOP/s to bytes/s), and the "
                   "checksum rows take 3 to 8 of 128 tile rows and columns; see BENCHMARKS.md")
def test_the_estimated_cost_is_within_five_percent(report):
    _, rep = report
    worst = max(c["estimated_ratio"] for c in rep["cost"])
    assert worst <= static.GATE_COST, worst


def test_bad_arch_and_unwritable_out_get_one_line_and_exit_2(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    for argv, word in ((["--arch", "75"], "--arch"), (["--out", str(blocker / "sub")], "--out")):
        r = subprocess.run([sys.executable, "-m", "abft.cli", "bench", "--static", *argv],
                           capture_output=True, text=True)
        assert r.returncode == 2, r
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and word in lines[0], r.stderr
        assert not (blocker / "sub").exists()


def test_the_row_check_is_compiled_and_costed(report):
    """``kernels/rowcheck.py`` at the same shapes: its main kernel checked and unchecked and its
    verify kernel, each GEMM's cost in parts, each layer's."""
    out, rep = report
    rw = rep["rows"]
    assert {(k["role"], k["variant"]) for k in rw["kernels"]} == {
        ("main", "checked"), ("main", "unchecked"), ("verify", "checked")}
    for k in rw["kernels"]:
        assert (out / k["cubin"]).stat().st_size > 0
    assert len(rw["cost"]) == 6 and len(rw["layers"]) == 2
    for c in rw["cost"]:
        parts = ("tensor_s", "smem_s", "share_s", "hot_s", "outside_s", "bytes_s", "verify_s")
        assert all(c[p] >= 0 for p in parts if p != "hot_s"), c
        assert abs(c["checked_s"] - c["unchecked_s"] - sum(c[p] for p in parts)) < 1e-12
        assert c["verify_s"] >= rows.LAUNCH_S


def test_every_row_checked_kernel_keeps_the_product_loop_lean_and_asynchronous(report):
    """No spills; two K loops, the slice's (its share of the steps, the tensor-core
    instructions of the slice besides the product's) and the hot loop, at most 1.10 times the
    unchecked loop's instructions; every loop's wgmma stays in flight across its waits (a branch
    in the loop made ptxas serialise them: C7515)."""
    _, rep = report
    uses = {}
    for k in rep["rows"]["kernels"]:
        if k["role"] == "main":
            for use in k["used_by"]:
                uses.setdefault(use, {})[k["variant"]] = k
    assert len(uses) == 6
    for use, p in uses.items():
        c, u = p["checked"], p["unchecked"]
        assert c["spills"] == 0 and c["stack"] == 0, (use, c["spills"])
        assert len(c["loops"]) == 2 and len(u["loops"]) == 1, use
        share, hot = sorted(c["loops"], key=lambda lp: -lp["tensor_core_instructions"])
        assert share["tensor_core_instructions"] > hot["tensor_core_instructions"]
        assert hot["instructions"] <= static.GATE_LOOP * u["loops"][0]["instructions"], \
            (use, hot["instructions"], u["loops"][0]["instructions"])
        assert all(lp["async_wgmma"] for lp in c["loops"] + u["loops"]), use


@pytest.mark.xfail(strict=True, reason="not met: 1.035-1.061 per GEMM, 1.037 and 1.053 a layer "
                   "(BENCHMARKS.md): at K = 4096 the code outside the K loops (the second loop's "
                   "prologue, the epilogue's row sums) is 2.6%, the share steps' instructions 1.5%, "
                   "the A tile to registers 0.8%, the verify launch 0.5%; benchmarks/rowfloor.py: "
                   "the 4096 -> 4096 layer's floor in this form is 1.025, above 1.02")
def test_the_row_checks_estimated_cost_is_within_three_percent(report):
    _, rep = report
    worst = max(c["estimated_ratio"] for c in rep["rows"]["cost"])
    layer = max(lay["estimated_ratio"] for lay in rep["rows"]["layers"])
    assert worst <= rows.GATE_COST and layer <= rows.GATE_LAYER, (worst, layer)
