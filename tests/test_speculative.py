"""Speculative decoding (n-gram prompt lookup and a draft model): the proposers, the
configuration, the executor's verification rule, and the scheduler planning drafts under
run-ahead with outputs identical to no speculation (greedy and seeded) through preemption,
chunked prefill, prefix hits, stops, n > 1 and aborts; the KV of rejected drafts rolled
back; a draft model's own KV kept in step with the model's."""

from __future__ import annotations

import dataclasses
import re
import zlib
from pathlib import Path

import pytest
import torch
from kernel_marks import needs_kernels
from scheduler_driver import (
    Driver,
    TokenFn,
    make_limits,
    make_request,
    plain_token,
    results,
    run_all,
    stops_at,
)

from ipc.errors import ConfigError
from ipc.messages import SamplingParams
from ipc.model_info import ModelInfo
from ipc.sampling import F
from ipc.speculative import SpeculativeConfig, parse_speculative
from stages.executor.sampler import StepSampling, accept_drafts
from stages.scheduler.speculative import MAX_SKIP, NgramProposer, ProposalState

NGRAM = SpeculativeConfig("ngram", 4, 3, 2)

# ---------------------------------------------------------------- configuration


def test_the_option_reads_k_n_m_and_vllms_json() -> None:
    assert parse_speculative("ngram:5") == SpeculativeConfig("ngram", 5, 4, 2)
    assert parse_speculative("ngram:3:6") == SpeculativeConfig("ngram", 3, 6, 2)
    assert parse_speculative("ngram:3:6:1") == SpeculativeConfig("ngram", 3, 6, 1)
    assert parse_speculative('{"method": "ngram", "num_speculative_tokens": 7, '
                             '"prompt_lookup_max": 5, "prompt_lookup_min": 3}'
                             ) == SpeculativeConfig("ngram", 7, 5, 3)
    assert parse_speculative(None) is None and parse_speculative("") is None


def test_a_draft_model_is_named_by_folder_k_and_quantization() -> None:
    """draft:PATH:K[:QUANT] (a folder may hold colons: K and QUANT are read from the end)
    and vLLM's draft_model JSON; describe() gives the option back."""
    assert parse_speculative("draft:/m/x:3") == SpeculativeConfig("draft", 3, model="/m/x")
    one = parse_speculative("draft:/m:a:5:int4")
    assert one == SpeculativeConfig("draft", 5, model="/m:a", quantization="int4")
    assert parse_speculative(one.describe()) == one
    assert parse_speculative('{"method": "draft_model", "model": "/m", '
                             '"num_speculative_tokens": 2, "quantization": "int8"}'
                             ) == SpeculativeConfig("draft", 2, model="/m", quantization="int8")
    assert parse_speculative('{"model": "/m", "num_speculative_tokens": 2}').is_draft_model


