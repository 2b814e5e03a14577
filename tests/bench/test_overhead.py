"""pytest-benchmark of checked against plain products (float32, CPU). `make test` runs these
once each with --benchmark-disable (as smoke tests); `pytest tests/bench` times them.
BENCHMARKS.md's table comes from `abft bench` (bench/overhead.py), which interleaves the pairs."""
import pytest

from abft.bench.overhead import make_pair

SHAPES = [("matmul", 512, 512, 512), ("matmul", 1024, 1024, 1024), ("linear", 1024, 1024, 1024)]


@pytest.mark.parametrize("kind,m,k,n", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("which", ["plain", "checked"])
def test_product(benchmark, kind, m, k, n, which):
    import abft
    plain, checked = make_pair(kind, m, k, n)
    fn = plain if which == "plain" else checked
    out = benchmark(fn)
    assert out.shape == (m, n)
    assert abft.flush() == []


@pytest.mark.parametrize("which", ["plain", "checked"])
def test_train_step(benchmark, which):
    import abft
    from abft.eval.models import bench_gpt
    from abft.bench.overhead import train_step_pair
    plain, checked = train_step_pair(bench_gpt)
    loss = benchmark(plain if which == "plain" else checked)
    assert loss.isfinite()
    assert abft.flush() == []
