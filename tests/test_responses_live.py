"""POST /v1/responses through `run_pipeline serve` and the official `openai` package, unchanged:
plain and streamed answers (the same text a chat gives), the SDK's stream helper, a function
tool round trip (by the call's output items, and by previous_response_id over the kept store),
text.format json_schema answers that validate, refusals by name, and LangChain's ChatOpenAI
with use_responses_api (tool calls, and a streamed answer)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
from test_server import Server, serve
from test_structured import PERSON

pytestmark = [pytest.mark.live, pytest.mark.timeout(300)]

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 10},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
    "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather now",
        "parameters": WEATHER, "strict": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny model, its context long enough for a tool's description."""
    from tiny_model import build_tiny_llama

    model = build_tiny_llama(tmp_path_factory.mktemp("tiny-responses"), max_len=2048)
    with serve(model) as s:
        yield s


def client_of(server: Server) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                         timeout=120)


def test_plain_and_streamed_answers_are_the_chats(server: Server) -> None:
    client = client_of(server)
    ask = dict(model=server.model, instructions="Be brief.", input="Hello there",
               max_output_tokens=12, temperature=0.0)
    r = client.responses.create(**ask)
    chat = client.chat.completions.create(
        model=server.model, max_tokens=12, temperature=0.0, messages=[
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}])
    assert r.id.startswith("resp_") and r.object == "response" and r.model == server.model
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.output_tokens == chat.usage.completion_tokens  # type: ignore[union-attr]
    assert r.usage.input_tokens == chat.usage.prompt_tokens  # type: ignore[union-attr]
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length"
                        else "completed")
    assert r.instructions == "Be brief." and r.max_output_tokens == 12 and r.store is False
    events = list(client.responses.create(stream=True, **ask))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == f"response.{r.status}"
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == r.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == r.usage.output_tokens  # type: ignore


def test_a_function_tool_round_trip(server: Server) -> None:
    import openai

    client = client_of(server)
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.responses.create(model=server.model, input=ask, tools=[TOOL],
                                    tool_choice="required", parallel_tool_calls=False,
                                    max_output_tokens=200, temperature=1.0)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}
    second = client.responses.create(model=server.model, input=[*ask, call, result],
                                      tools=[TOOL], max_output_tokens=8, temperature=0.0)
    assert second.status in ("completed", "incomplete") and second.output
    # The same turn by previous_response_id: the kept first turn is the same prompt.
    kept = client.responses.create(model=server.model, input=ask, tools=[TOOL],
                                   tool_choice="required", parallel_tool_calls=False,
                                   max_output_tokens=200, temperature=1.0, store=True)
    assert client.responses.retrieve(kept.id).output[0].call_id == kept.output[0].call_id
    kept_result = {**result, "call_id": kept.output[0].call_id}
    by_id = client.responses.create(model=server.model, previous_response_id=kept.id,
                                    input=[kept_result], tools=[TOOL], max_output_tokens=8,
                                    temperature=0.0)
    by_items = client.responses.create(model=server.model, input=[
        *ask, kept.output[0], kept_result], tools=[TOOL], max_output_tokens=8,
        temperature=0.0)
    assert by_id.output_text == by_items.output_text
    assert by_id.usage.input_tokens == by_items.usage.input_tokens  # type: ignore[union-attr]
    assert by_id.previous_response_id == kept.id
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)


def test_a_named_tools_arguments_stream_as_deltas(server: Server) -> None:
    client = client_of(server)
    events = list(client.responses.create(
        model=server.model, input="Weather in Rome?", tools=[TOOL], stream=True,
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=200,
        temperature=1.0, store=True))
    deltas = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == deltas and events[-1].type == "response.completed"
    jsonschema.validate(json.loads(deltas), WEATHER)
    (item,) = events[-1].response.output
    assert item.type == "function_call" and item.arguments == deltas
    kept = client_of(server).responses.retrieve(events[-1].response.id)  # kept when complete
    assert kept.output[0].arguments == deltas and kept.output[0].id == item.id


def test_text_format_json_schema_validates(server: Server) -> None:
    client = client_of(server)
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    r = client.responses.create(model=server.model, input="A person.", temperature=1.0,
                                max_output_tokens=450, text={"format": fmt})
    assert r.status == "completed" and r.text.format.type == "json_schema"  # type: ignore
    jsonschema.validate(json.loads(r.output_text), PERSON)
    with client.responses.stream(model=server.model, input="Another.", temperature=1.0,
                                 max_output_tokens=450, text={"format": fmt}) as stream:
        final = stream.get_final_response()  # the SDK's helper checks every item's identity
    jsonschema.validate(json.loads(final.output_text), PERSON)


def test_refusals_name_the_field(server: Server) -> None:
    import openai

    client = client_of(server)
    for kind in ("web_search", "file_search", "code_interpreter"):
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model=server.model, input="x", tools=[{"type": kind}])
        assert info.value.body["param"] == "tools[0].type"  # type: ignore[index]
        assert kind in info.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.create(model=server.model, input="x", previous_response_id="resp_x")
    assert gone.value.body["param"] == "previous_response_id"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_never_kept")
    r = httpx.post(f"{server.url}/v1/responses", timeout=30,
                   json={"input": "x", "max_output_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"
    r = httpx.post(f"{server.url}/v1/responses", timeout=30, json={"input": [
        {"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].content[0]"
    long = httpx.post(f"{server.url}/v1/responses", timeout=30, json={
        "instructions": "Be brief.", "input": [{"role": "user", "content": "x " * 3000}]})
    assert long.status_code == 400, long.text  # the tokenizer's refusal, renamed
    assert long.json()["error"]["param"] == "input"


def test_langchain_over_the_responses_api(server: Server) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{server.url}/v1", api_key="none", model=server.model,
                     max_tokens=200, temperature=1.0, max_retries=0, use_responses_api=True)
    answer = llm.bind_tools([TOOL], tool_choice="get_weather").invoke("Weather in Oslo?")
    assert [c["name"] for c in answer.tool_calls] == ["get_weather"]
    jsonschema.validate(answer.tool_calls[0]["args"], WEATHER)
    greedy = ChatOpenAI(base_url=f"{server.url}/v1", api_key="none", model=server.model,
                        max_tokens=10, temperature=0.0, max_retries=0, use_responses_api=True)
    text = "".join(chunk.text for chunk in greedy.stream("Hello"))
    assert text == client_of(server).responses.create(
        model=server.model, input="Hello", max_output_tokens=10, temperature=0.0).output_text
