"""Embeddings in the executor: which of a step's tokens an embedding's rows pool (planned on
the host from the step's rows) and, on the device, each slot's running sum of those tokens'
final hidden states, so that a prompt prefilled in chunks over several steps pools every
chunk. Runs in the executor process."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ipc.pooling import CLS, LAST, MEAN
from ipc.step import StepInputs


class PoolRows(NamedTuple):
    """A step's pooling, on the host. A row of an embedding (StepInputs.pooling) adds its
    pooled tokens' hidden states to its slot's sum; the row that samples ends the prompt,
    and its slot's sum over the divisor is the vector."""

    token_index: np.ndarray  # [P] the step's tokens whose hidden states are pooled
    token_slot: np.ndarray  # [P] their slots
    reset_slots: np.ndarray  # [Z] slots whose sums start afresh this step (prompt's start)
    done_slots: np.ndarray  # [R] slots whose prompt ends this step, in row order
    divisor: np.ndarray  # [R] float32: tokens in each one's sum


def plan_pooling(step: StepInputs, starts: np.ndarray) -> PoolRows | None:
    """The pooling of step `step` whose rows start at `starts` in its tokens; None when no
    row pools (one check, on the path of every step). A mean or cls row's prompt is never
    from the prefix cache (the scheduler computes it in full): its first chunk starts at
    position 0, where its sum is reset (a preempted one computes its prompt again)."""
    rows = step.pooling.nonzero()[0]
    if not len(rows):
        return None
    index: list[np.ndarray] = []
    resets, done, divisor = [], [], []
    for r in rows.tolist():
        mode, slot, q = int(step.pooling[r]), int(step.seq_slot[r]), int(step.query_len[r])
        ctx, start, ends = int(step.context_len[r]), int(starts[r]), bool(step.do_sample[r])
        if mode == MEAN:
            index.append(np.arange(start, start + q))
        elif mode == LAST and ends:
            index.append(np.array([start + q - 1]))
        elif mode == CLS and ctx == q:  # (the chunk that holds the first token)
            index.append(np.array([start]))
        else:
            index.append(np.zeros(0, np.int64))
        if ctx == q or mode == LAST:
            resets.append(slot)
        if ends:
            done.append(slot)
            divisor.append(ctx if mode == MEAN else 1)
    slots = np.repeat(step.seq_slot[rows], [len(i) for i in index])
    return PoolRows(np.concatenate(index).astype(np.int64), slots.astype(np.int64),
                    np.asarray(resets, np.int64), np.asarray(done, np.int64),
                    np.asarray(divisor, np.float32))


class Pooler:
    """Each slot's sum of pooled hidden states [slots, hidden] float32, on the device, made
    on the first embedding (a generation-only engine holds none)."""

    def __init__(self, num_slots: int, device: torch.device) -> None:
        self.num_slots, self.device = num_slots, device
        self.sums: torch.Tensor | None = None

    def pool(self, hidden: torch.Tensor, plan: PoolRows) -> torch.Tensor | None:
        """Add hidden [P, hidden] (the final norm's output of plan.token_index) to their
        slots' sums; returns the vectors [R, hidden] float32 of the slots whose prompt
        ended (None: none did)."""
        if self.sums is None:
            self.sums = torch.zeros(self.num_slots, hidden.shape[-1], dtype=torch.float32,
                                    device=self.device)
        sums, to = self.sums, self.device
        if len(plan.reset_slots):
            sums[torch.from_numpy(plan.reset_slots).to(to)] = 0
        if len(plan.token_slot):
            sums.index_add_(0, torch.from_numpy(plan.token_slot).to(to), hidden.float())
        if not len(plan.done_slots):
            return None
        done = sums[torch.from_numpy(plan.done_slots).to(to)]
        return done / torch.from_numpy(plan.divisor).to(to)[:, None]


def vector_bytes(vectors: torch.Tensor) -> list[bytes]:
    """Pooled vectors [R, hidden] float32 (any device) as one little-endian buffer each."""
    host = vectors.detach().to("cpu", torch.float32).numpy().astype("<f4", copy=False)
    return [row.tobytes() for row in host]