@pytest.mark.parametrize("text, says", [
    ("ngram", "cannot read"), ("ngram:x", "cannot read"), ("ngram:0", "K must be 1-16"),
    ("ngram:17", "K must be 1-16"), ("ngram:4:2:3", "M <= N"),
    ("eagle:/m:4", "'eagle' is not supported"), ('{"method": "eagle", '
                                                 '"num_speculative_tokens": 2}', "'eagle'"),
    ('{"num_speculative_tokens": 2, "hf_token": "x"}', "unsupported key(s) hf_token"),
    ("draft:4", "cannot read"), ("draft:/m", "cannot read"), ("draft:/m:4:int3", "cannot read"),
    ('{"method": "ngram", "model": "/m", "num_speculative_tokens": 2}', "only there"),
    ('{"method": "draft", "num_speculative_tokens": 2}', "only there"),
    ('{"model": "/m", "num_speculative_tokens": 2, "quantization": "fp8"}', "int8, int4"),
    ('{"method": "ngram"}', "needs num_speculative_tokens"), ("{", "not JSON"),
])
def test_a_bad_option_is_refused_by_name(text: str, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_speculative(text)
    assert says in str(err.value) and "ngram:K" in str(err.value)


def test_a_draft_model_the_executor_cannot_run_is_refused_before_anything_starts(
        tiny_model_dir: Path, default_model_dir: Path, tmp_path: Path) -> None:
    """preflight.check_draft (the launcher's check, and the executor's at load): a folder
    without config.json, another vocabulary, several ranks, another forward, the timed
    device; each says what to do instead."""
    from ipc.config import ExecutorConfig, PipelineConfig, SchedulerConfig
    from stages.executor.backends.select import Selection
    from stages.executor.preflight import check_draft, check_executor

    vocab = ModelInfo.from_dir(default_model_dir).vocab_size
    kernels = Selection("cpu_kernels", "the CPU's default")

    def refusal(draft: SpeculativeConfig, target: Selection = kernels, tp: int = 1) -> str:
        with pytest.raises(ConfigError) as err:
            check_draft(draft, vocab, target, tp, "cpu")
        return str(err.value)

    assert "no config.json" in refusal(SpeculativeConfig("draft", 3, model=str(tmp_path)))
    own = SpeculativeConfig("draft", 3, model=str(default_model_dir))
    assert "must share the model's tokenizer" in refusal(dataclasses.replace(
        own, model=str(tiny_model_dir)))
    assert "one rank" in refusal(own, tp=2)
    assert "ngram:K there" in refusal(own, Selection("flex", "asked for"))
    assert check_draft(own, vocab, kernels, 1, "cpu").vocab_size == vocab
    timed = PipelineConfig(model=ModelInfo.from_dir(default_model_dir),
                           scheduler=SchedulerConfig(speculative=own),
                           executor=ExecutorConfig(timed=(1.0, 0.0)))
    with pytest.raises(ConfigError, match="not the timed device"):
        check_executor(timed)


def test_a_draft_models_first_pass_leads_each_decode_row_with_the_token_before() -> None:
    """Pass 1 of the draft model: a prefill chunk as it is; a decode row (drafts or not)
    led by the token before its last (PREV_TOKEN) where its slot has sampled; a fresh
    slot's one-token chunk not led; each drafted row's last known token located."""
    import numpy as np

    from stages.executor.backends.base import StepRows
    from stages.executor.drafter import PREV_TOKEN, first_pass

    # rows: a prefill chunk (slot 0, positions 0-3), a drafted decode (slot 1, its last
    # sample at 10 then 2 drafts), a plain decode (slot 2, at 7), a fresh one-token chunk
    # (slot 3, at 5)
    q, ctx = np.array([4, 3, 1, 1]), np.array([4, 13, 8, 6])
    ids = np.array([5, 6, 7, 8, -1, -2, -2, -1, 9])
    starts = np.cumsum(q) - q
    rows = StepRows(q, ctx, np.array([0, 1, 2, 3]), starts, {"input_ids": ids})
    args = (rows, np.array([0, 2, 0, 0]), np.array([True, True, True, True]),
            np.array([False, True, True, False, False]))
    out = first_pass(*args, np.array([True, True, True, True]))
    assert out["draft_ids"].tolist() == [5, 6, 7, 8, PREV_TOKEN, -1, PREV_TOKEN, -1, 9]
    assert out["draft_positions"].tolist() == [0, 1, 2, 3, 9, 10, 6, 7, 5]
    assert out["draft_slots"].tolist() == [0, 0, 0, 0, 1, 1, 2, 2, 3]
    assert out["draft_last"].tolist() == [5]  # the drafted row's last sample, at 10
    # rows whose KV the draft model does not keep are left out
    out = first_pass(*args, np.array([False, True, False, True]))
    assert out["draft_ids"].tolist() == [PREV_TOKEN, -1, 9]
    assert out["draft_slots"].tolist() == [1, 1, 3] and out["draft_last"].tolist() == [1]


def test_the_setting_reaches_a_stage_that_joins_from_another_host(tiny_model_dir: Path
                                                                  ) -> None:
    """A joined engine gets the run's config as JSON-able values (to_wire): the speculative
    setting comes back as itself, and sizes its rings as the launcher's do."""
    import json

    from ipc.config import PipelineConfig, SchedulerConfig

    cfg = PipelineConfig(model=ModelInfo.from_dir(tiny_model_dir),
                         scheduler=SchedulerConfig(speculative=SpeculativeConfig("ngram", 6, 5, 3)))
    joined = PipelineConfig.from_wire(json.loads(json.dumps(cfg.to_wire())),
                                      str(tiny_model_dir))
    assert joined.scheduler.speculative == cfg.scheduler.speculative
    assert joined.limits == cfg.limits and joined.limits.max_sampled == 64 * (1 + 6)


# ---------------------------------------------------------------- the proposer


def test_the_latest_earlier_occurrence_of_the_longest_suffix_is_continued() -> None:
    proposer = NgramProposer(NGRAM)
    state = ProposalState()
    prompt = [1, 2, 3, 4, 5, 6, 9, 2, 3, 7, 8]
    # the suffix (2, 3) ends at 2 and at 7; its latest occurrence (7) is continued: 7, 8
    assert proposer.propose(state, prompt + [2, 3], [], 0, 4) == [7, 8, 2, 3]
    # with outputs 1, 2, 3 the longest suffix (1, 2, 3) matches at the start
    state = ProposalState()
    assert proposer.propose(state, prompt, [1, 2, 3], 0, 2) == [4, 5]


def test_a_pending_token_is_skipped_as_predicted() -> None:
    """With one token still being sampled, the drafts start after the token the match
    predicts for it (the placeholder precedes them in the row)."""
    state = ProposalState()
    assert NgramProposer(NGRAM).propose(state, [5, 6, 7, 8, 9, 5, 6], [], 1, 2) == [8, 9]


def test_no_match_or_no_room_proposes_nothing_and_outputs_extend_the_index() -> None:
    proposer, state = NgramProposer(NGRAM), ProposalState()
    assert proposer.propose(state, [1, 2, 3, 4], [], 0, 4) == []  # no earlier (3, 4)
    assert proposer.propose(state, [1, 2, 3, 4], [9, 1, 2], 0, 4) == [3, 4, 9, 1]
    assert state.num_indexed == 6
    assert proposer.propose(state, [1, 2, 3, 4], [9, 1, 2], 0, 0) == []


def test_a_continuation_that_runs_out_is_looked_up_again() -> None:
    """The latest occurrence of (5, 6) has only 7, 5, 6 after it: a repeating pattern is
    followed past its last repetition by looking up what those would be followed by."""
    state = ProposalState()
    assert NgramProposer(NGRAM).propose(state, [5, 6, 7, 5, 6, 7, 5, 6], [], 0, 6) == [
        7, 5, 6, 7, 5, 6]
    state = ProposalState()  # with one token pending: it is the 7, and the drafts follow it
    assert NgramProposer(NGRAM).propose(state, [5, 6, 7, 5, 6, 7, 5, 6], [], 1, 4) == [
        5, 6, 7, 5]


def test_a_sequence_whose_drafts_miss_backs_off_exponentially() -> None:
    proposer, state = NgramProposer(NGRAM), ProposalState()
    tokens = [1, 2, 3, 1, 2]
    assert proposer.propose(state, tokens, [], 0, 2) == [3, 1]
    skips = []
    for _ in range(8):
        proposer.record(state, 0)  # the last proposal's row: every draft rejected
        skipped = 0
        while not proposer.propose(state, tokens, [], 0, 2):
            skipped += 1
        skips.append(skipped)
    assert skips == [0, 1, 3, 7, 15, 31, 63, MAX_SKIP]
    proposer.record(state, 1)  # one accepted: back to proposing every step
    proposer.record(state, 0)
    assert proposer.propose(state, tokens, [], 0, 2) == [3, 1]


# ---------------------------------------------------------------- the verification rule


def test_a_row_keeps_its_drafts_up_to_the_first_miss_then_the_sampled_token() -> None:
    # rows: drafts [5, 6, 7] (sampled 5, 6, 9, 4: two stand, then 9), [8] (sampled 1, 2: a
    # miss, 1 stands), [3, 4] padded to 3 (sampled 3, 4, 0: both stand, then 0)
    tokens = torch.tensor([5, 6, 9, 4, 1, 2, 3, 4, 0])
    sampled = torch.tensor([0, 1, 2, 3, 4, 5, 5, 5, 6, 7, 8, 8])
    drafts = torch.tensor([5, 6, 7, 8, -1, -1, 3, 4, -1])
    stand, last, stands = accept_drafts(tokens, sampled, drafts, 3)
    assert stand.tolist() == [3, 1, 3] and last.tolist() == [9, 1, 0]
    assert stands.tolist() == [True, True, True, False, True, False, True, True, True]


def test_unseeded_verification_samples_from_the_models_distribution() -> None:
    """Rejection sampling with a deterministic draft reduces to: draw at each position from
    the target, keep the draft while it equals the draw. Over many rows, the first emitted
    token follows p0 and, given the draft stood, the second follows p1 (a chi-square test:
    a sampler reusing one noise for both positions, or an off-by-one in acceptance, fails)."""
    from stages.executor.sampler import SamplingState

    torch.manual_seed(0)
    vocab, rows = 6, 40_000
    p0 = torch.tensor([0.35, 0.25, 0.15, 0.1, 0.1, 0.05])
    p1 = torch.tensor([0.05, 0.05, 0.1, 0.2, 0.3, 0.3])
    state = SamplingState(rows, vocab, torch.device("cpu"))
    state.f[:, F.TEMPERATURE] = 1.0
    logits = torch.stack([p0.log(), p1.log()] * rows)  # rows x (draft position, next)
    slots = torch.arange(rows).repeat_interleave(2)
    positions = torch.tensor([10, 11] * rows)
    out = state.sample(logits, slots, positions, StepSampling(all_greedy=False))
    sampled = torch.arange(2 * rows)
    drafts = torch.zeros(rows, dtype=torch.int64)  # every row proposes token 0
    stand, last, _ = accept_drafts(out.tokens, sampled, drafts, 1)
    first = out.tokens[0::2]
    assert torch.equal(stand == 2, first == 0)
    _chi_square_fits(first, p0)
    _chi_square_fits(last[stand == 2], p1)
    assert abs((stand == 2).float().mean().item() - p0[0].item()) < 0.02


def _chi_square_fits(draws: torch.Tensor, p: torch.Tensor) -> None:
    counts = torch.bincount(draws, minlength=len(p)).double()
    expected = p.double() * len(draws)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, (counts.tolist(), expected.tolist())  # p = 0.001 at 5 dof


# ---------------------------------------------------------------- the scheduler


def looping_token(rid: str, index: int) -> int:
    """Outputs that repeat a period of 3-6 tokens (what n-gram lookup finds), with a
    one-token change every 11: drafts are accepted, and sometimes missed."""
    seed = zlib.crc32(rid.encode())
    period = 3 + seed % 4
    if index % 11 == 10:
        return 500 + (seed + index) % 97
    return 1000 + (seed + 7 * (index % period)) % 300


SPEC = make_limits(speculative=NGRAM, max_num_batched_tokens=64, max_model_len=96)


def both(limits: object, arrivals: dict, token_fn: TokenFn = looping_token,
         **overrides: object) -> tuple[Driver, Driver]:
    spec = dataclasses.replace(limits, **overrides)  # type: ignore[type-var]
    plain = dataclasses.replace(spec, speculative=None)
    return run_all(plain, arrivals, token_fn), run_all(spec, arrivals, token_fn)


def wave(count: int = 8, max_tokens: int = 40, **params: object) -> dict[int, list]:
    """Two requests arriving at each tick."""
    return {t: [make_request(f"r{i}", 3 + 5 * (i % 3), max_tokens=max_tokens, **params)
                for i in (2 * t, 2 * t + 1) if i < count] for t in range(-(-count // 2))}


@pytest.mark.parametrize("depth", [1, 2])
def test_drafts_change_no_output_and_take_fewer_steps(depth: int) -> None:
    plain, spec = both(SPEC, wave(), depth=depth)
    assert results(spec) == results(plain)
    core = spec.core
    assert core.spec_num_accepted_tokens > 0.3 * core.spec_num_draft_tokens > 0
    assert core.spec_num_accepted_tokens < core.spec_num_draft_tokens  # some were missed
    assert sum(core.spec_accepted_per_pos) == core.spec_num_accepted_tokens
    assert core.next_step_id < 0.9 * plain.core.next_step_id


def test_without_repetition_drafts_are_seldom_proposed_and_outputs_stand() -> None:
    plain, spec = both(SPEC, wave(), plain_token)
    assert results(spec) == results(plain)
    assert spec.core.spec_num_draft_tokens < 0.05 * plain.core.generation_tokens


@pytest.mark.parametrize("num_blocks", [11, 14])
def test_preemption_under_drafts_keeps_outputs(num_blocks: int) -> None:
    plain, spec = both(SPEC, wave(10), num_blocks=num_blocks, block_size=4)
    assert spec.core.num_preemptions > 0
    assert spec.core.spec_num_accepted_tokens > 0
    assert results(spec) == results(plain)


def test_chunked_prefill_prefix_hits_and_n_samples_under_drafts() -> None:
    shared = {i: [make_request(f"p{i % 2}x{i}", 30, max_tokens=30, n=1 + i % 3)]
              for i in range(6)}
    for reqs in shared.values():  # the same long prompt for several requests: prefix hits
        reqs[0] = dataclasses.replace(reqs[0], prompt_token_ids=list(range(10, 40)))
    plain, spec = both(SPEC, shared, max_num_batched_tokens=16, max_num_seqs=6)
    assert spec.core.prefix_cache_hits > 0 and spec.core.spec_num_accepted_tokens > 0
    assert results(spec) == results(plain)


def test_a_stop_inside_accepted_drafts_ends_the_sample_there() -> None:
    """EOS and a stop token id sampled where drafts were accepted: the tokens after it in
    the same row are dropped, and the finish is the same as without drafts."""
    table = {"r0": (20, 2), "r1": (17, 3), "r3": (25, 2)}
    arrivals = wave(6, stop_token_ids=[3])
    plain, spec = both(SPEC, arrivals, stops_at(table, looping_token))
    assert results(spec) == results(plain)
    assert {rid: d.finish_reason for rid, d in spec.finished.items() if rid in table} == {
        "r0": "stop", "r1": "stop", "r3": "stop"}
    assert len(spec.outputs["r1"]) == 18


def test_drafts_never_pass_max_tokens_or_the_context() -> None:
    arrivals = {0: [make_request("a", 5, max_tokens=13), make_request("b", 20)]}
    plain, spec = both(SPEC, arrivals, max_model_len=48)
    assert results(spec) == results(plain)
    assert len(spec.outputs["a"]) == 13 and len(spec.outputs["b"]) == 48 - 20
    for step in spec.history:
        for row in step.rows:
            assert row.context_len <= 48


def test_requests_that_opt_out_or_have_penalties_are_not_drafted() -> None:
    arrivals = {0: [make_request("off", 6, max_tokens=30, speculate=False),
                    make_request("pen", 6, max_tokens=30, presence_penalty=0.5)]}
    plain, spec = both(SPEC, arrivals)
    assert results(spec) == results(plain)
    assert spec.core.spec_num_drafts == 0
    assert all(row.num_draft == 0 for step in spec.history for row in step.rows)


def test_an_abort_while_drafts_are_in_flight_frees_everything() -> None:
    driver = Driver(SPEC, looping_token)
    for i in range(4):
        driver.add(make_request(f"r{i}", 6, max_tokens=60))
    while not any(r.num_draft for step in driver.pending for r in step.rows):
        driver.tick()
    drafted = next(r.request_id for step in driver.pending for r in step.rows if r.num_draft)
    driver.abort(drafted)
    driver.run()
    driver.check_idle()
    assert driver.finished[drafted].finish_reason == "abort"


def test_rejected_drafts_give_back_the_blocks_only_they_filled() -> None:
    """Drafts that cross into a new block take it; when they are rejected the sequence holds
    the blocks of its computed tokens again (Driver.check asserts it after every move), so
    its block count falls while it runs."""
    miss: TokenFn = lambda rid, i: 1000 + i % 5 if i < 12 else 7 + i  # noqa: E731
    driver = Driver(dataclasses.replace(SPEC, block_size=4, depth=1), miss)
    driver.add(make_request("a", 4, max_tokens=30))
    seq = driver.core.seq("a")
    shrank = False
    while driver.core.requests:
        driver.plan()
        planned = len(seq.blocks)
        driver.report()
        driver.collect()
        shrank |= seq.status.value == "running" and len(seq.blocks) < planned
    assert shrank and driver.core.spec_num_accepted_tokens > 0
    driver.check_idle()


def test_a_draft_models_row_holds_the_block_its_last_sample_lands_in() -> None:
    """A draft model's row also holds the position after its drafts, and a roll-back keeps
    the block of the position where the row's last sample lands: the executor's draft
    passes run ahead of the next plan in that block (drafter.work_ahead). A row whose
    drafts, if all stand, reach max_tokens says so (no passes run ahead after it)."""
    from ipc.config import EngineLimits
    from ipc.messages import TokenizedRequest
    from stages.scheduler.core import Scheduler

    limits = EngineLimits(4, 64, 4, 64, 1000, (), 2, num_speculative_tokens=3)
    core = Scheduler(limits, 16, speculative=SpeculativeConfig("draft", 3, model="draft"))
    core.add_request(TokenizedRequest("a", "", [11, 12, 13, 14],
                                      SamplingParams(max_tokens=10, temperature=0), 0.0))
    prefill = core.schedule()  # positions 0-3 (blocks of 4)
    decode = core.schedule()  # its sample at 4 (a placeholder), 3 drafts at 5-7
    assert prefill is not None and decode is not None and core.schedule() is None
    (row,) = decode.rows
    seq = row.seq
    assert row.num_draft == 3 and row.draft_kv and not row.last_drafts
    assert len(seq.blocks) == 3  # and position 8, where the last sample lands if all stand
    core.on_sampled(prefill.step_id, [20])
    core.on_sampled(decode.step_id, [21, 22, 23, 24], accepted=[4])  # all stand
    assert seq.num_computed == 8 and seq.output_ids == [20, 21, 22, 23, 24]
    assert len(seq.blocks) == 3  # position 8's block is kept (KV up to 7 is in)
    nxt = core.schedule()
    assert nxt is not None
    (row,) = nxt.rows
    assert row.num_draft == 3 and row.last_drafts  # 5 + 4 outputs: the 10th undrafted


# ---------------------------------------------------------------- the model, in process


@pytest.fixture(scope="module")
def engines(default_model_dir: Path) -> tuple[object, object, list[list[int]], object]:
    """The default model in process without and with drafts, and input-grounded prompts
    (a piece of source to copy, a counting list) that it continues from its input."""
    from transformers import AutoTokenizer

    from pipeline.tools.datasets import copy_prompts
    from stages.inprocess import InProcessEngine

    def engine(speculative: SpeculativeConfig | None) -> object:
        return InProcessEngine(str(default_model_dir), max_num_seqs=4,
                               max_num_batched_tokens=512, block_size=16, max_model_len=512,
                               kv_cache_memory=64 << 20, speculative=speculative,
                               eos_token_ids=ModelInfo.from_dir(default_model_dir).eos_token_ids)

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    texts = [*copy_prompts(2, seed=3), "The list: 1, 2, 3, 4, 5, 6, 7,"]
    return engine(None), engine(SpeculativeConfig("ngram", 5, 3, 2)), [
        tok(t)["input_ids"] for t in texts], tok


def draft_engine(model_dir: Path, num_blocks: int, quantization: str | None = None,
                 max_batch: int | None = None, **kw: object) -> object:
    """The model in process with itself as its draft model (quantized as asked), its cache
    of num_blocks blocks (each holds the model's KV and the draft's)."""
    from stages.inprocess import InProcessEngine

    info = ModelInfo.from_dir(model_dir)
    draft = SpeculativeConfig("draft", 4, model=str(model_dir), quantization=quantization,
                              disable_by_batch_size=max_batch)
    return InProcessEngine(str(model_dir), max_num_seqs=4, block_size=16, max_model_len=512,
                           kv_cache_memory=2 * num_blocks * KV_BLOCK_BYTES,
                           speculative=draft, eos_token_ids=info.eos_token_ids,
                           **kw)  # type: ignore[arg-type]


# SmolLM2-135M's KV per block of 16 tokens in float32: 30 layers, 3 KV heads of 64
KV_BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 4


@pytest.fixture(scope="module")
def drafted(default_model_dir: Path) -> object:
    return draft_engine(default_model_dir, 80, max_num_batched_tokens=512)


@pytest.mark.slow  # (the default model in process, tens of seconds)
@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=40, temperature=0),
    SamplingParams(max_tokens=40, temperature=0.5, top_k=20, seed=7),
    SamplingParams(max_tokens=40, temperature=0, logprobs=3, min_tokens=5),
], ids=["greedy", "seeded", "logprobs"])
@pytest.mark.parametrize("proposer", ["ngram", pytest.param("draft", marks=needs_kernels)])
def test_the_model_gives_the_same_tokens_with_drafts(engines: tuple, params: SamplingParams,
                                                     proposer: str,
                                                     request: pytest.FixtureRequest) -> None:
    """Greedy and seeded requests are token for token the same with and without
    speculation, by n-gram or by a draft model (a seeded draw depends only on the logits,
    the seed and the position), and logprobs of the accepted tokens are the model's."""
    plain_engine, spec_engine, prompts, tok = engines
    if proposer == "draft":  # (a draft model runs on the CPU kernels only)
        spec_engine = request.getfixturevalue("drafted")
    requests = [(str(i), p, params) for i, p in enumerate(prompts)]
    before = spec_engine.scheduler.spec_num_accepted_tokens
    plain, spec = plain_engine.run(requests), spec_engine.run(requests)
    assert spec_engine.scheduler.spec_num_accepted_tokens - before > 3  # drafts stood
    for key, want in plain.items():
        got = spec[key]
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
        if params.logprobs is not None:
            assert [e.token_id for e in got.logprobs] == [e.token_id for e in want.logprobs]
            for a, b in zip(got.logprobs, want.logprobs, strict=True):
                assert a.logprob == pytest.approx(b.logprob, abs=1e-3)


@pytest.mark.slow  # (the default model in process, tens of seconds)
def test_structured_outputs_are_drafted_masked_at_each_position_and_stay_valid(
        engines: tuple) -> None:
    """A JSON array of objects repeats its own keys: drafts are proposed and accepted; the
    matcher masks each drafted position (taking the drafts before it, then rolling them
    back) and then takes what stood. The output is valid and the same as without drafts,
    beside a regex output and copy prompts in the same steps."""
    import json

    from ipc.messages import StructuredOutputs

    plain_engine, spec_engine, prompts, tok = engines
    schema = {"type": "array", "minItems": 6, "maxItems": 6, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                         "age": {"type": "integer"}},
        "required": ["name", "age"], "additionalProperties": False}}
    people = tok("People: Ann is 31, Bob is 42, Cid is 23, Dee is 54, Eve is 35, Fay is 26. "
                 "As JSON:")["input_ids"]
    as_json = SamplingParams(max_tokens=120, temperature=0,
                             structured_outputs=StructuredOutputs(json=json.dumps(schema)))
    before = spec_engine.scheduler.spec_num_accepted_tokens
    alone = spec_engine.run([("j", people, as_json)])
    assert spec_engine.scheduler.spec_num_accepted_tokens - before > 20
    regex = SamplingParams(max_tokens=30, temperature=0,
                           structured_outputs=StructuredOutputs(regex=r"(ab|cd){3,6}x"))
    copy = SamplingParams(max_tokens=40, temperature=0)
    requests = [("j", people, as_json), ("s", prompts[0], regex),
                *((f"c{i}", p, copy) for i, p in enumerate(prompts))]
    plain, spec = plain_engine.run(requests), spec_engine.run(requests)
    def tokens(results: dict) -> dict:
        return {k: (r.token_ids, r.finish_reason) for k, r in results.items()}

    assert tokens(spec) == tokens(plain) and tokens(alone)["j", 0] == tokens(plain)["j", 0]
    answer = json.loads(tok.decode(spec["j", 0].token_ids, skip_special_tokens=True))
    assert len(answer) == 6 and all(set(a) == {"name", "age"} for a in answer)
    assert re.fullmatch(r"(ab|cd){3,6}x", tok.decode(spec["s", 0].token_ids,
                                                     skip_special_tokens=True))


