"""The tool-call formats of pipeline/server/tool_parsers.py (and the harmony reader under the
openai one), without processes: each format's answers read into calls and content, and the
same answer streamed through ToolStream split at every point (and a character at a time)
adding up to exactly the whole answer's message."""

from __future__ import annotations

import json

import pytest

from ipc.config import TOOL_CALL_PARSERS
from ipc.messages import FinishReason, ToolSpec
from pipeline.server.harmony import HarmonyStream, parse_harmony
from pipeline.server.tool_parsers import (
    HARMONY_SIGN,
    TEMPLATE_SIGNS,
    TOOL_PARSERS,
    default_parser,
    tool_parser,
)
from pipeline.server.tools import ToolRequest, ToolStream, message

WEATHER = ToolSpec("get_weather", "Weather now", json.dumps(
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}))
SEARCH = ToolSpec("search", "", json.dumps({"type": "object", "properties": {
    "query": {"type": "string"}, "limit": {"type": "integer"}, "exact": {"type": "boolean"},
    "score": {"type": "number"}, "tags": {"type": "array"}, "opts": {"type": "object"}}}))
TOOLS = [WEATHER, SEARCH]
OSLO = ("get_weather", '{"city": "Oslo"}')

# parser -> [(answer, calls as (name, arguments), content of the whole message)]
CASES: dict[str, list[tuple[str, list[tuple[str, str]], str | None]]] = {
    "hermes": [
        ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
         '</tool_call>', [OSLO], "Sure.\n"),
        ("<tool_call>not json</tool_call>", [], "<tool_call>not json</tool_call>"),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', [OSLO], None),
        ('<|python_tag|>{"name": "get_weather", "arguments": {"city": "Oslo"}}; '
         '{"name": "search", "arguments": {"query": "rain"}}',
         [OSLO, ("search", '{"query": "rain"}')], None),
        ('{"name": "unknown", "parameters": {}}', [], '{"name": "unknown", "parameters": {}}'),
    ],
    "mistral": [
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
         '{"name": "search", "arguments": {"query": "rain", "limit": 3}}]',
         [OSLO, ("search", '{"query": "rain", "limit": 3}')], None),
        ('Let me look.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'
         '[TOOL_CALLS]search[CALL_ID]a1b2c3d4e[ARGS]{"query": "x"}',
         [OSLO, ("search", '{"query": "x"}')], "Let me look."),
        ('[TOOL_CALLS] [{"name": "get_weather", "argu', [],
         '[TOOL_CALLS] [{"name": "get_weather", "argu'),  # cut short: no call, kept
        ("No tools needed [TOOL", [], "No tools needed [TOOL"),
    ],
    "pythonic": [
        ('[get_weather(city="Oslo"), search(query=\'rain\', limit=3, exact=True, '
         'tags=["a", (1, 2)], opts={"k": None})]',
         [OSLO, ("search", '{"query": "rain", "limit": 3, "exact": true, '
                 '"tags": ["a", [1, 2]], "opts": {"k": null}}')], None),
        ('Checking.<|python_start|>[get_weather(city="Oslo")]<|python_end|>', [OSLO],
         "Checking."),
        ('[get_weather(city=__import__("os").getcwd())]', [],  # never evaluated
         '[get_weather(city=__import__("os").getcwd())]'),
        ('[os.system("ls")]', [], '[os.system("ls")]'),
        ("[1, 2, 3] are numbers", [], "[1, 2, 3] are numbers"),
    ],
    "qwen3_coder": [
        ("I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"
         "</parameter>\n</function>\n</tool_call>", [OSLO], "I'll check.\n"),
        ("<tool_call>\n<function=search>\n<parameter=query>\n 42 \n</parameter>\n"
         "<parameter=limit>\n7\n</parameter>\n<parameter=exact>\nfalse\n</parameter>\n"
         "<parameter=score>\n0.5\n</parameter>\n<parameter=tags>\n[\"a\", 1]\n</parameter>\n"
         "<parameter=opts>\n{'k': 1}\n</parameter>\n<parameter=extra>\n{\"x\": 1}\n"
         "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
         "<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>",
         [("search", '{"query": " 42 ", "limit": 7, "exact": false, "score": 0.5, '
                     '"tags": ["a", 1], "opts": {"k": 1}, "extra": {"x": 1}}'), OSLO], None),
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOs", [],  # cut: no call
         "<tool_call>\n<function=get_weather>\n<parameter=city>\nOs"),
    ],
    "openai": [
        ("<|channel|>analysis<|message|>User wants weather.<|end|><|start|>assistant"
         "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
         '{"city": "Oslo"}<|call|>', [OSLO], None),
        ("<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final"
         "<|message|>It is sunny.<|return|>", [], "It is sunny."),
        ("<|channel|>commentary<|message|>Looking it up.<|end|><|start|>assistant to="
         'functions.search<|channel|>commentary json<|message|>{"query": "rain"}',
         [("search", '{"query": "rain"}')], "Looking it up."),
        ("plain text, no tags", [], "plain text, no tags"),
        ("<|channel|>commentary to=functions.search<|message|>not json<|call|><|start|>"
         "assistant<|channel|>final<|message|>ok<|end|><|start|>assistant<|channel|>fin",
         [], "not jsonok"),  # what is not JSON stays, as content; a header cut short is none
    ],
}
ALL = [(name, *case) for name, cases in CASES.items() for case in cases]


