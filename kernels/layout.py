"""The verdict layout: the contract between a backend and the policies.

A backend returns, for a product with batch shape ``batch`` and tiles of BM rows x BN columns,
a float32 tensor of shape ``(*batch, TM, TN, NFIELDS)`` on the product's device, one record
per tile. Fields (indices into the last dimension):

- ``ROW_RATIO``: the worst |residual| / threshold over the tile's row sums (one per row of
  the tile, summed over the tile's BN columns);
- ``ROW_FAILS``: how many of those row sums exceed their threshold;
- ``ROW``: the global row index (in the product's second-last dimension) of the worst row sum,
  or -1 when no row sum fails;
- ``COL_RATIO``, ``COL_FAILS``, ``COL``: the same for the column sums (one per column of the
  tile, summed over its BM rows);
- ``RESIDUAL``: the signed residual of the worst failing column sum (of the worst row sum when
  no column fails): the error estimate of a single corrupted element;
- ``THRESHOLD``: the threshold of that sum;
- ``STATUS``: ``OK``, ``UNVERIFIED`` (non-finite input, or magnitudes the threshold arithmetic
  cannot hold; on the reference backend not where a sum of |C| exceeds what the operands allow:
  that tile is ``OK``, its overflowing sums failing) or ``NONFINITE`` (non-finite output from
  finite inputs: an alarm).

A tile is alarmed when ``STATUS == NONFINITE`` or either ratio exceeds 1. Unverified tiles have
their ratios set to 0 and never alarm.

Indices are stored as float32, exact up to 2**24 rows or columns.
"""

ROW_RATIO, ROW_FAILS, ROW, COL_RATIO, COL_FAILS, COL, RESIDUAL, THRESHOLD, STATUS = range(9)
NFIELDS = 9

OK, UNVERIFIED, NONFINITE = 0.0, 1.0, 2.0

# The faults the fused kernel injects into one accumulator element (its constexpr INJECT codes);
# the reference backend corrupts the stored product with any of ``abft.hook.KINDS``.
INJECT_KINDS = {"bitflip": 1, "add": 2, "zero": 3}


def alarmed(v):
    """Bool (..., TM, TN): the tiles of verdict ``v`` that alarm (the rule above)."""
    return (v[..., ROW_RATIO] > 1) | (v[..., COL_RATIO] > 1) | (v[..., STATUS] == NONFINITE)


def summary(v):
    """(alarmed tiles, unverified tiles, tiles, worst ratio) of verdict ``v``: floats for a CPU
    verdict (the compiled check counts the same in its call), else a float32 tensor of four on
    ``v``'s device (read later: no host synchronisation here)."""
    import torch
    if v.device.type == "cpu" and not torch.compiler.is_compiling():
        # on the CPU without torch's ten ops: a few tiles in Python, more in numpy
        x = v.detach().numpy().reshape(-1, NFIELDS)
        if len(x) <= 16:
            rows = x.tolist()
            n_alarmed = sum(r[ROW_RATIO] > 1 or r[COL_RATIO] > 1 or r[STATUS] == NONFINITE for r in rows)
            n_unverified = sum(r[STATUS] == UNVERIFIED for r in rows)
            worst = max((max(r[ROW_RATIO], r[COL_RATIO]) for r in rows), default=0.0)
        else:
            import numpy as np
            n_alarmed = alarmed(x).sum()
            n_unverified = (x[:, STATUS] == UNVERIFIED).sum()
            worst = np.maximum(x[:, ROW_RATIO], x[:, COL_RATIO]).max()
        return (float(n_alarmed), float(n_unverified), float(len(x)), float(worst))
    bad = alarmed(v)
    unverified = v[..., STATUS] == UNVERIFIED
    # a fill, not a host-to-device copy: capturable in a CUDA graph
    tiles = torch.full((), float(v[..., 0].numel()), device=v.device)
    worst = torch.maximum(v[..., ROW_RATIO], v[..., COL_RATIO])
    worst = worst.amax() if worst.numel() else tiles * 0
    return torch.stack([bad.sum().float(), unverified.sum().float(), tiles, worst.float()])


FIELD_NAMES = ("row_ratio", "row_fails", "row", "col_ratio", "col_fails", "col",
               "residual", "threshold", "status")
