"""The rest of the API that real clients send, through `run_pipeline serve` and the official
`openai` package and LangChain: structured outputs by every field that asks for one (each
answer parses and validates), /tokenize, /detokenize, /version, `model` left out, CORS, and a
400 that names every field this server does not implement."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import pytest
from test_server import Server, serve
from test_structured import PERSON

pytestmark = pytest.mark.timeout(300)
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny model with a context long enough for tool descriptions (its tokenizer takes
    about a token per character)."""
    from tiny_model import build_tiny_llama

    model = build_tiny_llama(tmp_path_factory.mktemp("tiny-long"), max_len=2048)
    with serve(model, "--allowed-origins", ORIGIN) as s:
        yield s


def openai_client(server: Server):  # type: ignore[no-untyped-def]
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def test_json_schema_answers_always_validate(server: Server) -> None:
    client = openai_client(server)
    for seed in range(3):
        r = client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "A person, as JSON."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": PERSON}},
            max_tokens=450, temperature=1.0, seed=seed, n=4)
        assert len(r.choices) == 4
        for choice in r.choices:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content or ""), PERSON)


def test_a_streamed_json_schema_answer_validates_too(server: Server) -> None:
    client = openai_client(server)
    stream = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "hi"}],
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
        max_tokens=450, temperature=1.0, seed=7, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), PERSON)


def test_the_openai_clients_parse_with_a_pydantic_model(server: Server) -> None:
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        city: str = Field(max_length=8)
        celsius: int
        sunny: bool

    r = openai_client(server).chat.completions.parse(
        model=server.model, messages=[{"role": "user", "content": "The weather?"}],
        response_format=Weather, max_tokens=200, temperature=1.0, seed=1)
    assert isinstance(r.choices[0].message.parsed, Weather)


@pytest.mark.parametrize("extra, check", [
    ({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
    ({"guided_regex": "[0-9]{4}"}, lambda t: len(t) == 4 and t.isdigit()),
    ({"structured_outputs": {"choice": ["a", "b"]}}, lambda t: t in ("a", "b")),
    ({"structured_outputs": {"json": {"type": "array", "items": {"type": "integer"},
                                      "maxItems": 3}}},
     lambda t: all(isinstance(x, int) for x in json.loads(t))),
    ({"response_format": {"type": "json_object"}},
     lambda t: isinstance(json.loads(t), dict)),
    ({"structured_outputs": {"grammar": 'start: "ab" "c"'}}, lambda t: t == "abc"),
])
def test_vllms_fields_on_completions(server: Server, extra: dict, check) -> None:
    r = openai_client(server).completions.create(
        model=server.model, prompt="Answer:", max_tokens=300, temperature=1.0, seed=3,
        extra_body=extra)
    assert r.choices[0].finish_reason == "stop" and check(r.choices[0].text), r.choices[0].text


def test_langchain_with_structured_output(server: Server) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{server.url}/v1", api_key="none", model=server.model,
                     max_tokens=450, temperature=1.0, seed=5, max_retries=0)
    person = llm.with_structured_output(
        {"title": "person", "description": "a person", **PERSON}, method="json_schema")
    jsonschema.validate(person.invoke("Describe someone."), PERSON)


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": "x", "response_format": {"type": "json_schema",
                                         "json_schema": {"schema": {"type": "objectx"}}}},
     "response_format", "objectx"),
    ({"prompt": "x", "guided_regex": "(a"}, "guided_regex", "unclosed"),
    ({"prompt": "x", "guided_json": {}, "guided_regex": "a"}, "guided_regex", "one structured"),
    ({"prompt": "x", "response_format": {"type": "xml"}}, "response_format.type", "xml"),
    ({"prompt": "x", "chat_template_kwargs": {}}, "chat_template_kwargs", "not supported"),
    ({"prompt": "x", "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", ""),
    ({"prompt": "x", "frobnicate": 1}, "frobnicate", "unknown field"),
    ({"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats", "not supported"),
    ({"prompt": "x", "guided_json": {"type": "object"}, "min_tokens": 4}, "min_tokens",
     "structured output"),
])
def test_a_field_that_does_not_work_is_a_400_naming_it(server: Server, body: dict, param: str,
                                                        words: str) -> None:
    r = post(server, "/v1/completions", {"max_tokens": 4, **body})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and words in error["message"], error


def test_response_format_text_and_no_model_are_accepted(server: Server) -> None:
    r = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "response_format": {"type": "text"}})
    assert r.status_code == 200 and r.json()["model"] == server.model
    assert post(server, "/v1/completions", {"model": "other", "prompt": "x"}).status_code == 404


