"""The executor's hot path never makes the host wait for the device: every step's compute()
runs under tests/sync_guard.py, on the CPU, over workloads that reach every sampling feature,
structured outputs, prompt logprobs, chunked prefill and preemption; and the guard itself
catches what it must."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from sync_guard import HostSync, no_host_sync

from ipc.messages import SamplingParams, StructuredOutputs
from ipc.model_info import ModelInfo
from ipc.sampling import GREEDY_SLOT
from stages.executor.backends.flex import build_flex_metadata
from stages.executor.sampler import SamplingState
from stages.executor.staging import DeviceStep
from stages.inprocess import InProcessEngine

pytestmark = pytest.mark.timeout(300)

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def guarded(engine: InProcessEngine) -> list[int]:
    """Run every compute() of `engine` under the guard; returns the number of steps seen."""
    runner, seen = engine.runner, [0]
    compute = runner.compute

    def checked(step: Any, packed: torch.Tensor) -> Any:
        seen[0] += 1
        with no_host_sync(runner.slots.host_buffers()):
            return compute(step, packed)

    runner.compute = checked  # type: ignore[method-assign]
    return seen


def workloads(eos: int) -> dict[str, list[tuple[str, list[int], SamplingParams]]]:
    prompts = [[5 + i, 9, 13 + 2 * i] * (1 + 3 * i) for i in range(6)]  # 3 to 48 tokens

    def each(**kw: Any) -> list[tuple[str, list[int], SamplingParams]]:
        return [(f"r{i}", p, SamplingParams(max_tokens=10, ignore_eos=True, **kw))
                for i, p in enumerate(prompts)]

    return {
        "greedy": each(temperature=0.0),
        "seeded with penalties": each(temperature=0.8, seed=7, repetition_penalty=1.3,
                                      presence_penalty=0.5, frequency_penalty=0.2),
        "top-k, top-p, min-p": each(temperature=1.0, top_k=5, top_p=0.9, min_p=0.05),
        "min_tokens and stop ids": each(temperature=0.0, min_tokens=4, stop_token_ids=[7, 8]),
        "logprobs and prompt logprobs": each(temperature=0.0, logprobs=3, prompt_logprobs=2),
        "n samples": each(temperature=0.7, n=2),
        "structured": [(f"j{i}", p, SamplingParams(
            max_tokens=24, temperature=0.0,
            structured_outputs=StructuredOutputs(json=json.dumps(SCHEMA))))
            for i, p in enumerate(prompts[:3])],
        "mixed": [*each(temperature=0.0)[:2], *each(temperature=0.9, seed=3,
                                                     repetition_penalty=1.1)[2:4],
                  *each(temperature=0.0, logprobs=1, min_tokens=3, stop_token_ids=[eos])[4:]],
    }


def test_no_host_sync_when_verifying_drafts(tiny_model_dir: Path) -> None:
    """Rows with drafts (speculative decoding): sampled at every drafted position, the
    accepted prefix and each slot's last sample found on the device."""
    from ipc.speculative import SpeculativeConfig

    eos = ModelInfo.from_dir(tiny_model_dir).eos_token_ids
    engine = InProcessEngine(str(tiny_model_dir), max_num_seqs=4, max_num_batched_tokens=32,
                             block_size=4, kv_cache_memory=40 * 2048, eos_token_ids=eos,
                             speculative=SpeculativeConfig("ngram", 3, 2, 1))
    seen = guarded(engine)
    work = workloads(0)
    _, prompt, params = work["logprobs and prompt logprobs"][1]
    _, j_prompt, j_params = work["structured"][0]
    engine.run([*work["greedy"][:3], *work["top-k, top-p, min-p"][3:], ("lp", prompt, params),
                ("json", j_prompt, dataclasses.replace(j_params, max_tokens=40))])
    assert seen[0] > 10 and engine.scheduler.spec_num_drafts > 0


@pytest.mark.parametrize("name", list(workloads(0)))
def test_no_host_sync_in_compute(tiny_model_dir: Path, name: str) -> None:
    eos = ModelInfo.from_dir(tiny_model_dir).eos_token_ids
    # A small token budget (chunked prefill) and a small cache (preemption).
    engine = InProcessEngine(str(tiny_model_dir), max_num_seqs=4, max_num_batched_tokens=16,
                             block_size=4, kv_cache_memory=20 * 2048, eos_token_ids=eos)
    seen = guarded(engine)
    results = engine.run(workloads(eos[0])[name])
    assert seen[0] > 10
    assert all(r.finish_reason is not None for r in results.values())


def test_flex_metadata_is_sync_free(tiny_model_dir: Path) -> None:
    """The compiled forward's metadata, as CUDA builds it (a page of rows per query block)."""
    block_table = torch.arange(4 * 8, dtype=torch.int32).view(4, 8)
    v = {"positions": torch.tensor([5, 6, 7, 0, 1, 17]),
         "token_slots": torch.tensor([0, 0, 0, 1, 1, 2]),
         "query_rows": torch.tensor([1, 2, 3, 4, 5, 9]),
         "qblock_slots": torch.tensor([0, 1, 2]), "qblock_pages": torch.tensor([1, 0, 4])}
    with no_host_sync():
        meta = build_flex_metadata(DeviceStep(v), block_table, 4, 33)
    assert meta.slot_mapping.tolist() == [4 * 1 + 1, 4 * 1 + 2, 4 * 1 + 3, 4 * 8, 4 * 8 + 1,
                                          4 * 20 + 1]


