"""The fused checked-GEMM kernel (small shapes: under the interpreter on a machine without a GPU,
as ``conftest.py`` decides)."""
import os

import pytest
import torch

triton = pytest.importorskip("triton")

from stress import DISTRIBUTIONS, operands  # noqa: E402
from abft.kernels import configs, layout as L, naive  # noqa: E402
from abft.kernels import threshold as T  # noqa: E402
from abft.kernels import triton_gemm as TG  # noqa: E402

pytestmark = pytest.mark.skipif(not configs.interpreting() and not torch.cuda.is_available(),
                                reason="needs TRITON_INTERPRET=1 or a GPU")
DT = lambda d: str(d).replace("torch.", "")


def _err(c, ref):
    e = (c.double() - ref).abs()
    return e.max().item(), e.square().mean().sqrt().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=DT)
@pytest.mark.parametrize("case", ["odd", "k_ragged", "batched", "transposed", "broadcast", "bias", "addend"])
def test_values_within_twice_torch_error(case, dtype):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)
    bias = None
    if case == "odd":
        a, b = r(37, 45), r(45, 29)
    elif case == "k_ragged":
        a, b = r(32, 77), r(77, 32)
    elif case == "batched":
        a, b = r(3, 20, 40), r(3, 40, 18)
    elif case == "transposed":
        a, b = r(45, 37).t(), r(29, 45).t()
    elif case == "broadcast":
        a, b = r(2, 21, 33), r(33, 19)
    elif case == "bias":
        a, b, bias = r(30, 40), r(40, 20), r(20)
    if case == "addend":             # baddbmm: beta * input + alpha * a @ b, input broadcast
        a, b, d = r(2, 30, 40), r(2, 40, 20), r(2, 30, 1)
        c, v, (rr, rc) = TG.checked_gemm(a, b, addend=d, alpha=0.5, beta=-2.0)
        ref = torch.baddbmm(d.double(), a.double(), b.double(), alpha=0.5, beta=-2.0)
        theirs = _err(torch.baddbmm(d, a, b, alpha=0.5, beta=-2.0), ref)
    else:
        c, v, (rr, rc) = TG.checked_gemm(a, b, bias)
        ref = torch.matmul(a.double(), b.double()) + (0 if bias is None else bias.double())
        theirs = _err(torch.matmul(a, b) + (0 if bias is None else bias), ref)
    mine = _err(c, ref)
    ulp = torch.finfo(dtype).eps * ref.abs().max().item()
    assert mine[0] <= 2 * theirs[0] + ulp and mine[1] <= 2 * theirs[1] + ulp
    assert (v[..., L.STATUS] == L.OK).all()
    assert v[..., L.ROW_RATIO].max() <= 1 and v[..., L.COL_RATIO].max() <= 1


