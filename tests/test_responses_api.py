"""The Responses API without a server: a request mapped onto the chat request it runs as (every
field, every input item, errors naming the Responses field), the kept-response store, and the
chat outputs rendered as a response and as its event stream, checked by the openai package's
own types and stream accumulator."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ipc.messages import ChatMessage, StructuredOutputs, ToolCall
from pipeline.server.errors import ApiError
from pipeline.server.responses import ResponseStore, parse_responses, responses_param
from pipeline.server.responses_render import (
    ResponsesStream,
    as_messages,
    whole_response,
)

V = 1000
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}},
           "required": ["city"]}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather now",
        "parameters": WEATHER, "strict": None}


def parse(body: dict[str, Any], store: ResponseStore | None = None, workers: int = 1) -> Any:
    return parse_responses(body, V, store or ResponseStore(), workers)


def test_fields_map_onto_the_chat_request() -> None:
    asked = parse({"model": "m", "instructions": "be brief", "input": "hi",
                   "max_output_tokens": 9, "temperature": 0.5, "top_p": 0.9, "user": "u",
                   "metadata": {"k": "v"}, "stream": True, "store": False,
                   "reasoning": {"effort": None}, "truncation": "disabled",
                   "include": ["reasoning.encrypted_content"]})
    p = asked.parsed
    assert p.prompts == [[ChatMessage("system", "be brief"), ChatMessage("user", "hi")]]
    assert (p.params.max_tokens, p.params.temperature, p.params.top_p) == (9, 0.5, 0.9)
    assert p.stream and p.include_usage and p.chat and p.tools is None
    assert asked.conversation == [{"role": "user", "content": "hi"}]  # instructions not kept
    assert asked.echo["metadata"] == {"k": "v"} and asked.echo["instructions"] == "be brief"
    assert asked.echo["text"] == {"format": {"type": "text"}} and not asked.store
    assert parse({"input": "x", "text": None, "tools": None}).echo["text"] == {
        "format": {"type": "text"}}


def test_input_items_become_chat_messages() -> None:
    asked = parse({"input": [
        {"type": "message", "role": "developer", "content": [
            {"type": "input_text", "text": "a "}, {"type": "input_text", "text": "b"}]},
        {"role": "user", "content": "weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Oslo"}', "id": "fc_1", "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather",
         "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "5 C"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "20 C"}]}],
        "tools": [TOOL]})
    (messages,) = asked.parsed.prompts
    assert messages == [  # the reasoning item is checked, and left out of the prompt
        ChatMessage("system", "a b"), ChatMessage("user", "weather?"),
        ChatMessage("assistant", "Let me look.", [
            ToolCall("call_1", "get_weather", '{"city": "Oslo"}'),
            ToolCall("call_2", "get_weather", '{"city": "Rome"}')]),
        ChatMessage("tool", "5 C", [], "call_1"), ChatMessage("tool", "20 C", [], "call_2")]
    assert asked.parsed.tools.choice == "auto"
    assert [t.name for t in asked.parsed.tools.tools] == ["get_weather"]


def test_tool_choice_and_text_format_become_structured_outputs() -> None:
    named = parse({"input": "x", "tools": [TOOL],
                   "tool_choice": {"type": "function", "name": "get_weather"}}).parsed
    assert named.tools.choice == "named" and named.tools.name == "get_weather"
    assert named.params.structured_outputs == StructuredOutputs(json=json.dumps(WEATHER))
    assert parse({"input": "x", "tools": [TOOL], "tool_choice": "required"}
                 ).parsed.tools.choice == "required"
    assert parse({"input": "x", "tools": [TOOL], "tool_choice": "none"}).parsed.tools is None
    schema = parse({"input": "x", "text": {"format": {
        "type": "json_schema", "name": "w", "schema": WEATHER, "strict": True}}}).parsed
    assert schema.params.structured_outputs == StructuredOutputs(json=json.dumps(WEATHER))
    assert parse({"input": "x", "text": {"format": {"type": "json_object"}}}
                 ).parsed.params.structured_outputs == StructuredOutputs(json_object=True)
    assert parse({"input": "x", "text": {"format": {"type": "text"}}}
                 ).parsed.params.structured_outputs is None


BAD = [
    ({"max_output_tokens": -1}, "max_output_tokens", "max"),
    ({"max_output_tokens": "9"}, "max_output_tokens", "integer"),
    ({"temperature": -1}, "temperature", "temperature"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "web_search"),
    ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools[0].type",
     "file_search"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type", "code_interpreter"),
    ({"tools": {}}, "tools", "array"),
    ({"tools": [{**TOOL, "name": "bad name"}]}, "tools[0].name", "name"),
    ({"tools": [{**TOOL, "parameters": 3}]}, "tools[0].parameters", "parameters"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice.name", "nope"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "web_search_preview"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type", "xml"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "schema"),
    ({"text": {"verbosity": "low"}}, "text.verbosity", "verbosity"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content[0]", "input_image"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "robot"),
    ({"input": [{"type": "web_search_call", "id": "w"}]}, "input[0].type", "web_search_call"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id",
     "call_id"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0]", "call_id"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "e"}]},
     "input[0].encrypted_content", "encrypted"),
    ({"input": []}, "input", "non-empty"),
    ({"instructions": 5}, "instructions", "string"),
    ({"top_logprobs": 2}, "top_logprobs", "top_logprobs"),
    ({"conversation": "c"}, "conversation", "previous_response_id"),
    ({"frequency_penalty": 1}, "frequency_penalty", "unknown field"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort", "extreme"),
    ({"reasoning": {"summary": "long"}}, "reasoning.summary", "long"),
    ({"reasoning": {"budget": 5}}, "reasoning.budget", "not supported"),
    ({"include": ["message.output_text.logprobs"]}, "include", "logprobs"),
    ({"truncation": "auto"}, "truncation", "never cut"),
    ({"background": True}, "background", "background"),
    ({"store": "yes"}, "store", "boolean"),
    ({"metadata": {"k": 1}}, "metadata", "metadata"),
    ({"service_tier": "flex"}, "service_tier", "one tier"),
    ({"prompt_cache_key": 7}, "prompt_cache_key", "string"),
]


@pytest.mark.parametrize("fields, param, words", BAD)
def test_a_bad_field_is_a_400_naming_the_responses_field(fields: dict[str, Any], param: str,
                                                         words: str) -> None:
    with pytest.raises(ApiError) as info:
        parse({"input": "x", **fields})
    assert info.value.status == 400 and info.value.param == param
    assert words in info.value.message


def test_the_cache_and_tier_hints_are_taken_and_echoed() -> None:
    """Codex CLI's prompt_cache_key and the SDK's service_tier: taken (they change nothing
    here: the prefix cache finds a shared prefix by its tokens; one tier), and echoed."""
    asked = parse({"input": "x", "prompt_cache_key": "conversation-7", "service_tier": "auto"})
    assert asked.echo["prompt_cache_key"] == "conversation-7"
    assert asked.echo["service_tier"] == "default"
    assert parse({"input": "x"}).echo["prompt_cache_key"] is None


def test_reasoning_effort_reaches_the_template_and_a_summary_is_taken() -> None:
    asked = parse({"input": "x", "reasoning": {"effort": "high", "summary": "auto"}})
    assert json.loads(asked.parsed.chat_template_kwargs) == {"reasoning_effort": "high"}
    assert parse({"input": "x"}).parsed.chat_template_kwargs == ""


def test_chat_fields_are_renamed_back_to_where_they_came_from() -> None:
    origins = ["instructions", "previous_response_id", "input[2]"]
    assert responses_param("messages[0].content", origins) == "instructions"
    assert responses_param("messages[1]", origins) == "previous_response_id"
    assert responses_param("messages[2].tool_calls[0]", origins) == "input[2]"
    assert responses_param("messages", origins) == "input"
    assert responses_param("response_format.json_schema.schema", []) == "text.format.schema"
    assert responses_param("tools[3].function.description", []) == "tools[3].description"
    assert responses_param("top_p", []) == "top_p"


def test_previous_response_id_continues_a_kept_conversation() -> None:
    store = ResponseStore()
    first = parse({"input": "Weather in Oslo?", "tools": [TOOL], "store": True,
                   "instructions": "only the first turn"}, store)
    assert first.store
    output = [{"id": "fc_1", "type": "function_call", "call_id": "call_9",
               "name": "get_weather", "arguments": '{"city": "Oslo"}', "status": "completed"}]
    store.put("resp_1", {"id": "resp_1", "output": output},
              first.conversation + as_messages(output))
    second = parse({"previous_response_id": "resp_1", "tools": [TOOL], "input": [
        {"type": "function_call_output", "call_id": "call_9", "output": "5 C"}]}, store)
    assert second.parsed.prompts == [[
        ChatMessage("user", "Weather in Oslo?"),
        ChatMessage("assistant", "", [ToolCall("call_9", "get_weather", '{"city": "Oslo"}')]),
        ChatMessage("tool", "5 C", [], "call_9")]]  # the old instructions are not carried
    assert second.echo["previous_response_id"] == "resp_1" and not second.store
    with pytest.raises(ApiError) as info:
        parse({"previous_response_id": "resp_gone", "input": "x"}, store)
    assert info.value.status == 404 and info.value.param == "previous_response_id"
    for fields in ({"store": True}, {"previous_response_id": "resp_1"}):
        with pytest.raises(ApiError) as info:
            parse({"input": "x", **fields}, store, workers=2)
        assert info.value.status == 400 and "--api-workers 2" in info.value.message


def test_the_store_is_bounded_oldest_out_first() -> None:
    store = ResponseStore(max_responses=2)
    for i in range(3):
        store.put(f"r{i}", {"id": f"r{i}"}, [])
    assert list(store.items) == ["r1", "r2"]
    with pytest.raises(ApiError):
        store.get("r0")
    store.delete("r1")
    assert list(store.items) == ["r2"] and store.num_chars == store.items["r2"].size
    with pytest.raises(ApiError) as info:
        store.delete("r1")
    assert info.value.status == 404 and info.value.param == "response_id"
    small = ResponseStore(max_chars=200)
    small.put("a", {"text": "x" * 100}, [])
    small.put("b", {"text": "y" * 100}, [])
    assert list(small.items) == ["b"] and small.num_chars <= 200


ECHO = parse({"input": "x"}).echo


def chat(message: dict[str, Any], finish: str = "stop") -> dict[str, Any]:
    return {"id": "c", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
                      "prompt_tokens_details": {"cached_tokens": 2},
                      "completion_tokens_details": {"reasoning_tokens": 3}}}


def validated(response: dict[str, Any]) -> Any:
    from openai.types.responses import Response

    return Response.model_validate(response)


def test_a_whole_answer_renders_as_a_response() -> None:
    r = validated(whole_response("resp_1", "m", ECHO, chat(
        {"role": "assistant", "content": "Hello", "reasoning_content": "think first"})))
    assert [i.type for i in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "think first" and r.output_text == "Hello"
    assert r.status == "completed" and r.usage.output_tokens_details.reasoning_tokens == 3
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (5, 7, 12)
    assert r.usage.input_tokens_details.cached_tokens == 2
    newer = validated(whole_response("resp_2", "m", ECHO, chat(
        {"role": "assistant", "content": "Hi", "reasoning": "the newer field name"})))
    assert newer.output[0].content[0].text == "the newer field name"
    calls = validated(whole_response("resp_3", "m", ECHO, chat(
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "f", "arguments": "{}"}}]}, "tool_calls")))
    assert [(i.type, i.call_id, i.name, i.arguments) for i in calls.output] == [
        ("function_call", "call_1", "f", "{}")]
    cut = validated(whole_response("resp_4", "m", ECHO, chat(
        {"role": "assistant", "content": "Hel"}, "length")))
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output[0].status == "incomplete"


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None,
          usage: dict[str, Any] | None = None) -> dict[str, Any]:
    choices = [] if usage else [{"index": 0, "delta": delta or {}, "finish_reason": finish}]
    out: dict[str, Any] = {"id": "c", "object": "chat.completion.chunk", "choices": choices}
    if usage:
        out["usage"] = usage
    return out


def replay(chunks: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], Any, dict[str, Any]]:
    """The events of a chat chunk stream, each validated by the openai package's types and
    accumulated by its own stream state (which checks every item's identity); (events, the
    package's final response, ours)."""
    import pydantic
    from openai import omit
    from openai.lib.streaming.responses._responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent

    stream = ResponsesStream("resp_1", "m", ECHO)
    events = stream.start()
    for c in chunks:
        events += stream.feed(c)
    more, final = stream.end()
    events += more
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    state: Any = ResponseStreamState(input_tools=[], text_format=omit)
    adapter: Any = pydantic.TypeAdapter(ResponseStreamEvent)
    handled = []
    for event in json.loads(json.dumps(events)):
        typed = adapter.validate_python(event)
        assert typed.type == event["type"]
        handled += state.handle_event(typed)
    return events, handled[-1].response, final  # (response.completed, parsed)


USAGE = {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10,
         "prompt_tokens_details": {"cached_tokens": 0}}


def test_a_thinking_stream_gives_a_reasoning_item_then_the_message() -> None:
    events, sdk, final = replay([
        chunk({"role": "assistant", "content": ""}),
        chunk({"reasoning_content": "Let me "}), chunk({"reasoning_content": "think."}),
        chunk({"content": "Hel"}), chunk({"content": "lo"}), chunk({}, "stop"),
        chunk(usage=USAGE)])
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert events[6]["text"] == "Let me think." and events[13]["text"] == "Hello"
    assert final["usage"]["output_tokens"] == 6 and final["status"] == "completed"
    whole = whole_response("resp_1", "m", ECHO, chat({"role": "assistant", "content": "Hello",
                                                       "reasoning_content": "Let me think."}))
    strip = [{k: v for k, v in item.items() if k != "id"} for item in whole["output"]]
    assert [{k: v for k, v in item.items() if k != "id"} for item in final["output"]] == strip
    assert sdk.output_text == "Hello" and sdk.output[0].content[0].text == "Let me think."


def test_streamed_calls_and_an_empty_or_cut_answer() -> None:
    events, sdk, final = replay([
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Sure."}),
        chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "f", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "call_2", "type": "function",
                               "function": {"name": "g", "arguments": "{}"}}]}),
        chunk({}, "tool_calls")])
    assert [(i["type"], i.get("arguments")) for i in final["output"]] == [
        ("message", None), ("function_call", '{"a": 1}'), ("function_call", "{}")]
    done = [e["arguments"] for e in events
            if e["type"] == "response.function_call_arguments.done"]
    assert done == ['{"a": 1}', "{}"]
    assert [o.type for o in sdk.output] == ["message", "function_call", "function_call"]
    _, _, empty = replay([chunk({"role": "assistant", "content": ""}), chunk({}, "stop")])
    assert [i["type"] for i in empty["output"]] == ["message"]
    assert empty["output"][0]["content"][0]["text"] == ""
    events, _, cut = replay([chunk({"content": "Hel"}), chunk({}, "length")])
    assert cut["status"] == "incomplete" and events[-1]["type"] == "response.incomplete"
    assert cut["output"][0]["status"] == "incomplete"