@pytest.mark.slow  # (the default model in process, tens of seconds)
@needs_kernels
def test_a_draft_models_cache_keeps_step_with_the_models(engines: tuple,
                                                        default_model_dir: Path) -> None:
    """The model drafting for itself proposes exactly what it then samples, greedy, only
    if its own KV cache holds what the model's holds at every position: through chunked
    prefill (64-token budget), prefix hits, preemption (12 blocks) and rows whose drafts
    all stood (whose last draft's KV the next row's lead writes). So all but a rare tie
    stand, and outputs are the model's."""
    from stages.inprocess import InProcessEngine

    tok = engines[3]
    preamble = "Here is a long shared preamble about the history of computing machines and " \
        "their makers. "
    texts = [preamble + "Tell me about Ada.", preamble + "Tell me about Babbage.",
             "Count: 1, 2, 3,", preamble + "And Turing?", "Write a poem about rain."]
    asks = [tok(t)["input_ids"] for t in texts]
    greedy = SamplingParams(max_tokens=60, temperature=0)
    requests = [(str(i), ids, greedy) for i, ids in enumerate(asks)]
    info = ModelInfo.from_dir(default_model_dir)
    plain = InProcessEngine(str(default_model_dir), max_num_seqs=4, block_size=16,
                            max_model_len=512, kv_cache_memory=12 * KV_BLOCK_BYTES,
                            max_num_batched_tokens=64, eos_token_ids=info.eos_token_ids)
    spec = draft_engine(default_model_dir, 12, max_num_batched_tokens=64)
    assert spec.runner.num_blocks == plain.runner.num_blocks == 12
    want, got = plain.run(requests), spec.run(requests)
    assert {k: r.token_ids for k, r in got.items()} == {k: r.token_ids for k, r in want.items()}
    s = spec.scheduler
    assert s.num_preemptions > 0 and s.spec_num_draft_tokens > 100
    assert s.spec_num_accepted_tokens >= 0.97 * s.spec_num_draft_tokens


