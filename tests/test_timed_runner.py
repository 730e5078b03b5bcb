"""The timed instrument's compute (stages/executor/runner.py TimedRunner) and the lazy views
of a packed step (staging.py StagingLayout.unpack) against the straightforward ones they
replaced, kept here as the reference: random sequences of steps (steady decodes, rows that
do not sample, prompt chunks, sequences taking slots) give the same tokens and the same
last samples, and every field reads the same bytes; and the notifiers' ring write against
the loop over every field it replaced."""

from __future__ import annotations

import random

import numpy as np
import torch

from ipc.config import EngineLimits
from ipc.params import MAX_TOP_LOGPROBS
from ipc.sampling import GREEDY_SLOT
from ipc.step import StepRow, local_buffers, sampled_specs, step_input_specs, write_step
from stages.executor.backends.torch_sdpa import TorchBackend
from stages.executor.device import _counts, _with_logprobs, write_ring
from stages.executor.runner import TimedRunner
from stages.executor.sampler import PromptScores, SampleOutput
from stages.executor.staging import DeviceStep, StagingLayout
from stages.executor.step_inputs import HostStep

SEQS, TOKENS, VOCAB = 8, 40, 997
LIMITS = EngineLimits(SEQS, TOKENS, 4, 128, VOCAB, (2,), depth=2)
_DTYPES = {"int64": torch.int64, "float32": torch.float32}


def _eager_unpack(layout: StagingLayout, packed: torch.Tensor,
                  counts: dict[str, int]) -> DeviceStep:
    """The reference: every field's view made at once."""
    return DeviceStep({name: packed[offset:offset + count * np.dtype(dtype).itemsize]
                       .view(_DTYPES[dtype])
                       for name, (offset, count, dtype) in layout.offsets(counts).items()})


def _reference_compute(runner: TimedRunner, step: HostStep) -> SampleOutput:
    v = _eager_unpack(runner.slots.layout, step.packed, step.counts)
    ids = runner.slots.apply(step, v)
    assert ids is not None
    idx = v.logits_indices
    out = SampleOutput((ids[idx] * 1103515245 + v.positions[idx] + 12345) % VOCAB)
    runner.slots.keep_last(step, v, out)
    return out


def _random_steps(rng: random.Random, num_steps: int) -> list[tuple[list[StepRow], list]]:
    """Steps as a scheduler writes them: a slot's first row takes it (a prompt chunk), then
    it decodes; some steps are all decodes, some rows do not sample."""
    context = [0] * SEQS
    steps = []
    for _ in range(num_steps):
        rows, new_slots, budget = [], [], TOKENS
        all_decode = rng.random() < 0.5
        for slot in rng.sample(range(SEQS), rng.randint(1, SEQS)):
            if context[slot] == 0 and all_decode:
                continue
            n = 1 if context[slot] else rng.randint(1, 6)
            if n > budget:
                break
            if context[slot] == 0:
                new_slots.append((slot, GREEDY_SLOT))
            ids = [-1] if context[slot] and rng.random() < 0.8 else [
                rng.randrange(VOCAB) for _ in range(n)]
            context[slot] += len(ids)
            budget -= len(ids)
            rows.append(StepRow(slot, ids, context[slot], rng.random() < 0.85))
        if rows:
            steps.append((rows, new_slots))
    return steps


def test_timed_compute_equals_the_reference_on_random_steps() -> None:
    rng = random.Random(5)
    fast, slow = TimedRunner(0, 0, LIMITS), TimedRunner(0, 0, LIMITS)
    ring = local_buffers(step_input_specs(LIMITS))
    decodes = 0
    for step_id, (rows, new_slots) in enumerate(_random_steps(rng, 300)):
        plan = write_step(ring, step_id, 0, rows, new_slots=new_slots)
        a, b = fast.prepare(plan, ring), slow.prepare(plan, ring)
        decodes += a.decode_only and all(r.do_sample for r in rows)
        got, want = fast.compute(a, a.packed), _reference_compute(slow, b)
        assert torch.equal(got.tokens, want.tokens) and got.tokens.dtype == want.tokens.dtype
        assert torch.equal(fast.slots.last_sampled, slow.slots.last_sampled)
    assert decodes > 20  # (the path without gathers ran)


def test_lazy_views_read_each_field_as_the_eager_ones_do() -> None:
    layout = StagingLayout(TorchBackend.staging_fields)
    counts = {f.name: random.Random(i).randint(0, 5) for i, f in enumerate(layout.fields)}
    arrays = {f.name: np.arange(counts[f.name], dtype=f.dtype) + 10 * i
              for i, f in enumerate(layout.fields)}
    staging = np.zeros(layout.nbytes(LIMITS), np.uint8)
    packed_counts, nbytes = layout.pack(arrays, staging)
    assert packed_counts == counts
    packed = torch.from_numpy(staging[:nbytes])
    lazy, eager = layout.unpack(packed, counts), _eager_unpack(layout, packed, counts)
    assert "decode_slots" in lazy.views and "query_rows" not in lazy.views
    for f in reversed(layout.fields):  # (any order of first reads)
        got, want = lazy.views[f.name], eager.views[f.name]
        assert got.dtype == want.dtype and torch.equal(got, want), f.name
        assert got.data_ptr() == want.data_ptr() or not counts[f.name]  # a view, no copy
    lazy.positions = torch.zeros(3, dtype=torch.int64)  # (a device pass rewrites a field)
    assert lazy.positions.tolist() == [0, 0, 0]


def _reference_write(ring: dict[str, np.ndarray], out: SampleOutput) -> tuple[int, bool, int]:
    for name, tensor in _with_logprobs(out):
        ring[name][: len(tensor)] = tensor.numpy()
    return _counts(out)


def test_write_ring_writes_what_the_field_loop_wrote() -> None:
    """The notifiers' ring write (device.py write_ring), with and without logprobs, drafts
    and prompt logprobs, against the loop over every field it replaced."""
    rng = torch.Generator().manual_seed(3)
    k = MAX_TOP_LOGPROBS
    for case in range(16):
        x, p, r = 1 + case % 5, case % 3, case % 2
        out = SampleOutput(torch.randint(0, VOCAB, (x,), generator=rng))
        if case & 4:
            out.logprob, out.top_ids = torch.rand(x, generator=rng), torch.randint(
                0, VOCAB, (x, k), generator=rng)
            out.top_logprobs = torch.rand(x, k, generator=rng)
        if case & 8 and r:
            out.accepted = torch.randint(0, 3, (r,), dtype=torch.int32, generator=rng)
        if p:
            out.prompt = PromptScores(torch.rand(p, generator=rng),
                                      torch.randint(1, 9, (p,), dtype=torch.int32, generator=rng),
                                      torch.randint(0, VOCAB, (p, k), generator=rng),
                                      torch.rand(p, k, generator=rng))
        got, want = local_buffers(sampled_specs(LIMITS)), local_buffers(sampled_specs(LIMITS))
        assert write_ring(got, out) == _reference_write(want, out)
        for name in want:
            assert np.array_equal(got[name], want[name]), (case, name)
        assert got["token_ids"][:x].tolist() == out.tokens.tolist()
