"""Checked models: protect(), abft.nn.Linear, the checked() mode, autocast, coverage, no_grad,
gradient accumulation, activation checkpointing and torch.compile."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import abft
from abft.eval.models import GPT, GPTConfig

CFG = GPTConfig(vocab=32, block=16, layers=2, heads=2, dim=32)


def _batch(seed=0, b=3, t=12):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, CFG.vocab, (b, t + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _train(model, steps, ctx=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for s in range(steps):
        x, y = _batch(s)
        with (ctx() if ctx else abft.scope(step=s)), abft.scope(step=s):
            loss = model(x, y)
            opt.zero_grad()
            loss.backward()
        losses.append(loss.detach())
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
    return losses, grads


def test_protected_and_checked_training_is_bit_identical():
    torch.manual_seed(0)
    plain = GPT(CFG)
    prot = copy.deepcopy(plain)
    summary = abft.protect(prot)
    assert len(summary["linear"]) == 2 * 4 + 1
    l1, g1 = _train(plain, 3)
    l2, g2 = _train(prot, 3, ctx=lambda: abft.checked(prot))
    assert all(torch.equal(a, b) for a, b in zip(l1, l2))
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))
    assert abft.flush() == []
    cov = {(r["op"], r["module"]): r for r in abft.coverage()}
    # every Linear: 3 steps x (forward, grad_input, grad_weight); attention products: forward + 2 grads
    assert cov[("linear", "blocks.0.mlp.fc")]["checked"] == 9
    assert cov[("matmul", "blocks.1.attn.scores")]["checked"] == 3 * 3
    assert cov[("linear", "head")]["checked"] == 9
    for p in prot.parameters():
        assert p.grad is not None


@pytest.mark.parametrize("module,op,phase", [
    ("blocks.0.mlp.fc", "linear", "forward"), ("blocks.1.mlp.out", "linear", "grad_input"),
    ("blocks.0.attn.qkv", "linear", "grad_weight"), ("blocks.1.attn.scores", "matmul", "forward"),
    ("blocks.0.attn.context", "matmul", "grad_a"), ("blocks.0.attn.scores", "matmul", "grad_b")])
def test_fault_in_each_phase_of_the_model_is_labelled(module, op, phase):
    torch.manual_seed(0)
    model = GPT(CFG)
    abft.protect(model)
    x, y = _batch()
    with abft.inject(when=lambda c: c.module == module and c.phase == phase and c.op == op,
                     row=2, col=3, kind="add", value=1e3) as h:
        with abft.checked(model), abft.scope(step=7):
            model(x, y).backward()
    alarms = abft.flush()
    assert len(h.hits) == 1
    assert [(a.module, a.op, a.phase, a.step) for a in alarms] == [(module, op, phase, 7)]
    assert (alarms[0].row, alarms[0].col) == (2, 3)


def test_linear_module_state_dict_round_trip():
    plain = nn.Linear(8, 5)
    mine = abft.nn.Linear(8, 5, name="fc")
    mine.load_state_dict(plain.state_dict())
    x = torch.randn(4, 8)
    assert torch.equal(mine(x), plain(x))
    assert set(mine.state_dict()) == {"weight", "bias"}
    plain.load_state_dict(mine.state_dict())


def test_protect_unprotect_keeps_parameters():
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    params = [id(p) for p in model.parameters()]
    s = abft.protect(model)
    assert s["linear"] == ["0", "2"] and isinstance(model[0], nn.Linear)
    assert [id(p) for p in model.parameters()] == params
    assert abft.protect(model)["already"] == ["0", "2"]
    assert abft.unprotect(model) == ["0", "2"] and type(model[0]) is nn.Linear


def test_weight_flip_at_rest_is_caught_by_the_cached_checksums():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48))
    abft.protect(model)
    x = torch.randn(32, 64)
    model(x)
    assert abft.flush() == []
    with torch.no_grad():
        w = model[0].weight.data.view(torch.int32)     # behind autograd's back: no version bump
        w[5, 7] ^= 1 << 28
    model(x)
    alarms = abft.flush()
    assert alarms and all(a.module == "0" for a in alarms)
    assert {c for a in alarms for c in a.cols} == set() and all(len(a.rows) > 0 for a in alarms)
    # a fresh check sees a consistent product of the wrong weight
    abft.unprotect(model)
    abft.protect(model, cache_weight_checksums=False)
    model(x)
    assert abft.flush() == []


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_grad_input_keeps_the_weights_checksums_and_catches_a_flip_after_the_forward(
        backend, monkeypatch):
    from abft import autograd
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48))
    abft.protect(model)
    x = torch.randn(32, 64, requires_grad=True)
    from abft.kernels import reference
    made, real, pair = [], autograd._grad_input_summary, reference.weight_stats_pair
    monkeypatch.setattr(autograd, "_grad_input_summary",
                        lambda w, key: made.append(key) or real(w, key))
    monkeypatch.setattr(reference, "weight_stats_pair",    # the reference's: made with the forward's
                        lambda w, bn, bn_t: made.append(bn_t) or pair(w, bn, bn_t))
    with abft.config(backend=backend):
        for _ in range(2):
            model(x).square().sum().backward()
        assert abft.flush() == [] and len(made) == 1      # kept: made once for two backwards
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        model(x).square().sum().backward()
        assert abft.flush() == [] and len(made) == 2      # a new version of the weight
        y = model(x)
        with torch.no_grad():                             # after the forward read the weight
            model[0].weight.data.view(torch.int32)[5, 7] ^= 1 << 28
        y.square().sum().backward()
        alarms = abft.flush()
    assert alarms and {(a.module, a.phase) for a in alarms} == {("0", "grad_input")}, alarms


def test_a_flip_between_a_new_weights_first_forward_and_its_backward_is_caught():
    """On the reference backend grad_input's statistics of the weight are made with the forward's,
    from the weight the forward read: a bit flipped after the first forward of a new version shows
    in grad_input. (Made at the backward, they summed the flipped weight and agreed with it.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48))
    abft.protect(model)
    x = torch.randn(32, 64, requires_grad=True)
    y = model(x)
    with torch.no_grad():
        model[0].weight.data.view(torch.int32)[5, 7] ^= 1 << 28
    y.square().sum().backward()
    alarms = abft.flush()
    assert alarms and {(a.module, a.phase) for a in alarms} == {("0", "grad_input")}, alarms
    assert {r for a in alarms for r in a.rows} and not {c for a in alarms for c in a.cols}