@pytest.mark.slow  # (the default model in process, tens of seconds)
@needs_kernels
def test_draft_passes_run_ahead_of_the_plan_and_change_no_output(
        engines: tuple, default_model_dir: Path) -> None:
    """While the scheduler waits for a drafted row's verification (the device would idle),
    the executor runs the next step's draft passes already (drafter.work_ahead), and that
    step takes them when its first pass is the one run ahead. One request at a time, the
    model drafting for itself in float32: outputs are the model's and drafts stand but for
    ties (what the passes run ahead wrote kept the caches in step); the drafted steps after
    each request's first take passes run ahead (the scheduler holds the block where a row's
    last sample lands, so none stops at a block's end); none are run after a row that ends
    its sequence (an end token, or max_tokens)."""
    plain_engine, _, prompts, tok = engines
    spec = draft_engine(default_model_dir, 80, max_num_batched_tokens=512)
    asks = [*prompts, tok("Write a poem about rain.")["input_ids"]]
    for ask, n in zip(asks, (50, 37, 61, 45), strict=True):
        greedy = SamplingParams(max_tokens=n, temperature=0)
        assert spec.generate([ask], greedy) == plain_engine.generate([ask], greedy)
    s, drafter = spec.scheduler, spec.runner.drafter
    assert s.spec_num_accepted_tokens >= 0.97 * s.spec_num_draft_tokens
    assert drafter.num_ahead_taken >= s.spec_num_drafts - len(asks)
    assert drafter.num_ahead == drafter.num_ahead_taken


