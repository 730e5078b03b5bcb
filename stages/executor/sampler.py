"""Sampling on the device, batched over sequences. Runs in the executor process.

Every executor slot has its sampling parameters on the device (encoded by
ipc/sampling.py, set when a sequence takes the slot); a step samples all its rows at once: a
structured output's token mask, logit_bias, penalties, min_tokens, temperature, top-k/top-p,
min-p, then a draw. No Python loop over rows or over the vocabulary; the host only passes
which features the step's rows use (StepSampling), so a plain greedy batch costs one argmax.

Draws use the exponential race (argmax of p / Exp(1)), which samples from p exactly and needs
no host synchronisation, unlike torch.multinomial. A seeded row takes its Exp(1) noise from a
counter-based hash of (seed, position, token id): its draws depend on nothing else, so they
are the same whatever shares its batch, with or without overlap, after a preemption too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ipc.messages import SlotLogitBias
from ipc.params import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS
from ipc.sampling import GREEDY_SLOT, NUM_F, NUM_I, F, I, penalty_rows
from stages.executor import kernels
from stages.executor.grammar_mask import apply_bitmask


@dataclass(frozen=True)
class StepSampling:
    """What a step's rows need, known on the host (so the device never has to be asked)."""

    all_greedy: bool = True
    use_top_k_p: bool = False
    use_min_p: bool = False
    use_penalties: bool = False  # some row of the step (sampled or not) has penalties
    use_seed: bool = False
    use_min_tokens: bool = False
    use_logprobs: bool = False
    use_logit_bias: bool = False


class HostSlotParams:
    """The host's copy of every slot's encoded parameters (ipc/sampling.py), to compute
    StepSampling without asking the device. Each slot's share of a StepSampling is kept as
    bits (`flags`, set when a sequence takes the slot), so that a step's is an OR over its
    rows, and each distinct StepSampling is made once."""

    def __init__(self, max_num_seqs: int) -> None:
        self.f = np.tile(np.asarray(GREEDY_SLOT[0], dtype=np.float32), (max_num_seqs, 1))
        self.i = np.tile(np.asarray(GREEDY_SLOT[1], dtype=np.int64), (max_num_seqs, 1))
        self.flags = slot_flags(self.f, self.i)  # [slots] uint8, bits _FLAG_*
        self._made: dict[int, StepSampling] = {}

    def update(self, slots: np.ndarray, f: np.ndarray, i: np.ndarray) -> None:
        """New sequences took `slots` with rows f [N, NUM_F] and i [N, NUM_I]."""
        if len(slots):
            self.f[slots], self.i[slots] = f, i
            self.flags[slots] = slot_flags(self.f[slots], self.i[slots])

    def step_sampling(self, sampled: np.ndarray, all_rows: np.ndarray,
                      any_stop_ids: bool) -> StepSampling:
        """sampled: the slots of the rows that sample; all_rows: every row's (penalties count
        a row's tokens whether or not it samples)."""
        flags = self.flags
        bits = int(np.bitwise_or.reduce(flags[sampled]))
        if len(sampled) != len(all_rows):  # (else the same rows: their bits are all there)
            every = int(np.bitwise_or.reduce(flags[all_rows]))
            bits = (bits & ~_FLAG_PENALTIES) | (every & _FLAG_PENALTIES)
        if any_stop_ids:
            bits |= _FLAG_MIN_TOKENS
        made = self._made.get(bits)
        if made is None:
            made = self._made[bits] = StepSampling(
                all_greedy=not bits & _FLAG_SAMPLING, use_top_k_p=bool(bits & _FLAG_TOP_K_P),
                use_min_p=bool(bits & _FLAG_MIN_P), use_penalties=bool(bits & _FLAG_PENALTIES),
                use_seed=bool(bits & _FLAG_SEED), use_min_tokens=bool(bits & _FLAG_MIN_TOKENS),
                use_logprobs=bool(bits & _FLAG_LOGPROBS),
                use_logit_bias=bool(bits & _FLAG_LOGIT_BIAS))
        return made


