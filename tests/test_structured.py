"""Structured outputs: grammars from every kind of format (and the errors of bad ones), the
bitmask on the logits, matchers per slot (catching up after a preemption, ignoring the rows a
run-ahead step sampled past the end, failing loudly), the scheduler's error path, and whole
runs where every output parses and validates: many seeds, nested objects, enums, arrays, with
run-ahead, preemption and chunked prefill."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch
from scheduler_driver import make_limits, make_request

from ipc.messages import FinishReason, SamplingParams, StructuredOutputs
from ipc.model_info import ModelInfo
from ipc.params import RequestError, validate_params
from stages.executor.grammar_mask import SlotGrammars, apply_bitmask
from stages.grammar import Grammars, words_per_row
from stages.inprocess import InProcessEngine
from stages.scheduler.core import Scheduler

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "address", "active"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def grammars(tiny_model_dir: Path) -> Grammars:
    info = ModelInfo.from_dir(tiny_model_dir)
    return Grammars(str(tiny_model_dir), info.vocab_size, info.eos_token_ids[0])


def decode(model_dir: Path, ids: list[int]) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    eos = tok.eos_token_id
    return str(tok.decode([t for t in ids if t != eos]))


# ---------------------------------------------------------------- grammars


@pytest.mark.parametrize("so", [
    StructuredOutputs(json=json.dumps(PERSON)), StructuredOutputs(json_object=True),
    StructuredOutputs(regex=r"[0-9]{3}-[0-9]{4}"), StructuredOutputs(choice=['a "b"', "ü", "c"]),
    StructuredOutputs(grammar='start: "x" NUMBER\n%import common.NUMBER'),
])
def test_every_kind_of_format_compiles(grammars: Grammars, so: StructuredOutputs) -> None:
    text = grammars.grammar(so)
    assert text and grammars.matcher(text).is_error() is False


@pytest.mark.parametrize("so, words", [
    (StructuredOutputs(json='{"type": "objectx"}'), "objectx"),
    (StructuredOutputs(json="{not json"), "invalid json"),
    (StructuredOutputs(regex="(a"), "unclosed group"),
    (StructuredOutputs(grammar="start: undefined_rule"), "undefined_rule"),
    (StructuredOutputs(choice=[""]), "non-empty"),
    (StructuredOutputs(), "exactly one"),
    (StructuredOutputs(regex="a", choice=["a"]), "exactly one"),
])
def test_a_bad_format_is_an_error_naming_structured_outputs(grammars: Grammars,
                                                            so: StructuredOutputs,
                                                            words: str) -> None:
    with pytest.raises(RequestError) as err:
        grammars.grammar(so)
    assert err.value.param == "structured_outputs" and words in err.value.message


def test_a_schema_may_be_given_as_a_python_value() -> None:
    assert StructuredOutputs(json={"type": "object"}).json == '{"type": "object"}'


@pytest.mark.parametrize("change, param", [
    ({"min_tokens": 2}, "min_tokens"), ({"ignore_eos": True}, "ignore_eos"),
    ({"structured_outputs": StructuredOutputs(choice=["x"] * 2000)}, "structured_outputs"),
    ({"structured_outputs": StructuredOutputs(regex="a" * 200_000)}, "structured_outputs"),
])
def test_what_a_format_cannot_be_combined_with(change: dict, param: str) -> None:
    fields = {"structured_outputs": StructuredOutputs(json_object=True), **change}
    with pytest.raises(RequestError) as err:
        validate_params(SamplingParams(**fields), 100)
    assert err.value.param == param


# ---------------------------------------------------------------- the mask


def test_apply_bitmask_keeps_exactly_the_allowed_tokens_of_its_rows() -> None:
    vocab, gen = 70, torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=gen)
    allowed = torch.rand(2, vocab, generator=gen) < 0.3
    bits = torch.zeros(2, words_per_row(vocab) * 32, dtype=torch.int64)
    bits[:, :vocab] = allowed.long()
    weights = 2 ** torch.arange(32, dtype=torch.int64)
    words = (bits.view(2, -1, 32) * weights).sum(-1)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    rows = torch.tensor([3, 1])
    out = apply_bitmask(logits, rows, bitmask)
    for r, row in enumerate((3, 1)):
        assert torch.equal(torch.isinf(out[row]), ~allowed[r])
        assert torch.equal(out[row][allowed[r]], logits[row][allowed[r]])
    assert torch.equal(out[[0, 2]], logits[[0, 2]])  # the other rows are untouched
    assert not torch.isinf(logits).any()  # and the raw logits too (logprobs read them)


def random_walk(grammars: Grammars, so: StructuredOutputs, seed: int,
                limit: int = 400) -> list[int]:
    """Sample uniformly among the tokens the format allows until EOS: what a model that has
    no idea of the format produces under the mask."""
    slots = SlotGrammars(grammars)
    slots.admit(0, grammars.grammar(so), ())
    buffer = torch.zeros(1, words_per_row(grammars.vocab_size), dtype=torch.int32)
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(limit):
        mask = slots.fill(np.array([0]), buffer)
        logits = apply_bitmask(torch.rand(1, grammars.vocab_size, generator=gen),
                               torch.tensor([0]), mask)
        token = int(logits.argmax())
        out.append(token)
        if token == grammars.eos_token_id:
            return out
        slots.consume(np.array([0]), np.array([token]))
        assert not slots.failed
    raise AssertionError(f"no EOS in {limit} tokens")


@pytest.mark.parametrize("seed", range(20))
def test_random_walks_under_a_nested_schema_always_validate(grammars: Grammars,
                                                            tiny_model_dir: Path,
                                                            seed: int) -> None:
    ids = random_walk(grammars, StructuredOutputs(json=json.dumps(PERSON)), seed)
    jsonschema.validate(json.loads(decode(tiny_model_dir, ids)), PERSON)


@pytest.mark.parametrize("so, check", [
    (StructuredOutputs(regex=r"[0-9]{3}-[0-9]{4}"),
     lambda t: len(t) == 8 and t[3] == "-" and (t[:3] + t[4:]).isdigit()),
    (StructuredOutputs(choice=["red", "green", "blue"]), lambda t: t in ("red", "green", "blue")),
    (StructuredOutputs(json_object=True), lambda t: isinstance(json.loads(t), dict)),
])
def test_random_walks_under_regex_choice_and_json_object(grammars: Grammars,
                                                         tiny_model_dir: Path,
                                                         so: StructuredOutputs, check) -> None:
    for seed in range(5):
        text = decode(tiny_model_dir, random_walk(grammars, so, seed, limit=2000))
        assert check(text), text


# ---------------------------------------------------------------- matchers per slot


def walk_tokens(grammars: Grammars, so: StructuredOutputs, seed: int) -> list[int]:
    return random_walk(grammars, so, seed)[:-1]  # without the EOS


def test_a_resumed_sequence_catches_up_to_the_same_mask(grammars: Grammars) -> None:
    so = StructuredOutputs(json=json.dumps(PERSON))
    ids = walk_tokens(grammars, so, 3)
    half = len(ids) // 2
    words = words_per_row(grammars.vocab_size)
    one_by_one, resumed = SlotGrammars(grammars), SlotGrammars(grammars)
    one_by_one.admit(5, grammars.grammar(so), ())
    for t in ids[:half]:
        one_by_one.consume(np.array([5]), np.array([t]))
    resumed.admit(2, grammars.grammar(so), ids[:half])  # another slot, after a preemption
    a = one_by_one.fill(np.array([5]), torch.zeros(1, words, dtype=torch.int32))
    b = resumed.fill(np.array([2]), torch.zeros(1, words, dtype=torch.int32))
    assert torch.equal(a, b)


def test_a_complete_format_allows_only_eos_then_its_matcher_goes(grammars: Grammars) -> None:
    so = StructuredOutputs(choice=["yes"])
    slots = SlotGrammars(grammars)
    slots.admit(0, grammars.grammar(so), walk_tokens(grammars, so, 0))
    eos = grammars.eos_token_id
    mask = slots.fill(np.array([0]), torch.zeros(1, words_per_row(grammars.vocab_size),
                                                 dtype=torch.int32))
    logits = apply_bitmask(torch.zeros(1, grammars.vocab_size), torch.tensor([0]), mask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [eos]
    slots.consume(np.array([0]), np.array([eos]))
    assert 0 not in slots.matchers  # no more grammar work for the slot
    for junk in (7, 9):  # what a run-ahead step sampled after the end: dropped, no error
        slots.consume(np.array([0]), np.array([junk]))
    assert not slots.failed and slots.rows(np.array([0]))[0].tolist() == []


def test_a_rejected_token_fails_its_slot_and_its_next_rows_report_minus_one(
        grammars: Grammars) -> None:
    slots = SlotGrammars(grammars)
    slots.admit(4, grammars.grammar(StructuredOutputs(regex="[0-9]+")), ())
    slots.admit(6, grammars.grammar(StructuredOutputs(regex="[0-9]+")), ())
    from transformers import AutoTokenizer

    letter = AutoTokenizer.from_pretrained(grammars.model_dir)("z", add_special_tokens=False)
    slots.consume(np.array([4]), np.array(letter["input_ids"][:1]))  # not a digit
    assert list(slots.failed) == [4]
    tokens = torch.tensor([11, 12, 13])
    slots.mark_failed(np.array([6, 4, 1]), tokens)
    assert tokens.tolist() == [11, -1, 13]
    slots.admit(4, "", ())  # a new sequence takes the slot: nothing of the old one stays
    assert 4 not in slots.failed and 4 not in slots.matchers


def test_the_scheduler_ends_a_sequence_whose_grammar_failed_with_an_error() -> None:
    core = Scheduler(make_limits(depth=1).engine, 64)
    req = make_request("r", 4, max_tokens=8)
    core.add_request(type(req)(req.request_id, req.reply_to, req.prompt_token_ids,
                               SamplingParams(max_tokens=8, structured_outputs=StructuredOutputs(
                                   json_object=True)), 0.0, "grammar text"))
    step = core.schedule()
    assert step is not None and [g.slot for g in step.grammars] == [core.seq("r").slot]
    core.on_sampled(step.step_id, [-1])
    delta = core.take_outputs().deltas[-1]
    assert delta.finish_reason is FinishReason.ERROR and "grammar" in (delta.error or "")


def test_the_scheduler_refuses_a_format_without_its_grammar() -> None:
    core = Scheduler(make_limits().engine, 64)
    core.add_request(make_request("r", 4, max_tokens=8, structured_outputs=StructuredOutputs(
        json_object=True)))
    rejected = core.take_outputs().rejected
    assert rejected and "grammar" in (rejected[0].error or "")


# ---------------------------------------------------------------- whole runs


@pytest.mark.slow
@pytest.mark.parametrize("depth", [1, 2])
def test_every_output_validates_with_run_ahead_preemption_and_chunked_prefill(
        tiny_model_dir: Path, depth: int) -> None:
    """16 seeded samples under the nested schema, through the scheduler and the model, in a
    cache so small that sequences are preempted and resumed, with prompts chunked: each one
    parses and validates, and greedy ones equal a roomy run's."""
    eos = ModelInfo.from_dir(tiny_model_dir).eos_token_ids
    so = StructuredOutputs(json=json.dumps(PERSON))
    prompts = [[5 + i, 9, 13 + i, 40, 41, 42, 43, 44][: 3 + i % 6] for i in range(16)]
    runs = {}
    for name, memory in (("tiny", 130 * 2048), ("roomy", 1 << 24)):
        engine = InProcessEngine(str(tiny_model_dir), block_size=4, kv_cache_memory=memory,
                                 depth=depth, max_num_seqs=8, max_num_batched_tokens=16,
                                 eos_token_ids=eos, max_model_len=512)
        sampled = engine.run([(f"s{i}", p, SamplingParams(max_tokens=480, temperature=1.0,
                                                          seed=i, structured_outputs=so))
                              for i, p in enumerate(prompts)])
        greedy = engine.generate(prompts[:4], SamplingParams(max_tokens=480, temperature=0.0,
                                                             structured_outputs=so))
        runs[name] = greedy
        for result in [*sampled.values()]:
            assert result.finish_reason is FinishReason.STOP, result
            jsonschema.validate(json.loads(decode(tiny_model_dir, result.token_ids)), PERSON)
        if name == "tiny":
            assert engine.scheduler.num_preemptions > 0
    assert runs["tiny"] == runs["roomy"]


