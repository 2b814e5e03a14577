"""Policies, sampling, the bounded queue, labels, logs and callbacks. The API contract runs on
both backends (the ``backend`` fixture); what differs by backend (tile sizes, the faults the
kernel can inject) is tested on the reference."""
import json

import pytest
import torch

import abft
from abft import policy


def _pair(m=64, k=32, n=48):
    return torch.randn(m, k), torch.randn(k, n)


@pytest.mark.usefixtures("backend")
def test_record_is_lazy_until_flush():
    a, b = _pair()
    with abft.inject(row=1, col=2, kind="add", value=9.0):
        abft.matmul(a, b)
    from abft.alarms import default_log
    assert policy.pending() == 1 and len(default_log()) == 0
    (al,) = abft.flush()
    assert al.action == "recorded" and policy.pending() == 0
    assert list(abft.alarms()) == [al]


@pytest.mark.usefixtures("backend")
def test_readers_of_the_verdicts_leave_the_alarms_to_the_next_flush():
    """coverage(), alarms(), margin(), stats() and a config's exit resolve the queue without
    taking the alarms from whoever calls flush() next (a StepGuard resolving its step, a test)."""
    import io
    a, b = _pair()
    for read in (abft.coverage, abft.alarms, lambda: abft.margin(file=io.StringIO()), abft.stats,
                 None):
        if read is None:
            with abft.config(sample_every=1):
                with abft.inject(row=1, col=2, kind="add", value=9.0):
                    abft.matmul(a, b)
        else:
            with abft.inject(row=1, col=2, kind="add", value=9.0):
                abft.matmul(a, b)
            read()
        assert policy.pending() == 0
        (al,) = abft.flush()
        assert (al.row, al.col) == (1, 2) and abft.flush() == []


@pytest.mark.usefixtures("backend")
def test_warn_warns_on_resolve():
    a, b = _pair()
    with abft.config(policy="warn"):
        with abft.inject(row=1, col=2, kind="add", value=9.0):
            abft.matmul(a, b)
        with pytest.warns(RuntimeWarning, match="row 1, col 2"):
            abft.flush()


@pytest.mark.usefixtures("backend")
def test_raise_carries_the_alarm():
    a, b = _pair()
    with abft.config(policy="raise"):
        with abft.inject(row=3, col=4, kind="add", value=9.0):
            with pytest.raises(abft.SilentCorruptionError) as e:
                abft.matmul(a, b)
    assert (e.value.alarm.row, e.value.alarm.col, e.value.alarm.action) == (3, 4, "raised")


@pytest.mark.usefixtures("backend")
def test_recompute_transient_returns_the_clean_result():
    a, b = _pair()
    clean = abft.matmul(a, b)       # the backend's own product (the kernel's is not torch's bits)
    with abft.config(policy="recompute"):
        with abft.inject(row=3, col=4, kind="add", value=9.0):
            out = abft.matmul(a, b)
    assert torch.equal(out, clean)
    (al,) = abft.alarms()
    assert (al.action, al.persistence) == ("recomputed", "transient")


@pytest.mark.usefixtures("backend")
def test_recompute_persistent_raises():
    a, b = _pair()
    with abft.config(policy="recompute"):
        with abft.inject(row=3, col=4, kind="add", value=9.0, persistent=True):
            with pytest.raises(abft.SilentCorruptionError) as e:
                abft.matmul(a, b)
    assert e.value.alarm.persistence == "persistent"
    assert [a.persistence for a in abft.alarms()] == ["persistent", "persistent"]


@pytest.mark.usefixtures("backend")
def test_correct_fixes_a_single_element():
    a, b = _pair()
    ref = a @ b
    with abft.config(policy="correct"):
        with abft.inject(row=10, col=20, kind="bitflip", bit=29):
            out = abft.matmul(a, b)
    assert (out - ref).abs().max() < 1e-3
    (al,) = abft.alarms()
    assert al.action == "corrected"


