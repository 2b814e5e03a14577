"""abft.OutputCheck: a checked product's output changed in memory after its check (no version
bump) alarms when the output dies, at its element; the program's own in-place changes and clean
training never alarm."""
import pytest
import torch

import abft
from abft.detectors import outputs


def _model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    abft.protect(m)
    return m


def _flip(t, index, bit=28):
    t.data.view(-1).view(torch.int32)[index] ^= 1 << bit


def test_clean_training_never_alarms_and_every_output_is_verified():
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    with abft.OutputCheck() as chk:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = m(torch.randn(5, 8)).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            del loss
            assert abft.flush() == []
    # two forward products and three backward ones a step (the first layer's input needs no
    # gradient), each recorded and verified at its death; the operands taken: GELU's output
    # and the gradients arriving at the two forward products' outputs
    assert chk.recorded == 3 * 5 and chk.taken == 3 * 3
    assert chk.verified + chk.skipped == chk.recorded + chk.taken
    assert outputs.live() == (0, 0)


def test_a_flip_in_a_forward_output_alarms_at_its_element():
    m = _model()
    h = m[0].register_forward_hook(lambda mod, a, out: _flip(out, 2 * 16 + 5))
    with abft.scope(step=7), abft.OutputCheck():
        m(torch.randn(5, 8)).sum().backward()
    h.remove()
    found = [(a.kind, a.module, a.phase, a.row, a.col, a.step) for a in abft.flush()]
    assert found == [("carry", "0", "forward", 2, 5, 7)], found


def test_a_flip_in_a_backward_output_alarms_in_its_phase():
    m = _model()
    h = m[2].weight.register_hook(lambda g: _flip(g, 3 * 16 + 1))
    with abft.OutputCheck():
        m(torch.randn(5, 8)).sum().backward()
    h.remove()
    found = [(a.kind, a.module, a.phase, a.row, a.col) for a in abft.flush()]
    assert found == [("carry", "2", "grad_weight", 3, 1)], found


def test_the_programs_own_in_place_changes_are_skipped_not_alarmed():
    x, w = torch.randn(6, 8), torch.randn(8, 8)
    with abft.OutputCheck() as chk:
        y = abft.matmul(x, w)
        y.relu_()                       # the version moves: not a flip
        del y
        z = abft.matmul(x, w)
        del z
    assert abft.flush() == [] and chk.skipped == 1 and chk.verified == 1


def test_off_records_nothing_and_bad_block_is_refused():
    import pytest
    abft.matmul(torch.randn(4, 4), torch.randn(4, 4))
    assert outputs.live() == (0, 0)
    with pytest.raises(ValueError, match="block"):
        abft.OutputCheck(block=0)


def test_inference_mode_outputs_are_not_carried():
    """Inference tensors keep no version counter: recording one would raise."""
    m = _model()
    with abft.OutputCheck() as chk, torch.inference_mode():
        m(torch.randn(5, 8))
    assert chk.recorded == 0 and abft.flush() == []


