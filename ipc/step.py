"""The step protocol's shared memory, in one place (see docs/ARCHITECTURE.md, "The step
protocol"): the layouts of the step-input ring (written by the scheduler, read by the executor)
and the sampled-token ring (written by the executor, read by the scheduler), opening both,
and writing and reading one step with its stamps. (What the executor makes of a step for its
device is its own: stages/executor/staging.py.) Used by the launcher, both stages, the
in-process engine and the benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ipc.config import EngineLimits, PipelineConfig
from ipc.messages import SlotGrammar, StepPlan
from ipc.params import MAX_TOP_LOGPROBS
from ipc.sampling import NUM_F, NUM_I, SlotRow
from ipc.shm import BufferSpec, SharedRing, unlink_segment

# ---------------------------------------------------------------- the two rings


# A row's drafted position whose token the executor's draft model proposes (speculative
# decoding with a draft model): the scheduler plans the position, the device fills it.
DRAFT_TOKEN = -2


def step_input_specs(limits: EngineLimits) -> tuple[BufferSpec, ...]:
    s, t, u = limits.max_num_seqs, limits.max_num_batched_tokens, limits.max_block_updates
    return (
        BufferSpec("stamp", "int64", (2,)),  # step id before / after the writer's writes
        # -1: this slot's last sample; DRAFT_TOKEN: a draft the executor's draft model makes
        BufferSpec("input_ids", "int64", (t,)),
        BufferSpec("seq_slot", "int32", (s,)),  # executor slot of each row
        BufferSpec("query_len", "int32", (s,)),  # tokens computed this step
        BufferSpec("context_len", "int32", (s,)),  # KV length after this step
        BufferSpec("do_sample", "bool", (s,)),  # sample after the row's last token
        # speculative decoding: the row's last num_draft tokens are proposed, not known; the
        # executor samples after each of its last num_draft + 1 tokens and accepts a prefix
        BufferSpec("num_draft", "int32", (s,)),
        # ... with a draft model: the draft model keeps the row's KV (runs its tokens too)
        BufferSpec("draft_kv", "bool", (s,)),
        BufferSpec("last_drafts", "bool", (s,)),
        BufferSpec("bt_slot", "int32", (u,)),  # block_table[slot, index] = block
        BufferSpec("bt_index", "int32", (u,)),
        BufferSpec("bt_block", "int32", (u,)),
        BufferSpec("new_slot", "int32", (s,)),  # sequences taking a slot this step
        BufferSpec("new_fparams", "float32", (s, NUM_F)),  # their rows (ipc/sampling.py)
        BufferSpec("new_iparams", "int64", (s, NUM_I)),
        BufferSpec("stop_slot", "int32", (limits.max_stop_ids,)),  # ids min_tokens suppresses
        BufferSpec("stop_id", "int32", (limits.max_stop_ids,)),
        # prompt logprobs: the token (index in input_ids) whose logits score the next prompt
        # token, and that token's id
        BufferSpec("plp_index", "int32", (t,)),
        BufferSpec("plp_target", "int32", (t,)),
    )


def sampled_specs(limits: EngineLimits) -> tuple[BufferSpec, ...]:
    s, t, x = limits.max_num_seqs, limits.max_num_batched_tokens, limits.max_sampled
    return (
        # one per sampled position: a row's, and one per draft of a row that has drafts
        BufferSpec("token_ids", "int64", (x,)),
        # only in steps whose SampledTokens has num_top_logprobs >= 0:
        BufferSpec("logprob", "float32", (x,)),  # of the sampled token
        BufferSpec("top_ids", "int64", (x, MAX_TOP_LOGPROBS)),  # most likely first
        BufferSpec("top_logprobs", "float32", (x, MAX_TOP_LOGPROBS)),
        # one per row with drafts, in row order: how many of its sampled positions stand
        # (the drafts the sampler agreed with, and its own token after them)
        BufferSpec("num_accepted", "int32", (s,)),
        # only in steps whose SampledTokens has num_prompt_logprobs > 0, one per StepPlan pair:
        BufferSpec("plp_logprob", "float32", (t,)),  # of the target prompt token
        BufferSpec("plp_rank", "int32", (t,)),  # its rank under the model (1: most likely)
        BufferSpec("plp_top_ids", "int64", (t, MAX_TOP_LOGPROBS)),
        BufferSpec("plp_top_logprobs", "float32", (t, MAX_TOP_LOGPROBS)),
    )


@dataclass
class StepRings:
    """Both rings of one run, `limits.num_ring_slots` slots each, in /dev/shm under the run id.
    The executor creates them before it reports ready, the scheduler attaches, and the
    launcher removes the names once both have them mapped: at every moment some living
    process of the run can remove them (a stage orphaned by its launcher does)."""

    steps: SharedRing
    sampled: SharedRing

    @classmethod
    def open(cls, cfg: PipelineConfig, *, create: bool) -> StepRings:
        limits = cfg.limits
        n = limits.num_ring_slots
        steps = SharedRing(cfg.step_ring_name, step_input_specs(limits), n, create=create)
        try:
            sampled = SharedRing(cfg.sampled_ring_name, sampled_specs(limits), n, create=create)
        except BaseException:
            if create:
                steps.unlink()
            raise
        return cls(steps, sampled)

    def unlink(self) -> None:
        """Remove both names; mappings stay valid. Safe to call twice."""
        self.steps.unlink()
        self.sampled.unlink()

    @staticmethod
    def unlink_names(cfg: PipelineConfig) -> None:
        """Remove both names of every engine of a run without mapping them (the launcher, an
        orphaned stage); safe whether or not they exist."""
        for engine in {*range(cfg.data_parallel_size), cfg.engine}:  # (one that joined)
            StepRings.unlink_engine_names(cfg.for_engine(engine))

    @staticmethod
    def unlink_engine_names(cfg: PipelineConfig) -> None:
        """Remove both names of engine cfg.engine alone (one that is started again: the
        others' rings are in use); safe whether or not they exist."""
        for name in (cfg.step_ring_name, cfg.sampled_ring_name):
            unlink_segment(name)


def local_buffers(specs: tuple[BufferSpec, ...]) -> dict[str, np.ndarray]:
    """One slot's buffers in this process's memory (the in-process engine, benchmarks)."""
    return {s.name: np.zeros(s.shape, dtype=s.dtype) for s in specs}


# ---------------------------------------------------------------- one step in, one step out


class RingRaceError(RuntimeError):
    """A ring slot was read while it was being rewritten: the slot protocol was broken."""


def check_stamp(buf: dict[str, np.ndarray], step_id: int) -> None:
    """Raise unless slot `buf` holds exactly step `step_id`, completely written."""
    begin, end = int(buf["stamp"][0]), int(buf["stamp"][1])
    if begin != step_id or end != step_id:
        raise RingRaceError(f"step-input slot holds stamps ({begin}, {end}), expected step "
                            f"{step_id}: it was rewritten before the executor finished reading")


NewSlot = tuple[int, SlotRow]  # (executor slot, its encoded sampling parameters)


def write_step(buf: dict[str, np.ndarray], step_id: int, ring_slot: int, *,
               input_ids: list[int], seq_slots: list[int], query_lens: list[int],
               context_lens: list[int], do_sample: list[bool],
               block_updates: list[tuple[int, int, int]], new_slots: list[NewSlot],
               stop_ids: list[tuple[int, int]],
               grammars: list[SlotGrammar] | None = None,
               prompt_logprobs: list[tuple[int, int]] | None = None,
               num_drafts: list[int] | None = None,
               draft_kv: list[bool] | None = None,
               last_drafts: list[bool] | None = None) -> StepPlan:
    """Lay a step's bulk inputs into ring slot `buf`; returns the plan that names them. The
    stamp brackets the write, so a reader can tell a slot that is being rewritten."""
    buf["stamp"][0] = step_id
    num_seqs, num_tokens = len(seq_slots), len(input_ids)
    buf["input_ids"][:num_tokens] = input_ids
    buf["seq_slot"][:num_seqs] = seq_slots
    buf["query_len"][:num_seqs] = query_lens
    buf["context_len"][:num_seqs] = context_lens
    buf["do_sample"][:num_seqs] = do_sample
    buf["num_draft"][:num_seqs] = num_drafts if num_drafts is not None else 0
    buf["draft_kv"][:num_seqs] = draft_kv if draft_kv is not None else False
    buf["last_drafts"][:num_seqs] = last_drafts if last_drafts is not None else False
    if block_updates:
        updates = np.asarray(block_updates, dtype=np.int32)  # [n, 3]: slot, index, block
        n = len(updates)
        buf["bt_slot"][:n], buf["bt_index"][:n], buf["bt_block"][:n] = updates.T
    for j, (slot, (floats, ints)) in enumerate(new_slots):
        buf["new_slot"][j] = slot
        buf["new_fparams"][j] = floats
        buf["new_iparams"][j] = ints
    if stop_ids:
        pairs = np.asarray(stop_ids, dtype=np.int32)  # [m, 2]: slot, token id
        buf["stop_slot"][:len(pairs)], buf["stop_id"][:len(pairs)] = pairs.T
    if prompt_logprobs:
        scored = np.asarray(prompt_logprobs, dtype=np.int32)  # [p, 2]: token index, target
        buf["plp_index"][:len(scored)], buf["plp_target"][:len(scored)] = scored.T
    buf["stamp"][1] = step_id
    return StepPlan(step_id, ring_slot, num_seqs, num_tokens, len(block_updates),
                    len(new_slots), len(stop_ids), grammars or [], len(prompt_logprobs or ()))


@dataclass(frozen=True)
class StepInputs:
    """One step's arrays, copied out of its ring slot (int64 indices)."""

    input_ids: np.ndarray  # [T], -1: placeholder
    seq_slots: np.ndarray  # [S]
    query_lens: np.ndarray  # [S]
    context_lens: np.ndarray  # [S]
    do_sample: np.ndarray  # [S] bool
    num_draft: np.ndarray  # [S] proposed tokens at the end of each row
    draft_kv: np.ndarray  # [S] bool: the draft model keeps the row's KV
    last_drafts: np.ndarray  # [S] bool: if all stand, the row's sequence may draft no more
    bt_slot: np.ndarray  # [U]
    bt_index: np.ndarray  # [U]
    bt_block: np.ndarray  # [U]
    new_slots: np.ndarray  # [N]
    new_fparams: np.ndarray  # [N, NUM_F] float32
    new_iparams: np.ndarray  # [N, NUM_I]
    stop_slots: np.ndarray  # [M]
    stop_ids: np.ndarray  # [M]
    plp_index: np.ndarray  # [P] tokens whose logits score a prompt token
    plp_target: np.ndarray  # [P] the token each scores


def read_step(buf: dict[str, np.ndarray], plan: StepPlan) -> StepInputs:
    """Copy step `plan` out of ring slot `buf`. The stamps are checked before and after the
    copy: a slot rewritten meanwhile raises RingRaceError instead of feeding garbage."""
    check_stamp(buf, plan.step_id)
    s, u, n, m = plan.num_seqs, plan.num_block_updates, plan.num_new_slots, plan.num_stop_ids

    def ints(name: str, count: int) -> np.ndarray:
        return buf[name][:count].astype(np.int64)  # a copy

    inputs = StepInputs(
        ints("input_ids", plan.num_tokens), ints("seq_slot", s), ints("query_len", s),
        ints("context_len", s), buf["do_sample"][:s].copy(), ints("num_draft", s),
        buf["draft_kv"][:s].copy(), buf["last_drafts"][:s].copy(), ints("bt_slot", u),
        ints("bt_index", u), ints("bt_block", u), ints("new_slot", n),
        buf["new_fparams"][:n].copy(), ints("new_iparams", n), ints("stop_slot", m),
        ints("stop_id", m), ints("plp_index", plan.num_prompt_logprobs),
        ints("plp_target", plan.num_prompt_logprobs))
    check_stamp(buf, plan.step_id)
    return inputs


# Logprobs of one step's sampled rows, in row order: (logprob, top ids, top logprobs).
StepLogprobs = tuple[list[float], list[list[int]], list[list[float]]]
# A step's prompt-token logprobs, in the order of its plan's pairs: (logprob, rank, top ids,
# top logprobs), all MAX_TOP_LOGPROBS alternatives.
PromptLogprobs = tuple[list[float], list[int], list[list[int]], list[list[float]]]


def read_prompt_logprobs(buf: dict[str, np.ndarray], count: int) -> PromptLogprobs | None:
    if count <= 0:
        return None
    return (buf["plp_logprob"][:count].tolist(), buf["plp_rank"][:count].tolist(),
            buf["plp_top_ids"][:count].tolist(), buf["plp_top_logprobs"][:count].tolist())


def read_sampled(buf: dict[str, np.ndarray], num_sampled: int, num_top_logprobs: int
                 ) -> tuple[list[int], StepLogprobs | None]:
    """A step's sampled ids, one per sampled position (and, if it computed them, logprobs
    with k alternatives)."""
    n, k = num_sampled, num_top_logprobs
    ids = buf["token_ids"][:n].tolist()
    if k < 0:
        return ids, None
    return ids, (buf["logprob"][:n].tolist(), buf["top_ids"][:n, :k].tolist(),
                 buf["top_logprobs"][:n, :k].tolist())


def read_accepted(buf: dict[str, np.ndarray], num_rows: int) -> list[int]:
    """How many sampled positions stand in each of a step's `num_rows` rows with drafts."""
    return buf["num_accepted"][:num_rows].tolist()
