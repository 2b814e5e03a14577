"""Drop-in means torch's contracts hold (issue 27's wrong results and crashes): a subclass's own
forward is kept, ``checked()`` honours every keyword of the functions it intercepts, products it
does not check go to torch unchanged, and a raising ``on_alarm`` loses no alarm."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import abft


class Doubled(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


class Router(nn.Linear):
    """A router that subclasses nn.Linear and returns a tuple (Phimoe's, Llama 4's)."""
    def forward(self, x):
        logits = super().forward(x)
        return logits, logits.softmax(-1)


def _checked_calls():
    return sum(r["checked"] for r in abft.coverage())


def _unprotected(op):
    return sum(r["unprotected"] for r in abft.coverage() if r["op"] == op)


@pytest.mark.parametrize("cls", [Doubled, Router])
def test_a_subclass_keeps_its_own_forward(cls):
    torch.manual_seed(0)
    m = nn.Sequential(cls(8, 6), nn.Identity())
    x = torch.randn(4, 8)
    want = m[0](x)
    summary = abft.protect(m)
    got = m[0](x)
    for w, g in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)):
        assert torch.equal(w, g)
    assert summary["linear"] == [] and summary["own_forward"] == ["0"]
    with abft.checked(m):                     # its products are checked where they go through torch
        got = m[0](x)
        with abft.inject(row=1, col=2, kind="bitflip", bit=30):
            m[0](x)
    assert torch.equal((got if isinstance(got, tuple) else (got,))[0],
                       (want if isinstance(want, tuple) else (want,))[0])
    alarms = abft.flush()
    assert len(alarms) == 1 and alarms[0].module == "0" and (alarms[0].row, alarms[0].col) == (1, 2)
    assert abft.unprotect(m) == []
    assert type(m[0]) is cls


def test_a_plain_linear_is_still_swapped():
    m = nn.Sequential(nn.Linear(4, 3))
    assert abft.protect(m)["linear"] == ["0"] and isinstance(m[0], abft.nn._Checked)


@pytest.mark.parametrize("call", [
    lambda x, w, b: F.linear(x, w, bias=b),
    lambda x, w, b: F.linear(input=x, weight=w, bias=b),
    lambda x, w, b: F.linear(x, weight=w, bias=b),
    lambda x, w, b: torch.matmul(input=x, other=w.t()) + b,
    lambda x, w, b: torch.addmm(b, mat1=x, mat2=w.t()),
    lambda x, w, b: torch.addmm(input=b, mat1=x, mat2=w.t(), beta=1, alpha=1),
    lambda x, w, b: torch.mm(input=x, mat2=w.t()) + b,
    lambda x, w, b: b.addmm(mat1=x, mat2=w.t()),
    lambda x, w, b: x.matmul(other=w.t()) + b,
])
def test_keywords_are_honoured_and_the_product_checked(call):
    torch.manual_seed(0)
    x, w, b = torch.randn(5, 7), torch.randn(3, 7), torch.randn(3)
    want = call(x, w, b)
    with abft.checked():
        got = call(x, w, b)
    assert torch.equal(got, want)
    assert _checked_calls() == 1


@pytest.mark.parametrize("name", ["mm", "matmul", "addmm", "bmm", "baddbmm"])
def test_out_is_written_and_returned(name):
    torch.manual_seed(0)
    a, b = torch.randn(4, 5), torch.randn(5, 3)
    args = {"mm": (a, b), "matmul": (a, b), "addmm": (torch.randn(4, 3), a, b),
            "bmm": (a[None], b[None]), "baddbmm": (torch.randn(1, 4, 3), a[None], b[None])}[name]
    fn = getattr(torch, name)
    want = fn(*args)
    out = torch.full_like(want, float("nan"))
    with abft.checked():
        ret = fn(*args, out=out)
    assert ret is out and torch.equal(out, want)
    assert _checked_calls() == 1


def test_out_with_inputs_that_need_grad_raises_as_torch_does():
    a, b = torch.randn(4, 5, requires_grad=True), torch.randn(5, 3)
    with pytest.raises(RuntimeError) as theirs:
        torch.mm(a, b, out=torch.empty(4, 3))
    with abft.checked(), pytest.raises(RuntimeError) as ours:
        torch.mm(a, b, out=torch.empty(4, 3))
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("kind", ["int", "complex", "meta", "sparse"])
def test_products_abft_does_not_check_go_to_torch_and_count_as_unprotected(kind):
    if kind == "int":
        a, b = torch.randint(-5, 5, (4, 6)), torch.randint(-5, 5, (6, 3))
    elif kind == "complex":
        a, b = torch.randn(4, 6, dtype=torch.complex64), torch.randn(6, 3, dtype=torch.complex64)
    elif kind == "meta":
        a, b = torch.empty(4, 6, device="meta"), torch.empty(6, 3, device="meta")
    else:
        a, b = torch.randn(4, 6).to_sparse(), torch.randn(6, 3)
    for fn in (torch.mm, torch.matmul):
        want = fn(a, b)
        with abft.checked():
            got = fn(a, b)
        assert got.shape == want.shape and got.dtype == want.dtype and got.device == want.device
        if kind != "meta":
            assert torch.equal(got.to_dense() if kind == "sparse" else got,
                               want.to_dense() if kind == "sparse" else want)
    assert _checked_calls() == 0 and _unprotected("mm") == 1 and _unprotected("matmul") == 1
    if kind == "int":
        with abft.checked():
            assert torch.equal(a @ b, torch.matmul(a, b))
            assert torch.equal(F.linear(a, b.t()), a @ b)


def _other_products():
    """(op name in coverage, call on a random-tensor maker) for products abft has no checked form
    of: each runs as torch's under ``checked()`` and is counted as unprotected."""
    return [("mv", lambda r: torch.mv(r(3, 4), r(4))), ("mv", lambda r: r(3, 4).mv(r(4))),
            ("addmv", lambda r: torch.addmv(r(3), r(3, 4), r(4))),
            ("addmv_", lambda r: r(3).addmv_(r(3, 4), r(4))),
            ("addbmm", lambda r: torch.addbmm(r(3, 5), r(2, 3, 4), r(2, 4, 5))),
            ("addbmm_", lambda r: r(3, 5).addbmm_(r(2, 3, 4), r(2, 4, 5))),
            ("addmm_", lambda r: r(3, 5).addmm_(r(3, 4), r(4, 5))),
            ("baddbmm_", lambda r: r(2, 3, 5).baddbmm_(r(2, 3, 4), r(2, 4, 5))),
            ("dot", lambda r: torch.dot(r(4), r(4))), ("vdot", lambda r: torch.vdot(r(4), r(4))),
            ("inner", lambda r: torch.inner(r(3, 4), r(5, 4))),
            ("multi_dot", lambda r: torch.linalg.multi_dot([r(3, 4), r(4, 5), r(5, 2)])),
            ("matrix_power", lambda r: torch.linalg.matrix_power(r(3, 3), 3)),
            ("matrix_power", lambda r: torch.matrix_power(r(3, 3), 3)),
            ("conv_transpose3d", lambda r: F.conv_transpose3d(r(1, 2, 3, 3, 3), r(2, 3, 2, 2, 2))),
            ("aten.mm", lambda r: torch.ops.aten.mm(r(3, 4), r(4, 5))),
            ("aten.mm", lambda r: torch.ops.aten.mm.default(r(3, 4), r(4, 5))),
            ("aten.addmm", lambda r: torch.ops.aten.addmm.default(r(5), r(3, 4), r(4, 5)))]


