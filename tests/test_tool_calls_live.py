"""Tool calls in a format of special tokens, through `run_pipeline serve` and the official
`openai` package: a tiny Mistral whose chat template is Mistral's (tools as
[AVAILABLE_TOOLS], calls as [TOOL_CALLS], results as [TOOL_RESULTS]), with no
--tool-call-parser: the server reads the format off the template and decodes these requests
with their special tokens. The model is built to answer a call (its layers add nothing, its
head maps each token of the call to the next), so the whole path runs with nothing forced
per request; the parsers' own tests (test_tool_parsers.py) carry the formats."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_server import Server, serve

pytestmark = pytest.mark.timeout(300)

SPECIAL = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[ARGS]", "[AVAILABLE_TOOLS]",
           "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]
NAME, ARGS = "get_weather", '{"city": "Oslo"}'
# What the model answers after [/INST]: Mistral's newer call, `[TOOL_CALLS]name[ARGS]{...}`
CHAIN = ["[/INST]", "[TOOL_CALLS]", NAME, "[ARGS]", ARGS]
TOOLS = [{"type": "function", "function": {"name": NAME, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]

MISTRAL_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
  {%- if message.role == "user" %}
    {%- if tools and loop.last %}
      {{- "[AVAILABLE_TOOLS]" + tools|tojson + "[/AVAILABLE_TOOLS]" }}
    {%- endif %}
    {{- "[INST]" + message.content + "[/INST]" }}
  {%- elif message.tool_calls is defined and message.tool_calls %}
    {{- "[TOOL_CALLS][" }}
    {%- for call in message.tool_calls %}
      {%- if call.id is not defined or call.id|length != 9 %}
        {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
      {%- endif %}
      {{- {"name": call.function.name, "arguments": call.function.arguments,
           "id": call.id}|tojson }}{% if not loop.last %}, {% endif %}
    {%- endfor %}
    {{- "]" + eos_token }}
  {%- elif message.role == "tool" %}
    {{- "[TOOL_RESULTS]" + {"content": message.content,
                             "call_id": message.tool_call_id}|tojson + "[/TOOL_RESULTS]" }}
  {%- elif message.role == "assistant" %}
    {{- message.content + eos_token }}
  {%- endif %}
{%- endfor %}"""


def build_calling_mistral(folder: Path) -> Path:
    """A tiny Mistral with Mistral's template and tags whose greedy answer to a user turn is
    CHAIN then EOS: the layers' outputs are zero, so the last hidden state is the token's
    embedding; each CHAIN token's embedding is a basis vector, and the head scores the next
    token of CHAIN (EOS after the last) on it alone."""
    import torch
    from tiny_model import build_tiny_llama
    from transformers import AutoModelForCausalLM, AutoTokenizer

    build_tiny_llama(folder, arch="mistral", max_len=1024)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.add_tokens([NAME, ARGS])
    tok.chat_template = MISTRAL_TEMPLATE
    tok.save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    ids = [tok.convert_tokens_to_ids(t) for t in CHAIN] + [tok.eos_token_id]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.zero_()
        for dim, (token, after) in enumerate(zip(ids, ids[1:], strict=False)):
            embed[token] = 0
            embed[token, dim] = 1
            head[after, dim] = 50
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(build_calling_mistral(tmp_path_factory.mktemp("tiny-mistral-tools"))) as s:
        yield s


def openai_client(server: Server):  # type: ignore[no-untyped-def]
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                         timeout=60)


def ask(server: Server, **body: object) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": server.model, "max_tokens": 12, "temperature": 0, **body})


def test_a_call_in_special_tokens_is_read_whole_and_streamed(server: Server) -> None:
    client = openai_client(server)
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    whole = client.chat.completions.create(model=server.model, messages=messages,
                                           tools=TOOLS, max_tokens=12, temperature=0)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.model_extra["stop_reason"] is None  # EOS ended it, as without tools
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (NAME, {"city": "Oslo"})
    assert len(call.id) == 9 and call.id.isalnum()  # as Mistral's template demands
    calls: dict[int, dict[str, str]] = {}
    finish, content = None, ""
    for chunk in client.chat.completions.create(model=server.model, messages=messages,
                                                tools=TOOLS, max_tokens=12, temperature=0,
                                                stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for c in delta.tool_calls or []:
            got = calls.setdefault(c.index, {"name": "", "arguments": ""})
            got["name"] += (c.function.name or "") if c.function else ""
            got["arguments"] += (c.function.arguments or "") if c.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert calls == {0: {"name": NAME, "arguments": call.function.arguments}}
    assert (content, finish) == ("", "tool_calls")


def test_other_requests_get_their_text_without_special_tokens(server: Server) -> None:
    r = ask(server, messages=[{"role": "user", "content": "Weather in Oslo?"}])
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == NAME + ARGS  # tags skipped
    r = ask(server, messages=[{"role": "user", "content": "Weather in Oslo?"}],
            skip_special_tokens=False)
    assert r.json()["choices"][0]["message"]["content"].startswith(  # (EOS's text follows)
        "[TOOL_CALLS]" + NAME + "[ARGS]" + ARGS)


def test_the_call_goes_back_through_the_template_with_its_result(server: Server) -> None:
    first = ask(server, messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS).json()
    call = first["choices"][0]["message"]["tool_calls"][0]
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": call["id"], "content": "18 C"},
               {"role": "user", "content": "And tomorrow?"}]
    r = ask(server, messages=history, tools=TOOLS)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == NAME
    wrong = [dict(history[1], tool_calls=[dict(call, id="call_" + "0" * 24)]), history[2]]
    r = ask(server, messages=[history[0], *wrong, history[3]], tools=TOOLS)
    assert r.status_code == 400 and "length 9" in r.json()["error"]["message"]


def test_stop_token_ids_leave_room_for_eos_when_the_tags_are_kept(server: Server) -> None:
    question = [{"role": "user", "content": "Weather?"}]
    r = ask(server, messages=question, tools=TOOLS, stop_token_ids=list(range(3, 67)))
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"
    assert "at most 63" in r.json()["error"]["message"]
    assert ask(server, messages=question, stop_token_ids=list(range(3, 67))).status_code == 200
