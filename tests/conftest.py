import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _clean_abft():
    """Each test starts with no pending verdicts, an empty log and zeroed counters."""
    import abft
    abft.reset()
    torch.manual_seed(0)
    yield
    abft.reset()


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: minutes under the interpreter; `make test-slow` runs "
                                       "them, `make test` leaves them out")


def pytest_addoption(parser):
    parser.addoption("--stress-seed", type=int, default=None,
                     help="replay the fresh-seed stress test with this seed")
