"""Helpers for tests that start the real pipeline: config, and a finalizer that ends only the
processes the test started, by pid."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from ipc.config import ExecutorConfig, PipelineConfig, SchedulerConfig
from ipc.model_info import ModelInfo
from ipc.speculative import SpeculativeConfig
from pipeline.runtime.launcher import Pipeline


def live_config(model_dir: Path, *, num_tokenizers: int = 1, num_detokenizers: int = 1,
                depth: int = 2, kv_cache_memory: int = 64 << 20, max_num_seqs: int = 16,
                max_num_batched_tokens: int = 256, block_size: int = 16,
                max_model_len: int | None = None, device: str = "cpu",
                compile: bool | None = None, quantization: str | None = None,
                speculative: SpeculativeConfig | None = None) -> PipelineConfig:
    return PipelineConfig(
        model=ModelInfo.from_dir(model_dir, max_model_len),
        scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens, block_size, depth,
                                  speculative=speculative),
        executor=ExecutorConfig.for_device(device, "float32", kv_cache_memory, compile,
                                           quantization=quantization),
        num_tokenizers=num_tokenizers, num_detokenizers=num_detokenizers, ready_timeout_s=120)


def alive(pids: list[int]) -> list[int]:
    """The pids that still run (zombies count as gone)."""
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def kill_pids(pids: list[int]) -> None:
    for pid in alive(pids):
        os.kill(pid, signal.SIGKILL)


def shm_segments(run_id: str) -> list[str]:
    return [p.name for p in Path("/dev/shm").iterdir() if run_id in p.name]


@contextmanager
def running(cfg: PipelineConfig) -> Iterator[Pipeline]:
    """A started pipeline; on exit it is stopped and any of its stages still alive killed."""
    pipe = Pipeline(cfg)
    try:
        pipe.start()
        yield pipe
    finally:
        pipe.stop()
        kill_pids(list(pipe.stage_pids.values()))