def test_the_flag_names_every_parser() -> None:
    assert set(TOOL_CALL_PARSERS) == set(TOOL_PARSERS) == set(CASES)


@pytest.mark.parametrize("name, text, calls, content", ALL)
def test_a_whole_answer_is_read_into_calls_and_content(name: str, text: str, calls: list,
                                                       content: str | None) -> None:
    req = ToolRequest(TOOLS, "auto", parser=tool_parser(name, None))
    msg, reason = message(req, text, FinishReason.STOP)
    assert [(c["function"]["name"], c["function"]["arguments"])
            for c in msg.get("tool_calls", [])] == calls
    assert msg["content"] == content
    assert reason == ("tool_calls" if calls else "stop")


def reassemble(req: ToolRequest, pieces: list[str]) -> tuple[dict, list]:
    """Feed the pieces through a ToolStream; the message its deltas add up to, and the
    deltas."""
    stream, deltas = ToolStream(req), []
    for piece in pieces:
        deltas += stream.feed(piece)
    more, reason = stream.finish(FinishReason.STOP)
    deltas += more
    content, reasoning, calls = "", "", {}
    for d in deltas:
        content += d.get("content", "")
        reasoning += d.get("reasoning_content", "")
        for c in d.get("tool_calls", []):
            if "id" in c:  # a call's first delta: id, type and name
                assert c["index"] not in calls and c["type"] == "function"
                calls[c["index"]] = {"id": c["id"], "name": c["function"]["name"],
                                     "arguments": c["function"].get("arguments", "")}
            else:
                calls[c["index"]]["arguments"] += c["function"]["arguments"]
    msg = {"content": content or None, "reasoning": reasoning or None,
           "calls": [(c["name"], c["arguments"]) for _, c in sorted(calls.items())],
           "reason": reason}
    return msg, deltas


def whole(req: ToolRequest, text: str) -> dict:
    msg, reason = message(req, text, FinishReason.STOP)
    return {"content": msg["content"] or None, "reasoning": msg.get("reasoning_content"),
            "calls": [(c["function"]["name"], c["function"]["arguments"])
                      for c in msg.get("tool_calls", [])], "reason": reason}


@pytest.mark.parametrize("name, text, calls, content", ALL)
def test_streamed_at_every_split_and_per_character_it_is_the_whole_answer(
        name: str, text: str, calls: list, content: str | None) -> None:
    sign = {named: sign for sign, named in TEMPLATE_SIGNS}.get(name, "")
    sign = HARMONY_SIGN if name == "openai" else sign
    for parser in (tool_parser(name, None), default_parser(sign)):  # alone, and the default
        req = ToolRequest(TOOLS, "auto", parser=parser)
        expected = whole(req, text)
        for k in range(len(text) + 1):
            assert reassemble(req, [text[:k], text[k:]])[0] == expected, (parser.name, k)
        assert reassemble(req, list(text))[0] == expected


def test_calls_stream_as_each_one_settles_and_content_never_holds_part_of_a_call() -> None:
    req = ToolRequest(TOOLS, "auto", parser=tool_parser("mistral", None))
    first = 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'
    stream = ToolStream(req)
    sent = [d for ch in first for d in stream.feed(ch)]
    assert "".join(d.get("content", "") for d in sent) == "Sure."
    calls = [d["tool_calls"][0] for d in sent if "tool_calls" in d]
    assert len(calls) == 2 and sent[-2:] == [{"tool_calls": [c]} for c in calls]  # at once
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert calls[1]["function"] == {"arguments": '{"city": "Oslo"}'}
    assert len(calls[0]["id"]) == 9 and calls[0]["id"].isalnum()  # as Mistral's templates
    assert stream.feed('[TOOL_CALLS]search[ARGS]{"query"') == []


@pytest.mark.parametrize("name, text", [
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"
                    "</parameter>\n</function>"),
    ("openai", "<|channel|>commentary to=functions.get_weather<|message|>"
               '{"city": "Oslo"}<|call|>'),
])
def test_a_call_is_sent_as_soon_as_its_end_arrives(name: str, text: str) -> None:
    stream = ToolStream(ToolRequest(TOOLS, "auto", parser=tool_parser(name, None)))
    for i, ch in enumerate(text):
        deltas = stream.feed(ch)
        assert bool(deltas) == (i == len(text) - 1)
    assert deltas[1]["tool_calls"][0]["function"]["arguments"] == OSLO[1]


