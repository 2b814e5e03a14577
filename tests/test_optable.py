"""The table of checked ops (``abft.optable``): every op ``checked()`` intercepts is a row of
it, and a row that would take a name or a torch function taken already is refused whole."""
import pytest
import torch

import abft
from abft import optable
from abft.optable import CheckedOp


def test_every_intercepted_function_is_one_rows_and_each_row_names_its_custom_op():
    assert {"matmul", "rmatmul", "mm", "bmm", "addmm", "baddbmm", "linear", "grouped_mm",
            "grad_product", "grad_input_kept"} <= set(optable.OPS)
    for f, op in optable.INTERCEPTS.items():
        assert f in op.intercepts and optable.OPS[op.name] is op
    for op in optable.OPS.values():
        if op.custom_op is not None:
            assert hasattr(torch.ops.abft, op.custom_op._name.split("::")[-1])
    assert optable.INTERCEPTS[torch.Tensor.__matmul__].name == "matmul"
    assert optable.INTERCEPTS[torch._grouped_mm].name == "grouped_mm"


def test_a_taken_name_or_function_is_refused_and_nothing_is_wired():
    before = (dict(optable.OPS), dict(optable.INTERCEPTS))
    call = lambda module, input, mat2: None     # noqa: E731
    with pytest.raises(ValueError, match="'mm' is registered already"):
        optable.register(CheckedOp("mm", "(input, mat2)", ("input", "mat2"), call))
    with pytest.raises(ValueError, match="intercepted by 'mm' already"):
        optable.register(CheckedOp("my_mm", "(input, mat2)", ("input", "mat2"), call,
                                   intercepts=(torch.outer, torch.mm)))
    assert (optable.OPS, optable.INTERCEPTS) == before


@pytest.mark.parametrize("fields, what", [
    (dict(intercepts=(torch.outer,)), "intercepts need call and signature"),
    (dict(backward=lambda ctx, g: g), "backward and setup go together"),
    (dict(sharding=lambda *a: []), "backward and sharding need custom_op")])
def test_a_row_missing_what_its_fields_need_is_refused(fields, what):
    with pytest.raises(ValueError, match=what):
        CheckedOp("outer", **fields)


def test_a_registered_row_is_what_checked_runs():
    """A row registered after ``checked()``'s module was imported is intercepted: here torch.outer
    checked as a (M, 1) @ (1, N) product through abft.mm."""
    op = CheckedOp("outer", "(input, vec2, *, out=None)", ("input", "vec2"),
                   lambda module, input, vec2: abft.mm(input[:, None], vec2[None], module=module),
                   intercepts=(torch.outer,))
    optable.register(op)
    try:
        with abft.checked():
            y = torch.outer(torch.arange(3.0), torch.arange(4.0))
    finally:
        del optable.OPS["outer"], optable.INTERCEPTS[torch.outer]
    assert torch.equal(y, torch.outer(torch.arange(3.0), torch.arange(4.0)))
    assert {r["op"]: r["checked"] for r in abft.coverage()} == {"mm": 1}
