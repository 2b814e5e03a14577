"""Detectors beyond the GEMMs' checksums, each its own switch: ``attention`` (the softmax's
invariants under ``checked(sdpa=True)``), ``outputs`` (``OutputCheck``: products' outputs and
operands in memory until they die), ``comm`` (``CommCheck``: gradients in their collectives),
``recompute`` (``RecomputeCheck``: the ops between the products, rerun), ``rest`` (``RestCheck``:
parameters and optimizer state between steps)."""