@pytest.mark.slow  # (the default model in process, tens of seconds)
@needs_kernels
def test_a_draft_model_that_mostly_misses_changes_no_output(
        engines: tuple, default_model_dir: Path, tmp_path: Path) -> None:
    """Random weights with the model's tokenizer as the draft model: most drafts are
    rejected (their KV rolled back in both caches) and back-off thins them; the outputs
    stay the model's, greedy and seeded, through chunked prefill and preemption."""
    from pipeline.tools.random_model import build_random_llama
    from stages.inprocess import InProcessEngine

    tok = engines[3]
    info = ModelInfo.from_dir(default_model_dir)
    draft_dir = build_random_llama(tmp_path / "draft", vocab_size=info.vocab_size,
                                   tokenizer_from=default_model_dir)
    kw = dict(max_num_seqs=4, block_size=16, max_model_len=512, max_num_batched_tokens=64,
              eos_token_ids=info.eos_token_ids)
    asks = [tok(t)["input_ids"] for t in ("Count: 1, 2, 3,", "Once upon a time,",
                                          "The list: a, b, c,", "Tell me about Ada.")]
    requests = [(str(i), ids, SamplingParams(max_tokens=40, temperature=0.7 * (i % 2), seed=i))
                for i, ids in enumerate(asks)]
    plain = InProcessEngine(str(default_model_dir), kv_cache_memory=6 * KV_BLOCK_BYTES, **kw)
    draft = SpeculativeConfig("draft", 3, model=str(draft_dir))
    spec = InProcessEngine(str(default_model_dir), speculative=draft,
                           kv_cache_memory=6 * (KV_BLOCK_BYTES + 8192), **kw)  # (8 KiB its own)
    assert spec.runner.num_blocks == plain.runner.num_blocks
    want, got = plain.run(requests), spec.run(requests)
    assert {k: r.token_ids for k, r in got.items()} == {k: r.token_ids for k, r in want.items()}
    s = spec.scheduler
    assert s.num_preemptions > 0 and s.spec_num_draft_tokens > 10
    assert s.spec_num_accepted_tokens < 0.5 * s.spec_num_draft_tokens


