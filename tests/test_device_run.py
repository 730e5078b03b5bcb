"""The GPU check's in-process harness (pipeline/tools/device_run.py) on the CPU device: the
scheduler running ahead and the same run waiting for every step give bit-identical outputs
over sampling features, chunked prefill and preemption, and nothing is left in /dev/shm."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ipc.config import EngineLimits
from ipc.model_info import ModelInfo
from ipc.speculative import SpeculativeConfig
from pipeline.tools.device_run import DeviceRun, comparable, overlap_workload, same_tokens
from stages.executor.runner import ModelRunner, TimedRunner
from stages.trace import now_ns

pytestmark = [pytest.mark.live, pytest.mark.timeout(300)]


@pytest.mark.parametrize("depth", [2, 3])
def test_overlapped_equals_synchronised_bit_for_bit(tiny_model_dir: Path, depth: int) -> None:
    info = ModelInfo.from_dir(tiny_model_dir)
    # 4 slots, a 16-token budget (chunked prefill) and a cache of 20 blocks (preemption).
    limits = EngineLimits(4, 16, 4, 256, info.vocab_size, info.eos_token_ids, depth,
                          num_speculative_tokens=3)
    runner = ModelRunner.from_dir(str(tiny_model_dir), torch.float32, torch.device("cpu"),
                                  limits, 20 * 2048)
    run = DeviceRun(runner, limits)
    mine = f"llmp-devrun-{os.getpid()}-"  # (another xdist worker's runs are its own)
    assert [n for n in os.listdir("/dev/shm") if n.startswith(mine)] == []  # unlinked once mapped
    requests = overlap_workload(info.vocab_size)
    ahead, stats = run.run(requests)
    synced, _ = run.run(requests, sync=True)
    assert comparable(ahead) == comparable(synced)
    assert all(r.finish_reason is not None and r.token_ids for r in ahead.values())
    assert any(r.prompt_logprobs for r in ahead.values()) and any(r.logprobs
                                                                   for r in ahead.values())
    assert stats.steps == len(stats.device) == len(stats.submit_ns) > 20
    assert stats.preemptions > 0
    # with drafts (1-gram lookup), through the same device and rings: the same tokens
    drafted, drafted_stats = run.run(requests, speculative=SpeculativeConfig("ngram", 3, 2, 1))
    assert same_tokens(drafted, synced) and drafted_stats.draft_tokens > 0


def test_timed_device_charges_each_launch_and_starts_no_step_before_it() -> None:
    """--device timed:A,B,S: each submit holds the host S ms, each step takes A ms on the
    instrument's device from the later of its launch and the previous step's end, and the
    tokens come back through the notifier: three steps ahead give the synchronous run's."""
    limits = EngineLimits(4, 16, 4, 256, 997, (2,), 3)
    run = DeviceRun(TimedRunner(1.0, 0.0, limits, s_ms=0.5), limits)
    requests = overlap_workload(limits.vocab_size)
    launched: list[int] = []
    ahead, stats = run.run(requests, before_submit=lambda step: launched.append(now_ns()))
    synced, synced_stats = run.run(requests, sync=True)
    assert comparable(ahead) == comparable(synced)
    assert all(r.finish_reason is not None and r.token_ids for r in ahead.values())
    assert stats.steps == len(launched) > 20 and min(stats.submit_ns) >= 0.5e6
    previous_end = 0
    for before, (_, t0, t1) in zip(launched, stats.device, strict=True):
        assert t0 >= before + 0.5e6 and t0 >= previous_end and t1 - t0 == 1_000_000
        previous_end = t1
    # Synchronised, the device waits for every launch: no two steps touch.
    assert all(b[1] > a[2] for a, b in zip(synced_stats.device[:-1], synced_stats.device[1:],
                                           strict=True))


def test_gpu_check_driver_writes_each_part_and_skips_what_needs_cuda(tmp_path: Path) -> None:
    """scripts/gpu_check's driver, on the CPU: the overlap part runs in its own process and
    passes, the CUDA parts say they were skipped, and the JSON holds every part."""
    import json
    import subprocess
    import sys

    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, "-m", "pipeline.tools.gpu_check", "--device", "cpu",
                           "--parts", "versions,models,overlap", "--work", str(tmp_path / "w"),
                           "--out", str(out)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["versions"] == {"skipped": "needs CUDA"}
    assert report["overlap"]["ok"] is True and report["overlap"]["eager"]["equal"] is True
    assert report["overlap"]["eager"]["equal_with_drafts"] is True
    assert report["overlap"]["eager"]["preemptions"] > 0  # (the GPU check's small cache)


def test_kernel_busy_counts_overlapping_kernels_once() -> None:
    from pipeline.tools.gpu_check import kernel_busy

    assert kernel_busy([(0, 4), (2, 6), (10, 12), (11, 11.5)]) == (8.0, 12.0)
    assert kernel_busy([]) == (0.0, 0.0)
