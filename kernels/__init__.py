"""The arithmetic of checked GEMMs: the torch-ops reference backend and the verdict layout.

Installed as ``abft.kernels``. No policy and no logging here: a backend returns the product
and a verdict tensor, and ``abft.policy`` decides what to do with it.
"""
