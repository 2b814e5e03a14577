"""abft.OutputCheck: a checked product's output changed in memory after its check (no version
bump) alarms when the output dies, at its element; the program's own in-place changes and clean
training never alarm."""
import pytest
import torch

import abft
from abft import carry


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
    # gradient), each recorded and verified at its death
    assert chk.recorded == 3 * 5 and chk.verified + chk.skipped == chk.recorded
    assert carry.live() == (0, 0)


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
    assert carry.live() == (0, 0)
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
    from abft import carry

    def interrupted(entry):
        raise KeyboardInterrupt

    monkeypatch.setattr(carry, "_read", interrupted)
    monkeypatch.setattr(carry, "_dead", [])

    class Output:
        pass

    out = Output()
    ref = weakref.ref(out, lambda _, e={}: carry._died(e))
    del out
    assert ref() is None and len(carry._dead) == 1
    with pytest.raises(KeyboardInterrupt):     # at the next safe point (a record, a flush)
        carry.drain()
    monkeypatch.setattr(carry, "_dead", [])
    carry.drain()                              # once
