"""A linear layer whose weight format is a method of its own (as vLLM's quantize methods):
the layer holds the parameters as the checkpoint names them ([out, in] weight, bias), the
method turns them into its format once they are loaded (`process`) and runs the product
(`apply`). Executor process."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
from torch import nn


class LinearMethod(ABC):
    """One weight format. `unsupported` says why it cannot run here (None: it can)."""

    name: str
    # The layers' weights come already in this format from the checkpoint (a GGUF file's
    # blocks, set by the loader): the model allocates no float weight for them.
    takes_blocks = False

    @classmethod
    def unsupported(cls, dtype: torch.dtype, device: torch.device) -> str | None:
        return None

    def process(self, layer: Linear) -> None:
        """Called once the layer's weights are loaded and on their device: convert them
        (plain weights stay as loaded)."""
        return None

    def for_head(self) -> LinearMethod:
        """The method of the logits product (the head): this one, unless a format keeps the
        head at more bits."""
        return self

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out]."""

    def apply_gated(self, layer: Linear, x: torch.Tensor,
                    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """An MLP's gate/up layer (`layer.gated`): silu(gate) * up of x [T, in] -> [T, out / 2];
        where the format interleaved the layer's gate and up rows (`layer.fused_gate`: amx.py,
        quantized.py), its product computes it in its own pass (fused_product)."""
        if layer.fused_gate:
            return self.fused_product(layer, x, True)
        return silu_and_mul(self.apply(layer, x))

    def apply_interleaved(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """A fused gate/up layer's product without its activation: [T, out], its gate and
        up columns interleaved 16 at a time (amx.interleave_gate_up), for a caller that adds
        to them before the activation (LoRA: stages/executor/lora.py)."""
        return self.fused_product(layer, x, False)

    def fused_product(self, layer: Linear, x: torch.Tensor, gated: bool) -> torch.Tensor:
        """The product of a layer whose gate and up rows this format interleaved; gated:
        silu(gate) * up of it."""
        raise NotImplementedError(f"{self.name} interleaves no gate and up rows")


def over_rows(x: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """product(x as contiguous [T, in]) with x's leading dimensions put back: for the
    kernels that take a 2-D input."""
    shape = x.shape
    y = product(x.reshape(-1, shape[-1]).contiguous())
    return y.view(*shape[:-1], y.shape[-1])


class Linear(nn.Module):
    """y = x W^T + b through `method`. Parameters as nn.Linear's (so checkpoints load by
    name); built on the meta device, filled by load_state_dict(assign=True)."""

    # (set by a format's process where it has them: its codes' bits, its quantized products'
    # form)
    bits: int
    products: str

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 method: LinearMethod) -> None:
        super().__init__()
        self.in_features, self.out_features, self.method = in_features, out_features, method
        self.gated = False  # an MLP's gate/up product: its output goes through silu_and_mul
        self.routed_expert = False  # one of a mixture's experts (moe_block.py)
        # whether the format interleaved its gate and up rows, its product writing silu(gate) * up
        # itself (amx.py, quantized.py set it as they process the weights)
        self.fused_gate = False
        if not method.takes_blocks:
            self.weight = nn.Parameter(torch.empty(out_features, in_features),
                                       requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features), requires_grad=False) if bias
                     else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def gated_forward(self, x: torch.Tensor,
                      silu_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """silu(gate) * up of a gate/up layer (gate outputs first, then up)."""
        return self.method.apply_gated(self, x, silu_and_mul)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"method={self.method.name}")


def process_weights(model: nn.Module) -> int:
    """Each Linear's method converts its loaded weights, then each module with a
    `weights_processed()` gathers what it needs of them (moe_block.py stacks its experts' for
    one kernel); returns how many Linear layers."""
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    for layer in layers:
        layer.method.process(layer)
    for module in model.modules():
        gather = getattr(module, "weights_processed", None)
        if gather is not None:
            gather()
    return len(layers)
