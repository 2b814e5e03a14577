"""Launch configurations of the checked-GEMM kernel.

The tile (BM, BN) fixes the verdict's shape, so it is chosen before the launch from the shape and
dtype; the autotuner then picks only BK, warps and stages. Under the interpreter (TRITON_INTERPRET=1)
there is one fixed config: autotune with several configs fails there ("0 active drivers").
"""
import os

import triton


def interpreting():
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def tile(m, n, k, dtype):
    """(BM, BN): 128 x 128 for large products (the usual tensor-core tile; 64 x 64 halves the
    check's relative cost per tile only at the price of more tiles), 64 x 64 when either side is
    small or under the interpreter (its cost grows with the number of tiles more than with their
    size). A checked tile holds a few checksum rows and columns besides its data
    (``triton_gemm.Layout``)."""
    if interpreting():
        return 64, 64
    if m < 128 or n < 128:
        return 64, 64
    return 128, 128


TILE_MIN = 16             # a checked tile keeps at least 8 data rows and columns beside its checksums


def tiles_error(bm, bn):
    """Why (BM, BN) cannot be the fused kernel's tile (powers of two of at least TILE_MIN), or
    None. The layout may ask for more data rows (``triton_gemm.Layout``)."""
    if bm & (bm - 1) or bn & (bn - 1) or min(bm, bn) < TILE_MIN:
        return f"the triton backend's tiles are powers of two of at least {TILE_MIN}, got {(bm, bn)}"
    return None


def configs(bm, bn, dtype, interpret=None):
    """Autotune candidates for one tile. BK 32 or 64 (64 for 2-byte types, whose tiles are half
    the bytes); 4 or 8 warps; 3 or 4 stages (Hopper-class shared memory holds 4 stages of
    128 x 64 bf16 tiles for both operands)."""
    if interpreting() if interpret is None else interpret:
        return [triton.Config({"BLOCK_K": 32}, num_warps=4, num_stages=1)]
    two_byte = getattr(dtype, "itemsize", 4) == 2
    bks = (32, 64) if two_byte else (32,)
    return [triton.Config({"BLOCK_K": bk}, num_warps=w, num_stages=s)
            for bk in bks for w in (4, 8) for s in (3, 4)]
