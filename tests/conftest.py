import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
# the one-off scripts of benchmarks/ (not installed), for their smoke tests
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))


@pytest.fixture(autouse=True)
def _clean_abft():
    """Each test starts with no pending verdicts, an empty log and zeroed counters."""
    import abft
    abft.reset()
    torch.manual_seed(0)
    yield
    abft.reset()


@pytest.fixture(params=["reference", "triton"])
def backend(request):
    """The API contract on both backends: the test body runs under abft.config(backend=...)
    (triton: under the interpreter, or on a GPU)."""
    import abft
    if request.param == "triton":
        pytest.importorskip("triton")
        from abft.kernels import configs
        if not configs.interpreting() and not torch.cuda.is_available():
            pytest.skip("the triton backend needs TRITON_INTERPRET=1 or a GPU")
    with abft.config(backend=request.param):
        yield request.param


def pytest_configure(config):
    # The one place the suite chooses how Triton kernels run (triton decides when a kernel is
    # defined, so before any test module imports one): the interpreter with --interpret or where
    # there is no GPU; compiled otherwise. An explicit TRITON_INTERPRET is left as it is.
    if config.getoption("--interpret") or not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    config.addinivalue_line("markers", "slow: minutes under the interpreter; `make test-slow` runs "
                                       "them, `make test` leaves them out")


def pytest_addoption(parser):
    parser.addoption("--interpret", action="store_true",
                     help="run the Triton kernels under the interpreter even where a GPU is present")
    parser.addoption("--stress-seed", type=int, default=None,
                     help="replay the fresh-seed stress test with this seed")
