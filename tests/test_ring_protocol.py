"""The step protocol's shared memory (ipc/step.py): a step written by the scheduler reads back
exactly, and the ring never hands the executor a slot that is being rewritten: the stamps that
bracket each write are checked before and after the executor copies a slot out."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ipc.config import EngineLimits
from ipc.messages import SamplingParams, StepPlan, TokenizedRequest
from ipc.sampling import encode_slot
from ipc.step import (
    ROWS,
    STEP_FIELDS,
    RingRaceError,
    StepRow,
    check_stamp,
    local_buffers,
    read_step,
    step_input_specs,
    write_step,
)
from stages.executor.backends.base import AttentionBackend
from stages.executor.backends.flex import FlexBackend, FlexFields
from stages.executor.backends.torch_sdpa import TorchBackend, TorchFields
from stages.executor.sampler import HostSlotParams
from stages.executor.staging import DeviceStep, StagingLayout
from stages.executor.step_inputs import HostStep, prepare_host_step
from stages.scheduler.core import Scheduler

SEQS, TOKENS = 4, 64
LIMITS = EngineLimits(SEQS, TOKENS, 4, 128, 100, (2,), depth=2)


def _ring() -> dict[str, np.ndarray]:
    return local_buffers(step_input_specs(LIMITS))


def _planned_step(step_count: int = 1) -> tuple[Scheduler, list]:
    core = Scheduler(LIMITS, 64)
    for i in range(3):
        core.add_request(TokenizedRequest(str(i), "", [5, 6, 7, 8, 9], SamplingParams(max_tokens=5),
                                          0.0))
    return core, [core.schedule() for _ in range(step_count)]


def _prepare(plan: StepPlan, ring: dict[str, np.ndarray],
             backend: type[AttentionBackend] = TorchBackend
             ) -> tuple[HostStep, DeviceStep]:
    """The step packed as `backend`'s executor packs it, and the device's views of it."""
    layout = StagingLayout(backend.staging_fields)
    staging = torch.zeros(layout.nbytes(LIMITS), dtype=torch.uint8)
    host = prepare_host_step(plan, ring, staging, HostSlotParams(SEQS), layout,
                             backend(LIMITS, torch.device("cpu")))
    return host, layout.unpack(host.packed.clone(), host.counts)  # a copy, as on CUDA


def test_plain_leading_rows_write_the_same_bytes_as_the_general_path() -> None:
    """write_step's num_plain (a steady step's decodes, a fill for each constant column) lays
    the same slot as each row's own attributes, whatever rows follow the plain ones."""
    rng = np.random.default_rng(7)
    for num_plain in (0, 1, SEQS - 1, SEQS):
        rows = [StepRow(int(rng.integers(SEQS)), [int(rng.integers(-1, 100))],
                        int(rng.integers(1, 120)), True) for _ in range(num_plain)]
        rows += [StepRow(int(rng.integers(SEQS)), [5] * int(rng.integers(1, 4)), 7,
                         bool(rng.integers(2)), int(rng.integers(2)), True, True,
                         int(rng.integers(3))) for _ in range(SEQS - num_plain)]
        general, plain = _ring(), _ring()
        for buf in (general, plain):  # (stale values a fill must overwrite)
            for f in STEP_FIELDS:
                buf[f.name][...] = 3
        plans = [write_step(general, 5, 0, rows), write_step(plain, 5, 0, rows,
                                                              num_plain=num_plain)]
        assert plans[0] == plans[1]
        for f in STEP_FIELDS:
            assert np.array_equal(general[f.name], plain[f.name]), (num_plain, f.name)


def test_a_step_reads_back_as_written_and_packs_for_the_device() -> None:
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=-3, min_tokens=2, logprobs=4)
    row = encode_slot(params, 5, 1)
    ring = _ring()
    plan = write_step(ring, 9, 2, [StepRow(3, [5, 6, 7], 3, True),
                                   StepRow(1, [-1], 8, False, adapter_id=4)],
                      block_updates=[(3, 0, 11), (1, 2, 40)], new_slots=[(3, row)],
                      stop_ids=[(3, 2), (3, 7)])
    assert plan == StepPlan(9, 2, 2, 4, 2, 1, 2)
    got = read_step(ring, plan)
    assert got.input_ids.tolist() == [5, 6, 7, -1]
    assert got.seq_slot.tolist() == [3, 1] and got.query_len.tolist() == [3, 1]
    assert got.context_len.tolist() == [3, 8] and got.do_sample.tolist() == [True, False]
    assert got.adapter_id.tolist() == [0, 4] and got.num_draft.tolist() == [0, 0]
    assert list(zip(got.bt_slot.tolist(), got.bt_index.tolist(), got.bt_block.tolist(),
                    strict=True)) == [(3, 0, 11), (1, 2, 40)]
    assert got.new_slot.tolist() == [3]
    assert got.new_fparams[0].tolist() == pytest.approx(row[0])
    assert got.new_iparams[0].tolist() == row[1]
    assert list(zip(got.stop_slot.tolist(), got.stop_id.tolist(), strict=True)) == [(3, 2),
                                                                                      (3, 7)]
    host, v = _prepare(plan, ring)  # the eager PyTorch backend's fields
    assert v.input_ids.tolist() == [5, 6, 7, -1]
    assert v.positions.tolist() == [0, 1, 2, 7]  # the decode row sits at context 8
    assert v.logits_indices.tolist() == [2] and v.sample_slots.tolist() == [3]
    decodes = TorchFields(v.views)
    assert decodes.decode_slots.tolist() == [1] and decodes.decode_lens.tolist() == [8]
    assert "query_rows" not in v.views  # the compiled backend's fields
    assert [(g.start, g.end, g.max_len) for g in host.attn_plan.decode_groups] == [(0, 1, 8)]
    assert [(p.start, p.end, p.slot, p.context_len) for p in host.attn_plan.prefills] == [
        (0, 3, 3, 3)]
    assert v.new_fparams.view(1, -1).tolist()[0] == pytest.approx(row[0])
    assert v.new_iparams.tolist() == row[1]
    assert v.stop_id.tolist() == [2, 7]
    assert host.sampling.use_seed and host.sampling.use_logprobs and host.sampling.use_min_tokens
    # The compiled attention's query blocks (pages of 4 positions): the prompt's 3 tokens in
    # slot 3's page 0 at rows 0-2; the decode at position 7, page 1 of slot 1, at row 4 + 3.
    # Padded: 4 tokens is a bucket already; the query blocks grow to the bound for 4 tokens,
    # the extra ones the padding slot's (SEQS).
    host, v = _prepare(plan, ring, FlexBackend)
    assert "decode_slots" not in v.views and not host.attn_plan.per_row  # (a prompt row)
    flex = FlexFields(v.views)
    assert v.input_ids.tolist() == [5, 6, 7, -1] and flex.query_rows.tolist() == [0, 1, 2, 7]
    assert flex.qblock_slots.tolist() == [3, 1, SEQS, SEQS, SEQS]
    assert flex.qblock_pages.tolist() == [0, 1, 0, 0, 0]
    assert v.logits_indices.tolist() == [2]


