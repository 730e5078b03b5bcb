"""The executor core: model, paged KV cache and per-slot device state. No sockets.

Owns, on the device: the KV cache, the block table of every slot, each slot's last sampled
token (the placeholder value) and sampling parameters. A step is `prepare()` on the host
(any time after the previous one) then `compute()` on the device, strictly in step order.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np
import torch

from ipc.config import EngineLimits
from ipc.families import read_config
from ipc.gguf_source import gguf_source
from ipc.lora import LoraConfig
from ipc.messages import StepPlan
from ipc.sampling import GREEDY_SLOT
from ipc.speculative import SpeculativeConfig
from ipc.step import StepRow, local_buffers, step_input_specs, write_step
from stages.executor.backends.base import AttentionBackend, ForwardTables
from stages.executor.backends.select import ForwardRequest, Selection, select_backend
from stages.executor.compile import CompileStats, compile_layers
from stages.executor.drafter import Drafter, DraftFields
from stages.executor.grammar_mask import SlotGrammars
from stages.executor.graphs import DecodeGraphs
from stages.executor.host_memory import keep_freed_memory
from stages.executor.kv_pool import FORMATS, KVFormat, KVPool, kv_format
from stages.executor.linear.select import select_linear_method
from stages.executor.models import load_model
from stages.executor.models.base import CausalLM
from stages.executor.parallel import PipelineParallel, TensorParallel
from stages.executor.pooling import Pooler, PoolRows
from stages.executor.preflight import check_draft
from stages.executor.sampler import (
    HostSlotParams,
    SampleOutput,
    SamplingState,
    accept_drafts,
    score_prompt,
)
from stages.executor.staging import DeviceStep, StagedFields, StagingLayout
from stages.executor.step_inputs import HostStep, prepare_host_step
from stages.grammar import Grammars, words_per_row

# A step's grammar work, done while its forward runs: (their slots, the sampled rows with a
# matcher and their bitmask, both staged in host memory for the device).
GrammarMask = tuple[np.ndarray, torch.Tensor, torch.Tensor] | None
# The structured rows' samples on their way to the matchers: (slots, tokens, whether each
# stood (None: all did), the event that says they arrived (CUDA), all in host memory).
PendingTokens = tuple[np.ndarray, torch.Tensor, torch.Tensor | None, Any]

logger = logging.getLogger(__name__)


class Runner(Protocol):
    """What a device runs: the model, or the timed instrument."""

    device: torch.device
    num_blocks: int
    slots: SlotState

    def prepare(self, plan: StepPlan, ring: dict[str, np.ndarray]) -> HostStep: ...

    def compute(self, step: HostStep, packed: torch.Tensor) -> SampleOutput: ...

    def work_ahead(self, came: Callable[[], bool]) -> None: ...


class SlotState:
    """Per-slot device state shared by every runner: block table, last sample, sampling
    parameters and penalty counts, and the matchers of structured outputs; the staging
    buffers that steps are packed into, with `backend`'s fields (None: the common ones) and,
    `drafting` (a draft model proposes), its passes'. Slot max_num_seqs is the padding
    tokens' (a compiled backend's): its block table row in each KV group points at
    `pad_block`. The block table holds each KV group's rows one after the other
    (`group_tables`: a view of each), as the scheduler numbers them (KVGroup.rows)."""

    def __init__(self, limits: EngineLimits, device: torch.device, pin: bool,
                 backend: AttentionBackend | None = None, pad_block: int = 0,
                 grammars: Grammars | None = None, drafting: bool = False) -> None:
        self.device, self.limits, self.backend = device, limits, backend
        self.layout = StagingLayout(
            backend.staging_fields if backend is not None else StagedFields,
            DraftFields if drafting else StagedFields)
        self.drafter: Drafter | None = None  # set by a runner with a draft model
        n, num_groups = limits.max_num_seqs, len(limits.kv_windows)
        self.block_table = torch.zeros(num_groups * (n + 1), limits.max_blocks_per_seq,
                                       dtype=torch.int32, device=device)
        self.group_tables = [self.block_table[g * (n + 1):(g + 1) * (n + 1)]
                             for g in range(num_groups)]
        for table in self.group_tables:
            table[n] = pad_block
        self.last_sampled = torch.zeros(n + 1, dtype=torch.int64, device=device)
        self.sampling = SamplingState(n, limits.vocab_size, device)
        self.host_params = HostSlotParams(n)
        # One packed staging buffer per ring slot: rewritten only after its step completed.
        self.staging = [torch.zeros(self.layout.nbytes(limits), dtype=torch.uint8, pin_memory=pin)
                        for _ in range(limits.num_ring_slots)]
        # Structured outputs: the matchers, and a bitmask buffer per ring slot (on CUDA, a
        # step's mask may still be copying while the next step fills its own).
        self.matchers = SlotGrammars(grammars) if grammars is not None else None
        self._bitmasks = ([torch.zeros(limits.max_sampled, words_per_row(limits.vocab_size),
                                       dtype=torch.int32,
                                       pin_memory=pin) for _ in range(limits.num_ring_slots)]
                          if grammars is not None else [])
        # ... the sampled rows they apply to (a copy from pageable memory would wait for the
        # whole queued forward on CUDA), and the tokens those rows sampled, on their way back
        self._mask_rows = ([torch.zeros(limits.max_sampled, dtype=torch.int64, pin_memory=pin)
                            for _ in range(limits.num_ring_slots)] if grammars is not None else [])
        x = limits.max_sampled
        self._mask_tokens = ([torch.zeros(x, dtype=torch.int64, pin_memory=pin)
                              for _ in range(limits.num_ring_slots)]
                             if grammars is not None else [])
        # ... and whether each stood (rows with drafts)
        self._mask_stands = ([torch.zeros(x, dtype=torch.bool, pin_memory=pin)
                              for _ in range(limits.num_ring_slots)]
                             if grammars is not None and limits.num_speculative_tokens else [])
        # (slots, their tokens in host memory, whether each stood (None: all did), the event
        # that says they arrived (CUDA)): sampled by the last step, not yet consumed by the
        # matchers
        self._pending: PendingTokens | None = None
        self._grammar_thread: ThreadPoolExecutor | None = None

    def prepare(self, plan: StepPlan, ring: dict[str, np.ndarray]) -> HostStep:
        return prepare_host_step(plan, ring, self.staging[plan.ring_slot], self.host_params,
                                 self.layout, self.backend, self.drafter)

    def resolve_ids(self, v: DeviceStep) -> torch.Tensor:
        """The step's input ids [T], placeholders resolved from each slot's last sample."""
        ids = v.input_ids
        return torch.where(ids < 0, self.last_sampled[v.token_slots], ids)

    def apply(self, step: HostStep, v: DeviceStep,
              resolve: bool = True) -> torch.Tensor | None:
        """Apply the step's slot changes on the device; returns its input ids [T] with
        placeholders resolved (and counted for penalties), or None when not `resolve` and
        no penalty needs them (a graph resolves its own)."""
        if step.counts["bt_slot"]:
            self.block_table[v.bt_slot, v.bt_index] = v.bt_block.int()
        if step.counts["new_slot"]:
            self.sampling.init_slots(v.new_slot, v.new_fparams, v.new_iparams,
                                     v.stop_slot, v.stop_id)
            if step.plan.logit_biases:
                self.sampling.set_logit_biases(step.plan.logit_biases)
        if not (resolve or step.sampling.use_penalties):
            return None
        ids = self.resolve_ids(v)
        if step.sampling.use_penalties:
            real = slice(0, step.num_tokens)  # not the padding
            self.sampling.count_tokens(ids[real], v.token_slots[real], v.positions[real])
        return ids

    def start_grammar(self, step: HostStep) -> Future[GrammarMask] | None:
        """Start the step's grammar work on a thread of its own, to run while the forward
        does: the matchers take the tokens sampled last and this step's new slots, then the
        bitmask of its structured rows is filled. None when no row has a structured output
        (nothing is done at all)."""
        m = self.matchers
        if m is None or not (m or step.plan.grammars or self._pending is not None):
            return None
        if self._grammar_thread is None:
            self._grammar_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        pending, self._pending = self._pending, None
        return self._grammar_thread.submit(self._grammar_work, step, pending)

    def host_buffers(self) -> list[torch.Tensor]:
        """The host memory a step's device work copies from or to (page-locked on CUDA)."""
        return [*self.staging, *self._bitmasks, *self._mask_rows, *self._mask_tokens,
                *self._mask_stands]

    def _grammar_work(self, step: HostStep, pending: PendingTokens | None) -> GrammarMask:
        m = self.matchers
        assert m is not None
        if pending is not None:
            slots, tokens, stands, arrived = pending
            if arrived is not None:  # CUDA: this thread waits for the copy, nothing else does
                arrived.synchronize()
            m.consume(slots, tokens.numpy(), stands.numpy() if stands is not None else None)
        given = {g.slot: g for g in step.plan.grammars}
        for slot in step.new_slot.tolist():
            g = given.get(slot)
            m.admit(slot, g.grammar if g else "", g.output_ids if g else (),
                    g.reasoning if g else None)
        rows, slots = m.rows(step.sample_slots)
        if not len(rows):
            return None
        staged = self._mask_rows[step.plan.ring_slot][:len(rows)]
        staged.numpy()[:] = rows
        return slots, staged, m.fill(slots, self._bitmasks[step.plan.ring_slot], step.drafts)

    def keep_last(self, step: HostStep, v: DeviceStep, out: SampleOutput) -> None:
        """Each sampled slot's last sample (the next step's placeholder); for a row with
        drafts, the sample after the drafts it accepts (out.accepted says how many stand)."""
        self.last_sampled[v.sample_slots] = out.tokens  # (a row with drafts: fixed below)
        if step.spec_width:
            out.accepted, last, out.stands = accept_drafts(
                out.tokens, v.spec_sampled, v.spec_draft, step.spec_width)
            self.last_sampled[v.spec_slots] = last

    def sample(self, step: HostStep, v: DeviceStep, logits: torch.Tensor,
               grammar_work: Future[GrammarMask] | None = None) -> SampleOutput:
        """Sample the step's rows; grammar_work: from start_grammar, awaited here (the
        forward has run meanwhile)."""
        slots = v.sample_slots
        work = None
        if grammar_work is not None:
            try:
                work = grammar_work.result()
            except Exception as exc:  # a grammar the library fails on ends its requests only
                logger.exception("the grammar work of step %d failed", step.plan.step_id)
                assert self.matchers is not None
                self.matchers.fail_all(f"grammar error: {exc}")
        mask = None
        if work is not None:
            _, rows, bitmask = work
            mask = (rows.to(self.device, non_blocking=True),
                    bitmask.to(self.device, non_blocking=True))
        out = self.sampling.sample(logits, slots, v.positions[v.logits_indices],
                                   step.sampling, mask)
        self.keep_last(step, v, out)
        if work is not None and mask is not None:
            ring_slot, num_rows = step.plan.ring_slot, len(mask[0])
            host = self._mask_tokens[ring_slot][:num_rows]
            host.copy_(out.tokens.index_select(0, mask[0]), non_blocking=True)
            stands = None
            if out.stands is not None:
                stands = self._mask_stands[ring_slot][:num_rows]
                stands.copy_(out.stands.index_select(0, mask[0]), non_blocking=True)
            arrived = None
            if self.device.type == "cuda":  # the grammar thread sleeps on it, not spins
                arrived = torch.cuda.Event(blocking=True)
                arrived.record()
            self._pending = (work[0], host, stands, arrived)
        if self.matchers is not None:
            self.matchers.mark_failed(step.sample_slots, out.tokens)
        return out


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes of a model's parameters and buffers as loaded (a tied weight once)."""
    seen: dict[int, int] = {}
    for t in (*model.parameters(), *model.buffers()):
        try:
            key = t.data_ptr()
        except RuntimeError:  # (an opaque tensor, oneDNN's: its own)
            key = id(t)
        seen[key] = max(seen.get(key, 0), t.numel() * t.element_size())
    return sum(seen.values())


