"""Fingerprints of the state at rest (abft.RestCheck) and the guard's use of them."""
import copy

import pytest
import torch

import abft
from abft.detectors import rest as R


def _flip(t, index, bit):
    bits = t.detach().reshape(-1).view({2: torch.int16, 4: torch.int32}[t.element_size()])
    bits[index] ^= (1 << bit) if bit < 8 * t.element_size() - 1 else -(1 << bit)


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(),
                               torch.nn.Linear(40, 6)).to(dtype)


def _trained(dtype=torch.float32):
    m = _model(dtype)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(5, 24, dtype=dtype)).square().sum().backward()
    opt.step()
    return m, opt


def _want(bits, block):
    out = []
    for i in range(0, len(bits), block):
        part = bits[i:i + block]
        out.append([sum(x for x in part), sum((k + 1) * x for k, x in enumerate(part)),
                    sum(((k + 1) ** 2 % 4093 + 1) * x for k, x in enumerate(part))])
    return torch.tensor(out).t()


def test_fingerprints_are_the_per_block_sums_with_a_short_tail(monkeypatch):
    monkeypatch.setattr(R, "_CHUNK", 1000)            # several passes, and a tail block
    t = torch.randn(10007)
    want = _want(t.view(torch.int32).tolist(), 128)
    assert torch.equal(R.fingerprint(t, 128), want)
    assert torch.equal(R.fingerprint(t, 128, 5, 3), want[:, 5:8])


def test_fingerprints_stay_exact_at_the_largest_block_and_bits():
    for word in (-(1 << 31), (1 << 31) - 1):
        t = torch.full((256 * 3 + 5,), word, dtype=torch.int32).view(torch.float32)
        assert torch.equal(R.fingerprint(t, 256), _want([word] * (256 * 3 + 5), 256))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_flipped_bit_is_located_and_restored(dtype):
    m, opt = _trained(dtype)
    names = {p: n for n, p in m.named_parameters()}
    rc = abft.RestCheck(opt, names=names, block=256)
    rc.seal()
    assert rc.verify() == []
    before = [t.detach().clone() for _, _, t in rc.tensors()]
    w, moment = m[0].weight, opt.state[m[2].weight]["exp_avg"]
    _flip(w, 7 * 24 + 5, 8 * w.element_size() - 2)          # exponent MSB of weight (7, 5)
    _flip(moment, 13, 3)                                    # a low bit of an Adam moment
    found = sorted(rc.verify(), key=lambda a: a.module)
    assert [(a.module, a.phase, a.row, a.col, a.kind) for a in found] == [
        ("0.weight", "param", 7, 5, "rest"), ("2.weight", "exp_avg", 0, 13, "rest")]
    assert "rest/param in 0.weight" in found[0].where()
    assert rc.restore(found) == []
    assert all(torch.equal(a, t) for a, (_, _, t) in zip(before, rc.tensors()))
    assert rc.verify() == []


def test_two_changes_in_a_block_are_detected_not_located_and_left_alone():
    m, opt = _trained()
    rc = abft.RestCheck(opt, block=64)
    rc.seal()
    w = m[0].weight
    bits = w.detach().reshape(-1).view(torch.int32)
    bits[10] += 1
    bits[12] += 1          # with two sums this would pass for one change of 2 at element 11
    changed = w.detach().clone()
    found = rc.verify()
    assert len(found) == 1 and found[0].row is None and found[0].labels["index"] is None
    assert rc.restore(found) == found and torch.equal(w.detach(), changed)


def test_block_must_be_a_whole_number():
    m, opt = _trained()
    for bad in (0, 257, True, 2.0):
        with pytest.raises(ValueError, match="block"):
            abft.RestCheck(opt, block=bad)


