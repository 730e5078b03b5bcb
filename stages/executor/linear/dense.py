"""Plain weights, PyTorch's F.linear: CUDA, the compiled forward, a CPU oneDNN cannot pack
the dtype for. Executor process."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stages.executor.linear.base import Linear, LinearMethod


class DenseMethod(LinearMethod):
    name = "dense"

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)
