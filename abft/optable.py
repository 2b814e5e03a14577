"""The table of checked ops: one row each, registered by the module that defines the op.

A row says what ``abft.checked()`` intercepts (torch's functions, bound by torch's signature),
which of their tensor arguments abft checks, the checked function it calls instead, and the
custom op behind that function with its autograd rule and its DTensor sharding rule.
``register`` wires a row in: the autograd rule onto the custom op (``abft.autograd.rule``), the
sharding rule into DTensor (``abft.integrations.dtensor.rule``), the functions into
``checked()``. The built-in rows are at the end of this module (their ops and rules are ``abft.autograd``'s); a new op is one module
that defines it and registers its row (``abft/grouped.py``).
"""
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from abft import autograd
from abft.integrations import dtensor

OPS = {}             # name -> CheckedOp
INTERCEPTS = {}      # torch function -> the CheckedOp that checks it


@dataclass(frozen=True)
class CheckedOp:
    """One checked op."""
    name: str                          # its name in coverage (``abft.coverage()``) and alarms
    signature: str = ""                # torch's signature of ``intercepts``: "(input, mat2, *, out=None)"
    operands: tuple = ()               # their tensor arguments abft checks, by torch's names
    call: Optional[Callable] = None    # call(module, **those arguments) -> the checked result
    intercepts: tuple = ()             # torch functions ``checked()`` routes to ``call``
    optional: tuple = ()               # tensor arguments checked where given (a bias)
    custom_op: object = None           # the torch.library CustomOpDef ``call`` runs, if any
    backward: Optional[Callable] = None   # its autograd rule: backward(ctx, *grads)
    setup: Optional[Callable] = None      # and setup_context(ctx, inputs, output)
    sharding: Optional[Callable] = None   # DTensor: (arg specs...) -> [(out placements, in placements)]

    def __post_init__(self):
        if self.intercepts and (self.call is None or not self.signature):
            raise ValueError(f"abft: checked op {self.name!r}: intercepts need call and signature")
        if (self.backward is None) != (self.setup is None):
            raise ValueError(f"abft: checked op {self.name!r}: backward and setup go together")
        if (self.backward is not None or self.sharding is not None) and self.custom_op is None:
            raise ValueError(f"abft: checked op {self.name!r}: backward and sharding need custom_op")


def register(op):
    """Add ``op`` to the table and wire it in; returns it. A name or a torch function taken
    already is refused (ValueError), with nothing wired."""
    if op.name in OPS:
        raise ValueError(f"abft: a checked op named {op.name!r} is registered already")
    taken = [f for f in op.intercepts if f in INTERCEPTS]
    if taken:
        raise ValueError(f"abft: checked op {op.name!r}: {taken[0]} is intercepted by "
                         f"{INTERCEPTS[taken[0]].name!r} already")
    if op.backward is not None:
        autograd.rule(op.custom_op, op.backward, op.setup)
    if op.sharding is not None:
        dtensor.rule(op.custom_op, op.sharding)
    OPS[op.name] = op
    INTERCEPTS.update(dict.fromkeys(op.intercepts, op))
    return op


# -- the built-in rows ----------------------------------------------------------------------------

A, product_rule = autograd, dtensor.product_sharding

register(CheckedOp("grad_product", custom_op=A.grad_product, backward=A._gp_backward,
                   setup=A._gp_setup, sharding=product_rule(4)))      # every backward product
register(CheckedOp("grad_input_kept", custom_op=A.grad_input_kept, backward=A._gik_backward,
                   setup=A._gik_setup))             # never a DTensor's (``A._linear_backward``)
register(CheckedOp(
    "matmul", "(input, other, *, out=None)", ("input", "other"),
    lambda module, input, other: A.matmul(input, other, module=module),
    intercepts=(torch.matmul, torch.linalg.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__),
    custom_op=A.matmul_op, backward=A._matmul_backward, setup=A._matmul_setup,
    sharding=product_rule(3)))
register(CheckedOp(
    "rmatmul", "(input, other)", ("input", "other"),
    lambda module, input, other: A.matmul(other, input, module=module),
    intercepts=(torch.Tensor.__rmatmul__,)))
register(CheckedOp(
    "mm", "(input, mat2, *, out=None)", ("input", "mat2"),
    lambda module, input, mat2: A.mm(input, mat2, module=module),
    intercepts=(torch.mm, torch.Tensor.mm),
    custom_op=A.mm_op, backward=A._mm_backward, setup=A._ab_setup, sharding=product_rule(1)))
register(CheckedOp(
    "bmm", "(input, mat2, *, out=None)", ("input", "mat2"),
    lambda module, input, mat2: A.bmm(input, mat2, module=module),
    intercepts=(torch.bmm, torch.Tensor.bmm),
    custom_op=A.bmm_op, backward=A._bmm_backward, setup=A._ab_setup, sharding=product_rule(1)))
register(CheckedOp(
    "addmm", "(input, mat1, mat2, *, beta=1, alpha=1, out=None)", ("input", "mat1", "mat2"),
    lambda module, input, mat1, mat2, beta=1, alpha=1: A.addmm(input, mat1, mat2, beta=beta,
                                                               alpha=alpha, module=module),
    intercepts=(torch.addmm, torch.Tensor.addmm),
    custom_op=A.addmm_op, backward=A._addmm_backward, setup=A._add_setup,
    sharding=dtensor.addmm_sharding))
register(CheckedOp(
    "baddbmm", "(input, batch1, batch2, *, beta=1, alpha=1, out=None)", ("input", "batch1", "batch2"),
    lambda module, input, batch1, batch2, beta=1, alpha=1: A.baddbmm(input, batch1, batch2, beta=beta,
                                                                     alpha=alpha, module=module),
    intercepts=(torch.baddbmm, torch.Tensor.baddbmm),
    custom_op=A.baddbmm_op, backward=A._baddbmm_backward, setup=A._add_setup,
    sharding=dtensor.addmm_sharding))
register(CheckedOp(
    "linear", "(input, weight, bias=None, *, out=None)", ("input", "weight"),
    lambda module, input, weight, bias=None: A.linear(input, weight, bias, module=module),
    intercepts=(torch.nn.functional.linear,), optional=("bias",),
    custom_op=A.linear_op, backward=A._linear_backward, setup=A._linear_setup,
    sharding=dtensor.linear_sharding))
