"""Helpers for tests that start the real pipeline: config, and a finalizer that ends only the
processes the test started, by pid."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

from ipc.config import ExecutorConfig, PipelineConfig, SchedulerConfig
from ipc.model_info import ModelInfo
from ipc.speculative import SpeculativeConfig
from pipeline.runtime.launcher import Pipeline


def live_config(model_dir: Path, *, num_tokenizers: int = 1, num_detokenizers: int = 1,
                depth: int | str = 2, kv_cache_memory: int = 64 << 20, max_num_seqs: int = 16,
                max_num_batched_tokens: int = 256, block_size: int = 16,
                max_model_len: int | None = None, device: str = "cpu",
                compile: bool | None = None, quantization: str | None = None,
                speculative: SpeculativeConfig | None = None,
                dtype: str = "float32") -> PipelineConfig:
    return PipelineConfig(
        model=ModelInfo.from_dir(model_dir, max_model_len),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens,
                                  block_size=block_size, depth=depth, speculative=speculative),
        executor=ExecutorConfig.for_device(device, dtype=dtype,
                                           kv_cache_memory=kv_cache_memory, compile=compile,
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


def alive_after(pids: list[int], timeout: float = 10.0) -> list[int]:
    """The pids still running `timeout` s from now at most (multiprocessing's resource
    tracker exits only once it sees its parent gone)."""
    deadline = time.monotonic() + timeout
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive(pids)


def kill_pids(pids: list[int]) -> None:
    for pid in alive(pids):
        os.kill(pid, signal.SIGKILL)


def shm_segments(run_id: str) -> list[str]:
    return [p.name for p in Path("/dev/shm").iterdir() if run_id in p.name]


def our_segments() -> set[str]:
    """This project's shared-memory segments in /dev/shm (every run's)."""
    return {n for n in os.listdir("/dev/shm") if n.startswith("llm-pipeline-")}


def leaked_segments(before: set[str], settle_s: float = 10.0) -> list[str]:
    """This project's segments made since `before` that are still there `settle_s` s later:
    leaks. Under pytest-xdist another worker's pipeline has its rings for a moment while it
    starts (the launcher unlinks them once both users have them mapped): those go, a leaked
    one stays."""
    new = our_segments() - before
    deadline = time.monotonic() + settle_s
    while new and time.monotonic() < deadline:
        time.sleep(0.2)
        new &= our_segments()
    return sorted(new)


def mapped_segments(pids: list[int]) -> set[str]:
    """The project's segments these processes have mapped (named in their /proc maps, also
    once unlinked): a test's own rings, whatever other runs have in /dev/shm."""
    names = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:  # (gone)
            continue
        names.update(line.split("/dev/shm/")[1].split()[0] for line in maps.splitlines()
                     if "/dev/shm/llm-pipeline-" in line)
    return names


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


def kill_and_serve_again(cfg: PipelineConfig, victim: str, prompts: list[list[int]],
                         max_tokens: int = 12) -> list[list[int]]:
    """kill -9 of an engine's stage process `victim` (e.g. "executor:1"): waits until the
    engine was started again as a group (one restart, healthy, nothing restarting), checks
    that every process of the engine is new and the old ones gone, and returns the greedy
    tokens the engine then gives; every process is gone once it returns."""
    from ipc.messages import SamplingParams

    with running(cfg) as pipe:
        old = dict(pipe.stage_pids)
        os.kill(old[victim], signal.SIGKILL)
        client = pipe.client()
        deadline = time.monotonic() + 60
        while pipe.status().restarts != {"engine:0": 1} or not client.health().ok \
                or pipe.engines.restarting:
            assert pipe.is_alive and time.monotonic() < deadline, pipe.failure
            time.sleep(0.05)
        outs = client.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                       ignore_eos=True))
        new = pipe.stage_pids
        engine = [n for n in old if n.startswith(("scheduler:", "executor:"))]
        assert all(new[n] != old[n] for n in engine)
        assert alive([old[n] for n in engine]) == []
        pids = list(new.values())
    assert alive(pids) == []
    return [o.token_ids for o in outs]