def _train(steps, *, rest=True, flips=None, every=1, decision="rerun"):
    """Train the small model under a guard; ``flips``: {step: (tensor getter, index, bit)} made
    after that step's update, as a fault in memory between steps would."""
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    guard = abft.StepGuard(opt, decision=decision, rest=rest, every=every,
                           names={p: n for n, p in m.named_parameters()})
    g = torch.Generator().manual_seed(1)
    for s in range(steps):
        x, y = torch.randn(8, 24, generator=g), torch.randn(8, 6, generator=g)

        def closure():
            with abft.checked(m):
                loss = torch.nn.functional.mse_loss(m(x), y)
                loss.backward()
            return loss
        guard.step(closure)
        for get, index, bit in (flips or {}).get(s, ()):
            _flip(get(m, opt), index, bit)
    return m, guard


def test_the_guard_restores_a_flip_at_rest_and_the_run_ends_as_a_clean_one():
    clean, g0 = _train(6)
    assert not any(sum(r["alarm_counts"]) for r in g0.records)
    flips = {1: [(lambda m, o: m[0].weight, 100, 30)],                    # exponent MSB
             3: [(lambda m, o: o.state[m[2].weight]["exp_avg_sq"], 7, 29)]}
    faulty, g1 = _train(6, flips=flips)
    hit = {r["step"]: r for r in g1.records if sum(r["alarm_counts"])}
    assert sorted(hit) == [2, 4]
    assert hit[2]["alarms"][0]["module"] == "0.weight" and hit[2]["alarms"][0]["phase"] == "param"
    assert hit[4]["alarms"][0]["phase"] == "exp_avg_sq"
    assert all(r["decision"] == "rerun" and r["persistence"] == "transient" for r in hit.values())
    assert all(torch.equal(a, b) for a, b in zip(clean.parameters(), faulty.parameters()))
    # without the check the same flips change the run
    plain, _ = _train(6, rest=False, flips=flips)
    assert not all(torch.equal(a, b) for a, b in zip(clean.parameters(), plain.parameters()))


def test_sampled_steps_seal_only_before_checked_ones_and_never_false_alarm():
    _, guard = _train(7, every=3)
    assert [r["step"] for r in guard.records] == [0, 3, 6]
    assert not any(sum(r["alarm_counts"]) for r in guard.records)


def test_an_unlocated_change_is_persistent():
    def two(m, o):
        return m[0].weight
    with pytest.raises(abft.GuardHalt):
        _train(4, flips={1: [(two, 3, 2), (two, 5, 2)]})


def _guarded(decision):
    """A model, a guard with the rest check, and a closure of one fixed batch."""
    m = _model()
    guard = abft.StepGuard(torch.optim.AdamW(m.parameters(), lr=1e-2), rest=True,
                           decision=decision)

    def closure():
        loss = m(torch.ones(2, 24)).sum()
        loss.backward()
        return loss
    return m, guard, closure


def test_a_change_outside_the_step_needs_reseal():
    m, guard, closure = _guarded("continue")
    guard.step(closure)
    with torch.no_grad():
        m[0].weight.clamp_(-0.01, 0.01)            # the user's own change
    guard.reseal()
    guard.step(closure)
    assert not any(sum(r["alarm_counts"]) for r in guard.records)


def test_a_float64_flip_is_located_and_restored():
    t = torch.randn(300, dtype=torch.float64)
    p = torch.nn.Parameter(t.clone())
    opt = torch.optim.SGD([p], lr=0.1)
    rc = abft.RestCheck(opt, block=128)
    rc.seal()
    p.detach().view(torch.int64)[200] ^= 1 << 40        # the high word of element 200
    (a,) = rc.verify()
    assert (a.tile, a.row, a.col) == ((401 // 128,), 0, 200)
    assert rc.restore([a]) == [] and torch.equal(p.detach(), t)


def test_channels_last_weights_and_their_moments_are_checked():
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(conv.parameters(), lr=1e-2)
    conv(torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)).sum().backward()
    opt.step()
    rc = abft.RestCheck(opt, names={conv.weight: "w", conv.bias: "b"})
    rc.seal()
    before = conv.weight.detach().clone()
    conv.weight.detach()[5, 1, 2, 0].view(1).view(torch.int32)[0] ^= 1 << 27
    (a,) = rc.verify()
    assert a.module == "w" and rc.restore([a]) == [] and torch.equal(conv.weight.detach(), before)


def test_a_replaced_state_is_sealed_again_not_alarmed():
    m, opt = _trained()
    rc = abft.RestCheck(opt)
    rc.seal()
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))      # new tensors, the same values
    with pytest.warns(RuntimeWarning, match="replaced"):
        assert rc.verify() == []
    _flip(opt.state[m[0].weight]["exp_avg"], 3, 20)   # the live moment, not the old one
    assert [a.phase for a in rc.verify()] == ["exp_avg"]


