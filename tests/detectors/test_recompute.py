"""Sampled recompute of the non-GEMM modules (abft.RecomputeCheck)."""
import math

import pytest
import torch
from torch import nn

import abft


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4),
                         nn.Softmax(-1))


def _fault(mod, row=3, col=7, value=9.0):
    """A corrupted output, as the evaluation's nongemm_op fault makes it (a hook ahead of the
    others)."""
    def hook(m, args, out):
        out = out.clone()
        out.data[row, col] = value
        return out
    return mod.register_forward_hook(hook, prepend=True)


def test_a_corrupted_activation_is_found_and_located():
    m = _model()
    rc = abft.RecomputeCheck(m)
    assert sorted(rc.modules.values()) == ["1", "2", "4"]
    x = torch.randn(5, 8)
    m(x)
    assert abft.flush() == []
    h = _fault(m[2])
    m(x)
    h.remove()
    found = abft.flush()
    assert [(a.kind, a.op, a.module, a.row, a.col) for a in found] == [
        ("recompute", "GELU", "2", 3, 7, )]
    assert found[0].labels["elements"] == 1 and rc.checked == 6


def test_sampling_is_even_and_repeatable():
    m = nn.Sequential(nn.GELU())
    rc = abft.RecomputeCheck(m, rate=0.25)
    seen = []
    real = nn.GELU.forward

    def spy(self, x):
        seen.append(len(seen))
        return real(self, x)
    nn.GELU.forward = spy
    try:
        for _ in range(8):
            m(torch.randn(3, 4))
    finally:
        nn.GELU.forward = real
    # 8 calls and 2 reruns: the module's own 8 calls plus the reruns of calls 4 and 8
    assert rc.checked == 2 and len(seen) == 10


@pytest.mark.parametrize("rate", [0, 1.5, True, math.nan, "0.1"])
def test_a_bad_rate_names_the_field(rate):
    with pytest.raises(ValueError, match="rate"):
        abft.RecomputeCheck(_model(), rate=rate)


def _step(m, x, policy="record"):
    with abft.config(policy=policy):
        y = m(x)
        y.square().sum().backward()
    return y, [p.grad.clone() for p in m.parameters()]


def test_the_correct_policy_hands_on_the_rerun_bit_for_bit():
    m, x = _model(), torch.randn(5, 8)
    abft.RecomputeCheck(m)
    y0, g0 = _step(m, x)
    m.zero_grad()
    h = _fault(m[2])
    y1, g1 = _step(m, x, "correct")
    h.remove()
    assert torch.equal(y0, y1) and all(torch.equal(a, b) for a, b in zip(g0, g1))
    m.zero_grad()
    h = _fault(m[2])
    y2, _ = _step(m, x)
    h.remove()
    assert not torch.equal(y0, y2)           # record leaves the fault in place
    with pytest.raises(abft.SilentCorruptionError, match="GELU"):
        h = _fault(m[2])
        try:
            _step(m, x, "raise")
        finally:
            h.remove()


def test_the_guard_reruns_a_step_with_a_corrupted_norm():
    m = _model()
    abft.RecomputeCheck(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    guard = abft.StepGuard(opt, decision="rerun")
    x = torch.randn(5, 8)
    for s in range(3):
        h = _fault(m[1], 2, 5, -40.0) if s == 1 else None

        def closure():
            loss = m(x).square().sum()
            loss.backward()
            if h is not None:
                h.remove()                  # a transient fault: gone on the rerun
            return loss
        guard.step(closure)
    rec = [r for r in guard.records if sum(r["alarm_counts"])]
    assert [(r["step"], r["decision"], r["persistence"]) for r in rec] == [(1, "rerun", "transient")]
    assert rec[0]["alarms"][0]["module"] == "1"


def test_a_transformers_llama_trains_without_a_false_alarm():
    pytest.importorskip("transformers")
    from llama import tiny_llama
    torch.manual_seed(0)
    model = tiny_llama()
    rc = abft.RecomputeCheck(model)
    kinds = {type(m).__name__ for n, m in model.named_modules() if id(m) in rc.modules}
    assert {"LlamaRMSNorm", "Embedding"} <= kinds, kinds
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    abft.flush()
    for _ in range(3):
        ids = torch.randint(0, 64, (2, 16), generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    assert rc.checked >= 3 * 6 and abft.flush() == []


def test_own_modules_named_after_their_function_are_covered():
    from abft.eval.models import GPT, GPTConfig
    model = GPT(GPTConfig(vocab=16, block=8, layers=1, heads=2, dim=8))
    names = set(abft.RecomputeCheck(model).modules.values())
    assert {"blocks.0.mlp.act", "blocks.0.attn.softmax", "blocks.0.ln1", "tok"} <= names, names


class _Scale(nn.Module):
    """Writes into its input (as some users' norms do): no rerun can see that input again."""

    def forward(self, x):
        return x.mul_(2.0).tanh()


def test_modules_that_write_in_place_are_not_rerun():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8),
                      nn.SiLU(inplace=True), nn.Linear(8, 8), _Scale(), nn.LayerNorm(8),
                      nn.Embedding(4, 8, max_norm=1.0))
    rc = abft.RecomputeCheck(m[:7])
    assert sorted(rc.modules.values()) == ["6"]          # inplace ReLU/SiLU left out
    emb = abft.RecomputeCheck(nn.Sequential(nn.Embedding(4, 8, max_norm=1.0)))
    assert emb.modules == {}
    x = torch.randn(5, 8)
    y = m[:7](x)
    y.sum().backward()                                   # autograd intact
    assert abft.flush() == [] and rc.checked == 1


def test_own_modules_writing_their_input_are_skipped_not_alarmed():
    class Named(_Scale):
        pass
    Named.__name__ = "MyRMSNorm"                          # covered by its name
    m = nn.Sequential(Named())
    rc = abft.RecomputeCheck(m)
    assert list(rc.modules.values()) == ["0"]
    m(torch.randn(3, 4))
    assert abft.flush() == [] and rc.skipped == 1 and rc.checked == 0


def test_a_hook_registered_before_the_check_does_not_false_alarm():
    m = _model()
    m[2].register_forward_hook(lambda mod, args, out: out + 1.0)   # e.g. a steering hook
    abft.RecomputeCheck(m)
    m(torch.randn(5, 8))
    assert abft.flush() == []