def test_verdict_is_written_by_every_tile(monkeypatch):
    real_empty = torch.empty
    monkeypatch.setattr(TG.torch, "empty", lambda *s, **k: real_empty(*s, **k).fill_(float("nan")))
    a, b = torch.randn(2, 70, 40), torch.randn(2, 40, 65)
    c, v, (rr, rc) = TG.checked_gemm(a, b, tiles=(32, 32))
    dm, dn = TG.data_tiles(a, b, (32, 32))
    assert not torch.isnan(v).any() and not torch.isnan(rr).any() and not torch.isnan(rc).any()
    assert not torch.isnan(c).any() and v.shape == (2, -(-70 // dm), -(-65 // dn), L.NFIELDS)
    assert v.shape[1] * v.shape[2] >= 9


@pytest.mark.parametrize("kind,extra", [("bitflip", dict(bit=30)), ("bitflip", dict(bit=29)), ("bitflip", dict(bit=22)),
                                        ("bitflip", dict(bit=31)), ("add", dict(value=0.5)),
                                        ("zero", {})])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DT)
def test_injected_accumulator_fault_is_located(kind, extra, dtype):
    torch.manual_seed(1)
    a, b = torch.randn(2, 64, 96).to(dtype), torch.randn(2, 96, 64).to(dtype)
    inj = dict(kind=kind, batch=1, row=45, col=12, k_step=1, **extra)
    clean, _, _ = TG.checked_gemm(a, b, tiles=(32, 32))
    c, v, (rr, rc) = TG.checked_gemm(a, b, tiles=(32, 32), inject=inj)
    dm, dn = TG.data_tiles(a, b, (32, 32))
    alarmed = L.alarmed(v)
    assert alarmed.nonzero().tolist() == [[1, 45 // dm, 12 // dn]]
    t = v[1, 45 // dm, 12 // dn]
    assert (int(t[L.ROW]), int(t[L.COL])) == (45, 12)
    assert not torch.equal(c, clean)


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
@pytest.mark.parametrize("k", [1, 7, 64, 300])
def test_no_false_alarm_on_the_stress_set(dist, k):
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        a, b = operands(dist, 64, k, 64, dt, 0)
        c, v, _ = TG.checked_gemm(a, b)
        worst = max(v[..., L.ROW_RATIO].max().item(), v[..., L.COL_RATIO].max().item())
        assert worst <= 1, f"{dist} K={k} {dt}: {worst}"
        assert (v[..., L.STATUS] == L.OK).all()


@pytest.mark.parametrize("dist", ["gaussian", "all_positive", "llm_outliers", "cancellation", "rows_scaled"])
@pytest.mark.parametrize("k", [64, 300])
def test_an_error_above_the_naive_worst_case_is_caught_and_located(dist, k):
    """``abft.kernels.naive``'s worst case bounds a clean sum's round-off, so an accumulator error
    of twice it is a fault the kernel must alarm in its tile and locate (the kernel's thresholds
    stay below the oracle's bound; the reference's gate is in test_threshold.py)."""
    i, j = 40, 9
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        a, b = operands(dist, 64, k, 64, dt, 0)
        c, v, _ = TG.checked_gemm(a, b, tiles=(32, 32))
        assert not L.alarmed(v).any()
        dm, dn = TG.data_tiles(a, b, (32, 32))
        wc, wr = naive.worst_case(a, b, c, dm, dn)
        w = max(wc[i // dm, j].item(), wr[i, j // dn].item())
        _, v1, _ = TG.checked_gemm(a, b, tiles=(32, 32), inject=dict(kind="add", row=i, col=j, value=2 * w))
        assert L.alarmed(v1).nonzero().tolist() == [[i // dm, j // dn]], f"{DT(dt)}: an error of 2x the bound {w:.3g}"
        t = v1[i // dm, j // dn]
        assert (int(t[L.ROW]), int(t[L.COL])) == (i, j)


def test_every_gpu_config_launches_once():
    """Each config the GPU autotuner may pick runs here once (its BLOCK_K; warps and stages are
    the GPU's business), on the GPU's 128 x 128 tile, so a GPU run cannot die on an untried BLOCK_K;
    a fault is still located with each."""
    a, b = torch.randn(160, 128), torch.randn(128, 144)
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        ref = a.to(dt).double() @ b.to(dt).double()
        bks = sorted({cfg.kwargs["BLOCK_K"] for cfg in configs.configs(128, 128, dt, interpret=False)})
        assert bks == ([32, 64] if dt.itemsize == 2 else [32])
        for bk in bks:
            cfg = triton.Config({"BLOCK_K": bk}, num_warps=4, num_stages=1)
            c, v, _ = TG.checked_gemm(a.to(dt), b.to(dt), tiles=(128, 128), config=cfg)
            assert v.shape[:2] == (2, 2) and (v[..., L.STATUS] == L.OK).all()
            assert v[..., L.ROW_RATIO].max() <= 1 and v[..., L.COL_RATIO].max() <= 1
            assert (c.double() - ref).abs().max() < 1e-2 * ref.abs().max()
            _, v, _ = TG.checked_gemm(a.to(dt), b.to(dt), tiles=(128, 128), config=cfg,
                                      inject=dict(kind="bitflip", row=130, col=140, bit=30))
            assert v[1, 1, L.ROW] == 130 and v[1, 1, L.COL] == 140


def test_nonfinite_inputs_are_unverified_and_checks_compile_out():
    a, b = torch.randn(40, 40), torch.randn(40, 40)
    a[3, 3] = float("nan")
    _, v, _ = TG.checked_gemm(a, b)
    assert (v[0, :, L.STATUS] == L.UNVERIFIED).all()
    c, v, d = TG.checked_gemm(b, b, check=False)
    assert v is None and torch.allclose(c, b @ b, atol=1e-4)


def test_triton_backend_through_the_api():
    import abft
    x, w, bias = torch.randn(2, 20, 48), torch.randn(40, 48), torch.randn(40)
    with abft.config(backend="triton"):
        y = abft.linear(x, w, bias)
        torch.testing.assert_close(y, torch.nn.functional.linear(x, w, bias), rtol=1e-5, atol=1e-5)
        with abft.scope(module="fc", step=3):
            with abft.inject(row=25, col=7, kind="bitflip", bit=29):
                abft.linear(x, w, bias)
        (al,) = abft.flush()
        assert (al.backend, al.module, al.batch, al.row, al.col) == ("triton", "fc", (1,), 5, 7)
        with abft.config(policy="recompute"):
            with abft.inject(row=3, col=4, kind="add", value=2.0):
                out = abft.mm(x[0], w.t())
        torch.testing.assert_close(out, x[0] @ w.t(), rtol=1e-5, atol=1e-5)
        assert abft.alarms()[-1].persistence == "transient"
        xg, ref = x.clone().requires_grad_(), x.clone().requires_grad_()
        before = abft.stats()["checked_calls"]
        abft.linear(xg, w, bias).sum().backward()          # grad_input through the kernel (mm)
        torch.nn.functional.linear(ref, w, bias).sum().backward()
        torch.testing.assert_close(xg.grad, ref.grad, rtol=1e-5, atol=1e-5)
        assert abft.flush() == [] and abft.stats()["checked_calls"] - before == 2  # forward, grad_input


@pytest.mark.parametrize("mode", ["truncate", "nearest"])
def test_tf32_inputs_are_allowed_for_and_faults_still_caught(mode, monkeypatch):
    """tf32 emulated in the kernel (inputs chopped or rounded to 10 mantissa bits before the dot,
    checksums from the fp32 inputs, as on a GPU): no false alarm on the stress set; without the
    tf32 allowance the same products alarm, so the allowance is what makes them pass."""
    worst = {}
    for dist in DISTRIBUTIONS:
        a, b = operands(dist, 64, 300, 64, torch.float32, 0)
        c, v, _ = TG.checked_gemm(a, b, tf32=mode)
        worst[dist] = max(v[..., L.ROW_RATIO].max().item(), v[..., L.COL_RATIO].max().item())
        assert (v[..., L.STATUS] == L.OK).all()
    assert max(worst.values()) <= 1, worst
    a, b = operands("gaussian", 64, 300, 64, torch.float32, 0)
    c, v, _ = TG.checked_gemm(a, b, tf32=mode)
    fp32 = a.double() @ b.double()
    assert (c.double() - fp32).abs().max() > 100 * (a @ b - fp32).abs().max()     # tf32 really ran
    monkeypatch.setattr(T, "TF32_UNIT", 0.0)
    _, v0, _ = TG.checked_gemm(a, b, tf32=mode)
    assert L.alarmed(v0).any()
    monkeypatch.undo()
    # a fault at a tenth of the worst-case bound of the tf32 product's column sum is caught
    dm, dn = TG.data_tiles(a, b, (32, 32), tf32=mode)
    rows = a[40 // dm * dm:(40 // dm + 1) * dm]             # the tile's rows
    bound = (2 * 2.0 ** -10 + 300 * 2.0 ** -24) * (rows.abs().double() @ b.abs().double())[:, 9].sum().item()
    _, v1, _ = TG.checked_gemm(a, b, tf32=mode, tiles=(32, 32),
                               inject=dict(kind="add", row=40, col=9, value=bound / 10))
    alarmed = L.alarmed(v1).nonzero().tolist()
    assert alarmed == [[40 // dm, 9 // dn]]
    assert (int(v1[40 // dm, 9 // dn, L.ROW]), int(v1[40 // dm, 9 // dn, L.COL])) == (40, 9)


def _cases():
    r = torch.randn
    return {
        "mm": (lambda: (r(40, 50), r(50, 30)), torch.mm, "mm", (7, 20)),
        "bmm": (lambda: (r(3, 40, 50), r(3, 50, 30)), torch.bmm, "bmm", (7, 20)),
        "matmul_mv": (lambda: (r(40, 50), r(50)), torch.matmul, "matmul", (7, 0)),
        "matmul_fold": (lambda: (r(2, 20, 50), r(50, 30)), torch.matmul, "matmul", (27, 20)),
        "matmul_broadcast": (lambda: (r(2, 1, 10, 50), r(3, 50, 30)), torch.matmul, "matmul", (7, 20)),
        "addmm": (lambda: (r(30), r(40, 50), r(50, 30)),
                  lambda i, a, b: torch.addmm(i, a, b, beta=0.5, alpha=2.0), "addmm", (7, 20)),
        "baddbmm": (lambda: (r(3, 40, 1), r(3, 40, 50), r(3, 50, 30)),
                    lambda i, a, b: torch.baddbmm(i, a, b, beta=2.0, alpha=-0.5), "baddbmm", (7, 20)),
        "linear": (lambda: (r(2, 20, 50), r(30, 50), r(30)), torch.nn.functional.linear, "linear", (27, 20)),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_every_product_runs_on_the_kernel(name):
    """matmul, mm, bmm, addmm, baddbmm and linear with backend="triton": torch's values (to
    rounding) and shapes, and an accumulator fault is alarmed by the kernel at its element."""
    import abft
    make, ref, op, (row, col) = _cases()[name]
    torch.manual_seed(0)
    args = make()
    fn = {"mm": abft.ops.mm, "bmm": abft.ops.bmm, "matmul": abft.ops.matmul, "linear": abft.ops.linear,
          "addmm": lambda i, a, b: abft.ops.addmm(i, a, b, beta=0.5, alpha=2.0),
          "baddbmm": lambda i, a, b: abft.ops.baddbmm(i, a, b, beta=2.0, alpha=-0.5)}[op]
    with abft.config(backend="triton"):
        out = fn(*args)
        torch.testing.assert_close(out, ref(*args), rtol=1e-5, atol=1e-4)
        with abft.inject(row=row, col=col, kind="add", value=3.0):
            bad = fn(*args)
        (al,) = abft.flush()
    assert not torch.equal(bad, out)
    assert (al.backend, al.op, al.col) == ("triton", op, col)
    if name in ("matmul_fold", "linear"):          # rows folded from (2, 20): reported unfolded
        assert (al.batch, al.row) == ((row // 20,), row % 20)
    else:
        assert al.row == row


def test_backward_products_run_on_the_kernel():
    """Both gradient GEMMs of matmul go through the kernel: gradients match torch's, and a fault
    in grad_b's accumulator is alarmed there, labelled with its phase."""
    import abft
    torch.manual_seed(0)
    a, b = torch.randn(2, 20, 40, requires_grad=True), torch.randn(40, 30, requires_grad=True)
    (a @ b).square().sum().backward()
    ga, gb = a.grad, b.grad
    a.grad = b.grad = None
    with abft.config(backend="triton"):
        abft.matmul(a, b).square().sum().backward()
        assert abft.flush() == []
        torch.testing.assert_close((a.grad, b.grad), (ga, gb), rtol=1e-4, atol=1e-4)
        with abft.inject(when=lambda ctx: ctx.phase == "grad_b", row=5, col=6, kind="add", value=2.0):
            abft.matmul(a, b).square().sum().backward()
        (al,) = abft.flush()
    assert (al.backend, al.phase, al.row, al.col) == ("triton", "grad_b", 5, 6)


def _twice(a, b):
    c, v, _ = TG.checked_gemm(a, b)
    return c * 2, v


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_matches_eager(backend):
    torch._dynamo.reset()
    a, b = torch.randn(37, 45), torch.randn(45, 29)
    c, v = torch.compile(_twice, fullgraph=True, backend=backend)(a, b)
    c0, v0 = _twice(a, b)
    assert torch.equal(c, c0) and torch.equal(v, v0)


TRACE = """
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
from abft.kernels import triton_gemm as TG
graphs = []
def capture(gm, example_inputs):
    graphs.append(gm)
    def run(*args):
        raise KeyboardInterrupt        # traced only: no GPU here to run the kernel
    return run
def f(a, b, bias):
    c, v, _ = TG.checked_gemm(a, b.t(), bias)
    return c.relu(), v
try:
    torch.compile(f, fullgraph=True, backend=aot_autograd(fw_compiler=capture))(
        torch.randn(40, 48), torch.randn(24, 48), torch.randn(24))
except KeyboardInterrupt:
    pass
nodes = [n for n in graphs[0].graph.nodes if "triton_kernel_wrapper" in str(n.target)]
name = lambda n: getattr(kernel_side_table.get_kernel(n.kwargs["kernel_idx"]), "fn", None).__name__
main = [n for n in nodes if name(n) == "checked_gemm_kernel"]
print(len(nodes), sum(name(n) == "prepass_kernel" for n in nodes), len(main),
      main[0].kwargs["kwargs"]["CHECK"])
from abft.kernels import configs
for dt in (torch.float32, torch.bfloat16):           # the GPU autotuner: the factory's configs,
    tuner = TG._autotuned(128, 128, dt)              # keyed on arguments the kernel has
    same = lambda cs: [(c.kwargs, c.num_warps, c.num_stages) for c in cs]
    assert same(tuner.configs) == same(configs.configs(128, 128, dt, interpret=False))
    assert set(tuner.keys) <= set(tuner.arg_names) and {"M", "N", "K", "CHECK"} <= set(tuner.keys)
print("tuner ok")
"""


def test_torch_compile_traces_the_kernel_itself():
    """Without the interpreter the launches are triton_ops: torch.compile sees the kernels (the
    pre-passes' and the main kernel's triton_kernel_wrapper_functional nodes), not opaque calls.
    Traced here, run on GPUs only."""
    import subprocess
    import sys
    from paths import compiling_env
    env = compiling_env()
    out = subprocess.run([sys.executable, "-c", TRACE], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    # the pre-passes of both operands and the main kernel
    assert out.stdout.split()[-6:] == ["3", "2", "1", "True", "tuner", "ok"], out.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_record_policy_call_is_capturable_in_a_cuda_graph():
    """After a warm-up call (which autotunes), a checked call under the record policy makes no
    host synchronisation and replays from a CUDA graph; a fault placed in the captured launch
    is alarmed when the replay's verdict is flushed. (The capture queues one verdict: a flush
    reads the latest replay's, once.)"""
    import abft
    a = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(512, 384, device="cuda", dtype=torch.bfloat16)
    with abft.config(backend="triton", policy="record"):
        with abft.inject(row=100, col=200, kind="add", value=64.0):
            abft.ops.mm(a, b)                              # warm-up: autotune both variants
        abft.ops.mm(a, b)
        abft.flush()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            abft.ops.mm(a, b)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert abft.flush() == []
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s), torch.cuda.graph(g):
            with abft.inject(row=100, col=200, kind="add", value=64.0):
                c = abft.ops.mm(a, b)
        g.replay()
        torch.cuda.synchronize()
        (al,) = abft.flush()
    assert (al.backend, al.row, al.col) == ("triton", 100, 200)
    ref = a.double() @ b.double()
    ref[100, 200] += 64.0
    assert (c.double() - ref).abs().max() < 0.05 * ref.abs().max()


def test_bitflip_table_script_runs():
    """benchmarks/bitflips.py (the BENCHMARKS per-bit table) on a small K: exponent flips are always
    seen, and every flip above the bf16 rounding of its element is detected."""
    import bitflips                     # benchmarks/bitflips.py
    rows = bitflips.run(m=32, k=256, n=32, trials=2, bits=[3, 30])
    assert [r["bit"] for r in rows] == [3, 30] and rows[1]["fused"] == 1.0
    assert all(r["above_detected"] == r["above_rounding"] for r in rows)


def test_correct_policy_on_a_scaled_product():
    """baddbmm with alpha = -0.5 on the kernel: the residual is reported in C's units, so the
    correct policy subtracts it and the result equals the fault-free one."""
    import abft
    torch.manual_seed(0)
    i, a, b = torch.randn(3, 40, 1), torch.randn(3, 40, 50), torch.randn(3, 50, 30)
    ref = torch.baddbmm(i, a, b, beta=2.0, alpha=-0.5)
    with abft.config(backend="triton", policy="correct"):
        with abft.inject(row=7, col=20, kind="add", value=3.0, batch=(1,)):
            out = abft.ops.baddbmm(i, a, b, beta=2.0, alpha=-0.5)
    (al,) = [x for x in abft.alarms() if x.op == "baddbmm"][-1:]
    assert (al.action, al.batch, al.row, al.col) == ("corrected", (1,), 7, 20)
    assert al.residual == pytest.approx(-1.5, rel=1e-3)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)


def test_interpreted_bf16_output_is_rounded_to_nearest():
    """The interpreter's fp32 -> bf16 cast truncates; a GPU rounds to nearest even. The kernel
    rounds explicitly when interpreting, so its bf16 output is the accumulator rounded by torch."""
    torch.manual_seed(0)
    a, b = torch.randn(37, 45).bfloat16(), torch.randn(45, 29).bfloat16()
    acc, _, _ = TG.checked_gemm(a.float(), b.float())          # fp32 output: the accumulator
    c, _, _ = TG.checked_gemm(a, b)
    assert torch.equal(c, acc.to(torch.bfloat16))
    assert not torch.equal(c, (acc.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16))


def test_huge_accumulator_fault_is_an_alarm_not_unverified():
    """Bit 30 flipped in a partial sum below 2 makes it ~1e38, still finite: the squared sums of
    the threshold overflowed float32 and the tile was left unverified (a miss in the per-bit
    table). Squares are clamped, so the huge error is alarmed at its element."""
    import triton
    bk128 = triton.Config({"BLOCK_K": 128}, num_warps=4, num_stages=1)
    g = torch.Generator().manual_seed(30 * 1009 + 9)        # benchmarks/bitflips.py's trial 9 of bit 30
    a = torch.randn(32, 4096, generator=g).to(torch.bfloat16)
    b = torch.randn(4096, 32, generator=g).to(torch.bfloat16)
    c, v, _ = TG.checked_gemm(a, b, config=bk128,
                              inject=dict(kind="bitflip", row=3, col=31, k_step=18, bit=30))
    assert 1e37 < abs(c[3, 31].float().item()) < float("inf")
    t = v[0, 0]
    assert t[L.STATUS] == L.OK and t[L.ROW_RATIO] > 1 and t[L.COL_RATIO] > 1
    assert (int(t[L.ROW]), int(t[L.COL])) == (3, 31)


@pytest.mark.parametrize("k", [2, 40, 64])
@pytest.mark.parametrize("transpose", [False, True])
def test_a_checksum_split_into_subnormal_fp16_parts_does_not_alarm_at_small_k(transpose, k):
    """fp16 checksums are split into fp16 parts in units 2^S finer than their block's
    (``prepass.chk_shift``; S = 10 for these blocks of 29 rows); a column whose sum is small
    beside the block's largest value falls to fp16's subnormal grid there and errs by up to half
    of it (``prepass.split_error``: 2^-(25 + S) of the block's scale). At K <= SMALL_K the
    threshold is capped by the worst case, which must count that error too. Found by
    ``fuzzcheck.py --family kernel --seed 20000000`` (seed 20001383: ratios up to 620). Here row
    1 sums every column to 3 2^-24, 1.5 points of the grid in the shifted units: each rounds up
    by half a point, and every column sum of C reads off its prediction by k - 1 times that
    (ratios 0.71-0.99 with the allowance, 4e4-1e5 without). With ``transpose`` the same for a
    row sum (B's checksum)."""
    m = 16
    a = torch.zeros(m, k, dtype=torch.float16)
    a[0, 0] = 1024.0                       # the block's scale: 2^11
    a[1, :] = 3 * 2.0 ** -24
    b = torch.ones(k, 16, dtype=torch.float16)
    b[0, :] = 0
    if transpose:                          # C^T = B^T A^T: the same numbers in the row sums
        a, b = b.t().contiguous(), a.t().contiguous()
    c, verdict, _ = TG.checked_gemm(a, b, tiles=(32, 32))
    assert torch.equal(c, torch.matmul(a, b))
    assert not L.alarmed(verdict).any(), verdict


@pytest.mark.parametrize("transpose", [False, True])
def test_checksum_split_errors_of_one_sign_over_many_k_do_not_alarm(transpose):
    """Above SMALL_K too: fp16 checksums whose split errs the same way at every k (here each
    column's sum lies between 1.5 and 1.7 points of fp16's subnormal grid in the block's units,
    beside one large value that sets the block's scale, so every one rounds up) put the
    prediction off by eta sum_k |y_kj|, not by a random walk: a variance allowance (eta^2/3 y1)
    gave ratios up to 2.7 at K = 512. Positive B: the errors add. The threshold now bounds the
    split error deterministically, and fp16's parts are split 2^S above the block's units
    (``prepass.chk_shift``), where these sums are normal numbers: the split is exact, the ratios
    near 0 (0.62 with the bound alone, the parts unshifted)."""
    g = torch.Generator().manual_seed(0)
    k = 512
    n = torch.randint(193, 219, (k,), generator=g).double()
    a = (n * 2.0 ** -24).expand(16, k).clone()
    a[0, 0] = 1024.0
    a = a.half()
    b = (0.5 + 0.5 * torch.rand(k, 16, generator=g, dtype=torch.float64)).half()
    b[0, :] = 0
    if transpose:
        a, b = b.t().contiguous(), a.t().contiguous()
    c, verdict, detail = TG.checked_gemm(a, b, tiles=(32, 32))
    assert torch.equal(c, torch.matmul(a, b))
    assert not L.alarmed(verdict).any(), verdict
    assert max(float(d.abs().max()) for d in detail) < 0.05


def test_a_launch_plan_crosses_the_custom_op_as_two_lists_and_comes_back_whole():
    import dataclasses
    import math
    plan = TG.LaunchPlan(bm=64, bn=32, ra=1, rb=2, a_k_major=True, b_k_major=False, check=True,
                         tf32=False, tf32_emulation=2, sums=True, alpha=-0.5, beta=2.0,
                         inject_kind=3, inject_row=7, inject_value=float("nan"), block_k=32)
    ints, floats = plan.pack()
    assert all(type(v) is int for v in ints) and all(type(v) is float for v in floats)
    back = TG.LaunchPlan.unpack(ints, floats)
    for f in dataclasses.fields(plan):
        mine, theirs = getattr(plan, f.name), getattr(back, f.name)
        assert type(mine) is type(theirs), f.name
        assert mine == theirs or math.isnan(mine) and math.isnan(theirs), f.name
