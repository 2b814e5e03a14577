"""Helpers for the tests' spawned gloo ranks."""
import os
import sys


def exit_clean():
    """End a spawned rank that finished its work (results written, process group destroyed)
    without the interpreter's finalization: there, tensors still held by gloo's worker threads
    can abort the process (SIGABRT, "terminate called without an active exception"; seen twice
    in this suite's clean-clone runs on 2026-12-04, cf. pytorch/pytorch#179291). Only on the
    success path: a rank that raised keeps its traceback and exit code."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
