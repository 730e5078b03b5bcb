"""Malformed input to the HTTP front end is the client's fault: every body, however odd, is
parsed into a request or refused with a 4xx naming what is wrong, never an exception (a 500).
Fuzzed with hypothesis: arbitrary JSON, and valid requests with one field mutated."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.server.errors import ApiError
from pipeline.server.openai_parse import parse_chat, parse_completion

V = 1000
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                  max_size=4),
    max_leaves=12)
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "n", "stop", "seed", "logprobs", "top_logprobs", "presence_penalty",
          "frequency_penalty", "stream", "stream_options", "top_k", "min_p",
          "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
          "include_stop_str_in_output", "skip_special_tokens", "priority", "echo", "user",
          "role", "content", "name", "response_format", "structured_outputs", "guided_json",
          "guided_regex", "guided_choice", "guided_grammar", "tools", "tool_choice",
          "parallel_tool_calls", "prompt_logprobs", "tool_calls", "tool_call_id"]
COMPLETION = {"model": "m", "prompt": "hi", "max_tokens": 4}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def parse_or_refuse(body: Any, chat: bool) -> None:
    try:
        (parse_chat if chat else parse_completion)(body, V)
    except ApiError as exc:
        assert 400 <= exc.status < 500, exc.message


@settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), JSON, max_size=6),
       chat=st.booleans())
def test_arbitrary_bodies_are_parsed_or_refused_with_a_4xx(body: dict[str, Any],
                                                           chat: bool) -> None:
    parse_or_refuse(body, chat)


@settings(max_examples=2500, deadline=None, suppress_health_check=list(HealthCheck))
@given(field=st.sampled_from(FIELDS), value=JSON, chat=st.booleans(),
       in_message=st.booleans())
def test_a_valid_request_with_one_field_mutated(field: str, value: Any, chat: bool,
                                                in_message: bool) -> None:
    body = json.loads(json.dumps(CHAT if chat else COMPLETION))
    if chat and in_message:
        body["messages"][0][field] = value
    else:
        body[field] = value
    parse_or_refuse(body, chat)


@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
@given(messages=st.lists(JSON, max_size=4))
def test_unusual_chat_message_shapes(messages: list[Any]) -> None:
    parse_or_refuse({"model": "m", "messages": messages}, chat=True)


@pytest.mark.parametrize("depth", [50, 5000, 100_000])
def test_deeply_nested_bodies_are_refused_before_parsing(depth: int) -> None:
    from pipeline.server.app import parse_json_body

    text = ('{"model": "m", "prompt": ' + "[" * depth + "]" * depth + "}").encode()
    if depth <= 64:
        assert parse_json_body(text)["model"] == "m"
        return
    with pytest.raises(ApiError) as info:
        parse_json_body(text)
    assert info.value.status == 400 and "nested" in info.value.message