def test_correct_recomputes_the_tile_of_several_elements():
    """A corrupted row fails several column sums: the tiles it crosses are recomputed."""
    a, b = _pair()
    with abft.config(policy="correct"):
        with abft.inject(pattern="row", row=10, kind="add", value=3.0):
            out = abft.matmul(a, b)
    torch.testing.assert_close(out, a @ b, rtol=2e-6, atol=2e-6)
    assert {al.action for al in abft.alarms()} == {"corrected"}


def test_correct_after_exponent_msb_flip_restores_the_element():
    """bf16 element 0.75 with its exponent MSB flipped (~1e38): subtracting the residual from the
    corrupted value cancels to 0; recomputing the element's dot product restores it."""
    torch.manual_seed(0)
    a, b = torch.randn(64, 64).bfloat16(), torch.randn(64, 64).bfloat16()
    ref = a @ b
    with abft.config(policy="correct"):
        with abft.inject(row=3, col=5, kind="value", value=0.75):
            with abft.inject(row=3, col=5, kind="bitflip", bit=14):
                out = abft.matmul(a, b)
    (al,) = abft.alarms()
    assert al.action == "corrected" and (al.row, al.col) == (3, 5)
    exact = (a.double() @ b.double())[3, 5]
    assert abs(out[3, 5].double() - exact) <= 2.0 ** -8 * abs(exact)
    mask = torch.ones_like(ref, dtype=torch.bool)
    mask[3, 5] = False
    assert torch.equal(out[mask], ref[mask])


def test_correct_l_shaped_triple_does_not_touch_a_clean_element():
    """Errors +e at (3, 5), -e at (3, 9), +e at (7, 9): row 3 and column 9 cancel, so the sums
    point at row 7 and column 5, a clean element. Subtracting the residual there made four wrong
    elements that passed the re-check; recomputing the element shows the tile is still wrong."""
    a, b = _pair()
    ref = a @ b
    with abft.config(policy="correct", tiles=(32, 32)):
        faults = [abft.inject(row=3, col=5, kind="add", value=4.0),
                  abft.inject(row=3, col=9, kind="add", value=-4.0),
                  abft.inject(row=7, col=9, kind="add", value=4.0)]
        for f in faults:
            f.start()
        try:
            out = abft.matmul(a, b)
        finally:
            for f in faults:
                f.stop()
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-6)
    assert (out[7, 5] - ref[7, 5]).abs() < 1e-5
    first = abft.alarms()[0]
    assert (first.rows, first.cols) == ([7], [5])
    assert {al.action for al in abft.alarms()} <= {"corrected", "recomputed"}


@pytest.mark.usefixtures("backend")
def test_sample_every_checks_one_call_in_n_per_site():
    """A sampled-out call still returns the product (on the triton backend it returned None)."""
    a, b = _pair(8, 8, 8)
    ref = a @ b
    with abft.config(sample_every=3):
        for _ in range(9):
            torch.testing.assert_close(abft.matmul(a, b), ref)
        for _ in range(2):
            torch.testing.assert_close(abft.mm(a, b), ref)      # another call site: its own counter
    s = abft.stats()
    assert s["checked_calls"] == 3 + 1 and s["sampled_out_calls"] == 6 + 1


@pytest.mark.usefixtures("backend")
def test_queue_is_bounded():
    a, b = _pair(8, 8, 8)
    with abft.config(max_pending=4):
        for i in range(10):
            with abft.inject(row=1, col=2, kind="add", value=9.0):     # alarmed: queued
                abft.matmul(a, b)
            assert policy.pending() < 4
    assert abft.stats()["checked_calls"] == 10 and len(abft.flush()) == 10


@pytest.mark.usefixtures("backend")
def test_queue_bounded_by_bytes():
    a, b = _pair(64, 8, 64)
    with abft.config(max_pending_bytes=1):
        with abft.inject(row=1, col=2, kind="add", value=9.0):
            abft.matmul(a, b)
        assert policy.pending() == 0
    assert len(abft.flush()) == 1


