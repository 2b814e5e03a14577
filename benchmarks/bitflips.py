"""The per-bit table of BENCHMARKS.md (the code lives in ``abft.bench.bitflips``; on a GPU
``abft bench --validate`` runs it too).

    TRITON_INTERPRET=1 python benchmarks/bitflips.py --k 4096 --trials 12
"""
from abft.bench.bitflips import main, run  # noqa: F401

if __name__ == "__main__":
    main()
