"""torch's attention modules (issue 27, item 9): ``nn.MultiheadAttention`` computes its products
inside ``F.multi_head_attention_forward`` from its weights (``out_proj``'s forward is never
called), and in inference ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` take a
fused fast path that no product of theirs goes through. Under ``checked()`` and ``protect`` every
product is checked, values as torch's (the fast path's aside), and an injected fault alarms."""
import copy

import pytest
import torch
from torch import nn

import abft


_GEMMS = ("linear", "matmul", "bmm", "baddbmm")


def _checked(module=None):
    """Checked products (the decomposed SDPA's softmax check aside)."""
    return sum(r["checked"] for r in abft.coverage() if r["op"] in _GEMMS
               and (module is None or r["module"] == module))


def _modules_checked():
    return {r["module"] for r in abft.coverage() if r["checked"]}


def _mha(batch_first):
    torch.manual_seed(0)
    return nn.MultiheadAttention(16, 4, batch_first=batch_first)


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("need_weights", [False, True])
def test_multihead_attention_under_checked(batch_first, need_weights):
    mha = _mha(batch_first)
    x = torch.randn(5, 3, 16)
    want = mha(x, x, x, need_weights=need_weights)[0]
    with abft.checked(mha, sdpa=True):
        got = mha(x, x, x, need_weights=need_weights)[0]
    assert not abft.flush()
    # in projection, out projection and the two attention products
    assert _checked() == 4 and _modules_checked() == {"MultiheadAttention"}
    torch.testing.assert_close(got, want)
    with abft.checked(mha, sdpa=True), abft.inject(row=1, col=2, kind="add", value=4.0,
                                                   when=lambda c: c.op == "linear"):
        mha(x, x, x, need_weights=need_weights)
    alarms = abft.flush()
    assert alarms and {a.module for a in alarms} == {"MultiheadAttention"}


def test_multihead_attention_inference_fast_path_under_checked():
    """eval + no_grad: torch's fused path, bypassed under checked(), every product checked."""
    mha = _mha(True).eval()
    x = torch.randn(3, 5, 16)
    with torch.no_grad(), abft.checked(mha, sdpa=True):
        mha(x, x, x, need_weights=False)
    assert not abft.flush() and _checked() == 4


@pytest.mark.parametrize("need_weights", [False, True])
def test_protect_multihead_attention(need_weights):
    mha = _mha(False)
    twin = copy.deepcopy(mha)
    model = nn.Sequential(mha)
    s = abft.protect(model)
    assert s["attention"] == ["0"] and s["linear"] == [] and s["not_covered"] == []
    x = torch.randn(5, 3, 16, requires_grad=True)
    y, yt = model[0](x, x, x, need_weights=need_weights)[0], twin(x, x, x, need_weights=need_weights)[0]
    assert torch.equal(y, yt)               # the same torch products (SDPA stays torch's)
    g = torch.autograd.grad(y.square().sum(), [x, *mha.parameters()])
    gt = torch.autograd.grad(yt.square().sum(), [x, *twin.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(g, gt))
    assert not abft.flush()
    rows = [r for r in abft.coverage() if r["module"] == "0"]
    # forward: in and out projections (+ two products without SDPA); backward: two per product
    assert sum(r["checked"] for r in rows) == 3 * (2 + 2 * need_weights)
    assert sum(r["unprotected"] for r in rows) == (0 if need_weights else 1)
    with abft.inject(row=0, col=1, kind="add", value=4.0, when=lambda c: c.op == "linear"):
        model[0](x, x, x, need_weights=need_weights)
    assert {a.module for a in abft.flush()} == {"0"}
    assert abft.unprotect(model) == ["0"] and type(model[0]) is nn.MultiheadAttention


def test_protected_multihead_attention_pickles():
    import pickle
    model = nn.Sequential(_mha(True))
    abft.protect(model)
    x = torch.randn(2, 3, 16)
    back = pickle.loads(pickle.dumps(model))
    assert isinstance(back[0], abft.nn._Checked) and torch.equal(back[0](x, x, x)[0], model[0](x, x, x)[0])


def _encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=24, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def test_transformer_encoder_under_checked_checks_every_product():
    enc = _encoder()
    x = torch.randn(2, 5, 16)
    with abft.checked(enc, sdpa=True):
        enc(x)
    assert not abft.flush()
    assert _modules_checked() == {f"layers.{i}.{m}" for i in range(2)
                                  for m in ("self_attn", "linear1", "linear2")}


@pytest.mark.parametrize("train", [True, False])
def test_protected_transformer_encoder_checks_every_product(train):
    """In eval + no_grad the encoder layer's fused fast path would compute everything unchecked."""
    enc = _encoder().train(train)
    twin = copy.deepcopy(enc)
    s = abft.protect(enc)
    assert s["attention"] == ["layers.0.self_attn", "layers.1.self_attn"]
    assert s["fast_path"] == ["TransformerEncoder", "layers.0", "layers.1"]
    assert len(s["linear"]) == 4                         # linear1, linear2: out_proj is not called
    x = torch.randn(2, 5, 16)
    with torch.set_grad_enabled(train):
        y = enc(x)
        yt = twin(x)
    if train:
        assert torch.equal(y, yt)
    else:                      # the unprotected twin took torch's fused path: round-off apart
        torch.testing.assert_close(y, yt)
    assert not abft.flush()
    assert _modules_checked() == {f"layers.{i}.{m}" for i in range(2)
                                  for m in ("self_attn", "linear1", "linear2")}


def test_protected_attention_under_checked_counts_each_call_once():
    """protect's blocks nested in an outer checked(): SDPA decomposed as the outer block asks,
    no call counted or checked twice; the encoder's padding mask path as well (under checked
    the fused nested-tensor path is not taken: padded rows are computed, not zeroed)."""
    enc = _encoder().eval()
    twin = copy.deepcopy(enc)
    abft.protect(enc)
    x = torch.randn(2, 5, 16)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[0, 3:] = True
    with torch.no_grad():
        yt = twin(x, src_key_padding_mask=mask)
        with abft.checked(enc, sdpa=True):
            y = enc(x, src_key_padding_mask=mask)
    torch.testing.assert_close(y[~mask], yt[~mask])
    assert not abft.flush()
    rows = abft.coverage()
    assert not [r for r in rows if r["unprotected"]]
    # per layer: 2 projections + 2 attention products + linear1 + linear2
    assert _checked() == 2 * 6
    assert {r["module"] for r in rows if r["op"] == "matmul"} == {"layers.0.self_attn",
                                                                  "layers.1.self_attn"}
    abft.reset()
    with torch.no_grad():
        y = enc(x, src_key_padding_mask=mask)
    assert _checked() == 2 * 4
    assert sum(r["unprotected"] for r in abft.coverage()) == 2     # one SDPA per layer
