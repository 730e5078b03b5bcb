"""gpt-oss's MXFP4 expert blocks as the engine's 5-bit blocks (linear/mxfp4.py): the same
values as transformers' own dequantization, exactly; scales past float16's range are
refused."""

from __future__ import annotations

import pytest
import torch

from stages.executor.linear.mxfp4 import mxfp4_blocks, mxfp4_values


def _random(experts: int, rows: int, groups: int, lo: int, hi: int,
            seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), generator=gen,
                           dtype=torch.uint8)
    scales = torch.randint(lo, hi, (experts, rows, groups), generator=gen, dtype=torch.uint8)
    return blocks, scales


def test_values_are_transformers_dequantization() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random(3, 6, 2, 100, 140)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    got = torch.stack([mxfp4_values(b, s) for b, s in zip(blocks, scales, strict=True)])
    assert torch.equal(got, want.transpose(1, 2))


@pytest.mark.parametrize("groups", [1, 2, 3])  # (odd: padded to a pair of blocks)
def test_blocks_hold_the_values_exactly_as_five_bit_codes(groups: int) -> None:
    blocks, scales = _random(1, 8, groups, 104, 140, seed=groups)
    q = mxfp4_blocks(blocks[0], scales[0])
    assert q.bits == 5 and q.in_features == 32 * groups
    assert torch.equal(q.dequantize(), mxfp4_values(blocks[0], scales[0]))


def test_scales_past_float16_are_refused_by_range() -> None:
    blocks, scales = _random(1, 4, 2, 150, 160)  # 2^23 and more: past float16's range
    with pytest.raises(ValueError, match="MXFP4 scales from 2"):
        mxfp4_blocks(blocks[0], scales[0])


def test_malformed_blocks_are_refused() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        mxfp4_blocks(torch.zeros(2, 3, 8, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8))