def stop_under_load(cfg: PipelineConfig, prompts: list[list[int]]) -> tuple[dict[str, int | None],
                                                                           float]:
    """SIGTERM to every process while the prompts stream (0.4 s in): the executors' exit
    codes and how long the stop took."""
    import contextlib
    import threading

    from ipc.messages import SamplingParams
    from pipeline.runtime.client import PipelineClient, PipelineError

    pipe = Pipeline(cfg).start()
    client = pipe.client()
    params = SamplingParams(max_tokens=80, ignore_eos=True)

    def load(client: PipelineClient = client) -> None:
        with contextlib.suppress(PipelineError):
            client.generate(prompts, params, timeout=60)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    time.sleep(0.4)
    start = time.monotonic()
    pipe.stop()
    took = time.monotonic() - start
    thread.join(10)
    return {n: p.exitcode for n, p in pipe.procs.items() if n.startswith("executor:")}, took


def one_rank(folder: Path, prompts: list[list[int]], max_tokens: int = 12,
             **engine: Any) -> list[list[int]]:
    """The greedy tokens of one rank, from the scheduler and executor cores wired in this
    process (stages/inprocess.py) with the parallel tests' limits (4 slots, a 16-token
    budget: prompts chunked; blocks of 4, 96 positions): the reference of tensor and pipeline
    parallelism, without starting a second pipeline per case. `engine`: InProcessEngine's
    other options (quantization, kv_cache_dtype)."""
    from ipc.messages import SamplingParams
    from stages.inprocess import InProcessEngine

    core = InProcessEngine(str(folder), max_num_seqs=4, max_num_batched_tokens=16,
                           block_size=4, max_model_len=96, **engine)
    return core.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                 ignore_eos=True))


def ranks_config(folder: Path, kv_cache_memory: int = 1 << 22, **executor: Any
                 ) -> PipelineConfig:
    """The tensor and pipeline tests' run of a model on several executor ranks (`executor`:
    ExecutorConfig's fields, e.g. tensor_parallel_size): 4 slots and a 16-token budget, so
    prompts are chunked and steps mix chunks and decodes; float32, eager."""
    return PipelineConfig(
        model=ModelInfo.from_dir(folder, 96),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, block_size=4,
                                  depth=2),
        executor=ExecutorConfig.for_device("cpu", dtype="float32",
                                           kv_cache_memory=kv_cache_memory, compile=False,
                                           **executor),
        ready_timeout_s=120)


def generate_on_ranks(cfg: PipelineConfig, prompts: list[list[int]], max_tokens: int = 12
                      ) -> tuple[list[list[int]], Any]:
    """Greedy outputs of the prompts and the scheduler's stats once idle. On the way: each
    executor rank is named by its place in `ps` and the status (engine.stage.rank), the
    engine's ranks are the processes started, and every one is gone once it returns."""
    from ipc.messages import SamplingParams

    layout = cfg.ranks
    with running(cfg) as pipe:
        outs = pipe.client().generate(prompts, SamplingParams(max_tokens=max_tokens,
                                                              temperature=0.0, ignore_eos=True))
        stats = pipe.idle_stats()
        places = {f"executor:{r}": layout.describe(r) for r in range(layout.ranks_per_engine)}
        assert pipe.status().ranks == places
        for name, place in places.items():
            title = " ".join(psutil.Process(pipe.stage_pids[name]).cmdline())
            assert title.split() == [f"llm-pipeline:{name}", place]
        pids = list(pipe.stage_pids.values())
        names = sorted(n for n in pipe.stage_pids if n.startswith("executor:"))
        pipe.stop()
        assert alive(pids) == [], "a stage outlived its pipeline"
    assert not [o.error for o in outs if o.error]
    assert names == sorted(places)
    return [o.token_ids for o in outs], stats


def stream_and_abort(client: Any, prompt: list[int], max_tokens: int, after: int) -> str | None:
    """Stream a request of `max_tokens` (EOS ignored) and abort it once `after` tokens came:
    the finish reason of its last output ("abort" if the abort reached its engine)."""
    import asyncio

    from ipc.messages import SamplingParams

    async def run() -> str | None:
        reason = None
        async for out in client.stream(prompt, SamplingParams(max_tokens=max_tokens,
                                                              ignore_eos=True),
                                       request_id="aborted"):
            if out.num_output_tokens >= after and reason is None:
                client.abort("aborted")
            reason = out.finish_reason
        return reason

    return asyncio.run(run())