@pytest.mark.parametrize(("what", "code"), [
    ("item", lambda t: t.sum().item()),
    ("tolist", lambda t: t.tolist()),
    ("numpy", lambda t: t.numpy()),
    ("bool", lambda t: bool(t[0, 0] > 0)),
    ("python scalar assignment", lambda t: t.__setitem__(torch.zeros(1, dtype=torch.long), 0)),
    ("from_numpy", lambda t: t + torch.from_numpy(np.ones(3, dtype=np.float32))),
    ("factory without device", lambda t: t + torch.arange(3)),
    ("boolean mask", lambda t: t[t > 0]),
    ("nonzero", lambda t: t.nonzero()),
])
def test_guard_catches(what: str, code: Callable[[torch.Tensor], Any]) -> None:
    t = torch.ones(2, 3)
    with pytest.raises(HostSync), no_host_sync():
        code(t)


def test_guard_catches_a_blocking_copy_to_host_memory_and_allows_an_async_one() -> None:
    host, device = torch.zeros(3), torch.ones(3)
    with pytest.raises(HostSync), no_host_sync([host]):
        host.copy_(device)
    with no_host_sync([host]):
        host.copy_(device, non_blocking=True)
    assert host.sum() == 3


def test_guard_caught_the_old_slot_reset() -> None:
    """`t[idx] = 0`, as init_slots once reset the penalty counts, is caught; index_fill_ not."""
    state = SamplingState(4, 32, torch.device("cpu"))
    state.count_tokens(torch.tensor([1, 2]), torch.tensor([0, 1]), torch.tensor([0, 1]))
    slots = torch.tensor([1])
    assert state.output_counts is not None
    with pytest.raises(HostSync), no_host_sync():
        state.output_counts[slots] = 0
    params = (torch.tensor(GREEDY_SLOT[0], dtype=torch.float32), torch.tensor(GREEDY_SLOT[1]),
              torch.tensor([1]), torch.tensor([3]))
    with no_host_sync():
        state.init_slots(slots, *params)
    assert state.prompt_counts is not None
    counts = state.output_counts + state.prompt_counts
    assert counts[1].sum() == 0 and counts[0].sum() == 1  # slot 1 reset, slot 0 kept
    assert state.stop_mask is not None and state.stop_mask[1].nonzero().tolist() == [[3]]


def test_packed_outputs_fill_the_ring_as_the_fields_would() -> None:
    """CudaDevice brings a step's result back in one copy per row kind; unpacked, the ring
    holds what writing each field would have written."""
    from ipc.config import EngineLimits
    from ipc.step import local_buffers, sampled_specs
    from stages.executor.device import _with_logprobs, pack_outputs, unpack_outputs
    from stages.executor.sampler import PromptScores, SampleOutput

    limits = EngineLimits(8, 16, 4, 64, 100, (), 2)
    g = torch.Generator().manual_seed(0)
    x, p = 5, 3
    out = SampleOutput(torch.randint(0, 100, (x,), generator=g), torch.randn(x, generator=g),
                       torch.randint(0, 100, (x, 20), generator=g), torch.randn(x, 20, generator=g),
                       PromptScores(torch.randn(p, generator=g),
                                    torch.randint(1, 9, (p,), generator=g, dtype=torch.int32),
                                    torch.randint(0, 100, (p, 20), generator=g),
                                    torch.randn(p, 20, generator=g)))
    packed, direct = local_buffers(sampled_specs(limits)), local_buffers(sampled_specs(limits))
    groups = pack_outputs(out)
    assert len(groups) == 2 and groups[0][0].shape == (x, 8 + 4 + 160 + 80)
    for data, fields in groups:
        unpack_outputs(data.numpy(), fields, packed)
    for name, tensor in _with_logprobs(out):
        direct[name][:len(tensor)] = tensor.numpy()
    for name in direct:
        np.testing.assert_array_equal(packed[name], direct[name], err_msg=name)
    assert len(pack_outputs(SampleOutput(torch.zeros(0, dtype=torch.long)))) == 0


class FakeEvent:
    """A CUDA event's timing on a fake device clock (ms)."""

    def __init__(self, t_ms: float) -> None:
        self.t = t_ms

    def elapsed_time(self, other: FakeEvent) -> float:
        return other.t - self.t


def test_step_clock_chains_each_steps_own_events_and_reanchors_after_idle() -> None:
    from stages.executor.device import EventPool, StepClock

    base = FakeEvent(0.0)
    clock = StepClock(base, 1_000_000_000)
    # The host sees each step end a little later (the copy back, its wake-up).
    t0, t1, released = clock.place(FakeEvent(0.5), FakeEvent(2.5), 1_002_600_000)
    assert (t0, t1, released) == (1_000_500_000, 1_002_500_000, base)
    end2 = FakeEvent(4.0)
    t0, t1, released = clock.place(FakeEvent(3.0), end2, 1_004_070_000)  # 0.5 ms idle
    assert (t0, t1) == (1_003_000_000, 1_004_000_000)
    # After hours of no work, the host's clock anchors the chain again.
    hours = 3 * 3600 * 1000.0
    t0, t1, released = clock.place(FakeEvent(hours), FakeEvent(hours + 1.25), 5 * 10**12)
    assert (t0, t1, released) == (5 * 10**12 - 1_250_000, 5 * 10**12, end2)
    # A chain that drifted past the host's clock (a step cannot end after it was seen) too.
    t0, t1, _ = clock.place(FakeEvent(hours + 1.5), FakeEvent(hours + 2.5), 5 * 10**12 + 900_000)
    assert (t0, t1) == (5 * 10**12 - 100_000, 5 * 10**12 + 900_000)
    made = []
    pool = EventPool(lambda: made.append(object()) or made[-1])
    a, b = pool.take(), pool.take()
    pool.give(a)
    assert pool.take() is a and len(made) == 2 and b is made[1]
