"""The batch-1 roofline of `scripts/bench throughput` (pipeline/tools/roofline.py): the bytes
a token's forward reads, as loaded, for a dense model and a mixture of experts (each layer's
routed experts only), against the checkpoint's own count; the read bandwidth a positive
measurement."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors import safe_open

from pipeline.tools.roofline import bytes_per_token, read_bandwidth
from stages.executor.linear.amx import kernel_missing as amx_kernel_missing
from stages.executor.linear.amx import vector_kernel_missing
from stages.inprocess import InProcessEngine


def _expected(folder: Path, hidden: int, active: float, width: int = 4) -> float:
    """Bytes of the checkpoint's tensors as read per token: one embedding row, `active` of
    each expert tensor, every other tensor whole."""
    total = 0.0
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
            size = 1
            for d in f.get_slice(name).get_shape():
                size *= d
            share = (active if ".experts." in name else
                     hidden / size if "embed_tokens" in name else 1.0)
            total += size * share * width
    return total


@pytest.mark.parametrize("moe", [False, True])
def test_bytes_per_token_count_what_a_token_reads(tmp_path: Path, moe: bool) -> None:
    from pipeline.tools.random_model import build_random_model

    fields = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 128}
    if moe:
        fields.update(moe_intermediate_size=32, num_experts=5, num_experts_per_tok=2,
                      head_dim=16)
    folder = build_random_model(tmp_path / "m", "qwen3_moe" if moe else "llama", **fields)
    model = InProcessEngine(str(folder)).runner.model
    want = _expected(folder, 64, 2 / 5 if moe else 1.0)
    assert bytes_per_token(model) == pytest.approx(want, rel=1e-6)


@pytest.mark.skipif(vector_kernel_missing() is not None, reason=f"{vector_kernel_missing()}")
@pytest.mark.skipif(amx_kernel_missing() is None, reason="bf16 products run on AMX here, "
                    "where the experts keep their own tiles (MoEBlock._stackable)")
def test_stacked_experts_count_as_the_routed_ones(tmp_path: Path) -> None:
    """bf16 experts stacked for moe_experts (each expert a view of one [E, ...] tensor) count
    top_k / E of the stack, as when each held its own (the packed panels pad a layer's outputs
    to 32, which the vocabulary of 100 shows as a few percent)."""
    import torch

    from pipeline.tools.random_model import build_random_model

    folder = build_random_model(tmp_path / "m", "qwen3_moe", hidden_size=64,
                                intermediate_size=96, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                max_position_embeddings=128, moe_intermediate_size=32,
                                num_experts=5, num_experts_per_tok=2)
    model = InProcessEngine(str(folder), dtype=torch.bfloat16).runner.model
    assert model.model.layers[0].mlp.stacked is not None
    want = _expected(folder, 64, 2 / 5, width=2)
    assert bytes_per_token(model) == pytest.approx(want, rel=0.05)


def test_read_bandwidth_is_measured() -> None:
    assert 0.1 < read_bandwidth() < 10_000  # GB/s
