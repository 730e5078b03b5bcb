"""Reasoning parsers (pipeline/server/reasoning.py): the fields each answer splits into, and
the same fields however the answer is cut into deltas (every split into two, and one
character at a time), so a tag split over deltas never leaks into either field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ipc.errors import ConfigError
from pipeline.server.reasoning import (
    DeepSeekR1Parser,
    HarmonyParser,
    Qwen3Parser,
    ReasoningParser,
    ReasoningSpec,
    Split,
    check_parser,
    prompt_opens_reasoning,
    reasoning_tokens,
    token_id,
)

# (parser, the prompt left <think> open, answer, reasoning, content)
CASES = [
    (Qwen3Parser, False, "<think>\nI add 2 and 2.\n</think>\n\nIt is 4.", "\nI add 2 and 2.\n",
     "It is 4."),
    (Qwen3Parser, False, "It is 4.", "", "It is 4."),  # enable_thinking=False: no block
    (Qwen3Parser, False, "  <thin", "", "  <thin"),  # cut inside a would-be tag: content
    (Qwen3Parser, False, "\n<think>a < b </thin> c</think>x</think>", "a < b </thin> c",
     "x</think>"),
    (Qwen3Parser, True, "plan</think>\n\nanswer", "plan", "answer"),  # template opened it
    (Qwen3Parser, True, "<think>plan</think>answer", "plan", "answer"),
    (Qwen3Parser, True, "still thinking </thi", "still thinking </thi", ""),  # max_tokens
    (Qwen3Parser, False, "<think></think>\n\n", "", ""),
    (DeepSeekR1Parser, False, "no tag, thinking</think>done", "no tag, thinking", "done"),
    (DeepSeekR1Parser, False, "<think>with tag</think> done", "with tag", "done"),
    (DeepSeekR1Parser, False, "never ends", "never ends", ""),
    (DeepSeekR1Parser, False, "", "", ""),
    (HarmonyParser, False, "<|channel|>analysis<|message|>2 + 2 < 5<|end|><|start|>assistant"
     "<|channel|>final<|message|>It is 4.<|return|>", "2 + 2 < 5", "It is 4."),
    (HarmonyParser, False, "<|channel|>analysis<|message|>cut short", "cut short", ""),
    (HarmonyParser, False, "no harmony <at all>", "", "no harmony <at all>"),
    (HarmonyParser, False, "<|channel|>analysis<|message|>call it<|end|><|start|>assistant"
     "<|channel|>commentary to=functions.add <|constrain|>json<|message|>{\"a\": 1}<|call|>",
     "call it", "<|channel|>commentary to=functions.add <|constrain|>json<|message|>"
     "{\"a\": 1}<|call|>"),
]


def streamed(parser: ReasoningParser, pieces: list[str]) -> Split:
    reasoning, content = "", ""
    for piece in [*pieces, None]:
        part = parser.finish() if piece is None else parser.feed(piece)
        reasoning, content = reasoning + part.reasoning, content + part.content
    return Split(reasoning, content)


@pytest.mark.parametrize("cls, opened, text, reasoning, content", CASES)
def test_streamed_equals_whole_at_every_split(cls: type[ReasoningParser], opened: bool,
                                              text: str, reasoning: str, content: str) -> None:
    assert cls(opened).split(text) == (reasoning, content)
    for at in range(len(text) + 1):
        assert streamed(cls(opened), [text[:at], text[at:]]) == (reasoning, content), at
    assert streamed(cls(opened), list(text)) == (reasoning, content)


def test_a_tag_split_over_deltas_is_held_not_leaked() -> None:
    p = Qwen3Parser()
    assert p.feed("<th") == ("", "")
    assert p.feed("ink>why</th") == ("why", "")
    assert p.feed("ink>\n") == ("", "")
    assert p.feed("\nso") == ("", "so")


def test_prompt_opens_reasoning() -> None:
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n", Qwen3Parser)
    assert not prompt_opens_reasoning("assistant\n<think>\n\n</think>\n\n", Qwen3Parser)
    assert not prompt_opens_reasoning("<|im_start|>assistant\n", Qwen3Parser)


def test_reasoning_tokens_count_up_to_the_end_tag() -> None:
    end = 9
    done = Qwen3Parser()
    done.split("<think>a</think>b")
    assert reasoning_tokens([8, 1, end, 2, 3], done, end) == 3
    cut = Qwen3Parser()
    cut.split("<think>abc")
    assert reasoning_tokens([8, 1, 2], cut, end) == 3
    none = Qwen3Parser()
    none.split("abc")
    assert reasoning_tokens([1, 2], none, end) == 0
    # an end tag of several tokens, or merged with the text beside it: found in the text
    pieces = {1: "<think>", 2: "ab", 3: "c</", 4: "think", 5: ">\n", 6: "d"}
    split = Qwen3Parser()
    split.split("<think>abc</think>\nd")
    decode = lambda ids: "".join(pieces[i] for i in ids)  # noqa: E731
    assert reasoning_tokens([1, 2, 3, 4, 5, 6], split, None, decode) == 5
    assert reasoning_tokens([1, 2, 3, 4, 5, 6, 6, 6], split, None, decode) == 5


def test_reasoning_tokens_of_a_tag_of_several_tokens(tmp_path: Path) -> None:
    """A tokenizer without `</think>` as one token: the spec counts the answer's tokens up to
    the one that completes the tag, through the tokenizer's own decode."""
    from pipeline.tools.random_model import build_tokenizer

    tok = build_tokenizer(tmp_path)
    assert token_id(tok, "</think>") is None
    ids = tok("<think>plan it</think>\nthe answer", add_special_tokens=False)["input_ids"]
    within = len(tok("<think>plan it</think>", add_special_tokens=False)["input_ids"])
    spec = ReasoningSpec(Qwen3Parser, False, None, None, lambda i: tok.decode(i))
    answer = spec.answer(tok.decode(ids), ids)
    assert (answer.reasoning, answer.content) == ("plan it", "the answer")
    assert answer.num_reasoning_tokens == within < len(ids)