def test_tokenize_and_detokenize(server: Server) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(server.model_dir)
    r = post(server, "/tokenize", {"model": server.model, "prompt": "Hello there"}).json()
    assert r["tokens"] == tok("Hello there")["input_ids"] and r["count"] == len(r["tokens"])
    assert r["max_model_len"] > 0
    assert post(server, "/detokenize", {"tokens": r["tokens"]}).json()["prompt"] == (
        tok.decode(r["tokens"]))
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat["tokens"] == tok(text, add_special_tokens=False)["input_ids"]
    assert post(server, "/detokenize", {"tokens": [10**9]}).status_code == 400
    assert post(server, "/tokenize", {"prompt": "x", "messages": []}).status_code == 400


def test_version(server: Server) -> None:
    r = httpx.get(f"{server.url}/version", timeout=10)
    assert r.status_code == 200 and r.json()["version"]


def test_cors_only_for_the_allowed_origins(server: Server) -> None:
    def preflight(origin: str) -> httpx.Response:
        return httpx.options(f"{server.url}/v1/chat/completions", timeout=10, headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})

    ok = preflight(ORIGIN)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    assert "access-control-allow-origin" not in preflight("https://evil.example").headers
    r = httpx.get(f"{server.url}/v1/models", headers={"Origin": ORIGIN}, timeout=10)
    assert r.headers["access-control-allow-origin"] == ORIGIN


# ---------------------------------------------------------------- tool calls

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 10},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
    "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def calls_of(message) -> list[tuple[str, dict]]:  # type: ignore[no-untyped-def]
    out = []
    for call in message.tool_calls or []:
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        assert call.id.startswith("call_") and call.type == "function"
        out.append((call.function.name, args))
    return out


@pytest.mark.parametrize("choice, names", [
    ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
    ("required", {"get_weather", "get_time"}),
])
def test_required_and_named_tool_calls_always_parse(server: Server, choice, names) -> None:
    client = openai_client(server)
    for seed in range(4):
        r = client.chat.completions.create(
            model=server.model, messages=ASK, tools=TOOLS, tool_choice=choice,
            parallel_tool_calls=False, max_tokens=200, temperature=1.0, seed=seed)
        message = r.choices[0].message
        calls = calls_of(message)
        assert len(calls) == 1 and calls[0][0] in names and message.content is None
        assert r.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}},
                                    "required"])
def test_streamed_tool_call_deltas_reassemble_to_the_whole_answer(server: Server,
                                                                  choice) -> None:
    client = openai_client(server)
    kwargs = dict(model=server.model, messages=ASK, tools=TOOLS, tool_choice=choice,
                  max_tokens=200, temperature=1.0, seed=11)
    whole = calls_of(client.chat.completions.create(**kwargs).choices[0].message)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice_delta in chunk.choices:
            finish = choice_delta.finish_reason or finish
            assert not choice_delta.delta.content
            for d in choice_delta.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"name": "", "arguments": "", "id": None})
                call["id"] = call["id"] or d.id
                if d.function and d.function.name:
                    call["name"] = d.function.name
                if d.function and d.function.arguments:
                    call["arguments"] += d.function.arguments
    streamed = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    assert streamed == whole and all(c["id"] for c in calls.values())
    assert finish == "tool_calls"


def test_a_conversation_with_tool_calls_and_results(server: Server) -> None:
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    r = openai_client(server).chat.completions.create(
        model=server.model, messages=history, tools=TOOLS, max_tokens=5, temperature=0.0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    bad_call = post(server, "/v1/chat/completions", {
        "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function",
                                                        "function": {"name": "nope"}}})
    assert bad_call.status_code == 400 and bad_call.json()["error"]["param"] == (
        "tool_choice.function.name")
    no_id = post(server, "/v1/chat/completions", {
        "messages": ASK + [{"role": "tool", "content": "x"}], "max_tokens": 2})
    assert no_id.status_code == 400 and "tool_call_id" in no_id.json()["error"]["param"]


def test_langchain_bind_tools_and_function_calling(server: Server) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{server.url}/v1", api_key="none", model=server.model,
                     max_tokens=200, temperature=1.0, seed=2, max_retries=0)
    answer = llm.bind_tools(TOOLS, tool_choice="get_weather").invoke("Weather in Oslo?")
    assert [c["name"] for c in answer.tool_calls] == ["get_weather"]
    jsonschema.validate(answer.tool_calls[0]["args"], WEATHER)
    weather = llm.with_structured_output(
        {"title": "get_weather", "description": "Weather now", **WEATHER}).invoke("Oslo?")
    jsonschema.validate(weather, WEATHER)
