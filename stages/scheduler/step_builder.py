"""Lays out the rows of one step, in the scheduler process: decodes first, then chunks of
prompts (chunked prefill), then waiting samples admitted in the queue policy's order, with
each row's drafts and the prompt positions whose logprobs the step computes.

With P pipeline stages (EngineLimits.pipeline_stages), the first stage runs step k while the
later ones run steps k - 1 .. k - P + 1, whose samples it has not got yet: a sequence one of
those steps samples sits step k out (else the first stage would wait for that sample, and the
stages behind it idle), and the running sequences take turns in P sets of about equal size
(StepBuilder._fill_staged)."""

from __future__ import annotations

import time
from collections import Counter
from operator import attrgetter

from ipc.config import EngineLimits
from ipc.messages import SlotGrammar, SlotLogitBias
from ipc.pooling import POOLING_CODES
from ipc.sampling import encode_slot
from stages.scheduler.adapters import AdapterSlots
from stages.scheduler.drafts import DraftPlanner
from stages.scheduler.kv_manager import KVManager, Preempt
from stages.scheduler.planned import PlannedRow, PlannedStep
from stages.scheduler.queue_policy import QueuePolicy
from stages.scheduler.sequence import SeqStatus, Sequence
from stages.scheduler.stopping import reaches_length, suppressed_ids


