"""Every pattern of the fault hook is detected and located."""
import pytest
import torch

import abft

M, K, N = 96, 64, 80
TILES = (32, 32)


def _run(**inj):
    a, b = torch.randn(M, K), torch.randn(K, N)
    with abft.config(tiles=TILES):
        with abft.inject(**inj) as h:
            out = abft.matmul(a, b)
        alarms = abft.flush()
    assert len(h.hits) == 1
    return out, a @ b, alarms


@pytest.mark.parametrize("kind,extra", [
    ("bitflip", dict(bit=30)), ("bitflip", dict(bit=29)), ("bitflip", dict(bit=27)),
    ("bitflip", dict(bit=31)),
    ("value", dict(value=1e3)), ("add", dict(value=-0.5)), ("scale", dict(value=3.0)),
    ("zero", {}),
])
def test_element_faults_are_located(kind, extra):
    out, ref, alarms = _run(pattern="element", row=41, col=67, kind=kind, **extra)
    assert not torch.equal(out, ref)
    (a,) = alarms
    assert (a.row, a.col, a.tile) == (41, 67, (1, 2))
    assert a.rows == [41] and a.cols == [67]
    err = (out - ref)[41, 67].item()
    assert a.residual == pytest.approx(err, rel=1e-3, abs=10 * a.threshold)


def test_row_fault_lists_every_column():
    out, ref, alarms = _run(pattern="row", row=50, kind="add", value=1.0)
    assert len(alarms) == N // TILES[1] + (N % TILES[1] > 0)
    assert all(a.row == 50 and a.rows == [50] for a in alarms)
    assert sorted(c for a in alarms for c in a.cols) == list(range(N))


def test_column_fault_lists_every_row():
    out, ref, alarms = _run(pattern="column", col=5, kind="scale", value=-1.0)
    assert all(a.col == 5 and a.cols == [5] for a in alarms)
    assert sorted(r for a in alarms for r in a.rows) == list(range(M))


def test_tile_fault_lists_rows_and_columns():
    out, ref, alarms = _run(pattern="tile", row=32, col=32, size=(4, 3), kind="add", value=2.0)
    (a,) = alarms
    assert a.tile == (1, 1)
    assert a.rows == [32, 33, 34, 35] and a.cols == [32, 33, 34]


def test_fault_by_predicate_and_call_id():
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    with abft.scope(module="attn"):
        with abft.inject(when=lambda ctx: ctx.module == "attn" and ctx.call_id == 2, kind="add", value=5.0) as h:
            for _ in range(4):
                abft.matmul(a, b)
    (alarm,) = abft.flush()
    assert alarm.call_id == 2 and alarm.module == "attn" and len(h.hits) == 1


def test_batched_fault_reports_batch_index():
    x, w = torch.randn(3, 40, 24), torch.randn(24, 20)
    with abft.inject(row=7, col=3, kind="add", value=4.0, batch=(2,)):
        abft.bmm(x, w.expand(3, 24, 20))
    (a,) = abft.flush()
    assert a.batch == (2,) and (a.row, a.col) == (7, 3)


def test_folded_linear_reports_batch_and_row():
    x, w = torch.randn(3, 40, 24), torch.randn(20, 24)
    # linear folds (3, 40) rows into 120: the hook indexes the folded rows, alarms unfold them.
    with abft.inject(row=2 * 40 + 7, col=3, kind="add", value=4.0):
        abft.linear(x, w)
    (a,) = abft.flush()
    assert a.batch == (2,) and (a.row, a.col) == (7, 3) and a.rows == [7]


@pytest.mark.parametrize("dtype,bit", [(torch.bfloat16, 14), (torch.float16, 14), (torch.float64, 62)])
def test_bitflip_in_other_dtypes(dtype, bit):
    a, b = torch.randn(40, 30).to(dtype), torch.randn(30, 20).to(dtype)
    with abft.inject(row=3, col=4, kind="bitflip", bit=bit):
        abft.matmul(a, b)
    (al,) = abft.flush()
    assert (al.row, al.col, al.dtype) == (3, 4, str(dtype).replace("torch.", ""))


def test_bad_injections_are_refused():
    with pytest.raises(ValueError):
        abft.inject(kind="bitflip")
    with pytest.raises(ValueError):
        abft.inject(pattern="diagonal")
    with abft.inject(row=500, col=0, kind="zero"):
        with pytest.raises(IndexError):
            abft.matmul(torch.randn(4, 4), torch.randn(4, 4))


def test_an_injection_is_validated_however_it_is_built():
    """The evaluation builds Injection objects and retargets an installed one: both go through
    the same checks as abft.inject (they used to bypass them)."""
    from abft.hook import Injection
    for kw, field in ((dict(kind="melt"), "kind"), (dict(pattern="diagonal", kind="zero"), "pattern"),
                      (dict(kind="stuck"), "bit")):
        with pytest.raises(ValueError, match=field):
            Injection(**kw)
    slot = Injection(kind="zero", row=1)
    slot.retarget(Injection(kind="bitflip", bit=[3], row=5, col=6, size=[2, 2]))
    assert (slot.kind, slot.bit, slot.row, slot.col, slot.size) == ("bitflip", (3,), 5, 6, (2, 2))
