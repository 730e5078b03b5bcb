"""Which forward the executor runs, and why: the one place that decides. Used by the launcher's
pre-flight check (`probe=False`: no torch imported, nothing built) and by the executor
(`probe=True`: the CPU kernels are built or loaded here, and a failure says why).

The forwards, in order of preference:
- `flex`: compiled (TorchInductor) layers around FlexAttention, steps padded to buckets;
  the default on CUDA, on request on the CPU (it measured slower there than the kernels);
- `cpu_kernels`: the eager CPU forward on the C++ kernels; the CPU's default;
- `torch`: eager PyTorch ops: CUDA without compile, a CPU without the kernels.
"""

from __future__ import annotations

import importlib
import logging
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ipc.arch import UnsupportedModel
from ipc.errors import ConfigError

if TYPE_CHECKING:
    from stages.executor.backends.base import AttentionBackend

logger = logging.getLogger(__name__)

BACKENDS = {
    "flex": "stages.executor.backends.flex:FlexBackend",
    "cpu_kernels": "stages.executor.backends.cpu_kernels:CpuKernelBackend",
    "torch": "stages.executor.backends.torch_sdpa:TorchBackend",
}
# Compiled by default where it pays (docs/BENCHMARKS.md, "Compiled forward"): on CUDA a
# compiled, graph-ready forward is what keeps the GPU from waiting on kernel launches.
DEFAULT_COMPILE = {"cuda": True, "cpu": False}
# The forwards that read an 8-bit KV cache (--kv-cache-dtype int8 or fp8: stages/executor/
# kv_pool.py); the others keep the model's dtype.
KV_8BIT_BACKENDS = ("cpu_kernels",)
# Triton's smallest tile: the compiled attention's blocks are pages, so on CUDA a page must
# hold a whole number of tiles.
CUDA_PAGE_MULTIPLE = 16


@dataclass(frozen=True)
class ForwardRequest:
    """What was asked (None: the default) and what the model and the run need."""

    device: str  # "cpu" or "cuda"
    compile: bool | None = None
    cpu_kernels: bool | None = None
    block_size: int = 16
    tensor_parallel_size: int = 1
    mixture_of_experts: bool = False  # the model's MLPs are (ArchSpec.moe)
    kv_cache_dtype: str = "auto"  # the KV cache's format (ipc.config.KV_CACHE_DTYPES)


@dataclass(frozen=True)
class Selection:
    backend: str  # a key of BACKENDS
    reason: str  # why this one, for the executor's log

    @property
    def compiled(self) -> bool:
        return self.backend == "flex"

    def load(self) -> type[AttentionBackend]:
        module, name = BACKENDS[self.backend].split(":")
        return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def compile_unavailable(device: str) -> str | None:
    """Why this machine cannot compile for `device` (None: it can). Inductor's CPU code is C++
    built at run time, so it needs a C++ compiler on the PATH."""
    if device == "cpu" and not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
        return "no C++ compiler (g++, c++ or clang++) on the PATH, which TorchInductor needs"
    return None


def _why_not_compiled(req: ForwardRequest) -> tuple[str, type[ConfigError]] | None:
    """Why the compiled forward cannot serve `req`, and the error that says so when asked
    (UnsupportedModel: the model's). Sliding windows are no reason: the compiled attention
    has a block mask per window."""
    if req.tensor_parallel_size > 1 and req.device == "cuda":
        # (On the CPU the ranks' all-reduce over gloo is traced into the compiled layers and
        # tested; over NCCL, with CUDA graphs, it has not run on a GPU yet.)
        return ("the compiled forward with tensor parallelism is tested on the CPU only so "
                "far"), ConfigError
    if req.mixture_of_experts:
        # (which experts run is read on the host each step: one graph cannot hold it)
        return ("the model's mixture of experts runs in the eager forward only",
                UnsupportedModel)
    if req.device == "cuda" and req.block_size % CUDA_PAGE_MULTIPLE:
        return (f"on CUDA the compiled attention needs --block-size a multiple of "
                f"{CUDA_PAGE_MULTIPLE} (Triton's smallest tile), not {req.block_size}",
                ConfigError)
    return None


def resolve_compile(req: ForwardRequest) -> tuple[bool, str]:
    """--compile / --no-compile, or the device's default (None), and why: compiled where
    this machine can compile and, on CUDA, the page size is a multiple of Triton's tile;
    asked for where it cannot be, a ConfigError."""
    refusal = _why_not_compiled(req)
    if refusal is not None:
        why_not, error = refusal
        if req.compile:
            raise error(f"--compile: {why_not}; pass --no-compile")
        if req.compile is None and DEFAULT_COMPILE[req.device]:
            return False, f"eager: {why_not}"
        return False, "eager (--no-compile)" if req.compile is False else "eager"
    no_compiler = compile_unavailable(req.device)
    if req.compile and no_compiler:
        raise ConfigError(f"--compile: {no_compiler}; install one, or pass --no-compile")
    if req.compile is None:
        if not DEFAULT_COMPILE[req.device]:
            return False, f"eager, the default on the {req.device}"
        if no_compiler:
            return False, f"eager: {no_compiler}"
        return True, f"compiled, the default on {req.device}"
    return req.compile, "compiled (--compile)" if req.compile else "eager (--no-compile)"


def select_backend(req: ForwardRequest, probe: bool = True) -> Selection:
    """The forward that runs for `req`, or a ConfigError naming why what was asked cannot.
    With `probe`, the CPU kernels are loaded (built on a machine's first use) to know they
    work; without, only what can be known without torch is checked."""
    selection = _select(req, probe)
    if req.kv_cache_dtype != "auto" and selection.backend not in KV_8BIT_BACKENDS:
        raise ConfigError(f"--kv-cache-dtype {req.kv_cache_dtype}: the {selection.backend} "
                          f"forward ({selection.reason}) reads a KV cache in the model's dtype "
                          f"only; 8-bit KV caches run on the CPU kernels' forward "
                          f"(--device cpu --no-compile), else pass --kv-cache-dtype auto")
    return selection


def _select(req: ForwardRequest, probe: bool) -> Selection:
    compiled, why = resolve_compile(req)
    if compiled:
        if req.cpu_kernels:
            raise ConfigError("the CPU kernels serve the eager forward on the CPU only; "
                              "pass --no-compile")
        return Selection("flex", why)
    if req.device != "cpu":
        if req.cpu_kernels:
            raise ConfigError(f"the CPU kernels serve the eager forward on the CPU only, "
                              f"not on {req.device}")
        return Selection("torch", f"{why}: PyTorch's ops")
    if req.cpu_kernels is False:
        return Selection("torch", f"{why}: PyTorch's ops (the CPU kernels are off)")
    if not probe:
        return Selection("cpu_kernels", f"{why}: the CPU kernels (not yet loaded)")
    from stages.executor import kernels

    failure = kernels.load()
    if failure is None:
        return Selection("cpu_kernels", f"{why}: the CPU kernels")
    if req.cpu_kernels:
        raise RuntimeError(f"the CPU kernels are not available: {failure}")
    logger.warning("CPU kernels not available (%s): the eager forward runs on PyTorch's ops, "
                   "which is slower", failure)
    return Selection("torch", f"{why}: PyTorch's ops (CPU kernels unavailable: {failure})")
