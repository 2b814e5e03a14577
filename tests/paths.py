"""Where the suite's files are, from any folder of it (its folders mirror the packages')."""
import os

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
DATA = os.path.join(TESTS, "data")


def compiling_env():
    """This process's environment without TRITON_INTERPRET, for a subprocess that compiles
    kernels (an interpreted kernel cannot be compiled)."""
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