def test_many_changed_blocks_give_a_bounded_number_of_alarms():
    m, opt = _trained()
    rc = abft.RestCheck(opt, block=16)
    rc.seal()
    with torch.no_grad():
        m[0].weight.mul_(1.5)                       # forgot reseal() after changing weights
    found = rc.verify()
    assert len(found) == R.MAX_ALARMS + 1
    assert found[0].labels["blocks"] == -(-m[0].weight.numel() // 16)


def test_an_unrestored_change_stays_in_view_when_the_step_is_skipped():
    m, guard, closure = _guarded("skip")
    guard.step(closure)
    bits = m[0].weight.detach().reshape(-1).view(torch.int32)
    bits[10] += 1
    bits[12] += 1                                   # two in one block: not located
    for _ in range(2):
        guard.step(closure)
    assert [sum(r["alarm_counts"]) for r in guard.records] == [0, 1, 1]


def test_the_guard_counts_alarms_resolved_early_by_a_full_queue():
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    guard = abft.StepGuard(opt, decision="skip")

    def closure():
        with abft.checked(m):
            loss = m(torch.ones(2, 24)).sum()
            loss.backward()
        return loss
    with abft.config(max_pending=2), abft.inject(when=lambda c: c.phase == "forward" and
                                                 c.module == "0", kind="add", value=50.0):
        guard.step(closure)
    assert guard.records[-1]["alarm_counts"] == [1] and guard.records[-1]["decision"] == "skip"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                   torch.uint8, torch.int32])
@pytest.mark.parametrize("block", [1, 7, 256])
def test_the_compiled_fingerprint_equals_the_torch_one(dtype, block):
    """Every dtype's words (16-bit, 32-bit, 64-bit as two words, bytes widened), blocks that do
    not divide the length, a range of blocks, and the extreme words (+-2^31, +-2^15)."""
    from abft.kernels import compiled
    if compiled.library() is None:
        pytest.skip("no compiled library here")
    g = torch.Generator().manual_seed(block)
    n = 3 * 1000 + 17
    if dtype.is_floating_point:
        t = (torch.randn(n, generator=g, dtype=torch.float64) * 1e3).to(dtype)
    else:
        t = torch.randint(0, 200 if dtype == torch.uint8 else 2 ** 31 - 1, (n,), generator=g,
                          dtype=torch.int64).to(dtype)
    bits = R._bits(t)
    if bits.element_size() == 4:
        bits[:4] = torch.tensor([-2 ** 31, 2 ** 31 - 1, -2 ** 31, 2 ** 31 - 1], dtype=bits.dtype)
    else:
        bits[:4] = torch.tensor([-2 ** 15, 2 ** 15 - 1, -2 ** 15, 2 ** 15 - 1], dtype=bits.dtype)
    nb = -(-bits.numel() // block)
    for first, count in ((0, nb), (1, nb - 2), (nb - 1, 1)):
        if count < 1:
            continue
        fast = compiled.fingerprint(bits[first * block:(first + count) * block], block)
        assert fast is not None
        assert torch.equal(fast.t(), R.fingerprint_torch(bits, block, first, count))
    big = torch.full((257 * block,), 2 ** 31 - 1, dtype=torch.int32)   # the sums' largest terms
    assert torch.equal(compiled.fingerprint(big, block).t(),
                       R.fingerprint_torch(big, block, 0, 257))