def test_every_field_of_the_step_table_reads_back_as_written() -> None:
    """Each field of the table (ipc/step.py StepInputs) round-trips through a ring slot with
    no code of its own: a row's from the StepRow attribute of its name, the other counts'
    from the columns of their entry lists; the staged ones reach the device's views as read."""
    ring = _ring()
    rows = [StepRow(2, [4, 5], 9, True, num_draft=1, draft_kv=True, last_drafts=True,
                    adapter_id=3),
            StepRow(0, [-1], 6, False, adapter_id=0), StepRow(3, [7, 8, 9], 3, True)]
    row = encode_slot(SamplingParams(temperature=0.5, top_k=7), 3, 0)
    plan = write_step(ring, 4, 1, rows, block_updates=[(2, 1, 5), (3, 0, 6)],
                      new_slots=[(3, row)], stop_ids=[(3, 2)],
                      prompt_logprobs=[(3, 8), (4, 9)])
    got = read_step(ring, plan)
    for f in STEP_FIELDS:
        values = getattr(got, f.name)
        assert values.dtype == (np.int64 if f.dtype.startswith("int") else f.dtype), f.name
        assert len(values) == getattr(plan, f.count.plan_field), f.name
        if f.count is ROWS:
            assert values.tolist() == [getattr(r, f.name) for r in rows], f.name
    assert got.input_ids.tolist() == [4, 5, -1, 7, 8, 9] and got.query_len.tolist() == [2, 1, 3]
    assert got.bt_block.tolist() == [5, 6] and got.plp_target.tolist() == [8, 9]
    assert got.new_iparams.tolist() == [row[1]] and got.stop_id.tolist() == [2]
    host, v = _prepare(plan, ring)
    for f in STEP_FIELDS:
        if f.staged:
            assert v.views[f.name].view(-1).tolist() == pytest.approx(
                getattr(got, f.name).reshape(-1).tolist()), f.name


def test_a_completely_written_slot_is_accepted() -> None:
    _, (step,) = _planned_step()
    ring = _ring()
    _prepare(step.write(ring), ring)


def test_a_slot_half_rewritten_by_the_next_step_is_refused() -> None:
    _, (step,) = _planned_step()
    ring = _ring()
    plan = step.write(ring)
    ring["stamp"][0] = step.step_id + 3  # a later step began writing into the same slot
    with pytest.raises(RingRaceError, match="rewritten before the executor finished"):
        _prepare(plan, ring)


class _RewrittenWhileRead(dict):  # type: ignore[type-arg]
    """A ring slot whose writer starts on it while the executor is copying it out."""

    def __init__(self, ring: dict[str, np.ndarray], step_id: int) -> None:
        super().__init__(ring)
        self.step_id = step_id

    def __getitem__(self, name: str) -> np.ndarray:
        if name == "new_fparams":  # in the middle of the copy
            super().__getitem__("stamp")[0] = self.step_id + 3
        return super().__getitem__(name)


def test_a_slot_rewritten_while_it_is_being_read_is_refused() -> None:
    _, (step,) = _planned_step()
    ring = _ring()
    plan = step.write(ring)
    with pytest.raises(RingRaceError):
        _prepare(plan, _RewrittenWhileRead(ring, step.step_id))


def test_scheduler_never_reuses_a_ring_slot_still_in_flight() -> None:
    core, _ = _planned_step(step_count=0)
    seen_in_flight: set[int] = set()
    for _ in range(30):
        while (step := core.schedule()) is not None:
            assert step.ring_slot not in seen_in_flight
            seen_in_flight.add(step.ring_slot)
        if not core.inflight:
            break
        done = core.inflight[0]
        core.on_sampled(done.step_id, [11] * len(done.sampled_rows))
        seen_in_flight.discard(done.ring_slot)
    assert sorted(core.free_ring_slots) == [0, 1, 2]
    check_stamp({"stamp": np.array([4, 4])}, 4)
