"""The arithmetic of checked GEMMs (installed as ``abft.kernels``): the backends and what they
share. ``backends`` names them and routes a call; ``reference`` checks a product torch computed;
``triton_gemm`` (with ``prepass`` and ``configs``) computes and checks it in one fused kernel;
``threshold`` and ``stats`` are the round-off model both use; ``layout`` is the verdict format.

No policy and no logging here, and nothing imported from above: a backend returns the product
and a verdict tensor, and ``abft.policy`` decides what to do with it.
"""
if __name__ != "abft.kernels":        # found as top-level "kernels" from the repository's root (_shadow)
    from ._shadow import hand_over
    hand_over(__name__, __file__)
