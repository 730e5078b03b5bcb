"""The step protocol's shared memory, in one place (see docs/ARCHITECTURE.md, "The step
protocol"): the one table of a step's fields (StepInputs), from which the step-input ring's
layout, its writer (the scheduler's) and its reader (the executor's) derive; the sampled-token
ring; opening both. (What the executor makes of a step for its device is its own:
stages/executor/staging.py, which takes the table's `staged` fields as they are.) Used by the
launcher, both stages, the in-process engine and the benchmarks.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

import numpy as np

from ipc.config import EngineLimits, PipelineConfig
from ipc.messages import SampledTokens, SlotGrammar, SlotLogitBias, StepPlan
from ipc.params import MAX_TOP_LOGPROBS
from ipc.sampling import NUM_F, NUM_I, SlotRow
from ipc.shm import BufferSpec, SharedRing, unlink_segment

# ---------------------------------------------------------------- a step's fields, declared once


# A row's drafted position whose token the executor's draft model proposes (speculative
# decoding with a draft model): the scheduler plans the position, the device fills it.
DRAFT_TOKEN = -2


@dataclass(frozen=True)
class Count:
    """One kind of entry a step holds: the StepPlan field that says how many this step has,
    and the most any step may hold (the ring's capacity)."""

    plan_field: str
    most: Callable[[EngineLimits], int]


TOKENS = Count("num_tokens", lambda lim: lim.max_num_batched_tokens)
ROWS = Count("num_seqs", lambda lim: lim.max_num_seqs)  # one per sequence in the step
BLOCK_UPDATES = Count("num_block_updates", lambda lim: lim.max_block_updates)
NEW_SLOTS = Count("num_new_slots", lambda lim: lim.max_num_seqs)  # sequences taking a slot
STOP_IDS = Count("num_stop_ids", lambda lim: lim.max_stop_ids)  # (slot, id) min_tokens masks
PROMPT_LOGPROBS = Count("num_prompt_logprobs", lambda lim: lim.max_num_batched_tokens)


def _per(count: Count, dtype: str, width: int = 0, *, staged: bool = False) -> Any:
    """A field of the table: `count` entries of `dtype` (each `width` values wide when > 0).
    staged: the executor hands it to its device as it is read (stages/executor/staging.py);
    the others it derives its device's arrays from."""
    return field(metadata={"step_field": (count, dtype, width, staged)})


@dataclass(frozen=True)
class StepInputs:
    """THE table of a step's fields (one spelling each): the ring's buffers, what read_step
    returns (copied out, integers as int64), and what write_step writes. A ROWS field is an
    attribute of the same name of each StepRow; the other counts' fields are the columns, in
    this order, of write_step's entry lists of that count. A new per-row field is one line
    here and one in StepRow."""

    input_ids: np.ndarray = _per(TOKENS, "int64")  # -1: the slot's last sample; DRAFT_TOKEN
    seq_slot: np.ndarray = _per(ROWS, "int32")  # executor slot of each row
    query_len: np.ndarray = _per(ROWS, "int32")  # tokens computed this step
    context_len: np.ndarray = _per(ROWS, "int32")  # KV length after this step
    do_sample: np.ndarray = _per(ROWS, "bool")  # sample after the row's last token
    # speculative decoding: the row's last num_draft tokens are proposed, not known; the
    # executor samples after each of its last num_draft + 1 tokens and accepts a prefix
    num_draft: np.ndarray = _per(ROWS, "int32")
    draft_kv: np.ndarray = _per(ROWS, "bool")  # a draft model keeps the row's KV (runs it too)
    last_drafts: np.ndarray = _per(ROWS, "bool")  # if all stand, it may draft no more
    adapter_id: np.ndarray = _per(ROWS, "int32")  # the row's LoRA adapter; 0: the base model
    # an embedding's prompt chunk: its pooling's code (ipc/pooling.py; 0: none); the chunk
    # that samples ends the prompt, and its pooled vector comes back (SampledTokens.pooled)
    pooling: np.ndarray = _per(ROWS, "int32")
    bt_slot: np.ndarray = _per(BLOCK_UPDATES, "int32", staged=True)  # block_table[slot,
    bt_index: np.ndarray = _per(BLOCK_UPDATES, "int32", staged=True)  # index] = block
    bt_block: np.ndarray = _per(BLOCK_UPDATES, "int32", staged=True)
    new_slot: np.ndarray = _per(NEW_SLOTS, "int32", staged=True)  # taken by a sequence
    new_fparams: np.ndarray = _per(NEW_SLOTS, "float32", NUM_F, staged=True)  # its sampling
    new_iparams: np.ndarray = _per(NEW_SLOTS, "int64", NUM_I, staged=True)  # (ipc/sampling.py)
    stop_slot: np.ndarray = _per(STOP_IDS, "int32", staged=True)  # ids min_tokens suppresses
    stop_id: np.ndarray = _per(STOP_IDS, "int32", staged=True)
    # prompt logprobs: the token (index in input_ids) whose logits score the next prompt
    # token, and that token's id
    plp_index: np.ndarray = _per(PROMPT_LOGPROBS, "int32", staged=True)
    plp_target: np.ndarray = _per(PROMPT_LOGPROBS, "int32", staged=True)


@dataclass(frozen=True)
class StepField:
    """One field of StepInputs, as its metadata declares it."""

    name: str
    count: Count
    dtype: str
    width: int  # values per entry (0: a scalar entry)
    staged: bool

    def shape(self, n: int) -> tuple[int, ...]:
        return (n, self.width) if self.width else (n,)


STEP_FIELDS = tuple(StepField(f.name, *f.metadata["step_field"]) for f in fields(StepInputs))


@dataclass(slots=True)
class StepRow:
    """One sequence's row of a step, as a writer plans it: every ROWS field of StepInputs is
    an attribute of it by the same name (checked below). (Slots: the scheduler makes one per
    sequence per step.)"""

    seq_slot: int
    token_ids: list[int]  # the row's input_ids: -1 for a placeholder, DRAFT_TOKEN
    context_len: int
    do_sample: bool
    num_draft: int = 0
    draft_kv: bool = False
    last_drafts: bool = False
    adapter_id: int = 0
    pooling: int = 0

    @property
    def query_len(self) -> int:
        return len(self.token_ids)


def _check_rows() -> None:
    have = {f.name for f in fields(StepRow)}
    for f in STEP_FIELDS:
        if f.count is ROWS and f.name not in have and not isinstance(
                getattr(StepRow, f.name, None), property):
            raise TypeError(f"StepInputs.{f.name} is per row: StepRow must have it")


_check_rows()
_ROW_GETTERS = tuple((f.name, operator.attrgetter(f.name)) for f in STEP_FIELDS
                     if f.count is ROWS)
# A plain decode row (write_step's num_plain): its own slot and context, one token, sampled,
# every other ROWS field its StepRow default; those are one fill each over the plain rows.
_PLAIN_OWN = ("seq_slot", "context_len")


def _plain_fills() -> tuple[tuple[str, Any], ...]:
    defaults = {f.name: f.default for f in fields(StepRow)} | {"query_len": 1,
                                                                "do_sample": True}
    fills = tuple((f.name, defaults.get(f.name, MISSING)) for f in STEP_FIELDS
                  if f.count is ROWS and f.name not in _PLAIN_OWN)
    for name, value in fills:
        if value is MISSING:
            raise TypeError(f"StepRow.{name} has no default: say what a plain row holds")
    return fills


_PLAIN_FILLS = _plain_fills()
_first_token = operator.itemgetter(0)
_token_lists = operator.attrgetter("token_ids")
# Each entry count's fields, in the table's order: the columns of write_step's entry lists.
_ENTRY_COLUMNS = {count: tuple(f.name for f in STEP_FIELDS if f.count is count)
                  for count in (BLOCK_UPDATES, NEW_SLOTS, STOP_IDS, PROMPT_LOGPROBS)}

# ---------------------------------------------------------------- the two rings


def step_input_specs(limits: EngineLimits) -> tuple[BufferSpec, ...]:
    return (BufferSpec("stamp", "int64", (2,)),  # step id before / after the writer's writes
            *(BufferSpec(f.name, f.dtype, f.shape(f.count.most(limits))) for f in STEP_FIELDS))


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


def write_step(buf: dict[str, np.ndarray], step_id: int, ring_slot: int,
               rows: Sequence[StepRow], *,
               block_updates: Sequence[tuple[int, int, int]] = (),
               new_slots: Sequence[NewSlot] = (),
               stop_ids: Sequence[tuple[int, int]] = (),
               prompt_logprobs: Sequence[tuple[int, int]] = (),
               grammars: list[SlotGrammar] | None = None, num_plain: int = 0,
               logit_biases: list[SlotLogitBias] | None = None) -> StepPlan:
    """Lay a step into ring slot `buf`; returns the plan that names it. `rows` give the ROWS
    fields and the input ids; each entry list is the columns of its count's fields, in the
    table's order: block_updates (slot, index, block), new_slots (slot, its encoded sampling
    parameters), stop_ids (slot, token id), prompt_logprobs (index in input_ids, the prompt
    token it scores). The stamp brackets the write, so a reader can tell a slot that is
    being rewritten. num_plain: rows[:num_plain] are plain decodes (one token, sampled, the
    other ROWS fields their StepRow defaults), as a steady step's rows are: those take three
    passes over the rows instead of one a field."""
    buf["stamp"][0] = step_id
    num_rows, k = len(rows), num_plain
    if k:
        plain = rows if k == num_rows else rows[:k]
        buf["input_ids"][:k] = np.fromiter(map(_first_token, map(_token_lists, plain)),
                                           np.int64, k)
        for name in _PLAIN_OWN:
            buf[name][:k] = np.fromiter(map(operator.attrgetter(name), plain),
                                        buf[name].dtype, k)
        for name, value in _PLAIN_FILLS:
            buf[name][:k] = value
        rows = rows[k:]
    input_ids = [t for r in rows for t in r.token_ids]
    num_tokens = k + len(input_ids)
    buf["input_ids"][k:num_tokens] = input_ids
    for name, get in _ROW_GETTERS:  # (fromiter: no list of Python ints in between)
        buf[name][k:num_rows] = np.fromiter(map(get, rows), buf[name].dtype, num_rows - k)
    entries: dict[Count, Sequence[tuple[Any, ...]]] = {
        BLOCK_UPDATES: block_updates, NEW_SLOTS: [(s, f, i) for s, (f, i) in new_slots],
        STOP_IDS: stop_ids, PROMPT_LOGPROBS: prompt_logprobs}
    for count, values in entries.items():
        if values:
            columns = zip(*values, strict=True)
            for name, column in zip(_ENTRY_COLUMNS[count], columns, strict=True):
                buf[name][:len(values)] = column
    buf["stamp"][1] = step_id
    sizes = {TOKENS: num_tokens, ROWS: num_rows} | {c: len(v) for c, v in entries.items()}
    return StepPlan(step_id=step_id, ring_slot=ring_slot, grammars=grammars or [],
                    logit_biases=logit_biases or [],
                    **{c.plan_field: n for c, n in sizes.items()})


def _none_read(f: StepField) -> np.ndarray:
    """What read_step reads of field `f` in a step that has none of its entries: one shared
    empty array (read-only), of the dtype and width it would have."""
    empty = np.empty(f.shape(0), np.int64 if f.dtype.startswith("int") else f.dtype)
    empty.flags.writeable = False
    return empty


# read_step's plan per field, worked out once (it runs once a step, on the executor's
# critical path): (name, the StepPlan field that counts it, widened to int64, its empty read)
_READS = tuple((f.name, f.count.plan_field, f.dtype.startswith("int"), _none_read(f))
               for f in STEP_FIELDS)


def read_step(buf: dict[str, np.ndarray], plan: StepPlan) -> StepInputs:
    """Copy step `plan` out of ring slot `buf` (integers as int64; a field without entries
    this step is a shared read-only empty array). The stamps are checked before and after
    the copy: a slot rewritten meanwhile raises RingRaceError instead of feeding garbage."""
    check_stamp(buf, plan.step_id)
    columns = {}
    for name, plan_field, widen, none in _READS:
        n = getattr(plan, plan_field)
        if n:
            values = buf[name][:n]
            columns[name] = values.astype(np.int64) if widen else values.copy()
        else:
            columns[name] = none
    inputs = StepInputs(**columns)
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


# ---------------------------------------------------------------- a slot carried to another host

# Pipeline stages on another host (ipc/ranks.py RankLayout.joined_stages) do not map the
# rings: the first rank sends each step's slot with its plan (RemoteStep) and the sampling
# rank each step's samples (RemoteSampled), as each field's used entries in bytes.
Columns = dict[str, bytes]


def slot_columns(buf: dict[str, np.ndarray], counts: dict[str, int]) -> Columns:
    """The first counts[name] entries of each named field of slot `buf`, as bytes."""
    return {name: buf[name][:n].tobytes() for name, n in counts.items() if n > 0}


def put_columns(buf: dict[str, np.ndarray], columns: Columns) -> None:
    """Write `columns` (slot_columns' of a slot of the same layout) into slot `buf`."""
    for name, data in columns.items():
        flat = buf[name].reshape(-1).view(np.uint8)
        if len(data) > len(flat):
            raise ValueError(f"{len(data)} bytes for ring field {name!r} of {len(flat)}")
        flat[:len(data)] = np.frombuffer(data, dtype=np.uint8)


def step_columns(buf: dict[str, np.ndarray], plan: StepPlan) -> Columns:
    """What a step's slot holds for `plan`: its stamp and each field's entries."""
    counts = {f.name: int(getattr(plan, f.count.plan_field)) for f in STEP_FIELDS}
    return slot_columns(buf, {"stamp": 2, **counts})


def sampled_columns(buf: dict[str, np.ndarray], msg: SampledTokens, num_rows: int) -> Columns:
    """What a step's sampled-ring slot holds for `msg` (`num_rows`: the step's rows, the
    most that may have drafts): the fields read_sampled, read_accepted and
    read_prompt_logprobs read."""
    n = msg.num_sampled
    with_logprobs = n if msg.num_top_logprobs >= 0 else 0
    plp = max(0, msg.num_prompt_logprobs)
    return slot_columns(buf, {"token_ids": n, "logprob": with_logprobs,
                              "top_ids": with_logprobs, "top_logprobs": with_logprobs,
                              "num_accepted": num_rows, "plp_logprob": plp, "plp_rank": plp,
                              "plp_top_ids": plp, "plp_top_logprobs": plp})