def test_a_grammar_that_fails_in_the_executor_ends_its_request_only(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """If the library raises while filling masks, the structured requests end with an error
    and the others in the same batches finish as usual; the engine goes on."""
    eos = ModelInfo.from_dir(tiny_model_dir).eos_token_ids
    engine = InProcessEngine(str(tiny_model_dir), block_size=4, eos_token_ids=eos)

    def broken_fill(self, slots, buffer):  # type: ignore[no-untyped-def]
        raise RuntimeError("library bug")

    monkeypatch.setattr(SlotGrammars, "fill", broken_fill)
    results = engine.run([
        ("structured", [5, 9, 13], SamplingParams(max_tokens=8, temperature=0.0,
                                                  structured_outputs=StructuredOutputs(
                                                      json_object=True))),
        ("plain", [7, 8, 9], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))])
    assert results["structured", 0].finish_reason is FinishReason.ERROR
    assert results["plain", 0].finish_reason is FinishReason.LENGTH
    assert len(results["plain", 0].token_ids) == 8


def test_every_end_token_of_the_model_ends_a_format(tiny_model_dir: Path) -> None:
    """A model with several end tokens (Llama 3.1 Instruct ends a turn with <|eot_id|>, not
    the first of its eos ids): where the format may end, each is allowed, and each ends it."""
    info = ModelInfo.from_dir(tiny_model_dir)
    eos, other = info.eos_token_ids[0], 31  # 31: in the last bit of its word
    grammars = Grammars(str(tiny_model_dir), info.vocab_size, eos, end_token_ids=(eos, other))
    so = StructuredOutputs(choice=["yes"])
    buffer = torch.zeros(1, words_per_row(grammars.vocab_size), dtype=torch.int32)
    walked = walk_tokens(Grammars(str(tiny_model_dir), info.vocab_size, eos), so, 0)
    slots = SlotGrammars(grammars)
    slots.admit(0, grammars.grammar(so), ())
    first = apply_bitmask(torch.zeros(1, grammars.vocab_size), torch.tensor([0]),
                          slots.fill(np.array([0]), buffer))
    assert not torch.isfinite(first[0, [eos, other]]).any()  # not before the format is done
    slots.consume(np.array([0] * len(walked)), np.array(walked))
    done = apply_bitmask(torch.zeros(1, grammars.vocab_size), torch.tensor([0]),
                         slots.fill(np.array([0]), buffer))
    assert sorted(torch.isfinite(done[0]).nonzero().flatten().tolist()) == sorted([eos, other])
    slots.consume(np.array([0]), np.array([other]))
    assert 0 not in slots.matchers and not slots.failed