@pytest.mark.usefixtures("backend")
def test_a_clean_verdict_on_the_host_is_counted_at_once():
    """A CPU product's clean verdict is known when its check returns: counted then (the margins
    too), never queued; an alarmed one still waits for the flush."""
    a, b = _pair()
    abft.matmul(a, b)
    assert policy.pending() == 0 and policy._stats["checked_calls"] == 1
    (row,) = policy.margins()
    assert row["op"] == "matmul" and row["calls"] == 1 and 0 <= row["worst"] <= 1
    with abft.inject(row=1, col=2, kind="add", value=9.0):
        abft.matmul(a, b)
    assert policy.pending() == 1 and policy._stats["checked_calls"] == 1
    (al,) = abft.flush()
    assert (al.row, al.col, al.op, al.shapes) == (1, 2, "matmul", ((64, 32), (32, 48)))


def test_a_queued_verdict_keeps_no_operand_alive():
    """The alarm metadata is built when it is read, from values: a queued verdict holds neither
    the operands nor the product (a detector verifying outputs at their death sees them die)."""
    import gc
    import weakref
    a, b = _pair()
    with abft.inject(row=1, col=2, kind="add", value=9.0):
        c = abft.matmul(a, b)
    refs = [weakref.ref(t) for t in (a, b, c)]
    del a, b, c
    gc.collect()
    assert policy.pending() == 1 and all(r() is None for r in refs)
    (al,) = abft.flush()
    assert al.shapes == ((64, 32), (32, 48)) and al.rank == 0 and al.time > 0


def test_jsonl_sink_and_callback(tmp_path):
    seen = []
    path = tmp_path / "alarms-{rank}.jsonl"
    a, b = _pair()
    with abft.config(log_path=str(path), on_alarm=seen.append):
        with abft.scope(step=7, micro_step=1, replica="F", module="mlp.fc1"):
            with abft.inject(row=5, col=6, kind="add", value=9.0):
                abft.matmul(a, b)
            abft.flush()
    lines = (tmp_path / "alarms-0.jsonl").read_text().splitlines()
    assert len(lines) == 1 and len(seen) == 1
    rec = json.loads(lines[0])
    assert (rec["step"], rec["micro_step"], rec["replica"], rec["module"], rec["row"], rec["col"]) == \
        (7, 1, "F", "mlp.fc1", 5, 6)
    assert rec["bm"] == 64 and rec["bn"] == 48 and rec["dtype"] == "float32"


@pytest.mark.usefixtures("backend")
def test_scopes_nest_count_calls_and_keep_their_own_log():
    a, b = _pair(16, 16, 16)
    logs = {r: abft.AlarmLog() for r in ("H", "F")}
    for r in ("H", "F"):
        with abft.scope(replica=r, step=2, log=logs[r]):
            with abft.scope(module="blk0"):
                for i in range(3):
                    inj = abft.inject(call_id=1, kind="add", value=7.0, row=0, col=0) if r == "F" else None
                    if inj:
                        inj.start()
                    abft.matmul(a, b)
                    if inj:
                        inj.stop()
    abft.flush()
    assert len(logs["H"]) == 0
    (al,) = logs["F"]
    assert (al.replica, al.step, al.module, al.call_id) == ("F", 2, "blk0", 1)
    assert list(abft.alarms()) == [al]           # the process log sees every alarm


def test_config_validates_and_restores():
    with pytest.raises(ValueError, match="policy"):
        abft.config(policy="ignore")
    with pytest.raises(TypeError, match="unknown"):
        abft.config(polcy="raise")
    with pytest.raises(ValueError, match="sample_every"):
        abft.config(sample_every=0)
    with abft.config(policy="raise", tiles=(8, 8)) as s:
        assert s.policy == "raise" and s.tiles == (8, 8)
    from abft import settings
    assert settings.get().policy == "record"


@pytest.mark.usefixtures("backend")
def test_alarm_text_says_where():
    a, b = _pair()
    with abft.scope(step=3, module="lm_head"):
        with abft.inject(row=1, col=2, kind="add", value=9.0):
            abft.matmul(a, b)
    (al,) = abft.flush()
    text = str(al)
    for part in ("lm_head", "step 3", "row 1, col 2", "matmul/forward"):
        assert part in text


