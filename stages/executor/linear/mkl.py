"""float32 weights packed for MKL's sgemm (csrc/mkl_linear.cpp), in the executor process: the
float32 forward's products on the CPU kernels, in place of oneDNN's packed ones.

oneDNN's packed float32 product runs a decode step's shapes at ~170 GFLOP/s on the 2-core test
machine, compute-bound; MKL's packed sgemm (inside torch's x86 wheels) runs the same products
20% faster at 1 and 64 tokens and on par from 128 up (every projection of the default model,
30 layers and the head: 100 against 125 ms at 64 tokens; docs/BENCHMARKS.md, "float32
products on MKL"). Packed once for 64 rows, the weight serves any number of rows with each
row's result independent of the others in the call (the kernel's header says how), which
batching and speculative decoding rely on. A row alone runs as two unless MKL's one-row
path, 8-15% faster, is checked at load to give the same bits for the layer
(`one_row_threads`). Where MKL does not keep rows independent at all (measured on an AMD EPYC
with AVX-512: calls of fewer than 16 rows take a path that rounds otherwise), it is not used
(`rows_independent`), and the float32 products are oneDNN's.
"""

from __future__ import annotations

import functools
import logging

import torch

from stages.executor import kernels
from stages.executor.linear.base import Linear, LinearMethod, over_rows
from stages.executor.linear.onednn import OneDnnPackedMethod

logger = logging.getLogger(__name__)

# (N, K) of the probes: outputs small and large, inner sizes short and long
_PROBE_SHAPES = ((37, 19), (100, 64), (960, 576))
_PROBE_ROWS = (1, 2, 3, 7, 15, 16, 17, 65)  # prefixes of a 129-row call


def kernel_missing() -> str | None:
    """Why mkl_linear cannot run here (None: it can)."""
    return kernels.op_missing("mkl_linear_available",
                              "this torch has no MKL (cblas_sgemm_pack)")


@functools.cache
def rows_independent() -> str | None:
    """Why MKL's packed sgemm does not serve this CPU's float32 products (None: it does): a
    row's bits must not depend on how many rows share its call, nor on the thread count (at
    one thread and at this process's), which batching and speculative decoding rest on.
    Probed once a process: for each of _PROBE_SHAPES, every prefix in _PROBE_ROWS of a call
    of 129 rows against that call."""
    threads = torch.get_num_threads()
    for n, k in _PROBE_SHAPES:
        g = torch.Generator().manual_seed(n * k)
        packed = torch.ops.llm_cpu.mkl_pack(torch.randn(n, k, generator=g))
        bias = torch.randn(n, generator=g)
        x = torch.randn(129, k, generator=g)
        whole = torch.ops.llm_cpu.mkl_linear(x, packed, bias, n)
        for count in {1, threads}:
            torch.set_num_threads(count)
            try:
                differ = [rows for rows in (*_PROBE_ROWS, 129) if not torch.equal(
                    torch.ops.llm_cpu.mkl_linear(x[:rows], packed, bias, n), whole[:rows])]
            finally:
                torch.set_num_threads(threads)
            if differ:
                why = (f"MKL's packed sgemm rounds a row otherwise in calls of {differ} rows "
                       f"at {count} thread(s) ({n} x {k}) on this CPU")
                logger.info("float32 products on oneDNN, not MKL: %s", why)
                return why
    return None


class MklPackedMethod(LinearMethod):
    name = "mkl-packed"

    @classmethod
    def unsupported(cls, dtype: torch.dtype, device: torch.device) -> str | None:
        if device.type != "cpu":
            return f"MKL's sgemm runs on the CPU, not {device.type}"
        if dtype != torch.float32:
            return f"MKL's packed sgemm multiplies float32, not {dtype}"
        return kernel_missing() or rows_independent()

    def process(self, layer: Linear) -> None:
        """The packed copy replaces the plain weight (a tied head's plain matrix stays the
        embedding's). A layer of one output (MKL sums it by another path whose rows depend on
        each other) takes oneDNN's packed weights."""
        if layer.out_features < 2:
            OneDnnPackedMethod.take(layer)
            return
        packed = torch.ops.llm_cpu.mkl_pack(layer.weight.detach())
        del layer.weight
        # (not in the state dict: MKL's packed bytes stay where they were packed, and the
        # kernel refuses a copy)
        layer.register_buffer("mkl_weight", packed, persistent=False)
        layer.mkl_one_row = one_row_threads(packed, layer.bias, layer.in_features,
                                            layer.out_features)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return over_rows(x, lambda rows: torch.ops.llm_cpu.mkl_linear(
            rows, layer.mkl_weight, layer.bias, layer.out_features, layer.mkl_one_row))


def one_row_threads(packed: torch.Tensor, bias: torch.Tensor | None, k: int, n: int,
                    probes: int = 4) -> int:
    """The thread count (this one) at which MKL's one-row path gives a row the bits it has
    among others, for this weight and bias, or 0 where it does not (here it does for the
    default model's projections, not for outputs of <= 128 columns nor with a bias):
    `probes` random rows, each alone against all together. A different order of sums shows
    in nearly every one of the N outputs, so a chance agreement is out of reach. The kernel
    takes that path only at the thread count found."""
    threads = torch.get_num_threads()
    x = torch.randn(probes, k, generator=torch.Generator().manual_seed(0))
    together = torch.ops.llm_cpu.mkl_linear(x, packed, bias, n)
    agrees = all(torch.equal(torch.ops.llm_cpu.mkl_linear(x[i:i + 1], packed, bias, n,
                                                          threads)[0], together[i])
                 for i in range(probes))
    return threads if agrees else 0
