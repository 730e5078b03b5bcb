"""A structured output after a thinking model's reasoning (SamplingParams.reasoning): the
executor's matcher takes no token and masks nothing while the model thinks, then constrains
what follows the end tag; a first token may open the reasoning, or be the answer's; a resumed
sequence catches up through the same states. Unit (SlotGrammars) and in process."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from ipc.messages import ReasoningTags, SamplingParams, StructuredOutputs
from ipc.model_info import ModelInfo
from stages.executor.grammar_mask import SlotGrammars
from stages.grammar import Grammars, words_per_row
from stages.inprocess import InProcessEngine

DIGITS = StructuredOutputs(regex="[0-9]{3}")


@pytest.fixture(scope="module")
def setup(tiny_model_dir: Path) -> tuple[Grammars, dict[str, int]]:
    from transformers import AutoTokenizer

    info = ModelInfo.from_dir(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("1", "2", "a", "b", "x")}
    return Grammars(str(tiny_model_dir), info.vocab_size, info.eos_token_ids[0]), ids


def allowed(slots: SlotGrammars, slot: int, vocab: int) -> set[int]:
    rows, which = slots.rows(np.array([slot]))
    assert len(rows) == 1
    buffer = torch.zeros(1, words_per_row(vocab), dtype=torch.int32)
    mask = slots.fill(which, buffer)
    bits = mask.view(torch.uint8).view(-1)
    return {t for t in range(vocab) if (int(bits[t // 8]) >> (t % 8)) & 1}


def test_the_grammar_waits_for_the_end_tag(setup: tuple[Grammars, dict[str, int]]) -> None:
    grammars, ids = setup
    vocab = grammars.vocab_size
    start, end = ids["a"], ids["b"]  # (any two tokens stand for the tags)
    tags = ReasoningTags(start, end)
    slots = SlotGrammars(grammars)
    text = grammars.grammar(DIGITS)
    slots.admit(0, text, (), tags)
    first = allowed(slots, 0, vocab)
    assert start in first and ids["1"] in first and ids["x"] not in first
    for token in (start, ids["x"], start, ids["x"]):  # it opened the reasoning, and thinks
        slots.consume(np.array([0]), np.array([token]))
        assert allowed(slots, 0, vocab) == set(range(vocab))
    slots.consume(np.array([0]), np.array([end]))
    after = allowed(slots, 0, vocab)
    assert ids["1"] in after and start not in after and end not in after
    # a first token that is the answer's: the grammar took it
    slots.admit(1, text, (), tags)
    slots.consume(np.array([1]), np.array([ids["1"]]))
    slots.consume(np.array([1]), np.array([ids["2"]]))
    assert slots.matchers[1].consume_token(ids["1"]) and slots.matchers[1].is_stopped()  # 3
    # the template opened it: thinking from the first token, the start tag is just text
    slots.admit(2, text, (), ReasoningTags(-1, end, opened=True))
    assert allowed(slots, 2, vocab) == set(range(vocab))
    # resumed after a preemption: the same states, from its outputs
    slots.admit(3, text, [start, ids["x"], end, ids["1"]], tags)
    slots.admit(4, text, [ids["1"]], None)
    assert allowed(slots, 3, vocab) == allowed(slots, 4, vocab)


def test_in_process_the_format_follows_the_thinking(tiny_model_dir: Path) -> None:
    """+100 on the end tag: the thinking ends at once (the tag is not a digit, so the format
    masks it from then on), then three digits. Without the tags, the format starts at the
    first token, which then cannot be the tag."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    end = tok.convert_tokens_to_ids("b")
    eos = ModelInfo.from_dir(tiny_model_dir).eos_token_ids
    engine = InProcessEngine(str(tiny_model_dir), eos_token_ids=eos)
    engine.runner.slots.matchers.grammars  # noqa: B018 (structured outputs are on)
    params = SamplingParams(max_tokens=12, temperature=0.0, structured_outputs=DIGITS,
                            logit_bias={end: 100.0})
    tagged = SamplingParams(**{**_fields(params), "reasoning": ReasoningTags(-1, end, True)})
    out = engine.generate([[5, 9, 13]], tagged)[0]
    assert out[0] == end and re.fullmatch("[0-9]{3}", tok.decode(out[1:4])), out
    plain = engine.generate([[5, 9, 13]], params)[0]
    assert end not in plain and re.fullmatch("[0-9]{3}", tok.decode(plain[:3])), plain


def _fields(p: SamplingParams) -> dict[str, object]:
    return {f: getattr(p, f) for f in p.__dataclass_fields__}
