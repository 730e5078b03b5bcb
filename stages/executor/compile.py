"""torch.compile (TorchInductor) of the model's decoder layers. Runs in the executor process.

Which forward is compiled, and when, is backends/select.py's choice (the `flex` backend).
Regional compilation: the decoder layer is compiled, not the whole model, so one graph serves
every layer (their parameters are graph inputs) and a cold compile costs one layer's worth per
step size. Step sizes are padded to `backends.flex.token_buckets`, so a long run compiles at
most once per bucket; more than that is a bug, and dynamo is told to fail rather than keep
recompiling. Compiled artefacts go to an on-disk cache (TorchInductor's FX graph cache) under
the pipeline's cache folder, so a second start with the same model and shapes is fast.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from ipc.cache import cache_dir
from ipc.config import EngineLimits
from stages.executor.backends.flex import bucket, token_buckets

logger = logging.getLogger(__name__)

INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


@dataclass
class CompileStats:
    """What compiling cost so far: graphs compiled and seconds spent in the backend."""

    num_graphs: int = 0
    seconds: float = 0.0
    max_graphs: int = 0


def use_disk_cache() -> str:
    """Point TorchInductor's caches at the pipeline's cache folder unless the user chose one."""
    if INDUCTOR_CACHE_ENV not in os.environ:
        os.environ[INDUCTOR_CACHE_ENV] = str(cache_dir() / "inductor")
    return os.environ[INDUCTOR_CACHE_ENV]


def max_graphs(limits: EngineLimits, device: torch.device, num_kinds: int = 1) -> int:
    """One graph per bucket, and on the CPU one more per bucket a decode-only step can have
    (those attend row by row: another block mask, see flex.build_flex_metadata); each for
    every kind of layer (its class and how it attends: a window is another block mask)."""
    buckets = token_buckets(limits)
    decode = [b for b in buckets if b <= bucket(limits, limits.max_num_seqs)]
    return (len(buckets) + (len(decode) if device.type == "cpu" else 0)) * num_kinds


def layer_kinds(layers: torch.nn.ModuleList) -> int:
    """The distinct kinds of the layers: their class and their attention's LayerAttention."""
    return len({(type(layer), getattr(getattr(layer, "self_attn", None), "kind", None))
                for layer in layers})


def compile_layers(layers: torch.nn.ModuleList, limits: EngineLimits,
                   device: torch.device) -> CompileStats:
    """Compile each layer in place; returns the stats the backend keeps up to date."""
    stats = CompileStats(max_graphs=max_graphs(limits, device, layer_kinds(layers)))
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