# A slot's bits in HostSlotParams.flags: what StepSampling asks of a step's rows, row by row.
_FLAG_SAMPLING = 1  # temperature > 0 (not greedy)
_FLAG_TOP_K_P = 2  # sampling, with top-k or top-p
_FLAG_MIN_P = 4  # sampling, with min-p
_FLAG_PENALTIES = 8
_FLAG_SEED = 16  # sampling, seeded
_FLAG_MIN_TOKENS = 32
_FLAG_LOGPROBS = 64
_FLAG_LOGIT_BIAS = 128


def slot_flags(f: np.ndarray, i: np.ndarray) -> np.ndarray:
    """The _FLAG_* bits [N] uint8 of slots whose rows are f [N, NUM_F] and i [N, NUM_I]."""
    sampling = f[:, F.TEMPERATURE] > 0
    bits = (sampling * _FLAG_SAMPLING
            | (sampling & ((i[:, I.TOP_K] > 0) | (f[:, F.TOP_P] < 1))) * _FLAG_TOP_K_P
            | (sampling & (f[:, F.MIN_P] > 0)) * _FLAG_MIN_P
            | penalty_rows(f) * _FLAG_PENALTIES
            | (sampling & (i[:, I.HAS_SEED] != 0)) * _FLAG_SEED
            | (i[:, I.MIN_TOKENS] > 0) * _FLAG_MIN_TOKENS
            | (i[:, I.LOGPROBS] >= 0) * _FLAG_LOGPROBS
            | (i[:, I.LOGIT_BIAS] > 0) * _FLAG_LOGIT_BIAS)
    return bits.astype(np.uint8)


@dataclass
class PromptScores:
    """Logprobs of prompt tokens under the model, one row per scored position [P]."""

    logprob: torch.Tensor  # [P] float32, of the prompt token that follows the position
    rank: torch.Tensor  # [P] int32, its rank (1: the most likely)
    top_ids: torch.Tensor  # [P, MAX_TOP_LOGPROBS] int64
    top_logprobs: torch.Tensor  # [P, MAX_TOP_LOGPROBS] float32


@dataclass
class SampleOutput:
    tokens: torch.Tensor  # [X] int64
    logprob: torch.Tensor | None = None  # [X] float32, of the sampled token
    top_ids: torch.Tensor | None = None  # [X, MAX_TOP_LOGPROBS] int64, most likely first
    top_logprobs: torch.Tensor | None = None  # [X, MAX_TOP_LOGPROBS] float32
    prompt: PromptScores | None = None  # the step's prompt logprobs, if its plan asks
    accepted: torch.Tensor | None = None  # [R] int32: positions that stand, per row with drafts
    stands: torch.Tensor | None = None  # [X] bool: whether each sampled position stands
    began_ns: int | None = None  # its device work began before it came (drafts run ahead)
    pooled: torch.Tensor | None = None  # [R, hidden] float32: embeddings whose prompt ended