@pytest.mark.parametrize("op,call", _other_products(),
                         ids=[f"{o}-{i}" for i, (o, _) in enumerate(_other_products())])
def test_products_without_a_checked_form_run_as_torch_and_count_as_unprotected(op, call):
    def maker():
        g = torch.Generator().manual_seed(1)
        return lambda *shape: torch.randn(*shape, generator=g)
    want = call(maker())
    with abft.checked():
        got = call(maker())
    assert torch.equal(got, want)
    assert _checked_calls() == 0
    assert [(r["op"], r["unprotected"]) for r in abft.coverage()] == [(op, 1)]


def test_linalg_matmul_is_checked_as_matmul():
    a, b = torch.randn(5, 6), torch.randn(6, 4)
    with abft.checked():
        got = torch.linalg.matmul(a, b)
    assert torch.equal(got, a @ b)
    assert {r["op"]: (r["checked"], r["unprotected"]) for r in abft.coverage()} == {"matmul": (1, 0)}
    assert abft.flush() == []


def test_a_raising_callback_loses_no_alarm():
    seen = []

    def cb(alarm):
        seen.append(alarm)
        raise RuntimeError("stop the run")

    a, b = torch.randn(16, 16), torch.randn(16, 16)
    with abft.config(on_alarm=cb):
        with abft.inject(row=1, col=1, kind="bitflip", bit=30, times=3):
            for _ in range(3):
                abft.matmul(a, b)
        with pytest.raises(RuntimeError, match="stop the run"):
            abft.flush()
        assert len(seen) == 3 and len(abft.alarms()) == 3
        again = abft.flush()                 # the alarms the raising flush could not return
        assert [x.call_id for x in again] == [x.call_id for x in seen]


