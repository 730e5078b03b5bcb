"""The rest of the API that real clients send, through `run_pipeline serve` and the official
`openai` package and LangChain: structured outputs by every field that asks for one (each
answer parses and validates), /tokenize, /detokenize, /version, `model` left out, CORS, and a
400 that names every field this server does not implement."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest
from test_server import Server, serve
from test_structured import PERSON

pytestmark = pytest.mark.timeout(300)
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[Server]:
    with serve(tiny_model_dir, "--allowed-origins", ORIGIN) as s:
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