def test_a_failed_stream_ends_with_an_error_and_response_failed() -> None:
    import pydantic
    from openai.types.responses import ResponseStreamEvent

    stream = ResponsesStream("resp_1", "m", ECHO)
    events = stream.start() + stream.feed(chunk({"content": "Hel"}))
    events += stream.fail(ApiError(500, "the engine died", None, "server_error").body())
    adapter: Any = pydantic.TypeAdapter(ResponseStreamEvent)
    typed = [adapter.validate_python(e) for e in json.loads(json.dumps(events))]
    assert [t.type for t in typed[-2:]] == ["error", "response.failed"]
    assert typed[-2].message == "the engine died"
    assert typed[-1].response.status == "failed" and typed[-1].response.error.message


FIELDS = ["model", "input", "instructions", "max_output_tokens", "temperature", "top_p",
          "tools", "tool_choice", "parallel_tool_calls", "text", "stream", "store",
          "previous_response_id", "metadata", "user", "reasoning", "truncation", "include",
          "background", "type", "role", "content", "call_id", "name", "arguments", "output",
          "format", "schema", "parameters", "encrypted_content"]
VALID = {"model": "m", "input": [
    {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
    {"type": "function_call", "call_id": "c", "name": "get_weather", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c", "output": "x"}],
    "tools": [TOOL], "text": {"format": {"type": "json_object"}}, "max_output_tokens": 4}


def parse_or_refuse(body: Any) -> None:
    store = ResponseStore()
    store.put("resp_1", {"id": "resp_1"}, [{"role": "user", "content": "x"}])
    try:
        parse(body, store)
    except ApiError as exc:
        assert 400 <= exc.status < 500, exc.message


def test_arbitrary_and_mutated_bodies_are_parsed_or_refused_with_a_4xx() -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from test_http_fuzz import JSON

    keys = st.sampled_from(FIELDS) | st.text(max_size=6)
    fuzz = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))

    @fuzz
    @given(body=st.dictionaries(keys, JSON, max_size=6))
    def arbitrary(body: dict[str, Any]) -> None:
        parse_or_refuse(body)

    @fuzz
    @given(field=keys, value=JSON, where=st.sampled_from(["body", 0, 1, 2, "tool", "format"]))
    def mutated(field: str, value: Any, where: Any) -> None:
        body = json.loads(json.dumps(VALID))
        target = {"body": body, "tool": body["tools"][0],
                  "format": body["text"]["format"]}.get(where) or body["input"][where]
        target[field] = value
        parse_or_refuse(body)

    arbitrary()
    mutated()