def test_gradients_unscaled_by_gradscaler_after_their_backward_do_not_alarm():
    """A grad_weight output lives on as ``param.grad`` after its Python object dies, and
    GradScaler's ``unscale_`` rewrites it without a version bump: the output is read at its
    death, not at the next drain (2 false alarms a step before, and a guard halt)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    abft.protect(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    abft.reset()
    with abft.OutputCheck() as chk:
        for step in range(3):
            with abft.scope(step=step):
                opt.zero_grad()
                scaler.scale(m(torch.randn(8, 16)).pow(2).mean()).backward()
                scaler.unscale_(opt)
                scaler.step(opt)
                scaler.update()
            assert abft.flush() == []
    assert chk.verified > 0 and chk.skipped == 0


def test_a_ctrl_c_inside_the_death_callback_still_interrupts(monkeypatch):
    """A KeyboardInterrupt raised inside a weakref callback is printed and dropped by Python: Ctrl-C
    during an output's death read (seen: `abft eval` interrupted there ran on and exited 0) must
    reach the program all the same, at the next safe point."""
    import weakref
    from abft.detectors import outputs

    def interrupted(entry):
        raise KeyboardInterrupt

    monkeypatch.setattr(outputs, "_read", interrupted)
    monkeypatch.setattr(outputs, "_dead", [])

    class Output:
        pass

    out = Output()
    ref = weakref.ref(out, lambda _, e={}: outputs._died(e))
    del out
    assert ref() is None and len(outputs._dead) == 1
    with pytest.raises(KeyboardInterrupt):     # at the next safe point (a record, a flush)
        outputs.drain()
    monkeypatch.setattr(outputs, "_dead", [])
    outputs.drain()                              # once


# -- GEMM operands: fingerprinted where they are made, verified at their death ---------------

class _Block(torch.nn.Module):
    """A product reading a module's output (GELU), one reading a function's output made inside a
    forward (a reshape that copies), and one reading a view of another product's output."""

    def __init__(self):
        super().__init__()
        self.up, self.act = torch.nn.Linear(8, 16), torch.nn.GELU()
        self.down, self.out = torch.nn.Linear(16, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.down(self.act(self.up(x)))                     # (4, 6, 8)
        h = h.transpose(0, 1).reshape(4, 6, 8)                  # a copy: a function's output
        return torch.matmul(self.out(h), h.transpose(-2, -1))  # (4, 6, 6); a view of h


def _block():
    torch.manual_seed(0)
    m = _Block()
    abft.protect(m)
    return m


def _zero_in_memory(t):
    """An element of ``t`` changed in memory: no version bump, every reader sees it."""
    idx = (1,) * t.dim()
    t.data[idx] = 0.0 if float(t.detach()[idx]) != 0 else 1.0


@pytest.mark.parametrize("consumer,producer,op", [
    ("down", "act", "Gelu"),              # a module's output
    ("out", "_Block", "UnsafeView"),      # a reshape inside the forward, seen under checked()
])
def test_an_operand_changed_before_its_product_reads_it_alarms_naming_its_producer(consumer,
                                                                                  producer, op,
                                                                                  backend):
    m = _block()
    h = getattr(m, consumer).register_forward_pre_hook(lambda mod, a: _zero_in_memory(a[0]),
                                                       prepend=True)
    with abft.scope(step=3), abft.checked(m), abft.OutputCheck(model=m) as chk:
        m(torch.randn(4, 6, 8)).square().sum().backward()
    h.remove()
    alarms = abft.flush()
    found = [(a.kind, a.module, a.phase, a.op, a.row, a.col, a.step) for a in alarms]
    assert found == [("carry", producer, "forward", op, 1, 1, 3)], found
    assert consumer in alarms[0].labels["read_by"], alarms[0].labels     # and who read it
    assert chk.taken > 0 and outputs.live() == (0, 0)


def test_an_operand_that_is_a_view_of_a_product_alarms_at_that_product():
    """``h.transpose(...)`` is a view: what made ``h``'s memory (here the reshape's copy) is
    the fingerprinted one, alive as long as a view of it is."""
    m = _block()
    seen = []
    orig = abft.autograd.matmul

    def spy(a, b, **kw):
        _zero_in_memory(b)
        seen.append(b.shape)
        return orig(a, b, **kw)
    abft.autograd.matmul = spy
    try:
        with abft.checked(m), abft.OutputCheck(model=m):
            m(torch.randn(4, 6, 8)).sum().backward()
    finally:
        abft.autograd.matmul = orig
    found = [(a.kind, a.phase, a.op) for a in abft.flush()]
    assert seen and found == [("carry", "forward", "UnsafeView")], found


@pytest.mark.parametrize("consumer,producer,phase", [
    ("down", "down", "grad_output"),     # made by a reshape's backward: taken as it arrives
    ("out", "_Block", "grad_a"),         # the grad_a product of the matmul: recorded already
])
def test_an_incoming_gradient_changed_before_the_backward_products_read_it_alarms(
        consumer, producer, phase, backend):
    """The gradient arriving at ``down`` is transposed in memory (the reshape's backward): the
    alarm's element is still the one changed."""
    m = _block()

    def arm(mod, args, out):
        out.register_hook(_zero_in_memory)
    h = getattr(m, consumer).register_forward_hook(arm, prepend=True)
    with abft.checked(m), abft.OutputCheck(model=m):
        (m(torch.randn(4, 6, 8)) * torch.randn(4, 6, 6)).sum().backward()
    h.remove()
    found = [(a.kind, a.module, a.phase, a.row, a.col) for a in abft.flush()]
    assert found == [("carry", producer, phase, 1, 1)], found
    assert outputs.live() == (0, 0) and not outputs._waiting


def test_operands_off_takes_none_and_misses_them():
    m = _block()
    h = m.down.register_forward_pre_hook(lambda mod, a: _zero_in_memory(a[0]), prepend=True)
    with abft.checked(m), abft.OutputCheck(operands=False) as chk:
        m(torch.randn(4, 6, 8)).sum().backward()
    h.remove()
    assert chk.taken == 0 and abft.flush() == []
    with pytest.raises(ValueError, match="operands"):
        abft.OutputCheck(operands=1)


def test_clean_training_with_operands_never_alarms_and_frees_everything():
    m = _block()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with abft.OutputCheck(model=m) as chk:
        for step in range(3):
            for micro in range(2):                      # gradient accumulation
                with abft.scope(step=step, micro_step=micro), abft.checked(m), \
                        torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = m(torch.randn(4, 6, 8)).float().square().mean()
                scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            del loss
            assert abft.flush() == []
    assert chk.taken > 0 and chk.verified + chk.skipped == chk.recorded + chk.taken
    assert outputs.live() == (0, 0) and not outputs._waiting and not outputs._storages


def test_an_output_alive_at_exit_does_not_crash_the_interpreter(tmp_path):
    """A death callback run while the interpreter tears tensors down aborted it (an internal
    assert in torch's tensor clear) whenever a recorded output was still alive at exit."""
    import subprocess
    import sys
    script = tmp_path / "alive.py"
    script.write_text("import torch, abft\n"
                      "x = torch.randn(8, 8, requires_grad=True)\n"
                      "chk = abft.OutputCheck()\n"
                      "out = abft.matmul(x, x)\n"
                      "loss = (out * 2).sum()\n"
                      "print('done')\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "PYTHONSAFEPATH": "1"})
    assert r.returncode == 0 and r.stdout.strip() == "done", r.stderr[-2000:]


def _closure(m, step, fault=None):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, 6, 8, generator=g), torch.randn(4, 6, 6, generator=g)

    def run():
        h = None if not fault else m.down.register_forward_pre_hook(
            lambda mod, a: _zero_in_memory(a[0]), prepend=True)
        try:
            with abft.checked(m), abft.OutputCheck(model=m):
                loss = torch.nn.functional.mse_loss(m(x), y)
                loss.backward()
        finally:
            if h is not None:
                h.remove()
                fault.pop()              # a transient fault: once
        return loss
    return run


def test_the_guard_reruns_a_step_whose_operand_was_changed_and_keeps_the_clean_rerun():
    """A transient operand flip: the guard's rerun is clean (transient) and its update is the
    fault-free one, bit for bit."""
    def train(fault_step):
        m = _block()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        guard = abft.StepGuard(opt, decision="rerun")
        for s in range(3):
            guard.step(_closure(m, s, [1] if s == fault_step else None))
        return m, guard
    clean, _ = train(None)
    m, guard = train(1)
    hit = [r for r in guard.records if r["alarms"]]
    assert len(hit) == 1 and hit[0]["step"] == 1 and hit[0]["persistence"] == "transient", hit
    assert hit[0]["alarms"][0]["module"] == "act"
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), clean.parameters()))


