"""Smoke tests of the one-off scripts in benchmarks/ (their figures are in BENCHMARKS.md): each
runs one round end to end and prints its table."""

import pytest


def test_pairbench_runs_one_round(capsys):
    import pairbench
    pairbench.main(rounds=1)
    out = capsys.readouterr().out
    assert "median of 1 interleaved rounds" in out


def test_guardbench_runs_one_round(capsys):
    import guardbench
    guardbench.main(rounds=1)
    out = capsys.readouterr().out
    assert "x plain" in out and "guard all-reduce" in out


def test_fixedcost_measures_the_api_and_the_check(capsys):
    import fixedcost
    out = fixedcost.main(pairs=20, warmup=5)
    text = capsys.readouterr().out
    assert "abft.matmul + flush - plain" in text and "torch ops" in text
    assert out["api_ms"] > 0 and out["check_ms"] > 0 and 100 < out["ops"] < 2000


@pytest.mark.slow
def test_fixedcost_compiles_the_check_to_the_same_verdicts(capsys):
    import fixedcost
    out = fixedcost.main(pairs=20, warmup=5, compile=True)
    assert out["equal"] and out["compile_s"] > 0 and out["compiled_ms"] > 0