def test_one_call_when_parallel_calls_are_off() -> None:
    req = ToolRequest(TOOLS, "auto", parallel=False, parser=tool_parser("pythonic", None))
    text = '[get_weather(city="Oslo"), search(query="x")]'
    assert whole(req, text)["calls"] == [OSLO]
    assert reassemble(req, list(text))[0]["calls"] == [OSLO]


@pytest.mark.parametrize("template, first", [
    ("{%- if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}"
     "{{ '[TOOL_CALLS]' }}", "mistral"),
    ("<tool_call>\n<function=example_function_name>\n<parameter=p>", "qwen3_coder"),
    ("Respond in the format [func_name1(params_name1=params_value1)]", "pythonic"),
    ("{{ '<tool_call>' }}", "hermes"),
    (None, "hermes"),
])
def test_the_default_reads_the_format_the_chat_template_shows(template: str | None,
                                                              first: str) -> None:
    parser = default_parser(template)
    names = [p.name for p in parser.parsers]  # type: ignore[attr-defined]
    assert names[0] == first and names[-2:] == ["hermes", "llama3_json"]
    assert parser.special_tokens == (first in ("mistral", "openai"))


def test_a_harmony_template_is_read_as_harmony_alone_and_streams_as_it_comes() -> None:
    parser = default_parser("{{ '<|start|>assistant<|channel|>final<|message|>' }}")
    assert parser.name == "openai" and parser.special_tokens
    stream = ToolStream(ToolRequest(TOOLS, "auto", parser=parser))
    head = ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>"
            'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}'
            "<|call|><|start|>assistant<|channel|>final<|message|>It is sun")
    deltas = [d for ch in head for d in stream.feed(ch)]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Need weather."
    assert "".join(d.get("content", "") for d in deltas) == "It is sun"
    assert [c["tool_calls"][0]["function"] for c in deltas if "tool_calls" in c] == [
        {"name": "get_weather", "arguments": ""}, {"arguments": '{"city": "Oslo"}'}]


def test_the_default_still_reads_hermes_when_the_template_shows_another_format() -> None:
    req = ToolRequest(TOOLS, "auto", parser=default_parser("[TOOL_CALLS]"))
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    assert whole(req, text)["calls"] == [OSLO]
    assert whole(req, '[TOOL_CALLS][{"name": "get_weather", "arguments": '
                      '{"city": "Oslo"}}]')["calls"] == [OSLO]


HARMONY = ("<|channel|>analysis<|message|>Think <|end|>.<|end|><|start|>assistant"
           "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\": 1}<|call|>"
           "<|start|>assistant<|channel|>final<|message|>Done <|x|> here")


def test_harmony_messages() -> None:
    msgs = parse_harmony(HARMONY)
    assert [(m.channel, m.recipient, m.content_type, m.content, m.done, m.end) for m in msgs] \
        == [("analysis", None, None, "Think ", True, "<|end|>"),
            (None, None, None, ".", True, "<|end|>"),  # text between messages stays
            ("commentary", "functions.f", "json", '{"a": 1}', True, "<|call|>"),
            ("final", None, None, "Done <|x|> here", False, None)]
    assert msgs[2].function == "f" and msgs[0].function is None


@pytest.mark.parametrize("text", [HARMONY, "plain <|chan", "<|channel|>final<|message|>a<|en",
                                  "<|channel|>final<|message|>x<y <|st<<|end|>z<|end|>"])
def test_harmony_streamed_at_every_split_is_the_whole_parse(text: str) -> None:
    expected = [(m.channel, m.recipient, m.content) for m in parse_harmony(text)]
    for pieces in [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text)]:
        stream, got = HarmonyStream(), {}
        for i, piece in enumerate(pieces):
            for d in stream.feed(piece, final=i == len(pieces) - 1):
                assert not any(tag in d.text for tag in ("<|end|>", "<|channel|>"))
                got.setdefault(d.index, [d.channel, d.recipient, ""])[2] += d.text
        assert [tuple(got[i]) for i in sorted(got)] == [e for e in expected if e[2]]


def test_the_flag_reaches_the_server_options_and_beats_the_template(
        capsys: pytest.CaptureFixture[str]) -> None:
    from pipeline.cli import build_parser
    from pipeline.server.serve import server_options

    args = build_parser().parse_args(["serve", "--tool-call-parser", "pythonic"])
    assert server_options(args).tool_call_parser == "pythonic"
    assert tool_parser("pythonic", "[TOOL_CALLS] <|channel|>").name == "pythonic"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-call-parser", "llama4_json"])
    assert "invalid choice: 'llama4_json'" in capsys.readouterr().err