class SamplingState:
    """Per-slot sampling state on the device. Token counts for penalties and the masks of
    ids that min_tokens suppresses are made on first use ([slots, vocab] each)."""

    def __init__(self, max_num_seqs: int, vocab_size: int, device: torch.device) -> None:
        self.num_slots, self.vocab_size, self.device = max_num_seqs, vocab_size, device
        floats, ints = GREEDY_SLOT
        self.f = torch.tensor([floats] * max_num_seqs, dtype=torch.float32, device=device)
        self.i = torch.tensor([ints] * max_num_seqs, dtype=torch.int64, device=device)
        self.output_counts: torch.Tensor | None = None  # [slots, V] int32
        self.prompt_counts: torch.Tensor | None = None  # [slots, V] int32
        self.stop_mask: torch.Tensor | None = None  # [slots, V] bool
        # logit_bias: each slot's (id, bias) pairs, padded with (0, 0.0), which adds nothing
        self.bias_ids: torch.Tensor | None = None  # [slots, MAX_LOGIT_BIAS] int64
        self.bias_values: torch.Tensor | None = None  # [slots, MAX_LOGIT_BIAS] float32
        self._hashed_vocab = hash32(torch.arange(vocab_size, device=device) * 0x9E3779B1
                                    & 0xFFFFFFFF)
        self._hashed_vocab32 = self._hashed_vocab.to(torch.int32)  # (its 32 bits: the kernel's)

    def _table(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(self.num_slots, self.vocab_size, dtype=dtype, device=self.device)

    def init_slots(self, slots: torch.Tensor, fparams: torch.Tensor, iparams: torch.Tensor,
                   stop_slots: torch.Tensor, stop_ids: torch.Tensor) -> None:
        """New sequences take `slots`: fparams [N * NUM_F] float32, iparams [N * NUM_I]; the
        (stop_slots, stop_ids) pairs are the ids min_tokens suppresses."""
        # Device-side fills only: `t[idx] = 0` would copy the 0 from the host, which on CUDA
        # waits for the device (tests/sync_guard.py catches it).
        self.f.index_copy_(0, slots, fparams.view(-1, NUM_F))
        self.i.index_copy_(0, slots, iparams.view(-1, NUM_I))
        if self.output_counts is not None and self.prompt_counts is not None:
            self.output_counts.index_fill_(0, slots, 0)
            self.prompt_counts.index_fill_(0, slots, 0)
        if self.stop_mask is not None:
            self.stop_mask.index_fill_(0, slots, False)
        if self.bias_values is not None:  # (a slot's new sequence may share a biased step)
            self.bias_values.index_fill_(0, slots, 0.0)
        if stop_slots.numel():
            if self.stop_mask is None:
                self.stop_mask = self._table(torch.bool)
            self.stop_mask.view(-1).index_fill_(0, stop_slots * self.vocab_size + stop_ids, True)

    def set_logit_biases(self, biases: list[SlotLogitBias]) -> None:
        """New sequences with a logit_bias took these slots (after init_slots). Only steps
        that carry one pay for it: a small copy, made on first use."""
        if self.bias_ids is None or self.bias_values is None:
            shape = (self.num_slots, MAX_LOGIT_BIAS)
            self.bias_ids = torch.zeros(shape, dtype=torch.int64, device=self.device)
            self.bias_values = torch.zeros(shape, dtype=torch.float32, device=self.device)
        ids = torch.zeros(len(biases), MAX_LOGIT_BIAS, dtype=torch.int64)
        values = torch.zeros(len(biases), MAX_LOGIT_BIAS, dtype=torch.float32)
        for row, b in enumerate(biases):
            ids[row, :len(b.token_ids)] = torch.tensor(b.token_ids, dtype=torch.int64)
            values[row, :len(b.biases)] = torch.tensor(b.biases, dtype=torch.float32)
        slots = torch.tensor([b.slot for b in biases], dtype=torch.int64)
        if self.device.type == "cuda":  # pinned, so the copy does not wait for the queue
            ids, values, slots = ids.pin_memory(), values.pin_memory(), slots.pin_memory()
        slots = slots.to(self.device, non_blocking=True)
        self.bias_ids.index_copy_(0, slots, ids.to(self.device, non_blocking=True))
        self.bias_values.index_copy_(0, slots, values.to(self.device, non_blocking=True))

    def count_tokens(self, ids: torch.Tensor, token_slots: torch.Tensor,
                     positions: torch.Tensor) -> None:
        """Record this step's input tokens (prompt or output, by position) for penalties."""
        if self.output_counts is None or self.prompt_counts is None:
            self.output_counts, self.prompt_counts = (self._table(torch.int32),
                                                      self._table(torch.int32))
        is_prompt = (positions < self.i[token_slots, I.PROMPT_LEN]).to(torch.int32)
        self.prompt_counts.index_put_((token_slots, ids), is_prompt, accumulate=True)
        self.output_counts.index_put_((token_slots, ids), 1 - is_prompt, accumulate=True)

    def sample(self, logits: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
               flags: StepSampling,
               grammar: tuple[torch.Tensor, torch.Tensor] | None = None) -> SampleOutput:
        """logits [X, V] of the sampled rows in the model's dtype, their slots [X] and the
        positions [X] of their last input token -> SampleOutput. grammar: (rows [R], bitmask
        [R, words]) of the rows with a structured output (stages/executor/grammar_mask.py),
        the tokens each allows. Masks and the argmax read the logits as they are (exact);
        penalties and draws work on a float32 copy (as exact: widening rounds nothing)."""
        raw = logits
        if grammar is not None:
            logits = apply_bitmask(logits, *grammar)
        f, i = self.f[slots], self.i[slots]
        if flags.use_logit_bias:
            assert self.bias_ids is not None and self.bias_values is not None
            logits = logits.float().scatter_add(1, self.bias_ids[slots],
                                                self.bias_values[slots])
        if flags.use_penalties:
            assert self.output_counts is not None and self.prompt_counts is not None
            logits = apply_penalties(logits.float(), self.output_counts[slots],
                                     self.prompt_counts[slots], f[:, F.REPETITION],
                                     f[:, F.PRESENCE], f[:, F.FREQUENCY])
        if flags.use_min_tokens and self.stop_mask is not None:
            num_out = positions + 1 - i[:, I.PROMPT_LEN]
            suppress = (num_out < i[:, I.MIN_TOKENS]).unsqueeze(1) & self.stop_mask[slots]
            logits = logits.masked_fill(suppress, float("-inf"))
        tokens = greedy_tokens(logits)
        if not flags.all_greedy and not (flags.use_top_k_p or flags.use_min_p) and (
                logits.device.type == "cpu" and logits.dim() == 2 and logits.stride(-1) == 1
                and kernels.loaded()):
            # The same race in one pass (csrc/cpu_kernels.cpp sample_rows): a row without a
            # seed takes a fresh random one, so its noise is the same hash of new bits.
            temperature = f[:, F.TEMPERATURE]
            seeds = torch.randint(0, 1 << 62, temperature.shape, dtype=torch.int64,
                                  device=temperature.device)
            if flags.use_seed:
                seeds = torch.where(i[:, I.HAS_SEED] != 0, i[:, I.SEED], seeds)
            drawn = torch.ops.llm_cpu.sample_rows(logits, temperature, seeds, positions,
                                                  self._hashed_vocab32)
            tokens = torch.where(temperature == 0, tokens, drawn)
        elif not flags.all_greedy:
            temperature = f[:, F.TEMPERATURE]
            scaled = logits.float() / temperature.clamp_min(1e-6).unsqueeze(1)
            if flags.use_top_k_p:
                scaled = apply_top_k_top_p(scaled, i[:, I.TOP_K], f[:, F.TOP_P])
            if flags.use_min_p:
                scaled = apply_min_p(scaled, f[:, F.MIN_P])
            noise = torch.empty_like(scaled).exponential_()
            if flags.use_seed:
                seeded = seeded_exponential(i[:, I.SEED], positions, self._hashed_vocab)
                noise = torch.where((i[:, I.HAS_SEED] != 0).unsqueeze(1), seeded, noise)
            # argmax of p / E, in logs: softmax's normaliser is the same for every token
            drawn = (scaled - noise.log()).argmax(dim=-1)
            tokens = torch.where(temperature == 0, tokens, drawn)
        out = SampleOutput(tokens)
        if flags.use_logprobs:
            out.logprob, out.top_ids, out.top_logprobs = compute_logprobs(raw, tokens)
        return out


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax [X] int64 (the first of equal maxima), read in the logits' own dtype:
    on the CPU by the kernels' argmax_rows where they are loaded (64 rows of 49,152 bf16
    logits: 0.31 ms, against 3.6 ms for a float32 copy and torch's argmax)."""
    if (logits.device.type == "cpu" and logits.dim() == 2 and logits.stride(-1) == 1
            and kernels.loaded()):
        return torch.ops.llm_cpu.argmax_rows(logits)
    return logits.argmax(dim=-1)


def accept_drafts(tokens: torch.Tensor, sampled: torch.Tensor, drafts: torch.Tensor,
                  width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Verify the drafts of R rows: tokens [X] sampled at every position; sampled [R *
    (width + 1)] each row's positions among them (its last repeated past its own drafts);
    drafts [R * width] (-1 past a row's own). A row keeps its drafts up to the first that
    differs from the token sampled before it, then the token sampled there: so it emits
    exactly what sampling one token a step would have (the sampler's draw at a position
    depends only on the logits and the position). Returns (positions that stand [R] int32,
    the last of them [R], whether each of the X positions stands [X] bool), all on the
    device."""
    where = sampled.view(-1, width + 1)
    rows = tokens[where]  # [R, width + 1]
    drafts = drafts.view(-1, width)
    agree = (rows[:, :width] == drafts).to(torch.int64)
    run = agree.cumprod(dim=1).sum(dim=1)  # drafts accepted, before the first miss
    # position j of a row stands if j <= run; a padding entry (past the row's own drafts)
    # repeats the row's last position, and says what that one says
    own = (drafts >= 0).sum(dim=1, keepdim=True)  # [R, 1] the row's drafts
    j = torch.arange(width + 1, device=tokens.device).unsqueeze(0)
    stands = torch.ones(len(tokens), dtype=torch.bool, device=tokens.device)
    stands[where] = torch.minimum(j, own) <= run.unsqueeze(1)
    return (run + 1).to(torch.int32), rows.gather(1, run.unsqueeze(1)).squeeze(1), stands


def apply_penalties(logits: torch.Tensor, output_counts: torch.Tensor,
                    prompt_counts: torch.Tensor, repetition: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """vLLM's formulas. repetition: a logit of a token seen in the prompt or the output is
    divided by it if positive, multiplied if not. frequency: minus the token's count in the
    output times it. presence: minus it once if the token is in the output."""
    seen = (output_counts > 0) | (prompt_counts > 0)
    rep = repetition.unsqueeze(1)
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return (logits - frequency.unsqueeze(1) * output_counts
            - presence.unsqueeze(1) * (output_counts > 0))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's top_k logits (0 = all) and the smallest set of most likely tokens whose
    probability reaches top_p (at least one); the rest become -inf."""
    vocab = logits.shape[-1]
    ordered, order = logits.sort(dim=-1, descending=False)
    k = torch.where(top_k > 0, top_k.clamp_max(vocab), vocab)
    kth = ordered.gather(1, (vocab - k).unsqueeze(1))  # the k-th largest logit
    drop = ordered < kth
    probs = ordered.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Ascending order: drop a token while the mass of tokens below and at it is <= 1 - top_p.
    drop |= probs.cumsum(dim=-1) <= (1 - top_p).unsqueeze(1)
    drop[:, -1].fill_(False)  # the most likely token always stays
    ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, ordered)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's most likely one."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def score_prompt(logits: torch.Tensor, targets: torch.Tensor) -> PromptScores:
    """logits [P, V] of prompt positions and the token following each [P] -> its logprob,
    rank and the top alternatives, under the model's own distribution."""
    chosen, top_ids, top_lps, logprobs = _logprobs(logits, targets)
    rank = (logprobs > chosen.unsqueeze(1)).sum(dim=-1).to(torch.int32) + 1
    return PromptScores(chosen, rank, top_ids, top_lps)


def compute_logprobs(logits: torch.Tensor, tokens: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs under the model's own distribution (before penalties and temperature)."""
    return _logprobs(logits, tokens)[:3]


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob of each row's token, top ids, top logprobs, the whole log-softmax)."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    k = min(MAX_TOP_LOGPROBS, logprobs.shape[-1])
    top_lps, top_ids = logprobs.topk(k, dim=-1)
    if k < MAX_TOP_LOGPROBS:  # a vocabulary smaller than 20: pad so rows keep one width
        pad = MAX_TOP_LOGPROBS - k
        top_lps = torch.nn.functional.pad(top_lps, (0, pad), value=float("-inf"))
        top_ids = torch.nn.functional.pad(top_ids, (0, pad), value=-1)
    return chosen, top_ids, top_lps, logprobs


_M32 = 0xFFFFFFFF


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (Wellons' lowbias32 with multipliers below 2^31) on int64
    holding values < 2^32: every product stays below 2^63, so nothing overflows."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _M32
    return x ^ (x >> 16)


def seeded_exponential(seeds: torch.Tensor, positions: torch.Tensor,
                       hashed_vocab: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise [X, V] that is a pure function of (seed, position, token id)."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    key = hash32(lo ^ hash32(hi ^ hash32(positions & _M32)))
    bits = hash32(key.unsqueeze(1) ^ hashed_vocab.unsqueeze(0))
    uniform = ((bits >> 8).to(torch.float32) + 0.5) / float(1 << 24)  # in (0, 1), never 0 or 1
    return -torch.log(uniform)
