"""The batched sampler (stages.executor.sampler) against references written in plain torch, row
by row: top-k / top-p / min-p keep exactly the allowed set, penalties change logits as the
formulas say, min_tokens hides stop ids, seeded draws depend only on (seed, position), and
logprobs are the model's log-softmax."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ipc.messages import SamplingParams
from ipc.sampling import SlotRow, encode_slot
from stages.executor import kernels
from stages.executor.sampler import (
    SamplingState,
    StepSampling,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    hash32,
    seeded_exponential,
)

V = 50


def allowed_reference(row: torch.Tensor, temperature: float, k: int, p: float,
                      min_p: float) -> set[int]:
    """The token ids a row may sample from, computed one row at a time in plain torch."""
    probs = torch.softmax(row / temperature, dim=-1)
    order = sorted(range(len(row)), key=lambda t: -float(probs[t]))
    keep = order[:k] if k > 0 else order
    if p < 1:
        kept_probs = torch.softmax(row[keep] / temperature, dim=-1)
        chosen, mass = [], 0.0
        for t, q in zip(keep, kept_probs.tolist(), strict=True):
            chosen.append(t)
            mass += q
            if mass >= p:
                break
        keep = chosen
    if min_p > 0:
        final = torch.full_like(row, float("-inf"))
        final[keep] = row[keep] / temperature
        q = torch.softmax(final, dim=-1)
        keep = [t for t in keep if q[t] >= min_p * q.max()]
    return set(keep)


def Slot(slot: int, temperature: float, top_p: float = 1.0, top_k: int = 0,  # noqa: N802
         min_p: float = 0.0, *, num_prompt_tokens: int = 0, stop_ids: tuple[int, ...] = (),
         **fields: object) -> tuple[int, SlotRow, tuple[int, ...]]:
    """Slot `slot` encoded from these parameters, as the scheduler lays it out."""
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                            **fields)  # type: ignore[arg-type]
    return slot, encode_slot(params, num_prompt_tokens), stop_ids


def state_with(params: list[tuple[int, SlotRow, tuple[int, ...]]]) -> SamplingState:
    state = SamplingState(len(params), V, torch.device("cpu"))
    f = torch.tensor([row[0] for _, row, _ in params], dtype=torch.float32)
    i = torch.tensor([row[1] for _, row, _ in params], dtype=torch.int64)
    stops = [(slot, t) for slot, _, ids in params for t in ids]
    state.init_slots(torch.arange(len(params)), f.view(-1), i.view(-1),
                     torch.tensor([s for s, _ in stops], dtype=torch.int64),
                     torch.tensor([t for _, t in stops], dtype=torch.int64))
    return state


CASES = [(1.0, 5, 1.0, 0.0), (0.7, 0, 0.8, 0.0), (1.3, 10, 0.5, 0.0), (1.0, 0, 1.0, 0.2),
         (0.5, 3, 0.9, 0.1), (2.0, 1, 1.0, 0.0), (1.0, 0, 0.05, 0.0)]


def test_top_k_top_p_min_p_never_leave_the_allowed_set() -> None:
    torch.manual_seed(0)
    logits = torch.randn(len(CASES), V) * 3
    params = [Slot(s, t, p, k, m) for s, (t, k, p, m) in enumerate(CASES)]
    state = state_with(params)
    flags = StepSampling(all_greedy=False, use_top_k_p=True, use_min_p=True)
    allowed = [allowed_reference(logits[s], t, k, p, m) for s, (t, k, p, m) in enumerate(CASES)]
    seen: list[set[int]] = [set() for _ in CASES]
    for _ in range(300):
        out = state.sample(logits, torch.arange(len(CASES)), torch.zeros(len(CASES),
                                                                          dtype=torch.int64),
                           flags)
        for s, t in enumerate(out.tokens.tolist()):
            seen[s].add(t)
    for s in range(len(CASES)):
        assert seen[s] <= allowed[s], (CASES[s], seen[s] - allowed[s])
    assert len(seen[0]) > 1  # it does sample, not just take the argmax
    assert seen[5] == {int(logits[5].argmax())}  # top_k 1 is greedy


def test_top_k_top_p_masks_match_the_reference_exactly() -> None:
    torch.manual_seed(1)
    logits = torch.randn(len(CASES), V) * 2
    temps = torch.tensor([c[0] for c in CASES]).unsqueeze(1)
    scaled = logits / temps
    out = apply_top_k_top_p(scaled, torch.tensor([c[1] for c in CASES]),
                            torch.tensor([c[2] for c in CASES]))
    out = apply_min_p(out, torch.tensor([c[3] for c in CASES]))
    for s, (t, k, p, m) in enumerate(CASES):
        kept = set(torch.isfinite(out[s]).nonzero().flatten().tolist())
        assert kept == allowed_reference(logits[s], t, k, p, m)
        assert torch.equal(out[s][list(kept)], scaled[s][list(kept)])  # kept logits unchanged


def test_penalties_follow_the_formulas() -> None:
    torch.manual_seed(2)
    logits = torch.randn(3, V) * 4
    out_counts = torch.zeros(3, V, dtype=torch.int32)
    prompt_counts = torch.zeros(3, V, dtype=torch.int32)
    out_counts[0, [1, 2, 2, 7]] = torch.tensor([1, 2, 2, 1], dtype=torch.int32)
    out_counts[1, 4] = 3
    prompt_counts[0, [2, 9]] = 1
    prompt_counts[2, 5] = 1
    rep = torch.tensor([1.3, 1.0, 0.8])
    pres = torch.tensor([0.5, -0.4, 0.0])
    freq = torch.tensor([0.25, 0.3, 1.5])
    got = apply_penalties(logits, out_counts, prompt_counts, rep, pres, freq)
    for s in range(3):
        for t in range(V):
            x = float(logits[s, t])
            c = int(out_counts[s, t])
            if c > 0 or prompt_counts[s, t] > 0:
                x = x / float(rep[s]) if x > 0 else x * float(rep[s])
            x -= float(freq[s]) * c + float(pres[s]) * (c > 0)
            assert math.isclose(float(got[s, t]), x, rel_tol=1e-6, abs_tol=1e-6), (s, t)


def test_counted_tokens_are_split_by_the_prompt_length() -> None:
    state = state_with([Slot(0, 0.0, num_prompt_tokens=3), Slot(1, 0.0,
                                                                          num_prompt_tokens=1)])
    ids = torch.tensor([4, 4, 6, 4, 8, 8])  # slot 0: prompt 4 4 6, output 4; slot 1: 8 | 8
    slots = torch.tensor([0, 0, 0, 0, 1, 1])
    positions = torch.tensor([0, 1, 2, 3, 0, 1])
    state.count_tokens(ids, slots, positions)
    assert state.prompt_counts is not None and state.output_counts is not None
    assert state.prompt_counts[0, 4] == 2 and state.prompt_counts[0, 6] == 1
    assert state.output_counts[0, 4] == 1 and state.output_counts[0].sum() == 1
    assert state.prompt_counts[1, 8] == 1 and state.output_counts[1, 8] == 1
    # A slot taken by a new sequence starts from zero.
    state.init_slots(torch.tensor([0]), state.f[:1].clone(), state.i[:1].clone(),
                     torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64))
    assert state.prompt_counts[0].sum() == 0 and state.output_counts[0].sum() == 0
    assert state.output_counts[1, 8] == 1


def test_min_tokens_hides_stop_ids_until_enough_tokens() -> None:
    logits = torch.zeros(2, V)
    logits[:, 3] = 10.0  # the stop id is by far the most likely
    state = state_with([Slot(0, 0.0, min_tokens=2, num_prompt_tokens=4, stop_ids=[3]),
                        Slot(1, 0.0, min_tokens=2, num_prompt_tokens=4, stop_ids=[3])])
    flags = StepSampling(use_min_tokens=True)
    # positions of the last input token: 3 -> output 0, 5 -> output 2
    out = state.sample(logits, torch.tensor([0, 1]), torch.tensor([3, 5]), flags)
    assert out.tokens[0] != 3 and out.tokens[1] == 3


def test_seeded_noise_depends_only_on_seed_and_position() -> None:
    vocab = torch.arange(V)
    from stages.executor.sampler import hash32

    hashed = hash32(vocab * 0x9E3779B1 & 0xFFFFFFFF)
    a = seeded_exponential(torch.tensor([7, 7, 8, -5]), torch.tensor([10, 11, 10, 10]), hashed)
    b = seeded_exponential(torch.tensor([8, 7]), torch.tensor([10, 10]), hashed)
    assert torch.equal(a[0], b[1]) and torch.equal(a[2], b[0])
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    assert torch.isfinite(a).all() and (a > 0).all()
    # Exp(1): mean near 1 over many draws.
    many = seeded_exponential(torch.arange(200), torch.zeros(200, dtype=torch.int64), hashed)
    assert abs(float(many.mean()) - 1.0) < 0.05


def test_a_seeded_row_draws_the_same_token_in_any_batch() -> None:
    torch.manual_seed(3)
    logits = torch.randn(4, V)
    params = [Slot(0, 1.0, seed=42), Slot(1, 1.0), Slot(2, 1.0, seed=42),
              Slot(3, 0.9, top_p=0.9, seed=1)]
    state = state_with(params)
    flags = StepSampling(all_greedy=False, use_top_k_p=True, use_seed=True)
    positions = torch.tensor([5, 5, 6, 5])
    alone = state.sample(logits[[0]], torch.tensor([0]), positions[[0]], flags).tokens
    for _ in range(5):
        together = state.sample(logits, torch.arange(4), positions, flags).tokens
        assert together[0] == alone[0]
    # Different position, same seed: a different draw stream (tokens may still coincide).
    draws = {tuple(state.sample(logits[[0]].repeat(1, 1), torch.tensor([0]),
                                torch.tensor([p]), flags).tokens.tolist()) for p in range(40)}
    assert len(draws) > 1


def test_logprobs_are_the_raw_log_softmax() -> None:
    torch.manual_seed(4)
    logits = torch.randn(2, V)
    state = state_with([Slot(0, 0.0, repetition_penalty=1.5, logprobs=3),
                        Slot(1, 1.0, logprobs=0)])
    flags = StepSampling(all_greedy=False, use_logprobs=True)
    out = state.sample(logits, torch.arange(2), torch.zeros(2, dtype=torch.int64), flags)
    ref = torch.log_softmax(logits, dim=-1)
    assert out.logprob is not None and out.top_ids is not None and out.top_logprobs is not None
    assert torch.allclose(out.logprob, ref.gather(1, out.tokens.unsqueeze(1)).squeeze(1))
    top = ref.topk(20, dim=-1)
    assert torch.equal(out.top_ids, top.indices)
    assert torch.allclose(out.top_logprobs, top.values)


@pytest.mark.parametrize("vocab", [5, 20])
def test_logprobs_of_a_vocabulary_smaller_than_twenty_are_padded(vocab: int) -> None:
    state = SamplingState(1, vocab, torch.device("cpu"))
    out = state.sample(torch.randn(1, vocab), torch.tensor([0]), torch.tensor([0]),
                       StepSampling(use_logprobs=True))
    assert out.top_ids is not None and out.top_ids.shape == (1, 20)
    assert out.top_ids[0, :vocab].sort().values.tolist() == list(range(vocab))
    assert (out.top_ids[0, vocab:] == -1).all()


def test_logit_bias_is_added_before_greedy_and_draws_and_only_to_its_slot() -> None:
    """+100 forces a token (greedy and sampled rows), -100 bans the favourite; an unbiased row
    beside them, and a slot a biased sequence held before, sample as without."""
    from ipc.messages import SlotLogitBias
    from stages.executor.sampler import HostSlotParams

    torch.manual_seed(0)
    logits = torch.randn(4, V)
    logits[:, 7] = 20.0  # every row's favourite
    rows = [Slot(0, 0.0, logit_bias={11: 100.0}), Slot(1, 1.0, logit_bias={11: 100.0}),
            Slot(2, 0.0, logit_bias={7: -100.0, 12: 3.5}), Slot(3, 0.0)]
    state = state_with(rows)
    state.set_logit_biases([SlotLogitBias(0, [11], [100.0]), SlotLogitBias(1, [11], [100.0]),
                            SlotLogitBias(2, [7, 12], [-100.0, 3.5])])
    host = HostSlotParams(4)
    host.update(np.arange(4), np.array([r[1][0] for r in rows], np.float32),
                np.array([r[1][1] for r in rows], np.int64))
    flags = host.step_sampling(np.arange(4), np.arange(4), False)
    assert flags.use_logit_bias and not host.step_sampling(np.array([3]), np.array([3]),
                                                           False).use_logit_bias
    out = state.sample(logits, torch.arange(4), torch.tensor([5, 5, 5, 5]), flags)
    biased = logits[2].clone()
    biased[7] -= 100.0
    biased[12] += 3.5
    assert out.tokens.tolist() == [11, 11, int(biased.argmax()), 7]
    # slot 0 taken again by a sequence without a bias: its old row adds nothing any more
    plain = encode_slot(SamplingParams(temperature=0.0))
    state.init_slots(torch.tensor([0]), torch.tensor(plain[0]), torch.tensor(plain[1]),
                     torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64))
    again = state.sample(logits, torch.arange(4), torch.tensor([5, 5, 5, 5]), flags)
    assert again.tokens[0] == 7 and again.tokens[1] == 11


@pytest.mark.skipif(not kernels.available(), reason="the CPU kernels are not built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_draw_is_the_float_paths_race(dtype: torch.dtype) -> None:
    """csrc/cpu_kernels.cpp sample_rows: for a seeded row, the same token as the float path's
    race on the same noise (argmax of x/T - log E, E = seeded_exponential), for vocabularies
    that are and are not whole 16-lane vectors; temperatures near 0 give the argmax."""
    gen = torch.Generator().manual_seed(0)
    for vocab in (1000, 1003, 15):
        hashed = hash32(torch.arange(vocab) * 0x9E3779B1 & 0xFFFFFFFF)
        logits = (torch.randn(64, vocab, generator=gen) * 3).to(dtype)
        temperature = torch.rand(64, generator=gen) * 1.5 + 0.05
        seeds = torch.randint(0, 1 << 62, (64,), generator=gen)
        positions = torch.randint(0, 4096, (64,), generator=gen)
        got = torch.ops.llm_cpu.sample_rows(logits, temperature, seeds, positions,
                                            hashed.to(torch.int32))
        noise = seeded_exponential(seeds, positions, hashed)
        want = (logits.float() / temperature.unsqueeze(1) - noise.log()).argmax(dim=-1)
        assert torch.equal(got, want), vocab
        cold = torch.ops.llm_cpu.sample_rows(logits, torch.full((64,), 1e-4), seeds, positions,
                                             hashed.to(torch.int32))
        top2 = logits.float().topk(2, dim=-1).values
        unique = top2[:, 0] > top2[:, 1]  # (bf16's coarse values tie at times: either wins)
        assert torch.equal(cold[unique], logits.float().argmax(dim=-1)[unique])
        assert unique.sum() > 32


@pytest.mark.skipif(not kernels.available(), reason="the CPU kernels are not built here")
def test_the_kernels_draws_follow_the_softmax() -> None:
    """20,000 draws of one row (a seed each) fall on each token as softmax(x / T) says."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 5.0] + [-30.0] * 20])
    hashed = hash32(torch.arange(25) * 0x9E3779B1 & 0xFFFFFFFF).to(torch.int32)
    n = 20_000
    for t in (1.0, 2.0):
        draws = torch.ops.llm_cpu.sample_rows(logits.expand(n, -1).contiguous(),
                                              torch.full((n,), t), torch.arange(n) * 7919,
                                              torch.full((n,), 3), hashed)
        freq = torch.bincount(draws, minlength=25).double() / n
        want = torch.softmax(logits[0].double() / t, dim=0)
        assert (freq - want).abs().max() < 4 * math.sqrt(0.25 / n), (t, freq[:5], want[:5])
