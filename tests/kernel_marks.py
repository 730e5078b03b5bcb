"""The mark of a test that needs the CPU kernels (stages/executor/kernels.py). Where they are
not built (no compiler, a failed build, LLM_PIPELINE_CPU_KERNELS=0) the product refuses what
needs them by name and runs the rest on PyTorch's ops: such a test skips there, saying why
(tests/conftest.py builds the kernels before any test, and heads the report with the
outcome)."""

from __future__ import annotations

import pytest

from stages.executor import kernels
from stages.executor.linear.quantized import kernel_missing as quantized_kernel_missing

needs_kernels = pytest.mark.skipif(not kernels.available(), reason=f"CPU kernels: {kernels.load()}")
# Their quantized products (int8, int4 and GGUF's blocks) take AVX-512 with VNNI besides.
needs_quantized_kernels = pytest.mark.skipif(quantized_kernel_missing() is not None,
                                             reason=f"quantized kernels: "
                                                    f"{quantized_kernel_missing()}")
