"""Where the suite's files are, from any folder of it (its folders mirror the packages')."""
import os

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
DATA = os.path.join(TESTS, "data")