@pytest.mark.usefixtures("backend")
def test_margins_keep_the_worst_clean_ratio_per_op_and_module(capsys):
    """stats()['margins'] and abft.margin(): per op and module, the largest residual / threshold of
    a clean call; an alarmed call does not count (its ratio is the fault's, not round-off's)."""
    a, b = _pair()
    keys = set(abft.stats())
    with abft.scope(module="fc"):
        abft.matmul(a, b)
        abft.matmul(a * 3, b)
    with abft.scope(module="proj"):
        abft.mm(a, b)
        with abft.inject(row=1, col=2, kind="add", value=9.0):
            abft.mm(a, b)
    assert len(abft.flush()) == 1
    s = abft.stats()
    assert keys <= set(s) and s["checked_calls"] == 4
    rows = {(r["op"], r["module"]): r for r in s["margins"]}
    assert set(rows) == {("matmul", "fc"), ("mm", "proj")}
    assert rows[("matmul", "fc")]["calls"] == 2 and rows[("mm", "proj")]["calls"] == 1
    assert all(0 < r["worst"] <= 1 and r["phase"] == "forward" for r in rows.values())
    printed = abft.margin()
    out = capsys.readouterr().out
    assert printed == s["margins"] and "matmul / fc" in out and "mm / proj" in out
    abft.reset()
    assert abft.stats()["margins"] == []


@pytest.mark.usefixtures("backend")
def test_recompute_policy_raises_and_logs_an_alarm_in_a_product_given_as_views():
    """An einsum is checked as views of torch's output: it cannot be recomputed there, so the
    recompute policy raises the alarm, logged (it used to raise a RuntimeError and lose it)."""
    a, b = _pair()
    with abft.config(policy="recompute"):
        with abft.checked():
            with abft.inject(row=3, col=4, kind="add", value=9.0):
                with pytest.raises(abft.SilentCorruptionError) as e:
                    torch.einsum("ik,kj->ij", a, b)
    assert (e.value.alarm.row, e.value.alarm.col, e.value.alarm.action) == (3, 4, "raised")
    assert [(al.op, al.action) for al in abft.alarms()] == [("einsum", "raised")]


@pytest.mark.parametrize("tiles", [(48, 17), (8, 8), (1.7, 2), (4,), (64, 64, 64), 5])
def test_config_refuses_tiles_the_backend_cannot_run_naming_the_field(tiles):
    """Tiles are two positive ints, and on the triton backend powers of two of at least 16: a bad
    pair fails at config(), not at the first product on the kernel."""
    pytest.importorskip("triton")
    with pytest.raises(ValueError, match="tiles"):
        abft.config(backend="triton", tiles=tiles)
    from abft import settings
    assert settings.get().tiles is None and settings.get().backend == "reference"
    if tiles in ((48, 17), (8, 8)):
        with abft.config(tiles=tiles):               # the reference backend takes any size
            with pytest.raises(ValueError, match="tiles"):
                abft.config(backend="auto")


@pytest.mark.parametrize("tiles", [1, 7, 16, 17, 300])
def test_the_cpu_summary_is_the_torch_summary(tiles, monkeypatch):
    """summarize() reads CPU verdicts in Python (<= 16 tiles) or numpy: the same four numbers as
    its torch reductions (run by pretending to trace)."""
    from abft.kernels import layout as L
    g = torch.Generator().manual_seed(tiles)
    v = torch.rand(tiles, L.NFIELDS, generator=g) * 2
    v[:, L.STATUS] = torch.randint(0, 3, (tiles,), generator=g).float()
    v[0, L.COL_RATIO] = float("inf")
    fast = policy.summarize(v.view(1, tiles, L.NFIELDS))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    slow = policy.summarize(v.view(1, tiles, L.NFIELDS))
    assert isinstance(fast, tuple) and torch.equal(torch.tensor(fast), slow.cpu())