def test_grad_inputs_statistics_are_made_with_the_forwards_only_where_the_backward_needs_them(monkeypatch):
    """The pair (forward's and grad_input's weight statistics in one call) only where the forward
    records a gradient for its input: not for a first layer on data that needs no gradient, not
    under no_grad (a review found both making grad_input's statistics each step for nothing)."""
    from abft.kernels import reference
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 8))
    abft.protect(model)
    paired, pair = [], reference.weight_stats_pair
    monkeypatch.setattr(reference, "weight_stats_pair",
                        lambda w, bn, bn_t: paired.append(tuple(w.shape)) or pair(w, bn, bn_t))
    x = torch.randn(32, 16)                             # data: no gradient wanted
    model(x).square().sum().backward()
    assert paired == [(8, 24)]                          # the second layer only
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.step()                                          # a new version of both weights
    with torch.no_grad():
        model(x)                                        # (its forward statistics are kept)
    assert paired == [(8, 24)]
    opt.step()
    model(x.requires_grad_()).square().sum().backward()
    assert sorted(paired[1:]) == [(8, 24), (24, 16)] and abft.flush() == []


def test_no_grad_inference_and_gradient_accumulation():
    torch.manual_seed(0)
    plain = GPT(CFG)
    prot = copy.deepcopy(plain)
    abft.protect(prot)
    x, y = _batch()
    with torch.no_grad():
        assert torch.equal(plain(x), prot(x))
    for m in (plain, prot):
        for s in range(2):
            xs, ys = _batch(10 + s)
            (m(xs, ys) / 2).backward()
    for p, q in zip(plain.parameters(), prot.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert abft.flush() == []
    # every protected linear was checked: the forward under no_grad, then the forward and both
    # backward products of each of the two accumulated micro-batches
    rows = [r for r in abft.coverage() if r["op"] == "linear"]
    n_lin = sum(isinstance(m, torch.nn.Linear) for m in prot.modules())
    assert len(rows) == n_lin and all((r["checked"], r["unverified"]) == (1 + 2 * 3, 0) for r in rows)


def test_activation_checkpointing_labels_recompute():
    torch.manual_seed(0)
    lin = abft.nn.Linear(16, 16, name="ck")
    x = torch.randn(8, 16, requires_grad=True)
    phases = []
    with abft.inject(kind="zero", when=lambda c: phases.append((c.op, c.phase)) and False):
        y = torch.utils.checkpoint.checkpoint(lin, x, use_reentrant=False)
        y.sum().backward()
    assert ("linear", "forward") in phases and ("linear", "recompute") in phases
    assert abft.flush() == []
    with abft.inject(when=lambda c: c.phase == "recompute", kind="add", value=9.0, row=0, col=0) as h:
        y = torch.utils.checkpoint.checkpoint(lin, x, use_reentrant=False)
        y.sum().backward()
    (al,) = abft.flush()
    assert al.phase == "recompute" and len(h.hits) == 1


def test_checked_mode_covers_unmodified_code_and_names_what_it_misses():
    a, b = torch.randn(6, 5), torch.randn(5, 4)
    q = torch.randn(1, 2, 6, 8)
    with abft.checked():
        c1 = a @ b
        c2 = torch.mm(a, b)
        c3 = a.matmul(b)
        c4 = torch.einsum("ik,kj->ij", a, b)
        c5 = torch.einsum("bhqd,bhkd->bhqk", q, q)
        torch.einsum("ii->i", torch.randn(3, 3))
        F.scaled_dot_product_attention(q, q, q)
        F.conv1d(torch.randn(1, 2, 8), torch.randn(3, 2, 3))
        F.linear(a, b.t())
    assert torch.equal(c1, a @ b) and torch.equal(c2, c1) and torch.equal(c3, c1)
    assert torch.equal(c4, torch.einsum("ik,kj->ij", a, b))
    assert torch.equal(c5, torch.einsum("bhqd,bhkd->bhqk", q, q))
    cov = abft.coverage()
    checked = {r["op"]: r["checked"] for r in cov if r["checked"]}
    missed = {r["op"] for r in cov if r["unprotected"]}
    assert checked == {"matmul": 2, "mm": 1, "einsum": 2, "linear": 1}
    assert missed == {"einsum", "scaled_dot_product_attention", "conv1d"}
    assert abft.flush() == []


def test_checked_mode_sdpa_decomposition():
    q, k, v = (torch.randn(2, 3, 7, 8) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with abft.checked(sdpa=True):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(out, ref, atol=1e-5)
    # the two products, and the softmax between them by its invariants
    assert {r["op"]: r["checked"] for r in abft.coverage()} == {"matmul": 2, "softmax": 1}
    assert abft.flush() == []


def test_autocast_matches_torch():
    x, w, b = torch.randn(8, 16), torch.randn(12, 16), torch.randn(12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.linear(x, w, b)
        ref2 = x @ w.t()
        out = abft.linear(x, w, b)
        with abft.checked():
            out2 = x @ w.t()
    assert out.dtype == ref.dtype == torch.bfloat16 and torch.equal(out, ref)
    assert torch.equal(out2, ref2)
    assert abft.flush() == []


def test_torch_compile_fullgraph_matches_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    abft.protect(model)
    x = torch.randn(4, 16)
    eager = model(x)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    assert torch.equal(out, eager)
    out.sum().backward()
    assert abft.flush() == []
    with abft.inject(when=lambda c: c.module == "2", kind="add", value=5.0, row=1, col=1):
        compiled(x)
    (al,) = abft.flush()
    assert al.module == "2"


def test_torch_compile_inductor_fullgraph():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
    abft.protect(model)
    x = torch.randn(4, 16)
    eager = model(x)
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(x)
    # inductor schedules the surrounding graph itself; the checked products are opaque custom ops
    torch.testing.assert_close(out, eager, rtol=1e-6, atol=1e-6)
    out.sum().backward()
    assert abft.flush() == []
    with abft.inject(when=lambda c: c.module == "1" and c.phase == "grad_weight", kind="add", value=5.0):
        compiled(x).sum().backward()
    (al,) = abft.flush()
    assert (al.module, al.phase) == ("1", "grad_weight")


def test_protect_hugging_face_gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ref = copy.deepcopy(model)
    s = abft.protect(model)
    assert len(s["conv1d"]) == 8 and s["linear"] == ["lm_head"]
    x = torch.randint(0, 100, (2, 10))
    out, r = model(x, labels=x), ref(x, labels=x)
    assert torch.equal(out.logits, r.logits)
    out.loss.backward()
    r.loss.backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert abft.flush() == [] and abft.stats()["checked_calls"] == 27
