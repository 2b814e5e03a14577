"""The row check's per-bit table of BENCHMARKS.md against the tile kernel's (the code lives in
``abft.bench.rowflips``; on a GPU ``abft bench --validate`` runs it too).

    TRITON_INTERPRET=1 python benchmarks/rowflips.py --n 4096 --k 4096 --seeds 2
"""
from abft.bench.rowflips import main, run  # noqa: F401

if __name__ == "__main__":
    main()