class StepBuilder:
    """Fills a PlannedStep within the step's token budget. It changes the samples it plans
    (num_computed, num_pending, blocks, slots) but not the step's bookkeeping around them
    (its id, ring slot, in-flight counts: Scheduler.schedule)."""

    def __init__(self, limits: EngineLimits, max_len: int, queue: QueuePolicy, kv: KVManager,
                 drafts: DraftPlanner | None, preempt: Preempt) -> None:
        self.limits, self.max_len = limits, max_len
        self.queue, self.kv, self.drafts, self.preempt = queue, kv, drafts, preempt
        self.stages = limits.pipeline_stages
        self.adapters = AdapterSlots(limits.lora_names, limits.lora_paths,
                                     limits.lora_slots)

    def fill(self, step: PlannedStep) -> None:
        budget = self.limits.max_num_batched_tokens
        queue, kv = self.queue, self.kv
        if queue.waiting:
            queue.promote_within_sender()
        if queue.waiting and not kv.free_slots and not kv.victims:
            victim = queue.share_slots(kv.running, self.limits.max_num_seqs)
            if victim is not None:
                self.preempt(victim)
        decodes: list[Sequence] = []
        prefills: list[Sequence] = []
        running, max_len = SeqStatus.RUNNING, self.max_len
        for seq in kv.running:  # (wants_step, inline: a call per sequence per step)
            if seq.status is not running or seq.num_drafted_inflight:
                continue
            num_outputs = len(seq.output_ids) + seq.num_pending
            num_tokens = len(seq.prompt_ids) + num_outputs
            left = num_tokens - seq.num_computed
            if left <= 0 or num_outputs >= seq.output_limit and reaches_length(
                    seq.params, num_outputs, num_tokens, max_len):
                continue
            if left != 1:
                prefills.append(seq)
            elif not seq.params.pooling:
                decodes.append(seq)
            elif not seq.num_pending:  # an embedding's last prompt token: a pooled row
                prefills.append(seq)
            # (else an embedding's prompt is all planned: it waits for its vector, no more)
        if self.stages > 1:
            self._fill_staged(step, decodes, prefills, budget)
            return
        # Decodes first (_plan_decodes), then prefill chunks. Only a preemption in this step
        # can make a sequence listed above not want its row any more: then each is asked.
        budget = self._plan_decodes(step, decodes, budget)
        for seq in prefills:
            if budget <= 0:
                break
            if step.has_preempted and not self.wants_step(seq):
                continue
            budget -= self._plan_row(step, seq, budget)
        if queue.waiting:
            self._admit(step, budget)

    def _fill_staged(self, step: PlannedStep, decodes: list[Sequence],
                     prefills: list[Sequence], budget: int) -> None:
        """fill's rows with P > 1 stages. A decode whose pending sample comes from one of
        the P - 1 steps before this one is held back (a prompt chunk's tokens are all known:
        a sequence with a sample pending has exactly one token left, so it is a decode). The
        rest are planned as with one stage, up to a cap on the rows: N candidates (running,
        and waiting for which a slot is free) make P sets of N // P, N % P of them one more, so
        a step takes N // P + 1 rows only while fewer than N % P of the steps in the
        pipeline took as many (the held back show what each took). The sets come out within
        a row of each other from the first P steps on, and again after sequences finish or
        join: a set over its size leaves a sequence to the next step, which passes one on in
        turn, up to a set under its size. If nothing else could run (every candidate held back,
        or the waiting ones short of blocks), the oldest held back are planned anyway, up to
        the same cap (so that fewer sequences than stages, or too few
        for as many sets as the pipeline holds, spread out again): the first stage waits for
        their samples, which beats an idle step (one stream still runs ahead)."""
        stages, queue = self.stages, self.queue
        last_in_pipeline = step.step_id - stages  # (its sample is back as this step starts)
        ready: list[Sequence] = []
        held: list[Sequence] = []
        for seq in decodes:
            if seq.num_pending and seq.sampled_in_step > last_in_pipeline:
                held.append(seq)
            else:
                ready.append(seq)
        # (waiting samples count where a slot is free for them now)
        num_admissible = min(len(queue.waiting), len(self.kv.free_slots))
        num_seqs = len(decodes) + len(prefills) + num_admissible
        small, num_large = divmod(num_seqs, stages)  # P sets: num_large of small + 1
        # A large set only while fewer than num_large of the steps in the pipeline hold one;
        # what is left over joins the next step, and so on up to a small one.
        held_sets = Counter(seq.sampled_in_step for seq in held)
        is_large = sum(n > small for n in held_sets.values()) < num_large
        max_rows = max(1, small + is_large)
        budget = self._plan_decodes(step, ready[:max_rows], budget)
        rows = step.rows
        for seq in prefills:
            if budget <= 0 or len(rows) >= max_rows:
                break
            if step.has_preempted and not self.wants_step(seq):
                continue
            budget -= self._plan_row(step, seq, budget)
        if queue.waiting:
            budget = self._admit(step, budget, max_rows)
        if not rows and held:  # (nothing else could run, admission included: see above)
            self._plan_decodes(step, sorted(held, key=attrgetter("sampled_in_step"))[:max_rows],
                               budget)
        elif budget > 0 and not step.has_preempted and not step.is_starved:
            self._plan_unsampled(step, prefills, budget)
        for row in rows:
            if row.do_sample:
                row.seq.sampled_in_step = step.step_id

    def _plan_unsampled(self, step: PlannedStep, prefills: list[Sequence],
                        budget: int) -> None:
        """With P > 1 stages, the budget the capped rows left goes to prompts' chunks that
        stop one token short of the prompt's end (running ones first, then admitted ones):
        they sample nothing, so they wait on no stage and join no set, and the prompt's last
        token comes in a step of the set it joins. Without them a set whose sequences all
        decode takes a step of a row each while the other set's prompts fill theirs: the
        first stage, done with the short step, waits for the long one's samples, and the
        later stages idle through the short one."""
        for seq in prefills:
            if budget <= 0:
                return
            if seq not in step.members and seq.num_tokens - seq.num_computed > 1:
                budget -= self._plan_row(step, seq, budget, short_of_end=True)
        if self.queue.waiting and budget > 0 and not step.is_starved:
            self._admit(step, budget, short_of_end=True)

    def wants_step(self, seq: Sequence) -> bool:
        if seq.status is not SeqStatus.RUNNING or seq.num_drafted_inflight:
            return False
        num_tokens = seq.num_tokens
        if seq.num_computed >= num_tokens:
            return False  # all computed: waiting for its sample
        # Stop planning once the tokens in flight already reach a length limit.
        return not reaches_length(seq.params, seq.num_outputs, num_tokens, self.max_len)

    def _plan_decodes(self, step: PlannedStep, decodes: list[Sequence], budget: int) -> int:
        """Plan the sequences with one token to compute, in order, while the budget lasts;
        returns the budget left. Without drafts, a row is that token (the newest sampled, -1
        while it is in flight) at context + 1, sampled, straight from the sequence's state
        (as _plan_row would lay it: a decode never plans prompt logprobs, since only its
        prompt's last token is left, which scores nothing); a block is mapped only where
        the row crosses into a new one."""
        if self.drafts is not None:
            for seq in decodes:
                if budget <= 0:
                    break
                if not step.has_preempted or self.wants_step(seq):
                    budget -= self._plan_row(step, seq, budget)
            return budget
        kv, bs, rows, members = self.kv, self.kv.block_size, step.rows, step.members
        is_leading = not rows  # (then its rows are the step's first: write_step's num_plain)
        num_planned, num_plain = 0, -1
        for seq in decodes:
            if num_planned >= budget:
                break
            if step.has_preempted and not self.wants_step(seq):
                continue
            start = seq.num_computed
            if start >= len(seq.blocks) * bs and not kv.grow(step, seq, start + 1,
                                                              self.preempt):
                step.is_starved = True
                continue
            members.add(seq)
            if seq.num_pending:
                token = -1
            else:
                out = seq.output_ids
                token = out[-1] if out else seq.prompt_ids[-1]
            seq.num_computed = start + 1
            assert seq.slot is not None  # (a running sequence holds its slot from admission)
            # (plain: without drafts, draft_model_kv is False: _init_slot)
            rows.append(PlannedRow(seq.slot, [token], start + 1, True, seq=seq,
                                   adapter_id=seq.adapter_id))
            if seq.adapter_id and num_plain < 0:  # (a plain row is the base model's)
                num_plain = num_planned
            seq.num_pending += 1
            num_planned += 1
        step.num_tokens += num_planned
        step.num_sampled += num_planned
        if is_leading:
            step.num_plain = num_planned if num_plain < 0 else num_plain
        return budget - num_planned

    def _plan_row(self, step: PlannedStep, seq: Sequence, budget: int,
                  short_of_end: bool = False) -> int:
        """Add seq's next chunk to step; returns the tokens used (0 if it must wait).
        short_of_end: the chunk stops before seq's last token, and takes only free blocks
        (_plan_unsampled: an extra, not worth a preemption)."""
        start, num_tokens = seq.num_computed, seq.num_tokens
        num_new = self.kv.chunk_end(
            start, min(num_tokens - short_of_end, start + budget)) - start
        if not self.kv.grow(step, seq, start + num_new,
                            None if short_of_end else self.preempt):
            step.is_starved = True
            return 0
        step.members.add(seq)
        if seq.scores_prompt:
            self._plan_prompt_logprobs(step, seq, start, start + num_new)
        tokens = seq.tokens(start, start + num_new)
        dp = self.drafts
        if seq.draft_model_kv and dp is not None and dp.over_batch(len(self.kv.running)):
            seq.draft_model_kv = False  # (for good: its draft KV would have holes)
        drafts = (dp.drafts(step, seq, budget - num_new, self.kv)
                  if dp is not None and num_tokens - start == 1 and not seq.params.pooling
                  else [])
        seq.num_computed = start + num_new + len(drafts)
        do_sample = seq.num_computed >= num_tokens
        assert seq.slot is not None  # (a running sequence holds its slot from admission)
        # (by position: a row per sequence per step, and keywords cost a third more here)
        step.rows.append(PlannedRow(
            seq.slot, tokens + drafts, seq.num_computed, do_sample, len(drafts),
            seq.draft_model_kv,
            bool(drafts) and dp is not None and dp.is_last(seq, len(drafts)), seq.adapter_id,
            seq=seq))
        if seq.params.pooling:  # (an embedding's chunk: the executor pools its tokens)
            step.rows[-1].pooling = POOLING_CODES[seq.params.pooling]
        step.num_tokens += num_new + len(drafts)
        if do_sample:
            seq.num_pending += 1 + len(drafts)
            step.num_sampled += 1 + len(drafts)
        if drafts and dp is not None:
            seq.num_drafted_inflight += 1
            dp.count_planned(len(drafts))
        return num_new + len(drafts)

    def _plan_prompt_logprobs(self, step: PlannedStep, seq: Sequence, start: int,
                              end: int) -> None:
        """The positions [start, end) about to be planned whose logits score the next prompt
        token, unless an earlier step (before a preemption) already scored it."""
        prompt = seq.prompt_ids
        first = max(start, seq.num_plp_planned)
        last = min(end, len(prompt) - 1)
        if first >= last:
            return
        base = step.num_tokens - start  # index in the step of the row's position 0
        step.prompt_logprobs += [(base + p, prompt[p + 1]) for p in range(first, last)]
        step.plp_owners.append((seq, last - first))
        seq.num_plp_planned = last

    def _admit(self, step: PlannedStep, budget: int, max_rows: int | None = None,
               short_of_end: bool = False) -> int:
        """Admit waiting samples in the queue's order while the budget, slots and blocks
        last (and the step has fewer than max_rows rows, with pipeline stages); the first
        that does not fit ends admission (no overtaking). short_of_end: each takes a chunk
        that stops before its last token (_plan_unsampled), if the whole chunk would fit;
        one with no more to compute than that token ends admission too."""
        queue, kv = self.queue, self.kv
        while (queue.waiting and budget > 0 and kv.free_slots and not step.is_starved
               and not step.has_preempted
               and (max_rows is None or len(step.rows) < max_rows)):
            queue.promote_within_sender()
            seq = queue.waiting[0]
            hit = kv.cached_prefix(seq)
            start = hit.num_blocks * kv.block_size
            # (short of its end, it still must fit as a whole chunk would: else its last
            # token, planned next, would preempt for the block it saved)
            if (seq.num_tokens - short_of_end <= start
                    or not kv.admits(step, hit, kv.chunk_end(start, min(seq.num_tokens,
                                                                          start + budget)))):
                break
            if seq.adapter_id and not self.adapters.take(
                    seq.adapter_id, seq.params, (s.adapter_id for s in kv.running),
                    step.lora_loads, step.lora_evictions):
                break  # (its adapter waits for a slot that a running adapter holds)
            queue.pop_admitted()
            if seq.admitted_at is None:
                seq.admitted_at = time.time()
            seq.move_to(SeqStatus.RUNNING)
            kv.admit(step, seq, hit)
            if seq.num_preemptions:
                seq.resumed_at = len(seq.output_ids)
            self._init_slot(step, seq)
            budget -= self._plan_row(step, seq, budget, short_of_end)
        return budget

    def _init_slot(self, step: PlannedStep, seq: Sequence) -> None:
        """seq takes its executor slot: its encoded parameters and the ids min_tokens masks."""
        slot = seq.slot
        assert slot is not None
        dp, queue = self.drafts, self.queue
        seq.draft_model_kv = dp is not None and dp.keeps_kv(seq, len(self.kv.running),
                                                            len(queue.waiting))
        step.new_slots.append((slot, encode_slot(seq.params, len(seq.prompt_ids), seq.index)))
        step.stop_ids += [(slot, t) for t in suppressed_ids(
            seq.params, self.limits.eos_token_ids, len(seq.output_ids))]
        if seq.grammar:
            step.grammars.append(SlotGrammar(slot, seq.grammar, list(seq.output_ids),
                                             seq.params.reasoning))
        if seq.params.logit_bias:
            bias = seq.params.logit_bias
            step.logit_biases.append(SlotLogitBias(slot, [b.token_id for b in bias],
                                                   [b.bias for b in bias]))