def test_parser_names() -> None:
    assert check_parser("qwen3") == "qwen3" and check_parser(None) is None
    assert check_parser("openai_gptoss") == "openai_gptoss"
    with pytest.raises(ConfigError, match="not known"):
        check_parser("granite")


def test_tool_calls_are_parsed_after_the_thinking_only() -> None:
    """A call the model only thought about is reasoning; the one after </think> is a call,
    whole and streamed (the content deltas go through the tool stream)."""
    from ipc.messages import FinishReason, ToolSpec
    from ipc.outputs import SampleResult
    from pipeline.server.openai_render import choice_json
    from pipeline.server.reasoning import ReasoningSpec
    from pipeline.server.tools import ToolRequest, ToolStream

    call = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    text = f"<think>maybe {call.replace('1', '2')}?</think>\n\n{call}"
    tools = ToolRequest([ToolSpec("add")], "auto")
    spec = ReasoningSpec(Qwen3Parser, False, None)
    result = SampleResult(0)
    result.text, result.finish_reason = text, FinishReason.STOP
    message = choice_json(result, True, False, tools, None,
                          spec.answer(result.text, result.token_ids))["message"]
    assert message["reasoning_content"] == f"maybe {call.replace('1', '2')}?"
    assert message["content"] is None and len(message["tool_calls"]) == 1
    assert message["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'
    for at in range(len(text) + 1):
        parser, stream = spec.new(), ToolStream(tools)
        deltas: list[dict] = []
        thought = ""
        for piece in (text[:at], text[at:]):
            split = parser.feed(piece)
            thought += split.reasoning
            deltas += stream.feed(split.content)
        thought += parser.finish().reasoning
        more, reason = stream.finish(FinishReason.STOP)
        deltas += more
        assert thought == message["reasoning_content"] and reason == "tool_calls"
        calls: dict[int, dict[str, str]] = {}  # a call's name comes first, then its arguments
        for d in deltas:
            for part in d["tool_calls"]:
                got = calls.setdefault(part["index"], {"name": "", "arguments": ""})
                for key in got:
                    got[key] += part["function"].get(key, "")
        assert list(calls.values()) == [{"name": "add", "arguments": '{"a": 1}'}], at


def test_the_spec_of_a_request(tmp_path: Path) -> None:
    """The front end's view: whether the template opened the reasoning; the tags a format
    waits for; harmony's answers keep their special-token markers, and a format cannot
    follow harmony's reasoning (refused by name)."""
    from pipeline.server.errors import ApiError
    from pipeline.server.openai_parse import parse_chat
    from pipeline.server.reasoning import reasoning_spec
    from pipeline.tools.random_model import build_tokenizer

    tok = build_tokenizer(tmp_path)
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = "{{ messages[0]['content'] }}{% if think %}<think>{% endif %}"
    body = {"messages": [{"role": "user", "content": "hi"}], "guided_regex": "[0-9]"}
    parsed = parse_chat({**body, "chat_template_kwargs": {"think": True}}, len(tok))
    spec = reasoning_spec(tok, "qwen3", parsed)
    end = tok.convert_tokens_to_ids("</think>")
    assert spec.opened and spec.end_id == end
    assert parsed.params.reasoning is not None and parsed.params.reasoning.opened
    closed = parse_chat(body, len(tok))
    assert not reasoning_spec(tok, "qwen3", closed).opened
    assert closed.params.reasoning == type(parsed.params.reasoning)(
        tok.convert_tokens_to_ids("<think>"), end, False)
    plain = parse_chat({"messages": body["messages"]}, len(tok))
    assert reasoning_spec(tok, "openai_gptoss", plain).parser.needs_special_tokens
    assert plain.params.reasoning is None  # (answers.AnswerReading keeps the markers)
    with pytest.raises(ApiError, match="openai_gptoss"):
        reasoning_spec(tok, "openai_gptoss", parse_chat(body, len(tok)))


def test_reasoning_effort_is_the_templates_variable() -> None:
    """OpenAI's reasoning_effort reaches the chat template as `reasoning_effort` (vLLM's way;
    gpt-oss's template reads it), checked, and never at odds with chat_template_kwargs."""
    from pipeline.server.errors import ApiError
    from pipeline.server.openai_parse import parse_chat

    body = {"messages": [{"role": "user", "content": "hi"}]}
    parsed = parse_chat({**body, "reasoning_effort": "low"}, 100)
    assert json.loads(parsed.chat_template_kwargs) == {"reasoning_effort": "low"}
    both = parse_chat({**body, "reasoning_effort": "low",
                       "chat_template_kwargs": {"reasoning_effort": "low", "x": 1}}, 100)
    assert json.loads(both.chat_template_kwargs) == {"reasoning_effort": "low", "x": 1}
    odds = {"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}
    for wrong in ({"reasoning_effort": "max"}, {"reasoning_effort": 3}, odds):
        with pytest.raises(ApiError) as info:
            parse_chat({**body, **wrong}, 100)
        assert info.value.param == "reasoning_effort"


def test_harmony_reasoning_leaves_the_calls_to_the_openai_tool_parser() -> None:
    """With --reasoning-parser openai_gptoss the analysis channel is taken out first; the
    commentary call it writes back in harmony is what the openai tool parser reads, at every
    split of the answer."""
    from ipc.messages import ToolSpec
    from pipeline.server.tool_parsers import tool_parser

    text = ("<|channel|>analysis<|message|>add them<|end|><|start|>assistant<|channel|>"
            "commentary to=functions.add <|constrain|>json<|message|>{\"a\": 1}<|call|>")
    for at in range(len(text) + 1):
        split = streamed(HarmonyParser(), [text[:at], text[at:]])
        assert split.reasoning == "add them", at
        found = tool_parser("openai", None).parse(split.content, [ToolSpec("add")])
        assert [(c.name, c.arguments) for c in found.calls] == [("add", '{"a": 1}')], at
        assert found.content == "" and found.reasoning == "", at


def test_a_chat_answer_is_a_message_only() -> None:
    """A chat choice carries its message and no completion `text` (with or without tools or
    a reasoning parser: the raw text would undo the split and the tool parse)."""
    from ipc.messages import FinishReason, ToolSpec
    from ipc.outputs import SampleResult
    from pipeline.server.openai_render import choice_json
    from pipeline.server.reasoning import ReasoningSpec
    from pipeline.server.tools import ToolRequest

    result = SampleResult(0)
    result.text, result.finish_reason = "<think>x</think>hi", FinishReason.STOP
    spec = ReasoningSpec(Qwen3Parser, False, None)
    for tools in (None, ToolRequest([ToolSpec("add")], "auto")):
        for answer in (None, spec.answer(result.text, result.token_ids)):
            body = choice_json(result, True, False, tools, None, answer)
            assert "text" not in body and body["message"]["role"] == "assistant"
    assert choice_json(result, False, False)["text"] == result.text


def test_chat_template_kwargs_may_not_set_what_the_template_is_given() -> None:
    """apply_chat_template's own arguments and the special tokens every template is given are
    refused by name (a 400), not passed twice (a TypeError, once a 500)."""
    from ipc.params import RequestError
    from stages.chat_template import template_kwargs

    assert template_kwargs('{"enable_thinking": false}') == {"enable_thinking": False}
    for name in ("tools", "pad_token", "unk_token", "additional_special_tokens"):
        with pytest.raises(RequestError, match=f"may not set \\['{name}'\\]"):
            template_kwargs(json.dumps({name: "x"}))