@pytest.mark.slow  # (the default model in process, tens of seconds)
@needs_kernels
def test_a_draft_model_leaves_structured_outputs_undrafted(drafted: object, engines: tuple
                                                          ) -> None:
    """The host never sees a draft model's drafts, so a structured output's matcher could
    not mask their positions: such a request is not drafted, and stays valid."""
    from ipc.messages import StructuredOutputs

    _, _, prompts, tok = engines
    before = drafted.scheduler.spec_num_drafts
    regex = SamplingParams(max_tokens=30, temperature=0,
                           structured_outputs=StructuredOutputs(regex=r"(ab|cd){3,6}x"))
    out = drafted.run([("s", prompts[0], regex)])
    assert drafted.scheduler.spec_num_drafts == before
    assert re.fullmatch(r"(ab|cd){3,6}x", tok.decode(out["s", 0].token_ids,
                                                     skip_special_tokens=True))


@pytest.mark.slow  # (the default model in process, tens of seconds)
@needs_kernels
def test_a_draft_model_drafts_only_while_few_sequences_run(engines: tuple,
                                                           default_model_dir: Path) -> None:
    """Past disable_by_batch_size running sequences the draft model's passes would cost
    each step more than drafts win back: such sequences are not drafted and the draft
    model stops keeping their KV for good (a row says so to the executor); outputs stand."""
    plain_engine, _, prompts, tok = engines
    spec = draft_engine(default_model_dir, 80, max_batch=2, max_num_batched_tokens=512)
    greedy = SamplingParams(max_tokens=24, temperature=0)
    asks = [*prompts, tok("Write a poem about rain.")["input_ids"]]
    kept = []
    schedule = spec.scheduler.schedule

    def planned() -> object:
        step = schedule()
        kept.extend(row.draft_kv for row in step.rows) if step is not None else None
        return step

    spec.scheduler.schedule = planned
    assert spec.generate(asks, greedy) == plain_engine.generate(asks, greedy)
    assert spec.scheduler.spec_num_drafts == 0 and not any(kept[len(asks):])
    assert spec.generate(asks[:2], greedy) == plain_engine.generate(asks[:2], greedy)
    assert spec.scheduler.spec_num_drafts > 0 and any(kept)


