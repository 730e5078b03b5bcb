"""Layouts of the two shared rings of the step protocol (see docs/ARCHITECTURE.md).

step-input ring: written by the scheduler, read by the executor (one slot per in-flight step).
sampled-token ring: written by the executor, read by the scheduler.
"""

from __future__ import annotations

import numpy as np

from ipc.shm import BufferSpec


def step_input_specs(
    max_num_seqs: int, max_num_tokens: int, max_block_updates: int
) -> tuple[BufferSpec, ...]:
    return (
        BufferSpec("stamp", "int64", (2,)),  # step id before / after the writer's writes
        BufferSpec("input_ids", "int64", (max_num_tokens,)),  # -1: this slot's last sample
        BufferSpec("seq_slot", "int32", (max_num_seqs,)),  # executor slot of each row
        BufferSpec("query_len", "int32", (max_num_seqs,)),  # tokens computed this step
        BufferSpec("context_len", "int32", (max_num_seqs,)),  # KV length after this step
        BufferSpec("do_sample", "bool", (max_num_seqs,)),  # sample after the row's last token
        BufferSpec("bt_slot", "int32", (max_block_updates,)),  # block_table[slot, index] = block
        BufferSpec("bt_index", "int32", (max_block_updates,)),
        BufferSpec("bt_block", "int32", (max_block_updates,)),
    )


class RingRaceError(RuntimeError):
    """A ring slot was read while it was being rewritten: the slot protocol was broken."""


def check_stamp(buf: dict[str, np.ndarray], step_id: int) -> None:
    """Raise unless slot `buf` holds exactly step `step_id`, completely written."""
    begin, end = int(buf["stamp"][0]), int(buf["stamp"][1])
    if begin != step_id or end != step_id:
        raise RingRaceError(f"step-input slot holds stamps ({begin}, {end}), expected step "
                            f"{step_id}: it was rewritten before the executor finished reading")


MAX_TOP_LOGPROBS = 20


def sampled_specs(max_num_seqs: int) -> tuple[BufferSpec, ...]:
    return (
        BufferSpec("token_ids", "int64", (max_num_seqs,)),
        # only in steps whose SampledTokens has num_top_logprobs >= 0:
        BufferSpec("logprob", "float32", (max_num_seqs,)),  # of the sampled token
        BufferSpec("top_ids", "int64", (max_num_seqs, MAX_TOP_LOGPROBS)),  # most likely first
        BufferSpec("top_logprobs", "float32", (max_num_seqs, MAX_TOP_LOGPROBS)),
    )
