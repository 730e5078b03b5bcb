"""torch.compile (TorchInductor) of the model's decoder layers. Runs in the executor process.

Regional compilation: the decoder layer is compiled, not the whole model, so one graph serves
every layer (their parameters are graph inputs) and a cold compile costs one layer's worth per
step size. Step sizes are padded to `EngineLimits.token_buckets`, so a long run compiles at
most once per bucket; more than that is a bug, and dynamo is told to fail rather than keep
recompiling. Compiled artefacts go to an on-disk cache (TorchInductor's FX graph cache) under
the pipeline's cache folder, so a second start with the same model and shapes is fast.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any

import torch

from ipc.config import ConfigError, EngineLimits, cache_dir

logger = logging.getLogger(__name__)

INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
# Compiled by default where it pays (docs/BENCHMARKS.md, "Compiled forward"): on CUDA a
# compiled, graph-ready forward is what keeps the GPU from waiting on kernel launches.
DEFAULT_COMPILE = {"cuda": True, "cpu": False}


@dataclass
class CompileStats:
    """What compiling cost so far: graphs compiled and seconds spent in the backend."""

    num_graphs: int = 0
    seconds: float = 0.0
    max_graphs: int = 0


def compile_unavailable(device: torch.device) -> str | None:
    """Why this machine cannot compile for `device` (None: it can). Inductor's CPU code is C++
    built at run time, so it needs a C++ compiler on the PATH."""
    if device.type == "cpu" and not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
        return "no C++ compiler (g++, c++ or clang++) on the PATH, which TorchInductor needs"
    return None


# Triton's smallest tile: the compiled attention's blocks are pages, so on CUDA a page must
# hold a whole number of tiles.
CUDA_PAGE_MULTIPLE = 16


def resolve_compile(requested: bool | None, device: torch.device,
                    sliding_window: int | None = None, block_size: int = 16,
                    tensor_parallel_size: int = 1) -> bool:
    """--compile / --no-compile, or the device's default (None): compiled where this
    machine can compile (see DEFAULT_COMPILE), the model has no sliding window (which the
    compiled attention lacks) and, on CUDA, the page size is a multiple of Triton's tile;
    else eager with a log line saying why (or, asked for, a ConfigError)."""
    why_not = None
    if tensor_parallel_size > 1:
        why_not = "the compiled forward does not implement tensor parallelism yet"
    elif sliding_window is not None:
        why_not = (f"the model's sliding_window ({sliding_window}) is not implemented "
                   "compiled")
    elif device.type == "cuda" and block_size % CUDA_PAGE_MULTIPLE:
        why_not = (f"on CUDA the compiled attention needs --block-size a multiple of "
                   f"{CUDA_PAGE_MULTIPLE} (Triton's smallest tile), not {block_size}")
    if why_not is not None:
        if requested:
            raise ConfigError(f"--compile: {why_not}; pass --no-compile")
        if requested is None and DEFAULT_COMPILE[device.type]:
            logger.warning("running the model eager: %s", why_not)
        return False
    reason = compile_unavailable(device)
    if requested and reason:
        raise ConfigError(f"--compile: {reason}; install one, or pass --no-compile")
    if requested is None:
        requested = DEFAULT_COMPILE[device.type]
        if requested and reason:
            logger.warning("running the model eager: %s", reason)
            return False
    return requested


def use_disk_cache() -> str:
    """Point TorchInductor's caches at the pipeline's cache folder unless the user chose one."""
    if INDUCTOR_CACHE_ENV not in os.environ:
        os.environ[INDUCTOR_CACHE_ENV] = str(cache_dir() / "inductor")
    return os.environ[INDUCTOR_CACHE_ENV]


def max_graphs(limits: EngineLimits, device: torch.device) -> int:
    """One graph per bucket, and on the CPU one more per bucket a decode-only step can have
    (those attend row by row: another block mask, see attention.build_flex_metadata)."""
    buckets = limits.token_buckets
    decode = [b for b in buckets if b <= limits.bucket(limits.max_num_seqs)]
    return len(buckets) + (len(decode) if device.type == "cpu" else 0)


def compile_layers(layers: torch.nn.ModuleList, limits: EngineLimits,
                   device: torch.device) -> CompileStats:
    """Compile each layer in place; returns the stats the backend keeps up to date."""
    stats = CompileStats(max_graphs=max_graphs(limits, device))
    logger.info("compiling decoder layers (TorchInductor, cache %s)", use_disk_cache())

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        from torch._inductor.compile_fx import compile_fx

        start = time.perf_counter()
        compiled = compile_fx(gm, example_inputs)
        stats.num_graphs += 1
        stats.seconds += time.perf_counter() - start
        logger.info("compiled graph %d of at most %d (%.1f s)", stats.num_graphs,
                    stats.max_graphs, time.perf_counter() - start)
        return compiled

    # One compiled model a process (an executor has one): dynamo's caches are per code
    # object, so an earlier model's graphs would count against this one's limit.
    torch._dynamo.reset()
    # One entry per bucket on the shared code object; beyond that dynamo raises instead of
    # silently falling back to eager.
    torch._dynamo.config.recompile_limit = stats.max_graphs
    torch._dynamo.config.accumulated_recompile_limit = max(
        torch._dynamo.config.accumulated_recompile_limit, stats.max_graphs)
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    for layer in layers:
        layer.compile(backend=backend, dynamic=False, fullgraph=True)
    return stats