WARM_UP_ROW = 256  # tokens a row of the warm-up step holds (more where the rows run out)


def describe_kv_groups(windows: Sequence[int | None]) -> str:
    """The KV groups (EngineLimits.kv_windows), as the start-up log says them."""
    if len(windows) == 1:
        return "" if windows[0] is None else f", a window of {windows[0]} on every layer"
    return (f", {len(windows)} KV groups of its blocks: {windows.count(None)} for the "
            f"layers that read every key, {len(windows) - windows.count(None)} for the "
            f"windowed layers (window {windows[-1]})")


class ModelRunner:
    """The real model path, through its attention backend (backends/select.py says which):
    compiled (padded steps, FlexAttention), the CPU kernels, or eager PyTorch. Compiled,
    decode steps can replay a graph per bucket (graphs.py): captured CUDA graphs on CUDA; on
    the CPU (`graphs=True`, for tests) the same static buffers run as plain calls."""

    def __init__(self, model: CausalLM, limits: EngineLimits, kv_cache_memory: int,
                 device: torch.device, grammars: Grammars | None = None,
                 graphs: bool | None = None, selection: Selection | None = None,
                 draft: CausalLM | None = None,
                 kv_format: KVFormat = FORMATS["auto"]) -> None:
        """draft: a draft model (speculative decoding), whose KV cache shares the memory:
        each block id holds the target's KV and the draft's (both in `kv_format`)."""
        self.model, self.limits, self.device = model, limits, device
        self.backend = backend = model.backend
        self.selection = selection
        self.tp: TensorParallel | None = None
        self.pp: PipelineParallel | None = model.stage
        bs = limits.block_size
        scratch = backend.scratch_blocks  # where padding tokens write
        # The layers' places (ArchSpec.kv_places): a block holds the KV of one layer per
        # place, whichever KV group it serves (one place a layer with a single group).
        layers = self.pp.layers if self.pp is not None else range(model.spec.num_layers)
        every = backend.kv_places(model.spec)
        places = [every[i][1] for i in layers]
        per_block = KVPool.bytes_per_block(kv_format, model.kv_shape, bs, len(set(places)))
        if draft is not None:  # (its KV beside the target's, in one group: kept_windows)
            assert len(limits.kv_windows) == 1
            per_block += KVPool.bytes_per_block(kv_format, draft.kv_shape, bs)
        self.num_blocks = kv_cache_memory // per_block - scratch
        if self.pp is not None:  # stages of fewer layers fit more: the engine has the fewest
            self.num_blocks = self.pp.fewest(self.num_blocks, device)
        groups = len(limits.kv_windows)  # (a token takes a block in each KV group)
        if self.num_blocks < groups:
            raise ValueError(f"--kv-cache-memory {kv_cache_memory} bytes holds "
                             f"{max(self.num_blocks, 0)} KV blocks, fewer than the model's "
                             f"{groups} KV groups need for one token ({per_block} bytes "
                             f"each{', and one of scratch' * scratch})")
        self.kv = KVPool(kv_format, model.kv_shape, self.num_blocks + scratch, bs, device,
                         places)
        self.kv_caches = self.kv.caches
        self.compiled = backend.compiled
        self.slots = SlotState(limits, device, device.type == "cuda", backend,
                               pad_block=self.num_blocks if scratch else 0, grammars=grammars,
                               drafting=draft is not None)
        self.pooler = Pooler(limits.max_num_seqs + 1, device)  # (embeddings' sums)
        backend.bind(ForwardTables(self.slots.group_tables, model.ropes,
                                   self.num_blocks + scratch))
        self.drafter = self.slots.drafter = (
            Drafter(draft, limits, self.num_blocks + scratch, self.slots.block_table, device,
                    kv_format)
            if draft is not None else None)
        self.compile_stats = (compile_layers(model.model.layers, limits, device)
                              if self.compiled else CompileStats())
        if self.compiled:  # (one graph per bucket: the last layer takes every row too)
            model.trim_last_layer = False
        if graphs is None:
            graphs = device.type == "cuda"
        self.graphs = (DecodeGraphs(self._graph_forward, backend, self.slots.layout, device,
                                    device.type == "cuda")
                       if graphs and backend.graph_fields and self.pp is None else None)
        assert self.graphs is None or self.drafter is None, "graphs beside a draft model"
        logger.info("forward: %s (%s); weights %.1f MiB%s; KV cache: %s, %d blocks of %d "
                    "tokens (%.1f MiB)%s", backend.name,
                    selection.reason if selection else "given", weight_bytes(model) / 2**20,
                    f" (layers {self.pp.layers.start}-{self.pp.layers.stop - 1})"
                    if self.pp is not None else "",
                    self.kv.describe(), self.num_blocks, limits.block_size,
                    self.num_blocks * per_block / 2**20, describe_kv_groups(limits.kv_windows))

    @property
    def cpu_kernels(self) -> bool:
        return self.backend.name == "cpu_kernels"

    @classmethod
    def from_dir(cls, model_dir: str, dtype: torch.dtype, device: torch.device,
                 limits: EngineLimits, kv_cache_memory: int,
                 compile: bool | None = False, pack: bool | None = None,
                 graphs: bool | None = None, tp: TensorParallel | None = None,
                 pp: PipelineParallel | None = None, cpu_kernels: bool | None = None,
                 quantization: str | None = None,
                 speculative: SpeculativeConfig | None = None,
                 kv_cache_dtype: str = "auto", lora: LoraConfig | None = None) -> ModelRunner:
        """The forward is chosen first (select_backend: `compile` and `cpu_kernels` as asked,
        None for the default), then the weight format (select_linear_method: `quantization`
        as asked, else `pack` None packs for oneDNN where it can), then the model is built
        with both. tp: this rank's shard of the model (parallel.py); rank 0 samples.
        speculative: with a draft model, that model is loaded too (load_draft).
        kv_cache_dtype: the KV cache's format (kv_pool.py), which the forward must read.
        lora: the run's LoRA adapters, loaded with the model (stages/executor/lora.py)."""
        if device.type == "cpu":  # (the forward's activations: reused, not faulted in again)
            keep_freed_memory()
        _, spec = read_config(model_dir)
        selection = select_backend(ForwardRequest(
            device.type, compile, cpu_kernels, limits.block_size,
            tp.size if tp is not None else 1, spec.moe is not None, kv_cache_dtype))
        backend = selection.load()(limits, device, spec.windows)
        linear = select_linear_method(dtype, device, selection.compiled, pack, quantization,
                                      gguf_source(model_dir), selection.backend == "cpu_kernels",
                                      limits.max_num_seqs)
        model = load_model(model_dir, dtype, device, limits.max_model_len, backend, linear, tp,
                           pp, lora)
        samples = (tp is None or tp.rank == 0) and (pp is None or pp.last)
        grammars = (Grammars(model_dir, limits.vocab_size, limits.eos_token_ids[0],
                             end_token_ids=limits.eos_token_ids)
                    if limits.eos_token_ids and samples else None)
        draft = None
        if speculative is not None and speculative.is_draft_model:
            draft = load_draft(speculative, limits.vocab_size, dtype, device, limits,
                               selection, tp is not None)
        runner = cls(model, limits, kv_cache_memory, device, grammars, graphs, selection,
                     draft, kv_format(kv_cache_dtype))
        runner.tp = tp
        return runner

    def prepare(self, plan: StepPlan, ring: dict[str, np.ndarray]) -> HostStep:
        return self.slots.prepare(plan, ring)

    @torch.inference_mode()
    def compute(self, step: HostStep, packed: torch.Tensor) -> SampleOutput:
        """Run `step` whose packed buffer is already on the device; returns its samples."""
        v = self.slots.layout.unpack(packed, step.counts)
        if self.pp is not None:
            began = time.perf_counter()
            out = self._compute_stage(step, v, self.pp)
            self.pp.stepped(time.perf_counter() - began)
            return out
        # (an embedding's one-token prompt is a decode-shaped step, but it pools: no graph)
        graph = self.graphs is not None and step.pool is None and self.graphs.eligible(step)
        ids = self.slots.apply(step, v, resolve=not graph)
        grammar_work = self.slots.start_grammar(step)
        if self.drafter is not None:  # (beside the CPU kernels: never a graph, ids resolved)
            assert ids is not None
            ids = self.drafter.propose(v, ids, self.slots.last_sampled, step.spec_width,
                                       step.last_drafts)
        if graph:
            assert self.graphs is not None
            logits = self.graphs.run(step, packed, v.logits_indices)
            if logits is not None:
                return self.slots.sample(step, v, logits, grammar_work)
        if ids is None:  # (its bucket's first step: the ordinary path)
            ids = self.slots.resolve_ids(v)
        meta = self.backend.metadata(v, step.attn_plan)
        if self.model.lora is not None:  # (which rows take which adapter: lora.py)
            if step.plan.lora_loads:  # (adapters loaded at run time, in step order)
                self.model.lora.swap(self.model.model.layers, self.model.dtype,
                                     step.plan.lora_loads, step.plan.lora_evictions)
            self.model.lora.step = step.lora
        wanted, num_scored = v.logits_indices, step.counts["plp_index"]
        if num_scored:  # prompt logprobs: the logits of the positions that score them too
            wanted = torch.cat([wanted, v.plp_index])
        pooled = None
        if step.pool is None:
            logits = self.model(ids, self.kv_caches, meta, wanted)
        else:
            logits, pooled = self._forward_pooling(ids, meta, wanted, step.pool)
        num_sampled = step.counts["logits_indices"]
        if logits is None:  # a tensor-parallel rank other than 0: its samples come from 0
            return self._follow(v)
        out = self.slots.sample(step, v, logits[:num_sampled], grammar_work)
        out.pooled = pooled
        if self.drafter is not None:
            self.drafter.keep_prev(v, ids, out, step.spec_width)
            out.began_ns = self.drafter.began_ns
        if self.tp is not None:  # what the other ranks keep as these slots' last samples
            self.tp.broadcast(self.slots.last_sampled[v.sample_slots])
        if num_scored:
            out.prompt = score_prompt(logits[num_sampled:], v.plp_target)
        return out

    def _forward_pooling(self, ids: torch.Tensor, meta: Any, wanted: torch.Tensor,
                         pool: PoolRows) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward of a step with embeddings' rows: the final hidden states of the wanted
        rows and of the pooled tokens in one pass, the first turned into logits, the others
        added to their slots' sums (pooling.py); returns (logits, the vectors of the
        embeddings whose prompt ended, if any)."""
        index = torch.from_numpy(pool.token_index).to(self.device, wanted.dtype)
        x = self.model.hidden_states(ids, self.kv_caches, meta, torch.cat([wanted, index]))
        n = wanted.shape[0]
        return self.model.head(x[:n]), self.pooler.pool(x[n:], pool)

    def _compute_stage(self, step: HostStep, v: DeviceStep,
                       pp: PipelineParallel) -> SampleOutput:
        """This pipeline stage's part of `step` (parallel.py): the first resolves the ids
        (once the samples they take have come from the last stage) and embeds them, the others
        take the previous stage's hidden states; a stage before the last passes its own on and
        returns no samples; the last samples, sends them to the first, and returns them (on
        its first tensor rank; its other ranks return none)."""
        if pp.first:
            if step.placeholder_slots:
                pp.settle(step.placeholder_slots, self.slots.last_sampled)
            ids = self.slots.apply(step, v)
            assert ids is not None
            hidden = None
        else:  # (the last stage's own samples are current: penalties count from them)
            ids = self.slots.apply(step, v, resolve=False)
            hidden = pp.recv_hidden(v.input_ids.shape[0], self.model.spec.hidden,
                                    self.model.dtype, self.device)
        meta = self.backend.metadata(v, step.attn_plan)
        none = SampleOutput(v.sample_slots[:0])
        if not pp.last:
            x = self.model(ids, self.kv_caches, meta, v.logits_indices, hidden)
            if pp.first:  # (before the send: once the step is on its way it may report, and
                # this step's ring slot and staging buffer may be planned again at once)
                pp.expect_samples(step.plan.step_id, v.sample_slots, step.sample_slots.tolist(),
                                  self.slots.last_sampled)
            pp.send_hidden(x)
            return none
        grammar_work = self.slots.start_grammar(step)
        wanted, num_scored = v.logits_indices, step.counts["plp_index"]
        if num_scored:
            wanted = torch.cat([wanted, v.plp_index])
        logits = self.model(v.input_ids, self.kv_caches, meta, wanted, hidden)
        if logits is None:  # a tensor rank other than the stage's first: it samples nothing
            return none
        num_sampled = step.counts["logits_indices"]
        out = self.slots.sample(step, v, logits[:num_sampled], grammar_work)
        pp.send_samples(out.tokens)
        if num_scored:
            out.prompt = score_prompt(logits[num_sampled:], v.plp_target)
        return out

    @torch.inference_mode()
    def work_ahead(self, came: Callable[[], bool]) -> None:
        """Device work the next step will want, done before its plan comes (the device has
        nothing else to run), until `came()` says a step came: the draft model's passes
        of rows that drafted last step."""
        if self.drafter is not None:
            self.drafter.work_ahead(self.slots.last_sampled, came)

    def _follow(self, v: DeviceStep) -> SampleOutput:
        assert self.tp is not None
        slots = v.sample_slots
        tokens = self.tp.broadcast(torch.empty(len(slots), dtype=torch.int64,
                                               device=self.device))
        self.slots.last_sampled[slots] = tokens
        return SampleOutput(tokens)

    def _graph_forward(self, v: DeviceStep, wanted: torch.Tensor) -> torch.Tensor:
        """A decode step's forward from a graph's static inputs (graphs.py): placeholder ids
        resolved from the last samples, the metadata, the model, the wanted rows' logits."""
        ids = self.slots.resolve_ids(v)
        meta = self.backend.metadata(v, self.backend.graph_plan())
        return self.model(ids, self.kv_caches, meta, wanted)

    def execute(self, plan: StepPlan, ring: dict[str, np.ndarray]) -> SampleOutput:
        """prepare + compute, synchronously (tests, the in-process engine)."""
        step = self.prepare(plan, ring)
        return self.compute(step, step.packed.to(self.device))

    def warm_up(self) -> int:
        """On the CPU kernels' forward: one step of prompt rows as large as a step may be (the
        token budget, as far as the KV cache holds it), run before the engine serves, so that
        its first requests do not pay for the memory a large step's activations fault in
        (kept afterwards: host_memory.py) nor for first calls. Its rows take slots 0, 1, ...
        and blocks 0, 1, ... like any sequence; every one of them is set afresh when a request
        takes it (new slots) and its KV rewritten before it is read. Every tensor-parallel
        rank runs it alike. Returns the tokens run (0: not on this forward)."""
        if not self.cpu_kernels:
            return 0
        limits, size = self.limits, self.limits.block_size
        groups = len(limits.kv_windows)  # (each maps the row's pages, in its own rows)
        total = min(limits.max_num_batched_tokens, self.num_blocks // groups * size)
        # (rows of a prompt's usual length, not one long one whose attention would cost more)
        per_row = min(limits.max_model_len, max(WARM_UP_ROW, -(-total // limits.max_num_seqs)))
        lens: list[int] = []
        updates: list[tuple[int, int, int]] = []
        left = total
        while left > 0 and len(lens) < limits.max_num_seqs:
            # (a row's last block partly filled: never more blocks than the cache holds)
            n = min(per_row, left, (self.num_blocks - len(updates)) // groups * size)
            if n <= 0:
                break
            slot, pages = len(lens), -(-n // size)
            updates += [(g * (limits.max_num_seqs + 1) + slot, index,
                         len(updates) + g * pages + index)
                        for g in range(groups) for index in range(pages)]
            lens.append(n)
            left -= n
        ring = local_buffers(step_input_specs(limits))
        ids = [t % limits.vocab_size for t in range(sum(lens))]
        starts = np.cumsum([0, *lens]).tolist()
        rows = [StepRow(slot, ids[starts[slot]:starts[slot + 1]], n, True)
                for slot, n in enumerate(lens)]
        plan = write_step(ring, 0, 0, rows, block_updates=updates,
                          new_slots=[(slot, GREEDY_SLOT) for slot in range(len(lens))])
        began = time.perf_counter()
        self.execute(plan, ring)
        logger.info("warmed up: a step of %d prompt tokens in %.2f s", sum(lens),
                    time.perf_counter() - began)
        return sum(lens)


def load_draft(cfg: SpeculativeConfig, vocab_size: int, dtype: torch.dtype,
               device: torch.device, limits: EngineLimits, target: Selection,
               tensor_parallel: bool) -> CausalLM:
    """The draft model of `cfg` (its folder, its weights quantized as it says), on the
    target's device in its dtype, with a forward of its own; what preflight.check_draft
    refuses is refused here too."""
    assert cfg.model is not None
    spec = check_draft(cfg, vocab_size, target, 2 if tensor_parallel else 1, device.type)
    backend = target.load()(limits, device, spec.windows)
    linear = select_linear_method(dtype, device, False, None, cfg.quantization,
                                  gguf_source(cfg.model), target.backend == "cpu_kernels",
                                  limits.max_num_seqs)
    return load_model(cfg.model, dtype, device, limits.max_model_len, backend, linear)


class TimedRunner:
    """A measuring instrument, not a model: its device (device.py TimedDevice) takes
    `a + b * tokens` milliseconds a step, after `s` ms of the host's own work to launch it,
    and it emits deterministic tokens, to measure the orchestration alone as a fast device
    would expose it. Same slot protocol as the model."""

    def __init__(self, a_ms: float, b_ms: float, limits: EngineLimits,
                 s_ms: float = 0.0, pp: PipelineParallel | None = None) -> None:
        """pp: one stage of a pipeline of such instruments, each taking the step time (its
        device passes each step on: device.py TimedDevice)."""
        self.a_ms, self.b_ms, self.s_ms = a_ms, b_ms, s_ms
        self.pp = pp
        self.device = torch.device("cpu")
        self.vocab_size = limits.vocab_size
        # (every page of every slot's sequence, in each KV group)
        self.num_blocks = (limits.max_num_seqs * limits.max_blocks_per_seq
                           * len(limits.kv_windows))
        self.slots = SlotState(limits, self.device, False)

    def prepare(self, plan: StepPlan, ring: dict[str, np.ndarray]) -> HostStep:
        return self.slots.prepare(plan, ring)

    def step_ms(self, step: HostStep) -> float:
        """How long the step occupies the instrument's device."""
        return self.a_ms + self.b_ms * step.num_tokens

    @torch.inference_mode()
    def compute(self, step: HostStep, packed: torch.Tensor) -> SampleOutput:
        """The step's tokens, at once (its device time is the device's to charge).
        Sampling parameters are ignored: the tokens are a function of the context,
        (id * 1103515245 + position + 12345) % vocab at each sampled position. (Its host
        time counts, on the host loop's thread: a decode step whose rows all sample, whose
        sampled positions are its tokens, skips the two gathers; the formula is three
        calls, in place.)"""
        v = self.slots.layout.unpack(packed, step.counts)
        if self.pp is not None and not self.pp.last:  # (the last stage samples)
            self.slots.apply(step, v, resolve=False)
            return SampleOutput(v.sample_slots[:0])
        ids = self.slots.apply(step, v)
        assert ids is not None
        positions = v.positions
        if not (step.decode_only and step.counts["logits_indices"] == step.num_tokens):
            idx = v.logits_indices  # (else each token's position samples: idx is 0..T-1)
            ids, positions = ids[idx], positions[idx]
        tokens = torch.add(positions, ids, alpha=1103515245).add_(12345)
        out = SampleOutput(tokens.remainder_(self.vocab_size))
        self.slots.keep_last(step, v, out)
        return out

    def work_ahead(self, came: Callable[[], bool]) -> None:
        """(Nothing: an instrument's steps have no work to run ahead.)"""

    execute = ModelRunner.execute
