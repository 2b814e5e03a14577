"""Smoke tests of the one-off scripts in benchmarks/ (their figures are in BENCHMARKS.md): each
runs one round end to end and prints its table."""


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
