"""Tool calling without processes: the prompt a conversation with tools becomes (a template
that knows tools gets them; one that does not gets the Hermes description), the parse of calls
out of an answer, and the streamed deltas of every tool_choice reassembling to the whole
answer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ipc.messages import ChatMessage, FinishReason, ToolCall, ToolSpec
from pipeline.server.errors import ApiError
from pipeline.server.openai_parse import parse_chat
from pipeline.server.tool_parsers import Hermes
from pipeline.server.tools import ToolRequest, ToolStream, message, parse_tools
from stages.chat_template import HERMES_TOOLS, render

WEATHER = ToolSpec("get_weather", "Weather now", json.dumps(
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}))
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


class ChatMLTokenizer:
    """Enough of a tokenizer for render(): a template, and apply_chat_template."""

    def __init__(self, template: str) -> None:
        self.chat_template = template
        self.seen: dict = {}

    def apply_chat_template(self, conversation, tools=None, tokenize=False,
                            add_generation_prompt=True):  # type: ignore[no-untyped-def]
        self.seen = {"conversation": conversation, "tools": tools}
        return "".join(f"<{m['role']}>{m['content']}" for m in conversation) + "<assistant>"


def test_a_template_without_tools_gets_the_hermes_description_and_formats() -> None:
    tok = ChatMLTokenizer("{% for m in messages %}{{ m.content }}{% endfor %}")
    history = [ChatMessage("user", "Weather?"),
               ChatMessage("assistant", "", [ToolCall("c1", "get_weather", '{"city": "Oslo"}')]),
               ChatMessage("tool", "18 C", tool_call_id="c1")]
    text = render(tok, history, [WEATHER])
    system = tok.seen["conversation"][0]
    assert system["role"] == "system" and "<tools>" in system["content"]
    assert json.dumps({"type": "function", "function": {
        "name": "get_weather", "description": "Weather now",
        "parameters": json.loads(WEATHER.parameters)}}) in system["content"]
    assert CALL.replace("\n", "") in text.replace("\n", "")
    assert "<user><tool_response>\n18 C\n</tool_response>" in text
    assert HERMES_TOOLS.splitlines()[0] in text


def test_a_template_that_knows_tools_gets_them_as_transformers_passes_them() -> None:
    tok = ChatMLTokenizer("{% if tools %}{{ tools }}{% endif %}")
    render(tok, [ChatMessage("user", "x"), ChatMessage(
        "assistant", "", [ToolCall("c1", "get_weather", '{"city": "Oslo"}')]),
        ChatMessage("tool", "18 C", tool_call_id="c1")], [WEATHER])
    conversation = tok.seen["conversation"]
    assert tok.seen["tools"][0]["function"]["name"] == "get_weather"
    assert conversation[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert conversation[2] == {"role": "tool", "content": "18 C", "tool_call_id": "c1"}


def test_the_real_template_renders_a_tool_conversation(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = render(tok, [ChatMessage("user", "Weather?")], [WEATHER])
    assert "get_weather" in text and text.rstrip().endswith("assistant")


@pytest.mark.parametrize("text, calls, rest", [
    (CALL, [("get_weather", '{"city": "Oslo"}')], ""),
    ("Let me check.\n" + CALL + "\n" + CALL.replace("Oslo", "Rome"),
     [("get_weather", '{"city": "Oslo"}'), ("get_weather", '{"city": "Rome"}')],
     "Let me check.\n\n"),
    ('<tool_call>\n{"name": "f", "parameters": {"a": 1}}', [("f", '{"a": 1}')], ""),  # no close
    ("<tool_call>not json</tool_call> hi", [], "<tool_call>not json</tool_call> hi"),
    ("plain answer", [], "plain answer"),
])
def test_parse_tool_calls(text: str, calls: list, rest: str) -> None:
    found = Hermes().parse(text, [WEATHER])
    assert ([(c.name, c.arguments) for c in found.calls], found.content) == (calls, rest)


def reassemble(req: ToolRequest, text: str, pieces: int) -> tuple[str, list, str | None]:
    """Feed text in `pieces` chunks through a ToolStream: (content, calls, finish)."""
    stream, deltas = ToolStream(req), []
    size = max(1, len(text) // pieces)
    for i in range(0, len(text), size):
        deltas += stream.feed(text[i:i + size])
    more, finish = stream.finish(FinishReason.STOP)
    deltas += more
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for c in d.get("tool_calls", []):
            call = calls.setdefault(c["index"], {"name": "", "arguments": ""})
            fn = c.get("function", {})
            call["name"] = fn.get("name") or call["name"]
            call["arguments"] += fn.get("arguments", "")
    return content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())], finish


@pytest.mark.parametrize("pieces", [1, 3, 50, 10_000])
@pytest.mark.parametrize("req, text", [
    (ToolRequest([WEATHER], "auto"), "Checking the weather <tool_c" + CALL[7:]),
    (ToolRequest([WEATHER], "auto"), "Sure.\n" + CALL + "\nDone."),
    (ToolRequest([WEATHER], "auto"), "No call here, just < and <tool text."),
    (ToolRequest([WEATHER], "auto"), ' {"name": "get_weather", "parameters": {"city": "Oslo"}}'),
    (ToolRequest([WEATHER], "auto"), '{"name": "unknown_tool", "arguments": {}}'),
    (ToolRequest([WEATHER], "auto"), '{"answer": 42}'),
    (ToolRequest([WEATHER], "named", "get_weather"), '{"city": "Oslo"}'),
    (ToolRequest([WEATHER], "required"), '[{"name": "get_weather", "arguments": {"city": "X"}}]'),
])
def test_streamed_deltas_reassemble_to_the_whole_answer(req: ToolRequest, text: str,
                                                        pieces: int) -> None:
    whole, finish = message(req, text, FinishReason.STOP)
    content, calls, streamed_finish = reassemble(req, text, pieces)
    assert (content or None) == whole["content"]
    assert calls == [(c["function"]["name"], c["function"]["arguments"])
                     for c in whole.get("tool_calls", [])]
    assert streamed_finish == finish == ("tool_calls" if calls else "stop")


def test_auto_never_streams_part_of_a_call_as_content() -> None:
    stream = ToolStream(ToolRequest([WEATHER], "auto"))
    sent = "".join(d.get("content", "") for ch in "Hi <tool_call>{" for d in stream.feed(ch))
    assert sent == "Hi "


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"},
     "tool_choice"),
])
def test_bad_tool_fields_are_a_400_naming_them(body: dict, param: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_chat({"messages": [{"role": "user", "content": "x"}], **body}, 100)
    assert err.value.status == 400 and err.value.param == param


def test_required_and_named_are_enforced_by_a_schema_and_none_shows_no_tools() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}]
    messages = [{"role": "user", "content": "x"}]
    named = parse_chat({"messages": messages, "tools": tools, "tool_choice": {
        "type": "function", "function": {"name": "f"}}}, 100)
    so = named.params.structured_outputs
    assert so is not None and json.loads(so.json or "")["properties"]["a"]["type"] == "integer"
    required = parse_chat({"messages": messages, "tools": tools, "tool_choice": "required",
                           "parallel_tool_calls": False}, 100)
    schema = json.loads(required.params.structured_outputs.json)  # type: ignore[union-attr]
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    auto = parse_chat({"messages": messages, "tools": tools}, 100)
    assert auto.params.structured_outputs is None and auto.tools.choice == "auto"
    assert parse_tools({"tools": tools, "tool_choice": "none"}) is None
