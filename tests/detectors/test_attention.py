"""The softmax invariants of checked attention (abft/detectors/attention.py): no alarm on clean attention
of any size, dtype, scale or mask, forward and backward; a fault in the softmax, in its saved
output or in its backward alarms at its row."""
import contextlib

import pytest
import torch
import torch.nn.functional as F

import abft
from abft.detectors import attention


def _flip(t, index, bit):
    """Flip ``bit`` of the element at flat ``index`` of a float32 tensor, in place."""
    t.view(-1).view(torch.int32)[index] ^= 1 << bit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("scale", [0.1, 1.0, 30.0, 1e4])
def test_clean_softmax_never_alarms_forward_or_backward(dtype, scale):
    g = torch.Generator().manual_seed(int(scale * 10) + hash(str(dtype)) % 1000)
    for s in (1, 2, 7, 64, 257, 1024):
        scores = (torch.randn(2, 3, 5, s, generator=g, dtype=torch.float64) * scale)
        if s > 2:                                  # masked positions, one row fully masked
            scores[0, 0, 1, : s // 2] = float("-inf")
            scores[1, 2, 3, :] = float("-inf")
        scores = scores.to(dtype).requires_grad_()
        p = attention.softmax(scores)
        torch.testing.assert_close(p, torch.softmax(scores.detach(), -1), rtol=0, atol=0,
                                   equal_nan=True)             # torch's values, bit for bit
        dp = torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype) * scale
        (p * dp).sum().backward()
        assert abft.flush() == [], (dtype, scale, s)


@contextlib.contextmanager
def _softmax_hit(**flip):
    """torch.softmax returns its output with one bit flipped, once."""
    real = torch.softmax

    def faulty(x, dim, *a, **kw):
        torch.softmax = real
        out = real(x, dim, *a, **kw)
        _flip(out, **flip)
        return out
    torch.softmax = faulty
    try:
        yield
    finally:
        torch.softmax = real


def test_a_fault_in_the_softmax_alarms_at_its_row():
    scores = torch.randn(2, 4, 6, 32)
    with _softmax_hit(index=(1 * 4 + 2) * 6 * 32 + 3 * 32 + 5, bit=28):
        attention.softmax(scores, module="attn")
    alarms = abft.flush()
    assert [(a.kind, a.op, a.phase, a.module, a.batch, a.row) for a in alarms] == \
        [("invariant", "softmax", "forward", "attn", (1, 2), 3)]
    assert alarms[0].residual > alarms[0].threshold


def test_a_low_mantissa_flip_is_below_the_bound_and_changes_little():
    scores = torch.randn(1, 1, 4, 128)
    with _softmax_hit(index=7, bit=2):
        p = attention.softmax(scores)
    assert abft.flush() == []
    assert (p - torch.softmax(scores, -1)).abs().max() < attention.forward_bound(p)


def test_saved_probabilities_changed_at_rest_alarm_in_the_backward():
    scores = torch.randn(2, 2, 8, 16, requires_grad=True)
    p = attention.softmax(scores, module="attn")
    _flip(p.data, 2 * 16 + 9, 29)              # written behind autograd's back
    (p * torch.randn_like(p)).sum().backward()
    phases = [(a.phase, a.batch, a.row) for a in abft.flush()]
    assert ("saved", (0, 0), 2) in phases, phases


def test_a_fault_in_the_softmax_backward_alarms():
    scores = torch.randn(2, 2, 8, 16, requires_grad=True)
    p = attention.softmax(scores, module="attn")
    real = torch._softmax_backward_data

    def faulty(*a):
        out = real(*a)
        _flip(out, 5 * 16 + 3, 28)
        return out
    torch._softmax_backward_data = faulty
    try:
        (p * torch.randn_like(p)).sum().backward()
    finally:
        torch._softmax_backward_data = real
    alarms = abft.flush()
    assert [(a.phase, a.batch, a.row) for a in alarms] == [("backward", (0, 0), 5)], alarms


def test_checked_sdpa_trains_a_llama_without_alarms_and_counts_the_softmax():
    pytest.importorskip("transformers")
    from llama import tiny_llama
    torch.manual_seed(0)
    model = tiny_llama(attn_implementation="sdpa")
    abft.protect(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 64, (2, 16), generator=g)
        with abft.checked(model, sdpa=True):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        assert abft.flush() == []
    rows = {r["module"]: r["checked"] for r in abft.coverage() if r["op"] == "softmax"}
    assert len(rows) == 2 and all(n == 3 for n in rows.values()), rows


def test_the_sdpa_decomposition_gradients_equal_torchs_softmax_path():
    q, k, v = (torch.randn(2, 3, 7, 8, requires_grad=True) for _ in range(3))
    ref = torch.softmax(q @ k.transpose(-2, -1) / 8 ** 0.5, -1) @ v
    ref.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    with abft.checked(sdpa=True):
        out = F.scaled_dot_product_attention(q, k, v)
    out.sum().backward()
    assert torch.allclose(out, ref, atol=1e-6)
    assert all(torch.allclose(a.grad, b, atol=1e-6) for a, b in zip((q, k, v), grads))
    assert abft.flush() == []


def test_the_cost_bench_runs(capsys):
    import attnbench                    # benchmarks/attnbench.py (conftest puts it on the path)
    assert attnbench.main(["--shapes", "1x2x16x8", "--reps", "3", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("| 1x2x16x8 |") and out.splitlines()[-1].count("(") == 2
    assert abft.flush() == []


def test_checked_sdpa_gives_zeros_for_fully_masked_rows_as_torch_does():
    """Left padding masks whole rows of scores; torch's SDPA returns zeros there, the checked
    decomposition gave NaN (a softmax of -inf), and training went on with NaN weights."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 4, requires_grad=True) for _ in range(3))
    mask = torch.ones(2, 1, 8, 8, dtype=torch.bool)
    mask[0, :, :3, :] = False                       # the first 3 query rows see nothing
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    with abft.checked(sdpa=True):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out.sum().backward()
        assert abft.flush() == []
    assert torch.isfinite(out).all() and torch.equal(out[0, :, :3], torch.zeros_like(out[0, :, :3]))
    torch.testing.assert_close(out, ref)
    for t, g in zip((q, k, v), grads):
        assert torch.isfinite(t.grad).all()
        torch.testing.assert_close(t.grad, g)
