"""The executor's host preparation of a step (stages/executor/step_inputs.py, with the
backends' host_inputs) against the straightforward one it replaced, kept here as the
reference: random sequences of steps as a
scheduler writes them (steady decodes, prompt chunks, sequences taking and leaving slots,
drafts, prompt logprobs, min_tokens stop ids) are prepared both ways, with each backend, and
must pack the same bytes and the same HostStep."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

from ipc.config import EngineLimits
from ipc.messages import SamplingParams, StepPlan
from ipc.sampling import GREEDY_SLOT, NUM_F, NUM_I, F, I, encode_slot, penalty_rows
from ipc.step import (
    DRAFT_TOKEN,
    STEP_FIELDS,
    StepInputs,
    StepRow,
    check_stamp,
    local_buffers,
    step_input_specs,
    write_step,
)
from stages.executor.backends.base import AttentionBackend, HostInputs, StepRows
from stages.executor.backends.cpu_kernels import CpuKernelBackend
from stages.executor.backends.flex import (
    FlexBackend,
    FlexPlan,
    max_query_blocks,
    token_buckets,
)
from stages.executor.backends.torch_sdpa import (
    PrefillRow,
    TorchBackend,
    TorchPlan,
    group_by_length,
)
from stages.executor.drafter import Drafter, DraftFields
from stages.executor.sampler import HostSlotParams, StepSampling
from stages.executor.staging import StagedFields, StagingLayout
from stages.executor.step_inputs import HostStep, prepare_host_step

SEQS, TOKENS, BLOCK, MAX_LEN, K = 6, 48, 4, 64, 3
LIMITS = EngineLimits(SEQS, TOKENS, BLOCK, MAX_LEN, 100, (2,), depth=2,
                      num_speculative_tokens=K)

# ------------------------------------------------------------------ the reference


def _reference_read(buf: dict[str, np.ndarray], plan: StepPlan) -> StepInputs:
    check_stamp(buf, plan.step_id)
    columns = {}
    for f in STEP_FIELDS:
        values = buf[f.name][:getattr(plan, f.count.plan_field)]
        columns[f.name] = values.astype(np.int64) if values.dtype.kind == "i" else values.copy()
    inputs = StepInputs(**columns)
    check_stamp(buf, plan.step_id)
    return inputs


def _reference_pack(layout: StagingLayout, arrays: dict[str, np.ndarray],
                    out: np.ndarray) -> tuple[dict[str, int], int]:
    counts, offset = {}, 0
    for f in layout.fields:
        values = arrays[f.name]
        nbytes = values.size * np.dtype(f.dtype).itemsize
        out[offset:offset + nbytes].view(f.dtype)[:] = values.reshape(-1)
        counts[f.name] = values.size
        offset += -(-nbytes // 8) * 8  # (8-byte aligned fields)
    return counts, offset


class _ReferenceParams:
    def __init__(self, max_num_seqs: int) -> None:
        self.f = np.tile(np.asarray(GREEDY_SLOT[0], dtype=np.float32), (max_num_seqs, 1))
        self.i = np.tile(np.asarray(GREEDY_SLOT[1], dtype=np.int64), (max_num_seqs, 1))

    def update(self, slots: np.ndarray, f: np.ndarray, i: np.ndarray) -> None:
        if len(slots):
            self.f[slots], self.i[slots] = f, i

    def step_sampling(self, sampled: np.ndarray, all_rows: np.ndarray,
                      any_stop_ids: bool) -> StepSampling:
        fs, is_ = self.f[sampled], self.i[sampled]
        sampling = fs[:, F.TEMPERATURE] > 0
        return StepSampling(
            all_greedy=not sampling.any(),
            use_top_k_p=bool(((is_[:, I.TOP_K] > 0) | (fs[:, F.TOP_P] < 1))[sampling].any()),
            use_min_p=bool((fs[:, F.MIN_P] > 0)[sampling].any()),
            use_penalties=bool(penalty_rows(self.f[all_rows]).any()),
            use_seed=bool((is_[:, I.HAS_SEED] != 0)[sampling].any()),
            use_min_tokens=any_stop_ids or bool((is_[:, I.MIN_TOKENS] > 0).any()),
            use_logprobs=bool((is_[:, I.LOGPROBS] >= 0).any()),
            use_logit_bias=bool((is_[:, I.LOGIT_BIAS] > 0).any()),
        )


def _reference_speculative_rows(input_ids: np.ndarray, slots: np.ndarray, ends: np.ndarray,
                                width: np.ndarray, first: np.ndarray) -> dict[str, np.ndarray]:
    spec = width > 1
    num_drafts = width[spec] - 1
    k = int(num_drafts.max(initial=0))
    j = np.arange(k + 1)
    own = j[:k] < num_drafts[:, None]
    at = np.where(own, (ends[spec] - num_drafts)[:, None] + j[:k], 0)
    return {
        "spec_slots": slots[spec],
        "spec_sampled": first[spec][:, None] + np.minimum(j, num_drafts[:, None]),
        "spec_draft": np.where(own, input_ids[at], -1),
        "spec_at": at,
    }


def _reference_query_blocks(query_lens: np.ndarray, context_lens: np.ndarray,
                            slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    first = (context_lens - query_lens) // BLOCK
    num = (context_lens - 1) // BLOCK - first + 1
    start = np.cumsum(num) - num
    page_of_block = np.repeat(first, num) + (np.arange(int(num.sum())) - np.repeat(start, num))
    positions = np.repeat(context_lens - query_lens, query_lens) + (
        np.arange(int(query_lens.sum())) - np.repeat(np.cumsum(query_lens) - query_lens,
                                                     query_lens))
    block_of_token = np.repeat(start - first, query_lens) + positions // BLOCK
    rows = block_of_token * BLOCK + positions % BLOCK
    return rows, np.repeat(slots, num), page_of_block


def _reference_flex_inputs(backend: FlexBackend, rows: StepRows) -> HostInputs:
    query_rows, qblock_slots, qblock_pages = _reference_query_blocks(
        rows.query_lens, rows.context_lens, rows.slots)
    num_tokens = next(b for b in token_buckets(LIMITS) if b >= len(rows.forward["input_ids"]))
    num_blocks = max_query_blocks(LIMITS, num_tokens)
    pad_slot, spare_row = SEQS, (num_blocks - 1) * BLOCK

    def pad(values: np.ndarray, size: int, fill: int) -> np.ndarray:
        return np.concatenate([values, np.full(size - len(values), fill, values.dtype)])

    arrays = {
        "input_ids": pad(rows.forward["input_ids"], num_tokens, 0),
        "positions": pad(rows.forward["positions"], num_tokens, 0),
        "token_slots": pad(rows.forward["token_slots"], num_tokens, pad_slot),
        "query_rows": pad(query_rows, num_tokens, spare_row),
        "qblock_slots": pad(qblock_slots, num_blocks, pad_slot),
        "qblock_pages": pad(qblock_pages, num_blocks, 0),
    }
    decode_only = bool((rows.query_lens == 1).all())
    return HostInputs(arrays, FlexPlan(decode_only and backend.device.type == "cpu"))


def _reference_torch_inputs(backend: TorchBackend, rows: StepRows) -> HostInputs:
    q, ctx, slots, starts = rows.query_lens, rows.context_lens, rows.slots, rows.starts
    decode = np.flatnonzero(q == 1)
    decode = decode[np.argsort(ctx[decode], kind="stable")]
    prefills = [PrefillRow(int(starts[r]), int(starts[r] + q[r]), int(slots[r]), int(ctx[r]))
                for r in np.flatnonzero(q > 1)]
    arrays = {"decode_token_idx": starts[decode], "decode_slots": slots[decode],
              "decode_lens": ctx[decode]}
    return HostInputs(arrays, TorchPlan(group_by_length(ctx[decode]), prefills))


def _reference_host_inputs(backend: AttentionBackend | None, rows: StepRows) -> HostInputs:
    if isinstance(backend, FlexBackend):
        return _reference_flex_inputs(backend, rows)
    if isinstance(backend, TorchBackend):
        return _reference_torch_inputs(backend, rows)
    assert backend is None or isinstance(backend, CpuKernelBackend)
    return HostInputs({})


def _reference_prepare(plan: StepPlan, ring: dict[str, np.ndarray], staging: torch.Tensor,
                       host_params: _ReferenceParams, layout: StagingLayout,
                       backend: AttentionBackend | None, drafter: Any) -> HostStep:
    step = _reference_read(ring, plan)
    q, ctx, slots = step.query_len, step.context_len, step.seq_slot
    t = len(step.input_ids)
    ends = np.cumsum(q)
    starts = ends - q
    sampled = np.flatnonzero(step.do_sample)
    width = 1 + step.num_draft[sampled]
    first = np.cumsum(width) - width
    logits_indices = np.repeat(ends[sampled] - width - first, width) + np.arange(width.sum())
    host_params.update(step.new_slot, step.new_fparams, step.new_iparams)
    forward = {
        "input_ids": step.input_ids,
        "positions": np.repeat(ctx - q, q) + (np.arange(t) - np.repeat(starts, q)),
        "token_slots": np.repeat(slots, q),
    }
    rows = StepRows(q, ctx, slots, starts, forward)
    attn = _reference_host_inputs(backend, rows)
    draft_passes = ({} if drafter is None else drafter.host_arrays(
        rows, step.num_draft, step.do_sample, step.new_slot, step.draft_kv))
    arrays = {
        **forward,
        **attn.arrays,
        "logits_indices": logits_indices,
        "sample_slots": np.repeat(slots[sampled], width),
        **_reference_speculative_rows(step.input_ids, slots[sampled], ends[sampled], width,
                                      first),
        **{f.name: getattr(step, f.name) for f in STEP_FIELDS if f.staged},
        **draft_passes,
    }
    counts, nbytes = _reference_pack(layout, arrays, staging.numpy())
    sampling = host_params.step_sampling(slots[sampled], slots, len(step.stop_id) > 0)
    spec_width = int(width.max(initial=1)) - 1
    drafts = None
    if spec_width:
        drafts = {slot: [t for t in row if t >= 0] for slot, row in zip(
            arrays["spec_slots"].tolist(), arrays["spec_draft"].tolist(), strict=True)}
    host = HostStep(plan, staging[:nbytes], counts, attn.plan, sampling,
                    bool((q == 1).all()), arrays["sample_slots"], step.new_slot,
                    spec_width, bool(step.last_drafts.any()))
    host.__dict__["drafts"] = drafts  # (what HostStep.drafts, made when asked, must say)
    return host


# ------------------------------------------------------------------ random steps


class _HostDrafter:
    """A draft model's host side alone (Drafter.host_arrays and the record it keeps),
    without a model."""

    host_arrays = Drafter.host_arrays

    def __init__(self) -> None:
        self._has_prev = np.zeros(SEQS + 1, dtype=bool)


def _random_params(rng: random.Random) -> SamplingParams:
    sampling = rng.random() < 0.5
    return SamplingParams(
        temperature=rng.choice([0.5, 1.0]) if sampling else 0.0,
        top_k=rng.choice([0, 0, 5]), top_p=rng.choice([1.0, 1.0, 0.9]),
        min_p=rng.choice([0.0, 0.0, 0.1]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.2]),
        presence_penalty=rng.choice([0.0, 0.0, 0.5]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.3]),
        seed=rng.choice([None, None, 7]), min_tokens=rng.choice([0, 0, 3]),
        logprobs=rng.choice([None, None, 0, 2]))


class _Steps:
    """Steps as a scheduler might write them: each active slot's context grows by what its
    row computes; slots are taken (a prompt chunk, sampling rows, stop ids) and left."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.context: dict[int, int] = {}  # active slot -> its KV length so far
        self.prompt: dict[int, int] = {}  # its prompt length
        self.next_block = 0

    def next(self, decode: bool) -> tuple[list[StepRow], dict[str, list[Any]]]:
        rng = self.rng
        for slot in list(self.context):
            if rng.random() < 0.1 or self.context[slot] > MAX_LEN - K - 8:
                del self.context[slot]  # finished (or preempted)
        rows: list[StepRow] = []
        entries: dict[str, list[Any]] = {"block_updates": [], "new_slots": [],
                                         "stop_ids": [], "prompt_logprobs": []}
        budget = TOKENS
        for slot, ctx in list(self.context.items()):
            kind = "decode" if decode else rng.choice(["decode", "chunk", "draft"])
            prompt_left = self.prompt[slot] - ctx
            if kind == "chunk" or prompt_left > 0:
                q = max(1, min(prompt_left if prompt_left > 0 else 6, rng.randint(1, 6)))
                tokens = [rng.randrange(3, 100) for _ in range(q)]
                row = StepRow(slot, tokens, ctx + q, prompt_left <= q or rng.random() < 0.3)
            elif kind == "draft":
                d = rng.randint(1, K)
                drafts = [rng.choice([DRAFT_TOKEN, rng.randrange(3, 100)]) for _ in range(d)]
                row = StepRow(slot, [-1, *drafts], ctx + 1 + d, True, num_draft=d,
                              draft_kv=rng.random() < 0.5, last_drafts=rng.random() < 0.3)
            else:
                token = -1 if rng.random() < 0.9 else rng.randrange(3, 100)
                row = StepRow(slot, [token], ctx + 1, rng.random() < 0.9)
            if row.query_len > budget:
                continue
            budget -= row.query_len
            row.adapter_id = rng.randint(0, 2)
            self._blocks(entries, slot, ctx, row.context_len)
            self.context[slot] = row.context_len
            rows.append(row)
        free = [s for s in range(SEQS) if s not in self.context]
        for slot in free if not decode else ():
            if rng.random() < 0.5 or budget < 2:
                continue
            prompt = rng.randint(2, 20)
            q = min(prompt, budget, rng.randint(1, 12))
            budget -= q
            params = _random_params(rng)
            entries["new_slots"].append((slot, encode_slot(params, prompt, rng.randint(0, 1))))
            entries["stop_ids"] += [(slot, rng.randrange(3, 100))
                                    for _ in range(rng.choice([0, 0, 2]))]
            start = sum(r.query_len for r in rows)
            if q > 1 and rng.random() < 0.3:  # prompt logprobs: each token scores the next
                entries["prompt_logprobs"] += [(start + j, rng.randrange(3, 100))
                                               for j in range(q - 1)]
            self._blocks(entries, slot, 0, q)
            self.prompt[slot], self.context[slot] = prompt, q
            rows.append(StepRow(slot, [rng.randrange(3, 100) for _ in range(q)], q,
                                q == prompt))
        return rows, entries

    def _blocks(self, entries: dict[str, list[Any]], slot: int, before: int,
                after: int) -> None:
        for index in range(-(-before // BLOCK), -(-after // BLOCK)):
            entries["block_updates"].append((slot, index, self.next_block % 50))
            self.next_block += 1


def _same(a: HostStep, b: HostStep, staging_a: torch.Tensor, staging_b: torch.Tensor,
          where: str) -> None:
    assert a.packed.numpy().tobytes() == b.packed.numpy().tobytes(), where
    assert staging_a.numpy().tobytes() == staging_b.numpy().tobytes(), where
    assert list(a.counts.items()) == list(b.counts.items()), where
    assert (a.plan, a.attn_plan, a.sampling) == (b.plan, b.attn_plan, b.sampling), where
    assert (a.decode_only, a.spec_width, a.drafts, a.last_drafts) == (
        b.decode_only, b.spec_width, b.drafts, b.last_drafts), where
    for name in ("sample_slots", "new_slot"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.tolist() == y.tolist(), (where, name)


BACKENDS = {"none": None, "torch_sdpa": TorchBackend, "flex": FlexBackend,
            "cpu_kernels": CpuKernelBackend}


@pytest.mark.parametrize("backend_name", list(BACKENDS))
@pytest.mark.parametrize("drafting", [False, True])
def test_steps_pack_as_the_reference_packs_them(backend_name: str, drafting: bool) -> None:
    kind = BACKENDS[backend_name]
    backend = None if kind is None else kind(LIMITS, torch.device("cpu"))
    layout = StagingLayout(StagedFields if kind is None else kind.staging_fields,
                           DraftFields if drafting else StagedFields)
    rng = random.Random(f"{backend_name}-{drafting}")
    steps, ring = _Steps(rng), [local_buffers(step_input_specs(LIMITS)) for _ in range(3)]
    ours, theirs = HostSlotParams(SEQS), _ReferenceParams(SEQS)
    staging = [torch.zeros(layout.nbytes(LIMITS), dtype=torch.uint8) for _ in range(2)]
    drafters: tuple[Any, Any] = (_HostDrafter(), _HostDrafter()) if drafting else (None, None)
    kinds = set()
    for step_id in range(400):
        decode = rng.random() < 0.5
        rows, entries = steps.next(decode)
        buf = ring[step_id % 3]
        plan = write_step(buf, step_id, step_id % 3, rows, **entries)
        got = prepare_host_step(plan, buf, staging[0], ours, layout, backend, drafters[0])
        want = _reference_prepare(plan, buf, staging[1], theirs, layout, backend, drafters[1])
        _same(got, want, staging[0], staging[1], f"step {step_id}: {plan}")
        assert ours.f.tobytes() == theirs.f.tobytes() and ours.i.tobytes() == theirs.i.tobytes()
        kinds.add((got.decode_only, got.spec_width > 0, bool(plan.num_new_slots),
                   bool(plan.num_prompt_logprobs), bool(plan.num_stop_ids),
                   len(got.sample_slots) < plan.num_seqs))
    # the sequence went through every path: steady decodes, drafts, new slots, prompt
    # logprobs, stop ids, rows that do not sample
    assert {k[0] for k in kinds} == {True, False} and {k[1] for k in kinds} == {True, False}
    assert all(any(k[i] for k in kinds) for i in range(2, 6))
    assert (True, False, False, False, False, False) in kinds  # a steady decode, all sampled


def test_the_sampling_flags_are_the_reference_s_for_any_rows() -> None:
    """HostSlotParams.step_sampling (bits kept per slot) against the reference's, for random
    parameters and random subsets of rows, sampled or not."""
    rng = random.Random(5)
    ours, theirs = HostSlotParams(SEQS), _ReferenceParams(SEQS)
    for _ in range(300):
        slots = np.array(rng.sample(range(SEQS), rng.randint(0, 3)), dtype=np.int64)
        rows = [encode_slot(_random_params(rng), 5) for _ in slots]
        f = np.array([r[0] for r in rows], dtype=np.float32).reshape(-1, NUM_F)
        i = np.array([r[1] for r in rows], dtype=np.int64).reshape(-1, NUM_I)
        ours.update(slots, f, i)
        theirs.update(slots, f, i)
        every = np.array(rng.sample(range(SEQS), rng.randint(0, SEQS)), dtype=np.int64)
        sampled = every[[rng.random() < 0.7 for _ in every]] if len(every) else every
        stop = rng.random() < 0.2
        assert ours.step_sampling(sampled, every, stop) == theirs.step_sampling(
            sampled, every, stop)
