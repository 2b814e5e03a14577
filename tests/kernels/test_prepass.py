"""The fused kernel's pre-pass against the reference's statistics (``stats.operand_stats``), and its
checksum parts against the sums they split."""
import pytest
import torch

pytest.importorskip("triton")

from abft.kernels import configs, stats as S

if not configs.interpreting():
    pytest.skip("needs TRITON_INTERPRET=1", allow_module_level=True)

from abft.kernels import prepass as P   # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _operand(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(70, 300, generator=g) * torch.logspace(-3, 3, 300)
    x[5] = 0                                  # a zero row
    x[9, :100] *= 1e-6                        # a row whose largest value comes late
    x[12] = x[13]                             # a repeated row
    x[40, 200:] = 4.0                         # a low-entropy row
    return x.to(dtype)


@pytest.mark.parametrize("k_major", [True, False], ids=["k_major", "rows_contiguous"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_statistics_match_the_reference_and_the_parts_split_the_checksum(dtype, k_major):
    x = _operand(dtype)
    if not k_major:
        x = x.t().contiguous().t()               # the rows contiguous: A along M, B along N
    nparts = P.parts_for(dtype, False)
    pad = 8 if not k_major else nparts
    pre = P.prepare(x, 29, nparts, pad, k_major)
    st = S.operand_stats(x.unsqueeze(0), 29)
    rows, blocks = pre.rows[0].double(), pre.blocks[0].double()
    assert torch.equal(rows[:, P.ROW_E], st.e[0])
    assert torch.allclose(rows[:, P.ROW_R1], st.r1[0], rtol=2e-5, atol=0)
    assert torch.allclose(rows[:, P.ROW_RINF], st.rinf[0], rtol=2e-5, atol=0)
    assert torch.equal(rows[:, P.ROW_LOW] > 0, st.low[0])
    assert torch.equal(blocks[:, P.BLK_E], st.E[0])
    for f, ref in ((P.BLK_X1, st.x1), (P.BLK_XINF, st.xinf), (P.BLK_XS1, st.xs1),
                   (P.BLK_XSINF, st.xsinf), (P.BLK_NU, st.nu)):
        assert torch.allclose(blocks[:, f], ref[0], rtol=2e-5, atol=0), f
    assert torch.equal(blocks[:, P.BLK_LOW] > 0, st.block_low()[0])
    assert torch.equal(blocks[:, P.BLK_FINITE] > 0, st.block_finite()[0])
    assert blocks[:, P.BLK_NU].max() == 2                    # rows 12 and 13
    # the parts: pad rows per block, the first nparts summing to the block's checksum (in fp32's
    # round-off of a sum of 29 values), the rest zero
    parts = pre.parts[0].double().view(3, pad, 300)
    assert pre.parts.stride(2 if k_major else 1) == 1
    assert (parts[:, nparts:] == 0).all()
    scale = torch.exp2(blocks[:, P.BLK_E])[:, None]
    got = parts[:, :nparts].sum(1) * scale * 2.0 ** -P.chk_shift(dtype, 29)
    x64 = x.double()
    want = torch.stack([x64[i * 29:(i + 1) * 29].sum(0) for i in range(3)])
    bound = 29 * 2.0 ** -24 * torch.stack([x64[i * 29:(i + 1) * 29].abs().sum(0) for i in range(3)])
    log2, absolute = P.split_error(dtype, False, P.chk_shift(dtype, 29))   # the last part's grid
    assert not absolute
    bound = bound + 2.0 ** log2 * scale
    assert ((got - want).abs() <= bound).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nonfinite_rows_leave_the_block_not_finite(dtype):
    x = _operand(dtype)
    x[33, 7] = float("nan")
    x[64, 250] = float("inf")
    pre = P.prepare(x, 29, P.parts_for(dtype, False))
    st = S.operand_stats(x.unsqueeze(0), 29)
    assert (pre.blocks[0, :, P.BLK_FINITE] > 0).tolist() == [True, False, False]
    assert torch.equal(pre.blocks[0, :, P.BLK_FINITE] > 0, st.block_finite()[0])
    assert torch.equal(pre.rows[0, :, P.ROW_E].double(), st.e[0])
