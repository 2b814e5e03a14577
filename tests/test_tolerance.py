"""Gates of the threshold on the stress set: no false alarm, every threshold at most the
deterministic worst-case bound of its sum, every error above that bound detected and located."""
import os
import zlib

import pytest
import torch

from stress import cases, operands, worst_case_bounds
from abft.kernels.reference import check
from abft.kernels import layout as L
from abft.kernels.threshold import units

CASES = list(cases(quick=True))
ID = lambda c: f"{c[0]}-M{c[1]}-K{c[2]}-N{c[3]}-{str(c[4]).replace('torch.', '')}"


def _run(case, seed, bm, bn, inject=None):
    dist, m, k, n, dt = case
    a, b = operands(dist, m, k, n, dt, seed)
    c = a @ b
    if inject is not None:
        inject(a, b, c)
    v, detail, sums = check(a, b, c, bm=bm, bn=bn, units=units(dt), return_sums=True)
    return a, b, c, v, detail, sums


def _assert_clean(case, seed, bm, bn):
    *_, v, (rr, rc), _ = _run(case, seed, bm, bn)
    worst = max(rr.abs().max().item(), rc.abs().max().item())
    assert worst <= 1, f"false alarm: {ID(case)} seed {seed} tiles {bm}x{bn}: ratio {worst:.3f}"
    assert (v[..., L.STATUS] == L.OK).all()


@pytest.mark.parametrize("seed", [0, 1])
def test_no_false_alarm_fixed_seeds(seed):
    for case in CASES:
        for bm, bn in ((32, 32), (256, 256), (48, 17)):
            _assert_clean(case, seed, bm, bn)


def test_no_false_alarm_fresh_seed(request):
    seed = request.config.getoption("--stress-seed")
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")
    print(f"stress seed {seed} (replay: pytest tests/test_tolerance.py --stress-seed {seed})")
    for case in CASES:
        _assert_clean(case, seed, 32, 32)


@pytest.mark.parametrize("case", CASES, ids=ID)
def test_threshold_within_worst_case_bound(case):
    a, b, c, v, _, sums = _run(case, 0, 32, 32)
    w_col, w_row = worst_case_bounds(a, b, c, 32, 32)
    for name, thr, w in (("col", sums["thr_col"], w_col), ("row", sums["thr_row"], w_row)):
        excess = (thr.double() / w).max().item()
        assert excess <= 1.0, f"{ID(case)}: a {name} threshold is {excess:.3g}x its worst-case bound"


@pytest.mark.parametrize("case", CASES, ids=ID)
def test_error_above_worst_case_bound_detected_and_located(case):
    dist, m, k, n, dt = case
    g = torch.Generator().manual_seed(zlib.crc32(ID(case).encode()))
    bm = bn = 32
    for _ in range(3):
        i, j = int(torch.randint(m, (1,), generator=g)), int(torch.randint(n, (1,), generator=g))
        sign = 1 if torch.rand(1, generator=g).item() < 0.5 else -1
        a, b = operands(dist, m, k, n, dt, 0)
        c = a @ b
        w_col, w_row = worst_case_bounds(a, b, c, bm, bn)
        w = max(w_col[i // bm, j].item(), w_row[i, j // bn].item())
        before = c[i, j].double().item()
        big = torch.finfo(dt).max / 2
        if abs(before + sign * 4 * w) > big:
            sign = -sign        # keep the corrupted value representable
        if abs(before + sign * 4 * w) > big:
            continue            # no error above the bound is representable here (fp16)
        c[i, j] = before + sign * 2 * w
        moved = abs(c[i, j].double().item() - before)
        if moved <= w:          # rounding of the stored dtype swallowed it: push harder
            c[i, j] = before + sign * 4 * w + sign * abs(before) * 2 ** -6
            moved = abs(c[i, j].double().item() - before)
        assert w < moved < float("inf")
        v, (rr, rc) = check(a, b, c, bm=bm, bn=bn, units=units(dt))
        t = v[i // bm, j // bn]
        assert t[L.ROW_RATIO] > 1 and t[L.COL_RATIO] > 1, f"{ID(case)}: missed an error of {moved:.3g} > bound {w:.3g}"
        assert int(t[L.ROW]) == i and int(t[L.COL]) == j
        alarmed = (v[..., L.ROW_RATIO] > 1) | (v[..., L.COL_RATIO] > 1)
        assert alarmed.sum() == 1, "the alarm must stay in the corrupted tile"
        est = t[L.RESIDUAL].item()
        assert abs(est - (c[i, j].double().item() - before)) <= 0.01 * moved + 2 * w
