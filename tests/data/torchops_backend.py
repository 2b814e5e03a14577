"""A third backend, for tests/kernels/test_backends.py: the reference's torch-op check (its oracle) as a
checking backend of its own, in tiles of its own. This file and one ``backends.register`` call
are all it takes."""
from abft.kernels import reference


def check_product(a, b, c, *, bm, bn, alpha, addend, beta, lam, b_stats):
    verdict, detail = reference.check_torch(a, b, c, bm=bm, bn=bn, units=reference.units_for(c), alpha=alpha,
                                            addend=addend, beta=beta, lam=lam,
                                            b_stats=None if b_stats is None else b_stats(bn))
    return verdict, detail, None
