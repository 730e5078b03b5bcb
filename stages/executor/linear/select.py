"""Which linear method (weight format) a model's projections get: the one place that decides,
before the model is built."""

from __future__ import annotations

import torch

from ipc.gguf_source import GgufSource
from stages.executor.linear.amx import AmxMethod, VectorBf16Method
from stages.executor.linear.base import LinearMethod
from stages.executor.linear.dense import DenseMethod
from stages.executor.linear.mkl import MklPackedMethod
from stages.executor.linear.onednn import OneDnnPackedMethod
from stages.executor.linear.quantized import METHODS, GgufMethod, products_for


def select_linear_method(dtype: torch.dtype, device: torch.device, compiled: bool,
                         pack: bool | None = None, quantization: str | None = None,
                         gguf: GgufSource | None = None, kernels: bool = False,
                         rows: int = 1) -> LinearMethod:
    """A quantized GGUF file (`gguf`): its own blocks. `quantization` (int8, int4): that
    quantized format. Either raises ValueError saying why it cannot run here; either takes
    its products' form from the rows a decode step may hold (`rows`: quantized.products_for).
    Otherwise, for the eager CPU forward, packed weights (`pack`: None as that, False plain,
    True required): where the forward runs on the CPU kernels (`kernels`), bf16 on AMX tiles
    where the CPU has AMX-BF16, else on AVX512-BF16 in the same layout, and float32 for MKL's
    sgemm where torch has MKL; else oneDNN's packed layout where oneDNN can pack the dtype;
    plain F.linear otherwise.
    (TorchInductor lowers packed weights only as frozen constants, which one graph shared
    by every layer cannot have.)"""
    if gguf is not None and gguf.quantized:
        subject = gguf.describe()
        why = (f"the file is quantized already; leave out --quantization {quantization}"
               if quantization is not None else None)
        why = why or _why_not_quantized(GgufMethod, dtype, device, compiled)
        if why is not None:
            raise ValueError(f"{subject}: {why}")
        return GgufMethod(products_for(dtype, rows))
    if quantization is not None:
        return _quantized(quantization, dtype, device, compiled, rows)
    if pack is False:
        return DenseMethod()
    if kernels and not compiled:
        for method in (AmxMethod, VectorBf16Method, MklPackedMethod):
            if method.unsupported(dtype, device) is None:
                return method()
    why = OneDnnPackedMethod.unsupported(dtype, device)
    if why is None and compiled:
        why = "the compiled forward needs plain weights"
    if why is None:
        return OneDnnPackedMethod()
    if pack:
        raise ValueError(f"packed weights: {why}")
    return DenseMethod()


def _quantized(name: str, dtype: torch.dtype, device: torch.device, compiled: bool,
               rows: int) -> LinearMethod:
    method = METHODS.get(name)
    if method is None:
        raise ValueError(f"--quantization {name!r}: the formats are {', '.join(METHODS)}")
    why = _why_not_quantized(method, dtype, device, compiled)
    if why is not None:
        raise ValueError(f"--quantization {name}: {why}")
    return method(products_for(dtype, rows))


def _why_not_quantized(method: type[LinearMethod], dtype: torch.dtype, device: torch.device,
                       compiled: bool) -> str | None:
    if compiled:
        return "quantized weights run in the eager forward; leave out --compile"
    return method.unsupported(dtype, device)