@pytest.mark.slow  # (the default model in process, tens of seconds)
@needs_kernels
def test_a_quantized_draft_model_proposes_what_the_model_mostly_takes(
        engines: tuple, default_model_dir: Path) -> None:
    """The model's own weights quantized to int4 as its draft: the outputs are the float
    model's, and most drafts stand (the quantized copy seldom disagrees)."""
    from stages.executor.preflight import cpu_flags

    if not {"avx512f", "avx512bw", "avx512_vnni"} <= (cpu_flags() or set()):
        pytest.skip("the int4 kernels need AVX-512 with VNNI")
    plain_engine, _, prompts, _ = engines
    spec = draft_engine(default_model_dir, 80, "int4", max_num_batched_tokens=512)
    greedy = SamplingParams(max_tokens=40, temperature=0)
    assert spec.generate(prompts, greedy) == plain_engine.generate(prompts, greedy)
    s = spec.scheduler
    assert s.spec_num_accepted_tokens > 0.6 * s.spec_num_draft_tokens > 30


@pytest.mark.slow
@pytest.mark.live
@pytest.mark.parametrize("proposer", ["ngram", pytest.param("draft", marks=needs_kernels)])
def test_a_live_pipeline_with_drafts_answers_as_without(engines: tuple, default_model_dir: Path,
                                                        proposer: str) -> None:
    """The real processes with --speculative (n-gram, or the model drafting for itself in
    the executor, run-ahead on): the copy prompts' greedy outputs are those of the engine
    without drafts, several requests share steps, the counters come back in the status,
    and a request that opts out is never drafted."""
    from live import live_config, running

    plain_engine, _, prompts, _ = engines
    params = SamplingParams(max_tokens=48, temperature=0)
    want = plain_engine.generate(prompts, params)
    speculative = (SpeculativeConfig("ngram", 5, 3, 2) if proposer == "ngram" else
                   SpeculativeConfig("draft", 4, model=str(default_model_dir)))
    cfg = live_config(default_model_dir, max_num_batched_tokens=512, max_model_len=512,
                      speculative=speculative)
    with running(cfg) as pipe:
        client = pipe.client()
        outs = client.generate(prompts, params)  # type: ignore[arg-type]
        assert [o.token_ids for o in outs] == want
        stats = pipe.idle_stats()
        assert stats.spec_num_accepted_tokens > 20
        assert sum(stats.spec_accepted_per_pos) == stats.spec_num_accepted_tokens
        off = dataclasses.replace(params, speculate=False)
        (alone,) = client.generate(prompts[:1], off)  # type: ignore[arg-type]
        assert alone.token_ids == want[0]
        assert pipe.idle_stats().spec_num_drafts == stats.spec_num_drafts


def test_the_copy_workload_asks_to_copy_a_piece_of_this_projects_source(
        tiny_model_dir: Path) -> None:
    import argparse

    from pipeline.tools.bench_throughput import make_workload
    from pipeline.tools.datasets import COPY_SOURCES, copy_prompts

    root = Path(__file__).resolve().parents[1]
    texts = [(root / f).read_text(encoding="utf-8") for f in COPY_SOURCES]
    prompts = copy_prompts(7, seed=2)
    assert prompts == copy_prompts(7, seed=2) and len(set(prompts)) == 7
    for p in prompts:
        piece = p.split("Piece:\n", 1)[1].split("\n\nThe same piece, copied:\n")[0]
        assert len(piece) > 200 and any(piece in t for t in texts)
    work = make_workload(argparse.Namespace(model_dir=str(tiny_model_dir), dataset="copy",
                                            num_prompts=3, output_len=9))
    assert len(work.prompts) == 3 and work.output_lens == [9, 9, 9]
    assert all(len(ids) > 50 for ids in work.prompts)