def test_activation_checkpointing_and_compile_train_clean_and_bit_identical():
    """Operands taken in the checkpointed recomputation (inside backward) and none under
    torch.compile (the check stands aside): no alarm, the same values as without the check."""
    from torch.utils.checkpoint import checkpoint

    class Ckpt(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = _Block()

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False)

    def run(make, carried, steps=2):
        torch.manual_seed(0)
        m = make()
        abft.protect(m)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        f = torch.compile(m, backend="eager") if make is _Block and carried == "compile" else m
        out = []
        for s in range(steps):
            x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(s))
            ctx = abft.OutputCheck(model=m) if carried else contextlib.nullcontext()
            with abft.checked(m), ctx:
                loss = f(x).square().mean()
                loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.detach())
            assert abft.flush() == []
        return out, [p.detach().clone() for p in m.parameters()]

    import contextlib
    for make, how in ((Ckpt, True), (_Block, "compile")):
        plain = run(make, False)
        carried = run(make, how)
        assert all(torch.equal(a, b) for a, b in zip(plain[0] + plain[1], carried[0] + carried[1]))
    assert abft.flush() == []          # what died after the last step's drain
    assert outputs.live() == (0, 0) and not outputs._waiting and not outputs._storages


def test_a_site_whose_outputs_no_product_reads_stops_being_taken_until_one_does():
    """(module, op) sites whose outputs died unread ``LEARN`` times are passed over; a product
    reading one of their outputs later makes the site taken again from the next output on."""
    torch.manual_seed(0)

    class Branch(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.read_sin = False

        def forward(self, x):
            s = torch.sin(x)                     # the site ("Branch", "Sin")
            y = self.lin(x if not self.read_sin else s)
            return y.sum() + s.sum()

    m = Branch()
    abft.protect(m)

    def step(fault=False):
        h = m.lin.register_forward_pre_hook(lambda mod, a: _zero_in_memory(a[0]),
                                            prepend=True) if fault else None
        with abft.checked(m), abft.OutputCheck(model=m) as chk:
            m(torch.randn(4, 8, requires_grad=True)).backward()
        if h is not None:
            h.remove()
        return chk, abft.flush()

    taken = [step()[0].taken for _ in range(outputs.LEARN + 2)]
    assert taken[0] > 0 and taken[-1] == 0, taken        # Sin once a step, the sums twice
    assert outputs._sites[("Branch", "Sin")] == [False, outputs.LEARN]
    m.read_sin = True
    assert step()[1] == []                       # read once while passed over: marks the site
    chk, found = step(fault=True)
    assert [(a.kind, a.op) for a in found] == [("carry", "Sin")], found
    abft.reset()                                 # forgets what it learned
    assert outputs._sites == {}


def test_a_ctrl_c_anywhere_in_a_death_callback_reaches_the_program(tmp_path):
    """The campaign's Ctrl-C test once ran on and exited 0: the signal landed in the death
    callback outside its read ("Exception ignored in: <function _take.<locals>.<lambda>>",
    KeyboardInterrupt). Wherever it lands in one of those callbacks, the next safe point raises it.
    In a fresh interpreter: pytest replaces ``sys.unraisablehook`` around each test."""
    import subprocess
    import sys
    code = """
import torch, abft
from abft.detectors import outputs
x = torch.randn(8, 8, requires_grad=True)
chk = abft.OutputCheck()
out = abft.matmul(x, x)
def interrupted(entry):
    raise KeyboardInterrupt
outputs._died = interrupted
del out
try:
    abft.flush()
    print("ran on")
except KeyboardInterrupt:
    print("interrupted")
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "interrupted", (r.stdout, r.stderr[-2000:])
    assert "Exception ignored" not in r.stderr, r.stderr[-2000:]
