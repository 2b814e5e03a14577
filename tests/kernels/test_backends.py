"""kernels/backends.py: the one place that says which backend a call runs on."""
import pytest
import torch

import abft
from abft.kernels import backends


def test_auto_is_triton_on_cuda_and_reference_elsewhere():
    assert backends.resolve("auto", cuda=True) == "triton"
    assert backends.resolve("auto", cuda=False) == "reference"
    assert backends.resolve("reference", cuda=True) == "reference"
    assert backends.resolve("triton", cuda=False) == "triton"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_the_kernel_takes_its_dtypes_only_and_one_dtype_for_all(dtype):
    a, b = torch.ones(2, 2, dtype=dtype), torch.ones(2, 2, dtype=dtype)
    on_kernel = dtype in backends.DTYPES["triton"]
    assert (backends.route("triton", a, b) == "triton") == on_kernel
    assert backends.route("reference", a, b) == "reference"
    assert backends.route("auto", a, b) == "reference"                # CPU tensors
    assert backends.route("triton", a, b.double()) == "reference"    # mixed dtypes
    assert set(backends.DTYPES["triton"]) < set(backends.DTYPES["reference"])


def test_tf32_follows_torchs_setting_on_the_cpu():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert not backends.tf32_allowed(torch.device("cpu"))
        torch.set_float32_matmul_precision("high")
        assert backends.tf32_allowed(torch.device("cpu"))
    finally:
        torch.set_float32_matmul_precision(before)


def test_the_settings_and_the_campaign_take_the_same_backends():
    for name in backends.names():
        if name != "reference":
            pytest.importorskip("triton")
        with abft.config(backend=name):
            pass
    with pytest.raises(ValueError, match="backend"):
        abft.config(backend="cuda")
    from abft.eval.config import Config
    with pytest.raises(ValueError, match="config.backend"):
        Config.from_dict({"backend": "cuda"})


def test_a_third_backend_is_one_module_and_one_registration(tmp_path):
    """tests/data/torchops_backend.py registered as "torchops": products, their gradients and a
    protected model run on it, alarms name it, and dtypes it does not take go to the reference."""
    import subprocess
    import sys
    from paths import DATA
    code = """
import torch, abft
from abft.kernels import backends
backends.register(backends.Backend("torchops", (torch.float32,), "torchops_backend", tiles=(16, 16)))
abft.config(backend="torchops")
torch.manual_seed(0)
x, w = torch.randn(40, 24, requires_grad=True), torch.randn(32, 24, requires_grad=True)
y = abft.linear(x, w)
y.sum().backward()
assert torch.equal(y, torch.nn.functional.linear(x, w))
with abft.scope(module="fc"):
    with abft.inject(row=21, col=5, kind="add", value=1.0):
        abft.matmul(x.detach(), w.detach().t())
(al,) = abft.flush()
assert (al.backend, al.module, al.row, al.col, al.bm, al.bn, al.tile) == ("torchops", "fc", 21, 5, 16, 16, (1, 0)), al
abft.matmul(x.detach().double(), w.detach().double().t())
assert not abft.flush()
calls = abft.stats()["checked_calls"]
assert calls == 5, calls
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "PYTHONSAFEPATH": "1",
                            "PYTHONPATH": DATA})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