def _ops():
    """Each public op and its torch twin, on float64 operands (for gradcheck)."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    return [("matmul", abft.matmul, torch.matmul, (r(3, 4), r(4, 5))),
            ("mm", abft.mm, torch.mm, (r(3, 4), r(4, 5))),
            ("bmm", abft.bmm, torch.bmm, (r(2, 3, 4), r(2, 4, 5))),
            ("addmm", abft.addmm, torch.addmm, (r(3, 5), r(3, 4), r(4, 5))),
            ("baddbmm", abft.baddbmm, torch.baddbmm, (r(2, 3, 5), r(2, 3, 4), r(2, 4, 5))),
            ("linear", abft.linear, F.linear, (r(3, 4), r(5, 4), r(5)))]


@pytest.mark.parametrize("name,ours,theirs,args", _ops(), ids=[o[0] for o in _ops()])
def test_forward_mode_ad_gives_torch_tangents(name, ours, theirs, args):
    tangents = tuple(torch.ones_like(a) * 0.5 for a in args)
    want = torch.func.jvp(theirs, args, tangents)
    got = torch.func.jvp(ours, args, tangents)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    import torch.autograd.forward_ad as fwAD
    with fwAD.dual_level():
        duals = [fwAD.make_dual(a, t) for a, t in zip(args, tangents)]
        tangent = fwAD.unpack_dual(ours(*duals)).tangent
    assert tangent is not None and torch.equal(tangent, want[1])
    assert sum(r["unprotected"] for r in abft.coverage()) >= 2    # not checked, and said so


def test_forward_mode_ad_under_checked():
    x, w, t = torch.randn(3, 4), torch.randn(4, 5), torch.randn(3, 4)
    want = torch.func.jvp(lambda a: a @ w, (x,), (t,))
    with abft.checked():
        got = torch.func.jvp(lambda a: a @ w, (x,), (t,))
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


@pytest.mark.parametrize("name,ours,theirs,args", _ops(), ids=[o[0] for o in _ops()])
def test_double_backward_and_gradgradcheck(name, ours, theirs, args):
    args = tuple(a.requires_grad_() for a in args)
    assert torch.autograd.gradgradcheck(ours, args)
    # a gradient penalty: the gradient of a function of the gradients
    gs = torch.autograd.grad(ours(*args).square().sum(), args, create_graph=True)
    pen = sum(g.square().sum() for g in gs)
    got = torch.autograd.grad(pen, args)
    gs = torch.autograd.grad(theirs(*args).square().sum(), args, create_graph=True)
    want = torch.autograd.grad(sum(g.square().sum() for g in gs), args)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_double_backward_through_a_protected_linear_is_checked():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 1))
    twin = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 1))
    twin.load_state_dict(m.state_dict())
    abft.protect(m)
    x = torch.randn(8, 6, requires_grad=True)
    grads = []
    for net in (m, twin):
        (gx,) = torch.autograd.grad(net(x).sum(), x, create_graph=True)
        gx.square().sum().backward()
        grads.append([p.grad for p in net.parameters()])
    assert [g is None for g in grads[0]] == [g is None for g in grads[1]]
    assert sum(g is not None for g in grads[0]) >= 3
    for a, b in zip(*grads):
        if a is not None:
            torch.testing.assert_close(a, b)
    assert any(r["checked"] for r in abft.coverage())


def test_torch_func_grad_and_per_sample_grads():
    torch.manual_seed(0)
    m = nn.Linear(4, 3)
    twin = nn.Linear(4, 3)
    twin.load_state_dict(m.state_dict())
    abft.protect(nn.Sequential(m))
    x = torch.randn(5, 4)

    def loss(net):
        return lambda params, xi: torch.func.functional_call(net, params, (xi,)).square().sum()
    params = {k: v.detach() for k, v in m.named_parameters()}
    got = torch.func.vmap(torch.func.grad(loss(m)), in_dims=(None, 0))(params, x)
    want = torch.func.vmap(torch.func.grad(loss(twin)), in_dims=(None, 0))(params, x)
    for k in want:
        assert torch.equal(got[k], want[k])
    g1 = torch.func.grad(loss(m))(params, x)
    g2 = torch.func.grad(loss(twin))(params, x)
    assert all(torch.equal(g1[k], g2[k]) for k in g1)


def test_compile_fullgraph_works_on_the_first_call():
    """In a fresh process: torch.compile(protect(m), fullgraph=True) with no eager abft call
    before it (the DTensor rules were registered inside the trace and dynamo refused)."""
    import subprocess
    import sys
    code = ("import torch, abft\n"
            "m = torch.nn.Sequential(torch.nn.Linear(8, 4)); abft.protect(m)\n"
            "cm = torch.compile(m, fullgraph=True, backend='aot_eager')\n"
            "x = torch.randn(3, 8)\n"
            "assert torch.equal(cm(x), m(x)); print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_a_protected_model_pickles_and_saves(tmp_path):
    import pickle
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), abft.nn.Linear(3, 2))
    abft.protect(m)
    x = torch.randn(2, 4)
    for back in (pickle.loads(pickle.dumps(m)), _saved(m, tmp_path)):
        assert type(back[0]) is type(m[0]) and isinstance(back[2], abft.nn.Linear)
        assert torch.equal(back(x), m(x))
        with abft.inject(row=0, col=1, kind="bitflip", bit=30):
            back(x)
        assert [a.module for a in abft.flush()] == ["0"]
        assert abft.unprotect(back) == ["0", "2"] and type(back[0]) is nn.Linear


def _saved(m, tmp_path):
    torch.save(m, tmp_path / "m.pt")
    return torch.load(tmp_path / "m.pt", weights_only=False)


@pytest.mark.parametrize("key,value", [
    ("lam", float("nan")), ("lam", 0.0), ("lam", -1.0), ("lam", "6"), ("lam", float("inf")),
    ("enabled", "no"), ("enabled", 1), ("max_pending", "a"), ("max_pending", 0),
    ("max_pending_bytes", 1.5), ("sample_every", True),
])
def test_config_refuses_bad_values_in_one_line_and_changes_nothing(key, value):
    before = abft.config().__enter__()
    with pytest.raises(ValueError) as e:
        abft.config(**{key: value})
    assert str(e.value).startswith(f"abft.config: {key}") and "\n" not in str(e.value)
    assert abft.config().__enter__() == before


def test_a_bad_log_path_leaves_the_settings_and_the_sink_as_they_were(tmp_path):
    good = tmp_path / "a.jsonl"
    with abft.config(log_path=str(good)):
        (tmp_path / "file").write_text("")
        with pytest.raises(ValueError) as e:
            abft.config(log_path=str(tmp_path / "file" / "sub" / "x.jsonl"))
        assert str(e.value).startswith("abft.config: log_path")
        assert abft.config().__enter__().log_path == str(good)
        with abft.config(sample_every=1):           # a later block exits cleanly
            pass
        with abft.inject(row=0, col=0, kind="bitflip", bit=30):
            abft.matmul(torch.randn(8, 8), torch.randn(8, 8))
        abft.flush()
    assert len(good.read_text().splitlines()) == 1


@pytest.mark.parametrize("kw,field", [
    (dict(row=-2), "row"), (dict(col=-1), "col"), (dict(row=1.5), "row"),
    (dict(pattern="tile", size=(-4, 4)), "size"), (dict(pattern="tile", size=(4,)), "size"),
    (dict(bit=30.0), "bit"), (dict(bit=()), "bit"), (dict(bit=(3, 2.5)), "bit"),
    (dict(pattern="strided", stride=0), "stride"), (dict(times=0), "times"),
    (dict(call_id=-1), "call_id"), (dict(batch=(-1,)), "batch"), (dict(bit=True), "bit"),
])
def test_inject_refuses_bad_fields_in_one_line(kw, field):
    kw = {"kind": "bitflip", "bit": 30, **kw}
    with pytest.raises(ValueError) as e:
        abft.inject(**kw)
    assert str(e.value).startswith(f"abft.inject: {field}") and "\n" not in str(e.value)


@pytest.mark.parametrize("argv,option", [
    (["demo", "--bit", "40"], "--bit"), (["demo", "--size", "0"], "--size"),
    (["demo", "--size", "-5"], "--size"), (["bench", "--shapes", "10x10"], "--shapes"),
    (["bench", "--shapes", "axbxc"], "--shapes"), (["bench", "--reps", "-1"], "--reps"),
    (["bench", "--model", "nosuch:thing"], "--model"), (["bench", "--shapes", "conv:2x2x2"], "--shapes"),
])
def test_cli_bad_input_is_one_line_and_exit_2(argv, option, capsys):
    from abft import cli
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and option in err[0]


def test_demo_on_the_smallest_size(capsys):
    from abft import cli
    assert cli.main(["demo", "--size", "1", "--bit", "30"]) == 0


def test_ctrl_c_during_eval_stops_cleanly_with_130(tmp_path):
    """SIGINT mid-campaign: one line saying how to resume, exit 130, no traceback or abort."""
    import os
    import signal
    import subprocess
    import sys
    import time
    out = tmp_path / "run"
    # SIGINT as a terminal delivers it: not ignored, as a shell's background job would have it
    p = subprocess.Popen([sys.executable, "-m", "abft.cli", "eval", "--out", str(out), "--quiet"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while not (out / "pretrain.json").exists() and time.time() < deadline and p.poll() is None:
        time.sleep(0.5)
    time.sleep(2)
    os.kill(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--resume" in lines[0] and "Traceback" not in err


@pytest.mark.usefixtures("backend")
def test_batch_coordinates_are_the_callers():
    """A 4-D product folds its batch dims into one: inject and alarms speak the caller's
    (batch=(1, 2) of (2, 4, M, N)), not the folded index 6."""
    torch.manual_seed(0)
    a, b = torch.randn(2, 4, 16, 8), torch.randn(2, 4, 8, 12)
    clean = abft.matmul(a, b)
    with abft.inject(row=3, col=5, batch=(1, 2), kind="add", value=7.0):
        c = abft.matmul(a, b)
    (al,) = abft.flush()
    assert (al.batch, al.row, al.col) == ((1, 2), 3, 5)
    assert (c != clean).nonzero().tolist() == [[1, 2, 3, 5]]
    with pytest.raises(IndexError):
        with abft.inject(row=3, col=5, batch=(2, 0), kind="add", value=7.0):
            abft.matmul(a, b)


def _hf_configs():
    tr = pytest.importorskip("transformers")
    small = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=64)
    return {"PhimoeForCausalLM": lambda: tr.PhimoeConfig(**small, num_key_value_heads=2,
                                                         num_local_experts=4, num_experts_per_tok=2),
            "Llama4ForCausalLM": lambda: tr.Llama4TextConfig(**small, num_key_value_heads=2,
                                                             intermediate_size_mlp=48, head_dim=8,
                                                             num_local_experts=4, num_experts_per_tok=1),
            "IBertForMaskedLM": lambda: tr.IBertConfig(**small)}


@pytest.mark.parametrize("name", ["PhimoeForCausalLM", "Llama4ForCausalLM", "IBertForMaskedLM"])
def test_hf_models_that_broke_train_bit_identical(name):
    """Routers that subclass nn.Linear and return tuples (Phimoe, Llama 4) crashed once
    protected; IBert's F.linear(input=, weight=) raised under checked(). Three AdamW steps with
    clipping, protected and checked against plain: the same losses and weights, bit for bit."""
    import copy
    tr = pytest.importorskip("transformers")
    cfg = _hf_configs()[name]()
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(tr, name)(cfg)
    twin = copy.deepcopy(model)
    abft.protect(model)
    _train_bit_identical(model, twin, steps=3, clip=True)
    assert sum(r["checked"] for r in abft.coverage()) > 0 and not abft.flush()


def _train_bit_identical(model, twin, steps, clip):
    """AdamW steps of the protected ``model`` under ``checked`` and of its plain ``twin`` on the
    same tokens and seeds: the same losses and weights, bit for bit."""
    ids = torch.randint(0, 64, (2, 12))
    losses = []
    for net in (twin, model):
        torch.manual_seed(1)                # the same dropout and router jitter in both
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        ls = []
        for _ in range(steps):
            with abft.checked(model) if net is model else torch.enable_grad():
                out = net(input_ids=ids, labels=ids)
                out.loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            ls.append(out.loss.item())
        losses.append(ls)
    assert losses[0] == losses[1]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


def test_unprotect_keeps_a_parametrization_added_after_protect():
    from torch.nn.utils import parametrize
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 3))
    x = torch.randn(2, 4)
    abft.protect(m)
    nn.utils.parametrizations.weight_norm(m[0])
    want = m(x)
    assert abft.unprotect(m) == ["0"]
    assert isinstance(m[0], nn.Linear) and not isinstance(m[0], abft.nn._Checked)
    assert parametrize.is_parametrized(m[0], "weight") and torch.equal(m(x), want)
    parametrize.remove_parametrizations(m[0], "weight")
    assert type(m[0]) is nn.Linear and torch.allclose(m(x), want)


def test_non_reentrant_checkpoint_under_checked_recomputes_checked():
    from torch.utils.checkpoint import checkpoint
    torch.manual_seed(0)
    w = torch.randn(6, 5, requires_grad=True)
    x = torch.randn(4, 6, requires_grad=True)
    f = lambda t: torch.matmul(t, w).tanh()
    want = torch.autograd.grad(checkpoint(f, x, use_reentrant=False).sum(), (x, w))
    with abft.checked():
        got = torch.autograd.grad(checkpoint(f, x, use_reentrant=False).sum(), (x, w))
        with abft.inject(row=1, col=2, kind="add", value=3.0, when=lambda c: c.phase == "recompute"):
            checkpoint(f, x, use_reentrant=False).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    alarms = abft.flush()
    assert [(a.phase, a.row, a.col) for a in alarms] == [("recompute", 1, 2)]
    import torch.utils.checkpoint as cp
    assert cp.noop_context_fn.__module__ == "torch.utils.checkpoint"      # restored


def test_reentrant_checkpoint_under_checked_recomputes_checked():
    """use_reentrant=True ignores context_fn: its recomputation (and the gradients of what it
    recomputes) ran unchecked and uncounted."""
    from torch.utils.checkpoint import checkpoint
    import torch.utils.checkpoint as cp
    torch.manual_seed(0)
    w = torch.randn(6, 5, requires_grad=True)
    x = torch.randn(4, 6, requires_grad=True)
    f = lambda t: torch.matmul(t, w).tanh()

    def grads():
        checkpoint(f, x, use_reentrant=True).sum().backward()
        g = (x.grad, w.grad)
        x.grad = w.grad = None
        return g
    want = grads()
    with abft.checked():
        got = grads()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # the forward, its recomputation and the recomputation's two gradient products
    assert _checked_calls() == 4 and not abft.flush()
    with abft.checked():
        with abft.inject(row=1, col=2, kind="add", value=3.0, when=lambda c: c.phase == "recompute"):
            checkpoint(f, x, use_reentrant=True).sum().backward()
    assert [(a.phase, a.row, a.col) for a in abft.flush()] == [("recompute", 1, 2)]
    assert cp.CheckpointFunction.__module__ == "torch.utils.checkpoint"    # restored


@pytest.mark.parametrize("reentrant", [False, True])
def test_llama_gradient_checkpointing_under_checked_is_bit_identical(reentrant):
    import copy
    tr = pytest.importorskip("transformers")
    cfg = tr.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tr.LlamaForCausalLM(cfg)
    twin = copy.deepcopy(model)
    for m in (model, twin):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        m.train()
    abft.protect(model)
    _train_bit_identical(model, twin, steps=2, clip=False)
    assert not abft.flush()
    # eager attention's two matmuls per layer: forward, recomputation and two gradient products
    # each (2 layers, 2 steps); reentrant's recomputation ran unchecked before
    assert sum(r["checked"] for r in abft.coverage() if r["op"] == "matmul") == 2 * 4 * 2 * 2
